// The flight recorder's watchdog (flight_recorder.h): the thread that
// writes the process's record on SIGUSR2 and when another process of the
// job has written its record after a failure.
//
// The watchdog learns of a peer's dump through inotify on the dump
// directory (local file systems; on a shared network file system across
// hosts inotify sees only this host's writes, and a rank stuck in compute on
// another host leaves no record unless the option to end the process, or a
// signal from the launcher, comes first). It adds its watch once the
// directory exists, and then also reads the dumps already there that are
// newer than this process.

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include <dirent.h>

#include "core/env.h"
#include "core/flight_internal.h"
#include "core/flight_recorder.h"

namespace diststrat {
namespace flight {
namespace detail {
namespace {

bool exit_after_peer_failure() {
  try {
    return env::flag("DISTSTRAT_FLIGHT_RECORDER_EXIT").value_or(false);
  } catch (const Error& e) {
    std::fprintf(stderr, "diststrat: %s; the watchdog will not end the process\n",
                 e.message().c_str());
    return false;
  }
}

void on_sigusr2(int) {
  const int fd = registry().signal_pipe[1];
  if (fd >= 0) {
    const char c = 'u';
    ssize_t ignored = ::write(fd, &c, 1);
    (void)ignored;
  }
}

// Whether the file `name` of the open record directory `dfd` is a failure
// record of this run: a regular file (not followed if a symlink) of this
// uid whose first line, where the writer puts them, holds "trigger":
// "failure" and the run's nonce. Anything else is not the job's to act on.
bool is_failure_record(int dfd, const std::string& name, uint64_t nonce) {
  if (nonce == 0) return false;
  const fs::Fd fd(::openat(dfd, name.c_str(), O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC));
  struct stat st;
  if (fd.get() < 0 || ::fstat(fd.get(), &st) != 0) return false;
  if (!S_ISREG(st.st_mode) || st.st_uid != ::geteuid()) return false;
  char buf[512];
  const ssize_t n = ::read(fd.get(), buf, sizeof buf - 1);
  if (n <= 0) return false;
  buf[n] = '\0';
  if (char* end = std::strchr(buf, '\n')) *end = '\0';
  return std::strstr(buf, "\"trigger\": \"failure\"") != nullptr &&
         std::strstr(buf, nonce_field(nonce).c_str()) != nullptr;
}

// Reacts to a file of the job's dump directory.
void peer_file(int dfd, const std::string& name, const std::string& prefix,
               const std::string& mine) {
  if (name.compare(0, prefix.size(), prefix) != 0 || name == mine) return;
  if (name.size() < 5 || name.compare(name.size() - 5, 5, ".json") != 0) return;
  Registry& r = registry();
  uint64_t nonce;
  {
    // Read now: the job's communicator may have set it a moment ago.
    std::lock_guard<std::mutex> lock(r.mu);
    nonce = r.nonce;
  }
  if (!is_failure_record(dfd, name, nonce)) return;
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
  std::string watched, refused;
  fs::Fd watched_fd;  // the directory checked and watched, by descriptor
  int wd = -1;
  for (;;) {
    // The directory can change (an option set later, a variable set by a
    // test) or appear (a peer's first dump creates it).
    std::string prefix, mine;
    {
      std::lock_guard<std::mutex> lock(r.mu);
      const std::string job = job_of(r);
      prefix = file_prefix(job);
      mine = file_name(job, r.rank);
      if (job.empty()) prefix.clear();  // a lone process has no peers to answer
    }
    const Place dir = watched_directory();
    if (in >= 0 && !prefix.empty() && dir.path != watched) {
      if (wd >= 0) ::inotify_rm_watch(in, wd);
      wd = -1;
      watched.clear();
      watched_fd.reset(-1);
      try {
        watched_fd.reset(open_directory(dir, /*create=*/false));
      } catch (const Error& e) {
        // Said once per directory; the records are refused likewise.
        if (refused != dir.path) {
          std::fprintf(
              stderr,
              "diststrat: the flight recorder's watchdog does not watch the record directory: %s\n",
              e.message().c_str());
          refused = dir.path;
        }
      }
      if (watched_fd.get() >= 0) {
        // The watch goes on the directory checked, not on whatever the path
        // names by now (without /proc: the path, not followed if a link).
        const uint32_t mask = IN_CLOSE_WRITE | IN_MOVED_TO | IN_ONLYDIR;
        const std::string self = "/proc/self/fd/" + std::to_string(watched_fd.get());
        wd = ::inotify_add_watch(in, self.c_str(), mask);
        if (wd < 0) {
          wd = ::inotify_add_watch(in, dir.path.c_str(), mask | (dir.chosen ? 0 : IN_DONT_FOLLOW));
        }
      }
      if (wd >= 0) {
        watched = dir.path;
        // Dumps written before the watch: those newer than this process.
        const int copy = ::dup(watched_fd.get());
        if (DIR* d = copy >= 0 ? ::fdopendir(copy) : nullptr) {
          const int64_t started_unix_s = epoch_unix_us() / 1000000;
          while (dirent* e = ::readdir(d)) {
            struct stat st;
            if (::fstatat(watched_fd.get(), e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 &&
                st.st_mtime >= started_unix_s) {
              peer_file(watched_fd.get(), e->d_name, prefix, mine);
            }
          }
          ::closedir(d);
        } else if (copy >= 0) {
          ::close(copy);
        }
      } else {
        watched_fd.reset(-1);
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
          if (ev->len > 0 && !prefix.empty() && watched_fd.get() >= 0) {
            peer_file(watched_fd.get(), ev->name, prefix, mine);
          }
          p += sizeof(inotify_event) + ev->len;
        }
      }
    }
  }
}

}  // namespace

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

}  // namespace detail
}  // namespace flight
}  // namespace diststrat
