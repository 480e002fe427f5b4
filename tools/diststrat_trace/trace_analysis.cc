#include "trace_analysis.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <set>
#include <tuple>
#include <utility>

namespace diststrat::trace {

namespace {

// A call in the merged record: dumps[dump].calls[call].
struct Ref {
  size_t dump = 0;
  size_t call = 0;
};

// Missing members whose doing is looked up, per finding (the line names
// four; the search for a root follows these).
constexpr size_t kExplained = 64;
// Groups the table shows (the largest).
constexpr size_t kTableGroups = 16;

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
  // without a dump; mismatch: the members outside the majority (empty when
  // no call has a strict majority).
  std::vector<int> ranks;
  std::vector<int> entered;  // no record: the members waiting in `seq`
  std::vector<int> absent;   // members without a dump (whatever the kind)
};

// What a member that never entered a call is doing instead.
struct Doing {
  // kUnknown: a member that made no call, in a process whose calls come
  // from several threads, none known to be its (an in-process group's
  // member no thread has used yet): any of them would be a guess.
  enum Kind { kInCall, kCompute, kUnknown };
  Kind kind = kCompute;
  const Call* call = nullptr;  // kInCall: the call it is in; kCompute: its last ended call
  int64_t since_us = -1;       // -1 when the record does not say
};

// "dense2/kernel +3 more" -> "'dense2/kernel' +3 more"; "" -> "".
std::string quoted_name(const std::string& name) {
  if (name.empty()) return "";
  const size_t plus = name.rfind(" +");
  if (plus != std::string::npos && plus > 0 && name.size() > plus + 7 &&
      name.compare(name.size() - 5, 5, " more") == 0) {
    const std::string n = name.substr(plus + 2, name.size() - 5 - (plus + 2));
    if (!n.empty() && n.size() <= 9 &&
        std::all_of(n.begin(), n.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      return "'" + echo_text(name.substr(0, plus)) + "' +" + n + " more";
    }
  }
  return "'" + echo_text(name) + "'";
}

std::string kind_text(const Call& c) { return c.kind.empty() ? "call" : echo_text(c.kind, 40); }

std::string group_text(const std::string& g) { return "group '" + echo_text(g, 60) + "'"; }

std::string seconds(int64_t us) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.1f s", static_cast<double>(us) / 1e6);
  return buf;
}

// "all_reduce #4171 ('dense2/kernel' +3 more, 1.2 MB)".
std::string call_desc(const Call& c) {
  std::string s = kind_text(c) + " #" + std::to_string(c.seq);
  std::vector<std::string> parts;
  if (!c.name.empty()) parts.push_back(quoted_name(c.name));
  if (c.bytes >= 0) parts.push_back(human_bytes(c.bytes));
  if (!parts.empty()) {
    s += " (";
    for (size_t i = 0; i < parts.size(); ++i) s += (i ? ", " : "") + parts[i];
    s += ")";
  }
  return s;
}

// "broadcast #88 of group 'ps'".
std::string call_where(const Call& c) {
  return kind_text(c) + " #" + std::to_string(c.seq) + " of " + group_text(c.group);
}

// "all_reduce 'a' (count 1024, float32, sum, 4 KB)": what a mismatch compares.
std::string variant_desc(const Call& c) {
  std::string s = kind_text(c) + " " + (c.name.empty() ? "(no name)" : quoted_name(c.name));
  std::vector<std::string> parts;
  if (c.count >= 0) parts.push_back("count " + std::to_string(c.count));
  if (!c.dtype.empty()) parts.push_back(echo_text(c.dtype, 20));
  if (!c.op.empty()) parts.push_back(echo_text(c.op, 20));
  if (c.root >= 0) parts.push_back("root " + std::to_string(c.root));
  if (c.bytes >= 0) parts.push_back(human_bytes(c.bytes));
  if (!parts.empty()) {
    s += " (";
    for (size_t i = 0; i < parts.size(); ++i) s += (i ? ", " : "") + parts[i];
    s += ")";
  }
  return s;
}

// `s` (already escaped) in at most `width` bytes: cut with "..." at a
// character boundary.
std::string fit(const std::string& s, size_t width) {
  if (s.size() <= width) return s;
  size_t n = width - 3;
  while (n > 0 && (static_cast<unsigned char>(s[n]) & 0xC0) == 0x80) --n;
  return s.substr(0, n) + "...";
}

std::string join_ints(const std::vector<int>& v, size_t cap = 16) {
  std::string s;
  for (size_t i = 0; i < v.size() && i < cap; ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  if (v.size() > cap) s += " and " + std::to_string(v.size() - cap) + " more";
  return s;
}

std::string ranks_text(const std::vector<int>& v) {
  return (v.size() == 1 ? "rank " : "ranks ") + join_ints(v);
}

using Signature = std::tuple<std::string, std::string, int64_t, std::string, std::string, int64_t>;
// The whole name's hash where the record has it (the name itself may be
// cut), else the name.
Signature signature(const Call& c) {
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
  std::string finding_line(const Group& g, const Finding& f, const std::vector<Doing>& doings,
                           int first) const;
  std::string link_line(const Node& n, int member) const;
  Verdict no_divergence() const;

  const std::vector<Dump>& dumps_;
  std::map<std::string, Group> groups_;
  std::map<std::string, Finding> findings_;
};

void Analyzer::index() {
  for (size_t d = 0; d < dumps_.size(); ++d) {
    const Dump& dump = dumps_[d];
    for (size_t i = 0; i < dump.calls.size(); ++i) {
      const Call& c = dump.calls[i];
      if (dump.superseded.count({c.group, c.group_rank})) continue;
      Group& g = groups_[c.group];
      g.name = c.group;
      g.sizes.insert(c.group_size);
      auto [it, fresh] = g.members.try_emplace(c.group_rank);
      Member& m = it->second;
      if (fresh) {
        m.rank = c.group_rank;
        m.dump = d;
      } else if (m.dump != d) {
        continue;  // a second file's copy of this participant (load_dir resolves them)
      }
      m.by_seq[c.seq] = i;  // a seq recorded twice: the later entry
    }
  }
  for (auto& [name, g] : groups_) {
    for (auto& [r, m] : g.members)
      m.thread = dumps_[m.dump].calls[m.by_seq.rbegin()->second].thread;
  }
  // Members that made no call yet, in groups others used: known, not
  // missing records.
  for (size_t d = 0; d < dumps_.size(); ++d) {
    for (const MemberDecl& decl : dumps_[d].members) {
      auto it = groups_.find(decl.group);
      if (it == groups_.end()) continue;
      if (dumps_[d].superseded.count({decl.group, decl.group_rank})) continue;
      auto [m, fresh] = it->second.members.try_emplace(decl.group_rank);
      if (!fresh) continue;
      m->second.rank = decl.group_rank;
      m->second.dump = d;
      m->second.thread = decl.thread;
      it->second.sizes.insert(decl.group_size);
    }
  }
  for (auto& [name, g] : groups_) g.size = *g.sizes.rbegin();
}

const Finding& Analyzer::finding(const Group& g) {
  auto it = findings_.find(g.name);
  if (it == findings_.end()) it = findings_.emplace(g.name, walk(g)).first;
  return it->second;
}

Finding Analyzer::walk(const Group& g) const {
  Finding f;
  for (int r = 0; r < g.size; ++r) {
    if (!g.members.count(r)) f.absent.push_back(r);
  }
  int64_t lo = 0;
  std::vector<int64_t> newest;
  for (const auto& [r, m] : g.members) {
    if (!m.silent()) lo = std::max(lo, m.oldest());
    newest.push_back(m.newest());
  }
  std::sort(newest.begin(), newest.end());
  // Seq -> who recorded it, over the range every member retains.
  std::map<int64_t, std::vector<std::pair<int, size_t>>> at;
  for (const auto& [r, m] : g.members) {
    for (auto it = m.by_seq.lower_bound(lo); it != m.by_seq.end(); ++it) {
      at[it->first].emplace_back(r, it->second);
    }
  }
  for (const auto& [k, entries] : at) {
    std::map<Signature, std::pair<Ref, std::vector<int>>> by_sig;
    for (const auto& [r, idx] : entries) {
      const size_t d = g.members.at(r).dump;
      auto& v = by_sig[signature(dumps_[d].calls[idx])];
      if (v.second.empty()) v.first = Ref{d, idx};
      v.second.push_back(r);
    }
    if (by_sig.size() > 1) {
      f.kind = Finding::kMismatch;
      f.seq = k;
      for (auto& [sig, v] : by_sig) f.variants.push_back(v);
      std::sort(f.variants.begin(), f.variants.end(), [](const auto& a, const auto& b) {
        if (a.second.size() != b.second.size()) return a.second.size() > b.second.size();
        return a.second.front() < b.second.front();
      });
      f.ref = f.variants.front().first;
      f.has_ref = true;
      if (f.variants[0].second.size() > f.variants[1].second.size()) {
        for (size_t i = 1; i < f.variants.size(); ++i) {
          f.ranks.insert(f.ranks.end(), f.variants[i].second.begin(), f.variants[i].second.end());
        }
        std::sort(f.ranks.begin(), f.ranks.end());
      }
      return f;
    }
    const size_t behind = std::lower_bound(newest.begin(), newest.end(), k) - newest.begin();
    if (behind > 0) {
      f.kind = Finding::kMissing;
      f.seq = k;
      f.ref = Ref{g.members.at(entries.front().first).dump, entries.front().second};
      f.has_ref = true;
      for (const auto& [r, m] : g.members) {
        if (m.newest() < k) f.ranks.push_back(r);
      }
      return f;
    }
  }
  f.seq = newest.front();
  f.ranks = f.absent;
  if (!f.ranks.empty()) {
    f.kind = Finding::kNoRecord;
    f.seq = -1;
    // Where the others wait: the oldest in-flight newest call among them.
    for (const auto& [r, m] : g.members) {
      if (m.silent()) continue;
      const size_t idx = m.by_seq.rbegin()->second;
      const Call& c = dumps_[m.dump].calls[idx];
      if (!stuck_in(c.state)) continue;
      if (!f.has_ref || c.seq < f.seq) {
        f.has_ref = true;
        f.seq = c.seq;
        f.ref = Ref{m.dump, idx};
      }
    }
    for (const auto& [r, m] : g.members) {
      if (m.silent()) continue;
      const Call& c = dumps_[m.dump].calls[m.by_seq.rbegin()->second];
      if (f.has_ref && c.seq == f.seq && stuck_in(c.state)) f.entered.push_back(r);
    }
  }
  return f;
}

Doing Analyzer::doing(const Group& g, const Member& m) const {
  const Dump& dump = dumps_[m.dump];
  // In a process that holds several ranks of this group (threads), the
  // other ranks' threads are not this rank's doing.
  std::set<int> other_threads;
  for (const auto& [r, o] : g.members) {
    if (r != m.rank && o.dump == m.dump && o.thread != m.thread) other_threads.insert(o.thread);
  }
  // Newest by time on this process's clock, then by position in the file.
  const Call* flight_same = nullptr;
  const Call* flight_any = nullptr;
  const Call* ended_same = nullptr;
  const Call* ended_any = nullptr;
  std::set<int> threads;  // of the calls that could be this member's
  auto newer_flight = [](const Call* a, const Call& c) {
    return a == nullptr ||
           std::max(c.enqueue_us, c.start_us) >= std::max(a->enqueue_us, a->start_us);
  };
  auto newer_end = [](const Call* a, const Call& c) {
    return a == nullptr || c.end_us >= a->end_us;
  };
  for (const Call& c : dump.calls) {
    if (dump.superseded.count({c.group, c.group_rank})) continue;
    if (c.group == g.name && c.group_rank != m.rank) continue;
    if (other_threads.count(c.thread)) continue;
    threads.insert(c.thread);
    const bool same = c.thread == m.thread;
    if (stuck_in(c.state)) {
      if (same && newer_flight(flight_same, c)) flight_same = &c;
      if (newer_flight(flight_any, c)) flight_any = &c;
    }
    if (!in_flight(c.state)) {
      if (same && newer_end(ended_same, c)) ended_same = &c;
      if (newer_end(ended_any, c)) ended_any = &c;
    }
  }
  Doing d;
  if (m.silent() && flight_same == nullptr && ended_same == nullptr && threads.size() > 1) {
    d.kind = Doing::kUnknown;
    return d;
  }
  const Call* in = flight_same ? flight_same : flight_any;
  const Call* ended = ended_same ? ended_same : ended_any;
  // A failed call counts only when nothing ended after it started.
  if (in != nullptr && !in_flight(in->state) && ended != nullptr && ended != in &&
      ended->end_us > std::max(in->start_us, in->enqueue_us)) {
    in = nullptr;
  }
  if (const Call* c = in) {
    d.kind = Doing::kInCall;
    d.call = c;
    const int64_t from =
        c->state != CallState::kQueued && c->start_us >= 0 ? c->start_us : c->enqueue_us;
    if (from >= 0) d.since_us = std::max<int64_t>(0, dump.dump_time_us - from);
    return d;
  }
  d.kind = Doing::kCompute;
  d.call = ended_same ? ended_same : ended_any;
  if (d.call != nullptr && d.call->end_us >= 0) {
    d.since_us = std::max<int64_t>(0, dump.dump_time_us - d.call->end_us);
  }
  return d;
}

// What the first kExplained missing members of f do (each costs a pass
// over its file: a hostile record with 100000 missing ranks stays cheap).
std::vector<Doing> Analyzer::doings_of(const Group& g, const Finding& f) const {
  std::vector<Doing> out;
  for (size_t i = 0; i < f.ranks.size() && i < kExplained; ++i) {
    out.push_back(doing(g, g.members.at(f.ranks[i])));
  }
  return out;
}

int Analyzer::process_rank(const Group& g, int rank) const {
  const auto it = g.members.find(rank);
  return it == g.members.end() ? -1 : dumps_[it->second.dump].rank;
}

std::string Analyzer::rank_label(const Group& g, int rank) const {
  const int p = process_rank(g, rank);
  std::string s = "rank " + std::to_string(rank);
  if (p >= 0 && p != rank) s += " (process rank " + std::to_string(p) + ")";
  return s;
}

// "in broadcast #88 of group 'ps' since 31.2 s" / "in compute since 12.0 s
// (its last call, all_reduce #4170, completed then)".
std::string Analyzer::doing_phrase(const Group& g, const Doing& d) const {
  if (d.kind == Doing::kUnknown) {
    return "where the record does not show (it made no call yet, and none of its process's "
           "threads is known to be its)";
  }
  if (d.kind == Doing::kInCall) {
    std::string s = "in " + call_where(*d.call);
    if (d.call->state == CallState::kQueued) s += " (queued, not started)";
    if (d.since_us >= 0) s += " since " + seconds(d.since_us);
    if (!in_flight(d.call->state)) {
      s += std::string(" (") + state_name(d.call->state) +
           (d.call->error.empty() ? "" : ": " + echo_text(d.call->error, 80)) + ")";
    }
    return s;
  }
  std::string s = "in compute";
  if (d.since_us >= 0) s += " since " + seconds(d.since_us);
  if (d.call == nullptr) return s + " (no call of it has ended in the record)";
  const std::string last = d.call->group == g.name
                               ? kind_text(*d.call) + " #" + std::to_string(d.call->seq)
                               : call_where(*d.call);
  const std::string state = state_name(d.call->state);
  s += " (its last call, " + last + ", " + state + (d.since_us >= 0 ? " then" : "");
  if (!d.call->error.empty()) s += ": " + echo_text(d.call->error, 80);
  return s + ")";
}

// The finding as one line; for a missing finding the member `first` is
// named first.
std::string Analyzer::finding_line(const Group& g, const Finding& f,
                                   const std::vector<Doing>& doings, int first) const {
  switch (f.kind) {
    case Finding::kMismatch: {
      std::string s = "ranks disagree at " + kind_text(call(f.ref)) + " #" + std::to_string(f.seq) +
                      " of " + group_text(g.name) + ": ";
      for (size_t i = 0; i < f.variants.size() && i < 4; ++i) {
        const auto& [ref, ranks] = f.variants[i];
        s += (i ? ", " : "") + ranks_text(ranks) + (ranks.size() == 1 ? " has " : " have ") +
             variant_desc(call(ref));
      }
      if (f.variants.size() > 4) s += ", and " + std::to_string(f.variants.size() - 4) + " more";
      return s;
    }
    case Finding::kMissing: {
      if (doings.size() < std::min(f.ranks.size(), kExplained)) {
        return finding_line(g, f, doings_of(g, f), first);
      }
      std::vector<size_t> order;
      for (size_t i = 0; i < doings.size(); ++i) {
        if (f.ranks[i] == first)
          order.insert(order.begin(), i);
        else
          order.push_back(i);
      }
      const std::string what = call_desc(call(f.ref)) + " of " + group_text(g.name);
      if (f.ranks.size() == 1) {
        return rank_label(g, f.ranks[0]) + " never entered " + what + ": it is " +
               doing_phrase(g, doings[0]);
      }
      std::string s = ranks_text(f.ranks) + " never entered " + what + ": ";
      for (size_t i = 0; i < order.size() && i < 4; ++i) {
        s += (i ? "; " : "") + rank_label(g, f.ranks[order[i]]) + " is " +
             doing_phrase(g, doings[order[i]]);
      }
      if (f.ranks.size() > 4) s += "; and " + std::to_string(f.ranks.size() - 4) + " more";
      return s;
    }
    case Finding::kNoRecord: {
      std::string s = ranks_text(f.ranks) + " of " + group_text(g.name) + " left no record (" +
                      (f.ranks.size() == 1 ? "its process" : "their processes") +
                      " died, or could not write)";
      if (f.has_ref) {
        s += "; " + ranks_text(f.entered) + (f.entered.size() == 1 ? " waits" : " wait") + " in " +
             call_desc(call(f.ref));
      }
      return s;
    }
    case Finding::kNone:
      break;
  }
  return "no divergence in " + group_text(g.name);
}

// One link of a chain: how `member` of n's group waits in the next group.
std::string Analyzer::link_line(const Node& n, int member) const {
  const Finding& f = findings_.at(n.group->name);
  for (size_t i = 0; i < f.ranks.size(); ++i) {
    if (f.ranks[i] == member && i < n.doings.size()) {
      return rank_label(*n.group, member) + " never entered " + call_desc(call(f.ref)) + " of " +
             group_text(n.group->name) + ": it is " + doing_phrase(*n.group, n.doings[i]);
    }
  }
  return finding_line(*n.group, f, n.doings, member);
}

Verdict Analyzer::no_divergence() const {
  Verdict v;
  std::vector<const Group*> order;
  for (const auto& [name, g] : groups_) order.push_back(&g);
  std::stable_sort(order.begin(), order.end(),
                   [](const Group* a, const Group* b) { return a->size > b->size; });
  if (order.empty()) {
    v.line = "no divergence: the records hold no collective call";
    return v;
  }
  v.line = "no divergence: all ranks agree up to ";
  for (size_t i = 0; i < order.size() && i < 4; ++i) {
    const Finding& f = findings_.at(order[i]->name);
    v.line += (i ? ", " : "") + std::string("#") + std::to_string(f.seq) + " of " +
              group_text(order[i]->name);
  }
  if (order.size() > 4) v.line += ", and " + std::to_string(order.size() - 4) + " more groups";
  for (const Group* g : order) {
    // Every member waiting in the same call, none behind: the records do not
    // show who is missing (look below the library: the network, a host).
    size_t waiting = 0;
    const Call* c = nullptr;
    for (const auto& [r, m] : g->members) {
      if (m.silent()) continue;
      const Call& n = dumps_[m.dump].calls[m.by_seq.rbegin()->second];
      if (in_flight(n.state)) {
        ++waiting;
        c = &n;
      }
    }
    if (waiting > 0) {
      v.details.push_back(std::to_string(waiting) + " of " + std::to_string(g->size) +
                          " ranks of " + group_text(g->name) + " are still in " + call_desc(*c) +
                          ", and none is behind: the records do not show whom they wait for");
    }
  }
  return v;
}

Verdict Analyzer::run(int files_skipped) {
  std::vector<const Group*> order;
  for (const auto& [name, g] : groups_) order.push_back(&g);
  std::stable_sort(order.begin(), order.end(),
                   [](const Group* a, const Group* b) { return a->size > b->size; });
  const Group* start = nullptr;
  for (const Group* g : order) {
    if (finding(*g).kind != Finding::kNone && start == nullptr) start = g;
  }
  if (start == nullptr) return no_divergence();

  // Breadth first from the start: the nearest root wins.
  std::vector<Node> nodes{Node(start)};
  std::set<std::string> seen{start->name};
  int root = -1;
  int root_member = -1;
  int call_end = -1;  // a member in a call of a group that does not diverge
  int call_end_member = -1;
  std::vector<std::string> cycles;
  for (size_t q = 0; q < nodes.size() && root < 0; ++q) {
    const Group& g = *nodes[q].group;
    const Finding& f = finding(g);
    if (f.kind != Finding::kMissing) {
      root = static_cast<int>(q);
      root_member = f.ranks.empty() ? -1 : f.ranks.front();
      break;
    }
    nodes[q].doings = doings_of(g, f);
    for (size_t i = 0; i < nodes[q].doings.size(); ++i) {
      if (nodes[q].doings[i].kind == Doing::kCompute) {
        root = static_cast<int>(q);
        root_member = f.ranks[i];
        break;
      }
    }
    if (root >= 0) break;
    for (size_t i = 0; i < nodes[q].doings.size(); ++i) {
      if (nodes[q].doings[i].kind != Doing::kInCall) continue;  // kUnknown: nothing to follow
      const Call& c = *nodes[q].doings[i].call;
      const auto h = groups_.find(c.group);
      if (h == groups_.end()) continue;
      if (seen.count(c.group)) {
        // Back to a group on the way here (not merely one already queued):
        // ranks waiting for each other. An older call of this very group
        // needs no word: the line says so.
        bool on_path = false;
        for (int k = nodes[q].parent; k >= 0 && !on_path; k = nodes[k].parent) {
          on_path = nodes[k].group->name == c.group;
        }
        if (on_path) {
          cycles.push_back("cycle: " + rank_label(g, f.ranks[i]) + " of " + group_text(g.name) +
                           " waits in " + call_where(c) + ", a group the chain already passed");
        }
        continue;
      }
      if (finding(h->second).kind == Finding::kNone) {
        if (call_end < 0) {
          call_end = static_cast<int>(q);
          call_end_member = f.ranks[i];
        }
        continue;
      }
      seen.insert(c.group);
      Node child(&h->second);
      child.parent = static_cast<int>(q);
      child.via_member = f.ranks[i];
      nodes.push_back(child);
    }
  }
  if (root < 0) {
    if (call_end >= 0) {
      root = call_end;
      root_member = call_end_member;
    } else {
      root = 0;
      root_member = findings_.at(start->name).ranks.front();
    }
  }

  const Node& n = nodes[root];
  const Group& g = *n.group;
  const Finding& f = findings_.at(g.name);
  Verdict v;
  v.line = finding_line(g, f, n.doings, root_member);
  v.group = g.name;
  v.seq = f.seq;
  if (f.has_ref) {
    v.call_kind = call(f.ref).kind;
    v.tensor_name = call(f.ref).name;
  }
  v.culprit_rank = root_member;
  v.culprit_process_rank = root_member >= 0 ? process_rank(g, root_member) : -1;
  switch (f.kind) {
    case Finding::kMismatch:
      v.kind = Verdict::Kind::kMismatch;
      v.culprit_state = "mismatch";
      break;
    case Finding::kNoRecord:
      v.kind = Verdict::Kind::kNoRecord;
      v.culprit_state = "no_record";
      break;
    default: {
      v.kind = Verdict::Kind::kMissing;
      const size_t i = std::find(f.ranks.begin(), f.ranks.end(), root_member) - f.ranks.begin();
      const Doing& d = n.doings[i];
      v.culprit_state = d.kind == Doing::kCompute  ? "compute"
                        : d.kind == Doing::kInCall ? "in_call"
                                                   : "unknown";
      if (d.kind == Doing::kInCall) v.culprit_call = call_where(*d.call);
      break;
    }
  }
  // The chain from the start to the root.
  std::vector<std::string> chain;
  for (int k = root; nodes[k].parent >= 0; k = nodes[k].parent) {
    chain.insert(chain.begin(), link_line(nodes[nodes[k].parent], nodes[k].via_member));
  }
  if (!chain.empty()) {
    v.details.push_back("chain (each rank waits for the next):");
    for (const std::string& c : chain) v.details.push_back("  " + c);
    v.details.push_back("  " + v.line);
  }
  if (chain.empty() && nodes.size() > 1) {
    // The verdict stayed at the start (a cycle, or nobody in compute): what
    // the search found behind it.
    v.details.push_back("behind it:");
    for (size_t q = 1; q < nodes.size(); ++q) {
      v.details.push_back("  " + finding_line(*nodes[q].group, findings_.at(nodes[q].group->name),
                                              nodes[q].doings, -1));
    }
  }
  for (const std::string& c : cycles) v.details.push_back(c);
  // Members without a record in the groups the search passed, where the
  // verdict is about something else.
  bool absent = f.kind == Finding::kNoRecord;
  for (const Node& node : nodes) {
    const Finding& nf = findings_.at(node.group->name);
    if (nf.kind == Finding::kNoRecord || nf.absent.empty()) continue;
    absent = true;
    v.details.push_back("also: " + ranks_text(nf.absent) + " of " + group_text(node.group->name) +
                        " left no record (" +
                        (nf.absent.size() == 1 ? "its process" : "their processes") +
                        " died, or could not write)");
  }
  for (const Node& node : nodes) {
    const std::set<int>& sizes = node.group->sizes;
    if (sizes.size() < 2) continue;
    std::string list;
    for (int n : sizes) list += (list.empty() ? "" : ", ") + std::to_string(n);
    v.details.push_back("note: the members of " + group_text(node.group->name) +
                        " disagree on its size (" + list + "); the largest is used");
  }
  // Members whose newest call failed or was aborted: often the first sign
  // of a dead peer.
  size_t failed = 0;
  for (const Node& node : nodes) {
    for (const auto& [r, m] : node.group->members) {
      if (m.silent()) continue;
      const Call& c = dumps_[m.dump].calls[m.by_seq.rbegin()->second];
      if (c.state != CallState::kFailed && c.state != CallState::kAborted) continue;
      if (++failed > 3) continue;
      v.details.push_back("also: " + rank_label(*node.group, r) + " of " +
                          group_text(node.group->name) + ": its " + call_desc(c) + " " +
                          state_name(c.state) + (c.error.empty() ? "" : ": " + echo_text(c.error)));
    }
  }
  if (failed > 3) {
    v.details.push_back("also: " + std::to_string(failed - 3) + " more failed call" +
                        (failed - 3 == 1 ? "" : "s"));
  }
  if (absent && files_skipped > 0) {
    v.details.push_back("note: " + std::to_string(files_skipped) +
                        (files_skipped == 1 ? " file was" : " files were") +
                        " skipped as unusable; one may be a missing record");
  }
  // Divergences the chain did not pass through.
  size_t others = 0;
  for (const Group* o : order) {
    if (seen.count(o->name) || finding(*o).kind == Finding::kNone) continue;
    if (++others > 3) continue;
    const Finding& of = finding(*o);
    const std::vector<Doing> doings =
        of.kind == Finding::kMissing ? doings_of(*o, of) : std::vector<Doing>{};
    v.details.push_back("also: " + finding_line(*o, of, doings, -1));
  }
  if (others > 3)
    v.details.push_back("also: " + std::to_string(others - 3) + " more groups diverge");
  return v;
}

}  // namespace

std::string human_bytes(int64_t bytes) {
  if (bytes < 1024) return std::to_string(bytes) + " B";
  static const char* const kUnits[] = {"KB", "MB", "GB", "TB", "PB", "EB"};
  double v = static_cast<double>(bytes) / 1024;
  size_t u = 0;
  while (v >= 1024 && u + 1 < sizeof kUnits / sizeof kUnits[0]) {
    v /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", v);
  std::string s = buf;
  if (s.size() > 2 && s.compare(s.size() - 2, 2, ".0") == 0) s.resize(s.size() - 2);
  return s + " " + kUnits[u];
}

Verdict analyze(const std::vector<Dump>& dumps, int files_skipped) {
  Verdict v = Analyzer(dumps).run(files_skipped);
  // Records written far apart (on signals sent at different times, say)
  // are not one moment: a call in flight in one may have ended before the
  // next was written.
  int64_t first = 0, last = 0;
  bool any = false, on_demand = false;
  for (const Dump& d : dumps) {
    on_demand = on_demand || d.trigger == "signal" || d.trigger == "request";
    if (d.epoch_unix_us <= 0) continue;
    const int64_t at = d.epoch_unix_us + d.dump_time_us;
    first = any ? std::min(first, at) : at;
    last = any ? std::max(last, at) : at;
    any = true;
  }
  if (on_demand && any && last - first > 1000000) {
    v.details.push_back("note: the records were written " + seconds(last - first) +
                        " apart (by wall clock): they are not one moment, and a call in flight "
                        "in one may have ended before another was written");
  }
  return v;
}

std::string group_table(const std::vector<Dump>& dumps, size_t max_rows) {
  // (group) -> rank -> (dump, newest call index, oldest seq, newest seq, calls)
  struct Row {
    size_t dump = 0;
    size_t newest = 0;
    int64_t lo = 0;
    int64_t hi = -1;
  };
  std::map<std::string, std::pair<int, std::map<int, Row>>> groups;
  for (size_t d = 0; d < dumps.size(); ++d) {
    for (size_t i = 0; i < dumps[d].calls.size(); ++i) {
      const Call& c = dumps[d].calls[i];
      if (dumps[d].superseded.count({c.group, c.group_rank})) continue;
      auto& [size, rows] = groups[c.group];
      size = std::max(size, c.group_size);
      auto [it, fresh] = rows.try_emplace(c.group_rank);
      Row& row = it->second;
      if (fresh) {
        row = Row{d, i, c.seq, c.seq};
      } else if (row.dump != d) {
        continue;
      }
      row.lo = std::min(row.lo, c.seq);
      if (c.seq >= row.hi) {
        row.hi = c.seq;
        row.newest = i;
      }
    }
  }
  // The largest groups first, as the analysis looks at them.
  std::vector<const std::string*> order;
  for (const auto& [name, entry] : groups) order.push_back(&name);
  std::stable_sort(order.begin(), order.end(), [&](const std::string* a, const std::string* b) {
    return groups.at(*a).first > groups.at(*b).first;
  });
  std::string out;
  char buf[512];
  for (size_t gi = 0; gi < order.size(); ++gi) {
    if (gi == kTableGroups) {
      out += "... and " + std::to_string(order.size() - gi) + " more groups\n";
      break;
    }
    const std::string& name = *order[gi];
    const auto& [size, rows] = groups.at(name);
    out += group_text(name) + ": " + std::to_string(size) + " ranks, " +
           std::to_string(rows.size()) + " with a record\n";
    std::snprintf(buf, sizeof buf, "  %-6s %-8s %-12s %-7s %-17s %-40s %s\n", "rank", "process",
                  "host", "thread", "retained", "newest call", "state");
    out += buf;
    // The usual newest seq and state: rows that differ are shown first.
    std::map<std::pair<int64_t, int>, size_t> common;
    for (const auto& [r, row] : rows) {
      ++common[{row.hi, static_cast<int>(dumps[row.dump].calls[row.newest].state)}];
    }
    std::pair<int64_t, int> usual{-1, -1};
    size_t best = 0;
    for (const auto& [k, n] : common) {
      if (n > best) {
        best = n;
        usual = k;
      }
    }
    std::vector<int> show;
    std::vector<int> plain;
    for (int r = 0; r < size; ++r) {
      const auto it = rows.find(r);
      const bool unusual =
          it == rows.end() ||
          std::make_pair(it->second.hi,
                         static_cast<int>(dumps[it->second.dump].calls[it->second.newest].state)) !=
              usual;
      (unusual ? show : plain).push_back(r);
    }
    if (show.size() > max_rows) show.resize(max_rows);
    for (size_t i = 0; i < plain.size() && show.size() < max_rows; ++i) show.push_back(plain[i]);
    std::sort(show.begin(), show.end());
    for (int r : show) {
      const auto it = rows.find(r);
      if (it == rows.end()) {
        std::snprintf(buf, sizeof buf, "  %-6d %-8s %-12s %-7s %-17s %-40s %s\n", r, "-", "-", "-",
                      "-", "-", "no record");
        out += buf;
        continue;
      }
      const Row& row = it->second;
      const Dump& d = dumps[row.dump];
      const Call& c = d.calls[row.newest];
      std::string state = state_name(c.state);
      const int64_t at =
          in_flight(c.state) ? (c.start_us >= 0 ? c.start_us : c.enqueue_us) : c.end_us;
      if (at >= 0 && d.dump_time_us >= at) {
        state += in_flight(c.state) ? " for " + seconds(d.dump_time_us - at)
                                    : ", " + seconds(d.dump_time_us - at) + " before the dump";
      }
      const std::string proc = d.rank >= 0 ? std::to_string(d.rank) : "?";
      const std::string retained = "#" + std::to_string(row.lo) + "-#" + std::to_string(row.hi);
      const std::string newest = kind_text(c) + " #" + std::to_string(c.seq) +
                                 (c.name.empty() ? "" : " " + quoted_name(c.name));
      std::snprintf(buf, sizeof buf, "  %-6d %-8s %-12s %-7d %-17s %-40s %s\n", r, proc.c_str(),
                    fit(echo_text(d.host, 40), 12).c_str(), c.thread, retained.c_str(),
                    fit(newest, 40).c_str(), state.c_str());
      out += buf;
    }
    if (show.size() < static_cast<size_t>(size)) {
      out += "  ... and " + std::to_string(size - show.size()) + " more ranks like rank " +
             std::to_string(plain.empty() ? 0 : plain.back()) + "\n";
    }
  }
  return out;
}

}  // namespace diststrat::trace
