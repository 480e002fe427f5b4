// All-reduces across two CPU replicas of a MirroredStrategy and checks the sum;
// then a one-rank ProcessGroup (diststrat/process_group.h) from outside.
#include <cstdio>

#include <diststrat/diststrat.h>

int main() {
  namespace ds = diststrat;
  ds::MirroredStrategy strategy({ds::Device::cpu(0), ds::Device::cpu(1)});
  ds::PerReplica<float> sums = strategy.run([](ds::ReplicaContext& ctx) {
    ds::Tensor t(ds::Shape{3}, ds::DType::kFloat32);
    for (int i = 0; i < 3; ++i) t.data<float>()[i] = static_cast<float>(ctx.replica_id() + 1);
    std::vector<ds::Tensor> v{t};
    ctx.all_reduce(ds::ReduceOp::kSum, v);
    return t.data<float>()[2];
  });
  // The job-wide process group outside any strategy (one rank without mpirun).
  ds::ProcessGroup pg;
  std::vector<ds::Tensor> params{ds::Tensor(ds::Shape{2}, ds::DType::kFloat32)};
  params[0].data<float>()[1] = 5.0f;
  ds::broadcast_tensors(pg, params, 0, {"w"});
  pg.all_reduce(params[0], ds::ReduceOp::kSum, "w");
  const bool ok =
      sums[0] == 3.0f && sums[1] == 3.0f && pg.size() == 1 && params[0].data<float>()[1] == 5.0f;
  std::printf("consumer: diststrat %s, sum=%g %s\n", DISTSTRAT_VERSION, sums[0],
              ok ? "ok" : "WRONG");
  return ok ? 0 : 1;
}
