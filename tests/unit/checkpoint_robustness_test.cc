// Checkpoint directories as an operator leaves them (issues 13 and 14): stray
// files that look like checkpoints, a deleted or damaged `latest`, a corrupt
// newest checkpoint, metadata and index numbers that lie, an unusable
// directory, and FIFOs where files should be. Every case ends in the
// documented outcome (kept, fallen back with a warning, or a clear error with
// the right code) within a bound, never in a hang, a crash or lost checkpoints.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "checkpoint_util.h"
#include "diststrat/diststrat.h"
#include "core/timeline.h"
#include "io/checkpoint_internal.h"
#include "../common/temp_dir.h"

namespace ds = diststrat;

namespace {

using diststrat_test::contains;
using diststrat_test::temp_dir;
using ds::testing::ckpt_path;
using ds::testing::expect_error;
using ds::testing::read_bytes;
using ds::testing::save_steps;
using ds::testing::write_bytes;
using Small = ds::testing::SmallModel;
constexpr char kRobustnessTempPrefix[] =
    "diststrat_ckrob_";  // removed at exit (tests/common/temp_dir.h)

bool exists(const std::string& path) { return ::access(path.c_str(), F_OK) == 0; }

// Runs fn in a forked child that SIGALRM ends after `seconds`; returns the
// child's exit code, or 128 + signal when a signal ended it (a hang).
int run_bounded(const std::function<int()>& fn, unsigned seconds) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::alarm(seconds);
    int rc = 100;
    try {
      rc = fn();
    } catch (...) {
      rc = 101;
    }
    ::_exit(rc);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

}  // namespace

// ---- 13.7: pruning only what the manager wrote --------------------------------

TEST(CheckpointManagerRobustness, StrayFilesAreNeitherPrunedNorCounted) {
  const std::string dir = temp_dir(kRobustnessTempPrefix);
  Small m;
  // A file that only looks like a checkpoint, and a real safetensors file
  // written by someone else, both "newer" than anything the manager writes.
  write_bytes(ckpt_path(dir, 888888), {'n', 'o', 't', ' ', 'm', 'i', 'n', 'e'});
  ds::save_safetensors(ckpt_path(dir, 999999),
                       {{"x", ds::Tensor(ds::Shape{2}, ds::DType::kFloat32)}},
                       {{"step", "999999"}});
  // A shard-like name and a temp-like name that no save of ours produced.
  const std::string stray_shard = dir + "/ckpt-7.ps-0-of-1.00000000000000ff.safetensors";
  write_bytes(stray_shard, {1, 2, 3});
  const std::string stray_tmp = dir + "/ckpt-notes.tmp.txt";
  write_bytes(stray_tmp, {'x'});
  const auto stray888 = read_bytes(ckpt_path(dir, 888888)),
             stray999 = read_bytes(ckpt_path(dir, 999999));

  save_steps(m, dir, 100, 400, 50, /*keep=*/3);
  for (int64_t s : {300, 350, 400}) EXPECT_TRUE(exists(ckpt_path(dir, s))) << s;
  for (int64_t s : {100, 150, 200, 250}) EXPECT_FALSE(exists(ckpt_path(dir, s))) << s;
  // The strays are untouched.
  EXPECT_EQ(read_bytes(ckpt_path(dir, 888888)), stray888);
  EXPECT_EQ(read_bytes(ckpt_path(dir, 999999)), stray999);
  EXPECT_TRUE(exists(stray_shard));
  EXPECT_TRUE(exists(stray_tmp));
  // `latest` still names what the manager wrote last, and restores it.
  Small b(9);
  ds::CheckpointManager mb(b.ckpt, dir, {3});
  EXPECT_EQ(mb.latest().value(), ckpt_path(dir, 400));
  EXPECT_EQ(mb.restore_latest().value().at("step"), "400");
  ds::testing::expect_same_state(m.ckpt, b.ckpt);
}

// A copy of a real checkpoint under a newer name is not the manager's either
// (its metadata names another step).
TEST(CheckpointManagerRobustness, ARenamedCopyIsNotCounted) {
  const std::string dir = temp_dir(kRobustnessTempPrefix);
  Small m;
  save_steps(m, dir, 1, 2, 1, 2);
  const std::string copy = ckpt_path(dir, 50);
  write_bytes(copy, read_bytes(ckpt_path(dir, 1)));
  save_steps(m, dir, 3, 4, 1, 2);
  EXPECT_TRUE(exists(copy));
  EXPECT_TRUE(exists(ckpt_path(dir, 3)));
  EXPECT_TRUE(exists(ckpt_path(dir, 4)));
  EXPECT_FALSE(exists(ckpt_path(dir, 2)));
}

// ---- 13.8: `latest` deleted ---------------------------------------------------

TEST(CheckpointManagerRobustness, MissingLatestRestoresTheNewestCheckpointWithAWarning) {
  const std::string dir = temp_dir(kRobustnessTempPrefix);
  Small a;
  save_steps(a, dir, 200, 300, 50);
  ASSERT_EQ(::unlink((dir + "/latest").c_str()), 0);
  write_bytes(ckpt_path(dir, 777777), {'j', 'u', 'n', 'k'});  // not the manager's: ignored
  Small b(9);
  ds::CheckpointManager mb(b.ckpt, dir, {3});
  const auto md = mb.restore_latest();
  ASSERT_TRUE(md.has_value()) << "started from scratch over existing checkpoints";
  EXPECT_EQ(md->at("step"), "300");
  ds::testing::expect_same_state(a.ckpt, b.ckpt);
  EXPECT_TRUE(contains(b.warnings, dir + "/latest")) << b.warnings;
  EXPECT_TRUE(contains(b.warnings, "ckpt-300.safetensors")) << b.warnings;
}

TEST(CheckpointManagerRobustness, MissingLatestWithOnlyForeignCheckpointFilesRefuses) {
  const std::string dir = temp_dir(kRobustnessTempPrefix);
  ds::save_safetensors(ckpt_path(dir, 5), {{"x", ds::Tensor(ds::Shape{2}, ds::DType::kFloat32)}});
  Small b;
  ds::CheckpointManager mb(b.ckpt, dir, {3});
  expect_error<ds::FailedPreconditionError>([&] { mb.restore_latest(); },
                                            {dir, "latest", "ckpt-5.safetensors"}, "foreign only");
}

// ---- 13.9: newest checkpoint corrupt ------------------------------------------

TEST(CheckpointManagerRobustness, CorruptNewestFallsBackToTheNewestValidOneWithAWarning) {
  const std::string dir = temp_dir(kRobustnessTempPrefix);
  Small a;
  save_steps(a, dir, 1, 2, 1);
  Small at2(3);
  at2.ckpt.restore(ckpt_path(dir, 2));
  save_steps(a, dir, 3, 3, 1);
  auto bytes = read_bytes(ckpt_path(dir, 3));
  bytes[bytes.size() - 3] ^= 0x20;  // in the data: a tensor's checksum fails
  write_bytes(ckpt_path(dir, 3), bytes);

  Small b(9);
  ds::CheckpointManager mb(b.ckpt, dir, {3});
  const auto md = mb.restore_latest();
  ASSERT_TRUE(md.has_value());
  EXPECT_EQ(md->at("step"), "2");
  ds::testing::expect_same_state(at2.ckpt, b.ckpt);
  EXPECT_TRUE(contains(b.warnings, "ckpt-3.safetensors")) << b.warnings;
  EXPECT_TRUE(contains(b.warnings, "checksum mismatch")) << b.warnings;
}

TEST(CheckpointManagerRobustness, EveryCheckpointCorruptIsDataLossNamingEach) {
  const std::string dir = temp_dir(kRobustnessTempPrefix);
  Small a;
  save_steps(a, dir, 1, 2, 1);
  for (int64_t s : {1, 2}) write_bytes(ckpt_path(dir, s), {1, 2, 3, 4, 5, 6, 7, 8, 9});
  Small b(9);
  const auto before = b.ckpt.state();
  ds::CheckpointManager mb(b.ckpt, dir, {3});
  expect_error<ds::DataLossError>([&] { mb.restore_latest(); }, {"ckpt-2.safetensors"},
                                  "all corrupt");
  const auto after = b.ckpt.state();
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_EQ(
        0, std::memcmp(before[i].second.data(), after[i].second.data(), before[i].second.nbytes()));
  }
}

// ---- 13.10: numbers read from files -------------------------------------------

TEST(CheckpointRobustness, MalformedBroadcastMetadataIsADiststratError) {
  for (const std::string& bad :
       {std::string("zz"), std::string("5:ab"), std::string("99999999999999999999:x"),
        std::string("3:key"), std::string(":")}) {
    EXPECT_THROW(ds::ckpt::decode_metadata(bad), ds::Error) << bad;
  }
  const ds::CheckpointMetadata md{{"epoch", "3"}, {"", "x:y"}};
  EXPECT_EQ(ds::ckpt::decode_metadata(ds::ckpt::encode_metadata(md)), md);
}

// A parameter-server index whose numbers do not fit their fields (ps 2^32
// would wrap to 0) is DataLoss naming the file and the field.
TEST(CheckpointRobustness, ShardedIndexNumbersOutOfRangeAreDataLoss) {
  const std::string dir = temp_dir(kRobustnessTempPrefix);
  const std::string index = dir + "/ckpt-1.safetensors";
  ds::ShardSnapshot snap;
  snap.variable = "w";
  snap.full_shape = ds::Shape{2, 3};
  snap.value = ds::Tensor(ds::Shape{2, 3}, ds::DType::kFloat32);
  const uint64_t id = 0x1234;
  const std::string shard = ds::ckpt::shard_file_path(index, 0, 1, id);
  ds::ckpt::write_shard_file(shard, id, 0, 1, {snap});
  ds::ckpt::write_index(index, id, {shard},
                        {{"w", ds::DType::kFloat32, ds::Shape{2, 3}, {{0, 0, 0, 2}}}}, {});
  ASSERT_NO_THROW(ds::load_checkpoint(index));
  const ds::SafetensorsFile f = ds::load_safetensors(index);
  using nlohmann::json;
  const json good = json::parse(f.metadata.at(ds::ckpt::kIndexKey));
  auto rewrite = [&](const std::function<void(json&)>& edit) {
    json j = good;
    edit(j);
    ds::ckpt::save_safetensors_reserved(index, {}, {{ds::ckpt::kIndexKey, j.dump()}});
  };
  rewrite([](json& j) { j["variables"][0]["shards"][0]["ps"] = uint64_t{1} << 32; });
  expect_error<ds::DataLossError>([&] { ds::load_checkpoint(index); }, {index, "'ps'"}, "ps 2^32");
  rewrite([](json& j) { j["variables"][0]["shards"][0]["rows"] = uint64_t{1} << 63; });
  expect_error<ds::DataLossError>([&] { ds::load_checkpoint(index); }, {index, "'rows'"},
                                  "rows 2^63");
  rewrite([](json& j) { j["variables"][0]["shape"] = {int64_t{1} << 40, int64_t{1} << 40}; });
  expect_error<ds::DataLossError>([&] { ds::load_checkpoint(index); }, {index},
                                  "shape 2^80 elements");
  rewrite([](json& j) { j["format"] = 1.5; });
  expect_error<ds::DataLossError>([&] { ds::load_checkpoint(index); }, {index, "'format'"},
                                  "format 1.5");
}

// A shard file's name comes from the index, so from the file: an error
// quotes it escaped (issue 43), one readable line whatever the name holds.
TEST(CheckpointRobustness, AShardFileNameFromTheIndexIsQuotedEscaped) {
  const std::string dir = temp_dir(kRobustnessTempPrefix);
  const std::string index = dir + "/ckpt-1.safetensors";
  ds::ShardSnapshot snap;
  snap.variable = "w";
  snap.full_shape = ds::Shape{2, 3};
  snap.value = ds::Tensor(ds::Shape{2, 3}, ds::DType::kFloat32);
  // Written by another save than the index names: an error naming the file.
  const std::string shard = dir +
                            "/shard\x01"
                            "a.safetensors";
  ds::ckpt::write_shard_file(shard, 0x999, 0, 1, {snap});
  ds::ckpt::write_index(index, 0x1234, {shard},
                        {{"w", ds::DType::kFloat32, ds::Shape{2, 3}, {{0, 0, 0, 2}}}}, {});
  try {
    ds::load_checkpoint(index);
    ADD_FAILURE() << "loaded";
  } catch (const ds::DataLossError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("shard\\x01a.safetensors"), std::string::npos) << m;
    EXPECT_NE(m.find("another save"), std::string::npos) << m;
    EXPECT_EQ(m.find('\x01'), std::string::npos) << "a raw control byte in the message";
  }
}

// ---- 13.11: the directory is checked when the manager is made ------------------

TEST(CheckpointManagerRobustness, ARegularFileAsDirectoryFailsAtConstruction) {
  const std::string dir = temp_dir(kRobustnessTempPrefix);
  write_bytes(dir + "/file", {'x'});
  Small m;
  expect_error<ds::FailedPreconditionError>(
      [&] { ds::CheckpointManager bad(m.ckpt, dir + "/file"); }, {dir + "/file", "not a directory"},
      "regular file");
  expect_error<ds::FailedPreconditionError>(
      [&] { ds::CheckpointManager bad(m.ckpt, dir + "/file/sub"); }, {dir + "/file"},
      "below a regular file");
}

// As another user (root drops to nobody in a child; others use a 0555 dir).
TEST(CheckpointManagerRobustness, AnUnwritableDirectoryIsPermissionDeniedAtConstruction) {
  const std::string dir = temp_dir(kRobustnessTempPrefix);
  ASSERT_EQ(::mkdir((dir + "/ro").c_str(), 0555), 0);
  ASSERT_EQ(::chmod(dir.c_str(), 0755), 0);
  const int rc = run_bounded(
      [&] {
        if (::geteuid() == 0 && (::setgid(65534) != 0 || ::setuid(65534) != 0)) return 10;
        Small m;
        int out = 0;
        for (const std::string& d : {dir + "/ro", dir + "/ro/new"}) {
          try {
            ds::CheckpointManager bad(m.ckpt, d);
            out = out * 10 + 2;  // constructed: the defect
          } catch (const ds::PermissionDeniedError& e) {
            if (!contains(e.what(), dir + "/ro")) out = out * 10 + 3;
          } catch (const ds::Error& e) {
            std::fprintf(stderr, "%s\n", e.what());
            out = out * 10 + 4;  // wrong code
          }
        }
        if (out == 0) {
          try {  // a save into it (write_file_atomically) is PermissionDenied too
            ds::write_file_atomically(dir + "/ro/x", "x", 1);
            out = 5;
          } catch (const ds::PermissionDeniedError&) {
          } catch (const ds::Error& e) {
            std::fprintf(stderr, "%s\n", e.what());
            out = 6;
          }
        }
        return out;
      },
      30);
  EXPECT_EQ(rc, 0)
      << "digits per directory: 2 = constructed, 3 = message lacks the path, 4 = other code; "
         "5/6 = write_file_atomically not PermissionDenied";
}

// ---- 14.5: FIFOs and other non-regular files never block ----------------------

TEST(CheckpointManagerRobustness, LatestAsAFifoDoesNotHang) {
  const std::string dir = temp_dir(kRobustnessTempPrefix);
  {
    Small a;
    save_steps(a, dir, 1, 2, 1);
  }
  ASSERT_EQ(::unlink((dir + "/latest").c_str()), 0);
  ASSERT_EQ(::mkfifo((dir + "/latest").c_str(), 0644), 0);
  // Default: the damaged pointer is named in a warning and the newest
  // checkpoint is restored.
  const int rc = run_bounded(
      [&] {
        Small b(9);
        ds::CheckpointManager mb(b.ckpt, dir, {3});
        auto md = mb.restore_latest();
        if (!md || md->at("step") != "2") return 2;
        if (!contains(b.warnings, dir + "/latest")) return 3;
        try {
          mb.latest();  // the pointer itself is an error, named
          return 4;
        } catch (const ds::DataLossError& e) {
          if (!contains(e.what(), "not a regular file")) return 5;
        }
        return 0;
      },
      10);
  EXPECT_EQ(rc, 0) << "142 = SIGALRM: it hung on the FIFO";
}

TEST(CheckpointManagerRobustness, ACheckpointFileThatIsAFifoDoesNotHang) {
  const std::string dir = temp_dir(kRobustnessTempPrefix);
  {
    Small a;
    save_steps(a, dir, 1, 2, 1);
  }
  ASSERT_EQ(::unlink(ckpt_path(dir, 2).c_str()), 0);
  ASSERT_EQ(::mkfifo(ckpt_path(dir, 2).c_str(), 0644), 0);
  const int rc = run_bounded(
      [&] {
        try {
          ds::load_checkpoint(ckpt_path(dir, 2));
          return 2;
        } catch (const ds::DataLossError& e) {
          if (!contains(e.what(), "not a regular file")) return 3;
        }
        Small b(9);
        ds::CheckpointManager mb(b.ckpt, dir, {3});
        auto md = mb.restore_latest();  // falls back to ckpt-1
        if (!md || md->at("step") != "1") return 4;
        if (!contains(b.warnings, ckpt_path(dir, 2))) return 5;
        return 0;
      },
      10);
  EXPECT_EQ(rc, 0) << "142 = SIGALRM: it hung on the FIFO";
}

TEST(CheckpointManagerRobustness, AHugeOrDirectoryLatestIsNamedAndFallenBackFrom) {
  const std::string dir = temp_dir(kRobustnessTempPrefix);
  Small a;
  save_steps(a, dir, 1, 1, 1);
  {
    std::ofstream big(dir + "/latest", std::ios::trunc);
    big << "ckpt-1.safetensors\n" << std::string(1 << 20, 'x');
  }
  Small b(9);
  ds::CheckpointManager mb(b.ckpt, dir, {3});
  expect_error<ds::DataLossError>([&] { mb.latest(); }, {dir + "/latest"}, "1 MiB latest");
  EXPECT_EQ(mb.restore_latest().value().at("step"), "1");
  EXPECT_TRUE(contains(b.warnings, dir + "/latest")) << b.warnings;
}

TEST(CheckpointManagerRobustness, ADirectoryAsLatestIsNamedAndFallenBackFrom) {
  const std::string dir = temp_dir(kRobustnessTempPrefix);
  Small a;
  save_steps(a, dir, 1, 1, 1);
  ASSERT_EQ(::unlink((dir + "/latest").c_str()), 0);
  ASSERT_EQ(::mkdir((dir + "/latest").c_str(), 0755), 0);
  Small b(9);
  ds::CheckpointManager mb(b.ckpt, dir, {3});
  expect_error<ds::DataLossError>([&] { mb.latest(); }, {dir + "/latest", "a directory"},
                                  "directory latest");
  EXPECT_EQ(mb.restore_latest().value().at("step"), "1");
  EXPECT_EQ(mb.restored_path().value(), ckpt_path(dir, 1));
}

// With the fallback off, a corrupt newest checkpoint or a damaged pointer is
// the error it always was, and the model is untouched.
TEST(CheckpointManagerRobustness, WithoutFallbackACorruptNewestIsRefused) {
  const std::string dir = temp_dir(kRobustnessTempPrefix);
  Small a;
  save_steps(a, dir, 1, 2, 1);
  auto bytes = read_bytes(ckpt_path(dir, 2));
  bytes[bytes.size() - 3] ^= 0x20;
  write_bytes(ckpt_path(dir, 2), bytes);
  Small b(9);
  const auto before = b.ckpt.state();
  ds::CheckpointManager mb(b.ckpt, dir, {3});
  ds::RestoreOptions strict;
  strict.fall_back_to_valid = false;
  expect_error<ds::DataLossError>([&] { mb.restore_latest(strict); },
                                  {ckpt_path(dir, 2), "checksum mismatch"},
                                  "strict, corrupt newest");
  EXPECT_FALSE(mb.restored_path().has_value());
  const auto after = b.ckpt.state();
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_EQ(
        0, std::memcmp(before[i].second.data(), after[i].second.data(), before[i].second.nbytes()));
  }
  EXPECT_EQ(b.warnings, "");
  // A damaged pointer likewise.
  write_bytes(dir + "/latest", {'x', '\n'});
  expect_error<ds::DataLossError>([&] { mb.restore_latest(strict); }, {dir, "'x'"},
                                  "strict, damaged latest");
  // The default falls back to ckpt-1.
  EXPECT_EQ(mb.restore_latest().value().at("step"), "1");
  EXPECT_EQ(mb.restored_path().value(), ckpt_path(dir, 1));
}

// A checkpoint of another model is not "corrupt": no fallback hides it.
TEST(CheckpointManagerRobustness, AModelMismatchIsNotFallenBackFrom) {
  const std::string dir = temp_dir(kRobustnessTempPrefix);
  Small a;
  save_steps(a, dir, 1, 2, 1);
  ds::MirroredStrategy s(std::vector<ds::Device>{ds::Device::cpu(0)});
  ds::nn::Mlp other({4, 5, 3});
  auto vars = other.create_variables(s, 1);
  ds::SGD opt(s, {0.1f, 0.0f});
  ds::Checkpoint ck(s, {&opt});
  ds::CheckpointManager m(ck, dir, {3});
  EXPECT_THROW(m.restore_latest(), ds::InvalidArgumentError);
}

TEST(CheckpointRobustness, MetadataIntParsesStrictlyWithinRange) {
  const ds::CheckpointMetadata md{{"step", "42"},
                                  {"neg", "-7"},
                                  {"abc", "abc"},
                                  {"exp", "1e20"},
                                  {"big", "99999999999999999999"},
                                  {"space", " 5"},
                                  {"plus", "+5"},
                                  {"empty", ""},
                                  {"min", "-9223372036854775808"}};
  EXPECT_EQ(ds::metadata_int(md, "step", 0, 100, "f"), 42);
  EXPECT_EQ(ds::metadata_int(md, "neg", -10, 0, "f"), -7);
  EXPECT_EQ(ds::metadata_int(md, "min", std::numeric_limits<int64_t>::min(), 0, "f"),
            std::numeric_limits<int64_t>::min());
  for (const char* key : {"abc", "exp", "big", "space", "plus", "empty"}) {
    expect_error<ds::DataLossError>(
        [&] {
          ds::metadata_int(md, key, std::numeric_limits<int64_t>::min(),
                           std::numeric_limits<int64_t>::max(), "/c/f");
        },
        {"/c/f", std::string("'") + key + "'"}, key);
  }
  expect_error<ds::DataLossError>([&] { ds::metadata_int(md, "step", 0, 41, "/c/f"); },
                                  {"'step'", "[0, 41]"}, "out of range");
  expect_error<ds::InvalidArgumentError>([&] { ds::metadata_int(md, "epoch", 0, 1, "/c/f"); },
                                         {"/c/f", "'epoch'"}, "absent");
}

// ---- the same defect classes elsewhere -----------------------------------------

// The timeline file: written atomically through a fresh temporary, never
// through a symlink planted at "<path>.tmp", and errno mapped to its code.
TEST(FileWritesRobustness, TimelineFileDoesNotFollowAPlantedTempSymlink) {
  const std::string dir = temp_dir(kRobustnessTempPrefix);
  write_bytes(dir + "/victim", {'k', 'e', 'e', 'p'});
  ASSERT_EQ(::symlink((dir + "/victim").c_str(), (dir + "/t.json.tmp").c_str()), 0);
  ds::Timeline::write_file(dir + "/t.json", {"{\"name\":\"x\"}"});
  EXPECT_EQ(read_bytes(dir + "/victim"), (std::vector<uint8_t>{'k', 'e', 'e', 'p'}));
  const auto text = read_bytes(dir + "/t.json");
  EXPECT_TRUE(contains(std::string(text.begin(), text.end()), "traceEvents"));
  EXPECT_THROW(ds::Timeline::write_file(dir + "/victim/t.json", {}), ds::FailedPreconditionError);
  EXPECT_THROW(ds::Timeline::write_file(dir + "/none/t.json", {}), ds::NotFoundError);
}

// A device index too large for an int is an InvalidArgumentError, not std::out_of_range.
TEST(FileWritesRobustness, DeviceIndexOverflowIsInvalidArgument) {
  EXPECT_THROW(ds::Device::parse("cpu:99999999999"), ds::InvalidArgumentError);
  EXPECT_EQ(ds::Device::parse("gpu:12").index, 12);
}

// Shard-file names: an orphan a save of ours wrote (name and header agree) is
// pruned; a renamed one (its header names another save) or garbage is kept.
TEST(CheckpointManagerRobustness, OnlyOwnOrphanShardFilesArePruned) {
  const std::string dir = temp_dir(kRobustnessTempPrefix);
  ds::ShardSnapshot snap;
  snap.variable = "w";
  snap.full_shape = ds::Shape{2};
  snap.value = ds::Tensor(ds::Shape{2}, ds::DType::kFloat32);
  const std::string orphan = ds::ckpt::shard_file_path(dir + "/ckpt-5.safetensors", 0, 1, 0xab);
  ds::ckpt::write_shard_file(orphan, 0xab, 0, 1, {snap});
  const std::string renamed = ds::ckpt::shard_file_path(dir + "/ckpt-5.safetensors", 0, 1, 0xcd);
  ds::ckpt::write_shard_file(renamed, 0xef, 0, 1, {snap});  // header: save 0xef
  const std::string garbage = ds::ckpt::shard_file_path(dir + "/ckpt-6.safetensors", 0, 2, 0x12);
  write_bytes(garbage, {1, 2, 3});
  Small m;
  save_steps(m, dir, 1, 1, 1);
  EXPECT_FALSE(exists(orphan));
  EXPECT_TRUE(exists(renamed));
  EXPECT_TRUE(exists(garbage));
}

// A directory that cannot be listed is an error, not an empty directory (a
// silent fresh start over checkpoints that are there).
TEST(CheckpointManagerRobustness, AnUnlistableDirectoryIsNotEmpty) {
  const std::string dir = temp_dir(kRobustnessTempPrefix);
  ASSERT_EQ(::chmod(dir.c_str(), 0755), 0);
  {
    Small a;
    save_steps(a, dir + "/c", 1, 1, 1);
  }
  ASSERT_EQ(::unlink((dir + "/c/latest").c_str()), 0);
  ASSERT_EQ(::chmod((dir + "/c").c_str(), 0333), 0);  // writable, not readable
  const int rc = run_bounded(
      [&] {
        if (::geteuid() == 0 && (::setgid(65534) != 0 || ::setuid(65534) != 0)) return 10;
        Small b;
        try {
          ds::CheckpointManager mb(b.ckpt, dir + "/c");
          return mb.restore_latest().has_value() ? 2 : 3;  // 3: the silent fresh start
        } catch (const ds::PermissionDeniedError& e) {
          return contains(e.what(), dir + "/c") ? 0 : 4;
        } catch (const ds::Error& e) {
          std::fprintf(stderr, "%s\n", e.what());
          return 5;
        }
      },
      30);
  ::chmod((dir + "/c").c_str(), 0755);
  EXPECT_EQ(rc, 0) << "3 = an unlistable directory looked empty";
}

// ---- outside tester's findings: big junk files, silent skips, loops, echoes ----

namespace {
// The peak resident set of this process, in KiB.
long max_rss_kib() {
  struct rusage ru;
  ::getrusage(RUSAGE_SELF, &ru);
  return ru.ru_maxrss;
}
bool has_control_byte(const std::string& s) {
  for (unsigned char c : s) {
    if ((c < 0x20 && c != '\n') || c == 0x7f) return true;
  }
  return false;
}
}  // namespace

// A sparse 64 GiB file of zeros where `latest` points (header length 0) is
// damage: skipped at once for the older checkpoints, never "does not fit in memory".
TEST(CheckpointManagerRobustness, AHugeSparseJunkFileAsTheNewestIsFallenBackFrom) {
  const std::string dir = temp_dir(kRobustnessTempPrefix);
  Small a;
  save_steps(a, dir, 1, 2, 1);
  ASSERT_EQ(::unlink(ckpt_path(dir, 2).c_str()), 0);
  ASSERT_EQ(::truncate((write_bytes(ckpt_path(dir, 2), {}), ckpt_path(dir, 2)).c_str(),
                       int64_t{64} << 30),
            0);
  expect_error<ds::DataLossError>([&] { ds::load_safetensors(ckpt_path(dir, 2)); },
                                  {"ckpt-2.safetensors", "header length 0"}, "zeros");
  Small b(9);
  ds::CheckpointManager mb(b.ckpt, dir, {3});
  const auto md = mb.restore_latest();
  ASSERT_TRUE(md.has_value());
  EXPECT_EQ(md->at("step"), "1");
  EXPECT_TRUE(contains(b.warnings, "ckpt-2.safetensors")) << b.warnings;
}

// A valid checkpoint extended by 1 GiB (sparse) is kDataLoss for its trailing
// bytes, found from the header alone: nothing near 1 GiB is read or allocated.
TEST(CheckpointRobustness, TrailingBytesAreDataLossWithoutReadingThem) {
  const std::string dir = temp_dir(kRobustnessTempPrefix);
  Small a;
  save_steps(a, dir, 1, 1, 1);
  const std::string p = ckpt_path(dir, 1);
  struct stat st;
  ASSERT_EQ(::stat(p.c_str(), &st), 0);
  ASSERT_EQ(::truncate(p.c_str(), st.st_size + (int64_t{1} << 30)), 0);
  const int rc = run_bounded(
      [&] {
        const long before = max_rss_kib();
        try {
          ds::load_safetensors(p);
          return 2;
        } catch (const ds::DataLossError& e) {
          if (!contains(e.what(), "trailing bytes")) {
            std::fprintf(stderr, "%s\n", e.what());
            return 3;
          }
        } catch (const ds::Error& e) {
          std::fprintf(stderr, "%s\n", e.what());
          return 4;
        }
        const long grew = max_rss_kib() - before;
        if (grew > 128 * 1024) {
          std::fprintf(stderr, "peak RSS grew by %ld KiB\n", grew);
          return 5;
        }
        return 0;
      },
      30);
  EXPECT_EQ(rc, 0)
      << "2 = loaded, 3 = message, 4 = other code, 5 = the extension was read into memory";
}

// A checkpoint with a damaged header (not verifiable as the manager's) that
// the fallback passes over is named in the warning, and in the final error.
TEST(CheckpointManagerRobustness, ACheckpointWithADamagedHeaderSkippedInFallbackIsNamed) {
  const std::string dir = temp_dir(kRobustnessTempPrefix);
  Small a;
  save_steps(a, dir, 0, 2, 1);
  auto h = read_bytes(ckpt_path(dir, 1));
  h[20] ^= 0x20;
  write_bytes(ckpt_path(dir, 1), h);
  auto d = read_bytes(ckpt_path(dir, 2));
  d[d.size() - 3] ^= 0x20;
  write_bytes(ckpt_path(dir, 2), d);
  {
    Small b(9);
    ds::CheckpointManager mb(b.ckpt, dir, {3});
    const auto md = mb.restore_latest();
    ASSERT_TRUE(md.has_value());
    EXPECT_EQ(md->at("step"), "0");
    EXPECT_TRUE(contains(b.warnings, "ckpt-2.safetensors")) << b.warnings;
    EXPECT_TRUE(contains(b.warnings, "ckpt-1.safetensors")) << b.warnings;
  }
  auto z = read_bytes(ckpt_path(dir, 0));
  z[z.size() - 3] ^= 0x20;
  write_bytes(ckpt_path(dir, 0), z);
  Small c(9);
  ds::CheckpointManager mc(c.ckpt, dir, {3});
  expect_error<ds::DataLossError>(
      [&] { mc.restore_latest(); },
      {"ckpt-2.safetensors", "ckpt-1.safetensors", "ckpt-0.safetensors"}, "all corrupt");
  EXPECT_TRUE(exists(ckpt_path(dir, 1)));  // not pruned, not deleted
}

// `latest` as a symlink loop is a damaged pointer (fallen back from), like a FIFO.
TEST(CheckpointManagerRobustness, ASymlinkLoopAsLatestIsADamagedPointer) {
  const std::string dir = temp_dir(kRobustnessTempPrefix);
  Small a;
  save_steps(a, dir, 1, 2, 1);
  ASSERT_EQ(::unlink((dir + "/latest").c_str()), 0);
  ASSERT_EQ(::symlink("latest", (dir + "/latest").c_str()), 0);
  expect_error<ds::DataLossError>([&] { ds::latest_checkpoint(dir); }, {dir + "/latest"},
                                  "latest_checkpoint");
  Small b(9);
  ds::CheckpointManager mb(b.ckpt, dir, {3});
  const auto md = mb.restore_latest();
  ASSERT_TRUE(md.has_value());
  EXPECT_EQ(md->at("step"), "2");
  EXPECT_TRUE(contains(b.warnings, "damaged")) << b.warnings;
}

TEST(CheckpointRobustness, MetadataIntWithInvertedBoundsIsInvalidArgument) {
  const ds::CheckpointMetadata md{{"step", "3"}};
  expect_error<ds::InvalidArgumentError>([&] { ds::metadata_int(md, "step", 5, 1, "/c/f"); },
                                         {"'step'", "5", "1"}, "min > max");
}

// `latest` pointing at a binary file: the warning quotes it escaped, in full length.
TEST(CheckpointManagerRobustness, ADamagedPointerWarningEscapesControlBytes) {
  const std::string dir = temp_dir(kRobustnessTempPrefix);
  Small a;
  save_steps(a, dir, 1, 2, 1);
  ASSERT_EQ(::unlink((dir + "/latest").c_str()), 0);
  // Binary content under 4 KiB: its first line (up to a newline) is quoted.
  std::vector<uint8_t> junk = {'c', 'k', 0x00, 0x01, 0x1b, '[', '2', 'J', 0x7f, 'x', 0x00, 'y'};
  // Written in place: a symlinked `latest` is not followed at all (issue 23, item 16).
  write_bytes(dir + "/latest", junk);
  Small b(9);
  ds::CheckpointManager mb(b.ckpt, dir, {3});
  ASSERT_TRUE(mb.restore_latest().has_value());
  EXPECT_TRUE(contains(b.warnings, "damaged")) << b.warnings;
  EXPECT_FALSE(has_control_byte(b.warnings)) << b.warnings;
  EXPECT_TRUE(contains(b.warnings, "ck\\x00\\x01\\x1b[2J\\x7fx\\x00y")) << b.warnings;
}

// A restore-only reader (an evaluator) of a read-only directory.
TEST(CheckpointManagerRobustness, AReadOnlyManagerRestoresFromAReadOnlyDirectory) {
  const std::string dir = temp_dir(kRobustnessTempPrefix);
  ASSERT_EQ(::chmod(dir.c_str(), 0755), 0);
  {
    Small a;
    save_steps(a, dir + "/c", 1, 2, 1);
  }
  ASSERT_EQ(::chmod((dir + "/c").c_str(), 0555), 0);
  const int rc = run_bounded(
      [&] {
        if (::geteuid() == 0 && (::setgid(65534) != 0 || ::setuid(65534) != 0)) return 10;
        Small b(9);
        ds::CheckpointManagerOptions o;
        o.read_only = true;
        try {
          ds::CheckpointManager mb(b.ckpt, dir + "/c", o);
          const auto md = mb.restore_latest();
          if (!md || md->at("step") != "2") return 2;
          try {
            mb.save(3);
            return 3;
          } catch (const ds::FailedPreconditionError& e) {
            if (!contains(e.what(), "read_only")) return 4;
          }
        } catch (const ds::Error& e) {
          std::fprintf(stderr, "%s\n", e.what());
          return 5;
        }
        return 0;
      },
      30);
  ::chmod((dir + "/c").c_str(), 0755);
  EXPECT_EQ(rc, 0) << "2 = wrong restore, 3 = saved, 4 = message, 5 = refused";
}
