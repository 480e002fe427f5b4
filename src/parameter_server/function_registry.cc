// FunctionRegistry and the tensor encoding of diststrat/cluster_coordinator.h.
#include <cstring>

#include "diststrat/cluster_coordinator.h"
#include "parameter_server/coordinator_impl.h"

namespace diststrat {

// ---- registry ----------------------------------------------------------------

void FunctionRegistry::register_function(const std::string& name, RemoteFunction fn) {
  DISTSTRAT_CHECK(!name.empty() && name.size() <= kMaxFunctionName, kInvalidArgument,
                  "FunctionRegistry::register_function: a name has 1..", kMaxFunctionName,
                  " characters, got ", name.size());
  DISTSTRAT_CHECK(static_cast<bool>(fn), kInvalidArgument,
                  "FunctionRegistry::register_function: function '", name, "' is empty");
  DISTSTRAT_CHECK(functions_.count(name) == 0, kInvalidArgument,
                  "FunctionRegistry::register_function: '", name, "' is registered already");
  functions_.emplace(name, std::move(fn));
}

const RemoteFunction& FunctionRegistry::at(const std::string& name) const {
  auto it = functions_.find(name);
  DISTSTRAT_CHECK(it != functions_.end(), kInvalidArgument, "function '", name,
                  "' is not registered (every process must register the same functions)");
  return it->second;
}

std::vector<std::string> FunctionRegistry::names() const {
  std::vector<std::string> out;
  for (const auto& [name, fn] : functions_) out.push_back(name);
  return out;
}

// ---- tensors as bytes --------------------------------------------------------

namespace {

constexpr uint64_t kTensorsMagic = 0x31534E5354534444ull;  // "DDSTSNS1"

template <typename T>
void put(Bytes& out, T v) {
  const char* p = reinterpret_cast<const char*>(&v);
  out.insert(out.end(), p, p + sizeof(T));
}

template <typename T>
T take(const Bytes& in, size_t& at, const char* what) {
  DISTSTRAT_CHECK(in.size() - at >= sizeof(T), kInvalidArgument, "decode_tensors: ", in.size(),
                  " bytes end inside ", what, " at byte ", at);
  T v;
  std::memcpy(&v, in.data() + at, sizeof(T));
  at += sizeof(T);
  return v;
}

}  // namespace

Bytes encode_tensors(const std::vector<Tensor>& tensors) {
  Bytes out;
  put(out, kTensorsMagic);
  put(out, static_cast<uint64_t>(tensors.size()));
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    DISTSTRAT_CHECK(t.device().is_cpu(), kInvalidArgument, "encode_tensors: tensor ", i, " is on ",
                    t.device().to_string(), "; copy it to the host first");
    put(out, static_cast<int32_t>(t.dtype()));
    put(out, static_cast<uint32_t>(t.shape().rank()));
    for (int64_t d : t.shape().dims()) put(out, d);
    const char* p = static_cast<const char*>(t.data());
    out.insert(out.end(), p, p + t.nbytes());
  }
  return out;
}

std::vector<Tensor> decode_tensors(const Bytes& bytes) {
  size_t at = 0;
  DISTSTRAT_CHECK(take<uint64_t>(bytes, at, "the magic") == kTensorsMagic, kInvalidArgument,
                  "decode_tensors: these ", bytes.size(), " bytes are not encode_tensors' output");
  const uint64_t n = take<uint64_t>(bytes, at, "the count");
  DISTSTRAT_CHECK(n <= bytes.size(), kInvalidArgument, "decode_tensors: a count of ", n,
                  " tensors in ", bytes.size(), " bytes");
  std::vector<Tensor> out;
  for (uint64_t i = 0; i < n; ++i) {
    const int32_t dtype = take<int32_t>(bytes, at, "a dtype");
    DISTSTRAT_CHECK(dtype >= 0 && dtype <= static_cast<int32_t>(DType::kInt64) + 8,
                    kInvalidArgument, "decode_tensors: tensor ", i, " has dtype code ", dtype);
    const uint32_t rank = take<uint32_t>(bytes, at, "a rank");
    DISTSTRAT_CHECK(rank <= 32, kInvalidArgument, "decode_tensors: tensor ", i, " has rank ", rank);
    std::vector<int64_t> dims;
    uint64_t elements = 1;
    for (uint32_t d = 0; d < rank; ++d) {
      const int64_t v = take<int64_t>(bytes, at, "a shape");
      DISTSTRAT_CHECK(v >= 0 && static_cast<uint64_t>(v) <= bytes.size(), kInvalidArgument,
                      "decode_tensors: tensor ", i, " has dimension ", v);
      dims.push_back(v);
      elements = v == 0 ? 0 : elements * static_cast<uint64_t>(v);
      DISTSTRAT_CHECK(elements <= bytes.size(), kInvalidArgument, "decode_tensors: tensor ", i,
                      " claims more elements than the ", bytes.size(), " bytes hold");
    }
    Tensor t(Shape(dims), static_cast<DType>(dtype));
    DISTSTRAT_CHECK(bytes.size() - at >= t.nbytes(), kInvalidArgument, "decode_tensors: tensor ", i,
                    " needs ", t.nbytes(), " bytes, ", bytes.size() - at, " are left");
    if (t.nbytes() > 0) std::memcpy(t.data(), bytes.data() + at, t.nbytes());  // (empty: null)
    at += t.nbytes();
    out.push_back(std::move(t));
  }
  DISTSTRAT_CHECK(at == bytes.size(), kInvalidArgument, "decode_tensors: ", bytes.size() - at,
                  " bytes left over after ", n, " tensors");
  return out;
}

}  // namespace diststrat
