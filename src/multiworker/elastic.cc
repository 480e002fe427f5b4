// Elastic MultiWorkerMirroredStrategy (diststrat/elastic.h): joining and
// leaving groups (rendezvous, Gloo TCP transport), the commit at every step,
// and ElasticState::run's recovery: restore, re-form, state from a member.
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <thread>

#include "allreduce/flight_recording.h"
#include "allreduce/transport_communicator.h"
#include "core/flight_recorder.h"
#include "core/random_id.h"
#include "diststrat/config.h"
#if DISTSTRAT_HAVE_GLOO
#include "allreduce/gloo_transport.h"
#endif
#include "core/env.h"
#include "diststrat/checkpoint.h"
#include "diststrat/cpu_isa.h"
#include "diststrat/optimizer.h"
#include "io/checkpoint_internal.h"
#include "multiworker/multi_worker_impl.h"

namespace diststrat {

namespace {

using SteadyClock = std::chrono::steady_clock;

#if DISTSTRAT_HAVE_GLOO
// The connection addresses of group g<N> under the store's keys "g<N>/...".
class StoreAddressExchange : public AddressExchange {
 public:
  explicit StoreAddressExchange(MembershipStore& store) : store_(store) {}
  void publish(const std::string& key, const std::string& value,
               Clock::time_point deadline) override {
    store_.put(store_key(key), value, deadline);
  }
  std::string wait_for(const std::string& key, Clock::time_point deadline) override {
    for (;;) {
      if (std::optional<std::string> v = store_.get(store_key(key), deadline)) return *v;
      if (Clock::now() >= deadline) {
        throw DeadlineExceededError("elastic: '" + key + "' was not published in " +
                                    store_.describe() + " before the deadline");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }

 private:
  static std::string store_key(std::string key) {
    for (char& c : key) {
      if (c != '/' && (c == ':' || !is_member_id_char(c))) c = '_';
    }
    return key;
  }
  MembershipStore& store_;
};
#endif

std::string default_worker_id() {
  if (std::optional<std::string> id = env::text("DISTSTRAT_WORKER_ID")) {
    try {
      check_member_id(*id);
    } catch (const Error& e) {
      throw InvalidArgumentError("DISTSTRAT_WORKER_ID: " + e.message());
    }
    return *id;
  }
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) != 0 || host[0] == '\0') std::strcpy(host, "host");
  std::string id = std::string(host) + "-" + std::to_string(::getpid());
  for (char& c : id) {
    if (c == ':' || !is_member_id_char(c)) c = '_';
  }
  return id;
}

// A collective error that means the group is gone (a peer died, stopped or
// aborted), as opposed to a bug or bad input, which leave run() as they are.
bool lost_peer(const Error& e) {
  return e.code() == ErrorCode::kAborted || e.code() == ErrorCode::kUnavailable ||
         e.code() == ErrorCode::kDeadlineExceeded;
}

constexpr const char* kElasticPrefix = "diststrat.elastic.";

// While it lives, Strategy::run calls made by this file (Checkpoint::state
// and assign run steps to read and write optimizer slots) are not training
// steps: no commit, no look for joiners.
class InternalSteps {
 public:
  explicit InternalSteps(ElasticRuntime& e) : e_(e), was_(e.committing) { e_.committing = true; }
  ~InternalSteps() { e_.committing = was_; }
  InternalSteps(const InternalSteps&) = delete;
  InternalSteps& operator=(const InternalSteps&) = delete;

 private:
  ElasticRuntime& e_;
  bool was_;
};

}  // namespace

ElasticRuntime::ElasticRuntime(const ElasticOptions& o, const CommunicationOptions& communication)
    : options(o) {
  using std::chrono::milliseconds;
  for (const auto& [name, value] :
       {std::pair<const char*, milliseconds>{"settle_timeout", o.settle_timeout},
        {"join_timeout", o.join_timeout},
        {"join_poll", o.join_poll},
        {"communication.timeout", communication.timeout}}) {
    env::check_timeout(value, "elastic (" + o.rendezvous + "): " + name);
  }
#if !DISTSTRAT_HAVE_GLOO
  throw UnimplementedError("elastic training (rendezvous " + o.rendezvous +
                           "): this build has no Gloo (DISTSTRAT_WITH_GLOO), whose TCP transport "
                           "carries elastic groups");
#endif
  RendezvousOptions r;
  r.min_workers = o.min_workers;
  r.max_workers = o.max_workers;
  r.settle = o.settle_timeout;
  r.store_timeout = communication.timeout;
  rendezvous = std::make_unique<ElasticRendezvous>(
      open_membership_store(o.rendezvous), o.worker_id.empty() ? default_worker_id() : o.worker_id,
      r);
}

void MultiWorkerMirroredStrategy::Impl::join_group(SteadyClock::time_point deadline) {
  ElasticRuntime& e = *elastic;
  for (;;) {
    std::optional<GroupView> view = e.rendezvous->join(e.in_group ? &e.view : nullptr, deadline);
    if (!view) {
      // Declared dead while it was away: it comes back as a new worker, and
      // takes the group's state like one.
      const std::string was = e.rendezvous->id();
      const size_t r = was.rfind(".r");
      e.rendezvous->set_id((r == std::string::npos ? was : was.substr(0, r)) + ".r" +
                           std::to_string(++e.rejoins));
      self->logger().warning("elastic: worker '", was, "' was declared dead in ",
                             e.rendezvous->store().describe(),
                             " (it did not arrive at a round in time); joining again as '",
                             e.rendezvous->id(), "', a new worker");
      e.in_group = false;
      DISTSTRAT_CHECK(SteadyClock::now() < deadline, kUnavailable, "elastic: worker '", was,
                      "' found no group before the deadline");
      continue;
    }
    e.view = *view;
    e.in_group = true;
#if DISTSTRAT_HAVE_GLOO
    const int size = static_cast<int>(e.view.members.size());
    GlooTransportOptions go;
    go.group = "g" + std::to_string(e.view.group);
    go.listen_host = e.options.listen_host;
    try {
      StoreAddressExchange exchange(e.rendezvous->store());
      // The group's flight-record nonce (flight::set_nonce): its rank 0's,
      // published before it connects, so it is there once the group is.
      const std::string nonce_key = go.group + "/flight-nonce";
      const Clock::time_point setup_deadline =
          std::min(deadline, Clock::now() + options.communication.timeout);
      if (e.view.rank == 0) {
        exchange.publish(nonce_key, std::to_string(random_id()), setup_deadline);
      }
      std::unique_ptr<Transport> t =
          make_gloo_transport(e.view.rank, size, exchange, go,
                              std::min(deadline, Clock::now() + options.communication.timeout));
      Transport& ref = *t;
      // Ranks that share a host are one node: kAuto (and kHierarchical)
      // then cross the network once per host, whatever order the workers
      // arrived in (a flat ring in arrival order could cross it at every
      // step: h0 h1 h0 h1).
      std::vector<int> node_of = gloo_node_of(ref);
      comms.cross = wrap_recorded(std::make_unique<TransportCommunicator>(
                                      ref, options.communication, std::move(node_of), std::move(t)),
                                  "elastic g" + std::to_string(e.view.group));
      // The job's processes find each other's flight records by the URL.
      flight::set_job(e.options.rendezvous);
      flight::set_nonce(
          std::strtoull(exchange.wait_for(nonce_key, setup_deadline).c_str(), nullptr, 10));
      flight::set_process(e.view.rank, size);
      comms.hierarchical = false;
      cross = comms.cross.get();
      set_explicit_cluster(e.view.rank, size);
      // The group's first collective: a member lost now re-forms too.
      number_replicas(static_cast<int64_t>(options.devices.size()));
      return;
    } catch (const Error& err) {
      comms.cross.reset();
      cross = nullptr;
      if (!lost_peer(err) || Clock::now() >= deadline) throw;
      // A member died between the round and the connection: form again.
      self->logger().warning("elastic: worker '", e.rendezvous->id(),
                             "' could not connect to group ", e.view.group, ": ", err.message(),
                             "; forming again");
    }
#endif
  }
}

void MultiWorkerMirroredStrategy::Impl::leave_group(const std::string& reason) {
  if (engine) engine->abort(reason);
  engine.reset();  // joins the communication thread
  if (comms.cross) comms.cross->abort(reason);
  comms.cross.reset();  // closes the connections: the peers learn at once
  cross = nullptr;
}

// ---- ElasticState ---------------------------------------------------------------

struct ElasticState::Impl {
  Impl(MultiWorkerMirroredStrategy& s, std::vector<const Optimizer*> opts)
      : strategy(s), m(*s.impl_), optimizers(opts), checkpoint(s, std::move(opts)) {}

  MultiWorkerMirroredStrategy& strategy;
  MultiWorkerMirroredStrategy::Impl& m;
  const std::vector<const Optimizer*> optimizers;
  Checkpoint checkpoint;
  std::vector<std::function<void(const MembershipChange&)>> callbacks;
  std::vector<std::function<void(ElasticState&)>> fresh_group;  // on_fresh_group()
  std::vector<std::function<void()>> captures, restores;        // track()
  std::vector<std::function<std::vector<std::pair<std::string, std::string>>()>>
      agreements;  // agree_on()
  // What the members compare when a group forms besides the data: every
  // optimizer's configuration() (what the first apply_gradients compares),
  // the strategy's options that every step's call signature compares, and
  // the agree_on() settings.
  std::vector<std::pair<std::string, std::string>> settings() const {
    std::vector<std::pair<std::string, std::string>> f;
    f.emplace_back("shard_optimizer_state", m.options.shard_optimizer_state ? "true" : "false");
    f.emplace_back("communication.compression",
                   std::to_string(static_cast<int>(m.options.communication.compression)));
    // Determinism mode: the same shards, and the same CPU kernels (the bits
    // of a shard's gradient are the kernel variant's; docs/determinism.md).
    f.emplace_back("determinism.virtual_shards",
                   std::to_string(m.options.determinism.virtual_shards));
    if (m.options.determinism.enabled())
      f.emplace_back("determinism.cpu_kernels", cpu_isa_name(cpu_isa()));
    f.emplace_back("optimizers", std::to_string(optimizers.size()));
    for (size_t i = 0; i < optimizers.size(); ++i) {
      for (auto& [k, v] : optimizers[i]->configuration())
        f.emplace_back("optimizers[" + std::to_string(i) + "]." + k, std::move(v));
    }
    for (const auto& fn : agreements) {
      for (auto& kv : fn()) f.push_back(std::move(kv));
    }
    return f;
  }
  void capture() const {
    for (const auto& fn : captures) fn();
  }
  void restore() const {
    for (const auto& fn : restores) fn();
  }
  // The last commit.
  bool committed = false;
  std::vector<std::pair<std::string, Tensor>> tensors;
  DataPosition position;
  std::map<std::string, std::string> metadata;
  // This worker has no state of the group's yet (it is new, or came back).
  bool fresh = true;
  int64_t changes = 0, redone = 0;
};

ElasticState::ElasticState(MultiWorkerMirroredStrategy& strategy,
                           std::vector<const Optimizer*> optimizers)
    : impl_(std::make_unique<Impl>(strategy, std::move(optimizers))) {
  DISTSTRAT_CHECK(impl_->m.elastic, kInvalidArgument,
                  "ElasticState: the strategy is not elastic (set MultiWorkerOptions::elastic."
                  "rendezvous)");
}

ElasticState::~ElasticState() {
  if (impl_->m.elastic && impl_->m.elastic->state == this) impl_->m.elastic->state = nullptr;
}

void ElasticState::on_membership_change(std::function<void(const MembershipChange&)> fn) {
  impl_->callbacks.push_back(std::move(fn));
}

void ElasticState::on_fresh_group(std::function<void(ElasticState&)> fn) {
  DISTSTRAT_CHECK(fn != nullptr, kInvalidArgument, "ElasticState::on_fresh_group: no function");
  impl_->fresh_group.push_back(std::move(fn));
}

void ElasticState::track(std::function<void()> capture, std::function<void()> restore) {
  DISTSTRAT_CHECK(capture && restore, kInvalidArgument,
                  "ElasticState::track: both functions must be given");
  impl_->captures.push_back(std::move(capture));
  impl_->restores.push_back(std::move(restore));
}

void ElasticState::agree_on(
    std::function<std::vector<std::pair<std::string, std::string>>()> settings) {
  DISTSTRAT_CHECK(settings != nullptr, kInvalidArgument, "ElasticState::agree_on: no function");
  impl_->agreements.push_back(std::move(settings));
}

int64_t ElasticState::membership_changes() const { return impl_->changes; }
int64_t ElasticState::steps_redone() const { return impl_->redone; }

void ElasticState::commit() {
  Impl& s = *impl_;
  InternalSteps internal(*s.m.elastic);
  s.capture();
  s.tensors = s.checkpoint.state();
  s.position = position;
  s.metadata = metadata;
  s.committed = true;
}

void MultiWorkerMirroredStrategy::Impl::before_step() {
  ElasticRuntime& e = *elastic;
  if (!e.state || e.committing) return;
  e.state->commit();
  // The chief looks for waiting workers now and then; every worker learns
  // its answer in the same collective, so all re-form at the same step.
  int64_t admit = 0;
  const auto now = SteadyClock::now();
  if (rank() == 0 && now >= e.next_poll) {
    e.next_poll = now + e.options.join_poll;
    try {
      admit = e.rendezvous->joiners_waiting(
                  e.view.group, now + std::min<std::chrono::milliseconds>(
                                          options.communication.timeout, std::chrono::seconds(5)))
                  ? 1
                  : 0;
      e.poll_warning.clear();  // reachable again: a new failure is said at once
    } catch (const Error& err) {
      // A running group needs the store only to change: it goes on. Said
      // once per reason and then once a minute (a damaged record or a store
      // that is down would otherwise be logged at every look).
      if (err.message() != e.poll_warning || now - e.poll_warned >= std::chrono::minutes(1)) {
        self->logger().warning("elastic: rank 0 could not look for waiting workers: ",
                               err.message(), err.message() == e.poll_warning ? " (still)" : "",
                               "; the group trains on (it needs the store only to change)");
        e.poll_warning = err.message();
        e.poll_warned = now;
      }
    }
  }
  if (cross->size() > 1) {
    engine->run(
        [&](Communicator& c) {
          c.all_reduce(&admit, &admit, 1, DType::kInt64, ReduceOp::kMax, "elastic/admit");
        },
        "elastic admission");
  }
  if (admit) {
    e.admitting = true;
    throw AbortedError("elastic: group " + std::to_string(e.view.group) +
                       " re-forms to admit waiting workers");
  }
}

namespace {

// The state, position and metadata as one safetensors image.
std::vector<char> encode_state(const std::vector<std::pair<std::string, Tensor>>& tensors,
                               const DataPosition& pos,
                               const std::map<std::string, std::string>& user) {
  CheckpointMetadata md;
  for (const auto& [k, v] : user) md["user." + k] = v;
  md[std::string(kElasticPrefix) + "epoch"] = std::to_string(pos.epoch);
  md[std::string(kElasticPrefix) + "batch"] = std::to_string(pos.batch);
  md[std::string(kElasticPrefix) + "step"] = std::to_string(pos.step);
  return ckpt::encode_safetensors("elastic state", tensors, md, /*allow_reserved=*/true,
                                  /*allow_non_finite=*/true);
}

}  // namespace

void ElasticState::run(const std::function<void(ElasticState&)>& train) {
  Impl& s = *impl_;
  MultiWorkerMirroredStrategy::Impl& m = s.m;
  ElasticRuntime& e = *m.elastic;
  DISTSTRAT_CHECK(e.state == nullptr, kFailedPrecondition,
                  "ElasticState::run: another ElasticState of this strategy is running");
  e.state = this;
  struct Detach {
    ElasticRuntime& e;
    ~Detach() { e.state = nullptr; }
  } detach{e};

  std::optional<MembershipChange> change;
  int previous_replicas = s.fresh ? 0 : m.total_replicas;
  bool training = false;  // train is running (a failure then interrupted a step)
  for (;;) {
    try {
      // The group's state, from the member with the newest commit.
      std::optional<InternalSteps> internal(std::in_place, e);
      const int n = m.cross->size();
      int64_t mine = s.fresh || !s.committed ? -1 : s.position.step;
      std::vector<int64_t> steps(n, mine);
      if (n > 1) {
        m.engine->run(
            [&](Communicator& c) {
              c.all_gather(&mine, steps.data(), 1, DType::kInt64, "elastic/steps");
            },
            "elastic state agreement");
      }
      const int source =
          static_cast<int>(std::max_element(steps.begin(), steps.end()) - steps.begin());
      const bool same = std::all_of(steps.begin(), steps.end(),
                                    [&](int64_t v) { return v == steps[0] && v >= 0; });
      // Every member must split the same rows into the same global batches
      // and update alike: one with other data, batch or seed would train on
      // other rows, one with another learning rate would fail the whole group
      // at the first apply_gradients. Checked before the joiner takes the
      // state: only the member that differs leaves.
      agree_on_settings(m, steps, source, s.settings());
      if (s.fresh && !change && steps[static_cast<size_t>(source)] >= 0) {
        // A new worker in a group that trained before it came: a change for
        // it too (previous_replicas_in_sync 0).
        MembershipChange c;
        c.group = e.view.group;
        c.num_workers = n;
        c.joined = e.view.joined;
        c.left = e.view.left;
        c.rank = e.view.rank;
        change = c;
      }
      if (n > 1 && !same) {
        std::vector<char> image;
        if (m.rank() == source) {
          s.capture();
          image = encode_state(s.checkpoint.state(), position, metadata);
        }
        int64_t bytes = static_cast<int64_t>(image.size());
        m.engine->run(
            [&](Communicator& c) {
              c.broadcast(&bytes, 1, DType::kInt64, source, "elastic/state bytes");
              DISTSTRAT_CHECK(bytes >= 0 && bytes < (int64_t{1} << 40), kDataLoss, "rank ",
                              m.rank(), ": elastic state of ", bytes, " bytes from rank ", source);
              image.resize(static_cast<size_t>(bytes + 7) / 8 * 8);
              c.broadcast(image.data(), image.size() / 8, DType::kInt64, source, "elastic/state");
            },
            "elastic state transfer");
        if (m.rank() != source) {
          const std::string what = "elastic state from rank " + std::to_string(source) +
                                   " (worker '" + e.view.members[source] + "')";
          SafetensorsFile f = parse_safetensors(reinterpret_cast<const uint8_t*>(image.data()),
                                                static_cast<size_t>(bytes), what);
          DataPosition pos;
          pos.epoch = metadata_int(f.metadata, std::string(kElasticPrefix) + "epoch", 0,
                                   int64_t{1} << 40, what);
          pos.batch = metadata_int(f.metadata, std::string(kElasticPrefix) + "batch", 0,
                                   int64_t{1} << 40, what);
          pos.step = metadata_int(f.metadata, std::string(kElasticPrefix) + "step", 0,
                                  int64_t{1} << 50, what);
          std::map<std::string, std::string> user;
          for (const auto& [k, v] : f.metadata) {
            if (k.rfind("user.", 0) == 0) user[k.substr(5)] = v;
          }
          s.checkpoint.assign(f.tensors, what);
          s.restore();
          position = pos;
          metadata = std::move(user);
        }
      }
      // No member holds a committed state: the program's own starting point
      // (a checkpoint), on every member alike, before the first commit. A
      // group that breaks in it has still no commit, so the next one does
      // it again.
      if (steps[static_cast<size_t>(source)] < 0 && !s.fresh_group.empty()) {
        for (const auto& fn : s.fresh_group) fn(*this);
        s.restore();
      }
      s.fresh = false;
      commit();
      e.state_agreed = true;
      // The call signatures compare the group's step: position.step, agreed
      // now, not this worker's count of run() calls (a joiner's is lower;
      // survivors counted the interrupted step, redone under its number).
      m.step_offset = position.step - m.self->steps_run();
      internal.reset();
      if (change) {
        change->step = position.step;
        change->num_replicas_in_sync = m.total_replicas;
        for (const auto& fn : s.callbacks) fn(*change);
        change.reset();
      }
      training = true;
      train(*this);
      // Done: workers still waiting to join this group are told so (they
      // would wait until their join_timeout). Best effort: the training is
      // complete whether or not the store can be reached now.
      try {
        e.rendezvous->finish(e.view.group, SteadyClock::now() + std::min<std::chrono::milliseconds>(
                                                                    m.options.communication.timeout,
                                                                    std::chrono::seconds(5)));
      } catch (const Error& err) {
        m.self->logger().warning("elastic: worker '", e.rendezvous->id(), "' could not mark group ",
                                 e.view.group, " finished in the store: ", err.message());
      }
      return;
    } catch (const Error& err) {
      if (!lost_peer(err) || !m.cross) throw;
      const bool admission = e.admitting;
      e.admitting = false;
      // A step was in flight only once train had started (not in the
      // agreement or in on_fresh_group).
      const bool interrupted = training && !admission;
      training = false;
      m.self->logger().warning(
          "elastic: worker '", e.rendezvous->id(), "' (rank ", m.rank(), " of group ", e.view.group,
          "): ", admission ? "admitting waiting workers" : "the group broke: " + err.message(),
          "; re-forming");
      if (interrupted) ++s.redone;
      previous_replicas = m.total_replicas;
      m.leave_group("worker '" + e.rendezvous->id() + "' left group " +
                    std::to_string(e.view.group) + ": " + err.message());
      // Sharded optimizer state (ZeRO-1) is laid out again for the new group,
      // from the full slots of the commit (or of the state a member sends).
      for (const Optimizer* o : s.optimizers) o->reset_sharding();
      // Back to the last commit: the interrupted step is redone by the new group.
      if (s.committed) {
        // Locally only: the group is gone, and assign makes no collective call
        // for mirrored state (nor for slots no longer sharded).
        InternalSteps internal(e);
        s.checkpoint.assign(s.tensors, "the last elastic commit");
        s.restore();
        position = s.position;
        metadata = s.metadata;
      }
    }
    // A new group (the rendezvous decides who is in it); then the numbering
    // and the engine over it.
    const int rejoins = e.rejoins;
    m.join_group(SteadyClock::now() + e.options.join_timeout);
    if (e.rejoins != rejoins) s.fresh = true;
    m.start_engine();
    ++s.changes;
    MembershipChange c;
    c.group = e.view.group;
    c.num_workers = static_cast<int>(e.view.members.size());
    c.previous_replicas_in_sync = s.fresh ? 0 : previous_replicas;
    c.joined = e.view.joined;
    c.left = e.view.left;
    c.rank = e.view.rank;
    change = c;
    m.self->logger().warning("elastic: worker '", e.rendezvous->id(), "' is rank ", c.rank,
                             " of group ", c.group, " (", c.num_workers, " workers",
                             c.joined.empty() ? "" : ", joined: " + std::to_string(c.joined.size()),
                             c.left.empty() ? "" : ", left: " + std::to_string(c.left.size()), ")");
  }
}

}  // namespace diststrat
