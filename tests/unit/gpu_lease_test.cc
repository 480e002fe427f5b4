// The lease files against a hostile or unlucky environment (docs/gpu.md,
// "Threat model"): non-regular files and huge files at the lock path,
// symbolic links, unsafe directories, and, when the tests run as root, a
// second local user (uid 65534 through setpriv) who plants links, rewrites,
// deletes and pre-creates lock files and directories.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "child_util.h"
#include "diststrat/error.h"
#include "diststrat/gpu_lease.h"
#include "fake_gpu_backend.h"
#include "../common/compare.h"

namespace ds = diststrat;
using diststrat_test::current_rss_kib;
using diststrat_test::LeaseDir;
using diststrat_test::run_in_child;

namespace {

using diststrat_test::contains;
std::string lock_file(const LeaseDir& dir, const std::string& id) {
  return dir.path() + "/gpu-" + id + ".lock";
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void write_text(const std::string& path, const std::string& text, mode_t mode) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
  ASSERT_GE(fd, 0) << path;
  ASSERT_EQ(::write(fd, text.data(), text.size()), static_cast<ssize_t>(text.size()));
  ::close(fd);
}

// ---- one user ------------------------------------------------------------------------

// A FIFO planted at a lock path: reading the holder (diststrat-smi's
// list_leases, query_lease) and acquiring end at once with an error or "not
// held", never waiting for a writer.
TEST(GpuLeaseFiles, AFifoAtTheLockPathIsAnErrorNotAHang) {
  LeaseDir dir;
  ASSERT_EQ(::mkfifo(lock_file(dir, "fifo0").c_str(), 0644), 0);
  const auto r = run_in_child([&] {
    if (ds::query_lease("fifo0", dir.options())) return 10;
    if (!ds::list_leases(dir.options()).empty()) return 11;
    try {
      ds::GpuLease::acquire("fifo0", dir.options());
      return 12;
    } catch (const ds::PermissionDeniedError& e) {
      if (!contains(e.what(), "not a regular file") || !contains(e.what(), "gpu-fifo0.lock")) {
        std::fprintf(stderr, "acquire: %s\n", e.what());
        return 13;
      }
    } catch (const ds::Error& e) {
      std::fprintf(stderr, "acquire: %s\n", e.what());
      return 14;
    }
    return 0;
  });
  EXPECT_FALSE(r.timed_out) << "a FIFO at the lock path hung the lease code";
  EXPECT_EQ(r.exit_code, 0);
}

// A lock file grown to 1 GiB (sparse) is read only up to the record cap.
TEST(GpuLeaseFiles, AHugeLockFileIsReadWithACap) {
  LeaseDir dir;
  ds::GpuLease lease = ds::GpuLease::acquire("big0", dir.options());
  ASSERT_EQ(::truncate(lease.path().c_str(), off_t(1) << 30), 0);
  const long base = current_rss_kib();
  const pid_t parent = ::getpid();
  const auto r = run_in_child([&] {
    const auto h = ds::query_lease("big0", dir.options());
    if (!h || h->pid != parent) return 10;
    if (ds::list_leases(dir.options()).size() != 1) return 11;
    return 0;
  });
  EXPECT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_LT(r.max_rss_kib - base, 32 * 1024)
      << "peak memory grew by " << (r.max_rss_kib - base) / 1024
      << " MiB reading a 1 GiB lock file";
}

// A record's text goes to other users' terminals: control characters (a
// terminal escape in the command, say) come out as '?'.
TEST(GpuLeaseFiles, ControlCharactersInARecordAreNotPassedOn) {
  LeaseDir dir;
  ds::GpuLease lease = ds::GpuLease::acquire("esc0", dir.options());
  const std::string record = "pid=" + std::to_string(::getpid()) + "\ncommand=x\x1b]2;owned\x07y\n";
  const int fd = ::open(lease.path().c_str(), O_WRONLY | O_TRUNC | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::write(fd, record.data(), record.size()), static_cast<ssize_t>(record.size()));
  ::close(fd);
  const auto h = ds::query_lease("esc0", dir.options());
  ASSERT_TRUE(h.has_value());
  EXPECT_EQ(h->command, "x?]2;owned?y");
}

// A symbolic link at the lock path is never followed: its target keeps its
// mode and content, and the error names the link.
TEST(GpuLeaseFiles, ASymlinkAtTheLockPathIsNotFollowed) {
  LeaseDir dir;
  const std::string target = dir.path() + "/precious";
  write_text(target, "keep me\n", 0600);
  ASSERT_EQ(::symlink(target.c_str(), lock_file(dir, "link0").c_str()), 0);
  try {
    ds::GpuLease::acquire("link0", dir.options());
    ADD_FAILURE() << "acquired a lease through a symbolic link";
  } catch (const ds::PermissionDeniedError& e) {
    EXPECT_TRUE(contains(e.what(), lock_file(dir, "link0"))) << e.what();
    EXPECT_TRUE(contains(e.what(), "symbolic link")) << e.what();
  }
  struct stat st {};
  ASSERT_EQ(::stat(target.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0600u);
  EXPECT_EQ(read_text(target), "keep me\n");
  EXPECT_FALSE(ds::query_lease("link0", dir.options()).has_value());
}

// The holder creates its lock file (mode 0644, owned by it, one link) and
// removes it when it lets go.
TEST(GpuLeaseFiles, TheHolderCreatesItsLockFileAndRemovesItOnRelease) {
  LeaseDir dir;
  ds::GpuLease lease = ds::GpuLease::acquire("own0", dir.options());
  struct stat st {};
  ASSERT_EQ(::lstat(lease.path().c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));
  EXPECT_EQ(st.st_uid, ::geteuid());
  EXPECT_EQ(st.st_mode & 07777, 0644u);
  EXPECT_EQ(st.st_nlink, 1u);
  EXPECT_TRUE(contains(read_text(lease.path()), "pid=" + std::to_string(::getpid()) + "\n"));
  const std::string path = lease.path();
  lease.release();
  EXPECT_NE(::lstat(path.c_str(), &st), 0) << path << " is still there after release";
}

// A directory that others could rename entries in (world-writable without
// the sticky bit), one that is a symbolic link, and one whose parent is
// unsafe are refused; one the library creates is mode 1777.
TEST(GpuLeaseFiles, AnUnsafeDirectoryIsRefused) {
  LeaseDir dir;
  ds::LeaseOptions o = dir.options();
  o.lock_dir = dir.path() + "/open";
  ASSERT_EQ(::mkdir(o.lock_dir.c_str(), 0700), 0);
  ASSERT_EQ(::chmod(o.lock_dir.c_str(), 0777), 0);
  try {
    ds::GpuLease::acquire("d0", o);
    ADD_FAILURE() << "accepted a world-writable directory without the sticky bit";
  } catch (const ds::PermissionDeniedError& e) {
    EXPECT_TRUE(contains(e.what(), o.lock_dir)) << e.what();
    EXPECT_TRUE(contains(e.what(), "sticky")) << e.what();
  }
  // Its child, however safe itself, can be renamed away by anyone.
  o.lock_dir = dir.path() + "/open/inner";
  ASSERT_EQ(::mkdir(o.lock_dir.c_str(), 0700), 0);
  EXPECT_THROW(ds::GpuLease::acquire("d0", o), ds::PermissionDeniedError);

  ASSERT_EQ(::mkdir((dir.path() + "/real").c_str(), 0700), 0);
  o.lock_dir = dir.path() + "/link";
  ASSERT_EQ(::symlink((dir.path() + "/real").c_str(), o.lock_dir.c_str()), 0);
  try {
    ds::GpuLease::acquire("d0", o);
    ADD_FAILURE() << "followed a symbolic link as the lease directory";
  } catch (const ds::PermissionDeniedError& e) {
    EXPECT_TRUE(contains(e.what(), "symbolic link")) << e.what();
  }

  o.lock_dir = dir.path() + "/new";
  {
    ds::GpuLease lease = ds::GpuLease::acquire("d0", o);
    struct stat st {};
    ASSERT_EQ(::lstat(o.lock_dir.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 07777, 01777u);
  }
  // Reading leases never creates the directory.
  o.lock_dir = dir.path() + "/absent";
  EXPECT_FALSE(ds::query_lease("d0", o).has_value());
  EXPECT_TRUE(ds::list_leases(o).empty());
  struct stat st {};
  EXPECT_NE(::lstat(o.lock_dir.c_str(), &st), 0);
}

// Many acquirers racing for one GPU (create, clean-up of "stale" files, lock,
// release): never two holders at once, and every acquire ends in the lease or
// the "held" error.
TEST(GpuLeaseFiles, RacingAcquirersNeverShareAGpu) {
  LeaseDir dir;
  std::atomic<int> holders{0}, max_holders{0}, taken{0}, refused{0}, other{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 6; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 200; ++i) {
        try {
          ds::GpuLease lease = ds::GpuLease::acquire("race0", dir.options());
          const int now = ++holders;
          int seen = max_holders.load();
          while (now > seen && !max_holders.compare_exchange_weak(seen, now)) {
          }
          ++taken;
          std::this_thread::yield();
          --holders;
        } catch (const ds::ResourceExhaustedError&) {
          ++refused;
        } catch (const ds::Error& e) {
          ++other;
          std::fprintf(stderr, "race: %s\n", e.what());
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(max_holders.load(), 1);
  EXPECT_GT(taken.load(), 0);
  EXPECT_EQ(other.load(), 0);
  EXPECT_EQ(taken + refused, 6 * 200);
  EXPECT_FALSE(ds::query_lease("race0", dir.options()).has_value());
}

// ---- a second local user (root only) ------------------------------------------------------

constexpr uid_t kOther = 65534;  // "nobody" on Debian and most distributions

// A lease directory that another user can use: mode 1777, owned by root, like
// /tmp. Skips unless the test runs as root with setpriv(1) installed.
class OtherUser : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::geteuid() != 0) GTEST_SKIP() << "needs root, to act as a second user (uid 65534)";
    if (std::system("command -v setpriv >/dev/null 2>&1") != 0) {
      GTEST_SKIP() << "needs setpriv(1) (util-linux) to run commands as uid 65534";
    }
    ASSERT_EQ(::chmod(dir_.path().c_str(), 01777), 0);
  }

  // Runs `script` with sh as uid/gid 65534, no supplementary groups; its exit status.
  int as_other_user(const std::string& script) {
    const std::string cmd =
        "timeout 20 setpriv --reuid=65534 --regid=65534 --clear-groups sh -c '" + script +
        "' 2>/dev/null";
    const int status = std::system(cmd.c_str());
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
  }

  // Forks a child that becomes uid/gid 65534 and holds the lease on `id`
  // until killed; returns its pid once it holds it.
  pid_t hold_as_other_user(const std::string& id) {
    int ready[2];
    if (::pipe(ready) != 0) return -1;
    const pid_t child = ::fork();
    if (child == 0) {
      ::close(ready[0]);
      if (::setgroups(0, nullptr) != 0 || ::setresgid(kOther, kOther, kOther) != 0 ||
          ::setresuid(kOther, kOther, kOther) != 0) {
        ::_exit(3);
      }
      try {
        ds::GpuLease lease = ds::GpuLease::acquire(id, dir_.options());
        const char ok = 1;
        if (::write(ready[1], &ok, 1) != 1) ::_exit(2);
        ::pause();
      } catch (const ds::Error& e) {
        std::fprintf(stderr, "uid 65534 could not take %s: %s\n", id.c_str(), e.what());
      }
      ::_exit(1);
    }
    ::close(ready[1]);
    char ok = 0;
    pollfd p{ready[0], POLLIN, 0};
    const bool held = ::poll(&p, 1, 20000) == 1 && ::read(ready[0], &ok, 1) == 1;
    ::close(ready[0]);
    if (!held) {
      ::kill(child, SIGKILL);
      ::waitpid(child, nullptr, 0);
      return -1;
    }
    return child;
  }

  // Runs `fn` in a child that is uid/gid 65533 (a victim without root); its exit code.
  int as_unprivileged_victim(const std::function<int()>& fn) {
    return run_in_child([&] {
             if (::setgroups(0, nullptr) != 0 || ::setresgid(65533, 65533, 65533) != 0 ||
                 ::setresuid(65533, 65533, 65533) != 0) {
               return 3;
             }
             return fn();
           })
        .exit_code;
  }

  LeaseDir dir_;
};

// Another user plants a symbolic link at the lock path to a root-only file:
// a root job refuses it naming the link's owner, and the target keeps its
// mode and content.
TEST_F(OtherUser, APlantedSymlinkIsNotFollowedByARootJob) {
  const std::string secret = dir_.path() + "/root-only";
  write_text(secret, "root secret\n", 0600);
  const std::string lock = lock_file(dir_, "sym0");
  ASSERT_EQ(as_other_user("ln -s " + secret + " " + lock), 0);
  try {
    ds::GpuLease::acquire("sym0", dir_.options());
    ADD_FAILURE() << "a root job took a lease through another user's symbolic link";
  } catch (const ds::PermissionDeniedError& e) {
    EXPECT_TRUE(contains(e.what(), lock)) << e.what();
    EXPECT_TRUE(contains(e.what(), "uid 65534")) << e.what();
  }
  struct stat st {};
  ASSERT_EQ(::stat(secret.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0600u) << "the symlink's target was chmod-ed";
  EXPECT_EQ(read_text(secret), "root secret\n") << "the symlink's target was overwritten";
}

// Another user can neither rewrite a holder's record (spoofing) nor delete
// or rename its lock file; a second job is still refused (no stealing).
TEST_F(OtherUser, CannotRewriteOrRemoveAHoldersLockFile) {
  ds::GpuLease lease = ds::GpuLease::acquire("held0", dir_.options());
  const std::string lock = lease.path();
  EXPECT_NE(as_other_user("printf \"pid=1\\nuser=mallory\\n\" > " + lock), 0)
      << "another user rewrote the holder's record";
  EXPECT_NE(as_other_user("rm -f " + lock + " && test ! -e " + lock), 0)
      << "another user deleted a held lock file";
  EXPECT_NE(as_other_user("mv " + lock + " " + lock + ".x"), 0);
  const auto h = ds::query_lease("held0", dir_.options());
  ASSERT_TRUE(h.has_value());
  EXPECT_EQ(h->pid, ::getpid());
  EXPECT_EQ(h->user, "root");
  EXPECT_THROW(ds::GpuLease::acquire("held0", dir_.options()), ds::ResourceExhaustedError);
}

// A lock file another user created before any holder (0666, so that it looks
// usable): refused naming its owner. Were it accepted, its owner could delete
// it under the holder and let a second job take the same GPU.
TEST_F(OtherUser, APreCreatedLockFileIsRefusedSoItCannotBeUsedToSteal) {
  const std::string lock = lock_file(dir_, "pre0");
  ASSERT_EQ(as_other_user("touch " + lock + " && chmod 666 " + lock), 0);
  std::optional<ds::GpuLease> first;
  try {
    first = ds::GpuLease::acquire("pre0", dir_.options());
    ADD_FAILURE() << "took a lease on a lock file another user created";
  } catch (const ds::PermissionDeniedError& e) {
    EXPECT_TRUE(contains(e.what(), lock)) << e.what();
    EXPECT_TRUE(contains(e.what(), "nobody (uid 65534)")) << e.what();
  }
  // The theft: the file's owner removes it and a second job creates its own.
  ASSERT_EQ(as_other_user("rm -f " + lock), 0);
  if (first) {
    try {
      ds::GpuLease second = ds::GpuLease::acquire("pre0", dir_.options());
      ADD_FAILURE() << "a second job acquired a GPU that was held (the lock file was deleted)";
    } catch (const ds::ResourceExhaustedError&) {
    }
  }
}

// A lock file another user pre-created 0600 (denial of service): root and an
// unprivileged victim both get kPermissionDenied naming the file and its
// owner, and root leaves its mode alone.
TEST_F(OtherUser, APreCreated0600FileIsPermissionDeniedNamingItsOwner) {
  const std::string lock = lock_file(dir_, "dos0");
  ASSERT_EQ(as_other_user("touch " + lock + " && chmod 600 " + lock), 0);
  try {
    ds::GpuLease::acquire("dos0", dir_.options());
    ADD_FAILURE() << "root took a lease on another user's 0600 file";
  } catch (const ds::PermissionDeniedError& e) {
    EXPECT_TRUE(contains(e.what(), lock)) << e.what();
    EXPECT_TRUE(contains(e.what(), "nobody (uid 65534)")) << e.what();
  }
  struct stat st {};
  ASSERT_EQ(::lstat(lock.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0600u) << "root chmod-ed another user's file";
  EXPECT_EQ(as_unprivileged_victim([&] {
              try {
                ds::GpuLease::acquire("dos0", dir_.options());
                return 10;
              } catch (const ds::PermissionDeniedError& e) {
                std::fprintf(stderr, "victim: %s\n", e.what());
                return contains(e.what(), "uid 65534") ? 0 : 11;
              } catch (const ds::Error& e) {
                std::fprintf(stderr, "victim: %s\n", e.what());
                return 12;
              }
            }),
            0);
}

// Another user's live lease names them; once their job is killed, its stale
// file (theirs) is refused naming them, and their next job cleans it up.
TEST_F(OtherUser, AnotherUsersLeaseAndStaleFile) {
  const pid_t holder = hold_as_other_user("theirs0");
  ASSERT_GT(holder, 0);
  try {
    ds::GpuLease::acquire("theirs0", dir_.options());
    ADD_FAILURE() << "took a GPU another user holds";
  } catch (const ds::ResourceExhaustedError& e) {
    EXPECT_TRUE(contains(e.what(), "pid " + std::to_string(holder) + " (user nobody")) << e.what();
  }
  ::kill(holder, SIGKILL);
  ::waitpid(holder, nullptr, 0);
  try {
    ds::GpuLease::acquire("theirs0", dir_.options());
    ADD_FAILURE() << "took over another user's stale lock file";
  } catch (const ds::PermissionDeniedError& e) {
    EXPECT_TRUE(contains(e.what(), "nobody (uid 65534)")) << e.what();
    EXPECT_TRUE(contains(e.what(), "stale")) << e.what();
  }
  const pid_t again = hold_as_other_user("theirs0");
  ASSERT_GT(again, 0) << "the stale file's owner could not take its lease back";
  ::kill(again, SIGKILL);  // stale again; its owner may also remove it by hand
  ::waitpid(again, nullptr, 0);
  ASSERT_EQ(as_other_user("rm " + lock_file(dir_, "theirs0")), 0);
  ds::GpuLease mine = ds::GpuLease::acquire("theirs0", dir_.options());
  EXPECT_TRUE(mine.held());
}

// A lease directory another user created is refused naming them: its owner
// could delete anyone's lock files in it.
TEST_F(OtherUser, ADirectoryOwnedByAnotherUserIsRefused) {
  ds::LeaseOptions o = dir_.options();
  o.lock_dir = dir_.path() + "/theirs";
  ASSERT_EQ(as_other_user("mkdir -m 1777 " + o.lock_dir), 0);
  try {
    ds::GpuLease::acquire("dir0", o);
    ADD_FAILURE() << "accepted a lease directory owned by another user";
  } catch (const ds::PermissionDeniedError& e) {
    EXPECT_TRUE(contains(e.what(), o.lock_dir)) << e.what();
    EXPECT_TRUE(contains(e.what(), "nobody (uid 65534)")) << e.what();
  }
  EXPECT_THROW(ds::query_lease("dir0", o), ds::PermissionDeniedError);
}

}  // namespace
