// Collectives among the ranks of one host, through a shared segment.
// Buffers are this rank's; sizes are bytes unless named count (elements).
// Terms (step, buffer, phase) are those of group.h.
#pragma once

#include <cstddef>
#include <functional>
#include <vector>

#include "../reduce.h"
#include "group.h"

namespace hvs {

// dst = reduce of every local src.  root < 0: on every rank (allreduce);
// root >= 0: only on local rank `root` (dst is ignored elsewhere).
Status shm_allreduce(ShmGroup& g, const void* src, void* dst, size_t count, size_t elem,
                     ReduceFn fn, int root, size_t small_bytes);

// The same as a flat shm_allreduce (root < 0), by cross-memory attach (cma.cc):
// *used is false, having changed nothing, when the ranks can't or won't use it
// (then run shm_allreduce).  Every local rank must call it for the same ops.
Status shm_allreduce_cma(ShmGroup& g, const void* src, void* dst, size_t count, size_t elem,
                         ReduceFn fn, size_t chunk_bytes, bool* used);

// The leader's part of a pipelined hierarchical allreduce, chunk by chunk (elements
// [first, first + n)): `start` is handed a chunk once the leader holds the host's sum
// of it; `finish` returns once that chunk holds the world's (chunks finish in order).
struct CrossHost {
  std::function<void(size_t first, size_t n)> start;
  std::function<Status(size_t first, size_t n)> finish;
};

// The shared-memory phases of a hierarchical allreduce by cross-memory attach,
// pipelined in chunks of `chunk` elements around the leader's (local rank 0's)
// `cross`: every rank reduces its slice of chunk k and the leader reads the other
// slices, then starts chunk k across hosts; once it has finished, the others read
// chunk k from the leader.  Chunk k + 1 is reduced (and chunk k - 1 read) while
// chunk k is between hosts.  *used as shm_allreduce_cma's; `cross` runs on the leader only.
Status shm_hier_allreduce_cma(ShmGroup& g, const void* src, void* dst, size_t count, size_t elem,
                              ReduceFn fn, size_t chunk, const CrossHost& cross, bool* used);

// The same as shm_broadcast of one span, each rank reading root's buffer in place by
// cross-memory attach: *used is false, having changed nothing, unless the group has
// already agreed to use it (shm_allreduce_cma's probe).
Status shm_broadcast_cma(ShmGroup& g, char* buf, size_t len, int root, bool* used);

// Every local rank passes the peer it swaps with (a local rank; each rank's peer's
// peer is itself), the start of what it sends and where the peer's goes (recv_bytes,
// what the peer sends): each reads its peer's bytes in place by cross-memory attach.
// *used as shm_allreduce_cma's (then nothing was read, and every rank alike).
Status shm_exchange_cma(ShmGroup& g, int peer, const void* send, void* recv, size_t recv_bytes,
                        bool* used);

// Local rank j's span (spans[j], inside buf; every rank passes the same offsets and
// lengths) is read from rank j's buf into the same span of every other rank's, by
// cross-memory attach; *used as shm_allreduce_cma's.
Status shm_gather_spans_cma(ShmGroup& g, char* buf, const std::vector<Span>& spans, bool* used);

// The spans of local rank `root` are copied into the same spans of every
// other rank (every rank passes spans of the same lengths).
Status shm_broadcast(ShmGroup& g, const std::vector<Span>& spans, int root);

// Local rank j's block (bytes[j]) lands at dsts[j] on every rank; this
// rank's block is read from src.
Status shm_allgather(ShmGroup& g, const void* src, const std::vector<char*>& dsts,
                     const std::vector<size_t>& bytes);

// Block j of src (counts[j] elements at offsets[j]) is reduced over the local
// ranks into dst on local rank j.
Status shm_reducescatter(ShmGroup& g, const void* src, void* dst,
                         const std::vector<size_t>& offsets, const std::vector<size_t>& counts,
                         size_t elem, ReduceFn fn);

// Local rank i's send block for j (send[j]) lands in j's recv block for i.
Status shm_alltoall(ShmGroup& g, const std::vector<Span>& send, const std::vector<Span>& recv);

Status shm_barrier(ShmGroup& g);

}  // namespace hvs
