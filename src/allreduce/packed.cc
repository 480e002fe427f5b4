#include "allreduce/packed.h"

#include <cstring>

namespace diststrat {

namespace {
class HostPackMemory : public PackMemory {
 public:
  explicit HostPackMemory(std::vector<char>& b) : b_(b) {}
  void* buffer(size_t bytes) override {
    if (b_.size() < bytes) b_.resize(bytes);
    return b_.data();
  }
  void copy(void* dst, const void* src, size_t bytes) override { std::memcpy(dst, src, bytes); }

 private:
  std::vector<char>& b_;
};
}  // namespace

void PackedAllReduce::run(Communicator& comm, ReduceOp op, std::vector<Tensor>& tensors,
                          const std::vector<std::string>& names, size_t bytes_per_pack,
                          PackMemory* memory) {
  HostPackMemory host(buffer_);
  PackMemory& mem = memory ? *memory : host;
  auto name_of = [&](size_t i) {
    return i < names.size() && !names[i].empty() ? names[i] : "tensor#" + std::to_string(i);
  };
  const size_t limit = bytes_per_pack == 0 ? SIZE_MAX : bytes_per_pack;
  size_t i = 0;
  while (i < tensors.size()) {
    const DType dtype = tensors[i].dtype();
    // Extend the pack while the dtype matches and it fits.
    size_t j = i, bytes = 0;
    while (j < tensors.size() && tensors[j].dtype() == dtype &&
           (j == i || bytes + tensors[j].nbytes() <= limit)) {
      bytes += tensors[j].nbytes();
      ++j;
    }
    const size_t esz = dtype_size(dtype);
    // Device tensors already laid end to end in list order (views of one
    // buffer, as a GPU model's gradients are) are the pack themselves:
    // reduced in place, without the copies in and out.
    bool contiguous = memory != nullptr && j > i + 1;
    char* first = nullptr;
    char* next = nullptr;
    for (size_t k = i; contiguous && k < j; ++k) {
      if (tensors[k].nbytes() == 0) continue;
      char* p = static_cast<char*>(tensors[k].data());
      if (first == nullptr) first = p;
      contiguous = next == nullptr || p == next;
      next = p + tensors[k].nbytes();
    }
    if (contiguous && first != nullptr) {
      const std::string pack_name =
          "pack of " + std::to_string(j - i) + " [" + name_of(i) + " .. " + name_of(j - 1) + "]";
      comm.all_reduce(first, first, bytes / esz, dtype, op, pack_name);
      i = j;
      continue;
    }
    if (j == i + 1) {
      Tensor& t = tensors[i];
      comm.all_reduce(t.data(), t.data(), static_cast<size_t>(t.num_elements()), dtype, op,
                      name_of(i));
    } else {
      char* buffer = static_cast<char*>(mem.buffer(bytes));
      size_t off = 0;
      for (size_t k = i; k < j; ++k) {
        if (tensors[k].nbytes()) mem.copy(buffer + off, tensors[k].data(), tensors[k].nbytes());
        off += tensors[k].nbytes();
      }
      const std::string pack_name =
          "pack of " + std::to_string(j - i) + " [" + name_of(i) + " .. " + name_of(j - 1) + "]";
      comm.all_reduce(buffer, buffer, bytes / esz, dtype, op, pack_name);
      off = 0;
      for (size_t k = i; k < j; ++k) {
        if (tensors[k].nbytes()) mem.copy(tensors[k].data(), buffer + off, tensors[k].nbytes());
        off += tensors[k].nbytes();
      }
    }
    i = j;
  }
}

}  // namespace diststrat
