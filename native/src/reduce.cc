// Reduction kernels; see reduce.h for the semantics of every (dtype, op).
#include "reduce.h"

#include <cstdint>
#include <cstring>

#if defined(__GNUC__) && defined(__x86_64__) && defined(__linux__)  // GCC and clang (zig)
#define HVS_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define HVS_CLONES
#endif
#define HVS_INLINE inline __attribute__((always_inline))

namespace hvs {
namespace {

// -- value types: how an element is loaded to its compute type and stored back
template <typename T>
struct Plain {
  using Storage = T;
  using Compute = T;
  static HVS_INLINE Compute load(T v) { return v; }
  static HVS_INLINE T store(Compute v) { return v; }
};

struct Half {
  using Storage = _Float16;
  using Compute = float;
  static HVS_INLINE float load(_Float16 v) { return static_cast<float>(v); }
  static HVS_INLINE _Float16 store(float v) { return static_cast<_Float16>(v); }
};

struct BHalf {
  using Storage = uint16_t;
  using Compute = float;
  static HVS_INLINE float load(uint16_t v) {
    uint32_t bits = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  static HVS_INLINE uint16_t store(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    uint32_t quiet_nan = (bits >> 16) | 0x40u;
    bool nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
    return static_cast<uint16_t>(nan ? quiet_nan : rounded);
  }
};

// Integer sums and products wrap, computed unsigned so overflow is defined.
template <typename T>
struct Wrap {
  using Storage = T;
  using Compute = T;
  static HVS_INLINE T load(T v) { return v; }
  static HVS_INLINE T store(T v) { return v; }
};

// -- ops on the compute type
struct Sum {
  template <typename C>
  static HVS_INLINE C apply(C a, C b) { return a + b; }
};
struct Product {
  template <typename C>
  static HVS_INLINE C apply(C a, C b) { return a * b; }
};
struct Min {
  template <typename C>
  static HVS_INLINE C apply(C a, C b) {
    C r = b < a ? b : a;
    return a != a ? a : (b != b ? b : r);  // NaN wins, as in numpy.minimum
  }
};
struct Max {
  template <typename C>
  static HVS_INLINE C apply(C a, C b) {
    C r = b > a ? b : a;
    return a != a ? a : (b != b ? b : r);
  }
};
struct Or {
  template <typename C>
  static HVS_INLINE C apply(C a, C b) { return static_cast<C>((a | b) != 0); }
};
struct And {
  template <typename C>
  static HVS_INLINE C apply(C a, C b) { return static_cast<C>(a != 0 && b != 0); }
};

template <typename V, typename Op>
HVS_INLINE void binary(void* out, const void* a, const void* b, size_t n) {
  using S = typename V::Storage;
  S* __restrict o = static_cast<S*>(out);
  const S* __restrict x = static_cast<const S*>(a);
  const S* __restrict y = static_cast<const S*>(b);
  for (size_t i = 0; i < n; ++i) o[i] = V::store(Op::apply(V::load(x[i]), V::load(y[i])));
}

template <typename V, typename Op>
HVS_INLINE void inplace(void* out, const void* b, size_t n) {
  using S = typename V::Storage;
  S* __restrict o = static_cast<S*>(out);
  const S* __restrict y = static_cast<const S*>(b);
  for (size_t i = 0; i < n; ++i) o[i] = V::store(Op::apply(V::load(o[i]), V::load(y[i])));
}

// Every op here is commutative, so out == b reduces to the in-place form.
template <typename V, typename Op>
HVS_INLINE void dispatch(void* out, const void* a, const void* b, size_t n) {
  if (out == a)
    inplace<V, Op>(out, b, n);
  else if (out == b)
    inplace<V, Op>(out, a, n);
  else
    binary<V, Op>(out, a, b, n);
}

}  // namespace

#define HVS_KERNEL(NAME, V, OP) \
  HVS_CLONES void NAME(void* o, const void* a, const void* b, size_t n) { dispatch<V, OP>(o, a, b, n); }

#define HVS_FLOAT_KERNELS(PFX, V) \
  HVS_KERNEL(PFX##_sum, V, Sum)   \
  HVS_KERNEL(PFX##_min, V, Min)   \
  HVS_KERNEL(PFX##_max, V, Max)   \
  HVS_KERNEL(PFX##_prod, V, Product)

#define HVS_INT_KERNELS(PFX, T, U)           \
  HVS_KERNEL(PFX##_sum, Wrap<U>, Sum)        \
  HVS_KERNEL(PFX##_min, Plain<T>, Min)       \
  HVS_KERNEL(PFX##_max, Plain<T>, Max)       \
  HVS_KERNEL(PFX##_prod, Wrap<U>, Product)

HVS_FLOAT_KERNELS(k_f16, Half)
HVS_FLOAT_KERNELS(k_bf16, BHalf)
HVS_FLOAT_KERNELS(k_f32, Plain<float>)
HVS_FLOAT_KERNELS(k_f64, Plain<double>)
HVS_INT_KERNELS(k_i8, int8_t, uint8_t)
HVS_INT_KERNELS(k_i16, int16_t, uint16_t)
HVS_INT_KERNELS(k_i32, int32_t, uint32_t)
HVS_INT_KERNELS(k_i64, int64_t, uint64_t)
HVS_INT_KERNELS(k_u8, uint8_t, uint8_t)
HVS_KERNEL(k_bool_or, Plain<uint8_t>, Or)
HVS_KERNEL(k_bool_and, Plain<uint8_t>, And)

ReduceFn reduce_fn(DType dtype, ReduceOp op) {
  // Rows: dtypes in code order; columns: sum, average, min, max, product (adasum: none).
  static const ReduceFn table[kNumDTypes][kNumOps] = {
      {k_f16_sum, nullptr, k_f16_min, k_f16_max, k_f16_prod},
      {k_bf16_sum, nullptr, k_bf16_min, k_bf16_max, k_bf16_prod},
      {k_f32_sum, nullptr, k_f32_min, k_f32_max, k_f32_prod},
      {k_f64_sum, nullptr, k_f64_min, k_f64_max, k_f64_prod},
      {k_i8_sum, nullptr, k_i8_min, k_i8_max, k_i8_prod},
      {k_i16_sum, nullptr, k_i16_min, k_i16_max, k_i16_prod},
      {k_i32_sum, nullptr, k_i32_min, k_i32_max, k_i32_prod},
      {k_i64_sum, nullptr, k_i64_min, k_i64_max, k_i64_prod},
      {k_u8_sum, nullptr, k_u8_min, k_u8_max, k_u8_prod},
      {k_bool_or, nullptr, k_bool_and, k_bool_or, k_bool_and},
  };
  int d = static_cast<int>(dtype), o = static_cast<int>(op);
  if (d < 0 || d >= kNumDTypes || o < 0 || o >= kNumOps) return nullptr;
  return table[d][o];
}

void reduce_many(ReduceFn fn, size_t elem, void* out, const void* const* inputs, int n,
                 size_t count, void* copy) {
  if (n == 1) {
    if (out != inputs[0]) std::memmove(out, inputs[0], count * elem);
    if (copy && copy != out) std::memmove(copy, out, count * elem);
    return;
  }
  // Tiles small enough that `out` stays in L1 while every input streams by.
  constexpr size_t kTileBytes = 16 * 1024;
  alignas(64) char saved[kTileBytes];
  int alias = -1;  // an input past the first two that is `out` itself
  for (int k = 2; k < n; ++k)
    if (inputs[k] == out) alias = k;
  const size_t tile = kTileBytes / elem;
  char* o = static_cast<char*>(out);
  for (size_t start = 0; start < count; start += tile) {
    size_t len = count - start < tile ? count - start : tile;
    size_t off = start * elem;
    if (alias >= 0) std::memcpy(saved, o + off, len * elem);
    auto in = [&](int k) {
      return k == alias ? static_cast<const char*>(saved) : static_cast<const char*>(inputs[k]) + off;
    };
    fn(o + off, in(0), in(1), len);
    for (int k = 2; k < n; ++k) fn(o + off, o + off, in(k), len);
    if (copy) std::memcpy(static_cast<char*>(copy) + off, o + off, len * elem);
  }
}

}  // namespace hvs
