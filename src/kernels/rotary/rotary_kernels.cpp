// SIMD kernels of rotary position embedding (Highway, dynamic dispatch). See rotary_kernels.hpp
// for the coefficient layout and posenc/rotary.hpp for the math.
//
// rope_coefficients: θ_i = p·ω_i in fp64, SinPair (kernels/common/sincos-inl.h) for exact
//   sin/cos, times α, rounded once to f32 — the angle keeps every bit an fp32 `p·ω` would lose.
// rope_rotate_f32: out = x·cos_e + partner(x)·sin_e over the rotated entries, in f32:
//   half-split      partner vectors are the other half, loaded contiguously;
//   interleaved     partner vector = x with adjacent lanes swapped (Shuffle2301); the one-lane
//                   HWY_SCALAR target pairs entries in a plain loop instead.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/rotary/rotary_kernels.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include <cstring>

#include "kernels/common/sincos-inl.h"
#include "kernels/rotary/rotary_kernels.hpp"

HWY_BEFORE_NAMESPACE();
namespace posenc::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using common::HWY_NAMESPACE::SinPair;

void RopeCoefficients(const double* inv_freq, std::int64_t rotary_dim, bool interleaved,
                      bool inverse, double alpha, double position, float* cos_e, float* sin_e) {
  const hn::ScalableTag<double> dd;
  const hn::Rebind<float, decltype(dd)> df;
  const auto n = static_cast<std::int64_t>(hn::Lanes(dd));
  const std::int64_t half = rotary_dim / 2;
  const auto p = hn::Set(dd, position);
  const auto a = hn::Set(dd, alpha);
  const auto zero = hn::Zero(dd);
  // sin_e of the first member of a pair is −α·sin θ (forward); the inverse flips both signs.
  const float first_sign = inverse ? 1.0f : -1.0f;
  HWY_ALIGN float c_buf[hn::MaxLanes(df)];
  HWY_ALIGN float s_buf[hn::MaxLanes(df)];
  for (std::int64_t i = 0; i < half; i += n) {
    hn::Vec<decltype(dd)> s, c;
    SinPair(dd, hn::Mul(p, hn::LoadU(dd, inv_freq + i)), zero, s, c);
    hn::Store(hn::DemoteTo(df, hn::Mul(c, a)), df, c_buf);
    hn::Store(hn::DemoteTo(df, hn::Mul(s, a)), df, s_buf);
    const std::int64_t count = half - i < n ? half - i : n;
    for (std::int64_t l = 0; l < count; ++l) {
      const std::int64_t pair = i + l;
      const std::int64_t first = interleaved ? 2 * pair : pair;
      const std::int64_t second = interleaved ? 2 * pair + 1 : pair + half;
      cos_e[first] = cos_e[second] = c_buf[l];
      sin_e[first] = first_sign * s_buf[l];
      sin_e[second] = -first_sign * s_buf[l];
    }
  }
}

void RopeRotateF32(const float* cos_e, const float* sin_e, std::int64_t rotary_dim,
                   bool interleaved, std::int64_t head_dim, std::int64_t heads, const float* x,
                   std::int64_t x_head_stride, float* out, std::int64_t out_head_stride) {
  const hn::ScalableTag<float> df;
  [[maybe_unused]] const auto n = static_cast<std::int64_t>(hn::Lanes(df));
  const std::int64_t half = rotary_dim / 2;
  for (std::int64_t h = 0; h < heads; ++h) {
    const float* src = x + h * x_head_stride;
    float* dst = out + h * out_head_stride;
    std::int64_t j = 0;
    if (interleaved) {
#if HWY_TARGET != HWY_SCALAR
      for (; j + n <= rotary_dim; j += n) {
        const auto v = hn::LoadU(df, src + j);
        const auto swapped = hn::Shuffle2301(v);
        hn::StoreU(hn::MulAdd(swapped, hn::LoadU(df, sin_e + j), hn::Mul(v, hn::LoadU(df, cos_e + j))),
                   df, dst + j);
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
        hn::StoreU(first, df, dst + j);
        hn::StoreU(second, df, dst + half + j);
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

}  // namespace HWY_NAMESPACE
}  // namespace posenc::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace posenc::kernels {

HWY_EXPORT(RopeCoefficients);
HWY_EXPORT(RopeRotateF32);

void rope_coefficients(const double* inv_freq, std::int64_t rotary_dim, bool interleaved,
                       bool inverse, double alpha, double position, float* cos_e, float* sin_e) {
  HWY_DYNAMIC_DISPATCH(RopeCoefficients)(inv_freq, rotary_dim, interleaved, inverse, alpha,
                                         position, cos_e, sin_e);
}

void rope_rotate_f32(const float* cos_e, const float* sin_e, std::int64_t rotary_dim,
                     bool interleaved, std::int64_t head_dim, std::int64_t heads, const float* x,
                     std::int64_t x_head_stride, float* out, std::int64_t out_head_stride) {
  HWY_DYNAMIC_DISPATCH(RopeRotateF32)(cos_e, sin_e, rotary_dim, interleaved, head_dim, heads, x,
                                      x_head_stride, out, out_head_stride);
}

}  // namespace posenc::kernels
#endif  // HWY_ONCE
