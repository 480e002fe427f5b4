// MultiWorkerMirroredStrategy's set-up puts every rank on the lowest CPU
// kernel variant of the job (diststrat/cpu_isa.h): here the last rank is
// limited to the baseline, as a host without AVX would be, and every rank
// must then compute with the baseline and update bit-identically. It lowers
// the variant of each process for good, so ctest runs it on its own
// (mpi_cpu_isa_agreement); mpi_np2..4 leave it out.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstring>

#include "runtime/variable_impl.h"
#include "../unit/training_util.h"
#include "diststrat/diststrat.h"
#include "mpi_test_util.h"

namespace ds = diststrat;

namespace {

using diststrat_test::world_rank;
using diststrat_test::world_size;

TEST(CpuIsaAgreementMpi, EveryRankRunsTheJobsLowestVariant) {
  if (world_rank() == world_size() - 1) ds::limit_cpu_isa(ds::CpuIsa::kBaseline);
  ds::MultiWorkerOptions o;
  o.devices = {ds::Device::cpu(0)};
  ds::MultiWorkerMirroredStrategy s(o);
  EXPECT_EQ(ds::cpu_isa(), ds::CpuIsa::kBaseline) << "rank " << world_rank();
  const ds::nn::Mlp mlp({784, 32, 10});
  const ds::Dataset data = ds::testing::synthetic(32 * 5, 3);
  std::vector<ds::Variable> vars;
  ds::testing::train_under(s, mlp, data, 32, 5, 0.05f, 0.9f, &vars);
  for (const ds::Variable& v : vars) {
    ds::Tensor w0 = v.impl().copies[0].clone();
    s.broadcast(w0, 0, "check " + v.name());
    EXPECT_EQ(0, std::memcmp(w0.data(), v.impl().copies[0].data(), w0.nbytes())) << v.name();
  }
}

}  // namespace
