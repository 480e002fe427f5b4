// Where each group's members first diverge (a mismatch, a missing member,
// a member without a record), and what a missing member does instead.
#include <algorithm>

#include "analyzer.h"

namespace diststrat::trace::analysis {

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
  // The ranks between members (every member's rank is below g.size).
  int next = 0;
  for (const auto& [r, m] : g.members) {
    for (; next < r && f.absent.size() < kExplained; ++next) f.absent.push_back(next);
    next = r + 1;
  }
  for (; next < g.size && f.absent.size() < kExplained; ++next) f.absent.push_back(next);
  f.absent_count = static_cast<size_t>(g.size) - g.members.size();
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
  d.kind = dump.trigger == "exit" ? Doing::kExited : Doing::kCompute;
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

}  // namespace diststrat::trace::analysis
