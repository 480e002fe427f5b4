// Prelude "torch_no_sync" (compile only): inside a replica's step, a
// DistributedDataParallel `ddp`, K micro-batches' losses and row counts.
#include <cstdint>

#include <diststrat/diststrat.h>
#include <diststrat/torch.h>
namespace ds = diststrat;
namespace dt = diststrat::libtorch;
// @params: dt::DistributedDataParallel& ddp, ds::ReplicaContext& ctx, int K, const at::Tensor& loss_k, int64_t rows_k, int64_t global_rows_k, const at::Tensor& loss_last, int64_t rows, int64_t global_rows
// @body
