// HvsAsyncKernel: a TensorFlow graph op that runs one of our numpy kernels off
// TensorFlow's inter-op threads.
//
// Where TensorFlow does not order our ops (a graph built outside tf.function,
// run by a Session), independent collectives run in whatever order each
// rank's inter-op threads pick.  A kernel that blocks its thread until every
// rank has submitted its tensor can then hold every thread of one rank on ops
// the other rank has not reached: a deadlock.  This op never blocks: its
// ComputeAsync hands the inputs to Python (`start`), which runs the kernel on
// a thread of its own and calls hvs_async_finish with the outputs or an error;
// only then is the op done.  So every ready op is submitted to the fusion
// engine, which matches them across ranks by name, in any order.
//
// Terms: a *call* is one execution of the op (its context and done callback);
// Python holds the call's address between start and finish.
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/common_shape_fns.h"

namespace {

using StartFn = int (*)(int64_t kernel, void* call, int n, const void* const* data,
                        const int* dtypes, const int* ndims, const int64_t* dims);

std::atomic<StartFn> g_start{nullptr};

struct Call {
  tensorflow::OpKernelContext* ctx;
  std::function<void()> done;
};

}  // namespace

extern "C" __attribute__((visibility("default"))) void hvs_async_bind(void* start) {
  g_start.store(reinterpret_cast<StartFn>(start));
}

// The call's outputs (n of them, each a dtype, a rank and its dims, flattened)
// or, with `code` != 0, its error (a TensorFlow error code and message).
extern "C" __attribute__((visibility("default"))) void hvs_async_finish(
    void* handle, int n, const void* const* data, const int* dtypes, const int* ndims,
    const int64_t* dims, int code, const char* message) {
  auto* call = static_cast<Call*>(handle);
  tensorflow::OpKernelContext* ctx = call->ctx;
  if (code != 0) {
    ctx->SetStatus(absl::Status(static_cast<absl::StatusCode>(code), message));
  } else if (n != ctx->num_outputs()) {
    ctx->SetStatus(absl::InternalError("HvsAsyncKernel: the kernel returned " +
                                       std::to_string(n) + " outputs, the op has " +
                                       std::to_string(ctx->num_outputs())));
  } else {
    for (int i = 0, d = 0; i < n && ctx->status().ok(); d += ndims[i], ++i) {
      if (dtypes[i] != static_cast<int>(ctx->expected_output_dtype(i))) {
        ctx->SetStatus(absl::InternalError("HvsAsyncKernel: output " + std::to_string(i) +
                                           " has the wrong dtype"));
        break;
      }
      tensorflow::TensorShape shape;
      for (int k = 0; k < ndims[i]; ++k) shape.AddDim(dims[d + k]);
      tensorflow::Tensor* out = nullptr;
      auto status = ctx->allocate_output(i, shape, &out);
      if (!status.ok()) {
        ctx->SetStatus(status);
        break;
      }
      if (out->TotalBytes() > 0) {
        std::memcpy(const_cast<char*>(out->tensor_data().data()), data[i], out->TotalBytes());
      }
    }
  }
  auto done = std::move(call->done);
  delete call;
  done();
}

REGISTER_OP("HvsAsyncKernel")
    .Input("inputs: Tin")
    .Output("outputs: Tout")
    .Attr("Tin: list(type) >= 0")
    .Attr("Tout: list(type) >= 0")
    .Attr("kernel: int")
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::UnknownShape);

class HvsAsyncKernelOp : public tensorflow::AsyncOpKernel {
 public:
  explicit HvsAsyncKernelOp(tensorflow::OpKernelConstruction* ctx) : AsyncOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("kernel", &kernel_));
  }

  void ComputeAsync(tensorflow::OpKernelContext* ctx, DoneCallback done) override {
    StartFn start = g_start.load();
    OP_REQUIRES_ASYNC(ctx, start != nullptr,
                      absl::FailedPreconditionError("horovod_spark.tensorflow is not initialized"),
                      done);
    const int n = ctx->num_inputs();
    std::vector<const void*> data(n);
    std::vector<int> dtypes(n), ndims(n);
    std::vector<int64_t> dims;
    for (int i = 0; i < n; ++i) {
      const tensorflow::Tensor& t = ctx->input(i);
      data[i] = t.tensor_data().data();
      dtypes[i] = static_cast<int>(t.dtype());
      ndims[i] = t.dims();
      for (int k = 0; k < t.dims(); ++k) dims.push_back(t.dim_size(k));
    }
    auto* call = new Call{ctx, std::move(done)};
    // Python copies the inputs before it returns; the call ends in hvs_async_finish,
    // which start also calls when it cannot hand the call over.
    start(kernel_, call, n, data.data(), dtypes.data(), ndims.data(), dims.data());
  }

 private:
  int64_t kernel_ = -1;
};

REGISTER_KERNEL_BUILDER(Name("HvsAsyncKernel").Device(tensorflow::DEVICE_CPU), HvsAsyncKernelOp);
