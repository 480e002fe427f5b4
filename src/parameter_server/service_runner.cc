// ps::ServiceRunner (strategy_impl.h): a PS rank's service loop on its own
// thread, and what join() reports when the loop has ended.
#include <exception>
#include <string>
#include <vector>

#include "parameter_server/strategy_impl.h"

namespace diststrat {
namespace ps {

ServiceRunner::ServiceRunner(Transport& transport, ServiceOptions options, const Logger& logger)
    : service_(transport, std::move(options), logger) {
  thread_ = std::thread([this] {
    std::exception_ptr error;
    try {
      service_.run();
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(mu_);
    error_ = error;
    finished_ = true;
    cv_.notify_all();
  });
}

ServiceRunner::~ServiceRunner() {
  service_.stop();
  if (thread_.joinable()) thread_.join();
}

void ServiceRunner::fail(const std::string& reason, std::chrono::milliseconds grace) {
  std::unique_lock<std::mutex> lock(mu_);
  if (finished_) return;  // every worker has left: nobody to tell
  service_.fail(reason);
  cv_.wait_for(lock, grace, [&] { return finished_; });
}

void ServiceRunner::join() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    // The loop ends by itself: when every worker is done, or declared gone
    // after the service's timeout of silence, so this wait is bounded.
    cv_.wait(lock, [&] { return finished_; });
    if (error_) std::rethrow_exception(error_);
  }
  const std::string failure = service_.failure();
  if (!failure.empty()) throw AbortedError("parameter server: " + failure);
  const std::vector<int> gone = service_.gone_workers();
  if (!gone.empty()) {
    // Name each silent worker with the step it was in (its pushed step count).
    const ServiceStats st = service_.stats();
    std::string list;
    for (int g : gone) {
      list += (list.empty() ? "" : ", ") + std::string("rank ") + std::to_string(g);
      if (static_cast<size_t>(g) < st.worker_steps.size()) {
        list += " (at step " + std::to_string(st.worker_steps[static_cast<size_t>(g)]) + ")";
      }
    }
    throw DeadlineExceededError("parameter server: worker(s) " + list +
                                " went silent and never shut down");
  }
}

}  // namespace ps
}  // namespace diststrat
