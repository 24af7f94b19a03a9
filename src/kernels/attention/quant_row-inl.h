// A quantized cache row (quantized.hpp) read in registers, shared by the kernels that read such
// caches in place (attention_cache_kernels.cpp) and the one that dequantises rows into f32
// scratch (quantized_kernels.cpp). Highway per-target header: included after foreach_target.h.
//
// QuantRow<format>::Scale(d, row, c) broadcasts the scale of column c's group, and Load(d, row, c,
// scale) gives columns [c, c + lanes) as the exactly widened integer (E4M3 value) times that
// scale, one f32 multiply: the values of posenc::dequantize_rows to the bit. q4_0 on 16-lane
// targets instead: Scale gives the group's sixteen values (n − 8)·scale, and Load picks each
// column's by its nibble, one permute in place of a subtract, a conversion and a multiply (the
// same exact products). Row pointers count bytes. A vector never straddles two q8_0 / q4_0 blocks
// (lanes divide 32). Not on HWY_SCALAR.
#if defined(POSENC_KERNELS_ATTENTION_QUANT_ROW_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef POSENC_KERNELS_ATTENTION_QUANT_ROW_INL_H_
#undef POSENC_KERNELS_ATTENTION_QUANT_ROW_INL_H_
#else
#define POSENC_KERNELS_ATTENTION_QUANT_ROW_INL_H_
#endif

#include <hwy/highway.h>

#include <cstdint>
#include <cstring>

#include "posenc/dtype.hpp"
#include "posenc/quantized.hpp"

HWY_BEFORE_NAMESPACE();
namespace posenc::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#if HWY_TARGET != HWY_SCALAR
// E4M3 widened through f16 where F16C converts vectors of it (x86 AVX2 and above).
constexpr bool kFp8ThroughF16 = HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2;

template <CacheFormat kFormat>
struct QuantRow {
  using DQ = hn::ScalableTag<float>;
  using VQ = hn::Vec<DQ>;
  // Values per scale (fp8: the whole row, read at column 0).
  static constexpr std::int64_t kGroup = kFormat == CacheFormat::kFp8E4M3 ? std::int64_t{1} << 40 : 32;
  static constexpr std::int64_t kBlockBytes = kFormat == CacheFormat::kQ8_0 ? 34 : 18;

#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
  static constexpr bool kNibbleTable = kFormat == CacheFormat::kQ4_0;
#else
  static constexpr bool kNibbleTable = false;
#endif

  // The scale of column c (a multiple of kGroup) broadcast (kNibbleTable: times n − 8 in lane n).
  static HWY_INLINE VQ Scale(DQ d, const unsigned char* HWY_RESTRICT row, std::int64_t c) {
    if constexpr (kFormat == CacheFormat::kFp8E4M3) {
      (void)c;
      float scale;
      std::memcpy(&scale, row, sizeof(float));
      // With F16C, Load widens E4M3 through f16 at 2^-8 of its value: the scale takes the 2^8
      // (exact: s <= FLT_MAX / 448 keeps s·256 finite), so the product is s·e4m3, rounded once.
      return hn::Set(d, kFp8ThroughF16 ? scale * 256.0f : scale);
    } else {
      const unsigned char* at = row + c / 32 * kBlockBytes;
      const auto bits = static_cast<std::uint16_t>(at[0] | (at[1] << 8));
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2
      // F16C: the exact widening, broadcast.
      const hn::Rebind<hwy::float16_t, DQ> dh;
      const hn::RebindToUnsigned<decltype(dh)> du16;
      const VQ scale = hn::PromoteTo(d, hn::BitCast(dh, hn::Set(du16, bits)));
      if constexpr (kNibbleTable) return hn::Mul(hn::Sub(hn::Iota(d, 0.0f), hn::Set(d, 8.0f)), scale);
      return scale;
#else
      return hn::Set(d, from_f16(f16{bits}));
#endif
    }
  }

  // Columns [c, c + lanes) of the row, dequantised with `scale` (their group's).
  static HWY_INLINE VQ Load(DQ d, const unsigned char* HWY_RESTRICT row, std::int64_t c, VQ scale) {
    const hn::RebindToSigned<DQ> di;
    if constexpr (kFormat == CacheFormat::kQ8_0) {
      const hn::Rebind<std::int8_t, DQ> d8;
      const auto* q = reinterpret_cast<const std::int8_t*>(row + c / 32 * kBlockBytes + 2 + c % 32);
      return hn::Mul(hn::ConvertTo(d, hn::PromoteTo(di, hn::LoadU(d8, q))), scale);
    } else if constexpr (kNibbleTable) {
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
      // vpermps reads the low four bits of each index: the low nibble as it lies, the high one
      // shifted down.
      const hn::Rebind<std::uint8_t, DQ> du8;
      const auto bytes = hn::PromoteTo(hn::RebindToUnsigned<DQ>(), hn::LoadU(du8, row + c / 32 * kBlockBytes + 2));
      const auto index = c % 32 < 16 ? bytes : hn::ShiftRight<4>(bytes);
      return VQ{_mm512_permutexvar_ps(index.raw, scale.raw)};
#else
      return scale;  // never: kNibbleTable is false on this target
#endif
    } else if constexpr (kFormat == CacheFormat::kQ4_0) {
      const hn::Rebind<std::uint8_t, DQ> du8;
      const std::int64_t at = c % 32;
      const auto bytes = hn::BitCast(
          di, hn::PromoteTo(hn::RebindToUnsigned<DQ>(), hn::LoadU(du8, row + c / 32 * kBlockBytes + 2 + at % 16)));
      const auto nibbles = at < 16 ? hn::And(bytes, hn::Set(di, 0x0f)) : hn::ShiftRight<4>(bytes);
      return hn::Mul(hn::ConvertTo(d, hn::Sub(nibbles, hn::Set(di, 8))), scale);
    } else if constexpr (kFp8ThroughF16) {
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2
      // S.EEEE.MMM placed as the f16 S.0EEEE.MMM0000000 is the value times 2^-8 (f16's bias 15
      // against 7; subnormals too), widened exactly by F16C; S.1111.111 is NaN.
      const hn::Rebind<std::uint8_t, DQ> du8;
      const hn::Rebind<std::uint16_t, DQ> du16;
      const hn::Rebind<hwy::float16_t, DQ> dh;
      const auto bytes = hn::PromoteTo(du16, hn::LoadU(du8, row + sizeof(float) + c));
      const auto half = hn::Or(hn::ShiftLeft<7>(hn::And(bytes, hn::Set(du16, 0x7f))),
                               hn::ShiftLeft<8>(hn::And(bytes, hn::Set(du16, 0x80))));
      const VQ x = hn::PromoteTo(d, hn::BitCast(dh, half));
      // S.1111.111 became ±1.875 (480·2^-8, past E4M3's largest 448): no finite byte gives it.
      return hn::Mul(hn::IfThenElse(hn::Eq(hn::Abs(x), hn::Set(d, 1.875f)), hn::NaN(d), x), scale);
#else
      return scale;  // never: kFp8ThroughF16 is false on this target
#endif
    } else {
      // E4M3: normal bytes moved into f32's fields with the bias changed from 7 to 127, subnormals
      // m·2^-9 from the integer m (no f32 denormal on the way, so that a DAZ mode cannot flush
      // them), S.1111.111 NaN, then the sign.
      const hn::Rebind<std::uint8_t, DQ> du8;
      const hn::RebindToUnsigned<DQ> du;
      const auto bytes = hn::PromoteTo(du, hn::LoadU(du8, row + sizeof(float) + c));
      const auto mag = hn::And(bytes, hn::Set(du, 0x7f));
      const VQ normal = hn::BitCast(d, hn::Add(hn::ShiftLeft<20>(mag), hn::Set(du, 120u << 23)));
      const VQ subnormal = hn::Mul(hn::ConvertTo(d, hn::BitCast(di, mag)), hn::Set(d, 0x1p-9f));
      VQ x = hn::IfThenElse(hn::RebindMask(d, hn::Lt(mag, hn::Set(du, 8))), subnormal, normal);
      x = hn::IfThenElse(hn::RebindMask(d, hn::Eq(mag, hn::Set(du, 0x7f))), hn::NaN(d), x);
      x = hn::Or(x, hn::BitCast(d, hn::ShiftLeft<24>(hn::And(bytes, hn::Set(du, 0x80)))));
      return hn::Mul(x, scale);
    }
  }
};

#endif  // HWY_TARGET != HWY_SCALAR

}  // namespace HWY_NAMESPACE
}  // namespace posenc::kernels
HWY_AFTER_NAMESPACE();

#endif  // POSENC_KERNELS_ATTENTION_QUANT_ROW_INL_H_
