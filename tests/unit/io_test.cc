#include <gtest/gtest.h>
#include <zlib.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "child_util.h"
#include "diststrat/diststrat.h"
#include "../common/temp_dir.h"

namespace ds = diststrat;
using diststrat_test::current_rss_kib;
using diststrat_test::run_in_child;

namespace {

constexpr char kIoTempPrefix[] = "diststrat_io_";

std::vector<uint8_t> idx_bytes(std::vector<uint32_t> dims, size_t payload) {
  std::vector<uint8_t> b{0, 0, 8, static_cast<uint8_t>(dims.size())};
  for (uint32_t d : dims) {
    b.push_back(d >> 24);
    b.push_back(d >> 16);
    b.push_back(d >> 8);
    b.push_back(d);
  }
  for (size_t i = 0; i < payload; ++i) b.push_back(static_cast<uint8_t>(i * 7));
  return b;
}

void write(const std::string& path, const std::vector<uint8_t>& b) {
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(b.data()), b.size());
}

void write_gz(const std::string& path, const std::vector<uint8_t>& b) {
  gzFile f = gzopen(path.c_str(), "wb");
  gzwrite(f, b.data(), static_cast<unsigned>(b.size()));
  gzclose(f);
}

TEST(Idx, ParsesPlainAndGzip) {
  const diststrat_test::TempDir scoped(kIoTempPrefix);
  const std::string& dir = scoped.path();
  write(dir + "/a", idx_bytes({2, 3}, 6));
  write_gz(dir + "/a.gz", idx_bytes({2, 3}, 6));
  for (const std::string p : {dir + "/a", dir + "/a.gz"}) {
    ds::IdxArray a = ds::read_idx(p);
    EXPECT_EQ(a.dims, (std::vector<int64_t>{2, 3}));
    ASSERT_EQ(a.data.size(), 6u);
    EXPECT_EQ(a.data[5], 35);
  }
}

TEST(Idx, MissingTruncatedAndCorruptFilesAreClearErrors) {
  const diststrat_test::TempDir scoped(kIoTempPrefix);
  const std::string& dir = scoped.path();
  EXPECT_THROW(ds::read_idx(dir + "/missing"), ds::NotFoundError);
  write(dir + "/short", idx_bytes({2, 3}, 5));
  EXPECT_THROW(ds::read_idx(dir + "/short"), ds::DataLossError);
  auto bad_magic = idx_bytes({2}, 2);
  bad_magic[0] = 1;
  write(dir + "/magic", bad_magic);
  EXPECT_THROW(ds::read_idx(dir + "/magic"), ds::DataLossError);
  auto bad_type = idx_bytes({2}, 2);
  bad_type[2] = 0x0D;  // float
  write(dir + "/type", bad_type);
  EXPECT_THROW(ds::read_idx(dir + "/type"), ds::DataLossError);
  write(dir + "/tiny", {0, 0});
  EXPECT_THROW(ds::read_idx(dir + "/tiny"), ds::DataLossError);
  // A gzip file cut in half.
  write_gz(dir + "/full.gz", idx_bytes({100, 100}, 10000));
  std::ifstream in(dir + "/full.gz", std::ios::binary);
  std::vector<uint8_t> gz((std::istreambuf_iterator<char>(in)), {});
  gz.resize(gz.size() / 2);
  write(dir + "/cut.gz", gz);
  EXPECT_THROW(ds::read_idx(dir + "/cut.gz"), ds::DataLossError);
  EXPECT_THROW(ds::load_mnist_split(dir, "train"), ds::NotFoundError);
}

// A gzip "bomb": the IDX header and payload `dims` allow, followed by
// `extra_mib` MiB of zeros, at about 1 KiB per MiB. Each MiB is one
// self-contained deflate block (Z_FULL_FLUSH resets the history), so one
// compressed block repeated is a valid stream; the trailer's CRC is left
// wrong, a reader that inflates everything fails only at the very end.
std::vector<uint8_t> idx_gzip_bomb(std::vector<uint32_t> dims, size_t payload, size_t extra_mib) {
  z_stream z{};
  EXPECT_EQ(deflateInit2(&z, 9, Z_DEFLATED, 15 + 16, 9, Z_DEFAULT_STRATEGY), Z_OK);
  std::vector<uint8_t> out;
  auto run = [&](std::vector<uint8_t> in, int flush) {
    std::vector<uint8_t> produced;
    z.next_in = in.data();
    z.avail_in = static_cast<uInt>(in.size());
    uint8_t buf[1 << 16];
    do {
      z.next_out = buf;
      z.avail_out = sizeof(buf);
      deflate(&z, flush);
      produced.insert(produced.end(), buf, buf + (sizeof(buf) - z.avail_out));
    } while (z.avail_out == 0);
    return produced;
  };
  out = run(idx_bytes(dims, payload), Z_FULL_FLUSH);
  const std::vector<uint8_t> mib = run(std::vector<uint8_t>(1 << 20, 0), Z_FULL_FLUSH);
  for (size_t i = 0; i < extra_mib; ++i) out.insert(out.end(), mib.begin(), mib.end());
  const std::vector<uint8_t> tail = run({}, Z_FINISH);
  out.insert(out.end(), tail.begin(), tail.end());
  deflateEnd(&z);
  return out;
}

// A FIFO where an IDX file should be is a clear error, never a wait for a
// writer (nor a misleading "does not exist").
TEST(Idx, AFifoIsAnErrorNotAHang) {
  const diststrat_test::TempDir scoped(kIoTempPrefix);
  const std::string& dir = scoped.path();
  ASSERT_EQ(::mkfifo((dir + "/fifo").c_str(), 0644), 0);
  ASSERT_EQ(::mkfifo((dir + "/train-images-idx3-ubyte.gz").c_str(), 0644), 0);
  const auto r = run_in_child([&] {
    try {
      ds::read_idx(dir + "/fifo");
      return 10;
    } catch (const ds::InvalidArgumentError& e) {
      if (std::string(e.what()).find("is not a regular file") == std::string::npos) return 11;
    } catch (const ds::Error& e) {
      std::fprintf(stderr, "read_idx(fifo): %s\n", e.what());
      return 12;
    }
    try {
      ds::load_mnist_split(dir, "train");
      return 20;
    } catch (const ds::InvalidArgumentError& e) {
      if (std::string(e.what()).find("train-images-idx3-ubyte.gz") == std::string::npos) return 21;
    } catch (const ds::Error& e) {
      std::fprintf(stderr, "load_mnist_split: %s\n", e.what());
      return 22;
    }
    return 0;
  });
  EXPECT_FALSE(r.timed_out) << "reading a FIFO hung";
  EXPECT_EQ(r.exit_code, 0);
}

// A 1 MB gzip file that inflates to 512 MiB is refused as soon as the
// output passes what its header's dims allow, not after inflating it all.
TEST(Idx, AGzipBombStopsAtTheSizeTheHeaderAllows) {
  const diststrat_test::TempDir scoped(kIoTempPrefix);
  const std::string& dir = scoped.path();
  write(dir + "/bomb.gz", idx_gzip_bomb({10, 10}, 100, 512));
  const long base = current_rss_kib();
  const auto r = run_in_child([&] {
    try {
      ds::read_idx(dir + "/bomb.gz");
      return 10;
    } catch (const ds::DataLossError& e) {
      std::fprintf(stderr, "bomb: %s\n", e.what());
      return std::string(e.what()).find("more than") == std::string::npos ? 11 : 0;
    }
  });
  EXPECT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_LT(r.max_rss_kib - base, 64 * 1024)
      << "peak memory grew by " << (r.max_rss_kib - base) / 1024
      << " MiB reading a 100-byte IDX gzip bomb";
}

// A plain file far longer than its dims (sparse, 1 GiB) is refused from its
// size, not read whole.
TEST(Idx, APlainFileLongerThanItsDimsIsNotReadWhole) {
  const diststrat_test::TempDir scoped(kIoTempPrefix);
  const std::string& dir = scoped.path();
  write(dir + "/long", idx_bytes({10, 10}, 100));
  ASSERT_EQ(::truncate((dir + "/long").c_str(), off_t(1) << 30), 0);
  const long base = current_rss_kib();
  const auto r = run_in_child([&] {
    try {
      ds::read_idx(dir + "/long");
      return 10;
    } catch (const ds::DataLossError& e) {
      std::fprintf(stderr, "long: %s\n", e.what());
      return 0;
    }
  });
  EXPECT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_LT(r.max_rss_kib - base, 64 * 1024)
      << "peak memory grew by " << (r.max_rss_kib - base) / 1024
      << " MiB reading a 100-byte IDX file padded to 1 GiB";
}

// The header's claim alone allocates nothing: 2^34 elements claimed, 10 bytes
// there (gzip and plain), one extra byte, and concatenated gzip members (which
// gzip itself reads as one stream).
TEST(Idx, PayloadMustMatchTheDimsExactly) {
  const diststrat_test::TempDir scoped(kIoTempPrefix);
  const std::string& dir = scoped.path();
  write_gz(dir + "/claim.gz", idx_bytes({1 << 16, 1 << 16, 4}, 10));
  write(dir + "/claim", idx_bytes({1 << 16, 1 << 16, 4}, 10));
  write_gz(dir + "/extra.gz", idx_bytes({2, 3}, 7));
  const long base = current_rss_kib();
  const auto r = run_in_child([&] {
    for (const char* name : {"/claim.gz", "/claim", "/extra.gz"}) {
      try {
        ds::read_idx(dir + name);
        return 10;
      } catch (const ds::DataLossError& e) {
        std::fprintf(stderr, "%s: %s\n", name, e.what());
      }
    }
    return 0;
  });
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_LT(r.max_rss_kib - base, 64 * 1024);
  // Two gzip members: the header and part of the payload, then the rest.
  const std::vector<uint8_t> all = idx_bytes({2, 3}, 6);
  write_gz(dir + "/m1", std::vector<uint8_t>(all.begin(), all.begin() + 14));
  write_gz(dir + "/m2", std::vector<uint8_t>(all.begin() + 14, all.end()));
  std::ifstream a(dir + "/m1", std::ios::binary), b(dir + "/m2", std::ios::binary);
  std::vector<uint8_t> cat((std::istreambuf_iterator<char>(a)), {});
  cat.insert(cat.end(), std::istreambuf_iterator<char>(b), {});
  write(dir + "/multi.gz", cat);
  ds::IdxArray m = ds::read_idx(dir + "/multi.gz");
  EXPECT_EQ(m.dims, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(m.data, std::vector<uint8_t>(all.begin() + 12, all.end()));
}

TEST(Idx, LoadsFashionMnistWhenInstalled) {
  const std::string dir = DISTSTRAT_TEST_DATA_DIR;
  if (access((dir + "/t10k-labels-idx1-ubyte.gz").c_str(), R_OK) != 0) {
    GTEST_SKIP() << "dataset-fashion-mnist is not installed at " << dir;
  }
  ds::Dataset test = ds::load_mnist_split(dir, "t10k");
  EXPECT_EQ(test.size(), 10000);
  EXPECT_EQ(test.features().shape(), ds::Shape({10000, 784}));
  std::vector<int> per_class(10);
  for (int64_t i = 0; i < test.size(); ++i) per_class.at(test.labels().data<int32_t>()[i])++;
  for (int c : per_class) EXPECT_EQ(c, 1000);
  float mx = 0;
  for (int64_t i = 0; i < test.features().num_elements(); ++i)
    mx = std::max(mx, test.features().data<float>()[i]);
  EXPECT_EQ(mx, 1.0f);
}

}  // namespace
