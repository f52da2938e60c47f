// Allreduce of large buffers by cross-memory attach (process_vm_readv).
//
// The staged algorithm (allreduce.cc) moves every byte through the segment:
// each rank copies its input in, the reducer reads it there, and each result
// slice is copied out of the segment again.  With CMA a rank reads its peers'
// buffers in place, so the two segment copies go:
//
//   addresses  one step: every rank posts the addresses of its input and
//              output in its buffer (the tag check comes with it)
//   chunk      the buffer is cut into chunks (megabytes: every read is a
//              system call that pins the pages it copies, so fewer and larger
//              reads beat cache-sized steps here), each chunk into one slice per
//              local rank.  Per chunk, rank i reads slice i of every peer's
//              input, tile by tile, into a tile buffer of its own (in L1/L2),
//              reduces the tiles with its own input into its output, and
//              posts; then it copies every other slice of the previous chunk
//              straight from its owner's output into its own, once that owner
//              has posted it (pipelined: a rank reduces chunk k while its
//              peers may still reduce chunk k - 1)
//   done       a last post, and a wait for every peer's: nobody returns (and
//              lets its caller reuse the buffers) while a peer still reads them
//
// In place (input = output) is safe: rank i writes slice j of its output only
// after rank j has posted the chunk, so after it has read that slice of rank
// i's input; and nobody writes slice i of rank i's output but rank i.  Each
// element is reduced by one rank, in local-rank order: the same bits everywhere.
//
// Availability: the kernel must let these processes read each other's memory
// (the same user; Yama's ptrace_scope 0 or no Yama; no seccomp filter on the
// call).  Nothing here loosens that (no PR_SET_PTRACER): on the first large
// allreduce every rank tries a read of each peer and the ranks agree, in one
// extra step, to use CMA only if every read worked and no rank was told not
// to (ContextOptions::shm_cma); otherwise the group keeps the staged
// algorithm for good.
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <vector>

#include "collectives.h"

namespace hvs {

namespace {

constexpr size_t kTileBytes = 256 * 1024;  // one read per peer per tile (fewer, larger reads win)

struct Addresses {  // what a rank posts in its buffer
  uint64_t src, dst;
  uint32_t probe_ok;  // the availability probe: every read of a peer worked
};

// Reads `len` bytes at `remote` in local peer `j`'s memory into `local`.
Status read_peer(ShmGroup& g, int j, void* local, uint64_t remote, size_t len) {
  char* to = static_cast<char*>(local);
  while (len > 0) {
    iovec l{to, len}, r{reinterpret_cast<void*>(remote), len};
    ssize_t got = process_vm_readv(g.pid(j), &l, 1, &r, 1, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      if (errno == ESRCH)
        return HVS_ERROR(Code::kPeerLost, "local peer process has exited", g.world_rank(j));
      return Status::Errno("process_vm_readv of a local peer's buffer", errno, g.world_rank(j));
    }
    if (got == 0)
      return HVS_ERROR(Code::kSystem, "process_vm_readv read nothing of a local peer's buffer",
                       g.world_rank(j));
    to += got, remote += static_cast<uint64_t>(got), len -= static_cast<size_t>(got);
  }
  return Status();
}

bool probe(ShmGroup& g, const std::vector<Addresses>& peers) {
  for (int j = 0; j < g.size(); ++j) {
    if (j == g.me()) continue;
    char byte;
    iovec l{&byte, 1}, r{reinterpret_cast<void*>(peers[j].src), 1};
    if (process_vm_readv(g.pid(j), &l, 1, &r, 1, 0) != 1) return false;
  }
  return true;
}

struct Slices {  // elements [first(j), first(j) + len(j)) of a chunk are slice j
  size_t per, total;
  size_t first(int j) const { return std::min(total, per * j); }
  size_t len(int j) const { return std::min(total, per * (j + 1)) - first(j); }
};

Slices slices_of(size_t n, int size, size_t elem) {
  const size_t line = std::max<size_t>(1, 64 / elem);
  Slices s{(n + size - 1) / size, n};
  s.per = (s.per + line - 1) / line * line;
  return s;
}

class CmaAllreduce {
 public:
  CmaAllreduce(ShmGroup& g, const char* src, char* dst, size_t elem, ReduceFn fn,
               std::vector<Addresses> peers)
      : g_(g), src_(src), dst_(dst), elem_(elem), fn_(fn), peers_(std::move(peers)),
        tiles_(static_cast<size_t>(g.size()) * kTileBytes), inputs_(g.size()) {}

  // Reduces this rank's slice of the chunk at element `first`, then posts.
  Status reduce(size_t first, size_t n) {
    Slices s = slices_of(n, g_.size(), elem_);
    const size_t per_tile = kTileBytes / elem_;
    const size_t mine = s.first(g_.me()), len = s.len(g_.me());
    for (size_t t = 0; t < len; t += per_tile) {
      size_t k = std::min(per_tile, len - t), off = (first + mine + t) * elem_;
      for (int j = 0; j < g_.size(); ++j) {
        if (j == g_.me()) {
          inputs_[j] = src_ + off;
          continue;
        }
        char* tile = tiles_.data() + static_cast<size_t>(j) * kTileBytes;
        HVS_CHECK(read_peer(g_, j, tile, peers_[j].src + off, k * elem_));
        inputs_[j] = tile;
      }
      reduce_many(fn_, elem_, dst_ + off, inputs_.data(), g_.size(), k);
    }
    g_.post();
    return Status();
  }

  // Copies every peer's slice of the chunk at `first` from its output, once it posted
  // `phase` (its reduce of that chunk).
  Status copy_out(size_t first, size_t n, uint64_t phase) {
    Slices s = slices_of(n, g_.size(), elem_);
    for (int j = 0; j < g_.size(); ++j) {
      if (j == g_.me() || s.len(j) == 0) continue;
      HVS_CHECK(g_.wait_one(j, phase));
      size_t off = (first + s.first(j)) * elem_;
      HVS_CHECK(read_peer(g_, j, dst_ + off, peers_[j].dst + off, s.len(j) * elem_));
    }
    return Status();
  }

 private:
  ShmGroup& g_;
  const char* src_;
  char* dst_;
  size_t elem_;
  ReduceFn fn_;
  std::vector<Addresses> peers_;
  std::vector<char> tiles_;
  std::vector<const void*> inputs_;
};

// Opens a step in which every local rank posts its addresses (src, dst) and reads its
// peers'; on the group's first such step the ranks probe and agree on CMA (only the
// probe flag is written then: a peer may still be reading our addresses).  The step
// stays open; the caller ends it, at once where the group's verdict is off.
Status exchange_addresses(ShmGroup& g, const void* src, const void* dst,
                          std::vector<Addresses>* peers) {
  HVS_CHECK(g.begin_step());
  Addresses mine{reinterpret_cast<uint64_t>(src), reinterpret_cast<uint64_t>(dst), 0};
  std::memcpy(g.buffer(g.me()), &mine, sizeof mine);
  g.post();
  HVS_CHECK(g.wait_step_all());
  peers->resize(g.size());
  for (int j = 0; j < g.size(); ++j) std::memcpy(&(*peers)[j], g.buffer(j), sizeof (*peers)[j]);
  if (g.cma() == ShmGroup::Cma::kUnknown) {  // every rank probes, then all agree
    uint32_t ok = g.cma_wanted() && probe(g, *peers) ? 1 : 0;
    std::memcpy(g.buffer(g.me()) + offsetof(Addresses, probe_ok), &ok, sizeof ok);
    g.post();
    HVS_CHECK(g.wait_all(g.phase()));
    bool all = true;
    for (int j = 0; j < g.size(); ++j) {
      Addresses a;
      std::memcpy(&a, g.buffer(j), sizeof a);
      all = all && a.probe_ok;
    }
    g.set_cma(all ? ShmGroup::Cma::kOn : ShmGroup::Cma::kOff);
  }
  return Status();
}

// The end of a step in which peers read our buffers: post, and wait until every peer
// has posted too, so nobody returns (and lets its caller reuse them) while read.
Status finish_reads(ShmGroup& g) {
  g.post();
  HVS_CHECK(g.wait_all(g.phase()));
  g.end_step();
  return Status();
}

}  // namespace

Status shm_allreduce_cma(ShmGroup& g, const void* src, void* dst, size_t count, size_t elem,
                         ReduceFn fn, size_t chunk_bytes, bool* used) {
  *used = false;
  std::vector<Addresses> peers;
  HVS_CHECK(exchange_addresses(g, src, dst, &peers));
  if (g.cma() != ShmGroup::Cma::kOn) {
    g.end_step();
    return Status();  // the caller runs the staged algorithm
  }
  const size_t chunk = std::max<size_t>(1, chunk_bytes / elem);
  CmaAllreduce op(g, static_cast<const char*>(src), static_cast<char*>(dst), elem, fn,
                  std::move(peers));
  size_t prev_first = 0, prev_n = 0;
  uint64_t prev_phase = 0;
  for (size_t first = 0; first < count; first += chunk) {
    size_t n = std::min(chunk, count - first);
    HVS_CHECK(op.reduce(first, n));
    if (prev_n) HVS_CHECK(op.copy_out(prev_first, prev_n, prev_phase));
    prev_first = first, prev_n = n, prev_phase = g.phase();
  }
  HVS_CHECK(op.copy_out(prev_first, prev_n, prev_phase));
  HVS_CHECK(finish_reads(g));  // done reading the peers' buffers
  *used = true;
  return Status();
}

// Events in one order on every local rank, so that each post is the same phase
// everywhere: reduce(0), then reduce(k) and release(k - 1) for each later k, then
// release(last).  The leader waits in release(k) for the chunk between hosts.
Status shm_hier_allreduce_cma(ShmGroup& g, const void* src, void* dst, size_t count, size_t elem,
                              ReduceFn fn, size_t chunk, const CrossHost& cross, bool* used) {
  *used = false;
  std::vector<Addresses> peers;
  HVS_CHECK(exchange_addresses(g, src, dst, &peers));
  if (g.cma() != ShmGroup::Cma::kOn) {
    g.end_step();
    return Status();  // the caller runs the staged phases
  }
  const uint64_t leader_dst = peers[0].dst;
  CmaAllreduce op(g, static_cast<const char*>(src), static_cast<char*>(dst), elem, fn,
                  std::move(peers));
  char* out = static_cast<char*>(dst);
  const bool leader = g.me() == 0;
  auto reduce = [&](size_t first, size_t n) -> Status {
    HVS_CHECK(op.reduce(first, n));  // posts once this rank's slice of the chunk is reduced
    if (!leader) return Status();
    HVS_CHECK(op.copy_out(first, n, g.phase()));
    cross.start(first, n);
    return Status();
  };
  auto release = [&](size_t first, size_t n) -> Status {
    if (leader) {
      HVS_CHECK(cross.finish(first, n));
    } else {  // the leader posts this phase once the chunk is final
      HVS_CHECK(g.wait_one(0, g.phase() + 1));
      HVS_CHECK(read_peer(g, 0, out + first * elem, leader_dst + first * elem, n * elem));
    }
    g.post();
    return Status();
  };
  chunk = std::max<size_t>(1, chunk);
  for (size_t first = 0; first < count; first += chunk) {
    HVS_CHECK(reduce(first, std::min(chunk, count - first)));
    if (first) HVS_CHECK(release(first - chunk, chunk));
  }
  if (count) {
    const size_t last = (count - 1) / chunk * chunk;
    HVS_CHECK(release(last, count - last));
  }
  HVS_CHECK(finish_reads(g));  // nobody returns while a peer still reads its buffers
  *used = true;
  return Status();
}

Status shm_exchange_cma(ShmGroup& g, int peer, const void* send, void* recv, size_t recv_bytes,
                        bool* used) {
  *used = false;
  std::vector<Addresses> peers;
  HVS_CHECK(exchange_addresses(g, send, recv, &peers));
  if (g.cma() != ShmGroup::Cma::kOn) {
    g.end_step();
    return Status();
  }
  if (recv_bytes) HVS_CHECK(read_peer(g, peer, recv, peers[peer].src, recv_bytes));
  HVS_CHECK(finish_reads(g));
  *used = true;
  return Status();
}

Status shm_gather_spans_cma(ShmGroup& g, char* buf, const std::vector<Span>& spans, bool* used) {
  *used = false;
  std::vector<Addresses> peers;
  HVS_CHECK(exchange_addresses(g, buf, buf, &peers));
  if (g.cma() != ShmGroup::Cma::kOn) {
    g.end_step();
    return Status();
  }
  for (int j = 0; j < g.size(); ++j) {
    if (j == g.me() || spans[j].len == 0) continue;
    const size_t off = static_cast<size_t>(spans[j].ptr - buf);
    HVS_CHECK(read_peer(g, j, spans[j].ptr, peers[j].dst + off, spans[j].len));
  }
  HVS_CHECK(finish_reads(g));
  *used = true;
  return Status();
}

// Broadcast: every rank posts its buffer's address; the others read root's in one
// call each, then post; root returns (and lets its caller reuse the buffer) once
// every peer has posted that it is done reading.
Status shm_broadcast_cma(ShmGroup& g, char* buf, size_t len, int root, bool* used) {
  *used = false;
  if (g.cma() != ShmGroup::Cma::kOn) return Status();  // the same verdict on every rank
  HVS_CHECK(g.begin_step());
  Addresses mine{reinterpret_cast<uint64_t>(buf), reinterpret_cast<uint64_t>(buf), 1};
  std::memcpy(g.buffer(g.me()), &mine, sizeof mine);
  g.post();
  HVS_CHECK(g.wait_step_all());
  if (g.me() != root && len) {
    Addresses at;
    std::memcpy(&at, g.buffer(root), sizeof at);
    HVS_CHECK(read_peer(g, root, buf, at.dst, len));
  }
  g.post();  // done reading root's buffer
  HVS_CHECK(g.wait_all(g.phase()));
  g.end_step();
  *used = true;
  return Status();
}

}  // namespace hvs
