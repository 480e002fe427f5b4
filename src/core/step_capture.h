// One replica's captured step (issue 44 item 2): the work its step function
// enqueued, recorded once from its stream into graphs (GpuBackend's graph
// capture) and replayed without running the function again.
//
// How a step is captured and replayed:
//  1. The step runs once with the capture in its ExecScope (begin()). Every
//     launch on the replica's stream is recorded, not run. Device memory
//     allocated meanwhile comes from the caching allocator as usual but is
//     kept alive by the capture (keep()) until it is destroyed: that is the
//     capture's private pool. Nothing else can reuse it while a replay may
//     still write it, and no block is freed (no event recorded) during the
//     capture. Memory is not reused within the capture either: a captured
//     step holds its temporaries' total size.
//  2. Host work that cannot be in a graph splits it (boundary()): today the
//     device collectives, which wait on the host. The segment captured so
//     far is ended and launched, the host work runs, and a new segment is
//     captured. A replay launches the segments in order with the same host
//     work between them.
//  3. Scalars that change from step to step (the optimizer's rate from its
//     schedule and Adam's bias correction) live in device memory
//     (device_scalar()); their values are computed on the host and copied in
//     before each launch, so the graph never bakes one in.
//  4. Host state the step changed (the optimizer's step counter) is changed
//     again before each replay by the actions the step registered
//     (on_replay()); work that must follow each launch (a copy of the label
//     check's flag for the device checks) by after_launch().
// A call that capture cannot hold (a read of the device, a wait, a copy from
// host memory) is an error from the backend or from refuse_in_capture().
// Used on the replica's own thread only; not thread-safe.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/gpu_backend.h"
#include "diststrat/device.h"
#include "diststrat/tensor.h"

namespace diststrat {

class StepCapture {
 public:
  StepCapture(GpuBackend* backend, int ordinal, void* stream, Device device);
  ~StepCapture();  // destroys the graphs; the kept memory goes back to its allocator
  StepCapture(const StepCapture&) = delete;
  StepCapture& operator=(const StepCapture&) = delete;

  // ---- while the step function runs (capturing) ----
  // Starts the first segment.
  void begin();
  // Whether the stream is capturing now (between begin() and finish(), not
  // during a boundary's host work).
  bool active() const { return active_; }
  // Keeps device memory allocated during the capture alive with the graphs.
  void keep(std::shared_ptr<void> memory);
  // A float in device memory that holds value() at every launch.
  const float* device_scalar(std::function<float()> value);
  // Ends the segment, launches it, runs `host_work` (now and, between the
  // same segments, at every replay) and starts the next segment.
  void boundary(const std::string& what, std::function<void()> host_work);
  void on_replay(std::function<void()> action);
  void after_launch(std::function<void()> action);
  // Ends the last segment and launches it (the step the capture ran).
  void finish();
  // After an error inside the capture: ends it, keeps nothing. No throw.
  void abort() noexcept;

  // ---- later steps ----
  // Runs the on_replay actions, writes the scalars, launches the segments
  // with their host work between them, then runs the after_launch actions.
  void replay();

  int graphs() const { return static_cast<int>(segments_.size()); }
  int boundaries() const;

 private:
  struct Segment {
    void* graph = nullptr;
    std::function<void()> host_work;  // after the graph; empty for the last
  };
  void end_segment();  // ends the capture of the current segment (active_ = false)
  void write_scalars();
  void launch(size_t segment);

  GpuBackend* backend_;
  int ordinal_;
  void* stream_;
  Device device_;
  bool active_ = false;
  std::vector<Segment> segments_;
  std::vector<std::shared_ptr<void>> kept_;
  std::vector<std::function<float()>> scalar_values_;
  Tensor scalars_;  // float32 on the device
  std::vector<std::function<void()>> on_replay_, after_launch_;
};

// Throws FailedPreconditionError "<what> inside a captured step: ..." when
// the calling thread's scope is capturing a step (a call capture cannot
// hold, refused before it reaches the backend).
void refuse_in_capture(const std::string& what);

}  // namespace diststrat
