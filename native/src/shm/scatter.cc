// Reducescatter and alltoall through shared memory.
//
// Both cut a rank's buffer into one piece per local rank: piece j of rank
// i's buffer carries what i has for j.  Per step every rank fills its pieces
// and posts; after all have posted, rank j reads piece j of every buffer (and
// reduces them, for reducescatter, in local-rank order with its own
// contribution read straight from its input).
//
// Alltoall block sizes differ per pair and no rank knows all of them, so a
// first step exchanges each rank's largest block, to agree on the number of
// steps.
#include <algorithm>
#include <cstring>

#include "collectives.h"

namespace hvs {

namespace {
size_t piece_of(const ShmGroup& g, size_t elem) {
  size_t line = std::max<size_t>(1, 64 / elem);
  size_t per = g.buf_bytes() / g.size() / elem / line * line;
  return std::max<size_t>(per, 1) * elem;
}

size_t part(size_t total, size_t first, size_t cap) {
  return total > first ? std::min(cap, total - first) : 0;
}

Status agree_on_max(ShmGroup& g, size_t mine, size_t* most) {
  HVS_CHECK(g.begin_step());
  std::memcpy(g.buffer(g.me()), &mine, sizeof mine);
  g.post();
  HVS_CHECK(g.wait_step_all());
  *most = 0;
  for (int j = 0; j < g.size(); ++j) {
    size_t v;
    std::memcpy(&v, g.buffer(j), sizeof v);
    *most = std::max(*most, v);
  }
  g.end_step();
  return Status();
}
}  // namespace

Status shm_reducescatter(ShmGroup& g, const void* src, void* dst,
                         const std::vector<size_t>& offsets, const std::vector<size_t>& counts,
                         size_t elem, ReduceFn fn) {
  const int me = g.me(), size = g.size();
  const char* in = static_cast<const char*>(src);
  if (size == 1) {
    if (dst != in + offsets[0] * elem) std::memmove(dst, in + offsets[0] * elem, counts[0] * elem);
    return Status();
  }
  const size_t piece = piece_of(g, elem);
  size_t most = *std::max_element(counts.begin(), counts.end()) * elem;
  std::vector<const void*> inputs(size);
  for (size_t first = 0; first < most; first += piece) {
    HVS_CHECK(g.begin_step());
    char* mine = g.buffer(me);
    for (int j = 0; j < size; ++j)
      if (j != me)
        std::memcpy(mine + j * piece, in + offsets[j] * elem + first, part(counts[j] * elem, first, piece));
    g.post();
    HVS_CHECK(g.wait_step_all());
    size_t n = part(counts[me] * elem, first, piece);
    for (int j = 0; j < size; ++j)
      inputs[j] = j == me ? in + offsets[me] * elem + first : g.buffer(j) + me * piece;
    reduce_many(fn, elem, static_cast<char*>(dst) + first, inputs.data(), size, n / elem);
    g.end_step();
  }
  return Status();
}

Status shm_alltoall(ShmGroup& g, const std::vector<Span>& send, const std::vector<Span>& recv) {
  const int me = g.me(), size = g.size();
  if (size == 1) {
    if (recv[0].ptr != send[0].ptr) std::memmove(recv[0].ptr, send[0].ptr, send[0].len);
    return Status();
  }
  size_t mine = 0;
  for (int j = 0; j < size; ++j) mine = std::max({mine, send[j].len, recv[j].len});
  size_t most = 0;
  HVS_CHECK(agree_on_max(g, mine, &most));
  const size_t piece = piece_of(g, 8);
  for (size_t first = 0; first < most; first += piece) {
    HVS_CHECK(g.begin_step());
    char* buf = g.buffer(me);
    for (int j = 0; j < size; ++j)
      if (j != me) std::memcpy(buf + j * piece, send[j].ptr + first, part(send[j].len, first, piece));
    g.post();
    HVS_CHECK(g.wait_step_all());
    for (int j = 0; j < size; ++j) {
      const char* from = j == me ? send[me].ptr + first : g.buffer(j) + me * piece;
      std::memmove(recv[j].ptr + first, from, part(recv[j].len, first, piece));
    }
    g.end_step();
  }
  return Status();
}

}  // namespace hvs
