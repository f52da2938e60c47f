// Broadcast, allgather and barrier through shared memory.
//
// Broadcast: per step the root copies up to one buffer of its spans into its
// buffer and posts; every other rank waits for the root, copies out, posts.
// Allgather: per step every rank copies the next piece (one buffer) of its
// block into its buffer and posts; after all have posted, every rank copies
// every piece out.  Barrier: one step, one post, wait for all.
#include <algorithm>
#include <cstring>

#include "collectives.h"

namespace hvs {

namespace {

// A cursor over a list of spans, handing out pieces of at most `max` bytes.
struct SpanCursor {
  const std::vector<Span>& spans;
  size_t index = 0, offset = 0;
  bool done() const { return index >= spans.size(); }
  Span next(size_t max) {
    while (index < spans.size() && offset >= spans[index].len) {
      ++index;
      offset = 0;
    }
    if (done()) return Span{nullptr, 0};
    size_t n = std::min(max, spans[index].len - offset);
    Span piece{spans[index].ptr + offset, n};
    offset += n;
    return piece;
  }
};

}  // namespace

Status shm_broadcast(ShmGroup& g, const std::vector<Span>& spans, int root) {
  if (g.size() == 1) return Status();
  SpanCursor cursor{spans};
  const size_t cap = g.buf_bytes();
  for (;;) {
    // Fill one buffer with as many pieces as fit, identically on every rank.
    std::vector<Span> pieces;
    size_t used = 0;
    while (used < cap) {
      Span p = cursor.next(cap - used);
      if (p.len == 0) break;
      pieces.push_back(p);
      used += p.len;
    }
    if (pieces.empty()) break;
    HVS_CHECK(g.begin_step());
    char* buf = g.buffer(root);
    if (g.me() == root) {
      for (const Span& p : pieces) std::memcpy(buf, p.ptr, p.len), buf += p.len;
      g.post();
    } else {
      HVS_CHECK(g.wait_step_root(root));
      for (const Span& p : pieces) std::memcpy(p.ptr, buf, p.len), buf += p.len;
      g.post();
    }
    g.end_step();
  }
  return Status();
}

Status shm_allgather(ShmGroup& g, const void* src, const std::vector<char*>& dsts,
                     const std::vector<size_t>& bytes) {
  const int me = g.me();
  const size_t cap = g.buf_bytes();
  if (g.size() == 1) {
    if (dsts[me] != src) std::memmove(dsts[me], src, bytes[me]);
    return Status();
  }
  size_t most = *std::max_element(bytes.begin(), bytes.end());
  const char* in = static_cast<const char*>(src);
  for (size_t first = 0; first < most; first += cap) {
    HVS_CHECK(g.begin_step());
    size_t mine = bytes[me] > first ? std::min(cap, bytes[me] - first) : 0;
    std::memcpy(g.buffer(me), in + first, mine);
    g.post();
    HVS_CHECK(g.wait_step_all());
    for (int j = 0; j < g.size(); ++j) {
      size_t n = bytes[j] > first ? std::min(cap, bytes[j] - first) : 0;
      std::memcpy(dsts[j] + first, g.buffer(j), n);
    }
    g.end_step();
  }
  return Status();
}

Status shm_barrier(ShmGroup& g) {
  if (g.size() == 1) return Status();
  HVS_CHECK(g.begin_step());
  g.post();
  HVS_CHECK(g.wait_step_all());
  g.end_step();
  return Status();
}

}  // namespace hvs
