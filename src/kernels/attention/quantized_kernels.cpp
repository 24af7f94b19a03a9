// SIMD dequantisation of quantized cache rows into f32 scratch (Highway, dynamic dispatch), the
// same values as posenc::dequantize_rows (quantized.hpp) to the bit, through the loader the
// in-place decode kernels use (QuantRow, quant_row-inl.h). See attention_kernels.hpp.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/attention/quantized_kernels.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include <cstdint>
#include <cstring>

#include "kernels/attention/attention_kernels.hpp"
#include "kernels/attention/quant_row-inl.h"
#include "posenc/dtype.hpp"

HWY_BEFORE_NAMESPACE();
namespace posenc::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;

// Rows of one format into f32 rows dim_padded apart (zeros past dim).
template <CacheFormat kFormat>
void DequantizeHeads(const unsigned char* src, std::int64_t seq_stride, std::int64_t head_stride, std::int64_t keys,
                     std::int64_t heads, std::int64_t dim, float* HWY_RESTRICT dst, std::int64_t dim_padded) {
  for (std::int64_t j = 0; j < keys; ++j) {
    for (std::int64_t g = 0; g < heads; ++g) {
      const unsigned char* row = src + j * seq_stride + g * head_stride;
      float* out = dst + (j * heads + g) * dim_padded;
      std::int64_t c = 0;
#if HWY_TARGET != HWY_SCALAR
      using Q = QuantRow<kFormat>;
      const DF d;
      const auto lanes = static_cast<std::int64_t>(hn::Lanes(d));
      auto scale = hn::Zero(d);
      for (; c + lanes <= dim; c += lanes) {
        if (c % Q::kGroup == 0) scale = Q::Scale(d, row, c);
        hn::StoreU(Q::Load(d, row, c, scale), d, out + c);
      }
#endif
      // The rest (fp8 rows whose width the lanes do not divide; every row on HWY_SCALAR): the
      // scalar definition, the same values.
      if (c < dim) {
        if constexpr (kFormat == CacheFormat::kFp8E4M3) {
          float scale_f;
          std::memcpy(&scale_f, row, sizeof(float));
          for (; c < dim; ++c) out[c] = scale_f * from_e4m3(row[sizeof(float) + c]);
        } else {
          dequantize_rows(kFormat, row, 0, 1, dim, out);
        }
      }
      for (std::int64_t t = dim; t < dim_padded; ++t) out[t] = 0.0f;
    }
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

void attn_dequantize_heads(const void* src, CacheFormat format, std::int64_t seq_stride, std::int64_t head_stride,
                           std::int64_t keys, std::int64_t heads, std::int64_t dim, float* dst,
                           std::int64_t dim_padded) {
  cache_row_bytes(format, dim);  // posenc::Error for a dim the format does not hold
  HWY_DYNAMIC_DISPATCH(AttnDequantizeHeads)(src, format, seq_stride, head_stride, keys, heads, dim, dst, dim_padded);
}

}  // namespace posenc::kernels
#endif  // HWY_ONCE
