#include "posenc/dtype.hpp"

#include <cmath>

namespace posenc {

std::string_view dtype_name(DType dtype) noexcept {
  switch (dtype) {
    case DType::kF32:
      return "f32";
    case DType::kF64:
      return "f64";
    case DType::kBF16:
      return "bf16";
    case DType::kF16:
      return "f16";
  }
  return "?";
}

std::size_t dtype_size(DType dtype) noexcept {
  switch (dtype) {
    case DType::kF32:
      return 4;
    case DType::kF64:
      return 8;
    case DType::kBF16:
    case DType::kF16:
      return 2;
  }
  return 0;
}

bf16 to_bf16(float value) noexcept {
  std::uint32_t u = std::bit_cast<std::uint32_t>(value);
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep it a (quiet) NaN
    return bf16{static_cast<std::uint16_t>((u >> 16) | 0x0040u)};
  }
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return bf16{static_cast<std::uint16_t>(u >> 16)};
}

float from_bf16(bf16 value) noexcept { return std::bit_cast<float>(static_cast<std::uint32_t>(value.bits) << 16); }

f16 to_f16(float value) noexcept {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(value);
  const std::uint32_t sign = (bits >> 16) & 0x8000u;
  const std::uint32_t mag = bits & 0x7fffffffu;
  auto out = [sign](std::uint32_t h) { return f16{static_cast<std::uint16_t>(sign | h)}; };
  if (mag >= 0x7f800000u) return out(mag > 0x7f800000u ? 0x7e00u : 0x7c00u);  // NaN, Inf
  if (mag >= 0x477ff000u) return out(0x7c00u);                                // >= 65520 rounds past 65504 to infinity
  if (mag < 0x38800000u) {
    // Below 2^-14: a subnormal half, counted in units of 2^-24. The scaling by 2^24 is exact and
    // nearbyint rounds to nearest even; a result of 1024 is the encoding of 2^-14, as it should be.
    const float units = std::nearbyint(std::bit_cast<float>(mag) * 16777216.0f);
    return out(static_cast<std::uint32_t>(units));
  }
  const std::uint32_t exponent = (mag >> 23) - 127u + 15u;
  const std::uint32_t mantissa = mag & 0x7fffffu;
  std::uint32_t h = (exponent << 10) | (mantissa >> 13);
  const std::uint32_t rest = mantissa & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // a carry bumps the exponent: right
  return out(h);
}

float from_f16(f16 value) noexcept {
  const std::uint32_t h = value.bits;
  const std::uint32_t sign = (h & 0x8000u) << 16;
  const std::uint32_t exponent = (h >> 10) & 0x1fu;
  const std::uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 31) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

}  // namespace posenc
