// Quantized cache rows: formats, the reference quantiser and dequantiser (posenc/quantized.hpp).
#include "posenc/quantized.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "posenc/dtype.hpp"
#include "posenc/error.hpp"

namespace posenc {

namespace {

constexpr const char* kWhere = "quantized cache";
constexpr std::int64_t kBlock = 32;                // values per q8_0 / q4_0 block
constexpr std::int64_t kQ8Bytes = 2 + kBlock;      // f16 scale, 32 int8
constexpr std::int64_t kQ4Bytes = 2 + kBlock / 2;  // f16 scale, 16 bytes of nibbles
constexpr std::int64_t kFp8ScaleBytes = 4;         // f32 scale ahead of the row
constexpr std::uint16_t kF16NaN = 0x7e00;
constexpr float kE4M3Max = 448.0f;

bool all_finite(const float* x, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(x[i])) return false;
  }
  return true;
}

void put_f16(unsigned char* at, std::uint16_t bits) {
  at[0] = static_cast<unsigned char>(bits & 0xff);
  at[1] = static_cast<unsigned char>(bits >> 8);
}
float get_f16(const unsigned char* at) { return from_f16(f16{static_cast<std::uint16_t>(at[0] | (at[1] << 8))}); }

void quantize_q8_0(const float* x, std::int64_t dim, unsigned char* dst) {
  for (std::int64_t b = 0; b < dim / kBlock; ++b, x += kBlock, dst += kQ8Bytes) {
    if (!all_finite(x, kBlock)) {
      put_f16(dst, kF16NaN);
      std::memset(dst + 2, 0, kBlock);
      continue;
    }
    float amax = 0.0f;
    for (std::int64_t i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    put_f16(dst, to_f16(d).bits);
    for (std::int64_t i = 0; i < kBlock; ++i) {
      const auto q = static_cast<std::int8_t>(std::round(x[i] * id));  // halves away from zero
      std::memcpy(dst + 2 + i, &q, 1);
    }
  }
}

void quantize_q4_0(const float* x, std::int64_t dim, unsigned char* dst) {
  for (std::int64_t b = 0; b < dim / kBlock; ++b, x += kBlock, dst += kQ4Bytes) {
    if (!all_finite(x, kBlock)) {
      put_f16(dst, kF16NaN);
      std::memset(dst + 2, 0, kBlock / 2);
      continue;
    }
    float amax = 0.0f, max = 0.0f;
    for (std::int64_t i = 0; i < kBlock; ++i) {
      if (amax < std::fabs(x[i])) {
        amax = std::fabs(x[i]);
        max = x[i];
      }
    }
    const float d = max / -8.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    put_f16(dst, to_f16(d).bits);
    // x·id lies in [−8, 8], so x·id + 8.5 >= 0.5 and truncation is the floor.
    const auto nibble = [&](float v) { return std::min(15, static_cast<int>(v * id + 8.5f)); };
    for (std::int64_t i = 0; i < kBlock / 2; ++i)
      dst[2 + i] = static_cast<unsigned char>(nibble(x[i]) | (nibble(x[i + kBlock / 2]) << 4));
  }
}

void quantize_fp8(const float* x, std::int64_t dim, unsigned char* dst) {
  float scale = std::numeric_limits<float>::quiet_NaN();
  if (all_finite(x, dim)) {
    float amax = 0.0f;
    for (std::int64_t i = 0; i < dim; ++i) amax = std::max(amax, std::fabs(x[i]));
    scale = amax / kE4M3Max;
    const float inv = scale != 0.0f ? 1.0f / scale : 0.0f;
    // |x·inv| <= 448·(1 + 2^-22): rounds to 448 at most.
    for (std::int64_t i = 0; i < dim; ++i) dst[kFp8ScaleBytes + i] = to_e4m3(x[i] * inv);
  } else {
    std::memset(dst + kFp8ScaleBytes, 0, static_cast<std::size_t>(dim));
  }
  std::memcpy(dst, &scale, kFp8ScaleBytes);
}

}  // namespace

std::string_view cache_format_name(CacheFormat format) noexcept {
  switch (format) {
    case CacheFormat::kQ8_0:
      return "q8_0";
    case CacheFormat::kQ4_0:
      return "q4_0";
    case CacheFormat::kFp8E4M3:
      return "fp8_e4m3";
  }
  return "?";
}

std::optional<CacheFormat> parse_cache_format(std::string_view name) noexcept {
  for (CacheFormat f : {CacheFormat::kQ8_0, CacheFormat::kQ4_0, CacheFormat::kFp8E4M3}) {
    if (name == cache_format_name(f)) return f;
  }
  return std::nullopt;
}

std::int64_t cache_row_bytes(CacheFormat format, std::int64_t dim) {
  if (format == CacheFormat::kFp8E4M3) {
    if (dim < 1 || dim > (std::int64_t{1} << 40))
      throw Error(kWhere, "dim", std::to_string(dim), "1 to 2^40 values per row");
    return kFp8ScaleBytes + dim;
  }
  if (dim < kBlock || dim % kBlock != 0 || dim > (std::int64_t{1} << 40)) {
    throw Error(kWhere, "dim", std::to_string(dim),
                "a positive multiple of 32 (" + std::string(cache_format_name(format)) + " blocks of 32 values)");
  }
  return dim / kBlock * (format == CacheFormat::kQ8_0 ? kQ8Bytes : kQ4Bytes);
}

std::int64_t cache_row_dim(CacheFormat format, std::int64_t row_bytes) {
  const std::int64_t block = format == CacheFormat::kQ8_0 ? kQ8Bytes : kQ4Bytes;
  const bool ok =
      format == CacheFormat::kFp8E4M3 ? row_bytes > kFp8ScaleBytes : row_bytes >= block && row_bytes % block == 0;
  if (!ok) {
    throw Error(kWhere, "row bytes", std::to_string(row_bytes),
                format == CacheFormat::kFp8E4M3 ? std::string("4 + dim, dim >= 1 (an f32 scale, then a byte per value)")
                                                : "a positive multiple of " + std::to_string(block) + " (" +
                                                      std::string(cache_format_name(format)) + " blocks)");
  }
  return format == CacheFormat::kFp8E4M3 ? row_bytes - kFp8ScaleBytes : row_bytes / block * kBlock;
}

void quantize_rows(CacheFormat format, const float* x, std::int64_t rows, std::int64_t dim, void* dst,
                   std::int64_t row_stride) {
  cache_row_bytes(format, dim);  // checks dim
  auto* out = static_cast<unsigned char*>(dst);
  for (std::int64_t r = 0; r < rows; ++r, x += dim, out += row_stride) {
    switch (format) {
      case CacheFormat::kQ8_0:
        quantize_q8_0(x, dim, out);
        break;
      case CacheFormat::kQ4_0:
        quantize_q4_0(x, dim, out);
        break;
      case CacheFormat::kFp8E4M3:
        quantize_fp8(x, dim, out);
        break;
    }
  }
}

void dequantize_rows(CacheFormat format, const void* src, std::int64_t row_stride, std::int64_t rows, std::int64_t dim,
                     float* x) {
  cache_row_bytes(format, dim);
  const auto* in = static_cast<const unsigned char*>(src);
  for (std::int64_t r = 0; r < rows; ++r, in += row_stride) {
    const unsigned char* row = in;
    switch (format) {
      case CacheFormat::kQ8_0:
        for (std::int64_t b = 0; b < dim / kBlock; ++b, row += kQ8Bytes) {
          const float d = get_f16(row);
          for (std::int64_t i = 0; i < kBlock; ++i) {
            std::int8_t q;
            std::memcpy(&q, row + 2 + i, 1);
            *x++ = d * static_cast<float>(q);
          }
        }
        break;
      case CacheFormat::kQ4_0:
        for (std::int64_t b = 0; b < dim / kBlock; ++b, row += kQ4Bytes) {
          const float d = get_f16(row);
          for (std::int64_t i = 0; i < kBlock; ++i) {
            const int n = i < kBlock / 2 ? row[2 + i] & 0x0f : row[2 + i - kBlock / 2] >> 4;
            *x++ = d * static_cast<float>(n - 8);
          }
        }
        break;
      case CacheFormat::kFp8E4M3: {
        float scale;
        std::memcpy(&scale, row, kFp8ScaleBytes);
        for (std::int64_t i = 0; i < dim; ++i) *x++ = scale * from_e4m3(row[kFp8ScaleBytes + i]);
        break;
      }
    }
  }
}

float from_e4m3(std::uint8_t bits) noexcept {
  const int exponent = (bits >> 3) & 0x0f, mantissa = bits & 0x07;
  float magnitude;
  if (exponent == 0x0f && mantissa == 0x07) {
    magnitude = std::numeric_limits<float>::quiet_NaN();
  } else if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -9);
  } else {
    magnitude = std::ldexp(static_cast<float>(8 + mantissa), exponent - 10);
  }
  return (bits & 0x80) != 0 ? -magnitude : magnitude;
}

std::uint8_t to_e4m3(float value) noexcept {
  const std::uint8_t sign = std::signbit(value) ? 0x80 : 0x00;
  const double a = std::fabs(static_cast<double>(value));
  if (std::isnan(a)) return sign | 0x7f;
  // The spacing of E4M3 values near a: 2^(e − 3) for a normal a in [2^e, 2^(e+1)), e >= −6;
  // 2^-9 below 2^-6 (subnormals). a / quantum is exact, nearbyint rounds to nearest even.
  int e = 0;
  std::frexp(a, &e);  // a = f·2^e, f in [0.5, 1): a in [2^(e−1), 2^e)
  const int quantum_exp = std::max(e - 1, -6) - 3;
  const double units = std::nearbyint(std::ldexp(a, -quantum_exp));
  const double r = std::ldexp(units, quantum_exp);
  // Past 448 (rounded to 480 or beyond, infinities included) E4M3FN has no value: NaN, as
  // torch.float8_e4m3fn converts.
  if (r > kE4M3Max) return sign | 0x7f;
  if (r < 0x1p-6) return sign | static_cast<std::uint8_t>(units);  // 8 units is the encoding of 2^-6
  int re = 0;
  std::frexp(r, &re);
  const int exponent = re - 1;                                              // r in [2^exponent, 2^(exponent+1))
  const auto mantissa = static_cast<int>(std::ldexp(r, 3 - exponent)) - 8;  // 0 … 7
  return sign | static_cast<std::uint8_t>(((exponent + 7) << 3) | mantissa);
}

}  // namespace posenc
