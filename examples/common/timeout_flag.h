// --timeout SECONDS, one definition for the examples and the benchmarks:
// how long any collective (and set-up, and exit) waits for its peers.
// Checked as the library checks DISTSTRAT_TIMEOUT (timeout_seconds_error).
#pragma once

#include <CLI/CLI.hpp>
#include <string>

#include "diststrat/diststrat.h"

namespace diststrat_examples {

// Adds --timeout to `app`; the value stays text until apply_timeout.
// `fallback`: the wait the program has without the flag and the variable.
inline CLI::Option* add_timeout_flag(CLI::App& app, std::string& seconds,
                                     const std::string& fallback = "300") {
  return app
      .add_option("--timeout", seconds,
                  "seconds any collective (and set-up, and exit) waits for peers, fractional "
                  "allowed (default: $DISTSTRAT_TIMEOUT, else " +
                      fallback + ")")
      ->check(diststrat::timeout_seconds_error);
}

// A --timeout value given (not empty) becomes `comm`'s timeout.
inline void apply_timeout(const std::string& seconds, diststrat::CommunicationOptions& comm) {
  if (!seconds.empty()) comm.timeout = diststrat::parse_timeout_seconds(seconds);
}

}  // namespace diststrat_examples
