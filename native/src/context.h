// A communicator's native half: the topology, the shared segment of this
// host and the TCP links, and the collectives composed from them.
//
// Composition (hierarchical):
//   one host          shared memory only
//   one rank a host   TCP only (also every rank under force_tcp)
//   otherwise         shared memory within each host and TCP between one
//                     rank per host (its leader: its lowest rank), e.g.
//                     allreduce = shm reduce to the leader, ring allreduce
//                     between leaders, shm broadcast from the leader.
// After any failed op the context is broken: it marks itself aborted in the
// segment (so local peers fail fast too) and refuses every later op with the
// first error.  A mismatch (ranks in different ops, or the same op with other
// sizes) is also sent as a notice to the TCP peers (tcp/header.h), so remote
// ranks fail with it instead of waiting for their timeout; so is, with every payload
// tagged, a frame that failed its integrity check.
// With every payload tagged (seal_payload) across hosts, no rank returns an op before
// every rank has checked the tags of what it received in it: each public op ends in
// a confirmation round (`confirmed`), one control allreduce of one word, that fails the
// op on every rank where any rank found a changed payload.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "hvs/status.h"
#include "hvs/types.h"
#include "shm/collectives.h"
#include "shm/group.h"
#include "tcp/collectives.h"

namespace hvs {

struct ContextOptions {
  int rank = 0;
  int size = 1;
  std::vector<int> hosts;  // host index of every world rank
  std::vector<pid_t> pids;
  double timeout_s = 30.0;
  uint64_t spin_ns = 50000;  // shm waits: spin, then yield, then sleep (group.h)
  uint64_t yield_ns = 200000;
  size_t shm_chunk = 256 * 1024;  // bytes per shm step buffer
  size_t small_bytes = 64 * 1024;  // shm allreduce: one-step path up to here
  size_t cma_bytes = 0;  // shm allreduce from here up by cross-memory attach; 0: never
  size_t cma_chunk = 2 * 1024 * 1024;  // bytes per pipelined chunk of that algorithm
  bool cma = true;       // this rank agrees to cross-memory attach (all must)
  size_t tcp_chunk = 512 * 1024;
  // hierarchical allreduce from twice this up: pipelined in chunks of this (hier.cc); 0: never
  size_t hier_chunk = 2 * 1024 * 1024;
  // allreduce across hosts up to here by recursive doubling (tcp/doubling.cc), not the ring;
  // 0: never.  The same on every rank (it is in the op's tag)
  size_t doubling_bytes = 4096;
  bool seal_payload = false;  // every op's TCP payload carries a tag (tcp/mac.h), not only its headers
};

class Context {
 public:
  // `fds[r]` is the socket to world rank r (-1 for self) and `keys[r]` its
  // link key (tcp/mac.h; empty, or no keys at all: frames go untagged); `seg`
  // is this host's segment, or null when this rank is alone on its host.
  Context(ContextOptions opt, std::vector<int> fds, std::unique_ptr<Segment> seg,
          const std::vector<std::string>& keys = {});

  // `control`: the op carries the job's own coordination (negotiation, the
  // fusion cycle's vector, shapes): its TCP payload is tagged like a header
  // even where opt.seal_payload is off.
  Status allreduce(const void* src, void* dst, size_t count, DType dt, ReduceOp op,
                   bool control = false);
  Status allgather(const void* src, void* dst, const std::vector<size_t>& counts, DType dt,
                   bool control = false);
  Status broadcast(void* buf, size_t count, DType dt, int root);
  Status reducescatter(const void* src, void* dst, const std::vector<size_t>& counts, DType dt,
                       ReduceOp op);
  Status alltoall(const void* src, const std::vector<size_t>& send_counts, void* dst,
                  const std::vector<size_t>& recv_counts, DType dt);
  Status barrier();
  // Adasum of `buf` over the world, in place (adasum.cc): `segments` are the element
  // counts of the tensors packed in it, each combined with its own dot products.
  Status adasum(void* buf, size_t count, DType dt, const std::vector<size_t>& segments);

  // A link to `peer` made after construction (one the mesh connects when an op first needs
  // it: alltoall's pairs); `key` as in the constructor.  Between ops only.
  Status add_link(int peer, int fd, const std::string& key);

  // Records a failure: later ops refuse, local peers are told.
  Status fail(Status st);
  const ContextOptions& options() const { return opt_; }
  bool hierarchical() const { return shm_ && !leaders_.empty(); }
  // Cross-memory attach in the shm allreduce: "on" or "off" once the local ranks
  // agreed (on the first large allreduce), "unknown" before, "none" without shm.
  const char* cma_state() const;
  // What this rank moved through each transport (tcp/transfer.h).
  const TransportStats& stats() const { return stats_; }

 private:
  Status check_usable();       // also starts the op: every op counts (Agreement::seq)
  Status confirmed(Status st);  // payload mode: the op's confirmation round (see above)
  Status allreduce_op(const void* src, void* dst, size_t count, DType dt, ReduceOp op, bool control);
  Status allgather_op(const void* src, void* dst, const std::vector<size_t>& counts, DType dt, bool control);
  Status broadcast_op(void* buf, size_t count, DType dt, int root);
  Status reducescatter_op(const void* src, void* dst, const std::vector<size_t>& counts, DType dt,
                          ReduceOp op);
  Status alltoall_op(const void* src, const std::vector<size_t>& send_counts, void* dst,
                     const std::vector<size_t>& recv_counts, DType dt);
  Status barrier_op();
  void tag(const OpTag& t);  // what this op is, for the shm and TCP agreement checks
  TcpGroup tcp_group(const std::vector<int>& members);
  char* scratch(size_t bytes);
  Status swap_halves(int partner, const char* send, size_t send_count, char* recv,
                     size_t recv_count, DType dt, int distance, bool cma);
  // hier.cc.  `chunk` (elements; 0: the whole buffer at once) must be the same on every
  // rank: it cuts the leaders' ring into one ring per chunk.
  Status hier_allreduce(const void* src, void* dst, size_t count, size_t elem, ReduceFn fn,
                        bool cma = false, size_t chunk = 0);
  Status leaders_ring(char* dst, size_t count, size_t elem, ReduceFn fn, size_t chunk);

  ContextOptions opt_;
  std::vector<Link> links_;
  std::vector<int> locals_;   // world ranks on this host, in order
  std::vector<int> leaders_;  // lowest rank of each host, if more than one host
  std::unique_ptr<ShmGroup> shm_;
  std::vector<char> staging_;
  std::unique_ptr<char[]> scratch_;  // adasum.cc
  std::vector<char> doubling_copy_;  // tcp/doubling.cc's copy (adasum holds scratch_ meanwhile)
  size_t scratch_bytes_ = 0;
  Agreement agree_;  // this op, for the TCP headers
  bool confirming_ = false;  // in a confirmation round: it confirms nothing itself
  bool confirmed_failure_ = false;  // every rank learnt this failure in a confirmation round
  TransportStats stats_;
  Code failed_ = Code::kOk;
  std::string failure_;
  int failed_peer_ = -1;
};

}  // namespace hvs
