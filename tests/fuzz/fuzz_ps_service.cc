// Fuzz target: a parameter-server Service fed sequences of requests, judged
// by what the service does with them (fuzz_ps_request judges the stateless
// decoder alone). Two raw workers (ranks 0 and 1; 0 is the chief) send
// requests built from the input -- creates, update rules, pushes with any
// floats, pulls, saves naming any file, broadcasts of any size, replays of
// earlier messages, headers with any sequence number and incarnation -- one
// at a time, each answered before the next. Findings, besides crashes,
// sanitizer reports, libFuzzer's memory limits and a reply that never comes:
//  - a replayed message (same worker, incarnation and sequence number as one
//    sent before) answered OK, or pushes applied more often than accepted;
//  - a push whose gradient holds a NaN or an infinity answered OK, or any
//    variable changed by it;
//  - any file written outside the PS's checkpoint directory, or inside it
//    under a name the PS did not derive (<stem>.ps-0-of-1.<hex>.safetensors);
//  - a broadcast larger than max_broadcast_bytes answered OK.
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "allreduce/transport.h"
#include "diststrat/error.h"
#include "diststrat/logging.h"
#include "parameter_server/service.h"
#include "parameter_server/shard_updater.h"
#include "parameter_server/wire.h"

namespace ds = diststrat;
namespace ps = diststrat::ps;
using std::chrono::milliseconds;

namespace {

void check(bool ok) {
  if (!ok) __builtin_trap();
}

constexpr int kPs = 2;
constexpr int64_t kMaxBroadcast = 1 << 16;
constexpr int64_t kMaxSent = 1 << 16;  // payloads and replies the driver moves

// Reads the input front to back; past its end, zeros.
class Input {
 public:
  Input(const uint8_t* d, size_t n) : d_(d), n_(n) {}
  bool empty() const { return i_ >= n_; }
  uint8_t byte() { return i_ < n_ ? d_[i_++] : 0; }
  template <typename T>
  T get() {
    T v{};
    uint8_t b[sizeof(T)] = {};
    for (auto& x : b) x = byte();
    std::memcpy(&v, b, sizeof v);
    return v;
  }
  std::string str(size_t max) {
    const size_t n = byte() % (max + 1);
    std::string s;
    for (size_t k = 0; k < n; ++k) s.push_back(static_cast<char>(byte()));
    return s;
  }
  // A size worth trying: small, at a boundary, or huge.
  int64_t size() {
    static const int64_t kInteresting[] = {0,
                                           4,
                                           8,
                                           16,
                                           24,
                                           40,
                                           kMaxBroadcast,
                                           kMaxBroadcast + 1,
                                           int64_t{1} << 20,
                                           int64_t{2} << 30,
                                           int64_t{1} << 40,
                                           (int64_t{1} << 40) + 1,
                                           -1,
                                           INT64_MAX};
    const uint8_t k = byte();
    if (k < 128) return k % 64;
    return kInteresting[k % (sizeof kInteresting / sizeof kInteresting[0])];
  }

 private:
  const uint8_t* d_;
  size_t n_;
  size_t i_ = 0;
};

struct Sent {
  int worker;
  std::vector<char> control, payload;
  ps::RequestHeader h;
  bool nonfinite_push = false;
};

struct Var {
  std::string name;
  ds::Shape shape;
};

class Harness {
 public:
  explicit Harness(const std::string& dir) : dir_(dir) {
    ps::ServiceOptions o;
    o.worker_ranks = {0, 1};
    // Deferred requests fail at this deadline; it must also outlast a slow
    // (sanitized, shared-core) driver between a reply header and its error text.
    o.timeout = milliseconds(150);
    o.worker_timeout = std::chrono::seconds(60);
    o.checkpoint_dir = dir_ + "/ckpt";
    o.max_broadcast_bytes = kMaxBroadcast;
    service_ = std::make_unique<ps::Service>(group_.at(kPs), o, logger_);
    thread_ = std::thread([this] {
      try {
        service_->run();
      } catch (const ds::Error&) {
        check(false);  // run() throws only when the transport fails
      }
    });
  }
  ~Harness() {
    service_->stop();
    thread_.join();
  }

  // Sends one request and waits for its reply; returns its status.
  int call(Sent s) {
    keep_.push_back(std::make_shared<Sent>(std::move(s)));
    Sent& m = *keep_.back();
    ds::Transport& t = group_.at(m.worker);
    sends_.push_back(t.send(kPs, m.control.data(), m.control.size(), ps::kRequestTag));
    if (!m.payload.empty())
      sends_.push_back(t.send(kPs, m.payload.data(), m.payload.size(), ps::kRequestPayloadTag));
    const auto deadline = ds::Clock::now() + std::chrono::seconds(10);  // a hang is a finding
    auto h = std::make_shared<ps::ReplyHeader>();
    t.recv(kPs, h.get(), sizeof *h, ps::kReplyTag).wait(deadline);
    check(h->error_bytes >= 0 && h->error_bytes <= ps::kMaxStringBytes);
    if (h->error_bytes > 0) {
      std::string text(static_cast<size_t>(h->error_bytes), '\0');
      t.recv(kPs, &text[0], text.size(), ps::kReplyErrorTag).wait(deadline);
    }
    // Replies are exactly what the request expects (the driver keeps that small).
    check(h->payload_bytes ==
              std::max<int64_t>(0, std::min<int64_t>(m.h.reply_bytes, ps::kMaxMessageBytes)) ||
          h->payload_bytes == 0);
    if (h->payload_bytes > 0) {
      std::vector<char> p(static_cast<size_t>(h->payload_bytes));
      t.recv(kPs, p.data(), p.size(), ps::kReplyPayloadTag).wait(deadline);
    }
    if (h->incarnation != 0) ps_incarnation_ = h->incarnation;
    return h->status;
  }

  uint64_t ps_incarnation_ = 0;
  ps::Service& service() { return *service_; }

 private:
  std::string dir_;
  ds::InProcessTransportGroup group_{3};
  ds::Logger logger_{ds::LogLevel::kError};
  std::vector<std::shared_ptr<Sent>> keep_;  // the transport may read them until the end
  std::vector<ds::Request> sends_;
  std::unique_ptr<ps::Service> service_;
  std::thread thread_;
};

// The files under `dir`, recursively, relative to it.
void list_files(const std::string& dir, const std::string& rel, std::vector<std::string>& out) {
  DIR* d = opendir(dir.c_str());
  if (!d) return;
  while (dirent* e = readdir(d)) {
    const std::string n = e->d_name;
    if (n == "." || n == "..") continue;
    const std::string path = dir + "/" + n;
    out.push_back(rel + n);
    if (e->d_type == DT_DIR) list_files(path, rel + n + "/", out);
  }
  closedir(d);
}

void remove_tree(const std::string& dir) {
  std::vector<std::string> files;
  list_files(dir, "", files);
  for (auto it = files.rbegin(); it != files.rend(); ++it) {
    const std::string p = dir + "/" + *it;
    if (::unlink(p.c_str()) != 0) ::rmdir(p.c_str());
  }
}

bool derived_name(const std::string& n) {
  // <stem>.ps-0-of-1.<16 hex>.safetensors, or the writer's temporary of it.
  const std::string mid = ".ps-0-of-1.";
  const size_t at = n.find(mid);
  if (at == std::string::npos || !ps::valid_file_stem(n.substr(0, at))) return false;
  const std::string rest = n.substr(at + mid.size());
  if (rest.size() < 16 + 12) return false;
  for (size_t k = 0; k < 16; ++k) {
    if (!std::isxdigit(static_cast<unsigned char>(rest[k]))) return false;
  }
  return rest.compare(16, 12, ".safetensors") == 0;
}

std::vector<float> floats_of(const ps::Service& s) {
  std::vector<float> out;
  for (const ds::ShardSnapshot& snap : s.snapshot()) {
    if (snap.value.dtype() != ds::DType::kFloat32) continue;
    const float* p = snap.value.data<float>();
    out.insert(out.end(), p, p + snap.value.num_elements());
  }
  return out;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

std::string scratch_dir() {
  static const std::string dir = [] {
    char tmpl[] = "/tmp/fuzz_ps_service.XXXXXX";
    const char* d = ::mkdtemp(tmpl);
    check(d != nullptr);
    return std::string(d);
  }();
  return dir;
}

void write_entry(ps::Writer& w, int64_t id, const std::string& name, const ds::Shape& shape,
                 bool sparse, int64_t ids) {
  ps::Entry e;
  e.var_id = id;
  e.name = name;
  e.dtype = static_cast<int32_t>(ds::DType::kFloat32);
  e.shape = shape;
  e.sparse = sparse ? 1 : 0;
  e.num_ids = ids;
  ps::write_entry(w, e);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string dir = scratch_dir();
  remove_tree(dir);
  ::mkdir((dir + "/ckpt").c_str(), 0700);
  Input in(data, size);
  Harness hs(dir);
  std::vector<Var> vars = {{"w", ds::Shape{4}}, {"emb", ds::Shape{6, 2}}, {"b", ds::Shape{}}};
  std::vector<std::shared_ptr<Sent>> sent;
  std::set<std::tuple<int, uint64_t, int64_t>> taken;  // (worker, incarnation, seq) answered OK
  int64_t seq[2] = {1, 1};
  int64_t accepted_pushes = 0;
  bool aborted = false;  // worker 1 failed (kAbort served)
  const uint64_t incarnation[2] = {100, 200};
  for (int n = 0; n < 24 && !in.empty(); ++n) {
    const uint8_t cmd = in.byte();
    const int worker = in.byte() & 1;
    Sent s;
    s.worker = worker;
    ps::RequestHeader& h = s.h;
    h.worker = worker;
    h.incarnation = incarnation[worker];
    h.seq = seq[worker]++;
    ps::Writer w;
    std::vector<char> payload;
    const Var& v = vars[in.byte() % vars.size()];
    const int64_t vid = &v - vars.data();
    switch (cmd % 10) {
      case 0: {  // create, the chief with a value
        h.op = static_cast<uint16_t>(ps::Op::kCreate);
        const bool value = worker == 0 || (in.byte() & 1);
        w.put<int64_t>(vid).put_string(v.name).put<int32_t>(0).put_shape(v.shape);
        w.put<int64_t>(0).put<int64_t>(1).put<int64_t>(0).put<int64_t>(v.shape.rank() ? v.shape[0]
                                                                                      : 1);
        w.put<uint8_t>(value ? 1 : 0);
        if (value) {
          for (int64_t k = 0; k < v.shape.num_elements(); ++k) {
            const float f = static_cast<float>(in.byte()) - 100.0f;
            const char* p = reinterpret_cast<const char*>(&f);
            payload.insert(payload.end(), p, p + 4);
          }
        }
        break;
      }
      case 1: {  // an update rule with any parameters
        h.op = static_cast<uint16_t>(ps::Op::kRule);
        w.put<uint8_t>(in.byte() & 1);
        ps::OptimizerConfig c;
        c.name = (in.byte() & 1) ? "sgd" : "adam";
        const size_t np = (c.name == "sgd" ? 3 : 4) + (in.byte() % 8 == 0 ? in.byte() % 12 : 0);
        for (size_t k = 0; k < np; ++k)
          c.params.push_back(in.byte() < 200 ? in.byte() / 256.0 : in.get<double>());
        ps::write_config(w, c);
        w.put<int64_t>(1);
        write_entry(w, vid, v.name, {}, false, 0);
        break;
      }
      case 2:
      case 3: {  // a push: floats from the input, NaN and infinities included
        h.op = static_cast<uint16_t>(ps::Op::kPush);
        const bool sparse = v.shape.rank() == 2 && (in.byte() & 1);
        w.put<int64_t>(in.byte() % 4).put<int64_t>(-1).put<int64_t>(-1).put_string("");
        w.put<int64_t>(1);
        ds::Shape g = v.shape;
        int64_t ids = 0;
        if (sparse) {
          ids = in.byte() % 3;
          g = ds::Shape{ids, 2};
          for (int64_t k = 0; k < ids; ++k) {
            const int64_t id = static_cast<int64_t>(in.byte() % 8) - 1;
            const char* p = reinterpret_cast<const char*>(&id);
            payload.insert(payload.end(), p, p + 8);
          }
        }
        write_entry(w, vid, v.name, g, sparse, ids);
        for (int64_t k = 0; k < g.num_elements(); ++k) {
          const uint8_t b = in.byte();
          const float f = b == 255   ? NAN
                          : b == 254 ? INFINITY
                          : b == 253 ? -INFINITY
                          : b == 252 ? in.get<float>()
                                     : static_cast<float>(b) / 16.0f;
          s.nonfinite_push |= !std::isfinite(f);
          const char* p = reinterpret_cast<const char*>(&f);
          payload.insert(payload.end(), p, p + 4);
        }
        break;
      }
      case 4: {  // a pull of a whole variable
        h.op = static_cast<uint16_t>(ps::Op::kPull);
        w.put<int64_t>(-1).put<int64_t>(1);
        write_entry(w, vid, v.name, {}, false, 0);
        h.reply_bytes = v.shape.num_elements() * 4;
        break;
      }
      case 5: {  // a save naming any "stem": paths, "..", NULs
        h.op = static_cast<uint16_t>(ps::Op::kSave);
        std::string stem = in.str(24);
        static const char* const kNames[] = {"model", "../victim", "/tmp/x", "..",
                                             "a/b",   ".x",        "ckpt-1"};
        if (stem.empty() || (in.byte() & 1)) stem = kNames[in.byte() % 7];
        w.put_string(stem).put<uint64_t>(in.get<uint64_t>());
        static const char* const kDirs[] = {"", "/tmp", "..", ""};
        w.put_string(kDirs[in.byte() % 4]);
        h.reply_bytes = 8;
        break;
      }
      case 6: {  // a broadcast of any claimed size
        h.op = static_cast<uint16_t>(ps::Op::kBroadcast);
        const bool root = in.byte() & 1;
        const int64_t count = 1 + in.byte() % 3;
        int64_t bytes = in.size();
        if (!root && (bytes < 0 || bytes > kMaxSent)) bytes = kMaxSent;
        w.put<int64_t>(count).put<uint8_t>(root ? 1 : 0).put<int64_t>(bytes);
        if (root && bytes > 0 && bytes <= kMaxSent) payload.assign(static_cast<size_t>(bytes), 'b');
        if (!root) h.reply_bytes = bytes;
        // A root claiming more than it sends: the PS must refuse before allocating.
        h.payload_bytes = root ? bytes : 0;
        break;
      }
      case 7: {  // replay an earlier message verbatim
        if (sent.empty()) continue;
        --seq[worker];
        const Sent& old = *sent[in.byte() % sent.size()];
        Sent again = old;
        const int status = hs.call(again);
        check(status != -1);  // a message is served at most once
        continue;
      }
      case 8: {  // a header with any sequence number or incarnation
        h.op = static_cast<uint16_t>(ps::Op::kPull);
        w.put<int64_t>(-1).put<int64_t>(1);
        write_entry(w, vid, v.name, {}, false, 0);
        h.reply_bytes = v.shape.num_elements() * 4;
        h.seq = in.get<int64_t>();
        if (in.byte() & 1) h.incarnation = in.get<uint64_t>();
        break;
      }
      case 9: {  // barrier, stats, preemption check, heartbeat, abort
        const uint8_t k = in.byte() % 5;
        if (k == 3 || (k == 4 && (worker != 1 || aborted))) {
          h.op = static_cast<uint16_t>(ps::Op::kAlive);
        } else if (k == 4) {
          // Worker 1 fails (once: the loop ends when both workers have left).
          h.op = static_cast<uint16_t>(ps::Op::kAbort);
          w.put_string(in.byte() & 1 ? "rank 1 left during an exception" : "");
        } else if (k == 0) {
          h.op = static_cast<uint16_t>(ps::Op::kBarrier);
          w.put<int64_t>(in.byte() % 3);
        } else if (k == 1) {
          h.op = static_cast<uint16_t>(ps::Op::kStats);
          h.reply_bytes = (7 + 2) * 8;
        } else {
          h.op = static_cast<uint16_t>(ps::Op::kStopCheck);
          w.put<int64_t>(in.byte()).put<uint8_t>(0);
          h.reply_bytes = 8;
        }
        break;
      }
    }
    if (h.op != static_cast<uint16_t>(ps::Op::kBroadcast))
      h.payload_bytes = static_cast<int64_t>(payload.size());
    // The PS incarnation as a Client stamps it, or (rarely) none or a wrong one.
    const uint8_t pi = in.byte();
    h.ps_incarnation = pi < 240 ? hs.ps_incarnation_ : pi < 248 ? 0 : hs.ps_incarnation_ + 1;
    s.control.resize(sizeof h + w.bytes().size());
    std::memcpy(s.control.data(), &h, sizeof h);
    if (!w.bytes().empty())
      std::memcpy(s.control.data() + sizeof h, w.bytes().data(), w.bytes().size());
    s.payload = payload;

    const std::vector<float> before = floats_of(hs.service());
    const int64_t version_before = hs.service().stats().version;
    const int status = hs.call(s);
    const std::vector<float> after = floats_of(hs.service());
    const int64_t version_after = hs.service().stats().version;
    const bool ok = status == -1;
    const ps::Op op = static_cast<ps::Op>(h.op);
    if (ok) {
      check(taken.insert({worker, h.incarnation, h.seq}).second);  // served once
      // After a worker failed, nothing but leaving is served.
      if (aborted) check(op == ps::Op::kDone || op == ps::Op::kAbort);
      if (op == ps::Op::kAbort) {
        aborted = true;
        check(hs.service().failure().find("worker 1 (rank 1) failed: ") == 0);
      }
      if (op == ps::Op::kPush) {
        ++accepted_pushes;
        check(!s.nonfinite_push);  // a non-finite gradient is never accepted
      }
      if (op == ps::Op::kBroadcast)
        check(h.payload_bytes <= kMaxBroadcast && h.reply_bytes <= kMaxBroadcast);
    }
    if (op == ps::Op::kPush && s.nonfinite_push)
      check(same_bits(before, after) && version_after == version_before);
    if (op == ps::Op::kPull || op == ps::Op::kSave || op == ps::Op::kBroadcast)
      check(same_bits(before, after));
    check(version_after <= accepted_pushes);
    sent.push_back(std::make_shared<Sent>(s));
    // Nothing but the checkpoint directory, and only derived names in it.
    std::vector<std::string> files;
    list_files(dir, "", files);
    for (const std::string& f : files) {
      if (f == "ckpt") continue;
      check(f.compare(0, 5, "ckpt/") == 0 && f.find('/', 5) == std::string::npos &&
            derived_name(f.substr(5)));
    }
  }
  return 0;
}
