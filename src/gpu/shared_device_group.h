// Collectives for logical GPUs that share one physical GPU. They cannot share
// an NCCL communicator (NCCL needs distinct devices), but they share an
// address space, so a collective is a rendezvous of the replicas' buffer
// pointers plus device kernels that read every replica's buffer directly:
//
//   all_reduce, rank r of n, count elements:
//     1. record an event on r's stream (its input is ready), publish in/out
//        pointers and (count, dtype, op), and meet the others (host barrier
//        with the communication deadline; mismatches are errors on all ranks);
//     2. make r's stream wait for every peer's event;
//     3. reduce slice r (count/n elements, 64-element aligned) of all n
//        inputs and write it into all n outputs — one pass: the slice is read
//        n times and written n times, which is the least traffic possible;
//     4. record an event behind r's kernel, meet again (host barrier: every
//        rank has recorded), and make r's stream wait for every peer's event,
//        so no replica's later work reuses its buffers while a peer's kernel
//        still reads or writes them. The host never waits for the device
//        here: a failed or hung kernel surfaces at the replica's next wait
//        (each bounded by the deadline), naming the step.
// In place (in == out) is safe: element i is read and written only by the
// kernel of the rank that owns i's slice.
#pragma once

#include <memory>
#include <vector>

#include "core/gpu_backend.h"

namespace diststrat {
namespace gpu {

std::vector<std::unique_ptr<Communicator>> make_shared_device_group(
    const SharedDeviceGroupSpec& spec, const CommunicationOptions& options);

}  // namespace gpu
}  // namespace diststrat
