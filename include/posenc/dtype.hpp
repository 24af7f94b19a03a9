// posenc/dtype.hpp — element types of tensor views, and the two 16-bit float formats.
//
// bf16 and f16 are stored as raw bits; conversions round to nearest, ties to even, and keep
// NaN a NaN. They are plain scalar helpers: kernels convert in bulk with SIMD.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace posenc {

enum class DType : std::uint8_t { kF32, kF64, kBF16, kF16 };

std::string_view dtype_name(DType dtype) noexcept;  // "f32", "f64", "bf16", "f16"
std::size_t dtype_size(DType dtype) noexcept;       // bytes per element

// Brain float: the top 16 bits of an IEEE binary32.
struct bf16 {
  std::uint16_t bits = 0;
};
// IEEE binary16.
struct f16 {
  std::uint16_t bits = 0;
};

bf16 to_bf16(float value) noexcept;
float from_bf16(bf16 value) noexcept;
f16 to_f16(float value) noexcept;
float from_f16(f16 value) noexcept;

template <class T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<float>() {
  return DType::kF32;
}
template <>
constexpr DType dtype_of<double>() {
  return DType::kF64;
}
template <>
constexpr DType dtype_of<bf16>() {
  return DType::kBF16;
}
template <>
constexpr DType dtype_of<f16>() {
  return DType::kF16;
}

}  // namespace posenc
