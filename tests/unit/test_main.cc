#include <gtest/gtest.h>

#include <cstdlib>

int main(int argc, char** argv) {
  // The flight records of the suite's many deliberate failures go to the
  // build tree, not $TMPDIR (a test that checks dumps sets its own).
#ifdef DISTSTRAT_TEST_FLIGHT_DIR
  setenv("DISTSTRAT_FLIGHT_RECORDER_DIR", DISTSTRAT_TEST_FLIGHT_DIR, 0);
#endif
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
