// How the fusion engine's messages name a call's tensors: the name the user
// gave, or "tensor#i" for an unnamed one. The queue, the call signatures, the
// packs and the ZeRO-1 collectives all name tensors this way.
#pragma once

#include <string>
#include <vector>

namespace diststrat {

inline std::string name_at(const std::vector<std::string>& names, size_t i) {
  return i < names.size() && !names[i].empty() ? names[i] : "tensor#" + std::to_string(i);
}

}  // namespace diststrat
