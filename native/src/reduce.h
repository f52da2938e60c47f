// Elementwise reduction kernels: out[i] = a[i] op b[i].
//
// One kernel per (dtype, op), compiled for several instruction sets and
// picked at load time (target_clones: GCC and clang).  Integers wrap on overflow, as
// numpy's do.  float16 and bfloat16 are computed in float and rounded back to
// nearest-even after every op.  bool: sum and max are logical or, product and
// min logical and.  Float min/max propagate NaN, like numpy.minimum.
// `out` may be `a` or `b` itself, but must not partially overlap either.
#pragma once

#include <cstddef>

#include "hvs/types.h"

namespace hvs {

using ReduceFn = void (*)(void* out, const void* a, const void* b, size_t count);

// The kernel of (dtype, op), or nullptr where the pair is not supported
// (AVERAGE never is: the front end turns it into SUM and a postscale).
ReduceFn reduce_fn(DType dtype, ReduceOp op);

// out = inputs[0] op inputs[1] op ... in that order, in cache-sized tiles,
// so every rank that computes the same element gets the same bits.  With
// `copy`, each finished tile is also copied there while it is still in L1
// (cheaper than a second pass over out).
void reduce_many(ReduceFn fn, size_t elem, void* out, const void* const* inputs, int n,
                 size_t count, void* copy = nullptr);

}  // namespace hvs
