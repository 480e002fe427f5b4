// DistributedDataParallel's start: the module signature that every replica
// of the job must share (checked with two gathers, the first difference
// named), and the broadcast of the chief's parameters and buffers.
#include "ddp_module_sync.h"

#include <algorithm>
#include <sstream>

#include "core/fnv1a.h"

namespace diststrat::libtorch::ddp_detail {

namespace {

std::string join_lines(const std::vector<std::string>& lines) {
  std::string s;
  for (const std::string& l : lines) s += l + "\n";
  return s;
}

std::vector<std::string> split_lines(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream is(s);
  for (std::string l; std::getline(is, l);) out.push_back(l);
  return out;
}

}  // namespace

std::string shape_text(const at::Tensor& t) {
  std::ostringstream os;
  os << t.scalar_type() << t.sizes();
  return os.str();
}

// One line per parameter / buffer: what every replica must agree on.
std::vector<std::string> module_signature(torch::nn::Module& m) {
  std::vector<std::string> lines;
  for (const auto& p : m.named_parameters(/*recurse=*/true)) {
    lines.push_back("parameter '" + p.key() + "' " + shape_text(p.value()) +
                    (p.value().requires_grad() ? "" : " (no grad)"));
  }
  for (const auto& b : m.named_buffers(/*recurse=*/true)) {
    lines.push_back("buffer '" + b.key() + "' " + shape_text(b.value()));
  }
  return lines;
}

// Checks that every replica in sync has the same signature; throws the same
// InvalidArgumentError on every process otherwise. Collective (two gathers).
void check_same_module(Strategy& strategy, const std::vector<std::string>& lines) {
  const int local = strategy.num_local_replicas();
  const std::string text = join_lines(lines);
  std::vector<Tensor> mine;
  for (int i = 0; i < local; ++i) {
    Tensor t(Shape{1, 2}, DType::kInt64);
    t.data<int64_t>()[0] = static_cast<int64_t>(fnv1a(text));
    t.data<int64_t>()[1] = static_cast<int64_t>(text.size());
    mine.push_back(t);
  }
  const Tensor all = strategy.gather(PerReplica<Tensor>(mine));
  const int64_t n = all.shape()[0];
  const int64_t* v = all.data<int64_t>();
  bool same = true;
  int64_t max_len = 0;
  for (int64_t r = 0; r < n; ++r) {
    same = same && v[2 * r] == v[0] && v[2 * r + 1] == v[1];
    max_len = std::max(max_len, v[2 * r + 1]);
  }
  if (same) return;
  // Somebody differs: every process gathers every signature text (padded to
  // the longest, one int32 per byte) and names the first difference against
  // replica 0 (the chief's first replica).
  std::vector<Tensor> texts;
  for (int i = 0; i < local; ++i) {
    Tensor t(Shape{1, std::max<int64_t>(max_len, 1)}, DType::kInt32);
    for (size_t c = 0; c < text.size(); ++c)
      t.data<int32_t>()[c] = static_cast<unsigned char>(text[c]);
    texts.push_back(t);
  }
  const Tensor all_text = strategy.gather(PerReplica<Tensor>(texts));
  const int64_t width = all_text.shape()[1];
  auto text_of = [&](int64_t r) {
    std::string s(static_cast<size_t>(v[2 * r + 1]), '\0');
    for (size_t c = 0; c < s.size(); ++c)
      s[c] = static_cast<char>(all_text.data<int32_t>()[r * width + c]);
    return split_lines(s);
  };
  const std::vector<std::string> chief = text_of(0);
  for (int64_t r = 1; r < n; ++r) {
    const std::vector<std::string> other = text_of(r);
    for (size_t i = 0; i < std::max(chief.size(), other.size()); ++i) {
      const std::string a = i < chief.size() ? chief[i] : "";
      const std::string b = i < other.size() ? other[i] : "";
      if (a == b) continue;
      std::string what;
      if (a.empty()) {
        what = "replica " + std::to_string(r) + " has " + b + " that replica 0 does not have";
      } else if (b.empty()) {
        what = "replica 0 has " + a + " that replica " + std::to_string(r) + " does not have";
      } else {
        what = "replica 0 has " + a + " where replica " + std::to_string(r) + " has " + b;
      }
      throw_error(ErrorCode::kInvalidArgument,
                  "DistributedDataParallel: the module differs across replicas (entry " +
                      std::to_string(i) + " of named_parameters() then named_buffers()): " + what +
                      "; every worker must construct the same module");
    }
  }
  throw_error(ErrorCode::kInternal,
              "DistributedDataParallel: module signatures differ (hash) but "
              "their texts agree");
}

void broadcast_from_chief(Strategy& strategy, torch::nn::Module& module) {
  torch::NoGradGuard no_grad;
  // Through host memory for a module already on a GPU (cross-replica
  // context has no replica stream to order a device broadcast with).
  auto broadcast = [&](const at::Tensor& v, const std::string& name) {
    at::Tensor host = v.to(torch::kCPU).contiguous();
    Tensor t = to_diststrat(host);
    strategy.broadcast(t, 0, name);
    if (!host.is_same(v)) const_cast<at::Tensor&>(v).copy_(host);
  };
  for (auto& p : module.named_parameters(true)) broadcast(p.value(), "ddp/parameter/" + p.key());
  for (auto& b : module.named_buffers(true)) broadcast(b.value(), "ddp/buffer/" + b.key());
}

}  // namespace diststrat::libtorch::ddp_detail
