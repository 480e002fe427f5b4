// Strings that came from outside (tensor and variable names, TF_CONFIG,
// environment variables, file contents) as error messages echo them: at
// most kMaxEchoedChars characters, then how long the string was; control
// characters escaped, so a message stays one readable line whatever it
// quotes.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace diststrat {

constexpr size_t kMaxEchoedChars = 200;

// The length of the well-formed UTF-8 sequence at s[i] (within the first n
// bytes), or 0 when there is none there.
inline size_t utf8_sequence_length(const std::string& s, size_t i, size_t n) {
  const unsigned char c = static_cast<unsigned char>(s[i]);
  const size_t len = c >= 0xc2 && c <= 0xdf   ? 2
                     : c >= 0xe0 && c <= 0xef ? 3
                     : c >= 0xf0 && c <= 0xf4 ? 4
                                              : 0;
  if (len == 0 || i + len > n) return 0;
  for (size_t k = 1; k < len; ++k) {
    const unsigned char t = static_cast<unsigned char>(s[i + k]);
    if (t < 0x80 || t > 0xbf) return 0;
  }
  return len;
}

// Appends the first `n` bytes of `s` to `out` with newline, tab, the other
// control characters and bytes that are not well-formed UTF-8 escaped (\n,
// \t, \xNN): binary garbage reads as escapes, names in UTF-8 as themselves.
inline void append_escaped(std::string& out, const std::string& s, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c >= 0x80) {
      if (const size_t len = utf8_sequence_length(s, i, n)) {
        out.append(s, i, len);
        i += len - 1;
        continue;
      }
    }
    if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c >= 0x7f) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "\\x%02x", c);
      out += hex;
    } else {
      out += static_cast<char>(c);
    }
  }
}

// "abc", or the first kMaxEchoedChars characters + "... (12345 characters)".
inline std::string echo(const std::string& s, size_t max_chars = kMaxEchoedChars) {
  std::string out;
  const size_t shown = s.size() <= max_chars ? s.size() : max_chars;
  out.reserve(shown + 32);
  append_escaped(out, s, shown);
  if (shown < s.size()) out += "... (" + std::to_string(s.size()) + " characters)";
  return out;
}

// Writes at most `max_bytes` of `s` into the fixed-size slot `out` (room for
// max_bytes) and returns the length written: all of it when it fits, else
// its start and its end around "..." -- names that differ only at the end
// (the fusion engine's pack names) stay apart. Allocates nothing: the
// collectives fill such slots on every call.
inline size_t head_and_tail_to(const std::string& s, size_t max_bytes, char* out) {
  if (s.size() <= max_bytes || max_bytes < 8) {
    const size_t n = std::min(s.size(), max_bytes);
    std::memcpy(out, s.data(), n);
    return n;
  }
  const size_t tail = (max_bytes - 3) / 3, head = max_bytes - 3 - tail;
  std::memcpy(out, s.data(), head);
  std::memcpy(out + head, "...", 3);
  std::memcpy(out + head + 3, s.data() + s.size() - tail, tail);
  return max_bytes;
}
// Ranks as messages list them: "0, 2, 5".
inline std::string join_ranks(const std::vector<int>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}
// "rank 3", "ranks 0, 2".
inline std::string ranks_phrase(const std::vector<int>& ranks) {
  return (ranks.size() == 1 ? "rank " : "ranks ") + join_ranks(ranks);
}

}  // namespace diststrat
