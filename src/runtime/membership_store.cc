// The membership record and its two stores (membership_store.h): a directory
// (flock around read + atomic rename) and Redis (WATCH/MULTI/EXEC, hiredis;
// built with DISTSTRAT_HAVE_REDIS).
#include "runtime/membership_store.h"

#include <fcntl.h>
#include <dirent.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <set>
#include <sstream>
#include <thread>

#include "core/file_util.h"
#include "core/user_text.h"
#include "diststrat/error.h"

#if DISTSTRAT_HAVE_REDIS
#include <hiredis/hiredis.h>
#endif

namespace diststrat {

bool is_member_id_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
         c == '_' || c == ':' || c == '-';
}

namespace {
constexpr size_t kMaxIds = 100000;
constexpr size_t kMaxRecordBytes = 64 << 20;

bool valid_id(const std::string& id) {
  return !id.empty() && id.size() <= 256 && std::all_of(id.begin(), id.end(), is_member_id_char);
}

// Milliseconds left before `deadline` (at least 1).
constexpr size_t kMaxValueBytes = 64 << 10;

void check_key(const std::string& key, const std::string& store) {
  DISTSTRAT_CHECK(
      !key.empty() && key.size() <= 200 &&
          std::all_of(key.begin(), key.end(),
                      [](char c) { return (is_member_id_char(c) && c != ':') || c == '/'; }),
      kInvalidArgument, store, ": the key '", echo(key, 64), "' is not 1-200 of [A-Za-z0-9._/-]");
}

// The group number N of a key "g<N>/...", or -1.
int64_t key_group(const std::string& key) {
  if (key.size() < 3 || key[0] != 'g') return -1;
  size_t i = 1;
  int64_t n = 0;
  while (i < key.size() && i < 19 && key[i] >= '0' && key[i] <= '9') n = n * 10 + (key[i++] - '0');
  return i > 1 && i < key.size() && key[i] == '/' ? n : -1;
}

int64_t ms_left(MembershipStore::Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
      deadline - MembershipStore::Clock::now());
  return std::max<int64_t>(1, left.count());
}
}  // namespace

bool Membership::has_member(const std::string& id) const {
  return std::find(members.begin(), members.end(), id) != members.end();
}

bool Membership::has_arrived(const std::string& id) const {
  return std::find(arrived.begin(), arrived.end(), id) != arrived.end();
}

bool Membership::is_waiting(const std::string& id) const {
  return std::find(waiting.begin(), waiting.end(), id) != waiting.end();
}

bool Membership::is_dead(const std::string& id) const {
  return std::find(dead.begin(), dead.end(), id) != dead.end();
}

const Membership::Claim* Membership::claim_of(const std::string& id) const {
  for (const Claim& c : claims) {
    if (c.id == id) return &c;
  }
  return nullptr;
}

void Membership::set_claim(const std::string& id, const std::string& token, bool member) {
  for (Claim& c : claims) {
    if (c.id == id) {
      c.token = token;
      c.member = member;
      return;
    }
  }
  claims.push_back({id, token, member});
}

void Membership::drop_stale_claims() {
  claims.erase(std::remove_if(claims.begin(), claims.end(),
                              [&](const Claim& c) {
                                return !has_member(c.id) && !has_arrived(c.id) && !is_waiting(c.id);
                              }),
               claims.end());
}

void check_member_id(const std::string& id) {
  DISTSTRAT_CHECK(valid_id(id), kInvalidArgument, "worker id '", echo(id, 64),
                  "': 1-256 of [A-Za-z0-9._:-]");
}

std::string Membership::encode() const {
  std::string out = "diststrat-membership 1\ngeneration " + std::to_string(generation) +
                    "\ngroup " + std::to_string(group) + "\n";
  if (forming) out += "forming\n";
  if (finished) out += "finished\n";
  for (const std::string& m : members) out += "member " + m + "\n";
  for (const std::string& a : arrived) out += "arrived " + a + "\n";
  for (const std::string& w : waiting) out += "waiting " + w + "\n";
  for (const std::string& d : dead) out += "dead " + d + "\n";
  for (const Claim& c : claims) {
    out += "claim " + c.id + " " + c.token + (c.member ? " member\n" : " new\n");
  }
  return out;
}

Membership Membership::decode(const std::string& text, const std::string& where) {
  auto fail = [&](const std::string& why) -> void {
    throw DataLossError(where + ": the membership record is damaged: " + why);
  };
  Membership m;
  std::istringstream in(text);
  std::string line;
  if (!std::getline(in, line) || line != "diststrat-membership 1") {
    fail("no 'diststrat-membership 1' header");
  }
  bool have_generation = false, have_group = false;
  std::set<std::string> seen[4];
  size_t ids = 0;
  auto number = [&](const std::string& name, const std::string& value, bool* have) {
    if (*have || value.empty() || value.size() > 18 ||
        !std::all_of(value.begin(), value.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      fail(name + " '" + echo(value, 32) + "'");
    }
    *have = true;
    return std::stoll(value);
  };
  while (std::getline(in, line)) {
    const size_t sp = line.find(' ');
    const std::string key = line.substr(0, sp);
    const std::string value = sp == std::string::npos ? "" : line.substr(sp + 1);
    std::vector<std::string>* lists[4] = {&m.members, &m.arrived, &m.waiting, &m.dead};
    const char* names[4] = {"member", "arrived", "waiting", "dead"};
    const int list = key == "member"    ? 0
                     : key == "arrived" ? 1
                     : key == "waiting" ? 2
                     : key == "dead"    ? 3
                                        : -1;
    if (key == "generation") {
      m.generation = number("generation", value, &have_generation);
    } else if (key == "group") {
      m.group = number("group", value, &have_group);
    } else if (key == "claim") {
      // "claim ID TOKEN member|new"
      std::istringstream fields(value);
      Claim c;
      std::string kind, extra;
      fields >> c.id >> c.token >> kind;
      const bool token_ok = !c.token.empty() && c.token.size() <= 64 &&
                            std::all_of(c.token.begin(), c.token.end(), [](char ch) {
                              return (ch >= '0' && ch <= '9') || (ch >= 'a' && ch <= 'f');
                            });
      if (!valid_id(c.id) || !token_ok || (kind != "member" && kind != "new") ||
          (fields >> extra)) {
        fail("the claim '" + echo(value, 64) + "'");
      }
      if (m.claim_of(c.id) != nullptr) fail("the claim of " + c.id + " twice");
      if (++ids > kMaxIds) fail("more than 100000 ids");
      c.member = kind == "member";
      m.claims.push_back(c);
    } else if (line == "forming") {
      if (m.forming) fail("'forming' twice");
      m.forming = true;
    } else if (line == "finished") {
      if (m.finished) fail("'finished' twice");
      m.finished = true;
    } else if (list >= 0) {
      if (!valid_id(value)) fail("the id '" + echo(value, 64) + "'");
      if (++ids > kMaxIds) fail("more than 100000 ids");
      if (!seen[list].insert(value).second)
        fail(std::string("the ") + names[list] + " " + value + " twice");
      lists[list]->push_back(value);
    } else {
      fail("the line '" + echo(line, 64) + "'");
    }
  }
  if (!have_group) fail("no group");
  if (!have_generation) fail("no generation");
  return m;
}

namespace {

// <dir>/<job>: the record in <dir>/<job>.membership, written by atomic
// rename under an exclusive flock of <dir>/<job>.lock.
class FileMembershipStore : public MembershipStore {
 public:
  FileMembershipStore(std::string dir, std::string job, std::string url)
      : dir_(std::move(dir)), job_(std::move(job)), url_(std::move(url)) {}

  Membership transact(const std::function<bool(Membership&)>& change,
                      Clock::time_point deadline) override {
    // The probe's name is this thread's own: workers (threads and processes)
    // reach the directory at once.
    const std::string probe =
        "." + job_ + ".probe." + std::to_string(::getpid()) + "." +
        std::to_string(std::hash<std::thread::id>()(std::this_thread::get_id()));
    fs::ensure_writable_directory(dir_, probe, "membership store " + url_);
    const std::string lock_path = dir_ + "/" + job_ + ".lock";
    fs::Fd lock(::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644));
    if (lock.get() < 0) fs::throw_errno(errno, "membership store " + url_ + ": " + lock_path);
    // Bounded: a lock holder that hangs (a stopped process) must not hang us.
    while (::flock(lock.get(), LOCK_EX | LOCK_NB) != 0) {
      if (errno != EWOULDBLOCK && errno != EINTR) {
        fs::throw_errno(errno, "membership store " + url_ + ": flock " + lock_path);
      }
      if (Clock::now() >= deadline) {
        throw UnavailableError("membership store " + url_ + ": " + lock_path +
                               " stayed locked by another worker until the deadline");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    const std::string path = dir_ + "/" + job_ + ".membership";
    Membership m;
    if (::access(path.c_str(), F_OK) == 0) {
      fs::ReadOptions o;
      o.follow_symlinks = false;
      o.max_bytes = kMaxRecordBytes;
      m = Membership::decode(fs::read_text_file(path, "membership record of " + url_, o), url_);
    }
    Membership changed = m;
    if (change(changed)) {
      changed.generation = m.generation + 1;
      const std::string text = changed.encode();
      write_file_atomically(path, text.data(), text.size());
      return changed;  // the lock is released when `lock` closes
    }
    return m;
  }

  // Key k in <dir>/<job>.kv/<k with '/' as '+'>, written atomically.
  void put(const std::string& key, const std::string& value, Clock::time_point) override {
    check_key(key, url_);
    DISTSTRAT_CHECK(value.size() <= kMaxValueBytes, kInvalidArgument, url_, ": the value of '", key,
                    "' is over 64 KiB");
    const std::string kv = dir_ + "/" + job_ + ".kv";
    if (::mkdir(kv.c_str(), 0755) != 0 && errno != EEXIST) {
      fs::throw_errno(errno, "membership store " + url_ + ": mkdir " + kv);
    }
    write_file_atomically(kv + "/" + file_name(key), value.data(), value.size());
  }

  std::optional<std::string> get(const std::string& key, Clock::time_point) override {
    check_key(key, url_);
    const std::string path = dir_ + "/" + job_ + ".kv/" + file_name(key);
    if (::access(path.c_str(), F_OK) != 0) return std::nullopt;
    fs::ReadOptions o;
    o.follow_symlinks = false;
    o.max_bytes = kMaxValueBytes;
    return fs::read_text_file(path, "membership store value", o);
  }

  void erase_below(int64_t group) noexcept override {
    const std::string kv = dir_ + "/" + job_ + ".kv";
    DIR* d = ::opendir(kv.c_str());
    if (!d) return;
    std::vector<std::string> old;
    while (const dirent* e = ::readdir(d)) {
      std::string key = e->d_name;
      std::replace(key.begin(), key.end(), '+', '/');
      const int64_t n = key_group(key);
      if (n >= 0 && n < group) old.push_back(e->d_name);
    }
    ::closedir(d);
    for (const std::string& f : old) ::unlink((kv + "/" + f).c_str());
  }

  std::string describe() const override { return url_; }

 private:
  static std::string file_name(std::string key) {
    std::replace(key.begin(), key.end(), '/', '+');
    return key;
  }
  std::string dir_, job_, url_;
};

#if DISTSTRAT_HAVE_REDIS
// The record under key "diststrat:membership:<job>"; one connection per
// transaction (a worker changes membership rarely), every command bounded.
class RedisMembershipStore : public MembershipStore {
 public:
  RedisMembershipStore(std::string host, int port, std::string job, std::string url)
      : host_(std::move(host)),
        port_(port),
        key_("diststrat:membership:" + job),
        kv_prefix_("diststrat:kv:" + job + ":"),
        url_(std::move(url)) {}

  // Keys expire after an hour: they are read only while a group connects.
  void put(const std::string& key, const std::string& value, Clock::time_point deadline) override {
    check_key(key, url_);
    DISTSTRAT_CHECK(value.size() <= kMaxValueBytes, kInvalidArgument, url_, ": the value of '", key,
                    "' is over 64 KiB");
    Connection c = connect(deadline);
    command(c, deadline, {"SET", kv_prefix_ + key, value, "EX", "3600"});
  }

  std::optional<std::string> get(const std::string& key, Clock::time_point deadline) override {
    check_key(key, url_);
    Connection c = connect(deadline);
    Reply r = command(c, deadline, {"GET", kv_prefix_ + key});
    if (r->type == REDIS_REPLY_NIL) return std::nullopt;
    DISTSTRAT_CHECK(r->type == REDIS_REPLY_STRING && r->len <= kMaxValueBytes, kDataLoss, url_,
                    ": the value of '", key, "' is not a string of at most 64 KiB");
    return std::string(r->str, r->len);
  }

  void erase_below(int64_t) noexcept override {}  // they expire

  Membership transact(const std::function<bool(Membership&)>& change,
                      Clock::time_point deadline) override {
    for (;;) {
      Connection c = connect(deadline);
      command(c, deadline, {"WATCH", key_});
      Reply got = command(c, deadline, {"GET", key_});
      Membership m;
      if (got->type == REDIS_REPLY_STRING) {
        DISTSTRAT_CHECK(got->len <= kMaxRecordBytes, kDataLoss, url_,
                        ": the membership record is larger than 64 MiB");
        m = Membership::decode(std::string(got->str, got->len), url_);
      } else if (got->type != REDIS_REPLY_NIL) {
        throw DataLossError(url_ + ": GET " + key_ + " is not a string");
      }
      Membership changed = m;
      if (!change(changed)) return m;
      changed.generation = m.generation + 1;
      command(c, deadline, {"MULTI"});
      command(c, deadline, {"SET", key_, changed.encode()});
      Reply exec = command(c, deadline, {"EXEC"});
      if (exec->type == REDIS_REPLY_ARRAY) return changed;  // nil: another writer; again
      if (Clock::now() >= deadline) {
        throw UnavailableError(url_ + ": the membership record kept changing until the deadline");
      }
    }
  }

  std::string describe() const override { return url_; }

 private:
  struct Free {
    void operator()(redisContext* c) const { redisFree(c); }
    void operator()(redisReply* r) const { freeReplyObject(r); }
  };
  using Connection = std::unique_ptr<redisContext, Free>;
  using Reply = std::unique_ptr<redisReply, Free>;

  // Connects, retrying until the deadline (a server that restarts within it
  // is waited for).
  Connection connect(Clock::time_point deadline) {
    std::string why;
    for (;;) {
      const int64_t ms = std::min<int64_t>(ms_left(deadline), 1000);
      timeval tv{static_cast<time_t>(ms / 1000), static_cast<suseconds_t>((ms % 1000) * 1000)};
      Connection c(redisConnectWithTimeout(host_.c_str(), port_, tv));
      if (c && !c->err) return c;
      why = c ? c->errstr : "out of memory";
      if (Clock::now() >= deadline) {
        throw UnavailableError("membership store " + url_ + " cannot be reached: " + why);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }

  Reply command(Connection& c, Clock::time_point deadline, std::vector<std::string> args) {
    const int64_t ms = ms_left(deadline);
    timeval tv{static_cast<time_t>(ms / 1000), static_cast<suseconds_t>((ms % 1000) * 1000)};
    redisSetTimeout(c.get(), tv);
    std::vector<const char*> argv;
    std::vector<size_t> lens;
    for (const std::string& a : args) {
      argv.push_back(a.data());
      lens.push_back(a.size());
    }
    Reply r(static_cast<redisReply*>(
        redisCommandArgv(c.get(), static_cast<int>(argv.size()), argv.data(), lens.data())));
    if (!r) {
      throw UnavailableError("membership store " + url_ + ": " + args[0] +
                             " failed: " + (c->err ? c->errstr : "no reply"));
    }
    if (r->type == REDIS_REPLY_ERROR) {
      throw UnavailableError("membership store " + url_ + ": " + args[0] + ": " +
                             std::string(r->str, r->len));
    }
    return r;
  }

  std::string host_;
  int port_;
  std::string key_, kv_prefix_, url_;
};
#endif

bool job_name(const std::string& s) {
  return !s.empty() && s.size() <= 128 &&
         std::all_of(s.begin(), s.end(), [](char c) { return is_member_id_char(c) && c != ':'; });
}
}  // namespace

std::unique_ptr<MembershipStore> open_membership_store(const std::string& url) {
  auto bad = [&](const std::string& why) -> void {
    throw InvalidArgumentError("rendezvous URL '" + echo(url) + "': " + why +
                               " (redis://host:port/job or file:///dir/job)");
  };
  if (url.rfind("file://", 0) == 0) {
    const std::string path = url.substr(7);
    if (path.empty() || path[0] != '/') bad("not an absolute path after file://");
    const size_t slash = path.rfind('/');
    const std::string dir = slash == 0 ? "/" : path.substr(0, slash);
    const std::string job = path.substr(slash + 1);
    if (!job_name(job)) bad("the job name '" + echo(job, 64) + "': 1-128 of [A-Za-z0-9._-]");
    return std::make_unique<FileMembershipStore>(dir, job, url);
  }
  if (url.rfind("redis://", 0) == 0) {
    const std::string rest = url.substr(8);
    const size_t slash = rest.find('/');
    if (slash == std::string::npos) bad("no /job after host:port");
    const std::string hostport = rest.substr(0, slash), job = rest.substr(slash + 1);
    const size_t colon = hostport.rfind(':');
    if (colon == std::string::npos || colon == 0) bad("no host:port");
    const std::string host = hostport.substr(0, colon), port = hostport.substr(colon + 1);
    if (port.empty() || port.size() > 5 ||
        !std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; }) ||
        std::stoi(port) < 1 || std::stoi(port) > 65535) {
      bad("the port '" + echo(port, 16) + "'");
    }
    if (!std::all_of(host.begin(), host.end(),
                     [](char c) { return is_member_id_char(c) && c != ':'; })) {
      bad("the host '" + echo(host, 64) + "'");
    }
    if (!job_name(job)) bad("the job name '" + echo(job, 64) + "': 1-128 of [A-Za-z0-9._-]");
#if DISTSTRAT_HAVE_REDIS
    return std::make_unique<RedisMembershipStore>(host, std::stoi(port), job, url);
#else
    throw UnimplementedError("rendezvous URL '" + url +
                             "': this build has no Redis client (hiredis; DISTSTRAT_WITH_REDIS)");
#endif
  }
  bad("an unknown scheme");
  return nullptr;
}

}  // namespace diststrat
