#include "diststrat/device.h"

#include <algorithm>
#include <cctype>

#include "diststrat/error.h"

namespace diststrat {

std::string Device::to_string() const {
  return std::string("/device:") + (is_gpu() ? "GPU:" : "CPU:") + std::to_string(index);
}

Device Device::parse(const std::string& text) {
  std::string t = text;
  std::transform(t.begin(), t.end(), t.begin(), [](unsigned char c) { return std::tolower(c); });
  if (t.rfind("/device:", 0) == 0) t = t.substr(8);
  const auto colon = t.find(':');
  const std::string kind = t.substr(0, colon);
  int index = 0;
  if (colon != std::string::npos) {
    const std::string idx = t.substr(colon + 1);
    // At most 9 digits: std::stoi would throw std::out_of_range past INT_MAX.
    if (idx.empty() || idx.size() > 9 || !std::all_of(idx.begin(), idx.end(), ::isdigit)) {
      throw InvalidArgumentError("bad device '" + text.substr(0, 200) +
                                 "': index must be a non-negative integer below 10^9");
    }
    index = std::stoi(idx);
  }
  if (kind == "cpu") return cpu(index);
  if (kind == "gpu" || kind == "cuda") return gpu(index);
  throw InvalidArgumentError("bad device '" + text + "': expected cpu:N or gpu:N");
}

}  // namespace diststrat
