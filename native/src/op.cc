// OpTag's text and the counts digest; see op.h.
#include "op.h"

#include "hvs/types.h"

namespace hvs {

uint64_t digest_of(const std::vector<size_t>& counts) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (size_t c : counts) {
    h ^= static_cast<uint64_t>(c);
    h *= 1099511628211ull;
  }
  return h;
}

std::string OpTag::describe() const {
  static const char* kinds[] = {"no collective", "allreduce", "broadcast", "allgather",
                                "reducescatter", "alltoall", "barrier"};
  std::string out = kind <= kBarrier ? kinds[kind] : "an unknown collective";
  if (kind == kBarrier || kind == kNone) return out;
  if (kind == kAllreduce || kind == kReducescatter)
    out += std::string(" ") + op_name(static_cast<ReduceOp>(op));
  out += std::string(" of ") + std::to_string(count) + " " + dtype_name(static_cast<DType>(dtype));
  if (kind == kBroadcast) out += " from rank " + std::to_string(root);
  if (kind == kAllgather || kind == kReducescatter) out += " (counts digest " + std::to_string(digest % 100000) + ")";
  if (kind == kAllreduce && digest == kCmaDigest) out += " by cross-memory attach";
  if (kind == kAllreduce && digest == kDoublingDigest) out += " by recursive doubling across hosts";
  if (kind == kAllreduce && (digest >> 32) == (kPipeDigest >> 32))
    out += " pipelined across hosts in chunks of " + std::to_string(digest & 0xffffffffu) + " elements";
  return out;
}

}  // namespace hvs
