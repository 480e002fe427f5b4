// A fused all_reduce call, run by the fusion engine's thread: the call's
// tensors cut into packs (consecutive tensors of one dtype up to
// bytes_per_pack), and for each pack memcpy-in (the local replicas reduced
// into the fusion buffer), optional f32 wire compression, the cross-process
// all-reduce, and memcpy-out into every local replica's tensors.
#include <algorithm>
#include <cstring>

#include "allreduce/reduce_kernels.h"
#include "core/user_text.h"
#include "multiworker/fusion.h"
#include "multiworker/fusion_names.h"

namespace diststrat {

namespace {
using Clock = Timeline::Clock;
}  // namespace

void FusionEngine::execute_all_reduce(Call& call) {
  const auto t_pack = Clock::now();
  const int64_t index = executed_ - 1;
  const bool trace = timeline_ && timeline_->enabled();
  check_signatures(call);
  const Part& p0 = call.parts[0];
  const ReduceOp op = p0.op;
  // kMean is summed everywhere and divided once by the replicas in sync.
  const ReduceOp sum_op = op == ReduceOp::kMean ? ReduceOp::kSum : op;
  const size_t limit = options_.bytes_per_pack == 0 ? SIZE_MAX : options_.bytes_per_pack;
  const size_t num = p0.tensors.size();

  // Pack plan: consecutive tensors of one dtype up to `limit` bytes.
  std::vector<std::pair<size_t, size_t>> packs;
  for (size_t i = 0; i < num;) {
    const DType dtype = p0.tensors[i].dtype();
    size_t j = i, bytes = 0;
    while (j < num && p0.tensors[j].dtype() == dtype &&
           (j == i || bytes + p0.tensors[j].nbytes() <= limit)) {
      bytes += p0.tensors[j].nbytes();
      ++j;
    }
    packs.emplace_back(i, j);
    i = j;
  }
  const auto pack_name = [&](size_t pk) {
    const auto [i, j] = packs[pk];
    return "fused all_reduce #" + std::to_string(index) + " pack " + std::to_string(pk + 1) + "/" +
           std::to_string(packs.size()) + " [" + echo(name_at(p0.names, i)) +
           (j - i > 1 ? " .. " + echo(name_at(p0.names, j - 1)) : "") + "]";
  };
  if (p0.device_reduce) {
    // The data moves on the devices (device_reduction.cc); the agreement
    // above is what the host path does too. The step goes into the names, so
    // an error says where the job was.
    std::vector<FusionPack> plan;
    for (size_t pk = 0; pk < packs.size(); ++pk) {
      plan.push_back({packs[pk].first, packs[pk].second,
                      pack_name(pk) + (call.step >= 0 ? " (step " + std::to_string(call.step) + ")"
                                                      : std::string())});
    }
    p0.device_reduce(cross_, plan);
    if (trace) timeline_->complete("device all_reduce", "fusion", 0, t_pack, Clock::now());
    std::lock_guard<std::mutex> lock(mu_);
    stats_.packs += static_cast<int64_t>(packs.size());
    stats_.device_packs += static_cast<int64_t>(packs.size());
    for (const Tensor& t : p0.tensors) stats_.bytes += static_cast<int64_t>(t.nbytes());
    return;
  }
  if (trace) {
    timeline_->complete("pack", "fusion", 0, t_pack, Clock::now(),
                        "\"call\": " + std::to_string(index) + ", \"tensors\": " +
                            std::to_string(num) + ", \"packs\": " + std::to_string(packs.size()));
  }

  // Size the fusion buffer once for the largest multi-tensor pack of the call.
  size_t largest = 0;
  for (const auto& [i, j] : packs) {
    if (j == i + 1) continue;
    size_t bytes = 0;
    for (size_t k = i; k < j; ++k) bytes += p0.tensors[k].nbytes();
    largest = std::max(largest, bytes);
  }
  ensure(buffer_, largest);

  std::vector<const void*> srcs(num_local_);
  for (size_t pk = 0; pk < packs.size(); ++pk) {
    const auto [i, j] = packs[pk];
    const DType dtype = p0.tensors[i].dtype();
    const size_t esz = dtype_size(dtype);
    size_t bytes = 0;
    for (size_t k = i; k < j; ++k) bytes += p0.tensors[k].nbytes();
    const size_t count = bytes / esz;
    const std::string name = pack_name(pk);
    const std::string args =
        "\"call\": " + std::to_string(index) + ", \"pack\": " + std::to_string(pk) +
        ", \"tensors\": " + std::to_string(j - i) + ", \"bytes\": " + std::to_string(bytes);

    // memcpy-in: reduce the local replicas' tensors into the pack buffer.
    const auto t_in = Clock::now();
    char* data;
    const bool alone = j == i + 1;
    if (alone) {
      // A single tensor is reduced in place in local replica 0's tensor.
      data = static_cast<char*>(const_cast<Tensor&>(p0.tensors[i]).data());
      if (num_local_ > 1 && count) {
        for (int l = 0; l < num_local_; ++l) srcs[l] = call.parts[l].tensors[i].data();
        kernels::reduce(data, srcs.data(), num_local_, count, dtype, sum_op, 1);
      }
    } else {
      data = buffer_.data();
      size_t off = 0;
      for (size_t k = i; k < j; ++k) {
        const size_t nb = call.parts[0].tensors[k].nbytes();
        if (nb) {
          if (num_local_ == 1) {
            std::memcpy(data + off, call.parts[0].tensors[k].data(), nb);
          } else {
            for (int l = 0; l < num_local_; ++l) srcs[l] = call.parts[l].tensors[k].data();
            kernels::reduce(data + off, srcs.data(), num_local_, nb / esz, dtype, sum_op, 1);
          }
        }
        off += nb;
      }
    }
    const auto t_reduce = Clock::now();
    if (trace) timeline_->complete("memcpy-in", "fusion", 0, t_in, t_reduce, args);

    // reduce: across processes, compressed on the wire for f32.
    if (cross_.size() > 1) {
      if (dtype == DType::kFloat32 && options_.compression != Compression::kNone) {
        const DType wire =
            options_.compression == Compression::kFloat16 ? DType::kFloat16 : DType::kBFloat16;
        ensure(wire_, count * dtype_size(wire));
        kernels::cast(data, DType::kFloat32, wire_.data(), wire, count);
        cross_.all_reduce(wire_.data(), wire_.data(), count, wire, sum_op, name);
        kernels::cast(wire_.data(), wire, data, DType::kFloat32, count);
      } else {
        cross_.all_reduce(data, data, count, dtype, sum_op, name);
      }
    }
    if (op == ReduceOp::kMean) kernels::scale_mean(data, count, dtype, replicas_in_sync_);
    const auto t_out = Clock::now();
    if (trace) timeline_->complete("reduce", "fusion", 0, t_reduce, t_out, args);

    // memcpy-out: the result into every local replica's tensors.
    for (int l = 0; l < num_local_; ++l) {
      size_t off = 0;
      for (size_t k = i; k < j; ++k) {
        Tensor& t = call.parts[l].tensors[k];
        const size_t nb = t.nbytes();
        if (nb && t.data() != data + off) std::memcpy(t.data(), data + off, nb);
        off += nb;
      }
    }
    if (trace) timeline_->complete("memcpy-out", "fusion", 0, t_out, Clock::now(), args);
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.packs;
    stats_.bytes += static_cast<int64_t>(bytes);
  }
}

}  // namespace diststrat
