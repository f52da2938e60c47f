// Reduce ops and dtypes: the integer codes of collectives.types (DType,
// ReduceOp).  Keep the two in step (the test
// test_native_codes_are_the_codes_of_collectives_types compares them).
#pragma once

#include <cstddef>
#include <cstdint>

namespace hvs {

enum class DType : int {
  kFloat16 = 0,
  kBFloat16 = 1,
  kFloat32 = 2,
  kFloat64 = 3,
  kInt8 = 4,
  kInt16 = 5,
  kInt32 = 6,
  kInt64 = 7,
  kUInt8 = 8,
  kBool = 9,
};
constexpr int kNumDTypes = 10;

enum class ReduceOp : int {
  kSum = 0,
  kAverage = 1,  // never reaches native code: the front end sums, then scales
  kMin = 2,
  kMax = 3,
  kProduct = 4,
  kAdasum = 5,  // no elementwise kernel: Context::adasum (adasum.cc)
};
constexpr int kNumOps = 6;

size_t itemsize(DType dt);
const char* dtype_name(DType dt);
const char* op_name(ReduceOp op);
bool valid_dtype(int code);
bool valid_op(int code);

}  // namespace hvs
