#include "diststrat/data_position.h"

#include <limits>

#include "core/user_text.h"

namespace diststrat {

namespace {
std::string text(bool b) { return b ? "1" : "0"; }
}  // namespace

CheckpointMetadata data_position_metadata(const DistributedDataset& data, const DataPosition& pos) {
  const DistributeOptions o = data.options();
  return {{"epoch", std::to_string(pos.epoch)},
          {"batch", std::to_string(pos.batch)},
          {"step", std::to_string(pos.step)},
          {"global_batch", std::to_string(data.global_batch_size())},
          {"seed", std::to_string(o.seed)},
          {"rows", std::to_string(data.num_rows())},
          {"shuffle", text(o.shuffle)},
          {"drop_remainder", text(o.drop_remainder)}};
}

DataPosition restore_data_position(const DistributedDataset& data, const CheckpointMetadata& md,
                                   const std::string& path, std::optional<int64_t> iterations) {
  const std::string where = "checkpoint '" + echo(path) + "'";
  const DistributeOptions o = data.options();
  struct Order {
    const char* key;
    std::string mine;
    bool required;
  };
  for (const Order& k : {Order{"global_batch", std::to_string(data.global_batch_size()), true},
                         Order{"seed", std::to_string(o.seed), true},
                         Order{"rows", std::to_string(data.num_rows()), false},
                         Order{"shuffle", text(o.shuffle), false},
                         Order{"drop_remainder", text(o.drop_remainder), false}}) {
    auto it = md.find(k.key);
    if (it == md.end()) {
      if (!k.required) continue;
      throw DataLossError(where + " has no '" + k.key +
                          "' metadata: it was not written with a data position "
                          "(data_position_metadata)");
    }
    if (it->second != k.mine) {
      throw InvalidArgumentError(where + " was written with " + k.key + " " + echo(it->second, 64) +
                                 ", this run has " + k.mine +
                                 ": the order of the data would differ; resume with the same "
                                 "batch size, seed and data");
    }
  }
  for (const char* key : {"epoch", "batch", "step"}) {
    if (md.find(key) == md.end())
      throw DataLossError(where + " has no '" + key +
                          "' metadata: the data position is incomplete");
  }
  const int64_t batches = data.num_batches();
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  DataPosition p;
  p.epoch = metadata_int(md, "epoch", 0, kMax, path);
  p.batch = metadata_int(md, "batch", 0, batches, path);
  p.step = metadata_int(md, "step", 0, kMax, path);
  // step == epoch * batches + batch, computed without overflow.
  const bool consistent =
      batches == 0 ? p.step == p.batch
                   : p.epoch <= (kMax - p.batch) / batches && p.step == p.epoch * batches + p.batch;
  if (!consistent) {
    throw DataLossError(where + ": its data position contradicts itself: epoch " +
                        std::to_string(p.epoch) + ", batch " + std::to_string(p.batch) +
                        " and step " + std::to_string(p.step) + " (with " +
                        std::to_string(batches) + " batches per epoch, step must be epoch * " +
                        std::to_string(batches) + " + batch); keys 'epoch', 'batch', 'step'");
  }
  if (iterations && *iterations != p.step) {
    throw DataLossError(where + ": its data position says step " + std::to_string(p.step) +
                        " but the optimizer's restored step counter is " +
                        std::to_string(*iterations) +
                        "; keys 'step' and the optimizer's iterations");
  }
  return p;
}

}  // namespace diststrat
