// Collectives over TCP among a group of ranks (every rank, or the host
// leaders of a hierarchical job).  Terms: those of transfer.h, plus
//   member   a rank of the group, by its index in the group
//   left, right  the ring neighbours, member me - 1 and me + 1
//   segment  the part of the buffer a ring step moves; a segment is a list
//            of byte spans, cut into chunks of at most `chunk` bytes
// Every transfer carries the op headers of header.h: the ring and the chain
// send them both ways, alltoall and the barrier (where every pair talks in
// both directions anyway) with the data.  An op of zero bytes still
// exchanges its headers, so a rank with nothing to move cannot pass a peer
// that has something.
#pragma once

#include <cstddef>
#include <vector>

#include "../reduce.h"
#include "../op.h"
#include "header.h"
#include "transfer.h"

namespace hvs {

struct TcpGroup {
  std::vector<int> members;       // world ranks
  int me;                         // index of this rank in members
  std::vector<Link>* links;       // indexed by world rank
  size_t chunk;                   // bytes per item
  uint64_t timeout_ns;
  std::vector<char>* staging;     // grown to `chunk` on demand
  Agreement* agree;               // this op (header.h); never null
  TransportStats* stats = nullptr;  // the context's counters; may be null

  int size() const { return static_cast<int>(members.size()); }
  Link* link(int member) const { return &(*links)[members[member]]; }
};

// Options of a transfer of this group's op: headers, and the group's other
// links watched for notices.
inline TransferOptions group_options(TcpGroup& g, bool both_ways) {
  TransferOptions opt{g.timeout_ns};
  opt.agree = g.agree;
  opt.both_ways = both_ways;
  opt.links = g.links;
  opt.members = &g.members;
  opt.stats = g.stats;
  return opt;
}

// dst = reduce over members of src (pipelined ring: reduce-scatter, allgather).
Status ring_allreduce(TcpGroup& g, const char* src, char* dst, size_t count, size_t elem,
                      ReduceFn fn);

// Every member's region (spans of buf) is sent to every other member; this
// member's region must already be in buf.
Status ring_allgather(TcpGroup& g, const std::vector<std::vector<Span>>& regions);

// dst = member me's block of the reduction (blocks at byte offsets/lens of src).
// `tmp` holds partial sums of the other blocks (as large as src when size > 2).
Status ring_reducescatter(TcpGroup& g, const char* src, char* dst, char* tmp,
                          const std::vector<size_t>& offsets, const std::vector<size_t>& lens,
                          size_t elem, ReduceFn fn);

// Member 0 is the root; the others receive buf, forwarding chunks along the chain.
Status chain_broadcast(TcpGroup& g, char* buf, size_t len);

// Member me sends send[j] to member j and receives recv[j] from it, for the
// members j where remote[j] (the others talk through shared memory).
// Pairwise exchange: at step s, send to me + s and receive from me - s.  The
// headers carry the element counts (of `elem` bytes) both ways of their link.
Status pairwise_alltoall(TcpGroup& g, const std::vector<Span>& send, const std::vector<Span>& recv,
                         const std::vector<bool>& remote, size_t elem);

// buf = reduce over members of buf, by recursive doubling (doubling.cc): for small
// buffers.  `copy` holds as many bytes as buf.
Status rd_allreduce(TcpGroup& g, char* buf, char* copy, size_t count, size_t elem, ReduceFn fn);

// Dissemination barrier: round k sends a header to me + 2^k, receives one from me - 2^k.
Status tcp_barrier(TcpGroup& g);

}  // namespace hvs
