// A Communicator that records every call of another in the flight recorder
// (core/flight_recorder.h), writes the process's record when a call fails,
// and measures this rank's compute time between calls for straggler
// detection (diststrat/flight_recorder.h). Written once for every
// communicator: strategies, ProcessGroup, InProcessGroup and elastic groups
// wrap theirs (wrap_recorded).
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/flight_recorder.h"
#include "diststrat/collective.h"
#include "diststrat/flight_recorder.h"
#include "diststrat/logging.h"

namespace diststrat {

class Timeline;

class RecordingCommunicator : public Communicator {
 public:
  struct Options {
    // Straggler detection (its exchange every window of calls).
    bool stragglers = true;
    // Every member calls reset() (across processes): each restarts its
    // numbering. Off for groups where one member's reset resets all
    // (InProcessGroup): the numbering then goes on.
    bool members_reset_together = true;
  };
  // `group` names the group alike on every member ("world", "ps", ...).
  RecordingCommunicator(std::unique_ptr<Communicator> inner, std::string group, Options options);
  // Non-owning: `inner` must outlive this.
  RecordingCommunicator(Communicator& inner, std::string group, Options options);

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  const CommunicationOptions& options() const override { return inner_->options(); }

  void all_reduce(const void* in, void* out, size_t count, DType dtype, ReduceOp op,
                  const std::string& name = "") override;
  void broadcast(void* buf, size_t count, DType dtype, int root,
                 const std::string& name = "") override;
  void all_gather(const void* in, void* out, size_t count, DType dtype,
                  const std::string& name = "") override;
  void reduce_scatter(const void* in, void* out, size_t count, DType dtype, ReduceOp op,
                      const std::string& name = "") override;
  void barrier(const std::string& name = "") override;
  void abort(const std::string& reason) override { inner_->abort(reason); }
  void reset() override;
  std::shared_ptr<void> allocate_buffer(size_t bytes) override {
    return inner_->allocate_buffer(bytes);
  }

  Communicator& inner() { return *inner_; }
  StragglerReport straggler_report() const;
  // Where straggler warnings go (default: stderr at warning level).
  void set_logger(const Logger* logger) { logger_ = logger; }
  // Windows appear on the strategy's timeline (lane `lane`) when it records.
  void set_timeline(Timeline* timeline, int lane) {
    timeline_ = timeline;
    timeline_lane_ = lane;
  }

 private:
  template <typename Fn>
  void record(const char* kind, const std::string& name, size_t count, DType dtype,
              const ReduceOp* op, int root, Fn&& fn);
  void after_call(int64_t gap_us);
  void exchange_window();

  std::unique_ptr<Communicator> owned_;
  Communicator* inner_;
  flight::Recorder recorder_;
  const std::string group_;
  const Options options_;
  const Logger* logger_ = nullptr;
  Timeline* timeline_ = nullptr;
  int timeline_lane_ = 0;

  // Straggler detection (only the calling thread touches the window; the
  // report is guarded by report_mu_).
  int window_ = 0;  // calls per window; 0 = off
  int64_t last_end_us_ = -1;
  std::vector<float> gaps_;  // this rank's compute time before each call (ms)
  std::vector<std::string> hosts_;
  bool in_exchange_ = false;
  bool warned_last_ = false;
  std::vector<int> streaks_;  // per rank: windows in a row it was flagged in
  int64_t window_start_us_ = 0;
  mutable std::mutex report_mu_;
  StragglerReport report_;
};

// The recording wrapper around `inner`.
std::unique_ptr<Communicator> wrap_recorded(std::unique_ptr<Communicator> inner,
                                            const std::string& group,
                                            RecordingCommunicator::Options options = {});

}  // namespace diststrat
