// PerseusAwait: an asynchronous TensorFlow op that completes when the perseus engine has finished a request.
//
// The enqueue op (a py_function) submits a collective and outputs its request key. PerseusAwait takes that
// key and returns without holding a TensorFlow thread; the engine calls perseus_tf_complete(key) when the
// request is done (from Python, through ctypes), and the op's completion is then scheduled on TensorFlow's
// own worker threads. The finish op (a py_function) that follows never blocks. Either side may come first:
// a completion that arrives before the op ran is remembered.

#include <cstdint>
#include <functional>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace {

// Never destroyed: a waiting entry holds a TensorFlow completion callback, and destroying it during static
// destruction at process exit (after TensorFlow's own state may be gone) would touch freed memory.
std::mutex& g_mu = *new std::mutex;
std::unordered_map<int64_t, std::function<void()>>& g_waiting =
    *new std::unordered_map<int64_t, std::function<void()>>;
std::unordered_set<int64_t>& g_completed = *new std::unordered_set<int64_t>;

class PerseusAwaitOp : public tensorflow::AsyncOpKernel {
 public:
  explicit PerseusAwaitOp(tensorflow::OpKernelConstruction* ctx) : AsyncOpKernel(ctx) {}

  void ComputeAsync(tensorflow::OpKernelContext* ctx, DoneCallback done) override {
    const tensorflow::Tensor& key_tensor = ctx->input(0);
    const int64_t key = key_tensor.scalar<int64_t>()();
    ctx->set_output(0, key_tensor);
    auto* workers = ctx->device()->tensorflow_cpu_worker_threads()->workers;
    {
      std::lock_guard<std::mutex> lock(g_mu);
      if (g_completed.erase(key) == 0) {
        g_waiting.emplace(key, [workers, done]() { workers->Schedule(done); });
        return;
      }
    }
    done();
  }
};

}  // namespace

REGISTER_OP("PerseusAwait")
    .Input("key: int64")
    .Output("out: int64")
    .SetIsStateful()
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->Scalar());
      return absl::OkStatus();
    });

REGISTER_KERNEL_BUILDER(Name("PerseusAwait").Device(tensorflow::DEVICE_CPU), PerseusAwaitOp);

extern "C" void perseus_tf_complete(int64_t key) {
  std::function<void()> resume;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_waiting.find(key);
    if (it == g_waiting.end()) {
      g_completed.insert(key);
      return;
    }
    resume = std::move(it->second);
    g_waiting.erase(it);
  }
  resume();
}
