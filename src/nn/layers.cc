// Layers and losses: operands checked here, the math on a GPU backend or in
// the CPU kernels of the instruction set in use (nn_kernels.h: Eigen over
// row-major tensor memory, no copies, single-threaded: one replica = one
// worker thread).
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/cpu_isa.h"
#include "core/device_scope.h"
#include "diststrat/nn.h"
#include "nn/layers_internal.h"
#include "nn/nn_kernels.h"

namespace diststrat {
namespace nn {

const NnKernels& nn_kernels() { return DISTSTRAT_ISA_PICK(kNnKernels); }

void pin_gemm_blocking() {
  // Once per process: Eigen keeps the sizes in a global that its GEMMs read,
  // and strategies made on several threads at once (workers as threads) each
  // pinned them (a data race under TSan, on the same values).
  static std::once_flag once;
  std::call_once(once, [] {
    // A common x86 core's L1d and L2 and a modest L3: the values only need
    // to be the same on every machine of a job (docs/determinism.md).
    constexpr std::ptrdiff_t kL1 = 32 << 10, kL2 = 1 << 20, kL3 = 8 << 20;
    isa_baseline::kNnKernels.set_cache_sizes(kL1, kL2, kL3);
#if DISTSTRAT_ISA_VARIANTS
    // A variant this CPU cannot run is never picked (and its code must not run).
    const CpuIsa supported = cpu_isa_supported();
    if (supported >= CpuIsa::kAvx2) isa_avx2::kNnKernels.set_cache_sizes(kL1, kL2, kL3);
    if (supported >= CpuIsa::kAvx512) isa_avx512::kNnKernels.set_cache_sizes(kL1, kL2, kL3);
#endif
  });
}

namespace {
// Every operand of an op lives in the memory of `device` (the first
// operand's): the same GPU, or host memory for any CPU device.
bool same_memory(const Device& a, const Device& b) { return a == b || (a.is_cpu() && b.is_cpu()); }
void check_matrix(const Tensor& t, const char* what, const char* op, const Device& device) {
  DISTSTRAT_CHECK(t.defined() && t.dtype() == DType::kFloat32 && t.shape().rank() == 2 &&
                      same_memory(t.device(), device),
                  kInvalidArgument, op, ": ", what, " must be a float32 matrix on ",
                  device.to_string(), ", got ", t.debug_string());
}
void check_on(const Tensor& t, const char* what, const char* op, const Device& device) {
  DISTSTRAT_CHECK(t.defined() && same_memory(t.device(), device), kInvalidArgument, op, ": ", what,
                  " must be on ", device.to_string(), ", got ", t.debug_string());
}
// Runs the op's GPU kernel(s) in the replica's scope; logs placement either way.
bool on_gpu(const Device& device, const char* op) {
  record_op_placement(op, device);
  return device.is_gpu();
}

// Per-row loss and correctness of logits against labels on a GPU, enqueued:
// the kernel writes loss (float bits), correct and the bad-row flag into one
// device buffer [loss n | correct n | flag | scratch], so one device -> host
// copy (one wait) brings all three back when they are read. Inside a GPU
// replica's step the flag is also left to its DeviceChecks, so a bad label
// surfaces at the next synchronization even when nobody reads the loss.
// dlogits may be a scratch tensor.
struct GpuXent {
  Tensor packed;  // int32 [2n + 2] on the device
  int64_t n = 0, k = 0;
  GpuExec exec;
  std::shared_ptr<DeviceChecks> checks;  // null outside a GPU replica's step
  int64_t step = -1;
  std::string op;

  Tensor losses() const { return packed.slice_rows(0, n); }
  Tensor flag() const { return packed.slice_rows(2 * n, 2 * n + 1); }
  std::string message(int32_t bad) const {
    return op + (step >= 0 ? " in step " + std::to_string(step) : std::string()) +
           ": the label of row " + std::to_string(bad - 1) + " is outside [0, " +
           std::to_string(k) + ")";
  }
  // Host copies of the per-row values; throws for a label out of range
  // (the earliest failed check of the replica first).
  struct Host {
    std::vector<float> loss;
    std::vector<int32_t> correct;
  };
  Host read() const {
    std::vector<int32_t> host(static_cast<size_t>(2 * n + 1));
    exec.backend->copy_to_host(
        exec.ordinal, host.data(), packed.data(), host.size() * 4, live_stream(exec),
        exec.deadline(),
        op + "'s loss" + (step >= 0 ? " of step " + std::to_string(step) : std::string()) + " on " +
            packed.device().to_string());
    const int32_t bad_row = host[static_cast<size_t>(2 * n)];
    if (checks) {
      if (bad_row == 0) checks->drop(flag());  // read here: fine
      checks->run();  // earlier steps' checks (and this one's when it failed)
    }
    DISTSTRAT_CHECK(bad_row == 0, kInvalidArgument, message(bad_row));
    Host out;
    out.loss.resize(static_cast<size_t>(n));
    std::memcpy(out.loss.data(), host.data(), sizeof(float) * static_cast<size_t>(n));
    out.correct.assign(host.begin() + n, host.begin() + 2 * n);
    return out;
  }
};
GpuXent gpu_xent(const Tensor& logits, const Tensor& labels, Tensor& dlogits, float scale,
                 const char* op, bool deferred) {
  const Device& d = logits.device();
  GpuXent x;
  x.n = logits.shape()[0];
  x.k = logits.shape()[1];
  x.exec = gpu_exec(d, op);
  x.op = op;
  x.packed = Tensor::uninitialized(Shape{2 * x.n + 2}, DType::kInt32, d);  // written whole
  int32_t* base = x.packed.data<int32_t>();
  x.exec.backend->softmax_cross_entropy(x.exec.ordinal, x.exec.stream, logits.data<float>(),
                                        labels.data<int32_t>(), dlogits.data<float>(),
                                        reinterpret_cast<float*>(base), base + x.n, base + 2 * x.n,
                                        x.n, x.k, scale);
  const ExecScope* scope = current_exec_scope();
  if (deferred && scope && scope->checks) {
    x.checks = scope->checks;
    x.step = scope->step;
    DeviceChecks::Check c;
    c.flag = x.flag();
    c.scratch = x.packed.slice_rows(2 * x.n + 1, 2 * x.n + 2);
    c.exec = x.exec;
    c.step = x.step;
    GpuXent text;  // what the message needs, not the checks (no cycle)
    text.op = x.op;
    text.step = x.step;
    text.k = x.k;
    c.message = [text](int32_t v) { return text.message(v); };
    x.checks->add(std::move(c));
  }
  return x;
}

// A dense layer's operands, checked the same way for the plain and the
// ReLU-fused layer (`op` names the call in the messages).
void check_dense_forward(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& y,
                         const char* op) {
  const Device& dev = x.device();
  check_matrix(x, "x", op, dev);
  check_matrix(w, "w", op, dev);
  check_matrix(y, "y", op, dev);
  check_on(b, "b", op, dev);
  DISTSTRAT_CHECK_EQ(x.shape()[1], w.shape()[0], op, ": x cols vs w rows");
  DISTSTRAT_CHECK(y.shape() == Shape({x.shape()[0], w.shape()[1]}), kInvalidArgument, op, ": y is ",
                  y.shape().to_string(), ", expected [", x.shape()[0], ", ", w.shape()[1], "]");
  DISTSTRAT_CHECK_EQ(b.num_elements(), w.shape()[1], op, ": bias size vs w cols");
}
}  // namespace

void dense_forward(const Tensor& x, const Tensor& w, const Tensor& b, Tensor& y) {
  const Device& dev = x.device();
  check_dense_forward(x, w, b, y, "dense_forward");
  if (on_gpu(dev, "dense_forward")) {
    const GpuExec e = gpu_exec(dev, "dense_forward");
    e.backend->dense_forward(e.ordinal, e.stream, x.data<float>(), w.data<float>(), b.data<float>(),
                             y.data<float>(), x.shape()[0], w.shape()[0], w.shape()[1]);
    return;
  }
  if (x.shape()[0] == 0) return;
  nn_kernels().dense_forward(x.data<float>(), w.data<float>(), b.data<float>(), y.data<float>(),
                             x.shape()[0], w.shape()[0], w.shape()[1]);
}

void dense_backward(const Tensor& x, const Tensor& w, const Tensor& dy, Tensor* dx, Tensor& dw,
                    Tensor& db) {
  const Device& dev = x.device();
  check_matrix(x, "x", "dense_backward", dev);
  check_matrix(w, "w", "dense_backward", dev);
  check_matrix(dy, "dy", "dense_backward", dev);
  check_matrix(dw, "dw", "dense_backward", dev);
  check_on(db, "db", "dense_backward", dev);
  if (dx) check_matrix(*dx, "dx", "dense_backward", dev);
  DISTSTRAT_CHECK(dw.shape() == w.shape(), kInvalidArgument, "dense_backward: dw ",
                  dw.shape().to_string(), " vs w ", w.shape().to_string());
  DISTSTRAT_CHECK_EQ(db.num_elements(), w.shape()[1], "dense_backward: db size");
  if (on_gpu(dev, "dense_backward")) {
    const GpuExec e = gpu_exec(dev, "dense_backward");
    e.backend->dense_backward(e.ordinal, e.stream, x.data<float>(), w.data<float>(),
                              dy.data<float>(), dx ? dx->data<float>() : nullptr, dw.data<float>(),
                              db.data<float>(), x.shape()[0], w.shape()[0], w.shape()[1]);
    return;
  }
  if (x.shape()[0] == 0) {
    dw.zero();
    db.zero();
    return;
  }
  nn_kernels().dense_backward(x.data<float>(), w.data<float>(), dy.data<float>(),
                              dx ? dx->data<float>() : nullptr, dw.data<float>(), db.data<float>(),
                              x.shape()[0], w.shape()[0], w.shape()[1]);
}

void dense_relu_forward(const Tensor& x, const Tensor& w, const Tensor& b, Tensor& y) {
  if (!x.device().is_gpu()) {
    dense_forward(x, w, b, y);
    relu_forward(y, y);
    return;
  }
  const Device& dev = x.device();
  check_dense_forward(x, w, b, y, "dense_relu_forward");
  on_gpu(dev, "dense_forward");
  on_gpu(dev, "relu_forward");
  const GpuExec e = gpu_exec(dev, "dense_relu_forward");
  e.backend->dense_relu_forward(e.ordinal, e.stream, x.data<float>(), w.data<float>(),
                                b.data<float>(), y.data<float>(), x.shape()[0], w.shape()[0],
                                w.shape()[1]);
}

void dense_relu_backward(const Tensor& x, const Tensor& w, const Tensor& y, Tensor& dy, Tensor* dx,
                         Tensor& dw, Tensor& db) {
  if (!x.device().is_gpu()) {
    relu_backward(y, dy, dy);
    dense_backward(x, w, dy, dx, dw, db);
    return;
  }
  const Device& dev = x.device();
  check_matrix(x, "x", "dense_relu_backward", dev);
  check_matrix(w, "w", "dense_relu_backward", dev);
  check_matrix(dy, "dy", "dense_relu_backward", dev);
  check_matrix(dw, "dw", "dense_relu_backward", dev);
  check_on(y, "y", "dense_relu_backward", dev);
  check_on(db, "db", "dense_relu_backward", dev);
  if (dx) check_matrix(*dx, "dx", "dense_relu_backward", dev);
  DISTSTRAT_CHECK_EQ(y.num_elements(), dy.num_elements(), "dense_relu_backward: y vs dy sizes");
  DISTSTRAT_CHECK(dy.shape() == Shape({x.shape()[0], w.shape()[1]}), kInvalidArgument,
                  "dense_relu_backward: dy is ", dy.shape().to_string(), ", expected [",
                  x.shape()[0], ", ", w.shape()[1], "]");
  DISTSTRAT_CHECK(dw.shape() == w.shape(), kInvalidArgument, "dense_relu_backward: dw ",
                  dw.shape().to_string(), " vs w ", w.shape().to_string());
  DISTSTRAT_CHECK_EQ(db.num_elements(), w.shape()[1], "dense_relu_backward: db size");
  if (dx) {
    DISTSTRAT_CHECK(dx->shape() == x.shape(), kInvalidArgument, "dense_relu_backward: dx ",
                    dx->shape().to_string(), " vs x ", x.shape().to_string());
  }
  on_gpu(dev, "relu_backward");
  on_gpu(dev, "dense_backward");
  const GpuExec e = gpu_exec(dev, "dense_relu_backward");
  e.backend->dense_relu_backward(e.ordinal, e.stream, x.data<float>(), w.data<float>(),
                                 y.data<float>(), dy.data<float>(),
                                 dx ? dx->data<float>() : nullptr, dw.data<float>(),
                                 db.data<float>(), x.shape()[0], w.shape()[0], w.shape()[1]);
}

void relu_forward(const Tensor& x, Tensor& y) {
  DISTSTRAT_CHECK_EQ(x.num_elements(), y.num_elements(), "relu_forward sizes");
  check_on(y, "y", "relu_forward", x.device());
  if (on_gpu(x.device(), "relu_forward")) {
    const GpuExec e = gpu_exec(x.device(), "relu_forward");
    e.backend->relu_forward(e.ordinal, e.stream, x.data<float>(), y.data<float>(),
                            x.num_elements());
    return;
  }
  nn_kernels().relu_forward(x.data<float>(), y.data<float>(), x.num_elements());
}

void relu_backward(const Tensor& y, const Tensor& dy, Tensor& dx) {
  DISTSTRAT_CHECK_EQ(y.num_elements(), dy.num_elements(), "relu_backward sizes");
  DISTSTRAT_CHECK_EQ(y.num_elements(), dx.num_elements(), "relu_backward sizes");
  check_on(dy, "dy", "relu_backward", y.device());
  check_on(dx, "dx", "relu_backward", y.device());
  if (on_gpu(y.device(), "relu_backward")) {
    const GpuExec e = gpu_exec(y.device(), "relu_backward");
    e.backend->relu_backward(e.ordinal, e.stream, y.data<float>(), dy.data<float>(),
                             dx.data<float>(), y.num_elements());
    return;
  }
  nn_kernels().relu_backward(y.data<float>(), dy.data<float>(), dx.data<float>(), y.num_elements());
}

namespace {
// The operands of softmax_cross_entropy (both forms), on `dev`.
void check_xent_operands(const Tensor& logits, const Tensor& labels, const Tensor& dlogits,
                         const Device& dev) {
  check_matrix(logits, "logits", "softmax_cross_entropy", dev);
  check_matrix(dlogits, "dlogits", "softmax_cross_entropy", dev);
  check_on(labels, "labels", "softmax_cross_entropy", dev);
  DISTSTRAT_CHECK(labels.dtype() == DType::kInt32 && labels.num_elements() == logits.shape()[0],
                  kInvalidArgument, "softmax_cross_entropy: labels ", labels.debug_string(),
                  " must be int32 with one label per row of ", logits.debug_string());
  DISTSTRAT_CHECK(dlogits.shape() == logits.shape(), kInvalidArgument,
                  "softmax_cross_entropy: dlogits ", dlogits.shape().to_string());
}
}  // namespace

double softmax_cross_entropy(const Tensor& logits, const Tensor& labels, Tensor& dlogits,
                             float grad_scale) {
  const Device& dev = logits.device();
  check_xent_operands(logits, labels, dlogits, dev);
  if (on_gpu(dev, "softmax_cross_entropy")) {
    if (logits.shape()[0] == 0) return 0.0;
    const GpuXent::Host r =
        gpu_xent(logits, labels, dlogits, grad_scale, "softmax_cross_entropy", false).read();
    double loss = 0.0;
    for (float l : r.loss) loss += l;
    return loss;
  }
  const int64_t n = logits.shape()[0], k = logits.shape()[1];
  const int32_t* y = labels.data<int32_t>();
  for (int64_t i = 0; i < n; ++i) {
    DISTSTRAT_CHECK(y[i] >= 0 && y[i] < k, kInvalidArgument, "softmax_cross_entropy: label ", y[i],
                    " of row ", i, " is outside [0, ", k, ")");
  }
  return nn_kernels().softmax_cross_entropy(logits.data<float>(), y, dlogits.data<float>(), n, k,
                                            grad_scale);
}

XentStep softmax_cross_entropy_deferred(const Tensor& logits, const Tensor& labels, Tensor& dlogits,
                                        float grad_scale) {
  const Device& dev = logits.device();
  XentStep out;
  if (!dev.is_gpu() || logits.shape().rank() != 2 || logits.shape()[0] == 0) {
    out.loss_sum = softmax_cross_entropy(logits, labels, dlogits, grad_scale);
    out.correct = count_correct(logits, labels);
    return out;
  }
  // The public call validates the operands; then one kernel gives both.
  check_xent_operands(logits, labels, dlogits, dev);
  on_gpu(dev, "softmax_cross_entropy");
  auto x = std::make_shared<const GpuXent>(
      gpu_xent(logits, labels, dlogits, grad_scale, "softmax_cross_entropy", true));
  // Both values come from one read, made by whichever is read first.
  struct Sums {
    double loss = 0.0;
    int64_t correct = 0;
  };
  auto sums = std::make_shared<StepValue<Sums>>(StepValue<Sums>::deferred([x] {
    const GpuXent::Host r = x->read();
    Sums s;
    for (float l : r.loss) s.loss += l;
    for (int32_t v : r.correct) s.correct += v;
    return s;
  }));
  out.loss_sum = StepValue<double>::deferred([sums] { return sums->get().loss; });
  out.correct = StepValue<int64_t>::deferred([sums] { return sums->get().correct; });
  out.row_losses = x->losses().reshape(Shape{x->n});
  out.row_hits = x->packed.slice_rows(x->n, 2 * x->n);
  return out;
}

int64_t count_correct(const Tensor& logits, const Tensor& labels) {
  const Device& dev = logits.device();
  check_matrix(logits, "logits", "count_correct", dev);
  check_on(labels, "labels", "count_correct", dev);
  const int64_t n = logits.shape()[0], k = logits.shape()[1];
  DISTSTRAT_CHECK_EQ(labels.num_elements(), n, "count_correct: labels vs rows");
  if (on_gpu(dev, "count_correct")) {
    if (n == 0) return 0;
    Tensor scratch(logits.shape(), DType::kFloat32, dev);
    const GpuXent::Host r = gpu_xent(logits, labels, scratch, 1.0f, "count_correct", false).read();
    int64_t c = 0;
    for (int32_t v : r.correct) c += v;
    return c;
  }
  return nn_kernels().count_correct(logits.data<float>(), labels.data<int32_t>(), n, k);
}

}  // namespace nn
}  // namespace diststrat
