// The elastic membership store (src/runtime/membership_store.h): atomic
// transactions under concurrent writers (threads and processes) on a
// directory and on a real redis-server started here; a damaged record; the
// store stopped and back; rendezvous URLs.
#include "runtime/membership_store.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "diststrat/error.h"
#include "../common/temp_dir.h"

namespace ds = diststrat;

namespace {

using Clock = ds::MembershipStore::Clock;

Clock::time_point in(int ms) { return Clock::now() + std::chrono::milliseconds(ms); }

TEST(Membership, RecordRoundTripsAndDamagedOnesAreDataLoss) {
  ds::Membership m;
  m.generation = 7;
  m.members = {"w0", "host-1:4", "a.b_c"};
  m.dead = {"w9"};
  m.group = 3;
  m.forming = true;
  m.finished = true;
  m.arrived = {"w0", "new"};
  m.waiting = {"late"};
  m.claims = {{"w0", "0123456789abcdef", true}, {"late", "fe", false}};
  const ds::Membership back = ds::Membership::decode(m.encode(), "test");
  ASSERT_EQ(back.claims.size(), 2u);
  EXPECT_EQ(back.claim_of("w0")->token, "0123456789abcdef");
  EXPECT_TRUE(back.claim_of("w0")->member);
  EXPECT_FALSE(back.claim_of("late")->member);
  EXPECT_EQ(back.generation, 7);
  EXPECT_EQ(back.group, 3);
  EXPECT_TRUE(back.forming);
  EXPECT_TRUE(back.finished);
  EXPECT_FALSE(ds::Membership::decode(ds::Membership().encode(), "test").finished);
  EXPECT_EQ(back.members, m.members);
  EXPECT_EQ(back.arrived, m.arrived);
  EXPECT_EQ(back.waiting, m.waiting);
  EXPECT_EQ(back.dead, m.dead);
  for (const char* bad :
       {"",
        "garbage",
        "diststrat-membership 2\ngeneration 1\n",
        "diststrat-membership 1\nmember w0\n",
        "diststrat-membership 1\ngeneration -1\n",
        "diststrat-membership 1\ngeneration 1\nmember \n",
        "diststrat-membership 1\ngeneration 1\nmember w0\nmember w0\n",
        "diststrat-membership 1\ngeneration 1\nmember w 0\n",
        "diststrat-membership 1\ngeneration 1\ngeneration 2\n",
        "diststrat-membership 1\ngeneration 99999999999999999999\n",
        "diststrat-membership 1\ngeneration 1\nleader w0\n",
        "diststrat-membership 1\ngeneration 1\n",  // no group
        "diststrat-membership 1\ngeneration 1\ngroup 1\nforming\nforming\n",
        "diststrat-membership 1\ngeneration 1\ngroup 1\nfinished\nfinished\n",
        "diststrat-membership 1\ngeneration 1\ngroup x\n",
        "diststrat-membership 1\ngeneration 1\ngroup 1\nwaiting a\nwaiting a\n",
        "diststrat-membership 1\ngeneration 1\ngroup 1\nclaim a 0f\n",
        "diststrat-membership 1\ngeneration 1\ngroup 1\nclaim a 0F member\n",
        "diststrat-membership 1\ngeneration 1\ngroup 1\nclaim a 0f leader\n",
        "diststrat-membership 1\ngeneration 1\ngroup 1\nclaim a 0f new extra\n",
        "diststrat-membership 1\ngeneration 1\ngroup 1\nclaim a 0f new\nclaim a 1f new\n",
        "diststrat-membership 1\ngeneration 1\ngroup 1\nclaim a/b 0f new\n"}) {
    SCOPED_TRACE(bad);
    EXPECT_THROW(ds::Membership::decode(bad, "test"), ds::DataLossError);
  }
}

TEST(MembershipStore, RendezvousUrlsAreCheckedBeforeUse) {
  for (const char* bad :
       {"", "redis://", "redis://h/job", "redis://h:0/job", "redis://h:70000/job", "redis://h:6379",
        "redis://h:6379/", "redis://h:6379/a/b", "redis://h x:6379/job", "file://relative/job",
        "file:///dir/", "file:///dir/j;ob", "http://h/job", "etcd://h:2379/job"}) {
    SCOPED_TRACE(bad);
    EXPECT_THROW(ds::open_membership_store(bad), ds::InvalidArgumentError);
  }
  EXPECT_EQ(ds::open_membership_store("file:///tmp/x/job-1")->describe(), "file:///tmp/x/job-1");
}

// `writers` concurrent writers each add `each` members; no write may be lost.
void expect_no_lost_updates(const std::string& url, int writers, int each) {
  std::vector<std::thread> threads;
  for (int w = 0; w < writers; ++w) {
    threads.emplace_back([&, w] {
      auto store = ds::open_membership_store(url);
      for (int i = 0; i < each; ++i) {
        store->transact(
            [&](ds::Membership& m) {
              m.members.push_back("w" + std::to_string(w) + "-" + std::to_string(i));
              return true;
            },
            in(20000));
      }
    });
  }
  for (auto& t : threads) t.join();
  const ds::Membership m = ds::open_membership_store(url)->read(in(5000));
  EXPECT_EQ(m.members.size(), static_cast<size_t>(writers * each));
  EXPECT_EQ(m.generation, writers * each);
}

TEST(MembershipStore, DirectoryTransactionsLoseNoUpdateAcrossThreadsAndProcesses) {
  diststrat_test::TempDir dir("membership_");
  const std::string url = "file://" + dir.path() + "/job";
  expect_no_lost_updates(url, 4, 25);
  // Two processes as well (flock is per open file description).
  const std::string url2 = "file://" + dir.path() + "/job2";
  std::vector<pid_t> kids;
  for (int p = 0; p < 2; ++p) {
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      try {
        auto store = ds::open_membership_store(url2);
        for (int i = 0; i < 40; ++i) {
          store->transact(
              [&](ds::Membership& m) {
                m.members.push_back("p" + std::to_string(p) + "-" + std::to_string(i));
                return true;
              },
              in(20000));
        }
      } catch (...) {
        ::_exit(1);
      }
      ::_exit(0);
    }
    kids.push_back(pid);
  }
  for (pid_t k : kids) {
    int status = 0;
    ASSERT_EQ(::waitpid(k, &status, 0), k);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  const ds::Membership m = ds::open_membership_store(url2)->read(in(5000));
  EXPECT_EQ(m.members.size(), 80u);
  EXPECT_EQ(m.generation, 80);
}

TEST(MembershipStore, AChangeThatThrowsOrDeclinesLeavesTheRecordAsItWas) {
  diststrat_test::TempDir dir("membership_");
  auto store = ds::open_membership_store("file://" + dir.path() + "/job");
  store->transact(
      [](ds::Membership& m) {
        m.members = {"a"};
        return true;
      },
      in(5000));
  EXPECT_THROW(store->transact(
                   [](ds::Membership& m) -> bool {
                     m.members.push_back("b");
                     throw std::runtime_error("no");
                   },
                   in(5000)),
               std::runtime_error);
  EXPECT_EQ(store->read(in(5000)).members, std::vector<std::string>({"a"}));
  EXPECT_EQ(store
                ->transact(
                    [](ds::Membership& m) {
                      m.members.clear();
                      return false;
                    },
                    in(5000))
                .generation,
            1);
  // A damaged record on disk is named, not trusted.
  { std::ofstream(dir / "job.membership") << "diststrat-membership 1\ngeneration x\n"; }
  try {
    store->read(in(5000));
    ADD_FAILURE() << "no error";
  } catch (const ds::DataLossError& e) {
    EXPECT_NE(std::string(e.what()).find("file://" + dir.path() + "/job"), std::string::npos);
  }
}

TEST(MembershipStore, ADirectoryLockHeldPastTheDeadlineIsUnavailableNamingTheStore) {
  diststrat_test::TempDir dir("membership_");
  const std::string url = "file://" + dir.path() + "/job";
  auto store = ds::open_membership_store(url);
  std::atomic<bool> inside{false}, release{false};
  std::thread holder([&] {
    store->transact(
        [&](ds::Membership&) {
          inside = true;
          while (!release) std::this_thread::sleep_for(std::chrono::milliseconds(1));
          return false;
        },
        in(10000));
  });
  while (!inside) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const auto t0 = Clock::now();
  try {
    ds::open_membership_store(url)->read(in(200));
    ADD_FAILURE() << "no error";
  } catch (const ds::UnavailableError& e) {
    EXPECT_NE(std::string(e.what()).find(url), std::string::npos) << e.what();
  }
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(2));
  release = true;
  holder.join();
}

// A redis-server of this test's own on a free port (skipped without one).
class RedisServer {
 public:
  RedisServer() {
    if (::access("/usr/bin/redis-server", X_OK) != 0) return;
    for (int attempt = 0; attempt < 20 && pid_ <= 0; ++attempt) {
      port_ = 20000 + static_cast<int>((::getpid() * 7 + attempt * 131) % 30000);
      start();
    }
  }
  ~RedisServer() { stop(); }
  bool up() const { return pid_ > 0; }
  int port() const { return port_; }
  void stop() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
      pid_ = -1;
    }
  }
  void start() {
    const pid_t pid = ::fork();
    if (pid == 0) {
      const std::string port = std::to_string(port_);
      ::freopen("/dev/null", "w", stdout);
      ::execl("/usr/bin/redis-server", "redis-server", "--port", port.c_str(), "--bind",
              "127.0.0.1", "--save", "", "--appendonly", "no", static_cast<char*>(nullptr));
      ::_exit(127);
    }
    pid_ = pid;
    // Up when it answers (or gone: port taken).
    for (int i = 0; i < 100; ++i) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return;
      }
      try {
        ds::open_membership_store(url())->read(in(100));
        return;
      } catch (const ds::UnavailableError&) {
      }
    }
  }
  std::string url() const { return "redis://127.0.0.1:" + std::to_string(port_) + "/job"; }

 private:
  pid_t pid_ = -1;
  int port_ = 0;
};

bool have_redis_client() {
  try {
    ds::open_membership_store("redis://127.0.0.1:1/job");
    return true;
  } catch (const ds::UnimplementedError&) {
    return false;
  }
}

TEST(MembershipStoreRedis, TransactionsLoseNoUpdateAndAStoppedServerIsNamedWithinTheDeadline) {
  if (!have_redis_client()) GTEST_SKIP() << "this build has no Redis client (hiredis)";
  RedisServer redis;
  if (!redis.up()) GTEST_SKIP() << "no redis-server here (Debian package redis-server)";
  expect_no_lost_updates(redis.url(), 4, 25);

  // Stopped: the error names the store, within the deadline.
  redis.stop();
  const auto t0 = Clock::now();
  try {
    ds::open_membership_store(redis.url())->read(in(300));
    ADD_FAILURE() << "no error";
  } catch (const ds::UnavailableError& e) {
    EXPECT_NE(std::string(e.what()).find(redis.url()), std::string::npos) << e.what();
  }
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(3));

  // Back within the deadline: the transaction waits for it (the record is
  // gone with the server: it kept nothing on disk).
  std::thread restart([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    redis.start();
  });
  const ds::Membership m = ds::open_membership_store(redis.url())
                               ->transact(
                                   [](ds::Membership& r) {
                                     r.members = {"w0"};
                                     return true;
                                   },
                                   in(10000));
  restart.join();
  ASSERT_TRUE(redis.up());
  EXPECT_EQ(m.members, std::vector<std::string>({"w0"}));
  EXPECT_EQ(m.generation, 1);
}

}  // namespace
