// MirroredStrategy::compile: a step captured into graphs per replica and
// replayed (issue 44 item 2). core/step_capture.h says how one replica's
// step is captured and replayed; this file decides, per call, whether the
// step runs eagerly, is captured or is replayed, and feeds the replays their
// batch.
//
// Per global batch size (the key: the last batch of an epoch is shorter):
//  - the first warmup_steps calls run the function eagerly, as run() does;
//  - the next call captures: each replica copies its rows to the device as an
//    eager step does (batch.features(ctx)), keeps those tensors as the
//    capture's static input buffers, and runs the function with its stream
//    capturing; the graphs are launched at once (that call's step runs);
//  - later calls replay: each replica copies its rows to the device, then
//    into the static buffers (one device-to-device copy each, ordered before
//    the launch on its stream), and replays its capture.
// Every replica makes the same decision (the key is the global size), so
// collectives between the graphs meet.
#include "diststrat/mirrored.h"

#include <map>

#include "core/device_scope.h"
#include "core/step_capture.h"

namespace diststrat {

struct CompiledStep::Impl {
  MirroredStrategy* strategy = nullptr;
  StepFunction fn;
  CaptureOptions options;
  struct Graph {
    int64_t calls = 0;
    bool captured = false;
    bool failed = false;                                 // capture threw: later calls run eagerly
    std::vector<std::shared_ptr<StepCapture>> captures;  // per replica
    std::vector<Tensor> features, labels;                // the static inputs, per replica
    std::vector<Tensor> outputs;                         // what the captured step returned
  };
  std::map<int64_t, Graph> graphs;  // by global batch size
  Stats stats;
};

namespace {

void check_static_input(const Tensor& fed, const Tensor& captured, const ReplicaContext& ctx,
                        const char* what, int64_t global) {
  DISTSTRAT_CHECK(fed.shape() == captured.shape() && fed.dtype() == captured.dtype(),
                  kInvalidArgument, "compiled step on replica ", ctx.replica_id(), ": the batch's ",
                  what, " ", fed.debug_string(), " differ from the ", captured.debug_string(),
                  " its capture for global batch size ", global,
                  " read (one capture per batch size: compile a step per dataset)");
}

// A step's output as its own tensor: the next replay rewrites the captured
// one (a copy on the replica's stream, after the step's work).
Tensor own_copy(const Tensor& o) {
  if (!o.defined() || o.num_elements() == 0) return o;
  Tensor t = Tensor::uninitialized(o.shape(), o.dtype(), o.device());
  t.copy_from(o);
  return t;
}

}  // namespace

CompiledStep MirroredStrategy::compile_step(StepFunction fn, CaptureOptions options) {
  DISTSTRAT_CHECK(static_cast<bool>(fn), kInvalidArgument, "MirroredStrategy::compile: no step");
  DISTSTRAT_CHECK(options.warmup_steps >= 0 && options.max_graphs >= 0, kInvalidArgument,
                  "MirroredStrategy::compile: warmup_steps ", options.warmup_steps,
                  " and max_graphs ", options.max_graphs, " must be >= 0");
  auto impl = std::make_shared<CompiledStep::Impl>();
  impl->strategy = this;
  impl->fn = std::move(fn);
  impl->options = options;
  return CompiledStep(std::move(impl));
}

PerReplica<Tensor> CompiledStep::operator()(const DistributedBatch& batch) {
  DISTSTRAT_CHECK(impl_ != nullptr, kFailedPrecondition,
                  "CompiledStep: default-constructed (use MirroredStrategy::compile)");
  Impl& im = *impl_;
  MirroredStrategy& strategy = *im.strategy;
  const StepFunction& fn = im.fn;
  const bool gpu = !strategy.devices().empty() && strategy.devices()[0].is_gpu();
  const int64_t key = batch.global_size();
  Impl::Graph* g = nullptr;
  if (gpu && !strategy.determinism().enabled()) {
    auto it = im.graphs.find(key);
    if (it == im.graphs.end() && static_cast<int>(im.graphs.size()) < im.options.max_graphs) {
      it = im.graphs.emplace(key, Impl::Graph()).first;
    }
    if (it != im.graphs.end()) g = &it->second;
  }
  if (!g || g->failed || g->calls < im.options.warmup_steps) {
    if (g) ++g->calls;
    PerReplica<Tensor> out = strategy.run([&](ReplicaContext& ctx) { return fn(ctx, batch); });
    ++im.stats.eager_steps;
    return out;
  }
  ++g->calls;
  const size_t replicas = static_cast<size_t>(strategy.num_replicas_in_sync());
  std::vector<Tensor> out(replicas);
  if (g->captured) {
    strategy.run([&](ReplicaContext& ctx) {
      const size_t i = static_cast<size_t>(ctx.local_replica_id());
      const Tensor& x = batch.features(ctx);
      const Tensor& y = batch.labels(ctx);
      check_static_input(x, g->features[i], ctx, "features", key);
      check_static_input(y, g->labels[i], ctx, "labels", key);
      g->features[i].copy_from(x);  // device to device, on the replica's stream
      g->labels[i].copy_from(y);
      g->captures[i]->replay();
      const Tensor& o = g->outputs[i];
      out[i] = own_copy(o);
    });
    ++im.stats.replays;
    return PerReplica<Tensor>(std::move(out));
  }
  g->captures.assign(replicas, nullptr);
  g->features.assign(replicas, Tensor());
  g->labels.assign(replicas, Tensor());
  g->outputs.assign(replicas, Tensor());
  try {
    strategy.run([&](ReplicaContext& ctx) {
      const size_t i = static_cast<size_t>(ctx.local_replica_id());
      // The rows, copied to the device eagerly; the function reads these
      // very tensors (the batch caches them), so they are the static inputs.
      g->features[i] = batch.features(ctx);
      g->labels[i] = batch.labels(ctx);
      const GpuExec e = gpu_exec(ctx.device(), "compiled step");
      auto capture = std::make_shared<StepCapture>(e.backend, e.ordinal, e.stream, ctx.device());
      ExecScope scope = *current_exec_scope();
      scope.capture = capture;
      ScopedExec capturing(scope);
      capture->begin();
      try {
        Tensor o = fn(ctx, batch);
        DISTSTRAT_CHECK(!o.defined() || o.device() == ctx.device(), kInvalidArgument,
                        "the step returned ", o.debug_string(), ", not a tensor on ",
                        ctx.device().to_string(), " (a replay only changes device memory)");
        capture->finish();
        g->outputs[i] = o;
        out[i] = own_copy(o);
      } catch (const Error& err) {
        capture->abort();
        if (err.code() == ErrorCode::kAborted) throw;  // another replica failed
        throw_error(err.code(), "MirroredStrategy::compile: replica " +
                                    std::to_string(ctx.replica_id()) +
                                    "'s step cannot be captured into a graph: " + err.message());
      } catch (...) {
        capture->abort();
        throw;
      }
      g->captures[i] = std::move(capture);
    });
  } catch (...) {
    g->failed = true;
    g->captures.clear();
    g->features.clear();
    g->labels.clear();
    g->outputs.clear();
    throw;
  }
  g->captured = true;
  ++im.stats.captures;
  im.stats.graphs_per_step = g->captures[0]->graphs();
  im.stats.host_boundaries = g->captures[0]->boundaries();
  return PerReplica<Tensor>(std::move(out));
}

CompiledStep::Stats CompiledStep::stats() const { return impl_ ? impl_->stats : Stats(); }

}  // namespace diststrat
