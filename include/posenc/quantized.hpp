// posenc/quantized.hpp — quantized KV caches: the row formats, and their reference quantiser.
//
// A quantized cache holds each (token, KV head) row of `dim` values in one of these formats:
//
//   q8_0      ggml's block_q8_0: per 32 values, an f16 scale d, then 32 int8 q    (34 bytes)
//             x_i = d·q_i
//   q4_0      ggml's block_q4_0: per 32 values, an f16 scale d, then 16 bytes      (18 bytes)
//             whose low nibbles hold values 0–15 and high nibbles values 16–31
//             x_i = d·(n_i − 8)
//   fp8_e4m3  a row: an f32 scale s (little-endian), then dim OCP E4M3FN bytes     (4 + dim bytes)
//             (bias 7, no infinities, S.1111.111 NaN)   x_i = f32(s·e4m3(b_i))
//
// q8_0 and q4_0 rows are laid out as ggml lays them (blocks of the row in order, scales
// little-endian, no padding), so a llama.cpp cache is read where it lies; their dim must be a
// multiple of 32. Dequantisation is exact in f32 for q8_0 and q4_0 (an 11-bit scale times an
// integer of at most 8 bits) and rounds once for fp8_e4m3: attention against a quantized cache
// computes what it computes against the f32 cache of the dequantised values.
//
// The quantisers follow the published definitions (ggml/src/ggml-quants.c, quantize_row_q8_0_ref
// and quantize_row_q4_0_ref; the OCP 8-bit floating point specification, 2023):
//   q8_0      d = max|x| / 127, q_i = round_half_away(x_i / d), d stored as f16 (nearest even)
//   q4_0      m = the x of largest magnitude (first on ties), d = m / −8,
//             n_i = min(15, ⌊x_i / d + 8.5⌋), d stored as f16
//   fp8_e4m3  s = max|x| / 448, b_i = e4m3(x_i / s) rounded to nearest even (|x_i / s| <= 448)
// (the divisions multiply by the reciprocal, in f32, as ggml does; a q8_0 or q4_0 scale past f16's
// range, max|x| beyond 65504·127 or 65504·8, reads back as inf or NaN, as in ggml). A block (q8_0, q4_0) or row
// (fp8_e4m3) holding an inf or NaN gets a NaN scale, so every value of it reads back as NaN; a
// block of zeros gets scale 0.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace posenc {

enum class CacheFormat : std::uint8_t { kQ8_0, kQ4_0, kFp8E4M3 };

std::string_view cache_format_name(CacheFormat format) noexcept;  // "q8_0", "q4_0", "fp8_e4m3"
std::optional<CacheFormat> parse_cache_format(std::string_view name) noexcept;

// Bytes of one row of `dim` values; posenc::Error naming dim unless dim >= 1 (and a multiple of
// 32 for q8_0 and q4_0).
std::int64_t cache_row_bytes(CacheFormat format, std::int64_t dim);
// The values a row of `row_bytes` bytes holds (the inverse); posenc::Error when no dim has it.
std::int64_t cache_row_dim(CacheFormat format, std::int64_t row_bytes);

// `rows` rows of `dim` values at x (rows dim apart) into rows of cache_row_bytes bytes at dst
// (row_stride bytes apart), and back. Scalar definitions: the reference the kernels are tested
// against, and the quantiser of posenc.KVCache.
void quantize_rows(CacheFormat format, const float* x, std::int64_t rows, std::int64_t dim, void* dst,
                   std::int64_t row_stride);
void dequantize_rows(CacheFormat format, const void* src, std::int64_t row_stride, std::int64_t rows, std::int64_t dim,
                     float* x);

// OCP E4M3FN byte <-> f32 (from_e4m3 is exact; to_e4m3 rounds to nearest even, and a value that
// rounds past 448, infinities included, becomes NaN, as torch.float8_e4m3fn converts).
float from_e4m3(std::uint8_t bits) noexcept;
std::uint8_t to_e4m3(float value) noexcept;

// One K or V operand of attention in a quantized format: rows [B, S, G, dim] at data, strides in
// bytes (every row cache_row_bytes(format, dim) bytes long).
struct QuantizedRows {
  const void* data = nullptr;
  std::int64_t batch = 1, seq = 0, heads = 0, dim = 0;
  std::int64_t batch_stride = 0, seq_stride = 0, head_stride = 0;
};

// AttentionSpec::cache (attention.hpp): keys and values read from a quantized cache.
struct QuantizedCache {
  CacheFormat format = CacheFormat::kQ8_0;
  QuantizedRows k, v;
};

}  // namespace posenc
