// Exact sine and cosine of fp64 angles, shared by the sinusoidal and rotary kernels (Highway
// per-target header: included from each kernel translation unit after foreach_target.h).
//
// SinPair(x, q) returns value = sin(x + q·π/2) and partner = sin(x + (1 − q)·π/2) for x >= 0
// (x < 2^51) and q ∈ {0, 1} lane-wise: with q = 0, (sin x, cos x).
//   Reduction: k = round(x·2/π), r = x − k·(π/2)_hi − k·(π/2)_lo, |r| <= π/4, with
//   hi = fp64(π/2), lo = fp64(π/2 − hi) and fused multiply-adds: r is exact to ~1e-16 for any
//   k < 2^51, so the error is that of x itself.
//   sin r and cos r: Taylor polynomials to degree 11 and 12 (truncation <= (π/4)^13/13! ≈ 7e-12
//   and (π/4)^14/14! ≈ 4e-13); the quadrant m = (k + q) mod 4 picks ±sin r or ±cos r.
// Error: |value − sin(x + qπ/2)| <= 1e-11 plus the error already in x.
#if defined(POSENC_KERNELS_COMMON_SINCOS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef POSENC_KERNELS_COMMON_SINCOS_INL_H_
#undef POSENC_KERNELS_COMMON_SINCOS_INL_H_
#else
#define POSENC_KERNELS_COMMON_SINCOS_INL_H_
#endif

#include <hwy/highway.h>

HWY_BEFORE_NAMESPACE();
namespace posenc::kernels::common {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// value = sin(x + q·π/2) and partner = sin(x + (1 - q)·π/2) for x >= 0 (x < 2^51) and
// q ∈ {0, 1}, lane-wise, in fp64: one reduction and one pair of polynomials serve both.
template <class DD, class VD = hn::Vec<DD>>
HWY_INLINE void SinPair(DD d, VD x, VD q, VD& value, VD& partner) {
  const hn::RebindToUnsigned<DD> du;
  const auto k = hn::Round(hn::Mul(x, hn::Set(d, 0.63661977236758134308)));  // 2/π
  auto r = hn::NegMulAdd(k, hn::Set(d, 1.5707963267948966), x);              // (π/2)_hi
  r = hn::NegMulAdd(k, hn::Set(d, 6.123233995736766e-17), r);                // (π/2)_lo
  // m = k + q as an integer in the low mantissa bits (exact for 0 <= k + q < 2^51).
  const auto m = hn::BitCast(du, hn::Add(hn::Add(k, q), hn::Set(d, 6755399441055744.0)));  // 1.5·2^52
  const auto z = hn::Mul(r, r);
  // Taylor coefficients ±1/n!.
  auto s = hn::Set(d, -1.0 / 39916800.0);
  s = hn::MulAdd(s, z, hn::Set(d, 1.0 / 362880.0));
  s = hn::MulAdd(s, z, hn::Set(d, -1.0 / 5040.0));
  s = hn::MulAdd(s, z, hn::Set(d, 1.0 / 120.0));
  s = hn::MulAdd(s, z, hn::Set(d, -1.0 / 6.0));
  s = hn::MulAdd(hn::Mul(s, z), r, r);
  auto c = hn::Set(d, 1.0 / 479001600.0);
  c = hn::MulAdd(c, z, hn::Set(d, -1.0 / 3628800.0));
  c = hn::MulAdd(c, z, hn::Set(d, 1.0 / 40320.0));
  c = hn::MulAdd(c, z, hn::Set(d, -1.0 / 720.0));
  c = hn::MulAdd(c, z, hn::Set(d, 1.0 / 24.0));
  c = hn::MulAdd(c, z, hn::Set(d, -0.5));
  c = hn::MulAdd(c, z, hn::Set(d, 1.0));
  // sin(r + m·π/2) is sin r, cos r, -sin r, -cos r for m mod 4 = 0, 1, 2, 3; the partner's
  // quadrant is m + 1 - 2q, i.e. m + 1 for a sin column and m - 1 for a cos column.
  const auto one = hn::Set(du, 1);
  const auto odd = hn::RebindMask(d, hn::Eq(hn::And(m, one), one));
  const auto sign_of = [&](auto quadrant) {  // bit 1 of the quadrant into the sign bit
    return hn::BitCast(d, hn::ShiftLeft<62>(hn::And(quadrant, hn::Set(du, 2))));
  };
  const auto q_bits = hn::BitCast(du, hn::Add(q, hn::Set(d, 6755399441055744.0)));
  const auto partner_m = hn::Sub(hn::Add(m, one), hn::ShiftLeft<1>(hn::And(q_bits, one)));
  value = hn::Xor(hn::IfThenElse(odd, c, s), sign_of(m));
  partner = hn::Xor(hn::IfThenElse(odd, s, c), sign_of(partner_m));
}

}  // namespace HWY_NAMESPACE
}  // namespace posenc::kernels::common
HWY_AFTER_NAMESPACE();

#endif  // include guard
