// Adasum's arithmetic on spans of one floating dtype (float16, float32, float64).
//
// Two vectors a and b combine into
//
//     a' = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b
//
// (a side whose norm is zero keeps the coefficient 1).  A vector halving,
// distance doubling exchange (Context::adasum) holds only part of each vector
// on a rank, so the dot products are taken in parts (adasum_dots), summed over
// the ranks that hold the other parts, and only then turned into coefficients
// (adasum_coefficients) and applied (adasum_combine).
//
// Arithmetic as collectives/adasum.py's: dot products, norms and coefficients
// in float64; every element computed as ca * a + cb * b in float64 and rounded
// once to the dtype.  The dot products may differ from numpy's in the last bits
// (another order of summation); the rest is bit for bit.
#pragma once

#include <cstddef>

#include "hvs/types.h"

namespace hvs {

struct AdasumDots {
  double ab = 0, aa = 0, bb = 0;
};

// a.b, a.a and b.b over n elements, added to *dots.
void adasum_dots(DType dt, const void* a, const void* b, size_t n, AdasumDots* dots);

// The coefficients of a and b once *dots covers the whole vectors.
void adasum_coefficients(const AdasumDots& dots, double* ca, double* cb);

// out = ca * a + cb * b over n elements; out may be a or b.
void adasum_combine(DType dt, void* out, const void* a, const void* b, size_t n, double ca,
                    double cb);

bool adasum_dtype(DType dt);  // float16, float32, float64

}  // namespace hvs
