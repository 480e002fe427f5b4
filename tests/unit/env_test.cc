// The DISTSTRAT_* environment variables (src/core/env.h): every one is
// validated, a junk value is an InvalidArgumentError naming the variable, and
// DISTSTRAT_TIMEOUT sets the default communication timeout.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <chrono>
#include <optional>
#include <string>

#include "core/cpu_isa.h"
#include "core/device_manager_impl.h"
#include "diststrat/diststrat.h"
#include "fake_gpu_backend.h"

namespace ds = diststrat;
using std::chrono::milliseconds;

namespace {

// Sets (or, with nullptr, unsets) one variable for the scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = ::getenv(name)) old_ = old;
    if (value) {
      ::setenv(name, value, 1);
    } else {
      ::unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (old_) {
      ::setenv(name_, old_->c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

// Runs `fn` and expects InvalidArgumentError whose message names `name`.
template <class Fn>
void expect_rejected(const char* name, const char* value, Fn fn) {
  ScopedEnv env(name, value);
  try {
    fn();
    ADD_FAILURE() << name << "='" << value << "' was accepted";
  } catch (const ds::InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find(std::string(name) + "='" + value + "'"), std::string::npos)
        << e.what();
  }
}

ds::MirroredOptions one_cpu() {
  ds::MirroredOptions o;
  o.devices = {ds::Device::cpu(0)};
  return o;
}

}  // namespace

TEST(Env, TimeoutParsesSecondsIncludingFractions) {
  EXPECT_EQ(ds::parse_timeout_seconds("300"), milliseconds(300000));
  EXPECT_EQ(ds::parse_timeout_seconds("0.5"), milliseconds(500));
  EXPECT_EQ(ds::parse_timeout_seconds("1e1"), milliseconds(10000));
  EXPECT_EQ(ds::parse_timeout_seconds("0.001"), milliseconds(1));
  EXPECT_EQ(ds::parse_timeout_seconds("0.0015"), milliseconds(2));  // rounded up
  for (const char* bad : {"", "0", "-5", "abc", "5s", " 5", "nan", "inf", "1e300", "3000000"}) {
    EXPECT_THROW(ds::parse_timeout_seconds(bad), ds::InvalidArgumentError) << "'" << bad << "'";
  }
}

TEST(Env, TimeoutIsADecimalNumberOfAtLeastOneMillisecond) {
  EXPECT_EQ(ds::parse_timeout_seconds("2.5E2"), milliseconds(250000));
  EXPECT_EQ(ds::parse_timeout_seconds(".5"), milliseconds(500));
  EXPECT_EQ(ds::parse_timeout_seconds("5."), milliseconds(5000));
  EXPECT_EQ(ds::parse_timeout_seconds("1e-3"), milliseconds(1));
  for (const char* bad : {"0x10", "0X1p4", "1e-9", "0.0004", "0.0009", "+5", "1..2", "1e", "e5",
                          ".", "5 ", "1e+", "infinity"}) {
    std::string what;
    try {
      ds::parse_timeout_seconds(bad);
    } catch (const ds::InvalidArgumentError& e) {
      what = e.message();
    }
    EXPECT_NE(what.find(std::string("'") + bad + "'"), std::string::npos)
        << "'" << bad << "': " << what;
  }
  try {
    ds::parse_timeout_seconds("0.0004");
    FAIL() << "0.0004 accepted";
  } catch (const ds::InvalidArgumentError& e) {
    EXPECT_NE(e.message().find("at least 0.001"), std::string::npos) << e.message();
  }
}

TEST(Env, FaultSpecKeywordsIgnoreCaseAndFieldsRejectSpaces) {
  EXPECT_FALSE(ds::FaultInjection::parse("NONE").active());
  EXPECT_FALSE(ds::FaultInjection::parse("None").active());
  const ds::FaultInjection f = ds::FaultInjection::parse("THROW:1:2");
  EXPECT_EQ(f.kind, ds::FaultKind::kThrow);
  EXPECT_EQ(f.rank, 1);
  EXPECT_EQ(f.step, 2);
  for (const char* bad : {"throw: 1:1", "throw:1: 1", " throw:1:1", "throw :1:1", "throw:1:1 ",
                          "throw:+1:1", "throw:1:1:1"}) {
    EXPECT_THROW(ds::FaultInjection::parse(bad), ds::InvalidArgumentError) << "'" << bad << "'";
  }
}

TEST(Env, DiststratTimeoutSetsTheDefaultCommunicationTimeout) {
  {
    ScopedEnv env("DISTSTRAT_TIMEOUT", nullptr);
    EXPECT_EQ(ds::CommunicationOptions{}.timeout, milliseconds(300000));
    EXPECT_FALSE(ds::timeout_from_env().has_value());
  }
  {
    ScopedEnv env("DISTSTRAT_TIMEOUT", "2.5");
    EXPECT_EQ(ds::CommunicationOptions{}.timeout, milliseconds(2500));
    EXPECT_EQ(ds::MultiWorkerOptions{}.communication.timeout, milliseconds(2500));
    EXPECT_EQ(ds::ParameterServerOptions{}.communication.timeout, milliseconds(2500));
    // A group built with default options waits that long.
    ds::InProcessGroup group(1, ds::CommunicationOptions{});
    EXPECT_EQ(group.at(0).options().timeout, milliseconds(2500));
  }
  expect_rejected("DISTSTRAT_TIMEOUT", "soon", [] {
    ds::CommunicationOptions o;
    (void)o;
  });
  expect_rejected("DISTSTRAT_TIMEOUT", "0", [] { ds::MirroredStrategy s(one_cpu()); });
}

TEST(Env, JunkValuesOfEveryVariableAreAStartupError) {
  // Before: "maybe" turned placement logging on, "2" or "yes!" for the lease
  // switch meant "on", a bad log level did not say which variable it came from.
  expect_rejected("DISTSTRAT_LOG_DEVICE_PLACEMENT", "maybe",
                  [] { ds::MirroredStrategy s(one_cpu()); });
  expect_rejected("DISTSTRAT_LOG_DEVICE_PLACEMENT", "maybe", [] { ds::PlacementLog log(false); });
  expect_rejected("DISTSTRAT_LOG_LEVEL", "loud", [] { ds::Logger log(ds::LogLevel::kInfo); });
  expect_rejected("DISTSTRAT_FAULT", "throw:1", [] { ds::MirroredStrategy s(one_cpu()); });
  expect_rejected("DISTSTRAT_FAULT", "boom:0:1", [] { ds::FaultInjection::from_env(); });
  expect_rejected("DISTSTRAT_VIRTUAL_NODE_SIZE", "two", [] { ds::resolve_cluster({}); });
  expect_rejected("DISTSTRAT_CPU", "sse9", [] { ds::MirroredStrategy s(one_cpu()); });
  expect_rejected("DISTSTRAT_CPU", "AVX2 ", [] { ds::cpu::isa_from_env(); });
  expect_rejected("DISTSTRAT_VIRTUAL_NODE_SIZE", "-1", [] { ds::resolve_cluster({}); });
  expect_rejected("DISTSTRAT_GPU_LEASE", "maybe", [] {
    ds::GpuOptions g;
    g.lease.lock_dir = "/nonexistent/diststrat-env-test";  // rejected before any lease is taken
    auto dm_owner = ds::DeviceManagerAccess::with_backend(
        g, std::make_unique<diststrat_test::FakeGpuBackend>(1));
    ds::DeviceManager& dm = *dm_owner;
    dm.list_logical_devices();
  });
  // Accepted spellings.
  {
    ScopedEnv env("DISTSTRAT_LOG_DEVICE_PLACEMENT", "true");
    EXPECT_TRUE(ds::PlacementLog(false).enabled());
  }
  {
    ScopedEnv env("DISTSTRAT_LOG_DEVICE_PLACEMENT", "off");
    EXPECT_FALSE(ds::PlacementLog(true).enabled());
  }
}

TEST(Env, FaultAimedAtAReplicaTheJobDoesNotHaveIsAnError) {
  // Before: DISTSTRAT_FAULT=throw:7:3 on 2 replicas silently did nothing.
  ScopedEnv env("DISTSTRAT_FAULT", "throw:7:3");
  ds::MirroredOptions o;
  o.devices = {ds::Device::cpu(0), ds::Device::cpu(1)};
  ds::MirroredStrategy s(o);
  try {
    s.run([](ds::ReplicaContext&) {});
    ADD_FAILURE() << "a fault for replica 7 of 2 was accepted";
  } catch (const ds::InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 7 is not a replica of this job (replica ids 0..1)"),
              std::string::npos)
        << e.what();
  }
}
