// The training loss per example over every worker of a job, for the examples
// and benchmarks: the step function returns {loss sum, rows} (float64[2]) per
// replica and the loop adds strategy.reduce(kSum, ...) of it. Under the
// synchronous strategies that reduction covers the global batch; under the
// parameter server it covers one worker's replicas, so each worker adds its
// share to a metric on PS 0 and reads return every worker's totals.
#pragma once

#include <string>

#include "diststrat/diststrat.h"

namespace diststrat_examples {

class LossMeter {
 public:
  LossMeter(diststrat::Strategy& strategy, std::string metric)
      : ps_(dynamic_cast<diststrat::ParameterServerStrategy*>(&strategy)),
        metric_(std::move(metric)) {}
  void add(const diststrat::Tensor& loss_sum_and_rows) {
    const double* v = loss_sum_and_rows.data<double>();
    if (ps_) {
      ps_->add_to_metric(metric_, v[0], v[1]);
    } else {
      total_.sum += v[0];
      total_.count += v[1];
    }
  }
  // Every worker's totals so far (one round trip to PS 0 under the parameter
  // server: every addition it has received).
  diststrat::MetricTotals totals() const { return ps_ ? ps_->read_metric(metric_) : total_; }
  // The mean loss per example since the previous call.
  double mean_since_last() {
    const diststrat::MetricTotals t = totals();
    const double n = t.count - last_.count;
    const double mean = n > 0 ? (t.sum - last_.sum) / n : 0.0;
    last_ = t;
    return mean;
  }

 private:
  diststrat::ParameterServerStrategy* ps_;
  std::string metric_;
  diststrat::MetricTotals total_, last_;
};

}  // namespace diststrat_examples
