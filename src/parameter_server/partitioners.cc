// Partitioners (TensorFlow's tf.distribute.experimental.partitioners) and the
// row split of a sharded variable.

#include <algorithm>
#include <cmath>

#include "diststrat/parameter_server.h"

namespace diststrat {
namespace partitioners {
namespace {
int64_t rows_of(const Shape& shape) { return shape.rank() == 0 ? 1 : shape[0]; }
}  // namespace

int64_t FixedShards::operator()(const Shape& shape, DType) const {
  DISTSTRAT_CHECK_GE(num_shards, 1, "FixedShards partitioner: num_shards");
  if (shape.rank() == 0) return 1;
  return std::max<int64_t>(1, std::min(num_shards, rows_of(shape)));
}

int64_t MinSize::operator()(const Shape& shape, DType dtype) const {
  DISTSTRAT_CHECK_GE(min_shard_bytes, 1, "MinSize partitioner: min_shard_bytes");
  DISTSTRAT_CHECK_GE(max_shards, 1, "MinSize partitioner: max_shards");
  if (shape.rank() == 0) return 1;
  const double total = static_cast<double>(shape.num_elements()) * dtype_size(dtype);
  const int64_t wanted =
      static_cast<int64_t>(std::ceil(total / static_cast<double>(min_shard_bytes)));
  return std::max<int64_t>(1, std::min({rows_of(shape), max_shards, wanted}));
}

int64_t MaxSize::operator()(const Shape& shape, DType dtype) const {
  DISTSTRAT_CHECK_GE(max_shard_bytes, 1, "MaxSize partitioner: max_shard_bytes");
  DISTSTRAT_CHECK_GE(max_shards, 0, "MaxSize partitioner: max_shards");
  if (shape.rank() == 0 || shape[0] == 0) return 1;
  // Bytes of one row; how many whole rows fit in a shard (at least one).
  const double row_bytes =
      static_cast<double>(shape.num_elements() / shape[0]) * static_cast<double>(dtype_size(dtype));
  const int64_t rows_per_shard = std::max<int64_t>(
      1, static_cast<int64_t>(std::floor(max_shard_bytes / std::max(row_bytes, 1.0))));
  int64_t n = (shape[0] + rows_per_shard - 1) / rows_per_shard;
  if (max_shards > 0) n = std::min(n, max_shards);
  return std::max<int64_t>(1, n);
}
}  // namespace partitioners

std::vector<std::pair<int64_t, int64_t>> shard_rows(int64_t rows, int64_t num_shards) {
  DISTSTRAT_CHECK_GE(num_shards, 1, "shard_rows: num_shards");
  DISTSTRAT_CHECK_GE(rows, 0, "shard_rows: rows");
  std::vector<std::pair<int64_t, int64_t>> out;
  const int64_t base = rows / num_shards, extra = rows % num_shards;
  int64_t offset = 0;
  for (int64_t i = 0; i < num_shards; ++i) {
    const int64_t n = base + (i < extra ? 1 : 0);
    out.emplace_back(offset, n);
    offset += n;
  }
  return out;
}

}  // namespace diststrat
