// The registry of user algorithms and the PeerChannel they run on: blocking
// sends and receives over the communicator's transport, all on the call's
// first tag (so messages between two ranks keep their order), each bounded by
// the call's deadline.

#include "allreduce/custom.h"

#include "allreduce/reduce_kernels.h"

namespace diststrat {

void AlgorithmRegistry::add(const std::string& name, CustomAllReduce fn) {
  DISTSTRAT_CHECK(!name.empty(), kInvalidArgument, "AlgorithmRegistry::add: empty name");
  DISTSTRAT_CHECK(static_cast<bool>(fn), kInvalidArgument, "AlgorithmRegistry::add('", name,
                  "'): empty function");
  DISTSTRAT_CHECK(algorithms_.count(name) == 0, kInvalidArgument, "AlgorithmRegistry::add: '", name,
                  "' is already registered");
  algorithms_.emplace(name, std::move(fn));
}

const CustomAllReduce* AlgorithmRegistry::find(const std::string& name) const {
  auto it = algorithms_.find(name);
  return it == algorithms_.end() ? nullptr : &it->second;
}

std::vector<std::string> AlgorithmRegistry::names() const {
  std::vector<std::string> out;
  for (const auto& kv : algorithms_) out.push_back(kv.first);
  return out;
}

namespace algo {
namespace {

class TransportChannel : public PeerChannel {
 public:
  TransportChannel(const Peers& peers, const AllReduceArgs& a) : peers_(peers), a_(a) {}
  int rank() const override { return peers_.me; }
  int size() const override { return peers_.size(); }
  void send(int peer, const void* data, size_t bytes) override {
    peers_.send(peer, data, bytes, a_.tag).wait(a_.deadline);
  }
  void recv(int peer, void* data, size_t bytes) override {
    peers_.recv(peer, data, bytes, a_.tag).wait(a_.deadline);
  }
  void send_recv(int send_peer, const void* send_data, size_t send_bytes, int recv_peer,
                 void* recv_data, size_t recv_bytes) override {
    Request r = peers_.recv(recv_peer, recv_data, recv_bytes, a_.tag);
    Request s = peers_.send(send_peer, send_data, send_bytes, a_.tag);
    r.wait(a_.deadline);
    s.wait(a_.deadline);
  }
  void reduce_into(void* dst, const void* src, size_t count) override {
    a_.accumulate(dst, src, count);
  }

 private:
  const Peers& peers_;
  const AllReduceArgs& a_;
};

}  // namespace

void run_custom(const CustomAllReduce& fn, const Peers& peers, const AllReduceArgs& a) {
  TransportChannel channel(peers, a);
  fn(channel, a.buf, a.count, a.dtype, a.op);
  a.finish(a.buf, a.count);
}

}  // namespace algo
}  // namespace diststrat
