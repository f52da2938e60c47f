// Adasum's kernels; see adasum.h.
#include "adasum.h"

#if defined(__GNUC__) && defined(__x86_64__) && defined(__linux__)
#define HVS_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#define HVS_X86_KERNELS 1
#include <immintrin.h>
#else
#define HVS_CLONES
#define HVS_X86_KERNELS 0
#endif
#define HVS_INLINE inline __attribute__((always_inline))

namespace hvs {
namespace {

// Sixteen partial sums per product (element i goes to sum i % 16), in four vectors of
// four doubles: vectorized, and enough independent sums to hide the adds' latency,
// without reordering any one sum.
typedef double D4 __attribute__((vector_size(32)));
constexpr int kLanes = 16;

template <typename T>
HVS_INLINE D4 load4(const T* p) {
  typedef T T4 __attribute__((vector_size(4 * sizeof(T)), aligned(alignof(T)), may_alias));
  return __builtin_convertvector(*reinterpret_cast<const T4*>(p), D4);
}

// The elements from i on (fewer than kLanes) into lanes 0.., then the lanes' sums in order.
template <typename T>
HVS_INLINE void finish_dots(const T* a, const T* b, size_t i, size_t n, double* sab, double* saa,
                            double* sbb, AdasumDots* out) {
  for (int l = 0; i < n; ++i, ++l) {
    const double x = static_cast<double>(a[i]), y = static_cast<double>(b[i]);
    sab[l] += x * y;
    saa[l] += x * x;
    sbb[l] += y * y;
  }
  for (int l = 0; l < kLanes; ++l) out->ab += sab[l], out->aa += saa[l], out->bb += sbb[l];
}

template <typename T>
HVS_INLINE void dots(const T* __restrict a, const T* __restrict b, size_t n, AdasumDots* out) {
  D4 ab[4], aa[4], bb[4];
  for (int v = 0; v < 4; ++v) ab[v] = aa[v] = bb[v] = D4{0, 0, 0, 0};
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int v = 0; v < 4; ++v) {
      const D4 x = load4(a + i + 4 * v), y = load4(b + i + 4 * v);
      ab[v] += x * y;
      aa[v] += x * x;
      bb[v] += y * y;
    }
  double sab[kLanes], saa[kLanes], sbb[kLanes];
  for (int l = 0; l < kLanes; ++l) sab[l] = ab[l / 4][l % 4], saa[l] = aa[l / 4][l % 4], sbb[l] = bb[l / 4][l % 4];
  finish_dots(a, b, i, n, sab, saa, sbb, out);
}

template <typename T>
HVS_INLINE void combine(T* out, const T* a, const T* b, size_t n, double ca, double cb) {
  for (size_t i = 0; i < n; ++i)
    out[i] = static_cast<T>(ca * static_cast<double>(a[i]) + cb * static_cast<double>(b[i]));
}

// The dot products may fuse multiply and add: a product of two float16 or float32 values
// is exact in float64, so there the sums are the same to the bit, and for float64 only the
// dot products' last bits move, which their order of summation already does.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
#endif
HVS_CLONES void dots_f16(const void* a, const void* b, size_t n, AdasumDots* d) {
  dots(static_cast<const _Float16*>(a), static_cast<const _Float16*>(b), n, d);
}
#if HVS_X86_KERNELS
// The same sums as dots<float> (the same lanes, and a float32 product is exact in float64,
// so fused or not it is the same), with AVX2's one-instruction widening of four floats:
// GCC lowers __builtin_convertvector's in halves.
__attribute__((target("avx2,fma"))) void dots_f32_avx2(const float* a, const float* b, size_t n,
                                                      AdasumDots* out) {
  __m256d ab[4], aa[4], bb[4];
  for (int v = 0; v < 4; ++v) ab[v] = aa[v] = bb[v] = _mm256_setzero_pd();
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int v = 0; v < 4; ++v) {
      const __m256d x = _mm256_cvtps_pd(_mm_loadu_ps(a + i + 4 * v));
      const __m256d y = _mm256_cvtps_pd(_mm_loadu_ps(b + i + 4 * v));
      ab[v] = _mm256_fmadd_pd(x, y, ab[v]);
      aa[v] = _mm256_fmadd_pd(x, x, aa[v]);
      bb[v] = _mm256_fmadd_pd(y, y, bb[v]);
    }
  double sab[kLanes], saa[kLanes], sbb[kLanes];
  for (int v = 0; v < 4; ++v) {
    _mm256_storeu_pd(sab + 4 * v, ab[v]);
    _mm256_storeu_pd(saa + 4 * v, aa[v]);
    _mm256_storeu_pd(sbb + 4 * v, bb[v]);
  }
  finish_dots(a, b, i, n, sab, saa, sbb, out);
}

const bool kAvx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif

HVS_CLONES void dots_f32_any(const void* a, const void* b, size_t n, AdasumDots* d) {
  dots(static_cast<const float*>(a), static_cast<const float*>(b), n, d);
}

void dots_f32(const void* a, const void* b, size_t n, AdasumDots* d) {
#if HVS_X86_KERNELS
  if (kAvx2) return dots_f32_avx2(static_cast<const float*>(a), static_cast<const float*>(b), n, d);
#endif
  dots_f32_any(a, b, n, d);
}
HVS_CLONES void dots_f64(const void* a, const void* b, size_t n, AdasumDots* d) {
  dots(static_cast<const double*>(a), static_cast<const double*>(b), n, d);
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

HVS_CLONES void combine_f16(void* o, const void* a, const void* b, size_t n, double ca, double cb) {
  combine(static_cast<_Float16*>(o), static_cast<const _Float16*>(a), static_cast<const _Float16*>(b),
          n, ca, cb);
}
HVS_CLONES void combine_f32(void* o, const void* a, const void* b, size_t n, double ca, double cb) {
  combine(static_cast<float*>(o), static_cast<const float*>(a), static_cast<const float*>(b), n, ca, cb);
}
HVS_CLONES void combine_f64(void* o, const void* a, const void* b, size_t n, double ca, double cb) {
  combine(static_cast<double*>(o), static_cast<const double*>(a), static_cast<const double*>(b), n,
          ca, cb);
}

}  // namespace

bool adasum_dtype(DType dt) {
  return dt == DType::kFloat16 || dt == DType::kFloat32 || dt == DType::kFloat64;
}

void adasum_dots(DType dt, const void* a, const void* b, size_t n, AdasumDots* d) {
  switch (dt) {
    case DType::kFloat16: return dots_f16(a, b, n, d);
    case DType::kFloat32: return dots_f32(a, b, n, d);
    case DType::kFloat64: return dots_f64(a, b, n, d);
    default: return;
  }
}

void adasum_coefficients(const AdasumDots& d, double* ca, double* cb) {
  *ca = d.aa > 0.0 ? 1.0 - d.ab / (2.0 * d.aa) : 1.0;
  *cb = d.bb > 0.0 ? 1.0 - d.ab / (2.0 * d.bb) : 1.0;
}

void adasum_combine(DType dt, void* out, const void* a, const void* b, size_t n, double ca,
                    double cb) {
  switch (dt) {
    case DType::kFloat16: return combine_f16(out, a, b, n, ca, cb);
    case DType::kFloat32: return combine_f32(out, a, b, n, ca, cb);
    case DType::kFloat64: return combine_f64(out, a, b, n, ca, cb);
    default: return;
  }
}

}  // namespace hvs
