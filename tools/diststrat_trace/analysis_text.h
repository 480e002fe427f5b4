// Wording shared by the verdict and the group table: how calls, groups,
// ranks and times are written (every string from a record escaped).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "flight_record.h"

namespace diststrat::trace {

// "dense2/kernel +3 more" -> "'dense2/kernel' +3 more"; "" -> "".
std::string quoted_name(const std::string& name);
std::string kind_text(const Call& c);
std::string group_text(const std::string& g);
std::string seconds(int64_t us);
// "all_reduce #4171 ('dense2/kernel' +3 more, 1.2 MB)".
std::string call_desc(const Call& c);
// "broadcast #88 of group 'ps'".
std::string call_where(const Call& c);
// "all_reduce 'a' (count 1024, float32, sum, 4 KB)": what a mismatch compares.
std::string variant_desc(const Call& c);
// `s` (already escaped) in at most `width` bytes: cut with "..." at a
// character boundary.
std::string fit(const std::string& s, size_t width);
// "1, 2, 3 and 7 more": at most `cap` of v; `total` (when larger than v)
// counts ranks v leaves out.
std::string join_ints(const std::vector<int>& v, size_t cap = 16, size_t total = 0);
std::string ranks_text(const std::vector<int>& v, size_t total = 0);

}  // namespace diststrat::trace
