// TrainingState: a LibTorch module's parameters and buffers and its
// optimizer's state mirrored into diststrat variables, so that Checkpoint /
// CheckpointManager (safetensors, atomic, verified, sharded where the strategy
// shards) handle a LibTorch job like any other. capture() copies into the
// variables, apply() copies back into every local replica.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <sstream>

#include "diststrat/torch.h"
#include "torch_compat.h"

namespace diststrat::libtorch {

namespace {

enum class OptKind { kNone, kSgd, kAdam, kAdamW };

// Optimizer::state()'s key for `p` (text in LibTorch 1.x, an address in 2.x).
compat::OptimizerStateKey key_of(const at::Tensor& p) { return compat::optimizer_state_key(p); }

std::vector<at::Tensor> trainable(torch::nn::Module& m) {
  std::vector<at::Tensor> out;
  for (const auto& p : m.named_parameters(true)) {
    if (p.value().requires_grad()) out.push_back(p.value());
  }
  return out;
}

at::Tensor named(torch::nn::Module& m, const std::string& name, bool buffer) {
  if (buffer) {
    for (const auto& b : m.named_buffers(true)) {
      if (b.key() == name) return b.value();
    }
  } else {
    for (const auto& p : m.named_parameters(true)) {
      if (p.key() == name) return p.value();
    }
  }
  throw_error(ErrorCode::kInternal, "TrainingState: '" + name + "' vanished from the module");
}

void copy_into(at::Tensor& dst, const Tensor& src) {
  torch::NoGradGuard no_grad;
  dst.copy_(to_torch(src));
}

}  // namespace

struct TrainingState::Slot {
  enum Kind { kParameter, kBuffer, kMomentum, kExpAvg, kExpAvgSq, kMaxExpAvgSq, kStep } kind;
  std::string name;  // module name (parameter/buffer) or owning parameter
  size_t param = 0;  // index among the trainable parameters (optimizer slots)
  Variable var;
};

namespace {

OptKind kind_of(torch::optim::Optimizer* o, bool* momentum, bool* amsgrad) {
  *momentum = *amsgrad = false;
  if (o == nullptr) return OptKind::kNone;
  if (dynamic_cast<torch::optim::SGD*>(o) != nullptr) {
    for (auto& g : o->param_groups()) {
      *momentum = *momentum || static_cast<torch::optim::SGDOptions&>(g.options()).momentum() != 0;
    }
    return OptKind::kSgd;
  }
  if (dynamic_cast<torch::optim::Adam*>(o) != nullptr) {
    for (auto& g : o->param_groups()) {
      *amsgrad = *amsgrad || static_cast<torch::optim::AdamOptions&>(g.options()).amsgrad();
    }
    return OptKind::kAdam;
  }
  if (dynamic_cast<torch::optim::AdamW*>(o) != nullptr) {
    for (auto& g : o->param_groups()) {
      *amsgrad = *amsgrad || static_cast<torch::optim::AdamWOptions&>(g.options()).amsgrad();
    }
    return OptKind::kAdamW;
  }
  throw_error(ErrorCode::kUnimplemented,
              "TrainingState: only torch::optim::SGD, Adam and AdamW state can be checkpointed");
}

// Exact text of a hyper-parameter (17 significant digits round-trip a double).
std::string number(double v) {
  char b[64];
  std::snprintf(b, sizeof b, "%.17g", v);
  return b;
}

// The hyper-parameters of local replica 0's optimizer, every param group's,
// for the members of an elastic group to compare (ElasticState::agree_on).
std::vector<std::pair<std::string, std::string>> hyperparameters(torch::optim::Optimizer* o) {
  std::vector<std::pair<std::string, std::string>> f;
  bool momentum, amsgrad;
  const OptKind kind = kind_of(o, &momentum, &amsgrad);
  static const char* const kNames[] = {"none", "torch::optim::SGD", "torch::optim::Adam",
                                       "torch::optim::AdamW"};
  f.emplace_back("torch optimizer", kNames[static_cast<int>(kind)]);
  if (o == nullptr) return f;
  f.emplace_back("torch optimizer.param_groups", std::to_string(o->param_groups().size()));
  for (size_t i = 0; i < o->param_groups().size(); ++i) {
    torch::optim::OptimizerParamGroup& g = o->param_groups()[i];
    const std::string p = "torch optimizer.param_groups[" + std::to_string(i) + "].";
    f.emplace_back(p + "params", std::to_string(g.params().size()));
    auto adam_like = [&](auto& a) {
      f.emplace_back(p + "lr", number(a.lr()));
      f.emplace_back(p + "betas",
                     number(std::get<0>(a.betas())) + "," + number(std::get<1>(a.betas())));
      f.emplace_back(p + "eps", number(a.eps()));
      f.emplace_back(p + "weight_decay", number(a.weight_decay()));
      f.emplace_back(p + "amsgrad", a.amsgrad() ? "true" : "false");
    };
    if (kind == OptKind::kSgd) {
      auto& s = static_cast<torch::optim::SGDOptions&>(g.options());
      f.emplace_back(p + "lr", number(s.lr()));
      f.emplace_back(p + "momentum", number(s.momentum()));
      f.emplace_back(p + "dampening", number(s.dampening()));
      f.emplace_back(p + "weight_decay", number(s.weight_decay()));
      f.emplace_back(p + "nesterov", s.nesterov() ? "true" : "false");
    } else if (kind == OptKind::kAdam) {
      adam_like(static_cast<torch::optim::AdamOptions&>(g.options()));
    } else if (kind == OptKind::kAdamW) {
      adam_like(static_cast<torch::optim::AdamWOptions&>(g.options()));
    }
  }
  return f;
}

}  // namespace

TrainingState::TrainingState(DistributedDataParallel& ddp,
                             std::vector<torch::optim::Optimizer*> optimizers, std::string prefix)
    : ddp_(&ddp), optimizers_(std::move(optimizers)) {
  Strategy& strategy = ddp.strategy();
  DISTSTRAT_CHECK(
      optimizers_.empty() || static_cast<int>(optimizers_.size()) == ddp.num_local_replicas(),
      kInvalidArgument, "TrainingState: ", optimizers_.size(), " optimizers for ",
      ddp.num_local_replicas(), " local replicas (none, or one per replica)");
  bool momentum = false, amsgrad = false;
  const OptKind kind = kind_of(optimizers_.empty() ? nullptr : optimizers_[0], &momentum, &amsgrad);
  for (size_t i = 0; i < optimizers_.size(); ++i) {
    torch::optim::Optimizer* o = optimizers_[i];
    bool m2, a2;
    DISTSTRAT_CHECK(o != nullptr && kind_of(o, &m2, &a2) == kind && m2 == momentum && a2 == amsgrad,
                    kInvalidArgument, "TrainingState: optimizer ", i,
                    o == nullptr ? " is null" : " differs from optimizer 0 in kind or options",
                    " (one per local replica, the same kind and options)");
  }
  // Optimizer i must step local replica i's parameters: one over another
  // replica's clone would update that clone twice and checkpoint no state.
  for (size_t i = 0; i < optimizers_.size(); ++i) {
    const std::vector<at::Tensor> own = trainable(*ddp.module(static_cast<int>(i)));
    for (const auto& g : optimizers_[i]->param_groups()) {
      for (const at::Tensor& p : g.params()) {
        const bool ok = std::any_of(own.begin(), own.end(), [&](const at::Tensor& q) {
          return q.unsafeGetTensorImpl() == p.unsafeGetTensorImpl();
        });
        if (ok) continue;
        std::string whose = "a tensor of no local replica's module";
        for (int r = 0; r < ddp.num_local_replicas(); ++r) {
          const std::vector<std::string>& names = ddp.parameter_names();
          const std::vector<at::Tensor> other = trainable(*ddp.module(r));
          for (size_t k = 0; k < other.size() && k < names.size(); ++k) {
            if (other[k].unsafeGetTensorImpl() == p.unsafeGetTensorImpl())
              whose = "parameter '" + names[k] + "' of local replica " + std::to_string(r);
          }
        }
        std::ostringstream shape;
        shape << p.scalar_type() << p.sizes();
        throw_error(ErrorCode::kInvalidArgument,
                    "TrainingState: optimizer " + std::to_string(i) + " (of local replica " +
                        std::to_string(i) + ") holds " + shape.str() + ", " + whose +
                        "; optimizer i must be built over ddp.module(i)->parameters()");
      }
    }
  }
  torch::nn::Module& m = *ddp.module(0);
  VariableOptions vo;
  vo.trainable = false;
  auto add = [&](Slot::Kind k, const std::string& name, size_t param, const std::string& var_name,
                 const at::Tensor& like) {
    auto slot = std::make_unique<Slot>();
    slot->kind = k;
    slot->name = name;
    slot->param = param;
    // Through host memory: a CUDA module's tensors are copied to the host
    // here and in capture(), and back onto each parameter's device in apply().
    const at::Tensor src = like.detach().to(torch::kCPU).contiguous();
    const bool copy = k == Slot::kParameter || k == Slot::kBuffer;
    slot->var = strategy.create_variable(
        prefix + var_name, Shape(std::vector<int64_t>(src.sizes().begin(), src.sizes().end())),
        to_diststrat(src).dtype(),
        [src, copy](Tensor& t) {
          if (copy) {
            t.copy_from(to_diststrat(src));
          } else {
            t.zero();
          }
        },
        vo);
    variables_.push_back(slot->var);
    slots_.push_back(std::move(slot));
  };
  for (const auto& p : m.named_parameters(true))
    add(Slot::kParameter, p.key(), 0, p.key(), p.value());
  for (const auto& b : m.named_buffers(true)) add(Slot::kBuffer, b.key(), 0, b.key(), b.value());
  const std::vector<at::Tensor> params = trainable(m);
  const std::vector<std::string>& names = ddp.parameter_names();
  const at::Tensor step_like = torch::zeros({1}, torch::kLong);
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string& n = names[i];
    if (kind == OptKind::kSgd && momentum)
      add(Slot::kMomentum, n, i, n + "/momentum_buffer", params[i]);
    if (kind == OptKind::kAdam || kind == OptKind::kAdamW) {
      add(Slot::kExpAvg, n, i, n + "/exp_avg", params[i]);
      add(Slot::kExpAvgSq, n, i, n + "/exp_avg_sq", params[i]);
      if (amsgrad) add(Slot::kMaxExpAvgSq, n, i, n + "/max_exp_avg_sq", params[i]);
      add(Slot::kStep, n, i, n + "/step", step_like);
    }
  }
  defined_ = strategy.create_variable(prefix + "torch/optimizer_state",
                                      Shape{static_cast<int64_t>(params.size())}, DType::kInt64,
                                      init::Zeros{}, vo);
  step_ =
      strategy.create_variable(prefix + "torch/step", Shape{1}, DType::kInt64, init::Zeros{}, vo);
  variables_.push_back(defined_);
  variables_.push_back(step_);
}

TrainingState::~TrainingState() = default;

void TrainingState::capture(int64_t step) {
  torch::NoGradGuard no_grad;
  torch::nn::Module& m = *ddp_->module(0);
  const std::vector<at::Tensor> params = trainable(m);
  torch::optim::Optimizer* opt = optimizers_.empty() ? nullptr : optimizers_[0];
  Tensor defined(Shape{static_cast<int64_t>(params.size())}, DType::kInt64);
  for (size_t i = 0; i < params.size(); ++i) {
    defined.data<int64_t>()[i] = opt != nullptr && opt->state().count(key_of(params[i])) ? 1 : 0;
  }
  for (auto& s : slots_) {
    at::Tensor value;
    if (s->kind == Slot::kParameter || s->kind == Slot::kBuffer) {
      value = named(m, s->name, s->kind == Slot::kBuffer);
    } else if (defined.data<int64_t>()[s->param]) {
      auto& st = *opt->state().at(key_of(params[s->param]));
      switch (s->kind) {
        case Slot::kMomentum:
          value = static_cast<torch::optim::SGDParamState&>(st).momentum_buffer();
          break;
        case Slot::kExpAvg:
          value = dynamic_cast<torch::optim::AdamParamState*>(&st)
                      ? static_cast<torch::optim::AdamParamState&>(st).exp_avg()
                      : static_cast<torch::optim::AdamWParamState&>(st).exp_avg();
          break;
        case Slot::kExpAvgSq:
          value = dynamic_cast<torch::optim::AdamParamState*>(&st)
                      ? static_cast<torch::optim::AdamParamState&>(st).exp_avg_sq()
                      : static_cast<torch::optim::AdamWParamState&>(st).exp_avg_sq();
          break;
        case Slot::kMaxExpAvgSq:
          value = dynamic_cast<torch::optim::AdamParamState*>(&st)
                      ? static_cast<torch::optim::AdamParamState&>(st).max_exp_avg_sq()
                      : static_cast<torch::optim::AdamWParamState&>(st).max_exp_avg_sq();
          break;
        case Slot::kStep: {
          const int64_t n = dynamic_cast<torch::optim::AdamParamState*>(&st)
                                ? static_cast<torch::optim::AdamParamState&>(st).step()
                                : static_cast<torch::optim::AdamWParamState&>(st).step();
          value = torch::full({1}, n, torch::kLong);
          break;
        }
        default:
          break;
      }
    }
    if (!value.defined()) {  // no state yet (or a slot the optimizer leaves empty)
      Tensor zeros(s->var.shape(), s->var.dtype());
      s->var.assign(zeros);
    } else {
      s->var.assign(to_diststrat(value.to(torch::kCPU).contiguous()));
    }
  }
  defined_.assign(defined);
  Tensor st(Shape{1}, DType::kInt64);
  st.data<int64_t>()[0] = step;
  step_.assign(st);
}

void TrainingState::track(ElasticState& state) {
  ddp_->elastic_tracked_ = true;
  state.track([this, &state] { capture(state.position.step); }, [this] { apply(); });
  // Compared as they are now, before training: a scheduler changes the
  // learning rate later, and a joiner's would then differ from the group's
  // until its first step (then every worker sets it alike).
  state.agree_on([settings = hyperparameters(optimizers_.empty() ? nullptr : optimizers_[0])] {
    return settings;
  });
}

int64_t TrainingState::apply() {
  torch::NoGradGuard no_grad;
  const Tensor defined = defined_.value();
  std::vector<Tensor> values;
  for (auto& s : slots_) values.push_back(s->var.value());
  for (int r = 0; r < ddp_->num_local_replicas(); ++r) {
    torch::nn::Module& m = *ddp_->module(r);
    const std::vector<at::Tensor> params = trainable(m);
    torch::optim::Optimizer* opt =
        optimizers_.empty() ? nullptr : optimizers_[static_cast<size_t>(r)];
    bool momentum = false, amsgrad = false;
    const OptKind kind = kind_of(opt, &momentum, &amsgrad);
    if (opt != nullptr) {
      for (const at::Tensor& p : params) opt->state().erase(key_of(p));
    }
    for (size_t i = 0; i < slots_.size(); ++i) {
      Slot& s = *slots_[i];
      if (s.kind == Slot::kParameter || s.kind == Slot::kBuffer) {
        at::Tensor t = named(m, s.name, s.kind == Slot::kBuffer);
        copy_into(t, values[i]);
        continue;
      }
      if (!defined.data<int64_t>()[s.param]) continue;
      const compat::OptimizerStateKey key = key_of(params[s.param]);
      auto& state = opt->state();
      if (!state.count(key)) {
        if (kind == OptKind::kSgd) state[key] = std::make_unique<torch::optim::SGDParamState>();
        if (kind == OptKind::kAdam) state[key] = std::make_unique<torch::optim::AdamParamState>();
        if (kind == OptKind::kAdamW) state[key] = std::make_unique<torch::optim::AdamWParamState>();
      }
      auto& st = *state.at(key);
      // The optimizer owns its state, on its parameter's device.
      const at::Tensor v = to_torch(values[i]).to(params[s.param].device(), /*non_blocking=*/false,
                                                  /*copy=*/true);
      auto set = [&](auto& typed) {
        using T = std::decay_t<decltype(typed)>;
        if constexpr (std::is_same_v<T, torch::optim::SGDParamState>) {
          if (s.kind == Slot::kMomentum) typed.momentum_buffer(v);
        } else {
          if (s.kind == Slot::kExpAvg) typed.exp_avg(v);
          if (s.kind == Slot::kExpAvgSq) typed.exp_avg_sq(v);
          if (s.kind == Slot::kMaxExpAvgSq) typed.max_exp_avg_sq(v);
          if (s.kind == Slot::kStep) typed.step(v.item<int64_t>());
        }
      };
      if (kind == OptKind::kSgd) set(static_cast<torch::optim::SGDParamState&>(st));
      if (kind == OptKind::kAdam) set(static_cast<torch::optim::AdamParamState&>(st));
      if (kind == OptKind::kAdamW) set(static_cast<torch::optim::AdamWParamState&>(st));
    }
  }
  return step_.value().data<int64_t>()[0];
}

}  // namespace diststrat::libtorch
