#include "chrome_trace.h"

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>
#include <utility>

namespace diststrat::trace {

namespace {

using ojson = nlohmann::ordered_json;

// Strings came through the JSON parser (valid UTF-8); replace anyway, so
// that a bad byte can never make dump() throw.
std::string text(const ojson& j) { return j.dump(-1, ' ', false, ojson::error_handler_t::replace); }

ojson metadata(const char* what, int pid, int tid, const std::string& name) {
  ojson e;
  e["ph"] = "M";
  e["name"] = what;
  e["pid"] = pid;
  if (tid >= 0) e["tid"] = tid;
  e["args"] = ojson{{"name", name}};
  return e;
}

}  // namespace

std::vector<std::string> chrome_trace_events(const std::vector<Dump>& dumps) {
  std::vector<std::string> events;
  for (size_t d = 0; d < dumps.size(); ++d) {
    const Dump& dump = dumps[d];
    const int pid = dump.rank >= 0 ? dump.rank : kUnknownRankPid + static_cast<int>(d);
    // The Timeline names its process lane "rank N": the same name, so that
    // merged files show one lane per rank. Host, pid and file go in labels.
    events.push_back(text(metadata(
        "process_name", pid, -1,
        dump.rank >= 0 ? "rank " + std::to_string(dump.rank) : "rank ? (" + dump.file + ")")));
    ojson labels;
    labels["ph"] = "M";
    labels["name"] = "process_labels";
    labels["pid"] = pid;
    labels["args"] = ojson{{"labels", "flight record " + dump.file + ", host " + dump.host +
                                          ", pid " + std::to_string(dump.pid)}};
    events.push_back(text(labels));

    std::map<std::pair<std::string, int>, int> lanes;  // (group, thread) -> tid
    const int64_t base = dump.epoch_unix_us;
    for (const Call& c : dump.calls) {
      if (dump.superseded.count({c.group, c.group_rank})) continue;
      auto [lane, fresh] =
          lanes.try_emplace({c.group, c.thread}, kFirstFlightLane + static_cast<int>(lanes.size()));
      if (fresh) {
        events.push_back(
            text(metadata("thread_name", pid, lane->second,
                          "flight: group " + c.group + ", thread " + std::to_string(c.thread))));
      }
      const int64_t begin = c.start_us >= 0 ? c.start_us : c.enqueue_us;
      if (begin < 0) continue;  // never reached the queue: nothing to place
      const bool open = in_flight(c.state) || c.end_us < 0;
      const int64_t end = open ? std::max(begin, dump.dump_time_us) : std::max(begin, c.end_us);
      ojson e;
      // The lane label, capped (args hold the whole name).
      e["name"] = echo_text(c.kind, 40) + " #" + std::to_string(c.seq) +
                  (c.name.empty() ? "" : " " + echo_text(c.name, 160));
      e["cat"] = "flight";
      e["ph"] = "X";
      e["ts"] = base + begin;
      e["dur"] = end - begin;
      e["pid"] = pid;
      e["tid"] = lane->second;
      ojson args;
      args["group"] = c.group;
      args["group_rank"] = c.group_rank;
      args["group_size"] = c.group_size;
      args["seq"] = c.seq;
      args["kind"] = c.kind;
      args["name"] = c.name;
      args["count"] = c.count;
      args["dtype"] = c.dtype;
      args["op"] = c.op;
      args["root"] = c.root;
      args["algorithm"] = c.algorithm;
      args["bytes"] = c.bytes;
      args["state"] = state_name(c.state);
      args["enqueue_us"] = c.enqueue_us;
      args["start_us"] = c.start_us;
      args["end_us"] = c.end_us;
      if (open) args["in_flight_at_dump"] = true;
      if (!c.waiting_on.empty()) args["waiting_on"] = c.waiting_on;
      if (!c.error.empty()) args["error"] = c.error;
      if (!c.site.empty()) args["site"] = c.site;
      e["args"] = std::move(args);
      events.push_back(text(e));
    }
    ojson dumped;
    dumped["name"] = "flight record dumped";
    dumped["cat"] = "flight";
    dumped["ph"] = "i";
    dumped["s"] = "p";
    dumped["ts"] = base + dump.dump_time_us;
    dumped["pid"] = pid;
    dumped["tid"] = kFirstFlightLane;
    dumped["args"] = ojson{{"reason", dump.reason}, {"file", dump.file}};
    events.push_back(text(dumped));
  }
  return events;
}

}  // namespace diststrat::trace
