// Issue 23, items 3, 15 and 16: checkpoints of a diverged model (NaN/Inf)
// are neither saved over good ones nor restored; a manager counts, prunes and
// restores only its own checkpoints (owned by its user and listed in its
// manifest), never another run's copies or another user's forgeries; and it
// keeps to the ownership rules of the GPU lease directory (other users' temp
// files, symlinks, a directory someone else owns). Also: a timeline path that
// is a device or FIFO is refused instead of silently losing the timeline.
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "runtime/variable_impl.h"
#include "checkpoint_util.h"
#include "core/timeline.h"
#include "diststrat/diststrat.h"
#include "io/checkpoint_internal.h"
#include "../common/temp_dir.h"

namespace ds = diststrat;

namespace {

using diststrat_test::contains;
using diststrat_test::temp_dir;
using ds::testing::ckpt_path;
using ds::testing::expect_error;
using ds::testing::save_steps;
// SGD with momentum: one slot per weight.
struct MomentumModel : ds::testing::SmallModel {
  explicit MomentumModel(uint64_t seed = 3) : SmallModel(seed, 0.9f) {}
};
constexpr char kSafetyTempPrefix[] = "diststrat_cksafe_";
constexpr uid_t kOtherUid = 4242;  // another (non-root) user

// lstat: a dangling symbolic link exists too.
bool lexists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}
void copy_file(const std::string& from, const std::string& to) {
  std::ifstream in(from, std::ios::binary);
  std::ofstream out(to, std::ios::binary);
  out << in.rdbuf();
}

bool is_root() { return ::geteuid() == 0; }

}  // namespace

// ---- item 3: non-finite values ---------------------------------------------------

TEST(CheckpointNonFinite, ASaveOfANaNModelIsRefusedAndTheGoodCheckpointsStay) {
  const std::string dir = temp_dir(kSafetyTempPrefix);
  MomentumModel a;
  ds::CheckpointManager manager(a.ckpt, dir, {3});
  for (int s = 1; s <= 3; ++s) {
    a.train(s);
    manager.save(s, {{"step", std::to_string(s)}});
  }
  a.poison(std::numeric_limits<float>::quiet_NaN());
  expect_error<ds::DataLossError>(
      [&] {
        manager.save(4, {{"step", "4"}});
      },
      {ckpt_path(dir, 4), "'" + a.params[0].name() + "'", "NaN", "allow_non_finite"},
      "save of a NaN weight");
  EXPECT_FALSE(lexists(ckpt_path(dir, 4)));
  for (int s = 1; s <= 3; ++s) EXPECT_TRUE(lexists(ckpt_path(dir, s))) << s;  // nothing pruned
  EXPECT_EQ(ds::latest_checkpoint(dir).value(), ckpt_path(dir, 3));
  // Checkpoint::save refuses too; with the option it writes.
  expect_error<ds::DataLossError>([&] { a.ckpt.save(dir + "/x.safetensors"); }, {"NaN"},
                                  "Checkpoint::save");
  ds::SaveOptions allow;
  allow.allow_non_finite = true;
  a.ckpt.save(dir + "/x.safetensors", {}, allow);
  EXPECT_TRUE(lexists(dir + "/x.safetensors"));
}

TEST(CheckpointNonFinite, AnInfiniteOptimizerSlotIsRefusedNamingIt) {
  const std::string dir = temp_dir(kSafetyTempPrefix);
  MomentumModel a;
  a.train(1);
  std::vector<ds::Tensor>& momentum = a.params[1].impl().slot("momentum");
  ASSERT_FALSE(momentum.empty());
  momentum[0].data<float>()[0] = -std::numeric_limits<float>::infinity();
  ds::CheckpointManager manager(a.ckpt, dir, {3});
  expect_error<ds::DataLossError>([&] { manager.save(1); },
                                  {"'" + a.params[1].name() + "/momentum'", "-Inf"},
                                  "save of an infinite slot");
  EXPECT_FALSE(lexists(ckpt_path(dir, 1)));
}

// Every float dtype, NaN and both infinities, anywhere in a tensor (also past
// the first 64 KiB chunk); integers and finite extremes pass.
TEST(CheckpointNonFinite, EveryFloatDtypeIsCheckedOnSaveAndLoad) {
  const std::string dir = temp_dir(kSafetyTempPrefix);
  struct Case {
    ds::DType dtype;
    uint64_t bits;  // the non-finite value's bit pattern
    const char* kind;
  };
  const Case cases[] = {
      {ds::DType::kFloat32, 0x7fc00000u, "NaN"},
      {ds::DType::kFloat32, 0xff800000u, "-Inf"},
      {ds::DType::kFloat64, 0x7ff0000000000000ull, "+Inf"},
      {ds::DType::kFloat64, 0xfff8000000000001ull, "NaN"},
      {ds::DType::kFloat16, 0x7c00u, "+Inf"},
      {ds::DType::kFloat16, 0x7e00u, "NaN"},
      {ds::DType::kBFloat16, 0xff80u, "-Inf"},
      {ds::DType::kBFloat16, 0x7fc1u, "NaN"},
  };
  for (const Case& c : cases) {
    const std::string label = std::string(ds::dtype_name(c.dtype)) + " " + c.kind;
    const int64_t n = 70000;  // > one 64 KiB chunk for every dtype
    ds::Tensor t(ds::Shape{n}, c.dtype);
    std::memset(t.data(), 0, t.nbytes());
    const int64_t at = n - 3;
    std::memcpy(static_cast<char*>(t.data()) + at * ds::dtype_size(c.dtype), &c.bits,
                ds::dtype_size(c.dtype));
    ds::Tensor ints(ds::Shape{3}, ds::DType::kInt32);
    std::memset(ints.data(), 0xff, ints.nbytes());
    const std::string path = dir + "/t.safetensors";
    expect_error<ds::DataLossError>(
        [&] {
          ds::save_safetensors(path, {{"w", t}, {"i", ints}});
        },
        {path, "'w'", c.kind, "element " + std::to_string(at)}, label + " save");
    EXPECT_FALSE(lexists(path)) << label;
    ds::SafetensorsSaveOptions so;
    so.allow_non_finite = true;
    ds::save_safetensors(path, {{"w", t}, {"i", ints}}, {}, so);
    expect_error<ds::DataLossError>([&] { ds::load_safetensors(path); }, {path, "'w'", c.kind},
                                    label + " load");
    ds::SafetensorsLoadOptions lo;
    lo.allow_non_finite = true;
    EXPECT_EQ(ds::load_safetensors(path, lo).tensors.size(), 2u) << label;
    ::unlink(path.c_str());
  }
  // Finite extremes: the largest finite value and a denormal.
  ds::Tensor f(ds::Shape{2}, ds::DType::kFloat32);
  f.data<float>()[0] = std::numeric_limits<float>::max();
  f.data<float>()[1] = std::numeric_limits<float>::denorm_min();
  ds::save_safetensors(dir + "/ok.safetensors", {{"f", f}});
  EXPECT_EQ(ds::load_safetensors(dir + "/ok.safetensors").tensors.size(), 1u);
}

TEST(CheckpointNonFinite, RestoreRefusesANaNCheckpointUnlessAllowed) {
  const std::string dir = temp_dir(kSafetyTempPrefix);
  MomentumModel a;
  a.train(1);
  a.poison(std::numeric_limits<float>::quiet_NaN());
  ds::CheckpointManagerOptions mo;
  mo.allow_non_finite = true;
  ds::CheckpointManager(a.ckpt, dir, mo).save(7, {{"step", "7"}});
  MomentumModel b(9);
  const ds::Tensor before = b.params[0].value();
  expect_error<ds::DataLossError>([&] { b.ckpt.restore(ckpt_path(dir, 7)); },
                                  {ckpt_path(dir, 7), "'" + a.params[0].name() + "'", "NaN"},
                                  "restore");
  EXPECT_EQ(std::memcmp(before.data(), b.params[0].value().data(), before.nbytes()),
            0);  // unchanged
  ds::RestoreOptions ro;
  ro.allow_non_finite = true;
  EXPECT_EQ(b.ckpt.restore(ckpt_path(dir, 7), ro).at("step"), "7");
  EXPECT_TRUE(std::isnan(b.params[0].value().data<float>()[1]));
}

TEST(CheckpointNonFinite, RestoreLatestFallsBackToTheNewestFiniteCheckpointWithAWarning) {
  const std::string dir = temp_dir(kSafetyTempPrefix);
  MomentumModel a;
  save_steps(a, dir, 1, 2, 1);
  a.poison(std::numeric_limits<float>::infinity());
  ds::CheckpointManagerOptions mo;
  mo.allow_non_finite = true;
  ds::CheckpointManager(a.ckpt, dir, mo).save(3, {{"step", "3"}});
  MomentumModel b(9);
  ds::CheckpointManager mb(b.ckpt, dir, {3});
  const auto md = mb.restore_latest();
  ASSERT_TRUE(md.has_value());
  EXPECT_EQ(md->at("step"), "2");
  EXPECT_EQ(mb.restored_path().value(), ckpt_path(dir, 2));
  EXPECT_TRUE(contains(b.warnings, ckpt_path(dir, 3)) && contains(b.warnings, "+Inf"))
      << b.warnings;
  ds::RestoreOptions strict;
  strict.fall_back_to_valid = false;
  expect_error<ds::DataLossError>([&] { mb.restore_latest(strict); }, {ckpt_path(dir, 3), "+Inf"},
                                  "no fallback");
}

// ---- item 15: the manager's own checkpoints ------------------------------------

// Another run's genuine checkpoints copied into the directory (same user):
// not counted, not pruned, not restored, and named in a warning.
TEST(CheckpointOwnership, AnotherRunsGenuineCheckpointsCopiedInAreIgnored) {
  const std::string mine = temp_dir(kSafetyTempPrefix), theirs = temp_dir(kSafetyTempPrefix);
  MomentumModel other(5);
  for (int s : {560, 630, 700}) {
    other.train(s);
    ds::CheckpointManager(other.ckpt, theirs, {3}).save(s, {{"step", std::to_string(s)}});
  }
  MomentumModel a;
  save_steps(a, mine, 250, 450, 100);
  for (int s : {560, 630, 700}) copy_file(ckpt_path(theirs, s), ckpt_path(mine, s));
  MomentumModel b(9);
  ds::CheckpointManager mb(b.ckpt, mine, {3});
  EXPECT_TRUE(contains(b.warnings, "ckpt-700.safetensors") &&
              contains(b.warnings, "not among this run's saves"))
      << b.warnings;
  ASSERT_EQ(mb.restore_latest().value().at("step"), "450");
  b.train(460);
  mb.save(460, {{"step", "460"}});
  for (int s : {350, 450, 460, 560, 630, 700}) EXPECT_TRUE(lexists(ckpt_path(mine, s))) << s;
  EXPECT_FALSE(lexists(ckpt_path(mine, 250)));  // ours, beyond max_to_keep
  // Without `latest`, the newest of this run's, not the copied 700.
  ASSERT_EQ(::unlink((mine + "/latest").c_str()), 0);
  MomentumModel c(11);
  ds::CheckpointManager mc(c.ckpt, mine, {3});
  EXPECT_EQ(mc.restore_latest().value().at("step"), "460");
  EXPECT_EQ(ds::latest_checkpoint(mine).value(), ckpt_path(mine, 460));
  // `latest` naming a copied one is not believed either.
  std::ofstream(mine + "/latest") << "ckpt-700.safetensors\n";
  EXPECT_EQ(mc.restore_latest().value().at("step"), "460");
  EXPECT_TRUE(contains(c.warnings, "ckpt-700.safetensors")) << c.warnings;
  // On purpose, by name, it restores.
  EXPECT_EQ(c.ckpt.restore(ckpt_path(mine, 700)).at("step"), "700");
}

// A save whose name another run's file holds (the manager warned that it
// ignores it) keeps that file under another name instead of overwriting it.
TEST(CheckpointOwnership, ASaveKeepsAnotherRunsFileOfTheSameNameAside) {
  const std::string mine = temp_dir(kSafetyTempPrefix), theirs = temp_dir(kSafetyTempPrefix);
  MomentumModel other(5);
  other.train(3);
  ds::CheckpointManager(other.ckpt, theirs, {3}).save(20, {{"step", "theirs"}});
  MomentumModel a;
  save_steps(a, mine, 10, 10, 10);
  copy_file(ckpt_path(theirs, 20), ckpt_path(mine, 20));
  MomentumModel b(9);
  ds::CheckpointManager mb(b.ckpt, mine, {3});
  ASSERT_EQ(mb.restore_latest().value().at("step"), "10");
  b.train(20);
  mb.save(20, {{"step", "20"}});
  EXPECT_TRUE(contains(b.warnings, "kept as")) << b.warnings;
  std::string aside;
  if (DIR* d = ::opendir(mine.c_str())) {
    while (dirent* e = ::readdir(d)) {
      const std::string n = e->d_name;
      if (n.rfind("ckpt-20.safetensors.replaced-", 0) == 0) aside = mine + "/" + n;
    }
    ::closedir(d);
  }
  ASSERT_FALSE(aside.empty()) << "the other run's ckpt-20 was overwritten";
  EXPECT_EQ(ds::load_checkpoint(aside).metadata.at("step"), "theirs");
  EXPECT_EQ(ds::load_checkpoint(ckpt_path(mine, 20)).metadata.at("step"), "20");
  EXPECT_EQ(mb.restore_latest().value().at("step"), "20");
}

// The same name overwritten by another run's file: not ours any more.
TEST(CheckpointOwnership, AnotherRunsFileCopiedOverOursIsNotPruned) {
  const std::string mine = temp_dir(kSafetyTempPrefix), theirs = temp_dir(kSafetyTempPrefix);
  MomentumModel other(5);
  other.train(1);
  ds::CheckpointManager(other.ckpt, theirs, {3}).save(1, {{"step", "theirs"}});
  MomentumModel a;
  save_steps(a, mine, 1, 3, 1);
  copy_file(ckpt_path(theirs, 1), ckpt_path(mine, 1));
  save_steps(a, mine, 4, 4, 1);
  EXPECT_TRUE(lexists(ckpt_path(mine, 1)));  // theirs now: left alone
  EXPECT_TRUE(lexists(ckpt_path(mine, 2)) && lexists(ckpt_path(mine, 3)) &&
              lexists(ckpt_path(mine, 4)));
  EXPECT_TRUE(contains(a.warnings, "not the file this run saved under that name")) << a.warnings;
}

// Another user plants checkpoints with valid CRCs and manager metadata (and
// a `latest`) in a sticky shared directory: none is counted, pruned or restored.
TEST(CheckpointOwnership, AnotherUsersForgedCheckpointsAreIgnored) {
  if (!is_root()) GTEST_SKIP() << "needs root to create files of another uid";
  const std::string dir = temp_dir(kSafetyTempPrefix);
  ASSERT_EQ(::chmod(dir.c_str(), 01777), 0);  // a shared sticky directory, like /tmp
  MomentumModel a;
  save_steps(a, dir, 1, 3, 1);
  for (int s : {999990, 999991, 999992}) {
    ds::ckpt::save_safetensors_reserved(
        ckpt_path(dir, s), a.ckpt.state(),
        {{"step", std::to_string(s)}, {ds::ckpt::kManagerStepKey, std::to_string(s)}});
    ASSERT_EQ(::chown(ckpt_path(dir, s).c_str(), kOtherUid, kOtherUid), 0);
  }
  save_steps(a, dir, 4, 5, 1);
  for (int s : {3, 4, 5, 999990, 999991, 999992}) EXPECT_TRUE(lexists(ckpt_path(dir, s))) << s;
  EXPECT_FALSE(lexists(ckpt_path(dir, 2)));
  EXPECT_TRUE(contains(a.warnings, "uid 4242")) << a.warnings;
  // Their `latest` (ours removed first, as after a crash) is not believed.
  ASSERT_EQ(::unlink((dir + "/latest").c_str()), 0);
  std::ofstream(dir + "/latest") << "ckpt-999992.safetensors\n";
  ASSERT_EQ(::chown((dir + "/latest").c_str(), kOtherUid, kOtherUid), 0);
  MomentumModel b(9);
  ds::CheckpointManager mb(b.ckpt, dir, {3});
  EXPECT_EQ(mb.restore_latest().value().at("step"), "5");
  EXPECT_TRUE(contains(b.warnings, "latest")) << b.warnings;
}

TEST(CheckpointOwnership, AManifestPlantedByAnotherUserIsRefused) {
  if (!is_root()) GTEST_SKIP() << "needs root to create files of another uid";
  const std::string dir = temp_dir(kSafetyTempPrefix);
  ASSERT_EQ(::chmod(dir.c_str(), 01777), 0);
  std::ofstream(dir + "/manifest") << "diststrat-checkpoint-manifest 1\n";
  ASSERT_EQ(::chown((dir + "/manifest").c_str(), kOtherUid, kOtherUid), 0);
  MomentumModel a;
  expect_error<ds::PermissionDeniedError>([&] { ds::CheckpointManager m(a.ckpt, dir, {3}); },
                                          {dir + "/manifest", "uid 4242"}, "planted manifest");
}

// ---- item 16: ownership rules ---------------------------------------------------

TEST(CheckpointOwnership, TheConstructorRemovesOnlyItsOwnTemporaryFiles) {
  if (!is_root()) GTEST_SKIP() << "needs root to create files of another uid";
  const std::string dir = temp_dir(kSafetyTempPrefix);
  ASSERT_EQ(::chmod(dir.c_str(), 01777), 0);
  const std::string theirs = dir + "/ckpt-70.safetensors.tmp.1.0",
                    ours = dir + "/ckpt-71.safetensors.tmp.1.0";
  std::ofstream(theirs) << "x";
  std::ofstream(ours) << "x";
  ASSERT_EQ(::chown(theirs.c_str(), kOtherUid, kOtherUid), 0);
  MomentumModel a;
  ds::CheckpointManager m(a.ckpt, dir, {3});
  EXPECT_TRUE(lexists(theirs));
  EXPECT_FALSE(lexists(ours));
}

// `latest` naming a symlink to a file outside the directory (a valid
// checkpoint of the same model): not followed; the newest own one is restored.
TEST(CheckpointOwnership, LatestNamingASymlinkOutsideTheDirectoryIsNotFollowed) {
  const std::string dir = temp_dir(kSafetyTempPrefix), outside = temp_dir(kSafetyTempPrefix);
  MomentumModel a;
  save_steps(a, dir, 1, 2, 1);
  a.ckpt.save(outside + "/elsewhere.safetensors", {{"step", "900"}});
  ASSERT_EQ(::symlink((outside + "/elsewhere.safetensors").c_str(), ckpt_path(dir, 900).c_str()),
            0);
  std::ofstream(dir + "/latest") << "ckpt-900.safetensors\n";
  expect_error<ds::DataLossError>([&] { ds::latest_checkpoint(dir); },
                                  {"symbolic link", "elsewhere"}, "latest_checkpoint");
  MomentumModel b(9);
  ds::CheckpointManager mb(b.ckpt, dir, {3});
  EXPECT_EQ(mb.restore_latest().value().at("step"), "2");
  EXPECT_TRUE(contains(b.warnings, "symbolic link")) << b.warnings;
  // `latest` itself a symlink to a pointer outside: not followed either.
  std::ofstream(outside + "/latest") << "ckpt-1.safetensors\n";
  ASSERT_EQ(::unlink((dir + "/latest").c_str()), 0);
  ASSERT_EQ(::symlink((outside + "/latest").c_str(), (dir + "/latest").c_str()), 0);
  expect_error<ds::DataLossError>([&] { ds::latest_checkpoint(dir); }, {"symbolic link"},
                                  "latest as a symlink");
}

TEST(CheckpointOwnership, ADirectoryOtherUsersControlIsRefused) {
  MomentumModel a;
  const std::string open_dir = temp_dir(kSafetyTempPrefix);
  ASSERT_EQ(::chmod(open_dir.c_str(), 0777), 0);  // world-writable, not sticky
  expect_error<ds::PermissionDeniedError>([&] { ds::CheckpointManager m(a.ckpt, open_dir, {3}); },
                                          {open_dir, "sticky"}, "world-writable directory");
  ASSERT_EQ(::chmod(open_dir.c_str(), 01777), 0);
  ds::CheckpointManager ok(a.ckpt, open_dir, {3});  // sticky: fine
  if (!is_root()) GTEST_SKIP() << "needs root to chown a directory to another uid";
  const std::string theirs = temp_dir(kSafetyTempPrefix);
  ASSERT_EQ(::chown(theirs.c_str(), kOtherUid, kOtherUid), 0);
  expect_error<ds::PermissionDeniedError>([&] { ds::CheckpointManager m(a.ckpt, theirs, {3}); },
                                          {theirs, "uid 4242"}, "another user's directory");
  // A read-only reader (an evaluator) may read another user's directory.
  ds::CheckpointManagerOptions ro;
  ro.read_only = true;
  ds::CheckpointManager reader(a.ckpt, theirs, ro);
}

// A timeline path that is a FIFO or a device (/dev/full) is refused when the
// strategy is made, and never replaced when written.
TEST(TimelineFile, ADeviceOrFifoPathIsRefusedNotSilentlyLost) {
  const std::string dir = temp_dir(kSafetyTempPrefix);
  const std::string fifo = dir + "/timeline.json";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  expect_error<ds::InvalidArgumentError>(
      [&] { ds::Timeline::check_path(fifo, "DISTSTRAT_TIMELINE"); },
      {"DISTSTRAT_TIMELINE", "FIFO", "regular file"}, "check_path");
  expect_error<ds::FailedPreconditionError>([&] { ds::Timeline::write_file(fifo, {"{}"}); },
                                            {fifo, "FIFO"}, "write_file");
  struct stat st {};
  ASSERT_EQ(::lstat(fifo.c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));  // not replaced by a regular file
  expect_error<ds::InvalidArgumentError>(
      [&] { ds::Timeline::check_path("/dev/full", "DISTSTRAT_TIMELINE"); },
      {"/dev/full", "character device"}, "/dev/full");
}
