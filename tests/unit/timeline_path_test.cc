// DISTSTRAT_TIMELINE / MultiWorkerOptions::timeline_path: a path that can
// never be written fails when the strategy is made, and a timeline that
// cannot be written at the end is reported, never lost in silence.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <mutex>
#include <string>
#include <vector>

#include "diststrat/diststrat.h"
#include "diststrat/multi_worker_mirrored.h"
#include "harness.h"

namespace ds = diststrat;

namespace {

ds::CommunicationOptions comm_options() {
  ds::CommunicationOptions co;
  co.timeout = std::chrono::seconds(30);
  return co;
}

// The error each of two in-process workers gets making a strategy that
// writes its timeline to `path`.
std::vector<std::string> construction_errors(const std::string& path) {
  ds::InProcessGroup group(2, comm_options());
  std::vector<std::string> errors(2, "(no error)");
  ds::testing::run_ranks(group, [&](ds::Communicator& comm) {
    ds::MultiWorkerOptions o;
    o.devices = {ds::Device::cpu(0)};
    o.communication = comm_options();
    o.communicator = &comm;
    o.timeline_path = path;
    try {
      ds::MultiWorkerMirroredStrategy s(o);
    } catch (const ds::Error& e) {
      EXPECT_TRUE(e.code() == ds::ErrorCode::kInvalidArgument ||
                  e.code() == ds::ErrorCode::kPermissionDenied)
          << e.what();
      errors[comm.rank()] = e.what();
    }
  });
  return errors;
}

}  // namespace

TEST(TimelinePath, UnwritableDirectoryFailsAtConstructionNamingTheSetting) {
  for (const std::string& e : construction_errors("/nonexistent/x.json")) {
    EXPECT_NE(e.find("MultiWorkerOptions::timeline_path='/nonexistent/x.json'"), std::string::npos)
        << e;
    EXPECT_NE(e.find("'/nonexistent'"), std::string::npos) << e;
  }
  ::setenv("DISTSTRAT_TIMELINE", "/nonexistent/y.json", 1);
  const std::vector<std::string> env_errors =
      construction_errors(::testing::TempDir() + "/fine.json");
  ::unsetenv("DISTSTRAT_TIMELINE");
  for (const std::string& e : env_errors) {
    EXPECT_NE(e.find("DISTSTRAT_TIMELINE='/nonexistent/y.json'"), std::string::npos) << e;
  }
  for (const std::string& e : construction_errors(::testing::TempDir())) {
    EXPECT_NE(e.find("timeline_path="), std::string::npos) << e;
  }
}

TEST(TimelinePath, AFailedFallbackWriteIsAWarningNamingThePathAndErrno) {
  // The directory exists when the strategies are made and is gone when
  // they write: the merged write and rank 0's own fallback both fail.
  const std::string dir = ::testing::TempDir() + "/timeline_gone_" + std::to_string(::getpid());
  ASSERT_EQ(::mkdir(dir.c_str(), 0700), 0);
  const std::string path = dir + "/t.json";
  ds::InProcessGroup group(2, comm_options());
  std::mutex mu;
  std::vector<std::string> warnings;
  ds::testing::run_ranks(group, [&](ds::Communicator& comm) {
    ds::MultiWorkerOptions o;
    o.devices = {ds::Device::cpu(0)};
    o.communication = comm_options();
    o.communicator = &comm;
    o.timeline_path = path;
    ds::MultiWorkerMirroredStrategy s(o);
    s.logger().set_sink([&](ds::LogLevel level, const std::string& line) {
      std::lock_guard<std::mutex> lock(mu);
      if (level == ds::LogLevel::kWarning) warnings.push_back(line);
    });
    s.run([](ds::ReplicaContext& ctx) { ctx.barrier("step"); });
    comm.barrier("made");
    if (comm.rank() == 0) ::rmdir(dir.c_str());
    comm.barrier("removed");
  });
  bool said = false;
  for (const std::string& w : warnings) {
    said = said || (w.find("could not write " + path + ".rank0") != std::string::npos &&
                    w.find("No such file or directory") != std::string::npos);
  }
  std::string all;
  for (const std::string& w : warnings) all += w + "\n";
  EXPECT_TRUE(said) << all;
  struct stat st {};
  EXPECT_NE(::stat((path + ".rank0").c_str(), &st), 0);
}
