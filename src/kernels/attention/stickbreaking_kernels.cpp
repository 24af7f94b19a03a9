// SIMD kernels of stick-breaking attention (Highway, dynamic dispatch). See stickbreaking_kernels.hpp.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/attention/stickbreaking_kernels.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>
#include <hwy/contrib/math/math-inl.h>

#include <cstdint>

#include "kernels/attention/stickbreaking_kernels.hpp"

HWY_BEFORE_NAMESPACE();
namespace posenc::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using DI = hn::RebindToSigned<DF>;
using VF = hn::Vec<DF>;

// exp with arguments below kSbDead flushed to 0 and NaN kept (Highway's Exp clamps its argument).
HWY_INLINE VF ExpOrZero(DF d, VF x) {
  return hn::IfThenElse(hn::IsNaN(x), x, hn::IfThenZeroElse(hn::Lt(x, hn::Set(d, kSbDead)), hn::Exp(d, x)));
}

// softplus(z) and softplus(−z) from their shared log1p(e^−|z|): z = +inf gives (inf, 0), −inf
// (0, inf), NaN NaN in both (the log1p term carries it past Max). Also e = e^−|z|.
struct Softplus {
  VF pos, neg, e;
};
HWY_INLINE Softplus SoftplusBoth(DF d, VF z) {
  const VF e = hn::Exp(d, hn::Neg(hn::Abs(z)));
  // Exp(−inf) may come back as a tiny clamp value rather than 0; log1p of it is below 2^−126.
  const VF t = hn::IfThenElse(hn::IsNaN(z), z, hn::Log1p(d, e));
  return {hn::Add(hn::Max(z, hn::Zero(d)), t), hn::Add(hn::Max(hn::Neg(z), hn::Zero(d)), t), e};
}

template <bool kMasked>
void ForwardLanes(float* HWY_RESTRICT st, std::int64_t keys, std::int64_t width, std::int64_t k_first,
                  const std::int32_t* HWY_RESTRICT hi, float* HWY_RESTRICT carry, std::int64_t r) {
  const DF d;
  const DI di;
  VF c = hn::LoadU(d, carry + r);
  const auto hv = kMasked ? hn::LoadU(di, hi + r) : hn::Zero(di);
  for (std::int64_t j = keys - 1; j >= 0; --j) {
    float* at = st + j * width + r;
    const VF z = hn::LoadU(d, at);
    const Softplus sp = SoftplusBoth(d, z);
    VF a = ExpOrZero(d, hn::Sub(c, sp.neg));
    VF next = hn::Sub(c, sp.pos);
    if constexpr (kMasked) {
      const auto seen = hn::RebindMask(d, hn::Lt(hn::Set(di, static_cast<std::int32_t>(k_first + j)), hv));
      a = hn::IfThenElseZero(seen, a);
      next = hn::IfThenElse(seen, next, c);
    }
    hn::StoreU(a, d, at);
    c = next;
  }
  hn::StoreU(c, d, carry + r);
}

void SbForwardTile(float* HWY_RESTRICT st, std::int64_t keys, std::int64_t width, std::int64_t k_first,
                   const std::int32_t* HWY_RESTRICT hi, bool masked, float* HWY_RESTRICT carry) {
  const auto n = static_cast<std::int64_t>(hn::Lanes(DF()));
  for (std::int64_t r = 0; r < width; r += n) {
    if (masked) {
      ForwardLanes<true>(st, keys, width, k_first, hi, carry, r);
    } else {
      ForwardLanes<false>(st, keys, width, k_first, hi, carry, r);
    }
  }
}

template <bool kMasked>
void BackwardLanes(float* HWY_RESTRICT st, float* HWY_RESTRICT dpt, std::int64_t keys, std::int64_t width,
                   std::int64_t k_first, const std::int32_t* HWY_RESTRICT hi, const float* HWY_RESTRICT total,
                   const float* HWY_RESTRICT d_rem, float* HWY_RESTRICT carry, float* HWY_RESTRICT suffix,
                   std::int64_t r) {
  const DF d;
  const DI di;
  VF c = hn::LoadU(d, carry + r), u = hn::LoadU(d, suffix + r);
  const VF g_total = hn::LoadU(d, total + r), dr = hn::LoadU(d, d_rem + r);
  const VF one = hn::Set(d, 1.0f), dead = hn::Set(d, kSbDead);
  const auto hv = kMasked ? hn::LoadU(di, hi + r) : hn::Zero(di);
  for (std::int64_t j = keys - 1; j >= 0; --j) {
    float* at = st + j * width + r;
    float* dat = dpt + j * width + r;
    const VF z = hn::LoadU(d, at);
    const Softplus sp = SoftplusBoth(d, z);
    VF a = ExpOrZero(d, hn::Sub(c, sp.neg));
    VF next = hn::Sub(c, sp.pos);
    VF g = hn::Mul(a, hn::Sub(hn::LoadU(d, dat), dr));
    // Visible keys (every one when not masked); the others keep a, g and dz at 0, the carry as is.
    const auto seen = kMasked ? hn::RebindMask(d, hn::Lt(hn::Set(di, static_cast<std::int32_t>(k_first + j)), hv))
                              : hn::FirstN(d, hn::Lanes(d));
    if constexpr (kMasked) {
      a = hn::IfThenElseZero(seen, a);
      g = hn::IfThenElseZero(seen, g);
      next = hn::IfThenElse(seen, next, c);
    }
    u = hn::Add(u, g);
    // σ(z) and σ(−z) from e = e^−|z|: 1/(1 + e) for the sign of z, e/(1 + e) for the other.
    const VF inv = hn::Div(one, hn::Add(one, sp.e));
    const VF small = hn::Mul(sp.e, inv);
    const auto positive = hn::Ge(z, hn::Zero(d));
    const VF sig = hn::IfThenElse(positive, inv, small);
    const VF sig_neg = hn::IfThenElse(positive, small, inv);
    const VF rest = hn::IfThenZeroElse(hn::Lt(next, dead), hn::Sub(g_total, u));
    VF dz = hn::NegMulAdd(sig, rest, hn::Mul(g, sig_neg));
    if constexpr (kMasked) dz = hn::IfThenElseZero(seen, dz);
    hn::StoreU(a, d, at);
    hn::StoreU(dz, d, dat);
    c = next;
  }
  hn::StoreU(c, d, carry + r);
  hn::StoreU(u, d, suffix + r);
}

void SbBackwardTile(float* HWY_RESTRICT st, float* HWY_RESTRICT dpt, std::int64_t keys, std::int64_t width,
                    std::int64_t k_first, const std::int32_t* HWY_RESTRICT hi, bool masked,
                    const float* HWY_RESTRICT total, const float* HWY_RESTRICT d_rem, float* HWY_RESTRICT carry,
                    float* HWY_RESTRICT suffix) {
  const auto n = static_cast<std::int64_t>(hn::Lanes(DF()));
  for (std::int64_t r = 0; r < width; r += n) {
    if (masked) {
      BackwardLanes<true>(st, dpt, keys, width, k_first, hi, total, d_rem, carry, suffix, r);
    } else {
      BackwardLanes<false>(st, dpt, keys, width, k_first, hi, total, d_rem, carry, suffix, r);
    }
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace posenc::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace posenc::kernels {

HWY_EXPORT(SbForwardTile);
HWY_EXPORT(SbBackwardTile);

void sb_forward_tile(float* st, std::int64_t keys, std::int64_t width, std::int64_t k_first, const std::int32_t* hi,
                     bool masked, float* carry) {
  HWY_DYNAMIC_DISPATCH(SbForwardTile)(st, keys, width, k_first, hi, masked, carry);
}

void sb_backward_tile(float* st, float* dpt, std::int64_t keys, std::int64_t width, std::int64_t k_first,
                      const std::int32_t* hi, bool masked, const float* total, const float* d_rem, float* carry,
                      float* suffix) {
  HWY_DYNAMIC_DISPATCH(SbBackwardTile)(st, dpt, keys, width, k_first, hi, masked, total, d_rem, carry, suffix);
}

}  // namespace posenc::kernels
#endif
