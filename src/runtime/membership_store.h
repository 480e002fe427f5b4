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
#include <string>
#include <vector>

namespace diststrat {

struct Membership {
  // Bumped by every transaction that changes the record: a worker's view of
  // the group is the generation it last saw.
  int64_t generation = 0;
  // Worker ids in rank order.
  std::vector<std::string> members;
  // Ids declared dead in this job: never admitted again under that id (a
  // worker that comes back after it was declared dead joins as a new one).
  std::vector<std::string> dead;

  bool has_member(const std::string& id) const;
  bool is_dead(const std::string& id) const;

  // The stored form: "diststrat-membership 1\ngeneration G\nmember ID\n...\ndead ID\n".
  std::string encode() const;
  // Throws DataLossError "<where>: ..." for anything but encode()'s output
  // (unknown lines, a generation that is not a decimal, an id that is empty,
  // repeated, over 256 bytes or not [A-Za-z0-9._:-], more than 100000 ids).
  static Membership decode(const std::string& text, const std::string& where);
};

// A worker id: 1-256 of [A-Za-z0-9._:-]. Throws InvalidArgumentError.
void check_member_id(const std::string& id);

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
  // "redis://host:port/job" or "file:///dir/job", for messages.
  virtual std::string describe() const = 0;
};

// From a rendezvous URL: "redis://host:port/job" (port 1..65535, job 1-128 of
// [A-Za-z0-9._-]) or "file:///absolute/dir/job". Throws InvalidArgumentError
// for any other form, UnimplementedError for redis:// in a build without
// hiredis (DISTSTRAT_WITH_REDIS).
std::unique_ptr<MembershipStore> open_membership_store(const std::string& url);

}  // namespace diststrat
