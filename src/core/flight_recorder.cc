// The flight recorder (flight_recorder.h): the rings, the process's dump,
// and the watchdog thread that writes the dump on SIGUSR2 and when another
// process of the job has written its record after a failure.
//
// The watchdog learns of a peer's dump through inotify on the dump
// directory (local file systems; on a shared network file system across
// hosts inotify sees only this host's writes, and a rank stuck in compute on
// another host leaves no record unless the option to end the process, or a
// signal from the launcher, comes first). It adds its watch once the
// directory exists, and then also reads the dumps already there that are
// newer than this process.

#include "core/flight_recorder.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <thread>
#include <utility>

#include <dirent.h>
#include <execinfo.h>

#include "core/env.h"
#include "core/file_util.h"
#include "core/fnv1a.h"
#include "core/user_text.h"
#include "diststrat/flight_recorder.h"

namespace diststrat {
namespace flight {
namespace {

using Clock = std::chrono::steady_clock;

// Failures within this long of the last record written for one are the
// same episode (see Registry::last_failure_dump_us).
constexpr int64_t kEpisodeUs = 10 * 1000 * 1000;
// Calls per group in an exit record (Trigger::kExit), and how many closed
// groups it shows.
constexpr size_t kExitCalls = 16;
constexpr size_t kClosedGroups = 64;

const Clock::time_point& epoch() {
  static const Clock::time_point t = Clock::now();
  return t;
}
int64_t epoch_unix_us() {
  static const int64_t t = [] {
    const auto wall = std::chrono::system_clock::now();
    const int64_t since = now_us();
    return std::chrono::duration_cast<std::chrono::microseconds>(wall.time_since_epoch()).count() -
           since;
  }();
  return t;
}

// The call this thread is recording, for note_algorithm.
struct Current {
  Recorder* recorder = nullptr;
  uint64_t seq = 0;
  std::atomic<int32_t>* waiting_on = nullptr;
};
thread_local Current current;

uint32_t thread_number() {
  static std::atomic<uint32_t> next{0};
  thread_local const uint32_t mine = next++;
  return mine;
}

bool sites_on() {
  static const bool on = [] {
    try {
      return env::flag("DISTSTRAT_FLIGHT_RECORDER_SITES").value_or(false);
    } catch (const Error& e) {
      std::fprintf(stderr, "diststrat: %s; call sites stay off\n", e.message().c_str());
      return false;
    }
  }();
  return on;
}

size_t capacity() {
  static const size_t n = [] {
    try {
      return static_cast<size_t>(
          env::integer("DISTSTRAT_FLIGHT_RECORDER", 0, 1 << 16).value_or(2048));
    } catch (const Error& e) {
      // Read at the first communicator: a bad value must not take the
      // program down there; it is said once and the default kept.
      std::fprintf(stderr, "diststrat: %s; keeping the default 2048\n", e.message().c_str());
      return static_cast<size_t>(2048);
    }
  }();
  return n;
}

void json_text(std::string& out, const char* p, size_t n) {
  out += '"';
  for (size_t i = 0; i < n; ++i) {
    const unsigned char c = static_cast<unsigned char>(p[i]);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20 || c >= 0x7f) {
      // Control characters, and bytes outside ASCII (a name cut inside a
      // UTF-8 sequence must not make the file invalid JSON).
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  out += '"';
}
void json_text(std::string& out, const std::string& s) { json_text(out, s.data(), s.size()); }

struct Registry {
  std::mutex mu;  // guards everything below
  std::vector<Recorder*> live;
  // In a process of a job: the newest calls (JSON) and the member entry of
  // the groups closed last, for the exit record.
  std::deque<std::pair<std::string, std::string>> closed;
  bool exiting = false;    // write_exit_record has run
  pid_t watchdog_pid = 0;  // the process that started the watchdog
  // A call of this process failed (a record was asked for its own failure,
  // not only a peer's). Guarded by dump_mu.
  bool own_failure = false;
  int rank = -1, size = 0;
  std::string job, checkpoint_dir;
  bool job_set = false;
  std::mutex dump_mu;  // one dump at a time
  int64_t last_peer_dump_us = -1;
  // The last record written after a failure (or a peer's), and when: the
  // first record of a failure is the one that shows where every rank
  // waited, so later failures of the same episode (the others' calls
  // failing one after another, a stuck rank waking) do not overwrite it.
  int64_t last_failure_dump_us = -1;
  std::string last_failure_path;
  // The watchdog.
  bool watchdog_started = false;
  int signal_pipe[2] = {-1, -1};
  // The environment's part of the directory and DISTSTRAT_FLIGHT_RECORDER_EXIT,
  // read on the program's threads only: getenv races with setenv, which
  // MPI_Init and PMIx call while the watchdog may already run (a Slurm job's
  // process has its job from the start). The watchdog uses the values read
  // last (when a communicator was made or a record written).
  std::string env_dir, env_tmpdir = "/tmp";
  bool exit_on_peer_failure = false;
};

Registry& registry() {
  static Registry* r = new Registry;  // never destroyed: used by the watchdog until exit
  return *r;
}

std::string default_job() {
  if (auto id = env::text("SLURM_JOB_ID")) return "slurm" + *id;
  if (auto id = env::text("OMPI_MCA_ess_base_jobid")) return "ompi" + *id;
  return std::string();
}

// Keeps a job name safe inside a file name.
std::string file_safe(const std::string& s) {
  std::string out;
  for (char c : s.substr(0, 64)) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '-' || c == '_' || c == '.';
    out += ok ? c : '_';
  }
  return out;
}

std::string job_of(Registry& r) {
  if (!r.job_set) {
    r.job = default_job();
    r.job_set = true;
  }
  return r.job;
}

std::string file_prefix(const std::string& job) {
  return "flight-" + (job.empty() ? std::string("solo") : file_safe(job)) + "-";
}

// flight-<job>-rank<R>-pid<P>.json; a process of no known rank (one
// process, or before the cluster is resolved) has no rank<R>- part.
std::string file_name(const std::string& job, int rank) {
  return file_prefix(job) + (rank >= 0 ? "rank" + std::to_string(rank) + "-" : std::string()) +
         "pid" + std::to_string(::getpid()) + ".json";
}

bool exit_after_peer_failure() {
  try {
    return env::flag("DISTSTRAT_FLIGHT_RECORDER_EXIT").value_or(false);
  } catch (const Error& e) {
    std::fprintf(stderr, "diststrat: %s; the watchdog will not end the process\n",
                 e.message().c_str());
    return false;
  }
}

void make_directories(const std::string& dir) {
  for (size_t i = 1; i <= dir.size(); ++i) {
    if (i == dir.size() || dir[i] == '/') {
      const std::string part = dir.substr(0, i);
      if (::mkdir(part.c_str(), 0700) != 0 && errno != EEXIST) {
        fs::throw_errno(errno, "flight recorder: cannot create directory '" + part + "'");
      }
    }
  }
}

void read_environment_locked(Registry& r) {
  r.env_dir = env::text("DISTSTRAT_FLIGHT_RECORDER_DIR").value_or("");
  std::string tmp = env::text("TMPDIR").value_or("/tmp");
  r.env_tmpdir = tmp.empty() || tmp[0] != '/' ? "/tmp" : tmp;
}

std::string directory_locked(Registry& r) {
  if (!r.env_dir.empty()) return r.env_dir;
  if (!r.checkpoint_dir.empty()) return r.checkpoint_dir;
  const std::string job = job_of(r);
  return r.env_tmpdir + "/diststrat-flight-" +
         (job.empty() ? "pid" + std::to_string(::getpid()) : file_safe(job));
}

// The directory as last read on a program's thread (the watchdog's).
std::string watched_directory() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return directory_locked(r);
}

std::string dump_record(Trigger trigger, const std::string& reason, bool on_watchdog);

// `items` (JSON objects, comma-separated) into a list that `out` is writing.
void append_listed(std::string& out, const std::string& items) {
  if (items.empty()) return;
  if (out.back() != '[') out += ',';
  out += items;
}

// At a normal end of a process of a job (return from main, exit()): a
// record that says so, so that a rank that finished its loop is not taken
// for one that died. Not after a failure record of its own (dump_record).
void write_exit_record() {
  Registry& r = registry();
  {
    // From now on the watchdog answers no peer: a process lingering in its
    // exit (MPI_Finalize) is not stuck, and its record stays the exit one.
    std::lock_guard<std::mutex> lock(r.mu);
    // A forked child that exits is not the rank: the record is its parent's.
    if (r.watchdog_pid != ::getpid()) return;
    r.exiting = true;
  }
  dump_record(Trigger::kExit, "the process exited normally", /*on_watchdog=*/false);
}

void on_sigusr2(int) {
  const int fd = registry().signal_pipe[1];
  if (fd >= 0) {
    const char c = 'u';
    ssize_t ignored = ::write(fd, &c, 1);
    (void)ignored;
  }
}

// "failure" when the dump at `path` was written after a failure; reads only
// its first line (the writer puts the trigger there).
bool is_failure_dump(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return false;
  char buf[512];
  const ssize_t n = ::read(fd, buf, sizeof buf - 1);
  ::close(fd);
  if (n <= 0) return false;
  buf[n] = '\0';
  return std::strstr(buf, "\"trigger\": \"failure\"") != nullptr;
}

// Reacts to a file of the job's dump directory.
void peer_file(const std::string& dir, const std::string& name, const std::string& prefix,
               const std::string& mine) {
  if (name.compare(0, prefix.size(), prefix) != 0 || name == mine) return;
  if (name.size() < 5 || name.compare(name.size() - 5, 5, ".json") != 0) return;
  const std::string path = dir + "/" + name;
  if (!is_failure_dump(path)) return;
  Registry& r = registry();
  {
    // A process that wrote its own record on a failure of this episode has
    // its error in hand: not stuck, nothing to answer (nor to end).
    std::lock_guard<std::mutex> lock(r.dump_mu);
    if (r.last_failure_dump_us >= 0 && now_us() - r.last_failure_dump_us < kEpisodeUs) return;
  }
  {
    std::lock_guard<std::mutex> lock(r.mu);
    if (r.exiting) return;
    const int64_t now = now_us();
    // One answer per burst (every rank of a failed collective dumps).
    if (r.last_peer_dump_us >= 0 && now - r.last_peer_dump_us < 2000000) return;
    r.last_peer_dump_us = now;
  }
  const std::string written = dump_record(
      Trigger::kPeer, "another process of the job wrote its record after a failure: " + name,
      /*on_watchdog=*/true);
  bool end_process;
  {
    std::lock_guard<std::mutex> lock(r.mu);
    end_process = r.exit_on_peer_failure;
  }
  if (end_process) {
    std::fprintf(stderr,
                 "diststrat: process %d: another process of the job failed (%s); this process's "
                 "flight record is %s; ending it (DISTSTRAT_FLIGHT_RECORDER_EXIT)\n",
                 r.rank, name.c_str(), written.empty() ? "not written" : written.c_str());
    std::fflush(stderr);
    std::_Exit(1);
  }
}

void watchdog_main() {
  Registry& r = registry();
  const int in = ::inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
  std::string watched;
  int wd = -1;
  for (;;) {
    // The directory can change (an option set later, a variable set by a
    // test) or appear (a peer's first dump creates it).
    std::string dir, prefix, mine;
    {
      std::lock_guard<std::mutex> lock(r.mu);
      const std::string job = job_of(r);
      prefix = file_prefix(job);
      mine = file_name(job, r.rank);
      if (job.empty()) prefix.clear();  // a lone process has no peers to answer
    }
    dir = watched_directory();
    if (in >= 0 && !prefix.empty() && dir != watched) {
      if (wd >= 0) ::inotify_rm_watch(in, wd);
      wd = ::inotify_add_watch(in, dir.c_str(), IN_CLOSE_WRITE | IN_MOVED_TO);
      watched = wd >= 0 ? dir : std::string();
      if (wd >= 0) {
        // Dumps written before the watch: those newer than this process.
        if (DIR* d = ::opendir(dir.c_str())) {
          const int64_t started_unix_s = epoch_unix_us() / 1000000;
          while (dirent* e = ::readdir(d)) {
            struct stat st;
            const std::string path = dir + "/" + e->d_name;
            if (::stat(path.c_str(), &st) == 0 && st.st_mtime >= started_unix_s) {
              peer_file(dir, e->d_name, prefix, mine);
            }
          }
          ::closedir(d);
        }
      }
    }
    pollfd fds[2] = {{r.signal_pipe[0], POLLIN, 0}, {in, POLLIN, 0}};
    const int n = ::poll(fds, in >= 0 ? 2 : 1, 500);
    if (n <= 0) continue;
    if (fds[0].revents & POLLIN) {
      char buf[64];
      while (::read(r.signal_pipe[0], buf, sizeof buf) > 0) {
      }
      dump_record(Trigger::kSignal, "SIGUSR2", /*on_watchdog=*/true);
    }
    if (in >= 0 && (fds[1].revents & POLLIN)) {
      alignas(inotify_event) char buf[4096];
      ssize_t len;
      while ((len = ::read(in, buf, sizeof buf)) > 0) {
        for (char* p = buf; p < buf + len;) {
          const inotify_event* ev = reinterpret_cast<const inotify_event*>(p);
          if (ev->len > 0 && !prefix.empty()) peer_file(watched, ev->name, prefix, mine);
          p += sizeof(inotify_event) + ev->len;
        }
      }
    }
  }
}

// Only a process of a job (Slurm, Open MPI, an elastic job) has peers to
// answer, and only it gets the watchdog thread (and SIGUSR2): a lone
// process stays without a thread of ours, so a program that forks (as the
// checkpoint tests' bounded children do) forks a single-threaded process.
void start_watchdog_locked(Registry& r) {
  if (r.watchdog_started || job_of(r).empty()) return;
  r.watchdog_started = true;
  r.watchdog_pid = ::getpid();
  std::atexit(write_exit_record);
  read_environment_locked(r);
  r.exit_on_peer_failure = exit_after_peer_failure();  // a bad value is said now
  if (::pipe2(r.signal_pipe, O_NONBLOCK | O_CLOEXEC) != 0) {
    r.signal_pipe[0] = r.signal_pipe[1] = -1;
  }
  // SIGUSR2 dumps, unless the program has its own handler for it.
  struct sigaction old;
  if (r.signal_pipe[1] >= 0 && ::sigaction(SIGUSR2, nullptr, &old) == 0 &&
      old.sa_handler == SIG_DFL) {
    struct sigaction sa;
    std::memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_sigusr2;
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    ::sigaction(SIGUSR2, &sa, nullptr);
  }
  // Blocks every signal while it runs, so that process-directed signals
  // (SIGINT, SIGTERM, SIGUSR2) go to the program's own threads.
  sigset_t all, before;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &before);
  std::thread(watchdog_main).detach();
  pthread_sigmask(SIG_SETMASK, &before, nullptr);
}

}  // namespace

const char* state_name(State s) {
  switch (s) {
    case State::kQueued:
      return "queued";
    case State::kStarted:
      return "started";
    case State::kCompleted:
      return "completed";
    case State::kFailed:
      return "failed";
    case State::kAborted:
      return "aborted";
  }
  return "?";
}

int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - epoch()).count();
}

Recorder::Recorder(std::string group, int group_rank, int group_size)
    : group_(group),
      base_group_(std::move(group)),
      group_rank_(group_rank),
      group_size_(group_size) {
  const size_t n = capacity();
  if (n == 0) return;
  epoch_unix_us();  // fixed now, before any dump
  sites_on();       // read now, on the program's thread (see Registry)
  creator_thread_ = thread_number();
  ring_.reset(new Entry[n]);
  ring_size_ = n;
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.live.push_back(this);
  read_environment_locked(r);  // on the program's thread (see Registry)
  start_watchdog_locked(r);
}

Recorder::~Recorder() {
  if (ring_size_ == 0) return;
  Registry& r = registry();
  bool job;
  {
    std::lock_guard<std::mutex> lock(r.mu);
    job = r.watchdog_started;
  }
  // Its newest calls stay for the exit record: a group closed before the
  // process ends (the strategies in main) is still shown.
  std::string calls = "[", member = "[";
  if (job) {
    append_json(calls, kExitCalls);
    append_member_json(member);
  }
  std::lock_guard<std::mutex> lock(r.mu);
  r.live.erase(std::remove(r.live.begin(), r.live.end(), this), r.live.end());
  if (job) {
    r.closed.emplace_back(calls.substr(1), member.substr(1));
    if (r.closed.size() > kClosedGroups) r.closed.pop_front();
  }
}

uint64_t Recorder::begin(const char* kind, const std::string& name, uint64_t count,
                         const char* dtype, const char* op, int root, uint64_t bytes) {
  if (ring_size_ == 0) return 0;
  const int64_t now = now_us();
  void* site[kSiteFrames + 3];
  // Frames 0-2 are this function, the recording wrapper and its lambda.
  const int frames = sites_on() ? ::backtrace(site, kSiteFrames + 3) : 0;
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t seq = next_seq_++;
  Entry& e = ring_[seq % ring_size_];
  e.seq = seq;
  e.waiting_on.store(-1, std::memory_order_relaxed);
  e.start_us = now;
  e.end_us = -1;
  e.count = count;
  e.bytes = bytes;
  e.dtype = dtype;
  e.op = op;
  e.root = root;
  e.thread = thread_number();
  e.kind = kind;
  e.algorithm = "";
  e.state = State::kStarted;
  // A long name keeps its start and its end: names that differ only at the
  // end stay apart.
  e.name_len = static_cast<uint8_t>(head_and_tail_to(name, kNameBytes, e.name));
  e.name_hash = fnv1a(name);
  e.site_frames = static_cast<uint8_t>(std::max(0, frames - 3));
  for (int i = 0; i < e.site_frames; ++i) e.site[i] = site[i + 3];
  e.error.clear();
  last_gap_us_ = last_end_us_ >= 0 ? now - last_end_us_ : -1;
  current = {this, seq, &e.waiting_on};
  return seq;
}

Recorder::Entry* Recorder::find(uint64_t seq) {
  Entry& e = ring_[seq % ring_size_];
  return e.seq == seq ? &e : nullptr;
}

void Recorder::set_algorithm(uint64_t seq, const char* algorithm) {
  if (ring_size_ == 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (Entry* e = find(seq)) e->algorithm = algorithm;
}

void Recorder::end(uint64_t seq, State state, const std::string& error) {
  if (ring_size_ == 0) return;
  const int64_t now = now_us();
  if (current.recorder == this) current = {};
  std::lock_guard<std::mutex> lock(mu_);
  last_end_us_ = now;
  if (Entry* e = find(seq)) {
    e->end_us = now;
    e->state = state;
    // A call that completed waits for nobody; a failed one keeps whom it
    // waited for.
    if (state == State::kCompleted) e->waiting_on.store(-1, std::memory_order_relaxed);
    if (!error.empty()) e->error = error.substr(0, 1000);
  }
}

void Recorder::restart() {
  if (ring_size_ == 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  ++resets_;
  group_ = base_group_ + "#r" + std::to_string(resets_);
  // The old numbering's calls stay in the ring under the new name only if
  // renumbered; drop them instead (their record is in any earlier dump).
  for (size_t i = 0; i < ring_size_; ++i) ring_[i].seq = UINT64_MAX, ring_[i].start_us = -1;
  next_seq_ = 0;
}

int64_t Recorder::last_gap_us() const {
  std::lock_guard<std::mutex> lock(mu_);
  return last_gap_us_;
}

void Recorder::append_json(std::string& out, size_t newest) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (ring_size_ == 0 || next_seq_ == 0) return;
  const uint64_t n = ring_size_;
  const uint64_t keep = std::min<uint64_t>(n, newest);
  const uint64_t first = next_seq_ > keep ? next_seq_ - keep : 0;
  char num[64];
  for (uint64_t s = first; s < next_seq_; ++s) {
    const Entry& e = ring_[s % n];
    if (e.seq != s || e.start_us < 0) continue;
    if (out.back() != '[') out += ',';
    out += "\n  {\"group\": ";
    json_text(out, group_);
    std::snprintf(num, sizeof num, ", \"group_rank\": %d, \"group_size\": %d", group_rank_,
                  group_size_);
    out += num;
    std::snprintf(num, sizeof num, ", \"seq\": %llu, \"thread\": %u",
                  static_cast<unsigned long long>(e.seq), e.thread);
    out += num;
    out += ", \"kind\": ";
    json_text(out, e.kind, std::strlen(e.kind));
    out += ", \"name\": ";
    json_text(out, e.name, e.name_len);
    std::snprintf(num, sizeof num, ", \"name_hash\": \"%016llx\"",
                  static_cast<unsigned long long>(e.name_hash));
    out += num;
    std::snprintf(num, sizeof num,
                  ", \"count\": %llu, \"dtype\": ", static_cast<unsigned long long>(e.count));
    out += num;
    json_text(out, e.dtype, std::strlen(e.dtype));
    out += ", \"op\": ";
    json_text(out, e.op, std::strlen(e.op));
    std::snprintf(num, sizeof num, ", \"root\": %d, \"bytes\": %llu", e.root,
                  static_cast<unsigned long long>(e.bytes));
    out += num;
    out += ", \"algorithm\": ";
    json_text(out, e.algorithm, std::strlen(e.algorithm));
    std::snprintf(num, sizeof num, ", \"enqueue_us\": %lld, \"start_us\": %lld, \"end_us\": %lld",
                  static_cast<long long>(e.start_us), static_cast<long long>(e.start_us),
                  static_cast<long long>(e.end_us));
    out += num;
    out += ", \"state\": \"";
    out += state_name(e.state);
    out += '"';
    const int32_t waiting = e.waiting_on.load(std::memory_order_relaxed);
    if (waiting >= 0 && e.state != State::kCompleted) {
      out += ", \"waiting_on\": [" + std::to_string(waiting) + "]";
    }
    if (!e.error.empty()) {
      out += ", \"error\": ";
      json_text(out, e.error);
    }
    if (e.site_frames > 0) {
      std::string site;
      if (char** names = ::backtrace_symbols(e.site, e.site_frames)) {
        for (int i = 0; i < e.site_frames; ++i) {
          const char* n = names[i];
          const char* slash = std::strrchr(n, '/');
          site += (i ? " < " : "") + std::string(slash ? slash + 1 : n);
        }
        std::free(names);
      }
      out += ", \"site\": ";
      json_text(out, site);
    }
    out += '}';
  }
}

void note_algorithm(const char* algorithm) {
  if (current.recorder) current.recorder->set_algorithm(current.seq, algorithm);
}

void note_waiting(int peer) {
  if (current.waiting_on) current.waiting_on->store(peer, std::memory_order_relaxed);
}

void Recorder::append_member_json(std::string& out) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (ring_size_ == 0) return;
  if (out.back() != '[') out += ',';
  out += "\n  {\"group\": ";
  json_text(out, group_);
  char num[96];
  std::snprintf(num, sizeof num, ", \"group_rank\": %d, \"group_size\": %d, \"thread\": %u}",
                group_rank_, group_size_, creator_thread_);
  out += num;
}

void set_process(int rank, int size) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.rank = rank;
  r.size = size;
}

void set_job(const std::string& job) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.job = job;
  r.job_set = true;
  if (!r.live.empty()) start_watchdog_locked(r);
}

void set_checkpoint_directory(const std::string& dir) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.checkpoint_dir = dir;
}

std::string directory() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  read_environment_locked(r);
  return directory_locked(r);
}

std::string dump(Trigger trigger, const std::string& reason) {
  return dump_record(trigger, reason, /*on_watchdog=*/false);
}

namespace {

std::string dump_record(Trigger trigger, const std::string& reason, bool on_watchdog) {
  if (capacity() == 0) return std::string();
  Registry& r = registry();
  std::lock_guard<std::mutex> one_at_a_time(r.dump_mu);
  const bool failure = trigger == Trigger::kFailure || trigger == Trigger::kPeer;
  std::string path, dir;
  try {
    dir = on_watchdog ? watched_directory() : directory();
    // A failure of its own, also one whose record the episode's first record
    // stands for (a rank answered as a peer, then failing in its next call).
    if (trigger == Trigger::kFailure) r.own_failure = true;
    if (failure && r.last_failure_dump_us >= 0 && now_us() - r.last_failure_dump_us < kEpisodeUs &&
        fs::directory_of(r.last_failure_path) == dir) {
      return r.last_failure_path;
    }
    std::string out;
    out.reserve(1 << 16);
    // An exit record never replaces a record of this process's own failure:
    // that one shows where it waited. It does replace a peer record: a
    // process that went on to exit normally (the peer record may have caught
    // it closing its groups) was not stuck.
    if (trigger == Trigger::kExit && r.own_failure) return std::string();
    static const char* const kTriggers[] = {"failure", "signal", "request", "peer", "exit"};
    out += "{\"format\": \"diststrat-flight-record\", \"version\": 1, \"trigger\": \"";
    out += kTriggers[static_cast<int>(trigger)];
    out += "\",\n \"reason\": ";
    json_text(out, reason.substr(0, 2000));
    char host[256] = {};
    ::gethostname(host, sizeof host - 1);
    std::string job;
    std::lock_guard<std::mutex> lock(r.mu);
    job = job_of(r);
    out += ",\n \"process\": {\"rank\": " + std::to_string(r.rank) +
           ", \"size\": " + std::to_string(r.size) + ", \"host\": ";
    json_text(out, host, std::strlen(host));
    out += ", \"pid\": " + std::to_string(::getpid()) + ", \"job\": ";
    json_text(out, job);
    out += "},\n \"dump_time_us\": " + std::to_string(now_us()) +
           ", \"epoch_unix_us\": " + std::to_string(epoch_unix_us()) + ",\n \"calls\": [";
    // An exit record is written by every process of every job that ends
    // well, and a kept directory collects them: the newest calls say where
    // the process left.
    const bool at_exit = trigger == Trigger::kExit;
    for (const Recorder* rec : r.live) rec->append_json(out, at_exit ? kExitCalls : SIZE_MAX);
    for (size_t i = 0; at_exit && i < r.closed.size(); ++i) append_listed(out, r.closed[i].first);
    out += "\n ],\n \"members\": [";
    for (const Recorder* rec : r.live) rec->append_member_json(out);
    for (size_t i = 0; at_exit && i < r.closed.size(); ++i) append_listed(out, r.closed[i].second);
    out += "\n ]\n}\n";
    make_directories(dir);
    path = dir + "/" + file_name(job, r.rank);
    write_file_atomically(path, out.data(), out.size());
    if (failure) {
      r.last_failure_dump_us = now_us();
      r.last_failure_path = path;
    }
  } catch (const std::exception& e) {
    // At a normal end there is nothing to act on: no word.
    if (trigger != Trigger::kExit) {
      std::fprintf(stderr, "diststrat: the flight record was not written: %s\n", e.what());
    }
    return std::string();
  }
  return path;
}

}  // namespace

std::string dump_note(const std::string& path) {
  return path.empty() ? std::string() : " [flight record: " + path + "]";
}

}  // namespace flight

// diststrat/flight_recorder.h
std::string dump_flight_record(const std::string& reason) {
  return flight::dump(flight::Trigger::kRequest, reason);
}
std::string flight_record_directory() { return flight::directory(); }

}  // namespace diststrat
