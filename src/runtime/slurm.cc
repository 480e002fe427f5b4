// Slurm's step variables as a cluster (diststrat/slurm.h): the hostlist and
// tasks-per-node forms expanded and checked, this task's rank, node and local
// id checked against them, roles and GPUs given out by local id.
#include "diststrat/slurm.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <set>
#include <string>

#include "core/user_text.h"
#include "diststrat/error.h"

namespace diststrat {

namespace {
constexpr size_t kMaxHosts = 100000;
constexpr int64_t kMaxTasks = 10'000'000;
constexpr int kMaxGpusPerNode = 1024;

[[noreturn]] void bad(const std::string& what, const std::string& value, const std::string& why) {
  throw InvalidArgumentError(what + "='" + echo(value) + "': " + why);
}

// Decimal digits only, at most 18 (so that it fits an int64_t).
bool digits_only(const std::string& s) {
  return !s.empty() && s.size() <= 18 &&
         std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

bool host_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
         c == '_' || c == '.';
}

std::string padded(int64_t v, size_t width) {
  std::string s = std::to_string(v);
  if (s.size() < width) s.insert(0, width - s.size(), '0');
  return s;
}

// One bracket's contents ("1-3,5", "001-004") as the strings it stands for;
// errors name `what` (the variable the list came from).
std::vector<std::string> expand_ranges(const std::string& what, const std::string& list,
                                       const std::string& inner) {
  if (inner.empty()) bad(what, list, "an empty bracket");
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= inner.size()) {
    size_t comma = inner.find(',', start);
    if (comma == std::string::npos) comma = inner.size();
    const std::string item = inner.substr(start, comma - start);
    const size_t dash = item.find('-');
    const std::string lo = item.substr(0, dash);
    const std::string hi = dash == std::string::npos ? lo : item.substr(dash + 1);
    if (!digits_only(lo) || !digits_only(hi)) {
      bad(what, list, "'" + echo(item) + "' in a bracket is not N or N-M (decimal digits)");
    }
    const int64_t a = std::stoll(lo), b = std::stoll(hi);
    if (a > b) bad(what, list, "the range " + item + " goes down");
    if (b - a >= static_cast<int64_t>(kMaxHosts)) {
      bad(what, list, "more than " + std::to_string(kMaxHosts) + " hosts");
    }
    if (out.size() + static_cast<size_t>(b - a + 1) > kMaxHosts) {
      bad(what, list, "more than " + std::to_string(kMaxHosts) + " hosts");
    }
    for (int64_t v = a; v <= b; ++v) out.push_back(padded(v, lo.size()));
    start = comma + 1;
  }
  return out;
}

// One top-level entry ("r[1-2]n[01-02]", "login") as its hosts.
std::vector<std::string> expand_entry(const std::string& what, const std::string& list,
                                      const std::string& entry) {
  if (entry.empty()) bad(what, list, "an empty entry");
  std::vector<std::string> hosts{""};
  size_t i = 0;
  while (i < entry.size()) {
    if (entry[i] == '[') {
      const size_t close = entry.find(']', i);
      if (close == std::string::npos) bad(what, list, "a '[' that is not closed");
      const std::string inner = entry.substr(i + 1, close - i - 1);
      if (inner.find('[') != std::string::npos) bad(what, list, "a nested '['");
      const std::vector<std::string> parts = expand_ranges(what, list, inner);
      if (hosts.size() * parts.size() > kMaxHosts) {
        bad(what, list, "more than " + std::to_string(kMaxHosts) + " hosts");
      }
      std::vector<std::string> next;
      for (const std::string& h : hosts)
        for (const std::string& p : parts) next.push_back(h + p);
      hosts = std::move(next);
      i = close + 1;
    } else if (entry[i] == ']') {
      bad(what, list, "a ']' with no '['");
    } else if (!host_char(entry[i])) {
      // The whole character when it is well-formed UTF-8 (not half of an
      // e-acute), escaped when it is a control byte or stray.
      const size_t len = std::max<size_t>(1, utf8_sequence_length(entry, i, entry.size()));
      bad(what, list, "the character '" + echo(entry.substr(i, len)) + "' in a host name");
    } else {
      for (std::string& h : hosts) h += entry[i];
      ++i;
    }
  }
  return hosts;
}

// The variable's value, or nullopt when unset or empty.
std::optional<std::string> get(const std::map<std::string, std::string>& env,
                               std::initializer_list<const char*> names, std::string* which) {
  for (const char* n : names) {
    auto it = env.find(n);
    if (it != env.end() && !it->second.empty()) {
      if (which) *which = n;
      return it->second;
    }
  }
  return std::nullopt;
}

int64_t integer(const std::string& name, const std::string& value, int64_t lo, int64_t hi) {
  if (!digits_only(value)) {
    bad(name, value,
        value.size() > 18 &&
                std::all_of(value.begin(), value.end(), [](char c) { return c >= '0' && c <= '9'; })
            ? "out of range [" + std::to_string(lo) + ", " + std::to_string(hi) + "]"
            : "not a decimal integer");
  }
  const int64_t v = std::stoll(value);
  if (v < lo || v > hi) {
    bad(name, value, "out of range [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  }
  return v;
}

std::string required(const std::map<std::string, std::string>& env,
                     std::initializer_list<const char*> names, std::string* which) {
  if (auto v = get(env, names, which)) return *v;
  std::string all;
  for (const char* n : names) all += std::string(all.empty() ? "" : " / ") + n;
  throw InvalidArgumentError("Slurm step: " + all + " is not set");
}

// A node's GPU list: comma-separated, no empty entry and no repeated one, at
// most kMaxGpusPerNode. Slurm's SLURM_*_GPUS are indices (decimal);
// CUDA_VISIBLE_DEVICES may also hold "GPU-<uuid>" / "MIG-..." ids.
std::vector<std::string> gpu_list(const std::string& name, const std::string& value,
                                  bool indices_only) {
  std::vector<std::string> out;
  std::set<std::string> seen;
  size_t start = 0;
  while (start <= value.size()) {
    size_t comma = value.find(',', start);
    if (comma == std::string::npos) comma = value.size();
    std::string item = value.substr(start, comma - start);
    const bool ok = indices_only
                        ? digits_only(item) && item.size() <= 6
                        : !item.empty() && std::all_of(item.begin(), item.end(), host_char);
    if (!ok) {
      bad(name, value,
          indices_only ? "not a comma-separated list of GPU indices"
                       : "not a comma-separated list of GPU indices or ids");
    }
    if (!seen.insert(item).second) bad(name, value, "the GPU " + item + " twice");
    if (out.size() >= static_cast<size_t>(kMaxGpusPerNode)) {
      bad(name, value, "more than " + std::to_string(kMaxGpusPerNode) + " GPUs");
    }
    out.push_back(std::move(item));
    start = comma + 1;
  }
  return out;
}

// Whether Slurm's distribution `dist` ("block", "cyclic", "plane=N", with
// ":<within a node>" or ",Pack" after it) puts the tasks on the nodes as a
// block layout of these counts would.
bool same_as_block(const std::string& dist, const std::vector<int>& tasks_per_node) {
  const std::string across = dist.substr(0, dist.find_first_of(":,"));
  if (across == "block" || across == "*") return true;
  int chunk = 0;
  if (across == "cyclic") {
    chunk = 1;
  } else if (across.rfind("plane=", 0) == 0 && digits_only(across.substr(6))) {
    chunk = static_cast<int>(std::min<int64_t>(std::stoll(across.substr(6)), kMaxTasks));
  }
  if (chunk < 1) return false;  // arbitrary, or a layout this code does not know
  // Slurm's round robin over the nodes with room left, `chunk` tasks a turn.
  std::vector<int> left = tasks_per_node;
  int64_t total = 0;
  for (int t : left) total += t;
  int64_t rank = 0;
  int first_of_node = 0;  // the block layout's first rank of node n
  std::vector<int64_t> block_first(left.size());
  for (size_t n = 0; n < left.size(); ++n) {
    block_first[n] = first_of_node;
    first_of_node += left[n];
  }
  std::vector<int64_t> next(left.size(), 0);  // tasks given to node n so far
  while (rank < total) {
    for (size_t n = 0; n < left.size() && rank < total; ++n) {
      for (int k = 0; k < chunk && left[n] > 0; ++k, ++rank) {
        if (rank != block_first[n] + next[n]) return false;
        --left[n];
        ++next[n];
      }
    }
  }
  return true;
}

std::map<std::string, std::string> process_environment() {
  std::map<std::string, std::string> env;
  for (const char* n :
       {"SLURM_PROCID", "SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS",
        "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURM_STEP_TASKS_PER_NODE",
        "SLURM_TASKS_PER_NODE", "SLURM_STEP_NUM_NODES", "SLURM_NODEID", "SLURM_LOCALID",
        "SLURM_CPUS_PER_TASK", "SLURM_DISTRIBUTION", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS",
        "CUDA_VISIBLE_DEVICES"}) {
    if (const char* v = std::getenv(n)) env[n] = v;
  }
  return env;
}
}  // namespace

namespace {
std::vector<std::string> expand_hostlist(const std::string& what, const std::string& list) {
  if (list.empty()) bad(what, list, "empty");
  std::vector<std::string> out;
  std::set<std::string> seen;
  size_t start = 0;
  while (start <= list.size()) {
    // The next top-level comma (commas inside brackets separate ranges).
    size_t end = start;
    int depth = 0;
    while (end < list.size() && (list[end] != ',' || depth > 0)) {
      if (list[end] == '[') ++depth;
      if (list[end] == ']') --depth;
      ++end;
    }
    for (std::string& h : expand_entry(what, list, list.substr(start, end - start))) {
      if (h.size() > 255) bad(what, list, "a host name longer than 255 characters");
      if (!seen.insert(h).second) bad(what, list, "the host " + h + " twice");
      if (out.size() >= kMaxHosts) {
        bad(what, list, "more than " + std::to_string(kMaxHosts) + " hosts");
      }
      out.push_back(std::move(h));
    }
    start = end + 1;
  }
  return out;
}
}  // namespace

std::vector<std::string> expand_slurm_hostlist(const std::string& list) {
  return expand_hostlist("hostlist", list);
}

namespace {
std::vector<int> expand_tasks_per_node(const std::string& what, const std::string& list) {
  if (list.empty()) bad(what, list, "empty");
  std::vector<int> out;
  int64_t total = 0;
  size_t start = 0;
  while (start <= list.size()) {
    size_t comma = list.find(',', start);
    if (comma == std::string::npos) comma = list.size();
    const std::string item = list.substr(start, comma - start);
    std::string count = item, repeat = "1";
    const size_t paren = item.find("(x");
    if (paren != std::string::npos) {
      if (item.back() != ')') bad(what, list, "'" + echo(item) + "' is not N or N(xM)");
      count = item.substr(0, paren);
      repeat = item.substr(paren + 2, item.size() - paren - 3);
    }
    if (!digits_only(count) || !digits_only(repeat)) {
      bad(what, list, "'" + echo(item) + "' is not N or N(xM)");
    }
    const int64_t n = std::stoll(count), m = std::stoll(repeat);
    if (n < 1 || m < 1) bad(what, list, "'" + item + "': counts start at 1");
    if (static_cast<int64_t>(out.size()) + m > static_cast<int64_t>(kMaxHosts) ||
        total + n * m > kMaxTasks) {
      bad(what, list, "more nodes or tasks than a job can have");
    }
    total += n * m;
    out.insert(out.end(), static_cast<size_t>(m), static_cast<int>(n));
    start = comma + 1;
  }
  return out;
}
}  // namespace

std::vector<int> expand_slurm_tasks_per_node(const std::string& list) {
  return expand_tasks_per_node("tasks per node", list);
}

bool in_slurm_step() {
  const char* step = std::getenv("SLURM_STEP_ID");
  const char* procid = std::getenv("SLURM_PROCID");
  if (!step || !*step || !procid || !*procid) return false;
  for (const char* launcher : {"OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS"}) {
    if (std::getenv(launcher)) return false;
  }
  return true;
}

SlurmClusterResolver::SlurmClusterResolver(SlurmOptions options)
    : SlurmClusterResolver(
          [&]() -> SlurmOptions {
            DISTSTRAT_CHECK(in_slurm_step(), kFailedPrecondition,
                            "SlurmClusterResolver: this process is not a task of an srun step "
                            "(SLURM_STEP_ID / SLURM_PROCID unset, or it was started by mpirun)");
            return options;
          }(),
          process_environment()) {
  if (options.auto_set_gpu) set_visible_gpus();
}

SlurmClusterResolver::SlurmClusterResolver(SlurmOptions options,
                                           const std::map<std::string, std::string>& env) {
  std::string size_var, nodes_var, tpn_var;
  const std::string size_text =
      required(env, {"SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"}, &size_var);
  const int size = static_cast<int>(integer(size_var, size_text, 1, kMaxTasks));
  const int rank = static_cast<int>(
      integer("SLURM_PROCID", required(env, {"SLURM_PROCID"}, nullptr), 0, size - 1));
  const std::string nodelist =
      required(env, {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"}, &nodes_var);
  hosts_ = expand_hostlist(nodes_var, nodelist);
  const int nodes = static_cast<int>(hosts_.size());
  if (options.tasks_per_node > 0) {
    tasks_per_node_.assign(hosts_.size(), options.tasks_per_node);
    tpn_var = "SlurmOptions::tasks_per_node";
  } else {
    DISTSTRAT_CHECK(options.tasks_per_node == 0, kInvalidArgument, "SlurmOptions::tasks_per_node ",
                    options.tasks_per_node, " (0 = Slurm's)");
    const std::string tpn =
        required(env, {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"}, &tpn_var);
    tasks_per_node_ = expand_tasks_per_node(tpn_var, tpn);
  }
  DISTSTRAT_CHECK(static_cast<int>(tasks_per_node_.size()) == nodes, kInvalidArgument,
                  "Slurm step: ", tpn_var, " counts ", tasks_per_node_.size(), " nodes but ",
                  nodes_var, " names ", nodes);
  int64_t total = 0;
  for (int t : tasks_per_node_) total += t;
  DISTSTRAT_CHECK(total == size, kInvalidArgument, "Slurm step: ", tpn_var, " adds up to ", total,
                  " tasks but ", size_var, " is ", size);
  if (auto n = get(env, {"SLURM_STEP_NUM_NODES"}, nullptr)) {
    DISTSTRAT_CHECK(integer("SLURM_STEP_NUM_NODES", *n, 1, kMaxHosts) == nodes, kInvalidArgument,
                    "Slurm step: SLURM_STEP_NUM_NODES=", *n, " but ", nodes_var, " names ", nodes);
  }
  const int node = static_cast<int>(
      integer("SLURM_NODEID", required(env, {"SLURM_NODEID"}, nullptr), 0, nodes - 1));
  const int local = static_cast<int>(integer(
      "SLURM_LOCALID", required(env, {"SLURM_LOCALID"}, nullptr), 0, tasks_per_node_[node] - 1));
  // Only a block layout across the nodes says where every other task is.
  // Slurm names the layout in SLURM_DISTRIBUTION (cyclic is its default when
  // there are no more tasks than nodes, where it is the same as block): the
  // layout it names is worked out and refused on every task, not only on the
  // tasks it moves, when it is not the block one.
  if (auto dist = get(env, {"SLURM_DISTRIBUTION"}, nullptr)) {
    if (!same_as_block(*dist, tasks_per_node_)) {
      bad("SLURM_DISTRIBUTION", *dist,
          "tasks are not laid out in blocks across the nodes (consecutive ranks on one node); "
          "launch with srun --distribution=block");
    }
  }
  int first_of_node = 0;
  for (int n = 0; n < node; ++n) first_of_node += tasks_per_node_[n];
  if (first_of_node + local != rank) {
    const auto dist = get(env, {"SLURM_DISTRIBUTION"}, nullptr);
    throw InvalidArgumentError(
        "Slurm step: task " + std::to_string(rank) + " is local task " + std::to_string(local) +
        " of node " + std::to_string(node) + " (" + hosts_[node] +
        "), not where a block distribution puts it (SLURM_DISTRIBUTION=" + dist.value_or("unset") +
        "); launch with srun --distribution=block");
  }
  placement_.rank = rank;
  placement_.world_size = size;
  placement_.node = node;
  placement_.num_nodes = nodes;
  placement_.local_rank = local;
  placement_.local_size = tasks_per_node_[node];

  if (auto c = get(env, {"SLURM_CPUS_PER_TASK"}, nullptr)) {
    cpus_per_task_ = static_cast<int>(integer("SLURM_CPUS_PER_TASK", *c, 1, 1 << 20));
  }

  // Roles, in rank order chief, worker, ps.
  std::map<std::string, int> jobs = options.jobs;
  if (jobs.empty()) jobs["worker"] = size;
  int64_t assigned = 0;
  for (const auto& [job, count] : jobs) {
    DISTSTRAT_CHECK(job == "chief" || job == "worker" || job == "ps", kInvalidArgument,
                    "SlurmOptions::jobs: job '", job,
                    "' (chief, worker and ps tasks run in the step; run evaluators as a step "
                    "of their own)");
    DISTSTRAT_CHECK(count >= 0 && count <= size, kInvalidArgument, "SlurmOptions::jobs: ", job,
                    " has ", count, " tasks but the step has ", size, " (", size_var, ")");
    assigned += count;
  }
  DISTSTRAT_CHECK(assigned == size, kInvalidArgument, "SlurmOptions::jobs give out ", assigned,
                  " tasks but the step has ", size, " (", size_var, ")");
  DISTSTRAT_CHECK(options.port_base >= 1 && options.port_base <= 65535 - 1024, kInvalidArgument,
                  "SlurmOptions::port_base ", options.port_base, " (1..64511)");
  int r = 0;
  for (const char* job : {"chief", "worker", "ps"}) {
    auto it = jobs.find(job);
    if (it == jobs.end()) continue;
    for (int i = 0; i < it->second; ++i, ++r) {
      // The node and local id of rank r in the block layout.
      int n = 0, first = 0;
      while (r >= first + tasks_per_node_[n]) first += tasks_per_node_[n++];
      DISTSTRAT_CHECK(r - first < 1024, kInvalidArgument, "Slurm step: more than 1024 tasks on ",
                      hosts_[n]);
      spec_.jobs[job].push_back(hosts_[n] + ":" + std::to_string(options.port_base + r - first));
      if (r == rank) {
        spec_.task_type = job;
        spec_.task_index = i;
      }
    }
  }
  spec_.validate();

  // GPUs: the node's list, then this task's slice of it by local id.
  std::vector<std::string> node_gpus;
  std::string gpus_var;
  if (auto g = get(env, {"SLURM_STEP_GPUS", "SLURM_JOB_GPUS"}, &gpus_var)) {
    node_gpus = gpu_list(gpus_var, *g, true);
  }
  DISTSTRAT_CHECK(options.gpus_per_node >= -1 && options.gpus_per_node <= kMaxGpusPerNode,
                  kInvalidArgument, "SlurmOptions::gpus_per_node ", options.gpus_per_node,
                  " (-1 = from Slurm, else 0..", kMaxGpusPerNode, ")");
  DISTSTRAT_CHECK(options.gpus_per_task >= -1 && options.gpus_per_task <= kMaxGpusPerNode,
                  kInvalidArgument, "SlurmOptions::gpus_per_task ", options.gpus_per_task,
                  " (-1 = the node's GPUs over its tasks, else 0..", kMaxGpusPerNode, ")");
  int per_node = options.gpus_per_node;
  if (per_node < 0) per_node = static_cast<int>(node_gpus.size());
  if (node_gpus.empty() && per_node > 0) {
    if (auto v = get(env, {"CUDA_VISIBLE_DEVICES"}, nullptr)) {
      node_gpus = gpu_list("CUDA_VISIBLE_DEVICES", *v, false);
      gpus_var = "CUDA_VISIBLE_DEVICES";
    } else {
      for (int i = 0; i < per_node; ++i) node_gpus.push_back(std::to_string(i));
      gpus_var = "SlurmOptions::gpus_per_node";
    }
  }
  DISTSTRAT_CHECK(static_cast<int>(node_gpus.size()) >= per_node, kInvalidArgument,
                  "Slurm step: SlurmOptions::gpus_per_node ", per_node, " but ", gpus_var,
                  " lists ", node_gpus.size());
  const int most_tasks = *std::max_element(tasks_per_node_.begin(), tasks_per_node_.end());
  gpus_per_task_ = options.gpus_per_task >= 0 ? options.gpus_per_task : per_node / most_tasks;
  DISTSTRAT_CHECK(per_node == 0 || gpus_per_task_ > 0 || options.gpus_per_task == 0,
                  kInvalidArgument, "Slurm step: ", per_node, " GPUs on a node (", gpus_var,
                  ") for up to ", most_tasks,
                  " tasks: not one each; set SlurmOptions::gpus_per_task (0 = no GPUs)");
  DISTSTRAT_CHECK(int64_t{gpus_per_task_} * placement_.local_size <= per_node, kInvalidArgument,
                  "Slurm step: ", placement_.local_size, " tasks on ", hosts_[node], " with ",
                  gpus_per_task_, " GPUs each need ",
                  int64_t{gpus_per_task_} * placement_.local_size, " but the node has ", per_node);
  for (int i = 0; i < gpus_per_task_; ++i) {
    task_gpus_.push_back(node_gpus[static_cast<size_t>(local * gpus_per_task_ + i)]);
  }
}

void SlurmClusterResolver::set_visible_gpus() const {
  if (task_gpus_.empty()) return;
  std::string v;
  for (const std::string& g : task_gpus_) v += (v.empty() ? "" : ",") + g;
  ::setenv("CUDA_VISIBLE_DEVICES", v.c_str(), 1);
}

}  // namespace diststrat
