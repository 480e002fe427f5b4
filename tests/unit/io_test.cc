#include <gtest/gtest.h>
#include <zlib.h>

#include <cstdio>
#include <fstream>
#include <unistd.h>

#include "diststrat/diststrat.h"

namespace ds = diststrat;

namespace {

std::string temp_dir() {
  char tmpl[] = "/tmp/diststrat_io_XXXXXX";
  return mkdtemp(tmpl);
}

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
  const std::string dir = temp_dir();
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
  const std::string dir = temp_dir();
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
  for (int64_t i = 0; i < test.features().num_elements(); ++i) mx = std::max(mx, test.features().data<float>()[i]);
  EXPECT_EQ(mx, 1.0f);
}

}  // namespace
