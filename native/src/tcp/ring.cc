// Pipelined ring allreduce, allgather and reduce-scatter over TCP.
//
// Allreduce over P members splits the buffer into P segments and runs
// 2(P - 1) steps, all in one Transfer:
//   reduce-scatter step s (0..P-2): send segment me - s, receive segment
//     me - s - 1 and reduce it with our input; after the last step, member
//     me holds segment me + 1 fully reduced;
//   allgather step t (0..P-2): send segment me + 1 - t, receive segment
//     me - t into place.
// A chunk sent at a step is the chunk received at the step before; its send
// item depends on that receive item, so chunks stream through the ring
// without waiting for whole segments.  Each element is reduced on one
// member and copied to the others, so every member has the same bits.
#include <algorithm>

#include "collectives.h"

namespace hvs {

namespace {

int mod(int a, int p) { return ((a % p) + p) % p; }

// Byte ranges [first, first + len) of segment i when `total` bytes of
// `elem`-sized elements are cut into p near-equal segments.
void segment(size_t count, size_t elem, int p, int i, size_t* first, size_t* len) {
  size_t a = count * static_cast<size_t>(i) / p, b = count * static_cast<size_t>(i + 1) / p;
  *first = a * elem;
  *len = (b - a) * elem;
}

// Chunks of [first, first + len), each at most `chunk` bytes (a multiple of elem).
template <typename F>
void for_chunks(size_t first, size_t len, size_t chunk, F f) {
  for (size_t off = 0; off < len; off += chunk) f(first + off, std::min(chunk, len - off));
}

size_t chunk_of(const TcpGroup& g, size_t elem) {
  return std::max<size_t>(elem, g.chunk / elem * elem);
}

TransferOptions options(TcpGroup& g, ReduceFn fn, size_t elem) {
  if (g.staging->size() < g.chunk + elem) g.staging->resize(g.chunk + elem);
  TransferOptions opt = group_options(g, true);
  opt.fn = fn, opt.elem = elem, opt.staging = g.staging->data();
  return opt;
}

}  // namespace

Status ring_allreduce(TcpGroup& g, const char* src, char* dst, size_t count, size_t elem,
                      ReduceFn fn) {
  const int p = g.size(), me = g.me;
  if (p == 1) {
    if (dst != src) std::copy(src, src + count * elem, dst);
    return Status();
  }
  const size_t chunk = chunk_of(g, elem);
  std::vector<SendItem> sends;
  std::vector<RecvItem> recvs;
  std::vector<long> prev;  // receive items of the previous step, by chunk
  for (int s = 0; s < p - 1; ++s) {
    size_t first, len;
    std::vector<long> cur;
    segment(count, elem, p, mod(me - s, p), &first, &len);
    size_t c = 0;
    for_chunks(first, len, chunk, [&](size_t off, size_t n) {
      sends.push_back({(s == 0 ? src : dst) + off, n, s == 0 ? -1 : prev[c++]});
    });
    segment(count, elem, p, mod(me - s - 1, p), &first, &len);
    for_chunks(first, len, chunk, [&](size_t off, size_t n) {
      cur.push_back(static_cast<long>(recvs.size()));
      recvs.push_back({nullptr, n, dst + off, src + off});
    });
    prev.swap(cur);
  }
  for (int t = 0; t < p - 1; ++t) {
    size_t first, len;
    std::vector<long> cur;
    segment(count, elem, p, mod(me + 1 - t, p), &first, &len);
    size_t c = 0;
    for_chunks(first, len, chunk, [&](size_t off, size_t n) { sends.push_back({dst + off, n, prev[c++]}); });
    segment(count, elem, p, mod(me - t, p), &first, &len);
    for_chunks(first, len, chunk, [&](size_t off, size_t n) {
      cur.push_back(static_cast<long>(recvs.size()));
      recvs.push_back({dst + off, n, nullptr, nullptr});
    });
    prev.swap(cur);
  }
  HVS_CHECK(transfer(g.link(mod(me + 1, p)), sends, g.link(mod(me - 1, p)), recvs, options(g, fn, elem)));
  return Status();
}

Status ring_allgather(TcpGroup& g, const std::vector<std::vector<Span>>& regions) {
  const int p = g.size(), me = g.me;
  if (p == 1) return Status();
  std::vector<SendItem> sends;
  std::vector<RecvItem> recvs;
  std::vector<long> prev;
  for (int t = 0; t < p - 1; ++t) {
    std::vector<long> cur;
    size_t c = 0;
    for (const Span& sp : regions[mod(me - t, p)])
      for_chunks(0, sp.len, g.chunk, [&](size_t off, size_t n) {
        sends.push_back({sp.ptr + off, n, t == 0 ? -1 : prev[c++]});
      });
    for (const Span& sp : regions[mod(me - t - 1, p)])
      for_chunks(0, sp.len, g.chunk, [&](size_t off, size_t n) {
        cur.push_back(static_cast<long>(recvs.size()));
        recvs.push_back({sp.ptr + off, n, nullptr, nullptr});
      });
    prev.swap(cur);
  }
  HVS_CHECK(transfer(g.link(mod(me + 1, p)), sends, g.link(mod(me - 1, p)), recvs, options(g, nullptr, 1)));
  return Status();
}

// Step s (0..P-2): send block me - s - 1 (our input at s = 0, partial sums
// after), receive block me - s - 2 and reduce it with our input into tmp, or
// into dst at the last step, whose block is our own.
Status ring_reducescatter(TcpGroup& g, const char* src, char* dst, char* tmp,
                          const std::vector<size_t>& offsets, const std::vector<size_t>& lens,
                          size_t elem, ReduceFn fn) {
  const int p = g.size(), me = g.me;
  if (p == 1) {
    std::copy(src + offsets[0], src + offsets[0] + lens[0], dst);
    return Status();
  }
  const size_t chunk = chunk_of(g, elem);
  std::vector<SendItem> sends;
  std::vector<RecvItem> recvs;
  std::vector<long> prev;
  for (int s = 0; s < p - 1; ++s) {
    int out_block = mod(me - s - 1, p), in_block = mod(me - s - 2, p);
    std::vector<long> cur;
    size_t c = 0;
    for_chunks(offsets[out_block], lens[out_block], chunk, [&](size_t off, size_t n) {
      sends.push_back({(s == 0 ? src : tmp) + off, n, s == 0 ? -1 : prev[c++]});
    });
    bool last = s == p - 2;
    for_chunks(offsets[in_block], lens[in_block], chunk, [&](size_t off, size_t n) {
      cur.push_back(static_cast<long>(recvs.size()));
      char* out = last ? dst + (off - offsets[in_block]) : tmp + off;
      recvs.push_back({nullptr, n, out, src + off});
    });
    prev.swap(cur);
  }
  HVS_CHECK(transfer(g.link(mod(me + 1, p)), sends, g.link(mod(me - 1, p)), recvs, options(g, fn, elem)));
  return Status();
}

}  // namespace hvs
