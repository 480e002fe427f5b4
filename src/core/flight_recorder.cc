// The flight recorder (flight_recorder.h): the rings, one per rank and
// group, and their calls as JSON. The record file and its directory are in
// flight_record_file.cc, the watchdog in flight_watchdog.cc.

#include "core/flight_recorder.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <execinfo.h>

#include "core/env.h"
#include "core/flight_internal.h"
#include "core/fnv1a.h"
#include "core/user_text.h"

namespace diststrat {
namespace flight {
namespace {

using Clock = std::chrono::steady_clock;

const Clock::time_point& epoch() {
  static const Clock::time_point t = Clock::now();
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

}  // namespace

namespace detail {

int64_t epoch_unix_us() {
  static const int64_t t = [] {
    const auto wall = std::chrono::system_clock::now();
    const int64_t since = now_us();
    return std::chrono::duration_cast<std::chrono::microseconds>(wall.time_since_epoch()).count() -
           since;
  }();
  return t;
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

}  // namespace detail

using detail::json_text;
using detail::Registry;
using detail::registry;

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
  const size_t n = detail::capacity();
  if (n == 0) return;
  detail::epoch_unix_us();  // fixed now, before any dump
  sites_on();               // read now, on the program's thread (see Registry)
  creator_thread_ = thread_number();
  ring_.reset(new Entry[n]);
  ring_size_ = n;
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.live.push_back(this);
  detail::read_environment_locked(r);  // on the program's thread (see Registry)
  detail::start_watchdog_locked(r);
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
    append_json(calls, detail::kExitCalls);
    append_member_json(member);
  }
  std::lock_guard<std::mutex> lock(r.mu);
  r.live.erase(std::remove(r.live.begin(), r.live.end(), this), r.live.end());
  if (job) {
    r.closed.emplace_back(calls.substr(1), member.substr(1));
    if (r.closed.size() > detail::kClosedGroups) r.closed.pop_front();
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

}  // namespace flight
}  // namespace diststrat
