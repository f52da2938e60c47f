// Allreduce (and reduce to one rank) through shared memory.
//
// Small buffers (<= small_bytes): one step.  Every rank copies its input
// into its buffer and posts; then every rank reduces all buffers itself, in
// local-rank order, so every rank computes the same bits.  One phase, no
// second round trip: the latency path.
//
// Large buffers: the buffer is cut into chunks of at most the step buffer
// size (cache-sized), and each chunk into one slice per local rank.  Per
// chunk, one step of two phases:
//   stage    a rank copies every slice but its own into its buffer; post A
//   reduce   rank i reduces slice i of every rank (its own from its input,
//            the others' from their buffers) into slice i of its buffer and,
//            tile by tile while it is in L1, into its output; post B
//   copy out every rank copies slice j from rank j's buffer, for every other
//            j, once all have posted B.  It is deferred until the next chunk is
//            staged, so a rank stages chunk k + 1 while its peers still
//            reduce chunk k, instead of waiting for them.
// Each element is reduced by exactly one rank, so the result is the same
// bits everywhere, and no rank holds more than its input, its output and
// the segment.
#include <algorithm>
#include <cstring>

#include "collectives.h"

namespace hvs {

namespace {

Status allreduce_small(ShmGroup& g, const void* src, void* dst, size_t count, size_t elem,
                       ReduceFn fn, int root) {
  HVS_CHECK(g.begin_step());
  std::memcpy(g.buffer(g.me()), src, count * elem);
  g.post();
  if (root < 0 || root == g.me()) {
    HVS_CHECK(g.wait_step_all());
    std::vector<const void*> inputs(g.size());
    for (int j = 0; j < g.size(); ++j) inputs[j] = g.buffer(j);
    reduce_many(fn, elem, dst, inputs.data(), g.size(), count);
  }
  g.end_step();
  return Status();
}

// Elements [first, first + n) of the chunk belong to slice j.
struct Slices {
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

// A chunk reduced by everyone but not yet copied out.
struct Pending {
  bool active = false;
  uint64_t step = 0, phase = 0;
  char* dst = nullptr;
  Slices s{0, 0};
};

// Our own slice is in dst already (the reduce wrote it there too).
Status copy_out(ShmGroup& g, Pending& p, size_t elem) {
  if (!p.active) return Status();
  HVS_CHECK(g.wait_all(p.phase));
  for (int j = 0; j < g.size(); ++j)
    if (j != g.me())
      std::memcpy(p.dst + p.s.first(j) * elem, g.buffer(j, p.step) + p.s.first(j) * elem,
                  p.s.len(j) * elem);
  p.active = false;
  return Status();
}

Status allreduce_chunk(ShmGroup& g, const char* src, char* dst, size_t n, size_t elem,
                       ReduceFn fn, int root, std::vector<const void*>& inputs, Pending& pending) {
  const int me = g.me(), size = g.size();
  Slices s = slices_of(n, size, elem);
  HVS_CHECK(g.begin_step());
  char* mine = g.buffer(me);
  // Stage everything but our own slice: slices before it, then after it.
  std::memcpy(mine, src, s.first(me) * elem);
  size_t after = s.first(me) + s.len(me);
  std::memcpy(mine + after * elem, src + after * elem, (n - after) * elem);
  g.post();
  HVS_CHECK(copy_out(g, pending, elem));
  HVS_CHECK(g.wait_step_all());
  size_t off = s.first(me) * elem;
  for (int j = 0; j < size; ++j) inputs[j] = j == me ? src + off : g.buffer(j) + off;
  const bool out = root < 0 || root == me;
  reduce_many(fn, elem, mine + off, inputs.data(), size, s.len(me), out ? dst + off : nullptr);
  g.post();
  if (out) pending = Pending{true, g.step(), g.phase(), dst, s};
  g.end_step();
  return Status();
}

}  // namespace

Status shm_allreduce(ShmGroup& g, const void* src, void* dst, size_t count, size_t elem,
                     ReduceFn fn, int root, size_t small_bytes) {
  if (count == 0) return Status();
  if (g.size() == 1) {
    if (dst != src) std::memmove(dst, src, count * elem);
    return Status();
  }
  size_t bytes = count * elem;
  if (bytes <= small_bytes && bytes <= g.buf_bytes())
    return allreduce_small(g, src, dst, count, elem, fn, root);
  const size_t chunk = g.buf_bytes() / elem;
  std::vector<const void*> inputs(g.size());
  const char* in = static_cast<const char*>(src);
  char* out = static_cast<char*>(dst);
  Pending pending;
  for (size_t first = 0; first < count; first += chunk) {
    size_t n = std::min(chunk, count - first);
    HVS_CHECK(allreduce_chunk(g, in + first * elem, out + first * elem, n, elem, fn, root, inputs,
                              pending));
  }
  HVS_CHECK(copy_out(g, pending, elem));
  return Status();
}

}  // namespace hvs
