// SIMD dequantisation of quantized cache rows into f32 scratch (Highway, dynamic dispatch), the
// same values as posenc::dequantize_rows (quantized.hpp) to the bit, through the loader the
// in-place decode kernels use (QuantRow, quant_row-inl.h). See attention_kernels.hpp.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/attention/quantized_kernels.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "kernels/attention/attention_kernels.hpp"
#include "kernels/attention/quant_row-inl.h"
#include "posenc/dtype.hpp"
#include "posenc/error.hpp"

HWY_BEFORE_NAMESPACE();
namespace posenc::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;

// Columns [from, dim) of one row of a format into out[from, dim), then zeros to dim_padded; `from`
// a multiple of the lanes.
template <CacheFormat kFormat>
void DequantizeRow(const unsigned char* row, std::int64_t from, std::int64_t dim, float* HWY_RESTRICT out,
                   std::int64_t dim_padded) {
  std::int64_t c = from;
#if HWY_TARGET != HWY_SCALAR
  using Q = QuantRow<kFormat>;
  const DF d;
  const auto lanes = static_cast<std::int64_t>(hn::Lanes(d));
  auto scale = hn::Zero(d);
  for (; c + lanes <= dim; c += lanes) {
    if (c == from || c % Q::kGroup == 0) scale = Q::Scale(d, row, c);
    hn::StoreU(Q::Load(d, row, c, scale), d, out + c);
  }
#endif
  // The rest (fp8 rows whose width the lanes do not divide; every row on HWY_SCALAR): the scalar
  // definition, the same values.
  if (c < dim) {
    if constexpr (kFormat == CacheFormat::kFp8E4M3) {
      float scale_f;
      std::memcpy(&scale_f, row, sizeof(float));
      for (; c < dim; ++c) out[c] = scale_f * from_e4m3(row[sizeof(float) + c]);
    } else {
      // Whole blocks from the one holding c (c is a multiple of the lanes, which divide 32).
      const std::int64_t block = c / 32 * 32;
      dequantize_rows(kFormat, row + block / 32 * (kFormat == CacheFormat::kQ8_0 ? 34 : 18), 0, 1, dim - block,
                      out + block);
    }
  }
  for (std::int64_t t = dim; t < dim_padded; ++t) out[t] = 0.0f;
}

// Rows of one format into f32 rows dim_padded apart (zeros past dim).
template <CacheFormat kFormat>
void DequantizeHeads(const unsigned char* src, std::int64_t seq_stride, std::int64_t head_stride, std::int64_t keys,
                     std::int64_t heads, std::int64_t dim, float* HWY_RESTRICT dst, std::int64_t dim_padded) {
  for (std::int64_t j = 0; j < keys; ++j) {
    for (std::int64_t g = 0; g < heads; ++g) {
      DequantizeRow<kFormat>(src + j * seq_stride + g * head_stride, 0, dim, dst + (j * heads + g) * dim_padded,
                             dim_padded);
    }
  }
}

// DequantizeHeads with every key's rows rotated by the half-split RoPE of its table row: each pair
// of vectors dequantised and rotated in registers, a·c − b·s and b·c + a·s with the roundings of
// attn_rotate_half_split, so the bits of dequantising into scratch and rotating there (which
// reads every value back right after storing it). The pairs fill whole vectors
// (attn_dequantize_rotates).
template <CacheFormat kFormat>
void DequantizeRotateHeads(const unsigned char* src, std::int64_t seq_stride, std::int64_t head_stride,
                           std::int64_t keys, std::int64_t heads, std::int64_t dim, const float* HWY_RESTRICT cos_sin,
                           const std::int64_t* HWY_RESTRICT table_rows, std::int64_t half, float* HWY_RESTRICT dst,
                           std::int64_t dim_padded) {
#if HWY_TARGET != HWY_SCALAR
  using Q = QuantRow<kFormat>;
  const DF d;
  const auto lanes = static_cast<std::int64_t>(hn::Lanes(d));
  for (std::int64_t j = 0; j < keys; ++j) {
    const float* c = cos_sin + table_rows[j] * 2 * half;
    for (std::int64_t g = 0; g < heads; ++g) {
      const unsigned char* row = src + j * seq_stride + g * head_stride;
      float* out = dst + (j * heads + g) * dim_padded;
      for (std::int64_t i = 0; i < half; i += lanes) {
        const auto a = Q::Load(d, row, i, Q::Scale(d, row, i));
        const auto b = Q::Load(d, row, half + i, Q::Scale(d, row, half + i));
        const auto cs = hn::LoadU(d, c + i), sn = hn::LoadU(d, c + half + i);
        hn::StoreU(hn::NegMulAdd(b, sn, hn::Mul(a, cs)), d, out + i);
        hn::StoreU(hn::MulAdd(a, sn, hn::Mul(b, cs)), d, out + half + i);
      }
      DequantizeRow<kFormat>(row, 2 * half, dim, out, dim_padded);
    }
  }
#else
  (void)src, (void)seq_stride, (void)head_stride, (void)keys, (void)heads, (void)dim, (void)cos_sin, (void)table_rows,
      (void)half, (void)dst, (void)dim_padded;
#endif
}

bool AttnDequantizeRotates(std::int64_t half) {
#if HWY_TARGET == HWY_SCALAR
  (void)half;
  return false;
#else
  return half > 0 && half % static_cast<std::int64_t>(hn::Lanes(DF())) == 0;
#endif
}

void AttnDequantizeRotateHeads(const void* src, CacheFormat format, std::int64_t seq_stride, std::int64_t head_stride,
                               std::int64_t keys, std::int64_t heads, std::int64_t dim,
                               const float* HWY_RESTRICT cos_sin, const std::int64_t* HWY_RESTRICT table_rows,
                               std::int64_t half, float* HWY_RESTRICT dst, std::int64_t dim_padded) {
  const auto* bytes = static_cast<const unsigned char*>(src);
  switch (format) {
    case CacheFormat::kQ8_0:
      DequantizeRotateHeads<CacheFormat::kQ8_0>(bytes, seq_stride, head_stride, keys, heads, dim, cos_sin, table_rows,
                                                half, dst, dim_padded);
      break;
    case CacheFormat::kQ4_0:
      DequantizeRotateHeads<CacheFormat::kQ4_0>(bytes, seq_stride, head_stride, keys, heads, dim, cos_sin, table_rows,
                                                half, dst, dim_padded);
      break;
    case CacheFormat::kFp8E4M3:
      DequantizeRotateHeads<CacheFormat::kFp8E4M3>(bytes, seq_stride, head_stride, keys, heads, dim, cos_sin,
                                                   table_rows, half, dst, dim_padded);
      break;
  }
}

void AttnDequantizeHeads(const void* src, CacheFormat format, std::int64_t seq_stride, std::int64_t head_stride,
                         std::int64_t keys, std::int64_t heads, std::int64_t dim, float* HWY_RESTRICT dst,
                         std::int64_t dim_padded) {
  const auto* bytes = static_cast<const unsigned char*>(src);
  switch (format) {
    case CacheFormat::kQ8_0:
      DequantizeHeads<CacheFormat::kQ8_0>(bytes, seq_stride, head_stride, keys, heads, dim, dst, dim_padded);
      break;
    case CacheFormat::kQ4_0:
      DequantizeHeads<CacheFormat::kQ4_0>(bytes, seq_stride, head_stride, keys, heads, dim, dst, dim_padded);
      break;
    case CacheFormat::kFp8E4M3:
      DequantizeHeads<CacheFormat::kFp8E4M3>(bytes, seq_stride, head_stride, keys, heads, dim, dst, dim_padded);
      break;
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace posenc::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace posenc::kernels {

HWY_EXPORT(AttnDequantizeHeads);
HWY_EXPORT(AttnDequantizeRotates);
HWY_EXPORT(AttnDequantizeRotateHeads);

void attn_dequantize_heads(const void* src, CacheFormat format, std::int64_t seq_stride, std::int64_t head_stride,
                           std::int64_t keys, std::int64_t heads, std::int64_t dim, float* dst,
                           std::int64_t dim_padded) {
  cache_row_bytes(format, dim);  // posenc::Error for a dim the format does not hold
  HWY_DYNAMIC_DISPATCH(AttnDequantizeHeads)(src, format, seq_stride, head_stride, keys, heads, dim, dst, dim_padded);
}

bool attn_dequantize_rotates(std::int64_t half) { return HWY_DYNAMIC_DISPATCH(AttnDequantizeRotates)(half); }

void attn_dequantize_rotate_heads(const void* src, CacheFormat format, std::int64_t seq_stride,
                                  std::int64_t head_stride, std::int64_t keys, std::int64_t heads, std::int64_t dim,
                                  const float* cos_sin, const std::int64_t* table_rows, std::int64_t half, float* dst,
                                  std::int64_t dim_padded) {
  cache_row_bytes(format, dim);  // posenc::Error for a dim the format does not hold
  if (!attn_dequantize_rotates(half) || 2 * half > dim) {
    throw Error("attn_dequantize_rotate_heads", "half", std::to_string(half),
                "pairs that fill whole vectors within dim = " + std::to_string(dim) + " (attn_dequantize_rotates)");
  }
  HWY_DYNAMIC_DISPATCH(AttnDequantizeRotateHeads)
  (src, format, seq_stride, head_stride, keys, heads, dim, cos_sin, table_rows, half, dst, dim_padded);
}

}  // namespace posenc::kernels
#endif  // HWY_ONCE
