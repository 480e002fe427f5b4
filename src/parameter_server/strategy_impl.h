// ParameterServerStrategy's internals, shared with the tests: reaching its
// Impl (ParameterServerAccess), building a strategy over any Transport (the
// tests run PS ranks and workers as threads over an InProcessTransportGroup;
// the MPI launcher path uses the MPI one).
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>

#include "allreduce/transport.h"
#include "diststrat/parameter_server.h"
#include "parameter_server/service.h"

namespace diststrat {

// The internal way into a ParameterServerStrategy, whose Impl and
// constructor from an Impl are private: the factories below, the
// strategy's own set-up and the tests.
struct ParameterServerAccess {
  using Impl = ParameterServerStrategy::Impl;
  static Impl& impl(ParameterServerStrategy& strategy) { return *strategy.impl_; }
  static std::unique_ptr<ParameterServerStrategy> make(std::unique_ptr<Impl> impl);
};

namespace ps {

// A Service running on its own thread.
class ServiceRunner {
 public:
  ServiceRunner(Transport& transport, ServiceOptions options, const Logger& logger);
  // Stops the loop if it is still running and joins the thread.
  ~ServiceRunner();
  // Blocks until the loop has ended; rethrows its failure.
  void join();
  // This PS rank failed (its strategy is torn down by an exception): every
  // worker's request fails from now on naming it (Service::fail), so that
  // the workers fail at once instead of at their deadline; waits up to
  // `grace` for them to leave.
  void fail(const std::string& reason, std::chrono::milliseconds grace);
  Service& service() { return service_; }

 private:
  Service service_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool finished_ = false;
  std::exception_ptr error_;
  std::thread thread_;
};

// The strategy for rank transport.rank() of a job whose ranks are the
// transport's: the last options.num_ps ranks are PS ranks. The transport
// must outlive the strategy.
std::unique_ptr<ParameterServerStrategy> make_strategy(Transport& transport,
                                                       const ParameterServerOptions& options);
// The same, owning the transport.
std::unique_ptr<ParameterServerStrategy> make_strategy(std::unique_ptr<Transport> transport,
                                                       const ParameterServerOptions& options);

// This rank's service (PS ranks only; tests read its state).
Service& local_service(ParameterServerStrategy& strategy);

}  // namespace ps
}  // namespace diststrat
