// Run-time instruction-set dispatch (diststrat/cpu_isa.h): the variants'
// kernels agree (the element-wise ones bit for bit, the GEMMs to float
// rounding), sizes that are not a multiple of any vector width included, and
// the variant in use is one this CPU runs.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <tuple>
#include <vector>

#include "core/cast_kernels.h"
#include "core/cpu_isa.h"
#include "diststrat/diststrat.h"
#include "nn/nn_kernels.h"
#include "optim/optim_kernels.h"

namespace ds = diststrat;

namespace {

std::vector<float> random_floats(size_t n, uint32_t seed, float lo = -2.0f, float hi = 2.0f) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = d(gen);
  return v;
}

// The variants this CPU runs, each with its name.
struct Variant {
  ds::CpuIsa isa;
  const ds::nn::NnKernels* nn;
  const ds::optim_detail::OptimKernels* optim;
  const ds::cpu::CastKernels* cast;
};
std::vector<Variant> runnable_variants() {
  std::vector<Variant> v{{ds::CpuIsa::kBaseline, &ds::nn::isa_baseline::kNnKernels,
                          &ds::optim_detail::isa_baseline::kOptimKernels,
                          &ds::cpu::isa_baseline::kCastKernels}};
#if defined(__x86_64__)
  if (ds::cpu_isa_supported() >= ds::CpuIsa::kAvx2) {
    v.push_back({ds::CpuIsa::kAvx2, &ds::nn::isa_avx2::kNnKernels,
                 &ds::optim_detail::isa_avx2::kOptimKernels, &ds::cpu::isa_avx2::kCastKernels});
  }
  if (ds::cpu_isa_supported() >= ds::CpuIsa::kAvx512) {
    v.push_back({ds::CpuIsa::kAvx512, &ds::nn::isa_avx512::kNnKernels,
                 &ds::optim_detail::isa_avx512::kOptimKernels, &ds::cpu::isa_avx512::kCastKernels});
  }
#endif
  return v;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST(CpuIsa, TheVariantInUseRunsOnThisCpu) {
  EXPECT_LE(ds::cpu_isa(), ds::cpu_isa_supported());
  // limit_cpu_isa never raises the variant.
  EXPECT_EQ(ds::limit_cpu_isa(ds::CpuIsa::kAvx512), ds::cpu_isa());
  EXPECT_STREQ(ds::cpu_isa_name(ds::CpuIsa::kAvx2), "avx2");
}

// A value that is no variant is refused and changes nothing (it set the
// variant in use to -1, which no kernel table has).
TEST(CpuIsa, LimitingToAValueThatIsNoVariantIsAnError) {
  const ds::CpuIsa before = ds::cpu_isa();
  for (int bad : {-1, 3, 7}) {
    EXPECT_THROW(ds::limit_cpu_isa(static_cast<ds::CpuIsa>(bad)), ds::InvalidArgumentError) << bad;
  }
  EXPECT_EQ(ds::cpu_isa(), before);
}

TEST(CpuIsa, ForcingAVariantAboveTheCpuIsAnErrorNamingTheVariable) {
  if (ds::cpu_isa_supported() == ds::CpuIsa::kAvx512) GTEST_SKIP() << "this CPU runs every variant";
  const char* above = ds::cpu_isa_supported() == ds::CpuIsa::kAvx2 ? "avx512" : "avx2";
  ::setenv("DISTSTRAT_CPU", above, 1);
  try {
    ds::cpu::isa_from_env();
    ADD_FAILURE() << "DISTSTRAT_CPU=" << above << " accepted";
  } catch (const ds::InvalidArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("DISTSTRAT_CPU='"), std::string::npos) << e.what();
  }
  ::unsetenv("DISTSTRAT_CPU");
}

TEST(CpuIsa, DenseLayersAgreeToFloatRounding) {
  // m, k, n not multiples of 4, 8 or 16; k large enough for Eigen's blocking.
  for (const auto& [m, k, n] :
       {std::tuple<int64_t, int64_t, int64_t>{37, 785, 29}, {1, 3, 1}, {128, 256, 10}}) {
    const std::vector<float> x = random_floats(m * k, 1), w = random_floats(k * n, 2),
                             b = random_floats(n, 3), dy = random_floats(m * n, 4);
    std::vector<std::vector<float>> ys, dws, dbs, dxs;
    for (const Variant& v : runnable_variants()) {
      std::vector<float> y(m * n), dw(k * n), db(n), dx(m * k);
      v.nn->dense_forward(x.data(), w.data(), b.data(), y.data(), m, k, n);
      v.nn->dense_backward(x.data(), w.data(), dy.data(), dx.data(), dw.data(), db.data(), m, k, n);
      ys.push_back(y), dws.push_back(dw), dbs.push_back(db), dxs.push_back(dx);
    }
    for (size_t i = 1; i < ys.size(); ++i) {
      for (const auto& [a, b2] : {std::pair{&ys[0], &ys[i]},
                                  {&dws[0], &dws[i]},
                                  {&dbs[0], &dbs[i]},
                                  {&dxs[0], &dxs[i]}}) {
        for (size_t j = 0; j < a->size(); ++j) {
          // Sums of up to 785 products of magnitude <= 4: 1e-4 relative to
          // the sum of magnitudes is far above float rounding differences.
          ASSERT_NEAR((*a)[j], (*b2)[j], 1e-3f * (1.0f + std::fabs((*a)[j])))
              << ds::cpu_isa_name(runnable_variants()[i].isa) << " m=" << m << " k=" << k
              << " n=" << n << " j=" << j;
        }
      }
    }
  }
}

TEST(CpuIsa, ElementWiseKernelsAreBitIdenticalAcrossVariants) {
  const size_t n = 1037;  // not a multiple of any vector width
  const std::vector<float> grad = random_floats(n, 5);
  std::vector<std::vector<float>> results;
  std::vector<double> sums;
  std::vector<bool> finite;
  for (const Variant& v : runnable_variants()) {
    std::vector<float> var = random_floats(n, 6), mom = random_floats(n, 7),
                       m = random_floats(n, 8), s = random_floats(n, 9, 0.0f, 1.0f);
    v.optim->sgd(var.data(), grad.data(), n, 0.05f);
    v.optim->sgd_momentum(var.data(), grad.data(), mom.data(), n, 0.05f, 0.9f, true);
    v.optim->sgd_momentum(var.data(), grad.data(), mom.data(), n, 0.05f, 0.9f, false);
    v.optim->adam(var.data(), grad.data(), m.data(), s.data(), n, 0.9f, 0.999f, 0.01f, 1e-7f);
    std::vector<float> g = grad;
    finite.push_back(v.optim->scale_all_finite(g.data(), n, 0.37f));
    v.optim->scale(g.data(), n, 1.9f);
    v.optim->clip(g.data(), n, -0.5f, 0.5f);
    sums.push_back(v.optim->sum_of_squares(grad.data(), n));
    std::vector<float> relu(n), drelu(n), xent(6 * 11);
    v.nn->relu_forward(grad.data(), relu.data(), static_cast<int64_t>(n));
    v.nn->relu_backward(relu.data(), var.data(), drelu.data(), static_cast<int64_t>(n));
    const int32_t labels[6] = {0, 3, 10, 5, 5, 1};
    const double loss =
        v.nn->softmax_cross_entropy(grad.data(), labels, xent.data(), 6, 11, 1.0f / 6);
    const int64_t correct = v.nn->count_correct(grad.data(), labels, 6, 11);
    std::vector<uint16_t> h(n), bf(n);
    std::vector<float> back_h(n), back_bf(n);
    v.cast->f32_to_f16(var.data(), h.data(), n);
    v.cast->f16_to_f32(h.data(), back_h.data(), n);
    v.cast->f32_to_bf16(var.data(), bf.data(), n);
    v.cast->bf16_to_f32(bf.data(), back_bf.data(), n);
    std::vector<float> all;
    for (const auto* part : {&var, &mom, &m, &s, &g, &relu, &drelu, &xent, &back_h, &back_bf}) {
      all.insert(all.end(), part->begin(), part->end());
    }
    all.push_back(static_cast<float>(loss));
    all.push_back(static_cast<float>(correct));
    results.push_back(all);
  }
  for (size_t i = 1; i < results.size(); ++i) {
    EXPECT_TRUE(same_bits(results[0], results[i]))
        << ds::cpu_isa_name(runnable_variants()[i].isa) << " differs from the baseline";
    EXPECT_EQ(sums[0], sums[i]);
    EXPECT_EQ(finite[0], finite[i]);
  }
}

TEST(CpuIsa, NonFiniteGradientsAreFoundOnEveryVariant) {
  for (const Variant& v : runnable_variants()) {
    for (float bad : {INFINITY, -INFINITY, NAN, 3e38f}) {
      std::vector<float> g = random_floats(100, 10);
      g[97] = bad;  // in the scalar tail of a 16-wide loop
      EXPECT_FALSE(v.optim->scale_all_finite(g.data(), g.size(), 2.0f))
          << ds::cpu_isa_name(v.isa) << " " << bad;
    }
  }
}

}  // namespace
