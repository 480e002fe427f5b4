// What the members of an elastic group agree on when it forms, before it
// trains (ElasticState::run, after the steps are gathered): the data every
// member distributed (rows, global batch, seed, options and a digest of the
// features and labels), the optimizers' configuration (the fields the first
// apply_gradients compares), the strategy options every step's call
// signature compares (shard_optimizer_state, compression), and settings
// added with ElasticState::agree_on (a LibTorch optimizer's). A joiner with other data,
// or another learning rate, is told here and leaves; the group re-forms
// without it. Checked later, at the first apply_gradients, a differing
// learning rate failed every member of the group at once.
//
// Every member all-gathers its settings as one text of (name, value) pairs,
// so that every member names the same field and both values.
#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>

#include "core/user_text.h"
#include "multiworker/multi_worker_impl.h"

namespace diststrat {

namespace {

using Settings = std::vector<std::pair<std::string, std::string>>;

constexpr const char* kData = "data.";

std::string hex(int64_t v) {
  char b[32];
  std::snprintf(b, sizeof b, "0x%016" PRIx64, static_cast<uint64_t>(v));
  return b;
}

// The data fields: the first dataset in full, and every one after it as one
// hash (a program distributes an evaluation set too; the first names the
// difference in nearly every case).
Settings data_settings(const std::vector<std::array<int64_t, 6>>& datasets) {
  Settings s;
  auto add = [&](const char* name, std::string value) {
    s.emplace_back(std::string(kData) + name, std::move(value));
  };
  add("datasets", std::to_string(datasets.size()));
  if (datasets.empty()) return s;
  const std::array<int64_t, 6>& d = datasets[0];
  add("rows", std::to_string(d[0]));
  add("global batch", std::to_string(d[1]));
  add("seed", std::to_string(static_cast<uint64_t>(d[2])));
  add("shuffle", (d[3] & 1) ? "on" : "off");
  add("drop_remainder", (d[3] & 2) ? "on" : "off");
  add("features", "digest " + hex(d[4]));
  add("labels", "digest " + hex(d[5]));
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the later datasets' values
  for (size_t i = 1; i < datasets.size(); ++i) {
    for (int64_t v : datasets[i]) h = (h ^ static_cast<uint64_t>(v)) * 1099511628211ull;
  }
  add("later datasets", hex(static_cast<int64_t>(h)));
  return s;
}

std::string value_of(const Settings& s, const std::string& name) {
  for (const auto& [k, v] : s) {
    if (k == name) return v;
  }
  return "";
}

std::string describe_data(const Settings& s) {
  const std::string n = value_of(s, std::string(kData) + "datasets");
  if (n == "0") return "no distributed dataset";
  auto v = [&](const char* name) { return value_of(s, std::string(kData) + name); };
  return n + " distributed dataset(s), the first of " + v("rows") + " rows in global batches of " +
         v("global batch") + " (seed " + v("seed") + ", shuffle " + v("shuffle") +
         ", drop_remainder " + v("drop_remainder") + ", features " + v("features") + ", labels " +
         v("labels") + ")";
}

// The fields of `mine` and `theirs` whose names start with `prefix` and
// whose values differ (or that only one holds), in `theirs`' order.
std::vector<std::string> differing(const Settings& mine, const Settings& theirs,
                                   const std::string& prefix) {
  std::vector<std::string> names;
  auto consider = [&](const std::string& k) {
    if (k.compare(0, prefix.size(), prefix) != 0) return;
    if (std::find(names.begin(), names.end(), k) != names.end()) return;
    const bool in_mine =
        std::any_of(mine.begin(), mine.end(), [&](auto& f) { return f.first == k; });
    const bool in_theirs =
        std::any_of(theirs.begin(), theirs.end(), [&](auto& f) { return f.first == k; });
    if (in_mine != in_theirs || value_of(mine, k) != value_of(theirs, k)) names.push_back(k);
  };
  for (const auto& f : theirs) consider(f.first);
  for (const auto& f : mine) consider(f.first);
  return names;
}

std::string data_difference(const std::vector<std::string>& names) {
  std::string s;
  for (const std::string& n : names) s += (s.empty() ? "" : ", ") + n.substr(std::strlen(kData));
  return s + (names.size() == 1 ? " differs" : " differ");
}

// "'learning_rate' of optimizers[0] is 0.5 here against 0.05 (and 1 more field)".
std::string settings_difference(const std::vector<std::string>& names, const Settings& mine,
                                const Settings& theirs, const char* here, const char* there) {
  auto shown = [](const Settings& s, const std::string& k) {
    const bool held = std::any_of(s.begin(), s.end(), [&](auto& f) { return f.first == k; });
    return held ? echo(value_of(s, k)) : std::string("(none)");
  };
  const std::string& k = names.front();
  std::string s = "'" + echo(k) + "' is " + shown(mine, k) + " " + here + " against " +
                  shown(theirs, k) + " " + there;
  if (names.size() > 1) {
    s += " (and " + std::to_string(names.size() - 1) + " more: ";
    for (size_t i = 1; i < names.size() && i < 6; ++i) s += (i > 1 ? ", " : "") + echo(names[i]);
    s += names.size() > 6 ? ", ...)" : ")";
  }
  return s;
}

std::string encode(const Settings& s) {
  std::string out;
  for (const auto& [k, v] : s) {
    out += k;
    out += '\0';
    out += v;
    out += '\0';
  }
  return out;
}

Settings decode(const char* p, size_t n) {
  Settings s;
  std::vector<std::string> parts;
  std::string cur;
  for (size_t i = 0; i < n; ++i) {
    if (p[i] == '\0') {
      parts.push_back(std::move(cur));
      cur.clear();
    } else {
      cur += p[i];
    }
  }
  for (size_t i = 0; i + 1 < parts.size(); i += 2) s.emplace_back(parts[i], parts[i + 1]);
  return s;
}

}  // namespace

void agree_on_settings(MultiWorkerMirroredStrategy::Impl& m, const std::vector<int64_t>& steps,
                       int source, const Settings& optimizer_settings) {
  ElasticRuntime& e = *m.elastic;
  const int n = m.cross->size();
  if (n <= 1) return;
  Settings mine = data_settings(e.datasets);
  mine.insert(mine.end(), optimizer_settings.begin(), optimizer_settings.end());
  const std::string text = encode(mine);
  int64_t length = static_cast<int64_t>(text.size());
  std::vector<int64_t> lengths(static_cast<size_t>(n));
  std::vector<int64_t> all;
  m.engine->run(
      [&](Communicator& c) {
        c.all_gather(&length, lengths.data(), 1, DType::kInt64, "elastic/settings bytes");
        const int64_t longest = *std::max_element(lengths.begin(), lengths.end());
        DISTSTRAT_CHECK(longest >= 0 && longest < (int64_t{1} << 30), kDataLoss, "rank ", m.rank(),
                        ": elastic settings of ", longest, " bytes");
        const size_t words = static_cast<size_t>(longest + 7) / 8;
        std::vector<int64_t> padded(words, 0);
        std::memcpy(padded.data(), text.data(), text.size());
        all.assign(words * static_cast<size_t>(n), 0);
        c.all_gather(padded.data(), all.data(), words, DType::kInt64, "elastic/settings");
      },
      "elastic settings agreement");
  const size_t words = all.size() / static_cast<size_t>(n);
  std::vector<Settings> of(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    of[static_cast<size_t>(r)] =
        decode(reinterpret_cast<const char*>(all.data() + words * static_cast<size_t>(r)),
               static_cast<size_t>(lengths[static_cast<size_t>(r)]));
  }
  // The reference: the member whose state the group takes; in a group that
  // has no state yet, the settings most members have (then the lowest
  // rank's).
  int reference = source;
  if (steps[static_cast<size_t>(source)] < 0) {
    int best = 0;
    for (int r = 0; r < n; ++r) {
      const int count = static_cast<int>(std::count(of.begin(), of.end(), of[r]));
      if (count > best) best = count, reference = r;
    }
  }
  const Settings& theirs = of[static_cast<size_t>(reference)];
  const std::string ref_name = e.view.members[static_cast<size_t>(reference)];
  const std::string me = "elastic: worker '" + e.rendezvous->id() + "' (rank " +
                         std::to_string(m.rank()) + " of group " + std::to_string(e.view.group) +
                         ")";
  // This member differs: it leaves with the reason (InvalidArgumentError,
  // not a lost peer: run() does not re-form it).
  const std::vector<std::string> data = differing(mine, theirs, kData);
  if (!data.empty()) {
    throw InvalidArgumentError(
        me + " distributes other data than worker '" + ref_name +
        "', whose settings the group keeps: " + data_difference(data) + " (" + describe_data(mine) +
        " against " + describe_data(theirs) +
        "); every worker must split the same rows into the same global batches (the same "
        "dataset, features and labels alike, global batch, seed and options)");
  }
  const std::vector<std::string> opt = differing(mine, theirs, "");
  if (!opt.empty()) {
    throw InvalidArgumentError(
        me + " is configured otherwise than worker '" + ref_name +
        "', whose settings the group keeps: " +
        settings_difference(opt, mine, theirs, "here", "there") +
        "; every worker must configure its optimizers and the strategy alike (the same learning "
        "rate, schedule, momentum, clipping, loss scaling, accumulation, shard_optimizer_state "
        "and compression), set before ElasticState::run");
  }
  // Another member differs: the others leave the group and re-form without
  // it (it has left with its own error).
  for (int r = 0; r < n; ++r) {
    const Settings& other = of[static_cast<size_t>(r)];
    if (other == theirs) continue;
    const std::string who = "elastic: worker '" + e.view.members[static_cast<size_t>(r)] +
                            "' (rank " + std::to_string(r) + ") ";
    const std::vector<std::string> d = differing(other, theirs, kData);
    throw AbortedError(
        who +
        (d.empty()
             ? "is configured otherwise than the group: " +
                   settings_difference(differing(other, theirs, ""), other, theirs, "there", "here")
             : "distributes other data than the group: " + data_difference(d) + " (" +
                   describe_data(other) + " against " + describe_data(theirs) + ")") +
        "; it leaves, and the group re-forms without it");
  }
}

}  // namespace diststrat
