#include "multiworker/fusion.h"

#include <algorithm>
#include <cstring>
#include <sstream>

#include "allreduce/reduce_kernels.h"
#include "core/fnv1a.h"
#include "core/user_text.h"
#include "runtime/work_state.h"

namespace diststrat {

namespace {

using Clock = Timeline::Clock;

const char* compression_name(Compression c) {
  switch (c) {
    case Compression::kNone:
      return "none";
    case Compression::kFloat16:
      return "float16";
    case Compression::kBFloat16:
      return "bfloat16";
  }
  return "?";
}

// The collective in a call's signature header; all_reduce has none, so its
// signatures are as before.
template <typename K>
std::string kind_prefix(K kind) {
  switch (static_cast<int>(kind)) {
    case 1:
      return "reduce_scatter, ";
    case 2:
      return "all_gather, ";
    default:
      return "";
  }
}

std::string tensor_line(const std::string& name, const Tensor& t) {
  return "'" + name + "' " + dtype_name(t.dtype()) + t.shape().to_string();
}

std::string name_at(const std::vector<std::string>& names, size_t i) {
  return i < names.size() && !names[i].empty() ? names[i] : "tensor#" + std::to_string(i);
}

// The first tensors of a call, for messages about it: "'a', 'b', 'c' and 7
// more" (names as the user gave them, each echoed at most ~200 characters).
std::string first_tensors(const std::vector<std::string>& names, size_t num) {
  constexpr size_t kShown = 3;
  std::string out;
  for (size_t i = 0; i < num && i < kShown; ++i)
    out += (i ? ", '" : "'") + echo(name_at(names, i)) + "'";
  if (num > kShown) out += " and " + std::to_string(num - kShown) + " more";
  return num ? out : "no tensors";
}

std::vector<std::string> split_lines(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream is(s);
  for (std::string line; std::getline(is, line);) out.push_back(line);
  return out;
}

// A signature line as messages show it: a tensor line "'name' dtype[shape]"
// with the name echoed (at most ~200 characters), other lines echoed whole.
std::string shown_line(const std::string& line) {
  const size_t end = line.rfind("' ");
  if (line.empty() || line[0] != '\'' || end == std::string::npos || end == 0) return echo(line);
  return "'" + echo(line.substr(1, end - 1)) + line.substr(end);
}

// Explains how the ranks' call signatures differ: the first differing line
// (header, then tensors in order), which ranks have what.
std::string describe_mismatch(const std::vector<std::string>& sigs, int64_t call_index) {
  const int n = static_cast<int>(sigs.size());
  std::ostringstream os;
  os << "fused all_reduce call #" << call_index << ": ranks enqueued different tensors: ";
  for (int r = 0; r < n; ++r) {
    if (!sigs[r].empty() && sigs[r][0] == '!') {
      os << "on rank " << r << " " << sigs[r].substr(1);
      return os.str();
    }
  }
  std::vector<std::vector<std::string>> lines(n);
  size_t longest = 0;
  for (int r = 0; r < n; ++r) {
    lines[r] = split_lines(sigs[r]);
    longest = std::max(longest, lines[r].size());
  }
  for (size_t i = 0; i < longest; ++i) {
    // Group ranks by what they have at line i ("" = nothing).
    std::vector<std::pair<std::string, std::vector<int>>> groups;
    for (int r = 0; r < n; ++r) {
      const std::string v = i < lines[r].size() ? lines[r][i] : "";
      auto it = std::find_if(groups.begin(), groups.end(), [&](auto& g) { return g.first == v; });
      if (it == groups.end()) {
        groups.push_back({v, {r}});
      } else {
        it->second.push_back(r);
      }
    }
    if (groups.size() == 1) continue;
    if (i == 0) {
      os << "the calls differ in options:";
    } else {
      os << "first difference at tensor #" << (i - 1) << ":";
    }
    for (size_t g = 0; g < groups.size(); ++g) {
      os << (g ? ";" : "") << " " << ranks_phrase(groups[g].second);
      if (groups[g].first.empty()) {
        os << " enqueued no tensor #" << (i - 1) << " (only "
           << lines[groups[g].second[0]].size() - 1 << " tensors)";
      } else {
        os << (groups[g].second.size() == 1 ? " has " : " have ") << shown_line(groups[g].first);
      }
    }
    if (i == 0) {
      // A reduce_scatter / all_gather against an all-reduce: ZeRO-1 on some
      // workers only.
      bool sharded = false, plain = false;
      for (const auto& g : groups) {
        const bool s =
            g.first.rfind("reduce_scatter, ", 0) == 0 || g.first.rfind("all_gather, ", 0) == 0;
        sharded = sharded || s;
        plain = plain || !s;
      }
      if (sharded && plain) {
        os << " (a sharded-optimizer collective against a plain all-reduce: "
              "MultiWorkerOptions::shard_optimizer_state must be the same on every worker)";
      }
    }
    return os.str();
  }
  os << "signatures differ but no differing entry was found";
  return os.str();
}

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
  for (size_t i = 0; i < tensors.size(); ++i) {
    DISTSTRAT_CHECK(tensors[i].defined(), kInvalidArgument, "rank ", rank_,
                    ": all_reduce of an undefined tensor ", name_at(names, i));
  }
  Part p;
  p.op = op;
  p.tensors = std::move(tensors);
  p.names = std::move(names);
  return enqueue(local, std::move(p), false, "all_reduce", false);
}

Work FusionEngine::reduce_scatter_async(int local, ReduceOp op, Tensor in, Tensor out,
                                        std::string name) {
  const int64_t r = static_cast<int64_t>(cross_.size()) * num_local_;
  try {
    DISTSTRAT_CHECK(in.defined() && out.defined() && in.dtype() == out.dtype() &&
                        in.device().is_cpu() && out.device().is_cpu() &&
                        in.num_elements() == r * out.num_elements(),
                    kInvalidArgument, "rank ", rank_, ": reduce_scatter '", echo(name), "' of ",
                    in.debug_string(), " into ", out.debug_string(), ": needs host tensors, ", r,
                    " x the output's elements in the input");
  } catch (...) {
    return Work::completed(std::current_exception());
  }
  Part p;
  p.kind = Kind::kReduceScatter;
  p.op = op;
  p.tensors = {std::move(in)};
  p.names = {std::move(name)};
  p.out = std::move(out);
  return enqueue(local, std::move(p), false, "reduce_scatter", false);
}

Work FusionEngine::all_gather_async(int local, Tensor in, Tensor out, std::string name) {
  const int64_t r = static_cast<int64_t>(cross_.size()) * num_local_;
  try {
    DISTSTRAT_CHECK(in.defined() && out.defined() && in.dtype() == out.dtype() &&
                        in.device().is_cpu() && out.device().is_cpu() &&
                        out.num_elements() == r * in.num_elements(),
                    kInvalidArgument, "rank ", rank_, ": all_gather '", echo(name), "' of ",
                    in.debug_string(), " into ", out.debug_string(), ": needs host tensors, ", r,
                    " x the input's elements in the output");
  } catch (...) {
    return Work::completed(std::current_exception());
  }
  Part p;
  p.kind = Kind::kAllGather;
  p.tensors = {std::move(in)};
  p.names = {std::move(name)};
  p.out = std::move(out);
  return enqueue(local, std::move(p), false, "all_gather", false);
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
  } else if (c.local_mismatch.empty()) {
    // Compare with a local replica that already enqueued this call.
    const Part* other = nullptr;
    int other_id = 0;
    for (int l = 0; l < num_local_ && !other; ++l) {
      if (c.parts[l].present) {
        other = &c.parts[l];
        other_id = l;
      }
    }
    std::ostringstream why;
    if (c.is_task != is_task || c.what != what) {
      why << "local replica " << other_id << " called " << echo(c.what) << " but local replica "
          << local << " called " << echo(what);
    } else if (!is_task) {
      if (other->op != part.op) {
        why << "local replica " << other_id << " reduces with " << reduce_op_name(other->op)
            << " but local replica " << local << " with " << reduce_op_name(part.op);
      } else if (other->tensors.size() != part.tensors.size()) {
        why << "local replica " << other_id << " enqueued " << other->tensors.size()
            << " tensors but local replica " << local << " " << part.tensors.size();
      } else {
        for (size_t i = 0; i < part.tensors.size(); ++i) {
          const std::string a = tensor_line(name_at(other->names, i), other->tensors[i]);
          const std::string b = tensor_line(name_at(part.names, i), part.tensors[i]);
          if (a != b) {
            why << "tensor #" << i << ": local replica " << other_id << " has " << shown_line(a)
                << " but local replica " << local << " has " << shown_line(b);
            break;
          }
        }
      }
    }
    if (!why.str().empty()) {
      c.local_mismatch = "rank " + std::to_string(rank_) + ": local replicas disagree on call " +
                         std::to_string(seq) + ": " + why.str();
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
      call.parts[0].task(cross_);
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

std::string FusionEngine::signature_header(ReduceOp op) const {
  std::ostringstream os;
  os << "op " << reduce_op_name(op) << ", bytes_per_pack " << options_.bytes_per_pack
     << ", compression " << compression_name(options_.compression) << "\n";
  return os.str();
}

std::string FusionEngine::signature(const Call& call) const {
  if (!call.local_mismatch.empty()) return "!" + call.local_mismatch;
  const Part& p = call.parts[0];
  std::ostringstream os;
  os << kind_prefix(p.kind) << signature_header(p.op);
  for (size_t i = 0; i < p.tensors.size(); ++i)
    os << tensor_line(name_at(p.names, i), p.tensors[i]) << "\n";
  return os.str();
}

uint64_t FusionEngine::signature_hash(const Call& call) const {
  // A hash of what signature() spells out, computed without building the text.
  if (!call.local_mismatch.empty()) return fnv1a(signature(call));
  const Part& p = call.parts[0];
  uint64_t h = fnv1a(kind_prefix(p.kind) + signature_header(p.op));
  // Eight bytes per step (a call can have thousands of tensors; this runs on
  // every call), then the tail byte by byte, then the length.
  auto mix = [&](const void* data, size_t n) {
    const unsigned char* b = static_cast<const unsigned char*>(data);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      uint64_t w;
      std::memcpy(&w, b + i, 8);
      h = (h ^ w) * 0x9e3779b97f4a7c15ull;
      h ^= h >> 29;
    }
    for (; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
    h = (h ^ n) * 1099511628211ull;
  };
  for (size_t i = 0; i < p.tensors.size(); ++i) {
    const std::string& name = i < p.names.size() ? p.names[i] : std::string();
    mix(name.data(), name.size());
    const int dt = static_cast<int>(p.tensors[i].dtype());
    mix(&dt, sizeof dt);
    const auto& dims = p.tensors[i].shape().dims();
    const size_t rank = dims.size();
    mix(&rank, sizeof rank);
    mix(dims.data(), rank * sizeof(int64_t));
    mix("\n", 1);
  }
  return h;
}

void FusionEngine::check_signatures(const Call& call) {
  const int n = cross_.size();
  const int64_t index = executed_ - 1;
  if (n == 1) {
    if (!call.local_mismatch.empty()) throw InvalidArgumentError(call.local_mismatch);
    return;
  }
  // Named after the user's tensors: a peer that never comes makes this the
  // collective that times out.
  const Part& p0 = call.parts[0];
  const std::string label =
      "signature of fused all_reduce call #" + std::to_string(index) + " of " +
      (call.local_mismatch.empty() ? first_tensors(p0.names, p0.tensors.size())
                                   : std::string("mismatched local tensors"));
  const int64_t honest = static_cast<int64_t>(signature_hash(call));
  int64_t mine = honest;
  if (corrupt_next_signature_.exchange(false)) mine ^= static_cast<int64_t>(0x5a5a5a5a5a5a5a5aull);
  std::vector<int64_t> all(n);
  cross_.all_gather(&mine, all.data(), 1, DType::kInt64, label);
  bool same = true;
  for (int r = 0; r < n; ++r) same = same && all[r] == all[0];
  if (same) return;
  // Rare path: exchange the full signatures to say what differs.
  const std::string sig = signature(call);
  int64_t len = static_cast<int64_t>(sig.size());
  std::vector<int64_t> lens(n);
  cross_.all_gather(&len, lens.data(), 1, DType::kInt64, label + " (lengths)");
  const int64_t longest = *std::max_element(lens.begin(), lens.end());
  const size_t words = static_cast<size_t>(longest + 7) / 8;
  std::vector<int64_t> padded(words, 0), gathered(words * n);
  std::memcpy(padded.data(), sig.data(), sig.size());
  cross_.all_gather(padded.data(), gathered.data(), words, DType::kInt64, label + " (details)");
  std::vector<std::string> sigs(n);
  for (int r = 0; r < n; ++r) {
    sigs[r].assign(reinterpret_cast<const char*>(gathered.data() + r * words),
                   static_cast<size_t>(lens[r]));
  }
  if (std::all_of(sigs.begin(), sigs.end(), [&](const std::string& x) { return x == sigs[0]; })) {
    // Same calls, different hashes: a signature was damaged on its way.
    std::vector<int> bad;
    for (int r = 0; r < n; ++r) {
      if (all[r] != honest) bad.push_back(r);
    }
    throw DataLossError("rank " + std::to_string(rank_) + ": " + label +
                        ": corrupted pack signature from " + ranks_phrase(bad) +
                        " (its hash does not match the call every rank enqueued)");
  }
  throw InvalidArgumentError("rank " + std::to_string(rank_) + ": " +
                             describe_mismatch(sigs, index));
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

void FusionEngine::execute_all_reduce(Call& call) {
  const auto t_pack = Clock::now();
  const int64_t index = executed_ - 1;
  const bool trace = timeline_ && timeline_->enabled();
  check_signatures(call);
  const Part& p0 = call.parts[0];
  const ReduceOp op = p0.op;
  // kMean is summed everywhere and divided once by the replicas in sync.
  const ReduceOp sum_op = op == ReduceOp::kMean ? ReduceOp::kSum : op;
  const size_t limit = options_.bytes_per_pack == 0 ? SIZE_MAX : options_.bytes_per_pack;
  const size_t num = p0.tensors.size();

  // Pack plan: consecutive tensors of one dtype up to `limit` bytes.
  std::vector<std::pair<size_t, size_t>> packs;
  for (size_t i = 0; i < num;) {
    const DType dtype = p0.tensors[i].dtype();
    size_t j = i, bytes = 0;
    while (j < num && p0.tensors[j].dtype() == dtype &&
           (j == i || bytes + p0.tensors[j].nbytes() <= limit)) {
      bytes += p0.tensors[j].nbytes();
      ++j;
    }
    packs.emplace_back(i, j);
    i = j;
  }
  if (trace) {
    timeline_->complete("pack", "fusion", 0, t_pack, Clock::now(),
                        "\"call\": " + std::to_string(index) + ", \"tensors\": " +
                            std::to_string(num) + ", \"packs\": " + std::to_string(packs.size()));
  }

  // Size the fusion buffer once for the largest multi-tensor pack of the call.
  size_t largest = 0;
  for (const auto& [i, j] : packs) {
    if (j == i + 1) continue;
    size_t bytes = 0;
    for (size_t k = i; k < j; ++k) bytes += p0.tensors[k].nbytes();
    largest = std::max(largest, bytes);
  }
  ensure(buffer_, largest);

  std::vector<const void*> srcs(num_local_);
  for (size_t pk = 0; pk < packs.size(); ++pk) {
    const auto [i, j] = packs[pk];
    const DType dtype = p0.tensors[i].dtype();
    const size_t esz = dtype_size(dtype);
    size_t bytes = 0;
    for (size_t k = i; k < j; ++k) bytes += p0.tensors[k].nbytes();
    const size_t count = bytes / esz;
    const std::string name = "fused all_reduce #" + std::to_string(index) + " pack " +
                             std::to_string(pk + 1) + "/" + std::to_string(packs.size()) + " [" +
                             echo(name_at(p0.names, i)) +
                             (j - i > 1 ? " .. " + echo(name_at(p0.names, j - 1)) : "") + "]";
    const std::string args =
        "\"call\": " + std::to_string(index) + ", \"pack\": " + std::to_string(pk) +
        ", \"tensors\": " + std::to_string(j - i) + ", \"bytes\": " + std::to_string(bytes);

    // memcpy-in: reduce the local replicas' tensors into the pack buffer.
    const auto t_in = Clock::now();
    char* data;
    const bool alone = j == i + 1;
    if (alone) {
      // A single tensor is reduced in place in local replica 0's tensor.
      data = static_cast<char*>(const_cast<Tensor&>(p0.tensors[i]).data());
      if (num_local_ > 1 && count) {
        for (int l = 0; l < num_local_; ++l) srcs[l] = call.parts[l].tensors[i].data();
        kernels::reduce(data, srcs.data(), num_local_, count, dtype, sum_op, 1);
      }
    } else {
      data = buffer_.data();
      size_t off = 0;
      for (size_t k = i; k < j; ++k) {
        const size_t nb = call.parts[0].tensors[k].nbytes();
        if (nb) {
          if (num_local_ == 1) {
            std::memcpy(data + off, call.parts[0].tensors[k].data(), nb);
          } else {
            for (int l = 0; l < num_local_; ++l) srcs[l] = call.parts[l].tensors[k].data();
            kernels::reduce(data + off, srcs.data(), num_local_, nb / esz, dtype, sum_op, 1);
          }
        }
        off += nb;
      }
    }
    const auto t_reduce = Clock::now();
    if (trace) timeline_->complete("memcpy-in", "fusion", 0, t_in, t_reduce, args);

    // reduce: across processes, compressed on the wire for f32.
    if (cross_.size() > 1) {
      if (dtype == DType::kFloat32 && options_.compression != Compression::kNone) {
        const DType wire =
            options_.compression == Compression::kFloat16 ? DType::kFloat16 : DType::kBFloat16;
        ensure(wire_, count * dtype_size(wire));
        kernels::cast(data, DType::kFloat32, wire_.data(), wire, count);
        cross_.all_reduce(wire_.data(), wire_.data(), count, wire, sum_op, name);
        kernels::cast(wire_.data(), wire, data, DType::kFloat32, count);
      } else {
        cross_.all_reduce(data, data, count, dtype, sum_op, name);
      }
    }
    if (op == ReduceOp::kMean) kernels::scale_mean(data, count, dtype, replicas_in_sync_);
    const auto t_out = Clock::now();
    if (trace) timeline_->complete("reduce", "fusion", 0, t_reduce, t_out, args);

    // memcpy-out: the result into every local replica's tensors.
    for (int l = 0; l < num_local_; ++l) {
      size_t off = 0;
      for (size_t k = i; k < j; ++k) {
        Tensor& t = call.parts[l].tensors[k];
        const size_t nb = t.nbytes();
        if (nb && t.data() != data + off) std::memcpy(t.data(), data + off, nb);
        off += nb;
      }
    }
    if (trace) timeline_->complete("memcpy-out", "fusion", 0, t_out, Clock::now(), args);
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.packs;
    stats_.bytes += static_cast<int64_t>(bytes);
  }
}

}  // namespace diststrat

namespace diststrat {

void FusionEngine::execute_sharded(Call& call) {
  check_signatures(call);
  const Part& p0 = call.parts[0];
  const int64_t index = executed_ - 1;
  const bool scatter = p0.kind == Kind::kReduceScatter;
  const int w = cross_.size();
  const int l_count = num_local_;
  const DType dtype = p0.tensors[0].dtype();
  const size_t esz = dtype_size(dtype);
  // B: the elements of one replica's block.
  const size_t block =
      static_cast<size_t>(scatter ? p0.out.num_elements() : p0.tensors[0].num_elements());
  const size_t rank_block = block * static_cast<size_t>(l_count);  // this rank's replicas' blocks
  for (int l = 0; l < l_count; ++l) {
    const Part& p = call.parts[static_cast<size_t>(l)];
    DISTSTRAT_CHECK(p.out.num_elements() == p0.out.num_elements() && p.out.dtype() == dtype,
                    kInvalidArgument, "rank ", rank_, ": ", call.what, " '",
                    echo(name_at(p0.names, 0)), "': local replica ", l, " passed output ",
                    p.out.debug_string(), ", local replica 0 ", p0.out.debug_string());
  }
  const std::string name =
      "fused " + call.what + " #" + std::to_string(index) + " [" + echo(name_at(p0.names, 0)) + "]";
  const ReduceOp sum_op = p0.op == ReduceOp::kMean ? ReduceOp::kSum : p0.op;
  const size_t total = rank_block * static_cast<size_t>(w);
  if (scatter) {
    // In-process first: the local replicas' inputs reduced into one buffer
    // (a single local replica's input is used as it is).
    const char* in = static_cast<const char*>(p0.tensors[0].data());
    if (l_count > 1) {
      ensure(buffer_, total * esz);
      std::vector<const void*> srcs(static_cast<size_t>(l_count));
      for (int l = 0; l < l_count; ++l)
        srcs[static_cast<size_t>(l)] = call.parts[static_cast<size_t>(l)].tensors[0].data();
      if (total) kernels::reduce(buffer_.data(), srcs.data(), l_count, total, dtype, sum_op, 1);
      in = buffer_.data();
    }
    // This rank's replicas' blocks: straight into the output with one local
    // replica, else staged.
    char* mine;
    if (l_count == 1) {
      mine = static_cast<char*>(const_cast<Tensor&>(p0.out).data());
    } else {
      ensure(shard_, rank_block * esz);
      mine = shard_.data();
    }
    if (w > 1) {
      cross_.reduce_scatter(in, mine, rank_block, dtype, sum_op, name);
    } else if (mine != in) {
      std::memcpy(mine, in, rank_block * esz);
    }
    if (p0.op == ReduceOp::kMean) kernels::scale_mean(mine, rank_block, dtype, replicas_in_sync_);
    if (l_count > 1) {
      for (int l = 0; l < l_count; ++l) {
        Tensor& out = call.parts[static_cast<size_t>(l)].out;
        std::memcpy(out.data(), mine + static_cast<size_t>(l) * block * esz, block * esz);
      }
    }
  } else {
    // This rank's replicas' blocks side by side, then one cross-process
    // all_gather into local replica 0's output, copied to the others.
    const char* mine = static_cast<const char*>(p0.tensors[0].data());
    if (l_count > 1) {
      ensure(shard_, rank_block * esz);
      for (int l = 0; l < l_count; ++l) {
        std::memcpy(shard_.data() + static_cast<size_t>(l) * block * esz,
                    call.parts[static_cast<size_t>(l)].tensors[0].data(), block * esz);
      }
      mine = shard_.data();
    }
    char* out0 = static_cast<char*>(const_cast<Tensor&>(p0.out).data());
    if (w > 1) {
      cross_.all_gather(mine, out0, rank_block, dtype, name);
    } else if (out0 != mine) {
      std::memcpy(out0, mine, rank_block * esz);
    }
    for (int l = 1; l < l_count; ++l) {
      std::memcpy(call.parts[static_cast<size_t>(l)].out.data(), out0, total * esz);
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.packs;
  stats_.bytes += static_cast<int64_t>(total * esz);
}

}  // namespace diststrat
