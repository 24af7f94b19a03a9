// SIMD dequantisation of quantized cache rows into f32 (Highway, dynamic dispatch), the same
// values as posenc::dequantize_rows (quantized.hpp) to the bit: each is a scale times an exactly
// widened integer or E4M3 value, one f32 multiply. See attention_kernels.hpp.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/attention/quantized_kernels.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include <cstdint>
#include <cstring>
#include <limits>

#include "kernels/attention/attention_kernels.hpp"
#include "posenc/dtype.hpp"

HWY_BEFORE_NAMESPACE();
namespace posenc::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

constexpr std::int64_t kBlock = 32;

HWY_INLINE float BlockScale(const unsigned char* at) {
  return from_f16(f16{static_cast<std::uint16_t>(at[0] | (at[1] << 8))});
}

// One q8_0 row: per block, 32 int8 widened to f32 (exact) times the block's scale.
HWY_INLINE void RowQ8(const unsigned char* HWY_RESTRICT src, std::int64_t dim, float* HWY_RESTRICT dst) {
  const DF d;
  const hn::Rebind<std::int8_t, DF> d8;
  const hn::RebindToSigned<DF> di;
  const auto lanes = static_cast<std::int64_t>(hn::Lanes(d));
  for (std::int64_t b = 0; b < dim / kBlock; ++b, src += 2 + kBlock, dst += kBlock) {
    const VF scale = hn::Set(d, BlockScale(src));
    const auto* q = reinterpret_cast<const std::int8_t*>(src + 2);
    for (std::int64_t i = 0; i < kBlock; i += lanes)
      hn::StoreU(hn::Mul(hn::ConvertTo(d, hn::PromoteTo(di, hn::LoadU(d8, q + i))), scale), d, dst + i);
  }
}

// One q4_0 row: byte i of a block holds value i in its low nibble and value i + 16 in its high one.
HWY_INLINE void RowQ4(const unsigned char* HWY_RESTRICT src, std::int64_t dim, float* HWY_RESTRICT dst) {
  const DF d;
  const hn::Rebind<std::uint8_t, DF> du8;
  const hn::RebindToSigned<DF> di;
  const auto lanes = static_cast<std::int64_t>(hn::Lanes(d));
  const auto low = hn::Set(di, 0x0f), eight = hn::Set(di, 8);
  for (std::int64_t b = 0; b < dim / kBlock; ++b, src += 2 + kBlock / 2, dst += kBlock) {
    const VF scale = hn::Set(d, BlockScale(src));
    for (std::int64_t i = 0; i < kBlock / 2; i += lanes) {
      const auto bytes = hn::BitCast(di, hn::PromoteTo(hn::RebindToUnsigned<DF>(), hn::LoadU(du8, src + 2 + i)));
      const auto lo = hn::Sub(hn::And(bytes, low), eight), hi = hn::Sub(hn::ShiftRight<4>(bytes), eight);
      hn::StoreU(hn::Mul(hn::ConvertTo(d, lo), scale), d, dst + i);
      hn::StoreU(hn::Mul(hn::ConvertTo(d, hi), scale), d, dst + kBlock / 2 + i);
    }
  }
}

// One fp8_e4m3 row: normal bytes (exponent field >= 1) moved into f32's fields with the bias
// changed from 7 to 127; subnormals m·2^-9 from the integer m (no f32 denormal on the way, so
// that a DAZ mode cannot flush them); S.1111.111 NaN.
HWY_INLINE void RowFp8(const unsigned char* HWY_RESTRICT src, std::int64_t dim, float* HWY_RESTRICT dst) {
  float scale_f;
  std::memcpy(&scale_f, src, sizeof(float));
  src += sizeof(float);
  std::int64_t i = 0;
#if HWY_TARGET != HWY_SCALAR
  const DF d;
  const hn::Rebind<std::uint8_t, DF> du8;
  const hn::RebindToUnsigned<DF> du;
  const auto lanes = static_cast<std::int64_t>(hn::Lanes(d));
  const VF scale = hn::Set(d, scale_f), sub_unit = hn::Set(d, 0x1p-9f),
           nan = hn::Set(d, std::numeric_limits<float>::quiet_NaN());
  const auto mag_mask = hn::Set(du, 0x7f), sign_mask = hn::Set(du, 0x80), bias = hn::Set(du, 120u << 23);
  for (; i + lanes <= dim; i += lanes) {
    const auto bytes = hn::PromoteTo(du, hn::LoadU(du8, src + i));
    const auto mag = hn::And(bytes, mag_mask);
    const VF normal = hn::BitCast(d, hn::Add(hn::ShiftLeft<20>(mag), bias));
    const VF subnormal = hn::Mul(hn::ConvertTo(d, hn::BitCast(hn::RebindToSigned<DF>(), mag)), sub_unit);
    VF x = hn::IfThenElse(hn::RebindMask(d, hn::Lt(mag, hn::Set(du, 8))), subnormal, normal);
    x = hn::IfThenElse(hn::RebindMask(d, hn::Eq(mag, mag_mask)), nan, x);
    x = hn::Or(x, hn::BitCast(d, hn::ShiftLeft<24>(hn::And(bytes, sign_mask))));
    hn::StoreU(hn::Mul(x, scale), d, dst + i);
  }
#endif
  for (; i < dim; ++i) dst[i] = scale_f * from_e4m3(src[i]);
}

void AttnDequantizeHeads(const void* src, CacheFormat format, std::int64_t seq_stride, std::int64_t head_stride,
                         std::int64_t keys, std::int64_t heads, std::int64_t dim, float* HWY_RESTRICT dst,
                         std::int64_t dim_padded) {
  for (std::int64_t j = 0; j < keys; ++j) {
    for (std::int64_t g = 0; g < heads; ++g) {
      const auto* row = static_cast<const unsigned char*>(src) + j * seq_stride + g * head_stride;
      float* out = dst + (j * heads + g) * dim_padded;
      switch (format) {
        case CacheFormat::kQ8_0:
          RowQ8(row, dim, out);
          break;
        case CacheFormat::kQ4_0:
          RowQ4(row, dim, out);
          break;
        case CacheFormat::kFp8E4M3:
          RowFp8(row, dim, out);
          break;
      }
      for (std::int64_t t = dim; t < dim_padded; ++t) out[t] = 0.0f;
    }
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
