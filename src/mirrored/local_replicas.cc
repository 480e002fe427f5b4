#include "mirrored/local_replicas.h"

#include <algorithm>
#include <cstring>
#include <set>

namespace diststrat {

void validate_devices(const std::vector<Device>& devices, const char* strategy_name) {
  DISTSTRAT_CHECK(!devices.empty(), kInvalidArgument, strategy_name, ": no devices");
  std::set<Device> seen;
  for (const Device& d : devices) {
    DISTSTRAT_CHECK(d.index >= 0, kInvalidArgument, strategy_name, ": bad device ", d.to_string());
    DISTSTRAT_CHECK(seen.insert(d).second, kInvalidArgument, strategy_name, ": device ",
                    d.to_string(), " listed twice");
  }
}

LocalReplicas::LocalReplicas(Strategy* strategy, std::vector<Device> devices,
                             CommunicationOptions options)
    : strategy_(strategy),
      devices_(std::move(devices)),
      options_(options),
      group_(static_cast<int>(devices_.size()), options),
      pool_(static_cast<int>(devices_.size())) {
  for (int i = 0; i < size(); ++i) contexts_.push_back(std::make_unique<LocalReplicaContext>(this, i));
}

void LocalReplicas::run(const std::function<void(ReplicaContext&)>& fn) {
  auto errors = pool_.run_all([&](int i) {
    try {
      fn(*contexts_[i]);
    } catch (const AbortedError&) {
      throw;  // caused by another replica's failure
    } catch (const std::exception& e) {
      group_.at(i).abort("replica " + std::to_string(i) + " failed: " + e.what());
      throw;
    } catch (...) {
      group_.at(i).abort("replica " + std::to_string(i) + " failed with a non-standard exception");
      throw;
    }
  });
  std::exception_ptr first, first_abort;
  for (auto& e : errors) {
    if (!e) continue;
    try {
      std::rethrow_exception(e);
    } catch (const AbortedError&) {
      if (!first_abort) first_abort = e;
    } catch (...) {
      if (!first) first = e;
    }
  }
  if (first || first_abort) {
    group_.at(0).reset();  // every replica thread is idle now
    std::rethrow_exception(first ? first : first_abort);
  }
}

int LocalReplicaContext::replica_id() const {
  return owner_->strategy().first_local_replica() + local_id_;
}
int LocalReplicaContext::num_replicas_in_sync() const {
  return owner_->strategy().num_replicas_in_sync();
}
const Device& LocalReplicaContext::device() const { return owner_->devices_[local_id_]; }
Strategy& LocalReplicaContext::strategy() const { return owner_->strategy(); }
Communicator& LocalReplicaContext::local_comm() const { return owner_->group_.at(local_id_); }

void LocalReplicaContext::all_reduce(ReduceOp op, std::vector<Tensor>& tensors,
                                     const std::vector<std::string>& names) {
  packer_.run(local_comm(), op, tensors, names, owner_->options_.bytes_per_pack);
}

void LocalReplicaContext::barrier(const std::string& name) { local_comm().barrier(name); }

Tensor LocalReplicaContext::all_gather(const Tensor& t, const std::string& name) {
  Communicator& comm = local_comm();
  const int n = comm.size();
  DISTSTRAT_CHECK(t.shape().rank() >= 1, kInvalidArgument, "all_gather '", name,
                  "' of a scalar: reshape to [1]");
  // Rows may differ per replica: share row counts, pad to the largest, gather, compact.
  int64_t rows = t.shape()[0];
  std::vector<int64_t> all_rows(n);
  comm.all_gather(&rows, all_rows.data(), 1, DType::kInt64, name + "/rows");
  const int64_t max_rows = *std::max_element(all_rows.begin(), all_rows.end());
  const int64_t row_elems = rows ? t.num_elements() / rows : [&] {
    int64_t r = 1;
    for (size_t i = 1; i < t.shape().rank(); ++i) r *= t.shape()[i];
    return r;
  }();
  const size_t row_bytes = static_cast<size_t>(row_elems) * dtype_size(t.dtype());
  const size_t padded_count = static_cast<size_t>(max_rows * row_elems);
  std::vector<char> padded(padded_count * dtype_size(t.dtype()));
  if (t.nbytes()) std::memcpy(padded.data(), t.data(), t.nbytes());
  std::vector<char> gathered(padded.size() * n);
  comm.all_gather(padded.data(), gathered.data(), padded_count, t.dtype(), name);
  std::vector<int64_t> dims = t.shape().dims();
  dims[0] = 0;
  for (int64_t r : all_rows) dims[0] += r;
  Tensor out(Shape(dims), t.dtype());
  char* dst = static_cast<char*>(out.data());
  for (int r = 0; r < n; ++r) {
    const size_t bytes = static_cast<size_t>(all_rows[r]) * row_bytes;
    if (bytes) std::memcpy(dst, gathered.data() + r * padded.size(), bytes);
    dst += bytes;
  }
  return out;
}

std::shared_ptr<void> LocalReplicaContext::merge_call_impl(
    const std::function<std::shared_ptr<void>(Strategy&)>& fn) {
  Communicator& comm = local_comm();
  comm.barrier("merge_call enter");
  if (local_id_ == 0) {
    owner_->merge_result_.reset();
    owner_->merge_error_ = nullptr;
    try {
      owner_->merge_result_ = fn(owner_->strategy());
    } catch (...) {
      owner_->merge_error_ = std::current_exception();
    }
  }
  comm.barrier("merge_call result");
  std::shared_ptr<void> result = owner_->merge_result_;
  std::exception_ptr error = owner_->merge_error_;
  comm.barrier("merge_call exit");
  if (error) std::rethrow_exception(error);
  return result;
}

}  // namespace diststrat
