// Where a training loop stands in a DistributedDataset, as checkpoint
// metadata: save it with every checkpoint and a resumed run continues with
// the very next batch (the same rows, in the same order), or is told why it
// cannot.
//
//   ```cpp fragment=loop_manager
//   ds::DataPosition pos;                      // epoch 0, batch 0, step 0
//   if (auto md = manager.restore_latest())
//     pos = ds::restore_data_position(dist, *md, *manager.restored_path(),
//                                     opt.iterations().value().data<int64_t>()[0]);
//   for (; pos.epoch < epochs; ++pos.epoch, pos.batch = 0) {
//     dist.set_epoch(pos.epoch);
//     for (; pos.batch < dist.num_batches(); ) {
//       train_step(dist.batch(pos.batch));     // strategy.run over the batch
//       ++pos.batch; ++pos.step;
//       manager.save(pos.step, ds::data_position_metadata(dist, pos));
//     }
//   }
//   ```
//
// Not thread-safe with changes of `data`; no communication.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "diststrat/checkpoint.h"
#include "diststrat/data.h"

namespace diststrat {

// The next batch to run is batch `batch` of epoch `epoch` (batch ==
// num_batches() means that epoch is over); `step` steps ran before it, over
// all epochs. A loop that runs every batch of every epoch keeps
// step == epoch * num_batches() + batch.
struct DataPosition {
  int64_t epoch = 0;
  int64_t batch = 0;
  int64_t step = 0;
};

// Metadata keys "epoch", "batch", "step" (the position) and "global_batch",
// "seed", "rows", "shuffle", "drop_remainder" (what fixes the order of the
// rows). Add your own keys beside them.
CheckpointMetadata data_position_metadata(const DistributedDataset& data, const DataPosition& pos);

// Reads a position written by data_position_metadata back, from the metadata
// `md` of checkpoint `path` (named in every error), and checks it:
//  - the keys that fix the data order equal `data`'s: a different global
//    batch, seed or row count (another --limit) is InvalidArgumentError
//    naming the key and both values (the run's flags differ; resuming would
//    not continue the same order). "rows", "shuffle" and "drop_remainder"
//    are checked when present (files written before they existed lack them);
//  - each position key is an integer in range and they agree with each
//    other: batch <= num_batches() and step == epoch * num_batches() + batch;
//  - when `iterations` is given (the optimizer's restored step counter, for a
//    loop that makes one update per step), step == iterations.
// A missing or contradictory position key is DataLossError naming the file
// and the keys (a damaged or foreign checkpoint, never a silent restart at
// the wrong batch). Returns the position.
DataPosition restore_data_position(const DistributedDataset& data, const CheckpointMetadata& md,
                                   const std::string& path,
                                   std::optional<int64_t> iterations = std::nullopt);

}  // namespace diststrat
