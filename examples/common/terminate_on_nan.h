// Keras's TerminateOnNaN for the examples: a step whose training loss is NaN
// or infinite ends the run at that step with an error (non-zero exit), not
// with "train_loss=nan" and exit 0 after more steps, and before a diverged
// model could be saved. Every process of a synchronous strategy checks the
// same reduced loss, so all of them stop at the same step; under the
// parameter server each worker checks its own replicas' loss.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>

#include "diststrat/diststrat.h"

namespace diststrat_examples {

// `loss_sum` and `rows`: the step's loss summed over `rows` examples.
inline void terminate_on_nan(double loss_sum, double rows, int64_t step,
                             const std::string& example) {
  if (std::isfinite(loss_sum)) return;
  char buf[64];
  std::snprintf(buf, sizeof buf, "%g", rows > 0 ? loss_sum / rows : loss_sum);
  throw diststrat::AbortedError(
      example + ": the training loss of step " + std::to_string(step) + " is " + buf +
      " (not finite): the training diverged, stopping (like Keras's TerminateOnNaN). "
      "Lower the learning rate or resume from an earlier checkpoint");
}

}  // namespace diststrat_examples
