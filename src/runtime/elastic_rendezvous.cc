// Group formation through the membership store (elastic_rendezvous.h).
#include "runtime/elastic_rendezvous.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <set>
#include <thread>

#include "core/random_id.h"
#include "diststrat/error.h"

namespace diststrat {

namespace {

bool contains(const std::vector<std::string>& v, const std::string& id) {
  return std::find(v.begin(), v.end(), id) != v.end();
}

void add(std::vector<std::string>& v, const std::string& id) {
  if (!contains(v, id)) v.push_back(id);
}

void remove(std::vector<std::string>& v, const std::string& id) {
  v.erase(std::remove(v.begin(), v.end(), id), v.end());
}

// The workers a round waits for: the last group's members and the waiting
// ones, less the dead.
std::vector<std::string> expected(const Membership& m) {
  std::vector<std::string> out;
  for (const std::string& id : m.members) {
    if (!m.is_dead(id)) add(out, id);
  }
  for (const std::string& id : m.waiting) {
    if (!m.is_dead(id)) add(out, id);
  }
  return out;
}

}  // namespace

ElasticRendezvous::ElasticRendezvous(std::unique_ptr<MembershipStore> store, std::string id,
                                     RendezvousOptions options)
    : store_(std::move(store)), id_(std::move(id)), options_(options) {
  check_member_id(id_);
  DISTSTRAT_CHECK(options_.min_workers >= 1, kInvalidArgument, "elastic: min_workers ",
                  options_.min_workers, " must be at least 1");
  DISTSTRAT_CHECK(options_.max_workers == 0 || options_.max_workers >= options_.min_workers,
                  kInvalidArgument, "elastic: max_workers ", options_.max_workers,
                  " is below min_workers ", options_.min_workers, " (0 = no limit)");
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(random_id()));
  token_ = hex;
}

void ElasticRendezvous::id_taken(const std::string& holder) const {
  throw InvalidArgumentError("elastic: worker id '" + id_ + "' is taken in " + store_->describe() +
                             " by another live process" + (holder[0] == ',' ? "" : " ") + holder +
                             "; give every worker its own id (ElasticOptions::worker_id, "
                             "DISTSTRAT_WORKER_ID; the default, host-pid, is unique)");
}

bool ElasticRendezvous::claim(Membership& r, bool was_member) const {
  const Membership::Claim* c = r.claim_of(id_);
  if (c != nullptr && c->token == token_) {
    if (c->member == was_member) return false;
    r.set_claim(id_, token_, was_member);
    return true;
  }
  if (c != nullptr) {
    // Another process holds the id. A member of the last group takes it (back
    // from a process that came without one); a process without one takes an
    // id held only from the last group (its old process may be dead: a
    // restart); otherwise the other process is alive in this round or waits.
    const bool other_is_live = r.has_arrived(id_) || r.is_waiting(id_);
    const bool mine = was_member || !other_is_live;
    if (!mine) {
      id_taken(std::string("(") +
               (r.is_waiting(id_) ? "waiting to be admitted" : "arrived at this round") + ")");
    }
  }
  r.set_claim(id_, token_, was_member);
  return true;
}

void ElasticRendezvous::set_id(std::string id) {
  check_member_id(id);
  id_ = std::move(id);
}

std::optional<GroupView> ElasticRendezvous::join(const GroupView* last,
                                                 Clock::time_point deadline) {
  using Clock = ElasticRendezvous::Clock;
  const int64_t last_group = last ? last->group : -1;
  const size_t max = options_.max_workers > 0 ? static_cast<size_t>(options_.max_workers)
                                              : std::numeric_limits<size_t>::max();
  const size_t min = static_cast<size_t>(options_.min_workers);
  // When this worker first saw the round it waits in (its own clock: no
  // clocks are compared across hosts).
  int64_t round_seen = -1;
  // A worker with no last group counts only groups formed after it came.
  int64_t opened_at = std::numeric_limits<int64_t>::max();
  Clock::time_point round_since;
  size_t arrived_count = 0;
  const bool was_member = last != nullptr && contains(last->members, id_);
  for (;;) {
    bool dead = false;
    int64_t finished_group = -1;  // the group it waited for finished
    int64_t run_ended = -1;       // the run it took part in finished with this group
    const Membership m = store_->transact(
        [&](Membership& r) {
          finished_group = -1;
          run_ended = -1;
          if (!last && opened_at == std::numeric_limits<int64_t>::max()) opened_at = r.group;
          if (took_part_ && r.finished && !r.forming && !r.has_member(id_) && !r.is_waiting(id_)) {
            // This process took part in the run (a member, or waiting to
            // join), was left behind (declared dead: stopped past the
            // timeout, or killed) and the run finished meanwhile: nothing
            // is left to join. A process that never took part starts a new
            // run instead (the same URL run again).
            run_ended = r.group;
            return false;
          }
          if (r.is_dead(id_)) {
            dead = true;
            return false;
          }
          if (!r.forming) {
            const bool member = r.has_member(id_);
            // Groups formed since this worker came (a worker with no group
            // counts from the group it first saw).
            const int64_t since = last ? last_group : opened_at;
            if (r.finished && r.is_waiting(id_)) {
              remove(r.waiting, id_);
              finished_group = r.group;
              return true;
            }
            if (member && r.group > since) {
              // Formed with this worker, unless another process took the id.
              const Membership::Claim* c = r.claim_of(id_);
              if (c != nullptr && c->token != token_) {
                id_taken(", a member of group " + std::to_string(r.group));
              }
              return false;
            }
            // Its group broke or admits joiners; or the job's first round; or
            // a process with no group yet finds its id listed (it restarted,
            // or the record is a finished job's): the group re-forms.
            if ((member && r.group == since) || r.members.empty() || r.finished) {
              claim(r, was_member);
              r.forming = true;    // its group broke or admits joiners; or the job's first
              r.finished = false;  // (or starts again)
              r.arrived = {id_};
              remove(r.waiting, id_);
              return true;
            }
            const bool claimed = claim(r, was_member);
            if (r.is_waiting(id_)) return claimed;
            r.waiting.push_back(id_);  // a new worker: the running group admits it
            return true;
          }
          bool changed = claim(r, was_member);
          if (!r.has_arrived(id_)) {
            r.arrived.push_back(id_);
            remove(r.waiting, id_);
            changed = true;
          }
          if (round_seen != r.group) {
            round_seen = r.group;
            round_since = Clock::now();
          }
          // A member's id that arrived under a process that came without a
          // group (a restart, or a copy started by mistake) counts only after
          // the settle time: a live member gets that long to take it back.
          const std::vector<std::string> want = expected(r);
          const bool everyone =
              !want.empty() && std::all_of(want.begin(), want.end(), [&](const std::string& id) {
                const Membership::Claim* c = r.claim_of(id);
                return r.has_arrived(id) && !(r.has_member(id) && c != nullptr && !c->member);
              });
          const bool settled = Clock::now() - round_since >= options_.settle;
          if (r.arrived.size() < min || !(everyone || r.arrived.size() >= max || settled)) {
            return changed;
          }
          // Close the round.
          std::vector<std::string> members;
          for (const std::string& id : r.members) {
            if (r.has_arrived(id) && members.size() < max) members.push_back(id);
          }
          for (const std::string& id : r.arrived) {
            if (!contains(members, id) && members.size() < max) members.push_back(id);
          }
          for (const std::string& id : r.members) {
            if (!r.has_arrived(id)) add(r.dead, id);
          }
          // A waiting worker that did not arrive within the settle time is
          // dead too (killed while it waited): left in `waiting`, it would
          // make the group re-form for it after every round, forever. One
          // that comes back joins under a new id, like a dead member. (A
          // round closed by max_workers before the settle time leaves the
          // waiting ones waiting for a place.)
          if (settled) {
            for (const std::string& id : r.waiting) {
              if (!r.has_arrived(id)) add(r.dead, id);
            }
            r.waiting.clear();
          }
          for (const std::string& id : r.arrived) {
            if (!contains(members, id)) add(r.waiting, id);  // over max_workers: later
          }
          r.members = members;
          r.arrived.clear();
          r.forming = false;
          r.group += 1;
          r.drop_stale_claims();
          return true;
        },
        std::min(deadline, Clock::now() + options_.store_timeout));
    if (m.has_member(id_) || m.has_arrived(id_) || m.is_waiting(id_)) took_part_ = true;
    if (run_ended >= 0) {
      throw FailedPreconditionError(
          "elastic: worker '" + id_ + "' took part in the run in " + store_->describe() +
          ", which has ended: its group " + std::to_string(run_ended) +
          " finished its training without this worker (it was declared dead: stopped or "
          "unreachable past the settle time or the timeout). Start a new run to train again");
    }
    if (dead) return std::nullopt;
    if (finished_group >= 0) {
      throw FailedPreconditionError(
          "elastic: worker '" + id_ + "' waited to join group " + std::to_string(finished_group) +
          " in " + store_->describe() +
          ", which finished its training before admitting it: there is nothing left to join");
    }
    if (!m.forming && m.has_member(id_) && m.group > (last ? last_group : opened_at)) {
      GroupView v;
      v.group = m.group;
      v.members = m.members;
      v.rank =
          static_cast<int>(std::find(m.members.begin(), m.members.end(), id_) - m.members.begin());
      for (const std::string& id : m.members) {
        if (!last || !contains(last->members, id)) v.joined.push_back(id);
      }
      if (last) {
        for (const std::string& id : last->members) {
          if (!contains(m.members, id)) v.left.push_back(id);
        }
      }
      store_->erase_below(m.group);
      return v;
    }
    if (m.forming) arrived_count = m.arrived.size();
    if (Clock::now() >= deadline) {
      throw UnavailableError(
          "elastic: worker '" + id_ + "' found no group in " + store_->describe() +
          " before the deadline: " +
          (m.forming ? std::to_string(arrived_count) + " worker(s) arrived of the " +
                           std::to_string(min) + " needed (min_workers)"
                     : "waiting to be admitted by the running group " + std::to_string(m.group) +
                           " (" + std::to_string(m.members.size()) + " members)"));
    }
    std::this_thread::sleep_for(options_.poll);
  }
}

void ElasticRendezvous::finish(int64_t group, Clock::time_point deadline) {
  store_->transact(
      [&](Membership& r) {
        if (r.forming || r.group != group || r.finished) return false;
        r.finished = true;
        return true;
      },
      deadline);
}

bool ElasticRendezvous::joiners_waiting(int64_t group, Clock::time_point deadline) {
  const Membership m = store_->read(deadline);
  if (m.group != group) return true;  // another round already: re-form now
  if (m.forming) return true;
  if (options_.max_workers > 0 && m.members.size() >= static_cast<size_t>(options_.max_workers)) {
    return false;  // full: the waiting ones wait for a place
  }
  for (const std::string& id : m.waiting) {
    if (!m.is_dead(id)) return true;
  }
  return false;
}

}  // namespace diststrat
