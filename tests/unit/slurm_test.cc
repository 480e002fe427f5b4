// Slurm's hostlist and tasks-per-node forms, and SlurmClusterResolver over
// step environments: synthetic ones for every form and error, and ones
// recorded from real srun steps of the test cluster (slurm_environments.h).
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "diststrat/device_manager.h"
#include "diststrat/error.h"
#include "diststrat/slurm.h"
#include "core/user_text.h"
#include "slurm_environments.h"

namespace ds = diststrat;

namespace {

using Env = std::map<std::string, std::string>;
using Strings = std::vector<std::string>;

TEST(SlurmHostlist, EveryValidFormExpandsInSlurmsOrder) {
  EXPECT_EQ(ds::expand_slurm_hostlist("h1"), Strings({"h1"}));
  EXPECT_EQ(ds::expand_slurm_hostlist("h[1-3,5]"), Strings({"h1", "h2", "h3", "h5"}));
  EXPECT_EQ(ds::expand_slurm_hostlist("h[001-004]"), Strings({"h001", "h002", "h003", "h004"}));
  EXPECT_EQ(ds::expand_slurm_hostlist("h[8-10]"), Strings({"h8", "h9", "h10"}));
  EXPECT_EQ(ds::expand_slurm_hostlist("h[08-10]"), Strings({"h08", "h09", "h10"}));
  EXPECT_EQ(ds::expand_slurm_hostlist("a,b[1-2],c"), Strings({"a", "b1", "b2", "c"}));
  EXPECT_EQ(ds::expand_slurm_hostlist("dsc-h[0-1]"), Strings({"dsc-h0", "dsc-h1"}));
  EXPECT_EQ(ds::expand_slurm_hostlist("r[1-2]n[1-2]"), Strings({"r1n1", "r1n2", "r2n1", "r2n2"}));
  EXPECT_EQ(ds::expand_slurm_hostlist("gpu[7]-ib"), Strings({"gpu7-ib"}));
  EXPECT_EQ(ds::expand_slurm_hostlist("n.example.org"), Strings({"n.example.org"}));
}

TEST(SlurmHostlist, MalformedListsAreInvalidArgumentNamingTheProblem) {
  const std::pair<const char*, const char*> cases[] = {
      {"h[3-1]", "goes down"},
      {"h[1-", "not closed"},
      {"h[]", "empty bracket"},
      {"", "empty"},
      {"a,,b", "empty entry"},
      {"a,", "empty entry"},
      {"h[1-2", "not closed"},
      {"h1]", "']' with no '['"},
      {"h[1-[2]]", "nested"},
      {"h[a-b]", "decimal digits"},
      {"h[1,,2]", "decimal digits"},
      {"h[-2]", "decimal digits"},
      {"h[1-2-3]", "decimal digits"},
      {"h 1", "character ' '"},
      {"h[1-2],h2", "h2 twice"},
      {"h[0-999999]", "more than 100000 hosts"},
      {"h[0-999],g[0-999]x[0-999]", "more than 100000 hosts"},
  };
  for (const auto& [list, why] : cases) {
    SCOPED_TRACE(list);
    try {
      ds::expand_slurm_hostlist(list);
      ADD_FAILURE() << "no error";
    } catch (const ds::InvalidArgumentError& e) {
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("hostlist='" + std::string(list) + "'"),
                std::string::npos)
          << e.what();
    }
  }
}

// Whether `s` reads as one line of well-formed UTF-8: no control byte, no
// stray or truncated multi-byte sequence.
bool one_readable_line(const std::string& s) {
  for (size_t i = 0; i < s.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c < 0x20 || c == 0x7f) return false;
    if (c < 0x80) continue;
    const size_t len = c >= 0xc2 && c <= 0xdf   ? 2
                       : c >= 0xe0 && c <= 0xef ? 3
                       : c >= 0xf0 && c <= 0xf4 ? 4
                                                : 0;
    if (len == 0 || i + len > s.size()) return false;
    for (size_t k = 1; k < len; ++k) {
      if ((static_cast<unsigned char>(s[i + k]) & 0xc0) != 0x80) return false;
    }
    i += len - 1;
  }
  return true;
}

// Issue 43: "the character '...' in a host name" quoted one raw byte (half of
// an e-acute; a raw \x01). Every part of a message that quotes the list
// escapes it as echo() does, and a UTF-8 character is quoted whole.
TEST(SlurmHostlist, ErrorsQuoteTheOffendingTextEscapedAndWholeCharacters) {
  const std::pair<std::string, std::string> hostlists[] = {
      {"h\xc3\xa9t\xc3\xa9", "the character '\xc3\xa9' in a host name"},
      {"h\x01", "the character '\\x01' in a host name"},
      {"h\xc3", "the character '\\xc3' in a host name"},
      {"h\nx", "the character '\\n' in a host name"},
      {"h[1\x01]", "'1\\x01' in a bracket"},
      {"h[\xe2\x82]", "'\\xe2\\x82' in a bracket"},
  };
  for (const auto& [list, why] : hostlists) {
    SCOPED_TRACE(ds::echo(list));
    try {
      ds::expand_slurm_hostlist(list);
      ADD_FAILURE() << "no error";
    } catch (const ds::InvalidArgumentError& e) {
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
      EXPECT_TRUE(one_readable_line(e.what())) << e.what();
    }
  }
  for (const std::string list : {"2(x\x01)", "\x01(x2", "2(x3\xff"}) {
    SCOPED_TRACE(ds::echo(list));
    try {
      ds::expand_slurm_tasks_per_node(list);
      ADD_FAILURE() << "no error";
    } catch (const ds::InvalidArgumentError& e) {
      EXPECT_NE(std::string(e.what()).find("' is not N or N(xM)"), std::string::npos) << e.what();
      EXPECT_TRUE(one_readable_line(e.what())) << e.what();
    }
  }
}

TEST(SlurmTasksPerNode, RepeatsExpandAndMalformedOnesAreRefused) {
  EXPECT_EQ(ds::expand_slurm_tasks_per_node("2(x3),1"), std::vector<int>({2, 2, 2, 1}));
  EXPECT_EQ(ds::expand_slurm_tasks_per_node("4"), std::vector<int>({4}));
  EXPECT_EQ(ds::expand_slurm_tasks_per_node("1,3(x2)"), std::vector<int>({1, 3, 3}));
  for (const char* bad : {"", "0", "2(x0)", "2(x", "2(3)", "x", "2,", ",2", "-1", "2(x3)1",
                          "99999999(x99999999)", "1(x999999999)"}) {
    SCOPED_TRACE(bad);
    EXPECT_THROW(ds::expand_slurm_tasks_per_node(bad), ds::InvalidArgumentError);
  }
}

// A step of `nodes` in "n[0-K]" with the given tasks per node, seen by `rank`
// (block distribution).
Env step(const std::string& nodelist, const std::string& tpn, int size, int rank, int node,
         int local) {
  return {{"SLURM_STEP_ID", "0"},
          {"SLURM_PROCID", std::to_string(rank)},
          {"SLURM_STEP_NUM_TASKS", std::to_string(size)},
          {"SLURM_STEP_NODELIST", nodelist},
          {"SLURM_STEP_TASKS_PER_NODE", tpn},
          {"SLURM_NODEID", std::to_string(node)},
          {"SLURM_LOCALID", std::to_string(local)}};
}

TEST(SlurmResolver, HeterogeneousTasksPerNodeGiveBlockRanksAddressesAndPlacement) {
  // 2(x2),1 over h[01-03]: ranks 0,1 on h01; 2,3 on h02; 4 on h03.
  const struct {
    int rank, node, local;
  } tasks[] = {{0, 0, 0}, {1, 0, 1}, {2, 1, 0}, {3, 1, 1}, {4, 2, 0}};
  for (const auto& t : tasks) {
    SCOPED_TRACE(t.rank);
    ds::SlurmClusterResolver r({}, step("h[01-03]", "2(x2),1", 5, t.rank, t.node, t.local));
    EXPECT_EQ(r.hosts(), Strings({"h01", "h02", "h03"}));
    EXPECT_EQ(r.tasks_per_node(), std::vector<int>({2, 2, 1}));
    const ds::ClusterSpec& s = r.cluster_spec();
    EXPECT_EQ(s.jobs.at("worker"),
              Strings({"h01:8888", "h01:8889", "h02:8888", "h02:8889", "h03:8888"}));
    EXPECT_EQ(s.task_type, "worker");
    EXPECT_EQ(s.task_index, t.rank);
    EXPECT_EQ(s.rank(), t.rank);
    EXPECT_EQ(r.placement().rank, t.rank);
    EXPECT_EQ(r.placement().world_size, 5);
    EXPECT_EQ(r.placement().node, t.node);
    EXPECT_EQ(r.placement().num_nodes, 3);
    EXPECT_EQ(r.placement().local_rank, t.local);
    EXPECT_EQ(r.placement().local_size, t.node == 2 ? 1 : 2);
    EXPECT_EQ(r.cpus_per_task(), 0);
    EXPECT_TRUE(r.task_gpus().empty());
  }
}

TEST(SlurmResolver, JobsAreGivenOutInChiefWorkerPsOrderSoThePsTasksAreTheLast) {
  ds::SlurmOptions o;
  o.jobs = {{"ps", 1}, {"worker", 2}, {"chief", 1}};
  o.port_base = 2222;
  const char* want_type[] = {"chief", "worker", "worker", "ps"};
  const int want_index[] = {0, 0, 1, 0};
  for (int rank = 0; rank < 4; ++rank) {
    ds::SlurmClusterResolver r(o, step("n[0-1]", "2(x2)", 4, rank, rank / 2, rank % 2));
    EXPECT_EQ(r.cluster_spec().task_type, want_type[rank]);
    EXPECT_EQ(r.cluster_spec().task_index, want_index[rank]);
    EXPECT_EQ(r.cluster_spec().rank(), rank);
    EXPECT_EQ(r.cluster_spec().jobs.at("ps"), Strings({"n1:2223"}));
    EXPECT_EQ(r.cluster_spec().jobs.at("chief"), Strings({"n0:2222"}));
  }
}

TEST(SlurmResolver, CpusPerTaskAndOverriddenTasksPerNode) {
  Env e = step("n[0-1]", "1(x2)", 4, 3, 1, 1);
  e["SLURM_CPUS_PER_TASK"] = "4";
  ds::SlurmOptions o;
  o.tasks_per_node = 2;  // TF's tasks_per_node argument wins over Slurm's
  ds::SlurmClusterResolver r(o, e);
  EXPECT_EQ(r.cpus_per_task(), 4);
  EXPECT_EQ(r.tasks_per_node(), std::vector<int>({2, 2}));
  EXPECT_EQ(r.placement().local_rank, 1);
}

TEST(SlurmResolver, GpusAreSlicedByLocalIdFromStepGpusOrVisibleDevices) {
  Env e = step("g[1-2]", "2(x2)", 4, 3, 1, 1);
  e["SLURM_STEP_GPUS"] = "4,5,6,7";  // synthetic: no GPU here
  ds::SlurmClusterResolver r({}, e);
  EXPECT_EQ(r.gpus_per_task(), 2);
  EXPECT_EQ(r.task_gpus(), Strings({"6", "7"}));

  Env j = step("g[1-2]", "2(x2)", 4, 2, 1, 0);
  j["SLURM_JOB_GPUS"] = "0,1,2,3";
  ds::SlurmOptions one;
  one.gpus_per_task = 1;
  EXPECT_EQ(ds::SlurmClusterResolver(one, j).task_gpus(), Strings({"0"}));

  Env c = step("g1", "2", 2, 1, 0, 1);
  c["CUDA_VISIBLE_DEVICES"] = "GPU-aaaa,GPU-bbbb";
  ds::SlurmOptions per_node;
  per_node.gpus_per_node = 2;
  EXPECT_EQ(ds::SlurmClusterResolver(per_node, c).task_gpus(), Strings({"GPU-bbbb"}));

  Env none = step("g1", "2", 2, 1, 0, 1);
  ds::SlurmOptions two;
  two.gpus_per_node = 2;
  EXPECT_EQ(ds::SlurmClusterResolver(two, none).task_gpus(), Strings({"1"}));
}

void expect_invalid(const ds::SlurmOptions& o, const Env& e, const std::string& why) {
  try {
    ds::SlurmClusterResolver r(o, e);
    ADD_FAILURE() << "no error; wanted " << why;
  } catch (const ds::InvalidArgumentError& err) {
    EXPECT_NE(std::string(err.what()).find(why), std::string::npos) << err.what();
  }
}

TEST(SlurmResolver, InconsistentOrMalformedStepsAreInvalidArgumentNamingTheVariable) {
  const ds::SlurmOptions d;
  expect_invalid(d, step("n[0-1]", "2(x3)", 6, 0, 0, 0), "counts 3 nodes but");
  expect_invalid(d, step("n[0-1]", "2(x2)", 5, 0, 0, 0), "adds up to 4 tasks but");
  expect_invalid(d, step("n[0-1]", "2(x2)", 4, 4, 1, 1), "SLURM_PROCID='4'");
  Env big = step("n[0-1]", "2(x2)", 4, 0, 0, 0);
  big["SLURM_PROCID"] = "99999999999";
  expect_invalid(d, big, "SLURM_PROCID='99999999999': out of range");
  big = step("n[0-1]", "2(x2)", 4, 0, 0, 0);
  big["SLURM_STEP_NODELIST"] = std::string(1 << 20, 'a');
  expect_invalid(d, big, "(1048576 characters)");
  big["SLURM_STEP_NODELIST"] = "n[0-99999999999]";
  expect_invalid(d, big, "more than 100000 hosts");
  expect_invalid(d, step("n[0-1]", "2(x2)", 4, 1, 2, 0), "SLURM_NODEID='2'");
  expect_invalid(d, step("n[0-1]", "2(x2)", 4, 1, 0, 2), "SLURM_LOCALID='2'");
  expect_invalid(d, step("n[3-1]", "2(x2)", 4, 0, 0, 0), "goes down");
  // cyclic: rank 1 on node 1.
  Env cyc = step("n[0-1]", "2(x2)", 4, 1, 1, 0);
  cyc["SLURM_DISTRIBUTION"] = "cyclic";
  expect_invalid(d, cyc, "SLURM_DISTRIBUTION='cyclic'");
  // Also on a task that a cyclic layout happens to put where a block one would.
  Env cyc0 = step("n[0-1]", "4(x2)", 8, 0, 0, 0);
  cyc0["SLURM_DISTRIBUTION"] = "plane=2";
  expect_invalid(d, cyc0, "SLURM_DISTRIBUTION='plane=2'");
  Env blk = step("n[0-1]", "2(x2)", 4, 1, 0, 1);
  blk["SLURM_DISTRIBUTION"] = "block:cyclic";  // within a node: fine
  EXPECT_EQ(ds::SlurmClusterResolver(d, blk).placement().rank, 1);
  // cyclic with one task per node (what srun sets inside sbatch -N 2
  // --ntasks-per-node=1) is the block layout: fine.
  Env one_each = step("n[0-1]", "1(x2)", 2, 1, 1, 0);
  one_each["SLURM_DISTRIBUTION"] = "cyclic";
  EXPECT_EQ(ds::SlurmClusterResolver(d, one_each).placement().node, 1);
  one_each["SLURM_DISTRIBUTION"] = "plane=1";
  EXPECT_EQ(ds::SlurmClusterResolver(d, one_each).placement().node, 1);
  one_each["SLURM_DISTRIBUTION"] = "arbitrary";
  expect_invalid(d, one_each, "SLURM_DISTRIBUTION='arbitrary'");
  Env plane = step("n[0-1]", "2(x2)", 4, 0, 0, 0);
  plane["SLURM_DISTRIBUTION"] = "plane=2";  // 2 a turn over 2 per node = block
  EXPECT_EQ(ds::SlurmClusterResolver(d, plane).placement().rank, 0);
  // List errors name the variable the list came from.
  expect_invalid(d, step("n[0-1],n1", "2(x3)", 6, 0, 0, 0), "SLURM_STEP_NODELIST='n[0-1],n1'");
  expect_invalid(d, step("n[0-1]", "2(x99999999999)", 4, 0, 0, 0),
                 "SLURM_STEP_TASKS_PER_NODE='2(x99999999999)'");
  Env junk = step("n[0-1]", "2(x2)", 4, 0, 0, 0);
  junk["SLURM_PROCID"] = "0x1";
  expect_invalid(d, junk, "SLURM_PROCID='0x1': not a decimal integer");
  junk = step("n[0-1]", "2(x2)", 4, 0, 0, 0);
  junk["SLURM_CPUS_PER_TASK"] = "-2";
  expect_invalid(d, junk, "SLURM_CPUS_PER_TASK='-2'");
  junk = step("n[0-1]", "2(x2)", 4, 0, 0, 0);
  junk["SLURM_STEP_NUM_NODES"] = "3";
  expect_invalid(d, junk, "SLURM_STEP_NUM_NODES=3");
  junk = step("n[0-1]", "2(x2)", 4, 0, 0, 0);
  junk["SLURM_STEP_GPUS"] = "0,,1";
  expect_invalid(d, junk, "SLURM_STEP_GPUS='0,,1'");
  Env missing = step("n[0-1]", "2(x2)", 4, 0, 0, 0);
  missing.erase("SLURM_NODEID");
  expect_invalid(d, missing, "SLURM_NODEID is not set");

  ds::SlurmOptions jobs;
  jobs.jobs = {{"worker", 2}, {"ps", 1}};
  expect_invalid(jobs, step("n[0-1]", "2(x2)", 4, 0, 0, 0), "give out 3 tasks but the step has 4");
  jobs.jobs = {{"worker", 3}, {"evaluator", 1}};
  expect_invalid(jobs, step("n[0-1]", "2(x2)", 4, 0, 0, 0), "job 'evaluator'");
  ds::SlurmOptions gpus;
  gpus.gpus_per_task = 3;
  Env g = step("n[0-1]", "2(x2)", 4, 0, 0, 0);
  g["SLURM_STEP_GPUS"] = "0,1,2,3";
  expect_invalid(gpus, g, "need 6 but the node has 4");
  // GPU lists and options that would overflow, exhaust memory or give
  // tasks the wrong GPUs.
  for (const char* list : {"-1,0,1,2", "0,0,1,1", "0-3", "GPU-a,GPU-b", ""}) {
    SCOPED_TRACE(list);
    Env e = step("n[0-1]", "2(x2)", 4, 0, 0, 0);
    e["SLURM_STEP_GPUS"] = std::string(list) + (*list ? "" : "0,,1");
    expect_invalid(d, e, "SLURM_STEP_GPUS=");
  }
  Env one_gpu = step("n[0-1]", "2(x2)", 4, 0, 0, 0);
  one_gpu["SLURM_STEP_GPUS"] = "0";
  expect_invalid(d, one_gpu, "not one each");
  ds::SlurmOptions none_each;
  none_each.gpus_per_task = 0;  // said explicitly: no GPUs, fine
  EXPECT_TRUE(ds::SlurmClusterResolver(none_each, one_gpu).task_gpus().empty());
  for (int per_task : {1 << 30, 2147483647, -5}) {
    SCOPED_TRACE(per_task);
    ds::SlurmOptions o;
    o.gpus_per_task = per_task;
    expect_invalid(o, g, "SlurmOptions::gpus_per_task");
  }
  for (int per_node : {100000000, 2147483647, -5}) {
    SCOPED_TRACE(per_node);
    ds::SlurmOptions o;
    o.gpus_per_node = per_node;
    expect_invalid(o, step("n[0-1]", "2(x2)", 4, 0, 0, 0), "SlurmOptions::gpus_per_node");
  }
  ds::SlurmOptions port;
  port.port_base = 0;
  expect_invalid(port, step("n0", "1", 1, 0, 0, 0), "port_base 0");
}

TEST(SlurmResolver, RecordedSrunStepsResolveToWhatSlurmPlacedWhere) {
  ASSERT_FALSE(diststrat_test::kRecordedSlurmSteps.empty());
  for (const auto& rec : diststrat_test::kRecordedSlurmSteps) {
    SCOPED_TRACE(rec.what);
    const Env env(rec.env.begin(), rec.env.end());
    ds::SlurmClusterResolver r({}, env);
    EXPECT_EQ(r.placement().rank, rec.rank);
    EXPECT_EQ(r.placement().world_size, rec.size);
    EXPECT_EQ(r.placement().node, rec.node);
    EXPECT_EQ(r.placement().local_rank, rec.local_rank);
    EXPECT_EQ(r.hosts()[static_cast<size_t>(rec.node)], rec.hostname);
    EXPECT_EQ(r.cluster_spec().rank(), rec.rank);
    EXPECT_EQ(r.cpus_per_task(), rec.cpus_per_task);
  }
}

}  // namespace

namespace {

TEST(SlurmResolver, RecordedCyclicStepsAreRefusedOnEveryTaskNamingTheDistribution) {
  ASSERT_FALSE(diststrat_test::kRecordedCyclicSlurmSteps.empty());
  for (const auto& rec : diststrat_test::kRecordedCyclicSlurmSteps) {
    SCOPED_TRACE(rec.what);
    const Env env(rec.env.begin(), rec.env.end());
    // Task 0 sits where a block layout would put it, but its view of the
    // others is wrong all the same: refused too.
    expect_invalid({}, env, "SLURM_DISTRIBUTION='cyclic'");
  }
}

// The variables in_slurm_step() reads, restored after the test.
class SlurmStepEnv : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* n : kNames) {
      if (const char* v = std::getenv(n)) saved_.emplace_back(n, v);
      ::unsetenv(n);
    }
  }
  void TearDown() override {
    for (const char* n : kNames) ::unsetenv(n);
    for (const auto& [n, v] : saved_) ::setenv(n.c_str(), v.c_str(), 1);
  }
  static constexpr const char* kNames[] = {"SLURM_STEP_ID", "SLURM_PROCID", "OMPI_COMM_WORLD_SIZE",
                                           "MPI_LOCALNRANKS"};
  std::vector<std::pair<std::string, std::string>> saved_;
};

TEST_F(SlurmStepEnv, OnlyAnSrunStepTaskNotABatchScriptOrAnMpirunRankIsInAStep) {
  EXPECT_FALSE(ds::in_slurm_step());
  ::setenv("SLURM_PROCID", "0", 1);  // what a batch script has (no step id)
  EXPECT_FALSE(ds::in_slurm_step());
  EXPECT_THROW(ds::SlurmClusterResolver{}, ds::FailedPreconditionError);
  ::setenv("SLURM_STEP_ID", "0", 1);
  EXPECT_TRUE(ds::in_slurm_step());
  ::setenv("OMPI_COMM_WORLD_SIZE", "4", 1);  // mpirun inside an allocation
  EXPECT_FALSE(ds::in_slurm_step());
}

}  // namespace

namespace {

// The launcher's local rank picks a process's GPUs: a junk value is an error
// naming the variable, not GPU 0 (it was read with atoi).
TEST(GpuOptionsForLocalProcess, TheLaunchersLocalRankIsCheckedBeforeItPicksGpus) {
  const char* names[] = {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"};
  std::vector<std::pair<std::string, std::string>> saved;
  for (const char* n : names) {
    if (const char* v = std::getenv(n)) saved.emplace_back(n, v);
    ::unsetenv(n);
  }
  ::setenv("SLURM_LOCALID", "1", 1);
  EXPECT_EQ(*ds::gpu_options_for_local_process(2).visible_devices, std::vector<int>({2, 3}));
  EXPECT_THROW(ds::gpu_options_for_local_process(2147483647, 0), ds::InvalidArgumentError);
  EXPECT_THROW(ds::gpu_options_for_local_process(4096, 4097), ds::InvalidArgumentError);
  for (const char* junk : {"one", "-1", "1x", "99999999999", "1048576"}) {
    SCOPED_TRACE(junk);
    ::setenv("SLURM_LOCALID", junk, 1);
    try {
      ds::gpu_options_for_local_process(1);
      ADD_FAILURE() << "no error";
    } catch (const ds::InvalidArgumentError& e) {
      EXPECT_NE(std::string(e.what()).find("SLURM_LOCALID"), std::string::npos) << e.what();
    }
  }
  for (const char* n : names) ::unsetenv(n);
  for (const auto& [n, v] : saved) ::setenv(n.c_str(), v.c_str(), 1);
}

}  // namespace
