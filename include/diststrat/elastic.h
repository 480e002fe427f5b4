// Elastic synchronous training: a MultiWorkerMirroredStrategy job goes on
// when workers die and takes in workers that join, without restarting any
// process, without losing or repeating a sample (docs/elastic.md).
//
//   ```cpp fragment=elastic norun
//   ds::MultiWorkerOptions o;
//   o.elastic.rendezvous = "redis://store:6379/job1";
//   o.elastic.min_workers = 2;
//   ds::MultiWorkerMirroredStrategy strategy(o);  // waits for a group
//   // ... create variables, the optimizer, the distributed dataset ...
//   ds::ElasticState state(strategy, {&opt});
//   state.run([&](ds::ElasticState& s) {
//     ds::DataPosition& pos = s.position;  // where this (re)start begins
//     for (; pos.epoch < epochs; ++pos.epoch, pos.batch = 0) {
//       dist.set_epoch(pos.epoch);
//       for (; pos.batch < dist.num_batches(); ++pos.batch, ++pos.step) {
//         ds::DistributedBatch batch = dist.batch(pos.batch);
//         strategy.run(step_fn);          // the state is committed here
//       }
//     }
//   });
//   ```
//
// What happens:
//  - Commit: at the start of every Strategy::run inside ElasticState::run the
//    state is committed in memory: every variable, the optimizers' slots and
//    step counters, `position` and `metadata`. Nothing is written to disk.
//  - A worker dies (its process killed: its peers see the socket close at
//    once; its host gone: at the strategy's timeout): every collective in
//    flight fails on every survivor; each survivor's train function is left
//    by that exception, the last commit is restored, the survivors form a
//    new group through the rendezvous, the state is sent from the member
//    with the newest commit to all, the callbacks run, and train is called
//    again: it continues from `position`, so the interrupted step is redone
//    over the same global rows by the new group.
//  - A worker joins: it waits at the rendezvous; the chief sees it between
//    steps, the group re-forms at the next step boundary, the new worker
//    receives the committed state from a member over the new group (not
//    from disk), and every worker's train is called again.
//  - The global batch stays the same whatever the group's size (each batch's
//    rows are split over the replicas of the group that runs it), so every
//    row is used exactly once per epoch and a redone step runs over the same
//    rows; a program that rescales with the worker count does it in a
//    callback. The weights are not those of an uninterrupted run with a
//    fixed worker count: another split sums the gradient in another order,
//    and training amplifies the rounding (as between two mpirun runs with
//    different -np; docs/elastic.md gives the measured spread).
//
// Rules: train must take the position from `position` (and any value of its
// own from `metadata`) and make every collective call inside train; before
// ElasticState::run a program makes no collective call (variables are
// created without the usual broadcast: the group's state comes at run()).
// Errors that are not a lost peer (a bug, bad input, a diverged loss) leave
// run() as they are. ElasticState is not thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "diststrat/data_position.h"
#include "diststrat/multi_worker_mirrored.h"

namespace diststrat {

class Optimizer;

// What a membership change did, for the callbacks.
struct MembershipChange {
  int64_t group = 0;  // the new group's number in the job
  int num_workers = 0;
  int num_replicas_in_sync = 0;
  int previous_replicas_in_sync = 0;  // 0 for a worker that just joined
  std::vector<std::string> joined;    // worker ids new to this worker's group
  std::vector<std::string> left;      // ids of its last group that are gone
  int rank = 0;                       // this worker's rank in the new group
  int64_t step = 0;                   // the committed step the group goes on from
};

class ElasticState {
 public:
  // `strategy` must be elastic (MultiWorkerOptions::elastic) and outlive
  // this object, as must the optimizers.
  ElasticState(MultiWorkerMirroredStrategy& strategy,
               std::vector<const Optimizer*> optimizers = {});
  ~ElasticState();
  ElasticState(const ElasticState&) = delete;
  ElasticState& operator=(const ElasticState&) = delete;

  // Where the next step starts; committed and restored with the model.
  DataPosition position;
  // The program's own values (e.g. a metric's running sums), committed and
  // restored with the model.
  std::map<std::string, std::string> metadata;

  // Called on every worker after each membership change, before train runs
  // again (e.g. to rescale a learning rate with num_replicas_in_sync). Not
  // called for a worker's first group when that group holds no trained
  // state (the job's first group, or a group of new workers only): set what
  // depends on the group's size there in on_fresh_group, or in train from
  // strategy.num_replicas_in_sync(). A worker that joins a group that has
  // trained is called once, with previous_replicas_in_sync 0.
  void on_membership_change(std::function<void(const MembershipChange&)> fn);

  // Called in run() on every worker of a group in which no worker holds a
  // committed state (the job's first group, or one whose workers are all
  // new), after the group agreed on its starting values and before train:
  // restore a checkpoint here and set `position` from it, e.g.
  //   ```cpp fragment=elastic_state norun
  //   state.on_fresh_group([&](ds::ElasticState& s) {
  //     ds::CheckpointManager manager(checkpoint, dir);  // collective: made here
  //     if (auto md = manager.restore_latest())
  //       s.position = ds::restore_data_position(dist, *md, *manager.restored_path());
  //   });
  //   ```
  // Collective (every worker of the group calls it at the same point), in
  // cross-replica context; called again if the group breaks before its
  // first commit. Tracked state (track) is restored after it. A group with a
  // committed state takes that instead: a checkpoint is read only when the
  // state in memory is gone (docs/elastic.md, "Checkpoints").
  void on_fresh_group(std::function<void(ElasticState&)> fn);

  // State kept outside diststrat variables (a LibTorch module and its
  // optimizer: libtorch::TrainingState::track does both calls): `capture`
  // runs before every commit and copies that state into variables (made on
  // every worker, in the same order, before run()); `restore` runs after the
  // variables were put back to the last commit or received from a member,
  // and copies them out again. Both run in cross-replica context.
  void track(std::function<void()> capture, std::function<void()> restore);

  // Settings every worker of a group must share, as (name, value) pairs
  // (libtorch::TrainingState::track adds its optimizers' hyper-parameters).
  // run() compares them whenever a group forms, before it trains, together
  // with the data every worker distributed (rows, global batch, seed,
  // options, and a digest of the features and labels) and the
  // configuration() of the optimizers given to the constructor (what the
  // first apply_gradients compares: learning rate, schedule, momentum ...,
  // clipping, loss scaling, accumulation; set them before run()). A worker
  // whose values differ from the group's leaves run() with
  // InvalidArgumentError naming the first such setting and both values,
  // before it is admitted; the others re-form without it. `settings` runs
  // on the thread that calls run().
  void agree_on(std::function<std::vector<std::pair<std::string, std::string>>()> settings);

  // Runs train(*this) until it returns, re-forming the group after each
  // membership change as described above. Collective. Throws what train
  // throws that is not a lost peer; UnavailableError when the store cannot
  // be reached or fewer than min_workers remain until join_timeout;
  // FailedPreconditionError for a worker that waited to be admitted by a
  // group that finished its training first, or that took part in the run,
  // was declared dead (stopped past the timeout) and came back after the
  // run finished without it. When train returns, the group is marked
  // finished in the store (best effort).
  void run(const std::function<void(ElasticState&)>& train);

  // Commits now (also done at the start of every Strategy::run in train).
  // Collective.
  void commit();

  // Membership changes this worker went through in run().
  int64_t membership_changes() const;
  // The steps redone after a failure (the interrupted steps), on this worker.
  int64_t steps_redone() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace diststrat
