// Error messages say what the user wrote: the user's tensors (not internal
// collectives), the replica, what is wrong with an address; and they echo at
// most ~200 characters of any string that came from the user.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "diststrat/diststrat.h"
#include "diststrat/multi_worker_mirrored.h"
#include "core/user_text.h"
#include "harness.h"
#include "training_util.h"

namespace ds = diststrat;

namespace {

// An error message that quotes a user string of `n` characters stays short
// and says how long the string was.
void expect_bounded(const std::string& msg, size_t n, const std::string& what) {
  EXPECT_LT(msg.size(), 700u) << what << ": " << msg.substr(0, 1000);
  EXPECT_NE(msg.find("(" + std::to_string(n) + " characters)"), std::string::npos)
      << what << ": " << msg.substr(0, 1000);
}

std::string message_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const ds::Error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

// Text from outside as messages quote it: bytes that are not UTF-8 (a
// garbage store key, a damaged file) read as escapes, UTF-8 names as
// themselves. Before, bytes >= 0x80 went into the message raw.
TEST(ErrorMessages, QuotedBytesThatAreNotUtf8AreEscapedAndUtf8IsKept) {
  EXPECT_EQ(ds::echo("w\xc3\xa9ight"), "w\xc3\xa9ight");
  EXPECT_EQ(ds::echo("a\xff\xfe"
                     "b\xc3"),
            "a\\xff\\xfeb\\xc3");
  EXPECT_EQ(ds::echo("\xe2\x82\xac\x7f\xed"), "\xe2\x82\xac\\x7f\\xed");
  EXPECT_EQ(ds::echo("\xc0\xaf"), "\\xc0\\xaf");  // an overlong '/'
}

TEST(ErrorMessages, MultiWorkerDeadlineNamesTheUsersTensorsNotTheSignatureExchange) {
  ds::CommunicationOptions co;
  co.timeout = std::chrono::milliseconds(300);
  ds::InProcessGroup group(2, co);
  std::string message;
  std::atomic<bool> done{false};
  ds::testing::run_ranks(group, [&](ds::Communicator& comm) {
    ds::MultiWorkerOptions o;
    o.communication = co;
    o.communicator = &comm;
    ds::MultiWorkerMirroredStrategy s(o);
    if (comm.rank() == 1) {  // never joins the step; waits until rank 0 gave up
      while (!done.load()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      return;
    }
    message = message_of([&] {
      s.run([&](ds::ReplicaContext& ctx) {
        std::vector<ds::Tensor> g{ds::Tensor(ds::Shape{8}, ds::DType::kFloat32),
                                  ds::Tensor(ds::Shape{2}, ds::DType::kFloat32),
                                  ds::Tensor(ds::Shape{3}, ds::DType::kFloat32)};
        ctx.all_reduce(ds::ReduceOp::kSum, g, {"dense/kernel/grad", "dense/bias/grad", "out/grad"});
      });
    });
    done = true;
  });
  EXPECT_NE(message.find("kDeadlineExceeded"), std::string::npos) << message;
  EXPECT_NE(message.find("'dense/kernel/grad'"), std::string::npos) << message;
  EXPECT_NE(message.find("rank 1"), std::string::npos) << message;
}

TEST(ErrorMessages, ApplyGradientsShapeErrorNamesTheReplica) {
  ds::MirroredStrategy s(ds::testing::cpu_devices(3));
  ds::Variable w =
      s.create_variable("dense/kernel", ds::Shape{2}, ds::DType::kFloat32, ds::init::Zeros{});
  ds::SGD opt(s);
  const std::string msg = message_of([&] {
    s.run([&](ds::ReplicaContext& ctx) {
      const int64_t n = ctx.replica_id() == 2 ? 3 : 2;
      opt.apply_gradients(ctx, {{ds::Tensor(ds::Shape{n}, ds::DType::kFloat32), w}});
    });
  });
  EXPECT_NE(msg.find("replica 2"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'dense/kernel'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("float32[3]"), std::string::npos) << msg;
}

TEST(ErrorMessages, TfConfigAddressErrorsSayWhatIsWrongWithThePort) {
  auto config = [](const std::string& address) {
    return R"({"cluster": {"worker": [")" + address +
           R"("]}, "task": {"type": "worker", "index": 0}})";
  };
  const std::string not_number =
      message_of([&] { ds::ClusterSpec::from_tf_config(config("host1:port")); });
  EXPECT_NE(not_number.find("'host1:port'"), std::string::npos) << not_number;
  EXPECT_NE(not_number.find("port 'port' is not a number"), std::string::npos) << not_number;
  const std::string range =
      message_of([&] { ds::ClusterSpec::from_tf_config(config("host1:70000")); });
  EXPECT_NE(range.find("port 70000 is out of range"), std::string::npos) << range;
  const std::string no_port = message_of([&] { ds::ClusterSpec::from_tf_config(config("host1")); });
  EXPECT_NE(no_port.find("has no ':port'"), std::string::npos) << no_port;
  const std::string no_host = message_of([&] { ds::ClusterSpec::from_tf_config(config(":2222")); });
  EXPECT_NE(no_host.find("has no host"), std::string::npos) << no_host;
}

TEST(ErrorMessages, UserStringsAreEchoedAtMost200Characters) {
  const std::string long_name(5000, 'v');
  ds::MirroredStrategy s(ds::testing::cpu_devices(2));
  s.create_variable(long_name, ds::Shape{1}, ds::DType::kFloat32, ds::init::Zeros{});
  expect_bounded(message_of([&] {
                   s.create_variable(long_name, ds::Shape{1}, ds::DType::kFloat32,
                                     ds::init::Zeros{});
                 }),
                 5000, "duplicate variable");
  expect_bounded(message_of([&] { s.variable(std::string(6000, 'q')); }), 6000, "variable lookup");
  expect_bounded(message_of([&] { ds::parse_algorithm(std::string(7000, 'a')); }), 7000,
                 "parse_algorithm");
  // TF_CONFIG: a long address, a long job name, a long unknown key.
  const std::string addr(8000, 'h');
  expect_bounded(
      message_of([&] {
        ds::ClusterSpec::from_tf_config(R"({"cluster": {"worker": [")" + addr +
                                        R"("]}, "task": {"type": "worker", "index": 0}})");
      }),
      8000, "TF_CONFIG address");
  expect_bounded(
      message_of([&] {
        ds::ClusterSpec::from_tf_config(R"({"cluster": {")" + addr +
                                        R"(": ["a:1"]}, "task": {"type": "worker", "index": 0}})");
      }),
      8000, "TF_CONFIG job");
  expect_bounded(message_of([&] { ds::ClusterSpec::from_tf_config(R"({")" + addr + R"(": 1})"); }),
                 8000, "TF_CONFIG key");
  // A collective whose tensor names are long, mismatched between ranks.
  ds::InProcessGroup group(2);
  std::vector<std::string> msgs(2);
  ds::testing::run_ranks(group, [&](ds::Communicator& c) {
    float v[2] = {0, 0};
    msgs[c.rank()] = message_of([&] {
      c.all_reduce(v, v, c.rank() == 0 ? 1 : 2, ds::DType::kFloat32, ds::ReduceOp::kSum,
                   std::string(9000, 't'));
    });
  });
  for (const std::string& m : msgs) {
    EXPECT_LT(m.size(), 1000u) << m.substr(0, 1200);
    EXPECT_NE(m.find("(9000 characters)"), std::string::npos) << m.substr(0, 1200);
  }
  // Multi-worker: ranks enqueue differently named long tensors.
  ds::InProcessGroup workers(2);
  std::vector<std::string> mw(2);
  ds::testing::run_ranks(workers, [&](ds::Communicator& comm) {
    ds::MultiWorkerOptions o;
    o.communicator = &comm;
    ds::MultiWorkerMirroredStrategy st(o);
    mw[comm.rank()] = message_of([&] {
      st.run([&](ds::ReplicaContext& ctx) {
        std::vector<ds::Tensor> g{ds::Tensor(ds::Shape{4}, ds::DType::kFloat32)};
        ctx.all_reduce(ds::ReduceOp::kSum, g, {std::string(5000, char('a' + comm.rank()))});
      });
    });
  });
  for (const std::string& m : mw) {
    EXPECT_NE(m.find("kInvalidArgument"), std::string::npos) << m.substr(0, 1200);
    EXPECT_LT(m.size(), 1500u) << m.substr(0, 1600);
    EXPECT_NE(m.find("(5000 characters)"), std::string::npos) << m.substr(0, 1200);
  }
}
