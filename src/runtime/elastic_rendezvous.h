// How an elastic job's workers form groups (issue 27), through the membership
// store (runtime/membership_store.h), which is the only arbiter.
//
// The record holds the running group (its number and members in rank order),
// the ids waiting to join, the ids declared dead and, while a round is open,
// the ids that arrived at it. Every step below is one transaction.
//  - A member whose group broke (a peer died, the group aborted) or that is
//    told to admit joiners opens a round (if its group is still the running
//    one) and arrives at it; others of the group arrive as they notice.
//  - A new worker adds itself to `waiting` while a group runs (the running
//    group's chief sees it and the group re-forms at its next step boundary),
//    or arrives at the open round, or opens the first round of the job.
//  - The round closes, in the transaction of whichever participant sees it
//    first, when every expected worker (the last group's members and the
//    waiting ones, less the dead) has arrived, or `max_workers` have, or the
//    settle time has passed since this participant saw the round open; and
//    only with at least `min_workers` arrived. The new group: the last
//    group's members that arrived, in their old order (so the new chief is
//    the lowest surviving rank), then the others in arrival order, at most
//    max_workers; members of the last group that did not arrive are dead,
//    and so are waiting workers that did not arrive when the round closes
//    at the settle time (killed while they waited: left waiting, the group
//    would re-form for them forever).
//  - Two live processes under one id: each process claims its id with a
//    random token. A process with no last group takes an id held from the
//    last group (a restarted worker: the old process may be dead); a member
//    of the last group takes its id (back) when it arrives, and a round does
//    not count a member's id as arrived under such a process before the
//    settle time (so a live member has that long to); any other clash (the id arrived at this round, or waits, under
//    another process) is InvalidArgumentError for the process that comes
//    second, naming the id. Never two processes as one member.
//  - A worker that cannot reach the store before its deadline stops
//    (UnavailableError naming the store): it can no longer know whether it
//    is a member. A side with fewer than min_workers never forms a group.
//    So two groups never both go on.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "runtime/membership_store.h"

namespace diststrat {

struct RendezvousOptions {
  int min_workers = 1;
  int max_workers = 0;  // 0: no limit
  // How long an open round waits for members that have not arrived once
  // min_workers have (a dead member never arrives).
  std::chrono::milliseconds settle{2000};
  // How often the store is read while waiting.
  std::chrono::milliseconds poll{20};
  // How long one read or change of the store may take (a worker that cannot
  // reach the store that long stops: UnavailableError naming it).
  std::chrono::milliseconds store_timeout{std::chrono::seconds(30)};
};

struct GroupView {
  int64_t group = 0;                 // the group's number in the job
  std::vector<std::string> members;  // in rank order
  int rank = 0;                      // this worker's index in members
  std::vector<std::string> joined;   // members not in this worker's last group
  std::vector<std::string> left;     // members of its last group not in this one
};

class ElasticRendezvous {
 public:
  using Clock = std::chrono::steady_clock;

  // `id`: this worker's id (check_member_id). Throws InvalidArgumentError for
  // bad options (min_workers < 1, max_workers in [1, min_workers)).
  ElasticRendezvous(std::unique_ptr<MembershipStore> store, std::string id,
                    RendezvousOptions options);

  // Blocks until a group with this worker has formed, and returns it. `last`:
  // this worker's last group (nullptr for a worker that has none yet).
  // Throws UnavailableError naming the store when it cannot be reached, or
  // when no group with this worker forms before `deadline` (the message says
  // how many workers arrived of the min_workers needed). Returns nullopt when
  // this worker's id was declared dead (the caller joins again under a new
  // id, as a new worker). A worker with no last group whose id the running
  // group lists (a restarted process, or a finished job's record) is not
  // taken for that group's member: it opens a round, like a broken member.
  // A worker that waits to be admitted by a group that then finishes its
  // training gets FailedPreconditionError (there is nothing left to join),
  // and so does a process that took part in the run and comes back after
  // the run finished without it (it was declared dead: stopped past the
  // timeout, say), under its id or a new one; a process that never took part
  // and comes after a group finished opens a new round (the job is started
  // again).
  std::optional<GroupView> join(const GroupView* last, Clock::time_point deadline);

  // Marks group `group` finished (its training is done), unless another
  // round has begun since: the workers waiting to join it stop waiting
  // (join throws FailedPreconditionError for them). One transaction.
  void finish(int64_t group, Clock::time_point deadline);

  // Whether group `group` should re-form now (one read of the record): a
  // worker waits and there is room for it (max_workers), or a round is open;
  // the running group's chief asks this between steps.
  bool joiners_waiting(int64_t group, Clock::time_point deadline);

  const std::string& id() const { return id_; }
  // Changes this worker's id (after it was declared dead).
  void set_id(std::string id);
  MembershipStore& store() { return *store_; }

 private:
  // Claims id_ for this process in `r` (see the header comment); false when
  // it already held it. Throws InvalidArgumentError when another live
  // process holds it.
  bool claim(Membership& r, bool was_member) const;
  // Throws InvalidArgumentError: id_ is held by another live process
  // (`holder` says how: "(waiting to be admitted)", ", a member of group N").
  [[noreturn]] void id_taken(const std::string& holder) const;

  std::unique_ptr<MembershipStore> store_;
  std::string id_;
  RendezvousOptions options_;
  std::string token_;  // this process's claims
  // This process was listed in the record (a member, arrived or waiting):
  // it belongs to the record's run, and is told when that run has ended
  // without it (join).
  bool took_part_ = false;
};

}  // namespace diststrat
