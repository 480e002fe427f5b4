// Sizes and names that come from a user (flags, the environment) and the
// arithmetic done on them: nothing overflows into a wrong count, and a
// misspelled DISTSTRAT_* variable is named instead of ignored.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstdint>
#include <fstream>
#include <limits>
#include <regex>
#include <set>
#include <sstream>
#include <string>

#include "core/env.h"
#include "diststrat/diststrat.h"
#include "training_util.h"

namespace ds = diststrat;
using diststrat::testing::synthetic;

namespace {

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

TEST(UserInput, AGlobalBatchNearInt64MaxIsOneShortBatchNotZeroBatches) {
  ds::MirroredStrategy strategy({ds::Device::cpu(0), ds::Device::cpu(1)});
  for (const int64_t batch : {kMax, kMax - 1, kMax / 2 + 1, int64_t{100}}) {
    for (const bool drop : {false, true}) {
      ds::DistributeOptions o;
      o.drop_remainder = drop;
      const ds::DistributedDataset dist = strategy.distribute(synthetic(10, 1), batch, o);
      EXPECT_EQ(dist.num_batches(), drop ? 0 : 1) << "batch " << batch << " drop " << drop;
      if (!drop) {
        const ds::DistributedBatch b = dist.batch(0);
        EXPECT_EQ(b.global_size(), 10) << "batch " << batch;
      }
    }
  }
  // Exact and inexact divisions stay right.
  EXPECT_EQ(strategy.distribute(synthetic(10, 1), 5).num_batches(), 2);
  EXPECT_EQ(strategy.distribute(synthetic(10, 1), 4).num_batches(), 3);
}

TEST(UserInput, AShapeWhoseElementCountOverflowsIsRejected) {
  EXPECT_THROW(ds::Shape({int64_t{1} << 32, int64_t{1} << 32}), ds::InvalidArgumentError);
  EXPECT_THROW(ds::Shape({kMax, 2}), ds::InvalidArgumentError);
  EXPECT_NO_THROW(ds::Shape({kMax, 1}));
  EXPECT_NO_THROW(ds::Shape({0, kMax, kMax}));  // empty: no element to count
  EXPECT_EQ(ds::Shape({0, kMax, kMax}).num_elements(), 0);
  // Bytes: 2^61 float32 elements are 2^63 bytes, past int64.
  try {
    ds::Tensor t(ds::Shape({int64_t{1} << 61}), ds::DType::kFloat32);
    ADD_FAILURE() << "a tensor of 2^63 bytes was accepted";
  } catch (const ds::InvalidArgumentError& e) {
    EXPECT_NE(e.message().find("byte size overflows"), std::string::npos) << e.message();
  }
  float x = 0;
  EXPECT_THROW(ds::Tensor::wrap(&x, ds::Shape({int64_t{1} << 62}), ds::DType::kFloat64),
               ds::InvalidArgumentError);
  // Variables take their shape from the user too.
  ds::MirroredStrategy strategy({ds::Device::cpu(0)});
  EXPECT_THROW(strategy.create_variable("huge", ds::Shape({int64_t{1} << 40, int64_t{1} << 40}),
                                        ds::DType::kFloat32, ds::init::Zeros{}),
               ds::InvalidArgumentError);
}

// Sets a variable for the scope.
struct ScopedVar {
  std::string name;
  ScopedVar(std::string n, const char* v) : name(std::move(n)) { ::setenv(name.c_str(), v, 1); }
  ~ScopedVar() { ::unsetenv(name.c_str()); }
};

TEST(EnvVars, AMisspelledVariableIsNamedWithTheClosestKnownOne) {
  ScopedVar a("DISTSTRAT_TIMEOUTS", "5");
  ScopedVar b("DISTSTRAT_LOGLEVEL", "debug");
  ScopedVar c("DISTSTRAT_TIMEOUT", "5");  // known: no line
  const std::vector<std::string> w = ds::env::unknown_variable_warnings();
  ASSERT_EQ(w.size(), 2u) << (w.empty() ? "" : w[0]);
  EXPECT_NE(w[0].find("DISTSTRAT_LOGLEVEL"), std::string::npos) << w[0];
  EXPECT_NE(w[0].find("did you mean DISTSTRAT_LOG_LEVEL?"), std::string::npos) << w[0];
  EXPECT_NE(w[1].find("DISTSTRAT_TIMEOUTS"), std::string::npos) << w[1];
  EXPECT_NE(w[1].find("did you mean DISTSTRAT_TIMEOUT?"), std::string::npos) << w[1];
  EXPECT_EQ(ds::env::closest_known("DISTSTRAT_GPU_LEASE_DIRS"), "DISTSTRAT_GPU_LEASE_DIR");
}

TEST(EnvVars, AHostileNameIsEchoedSafely) {
  ScopedVar a(std::string("DISTSTRAT_") + std::string(5000, 'X') + "\x01", "1");
  const std::vector<std::string> w = ds::env::unknown_variable_warnings();
  ASSERT_EQ(w.size(), 1u);
  EXPECT_LT(w[0].size(), 600u);
  EXPECT_EQ(w[0].find('\x01'), std::string::npos);
}

// Every DISTSTRAT_* variable something in the tree reads is in the table
// (src/core/env_vars.cc): the library (env::text/flag/integer/seconds/parsed
// and getenv), scripts (a dollar sign, with or without a brace, before the
// name) and tests.
TEST(EnvVars, EveryVariableReadInTheTreeIsKnown) {
  const std::string root = DISTSTRAT_SOURCE_DIR;
  const std::regex code_reads(
      R"re((?:env::(?:text|flag|integer|seconds|parsed<[^>]*>)|getenv)\(\s*"(DISTSTRAT_[A-Z0-9_]+)")re");
  // In shell scripts; CMake files use ${DISTSTRAT_...} for their own options.
  const std::regex shell_reads(R"re(\$\{?(DISTSTRAT_[A-Z0-9_]+))re");
  const auto is_cmake = [](const std::string& f) {
    return f.find("CMakeLists.txt") != std::string::npos || f.find(".cmake") != std::string::npos;
  };
  std::set<std::string> missing;
  int files = 0;
  const std::string list = ::testing::TempDir() + "/diststrat_env_files.txt";
  const std::string cmd = "cd '" + root +
                          "' && git ls-files src include tools benchmarks examples tests scripts "
                          ".ci > '" +
                          list + "' 2>/dev/null";
  if (std::system(cmd.c_str()) != 0) GTEST_SKIP() << "not a git checkout: " << root;
  std::ifstream names(list);
  for (std::string rel; std::getline(names, rel);) {
    std::ifstream in(root + "/" + rel);
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string text = ss.str();
    ++files;
    for (const std::regex* re : {&code_reads, &shell_reads}) {
      if (re == &shell_reads && is_cmake(rel)) continue;
      for (auto it = std::sregex_iterator(text.begin(), text.end(), *re);
           it != std::sregex_iterator(); ++it) {
        const std::string name = (*it)[1].str();
        if (!ds::env::is_known(name)) missing.insert(name + " (" + rel + ")");
      }
    }
  }
  std::remove(list.c_str());
  EXPECT_GT(files, 100);
  std::string all;
  for (const std::string& m : missing) all += m + " ";
  EXPECT_TRUE(missing.empty()) << "read but not in src/core/env_vars.cc's table: " << all;
}

}  // namespace
