// What the shared-memory and TCP paths share about one collective: its tag,
// which every rank compares with its peers' before any payload moves (the
// agreement of docs/architecture.md), and a span of a buffer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace hvs {

// The op a rank is in: kind, dtype, reduce op, root, count, and a digest of
// per-rank counts (allgather, reducescatter).  Equal tags, same op.
struct OpTag {
  enum Kind : uint32_t { kNone, kAllreduce, kBroadcast, kAllgather, kReducescatter, kAlltoall, kBarrier };
  uint32_t kind = kNone;
  int32_t dtype = -1, op = -1, root = -1;
  uint64_t count = 0, digest = 0;
  bool operator==(const OpTag& o) const {
    return kind == o.kind && dtype == o.dtype && op == o.op && root == o.root && count == o.count &&
           digest == o.digest;
  }
  std::string describe() const;
};

// A digest of per-rank counts, for tags.
uint64_t digest_of(const std::vector<size_t>& counts);

// An allreduce's digest names its algorithm where ranks could differ on it (their
// options): by cross-memory attach on one host, or pipelined across hosts in
// chunks of (the low 32 bits) elements.
constexpr uint64_t kCmaDigest = 0x434d41;              // "CMA"
constexpr uint64_t kPipeDigest = 0x50495045ull << 32;  // "PIPE"
constexpr uint64_t kDoublingDigest = 0x5244;           // "RD": by recursive doubling across hosts

// Bytes of one buffer: a piece of a segment or of a stream.
struct Span {
  char* ptr;
  size_t len;
};

}  // namespace hvs
