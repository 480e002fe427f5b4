// The parameter-server service: the loop a PS rank runs on its dedicated
// thread. It holds this rank's variable shards (value, optimizer slots and a
// per-shard step counter), receives requests from every worker over the
// Transport, and answers them (see wire.h for the protocol).
//
// The loop never blocks on one worker: requests are queued per worker and
// served in each worker's order; a request that must wait (a pull held back
// by the staleness bound, a barrier, a variable the chief has not created
// yet) stays at the head of that worker's queue until it can be served or
// its deadline passes, while the other workers are served. A request the PS
// rejects (malformed, or a shape, size, dtype, variable or row id that
// disagrees with its shards) is answered with an error naming the worker
// and changes nothing; it is checked before its payload is allocated, and a
// payload that does not arrive within the deadline fails its request.
//
// The PS trusts no worker further than its own checks (see wire.h for the
// sequence numbers and incarnations that make each request served at most
// once, in order):
//  - each variable's update rule is declared by a kRule request and fixed by
//    the chief's (worker 0's) declaration; another worker's declaration must
//    match it field by field, and only the chief may replace it
//    (update_hyperparameters). Pushes carry gradients, never the rule; a
//    schedule is evaluated from the shard's own step counter;
//  - a push with a non-finite gradient is rejected (or, with
//    skip_nonfinite_gradients, answered OK but not applied, and counted):
//    it never reaches a variable;
//  - a save names only a file stem: the PS writes into its own configured
//    checkpoint directory, under a name it derives;
//  - a broadcast declares its size, which is checked against
//    max_broadcast_bytes (and the root's against the receivers') before
//    anything is allocated; only the chief sends a create with a value.
//
// Silence and waits are measured in the loop's running time: a gap between
// two polls longer than kMaxPollGap (the PS process was stopped, or its
// host starved it) counts as kMaxPollGap, so a PS that was not running does
// not declare its workers gone or their waits expired.
#pragma once

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "allreduce/transport.h"
#include "diststrat/logging.h"
#include "diststrat/parameter_server.h"
#include "parameter_server/shard_updater.h"
#include "parameter_server/messages.h"
#include "parameter_server/wire.h"

namespace diststrat {
namespace ps {

// The longest gap between two polls of the loop that counts as running time.
constexpr std::chrono::milliseconds kMaxPollGap{100};

struct ServiceOptions {
  std::vector<int> worker_ranks;  // transport ranks of the workers, by worker index
  int max_staleness = -1;         // < 0: unbounded
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
  // A worker silent this long is treated as gone (see ParameterServerOptions).
  std::chrono::milliseconds worker_timeout{std::chrono::seconds(300)};
  // This PS's index among the PS ranks and their number (they name its
  // checkpoint shard files).
  int ps_index = 0;
  int num_ps = 1;
  // The only directory the PS writes checkpoint shards into (empty: saves
  // are refused until set_checkpoint_dir is called in this process).
  std::string checkpoint_dir;
  // A push with a NaN or infinite gradient: rejected (false), or answered OK,
  // not applied and counted in ServiceStats::pushes_nonfinite (true).
  bool skip_nonfinite_gradients = false;
  // The most broadcast bytes PS 0 holds at once (deposited, or announced by
  // a root whose payload is on its way); a larger broadcast is rejected.
  int64_t max_broadcast_bytes = int64_t{256} << 20;
  // Test seam: the clock the loop reads to measure silence (empty: the
  // steady clock). A test makes it jump to stand for a PS that was stopped.
  std::function<Clock::time_point()> clock;
};

struct ServiceStats {
  int64_t version = 0;  // pushes applied
  int64_t pushes_rejected = 0;
  int64_t pushes_nonfinite = 0;  // skipped for a non-finite gradient (skip_nonfinite_gradients)
  int64_t staleness_sum = 0;
  int64_t staleness_max = 0;
  int64_t max_step_gap = 0;
  std::vector<int64_t> worker_steps;
};

class Service {
 public:
  Service(Transport& transport, ServiceOptions options, const Logger& logger);
  ~Service();

  // Serves until every worker has said done (or was declared gone after
  // worker_timeout of silence), or stop() is called. Throws only on failures of
  // the transport itself.
  void run();
  // Makes run() return soon. Thread-safe.
  void stop() { stop_ = true; }

  // Thread-safe views for tests, stats and checkpoints.
  ServiceStats stats() const;
  std::vector<ShardSnapshot> snapshot() const;
  // Before the workers create their variables: shards to resume from.
  void restore(const std::vector<ShardSnapshot>& shards);
  // Worker indices declared gone (silent past the timeout).
  std::vector<int> gone_workers() const;
  // "worker W (rank R) failed: <its reason>" once a worker left with kAbort
  // (the first one), or what fail() was given; empty otherwise. From then on
  // every other worker's request is answered with AbortedError naming it,
  // and run() ends when every worker has left. Thread-safe.
  std::string failure() const;
  // The same for a failure of this PS itself ("PS rank P failed: ...").
  // Thread-safe.
  void fail(const std::string& reason);
  // The directory checkpoint shards go to (a call in this process, never a
  // request: a single-process strategy sets it to its save's directory).
  // Thread-safe.
  void set_checkpoint_dir(const std::string& dir);
  // Updaters built from kRule configs so far (a test reads that a variable's
  // rule is built once, not per declaration or push). Thread-safe.
  int64_t updaters_built() const;
  // This Service's incarnation (sent in every reply).
  uint64_t incarnation() const { return incarnation_; }

 private:
  struct Shard {
    std::string name;
    DType dtype = DType::kFloat32;
    Shape full_shape;
    int64_t num_shards = 1, row_offset = 0, rows = 0;
    Tensor value;
    std::map<std::string, Tensor> slots;
    int64_t step = 0;
    bool initialized = false;
    // The update rule (kRule): fixed by the chief's declaration; `declared`
    // is what the chief declared first (every other declaration must match
    // it), `config` what is applied now (update_hyperparameters may change
    // it), `rule` its updater, built when `config` changes (never per push).
    std::shared_ptr<const ShardUpdater> rule;
    OptimizerConfig declared, config;
  };
  struct Pending {
    RequestHeader header;
    DecodedRequest request;  // decoded and checked on arrival
    std::vector<char> payload;
    size_t received = 0;  // payload bytes in so far (it may come in parts)
    bool payload_ready = false;
    std::string error;  // set when its payload came wrong: answered with it
    Clock::time_point arrived;
    std::shared_ptr<const ShardUpdater> updater;  // kRule: its config's, once looked up
  };
  struct WorkerState {
    int rank = -1;
    int index = 0;
    int64_t steps = 0;  // pushes applied from it
    int64_t barrier_count = 0;
    int64_t broadcast_count = 0;    // broadcasts it has completed
    int64_t checked_step = -1;      // the last step it asked kStopCheck about
    int64_t push_reached = -1;      // lockstep: last step whose push reached its queue's head
    uint64_t incarnation = 0;       // of the worker's requests taken so far (0: none)
    int64_t last_seq = 0;           // the last sequence number taken from that incarnation
    int64_t broadcast_arrived = 0;  // the last broadcast count it sent
    bool done = false;
    bool gone = false;
    Clock::time_point last_heard;
    std::deque<Pending> queue;
  };
  struct Outgoing {
    std::shared_ptr<ReplyHeader> header;
    std::shared_ptr<std::string> error;
    std::shared_ptr<const void> payload;  // a vector, or zeros that take no memory
    std::vector<Request> requests;
    int rank = -1;
    Clock::time_point posted;  // a reply not taken within the timeout is given up
  };
  enum class Outcome { kServed, kDeferred };
  struct Reply {
    std::vector<char> payload;
  };

  // Advances the loop's running time (see above): called before every
  // check of silence or of a wait.
  void tick();
  bool receive_new();
  // Checks a decoded request against the shards (or the shards this
  // worker's queued creates declare), before its payload is allocated;
  // throws like the handlers do. Caller holds mu_.
  void check_on_arrival(const WorkerState& w, const DecodedRequest& q) const;
  // Takes the request's sequence number and incarnations (at most once, in
  // order); throws naming the worker otherwise. Caller holds mu_.
  void check_sequence(WorkerState& w, const RequestHeader& h);
  // Broadcast bytes held and announced (deposits, roots' queued payloads).
  int64_t broadcast_bytes_held() const;
  // Receives and drops a message nobody expects.
  void discard(const Envelope& env);
  // Receives one payload message (a part) of worker `w`'s latest request.
  void receive_payload(WorkerState& w, const Envelope& env);
  bool process_queues();
  void reap_outgoing();
  void check_liveness();
  bool finished() const;
  bool waiting_for_payload() const;

  // Handlers: fill `reply` and return kServed, or kDeferred (nothing changed).
  Outcome handle(WorkerState& w, Pending& p, Reply& reply);
  Outcome handle_create(WorkerState& w, Pending& p);
  Outcome handle_pull(WorkerState& w, Pending& p, Reply& reply);
  void handle_push(WorkerState& w, Pending& p);
  // max_staleness 0: whether push `p` must wait for the other workers' pushes
  // of its step.
  bool lockstep_holds(WorkerState& w, const Pending& p);
  void handle_assign(WorkerState& w, Pending& p);
  Outcome handle_barrier(WorkerState& w, Pending& p);
  void handle_stats(Reply& reply);
  Outcome handle_broadcast(WorkerState& w, Pending& p, Reply& reply);
  void handle_stop_check(WorkerState& w, Pending& p, Reply& reply);
  void handle_save(Pending& p, Reply& reply);
  Outcome handle_rule(WorkerState& w, Pending& p);
  // The updater of a kRule's config: the one a shard it names applies
  // already when that shard's config is the same (same_config), else built
  // (which validates the config; throws like make_shard_updater). Caller
  // holds mu_.
  std::shared_ptr<const ShardUpdater> updater_for(const DecodedRequest& q);
  void handle_read_slots(Pending& p, Reply& reply);
  void handle_restore(Pending& p);
  void handle_metric(Pending& p, Reply& reply);
  void handle_abort(WorkerState& w, const Pending& p);
  std::vector<ShardSnapshot> snapshot_locked() const;

  Shard& find_shard(const Entry& e, const std::string& what);
  // Who sent a request: "PS rank 2: push from worker 1".
  std::string from(const WorkerState& w, uint16_t op) const;
  // Slowest live worker other than `except` (index), or -1 when none.
  int slowest_other(int except) const;
  // Sends header, error text and payload; the payload is always exactly
  // `reply_bytes` (what the request expects): zeros after an error.
  void send_reply(int rank, const RequestHeader& request, int status, std::vector<char> payload,
                  std::string error);
  std::string who() const;
  Clock::time_point now() const { return options_.clock ? options_.clock() : Clock::now(); }

  Transport& t_;
  ServiceOptions options_;
  uint64_t incarnation_ = 0;
  // Without a configured checkpoint directory: the one the first save named,
  // the only one later saves may name.
  std::string adopted_dir_;
  const Logger& logger_;
  std::atomic<bool> stop_{false};
  std::vector<WorkerState> workers_;
  std::map<int, int> worker_of_rank_;
  std::deque<Outgoing> outgoing_;
  Clock::time_point last_tick_;
  // Buffers of replies given up on: the transport may still read them.
  std::vector<Outgoing> abandoned_;
  size_t next_worker_ = 0;  // round-robin start

  mutable std::mutex mu_;  // guards everything below (read by other threads)
  std::map<std::pair<int64_t, int64_t>, Shard> shards_;  // (var id, shard index)
  std::map<std::pair<std::string, int64_t>, ShardSnapshot> restored_;
  ServiceStats stats_;
  // Broadcasts deposited by their root, until every live worker has them.
  std::map<int64_t, std::vector<char>> broadcasts_;
  // Preemption: the step every worker stops at (-1: none yet).
  int64_t stop_at_ = -1;
  // The first worker failure (kAbort), see failure().
  std::string failure_;
  int64_t updaters_built_ = 0;  // see updaters_built()
  // Job-wide metrics (PS 0): name -> (sum, count) over every worker's additions.
  std::map<std::string, std::pair<double, double>> metrics_;
};

}  // namespace ps
}  // namespace diststrat
