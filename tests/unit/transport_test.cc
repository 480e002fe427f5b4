#include <gtest/gtest.h>

#include <memory>
#include <thread>

#include "allreduce/transport.h"

namespace ds = diststrat;

TEST(InProcessTransport, SendRecvInOrderEitherSideFirst) {
  ds::InProcessTransportGroup g(2);
  std::thread t([&] {
    int a = 1, b = 2;
    auto r1 = g.at(0).send(1, &a, 4, 5);
    auto r2 = g.at(0).send(1, &b, 4, 5);
    std::vector<ds::Request> rs{r1, r2};
    ds::wait_all(rs, ds::Clock::now() + std::chrono::seconds(5));
  });
  int x = 0, y = 0;
  std::this_thread::sleep_for(std::chrono::milliseconds(10));
  auto q1 = g.at(1).recv(0, &x, 4, 5);
  auto q2 = g.at(1).recv(0, &y, 4, 5);
  q1.wait(ds::Clock::now() + std::chrono::seconds(5));
  q2.wait(ds::Clock::now() + std::chrono::seconds(5));
  t.join();
  EXPECT_EQ(x, 1);
  EXPECT_EQ(y, 2);
}

TEST(InProcessTransport, ProbeAnyDeadlineSizeMismatchAndAbort) {
  ds::InProcessTransportGroup g(3);
  ds::Envelope env;
  EXPECT_FALSE(g.at(0).probe_any(&env));
  double v = 3.5;
  auto s = g.at(2).send(0, &v, 8, 9);
  ASSERT_TRUE(g.at(0).probe_any(&env));
  EXPECT_EQ(env.source, 2);
  EXPECT_EQ(env.tag, 9);
  EXPECT_EQ(env.bytes, 8u);
  float wrong;
  auto r = g.at(0).recv(2, &wrong, 4, 9);
  EXPECT_THROW(r.wait(ds::Clock::now() + std::chrono::seconds(1)), ds::InvalidArgumentError);

  int never;
  auto late = g.at(1).recv(0, &never, 4, 1);
  try {
    late.wait(ds::Clock::now() + std::chrono::milliseconds(50));
    FAIL();
  } catch (const ds::DeadlineExceededError& e) {
    EXPECT_NE(e.message().find("from rank 0"), std::string::npos) << e.message();
  }
  g.at(0).abort("rank 0 died");
  EXPECT_THROW(late.wait(ds::Clock::now() + std::chrono::seconds(5)), ds::AbortedError);
  EXPECT_THROW(g.at(1).send(1, &never, 4, 1), ds::InvalidArgumentError);  // to itself
}

// A Request dropped before it completes is cancelled, as the MPI transport's
// is: the transport never touches its buffer afterwards (an algorithm that
// fails a wait unwinds and frees its scratch while other receives are still
// posted into it). A cancelled recv does not consume the message; a cancelled
// send is never delivered.
TEST(InProcessTransport, ADroppedRecvIsCancelledAndNeverWritten) {
  ds::InProcessTransportGroup g(2);
  int dropped = 7;
  { ds::Request r = g.at(1).recv(0, &dropped, sizeof(int), 3); }
  int value = 42;
  ds::Request s = g.at(0).send(1, &value, sizeof(int), 3);
  int got = 0;
  ds::Request r = g.at(1).recv(0, &got, sizeof(int), 3);
  r.wait(ds::Clock::now() + std::chrono::seconds(5));
  s.wait(ds::Clock::now() + std::chrono::seconds(5));
  EXPECT_EQ(dropped, 7);
  EXPECT_EQ(got, 42);
}

TEST(InProcessTransport, ADroppedSendIsCancelledAndNeverRead) {
  ds::InProcessTransportGroup g(2);
  {
    auto gone = std::make_unique<int>(13);
    ds::Request s = g.at(0).send(1, gone.get(), sizeof(int), 4);
  }  // the request, then the buffer, are gone before any recv
  int got = 0;
  ds::Request r = g.at(1).recv(0, &got, sizeof(int), 4);
  EXPECT_THROW(r.wait(ds::Clock::now() + std::chrono::milliseconds(50)), ds::DeadlineExceededError);
  EXPECT_EQ(got, 0);
}
