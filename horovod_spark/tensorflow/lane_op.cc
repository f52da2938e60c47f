// HvsLaneAllreduce: a TensorFlow graph op that allreduces one tensor through
// the fusion engine without entering Python in steady state.
//
// Compiled on first use by horovod_spark.tensorflow._lane_op against the installed TensorFlow.
// The op calls the engine's lane (`hvs::Lane`) through a function
// pointer; whatever the lane returns other than done (the op's first run,
// a cycle the engine must finish, an error) goes to the Python callback,
// which runs it through the engine like any other op.  Python binds the
// three pointers with hvs_tf_bind; a graph holds only the slot number.
#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>

#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"

namespace {

using RunFn = int (*)(void* lane, int slot, const void* in, void* out, int64_t bytes);
using CallbackFn = int (*)(int code, void* lane, int64_t slot, const void* in, void* out,
                           int64_t bytes, char* err, int64_t errlen);

constexpr int kDone = 0, kFallback = 1;  // hvs::LaneCode

std::atomic<RunFn> g_run{nullptr};
std::atomic<void*> g_lane{nullptr};
std::atomic<CallbackFn> g_callback{nullptr};

}  // namespace

extern "C" __attribute__((visibility("default"))) void hvs_tf_bind(void* run, void* lane,
                                                                   void* callback) {
  g_run.store(reinterpret_cast<RunFn>(run));
  g_lane.store(lane);
  g_callback.store(reinterpret_cast<CallbackFn>(callback));
}

using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;

REGISTER_OP("HvsLaneAllreduce")
    .Input("tensor: T")
    .Output("reduced: T")
    .Attr("T: {half, float, double}")
    .Attr("slot: int")
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::UnchangedShape);

class HvsLaneAllreduceOp : public OpKernel {
 public:
  explicit HvsLaneAllreduceOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("slot", &slot_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& in = ctx->input(0);
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, in.shape(), &out));
    const void* src = in.tensor_data().data();
    void* dst = const_cast<char*>(out->tensor_data().data());
    const int64_t bytes = static_cast<int64_t>(in.TotalBytes());
    RunFn run = g_run.load();
    void* lane = g_lane.load();
    int code = kFallback;
    if (run != nullptr && lane != nullptr) code = run(lane, static_cast<int>(slot_), src, dst, bytes);
    if (code == kDone) return;
    CallbackFn callback = g_callback.load();
    OP_REQUIRES(ctx, callback != nullptr,
                absl::FailedPreconditionError("horovod_spark.tensorflow is not initialized"));
    char err[8192];
    err[0] = '\0';
    int rc = callback(code, lane, slot_, src, dst, bytes, err, sizeof(err));
    OP_REQUIRES(ctx, rc == 0, absl::UnknownError(err));
  }

 private:
  int64_t slot_ = -1;
};

REGISTER_KERNEL_BUILDER(Name("HvsLaneAllreduce").Device(tensorflow::DEVICE_CPU), HvsLaneAllreduceOp);
