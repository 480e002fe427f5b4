#include "runtime/variable_impl.h"
#include "diststrat/variable.h"

#include <cmath>
#include <random>

#include "core/user_text.h"
#include "diststrat/strategy.h"

namespace diststrat {

const std::string& Variable::name() const { return impl().name; }
const Shape& Variable::shape() const { return impl().shape; }
DType Variable::dtype() const { return impl().dtype; }
const VariableOptions& Variable::options() const { return impl().options; }

Variable::Impl& Variable::impl() const {
  DISTSTRAT_CHECK(impl_ != nullptr, kFailedPrecondition, "use of an undefined Variable");
  return *impl_;
}

namespace {
// The strategy that created `v`: an Impl made by hand has none.
Strategy& owner_of(const Variable::Impl& v) {
  DISTSTRAT_CHECK(v.owner != nullptr, kFailedPrecondition, "variable '", echo(v.name),
                  "' was not created by a strategy (use Strategy::create_variable)");
  return *v.owner;
}
}  // namespace

Tensor Variable::read(const ReplicaContext& ctx) const {
  return owner_of(impl()).read_variable(impl(), ctx);
}

Tensor Variable::value() const {
  Strategy& s = owner_of(impl());
  if (impl().options.synchronization == VariableSynchronization::kOnRead)
    return s.on_read_value(impl());
  return s.variable_value(impl());
}

void Variable::assign(const Tensor& value) {
  Strategy& s = owner_of(impl());
  if (impl().options.synchronization == VariableSynchronization::kOnRead) {
    s.on_read_assign(*this, value);
    return;
  }
  s.assign_variable(impl(), value);
}

std::vector<Tensor>& Variable::Impl::slot(const std::string& slot_name) {
  std::lock_guard<std::mutex> lock(slots_mu);
  auto it = slots.find(slot_name);
  if (it == slots.end()) {
    std::vector<Tensor> copies_of_slot;
    copies_of_slot.reserve(copies.size());
    for (const Tensor& c : copies) copies_of_slot.emplace_back(c.shape(), c.dtype(), c.device());
    it = slots.emplace(slot_name, std::move(copies_of_slot)).first;
  }
  return it->second;
}

namespace init {
namespace {
template <typename Fn>
void fill(Tensor& t, Fn&& next) {
  const int64_t n = t.num_elements();
  switch (t.dtype()) {
    case DType::kFloat32: {
      float* p = t.data<float>();
      for (int64_t i = 0; i < n; ++i) p[i] = static_cast<float>(next());
      break;
    }
    case DType::kFloat64: {
      double* p = t.data<double>();
      for (int64_t i = 0; i < n; ++i) p[i] = next();
      break;
    }
    case DType::kFloat16: {
      Half* p = t.data<Half>();
      for (int64_t i = 0; i < n; ++i) p[i] = Half(static_cast<float>(next()));
      break;
    }
    case DType::kBFloat16: {
      BFloat16* p = t.data<BFloat16>();
      for (int64_t i = 0; i < n; ++i) p[i] = BFloat16(static_cast<float>(next()));
      break;
    }
    case DType::kInt32: {
      int32_t* p = t.data<int32_t>();
      for (int64_t i = 0; i < n; ++i) p[i] = static_cast<int32_t>(next());
      break;
    }
    case DType::kInt64: {
      int64_t* p = t.data<int64_t>();
      for (int64_t i = 0; i < n; ++i) p[i] = static_cast<int64_t>(next());
      break;
    }
  }
}

// Uniform doubles in [0, 1) from a 64-bit generator, identical on every
// platform (std::uniform_real_distribution is not).
double unit(std::mt19937_64& g) { return static_cast<double>(g() >> 11) * 0x1.0p-53; }
}  // namespace

void Zeros::operator()(Tensor& t) const { t.zero(); }

void Constant::operator()(Tensor& t) const {
  fill(t, [&] { return value; });
}

void GlorotUniform::operator()(Tensor& t) const {
  const auto& dims = t.shape().dims();
  double fan_out = dims.empty() ? 1.0 : static_cast<double>(dims.back());
  double fan_in = 1.0;
  for (size_t i = 0; i + 1 < dims.size(); ++i) fan_in *= static_cast<double>(dims[i]);
  if (dims.size() == 1) fan_in = fan_out;
  const double limit = std::sqrt(6.0 / std::max(1.0, fan_in + fan_out));
  std::mt19937_64 g(seed);
  fill(t, [&] { return (2.0 * unit(g) - 1.0) * limit; });
}

void RandomNormal::operator()(Tensor& t) const {
  std::mt19937_64 g(seed);
  // Box-Muller on our own uniform draws, for cross-platform determinism.
  fill(t, [&] {
    const double u1 = std::max(unit(g), 1e-300), u2 = unit(g);
    return mean + stddev * std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  });
}
}  // namespace init

}  // namespace diststrat
