// Determinism mode's exact sum of the virtual shards' gradients
// (diststrat/determinism.h, docs/determinism.md).
//
// Each shard's gradients are held until the real replica's last shard. Then,
// per tensor:
//  1. e = the largest binary exponent of any element of any shard (a max
//     all-reduce over every replica, exact in any order), so every replica
//     picks the same scale s = 61 - L - e, L = ceil(log2 V): each element
//     x becomes q = round(x * 2^s) with |q| <= 2^(62 - L), and a sum of V of
//     them stays below 2^62.
//  2. the shards' q are summed as int64 here and over the replicas (one
//     int64 sum all-reduce of every tensor's sums, laid end to end):
//     integer addition is associative, so the sum is the same whichever
//     replica held which shard and whatever the algorithm.
//  3. converted back once: float(sum) * 2^-s.
// The error against the exact sum is at most V * 2^-(s+1) per element, plus
// the final rounding to float (docs/determinism.md measures it). A tensor
// with a non-finite element anywhere becomes NaN everywhere, so loss
// scaling's check still sees it.
//
// The result is identical on every replica. Under MirroredStrategy and
// MultiWorkerMirroredStrategy every replica takes it and the strategy's
// gradient all-reduce is skipped (SummedContext); under CentralStorage it
// enters the reduce-to-one as replica 0's gradient with zeros from the
// others: x + 0 is exact, so that reduction returns the same bits. The
// element-wise passes (copy with max, rounding and sum, conversion back) are
// OptimKernels, one per instruction-set variant: integer results, so every
// variant gives the same bits.
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>

#include "optim/optim_kernels.h"
#include "runtime/determinism.h"
#include "runtime/variable_impl.h"
#include "core/user_text.h"
#include "diststrat/optimizer.h"

namespace diststrat {

struct Optimizer::ShardSums {
  // One local replica's buffers, kept from step to step (a step's gradients
  // are megabytes; fresh pages each step cost more than the sums).
  struct Replica {
    std::vector<std::vector<Tensor>> held;  // per shard position: its gradients
    size_t count = 0;                       // shards held in this step
    std::vector<int32_t> max_bits;          // per tensor: the largest |x|'s bits held
    Tensor sums;                            // every tensor's int64 sums, one after another
    std::vector<Tensor> out;                // per tensor: the result
    std::unique_ptr<SummedContext> summed;  // the step's context when the sum is everyone's
  };
  std::mutex mu;
  std::map<int, Replica> replicas;  // by local replica id
};

std::shared_ptr<Optimizer::ShardSums> Optimizer::new_shard_sums() {
  return std::make_shared<ShardSums>();
}

namespace {
constexpr int64_t kAllZero = INT_MIN;    // no nonzero element anywhere
constexpr int64_t kNonFinite = INT_MAX;  // an inf or NaN somewhere

int ceil_log2(int v) {
  int l = 0;
  while ((1 << l) < v) ++l;
  return l;
}

// The exponent entry of a tensor whose largest |x| has the bit pattern
// `max_bits` (a non-negative float's bits order as the float does, inf and
// NaN above every finite one).
int64_t exponent_of(int32_t max_bits) {
  if (max_bits >= 0x7f800000) return kNonFinite;
  if (max_bits == 0) return kAllZero;
  float max_abs;
  std::memcpy(&max_abs, &max_bits, sizeof max_abs);
  return std::ilogb(max_abs);
}

// The power of two that takes values of agreed exponent `e` to int64 with
// room for 2^L terms (0 when there is nothing to scale).
int fixed_point_shift(int64_t e, int L) {
  return e == kAllZero || e == kNonFinite ? 0 : static_cast<int>(61 - L - e);
}

// `t`, kept for the next step when it has `shape` already, else made anew
// with `shape` and `dtype` (contents left to the caller).
Tensor& reuse(Tensor& t, const Shape& shape, DType dtype) {
  if (!t.defined() || t.shape() != shape) t = Tensor(shape, dtype);
  return t;
}
}  // namespace

ReplicaContext* Optimizer::combine_shards(
    ReplicaContext& ctx, const std::vector<std::pair<Tensor, Variable>>& grads_and_vars,
    std::vector<std::pair<Tensor, Variable>>& combined) {
  auto* shard = dynamic_cast<ShardContext*>(&ctx);
  DISTSTRAT_CHECK(shard != nullptr, kInternal, "apply_gradients: virtual shard ",
                  ctx.virtual_shard(), " without the strategy's shard context");
  const int V = ctx.num_replicas_in_sync();
  const ShardRange local = shard->local_shards();
  ShardSums::Replica* mine;
  {
    std::lock_guard<std::mutex> lock(shard_sums_->mu);
    mine = &shard_sums_->replicas[ctx.local_replica_id()];
  }
  // A step that failed part-way left its shards behind: a new step starts
  // at the replica's first shard.
  if (ctx.virtual_shard() == local.first) mine->count = 0;
  const size_t position = static_cast<size_t>(ctx.virtual_shard() - local.first);
  DISTSTRAT_CHECK(mine->count == position, kFailedPrecondition,
                  "apply_gradients from virtual shard ", ctx.virtual_shard(), ": ", mine->count,
                  " calls held for the ", position,
                  " shards before it on this replica; call apply_gradients once per shard");
  const size_t K = grads_and_vars.size();
  if (mine->held.size() <= position) mine->held.resize(position + 1);
  std::vector<Tensor>& held = mine->held[position];
  held.resize(K);
  if (position == 0) mine->max_bits.assign(K, 0);
  DISTSTRAT_CHECK(mine->max_bits.size() == K, kInvalidArgument,
                  "apply_gradients from virtual shard ", ctx.virtual_shard(), ": ", K,
                  " gradients, the replica's first shard passed ", mine->max_bits.size());
  const optim_detail::OptimKernels& kernels = optim_detail::optim_kernels();
  for (size_t k = 0; k < K; ++k) {
    const Tensor& g = grads_and_vars[k].first;
    DISTSTRAT_CHECK(g.device().is_cpu(), kUnimplemented, "apply_gradients from virtual shard ",
                    ctx.virtual_shard(), ": gradient of '", echo(grads_and_vars[k].second.name()),
                    "' on ", g.device().to_string(), " (determinism mode takes host gradients)");
    if (position > 0) {
      const Tensor& first = mine->held[0][k];
      DISTSTRAT_CHECK(first.shape() == g.shape(), kInvalidArgument,
                      "apply_gradients from virtual shard ", ctx.virtual_shard(), ": gradient ", k,
                      " of '", echo(grads_and_vars[k].second.name()), "' is ", g.debug_string(),
                      ", unlike the replica's first shard's");
    }
    // The copy and the largest |x| in one pass.
    Tensor& h = reuse(held[k], g.shape(), DType::kFloat32);
    const int32_t bits = kernels.copy_max_abs_bits(h.data<float>(), g.data<float>(),
                                                   static_cast<size_t>(g.num_elements()));
    mine->max_bits[k] = std::max(mine->max_bits[k], bits);
  }
  ++mine->count;
  if (!shard->is_last()) return nullptr;

  const size_t count = mine->count;
  mine->count = 0;
  ReplicaContext& real = shard->real();
  Tensor exponents(Shape{static_cast<int64_t>(K)}, DType::kInt64);
  for (size_t k = 0; k < K; ++k) exponents.data<int64_t>()[k] = exponent_of(mine->max_bits[k]);
  std::vector<Tensor> agree{exponents};
  real.all_reduce(ReduceOp::kMax, agree, {"determinism/exponents"});

  // One int64 tensor for all the sums: the strategy reduces a lone tensor
  // in place, without packing it into a fusion buffer and out again.
  const int L = ceil_log2(V);
  int64_t total = 0;
  for (const auto& gv : grads_and_vars) total += gv.first.num_elements();
  Tensor& flat = reuse(mine->sums, Shape{total}, DType::kInt64);
  std::vector<const float*> srcs(count);
  int64_t* q = flat.data<int64_t>();
  for (size_t k = 0; k < K; ++k) {
    const int64_t e = agree[0].data<int64_t>()[k];
    const size_t n = static_cast<size_t>(grads_and_vars[k].first.num_elements());
    if (e == kAllZero || e == kNonFinite) {
      std::memset(q, 0, n * sizeof(int64_t));
    } else {
      for (size_t j = 0; j < count; ++j) srcs[j] = mine->held[j][k].data<float>();
      // Each element of each shard rounded to the agreed grid, summed here.
      kernels.fixed_point_sum(q, srcs.data(), count, n, fixed_point_shift(e, L));
    }
    q += n;
  }
  std::vector<Tensor> sums{flat};
  real.all_reduce(
      ReduceOp::kSum, sums,
      {"determinism/gradients of " + std::to_string(K) + " variable(s) '" +
       (K ? grads_and_vars.front().second.name() + "'..'" + grads_and_vars.back().second.name()
          : std::string()) +
       "'"});

  // Where the strategy sums on the context, every replica takes the sum and
  // the context's kSum leaves it be; elsewhere replica 0 carries it into the
  // strategy's reduction and the others zeros.
  const bool everyone = sums_gradients_on_context(real.strategy());
  const bool carrier = everyone || real.replica_id() == 0;
  combined.clear();
  mine->out.resize(K);
  q = sums[0].data<int64_t>();
  for (size_t k = 0; k < K; ++k) {
    const int64_t e = agree[0].data<int64_t>()[k];
    Tensor& g = reuse(mine->out[k], grads_and_vars[k].first.shape(), DType::kFloat32);
    float* out = g.data<float>();
    const size_t n = static_cast<size_t>(g.num_elements());
    if (!carrier) {
      std::memset(out, 0, n * sizeof(float));  // +0: x + 0 is exact
    } else if (e == kNonFinite) {
      for (size_t i = 0; i < n; ++i) out[i] = std::numeric_limits<float>::quiet_NaN();
    } else {
      kernels.from_fixed_point(out, q, n, fixed_point_shift(e, L));
    }
    q += n;
    combined.emplace_back(g, grads_and_vars[k].second);
  }
  if (!everyone) return &real;
  mine->summed = std::make_unique<SummedContext>(real);
  return mine->summed.get();
}

}  // namespace diststrat
