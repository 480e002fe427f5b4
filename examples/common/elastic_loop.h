// The training examples' loop under --elastic (docs/elastic.md): both run
// their own loop from a position inside ElasticState::run, with the same
// checkpoint rules and the same line for each group change.
#pragma once

#include <cstdio>
#include <functional>

#include "diststrat/diststrat.h"
#include "train_position.h"

namespace diststrat_examples {

// What an example does at each point of an elastic run. Each function runs
// on every worker of the group at the same point (each may make collective
// calls); null ones are skipped.
struct ElasticLoop {
  // At every (re)start of the group, before `train`: e.g. make the
  // checkpoint manager (its constructor is collective).
  std::function<void()> begin;
  // When no worker of the group holds a state (the job's first group, or
  // every earlier worker gone): e.g. restore the latest checkpoint into the
  // variables and the position.
  std::function<void(Position&)> restore;
  // The loop from a position; ElasticState::run calls it again from the
  // committed position after each membership change.
  std::function<void(Position&)> train;
  // After `train` returned, still inside run (a member lost here re-forms
  // the group, which redoes the last step): e.g. the final save.
  std::function<void(const Position&)> end;
};

// Runs `loop` from `pos` under `state` (made by the caller, which may have
// tracked state of its own on it) and returns where it ended. The group's
// rank 0 prints each group change.
inline Position run_elastic(diststrat::ElasticState& state, const Position& pos,
                            const ElasticLoop& loop) {
  namespace ds = diststrat;
  state.position = pos;
  state.on_membership_change([](const ds::MembershipChange& c) {
    if (c.rank != 0) return;
    std::printf("elastic: group %lld, %d workers (%zu joined, %zu left), from step %lld\n",
                static_cast<long long>(c.group), c.num_workers, c.joined.size(), c.left.size(),
                static_cast<long long>(c.step));
    std::fflush(stdout);
  });
  if (loop.restore) {
    state.on_fresh_group([&](ds::ElasticState& s) {
      if (loop.begin) loop.begin();
      loop.restore(s.position);
    });
  }
  state.run([&](ds::ElasticState& s) {
    if (loop.begin) loop.begin();
    loop.train(s.position);
    if (loop.end) loop.end(s.position);
  });
  return state.position;
}

}  // namespace diststrat_examples
