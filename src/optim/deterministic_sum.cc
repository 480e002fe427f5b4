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
//  2. the shards' q are summed as int64 here and over the replicas (an int64
//     sum all-reduce): integer addition is associative, so the sum is the
//     same whichever replica held which shard and whatever the algorithm.
//  3. converted back once: float(sum) * 2^-s.
// The error against the exact sum is at most V * 2^-(s+1) per element, plus
// the final rounding to float (docs/determinism.md measures it). A tensor
// with a non-finite element anywhere becomes NaN everywhere, so loss
// scaling's check still sees it.
//
// The result is identical on every replica. It then enters the strategy's
// ordinary reduction (flat, hierarchical, fused, clipping, accumulation) as
// replica 0's gradient with zeros from the others: x + 0 is exact, so that
// reduction returns the same bits whatever its order.
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#include <climits>
#include <cstring>
#include <cmath>
#include <limits>
#include <map>
#include <mutex>

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
    std::vector<Tensor> sums, out;          // per tensor: int64 sums, the result
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

// round-to-nearest-even of v to int64 (|v| < 2^63): llrint without the
// library call where the CPU converts by itself.
inline int64_t round_to_int64(double v) {
#if defined(__x86_64__)
  return _mm_cvtsd_si64(_mm_set_sd(v));  // MXCSR's rounding: nearest-even
#else
  return std::llrint(v);
#endif
}

int ceil_log2(int v) {
  int l = 0;
  while ((1 << l) < v) ++l;
  return l;
}

// The exponent entry of one tensor over this replica's shards. The largest
// |x| is found on the bit patterns: a non-negative float's bits order as
// the float does (inf and NaN above every finite one), and an integer max
// vectorizes where a float compare with a NaN check does not.
int64_t local_exponent(const std::vector<std::vector<Tensor>>& shards, size_t k) {
  uint32_t max_bits = 0;
  for (const auto& grads : shards) {
    const uint32_t* x = static_cast<const uint32_t*>(grads[k].data());
    for (int64_t i = 0, n = grads[k].num_elements(); i < n; ++i) {
      const uint32_t a = x[i] & 0x7fffffffu;
      max_bits = a > max_bits ? a : max_bits;
    }
  }
  if (max_bits >= 0x7f800000u) return kNonFinite;
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
  for (size_t k = 0; k < K; ++k) {
    const Tensor& g = grads_and_vars[k].first;
    DISTSTRAT_CHECK(g.device().is_cpu(), kUnimplemented, "apply_gradients from virtual shard ",
                    ctx.virtual_shard(), ": gradient of '", echo(grads_and_vars[k].second.name()),
                    "' on ", g.device().to_string(), " (determinism mode takes host gradients)");
    if (position > 0) {
      const Tensor& first = mine->held[0][k];
      DISTSTRAT_CHECK(mine->held[0].size() == K && first.shape() == g.shape(), kInvalidArgument,
                      "apply_gradients from virtual shard ", ctx.virtual_shard(), ": gradient ", k,
                      " of '", echo(grads_and_vars[k].second.name()), "' is ", g.debug_string(),
                      ", unlike the replica's first shard's");
    }
    if (held[k].defined() && held[k].shape() == g.shape()) {
      held[k].copy_from(g);
    } else {
      held[k] = g.clone();
    }
  }
  ++mine->count;
  if (!shard->is_last()) return nullptr;

  const std::vector<std::vector<Tensor>> shards(
      mine->held.begin(), mine->held.begin() + static_cast<long>(mine->count));
  mine->count = 0;
  ReplicaContext& real = shard->real();
  Tensor exponents(Shape{static_cast<int64_t>(K)}, DType::kInt64);
  for (size_t k = 0; k < K; ++k) exponents.data<int64_t>()[k] = local_exponent(shards, k);
  std::vector<Tensor> agree{exponents};
  real.all_reduce(ReduceOp::kMax, agree, {"determinism/exponents"});

  const int L = ceil_log2(V);
  std::vector<Tensor> sums;
  std::vector<std::string> names;
  mine->sums.resize(K);
  for (size_t k = 0; k < K; ++k) {
    const int64_t e = agree[0].data<int64_t>()[k];
    const int s = fixed_point_shift(e, L);
    Tensor& q = reuse(mine->sums[k], grads_and_vars[k].first.shape(), DType::kInt64);
    int64_t* out = q.data<int64_t>();
    const int64_t n = q.num_elements();
    for (int64_t i = 0; i < n; ++i) out[i] = 0;
    if (e != kAllZero && e != kNonFinite) {
      // A float times a power of two within double's range is exact.
      const double scale = std::ldexp(1.0, s);
      for (const auto& g : shards) {
        const float* x = g[k].data<float>();
        for (int64_t i = 0; i < n; ++i) out[i] += round_to_int64(static_cast<double>(x[i]) * scale);
      }
    }
    sums.push_back(q);
    names.push_back("determinism/" + grads_and_vars[k].second.name() + "/grad");
  }
  real.all_reduce(ReduceOp::kSum, sums, names);

  // Replica 0 carries the sum into the strategy's reduction, the others zeros.
  const bool carrier = real.replica_id() == 0;
  combined.clear();
  mine->out.resize(K);
  for (size_t k = 0; k < K; ++k) {
    const int64_t e = agree[0].data<int64_t>()[k];
    const int s = fixed_point_shift(e, L);
    Tensor& g = reuse(mine->out[k], grads_and_vars[k].first.shape(), DType::kFloat32);
    float* out = g.data<float>();
    const int64_t* q = sums[k].data<int64_t>();
    const int64_t n = g.num_elements();
    // The sum rounded once to float, then scaled in double (exact unless the
    // result is a float subnormal).
    const double unscale = std::ldexp(1.0, -s);
    if (!carrier) {
      for (int64_t i = 0; i < n; ++i) out[i] = 0.0f;
    } else if (e == kNonFinite) {
      for (int64_t i = 0; i < n; ++i) out[i] = std::numeric_limits<float>::quiet_NaN();
    } else {
      for (int64_t i = 0; i < n; ++i)
        out[i] = static_cast<float>(static_cast<double>(static_cast<float>(q[i])) * unscale);
    }
    combined.emplace_back(g, grads_and_vars[k].second);
  }
  return &real;
}

}  // namespace diststrat
