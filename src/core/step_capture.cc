#include "core/step_capture.h"

#include "core/device_scope.h"

namespace diststrat {

namespace {
constexpr int64_t kMaxScalars = 64;
}  // namespace

StepCapture::StepCapture(GpuBackend* backend, int ordinal, void* stream, Device device)
    : backend_(backend), ordinal_(ordinal), stream_(stream), device_(device) {}

StepCapture::~StepCapture() {
  abort();
  for (Segment& s : segments_) backend_->destroy_graph(ordinal_, s.graph);
}

void StepCapture::begin() {
  DISTSTRAT_CHECK(!active_, kInternal, "StepCapture::begin while capturing");
  backend_->begin_capture(ordinal_, stream_);
  active_ = true;
}

void StepCapture::keep(std::shared_ptr<void> memory) { kept_.push_back(std::move(memory)); }

const float* StepCapture::device_scalar(std::function<float()> value) {
  DISTSTRAT_CHECK(static_cast<int64_t>(scalar_values_.size()) < kMaxScalars, kUnimplemented,
                  "a captured step holds at most ", kMaxScalars, " per-step scalars");
  if (!scalars_.defined()) {
    scalars_ = Tensor::uninitialized(Shape{kMaxScalars}, DType::kFloat32, device_);
  }
  scalar_values_.push_back(std::move(value));
  return scalars_.data<float>() + (scalar_values_.size() - 1);
}

void StepCapture::end_segment() {
  active_ = false;
  Segment s;
  s.graph = backend_->end_capture(ordinal_, stream_);
  segments_.push_back(std::move(s));
}

void StepCapture::write_scalars() {
  if (scalar_values_.empty()) return;
  Tensor host(Shape{static_cast<int64_t>(scalar_values_.size())}, DType::kFloat32);
  for (size_t i = 0; i < scalar_values_.size(); ++i) host.data<float>()[i] = scalar_values_[i]();
  // Staged through pinned memory on the replica's stream, ahead of the
  // launch that reads it.
  Tensor head = scalars_.slice_rows(0, static_cast<int64_t>(scalar_values_.size()));
  head.copy_from(host);
}

void StepCapture::launch(size_t segment) {
  backend_->launch_graph(ordinal_, segments_[segment].graph, stream_);
}

void StepCapture::boundary(const std::string& what, std::function<void()> host_work) {
  DISTSTRAT_CHECK(active_, kInternal, "StepCapture::boundary (", what, ") while not capturing");
  end_segment();
  write_scalars();
  launch(segments_.size() - 1);
  host_work();
  segments_.back().host_work = std::move(host_work);
  begin();
}

void StepCapture::on_replay(std::function<void()> action) {
  on_replay_.push_back(std::move(action));
}
void StepCapture::after_launch(std::function<void()> action) {
  after_launch_.push_back(std::move(action));
}

void StepCapture::finish() {
  end_segment();
  write_scalars();
  launch(segments_.size() - 1);
  for (auto& a : after_launch_) a();
}

void StepCapture::abort() noexcept {
  if (!active_) return;
  active_ = false;
  try {
    void* g = backend_->end_capture(ordinal_, stream_);
    backend_->destroy_graph(ordinal_, g);
  } catch (...) {
    // An invalidated capture has no graph; the stream is out of capture mode.
  }
}

void StepCapture::replay() {
  for (auto& a : on_replay_) a();
  write_scalars();
  for (size_t i = 0; i < segments_.size(); ++i) {
    launch(i);
    if (segments_[i].host_work) segments_[i].host_work();
  }
  for (auto& a : after_launch_) a();
}

int StepCapture::boundaries() const {
  int n = 0;
  for (const Segment& s : segments_) n += s.host_work ? 1 : 0;
  return n;
}

void refuse_in_capture(const std::string& what) {
  const ExecScope* s = current_exec_scope();
  if (!s || !s->capture || !s->capture->active()) return;
  throw FailedPreconditionError(
      what +
      " inside a captured step: a graph replays device work only (no host reads or waits, "
      "no copies from host memory; feed inputs through the step's batch)");
}

}  // namespace diststrat
