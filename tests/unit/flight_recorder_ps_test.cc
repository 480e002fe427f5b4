// The parameter-server client's requests are in the flight record (a group
// of their own per worker, "ps-client w<index>"), so that a hang's verdict
// can say a worker waits in a push or a pull.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "../common/temp_dir.h"
#include "diststrat/diststrat.h"
#include "fault_util.h"

TEST(FlightRecorderPs, ClientRequestsAreRecorded) {
  diststrat_test::TempDir dir("diststrat_flight_ps_");
  setenv("DISTSTRAT_FLIGHT_RECORDER_DIR", dir.path().c_str(), 1);
  diststrat::ParameterServerOptions o;
  const auto job = diststrat::testing::run_ps_job<std::string>(
      o, false, [&](diststrat::ParameterServerStrategy& s, int w) -> std::string {
        diststrat::Variable v = s.create_variable(
            "v", diststrat::Shape{4}, diststrat::DType::kFloat32, diststrat::init::Zeros{});
        diststrat::SGD opt(s, {0.1f});
        for (int step = 0; step < 3; ++step) {
          s.run([&](diststrat::ReplicaContext& ctx) {
            diststrat::Tensor g(diststrat::Shape{4}, diststrat::DType::kFloat32);
            for (int i = 0; i < 4; ++i) g.data<float>()[i] = 1.f;
            opt.apply_gradients(ctx, {{g, v}});
          });
        }
        s.flush();
        if (w != 0) return "";
        const std::string path = diststrat::dump_flight_record("test");
        std::ifstream f(path);
        std::stringstream text;
        text << f.rdbuf();
        return text.str();
      });
  const std::string& record = job.workers[0];
  EXPECT_NE(record.find("\"group\": \"ps-client w0\""), std::string::npos)
      << record.substr(0, 2000);
  EXPECT_NE(record.find("\"kind\": \"push\""), std::string::npos) << record.substr(0, 2000);
  EXPECT_NE(record.find("\"kind\": \"pull\""), std::string::npos) << record.substr(0, 2000);
  unsetenv("DISTSTRAT_FLIGHT_RECORDER_DIR");
}
