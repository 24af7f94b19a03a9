// SIMD kernels of CoPE (Highway, dynamic dispatch). See cope_kernels.hpp.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/attention/cope_kernels.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>
#include <hwy/contrib/math/math-inl.h>

#include <cstdint>
#include <limits>

#include "kernels/attention/cope_kernels.hpp"

HWY_BEFORE_NAMESPACE();
namespace posenc::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using DI = hn::RebindToSigned<DF>;
using VF = hn::Vec<DF>;
using VI = hn::Vec<DI>;
using MF = hn::Mask<DF>;

// exp with arguments below −87.3 flushed to 0 (FLT_MIN, as the softmax's probabilities are) and
// NaN kept (Highway's Exp clamps its argument).
HWY_INLINE VF ExpOrZero(DF d, VF x) {
  return hn::IfThenElse(hn::IsNaN(x), x, hn::IfThenZeroElse(hn::Lt(x, hn::Set(d, -87.3f)), hn::Exp(d, x)));
}

// σ(z) and σ(z)·(1 − σ(z)) from e = e^−|z|: 1/(1 + e) and e/(1 + e) are σ of |z| and of −|z|;
// each below FLT_MIN is 0. A NaN z gives NaN in both.
struct Gate {
  VF g, gg;
};
HWY_INLINE Gate Sigmoid(DF d, VF z) {
  const VF one = hn::Set(d, 1.0f), tiny = hn::Set(d, std::numeric_limits<float>::min());
  const VF e = hn::Exp(d, hn::Neg(hn::Abs(z)));
  const VF inv = hn::Div(one, hn::Add(one, e));
  const VF small = hn::IfThenElse(hn::IsNaN(z), z, hn::Mul(e, inv));
  const VF g = hn::IfThenElse(hn::Ge(z, hn::Zero(d)), inv, small);
  const VF gg = hn::Mul(inv, small);
  return {hn::IfThenZeroElse(hn::Lt(g, tiny), g), hn::IfThenZeroElse(hn::Lt(gg, tiny), gg)};
}

// The interpolated position logit of sums `sum` (cope_kernels.hpp), with what backward needs.
struct Position {
  VF logit, w, qfl, qce;
  VI fl, ce;  // indices into qe
  MF clamped;
};
HWY_INLINE Position Interpolate(DF d, VF sum, VF cap, const float* HWY_RESTRICT qe, VI rows) {
  const DI di;
  Position o;
  o.clamped = hn::Ge(sum, cap);
  const VF p = hn::IfThenElse(o.clamped, cap, sum);
  const VF pf = hn::IfThenZeroElse(hn::IsNaN(p), hn::Floor(p));
  o.w = hn::Sub(p, pf);
  o.fl = hn::Add(rows, hn::ConvertTo(di, pf));
  o.ce = hn::IfThenElse(hn::RebindMask(di, hn::Gt(o.w, hn::Zero(d))), hn::Add(o.fl, hn::Set(di, 1)), o.fl);
  o.qfl = hn::GatherIndex(d, qe, o.fl);
  o.qce = hn::GatherIndex(d, qe, o.ce);
  o.logit = hn::MulAdd(o.w, o.qce, hn::Mul(hn::Sub(hn::Set(d, 1.0f), o.w), o.qfl));
  return o;
}

// The lanes' qe row offsets r·ldqe.
HWY_INLINE VI RowOffsets(DI di, std::int64_t r, std::int64_t ldqe) {
  return hn::Mul(hn::Iota(di, static_cast<std::int32_t>(r)), hn::Set(di, static_cast<std::int32_t>(ldqe)));
}

// The position logit of a clamped lane, as Interpolate computes it at w = 0: qe[cap] + 0·qe[cap]
// (NaN for an infinite qe[cap], as there).
HWY_INLINE VF ClampedLogit(DF d, const float* HWY_RESTRICT qe, VI cap_index) {
  const VF q = hn::GatherIndex(d, qe, cap_index);
  return hn::MulAdd(hn::Zero(d), q, q);
}

// The gate sum c += g (where seen), compensated (Kahan): positions are sums of up to npos − 1
// gates, and a plain f32 sum of a thousand of them errs by 1e-3, which the table's slope turns
// into logit error; with the compensation the error stays near the sum's own rounding.
HWY_INLINE void AddGate(VF g, MF seen, VF& c, VF& comp) {
  const VF y = hn::Sub(g, comp);
  const VF t = hn::Add(c, y);
  comp = hn::IfThenElse(seen, hn::Sub(hn::Sub(t, c), y), comp);
  c = hn::IfThenElse(seen, t, c);
}

template <bool kMasked>
HWY_INLINE MF Seen(DF d, std::int64_t key, hn::Vec<DI> hv) {
  const DI di;
  if constexpr (kMasked) return hn::RebindMask(d, hn::Lt(hn::Set(di, static_cast<std::int32_t>(key)), hv));
  return hn::FirstN(d, hn::Lanes(d));
}

template <bool kMasked>
void ForwardLanes(float* HWY_RESTRICT st, std::int64_t keys, std::int64_t width, std::int64_t k_first,
                  const std::int32_t* HWY_RESTRICT hi, const float* HWY_RESTRICT qe, std::int64_t ldqe, float cap,
                  float* HWY_RESTRICT carry, std::int64_t r) {
  const DF d;
  const DI di;
  const VF capv = hn::Set(d, cap), ninf = hn::Set(d, -std::numeric_limits<float>::infinity());
  const VI rows = RowOffsets(di, r, ldqe);
  const auto hv = kMasked ? hn::LoadU(di, hi + r) : hn::Zero(di);
  VF c = hn::LoadU(d, carry + r), comp = hn::LoadU(d, carry + width + r);
  std::int64_t j = keys - 1;
  for (; j >= 0 && !hn::AllTrue(d, hn::Ge(c, capv)); --j) {
    float* at = st + j * width + r;
    const VF z = hn::LoadU(d, at);
    const auto seen = Seen<kMasked>(d, k_first + j, hv);
    AddGate(Sigmoid(d, z).g, seen, c, comp);
    VF s = hn::Add(z, Interpolate(d, c, capv, qe, rows).logit);
    if constexpr (kMasked) s = hn::IfThenElse(seen, s, ninf);
    hn::StoreU(s, d, at);
  }
  if (j >= 0) {
    // Every lane has counted cap: the position logit is qe[cap] for the keys left.
    const VF add = ClampedLogit(d, qe, hn::Add(rows, hn::Set(di, static_cast<std::int32_t>(cap))));
    for (; j >= 0; --j) {
      float* at = st + j * width + r;
      VF s = hn::Add(hn::LoadU(d, at), add);
      if constexpr (kMasked) s = hn::IfThenElse(Seen<kMasked>(d, k_first + j, hv), s, ninf);
      hn::StoreU(s, d, at);
    }
  }
  hn::StoreU(c, d, carry + r);
  hn::StoreU(comp, d, carry + width + r);
}

void CopeForwardTile(float* HWY_RESTRICT st, std::int64_t keys, std::int64_t width, std::int64_t k_first,
                     const std::int32_t* HWY_RESTRICT hi, bool masked, const float* HWY_RESTRICT qe, std::int64_t ldqe,
                     float cap, float* HWY_RESTRICT carry) {
  const auto n = static_cast<std::int64_t>(hn::Lanes(DF()));
  for (std::int64_t r = 0; r < width; r += n) {
    if (masked) {
      ForwardLanes<true>(st, keys, width, k_first, hi, qe, ldqe, cap, carry, r);
    } else {
      ForwardLanes<false>(st, keys, width, k_first, hi, qe, ldqe, cap, carry, r);
    }
  }
}

// dqe[index] += add per lane (the lanes' rows differ, so no two lanes meet).
HWY_INLINE void ScatterAdd(DF d, float* HWY_RESTRICT dqe, VI index, VF add) {
  hn::ScatterIndex(hn::Add(hn::GatherIndex(d, dqe, index), add), d, dqe, index);
}

template <bool kMasked>
void BackwardLanes(float* HWY_RESTRICT st, float* HWY_RESTRICT dpt, float* HWY_RESTRICT dpp, float* HWY_RESTRICT gg,
                   std::int64_t keys, std::int64_t width, std::int64_t k_first, const std::int32_t* HWY_RESTRICT hi,
                   const float* HWY_RESTRICT qe, std::int64_t ldqe, float cap, const float* HWY_RESTRICT lse,
                   const float* HWY_RESTRICT delta, float* HWY_RESTRICT carry, float* HWY_RESTRICT dqe,
                   float* HWY_RESTRICT tile_sum, std::int64_t r) {
  const DF d;
  const DI di;
  const VF capv = hn::Set(d, cap), one = hn::Set(d, 1.0f);
  const VI rows = RowOffsets(di, r, ldqe);
  const auto hv = kMasked ? hn::LoadU(di, hi + r) : hn::Zero(di);
  const VF l = hn::LoadU(d, lse + r), del = hn::LoadU(d, delta + r);
  const auto no_keys = hn::Eq(l, hn::Set(d, -std::numeric_limits<float>::infinity()));
  VF c = hn::LoadU(d, carry + r), comp = hn::LoadU(d, carry + width + r), sum = hn::Zero(d);
  std::int64_t j = keys - 1;
  for (; j >= 0 && !hn::AllTrue(d, hn::Ge(c, capv)); --j) {
    const std::int64_t at = j * width + r;
    const VF z = hn::LoadU(d, st + at);
    const auto seen = Seen<kMasked>(d, k_first + j, hv);
    const Gate gate = Sigmoid(d, z);
    AddGate(gate.g, seen, c, comp);
    const Position pos = Interpolate(d, c, capv, qe, rows);
    const VF p = hn::IfThenElseZero(seen, hn::IfThenZeroElse(no_keys, ExpOrZero(d, hn::Sub(hn::Add(z, pos.logit), l))));
    const VF ds = hn::IfThenElseZero(seen, hn::Mul(p, hn::Sub(hn::LoadU(d, dpt + at), del)));
    const VF dp = hn::IfThenElseZero(seen, hn::IfThenZeroElse(pos.clamped, hn::Mul(ds, hn::Sub(pos.qce, pos.qfl))));
    if (dqe != nullptr) {
      ScatterAdd(d, dqe, pos.fl, hn::IfThenElseZero(seen, hn::Mul(ds, hn::Sub(one, pos.w))));
      ScatterAdd(d, dqe, pos.ce, hn::IfThenElseZero(seen, hn::Mul(ds, pos.w)));
    }
    sum = hn::Add(sum, dp);
    hn::StoreU(p, d, st + at);
    hn::StoreU(ds, d, dpt + at);
    hn::StoreU(dp, d, dpp + at);
    hn::StoreU(hn::IfThenElseZero(seen, gate.gg), d, gg + at);
  }
  if (j >= 0) {
    // Every lane has counted cap: no dp and no gate gradient; dqe[cap] gets Σ dS (each with the
    // 0·dS of its zero weight, which is NaN for an infinite dS as in the general path).
    const VI cap_index = hn::Add(rows, hn::Set(di, static_cast<std::int32_t>(cap)));
    const VF add = ClampedLogit(d, qe, cap_index);
    VF acc = hn::Zero(d);
    for (; j >= 0; --j) {
      const std::int64_t at = j * width + r;
      const VF z = hn::LoadU(d, st + at);
      const auto seen = Seen<kMasked>(d, k_first + j, hv);
      const VF p = hn::IfThenElseZero(seen, hn::IfThenZeroElse(no_keys, ExpOrZero(d, hn::Sub(hn::Add(z, add), l))));
      const VF ds = hn::IfThenElseZero(seen, hn::Mul(p, hn::Sub(hn::LoadU(d, dpt + at), del)));
      acc = hn::Add(acc, hn::MulAdd(ds, hn::Zero(d), ds));
      hn::StoreU(p, d, st + at);
      hn::StoreU(ds, d, dpt + at);
      hn::StoreU(hn::Zero(d), d, dpp + at);
      hn::StoreU(hn::Zero(d), d, gg + at);
    }
    if (dqe != nullptr) ScatterAdd(d, dqe, cap_index, acc);
  }
  hn::StoreU(c, d, carry + r);
  hn::StoreU(comp, d, carry + width + r);
  if (tile_sum != nullptr) hn::StoreU(hn::Add(hn::LoadU(d, tile_sum + r), sum), d, tile_sum + r);
}

void CopeBackwardTile(float* HWY_RESTRICT st, float* HWY_RESTRICT dpt, float* HWY_RESTRICT dpp, float* HWY_RESTRICT gg,
                      std::int64_t keys, std::int64_t width, std::int64_t k_first, const std::int32_t* HWY_RESTRICT hi,
                      bool masked, const float* HWY_RESTRICT qe, std::int64_t ldqe, float cap,
                      const float* HWY_RESTRICT lse, const float* HWY_RESTRICT delta, float* HWY_RESTRICT carry,
                      float* HWY_RESTRICT dqe, float* HWY_RESTRICT tile_sum) {
  const auto n = static_cast<std::int64_t>(hn::Lanes(DF()));
  for (std::int64_t r = 0; r < width; r += n) {
    if (masked) {
      BackwardLanes<true>(st, dpt, dpp, gg, keys, width, k_first, hi, qe, ldqe, cap, lse, delta, carry, dqe, tile_sum,
                          r);
    } else {
      BackwardLanes<false>(st, dpt, dpp, gg, keys, width, k_first, hi, qe, ldqe, cap, lse, delta, carry, dqe, tile_sum,
                           r);
    }
  }
}

template <bool kMasked>
void FinishLanes(float* HWY_RESTRICT dpt, const float* HWY_RESTRICT dpp, const float* HWY_RESTRICT gg,
                 std::int64_t keys, std::int64_t width, std::int64_t k_first, const std::int32_t* HWY_RESTRICT hi,
                 float* HWY_RESTRICT left, std::int64_t r) {
  const DF d;
  const DI di;
  const auto hv = kMasked ? hn::LoadU(di, hi + r) : hn::Zero(di);
  VF run = hn::LoadU(d, left + r);
  for (std::int64_t j = 0; j < keys; ++j) {
    const std::int64_t at = j * width + r;
    run = hn::Add(run, hn::LoadU(d, dpp + at));
    VF dz = hn::MulAdd(hn::LoadU(d, gg + at), run, hn::LoadU(d, dpt + at));
    if constexpr (kMasked) dz = hn::IfThenElseZero(Seen<kMasked>(d, k_first + j, hv), dz);
    hn::StoreU(dz, d, dpt + at);
  }
  hn::StoreU(run, d, left + r);
}

void CopeBackwardFinish(float* HWY_RESTRICT dpt, const float* HWY_RESTRICT dpp, const float* HWY_RESTRICT gg,
                        std::int64_t keys, std::int64_t width, std::int64_t k_first,
                        const std::int32_t* HWY_RESTRICT hi, bool masked, float* HWY_RESTRICT left) {
  const auto n = static_cast<std::int64_t>(hn::Lanes(DF()));
  for (std::int64_t r = 0; r < width; r += n) {
    if (masked) {
      FinishLanes<true>(dpt, dpp, gg, keys, width, k_first, hi, left, r);
    } else {
      FinishLanes<false>(dpt, dpp, gg, keys, width, k_first, hi, left, r);
    }
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace posenc::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace posenc::kernels {

HWY_EXPORT(CopeForwardTile);
HWY_EXPORT(CopeBackwardTile);
HWY_EXPORT(CopeBackwardFinish);

void cope_forward_tile(float* st, std::int64_t keys, std::int64_t width, std::int64_t k_first, const std::int32_t* hi,
                       bool masked, const float* qe, std::int64_t ldqe, float cap, float* carry) {
  HWY_DYNAMIC_DISPATCH(CopeForwardTile)(st, keys, width, k_first, hi, masked, qe, ldqe, cap, carry);
}

void cope_backward_tile(float* st, float* dpt, float* dpp, float* gg, std::int64_t keys, std::int64_t width,
                        std::int64_t k_first, const std::int32_t* hi, bool masked, const float* qe, std::int64_t ldqe,
                        float cap, const float* lse, const float* delta, float* carry, float* dqe, float* tile_sum) {
  HWY_DYNAMIC_DISPATCH(CopeBackwardTile)
  (st, dpt, dpp, gg, keys, width, k_first, hi, masked, qe, ldqe, cap, lse, delta, carry, dqe, tile_sum);
}

void cope_backward_finish(float* dpt, const float* dpp, const float* gg, std::int64_t keys, std::int64_t width,
                          std::int64_t k_first, const std::int32_t* hi, bool masked, float* left) {
  HWY_DYNAMIC_DISPATCH(CopeBackwardFinish)(dpt, dpp, gg, keys, width, k_first, hi, masked, left);
}

}  // namespace posenc::kernels
#endif
