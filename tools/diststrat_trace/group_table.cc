// The per-group table printed under the verdict.
#include <algorithm>
#include <cstdio>
#include <map>
#include <utility>

#include "analysis_text.h"
#include "trace_analysis.h"

namespace diststrat::trace {

namespace {

// Groups the table shows (the largest).
constexpr size_t kTableGroups = 16;

}  // namespace

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
    // Ranks without a record and rows that differ first, then the usual
    // ones, by rank; only those shown are collected (the size is what a
    // record claims: it allocates nothing).
    auto unusual = [&](const Row& row) {
      return std::make_pair(row.hi, static_cast<int>(dumps[row.dump].calls[row.newest].state)) !=
             usual;
    };
    std::vector<int> show;
    std::vector<int> plain;
    int last_plain = 0;
    int next = 0;
    for (const auto& [r, row] : rows) {
      for (; next < r && show.size() < max_rows; ++next) show.push_back(next);
      next = r + 1;
      if (unusual(row)) {
        if (show.size() < max_rows) show.push_back(r);
      } else {
        if (plain.size() < max_rows) plain.push_back(r);
        last_plain = r;
      }
    }
    for (; next < size && show.size() < max_rows; ++next) show.push_back(next);
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
             std::to_string(last_plain) + "\n";
    }
  }
  return out;
}

}  // namespace diststrat::trace
