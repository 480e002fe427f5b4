// The elastic tests' scenario with workers as threads of one process over the
// Gloo TCP transport on 127.0.0.1 and a directory store
// (tests/unit/elastic_training_test.cc, tests/torch/torch_elastic_test.cc):
// the workers' options, the cues a worker follows (die inside a step, hold
// before one), the kill-then-join choreography and the checks of the end
// state against a sequential reference.
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "diststrat/diststrat.h"
#include "elastic_model.h"
#include "runtime/membership_store.h"

namespace diststrat_test {
namespace elastic_scenario {

struct Death {};  // a worker's thread "dies" by this exception

// An elastic worker `id` of the job in the directory store under `dir`.
inline diststrat::MultiWorkerOptions worker_options(const std::string& dir, const std::string& id,
                                                    int min_workers) {
  diststrat::MultiWorkerOptions o;
  o.elastic.rendezvous = "file://" + dir + "/job";
  o.elastic.worker_id = id;
  o.elastic.min_workers = min_workers;
  o.elastic.listen_host = "127.0.0.1";
  o.elastic.settle_timeout = std::chrono::milliseconds(300);
  o.elastic.join_poll = std::chrono::milliseconds(20);
  o.elastic.join_timeout = std::chrono::seconds(60);
  o.communication.timeout = std::chrono::seconds(30);
  return o;
}

// What the scenario tells a worker.
struct Cues {
  std::string dir;                           // the directory store's
  int die_at_step = -1;                      // this worker dies inside this step (die_if)
  std::atomic<int>* changes_seen = nullptr;  // counts on_membership_change calls
  // Before step hold_at_step, wait while *hold (so that a joiner finds the
  // group still training).
  int hold_at_step = -1;
  std::atomic<bool>* hold = nullptr;
  std::atomic<int>* at_hold = nullptr;  // workers that reached the hold

  // Before the step's batch.
  void hold_if(int64_t step) const {
    if (step != hold_at_step || hold == nullptr || !hold->load()) return;
    ++*at_hold;
    while (hold->load()) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  // Inside the step, before its update.
  void die_if(int64_t step) const {
    if (step == die_at_step) throw Death{};
  }
  // In on_membership_change.
  void changed() const {
    if (changes_seen) ++*changes_seen;
  }
};

// What a worker ends with.
struct Outcome {
  std::vector<float> weights, counts;
  int64_t redone = 0;
  int final_workers = 0;
};

// Three workers a, b and c; c dies inside step 4; once a and b re-formed
// without it, d starts, and a and b hold before step 8 until d waits in the
// store (or was admitted already and holds there too), so that it is
// admitted while they train. `train(id, cues)` runs one worker. Fills
// *survivors (a, b) and *joiner (d); a fatal failure returns early.
template <class Result>
void kill_then_join(const std::string& dir,
                    const std::function<Result(const std::string&, const Cues&)>& train,
                    std::vector<Result>* survivors, Result* joiner) {
  std::atomic<int> changes{0};
  std::atomic<bool> hold{true};
  std::atomic<int> at_hold{0};
  Cues cues;
  cues.dir = dir;
  cues.changes_seen = &changes;
  cues.hold_at_step = 8;  // epoch 1
  cues.hold = &hold;
  cues.at_hold = &at_hold;
  Cues dying = cues;
  dying.die_at_step = 4;  // mid-epoch 0
  auto a = std::async(std::launch::async, [&] { return train("a", cues); });
  auto b = std::async(std::launch::async, [&] { return train("b", cues); });
  auto c = std::async(std::launch::async, [&] {
    try {
      train("c", dying);
    } catch (const Death&) {
      return true;
    }
    return false;
  });
  EXPECT_TRUE(c.get());
  // After the survivors re-formed, a new worker joins.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (changes.load() < 2 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_GE(changes.load(), 2) << "the survivors did not re-form";
  auto d = std::async(std::launch::async, [&] { return train("d", cues); });
  // The survivors wait before step 8 until d waits in the store to be
  // admitted, and long enough for the chief's next look (join_poll 20 ms):
  // otherwise they could finish the last steps before it looks again.
  std::unique_ptr<diststrat::MembershipStore> store =
      diststrat::open_membership_store("file://" + dir + "/job");
  while (
      at_hold.load() < 3 &&
      (at_hold.load() < 2 ||
       !store->read(std::chrono::steady_clock::now() + std::chrono::seconds(5)).is_waiting("d")) &&
      std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  hold = false;
  *survivors = {a.get(), b.get()};
  *joiner = d.get();
  // Their train returned: the group is marked finished (a worker still
  // waiting to join it would be told so).
  EXPECT_TRUE(store->read(std::chrono::steady_clock::now() + std::chrono::seconds(5)).finished);
}

// Workers a and b train and hold before step 4; then `joiner` runs worker c
// (with the same cues), and once c waits in the store to be admitted the
// hold ends. c must be refused: returns the text of the InvalidArgumentError
// it left with (or what happened instead), and fills *group with a's and b's
// results.
template <class Result>
std::string refused_joiner(const std::string& dir,
                           const std::function<Result(const std::string&, const Cues&)>& train,
                           const std::function<void(const std::string&, const Cues&)>& joiner,
                           std::vector<Result>* group) {
  std::atomic<bool> hold{true};
  std::atomic<int> at_hold{0};
  Cues cues;
  cues.dir = dir;
  cues.hold_at_step = 4;
  cues.hold = &hold;
  cues.at_hold = &at_hold;
  auto a = std::async(std::launch::async, [&] { return train("a", cues); });
  auto b = std::async(std::launch::async, [&] { return train("b", cues); });
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (at_hold.load() < 2 && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_EQ(at_hold.load(), 2) << "a and b did not reach step 4";
  auto c = std::async(std::launch::async, [&]() -> std::string {
    try {
      joiner("c", cues);
    } catch (const diststrat::InvalidArgumentError& e) {
      return e.what();
    }
    return "c trained with the group";
  });
  std::unique_ptr<diststrat::MembershipStore> store =
      diststrat::open_membership_store("file://" + dir + "/job");
  while (!store->read(std::chrono::steady_clock::now() + std::chrono::seconds(5)).is_waiting("c") &&
         std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  // Long enough for the chief's next look (join_poll 20 ms).
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  hold = false;
  const std::string error = c.get();
  *group = {a.get(), b.get()};
  return error;
}

// `o` trained like `reference` and used each of its rows exactly `epochs`
// times (the counter adds elastic_model::kLr per use), with `workers` workers
// at the end.
inline void expect_trained(const Outcome& o, const std::vector<float>& reference, int rows,
                           int epochs, int workers) {
  for (int f = 0; f < elastic_model::kFeatures; ++f) {
    EXPECT_NEAR(o.weights[f], reference[f], 1e-5) << "w[" << f << "]";
  }
  for (int r = 0; r < rows; ++r) {
    EXPECT_NEAR(o.counts[r], elastic_model::kLr * epochs, 1e-5)
        << "row " << r << " used " << o.counts[r] / elastic_model::kLr << " times";
  }
  EXPECT_EQ(o.final_workers, workers);
}

}  // namespace elastic_scenario
}  // namespace diststrat_test
