// Adasum by vector halving, distance doubling (the algorithm of Horovod's
// Adasum paper, Maleki et al. 2020), composed from the context's own ops.
//
// Terms as collectives/adasum.py: a world of 2^k ranks; at level j (distance
// d = 2^j) rank r pairs with r ^ d; the rank with bit j clear holds the lower
// group's vector (a), its partner the upper group's (b).  Every rank starts
// with its whole vector and a range, [0, count):
//
//   level j   each pair splits its range in two halves: the lower rank keeps
//             the first, the upper rank the second; each sends the half it
//             gives up to its partner (one alltoall of the world, only the
//             partner's block non-empty) and now holds a and b on its half.
//             It takes the partial dot products a.b, a.a, b.b of its half, per
//             segment; the block of 2^(j+1) ranks around the pair holds the
//             two groups' vectors, each element on exactly one of them, so
//             one allreduce of the partial sums (a few doubles) gives every
//             rank the whole dot products, and it combines its half in place
//   gather    after k levels rank r holds 1/2^k of the result, at its own
//             offset in the buffer.  On one host every rank reads the others'
//             parts in place (cross-memory attach; else an allgather through
//             the segment); across hosts the levels run backwards (distance
//             halving), each pair swapping what it holds, in place
//
// Each rank sends count/2 + count/4 + ... ~ count elements and then gathers
// the same again: what a ring allreduce moves, in 2k exchanges and k tiny
// allreduces, where an allgather of every vector moves (2^k - 1) x count.
// The tree, the dot products per segment, the float64 arithmetic and the
// rounding of each level's result to the dtype are those of adasum.py's tree,
// so the results agree with it to the last bits of the dot products' sums.
#include <algorithm>
#include <cstring>
#include <vector>

#include "adasum.h"
#include "context.h"

namespace hvs {

namespace {

constexpr uint64_t kCmaSwap = 0x434d4153;  // "CMAS": a step of Adasum's by cross-memory attach

struct Range {
  size_t lo, hi;
  size_t len() const { return hi - lo; }
};

// The range rank r keeps after levels 0 .. levels-1 (the halving is the same on every rank).
Range kept_range(int r, int levels, size_t count) {
  Range at{0, count};
  for (int j = 0; j < levels; ++j) {
    const size_t mid = at.lo + at.len() / 2;
    at = (r >> j) & 1 ? Range{mid, at.hi} : Range{at.lo, mid};
  }
  return at;
}

}  // namespace

// At least `bytes` of scratch memory, kept between calls: a fresh allocation of tens
// of megabytes costs its page faults again on every call.
char* Context::scratch(size_t bytes) {
  if (scratch_bytes_ < bytes || !scratch_) {
    scratch_.reset(new char[bytes + 64]);  // uninitialised
    scratch_bytes_ = bytes;
  }
  return scratch_.get();
}

// One level's exchange: `send` (send_count elements) to `partner`, its half into `recv`.
// Where every rank's partner at this distance shares its host, only the shared memory
// groups take part: by cross-memory attach, else staged through the segment; otherwise
// an alltoall of the world with one non-empty block per rank.  `cma`: the whole vector
// is as large as an allreduce's that takes cross-memory attach (ContextOptions::cma_bytes;
// part of the tag, so ranks configured otherwise fail with a mismatch, as there).
Status Context::swap_halves(int partner, const char* send, size_t send_count, char* recv,
                            size_t recv_count, DType dt, int distance, bool cma) {
  bool local = shm_ != nullptr;
  for (int r = 0; r < opt_.size && local; ++r) local = opt_.hosts[r] == opt_.hosts[r ^ distance];
  const size_t elem = itemsize(dt);
  if (local) {
    HVS_CHECK(check_usable());
    tag(OpTag{OpTag::kAlltoall, static_cast<int>(dt), -1, -1, 0, cma ? kCmaSwap : 0});
    const int peer = static_cast<int>(std::find(locals_.begin(), locals_.end(), partner) - locals_.begin());
    bool used = false;
    if (cma && shm_->cma() != ShmGroup::Cma::kOff)  // the verdict is the group's
      HVS_CHECK(shm_exchange_cma(*shm_, peer, send, recv, recv_count * elem, &used));
    if (used) return Status();
    std::vector<Span> out(locals_.size(), Span{const_cast<char*>(send), 0}),
        in(locals_.size(), Span{recv, 0});
    out[peer] = Span{const_cast<char*>(send), send_count * elem};
    in[peer] = Span{recv, recv_count * elem};
    return shm_alltoall(*shm_, out, in);
  }
  std::vector<size_t> sends(opt_.size, 0), recvs(opt_.size, 0);
  sends[partner] = send_count;
  recvs[partner] = recv_count;
  return alltoall(send, sends, recv, recvs, dt);
}

Status Context::adasum(void* buf, size_t count, DType dt, const std::vector<size_t>& segments) {
  const int size = opt_.size, me = opt_.rank;
  if (size & (size - 1))
    return HVS_ERROR(Code::kNotSupported, "Adasum needs a power-of-two number of ranks, this world has " +
                                              std::to_string(size));
  if (!adasum_dtype(dt))
    return HVS_ERROR(Code::kNotSupported, std::string("Adasum combines float16, float32 and float64, not ") +
                                              dtype_name(dt));
  size_t total = 0;
  for (size_t n : segments) total += n;
  if (total != count)
    return HVS_ERROR(Code::kInvalid, "Adasum segments cover " + std::to_string(total) + " of " +
                                         std::to_string(count) + " elements");
  if (size == 1) return Status();
  const size_t elem = itemsize(dt);
  const size_t nseg = segments.size();
  std::vector<size_t> seg_lo(nseg + 1, 0);
  for (size_t s = 0; s < nseg; ++s) seg_lo[s + 1] = seg_lo[s] + segments[s];
  int levels = 0;
  while ((1 << levels) < size) ++levels;

  char* data = static_cast<char*>(buf);
  const bool cma = opt_.cma_bytes && count * elem >= opt_.cma_bytes;
  char* theirs = scratch(((count + 1) / 2) * elem);
  std::vector<double> sums;
  std::vector<AdasumDots> parts(nseg);
  Range at{0, count};
  for (int j = 0; j < levels; ++j) {
    const int partner = me ^ (1 << j);
    const bool lower = ((me >> j) & 1) == 0;
    const size_t mid = at.lo + at.len() / 2;
    const Range keep = lower ? Range{at.lo, mid} : Range{mid, at.hi};
    const Range give = lower ? Range{mid, at.hi} : Range{at.lo, mid};
    HVS_CHECK(swap_halves(partner, data + give.lo * elem, give.len(), theirs, keep.len(),
                          dt, 1 << j, cma));

    // Partial dot products of the kept half, per segment it overlaps.
    const char* mine = data + keep.lo * elem;
    const char* a = lower ? mine : theirs;
    const char* b = lower ? theirs : mine;
    const int blocks = size >> (j + 1), block = me >> (j + 1);
    sums.assign(static_cast<size_t>(blocks) * nseg * 3, 0.0);
    for (size_t s = 0; s < nseg; ++s) {
      const size_t lo = std::max(seg_lo[s], keep.lo), hi = std::min(seg_lo[s + 1], keep.hi);
      if (lo >= hi) continue;
      AdasumDots d;
      adasum_dots(dt, a + (lo - keep.lo) * elem, b + (lo - keep.lo) * elem, hi - lo, &d);
      double* at_s = &sums[(static_cast<size_t>(block) * nseg + s) * 3];
      at_s[0] = d.ab, at_s[1] = d.aa, at_s[2] = d.bb;
    }
    HVS_CHECK(allreduce(sums.data(), sums.data(), sums.size(), DType::kFloat64, ReduceOp::kSum));

    for (size_t s = 0; s < nseg; ++s) {
      const size_t lo = std::max(seg_lo[s], keep.lo), hi = std::min(seg_lo[s + 1], keep.hi);
      if (lo >= hi) continue;
      const double* at_s = &sums[(static_cast<size_t>(block) * nseg + s) * 3];
      double ca, cb;
      adasum_coefficients(AdasumDots{at_s[0], at_s[1], at_s[2]}, &ca, &cb);
      const size_t off = (lo - keep.lo) * elem;
      adasum_combine(dt, data + lo * elem, a + off, b + off, hi - lo, ca, cb);
    }
    at = keep;
  }

  if (!leaders_.empty()) {
    // Across hosts, the levels backwards (distance halving, as Horovod's): each pair swaps
    // what it holds, in place, so every rank sends count/2^k + ... + count/2 and the
    // ranks of a host all use their links, where an allgather goes through the leaders.
    for (int j = levels - 1; j >= 0; --j) {
      const int partner = me ^ (1 << j);
      const Range theirs_at = kept_range(partner, j + 1, count);
      const Range both = kept_range(me, j, count);
      HVS_CHECK(swap_halves(partner, data + at.lo * elem, at.len(), data + theirs_at.lo * elem,
                            theirs_at.len(), dt, 1 << j, cma));
      at = both;
    }
    return Status();
  }

  // One host: every rank's range, in rank order; where they lie in rank order too (2
  // ranks), the allgather writes straight into the buffer.
  std::vector<Range> ranges(size);
  std::vector<size_t> counts(size);
  bool in_order = true;
  for (int r = 0; r < size; ++r) {
    ranges[r] = kept_range(r, levels, count);
    counts[r] = ranges[r].len();
    if (r > 0 && ranges[r].lo != ranges[r - 1].hi) in_order = false;
  }
  if (shm_ && cma && shm_->cma() != ShmGroup::Cma::kOff) {  // read in place
    HVS_CHECK(check_usable());
    tag(OpTag{OpTag::kAllgather, static_cast<int>(dt), -1, -1, count, kCmaSwap});
    std::vector<Span> spans;
    for (int r : locals_) spans.push_back(Span{data + ranges[r].lo * elem, counts[r] * elem});
    bool used = false;
    HVS_CHECK(shm_gather_spans_cma(*shm_, data, spans, &used));
    if (used) return Status();
  }
  if (in_order) return allgather(data + at.lo * elem, data, counts, dt);
  char* gathered = scratch(count * elem);  // (the halves are no longer needed)
  HVS_CHECK(allgather(data + at.lo * elem, gathered, counts, dt));
  size_t off = 0;
  for (int r = 0; r < size; ++r) {
    std::memcpy(data + ranges[r].lo * elem, gathered + off, counts[r] * elem);
    off += counts[r] * elem;
  }
  return Status();
}

}  // namespace hvs
