#include "flight_record.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <tuple>
#include <nlohmann/json.hpp>

#include "core/user_text.h"

namespace diststrat::trace {

namespace {

using json = nlohmann::json;

constexpr const char* kFormat = "diststrat-flight-record";
constexpr int64_t kFormatVersion = 1;

// Thrown inside parse_dump only, for the first field that fails a check.
struct BadField {
  std::string why;
};

std::string type_phrase(const json& v) {
  const std::string t = v.type_name();
  return (t == "array" || t == "object") ? "an " + t : "a " + t;
}

// v as an integer in [lo, hi]; `path` names it in the message.
int64_t check_int(const json& v, const std::string& path, int64_t lo, int64_t hi) {
  const std::string range =
      " is out of range [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(hi) || static_cast<int64_t>(u) < lo) {
      throw BadField{path + " " + std::to_string(u) + range};
    }
    return static_cast<int64_t>(u);
  }
  if (v.is_number_integer()) {
    const int64_t i = v.get<int64_t>();
    if (i < lo || i > hi) throw BadField{path + " " + std::to_string(i) + range};
    return i;
  }
  if (v.is_number_float()) {
    throw BadField{path + " is " + echo_text(v.dump(), 40) + ", not an integer"};
  }
  throw BadField{path + " is " + type_phrase(v) + ", not an integer"};
}

// obj[key] as an integer in [lo, hi]; `def` when absent and optional.
int64_t get_int(const json& obj, const char* key, const std::string& where, int64_t lo, int64_t hi,
                bool required, int64_t def = 0) {
  const auto it = obj.find(key);
  if (it == obj.end()) {
    if (required) throw BadField{where + key + " is missing"};
    return def;
  }
  return check_int(*it, where + key, lo, hi);
}

std::string get_str(const json& obj, const char* key, const std::string& where, bool required) {
  const auto it = obj.find(key);
  if (it == obj.end()) {
    if (required) throw BadField{where + key + " is missing"};
    return "";
  }
  if (!it->is_string()) throw BadField{where + key + " is " + type_phrase(*it) + ", not a string"};
  return it->get<std::string>();
}

const json& get_obj(const json& obj, const char* key, const std::string& where) {
  const auto it = obj.find(key);
  if (it == obj.end()) throw BadField{where + key + " is missing"};
  if (!it->is_object()) throw BadField{where + key + " is " + type_phrase(*it) + ", not an object"};
  return *it;
}

CallState parse_state(const std::string& s, const std::string& where) {
  if (s == "queued") return CallState::kQueued;
  if (s == "started") return CallState::kStarted;
  if (s == "completed") return CallState::kCompleted;
  if (s == "failed") return CallState::kFailed;
  if (s == "aborted") return CallState::kAborted;
  throw BadField{where + "state '" + echo_text(s, 40) +
                 "' is not one of queued, started, completed, failed, aborted"};
}

Call parse_call(const json& c, size_t i) {
  const std::string where = "calls[" + std::to_string(i) + "].";
  if (!c.is_object())
    throw BadField{"calls[" + std::to_string(i) + "] is " + type_phrase(c) + ", not an object"};
  Call call;
  call.group = get_str(c, "group", where, true);
  call.group_size = static_cast<int>(get_int(c, "group_size", where, 1, kMaxGroupSize, true));
  call.group_rank = static_cast<int>(get_int(c, "group_rank", where, 0, kMaxGroupSize - 1, true));
  if (call.group_rank >= call.group_size) {
    throw BadField{where + "group_rank " + std::to_string(call.group_rank) +
                   " is not below group_size " + std::to_string(call.group_size)};
  }
  call.seq = get_int(c, "seq", where, 0, kMaxValue, true);
  call.thread = static_cast<int>(get_int(c, "thread", where, -1, INT32_MAX, false, 0));
  call.kind = get_str(c, "kind", where, true);
  call.name = get_str(c, "name", where, false);
  call.name_hash = get_str(c, "name_hash", where, false);
  call.count = get_int(c, "count", where, -1, kMaxValue, false, -1);
  call.dtype = get_str(c, "dtype", where, false);
  call.op = get_str(c, "op", where, false);
  call.root = get_int(c, "root", where, -1, kMaxGroupSize - 1, false, -1);
  call.algorithm = get_str(c, "algorithm", where, false);
  call.bytes = get_int(c, "bytes", where, -1, kMaxValue, false, -1);
  call.enqueue_us = get_int(c, "enqueue_us", where, -1, kMaxValue, false, -1);
  call.start_us = get_int(c, "start_us", where, -1, kMaxValue, false, -1);
  call.end_us = get_int(c, "end_us", where, -1, kMaxValue, false, -1);
  call.state = parse_state(get_str(c, "state", where, true), where);
  const auto w = c.find("waiting_on");
  if (w != c.end() && !w->is_null()) {
    if (!w->is_array())
      throw BadField{where + "waiting_on is " + type_phrase(*w) + ", not an array"};
    for (size_t k = 0; k < w->size(); ++k) {
      call.waiting_on.push_back(static_cast<int>(check_int(
          (*w)[k], where + "waiting_on[" + std::to_string(k) + "]", 0, call.group_size - 1)));
    }
  }
  call.error = get_str(c, "error", where, false);
  call.site = get_str(c, "site", where, false);
  return call;
}

// "ill-formed UTF-8 byte" out of nlohmann's "...parse error at line 1,
// column 8: syntax error while parsing value - ill-formed UTF-8 byte; last
// read: '...'" (the last read text is file content: left out).
std::string parse_error_reason(const std::string& what) {
  std::string r = what;
  if (r.rfind("[json.exception.", 0) == 0 && r.find("] ") != std::string::npos) {
    r = r.substr(r.find("] ") + 2);
  }
  const size_t dash = r.rfind(" - ");
  if (dash != std::string::npos) r = r.substr(dash + 3);
  const size_t last = r.find("; last read");
  if (last != std::string::npos) r = r.substr(0, last);
  return echo_text(r, 80);
}

// The byte at which arrays and objects nest deeper than kMaxNesting, or -1.
// Counts brackets outside strings: where the text is not JSON the parser
// stops at that point anyway.
int64_t too_deep_at(const std::string& text) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > kMaxNesting) return static_cast<int64_t>(i);
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return -1;
}

bool all_space(const std::string& s) {
  return std::all_of(s.begin(), s.end(),
                     [](char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; });
}

// Reads a regular file (never blocks on a FIFO; refuses devices and
// directories). Returns "" on success, else why not.
std::string read_file(const std::string& path, std::string* text) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) {
    const int err = errno;
    return std::string("cannot open it: ") + std::strerror(err);
  }
  struct stat st {};
  std::string why;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    why = std::string("cannot stat it: ") + std::strerror(err);
  } else if (S_ISDIR(st.st_mode)) {
    why = "it is a directory";
  } else if (!S_ISREG(st.st_mode)) {
    why = "it is not a regular file";
  } else if (st.st_size > kMaxFileBytes) {
    why = "it is " + std::to_string(static_cast<long long>(st.st_size)) +
          " bytes, more than a flight record can be (" + std::to_string(kMaxFileBytes) + ")";
  }
  if (why.empty()) {
    text->clear();
    // One allocation of the size read (at most kMaxFileBytes), not doubling
    // growth up to twice the file.
    text->reserve(static_cast<size_t>(st.st_size) + 1);
    char buf[1 << 16];
    for (;;) {
      const ssize_t n = ::read(fd, buf, sizeof buf);
      if (n > 0) {
        text->append(buf, static_cast<size_t>(n));
        if (static_cast<int64_t>(text->size()) > kMaxFileBytes) {
          why = "it grew past " + std::to_string(kMaxFileBytes) + " bytes while being read";
          break;
        }
      } else if (n == 0) {
        break;
      } else if (errno != EINTR) {
        const int err = errno;
        why = std::string("cannot read it: ") + std::strerror(err);
        break;
      }
    }
  }
  ::close(fd);
  return why;
}

// Per participant (group, group rank): its newest seq and how many calls.
struct ParticipantInfo {
  int64_t newest = -1;
  size_t calls = 0;
};
std::map<std::pair<std::string, int>, ParticipantInfo> participants_of(const Dump& d) {
  std::map<std::pair<std::string, int>, ParticipantInfo> out;
  for (const Call& c : d.calls) {
    ParticipantInfo& p = out[{c.group, c.group_rank}];
    p.newest = std::max(p.newest, c.seq);
    ++p.calls;
  }
  return out;
}

// True when dump a's record of a participant is to be preferred to b's.
bool better(const Dump& a, const ParticipantInfo& pa, const Dump& b, const ParticipantInfo& pb) {
  if (pa.newest != pb.newest) return pa.newest > pb.newest;
  if (a.host == b.host && a.pid == b.pid && a.dump_time_us != b.dump_time_us) {
    return a.dump_time_us > b.dump_time_us;  // one process, dumped twice: the later dump
  }
  if (pa.calls != pb.calls) return pa.calls > pb.calls;
  return false;  // keep the first by file name
}

std::string participant_phrase(const std::pair<std::string, int>& p) {
  return "rank " + std::to_string(p.second) + " of group '" + echo_text(p.first, 60) + "'";
}

// Picks one file per participant; marks the others' copies superseded and
// drops files left with nothing of their own.
void resolve_duplicates(LoadResult* r) {
  std::vector<std::map<std::pair<std::string, int>, ParticipantInfo>> info;
  for (const Dump& d : r->dumps) info.push_back(participants_of(d));
  std::map<std::pair<std::string, int>, size_t> chosen;
  std::map<std::pair<std::string, int>, std::vector<size_t>> holders;
  for (size_t i = 0; i < r->dumps.size(); ++i) {
    for (const auto& [p, pi] : info[i]) {
      holders[p].push_back(i);
      const auto it = chosen.find(p);
      if (it == chosen.end() ||
          better(r->dumps[i], pi, r->dumps[it->second], info[it->second].at(p))) {
        chosen[p] = i;
      }
    }
  }
  std::vector<bool> keep(r->dumps.size(), true);
  std::vector<std::string> notes;
  for (size_t i = 0; i < r->dumps.size(); ++i) {
    size_t own = 0;
    size_t other = 0;
    for (const auto& [p, pi] : info[i]) {
      if (chosen[p] == i) {
        ++own;
      } else {
        other = chosen[p];
        r->dumps[i].superseded.insert(p);
      }
    }
    if (own == 0 && !info[i].empty()) {
      keep[i] = false;
      notes.push_back("skipping " + echo_text(r->dumps[i].file) + ": a duplicate (" +
                      echo_text(r->dumps[other].file) + " records " +
                      (info[i].size() == 1 ? participant_phrase(info[i].begin()->first)
                                           : "every participant it records") +
                      ", as new or newer)");
      ++r->files_skipped;
    } else {
      for (const auto& p : r->dumps[i].superseded) {
        notes.push_back("note: " + echo_text(r->dumps[i].file) + " and " +
                        echo_text(r->dumps[chosen[p]].file) + " both record " +
                        participant_phrase(p) + "; using " + echo_text(r->dumps[chosen[p]].file));
      }
    }
  }
  std::vector<Dump> kept;
  for (size_t i = 0; i < r->dumps.size(); ++i) {
    if (keep[i]) kept.push_back(std::move(r->dumps[i]));
  }
  r->dumps = std::move(kept);
  r->messages.insert(r->messages.end(), notes.begin(), notes.end());
}

}  // namespace

const char* state_name(CallState s) {
  switch (s) {
    case CallState::kQueued:
      return "queued";
    case CallState::kStarted:
      return "started";
    case CallState::kCompleted:
      return "completed";
    case CallState::kFailed:
      return "failed";
    case CallState::kAborted:
      return "aborted";
  }
  return "?";
}

std::string echo_text(const std::string& s, size_t max_bytes) {
  size_t shown = std::min(s.size(), max_bytes);
  // Back up to a character boundary (never split a UTF-8 sequence).
  if (shown < s.size()) {
    while (shown > 0 && (static_cast<unsigned char>(s[shown]) & 0xC0) == 0x80) --shown;
  }
  std::string out;
  out.reserve(shown + 24);
  append_escaped(out, s, shown);
  if (shown < s.size()) out += "... (" + std::to_string(s.size()) + " bytes)";
  return out;
}

bool parse_dump(const std::string& text, Dump* out, std::string* why) {
  if (all_space(text)) {
    *why = text.empty() ? "empty file" : "no JSON in it (only white space)";
    return false;
  }
  const int64_t deep = too_deep_at(text);
  if (deep >= 0) {
    *why = "not a flight record (arrays and objects nested more than " +
           std::to_string(kMaxNesting) + " deep, at byte " + std::to_string(deep) + ")";
    return false;
  }
  json j;
  try {
    j = json::parse(text);
  } catch (const json::parse_error& e) {
    if (e.byte > text.size()) {
      *why = "truncated JSON at byte " + std::to_string(text.size());
    } else {
      *why = "invalid JSON at byte " + std::to_string(e.byte > 0 ? e.byte - 1 : 0) + " (" +
             parse_error_reason(e.what()) + ")";
    }
    return false;
  } catch (const std::exception& e) {  // number overflow (1e999), out of memory
    *why = std::string("unreadable JSON (") + parse_error_reason(e.what()) + ")";
    return false;
  }
  try {
    if (!j.is_object()) {
      throw BadField{"not a flight record (the JSON is " + type_phrase(j) + ", not an object)"};
    }
    const auto fmt = j.find("format");
    if (fmt == j.end()) throw BadField{"not a flight record (no \"format\" field)"};
    if (!fmt->is_string() || fmt->get<std::string>() != kFormat) {
      throw BadField{"not a flight record (format " + echo_text(fmt->dump(), 60) + ", not \"" +
                     kFormat + "\")"};
    }
    const int64_t version = get_int(j, "version", "", 0, INT32_MAX, true);
    if (version != kFormatVersion) {
      throw BadField{"format version " + std::to_string(version) +
                     " is not supported (this tool reads version " +
                     std::to_string(kFormatVersion) + ")"};
    }
    Dump d;
    const json& p = get_obj(j, "process", "");
    d.rank = static_cast<int>(get_int(p, "rank", "process.", -1, kMaxGroupSize - 1, true));
    d.size = static_cast<int>(get_int(p, "size", "process.", 0, kMaxGroupSize, false, 0));
    d.host = get_str(p, "host", "process.", false);
    d.pid = get_int(p, "pid", "process.", -1, kMaxValue, false, 0);
    d.has_job = p.find("job") != p.end();
    d.job = get_str(p, "job", "process.", false);
    d.trigger = get_str(j, "trigger", "", false);
    d.reason = get_str(j, "reason", "", false);
    d.dump_time_us = get_int(j, "dump_time_us", "", 0, kMaxValue, true);
    d.epoch_unix_us = get_int(j, "epoch_unix_us", "", 0, kMaxValue, false, 0);
    const auto calls = j.find("calls");
    if (calls == j.end()) throw BadField{"calls is missing"};
    if (!calls->is_array()) throw BadField{"calls is " + type_phrase(*calls) + ", not an array"};
    d.calls.reserve(calls->size());
    for (size_t i = 0; i < calls->size(); ++i) d.calls.push_back(parse_call((*calls)[i], i));
    const auto members = j.find("members");
    if (members != j.end()) {
      if (!members->is_array()) {
        throw BadField{"members is " + type_phrase(*members) + ", not an array"};
      }
      for (size_t i = 0; i < members->size(); ++i) {
        const json& m = (*members)[i];
        const std::string where = "members[" + std::to_string(i) + "].";
        if (!m.is_object()) throw BadField{where + " is " + type_phrase(m) + ", not an object"};
        MemberDecl decl;
        decl.group = get_str(m, "group", where, true);
        decl.group_size = static_cast<int>(get_int(m, "group_size", where, 1, kMaxGroupSize, true));
        decl.group_rank =
            static_cast<int>(get_int(m, "group_rank", where, 0, decl.group_size - 1, true));
        decl.thread = static_cast<int>(get_int(m, "thread", where, 0, INT32_MAX, false, 0));
        d.members.push_back(std::move(decl));
      }
    }
    d.file = std::move(out->file);
    *out = std::move(d);
    return true;
  } catch (const BadField& b) {
    *why = b.why;
    return false;
  } catch (const std::exception& e) {  // a type nlohmann refuses to convert; out of memory
    *why = std::string("unreadable record (") + echo_text(e.what(), 80) + ")";
    return false;
  }
}

namespace {

// A directory kept across runs holds several jobs' records: analysing them
// together pairs one job's ranks with another's. The job of the newest
// record is kept (a record without a job is a job of its own process); the
// others are left out with one message.
void keep_newest_job(LoadResult* r) {
  // Without the field (older records) all are taken as one job.
  auto job_of = [](const Dump& d) {
    return !d.has_job ? std::string() : d.job.empty() ? "pid" + std::to_string(d.pid) : d.job;
  };
  auto wall = [](const Dump& d) { return d.epoch_unix_us + d.dump_time_us; };
  std::set<std::string> jobs;
  const Dump* newest = nullptr;
  for (const Dump& d : r->dumps) {
    jobs.insert(job_of(d));
    if (newest == nullptr || wall(d) > wall(*newest)) newest = &d;
  }
  if (jobs.size() <= 1) return;
  const std::string keep = job_of(*newest);
  std::vector<Dump> kept;
  int left = 0;
  for (Dump& d : r->dumps) {
    if (job_of(d) == keep) {
      kept.push_back(std::move(d));
    } else {
      ++left;
    }
  }
  r->messages.push_back("the directory holds records of " + std::to_string(jobs.size()) +
                        " jobs: analysing job '" + echo_text(keep, 80) + "' (the newest record), " +
                        std::to_string(left) + " record(s) of other jobs left out");
  r->files_skipped += left;
  r->dumps = std::move(kept);
}

// The groups of one process's threads (InProcessGroup: in-process#N, the
// GPU replicas' gpu-local#N) are numbered by a counter of that process:
// every process has its own in-process#0. With records of several
// processes, each such group is named after its process, so that two
// processes' groups are neither taken for copies of one participant nor
// merged into one group.
void key_local_groups(LoadResult* r) {
  auto local = [](const std::string& g) {
    return g.rfind("in-process#", 0) == 0 || g.rfind("gpu-local#", 0) == 0;
  };
  std::set<std::tuple<std::string, int64_t, int>> processes;
  for (const Dump& d : r->dumps) processes.emplace(d.host, d.pid, d.rank);
  if (processes.size() < 2) return;
  for (Dump& d : r->dumps) {
    const std::string of = d.rank >= 0 ? " of process " + std::to_string(d.rank) + " (pid " +
                                             std::to_string(d.pid) + ")"
                                       : " of pid " + std::to_string(d.pid);
    for (Call& c : d.calls) {
      if (local(c.group)) c.group += of;
    }
    for (MemberDecl& m : d.members) {
      if (local(m.group)) m.group += of;
    }
  }
}

}  // namespace

LoadResult load_dir(const std::string& dir) {
  LoadResult r;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) {
    const int err = errno;
    r.error = "cannot read directory '" + echo_text(dir, 200) + "': " + std::strerror(err);
    return r;
  }
  std::vector<std::string> names;
  errno = 0;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.size() > 5 && name.compare(name.size() - 5, 5, ".json") == 0) names.push_back(name);
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());
  r.files_seen = static_cast<int>(names.size());
  if (names.empty()) {
    r.error = "no flight record (*.json) in '" + echo_text(dir, 200) + "'";
    return r;
  }
  for (const std::string& name : names) {
    std::string text;
    std::string why = read_file(dir + "/" + name, &text);
    Dump dump;
    dump.file = name;
    if (why.empty() && parse_dump(text, &dump, &why)) {
      r.dumps.push_back(std::move(dump));
    } else {
      r.messages.push_back("skipping " + echo_text(name) + ": " + why);
      ++r.files_skipped;
    }
  }
  keep_newest_job(&r);
  key_local_groups(&r);
  resolve_duplicates(&r);
  if (r.dumps.empty()) {
    r.error = "no usable flight record in '" + echo_text(dir, 200) + "' (" +
              std::to_string(r.files_skipped) + " of " + std::to_string(r.files_seen) +
              " *.json files skipped)";
  }
  return r;
}

}  // namespace diststrat::trace
