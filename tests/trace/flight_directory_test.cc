// The flight-record directory is the job's own (issue 43, item 6): the
// default $TMPDIR/diststrat-flight-<job> is a predictable name in a directory
// every user can write, so a directory found there is used only when it is a
// real directory of this process's uid with mode 0700, and a chosen one only
// when it is this uid's and nobody else may write it; and the watchdog acts
// only on a failure record this uid wrote that carries the run's nonce.
//
// Another user is made by chown to uid 65534 (nobody), which needs root (CI
// runs as root); those cases skip, saying so, under another uid.
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "../common/temp_dir.h"
#include "core/flight_recorder.h"
#include "diststrat/flight_recorder.h"

namespace fl = diststrat::flight;

namespace {

constexpr uid_t kOtherUid = 65534;

// One test's environment: a private $TMPDIR (so the default directory is
// $TMPDIR/diststrat-flight-<job>), no DISTSTRAT_FLIGHT_RECORDER_DIR, a job
// of its own; all put back afterwards.
class FlightDirectory : public ::testing::Test {
 protected:
  void SetUp() override {
    save("TMPDIR", tmpdir_was_);
    save("DISTSTRAT_FLIGHT_RECORDER_DIR", dir_was_);
    root_ = diststrat_test::make_temp_dir("diststrat_flightdir_");
    setenv("TMPDIR", root_.c_str(), 1);
    unsetenv("DISTSTRAT_FLIGHT_RECORDER_DIR");
    job_ = "t43-" + std::to_string(::getpid());
    fl::set_job(job_);
  }
  void TearDown() override {
    fl::set_job("");
    restore("TMPDIR", tmpdir_was_);
    restore("DISTSTRAT_FLIGHT_RECORDER_DIR", dir_was_);
    diststrat_test::remove_tree(root_);
  }
  std::string default_dir() const { return root_ + "/diststrat-flight-" + job_; }
  static bool root() { return ::geteuid() == 0; }

  // dump_flight_record(), with what it said on stderr.
  static std::string dump(std::string* said) {
    ::testing::internal::CaptureStderr();
    const std::string path = diststrat::dump_flight_record("test");
    *said = ::testing::internal::GetCapturedStderr();
    return path;
  }
  static int entries(const std::string& dir) {
    int n = 0;
    if (DIR* d = ::opendir(dir.c_str())) {
      while (dirent* e = ::readdir(d)) n += e->d_name[0] != '.';
      ::closedir(d);
    }
    return n;
  }

  std::string root_, job_;

 private:
  static void save(const char* name, std::string& into) {
    const char* v = std::getenv(name);
    into = v ? std::string(1, '=') + v : std::string();
  }
  static void restore(const char* name, const std::string& was) {
    if (was.empty()) {
      unsetenv(name);
    } else {
      setenv(name, was.c_str() + 1, 1);
    }
  }
  std::string tmpdir_was_, dir_was_;
};

TEST_F(FlightDirectory, AMissingDefaultDirectoryIsCreatedPrivate) {
  EXPECT_EQ(diststrat::flight_record_directory(), default_dir());
  std::string said;
  const std::string path = dump(&said);
  ASSERT_FALSE(path.empty()) << said;
  EXPECT_EQ(path.rfind(default_dir() + "/", 0), 0u) << path;
  struct stat st;
  ASSERT_EQ(::lstat(default_dir().c_str(), &st), 0);
  EXPECT_TRUE(S_ISDIR(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  ASSERT_EQ(::lstat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 077, 0u) << "the record is open to others: " << std::oct
                                  << (st.st_mode & 0777);
}

// (b) of the issue: a 0777 directory of another uid received the job's
// records, which that user could read and replace.
TEST_F(FlightDirectory, ADefaultDirectoryOfAnotherUserIsRefused) {
  if (!root()) GTEST_SKIP() << "needs root to make a directory of another uid";
  ASSERT_EQ(::mkdir(default_dir().c_str(), 0700), 0);
  ASSERT_EQ(::chmod(default_dir().c_str(), 0777), 0);
  ASSERT_EQ(::chown(default_dir().c_str(), kOtherUid, kOtherUid), 0);
  std::string said;
  EXPECT_EQ(dump(&said), "");
  EXPECT_EQ(entries(default_dir()), 0) << "a record was written into another user's directory";
  EXPECT_NE(said.find("'" + default_dir() + "'"), std::string::npos) << said;
  EXPECT_NE(said.find("uid 65534"), std::string::npos) << said;
  std::printf("%s", said.c_str());
}

TEST_F(FlightDirectory, ADefaultDirectoryOfAnotherUserIsRefusedEvenWhenPrivate) {
  if (!root()) GTEST_SKIP() << "needs root to make a directory of another uid";
  ASSERT_EQ(::mkdir(default_dir().c_str(), 0700), 0);
  ASSERT_EQ(::chown(default_dir().c_str(), kOtherUid, kOtherUid), 0);
  std::string said;
  EXPECT_EQ(dump(&said), "");
  EXPECT_EQ(entries(default_dir()), 0);
  EXPECT_NE(said.find("uid 65534"), std::string::npos) << said;
}

TEST_F(FlightDirectory, AnOwnDefaultDirectoryOpenToOthersIsRefused) {
  ASSERT_EQ(::mkdir(default_dir().c_str(), 0700), 0);
  ASSERT_EQ(::chmod(default_dir().c_str(), 0750), 0);
  std::string said;
  EXPECT_EQ(dump(&said), "");
  EXPECT_EQ(entries(default_dir()), 0);
  EXPECT_NE(said.find("'" + default_dir() + "'"), std::string::npos) << said;
  EXPECT_NE(said.find("0750"), std::string::npos) << said;
}

// (c) of the issue: a symlink of another uid was followed.
TEST_F(FlightDirectory, ASymlinkInPlaceOfTheDefaultDirectoryIsNotFollowed) {
  const std::string target = root_ + "/elsewhere";
  ASSERT_EQ(::mkdir(target.c_str(), 0700), 0);
  ASSERT_EQ(::symlink(target.c_str(), default_dir().c_str()), 0);
  if (root()) {
    ASSERT_EQ(::lchown(default_dir().c_str(), kOtherUid, kOtherUid), 0);
    ASSERT_EQ(::chown(target.c_str(), kOtherUid, kOtherUid), 0);
  }
  std::string said;
  EXPECT_EQ(dump(&said), "");
  EXPECT_EQ(entries(target), 0) << "the symlink was followed";
  EXPECT_NE(said.find("symbolic link"), std::string::npos) << said;
}

TEST_F(FlightDirectory, AChosenDirectoryOthersMayWriteIsRefused) {
  const std::string chosen = root_ + "/chosen";
  ASSERT_EQ(::mkdir(chosen.c_str(), 0700), 0);
  ASSERT_EQ(::chmod(chosen.c_str(), 0777), 0);
  setenv("DISTSTRAT_FLIGHT_RECORDER_DIR", chosen.c_str(), 1);
  std::string said;
  EXPECT_EQ(dump(&said), "");
  EXPECT_EQ(entries(chosen), 0);
  EXPECT_NE(said.find("'" + chosen + "'"), std::string::npos) << said;
  // Readable by others is the owner's choice for a directory named.
  ASSERT_EQ(::chmod(chosen.c_str(), 0755), 0);
  EXPECT_NE(dump(&said), "") << said;
  if (!root()) return;
  ASSERT_EQ(::chown(chosen.c_str(), kOtherUid, kOtherUid), 0);
  EXPECT_EQ(dump(&said), "");
  EXPECT_NE(said.find("uid 65534"), std::string::npos) << said;
}

// Writes `text` as `dir`/`name` by a rename (so the watchdog sees it whole),
// owned by `uid`.
void place(const std::string& dir, const std::string& name, const std::string& text, uid_t uid) {
  const std::string tmp = dir + "/.placing";
  {
    std::ofstream f(tmp);
    f << text;
  }
  ASSERT_EQ(::chown(tmp.c_str(), uid, uid), 0);
  ASSERT_EQ(::rename(tmp.c_str(), (dir + "/" + name).c_str()), 0);
}

std::string failure_record(const std::string& nonce_field) {
  return "{\"format\": \"diststrat-flight-record\", \"version\": 1, \"trigger\": \"failure\"" +
         nonce_field + ",\n \"reason\": \"x\", \"calls\": [], \"members\": []}\n";
}

std::string read_text(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// Waits (10 s at most) until this process's record in `dir` says `trigger`.
std::string wait_for_own_record(const std::string& dir, const std::string& mine,
                                const std::string& trigger) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  for (;;) {
    const std::string text = read_text(dir + "/" + mine);
    if (text.find("\"trigger\": \"" + trigger + "\"") != std::string::npos) return text;
    if (std::chrono::steady_clock::now() > deadline) return std::string();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

// (a) of the issue: another uid's file holding "trigger": "failure" ended
// the job's processes (with DISTSTRAT_FLIGHT_RECORDER_EXIT=1). The watchdog
// must answer only a failure record of its own uid with the run's nonce:
// the foreign ones are placed first, then the job's own; the answer must
// name the job's own (the watchdog answers the first it accepts, and one
// answer per burst).
TEST_F(FlightDirectory, TheWatchdogAnswersOnlyTheJobsOwnRecords) {
  const std::string dir = root_ + "/records";
  ASSERT_EQ(::mkdir(dir.c_str(), 0700), 0);
  setenv("DISTSTRAT_FLIGHT_RECORDER_DIR", dir.c_str(), 1);
  const uint64_t nonce = 0x5eed43c0ffee0006ULL;
  fl::set_nonce(nonce);
  char hex[40];
  std::snprintf(hex, sizeof hex, ", \"nonce\": \"%016llx\"",
                static_cast<unsigned long long>(nonce));
  const std::string good = failure_record(hex);
  fl::Recorder recorder("g", 0, 1);  // starts the watchdog (a process of a job)
  const std::string mine = "flight-" + job_ + "-pid" + std::to_string(::getpid()) + ".json";
  // The watchdog watches the directory before it answers a signal.
  ASSERT_EQ(::raise(SIGUSR2), 0);
  ASSERT_NE(wait_for_own_record(dir, mine, "signal"), "") << "no record on SIGUSR2";

  const std::string prefix = "flight-" + job_ + "-";
  if (root()) place(dir, prefix + "rank1-pid101.json", good, kOtherUid);
  place(dir, prefix + "rank2-pid102.json", failure_record(""), ::geteuid());
  place(dir, prefix + "rank3-pid103.json", failure_record(", \"nonce\": \"0000000000000001\""),
        ::geteuid());
  const std::string outside = root_ + "/outside.json";
  place(root_, "outside.json", good, ::geteuid());
  ASSERT_EQ(::symlink(outside.c_str(), (dir + "/.link").c_str()), 0);
  ASSERT_EQ(::rename((dir + "/.link").c_str(), (dir + "/" + prefix + "rank4-pid104.json").c_str()),
            0);
  place(dir, prefix + "rank5-pid105.json", good, ::geteuid());

  const std::string answer = wait_for_own_record(dir, mine, "peer");
  ASSERT_NE(answer, "") << "the job's own failure record was not answered";
  EXPECT_NE(answer.find(prefix + "rank5-pid105.json"), std::string::npos) << answer.substr(0, 400);
  fl::set_nonce(0);
}

}  // namespace
