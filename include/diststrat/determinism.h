// Determinism across world sizes: a synchronous strategy (MirroredStrategy,
// MultiWorkerMirroredStrategy, CentralStorageStrategy) whose final
// variables are the same bits whether a global batch is computed on 1, 2 or
// 4 replicas, on one process or three (docs/determinism.md).
//
// With virtual_shards = V every global batch is cut into V fixed shards by
// row, whatever the number of replicas; the strategy calls the step function
// once per shard (V virtual replicas, a contiguous range of shards per real
// replica), so each shard's gradient comes out of the same kernel on the same
// shape wherever it runs; and the shards' gradients are summed exactly (as
// 64-bit fixed point under one exponent per tensor that all replicas agree
// on), so the order of the sum, which the all-reduce's algorithm and the
// number of workers decide, no longer matters. Clipping's global norm is
// summed exactly and rounded once, so ZeRO-1 (shard_optimizer_state), whose
// blocks the replica count cuts, gives the same bits as well.
//
// Rules, in this mode:
//  - Strategy::run calls fn once per virtual shard; ReplicaContext::
//    virtual_shard() and replica_id() say which (0..V-1), num_replicas_in_sync()
//    is V, local_replica_id() names the real local replica (whose variable
//    copies and device the shard uses). run() returns one value per local
//    shard, in shard order; Strategy::reduce takes such values and combines
//    them over all shards in shard order.
//  - Optimizer::apply_gradients called from a shard only stores its gradients
//    (ApplyResult::applied false) until the real replica's last shard, whose
//    call reduces and updates. Call it once per shard, as the last thing the
//    shard does: the update waits until every shard has computed.
//  - The step function may not call ReplicaContext's collectives (all_reduce,
//    all_gather, barrier, merge_call) from a shard: FailedPreconditionError.
//  - Refused at construction (InvalidArgumentError or UnimplementedError, the
//    message says which option): V < the replicas in sync, fp16/bf16 wire
//    compression, GPU replicas, distribute_datasets_from_function
//    (its rows depend on the worker count). An elastic group that grows past
//    V replicas fails its next step (FailedPreconditionError); its members
//    must agree on V and on the CPU kernel variant when it forms.
//  - The strategy pins the process's CPU GEMM blocking (Eigen's cache sizes,
//    every instruction-set variant) while it lives; that is per process.
#pragma once

namespace diststrat {

struct DeterminismOptions {
  // Fixed shards per global batch; 0 turns the mode off (the default). Needs
  // at least as many shards as replicas in sync; a multiple of every replica
  // count you want to compare spreads them evenly (12: 1, 2, 3, 4, 6, 12).
  int virtual_shards = 0;
  bool enabled() const { return virtual_shards > 0; }
};

}  // namespace diststrat
