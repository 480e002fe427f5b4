// ElasticOptions: how a MultiWorkerMirroredStrategy worker takes part in an
// elastic job (workers may die and join while it trains; see
// diststrat/elastic.h for the training loop and docs/elastic.md).
//
// Rules: the options are read once, when the strategy is made. Every worker
// of one job gives the same rendezvous URL, min/max workers and timeouts, and
// distributes the same data (dataset, global batch, seed and options: a
// worker that differs from the group is refused when it is admitted).
// Durations are positive and at most 30 days.
#pragma once

#include <chrono>
#include <string>

namespace diststrat {

struct ElasticOptions {
  // Where the workers meet and the membership is decided (one atomic record
  // per job): "redis://host:port/job" for several hosts, "file:///dir/job"
  // for one host (or a directory every host shares). Empty: not elastic.
  std::string rendezvous;
  // A group trains only with at least min_workers; at most max_workers are
  // admitted (0: no limit; the others wait until a place is free).
  int min_workers = 1;
  int max_workers = 0;
  // This worker's id in the job (1-256 of [A-Za-z0-9._:-]). Empty:
  // DISTSTRAT_WORKER_ID, else "<host name>-<pid>". An id declared dead is
  // never admitted again: such a worker joins again as "<id>.r<n>".
  std::string worker_id;
  // The host name or address peers reach this worker at (its TCP transport
  // binds there). Empty: this host's name.
  std::string listen_host;
  // How long a re-forming group waits for members that have not arrived,
  // once min_workers have (a dead member never arrives): the time a death
  // costs on top of the redone step.
  std::chrono::milliseconds settle_timeout{2000};
  // How long a worker waits for a group with it to form (a new worker
  // waiting to be admitted included) before UnavailableError: counted from
  // the strategy's construction for the first group, and from each break of
  // its group for the next (a worker declared dead that joins again as
  // "<id>.r<n>" does so within the same wait).
  std::chrono::milliseconds join_timeout{std::chrono::minutes(10)};
  // How often the chief looks in the store for waiting workers (between
  // steps; the group admits them at the next step boundary after it sees
  // them).
  std::chrono::milliseconds join_poll{500};

  bool enabled() const { return !rendezvous.empty(); }
};

}  // namespace diststrat
