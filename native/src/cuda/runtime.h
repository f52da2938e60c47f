// The CUDA lane's device step: the CUDA runtime and NCCL loaded at run time, and one
// allreduce ordered on the caller's stream.
//
// Terms:
//   runtime        the CUDA runtime library (libcudart.so.<major>) and NCCL (libnccl.so.2):
//                  by name, the instances the process has already loaded (CuPy's, torch's:
//                  RTLD_NOLOAD, so that CuPy's communicator belongs to this NCCL), or by
//                  path (the nvidia-* wheels' lib folders)
//   caller stream  the stream the caller's framework queues its work on (torch's current)
//   engine stream  the stream the collective runs on (the communicator's own)
//   step           a ready event on the caller stream, the engine stream waits for it,
//                  ncclAllReduce on the engine stream, a done event there, the caller
//                  stream waits for it.  The host never blocks: the caller's next kernels
//                  queue behind the allreduce.  One stream for both: no events.
// No CUDA header is needed: handles are opaque pointers and results ints; the codes are
// NCCL's stable ABI (nccl.h: ncclInt8 = 0 ... ncclFloat64 = 8, ncclBfloat16 = 9; ncclSum
// = 0, ncclProd, ncclMax, ncclMin, ncclAvg = 4, from NCCL 2.10).  Not thread-safe: one
// caller at a time (the lane's cycle lock).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "hvs/status.h"
#include "hvs/types.h"

namespace hvs {

class CudaRuntime {
 public:
  // Each list is tried in order: a name containing '/' is a path and is loaded; any other
  // name must already be loaded in this process.  kNotSupported names what is missing
  // (a library, or an entry point in it) and how to install it.
  static Status load(const std::vector<std::string>& cudart, const std::vector<std::string>& nccl,
                     std::unique_ptr<CudaRuntime>* out);
  ~CudaRuntime();

  // dst = the sum (op) of every rank's src over `comm` (an ncclComm_t), the step above.
  Status allreduce(void* comm, void* caller_stream, void* engine_stream, const void* src,
                   void* dst, size_t count, DType dt, ReduceOp op);
  int nccl_version() const { return nccl_version_; }
  const std::string& cudart_name() const { return cudart_name_; }
  const std::string& nccl_name() const { return nccl_name_; }

 private:
  CudaRuntime() = default;
  Status cuda(int rc, const char* what) const;
  Status events();

  void* cudart_ = nullptr;
  void* nccl_ = nullptr;
  std::string cudart_name_, nccl_name_;
  int nccl_version_ = 0;
  void* ready_ = nullptr;  // cudaEvent_t, created on first use (on the current device)
  void* done_ = nullptr;
  int (*event_create_)(void**, unsigned) = nullptr;
  int (*event_record_)(void*, void*) = nullptr;
  int (*stream_wait_)(void*, void*, unsigned) = nullptr;
  int (*event_destroy_)(void*) = nullptr;
  const char* (*cuda_error_)(int) = nullptr;
  int (*all_reduce_)(const void*, void*, size_t, int, int, void*, void*) = nullptr;
  const char* (*nccl_error_)(int) = nullptr;
};

// NCCL's codes for a dtype and a reduce op (`version` as ncclGetVersion's: ncclBfloat16
// and ncclAvg from 21000 up); kNotSupported for what NCCL cannot reduce (bool, Adasum).
Status nccl_dtype(DType dt, int version, int* out);
Status nccl_op(ReduceOp op, int version, int* out);

}  // namespace hvs
