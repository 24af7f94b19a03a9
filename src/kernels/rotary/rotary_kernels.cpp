// SIMD kernels of rotary position embedding (Highway, dynamic dispatch). See rotary_kernels.hpp
// for the coefficient layout and posenc/rotary.hpp for the math.
//
// rope_state_*: θ = p·ω in fp64, SinPair (kernels/common/sincos-inl.h) for exact sin/cos at the
//   start of a run of consecutive positions, an fp64 rotation by ω per further position; times α,
//   rounded once to f32 — the angle keeps every bit an fp32 `p·ω` would lose.
// rope_rotate_f32: out = x·cos_e + partner(x)·sin_e over the rotated entries, in f32:
//   half-split      partner vectors are the other half, loaded contiguously;
//   interleaved     partner vector = x with adjacent lanes swapped (Shuffle2301); the one-lane
//                   HWY_SCALAR target pairs entries in a plain loop instead.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/rotary/rotary_kernels.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include <cstdint>
#include <cstring>

#include "kernels/common/sincos-inl.h"
#include "kernels/common/store-inl.h"
#include "kernels/rotary/rotary_kernels.hpp"
#include "posenc/dtype.hpp"

HWY_BEFORE_NAMESPACE();
namespace posenc::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using common::HWY_NAMESPACE::SinPair;
using common::HWY_NAMESPACE::StoreOrStream;
using common::HWY_NAMESPACE::StreamableTag;

// Full vectors of doubles are read and written up to kRopePadding entries past the rotary dims.
static_assert(hn::MaxLanes(hn::ScalableTag<double>()) <= kRopePadding, "rope tables need more padding");

void RopeStateStart(const RopeColumns& cols, double position, double* HWY_RESTRICT state) {
  const hn::ScalableTag<double> dd;
  const auto n = static_cast<std::int64_t>(hn::Lanes(dd));
  const std::int64_t r = cols.rotary_dim, half = r / 2;
  const std::int64_t stride = r + kRopePadding;
  const auto p = hn::Set(dd, position);
  // One SinPair per pair (not per entry): both members of a pair share (cos θ, sin θ).
  HWY_ALIGN double c_buf[hn::MaxLanes(dd)];
  HWY_ALIGN double s_buf[hn::MaxLanes(dd)];
  for (std::int64_t i = 0; i < half; i += n) {
    hn::Vec<decltype(dd)> s, c;
    SinPair(dd, hn::Mul(p, hn::LoadU(dd, cols.pair_freq + i)), hn::Zero(dd), s, c);
    if (!cols.interleaved && i + n <= half) {  // entries i and i + r/2
      hn::StoreU(c, dd, state + i);
      hn::StoreU(s, dd, state + stride + i);
      hn::StoreU(c, dd, state + half + i);
      hn::StoreU(s, dd, state + stride + half + i);
      continue;
    }
    // Interleaved (entries 2i and 2i + 1), or the last, partial vector of pairs.
    hn::Store(c, dd, c_buf);
    hn::Store(s, dd, s_buf);
    const std::int64_t count = half - i < n ? half - i : n;
    for (std::int64_t l = 0; l < count; ++l) {
      const std::int64_t first = cols.interleaved ? 2 * (i + l) : i + l;
      const std::int64_t second = cols.interleaved ? first + 1 : first + half;
      state[first] = state[second] = c_buf[l];
      state[stride + first] = state[stride + second] = s_buf[l];
    }
  }
}

void RopeStateStep(const RopeColumns& cols, double* HWY_RESTRICT state) {
  const hn::ScalableTag<double> dd;
  const auto n = static_cast<std::int64_t>(hn::Lanes(dd));
  const std::int64_t stride = cols.rotary_dim + kRopePadding;
  for (std::int64_t j = 0; j < cols.rotary_dim; j += n) {
    // (cos, sin)(θ + ω) = (cos θ·cos ω − sin θ·sin ω, sin θ·cos ω + cos θ·sin ω)
    const auto c = hn::LoadU(dd, state + j), s = hn::LoadU(dd, state + stride + j);
    const auto sc = hn::LoadU(dd, cols.step_cos + j), ss = hn::LoadU(dd, cols.step_sin + j);
    hn::StoreU(hn::NegMulAdd(s, ss, hn::Mul(c, sc)), dd, state + j);
    hn::StoreU(hn::MulAdd(c, ss, hn::Mul(s, sc)), dd, state + stride + j);
  }
}

void RopeStateEmit(const RopeColumns& cols, const double* HWY_RESTRICT state, double alpha,
                   float* HWY_RESTRICT cos_e, float* HWY_RESTRICT sin_e) {
  const hn::ScalableTag<double> dd;
  const hn::Rebind<float, decltype(dd)> df;
  const auto n = static_cast<std::int64_t>(hn::Lanes(dd));
  const std::int64_t stride = cols.rotary_dim + kRopePadding;
  const auto a = hn::Set(dd, alpha);
  // cos_e and sin_e hold r + kRopePadding floats: full vectors may be stored past r.
  for (std::int64_t j = 0; j < cols.rotary_dim; j += n) {
    hn::StoreU(hn::DemoteTo(df, hn::Mul(hn::LoadU(dd, state + j), a)), df, cos_e + j);
    const auto signed_alpha = hn::Mul(hn::LoadU(dd, cols.sign + j), a);
    hn::StoreU(hn::DemoteTo(df, hn::Mul(hn::LoadU(dd, state + stride + j), signed_alpha)), df, sin_e + j);
  }
}

void RopeRotateF32(const float* cos_e, const float* sin_e, std::int64_t rotary_dim,
                   bool interleaved, std::int64_t head_dim, std::int64_t heads, const float* x,
                   std::int64_t x_head_stride, float* out, std::int64_t out_head_stride, bool stream) {
  const hn::ScalableTag<float> df;
  [[maybe_unused]] const auto n = static_cast<std::int64_t>(hn::Lanes(df));
  const std::int64_t half = rotary_dim / 2;
  stream = stream && StreamableTag(df);
  for (std::int64_t h = 0; h < heads; ++h) {
    const float* src = x + h * x_head_stride;
    float* dst = out + h * out_head_stride;
    std::int64_t j = 0;
    if (interleaved) {
#if HWY_TARGET != HWY_SCALAR
      for (; j + n <= rotary_dim; j += n) {
        const auto v = hn::LoadU(df, src + j);
        const auto swapped = hn::Shuffle2301(v);
        StoreOrStream(hn::MulAdd(swapped, hn::LoadU(df, sin_e + j), hn::Mul(v, hn::LoadU(df, cos_e + j))),
                 df, dst + j, stream);
      }
#endif
      for (; j < rotary_dim; j += 2) {  // tail (and the whole row on HWY_SCALAR)
        const float a = src[j], b = src[j + 1];
        dst[j] = a * cos_e[j] + b * sin_e[j];
        dst[j + 1] = b * cos_e[j + 1] + a * sin_e[j + 1];
      }
    } else {
      for (; j + n <= half; j += n) {
        const auto a = hn::LoadU(df, src + j);
        const auto b = hn::LoadU(df, src + half + j);
        const auto first = hn::MulAdd(b, hn::LoadU(df, sin_e + j), hn::Mul(a, hn::LoadU(df, cos_e + j)));
        const auto second = hn::MulAdd(a, hn::LoadU(df, sin_e + half + j), hn::Mul(b, hn::LoadU(df, cos_e + half + j)));
        StoreOrStream(first, df, dst + j, stream);
        StoreOrStream(second, df, dst + half + j, stream);
      }
      for (; j < half; ++j) {
        const float a = src[j], b = src[half + j];
        dst[j] = a * cos_e[j] + b * sin_e[j];
        dst[half + j] = b * cos_e[half + j] + a * sin_e[half + j];
      }
    }
    if (dst != src && head_dim > rotary_dim) {
      std::memcpy(dst + rotary_dim, src + rotary_dim, static_cast<size_t>(head_dim - rotary_dim) * sizeof(float));
    }
  }
}

// bf16 ↔ f32 for a vector of DF lanes. Widening is exact (bf16 is the top half of an f32);
// narrowing rounds to nearest even (Highway 1.0.3's DemoteTo truncates) and keeps NaN a NaN.
template <class DF>
HWY_INLINE hn::Vec<DF> LoadBF16(DF df, const std::uint16_t* p) {
  const hn::RebindToUnsigned<DF> du32;
  const hn::Rebind<std::uint16_t, DF> du16;
  return hn::BitCast(df, hn::ShiftLeft<16>(hn::PromoteTo(du32, hn::LoadU(du16, p))));
}

template <class DF>
HWY_INLINE void StoreBF16(hn::Vec<DF> v, DF /* tag */, std::uint16_t* p) {
  const hn::RebindToUnsigned<DF> du32;
  const hn::RebindToSigned<DF> di32;
  const hn::Rebind<std::uint16_t, DF> du16;
  const auto bits = hn::BitCast(du32, v);
  const auto odd = hn::And(hn::ShiftRight<16>(bits), hn::Set(du32, 1));
  auto rounded = hn::ShiftRight<16>(hn::Add(bits, hn::Add(hn::Set(du32, 0x7fff), odd)));
  const auto quiet_nan = hn::Or(hn::ShiftRight<16>(bits), hn::Set(du32, 0x40));
  rounded = hn::IfThenElse(hn::RebindMask(du32, hn::IsNaN(v)), quiet_nan, rounded);
  hn::StoreU(hn::DemoteTo(du16, hn::BitCast(di32, rounded)), du16, p);
}

void RopeRotateBF16(const float* cos_e, const float* sin_e, std::int64_t rotary_dim, bool interleaved,
                    std::int64_t head_dim, std::int64_t heads, const std::uint16_t* x, std::int64_t x_head_stride,
                    std::uint16_t* out, std::int64_t out_head_stride) {
  const hn::ScalableTag<float> df;
  [[maybe_unused]] const auto n = static_cast<std::int64_t>(hn::Lanes(df));
  const std::int64_t half = rotary_dim / 2;
  const auto widen = [](std::uint16_t b) { return from_bf16(bf16{b}); };
  const auto narrow = [](float f) { return to_bf16(f).bits; };
  for (std::int64_t h = 0; h < heads; ++h) {
    const std::uint16_t* src = x + h * x_head_stride;
    std::uint16_t* dst = out + h * out_head_stride;
    std::int64_t j = 0;
    if (interleaved) {
#if HWY_TARGET != HWY_SCALAR
      for (; j + n <= rotary_dim; j += n) {
        const auto v = LoadBF16(df, src + j);
        StoreBF16(hn::MulAdd(hn::Shuffle2301(v), hn::LoadU(df, sin_e + j), hn::Mul(v, hn::LoadU(df, cos_e + j))), df, dst + j);
      }
#endif
      for (; j < rotary_dim; j += 2) {
        const float a = widen(src[j]), b = widen(src[j + 1]);
        dst[j] = narrow(a * cos_e[j] + b * sin_e[j]);
        dst[j + 1] = narrow(b * cos_e[j + 1] + a * sin_e[j + 1]);
      }
    } else {
      for (; j + n <= half; j += n) {
        const auto a = LoadBF16(df, src + j);
        const auto b = LoadBF16(df, src + half + j);
        StoreBF16(hn::MulAdd(b, hn::LoadU(df, sin_e + j), hn::Mul(a, hn::LoadU(df, cos_e + j))), df, dst + j);
        StoreBF16(hn::MulAdd(a, hn::LoadU(df, sin_e + half + j), hn::Mul(b, hn::LoadU(df, cos_e + half + j))), df,
                  dst + half + j);
      }
      for (; j < half; ++j) {
        const float a = widen(src[j]), b = widen(src[half + j]);
        dst[j] = narrow(a * cos_e[j] + b * sin_e[j]);
        dst[half + j] = narrow(b * cos_e[half + j] + a * sin_e[half + j]);
      }
    }
    if (dst != src && head_dim > rotary_dim) {
      std::memcpy(dst + rotary_dim, src + rotary_dim, static_cast<size_t>(head_dim - rotary_dim) * sizeof(std::uint16_t));
    }
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace posenc::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace posenc::kernels {

HWY_EXPORT(RopeStateStart);
HWY_EXPORT(RopeStateStep);
HWY_EXPORT(RopeStateEmit);
HWY_EXPORT(RopeRotateF32);
HWY_EXPORT(RopeRotateBF16);

void rope_state_start(const RopeColumns& cols, double position, double* state) {
  HWY_DYNAMIC_DISPATCH(RopeStateStart)(cols, position, state);
}
void rope_state_step(const RopeColumns& cols, double* state) {
  HWY_DYNAMIC_DISPATCH(RopeStateStep)(cols, state);
}
void rope_state_emit(const RopeColumns& cols, const double* state, double alpha, float* cos_e, float* sin_e) {
  HWY_DYNAMIC_DISPATCH(RopeStateEmit)(cols, state, alpha, cos_e, sin_e);
}
void rope_rotate_f32(const float* cos_e, const float* sin_e, std::int64_t rotary_dim,
                     bool interleaved, std::int64_t head_dim, std::int64_t heads, const float* x,
                     std::int64_t x_head_stride, float* out, std::int64_t out_head_stride, bool stream) {
  HWY_DYNAMIC_DISPATCH(RopeRotateF32)(cos_e, sin_e, rotary_dim, interleaved, head_dim, heads, x,
                                      x_head_stride, out, out_head_stride, stream);
}

void rope_rotate_bf16(const float* cos_e, const float* sin_e, std::int64_t rotary_dim, bool interleaved,
                      std::int64_t head_dim, std::int64_t heads, const std::uint16_t* x, std::int64_t x_head_stride,
                      std::uint16_t* out, std::int64_t out_head_stride) {
  HWY_DYNAMIC_DISPATCH(RopeRotateBF16)(cos_e, sin_e, rotary_dim, interleaved, head_dim, heads, x, x_head_stride, out,
                                       out_head_stride);
}

}  // namespace posenc::kernels
#endif  // HWY_ONCE
