#include "core/timeline.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "core/file_util.h"
#include "core/user_text.h"
#include "diststrat/error.h"

namespace diststrat {

namespace {
// Microseconds on the system clock, so that processes on one host line up.
double micros(Timeline::Clock::time_point t) {
  const auto sys =
      std::chrono::system_clock::now() +
      std::chrono::duration_cast<std::chrono::system_clock::duration>(t - Timeline::Clock::now());
  return std::chrono::duration<double, std::micro>(sys.time_since_epoch()).count();
}

std::string escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    if (static_cast<unsigned char>(c) < 0x20) {
      o += ' ';
      continue;
    }
    o += c;
  }
  return o;
}
}  // namespace

Timeline::Timeline(int pid) : pid_(pid) {}

void Timeline::name_thread(int tid, const std::string& name) {
  char buf[512];
  std::snprintf(
      buf, sizeof buf,
      "{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":%d,\"tid\":%d,\"args\":{\"name\":\"%s\"}}",
      pid_, tid, escape(name).c_str());
  std::lock_guard<std::mutex> lock(mu_);
  if (events_.empty()) {
    events_.push_back("{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":" + std::to_string(pid_) +
                      ",\"args\":{\"name\":\"rank " + std::to_string(pid_) + "\"}}");
  }
  events_.emplace_back(buf);
}

void Timeline::complete(const std::string& name, const char* category, int tid,
                        Clock::time_point begin, Clock::time_point end, const std::string& args) {
  if (!enabled_) return;
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "\",\"cat\":\"%s\",\"ph\":\"X\",\"ts\":%.3f,\"dur\":%.3f,\"pid\":%d,\"tid\":%d",
                category, micros(begin),
                std::chrono::duration<double, std::micro>(end - begin).count(), pid_, tid);
  std::string e = "{\"name\":\"" + escape(name) + buf;
  if (!args.empty()) e += ",\"args\":{" + args + "}";
  e += "}";
  std::lock_guard<std::mutex> lock(mu_);
  events_.push_back(std::move(e));
}

std::string Timeline::events_json() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out;
  for (size_t i = 0; i < events_.size(); ++i) {
    if (i) out += ",\n";
    out += events_[i];
  }
  return out;
}

size_t Timeline::num_events() const {
  std::lock_guard<std::mutex> lock(mu_);
  return events_.size();
}

void Timeline::write_file(const std::string& path, const std::vector<std::string>& events) {
  std::string text = "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n";
  bool first = true;
  for (const std::string& e : events) {
    if (e.empty()) continue;
    if (!first) text += ",\n";
    text += e;
    first = false;
  }
  text += "\n]}\n";
  // A FIFO (or device) at the path would take the events and drop them, or be
  // replaced by the rename: a timeline goes only to a regular file.
  struct stat lst {};
  if (::lstat(path.c_str(), &lst) == 0 && !S_ISREG(lst.st_mode) && !S_ISLNK(lst.st_mode)) {
    throw FailedPreconditionError("writing timeline '" + echo(path) + "': it exists and is " +
                                  fs::file_kind(lst.st_mode) + ", not a regular file");
  }
  // Atomic, with a fresh O_EXCL temporary (never a planted "<path>.tmp"
  // followed through a symlink) and errno mapped to the right code
  // (EACCES: kPermissionDenied, ENOENT: kNotFound, ENOSPC: kResourceExhausted).
  write_file_atomically(path, text.data(), text.size());
}

void Timeline::check_path(const std::string& path, const std::string& source) {
  const std::string what = source + "='" + echo(path) + "'";
  const size_t slash = path.rfind('/');
  DISTSTRAT_CHECK(slash != path.size() - 1 || path.empty(), kInvalidArgument, what,
                  ": a timeline file path must name a file, not a directory");
  const std::string dir = slash == std::string::npos ? "."
                          : slash == 0               ? "/"
                                                     : path.substr(0, slash);
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) {
    const int err = errno;
    throw InvalidArgumentError(what + ": its directory '" + echo(dir) + "' cannot be used (errno " +
                               std::to_string(err) + ": " + std::strerror(err) + ")");
  }
  DISTSTRAT_CHECK(S_ISDIR(st.st_mode), kInvalidArgument, what, ": '", echo(dir),
                  "' is not a directory");
  if (::access(dir.c_str(), W_OK | X_OK) != 0) {
    const int err = errno;
    throw PermissionDeniedError(what + ": its directory '" + echo(dir) +
                                "' is not writable (errno " + std::to_string(err) + ": " +
                                std::strerror(err) + ")");
  }
  if (::stat(path.c_str(), &st) == 0) {
    // A device (/dev/full, /dev/null), a FIFO or a directory would take or
    // lose the events without a word (write_file refuses to replace it).
    DISTSTRAT_CHECK(S_ISREG(st.st_mode), kInvalidArgument, what, " is ", fs::file_kind(st.st_mode),
                    ", not a regular file; a timeline is written only to a regular file");
  }
}

}  // namespace diststrat
