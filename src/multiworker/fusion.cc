// The fusion engine's queue and communication thread: local replicas
// enqueue their parts of each call, the thread runs the calls in order once
// every local replica has come (or fails them past the deadline), and a
// failure makes the engine unusable (fusion.h). The calls themselves run in
// fusion_pack.cc (all_reduce) and fusion_sharded.cc (ZeRO-1), after the
// signature check of fusion_signature.cc.
#include "multiworker/fusion.h"

#include <algorithm>
#include <sstream>

#include "multiworker/fusion_names.h"
#include "runtime/work_state.h"

namespace diststrat {

namespace {
using Clock = Timeline::Clock;

// The communicator a task made inside a training step runs on: its calls'
// names end in " (step N)", so that the communicator's call comparison,
// which compares names, tells a task of one step from the same task of
// another (a fused call's signature carries its step itself). Nothing else
// changes.
class StepNamed : public Communicator {
 public:
  StepNamed(Communicator& inner, int64_t step)
      : inner_(inner), suffix_(" (step " + std::to_string(step) + ")") {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  const CommunicationOptions& options() const override { return inner_.options(); }
  void all_reduce(const void* in, void* out, size_t count, DType dtype, ReduceOp op,
                  const std::string& name) override {
    inner_.all_reduce(in, out, count, dtype, op, name + suffix_);
  }
  void broadcast(void* buf, size_t count, DType dtype, int root, const std::string& name) override {
    inner_.broadcast(buf, count, dtype, root, name + suffix_);
  }
  void all_gather(const void* in, void* out, size_t count, DType dtype,
                  const std::string& name) override {
    inner_.all_gather(in, out, count, dtype, name + suffix_);
  }
  void reduce_scatter(const void* in, void* out, size_t count, DType dtype, ReduceOp op,
                      const std::string& name) override {
    inner_.reduce_scatter(in, out, count, dtype, op, name + suffix_);
  }
  void barrier(const std::string& name) override { inner_.barrier(name + suffix_); }
  void abort(const std::string& reason) override { inner_.abort(reason); }
  void reset() override { inner_.reset(); }
  std::shared_ptr<void> allocate_buffer(size_t bytes) override {
    return inner_.allocate_buffer(bytes);
  }

 private:
  Communicator& inner_;
  const std::string suffix_;
};

}  // namespace

FusionEngine::FusionEngine(Communicator& cross, int num_local_replicas, int replicas_in_sync,
                           CommunicationOptions options, Timeline* timeline)
    : cross_(cross),
      num_local_(num_local_replicas),
      replicas_in_sync_(replicas_in_sync),
      options_(std::move(options)),
      timeline_(timeline),
      rank_(cross.rank()),
      next_seq_(num_local_replicas, 0) {
  DISTSTRAT_CHECK_GE(num_local_, 1, "FusionEngine local replicas");
  if (timeline_) timeline_->name_thread(0, "communication");
  thread_ = std::thread([this] { loop(); });
}

FusionEngine::~FusionEngine() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

FusionStats FusionEngine::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

Work FusionEngine::all_reduce_async(int local, ReduceOp op, std::vector<Tensor> tensors,
                                    std::vector<std::string> names) {
  return device_all_reduce_async(local, op, std::move(tensors), std::move(names), nullptr);
}

Work FusionEngine::device_all_reduce_async(int local, ReduceOp op, std::vector<Tensor> tensors,
                                           std::vector<std::string> names, DeviceReduce reduce) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    DISTSTRAT_CHECK(tensors[i].defined(), kInvalidArgument, "rank ", rank_,
                    ": all_reduce of an undefined tensor ", name_at(names, i));
  }
  Part p;
  p.op = op;
  p.tensors = std::move(tensors);
  p.names = std::move(names);
  p.device_reduce = std::move(reduce);
  return enqueue(local, std::move(p), false, "all_reduce", false);
}

Work FusionEngine::submit(int local, std::function<void(Communicator&)> fn, std::string what) {
  Part p;
  p.task = std::move(fn);
  return enqueue(local, std::move(p), true, what, false);
}

void FusionEngine::run(std::function<void(Communicator&)> fn, std::string what) {
  Part p;
  p.task = std::move(fn);
  enqueue(0, std::move(p), true, what, true).wait();
}

Work FusionEngine::enqueue(int local, Part part, bool is_task, const std::string& what,
                           bool all_local) {
  DISTSTRAT_CHECK(0 <= local && local < num_local_, kInvalidArgument, "rank ", rank_,
                  ": local replica ", local, " of ", num_local_);
  std::unique_lock<std::mutex> lock(mu_);
  if (!broken_.empty()) {
    return Work::completed(std::make_exception_ptr(AbortedError(
        "rank " + std::to_string(rank_) + ": " + what +
        ": the multi-worker collectives are unusable after an earlier failure: " + broken_)));
  }
  int64_t seq;
  if (all_local) {
    seq = *std::max_element(next_seq_.begin(), next_seq_.end());
    std::fill(next_seq_.begin(), next_seq_.end(), seq + 1);
  } else {
    seq = next_seq_[local]++;
  }
  const size_t idx = static_cast<size_t>(seq - base_);
  while (calls_.size() <= idx) {
    auto c = std::make_unique<Call>();
    c->parts.resize(num_local_);
    c->work = std::make_shared<Work::State>();
    calls_.push_back(std::move(c));
  }
  Call& c = *calls_[idx];
  part.present = true;
  if (c.arrived == 0) {
    c.is_task = is_task;
    c.what = what;
    c.first_arrival = Clock::now();
    c.step = step_.load();
  } else if (c.local_mismatch.empty()) {
    const std::string why = describe_local_mismatch(c, local, part, is_task, what);
    if (!why.empty()) {
      c.local_mismatch = "rank " + std::to_string(rank_) + ": local replicas disagree on call " +
                         std::to_string(seq) + ": " + why;
    }
  }
  if (all_local) {
    for (int l = 0; l < num_local_; ++l) c.parts[l] = part;
    c.arrived = num_local_;
  } else {
    if (!c.parts[local].present) ++c.arrived;
    c.parts[local] = std::move(part);
  }
  Work w(c.work);
  lock.unlock();
  cv_.notify_all();
  return w;
}

void FusionEngine::abort(const std::string& reason) {
  std::deque<std::unique_ptr<Call>> failed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (broken_.empty()) broken_ = reason;
    failed.swap(calls_);
    base_ += static_cast<int64_t>(failed.size());
    std::fill(next_seq_.begin(), next_seq_.end(), base_);
  }
  for (auto& c : failed) {
    c->work->finish(std::make_exception_ptr(
        AbortedError("rank " + std::to_string(rank_) + ": " + c->what + " aborted: " + reason)));
  }
}

bool FusionEngine::abort_if_pending(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (calls_.empty()) return false;
  }
  abort(reason);
  return true;
}

void FusionEngine::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    if (calls_.empty() || calls_.front()->arrived == 0) {
      cv_.wait(lock);
      continue;
    }
    Call& front = *calls_.front();
    if (front.arrived < num_local_) {
      const auto deadline = front.first_arrival + options_.timeout;
      if (Clock::now() < deadline) {
        cv_.wait_until(lock, deadline);
        continue;
      }
      std::ostringstream msg;
      std::vector<int> missing;
      for (int l = 0; l < num_local_; ++l) {
        if (!front.parts[l].present) missing.push_back(l);
      }
      msg << "rank " << rank_ << ": " << front.what << " (call " << base_ << "): local "
          << (missing.size() == 1 ? "replica " : "replicas ");
      for (size_t i = 0; i < missing.size(); ++i) msg << (i ? ", " : "") << missing[i];
      msg << " did not enqueue it within " << options_.timeout.count() << " ms";
      lock.unlock();
      front.work->finish(std::make_exception_ptr(DeadlineExceededError(msg.str())));
      abort(msg.str());
      lock.lock();
      continue;
    }
    std::unique_ptr<Call> call = std::move(calls_.front());
    calls_.pop_front();
    ++base_;
    lock.unlock();
    execute(*call);
    lock.lock();
  }
  // Shutting down: nothing will run the rest.
  auto rest = std::move(calls_);
  lock.unlock();
  for (auto& c : rest) {
    c->work->finish(std::make_exception_ptr(AbortedError(
        "rank " + std::to_string(rank_) + ": " + c->what + ": the strategy was destroyed")));
  }
}

void FusionEngine::execute(Call& call) {
  const auto start = Clock::now();
  const int64_t index = executed_++;
  const bool trace = timeline_ && timeline_->enabled();
  if (trace) {
    timeline_->complete("queue", "fusion", 0, call.first_arrival, start,
                        "\"call\": " + std::to_string(index));
  }
  try {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!broken_.empty()) {
        throw AbortedError(
            "rank " + std::to_string(rank_) + ": " + call.what +
            ": the multi-worker collectives are unusable after an earlier failure: " + broken_);
      }
    }
    if (call.is_task) {
      if (!call.local_mismatch.empty()) throw InvalidArgumentError(call.local_mismatch);
      if (call.step >= 0) {
        StepNamed in_step(cross_, call.step);
        call.parts[0].task(in_step);
      } else {
        call.parts[0].task(cross_);
      }
      if (trace) timeline_->complete(call.what, "collective", 0, start, Clock::now());
    } else if (call.parts[0].kind == Kind::kAllReduce) {
      execute_all_reduce(call);
    } else {
      execute_sharded(call);
    }
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.calls;
  } catch (const InvalidArgumentError&) {
    // Raised alike on every rank before data moved (or a bad argument to a
    // task): the collectives stay in step.
    call.work->finish(std::current_exception());
    return;
  } catch (const std::exception& e) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (broken_.empty()) broken_ = e.what();
    }
    call.work->finish(std::current_exception());
    return;
  } catch (...) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (broken_.empty()) broken_ = "a non-standard exception";
    }
    call.work->finish(std::current_exception());
    return;
  }
  call.work->finish();
}

void FusionEngine::ensure(Buffer& buf, size_t bytes) {
  if (buf.bytes >= bytes) return;
  // Sizes follow from the call signature, which every rank has just checked,
  // so every rank grows here in the same order: the allocation is collective
  // (a shared-memory window inside a node, which the communicator reduces
  // without staging copies). The barrier bounds the wait for a rank that
  // would never come; grown in powers of two, so that few windows are made.
  size_t grown = 4096;
  while (grown < bytes) grown *= 2;
  if (cross_.size() > 1)
    cross_.barrier("allocate fusion buffer of " + std::to_string(grown) + " bytes");
  buf.memory = cross_.allocate_buffer(grown);
  buf.bytes = grown;
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.buffer_allocations;
}

}  // namespace diststrat
