// ParameterServerModel: a LibTorch module whose parameters live on the
// parameter servers. Dense parameters are PS variables whose worker cache
// (Variable::read: one host copy per worker, filled by each step's pull) the
// replicas' module parameters view through set_data, so no copy is made
// between the pull and forward. Row-sparse parameters (embedding tables) are
// pulled per step for the ids a replica needs; their gradients go back as
// SparseGradients. backward() pushes everything in one apply_gradients.
#include <algorithm>

#include "diststrat/torch.h"

#include "intra_op_threads.h"

namespace diststrat::libtorch {

struct ParameterServerModel::Replica {
  std::vector<at::Tensor> dense;  // module parameters, dense_names_ order
  struct Gathered {
    size_t var;       // index into sparse_vars_
    Tensor ids;       // unique ids pulled (int64 [n])
    at::Tensor rows;  // leaf [n, D]
  };
  std::vector<Gathered> gathered;  // this step's gather_rows calls
};

namespace {

at::Tensor parameter(torch::nn::Module& m, const std::string& name) {
  for (const auto& p : m.named_parameters(true)) {
    if (p.key() == name) return p.value();
  }
  throw_error(ErrorCode::kNotFound,
              "ParameterServerModel: the module has no parameter '" + name + "'");
}

}  // namespace

ParameterServerModel::ParameterServerModel(ParameterServerStrategy& strategy,
                                           std::shared_ptr<torch::nn::Module> module,
                                           Optimizer& optimizer,
                                           std::vector<std::string> row_sparse)
    : strategy_(&strategy), optimizer_(&optimizer), sparse_names_(std::move(row_sparse)) {
  DISTSTRAT_CHECK(module != nullptr, kInvalidArgument, "ParameterServerModel: null module");
  DISTSTRAT_CHECK(strategy.is_worker(), kFailedPrecondition,
                  "ParameterServerModel: this process is a PS rank (call join() there)");
  for (const std::string& n : sparse_names_) {
    const at::Tensor p = parameter(*module, n);
    DISTSTRAT_CHECK(p.dim() == 2, kInvalidArgument, "ParameterServerModel: row-sparse parameter '",
                    n, "' must be a [rows, dim] table, not ", p.sizes());
  }
  torch::NoGradGuard no_grad;
  auto make = [&](const std::string& name, const at::Tensor& p, bool sparse) {
    const at::Tensor src = p.detach().contiguous();
    DISTSTRAT_CHECK(src.is_cpu(), kInvalidArgument, "ParameterServerModel: parameter '", name,
                    "' must be on the CPU (the worker cache is host memory)");
    const Tensor view = to_diststrat(src);
    const Initializer init = [src](Tensor& t) { t.copy_from(to_diststrat(src)); };
    return sparse ? strategy.create_row_sparse_variable(name, view.shape(), view.dtype(), init)
                  : strategy.create_variable(name, view.shape(), view.dtype(), init);
  };
  for (const auto& p : module->named_parameters(true)) {
    const bool sparse =
        std::find(sparse_names_.begin(), sparse_names_.end(), p.key()) != sparse_names_.end();
    if (sparse) continue;
    if (!p.value().requires_grad()) continue;
    dense_names_.push_back(p.key());
    dense_vars_.push_back(make(p.key(), p.value(), false));
  }
  for (const std::string& n : sparse_names_)
    sparse_vars_.push_back(make(n, parameter(*module, n), true));

  replicas_.push_back(module);
  for (int i = 1; i < strategy.num_local_replicas(); ++i) {
    try {
      replicas_.push_back(module->clone());
    } catch (const c10::Error& e) {
      throw_error(ErrorCode::kInvalidArgument,
                  "ParameterServerModel: cannot replicate the module for local replica " +
                      std::to_string(i) +
                      " (make it a torch::nn::Cloneable): " + e.what_without_backtrace());
    }
  }
  for (auto& m : replicas_) {
    auto r = std::make_unique<Replica>();
    for (const std::string& n : dense_names_) r->dense.push_back(parameter(*m, n));
    state_.push_back(std::move(r));
  }
}

ParameterServerModel::~ParameterServerModel() = default;

const std::shared_ptr<torch::nn::Module>& ParameterServerModel::module(int local_replica) const {
  DISTSTRAT_CHECK(local_replica >= 0 && local_replica < num_local_replicas(), kInvalidArgument,
                  "ParameterServerModel::module(", local_replica, "): ", num_local_replicas(),
                  " local replicas");
  return replicas_[static_cast<size_t>(local_replica)];
}

const std::shared_ptr<torch::nn::Module>& ParameterServerModel::module(ReplicaContext& ctx) {
  if (num_local_replicas() > 1) single_intra_op_thread();
  Replica& r = *state_[static_cast<size_t>(ctx.local_replica_id())];
  torch::NoGradGuard no_grad;
  for (size_t k = 0; k < dense_vars_.size(); ++k) {
    // The cache this step's pull filled; re-pointed only if it moved.
    const Tensor cache = dense_vars_[k].read(ctx);
    if (r.dense[k].data_ptr() != cache.data()) r.dense[k].set_data(to_torch(cache));
  }
  return module(ctx.local_replica_id());
}

Variable ParameterServerModel::variable(const std::string& parameter) const {
  for (size_t k = 0; k < dense_names_.size(); ++k) {
    if (dense_names_[k] == parameter) return dense_vars_[k];
  }
  for (size_t k = 0; k < sparse_names_.size(); ++k) {
    if (sparse_names_[k] == parameter) return sparse_vars_[k];
  }
  throw_error(ErrorCode::kNotFound,
              "ParameterServerModel: no PS variable for parameter '" + parameter + "'");
}

ParameterServerModel::Rows ParameterServerModel::gather_rows(ReplicaContext& ctx,
                                                             const std::string& name,
                                                             const at::Tensor& ids) {
  size_t v = sparse_names_.size();
  for (size_t k = 0; k < sparse_names_.size(); ++k) {
    if (sparse_names_[k] == name) v = k;
  }
  DISTSTRAT_CHECK(v < sparse_names_.size(), kNotFound, "ParameterServerModel::gather_rows: '", name,
                  "' is not a row-sparse parameter of this model");
  DISTSTRAT_CHECK(ids.scalar_type() == torch::kLong, kInvalidArgument,
                  "ParameterServerModel::gather_rows('", name, "'): ids must be int64, not ",
                  ids.scalar_type());
  auto [unique, inverse] =
      at::_unique(ids.flatten().cpu(), /*sorted=*/true, /*return_inverse=*/true);
  const Tensor uids = to_diststrat(unique.contiguous()).clone();
  const Tensor pulled = strategy_->gather_rows(sparse_vars_[v], uids);
  Rows out;
  out.rows = to_torch(pulled).detach().requires_grad_(true);
  out.index = inverse.reshape(ids.sizes());
  state_[static_cast<size_t>(ctx.local_replica_id())]->gathered.push_back({v, uids, out.rows});
  return out;
}

void ParameterServerModel::backward(ReplicaContext& ctx, const at::Tensor& loss, int64_t rows,
                                    int64_t global_rows) {
  DISTSTRAT_CHECK(rows >= 0 && global_rows >= rows && global_rows > 0, kInvalidArgument,
                  "ParameterServerModel::backward (replica ", ctx.replica_id(), "): rows ", rows,
                  " and global_rows ", global_rows, " (0 <= rows <= global_rows, global_rows > 0)");
  Replica& r = *state_[static_cast<size_t>(ctx.local_replica_id())];
  std::vector<Replica::Gathered> gathered = std::move(r.gathered);
  r.gathered.clear();
  for (at::Tensor& p : r.dense) {
    if (p.grad().defined()) p.mutable_grad().zero_();
  }
  if (rows > 0) {
    DISTSTRAT_CHECK(loss.defined() && loss.numel() == 1, kInvalidArgument,
                    "ParameterServerModel::backward (replica ", ctx.replica_id(),
                    "): the loss must be a scalar");
    // The summed-gradient convention of Optimizer::apply_gradients: this
    // replica's share of the global mean.
    torch::autograd::backward(
        {loss},
        {torch::full_like(loss, static_cast<double>(rows) / static_cast<double>(global_rows))});
  }
  torch::NoGradGuard no_grad;
  std::vector<std::pair<Tensor, Variable>> dense;
  for (size_t k = 0; k < r.dense.size(); ++k) {
    at::Tensor& p = r.dense[k];
    if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p, at::MemoryFormat::Contiguous);
    if (!p.grad().is_contiguous()) p.mutable_grad() = p.grad().contiguous();
    dense.emplace_back(to_diststrat(p.grad()), dense_vars_[k]);
  }
  std::vector<SparseGradient> sparse;
  for (const Replica::Gathered& g : gathered) {
    at::Tensor grad = g.rows.grad();
    if (!grad.defined()) grad = torch::zeros_like(g.rows);
    sparse.push_back({sparse_vars_[g.var], g.ids, to_diststrat(grad.contiguous())});
  }
  strategy_->apply_gradients(ctx, *optimizer_, dense, sparse);
}

}  // namespace diststrat::libtorch
