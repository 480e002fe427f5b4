// A sum of doubles rounded once, whatever their order and however they were
// split (Shewchuk's exact partials, as Python's math.fsum): determinism
// mode's global gradient norm (docs/determinism.md), where a plain sum's
// rounding would follow the order the replica count gives the terms.
#pragma once

#include <cmath>
#include <cstddef>
#include <utility>
#include <vector>

namespace diststrat {
namespace optim_detail {

class ExactSum {
 public:
  void add(double x) {
    if (!std::isfinite(x)) {  // inf and NaN: plain IEEE arithmetic
      special_ += x;
      has_special_ = true;
      return;
    }
    size_t i = 0;
    for (size_t j = 0; j < partials_.size(); ++j) {
      double y = partials_[j];
      if (std::fabs(x) < std::fabs(y)) std::swap(x, y);
      const double hi = x + y;
      const double lo = y - (hi - x);
      if (lo != 0.0) partials_[i++] = lo;
      x = hi;
    }
    partials_.resize(i);
    if (x != 0.0) partials_.push_back(x);
  }
  // Squares of floats are exact in double (24 + 24 bits of mantissa).
  void add_squares(const float* p, size_t count) {
    for (size_t k = 0; k < count; ++k) add(double(p[k]) * double(p[k]));
  }
  // The exact sum rounded to nearest, ties to even.
  double value() const {
    if (has_special_) return special_;
    size_t n = partials_.size();
    if (n == 0) return 0.0;
    double hi = partials_[--n], lo = 0.0;
    while (n > 0) {
      const double x = hi, y = partials_[--n];
      hi = x + y;
      lo = y - (hi - x);
      if (lo != 0.0) break;
    }
    // Half-way cases: the rest of the partials decide the direction.
    if (n > 0 && ((lo < 0.0 && partials_[n - 1] < 0.0) || (lo > 0.0 && partials_[n - 1] > 0.0))) {
      const double y = lo * 2.0, x = hi + y;
      if (y == x - hi) hi = x;
    }
    return hi;
  }

 private:
  std::vector<double> partials_;
  double special_ = 0.0;
  bool has_special_ = false;
};

}  // namespace optim_detail
}  // namespace diststrat
