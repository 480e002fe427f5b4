// How elastic workers form groups through the membership store
// (src/runtime/elastic_rendezvous.h), workers as threads on a directory store:
// the first group, a member that never comes back (declared dead after the
// settle time, the new chief the lowest surviving rank), a dead id refused, a
// waiting worker admitted at the next round, a waiting worker that never
// arrives (declared dead), max_workers, and a round that never reaches
// min_workers.
#include "runtime/elastic_rendezvous.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <future>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "diststrat/error.h"
#include "../common/temp_dir.h"

namespace ds = diststrat;

namespace {

using Clock = ds::ElasticRendezvous::Clock;

Clock::time_point in_ms(int ms) { return Clock::now() + std::chrono::milliseconds(ms); }

ds::RendezvousOptions quick(int min, int max = 0) {
  ds::RendezvousOptions o;
  o.min_workers = min;
  o.max_workers = max;
  o.settle = std::chrono::milliseconds(300);
  o.poll = std::chrono::milliseconds(5);
  return o;
}

ds::ElasticRendezvous make(const diststrat_test::TempDir& dir, const std::string& id,
                           ds::RendezvousOptions o) {
  return ds::ElasticRendezvous(ds::open_membership_store("file://" + dir.path() + "/job"), id, o);
}

// Each worker joins (from `last`, if given) on its own thread.
std::vector<ds::GroupView> join_all(std::vector<ds::ElasticRendezvous*> workers,
                                    std::vector<const ds::GroupView*> last) {
  std::vector<std::future<ds::GroupView>> f;
  for (size_t i = 0; i < workers.size(); ++i) {
    f.push_back(std::async(std::launch::async, [&, i] {
      return workers[i]->join(last.empty() ? nullptr : last[i], in_ms(10000)).value();
    }));
  }
  std::vector<ds::GroupView> out;
  for (auto& x : f) out.push_back(x.get());
  return out;
}

TEST(ElasticRendezvous, TheFirstGroupFormsWithEveryWorkerThatCameAndSurvivorsReformWithoutTheDead) {
  diststrat_test::TempDir dir("elastic_rdzv");
  ds::ElasticRendezvous a = make(dir, "a", quick(2, 3)), b = make(dir, "b", quick(2, 3)),
                        c = make(dir, "c", quick(2, 3));
  std::vector<ds::GroupView> g = join_all({&a, &b, &c}, {});
  for (const ds::GroupView& v : g) {
    EXPECT_EQ(v.group, 1);
    EXPECT_EQ(v.members.size(), 3u);  // max_workers reached: no settle wait
    EXPECT_EQ(v.members, g[0].members);
  }
  EXPECT_EQ(g[0].members[static_cast<size_t>(g[0].rank)], "a");
  // The worker of rank 0 dies: the two others re-form after the settle time.
  const std::string gone = g[0].members[0];
  std::vector<ds::ElasticRendezvous*> rest;
  std::vector<const ds::GroupView*> last;
  for (size_t i = 0; i < 3; ++i) {
    if (g[i].members[static_cast<size_t>(g[i].rank)] != gone) {
      rest.push_back(i == 0 ? &a : i == 1 ? &b : &c);
      last.push_back(&g[i]);
    }
  }
  const auto t0 = Clock::now();
  std::vector<ds::GroupView> h = join_all(rest, last);
  EXPECT_GE(Clock::now() - t0, std::chrono::milliseconds(300));
  for (const ds::GroupView& v : h) {
    EXPECT_EQ(v.group, 2);
    // The survivors keep their order: the new chief is the lowest surviving rank.
    EXPECT_EQ(v.members, std::vector<std::string>(g[0].members.begin() + 1, g[0].members.end()));
    EXPECT_EQ(v.left, std::vector<std::string>{gone});
    EXPECT_TRUE(v.joined.empty());
  }
  // The dead id is never admitted again (the caller joins under a new id).
  ds::ElasticRendezvous back = make(dir, gone, quick(1));
  EXPECT_FALSE(back.join(nullptr, in_ms(2000)).has_value());
}

TEST(ElasticRendezvous, AWaitingWorkerIsSeenByTheGroupAndAdmittedWhenItReforms) {
  diststrat_test::TempDir dir("elastic_rdzv");
  ds::ElasticRendezvous a = make(dir, "a", quick(2, 3)), b = make(dir, "b", quick(2, 3));
  std::vector<ds::GroupView> g = join_all({&a, &b}, {});
  EXPECT_FALSE(a.joiners_waiting(g[0].group, in_ms(2000)));
  ds::ElasticRendezvous c = make(dir, "c", quick(2, 3));
  auto joined =
      std::async(std::launch::async, [&] { return c.join(nullptr, in_ms(10000)).value(); });
  const auto until = in_ms(5000);
  while (!a.joiners_waiting(g[0].group, in_ms(2000)) && Clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_TRUE(a.joiners_waiting(g[0].group, in_ms(2000)));
  // The group re-forms (its members made anew here, with room for three).
  ds::ElasticRendezvous a3 = make(dir, "a", quick(2, 3)), b3 = make(dir, "b", quick(2, 3));
  std::vector<ds::GroupView> h = join_all({&a3, &b3}, {&g[0], &g[1]});
  const ds::GroupView cv = joined.get();
  EXPECT_EQ(cv.group, h[0].group);
  // The members keep their order (whoever arrived first at the first round
  // leads), the newcomer comes last.
  std::vector<std::string> want = g[0].members;
  want.push_back("c");
  EXPECT_EQ(cv.members, want);
  EXPECT_EQ(cv.rank, 2);
  EXPECT_EQ(h[0].joined, std::vector<std::string>{"c"});
  EXPECT_FALSE(a3.joiners_waiting(cv.group, in_ms(2000)));
}

// A process with no group yet whose id the record lists (it restarted under
// its id, or the record is a finished job's, the same URL run again) must not
// take that group for its own: before, it did, and connected to addresses of
// processes long gone (hangs and lost workers when a job was run twice).
TEST(ElasticRendezvous, ARerunUnderTheSameIdsFormsANewGroup) {
  diststrat_test::TempDir dir("elastic_rdzv");
  ds::ElasticRendezvous a = make(dir, "a", quick(2, 2)), b = make(dir, "b", quick(2, 2));
  const std::vector<ds::GroupView> first = join_all({&a, &b}, {});
  ds::ElasticRendezvous a2 = make(dir, "a", quick(2, 2)), b2 = make(dir, "b", quick(2, 2));
  const std::vector<ds::GroupView> again = join_all({&a2, &b2}, {});
  for (const ds::GroupView& v : again) EXPECT_GT(v.group, first[0].group);
}

// A worker waiting to be admitted by a group that then finishes its training
// is told so at once (before, it waited until its join_timeout, 10 minutes
// by default); a worker that comes after that starts the job again, and a
// finished group's members can still form the next one.
TEST(ElasticRendezvous, AWorkerWaitingForAGroupThatFinishesIsToldSo) {
  diststrat_test::TempDir dir("elastic_rdzv");
  ds::ElasticRendezvous a = make(dir, "a", quick(2, 3)), b = make(dir, "b", quick(2, 3));
  const std::vector<ds::GroupView> g = join_all({&a, &b}, {});
  ds::ElasticRendezvous c = make(dir, "c", quick(2, 3));
  auto waited = std::async(std::launch::async, [&] { return c.join(nullptr, in_ms(60000)); });
  const auto until = in_ms(5000);
  while (!a.joiners_waiting(g[0].group, in_ms(2000)) && Clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_TRUE(a.joiners_waiting(g[0].group, in_ms(2000)));
  const auto t0 = Clock::now();
  a.finish(g[0].group, in_ms(2000));
  try {
    waited.get();
    ADD_FAILURE() << "the waiting worker joined a finished group";
  } catch (const ds::FailedPreconditionError& e) {
    EXPECT_NE(std::string(e.what()).find("worker 'c' waited to join group 1"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("finished its training"), std::string::npos) << e.what();
  }
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(5));
  b.finish(g[0].group, in_ms(2000));  // a second member's mark changes nothing
  // The next workers start the job again under their ids.
  ds::ElasticRendezvous a2 = make(dir, "a", quick(2, 2)), c2 = make(dir, "c", quick(2, 2));
  const std::vector<ds::GroupView> again = join_all({&a2, &c2}, {});
  for (const ds::GroupView& v : again) {
    EXPECT_EQ(v.group, g[0].group + 1);
    EXPECT_EQ(v.members.size(), 2u);
  }
}

// What a worker's strategy does (MultiWorkerMirroredStrategy::Impl::join_group):
// joins; declared dead, it joins again as "<id>.r<n>", a new worker.
std::optional<ds::GroupView> join_as_a_worker(ds::ElasticRendezvous& w, const ds::GroupView* last,
                                              Clock::time_point deadline) {
  const std::string base = w.id();
  for (int rejoins = 1;; ++rejoins) {
    if (std::optional<ds::GroupView> v = w.join(last, deadline)) return v;
    w.set_id(base + ".r" + std::to_string(rejoins));
    last = nullptr;
  }
}

// A process that took part in a run and comes back after the run finished
// without it (SIGSTOPped past the timeout and continued after the end; or
// stopped while it waited to be admitted) is told at once that its run has
// ended. Before, it joined again as "<id>.r1", opened a new round and waited
// for min_workers until its join_timeout (10 minutes by default). New
// processes at the same URL still start a new run, under the same ids too.
TEST(ElasticRendezvous, AWorkerLeftBehindByARunThatFinishedIsToldItEnded) {
  diststrat_test::TempDir dir("elastic_rdzv");
  ds::ElasticRendezvous a = make(dir, "a", quick(2, 3)), b = make(dir, "b", quick(2, 3)),
                        c = make(dir, "c", quick(2, 3));
  const std::vector<ds::GroupView> g = join_all({&a, &b, &c}, {});
  // w waits to be admitted, then stops (its deadline passes: it polls no more).
  ds::ElasticRendezvous w = make(dir, "w", quick(2, 3));
  EXPECT_THROW(w.join(nullptr, in_ms(50)), ds::UnavailableError);
  // c stops too: a and b re-form without it (and without w) and finish.
  std::vector<ds::GroupView> h = join_all({&a, &b}, {&g[0], &g[1]});
  // (In the order the first group listed them, which is the order they came.)
  std::vector<std::string> members = h[0].members;
  std::sort(members.begin(), members.end());
  ASSERT_EQ(members, (std::vector<std::string>{"a", "b"}));
  a.finish(h[0].group, in_ms(2000));
  // Both come back after the end.
  for (auto [who, last] :
       {std::pair<ds::ElasticRendezvous*, const ds::GroupView*>{&c, &g[2]}, {&w, nullptr}}) {
    const auto t0 = Clock::now();
    try {
      join_as_a_worker(*who, last, in_ms(3000));
      ADD_FAILURE() << who->id() << " formed a group after its run ended";
    } catch (const ds::FailedPreconditionError& e) {
      EXPECT_NE(std::string(e.what()).find("took part in the run"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("has ended"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("group " + std::to_string(h[0].group) + " finished"),
                std::string::npos)
          << e.what();
    } catch (const ds::Error& e) {
      ADD_FAILURE() << who->id() << ": " << e.what();
    }
    EXPECT_LT(Clock::now() - t0, std::chrono::seconds(1)) << who->id() << " was not told at once";
  }
  // A new run at the same URL, under the same ids (c's is dead: c.r1).
  ds::ElasticRendezvous a2 = make(dir, "a", quick(2, 3)), c2 = make(dir, "c", quick(2, 3));
  auto fa =
      std::async(std::launch::async, [&] { return join_as_a_worker(a2, nullptr, in_ms(10000)); });
  auto fc =
      std::async(std::launch::async, [&] { return join_as_a_worker(c2, nullptr, in_ms(10000)); });
  const std::optional<ds::GroupView> va = fa.get(), vc = fc.get();
  ASSERT_TRUE(va && vc);
  EXPECT_GT(va->group, h[0].group);
  EXPECT_EQ(va->members, vc->members);
  EXPECT_EQ(va->members.size(), 2u);
}

// Two live processes under one id are never one member: a second process
// waiting under the id of a waiting worker is refused at once, naming it.
TEST(ElasticRendezvous, ASecondLiveProcessUnderAWaitingIdIsRefused) {
  diststrat_test::TempDir dir("elastic_rdzv");
  ds::ElasticRendezvous a = make(dir, "a", quick(2)), b = make(dir, "b", quick(2));
  const std::vector<ds::GroupView> g = join_all({&a, &b}, {});
  ds::ElasticRendezvous x1 = make(dir, "x", quick(2)), x2 = make(dir, "x", quick(2));
  auto first = std::async(std::launch::async, [&] {
    try {
      x1.join(nullptr, in_ms(1500));
    } catch (const ds::UnavailableError&) {  // never admitted here: the group does not re-form
    }
  });
  const auto until = in_ms(5000);
  while (!a.joiners_waiting(g[0].group, in_ms(2000)) && Clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  try {
    x2.join(nullptr, in_ms(3000));
    ADD_FAILURE() << "a second process under the waiting id 'x' was let in";
  } catch (const ds::InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("worker id 'x' is taken"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("waiting"), std::string::npos) << e.what();
  }
  first.get();
}

// A live member and a new process under its id (a second copy started by
// mistake): the group re-forms, the member keeps its id (it arrives within
// the settle time) and the copy is refused; never both. (An outside trial
// saw the copy win and the live member refused: the round closed on the
// copy's arrival before the member came.)
TEST(ElasticRendezvous, ALiveMemberAndANewProcessUnderItsIdAreNeverBothMembers) {
  diststrat_test::TempDir dir("elastic_rdzv");
  ds::ElasticRendezvous a = make(dir, "a", quick(2)), b = make(dir, "b", quick(2));
  const std::vector<ds::GroupView> g = join_all({&a, &b}, {});
  ds::ElasticRendezvous a2 = make(dir, "a", quick(2));
  auto outcome = [](ds::ElasticRendezvous& w, const ds::GroupView* last) {
    return std::async(std::launch::async, [&w, last]() -> std::optional<ds::GroupView> {
      try {
        return w.join(last, in_ms(5000));
      } catch (const ds::InvalidArgumentError& e) {
        EXPECT_NE(std::string(e.what()).find("worker id 'a' is taken"), std::string::npos)
            << e.what();
        return std::nullopt;
      }
    });
  };
  // The copy opens a round, b arrives, and a comes last (within the settle
  // time of 300 ms), as a member that notices the round at its next step does.
  auto copy = outcome(a2, nullptr);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  auto other = outcome(b, &g[1]);
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  auto original = outcome(a, &g[0]);
  const std::optional<ds::GroupView> vo = original.get(), vc = copy.get(), vb = other.get();
  ASSERT_TRUE(vb.has_value());
  EXPECT_TRUE(vo.has_value()) << "the live member was refused";
  EXPECT_FALSE(vc.has_value()) << "the copy under 'a' got a group";
  EXPECT_EQ(vb->members.size(), 2u);
}

// A full group (max_workers) does not re-form for a waiting worker: before,
// it re-formed at every look of its chief and declared healthy members dead.
TEST(ElasticRendezvous, AFullGroupDoesNotReformForAWaitingWorker) {
  diststrat_test::TempDir dir("elastic_rdzv");
  ds::ElasticRendezvous a = make(dir, "a", quick(2, 2)), b = make(dir, "b", quick(2, 2));
  const std::vector<ds::GroupView> g = join_all({&a, &b}, {});
  ds::ElasticRendezvous c = make(dir, "c", quick(2, 2));
  EXPECT_THROW(c.join(nullptr, in_ms(200)), ds::UnavailableError);  // waits; no place
  EXPECT_FALSE(a.joiners_waiting(g[0].group, in_ms(2000)));
}

// A joiner that is killed while it waits to be admitted (listed as waiting,
// never arriving at the round it caused) is declared dead when the round
// closes at the settle time, and never waited for again. Before, it stayed
// listed as waiting: joiners_waiting() said yes after every round and the
// group re-formed forever (issue 43: 16 group changes in 34 s, no step done).
TEST(ElasticRendezvous, AJoinerThatDiesWhileWaitingIsDeclaredDeadAndNotWaitedForAgain) {
  diststrat_test::TempDir dir("elastic_rdzv");
  ds::ElasticRendezvous a = make(dir, "a", quick(2)), b = make(dir, "b", quick(2));
  std::vector<ds::GroupView> g = join_all({&a, &b}, {});
  {
    // Registers as waiting, then its process "dies": it never polls again.
    ds::ElasticRendezvous ghost = make(dir, "ghost", quick(2));
    EXPECT_THROW(ghost.join(nullptr, in_ms(50)), ds::UnavailableError);
  }
  ASSERT_TRUE(a.joiners_waiting(g[0].group, in_ms(2000)));
  // What the running group does: re-form while its chief sees a joiner
  // waiting. Bounded: once for the ghost, never again.
  int reforms = 0;
  const auto t0 = Clock::now();
  while (a.joiners_waiting(g[0].group, in_ms(2000)) && reforms < 5) {
    g = join_all({&a, &b}, {&g[0], &g[1]});
    ++reforms;
    // The members as a set: their order is the order they came to the
    // round, which the two threads do not fix.
    std::vector<std::string> members = g[0].members;
    std::sort(members.begin(), members.end());
    EXPECT_EQ(members, (std::vector<std::string>{"a", "b"}));
  }
  EXPECT_EQ(reforms, 1) << "the group re-formed for a joiner that never came";
  EXPECT_FALSE(a.joiners_waiting(g[0].group, in_ms(2000)));
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(5));
  // Its record: dead, no longer waiting. Under that id it is never admitted
  // again: a process that comes back under it joins as a new worker.
  const ds::Membership m =
      ds::open_membership_store("file://" + dir.path() + "/job")->read(in_ms(2000));
  EXPECT_TRUE(m.is_dead("ghost"));
  EXPECT_FALSE(m.is_waiting("ghost"));
  ds::ElasticRendezvous back = make(dir, "ghost", quick(2));
  EXPECT_FALSE(back.join(nullptr, in_ms(2000)).has_value());
  EXPECT_FALSE(a.joiners_waiting(g[0].group, in_ms(2000)));
}

TEST(ElasticRendezvous, ARoundBelowMinWorkersFormsNoGroupAndSaysHowManyCame) {
  diststrat_test::TempDir dir("elastic_rdzv");
  ds::ElasticRendezvous a = make(dir, "a", quick(2));
  try {
    a.join(nullptr, in_ms(500));
    FAIL() << "formed a group alone with min_workers 2";
  } catch (const ds::UnavailableError& e) {
    EXPECT_NE(std::string(e.what()).find("1 worker(s) arrived of the 2 needed"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("file://"), std::string::npos) << e.what();
  }
  EXPECT_THROW(make(dir, "x", quick(0)), ds::InvalidArgumentError);
  EXPECT_THROW(make(dir, "x", quick(3, 2)), ds::InvalidArgumentError);
  EXPECT_THROW(make(dir, "bad id", quick(1)), ds::InvalidArgumentError);
}

}  // namespace
