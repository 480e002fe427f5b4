// Call signatures of the fusion engine and the text of their mismatches:
// local replicas that enqueue different parts of one call, and ranks whose
// calls differ (their 64-bit signature hashes are exchanged first, the full
// signatures only to say what differs) or were made in different steps, or
// whose hash arrived damaged.
#include <algorithm>
#include <cstring>
#include <sstream>

#include "core/fnv1a.h"
#include "core/user_text.h"
#include "multiworker/fusion.h"
#include "multiworker/fusion_names.h"

namespace diststrat {

namespace {

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

// The first line of a call's signature: the step it was made in, which the
// ranks must agree on as on its tensors (fusion.h).
std::string step_line(int64_t step) {
  return step < 0 ? std::string("no step\n") : "step " + std::to_string(step) + "\n";
}

// "in step 4", "outside a step": a step line as messages say it.
std::string step_phrase(const std::string& line) {
  return line.rfind("step ", 0) == 0 ? "in " + line : "outside a step";
}

std::string tensor_line(const std::string& name, const Tensor& t) {
  return "'" + name + "' " + dtype_name(t.dtype()) + t.shape().to_string();
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
// `tensors`: the call's first tensors on this rank, for the message about
// ranks in different steps.
std::string describe_mismatch(const std::vector<std::string>& sigs, int64_t call_index,
                              const std::string& tensors) {
  const int n = static_cast<int>(sigs.size());
  std::ostringstream os;
  for (int r = 0; r < n; ++r) {
    if (!sigs[r].empty() && sigs[r][0] == '!') {
      os << "fused all_reduce call #" << call_index << ": ranks enqueued different tensors: "
         << "on rank " << r << " " << sigs[r].substr(1);
      return os.str();
    }
  }
  // Line 0 is the step: ranks in different steps are told so whatever else
  // differs (a rank that skipped a step enqueues the same tensors a step on).
  std::vector<std::vector<std::string>> lines(n);
  std::vector<std::pair<std::string, std::vector<int>>> steps;
  size_t longest = 0;
  for (int r = 0; r < n; ++r) {
    lines[r] = split_lines(sigs[r]);
    const std::string step = lines[r].empty() ? std::string() : lines[r][0];
    if (!lines[r].empty()) lines[r].erase(lines[r].begin());
    auto it = std::find_if(steps.begin(), steps.end(), [&](auto& g) { return g.first == step; });
    if (it == steps.end()) {
      steps.push_back({step, {r}});
    } else {
      it->second.push_back(r);
    }
    longest = std::max(longest, lines[r].size());
  }
  if (steps.size() > 1) {
    os << "fused all_reduce call #" << call_index << " of " << tensors
       << ": ranks are in different steps:";
    for (size_t g = 0; g < steps.size(); ++g) {
      os << (g ? ";" : "") << " " << ranks_phrase(steps[g].second)
         << (steps[g].second.size() == 1 ? " is " : " are ") << step_phrase(steps[g].first);
    }
    os << " (a rank skipped or repeated a step's collective calls; every rank must make the "
          "same calls in every step, or one step's tensors would be reduced with another's)";
    return os.str();
  }
  os << "fused all_reduce call #" << call_index << ": ranks enqueued different tensors: ";
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

std::string FusionEngine::describe_local_mismatch(const Call& c, int local, const Part& part,
                                                  bool is_task, const std::string& what) const {
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
  return why.str();
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
  os << step_line(call.step) << kind_prefix(p.kind) << signature_header(p.op);
  for (size_t i = 0; i < p.tensors.size(); ++i)
    os << tensor_line(name_at(p.names, i), p.tensors[i]) << "\n";
  return os.str();
}

uint64_t FusionEngine::signature_hash(const Call& call) const {
  // A hash of what signature() spells out, computed without building the text.
  if (!call.local_mismatch.empty()) return fnv1a(signature(call));
  const Part& p = call.parts[0];
  uint64_t h = fnv1a(step_line(call.step) + kind_prefix(p.kind) + signature_header(p.op));
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
  // The gathers' names are the same on every rank (the communicator
  // compares them); their errors are told after the user's tensors, since a
  // peer that never comes makes this the collective that times out.
  const Part& p0 = call.parts[0];
  const std::string wire = "signature of fused all_reduce call #" + std::to_string(index);
  const std::string label =
      wire + " of " +
      (call.local_mismatch.empty() ? first_tensors(p0.names, p0.tensors.size())
                                   : std::string("mismatched local tensors"));
  auto gather = [&](const int64_t* in, int64_t* out, size_t count, const char* part) {
    try {
      cross_.all_gather(in, out, count, DType::kInt64, wire + part);
    } catch (const Error& e) {
      throw_error(e.code(), "rank " + std::to_string(rank_) + ": " + label + ": " + e.message());
    }
  };
  const int64_t honest = static_cast<int64_t>(signature_hash(call));
  int64_t mine = honest;
  if (corrupt_next_signature_.exchange(false)) mine ^= static_cast<int64_t>(0x5a5a5a5a5a5a5a5aull);
  std::vector<int64_t> all(n);
  gather(&mine, all.data(), 1, "");
  bool same = true;
  for (int r = 0; r < n; ++r) same = same && all[r] == all[0];
  if (same) return;
  // Rare path: exchange the full signatures to say what differs.
  const std::string sig = signature(call);
  int64_t len = static_cast<int64_t>(sig.size());
  std::vector<int64_t> lens(n);
  gather(&len, lens.data(), 1, " (lengths)");
  const int64_t longest = *std::max_element(lens.begin(), lens.end());
  const size_t words = static_cast<size_t>(longest + 7) / 8;
  std::vector<int64_t> padded(words, 0), gathered(words * n);
  std::memcpy(padded.data(), sig.data(), sig.size());
  gather(padded.data(), gathered.data(), words, " (details)");
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
  throw InvalidArgumentError(
      "rank " + std::to_string(rank_) + ": " +
      describe_mismatch(sigs, index, first_tensors(p0.names, p0.tensors.size())));
}

}  // namespace diststrat
