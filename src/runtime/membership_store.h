// The arbiter of an elastic job's membership (issue 27): one record per job in
// a store every worker reaches, changed only by atomic transactions, so that
// two groups never both believe they are the job. Redis (redis://host:port/job,
// several hosts) or a directory (file:///dir/job, one host or a shared file
// system).
//
// A transaction reads the record, lets the caller change it and writes it
// back only if nobody wrote in between (Redis: WATCH/MULTI/EXEC; a directory:
// an exclusive lock on <dir>/<job>.lock around read and atomic rename);
// otherwise it reads again and retries. A worker that cannot reach the store
// before its deadline gets UnavailableError naming the store: it must stop,
// since it can no longer know whether it is still a member.
//
// Nothing read from the store is trusted: the record is a small text format
// that is parsed and checked (DataLossError naming the store otherwise).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace diststrat {

struct Membership {
  // Bumped by every transaction that changes the record.
  int64_t generation = 0;
  // The number of the group now running (or, while `forming`, of the last
  // one): bumped only when a round closes (runtime/elastic_rendezvous.h).
  int64_t group = 0;
  // A round is open: workers of the last group and waiting ones are arriving.
  bool forming = false;
  // Group `group` finished its training (a member's train returned): the
  // workers waiting to join it are told so; the next worker to come starts
  // the job again (a new round).
  bool finished = false;
  // The members of group `group`, in rank order.
  std::vector<std::string> members;
  // While forming: the ids that arrived at the round, in arrival order.
  std::vector<std::string> arrived;
  // Ids waiting to join at the running group's next step boundary.
  std::vector<std::string> waiting;
  // Ids declared dead in this job: never admitted again under that id (a
  // worker that comes back after it was declared dead joins as a new one).
  std::vector<std::string> dead;
  // Which process holds an id (of a member, an arrival or a waiting worker):
  // its token (random, one per process) and whether it came as a member of
  // its last group. Two live processes under one id are told apart by it
  // (runtime/elastic_rendezvous.h says who wins).
  struct Claim {
    std::string id, token;
    bool member = false;
  };
  std::vector<Claim> claims;
  const Claim* claim_of(const std::string& id) const;
  // Sets (or replaces) the claim of `id`.
  void set_claim(const std::string& id, const std::string& token, bool member);
  // Drops the claims of ids that are neither members, arrived nor waiting.
  void drop_stale_claims();

  bool has_member(const std::string& id) const;
  bool has_arrived(const std::string& id) const;
  bool is_waiting(const std::string& id) const;
  bool is_dead(const std::string& id) const;

  // The stored form: "diststrat-membership 1\ngeneration G\ngroup N\n[forming\n][finished\n]"
  // then "member ID", "arrived ID", "waiting ID", "dead ID" and
  // "claim ID TOKEN member|new" lines (TOKEN: 1-64 of [0-9a-f]).
  std::string encode() const;
  // Throws DataLossError "<where>: ..." for anything but encode()'s output
  // (unknown lines, a number that is not a decimal, an id that is empty,
  // repeated in one list, over 256 bytes or not [A-Za-z0-9._:-], more than
  // 100000 ids).
  static Membership decode(const std::string& text, const std::string& where);
};

// A worker id: 1-256 of [A-Za-z0-9._:-]. Throws InvalidArgumentError.
void check_member_id(const std::string& id);
// Whether `c` may be part of a worker id ([A-Za-z0-9._:-]); also the base of
// the file-safe names made from ids and keys.
bool is_member_id_char(char c);

class MembershipStore {
 public:
  virtual ~MembershipStore() = default;
  using Clock = std::chrono::steady_clock;

  // Atomically: the current record (an empty one, generation 0, when the job
  // has none yet) is passed to `change`; when it returns true the changed
  // record is written with generation + 1, unless another writer got in
  // between (then it starts over with the new record). Returns the record as
  // it is afterwards. Throws UnavailableError naming the store when it cannot
  // be reached or locked before `deadline`, DataLossError for a damaged
  // record; an exception from `change` leaves the record as it was.
  virtual Membership transact(const std::function<bool(Membership&)>& change,
                              Clock::time_point deadline) = 0;
  // The current record (no change).
  Membership read(Clock::time_point deadline) {
    return transact([](Membership&) { return false; }, deadline);
  }
  // A small key-value side, for what one group's members exchange (their
  // connection addresses): `key` is 1-200 of [A-Za-z0-9._/-], `value` at most
  // 64 KiB. put overwrites; get returns nullopt for a key never put. Both
  // throw UnavailableError naming the store when it cannot be reached before
  // `deadline`. Keys of old groups are removed by erase_below.
  virtual void put(const std::string& key, const std::string& value,
                   Clock::time_point deadline) = 0;
  virtual std::optional<std::string> get(const std::string& key, Clock::time_point deadline) = 0;
  // Removes the keys "g<N>/..." with N < `group` (best effort: never throws).
  virtual void erase_below(int64_t group) noexcept = 0;
  // "redis://host:port/job" or "file:///dir/job", for messages.
  virtual std::string describe() const = 0;
};

// From a rendezvous URL: "redis://host:port/job" (port 1..65535, job 1-128 of
// [A-Za-z0-9._-]) or "file:///absolute/dir/job". Throws InvalidArgumentError
// for any other form, UnimplementedError for redis:// in a build without
// hiredis (DISTSTRAT_WITH_REDIS).
std::unique_ptr<MembershipStore> open_membership_store(const std::string& url);

}  // namespace diststrat
