// MultiWorkerMirroredStrategy's replica context: its collectives go to the
// fusion engine (GPU tensors through NCCL, device_reduction.h, or staged
// through host memory), its all_gather and
// barrier through a merge call to the workers' collectives.
#include <algorithm>

#include "core/user_text.h"
#include "multiworker/multi_worker_impl.h"
#include "runtime/collective_check.h"

namespace diststrat {

int MultiWorkerReplicaContext::replica_id() const { return impl_->first_local + local_; }
int MultiWorkerReplicaContext::num_replicas_in_sync() const { return impl_->total_replicas; }
const Device& MultiWorkerReplicaContext::device() const {
  return impl_->replicas->devices()[local_];
}
Strategy& MultiWorkerReplicaContext::strategy() const { return *impl_->self; }
LocalReplicaContext& MultiWorkerReplicaContext::inner() const {
  return impl_->replicas->context(local_);
}

Work MultiWorkerReplicaContext::all_reduce_async(ReduceOp op, std::vector<Tensor> tensors,
                                                 std::vector<std::string> names) {
  try {
    check_replica_tensors(*this, "all_reduce", tensors, names);
  } catch (...) {
    return Work::completed(std::current_exception());
  }
  const bool on_gpu = std::any_of(tensors.begin(), tensors.end(),
                                  [](const Tensor& t) { return t.device().is_gpu(); });
  if (!on_gpu)
    return impl_->engine->all_reduce_async(local_, op, std::move(tensors), std::move(names));
  const bool all_here = std::all_of(tensors.begin(), tensors.end(),
                                    [&](const Tensor& t) { return t.device() == device(); });
  if (impl_->device && all_here) {
    // NCCL across processes (device_reduction.h): enqueued behind this
    // replica's stream, and this stream ordered after it; no host wait.
    try {
      return impl_->device->all_reduce_async(*impl_->engine, op, std::move(tensors),
                                             std::move(names), stream());
    } catch (...) {
      return Work::completed(std::current_exception());
    }
  }
  // GPU tensors without NCCL (gpu_reduction, docs/gpu.md): staged through
  // host memory (copies on this replica's stream), reduced by the fusion
  // engine like host tensors, copied back. Completes before returning, so no
  // overlap with later device work.
  std::vector<Tensor> host = tensors;
  for (Tensor& h : host) stage_to_host(h);
  impl_->engine->all_reduce_async(local_, op, host, std::move(names)).wait();
  for (size_t i = 0; i < tensors.size(); ++i) tensors[i].copy_from(host[i]);
  return Work::completed();
}

Tensor MultiWorkerReplicaContext::all_gather(const Tensor& t, const std::string& name) {
  // In-process first (rows ordered by local replica = by replica id), then
  // across workers once per process.
  const Tensor local = inner().all_gather(t, name);
  if (local.device().is_cpu()) {
    return merge_call([&](Strategy&) { return impl_->cross_gather(local, name); });
  }
  Tensor host = local;
  stage_to_host(host);
  const Tensor all = merge_call([&](Strategy&) { return impl_->cross_gather(host, name); });
  Tensor out(all.shape(), all.dtype(), local.device());
  out.copy_from(all);
  return out;
}

void MultiWorkerReplicaContext::barrier(const std::string& name) {
  merge_call([&](Strategy&) {
    impl_->engine->run([&](Communicator& c) { c.barrier(name); }, "barrier '" + echo(name) + "'");
  });
}

std::shared_ptr<void> MultiWorkerReplicaContext::merge_call_impl(
    const std::function<std::shared_ptr<void>(Strategy&)>& fn) {
  return inner().merge_call(fn);
}

}  // namespace diststrat
