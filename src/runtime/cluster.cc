// ClusterSpec: TF_CONFIG parsing and validation, rank assignment.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdlib>
#include <set>

#include "core/user_text.h"
#include "diststrat/cluster.h"
#include "diststrat/error.h"

namespace diststrat {

namespace {

// Training jobs in rank order; the evaluator has no training rank.
const char* const kRankedJobs[] = {"chief", "worker", "ps"};
const std::set<std::string> kKnownJobs = {"chief", "worker", "ps", "evaluator"};

[[noreturn]] void bad(const std::string& what) {
  throw InvalidArgumentError("cluster spec: " + what);
}

// What is wrong with a "host:port" address, or "" when nothing is.
std::string address_problem(const std::string& a) {
  const size_t colon = a.rfind(':');
  if (colon == std::string::npos || colon + 1 == a.size()) return "has no ':port'";
  if (colon == 0) return "has no host before ':'";
  const std::string host = a.substr(0, colon);
  if (host.front() == '[') {
    return "is an IPv6 address: addresses here are IPv4 addresses or host names";
  }
  if (host.find(':') != std::string::npos) return "has more than one ':'";
  for (char c : host) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '-' || c == '_';
    if (!ok) {
      return "the host has a character other than letters, digits, '.', '-' and '_' (" +
             echo(std::string(1, c)) + ")";
    }
  }
  const std::string port = a.substr(colon + 1);
  for (char c : port) {
    if (c < '0' || c > '9') return "port '" + echo(port) + "' is not a number";
  }
  if (port.size() > 5 || std::strtol(port.c_str(), nullptr, 10) < 1 ||
      std::strtol(port.c_str(), nullptr, 10) > 65535) {
    return "port " + echo(port) + " is out of range (1-65535)";
  }
  return "";
}

}  // namespace

void ClusterSpec::validate() const {
  std::set<std::string> addresses;
  int present = 0;
  for (const auto& [job, tasks] : jobs) {
    if (!kKnownJobs.count(job)) {
      bad("unknown job '" + echo(job) + "' (jobs are chief, worker, ps, evaluator)");
    }
    if (tasks.empty()) continue;
    ++present;
    if ((job == "chief" || job == "evaluator") && tasks.size() > 1) {
      bad("job '" + echo(job) + "' has " + std::to_string(tasks.size()) +
          " tasks; at most one is allowed");
    }
    for (size_t i = 0; i < tasks.size(); ++i) {
      const std::string& a = tasks[i];
      const std::string problem = address_problem(a);
      if (!problem.empty()) {
        bad("address '" + echo(a) + "' of " + echo(job) + "[" + std::to_string(i) +
            "] is not host:port: " + problem);
      }
      if (!addresses.insert(a).second) {
        bad("duplicate address '" + echo(a) + "' (" + echo(job) + "[" + std::to_string(i) + "])");
      }
    }
  }
  if (present == 0) bad("the cluster has no tasks");
  if (num_workers() == 0) bad("the cluster has no chief and no worker: nothing runs replicas");
  if (!kKnownJobs.count(task_type)) {
    bad("task type '" + echo(task_type) + "' is not a job (chief, worker, ps, evaluator)");
  }
  const int n = num_tasks(task_type);
  if (n == 0) bad("task type '" + echo(task_type) + "' has no tasks in the cluster");
  if (task_index < 0 || task_index >= n) {
    bad("task index " + std::to_string(task_index) + " out of range for job '" + echo(task_type) +
        "' with " + std::to_string(n) + " task" + (n == 1 ? "" : "s"));
  }
}

ClusterSpec ClusterSpec::from_tf_config(const std::string& text) {
  using nlohmann::json;
  json j;
  // nlohmann keeps the last of two equal keys in one object without a word:
  // the keys seen in each object being parsed, and the first repeated one.
  std::vector<std::set<std::string>> keys;
  std::string repeated;
  const json::parser_callback_t note_keys = [&](int, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::object_start) {
      keys.emplace_back();
    } else if (event == json::parse_event_t::object_end) {
      if (!keys.empty()) keys.pop_back();
    } else if (event == json::parse_event_t::key && !keys.empty() && repeated.empty()) {
      if (!keys.back().insert(parsed.get<std::string>()).second)
        repeated = parsed.get<std::string>();
    }
    return true;
  };
  try {
    j = json::parse(text, note_keys);
  } catch (const json::exception& e) {
    // parse_error, and out_of_range for numbers that overflow (found by fuzz_tf_config).
    throw InvalidArgumentError("TF_CONFIG is not valid JSON: " +
                               echo(e.what(), 2 * kMaxEchoedChars));
  }
  if (!repeated.empty()) bad("TF_CONFIG repeats the key '" + echo(repeated) + "' in one object");
  if (!j.is_object()) bad("TF_CONFIG must be a JSON object, got " + std::string(j.type_name()));
  for (const auto& [key, value] : j.items()) {
    if (key != "cluster" && key != "task" && key != "environment" && key != "rpc_layer") {
      bad("TF_CONFIG has an unknown key '" + echo(key) +
          "' (cluster, task, environment, rpc_layer)");
    }
  }
  if (!j.contains("cluster")) bad("TF_CONFIG has no 'cluster'");
  if (!j.contains("task")) bad("TF_CONFIG has no 'task'");
  const json& c = j["cluster"];
  if (!c.is_object()) bad("'cluster' must be an object of job -> [addresses]");
  ClusterSpec spec;
  for (const auto& [job, tasks] : c.items()) {
    if (!kKnownJobs.count(job))
      bad("unknown job '" + echo(job) + "' (jobs are chief, worker, ps, evaluator)");
    if (!tasks.is_array()) bad("job '" + echo(job) + "' must be a list of \"host:port\" strings");
    std::vector<std::string> addrs;
    for (const json& a : tasks) {
      if (!a.is_string()) bad("job '" + echo(job) + "' has a non-string address " + echo(a.dump()));
      addrs.push_back(a.get<std::string>());
    }
    spec.jobs[job] = std::move(addrs);
  }
  const json& t = j["task"];
  if (!t.is_object()) bad("'task' must be an object with 'type' and 'index'");
  for (const auto& [key, value] : t.items()) {
    if (key != "type" && key != "index" && key != "trial") {
      bad("'task' has an unknown key '" + echo(key) + "'");
    }
  }
  if (!t.contains("type")) bad("'task' has no 'type'");
  if (!t["type"].is_string()) bad("task 'type' must be a string, got " + echo(t["type"].dump()));
  spec.task_type = t["type"].get<std::string>();
  if (!t.contains("index")) bad("'task' has no 'index'");
  if (!t["index"].is_number_integer())
    bad("task 'index' must be an integer, got " + echo(t["index"].dump()));
  const json& ix = t["index"];
  // (A number above INT64_MAX is unsigned in nlohmann: compared as such, not wrapped.)
  if (ix.is_number_unsigned() ? ix.get<uint64_t>() > 1'000'000
                              : (ix.get<int64_t>() < 0 || ix.get<int64_t>() > 1'000'000)) {
    bad("task index " + echo(ix.dump()) + " out of range");
  }
  spec.task_index = static_cast<int>(ix.get<int64_t>());
  spec.validate();
  return spec;
}

int ClusterSpec::num_tasks(const std::string& job) const {
  auto it = jobs.find(job);
  return it == jobs.end() ? 0 : static_cast<int>(it->second.size());
}

int ClusterSpec::world_size() const {
  int n = 0;
  for (const char* job : kRankedJobs) n += num_tasks(job);
  return n;
}

int ClusterSpec::num_workers() const { return num_tasks("chief") + num_tasks("worker"); }

int ClusterSpec::rank() const {
  int base = 0;
  for (const char* job : kRankedJobs) {
    if (task_type == job) return base + task_index;
    base += num_tasks(job);
  }
  return -1;
}

std::pair<std::string, int> ClusterSpec::task_of_rank(int r) const {
  int base = 0;
  for (const char* job : kRankedJobs) {
    const int n = num_tasks(job);
    if (r >= base && r < base + n) return {job, r - base};
    base += n;
  }
  throw InvalidArgumentError("cluster spec: rank " + std::to_string(r) + " out of range for " +
                             std::to_string(world_size()) + " training processes");
}

std::vector<std::string> ClusterSpec::roles() const {
  std::vector<std::string> out;
  for (const char* job : kRankedJobs) {
    if (num_tasks(job)) out.push_back(job);
  }
  if (num_tasks("evaluator")) out.push_back("evaluator");
  return out;
}

const std::string& ClusterSpec::address() const {
  auto it = jobs.find(task_type);
  DISTSTRAT_CHECK(
      it != jobs.end() && task_index >= 0 && task_index < static_cast<int>(it->second.size()),
      kInvalidArgument, "cluster spec: no task ", echo(task_type), "[", task_index, "]");
  return it->second[task_index];
}

ClusterInfo ClusterSpec::info() const {
  ClusterInfo i;
  i.task_type = task_type;
  i.task_index = task_index;
  i.rank = rank();
  i.world_size = world_size();
  i.num_workers = num_workers();
  if (task_type == "chief") {
    i.worker_index = 0;
  } else if (task_type == "worker") {
    i.worker_index = num_tasks("chief") + task_index;
  } else {
    i.worker_index = -1;  // ps / evaluator run no replicas in sync
  }
  return i;
}

Placement virtual_nodes(const Placement& real, int ranks_per_node) {
  if (ranks_per_node <= 0) return real;
  Placement p = real;
  p.node = real.rank / ranks_per_node;
  p.num_nodes = (real.world_size + ranks_per_node - 1) / ranks_per_node;
  p.local_rank = real.rank % ranks_per_node;
  p.local_size = std::min(ranks_per_node, real.world_size - p.node * ranks_per_node);
  return p;
}

const char* cluster_source_name(ClusterSource s) {
  switch (s) {
    case ClusterSource::kExplicit:
      return "explicit";
    case ClusterSource::kTfConfig:
      return "TF_CONFIG";
    case ClusterSource::kMpi:
      return "mpi";
    case ClusterSource::kSingleProcess:
      return "single-process";
    case ClusterSource::kSlurm:
      return "slurm";
  }
  return "?";
}

}  // namespace diststrat
