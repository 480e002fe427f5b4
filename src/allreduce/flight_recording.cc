// RecordingCommunicator (flight_recording.h).
//
// Straggler detection: each rank keeps its compute time before each call
// (the gap from the end of its previous call) for a window of W calls; at
// the end of every window the ranks all_gather their W gaps (one call named
// "straggler window", W floats per rank), so every rank holds the same
// matrix and computes the same verdict: per rank its trimmed mean (the 10 %
// longest gaps left out, so a descheduled moment does not count) and
// median, and per call which rank came to it last (longest gap). A rank
// whose trimmed mean is >= 1.2x the median rank's and >= 0.25 ms above it is
// flagged in that window's report; flagged in two windows running, it is a
// straggler and rank 0 warns. The exchange runs only at window boundaries, which every
// rank reaches at the same call (the calls are compared), so it never
// mispairs.

#include "allreduce/flight_recording.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <numeric>
#include <sstream>

#include "core/env.h"
#include "core/timeline.h"

namespace diststrat {
namespace {

int window_size() {
  static const int w = [] {
    try {
      return static_cast<int>(env::integer("DISTSTRAT_STRAGGLER_WINDOW", 0, 100000).value_or(50));
    } catch (const Error& e) {
      std::fprintf(stderr, "diststrat: %s; keeping the default 50\n", e.message().c_str());
      return 50;
    }
  }();
  return w;
}

const Logger& default_logger() {
  static const Logger* l = new Logger(LogLevel::kWarning);
  return *l;
}

constexpr size_t kHostBytes = 64;
// Below this much more compute per call a rank is not called a straggler:
// in train_bench's 0.1 ms calls on a loaded 2-core machine, 30 us apart
// (+44 %) was noise, not a slow rank worth a warning.
constexpr double kMinExcessMs = 0.25;

}  // namespace

RecordingCommunicator::RecordingCommunicator(std::unique_ptr<Communicator> inner, std::string group,
                                             Options options)
    : RecordingCommunicator(*inner, std::move(group), options) {
  owned_ = std::move(inner);
}

RecordingCommunicator::RecordingCommunicator(Communicator& inner, std::string group,
                                             Options options)
    : inner_(&inner),
      recorder_(group, inner.rank(), inner.size()),
      group_(std::move(group)),
      options_(options),
      window_(inner.size() > 1 && options.stragglers ? window_size() : 0) {
  gaps_.reserve(static_cast<size_t>(window_));
}

template <typename Fn>
void RecordingCommunicator::record(const char* kind, const std::string& name, size_t count,
                                   DType dtype, const ReduceOp* op, int root, Fn&& fn) {
  const int64_t start = flight::now_us();
  const int64_t gap = last_end_us_ >= 0 ? start - last_end_us_ : -1;
  const uint64_t seq =
      recorder_.begin(kind, name, count, dtype_name(dtype), op ? reduce_op_name(*op) : "", root,
                      static_cast<uint64_t>(count) * dtype_size(dtype));
  try {
    fn();
  } catch (const Error& e) {
    recorder_.end(
        seq, e.code() == ErrorCode::kAborted ? flight::State::kAborted : flight::State::kFailed,
        e.message());
    last_end_us_ = -1;
    const std::string path =
        flight::dump(flight::Trigger::kFailure, "rank " + std::to_string(rank()) + " of group '" +
                                                    group_ + "': " + e.message());
    if (path.empty()) throw;
    throw_error(e.code(), e.message() + flight::dump_note(path));
  }
  recorder_.end(seq, flight::State::kCompleted);
  last_end_us_ = flight::now_us();
  if (window_ > 0 && !in_exchange_) after_call(gap);
}

void RecordingCommunicator::all_reduce(const void* in, void* out, size_t count, DType dtype,
                                       ReduceOp op, const std::string& name) {
  record("all_reduce", name, count, dtype, &op, -1,
         [&] { inner_->all_reduce(in, out, count, dtype, op, name); });
}

void RecordingCommunicator::broadcast(void* buf, size_t count, DType dtype, int root,
                                      const std::string& name) {
  record("broadcast", name, count, dtype, nullptr, root,
         [&] { inner_->broadcast(buf, count, dtype, root, name); });
}

void RecordingCommunicator::all_gather(const void* in, void* out, size_t count, DType dtype,
                                       const std::string& name) {
  record("all_gather", name, count, dtype, nullptr, -1,
         [&] { inner_->all_gather(in, out, count, dtype, name); });
}

void RecordingCommunicator::reduce_scatter(const void* in, void* out, size_t count, DType dtype,
                                           ReduceOp op, const std::string& name) {
  record("reduce_scatter", name, count, dtype, &op, -1,
         [&] { inner_->reduce_scatter(in, out, count, dtype, op, name); });
}

void RecordingCommunicator::barrier(const std::string& name) {
  record("barrier", name, 0, DType::kFloat32, nullptr, -1, [&] { inner_->barrier(name); });
}

void RecordingCommunicator::reset() {
  inner_->reset();
  // Every member resets alike: a new numbering, an empty window.
  if (options_.members_reset_together) recorder_.restart();
  gaps_.clear();
  last_end_us_ = -1;
}

void RecordingCommunicator::after_call(int64_t gap_us) {
  if (gap_us < 0) return;  // the first call after set-up or a failure
  if (gaps_.empty()) window_start_us_ = flight::now_us() - gap_us;
  gaps_.push_back(static_cast<float>(gap_us) / 1000.f);
  if (static_cast<int>(gaps_.size()) == window_) exchange_window();
}

void RecordingCommunicator::exchange_window() {
  const int n = size(), w = window_;
  std::vector<float> all(static_cast<size_t>(n) * w);
  in_exchange_ = true;
  struct Clear {
    bool& flag;
    ~Clear() { flag = false; }
  } clear{in_exchange_};
  if (hosts_.empty()) {
    char mine[kHostBytes] = {};
    ::gethostname(mine, kHostBytes - 1);
    std::vector<char> names(static_cast<size_t>(n) * kHostBytes);
    all_gather(mine, names.data(), kHostBytes / 8, DType::kInt64, "straggler hosts");
    for (int r = 0; r < n; ++r) {
      const char* h = names.data() + static_cast<size_t>(r) * kHostBytes;
      hosts_.emplace_back(h, strnlen(h, kHostBytes));
    }
  }
  all_gather(gaps_.data(), all.data(), static_cast<size_t>(w), DType::kFloat32, "straggler window");
  gaps_.clear();
  // The last exchange took its own time: not anyone's compute.
  last_end_us_ = flight::now_us();

  StragglerReport rep;
  rep.calls_per_window = w;
  rep.ranks.resize(n);
  std::vector<double> means(n);
  const int keep = std::max(1, w - w / 10);
  for (int r = 0; r < n; ++r) {
    std::vector<float> g(all.begin() + static_cast<size_t>(r) * w,
                         all.begin() + static_cast<size_t>(r + 1) * w);
    std::sort(g.begin(), g.end());
    StragglerReport::Rank& x = rep.ranks[r];
    x.rank = r;
    x.host = r < static_cast<int>(hosts_.size()) ? hosts_[r] : std::string();
    x.median_compute_ms = g[g.size() / 2];
    x.mean_compute_ms = std::accumulate(g.begin(), g.begin() + keep, 0.0) / keep;
    means[r] = x.mean_compute_ms;
  }
  for (int c = 0; c < w; ++c) {
    int last = 0;
    for (int r = 1; r < n; ++r) {
      if (all[static_cast<size_t>(r) * w + c] > all[static_cast<size_t>(last) * w + c]) last = r;
    }
    rep.ranks[last].arrived_last_share += 1.0 / w;
  }
  std::vector<double> sorted = means;
  // The median rank (for an even count, the lower middle one: with two
  // ranks the faster one is the reference).
  std::nth_element(sorted.begin(), sorted.begin() + (n - 1) / 2, sorted.end());
  const double median = sorted[(n - 1) / 2];
  std::ostringstream warning;
  int flagged = 0, persistent = 0;
  streaks_.resize(static_cast<size_t>(n), 0);
  for (StragglerReport::Rank& x : rep.ranks) {
    x.straggler = x.mean_compute_ms >= 1.2 * median && x.mean_compute_ms - median >= kMinExcessMs;
    int& streak = streaks_[static_cast<size_t>(x.rank)];
    streak = x.straggler ? streak + 1 : 0;
    if (x.straggler) ++flagged;
    // Warned about once it is slow in two windows running: one window can
    // be a rank starved by another job for a moment.
    if (streak < 2) continue;
    char buf[256];
    std::snprintf(buf, sizeof buf,
                  "%srank %d (host %s) computes %.2f ms per call against the median rank's "
                  "%.2f ms (+%.0f %%) and came last to %.0f %% of the calls",
                  persistent++ ? "; " : "", x.rank, x.host.c_str(), x.mean_compute_ms, median,
                  100.0 * (x.mean_compute_ms / std::max(median, 1e-9) - 1.0),
                  100.0 * x.arrived_last_share);
    warning << buf;
  }
  {
    std::lock_guard<std::mutex> lock(report_mu_);
    rep.windows = report_.windows + 1;
    rep.warning = report_.warning;
    if (persistent) {
      rep.warning = "straggler in group '" + group_ + "' over the last " + std::to_string(2 * w) +
                    " calls: " + warning.str();
    }
    report_ = rep;
  }
  // Rank 0 says it when a straggler appears, then every 100 windows while
  // one stays.
  if (persistent && rank() == 0 && (!warned_last_ || rep.windows % 100 == 0)) {
    (logger_ ? *logger_ : default_logger()).warning(rep.warning);
  }
  warned_last_ = persistent > 0;
  if (timeline_ && timeline_->enabled()) {
    std::ostringstream args;
    for (const StragglerReport::Rank& x : rep.ranks) {
      args << (x.rank ? ", " : "") << "\"rank " << x.rank << " ms\": " << x.mean_compute_ms;
    }
    const auto now = Timeline::Clock::now();
    const auto begin = now - std::chrono::microseconds(flight::now_us() - window_start_us_);
    timeline_->complete(flagged ? "straggler" : "compute per call", "straggler", timeline_lane_,
                        begin, now, args.str());
  }
}

StragglerReport RecordingCommunicator::straggler_report() const {
  std::lock_guard<std::mutex> lock(report_mu_);
  return report_;
}

std::unique_ptr<Communicator> wrap_recorded(std::unique_ptr<Communicator> inner,
                                            const std::string& group,
                                            RecordingCommunicator::Options options) {
  return std::make_unique<RecordingCommunicator>(std::move(inner), group, options);
}

}  // namespace diststrat
