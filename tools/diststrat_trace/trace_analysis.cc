#include "trace_analysis.h"

#include <algorithm>
#include <map>
#include <set>
#include <utility>

#include "analysis_text.h"
#include "analyzer.h"

namespace diststrat::trace {

namespace analysis {

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
  const std::string last = d.call == nullptr ? std::string()
                           : d.call->group == g.name
                               ? kind_text(*d.call) + " #" + std::to_string(d.call->seq)
                               : call_where(*d.call);
  if (d.kind == Doing::kExited) {
    // The record was written as the process exited normally (return from
    // main, exit()), with no failure record of its own.
    std::string s = "gone: its process exited normally (its record was written at exit";
    if (d.call == nullptr) return s + "; no call of it has ended in the record)";
    s += std::string("; its last call, ") + last + ", " + state_name(d.call->state);
    if (d.since_us >= 0) s += " " + seconds(d.since_us) + " before";
    return s + ")";
  }
  std::string s = "in compute";
  if (d.since_us >= 0) s += " since " + seconds(d.since_us);
  if (d.call == nullptr) return s + " (no call of it has ended in the record)";
  const std::string state = state_name(d.call->state);
  s += " (its last call, " + last + ", " + state + (d.since_us >= 0 ? " then" : "");
  if (!d.call->error.empty()) s += ": " + echo_text(d.call->error, 80);
  return s + ")";
}

// Why `n` members may have left no record. A record written at a normal
// exit shows the groups its process closed last, not every one.
std::string Analyzer::no_record_why(size_t n) const {
  std::string s = n == 1 ? "its process" : "their processes";
  size_t exits = 0;
  for (const Dump& d : dumps_) exits += d.trigger == "exit";
  if (exits == 0) return s + " died, or could not write";
  return s + " died, could not write, or exited normally long after closing this group: " +
         std::to_string(exits) + (exits == 1 ? " record here was" : " records here were") +
         " written at a normal exit, which shows only the groups closed last";
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
      std::string s = ranks_text(f.ranks, f.absent_count) + " of " + group_text(g.name) +
                      " left no record (" + no_record_why(f.absent_count) + ")";
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
      if (nodes[q].doings[i].kind == Doing::kCompute || nodes[q].doings[i].kind == Doing::kExited) {
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
                        : d.kind == Doing::kExited ? "exited"
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
    v.details.push_back("also: " + ranks_text(nf.absent, nf.absent_count) + " of " +
                        group_text(node.group->name) + " left no record (" +
                        no_record_why(nf.absent_count) + ")");
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

}  // namespace analysis

Verdict analyze(const std::vector<Dump>& dumps, int files_skipped) {
  Verdict v = analysis::Analyzer(dumps).run(files_skipped);
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

}  // namespace diststrat::trace
