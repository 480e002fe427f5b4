// The training loss per example over every worker of a job, for the examples
// and benchmarks: the step function returns {loss sum, rows} (float64[2]) per
// replica and the loop adds strategy.reduce(kSum, ...) of it. Under the
// synchronous strategies that reduction covers the global batch; under the
// parameter server it covers one worker's replicas, so each worker adds its
// share to a metric on PS 0 and reads return every worker's totals.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "diststrat/diststrat.h"
#include "terminate_on_nan.h"

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

// The per-replica losses of the steps not read yet, kept as the step left
// them (on a GPU, on the device, so the step does not wait for them). read()
// reads each step's losses (`sum_of`: a replica's loss sum; `StepLoss::rows`
// its rows), reduces them, NaN-checks them and adds them to the meter.
// Every worker must read at the same steps: the reduction is collective.
template <typename StepLoss>
class PendingLosses {
 public:
  PendingLosses(diststrat::Strategy& strategy, LossMeter& meter, std::string program,
                std::function<double(const StepLoss&)> sum_of)
      : strategy_(strategy),
        meter_(meter),
        program_(std::move(program)),
        sum_of_(std::move(sum_of)) {}
  void add(int64_t step, diststrat::PerReplica<StepLoss> loss) {
    pending_.push_back({step, std::move(loss)});
  }
  void read() {
    for (const Pending& p : pending_) {
      std::vector<diststrat::Tensor> sums;
      for (const StepLoss& l : p.loss) {
        diststrat::Tensor sum_and_rows(diststrat::Shape{2}, diststrat::DType::kFloat64);
        sum_and_rows.data<double>()[0] = sum_of_(l);
        sum_and_rows.data<double>()[1] = l.rows;
        sums.push_back(sum_and_rows);
      }
      const diststrat::Tensor step_loss = strategy_.reduce(
          diststrat::ReduceOp::kSum, diststrat::PerReplica<diststrat::Tensor>(sums));
      terminate_on_nan(step_loss.data<double>()[0], step_loss.data<double>()[1], p.step, program_);
      meter_.add(step_loss);
    }
    pending_.clear();
  }
  // Forgets them unread (after an elastic group change: a joiner has none
  // to match).
  void clear() { pending_.clear(); }

 private:
  struct Pending {
    int64_t step;
    diststrat::PerReplica<StepLoss> loss;
  };
  diststrat::Strategy& strategy_;
  LossMeter& meter_;
  std::string program_;
  std::function<double(const StepLoss&)> sum_of_;
  std::vector<Pending> pending_;
};

}  // namespace diststrat_examples
