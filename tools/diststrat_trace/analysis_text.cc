#include "analysis_text.h"

#include <algorithm>
#include <cstdio>

#include "trace_analysis.h"

namespace diststrat::trace {

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

std::string join_ints(const std::vector<int>& v, size_t cap, size_t total) {
  total = std::max(total, v.size());
  std::string s;
  for (size_t i = 0; i < v.size() && i < cap; ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  const size_t shown = std::min(v.size(), cap);
  if (total > shown) s += " and " + std::to_string(total - shown) + " more";
  return s;
}

std::string ranks_text(const std::vector<int>& v, size_t total) {
  return (std::max(total, v.size()) == 1 ? "rank " : "ranks ") + join_ints(v, 16, total);
}

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

}  // namespace diststrat::trace
