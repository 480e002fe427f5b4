// Element types, and the 16-bit float formats as plain value types.
// Rules: plain values; no call blocks or communicates; thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace diststrat {

enum class DType { kFloat32, kFloat64, kFloat16, kBFloat16, kInt32, kInt64 };

// Bytes per element.
size_t dtype_size(DType dtype);
// "float32", "float64", "float16", "bfloat16", "int32", "int64".
const char* dtype_name(DType dtype);
// safetensors spelling: "F32", "F64", "F16", "BF16", "I32", "I64".
const char* dtype_safetensors_name(DType dtype);
// Inverse of dtype_name / dtype_safetensors_name; throws InvalidArgumentError.
DType dtype_from_name(const std::string& name);
bool dtype_is_floating(DType dtype);

// IEEE 754 binary16, stored as bits; converts with round-to-nearest-even.
struct Half {
  uint16_t bits = 0;
  Half() = default;
  explicit Half(float f) : bits(from_float(f)) {}
  explicit operator float() const { return to_float(bits); }
  static uint16_t from_float(float f);
  static float to_float(uint16_t h);
};

// bfloat16 (the top half of a float32), round-to-nearest-even.
struct BFloat16 {
  uint16_t bits = 0;
  BFloat16() = default;
  explicit BFloat16(float f) : bits(from_float(f)) {}
  explicit operator float() const { return to_float(bits); }
  static uint16_t from_float(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
  }
  static float to_float(uint16_t b) {
    uint32_t u = static_cast<uint32_t>(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};

// The DType of a C++ element type: dtype_of<float>() == DType::kFloat32.
template <typename T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<float>() {
  return DType::kFloat32;
}
template <>
constexpr DType dtype_of<double>() {
  return DType::kFloat64;
}
template <>
constexpr DType dtype_of<Half>() {
  return DType::kFloat16;
}
template <>
constexpr DType dtype_of<BFloat16>() {
  return DType::kBFloat16;
}
template <>
constexpr DType dtype_of<int32_t>() {
  return DType::kInt32;
}
template <>
constexpr DType dtype_of<int64_t>() {
  return DType::kInt64;
}

}  // namespace diststrat
