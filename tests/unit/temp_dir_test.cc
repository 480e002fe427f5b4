// tests/common/temp_dir.h: the directories a test process makes are gone once
// it exits normally; a forked child that exits leaves its parent's alone; a
// failure to create one names the template and the errno text.
#include "../common/temp_dir.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "child_util.h"

namespace dt = diststrat_test;
namespace fs = std::filesystem;

namespace {

bool is_private_dir(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode) && (st.st_mode & 0777) == 0700;
}

std::vector<std::string> entries(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().string());
  return out;
}

}  // namespace

// Run on its own, an ordinary check of both forms; TempDir.* runs it as a
// child process with a private TMPDIR and checks that nothing is left there.
// It forks a grandchild that exits normally after destroying (its copy of)
// this process's TempDir: the grandchild removes only what it made itself.
TEST(TempDirChild, MakesBothFormsAndAForkedGrandchildLeavesThemAlone) {
  const std::string registered = dt::temp_dir("diststrat_tempdir_registered_");
  const dt::TempDir scoped("diststrat_tempdir_scoped_");
  auto heap = std::make_unique<dt::TempDir>("diststrat_tempdir_heap_");
  ASSERT_TRUE(is_private_dir(registered)) << registered;
  ASSERT_TRUE(is_private_dir(scoped.path())) << scoped.path();
  EXPECT_EQ(fs::path(registered).parent_path(), fs::path(dt::temp_root()));
  EXPECT_EQ(scoped / "x", scoped.path() + "/x");
  std::string grandchild_dir;
  {
    // The grandchild's scoped directory name travels back over a pipe.
    int fds[2];
    ASSERT_EQ(::pipe(fds), 0) << std::strerror(errno);
    std::fflush(nullptr);
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0) << std::strerror(errno);
    if (pid == 0) {
      ::close(fds[0]);
      heap.reset();  // a copy of the parent's: must not remove it
      const std::string own = dt::temp_dir("diststrat_tempdir_grandchild_");
      if (::write(fds[1], own.data(), own.size()) != static_cast<ssize_t>(own.size())) ::_exit(3);
      ::close(fds[1]);
      std::exit(0);  // normal exit: the registry's destructor runs here
    }
    ::close(fds[1]);
    char buf[4096];
    ssize_t n = 0;
    while ((n = ::read(fds[0], buf, sizeof buf)) > 0)
      grandchild_dir.append(buf, static_cast<size_t>(n));
    ::close(fds[0]);
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
  }
  // Run by TempDir.AChildProcessThatExitsNormallyLeavesNothingInTmpdir: tell
  // it which directories to look for.
  if (const char* report = std::getenv("DISTSTRAT_TEMP_DIR_TEST_REPORT")) {
    std::FILE* f = std::fopen(report, "w");
    ASSERT_NE(f, nullptr) << report << ": " << std::strerror(errno);
    std::fprintf(f, "%s\n%s\n%s\n", registered.c_str(), scoped.path().c_str(),
                 heap->path().c_str());
    std::fclose(f);
  }
  ASSERT_FALSE(grandchild_dir.empty());
  EXPECT_FALSE(fs::exists(grandchild_dir)) << "the grandchild left " << grandchild_dir;
  EXPECT_TRUE(is_private_dir(registered)) << "the grandchild removed its parent's " << registered;
  EXPECT_TRUE(is_private_dir(heap->path()))
      << "the grandchild removed its parent's " << heap->path();
  const std::string heap_path = heap->path();
  heap.reset();
  EXPECT_FALSE(fs::exists(heap_path));
}

// The test binary itself, as a child with a private TMPDIR, runs the test
// above and exits normally: every directory it made is gone.
TEST(TempDir, AChildProcessThatExitsNormallyLeavesNothingInTmpdir) {
  const dt::TempDir root("diststrat_tempdir_test_"), out("diststrat_tempdir_report_");
  const std::string report = out / "report";
  const dt::ChildResult r = dt::run_in_child(
      [&] {
        ::setenv("TMPDIR", root.path().c_str(), 1);
        ::setenv("DISTSTRAT_TEMP_DIR_TEST_REPORT", report.c_str(), 1);
        for (const char* v :
             {"GTEST_OUTPUT", "GTEST_FILTER", "GTEST_SHARD_INDEX", "GTEST_TOTAL_SHARDS"}) {
          ::unsetenv(v);
        }
        const char* argv[] = {
            "/proc/self/exe",
            "--gtest_filter=TempDirChild.MakesBothFormsAndAForkedGrandchildLeavesThemAlone",
            nullptr};
        ::execv(argv[0], const_cast<char* const*>(argv));
        return 97;  // exec failed
      },
      std::chrono::seconds(60));
  ASSERT_FALSE(r.timed_out);
  ASSERT_EQ(r.term_signal, 0);
  ASSERT_EQ(r.exit_code, 0) << "the child test failed (97: exec failed)";
  // The child made its directories in root (it ran), and they are gone.
  std::ifstream in(report);
  std::vector<std::string> made;
  for (std::string line; std::getline(in, line);) made.push_back(line);
  ASSERT_EQ(made.size(), 3u) << "the child test did not run or report";
  for (const std::string& d : made) {
    EXPECT_EQ(fs::path(d).parent_path(), fs::path(root.path())) << d;
    EXPECT_FALSE(fs::exists(d)) << d;
  }
  EXPECT_EQ(entries(root.path()), std::vector<std::string>{});
}

TEST(TempDir, FailureToCreateNamesTheTemplateAndTheErrno) {
  const dt::TempDir root("diststrat_tempdir_test_");
  const std::string missing = root / "missing";
  const dt::ChildResult r = dt::run_in_child([&] {
    ::setenv("TMPDIR", missing.c_str(), 1);
    try {
      dt::temp_dir("never_");
    } catch (const std::runtime_error& e) {
      const std::string what = e.what();
      const bool ok = what.find(missing + "/never_XXXXXX") != std::string::npos &&
                      what.find(std::strerror(ENOENT)) != std::string::npos;
      if (!ok) std::fprintf(stderr, "unexpected message: %s\n", e.what());
      return ok ? 0 : 1;
    }
    return 2;  // no throw
  });
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_THROW(dt::TempDir("a/b_"), std::runtime_error);
}

TEST(TempDir, ScopedDirectoryIsRemovedWithItsContents) {
  std::string path;
  {
    const dt::TempDir d("diststrat_tempdir_test_");
    path = d.path();
    fs::create_directories(d / "nested/deeper");
    std::FILE* f = std::fopen((d / "nested/deeper/f").c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fclose(f);
  }
  EXPECT_FALSE(fs::exists(path));
}
