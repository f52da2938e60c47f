// Loading the CUDA runtime and NCCL, and the lane's device step; see runtime.h.
#include "runtime.h"

#include <dlfcn.h>

namespace hvs {

namespace {

constexpr unsigned kDisableTiming = 0x02;  // cudaEventDisableTiming: cheaper to record
constexpr int kNccl2_10 = 21000;           // ncclAvg and ncclBfloat16 from here

const char* kCudartHint =
    "the CUDA lane needs the CUDA runtime loaded (import cupy or torch with CUDA first), or "
    "pip install nvidia-cuda-runtime-cu12 (match your CUDA major version)";
const char* kNcclHint =
    "the CUDA lane needs NCCL: pip install cupy-cuda12x \"nvidia-nccl-cu12>=2.18\" "
    "(match your CUDA major version)";

// The first of `names` that opens (see CudaRuntime::load); what each failure said.
void* open_first(const std::vector<std::string>& names, std::string* opened, std::string* why) {
  for (const std::string& n : names) {
    bool path = n.find('/') != std::string::npos;
    void* h = dlopen(n.c_str(), RTLD_NOW | RTLD_LOCAL | (path ? 0 : RTLD_NOLOAD));
    if (h) {
      *opened = n;
      return h;
    }
    const char* err = dlerror();
    *why += (why->empty() ? "" : "; ") + n + ": " +
            (path ? (err ? err : "cannot be opened") : "not loaded in this process");
  }
  return nullptr;
}

template <typename F>
Status symbol(void* lib, const char* name, const std::string& from, const char* hint, F* out) {
  dlerror();
  *out = reinterpret_cast<F>(dlsym(lib, name));
  if (!*out)
    return HVS_ERROR(Code::kNotSupported, std::string(name) + " is missing from " + from)
        .with_hint(hint);
  return Status();
}

}  // namespace

Status CudaRuntime::load(const std::vector<std::string>& cudart,
                         const std::vector<std::string>& nccl, std::unique_ptr<CudaRuntime>* out) {
  std::unique_ptr<CudaRuntime> rt(new CudaRuntime());
  std::string why;
  rt->cudart_ = open_first(cudart, &rt->cudart_name_, &why);
  if (!rt->cudart_)
    return HVS_ERROR(Code::kNotSupported, "no CUDA runtime library (" + why + ")").with_hint(kCudartHint);
  why.clear();
  rt->nccl_ = open_first(nccl, &rt->nccl_name_, &why);
  if (!rt->nccl_) return HVS_ERROR(Code::kNotSupported, "no NCCL library (" + why + ")").with_hint(kNcclHint);
  const std::string& c = rt->cudart_name_;
  const std::string& n = rt->nccl_name_;
  HVS_CHECK(symbol(rt->cudart_, "cudaEventCreateWithFlags", c, kCudartHint, &rt->event_create_));
  HVS_CHECK(symbol(rt->cudart_, "cudaEventRecord", c, kCudartHint, &rt->event_record_));
  HVS_CHECK(symbol(rt->cudart_, "cudaStreamWaitEvent", c, kCudartHint, &rt->stream_wait_));
  HVS_CHECK(symbol(rt->cudart_, "cudaEventDestroy", c, kCudartHint, &rt->event_destroy_));
  HVS_CHECK(symbol(rt->cudart_, "cudaGetErrorString", c, kCudartHint, &rt->cuda_error_));
  HVS_CHECK(symbol(rt->nccl_, "ncclAllReduce", n, kNcclHint, &rt->all_reduce_));
  HVS_CHECK(symbol(rt->nccl_, "ncclGetErrorString", n, kNcclHint, &rt->nccl_error_));
  int (*get_version)(int*) = nullptr;
  HVS_CHECK(symbol(rt->nccl_, "ncclGetVersion", n, kNcclHint, &get_version));
  int rc = get_version(&rt->nccl_version_);
  if (rc != 0)
    return HVS_ERROR(Code::kNotSupported, "ncclGetVersion failed: " + std::string(rt->nccl_error_(rc)))
        .with_hint(kNcclHint);
  *out = std::move(rt);
  return Status();
}

CudaRuntime::~CudaRuntime() {
  if (ready_) event_destroy_(ready_);
  if (done_) event_destroy_(done_);
  if (nccl_) dlclose(nccl_);
  if (cudart_) dlclose(cudart_);
}

Status CudaRuntime::cuda(int rc, const char* what) const {
  if (rc == 0) return Status();
  return HVS_ERROR(Code::kSystem, std::string(what) + " failed: CUDA error " + std::to_string(rc) +
                                      " (" + cuda_error_(rc) + ")");
}

Status CudaRuntime::events() {
  if (!ready_) HVS_CHECK(cuda(event_create_(&ready_, kDisableTiming), "cudaEventCreateWithFlags"));
  if (!done_) HVS_CHECK(cuda(event_create_(&done_, kDisableTiming), "cudaEventCreateWithFlags"));
  return Status();
}

Status CudaRuntime::allreduce(void* comm, void* caller_stream, void* engine_stream,
                              const void* src, void* dst, size_t count, DType dt, ReduceOp op) {
  int nccl_dt = 0, nccl_o = 0;
  HVS_CHECK(nccl_dtype(dt, nccl_version_, &nccl_dt));
  HVS_CHECK(nccl_op(op, nccl_version_, &nccl_o));
  if (count == 0) return Status();
  if (!comm) return HVS_ERROR(Code::kInvalid, "the CUDA lane's allreduce got no NCCL communicator");
  if (!src || !dst) return HVS_ERROR(Code::kInvalid, "the CUDA lane's allreduce got a null buffer");
  const bool fence = caller_stream != engine_stream;
  if (fence) {
    HVS_CHECK(events());
    HVS_CHECK(cuda(event_record_(ready_, caller_stream), "cudaEventRecord on the caller's stream"));
    HVS_CHECK(cuda(stream_wait_(engine_stream, ready_, 0), "cudaStreamWaitEvent on the engine's stream"));
  }
  int rc = all_reduce_(src, dst, count, nccl_dt, nccl_o, comm, engine_stream);
  if (rc != 0)
    return HVS_ERROR(Code::kSystem, "ncclAllReduce of " + std::to_string(count) + " " + dtype_name(dt) +
                                        " failed: NCCL error " + std::to_string(rc) + " (" +
                                        nccl_error_(rc) + ")");
  if (fence) {
    HVS_CHECK(cuda(event_record_(done_, engine_stream), "cudaEventRecord on the engine's stream"));
    HVS_CHECK(cuda(stream_wait_(caller_stream, done_, 0), "cudaStreamWaitEvent on the caller's stream"));
  }
  return Status();
}

Status nccl_dtype(DType dt, int version, int* out) {
  if (dt == DType::kBFloat16 && version < kNccl2_10)
    return HVS_ERROR(Code::kNotSupported, "NCCL " + std::to_string(version) +
                                              " reduces no bfloat16 (NCCL 2.10 and later do)");
  switch (dt) {
    case DType::kInt8: *out = 0; return Status();
    case DType::kUInt8: *out = 1; return Status();
    case DType::kInt32: *out = 2; return Status();
    case DType::kInt64: *out = 4; return Status();
    case DType::kFloat16: *out = 6; return Status();
    case DType::kFloat32: *out = 7; return Status();
    case DType::kFloat64: *out = 8; return Status();
    case DType::kBFloat16: *out = 9; return Status();
    default:
      return HVS_ERROR(Code::kNotSupported, std::string("NCCL reduces no ") + dtype_name(dt));
  }
}

Status nccl_op(ReduceOp op, int version, int* out) {
  switch (op) {
    case ReduceOp::kSum: *out = 0; return Status();
    case ReduceOp::kProduct: *out = 1; return Status();
    case ReduceOp::kMax: *out = 2; return Status();
    case ReduceOp::kMin: *out = 3; return Status();
    case ReduceOp::kAverage:
      if (version < kNccl2_10)
        return HVS_ERROR(Code::kNotSupported, "NCCL " + std::to_string(version) +
                                                  " has no average (ncclAvg: NCCL 2.10 and later)");
      *out = 4;
      return Status();
    default:
      return HVS_ERROR(Code::kNotSupported, std::string("NCCL has no reduce op ") + op_name(op));
  }
}

}  // namespace hvs
