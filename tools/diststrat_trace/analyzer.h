// The analysis behind the verdict (trace_analysis.h has its rules): the
// merged record indexed per group and member, each group's first
// divergence (analyzer_findings.cc) and the verdict with its wording
// (trace_analysis.cc). Internal to the tool.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "flight_record.h"
#include "trace_analysis.h"

namespace diststrat::trace::analysis {

// A call in the merged record: dumps[dump].calls[call].
struct Ref {
  size_t dump = 0;
  size_t call = 0;
};

// Missing members whose doing is looked up, per finding (the line names
// four; the search for a root follows these).
constexpr size_t kExplained = 64;

// One participant (group, group rank) and its retained calls by seq.
struct Member {
  int rank = 0;
  size_t dump = 0;
  int thread = 0;  // the thread of its newest call
  // Empty for a member its process declares (the record's "members") that
  // has made no call yet: behind every call of its group.
  std::map<int64_t, size_t> by_seq;
  bool silent() const { return by_seq.empty(); }
  int64_t oldest() const { return by_seq.empty() ? -1 : by_seq.begin()->first; }
  int64_t newest() const { return by_seq.empty() ? -1 : by_seq.rbegin()->first; }
};

struct Group {
  std::string name;
  int size = 1;  // the largest group_size any member recorded
  std::set<int> sizes;
  std::map<int, Member> members;
};

// The first divergence of one group.
struct Finding {
  enum Kind { kNone, kMismatch, kMissing, kNoRecord };
  Kind kind = kNone;
  // mismatch, missing: the deciding seq; none: the newest seq all agree on;
  // no record: the seq the others wait in (-1 when they wait in none).
  int64_t seq = -1;
  Ref ref;  // a call at `seq` (mismatch: the majority's); valid when has_ref
  bool has_ref = false;
  // mismatch: every distinct call recorded at `seq` and who recorded it,
  // the most common first.
  std::vector<std::pair<Ref, std::vector<int>>> variants;
  // missing: the members that never entered `seq`; no record: the members
  // without a dump (the first kExplained: see absent); mismatch: the
  // members outside the majority (empty when no call has a strict
  // majority).
  std::vector<int> ranks;
  std::vector<int> entered;  // no record: the members waiting in `seq`
  // Members without a dump (whatever the kind): the first kExplained of
  // them, and how many in all. A group's size is what a record claims, so
  // nothing is allocated by it: 2^20 claimed ranks of which one left a
  // record cost what one rank does.
  std::vector<int> absent;
  size_t absent_count = 0;
};

// What a member that never entered a call is doing instead.
struct Doing {
  // kUnknown: a member that made no call, in a process whose calls come
  // from several threads, none known to be its (an in-process group's
  // member no thread has used yet): any of them would be a guess.
  // kExited: nothing in flight in a record written as its process ended
  // normally (trigger "exit"): it left, it does not compute.
  enum Kind { kInCall, kCompute, kUnknown, kExited };
  Kind kind = kCompute;
  // kInCall: the call it is in; kCompute, kExited: its last ended call
  const Call* call = nullptr;
  int64_t since_us = -1;  // -1 when the record does not say
};

using Signature = std::tuple<std::string, std::string, int64_t, std::string, std::string, int64_t>;
// The whole name's hash where the record has it (the name itself may be
// cut), else the name.
inline Signature signature(const Call& c) {
  return {c.kind, c.name_hash.empty() ? c.name : c.name + "#" + c.name_hash, c.count, c.dtype, c.op,
          c.root};
}

class Analyzer {
 public:
  explicit Analyzer(const std::vector<Dump>& dumps) : dumps_(dumps) { index(); }

  Verdict run(int files_skipped);

 private:
  // A group's finding in the chain search, and how the search got there.
  struct Node {
    explicit Node(const Group* g) : group(g) {}
    const Group* group;
    int parent = -1;            // index of the node whose member waits here
    int via_member = -1;        // that member (a group rank of the parent's group)
    std::vector<Doing> doings;  // per finding.ranks, for a missing finding
  };

  const Call& call(Ref r) const { return dumps_[r.dump].calls[r.call]; }
  void index();
  const Finding& finding(const Group& g);
  Finding walk(const Group& g) const;
  Doing doing(const Group& g, const Member& m) const;
  std::vector<Doing> doings_of(const Group& g, const Finding& f) const;
  int process_rank(const Group& g, int rank) const;
  std::string rank_label(const Group& g, int rank) const;
  std::string doing_phrase(const Group& g, const Doing& d) const;
  std::string no_record_why(size_t n) const;
  std::string finding_line(const Group& g, const Finding& f, const std::vector<Doing>& doings,
                           int first) const;
  std::string link_line(const Node& n, int member) const;
  Verdict no_divergence() const;

  const std::vector<Dump>& dumps_;
  std::map<std::string, Group> groups_;
  std::map<std::string, Finding> findings_;
};

}  // namespace diststrat::trace::analysis
