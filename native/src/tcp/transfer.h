// Moving bytes over the mesh's TCP connections.
//
// Terms used by every TCP algorithm:
//   link      a connected, authenticated, non-blocking socket to one peer
//   item      a contiguous piece of a send or receive stream; a stream is a
//             list of items handled in order
//   dep       a send item may wait for a receive item (its index): a ring
//             forwards a chunk as soon as it has arrived (and been reduced)
//   reduce    a receive item may land in a staging buffer and be reduced
//             into `out` = `own` op received, instead of landing in place
//
// A Transfer runs one send stream and one receive stream at once, on one
// thread, with non-blocking send/recv and poll(): sending and receiving
// overlap, and a ring step starts forwarding before it has received the
// whole segment.  The deadline is "no byte moved for timeout", so a slow but
// moving transfer never times out and a dead one fails within the timeout.
// With an Agreement, a Transfer also sends and checks the op headers of
// header.h (before the payload, on the same links) and watches the other
// links of the group for notices.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "../reduce.h"
#include "mac.h"
#include "../op.h"
#include "hvs/status.h"

namespace hvs {

struct Link {
  int fd = -1;
  int peer = -1;          // world rank, for error messages
  bool open = false;      // a send stream on it is unfinished: a notice would land inside
  int me = -1;            // this rank (world)
  std::shared_ptr<const MacKey> key;  // the link key (mac.h); null: frames go untagged
  uint64_t sent = 0, taken = 0;       // tagged frames sent on it and taken from it
};

struct Agreement;

struct SendItem {
  const char* ptr;
  size_t len;
  long dep;  // receive item that must be complete first, or -1
};

struct RecvItem {
  char* ptr;        // where the bytes land (reduce: unused, they are staged)
  size_t len;
  char* out;        // reduce only: out = own op received
  const char* own;  // reduce only; nullptr means land in place at ptr
};

// What this rank moved, for metrics: TCP payload bytes sent and received and the
// ops that moved any (an op counts once however many transfers it runs: its
// Agreement::seq was last_tcp_seq), and the ops that went through the host's
// shared segment with their payload bytes, and the allreduces whose shared-memory
// phases overlapped the leaders' ring (hier.cc).
struct TransportStats {
  uint64_t tcp_ops = 0, tcp_sent = 0, tcp_received = 0, last_tcp_seq = 0;
  uint64_t shm_ops = 0, shm_bytes = 0;
  uint64_t pipelined_ops = 0;
};

struct TransferOptions {
  uint64_t timeout_ns;
  ReduceFn fn = nullptr;
  size_t elem = 1;
  char* staging = nullptr;  // at least the largest reduce item
  // Agreement (header.h); null: no headers, nothing watched.
  Agreement* agree = nullptr;
  const OpTag* send_tag = nullptr;  // the header sent; null: agree->tag
  const OpTag* recv_tag = nullptr;  // the header expected; null: agree->tag
  bool link_counts = false;         // the tags' counts are per link (alltoall)
  bool both_ways = false;           // headers both ways on `to` and `from`
  bool chain_ack = false;  // both ways: the header back on `from` waits for the checks of both
  std::vector<Link>* links = nullptr;         // by world rank; watched: those of
  const std::vector<int>* members = nullptr;  // these ranks that it does not read
  TransportStats* stats = nullptr;            // counted into on success; may be null
};

// Runs both streams (and the headers) to completion.  `to` or `from` may be
// null when nothing moves in that direction.
Status transfer(Link* to, const std::vector<SendItem>& sends, Link* from,
                const std::vector<RecvItem>& recvs, const TransferOptions& opt);

// Sets O_NONBLOCK on a link's socket.
Status make_nonblocking(int fd);

}  // namespace hvs
