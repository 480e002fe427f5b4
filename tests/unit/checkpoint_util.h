// Test helpers for the checkpoint tests: training an MLP under any strategy,
// and comparing two checkpoints' states byte for byte.
#pragma once

#include <dirent.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <functional>
#include <random>
#include <thread>

#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "../common/compare.h"
#include "diststrat/diststrat.h"

namespace diststrat {
namespace testing {

inline void mlp_step(Strategy& strategy, const nn::Mlp& mlp, const std::vector<Variable>& vars,
                     Optimizer& opt, const DistributedBatch& batch) {
  const float scale = 1.0f / static_cast<float>(batch.global_size());
  strategy.run([&](ReplicaContext& ctx) {
    std::vector<Tensor> p;
    for (const Variable& v : vars) p.push_back(v.read(ctx));
    nn::Mlp::Step st = mlp.forward_backward(p, batch.features(ctx), batch.labels(ctx), scale);
    std::vector<std::pair<Tensor, Variable>> gv;
    for (size_t k = 0; k < vars.size(); ++k) gv.emplace_back(st.grads[k], vars[k]);
    opt.apply_gradients(ctx, gv);
  });
}

// `steps` passes over `rows` random rows (one global batch of `rows`) seeded
// by `seed`, labels i % classes.
inline void mlp_train(Strategy& strategy, const nn::Mlp& mlp, const std::vector<Variable>& vars,
                      Optimizer& opt, int64_t rows, int steps, uint64_t seed) {
  Tensor x(Shape{rows, mlp.sizes().front()}, DType::kFloat32), y(Shape{rows}, DType::kInt32);
  init::RandomNormal{0.0, 1.0, seed}(x);
  for (int64_t i = 0; i < rows; ++i)
    y.data<int32_t>()[i] = static_cast<int32_t>(i % mlp.sizes().back());
  DistributedDataset dist = strategy.distribute(Dataset(x, y), rows, {false, 0, false});
  for (int s = 0; s < steps; ++s) {
    for (const DistributedBatch& b : dist) mlp_step(strategy, mlp, vars, opt, b);
  }
}

inline std::vector<uint8_t> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
}
inline void write_bytes(const std::string& path, const std::vector<uint8_t>& b) {
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(b.data()), b.size());
}

// `dir`/ckpt-<step>.safetensors: the name a CheckpointManager gives step `step`.
inline std::string ckpt_path(const std::string& dir, int64_t step) {
  return dir + "/ckpt-" + std::to_string(step) + ".safetensors";
}

// Expects fn to throw E whose message contains every one of `parts`.
template <typename E, typename Fn>
void expect_error(Fn&& fn, std::vector<std::string> parts, const std::string& label) {
  try {
    fn();
    ADD_FAILURE() << label << ": no error";
  } catch (const E& e) {
    for (const std::string& p : parts) {
      EXPECT_TRUE(diststrat_test::contains(e.what(), p))
          << label << ": '" << e.what() << "' does not mention '" << p << "'";
    }
  } catch (const std::exception& e) {
    ADD_FAILURE() << label << ": wrong exception: " << e.what();
  }
}

// A small model under a one-replica MirroredStrategy (an MLP 4-3, SGD with
// `momentum`: with momentum, one slot per weight) whose warnings are kept.
struct SmallModel {
  explicit SmallModel(uint64_t seed = 3, float momentum = 0.0f)
      : strategy(std::vector<Device>{Device::cpu(0)}),
        mlp({4, 3}),
        params(mlp.create_variables(strategy, seed)),
        opt(strategy, {0.1f, momentum}),
        ckpt(strategy, {&opt}) {
    strategy.logger().set_sink([this](LogLevel level, const std::string& m) {
      if (level >= LogLevel::kWarning) warnings += m + "\n";
    });
  }
  void train(uint64_t seed) { mlp_train(strategy, mlp, params, opt, 4, 1, seed); }
  // Element 1 of the first weight becomes `v`.
  void poison(float v) {
    Tensor t = params[0].value();
    t.data<float>()[1] = v;
    params[0].assign(t);
  }
  MirroredStrategy strategy;
  nn::Mlp mlp;
  std::vector<Variable> params;
  SGD opt;
  Checkpoint ckpt;
  std::string warnings;
};

// Saves steps `first`, first+step, ..., `last` through a manager keeping `keep`.
inline void save_steps(SmallModel& m, const std::string& dir, int64_t first, int64_t last,
                       int64_t step, int keep = 3) {
  CheckpointManager manager(m.ckpt, dir, {keep});
  for (int64_t s = first; s <= last; s += step) {
    m.train(static_cast<uint64_t>(s));
    manager.save(s, {{"step", std::to_string(s)}});
  }
}

// Same names and the same bytes in every tensor of the two states.
inline void expect_same_state(const Checkpoint& a, const Checkpoint& b) {
  const auto sa = a.state(), sb = b.state();
  ASSERT_EQ(sa.size(), sb.size());
  for (size_t i = 0; i < sa.size(); ++i) {
    EXPECT_EQ(sa[i].first, sb[i].first);
    const Tensor &x = sa[i].second, &y = sb[i].second;
    ASSERT_TRUE(x.dtype() == y.dtype() && x.shape() == y.shape()) << sa[i].first;
    EXPECT_EQ(0, x.nbytes() ? std::memcmp(x.data(), y.data(), x.nbytes()) : 0) << sa[i].first;
  }
}

// The state equals a checkpoint's contents (load_checkpoint: a single file
// or a parameter-server index with its shard files), byte for byte.
inline void expect_state_is_file(const Checkpoint& c, const std::string& path) {
  const SafetensorsFile f = load_checkpoint(path);
  EXPECT_TRUE(f.verified);
  const auto st = c.state();
  ASSERT_EQ(st.size(), f.tensors.size());
  for (size_t i = 0; i < st.size(); ++i) {
    EXPECT_EQ(st[i].first, f.tensors[i].first);
    const Tensor &x = st[i].second, &y = f.tensors[i].second;
    ASSERT_TRUE(x.dtype() == y.dtype() && x.shape() == y.shape()) << st[i].first;
    EXPECT_EQ(0, x.nbytes() ? std::memcmp(x.data(), y.data(), x.nbytes()) : 0) << st[i].first;
  }
}

// The model of the save/resume tests: an MLP 6-7-3 with weights from `seed`,
// Adam (learning rate 0.01), its Checkpoint and a CheckpointManager on `dir`
// that keeps 2.
struct CheckpointedMlp {
  CheckpointedMlp(Strategy& s, uint64_t seed, const std::string& dir)
      : vars(mlp.create_variables(s, seed)),
        adam(s, {0.01f}),
        ckpt(s, {&adam}),
        manager(ckpt, dir, {2}) {}
  nn::Mlp mlp{{6, 7, 3}};
  std::vector<Variable> vars;
  Adam adam;
  Checkpoint ckpt;
  CheckpointManager manager;
};

struct KillStats {
  int kills = 0, mid_write = 0, checked = 0;
  int64_t last_step = -1;
};

// The save loop of a kill_during_save child: at every step from
// `first_step` on, each of `vars` is set to the step number and saved
// through a CheckpointManager on `dir` (keeping 2) with metadata "step".
[[noreturn]] inline void save_step_valued_forever(Strategy& s, const std::vector<Variable>& vars,
                                                  const std::string& dir, int64_t first_step) {
  Checkpoint ckpt(s);
  CheckpointManager manager(ckpt, dir, {2});
  for (int64_t step = first_step;; ++step) {
    for (Variable v : vars) {
      Tensor t(v.shape(), v.dtype());
      init::Constant{static_cast<double>(step)}(t);
      v.assign(t);
    }
    manager.save(step, {{"step", std::to_string(step)}});
  }
}

// Kill-during-save: forks children that each run `save_loop(dir, first_step)`
// (build a model, then save it every step through a CheckpointManager on
// `dir` with every variable equal to the step and metadata "step"; never
// returns), SIGKILLs each at a random point, and after every kill loads
// `latest` (load_checkpoint: either format): it must verify, be the newest
// step so far, and hold each of `tensors` equal to its step (first and last
// element). Stops after `max_kills` kills or `seconds`.
inline KillStats kill_during_save(const std::string& dir,
                                  const std::function<void(const std::string&, int64_t)>& save_loop,
                                  const std::vector<std::string>& tensors, int max_kills,
                                  int seconds, uint32_t seed) {
  KillStats st;
  std::mt19937 rng(seed);
  uint32_t window_us = 30000;  // kill 2 ms + [0, window) after the fork
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  while (st.kills < max_kills && std::chrono::steady_clock::now() < deadline) {
    const pid_t pid = ::fork();
    if (pid < 0) {
      ADD_FAILURE() << "fork failed";
      return st;
    }
    if (pid == 0) {
      try {
        save_loop(dir, st.last_step + 1);
      } catch (...) {
      }
      ::_exit(3);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(2000 + rng() % window_us));
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
    if (!WIFSIGNALED(status)) {
      ADD_FAILURE() << "the child ended by itself (status " << status << ")";
      return st;
    }
    ++st.kills;
    // A temporary file left behind means this kill landed inside a write.
    if (DIR* d = ::opendir(dir.c_str())) {
      bool partial = false;
      while (dirent* e = ::readdir(d)) partial |= std::strstr(e->d_name, ".tmp.") != nullptr;
      ::closedir(d);
      st.mid_write += partial;
    }
    std::ifstream latest(dir + "/latest");
    if (!latest) {
      // Killed before the first save completed: a slow build (a sanitizer,
      // a loaded machine) needs more than the window to set up, so widen it.
      window_us = std::min<uint32_t>(2 * window_us, 4000000);
      continue;
    }
    std::string name;
    std::getline(latest, name);
    const SafetensorsFile f = load_checkpoint(dir + "/" + name);
    EXPECT_TRUE(f.verified);
    const int64_t step = std::stoll(f.metadata.at("step"));
    EXPECT_EQ(name, "ckpt-" + std::to_string(step) + ".safetensors");
    EXPECT_GE(step, st.last_step);
    for (const std::string& t : tensors) {
      const Tensor* v = f.find(t);
      if (!v || v->num_elements() == 0) {
        ADD_FAILURE() << "tensor '" << t << "' missing in " << name;
        return st;
      }
      const int64_t last = v->num_elements() - 1;
      auto at = [&](int64_t i) {
        return v->dtype() == DType::kInt64 ? static_cast<double>(v->data<int64_t>()[i])
                                           : v->data<float>()[i];
      };
      EXPECT_EQ(at(0), static_cast<double>(step)) << t;
      EXPECT_EQ(at(last), static_cast<double>(step)) << t;
    }
    st.last_step = step;
    ++st.checked;
  }
  return st;
}

}  // namespace testing
}  // namespace diststrat
