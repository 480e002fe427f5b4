// The fusion engine's ZeRO-1 collectives: reduce_scatter and all_gather over
// every replica in sync, one message each (no packing); the local replicas
// are reduced (or laid side by side) in-process first, then one
// cross-process collective runs per rank.
#include <cstring>

#include "allreduce/reduce_kernels.h"
#include "core/user_text.h"
#include "multiworker/fusion.h"
#include "multiworker/fusion_names.h"

namespace diststrat {

Work FusionEngine::reduce_scatter_async(int local, ReduceOp op, Tensor in, Tensor out,
                                        std::string name, DeviceReduce device) {
  const int64_t r = static_cast<int64_t>(cross_.size()) * num_local_;
  try {
    const bool where = device ? num_local_ == 1 && in.device() == out.device()
                              : in.device().is_cpu() && out.device().is_cpu();
    DISTSTRAT_CHECK(in.defined() && out.defined() && in.dtype() == out.dtype() && where &&
                        in.num_elements() == r * out.num_elements(),
                    kInvalidArgument, "rank ", rank_, ": reduce_scatter '", echo(name), "' of ",
                    in.debug_string(), " into ", out.debug_string(), ": needs ",
                    device ? "tensors of one device" : "host tensors", ", ", r,
                    " x the output's elements in the input");
  } catch (...) {
    return Work::completed(std::current_exception());
  }
  Part p;
  p.kind = Kind::kReduceScatter;
  p.op = op;
  p.tensors = {std::move(in)};
  p.names = {std::move(name)};
  p.out = std::move(out);
  p.device_reduce = std::move(device);
  return enqueue(local, std::move(p), false, "reduce_scatter", false);
}

Work FusionEngine::all_gather_async(int local, Tensor in, Tensor out, std::string name,
                                    DeviceReduce device) {
  const int64_t r = static_cast<int64_t>(cross_.size()) * num_local_;
  try {
    const bool where = device ? num_local_ == 1 && in.device() == out.device()
                              : in.device().is_cpu() && out.device().is_cpu();
    DISTSTRAT_CHECK(in.defined() && out.defined() && in.dtype() == out.dtype() && where &&
                        out.num_elements() == r * in.num_elements(),
                    kInvalidArgument, "rank ", rank_, ": all_gather '", echo(name), "' of ",
                    in.debug_string(), " into ", out.debug_string(), ": needs ",
                    device ? "tensors of one device" : "host tensors", ", ", r,
                    " x the input's elements in the output");
  } catch (...) {
    return Work::completed(std::current_exception());
  }
  Part p;
  p.kind = Kind::kAllGather;
  p.tensors = {std::move(in)};
  p.names = {std::move(name)};
  p.out = std::move(out);
  p.device_reduce = std::move(device);
  return enqueue(local, std::move(p), false, "all_gather", false);
}

void FusionEngine::execute_sharded(Call& call) {
  check_signatures(call);
  const Part& p0 = call.parts[0];
  const int64_t index = executed_ - 1;
  const bool scatter = p0.kind == Kind::kReduceScatter;
  const int w = cross_.size();
  const int l_count = num_local_;
  const DType dtype = p0.tensors[0].dtype();
  const size_t esz = dtype_size(dtype);
  // B: the elements of one replica's block.
  const size_t block =
      static_cast<size_t>(scatter ? p0.out.num_elements() : p0.tensors[0].num_elements());
  const size_t rank_block = block * static_cast<size_t>(l_count);  // this rank's replicas' blocks
  for (int l = 0; l < l_count; ++l) {
    const Part& p = call.parts[static_cast<size_t>(l)];
    DISTSTRAT_CHECK(p.out.num_elements() == p0.out.num_elements() && p.out.dtype() == dtype,
                    kInvalidArgument, "rank ", rank_, ": ", call.what, " '",
                    echo(name_at(p0.names, 0)), "': local replica ", l, " passed output ",
                    p.out.debug_string(), ", local replica 0 ", p0.out.debug_string());
  }
  const std::string name =
      "fused " + call.what + " #" + std::to_string(index) + " [" + echo(name_at(p0.names, 0)) + "]";
  const ReduceOp sum_op = p0.op == ReduceOp::kMean ? ReduceOp::kSum : p0.op;
  const size_t total = rank_block * static_cast<size_t>(w);
  if (p0.device_reduce) {
    // On the devices (device_reduction.cc), after the same agreement.
    p0.device_reduce(
        cross_, {FusionPack{0, 1,
                            name + (call.step >= 0 ? " (step " + std::to_string(call.step) + ")"
                                                   : std::string())}});
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.packs;
    ++stats_.device_packs;
    stats_.bytes += static_cast<int64_t>(total * esz);
    return;
  }
  if (scatter) {
    // In-process first: the local replicas' inputs reduced into one buffer
    // (a single local replica's input is used as it is).
    const char* in = static_cast<const char*>(p0.tensors[0].data());
    if (l_count > 1) {
      ensure(buffer_, total * esz);
      std::vector<const void*> srcs(static_cast<size_t>(l_count));
      for (int l = 0; l < l_count; ++l)
        srcs[static_cast<size_t>(l)] = call.parts[static_cast<size_t>(l)].tensors[0].data();
      if (total) kernels::reduce(buffer_.data(), srcs.data(), l_count, total, dtype, sum_op, 1);
      in = buffer_.data();
    }
    // This rank's replicas' blocks: straight into the output with one local
    // replica, else staged.
    char* mine;
    if (l_count == 1) {
      mine = static_cast<char*>(const_cast<Tensor&>(p0.out).data());
    } else {
      ensure(shard_, rank_block * esz);
      mine = shard_.data();
    }
    if (w > 1) {
      cross_.reduce_scatter(in, mine, rank_block, dtype, sum_op, name);
    } else if (mine != in) {
      std::memcpy(mine, in, rank_block * esz);
    }
    if (p0.op == ReduceOp::kMean) kernels::scale_mean(mine, rank_block, dtype, replicas_in_sync_);
    if (l_count > 1) {
      for (int l = 0; l < l_count; ++l) {
        Tensor& out = call.parts[static_cast<size_t>(l)].out;
        std::memcpy(out.data(), mine + static_cast<size_t>(l) * block * esz, block * esz);
      }
    }
  } else {
    // This rank's replicas' blocks side by side, then one cross-process
    // all_gather into local replica 0's output, copied to the others.
    const char* mine = static_cast<const char*>(p0.tensors[0].data());
    if (l_count > 1) {
      ensure(shard_, rank_block * esz);
      for (int l = 0; l < l_count; ++l) {
        std::memcpy(shard_.data() + static_cast<size_t>(l) * block * esz,
                    call.parts[static_cast<size_t>(l)].tensors[0].data(), block * esz);
      }
      mine = shard_.data();
    }
    char* out0 = static_cast<char*>(const_cast<Tensor&>(p0.out).data());
    if (w > 1) {
      cross_.all_gather(mine, out0, rank_block, dtype, name);
    } else if (out0 != mine) {
      std::memcpy(out0, mine, rank_block * esz);
    }
    for (int l = 1; l < l_count; ++l) {
      std::memcpy(call.parts[static_cast<size_t>(l)].out.data(), out0, total * esz);
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.packs;
  stats_.bytes += static_cast<int64_t>(total * esz);
}

}  // namespace diststrat
