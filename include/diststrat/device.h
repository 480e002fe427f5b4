// Devices. A Device names where a replica computes and where a tensor lives:
// a CPU "device" is a worker thread sharing host memory; a GPU device is a
// (possibly logical) CUDA device. The GPU kind is part of the type from the
// start so that strategies are written once for both.
//
// Rules: plain values; no call blocks or communicates; thread-safe.
#pragma once

#include <string>

namespace diststrat {

enum class DeviceType { kCpu, kGpu };

struct Device {
  DeviceType type = DeviceType::kCpu;
  int index = 0;

  static Device cpu(int index = 0) { return Device{DeviceType::kCpu, index}; }
  static Device gpu(int index = 0) { return Device{DeviceType::kGpu, index}; }

  bool is_cpu() const { return type == DeviceType::kCpu; }
  bool is_gpu() const { return type == DeviceType::kGpu; }
  // "/device:CPU:0", "/device:GPU:1" (TensorFlow's spelling).
  std::string to_string() const;
  // Parses "cpu:0", "gpu:1", "/device:GPU:1" (case-insensitive); throws
  // InvalidArgumentError otherwise.
  static Device parse(const std::string& text);

  bool operator==(const Device& o) const { return type == o.type && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
  bool operator<(const Device& o) const { return type != o.type ? type < o.type : index < o.index; }
};

}  // namespace diststrat
