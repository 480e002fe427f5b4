// The state behind a Variable handle: what every strategy, optimizer and
// checkpoint reads and writes. Internal: users hold Variables, whose public
// header only names this type.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "diststrat/variable.h"

namespace diststrat {

struct Variable::Impl {
  std::string name;
  Shape shape;
  DType dtype = DType::kFloat32;
  VariableOptions options;
  Strategy* owner = nullptr;
  int64_t creation_index = 0;
  // Local copies: one per local replica (mirrored), or a single one.
  std::vector<Tensor> copies;
  // Optimizer slots (momentum, Adam moments): one vector of copies per slot
  // name, laid out like `copies`. Created zero-filled on first use.
  std::vector<Tensor>& slot(const std::string& slot_name);
  std::map<std::string, std::vector<Tensor>> slots;  // guarded by slots_mu
  std::mutex slots_mu;
};

}  // namespace diststrat
