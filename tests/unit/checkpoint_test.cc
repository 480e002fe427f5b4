// Checkpoints: the safetensors format, verified loading (a corruption table),
// restore into a model (round trip, mismatches, nothing written on failure),
// the manager (keep K, latest), kill -9 during saves, preemption, and interop
// with Python's safetensors.
#include <dirent.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "runtime/variable_impl.h"
#include "checkpoint_util.h"
#include "diststrat/diststrat.h"
#include "harness.h"
#include "../common/temp_dir.h"
#include "../common/compare.h"

namespace ds = diststrat;

namespace {

using diststrat_test::same_bytes;
using diststrat_test::temp_dir;
using ds::testing::expect_error;
using ds::testing::read_bytes;
using ds::testing::write_bytes;
constexpr char kCheckpointTempPrefix[] =
    "diststrat_ckpt_";  // removed at exit (tests/common/temp_dir.h)

// One tensor of every dtype, a scalar and an empty one.
std::vector<std::pair<std::string, ds::Tensor>> sample_tensors() {
  std::vector<std::pair<std::string, ds::Tensor>> out;
  int k = 0;
  for (ds::DType d : {ds::DType::kFloat32, ds::DType::kFloat64, ds::DType::kFloat16,
                      ds::DType::kBFloat16, ds::DType::kInt32, ds::DType::kInt64}) {
    ds::Tensor t(ds::Shape{3, 2}, d);
    ds::init::RandomNormal{0.0, 3.0, static_cast<uint64_t>(++k)}(t);
    out.emplace_back(std::string("t/") + ds::dtype_name(d), t);
  }
  ds::Tensor scalar(ds::Shape{}, ds::DType::kInt64);
  scalar.data<int64_t>()[0] = -42;
  out.emplace_back("scalar", scalar);
  out.emplace_back("empty", ds::Tensor(ds::Shape{0, 5}, ds::DType::kFloat32));
  return out;
}

}  // namespace

TEST(Safetensors, RoundTripsEveryDtypeScalarsAndEmptyTensors) {
  const std::string path = temp_dir(kCheckpointTempPrefix) + "/a.safetensors";
  const auto tensors = sample_tensors();
  ds::save_safetensors(path, tensors, {{"epoch", "3"}, {"note", "é ✓"}});
  ds::SafetensorsFile f = ds::load_safetensors(path);
  EXPECT_TRUE(f.verified);
  ASSERT_EQ(f.tensors.size(), tensors.size());
  for (const auto& [name, t] : tensors) {
    const ds::Tensor* got = f.find(name);
    ASSERT_NE(got, nullptr) << name;
    EXPECT_TRUE(same_bytes(*got, t)) << name;
  }
  EXPECT_EQ(f.metadata.at("epoch"), "3");
  EXPECT_EQ(f.metadata.at("note"), "é ✓");
  // The layout is the reference one: u64 LE length, '{', data 8-aligned.
  const auto bytes = read_bytes(path);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];
  EXPECT_EQ(bytes[8], '{');
  EXPECT_EQ(n % 8, 0u);
}

TEST(Safetensors, RejectsBadInputOnSave) {
  const std::string dir = temp_dir(kCheckpointTempPrefix);
  ds::Tensor t(ds::Shape{2}, ds::DType::kFloat32);
  EXPECT_THROW(ds::save_safetensors(dir + "/x", {{"a", t}, {"a", t}}), ds::InvalidArgumentError);
  EXPECT_THROW(ds::save_safetensors(dir + "/x", {{"", t}}), ds::InvalidArgumentError);
  EXPECT_THROW(ds::save_safetensors(dir + "/x", {{"a", t}}, {{"diststrat.x", "1"}}),
               ds::InvalidArgumentError);
  EXPECT_THROW(ds::save_safetensors(dir + "/no/such/dir/x", {{"a", t}}), ds::NotFoundError);
  EXPECT_THROW(ds::load_safetensors(dir + "/missing"), ds::NotFoundError);
}

// Truncation at every length, and flipped bits at every byte (header length,
// JSON header, padding, data): always DataLossError naming the file, never a
// crash or a silently different tensor.
TEST(Safetensors, EveryTruncationAndEveryFlippedByteIsDataLoss) {
  const std::string dir = temp_dir(kCheckpointTempPrefix);
  const std::string path = dir + "/good.safetensors";
  ds::Tensor w(ds::Shape{4, 3}, ds::DType::kFloat32);
  ds::init::RandomNormal{0.0, 1.0, 7}(w);
  ds::Tensor it(ds::Shape{}, ds::DType::kInt64);
  ds::save_safetensors(path, {{"w", w}, {"it", it}}, {{"epoch", "2"}});
  const std::vector<uint8_t> good = read_bytes(path);
  ASSERT_NO_THROW(ds::parse_safetensors(good.data(), good.size(), "good"));

  for (size_t len = 0; len < good.size(); ++len) {
    expect_error<ds::DataLossError>([&] { ds::parse_safetensors(good.data(), len, "cut"); },
                                    {"checkpoint 'cut'"}, "truncated to " + std::to_string(len));
  }
  // One byte too many is caught as well.
  std::vector<uint8_t> longer = good;
  longer.push_back(0);
  EXPECT_THROW(ds::parse_safetensors(longer.data(), longer.size(), "long"), ds::DataLossError);

  int flips = 0;
  for (size_t i = 0; i < good.size(); ++i) {
    for (uint8_t mask : {0x01, 0x10, 0x80}) {
      std::vector<uint8_t> bad = good;
      bad[i] ^= mask;
      // A space flipped to another whitespace character changes nothing read.
      auto is_ws = [](uint8_t c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; };
      if (is_ws(good[i]) && is_ws(bad[i])) continue;
      ++flips;
      expect_error<ds::DataLossError>(
          [&] { ds::parse_safetensors(bad.data(), bad.size(), "flip"); }, {"checkpoint 'flip'"},
          "byte " + std::to_string(i) + " ^ " + std::to_string(mask));
    }
  }
  EXPECT_GT(flips, 3 * 100);
}

TEST(Safetensors, DataFlipNamesTheTensor) {
  const std::string path = temp_dir(kCheckpointTempPrefix) + "/a.safetensors";
  ds::Tensor a(ds::Shape{8}, ds::DType::kFloat32), b(ds::Shape{8}, ds::DType::kFloat32);
  ds::save_safetensors(path, {{"layer/a", a}, {"layer/b", b}});
  auto bytes = read_bytes(path);
  bytes[bytes.size() - 1] ^= 0x40;  // last byte of the last tensor, "layer/b"
  write_bytes(path, bytes);
  expect_error<ds::DataLossError>([&] { ds::load_safetensors(path); },
                                  {path, "'layer/b'", "checksum mismatch"}, "data flip");
}

// Headers that lie, built by hand (no checksums, so the structural checks are
// what fires): each gives the expected error naming the tensor.
TEST(Safetensors, LyingHeadersTable) {
  using nlohmann::json;
  auto file = [](const json& header, size_t data_bytes) {
    std::string text = header.dump();
    std::vector<uint8_t> b(8 + text.size() + data_bytes, 0);
    for (int i = 0; i < 8; ++i) b[i] = static_cast<uint8_t>((text.size() >> (8 * i)) & 0xff);
    std::memcpy(b.data() + 8, text.data(), text.size());
    return b;
  };
  auto t = [](const char* dtype, json shape, uint64_t begin, uint64_t end) {
    return json{{"dtype", dtype}, {"shape", shape}, {"data_offsets", {begin, end}}};
  };
  struct Case {
    std::string label;
    std::vector<uint8_t> bytes;
    std::string needle;
    bool unimplemented = false;
  };
  const std::vector<Case> cases = {
      {"offset beyond data", file({{"a", t("F32", {4}, 0, 32)}}, 16), "'a'"},
      {"overlap", file({{"a", t("F32", {2}, 0, 8)}, {"b", t("F32", {2}, 4, 12)}}, 12), "overlaps"},
      {"gap", file({{"a", t("F32", {1}, 0, 4)}, {"b", t("F32", {1}, 8, 12)}}, 12), "gap"},
      {"tail not covered", file({{"a", t("F32", {1}, 0, 4)}}, 8), "cover 4 bytes"},
      {"backwards", file({{"a", t("F32", {1}, 8, 4)}}, 8), "backwards"},
      {"shape vs offsets", file({{"a", t("F32", {3}, 0, 8)}}, 8), "does not match data_offsets"},
      {"dtype vs offsets", file({{"a", t("F64", {2}, 0, 8)}}, 8), "does not match data_offsets"},
      {"negative dim", file({{"a", t("F32", {-1}, 0, 4)}}, 4), "non-natural dim"},
      {"overflowing shape",
       file({{"a", t("F32", {uint64_t{1} << 62, uint64_t{1} << 62}, 0, 0)}}, 0), "'a'"},
      {"shape not an array", file({{"a", t("F32", 4, 0, 16)}}, 16), "shape is not an array"},
      {"missing dtype", file({{"a", {{"shape", {1}}, {"data_offsets", {0, 4}}}}}, 4), "'a'"},
      {"unknown dtype", file({{"a", t("F31", {1}, 0, 4)}}, 4), "unknown dtype"},
      {"unsupported dtype", file({{"a", t("U8", {4}, 0, 4)}}, 4), "U8", true},
      {"metadata not strings", file({{"__metadata__", {{"epoch", 3}}}}, 0), "'epoch'"},
      {"header not an object", file(json::array({1, 2}), 0), "not a JSON object"},
      {"fractional offset",
       file({{"a", {{"dtype", "F32"}, {"shape", {1}}, {"data_offsets", {0, 4.5}}}}}, 4),
       "data_offsets"},
  };
  ds::SafetensorsLoadOptions unchecked;
  unchecked.require_checksums = false;
  for (const Case& c : cases) {
    auto parse = [&] { ds::parse_safetensors(c.bytes.data(), c.bytes.size(), c.label, unchecked); };
    if (c.unimplemented) {
      expect_error<ds::UnimplementedError>(parse, {c.label, c.needle}, c.label);
    } else {
      expect_error<ds::DataLossError>(parse, {c.label, c.needle}, c.label);
    }
  }
  // A header length beyond the file, and a huge one.
  std::vector<uint8_t> b = file(json::object(), 0);
  b[0] += 1;
  EXPECT_THROW(ds::parse_safetensors(b.data(), b.size(), "len", unchecked), ds::DataLossError);
  b[6] = 1;
  EXPECT_THROW(ds::parse_safetensors(b.data(), b.size(), "len", unchecked), ds::DataLossError);
  // A well-formed foreign file (no checksums) needs require_checksums = false.
  const std::vector<uint8_t> foreign = file({{"a", t("F32", {1}, 0, 4)}}, 4);
  EXPECT_THROW(ds::parse_safetensors(foreign.data(), foreign.size(), "foreign"), ds::DataLossError);
  EXPECT_FALSE(
      ds::parse_safetensors(foreign.data(), foreign.size(), "foreign", unchecked).verified);
}

// ---- a model under MirroredStrategy ---------------------------------------------

namespace {

struct Model {
  explicit Model(std::vector<int64_t> sizes = {6, 5, 3}, int replicas = 2, uint64_t seed = 3)
      : strategy(devices(replicas)),
        mlp(sizes),
        params(mlp.create_variables(strategy, seed)),
        opt(strategy, {0.1f, 0.9f}),
        ckpt(strategy, {&opt}) {}
  static std::vector<ds::Device> devices(int n) {
    std::vector<ds::Device> d;
    for (int i = 0; i < n; ++i) d.push_back(ds::Device::cpu(i));
    return d;
  }
  void train(int steps, uint64_t seed) {
    ds::testing::mlp_train(strategy, mlp, params, opt, 8, steps, seed);
  }
  ds::MirroredStrategy strategy;
  ds::nn::Mlp mlp;
  std::vector<ds::Variable> params;
  ds::SGD opt;
  ds::Checkpoint ckpt;
};

void expect_same_state(const Model& a, const Model& b) {
  ds::testing::expect_same_state(a.ckpt, b.ckpt);
}

}  // namespace

TEST(Checkpoint, MirroredRoundTripRestoresWeightsSlotsAndIterationsBitExact) {
  const std::string path = temp_dir(kCheckpointTempPrefix) + "/m.safetensors";
  Model a;
  a.train(3, 11);
  const auto names = [&] {
    std::vector<std::string> n;
    for (const auto& [k, v] : a.ckpt.state()) n.push_back(k);
    return n;
  }();
  EXPECT_EQ(names, (std::vector<std::string>{"dense0/bias", "dense0/bias/momentum", "dense0/kernel",
                                             "dense0/kernel/momentum", "dense1/bias",
                                             "dense1/bias/momentum", "dense1/kernel",
                                             "dense1/kernel/momentum", "optimizer/iterations"}));
  a.ckpt.save(path, {{"epoch", "1"}, {"batch", "4"}});

  Model b(std::vector<int64_t>{6, 5, 3}, 2, /*seed=*/99);  // different initial weights
  const ds::CheckpointMetadata md = b.ckpt.restore(path);
  EXPECT_EQ(md, (ds::CheckpointMetadata{{"epoch", "1"}, {"batch", "4"}}));
  expect_same_state(a, b);
  EXPECT_EQ(b.opt.iterations().value().data<int64_t>()[0], 3);
  // Every replica's copy was written, so training continues identically.
  a.train(2, 12);
  b.train(2, 12);
  expect_same_state(a, b);

  // Restoring onto a different number of replicas works too.
  Model c(std::vector<int64_t>{6, 5, 3}, 1, 5);
  c.ckpt.restore(path);
  Model a1(std::vector<int64_t>{6, 5, 3}, 1, 5);
  a1.ckpt.restore(path);
  c.train(1, 13);
  a1.train(1, 13);
  expect_same_state(a1, c);
}

TEST(Checkpoint, ModelMismatchIsInvalidArgumentAndChangesNothing) {
  const std::string dir = temp_dir(kCheckpointTempPrefix);
  Model small;
  small.train(1, 1);
  small.ckpt.save(dir + "/small.safetensors");

  Model wide(std::vector<int64_t>{6, 7, 3});
  const auto before = wide.ckpt.state();
  expect_error<ds::InvalidArgumentError>(
      [&] { wide.ckpt.restore(dir + "/small.safetensors"); },
      {dir + "/small.safetensors",
       "'dense0/kernel' is float32[6, 5] in the file but float32[6, 7]"},
      "wider model");
  const auto after = wide.ckpt.state();
  for (size_t i = 0; i < before.size(); ++i)
    EXPECT_TRUE(same_bytes(before[i].second, after[i].second));

  Model deeper(std::vector<int64_t>{6, 5, 4, 3});
  expect_error<ds::InvalidArgumentError>([&] { deeper.ckpt.restore(dir + "/small.safetensors"); },
                                         {"'dense2/kernel'", "missing"}, "deeper model");
  Model shallower(std::vector<int64_t>{6, 5});
  expect_error<ds::InvalidArgumentError>(
      [&] { shallower.ckpt.restore(dir + "/small.safetensors"); },
      {"'dense1/kernel'", "not in the model"}, "shallower model");

  // A model-only file (e.g. exported by PyTorch): refused unless optimizer state may be missing.
  std::vector<std::pair<std::string, ds::Tensor>> weights;
  for (const ds::Variable& v : small.params) weights.emplace_back(v.name(), v.value());
  ds::save_safetensors(dir + "/weights.safetensors", weights);
  Model m;
  expect_error<ds::InvalidArgumentError>([&] { m.ckpt.restore(dir + "/weights.safetensors"); },
                                         {"'optimizer/iterations'", "missing"}, "weights only");
  ds::RestoreOptions ro;
  ro.allow_missing_optimizer_state = true;
  m.ckpt.restore(dir + "/weights.safetensors", ro);
  for (size_t i = 0; i < m.params.size(); ++i) {
    EXPECT_TRUE(same_bytes(m.params[i].value(), small.params[i].value()));
  }
  EXPECT_EQ(m.opt.iterations().value().data<int64_t>()[0], 0);
}

TEST(Checkpoint, CorruptFileRestoreChangesNothing) {
  const std::string path = temp_dir(kCheckpointTempPrefix) + "/c.safetensors";
  Model a;
  a.train(2, 1);
  a.ckpt.save(path);
  auto bytes = read_bytes(path);
  bytes[bytes.size() / 2 + 40] ^= 0x08;  // somewhere in the data
  write_bytes(path, bytes);
  Model b;
  const auto before = b.ckpt.state();
  EXPECT_THROW(b.ckpt.restore(path), ds::DataLossError);
  const auto after = b.ckpt.state();
  for (size_t i = 0; i < before.size(); ++i)
    EXPECT_TRUE(same_bytes(before[i].second, after[i].second));
}

TEST(CheckpointManager, KeepsTheLastKAndPointsLatestAtTheNewest) {
  const std::string dir = temp_dir(kCheckpointTempPrefix) + "/nested/ckpts";
  Model a;
  ds::CheckpointManager manager(a.ckpt, dir, {2});
  EXPECT_FALSE(manager.latest().has_value());
  EXPECT_FALSE(manager.restore_latest().has_value());
  for (int step = 1; step <= 4; ++step) {
    a.train(1, step);
    manager.save(step, {{"step", std::to_string(step)}});
  }
  EXPECT_EQ(manager.latest().value(), dir + "/ckpt-4.safetensors");
  EXPECT_NE(access((dir + "/ckpt-3.safetensors").c_str(), F_OK), -1);
  EXPECT_EQ(access((dir + "/ckpt-2.safetensors").c_str(), F_OK), -1);
  EXPECT_EQ(access((dir + "/ckpt-1.safetensors").c_str(), F_OK), -1);
  Model b;
  ds::CheckpointManager mb(b.ckpt, dir, {2});
  EXPECT_EQ(mb.restore_latest().value().at("step"), "4");
  expect_same_state(a, b);
  // A damaged pointer is a clear error, not a guess.
  write_bytes(dir + "/latest", {'.', '.', '/', 'x', '\n'});
  EXPECT_THROW(mb.latest(), ds::DataLossError);
}

// A child saves in a loop and is SIGKILLed at random points; after every kill
// the latest checkpoint loads, verifies and is internally consistent.
TEST(CheckpointManager, KillDuringSaveAlwaysLeavesALoadableLatest) {
  const ds::testing::KillStats st = ds::testing::kill_during_save(
      temp_dir(kCheckpointTempPrefix),
      [](const std::string& dir, int64_t first_step) {
        ds::MirroredStrategy s(std::vector<ds::Device>{ds::Device::cpu(0)});
        ds::Variable big =
            s.create_variable("big", {256, 256}, ds::DType::kFloat32, ds::init::Zeros{});
        ds::Variable small = s.create_variable("small", {3}, ds::DType::kInt64, ds::init::Zeros{});
        ds::testing::save_step_valued_forever(s, {big, small}, dir, first_step);
      },
      {"big", "small"}, 40, 12, 12345);
  EXPECT_GE(st.kills, 10);
  EXPECT_GE(st.checked, st.kills / 2) << "too few kills landed after a first complete save";
  std::printf("kill-during-save: %d kills (%d inside a file write), %d checked, last step %lld\n",
              st.kills, st.mid_write, st.checked, static_cast<long long>(st.last_step));
}

TEST(Preemption, SignalSetsTheFlagAndShouldStopAgrees) {
  ds::MirroredStrategy s(std::vector<ds::Device>{ds::Device::cpu(0), ds::Device::cpu(1)});
  {
    ds::PreemptionOptions o;
    o.check_every = 2;
    ds::PreemptionHandler h(s, o);
    EXPECT_FALSE(h.signalled());
    EXPECT_FALSE(h.should_stop(1));
    ::raise(SIGTERM);  // handled: the test process survives
    EXPECT_TRUE(h.signalled());
    EXPECT_FALSE(h.should_stop(3));  // not a check step
    EXPECT_TRUE(h.should_stop(4));
  }
  ds::PreemptionHandler again(s);
  EXPECT_FALSE(again.signalled());
}

// Files written by us open with Python's safetensors and the reverse. Needs
// python3 with numpy and safetensors: scripts/setup.sh installs them (numpy
// from Debian, safetensors with pip into .deps/python); skipped otherwise.
TEST(Safetensors, InteropWithPythonSafetensors) {
  // The source tree from the build (not __FILE__, which a compiler cache may
  // make relative to the build directory).
  const std::string deps = std::string(DISTSTRAT_SOURCE_DIR) + "/.deps/python";
  // Debian's interpreter (numpy from apt) when there is one, else the first on PATH.
  const std::string py = "PYTHONPATH=" + deps +
                         (access("/usr/bin/python3", X_OK) == 0 ? " /usr/bin/python3" : " python3");
  if (std::system((py + " -c 'import numpy, safetensors.numpy' 2>/dev/null").c_str()) != 0) {
    GTEST_SKIP() << "python3 with numpy and safetensors is not available (scripts/setup.sh "
                    "installs them into "
                 << deps << ")";
  }
  const std::string dir = temp_dir(kCheckpointTempPrefix);
  ds::save_safetensors(dir + "/ours.safetensors", sample_tensors(), {{"epoch", "7"}});
  const std::string script = dir + "/interop.py";
  std::ofstream(script) << R"(import json, struct, sys, numpy as np
from safetensors.numpy import save_file
from safetensors import safe_open
d = sys.argv[1]
with safe_open(d + "/ours.safetensors", "np") as f:
    # numpy has no bfloat16: that one is checked through the raw header below.
    t = {k: f.get_tensor(k) for k in f.keys() if k != "t/bfloat16"}
with open(d + "/ours.safetensors", "rb") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    h = json.loads(f.read(n))
assert h["t/bfloat16"]["dtype"] == "BF16" and h["t/bfloat16"]["shape"] == [3, 2], h
assert len(t) == 7, sorted(t)
assert t["t/float32"].dtype == np.float32 and t["t/float32"].shape == (3, 2), t["t/float32"]
assert t["t/int64"].dtype == np.int64 and t["scalar"].shape == () and int(t["scalar"]) == -42
assert t["empty"].shape == (0, 5)
with safe_open(d + "/ours.safetensors", "np") as f:
    md = f.metadata()
assert md["epoch"] == "7" and "diststrat.header_crc32" in md, md
np.savetxt(d + "/f32.txt", t["t/float32"].reshape(-1), fmt="%.9g")
save_file({"w": np.arange(12, dtype=np.float32).reshape(3, 4) / 8,
           "n": np.array([1, -2, 3], dtype=np.int64),
           "h": np.array([0.5, -2.0], dtype=np.float16)}, d + "/theirs.safetensors",
          metadata={"from": "python"})
print("python side ok")
)";
  ASSERT_EQ(std::system((py + " " + script + " " + dir).c_str()), 0);
  // Python read our float32 tensor exactly.
  std::ifstream txt(dir + "/f32.txt");
  const ds::Tensor ours = sample_tensors()[0].second;
  for (int i = 0; i < 6; ++i) {
    float v;
    txt >> v;
    EXPECT_EQ(v, ours.data<float>()[i]);
  }
  ds::SafetensorsLoadOptions unchecked;
  unchecked.require_checksums = false;
  const ds::SafetensorsFile theirs = ds::load_safetensors(dir + "/theirs.safetensors", unchecked);
  EXPECT_FALSE(theirs.verified);
  EXPECT_EQ(theirs.metadata.at("from"), "python");
  const ds::Tensor* w = theirs.find("w");
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->shape(), (ds::Shape{3, 4}));
  EXPECT_EQ(w->data<float>()[11], 11.0f / 8);
  EXPECT_EQ(theirs.find("n")->data<int64_t>()[1], -2);
  EXPECT_EQ(static_cast<float>(theirs.find("h")->data<ds::Half>()[1]), -2.0f);
}

// ---- the default multi-process protocol (chief writes, broadcast on restore) ----
//
// Two "workers" as threads, each a MirroredStrategy that reports itself as
// worker i of 2 and broadcasts / reduces over an in-process group: what
// multi-worker strategies get from CheckpointParticipant's defaults.

namespace {

class FakeWorker : public ds::MirroredStrategy {
 public:
  FakeWorker(int index, ds::Communicator& comm)
      : ds::MirroredStrategy(std::vector<ds::Device>{ds::Device::cpu(0)}),
        index_(index),
        comm_(comm) {}
  ds::ClusterInfo cluster() const override {
    ds::ClusterInfo c;
    c.rank = c.worker_index = c.task_index = index_;
    c.world_size = c.num_workers = 2;
    c.task_type = index_ == 0 ? "chief" : "worker";
    return c;
  }
  int num_replicas_in_sync() const override { return 2; }
  void broadcast(ds::Tensor& t, int root, const std::string& name) override {
    comm_.broadcast(t, root, name);
  }

 protected:
  double reduce_across(ds::ReduceOp op, const std::vector<double>& local) override {
    double v = local[0];
    comm_.all_reduce(&v, 1, op, "reduce");
    return v;
  }

 private:
  int index_;
  ds::Communicator& comm_;
};

struct Worker {
  Worker(int i, ds::Communicator& comm) : s(i, comm), mlp({6, 5, 3}) {
    params = mlp.create_variables(s, 3 + i);  // different weights on each worker
    opt = std::make_unique<ds::SGD>(s, ds::SGDOptions{0.1f, 0.9f});
    ckpt = std::make_unique<ds::Checkpoint>(s, std::vector<const ds::Optimizer*>{opt.get()});
  }
  FakeWorker s;
  ds::nn::Mlp mlp;
  std::vector<ds::Variable> params;
  std::unique_ptr<ds::SGD> opt;
  std::unique_ptr<ds::Checkpoint> ckpt;
};

void comm_barrier(Worker& w) {
  ds::Tensor t(ds::Shape{1}, ds::DType::kInt32);
  w.s.broadcast(t, 0, "barrier");
}

void on_two_workers(const std::function<void(int, Worker&)>& fn) {
  ds::CommunicationOptions co;
  co.timeout = std::chrono::seconds(60);  // bounded; generous for a loaded machine
  ds::InProcessGroup group(2, co);
  ds::testing::run_ranks(group, [&](ds::Communicator& comm) {
    Worker w(comm.rank(), comm);
    fn(comm.rank(), w);
  });
}

}  // namespace

TEST(CheckpointMultiProcess, ChiefWritesAndEveryWorkerRestoresTheChiefsFile) {
  const std::string dir = temp_dir(kCheckpointTempPrefix);
  std::vector<std::vector<std::pair<std::string, ds::Tensor>>> saved(2), restored(2);
  std::vector<ds::CheckpointMetadata> md(2);
  on_two_workers([&](int i, Worker& w) {
    ds::CheckpointManager manager(*w.ckpt, dir, {2});
    EXPECT_FALSE(manager.restore_latest().has_value());
    saved[i] = w.ckpt->state();
    manager.save(5, {{"epoch", "1"}});
    // Scramble, then restore: every worker gets the chief's values.
    for (ds::Variable& v : w.params) v.assign(ds::Tensor(v.shape(), v.dtype()));
    md[i] = manager.restore_latest().value();
    restored[i] = w.ckpt->state();
  });
  EXPECT_EQ(md[0], (ds::CheckpointMetadata{{"epoch", "1"}}));
  EXPECT_EQ(md[1], md[0]);
  ASSERT_EQ(restored[1].size(), saved[0].size());
  for (size_t k = 0; k < saved[0].size(); ++k) {
    EXPECT_TRUE(same_bytes(restored[0][k].second, saved[0][k].second)) << saved[0][k].first;
    EXPECT_TRUE(same_bytes(restored[1][k].second, saved[0][k].second)) << saved[0][k].first;
  }
  // Worker 1's own (different) weights never reached the file.
  EXPECT_FALSE(same_bytes(saved[1][2].second, saved[0][2].second));
}

// A corrupt newest checkpoint: the chief decides what to try, and every
// worker falls back to the same valid one (restore_latest's fallback).
TEST(CheckpointMultiProcess, EveryWorkerFallsBackToTheSameValidCheckpoint) {
  const std::string dir = temp_dir(kCheckpointTempPrefix);
  std::vector<std::string> step(2), path(2);
  std::vector<std::vector<std::pair<std::string, ds::Tensor>>> at5(2), restored(2);
  on_two_workers([&](int i, Worker& w) {
    ds::CheckpointManager manager(*w.ckpt, dir, {3});
    manager.save(5, {{"step", "5"}});
    at5[i] = w.ckpt->state();
    for (ds::Variable& v : w.params) v.assign(ds::Tensor(v.shape(), v.dtype()));
    manager.save(6, {{"step", "6"}});
    if (i == 0) {
      auto bytes = read_bytes(dir + "/ckpt-6.safetensors");
      bytes[bytes.size() - 2] ^= 0x11;
      write_bytes(dir + "/ckpt-6.safetensors", bytes);
    }
    comm_barrier(w);
    step[i] = manager.restore_latest().value().at("step");
    path[i] = manager.restored_path().value();
    restored[i] = w.ckpt->state();
  });
  EXPECT_EQ(step[0], "5");
  EXPECT_EQ(step[1], "5");
  EXPECT_EQ(path[1], dir + "/ckpt-5.safetensors");
  ASSERT_EQ(restored[1].size(), at5[0].size());
  for (size_t k = 0; k < at5[0].size(); ++k) {
    EXPECT_TRUE(same_bytes(restored[0][k].second, at5[0][k].second)) << at5[0][k].first;
    EXPECT_TRUE(same_bytes(restored[1][k].second, at5[0][k].second)) << at5[0][k].first;
  }
}

// Named objects and a partial restore (issue 46, item 4): the chief reads
// the file, and every worker gets its tensors and the same unmatched names.
TEST(CheckpointMultiProcess, NamedObjectsAndAPartialRestoreReachEveryWorker) {
  const std::string dir = temp_dir(kCheckpointTempPrefix);
  std::vector<std::vector<std::pair<std::string, ds::Tensor>>> saved(2), restored(2);
  std::vector<std::vector<std::string>> unused(2);
  std::vector<std::string> refused(2);
  on_two_workers([&](int i, Worker& w) {
    ds::Checkpoint named({{"model", w.params}, {"optimizer", *w.opt}});
    named.save(dir + "/named.safetensors");
    saved[i] = named.state();
    for (ds::Variable& v : w.params) v.assign(ds::Tensor(v.shape(), v.dtype()));
    ds::Checkpoint model_only({{"model", w.params}});
    try {
      model_only.restore(dir + "/named.safetensors");
    } catch (const ds::InvalidArgumentError& e) {
      refused[i] = e.what();
    }
    ds::RestoreOptions partial;
    partial.expect_partial = true;
    model_only.restore(dir + "/named.safetensors", partial);
    unused[i] = model_only.last_restore().unused;
    restored[i] = model_only.state();
  });
  for (int i = 0; i < 2; ++i) {
    EXPECT_NE(refused[i].find("'optimizer/iterations'"), std::string::npos) << refused[i];
    EXPECT_EQ(unused[i], unused[0]);
    EXPECT_EQ(std::count(unused[i].begin(), unused[i].end(), "optimizer/iterations"), 1);
    // The chief's model on both: "model/..." sorts before "optimizer/...".
    ASSERT_EQ(restored[i].size(), 4u);
    for (size_t k = 0; k < restored[i].size(); ++k) {
      EXPECT_EQ(restored[i][k].first, saved[0][k].first);
      EXPECT_TRUE(same_bytes(restored[i][k].second, saved[0][k].second)) << saved[0][k].first;
    }
  }
}

TEST(CheckpointMultiProcess, TheChiefsErrorReachesEveryWorker) {
  const std::string dir = temp_dir(kCheckpointTempPrefix);
  std::vector<std::string> messages(2);
  std::vector<int> stopped(2);  // not vector<bool>: its bits share words (a data race, TSan)
  on_two_workers([&](int i, Worker& w) {
    try {
      w.ckpt->save(dir + "/missing/dir/x.safetensors");
    } catch (const ds::NotFoundError& e) {
      messages[i] = e.what();
    }
    // A corrupt file: the chief's DataLoss reaches worker 1 too.
    if (i == 0) write_bytes(dir + "/bad.safetensors", {1, 2, 3});
    comm_barrier(w);
    try {
      w.ckpt->restore(dir + "/bad.safetensors");
    } catch (const ds::DataLossError& e) {
      messages[i] += std::string(" | ") + e.what();
    }
    // Preemption agreement runs as a collective on both (the flag itself is
    // per process, so two threads cannot show one worker signalled alone).
    ds::PreemptionHandler h(w.s);
    comm_barrier(w);
    EXPECT_FALSE(h.should_stop(1));
    comm_barrier(w);
    if (i == 1) ds::PreemptionHandler::notify_preemption();
    comm_barrier(w);
    stopped[i] = h.should_stop(2);
  });
  EXPECT_NE(messages[0].find("missing/dir"), std::string::npos) << messages[0];
  EXPECT_NE(messages[1].find("the chief failed to write"), std::string::npos) << messages[1];
  EXPECT_NE(messages[1].find("bad.safetensors"), std::string::npos) << messages[1];
  EXPECT_NE(messages[1].find("kDataLoss"), std::string::npos) << messages[1];
  EXPECT_TRUE(stopped[0] && stopped[1]);
}

TEST(Checkpoint, AdamMomentsAndStepRoundTripAndTrainingContinuesIdentically) {
  const std::string path = temp_dir(kCheckpointTempPrefix) + "/adam.safetensors";
  auto make = [](uint64_t seed) {
    auto s = std::make_unique<ds::MirroredStrategy>(
        std::vector<ds::Device>{ds::Device::cpu(0), ds::Device::cpu(1)});
    s->create_variable("w", {5}, ds::DType::kFloat32, ds::init::RandomNormal{0.0, 1.0, seed});
    return s;
  };
  auto step = [](ds::Strategy& s, ds::Adam& opt, float g) {
    ds::Variable w = s.variable("w");
    s.run([&](ds::ReplicaContext& ctx) {
      ds::Tensor grad(w.shape(), w.dtype());
      ds::init::Constant{g * (ctx.replica_id() + 1)}(grad);
      opt.apply_gradients(ctx, {{grad, w}});
    });
  };
  auto a = make(1);
  ds::Adam opt_a(*a, {0.01f});
  for (int i = 0; i < 3; ++i) step(*a, opt_a, 0.5f + i);
  ds::Checkpoint(*a, {&opt_a}).save(path);

  auto b = make(2);
  ds::Adam opt_b(*b, {0.01f});
  ds::Checkpoint cb(*b, {&opt_b});
  cb.restore(path);
  EXPECT_EQ(opt_b.iterations().value().data<int64_t>()[0], 3);
  ds::SafetensorsFile f = ds::load_safetensors(path);
  ASSERT_NE(f.find("w/m"), nullptr);
  ASSERT_NE(f.find("w/v"), nullptr);
  // The bias correction depends on the step, the update on m and v: all restored.
  for (int i = 0; i < 2; ++i) {
    step(*a, opt_a, 2.0f);
    step(*b, opt_b, 2.0f);
  }
  EXPECT_TRUE(same_bytes(a->variable("w").value(), b->variable("w").value()));
  EXPECT_TRUE(
      same_bytes(a->variable("w").impl().slot("v")[1], b->variable("w").impl().slot("v")[1]));
}

// Random multi-byte damage: every outcome is either a diststrat::Error or a
// file that reads back exactly as written (a change only to whitespace) —
// never a crash, never different tensors or metadata.
TEST(Safetensors, RandomDamageIsAnErrorOrHarmless) {
  const std::string path = temp_dir(kCheckpointTempPrefix) + "/r.safetensors";
  ds::save_safetensors(path, sample_tensors(), {{"epoch", "12"}});
  const std::vector<uint8_t> good = read_bytes(path);
  const ds::SafetensorsFile original = ds::parse_safetensors(good.data(), good.size(), "good");
  std::mt19937_64 rng(2024);
  int errors = 0, harmless = 0;
  for (int it = 0; it < 3000; ++it) {
    std::vector<uint8_t> bad = good;
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      const size_t at = rng() % bad.size();
      switch (rng() % 4) {
        case 0:
          bad[at] = static_cast<uint8_t>(rng());
          break;  // overwrite
        case 1:
          bad.erase(bad.begin() + static_cast<long>(at));
          break;  // delete
        case 2:
          bad.insert(bad.begin() + static_cast<long>(at), static_cast<uint8_t>(rng()));
          break;
        case 3:
          bad.resize(at);
          break;  // truncate
      }
      if (bad.empty()) break;
    }
    try {
      const ds::SafetensorsFile f = ds::parse_safetensors(bad.data(), bad.size(), "fuzz");
      ASSERT_EQ(f.tensors.size(), original.tensors.size()) << "iteration " << it;
      for (size_t i = 0; i < f.tensors.size(); ++i) {
        ASSERT_EQ(f.tensors[i].first, original.tensors[i].first) << "iteration " << it;
        ASSERT_TRUE(same_bytes(f.tensors[i].second, original.tensors[i].second))
            << "iteration " << it;
      }
      ASSERT_EQ(f.metadata, original.metadata) << "iteration " << it;
      ++harmless;
    } catch (const ds::Error&) {
      ++errors;
    }
  }
  EXPECT_GT(errors, 2900);
  std::printf("random damage: %d errors, %d harmless (whitespace)\n", errors, harmless);
}
