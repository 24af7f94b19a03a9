// SIMD kernels of the absolute encodings (Highway, dynamic dispatch).
//
// Sinusoids are computed for runs of consecutive positions p0, p0+1, … (at most kMaxRun rows):
//
// 1. The first row exactly: for each column, sin(x + q·π/2) with x = p0·ω_j >= 0, q ∈ {0, 1}.
//    Angle reduction in fp64: k = round(x·2/π), r = x - k·(π/2)_hi - k·(π/2)_lo, |r| <= π/4.
//    The two-part π/2 (hi = fp64(π/2), lo = fp64(π/2 - hi)) with fused multiply-adds keeps r
//    exact to ~1e-16 for any k < 2^51, so the error is that of x = p0·ω itself (<= p0·2^-53) —
//    the bits an fp32 `p * div_term` loses at long positions are kept. The quadrant
//    m = (k + q) mod 4 picks ±sin r or ±cos r; sin and cos on [-π/4, π/4] are their Taylor
//    polynomials to degree 11 and 12 (truncation <= (π/4)^13/13! ≈ 7e-12 and
//    (π/4)^14/14! ≈ 4e-13).
// 2. Every further row by rotating each (value, partner) pair in fp64 (see the recurrence in
//    absolute_kernels.hpp): row 1 by ω_j from row 0, then even and odd rows as two independent
//    chains stepping by 2ω_j — four multiply-adds per column instead of a reduction and two
//    polynomials. Contiguous loads only — no shuffles — so every layout and target share it.
//    The run walks a tile of two vectors of columns down all its rows with the state in
//    registers: no scratch memory, and each row receives one whole 64-byte line (AVX-512) at a
//    time, which suits non-temporal stores.
// 3. Each value is rounded once to f32 (<= 2^-25 for |value| <= 1).
// Error against the exact sin/cos: 2^-25 + p·2^-52 + 1e-11 (see posenc/absolute.hpp).
//
// Data flow for one tile of columns [j, j+16) (AVX-512: two vectors of 8 fp64 lanes):
//   row 0:   p0·ω ──► reduce, polynomials ──► v, u (registers) ──► demote ──► out[0][j..j+16)
//   row r:   v, u ──► rotate by ω ─────────► v, u              ──► demote ──► out[r][j..j+16)
// The float vector has as many lanes as the double one (half width), which every target supports,
// including Highway's one-lane HWY_SCALAR (the baseline when GCC < 12.3 cannot build EMU128).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/absolute/absolute_kernels.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>
#include <hwy/cache_control.h>

#include <algorithm>
#include <cstring>

#include "kernels/absolute/absolute_kernels.hpp"
#include "kernels/common/sincos-inl.h"
#include "kernels/common/store-inl.h"

HWY_BEFORE_NAMESPACE();
namespace posenc::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DD = hn::ScalableTag<double>;
using DF = hn::Rebind<float, DD>;  // as many lanes as DD, half the width
using VD = hn::Vec<DD>;
using common::HWY_NAMESPACE::SinPair;
using common::HWY_NAMESPACE::StoreOrStream;
using common::HWY_NAMESPACE::StreamableTag;

// A tile reads columns [j, j + 2·Lanes) of the column tables, j < dim: the padding must cover it.
static_assert(kColumnPadding >= 2 * hn::MaxLanes(DD()), "column tables need more padding");

template <class Emit>
HWY_INLINE void Tile(const SinusoidColumns& cols, double p0, std::int64_t rows, std::int64_t j, const Emit& emit) {
  const DD dd;
  const DF df;
  const std::int64_t n = static_cast<std::int64_t>(hn::Lanes(dd));
  const VD p = hn::Set(dd, p0);
  const VD x0 = hn::Mul(p, hn::LoadU(dd, cols.freq + j));
  const VD x1 = hn::Mul(p, hn::LoadU(dd, cols.freq + j + n));
  VD v0, v1, u0, u1;
  SinPair(dd, x0, hn::LoadU(dd, cols.quadrant + j), v0, u0);
  SinPair(dd, x1, hn::LoadU(dd, cols.quadrant + j + n), v1, u1);
  emit(0, hn::DemoteTo(df, v0), hn::DemoteTo(df, v1));
  if (rows == 1) return;
  // Rotation by ω: (v, u) ← (v·c + u·s, u·c - v·s).
  const auto rotate = [](VD& v, VD& u, VD c, VD s) {
    const VD next_v = hn::MulAdd(u, s, hn::Mul(v, c));
    u = hn::NegMulAdd(v, s, hn::Mul(u, c));
    v = next_v;
  };
  const VD c0 = hn::LoadU(dd, cols.step_cos + j), s0 = hn::LoadU(dd, cols.step_sin + j);
  const VD c1 = hn::LoadU(dd, cols.step_cos + j + n), s1 = hn::LoadU(dd, cols.step_sin + j + n);
  VD odd_v0 = v0, odd_u0 = u0, odd_v1 = v1, odd_u1 = u1;
  rotate(odd_v0, odd_u0, c0, s0);
  rotate(odd_v1, odd_u1, c1, s1);
  emit(1, hn::DemoteTo(df, odd_v0), hn::DemoteTo(df, odd_v1));
  // Two independent chains — even rows and odd rows — each stepping by 2ω: a rotation's
  // latency (multiply, then multiply-add) would otherwise bound the loop. Double angle:
  // cos 2ω = c² - s², sin 2ω = 2·c·s (signs follow the column's convention).
  const VD cc0 = hn::NegMulAdd(s0, s0, hn::Mul(c0, c0)), ss0 = hn::Mul(hn::Add(c0, c0), s0);
  const VD cc1 = hn::NegMulAdd(s1, s1, hn::Mul(c1, c1)), ss1 = hn::Mul(hn::Add(c1, c1), s1);
  std::int64_t r = 2;
  for (; r + 1 < rows; r += 2) {
    rotate(v0, u0, cc0, ss0);
    rotate(v1, u1, cc1, ss1);
    rotate(odd_v0, odd_u0, cc0, ss0);
    rotate(odd_v1, odd_u1, cc1, ss1);
    emit(r, hn::DemoteTo(df, v0), hn::DemoteTo(df, v1));
    emit(r + 1, hn::DemoteTo(df, odd_v0), hn::DemoteTo(df, odd_v1));
  }
  if (r < rows) {
    rotate(v0, u0, cc0, ss0);
    rotate(v1, u1, cc1, ss1);
    emit(r, hn::DemoteTo(df, v0), hn::DemoteTo(df, v1));
  }
}

// Partial tiles: the first `valid` (< 2·Lanes) floats of lo ++ hi. AVX2 and AVX-512 have native
// masked loads and stores, which touch exactly the valid lanes; older targets go through a small
// buffer and memcpy, which touches exactly the valid bytes too (never an element of a row that
// another thread writes).
#if HWY_TARGET <= HWY_AVX2
constexpr bool kNativeMasks = true;
#else
constexpr bool kNativeMasks = false;
#endif

HWY_INLINE void StorePartial(hn::Vec<DF> lo, hn::Vec<DF> hi, float* out, size_t valid) {
  const DF df;
  const size_t n = hn::Lanes(df);
  if constexpr (kNativeMasks) {
    if (valid >= n) {
      hn::StoreU(lo, df, out);
      hn::BlendedStore(hi, hn::FirstN(df, valid - n), df, out + n);
    } else {
      hn::BlendedStore(lo, hn::FirstN(df, valid), df, out);
    }
  } else {
    HWY_ALIGN float buffer[2 * hn::MaxLanes(df)];
    hn::Store(lo, df, buffer);
    hn::Store(hi, df, buffer + n);
    std::memcpy(out, buffer, valid * sizeof(float));
  }
}

// Loads the first `valid` (< 2·Lanes) floats at src into lo ++ hi, zeros elsewhere.
HWY_INLINE void LoadPartial(const float* src, size_t valid, hn::Vec<DF>& lo, hn::Vec<DF>& hi) {
  const DF df;
  const size_t n = hn::Lanes(df);
  if constexpr (kNativeMasks) {
    if (valid >= n) {
      lo = hn::LoadU(df, src);
      hi = hn::MaskedLoad(hn::FirstN(df, valid - n), df, src + n);
    } else {
      lo = hn::MaskedLoad(hn::FirstN(df, valid), df, src);
      hi = hn::Zero(df);
    }
  } else {
    HWY_ALIGN float buffer[2 * hn::MaxLanes(df)] = {};
    std::memcpy(buffer, src, valid * sizeof(float));
    lo = hn::Load(df, buffer);
    hi = hn::Load(df, buffer + n);
  }
}

void SinusoidRunF32(const SinusoidColumns& cols, double first_position, std::int64_t rows, float* HWY_RESTRICT out,
                    std::int64_t out_row_stride, bool stream) {
  const DF df;
  const auto n = static_cast<std::int64_t>(hn::Lanes(df));
  const std::int64_t dim = cols.dim;
  const std::uintptr_t vector_bytes = static_cast<std::uintptr_t>(n) * sizeof(float);
  // Columns before row 0's first line boundary form a partial tile, so that the full tiles of
  // row 0 (and of every row whose stride keeps that alignment) can be streamed.
  const bool streamable = stream && StreamableTag(df);
  std::int64_t j = 0;
  if (streamable) {
    const std::uintptr_t line = 2 * vector_bytes;
    const std::uintptr_t misalignment = reinterpret_cast<std::uintptr_t>(out) % line;
    if (misalignment != 0 && misalignment % sizeof(float) == 0) {
      j = std::min<std::int64_t>(dim, static_cast<std::int64_t>((line - misalignment) / sizeof(float)));
      Tile(cols, first_position, rows, 0, [&](std::int64_t r, auto lo, auto hi) {
        StorePartial(lo, hi, out + r * out_row_stride, static_cast<size_t>(j));
      });
    }
  }
  for (; j + 2 * n <= dim; j += 2 * n) {
    Tile(cols, first_position, rows, j, [&](std::int64_t r, auto lo, auto hi) {
      float* dst = out + r * out_row_stride + j;
      StoreOrStream(lo, df, dst, streamable);
      StoreOrStream(hi, df, dst + n, streamable);
    });
  }
  if (j < dim) {
    Tile(cols, first_position, rows, j, [&](std::int64_t r, auto lo, auto hi) {
      StorePartial(lo, hi, out + r * out_row_stride + j, static_cast<size_t>(dim - j));
    });
  }
}

void SinusoidAddRunF32(const SinusoidColumns& cols, double first_position, std::int64_t rows, const float* x,
                       std::int64_t x_row_stride, float* out, std::int64_t out_row_stride, bool stream) {
  const DF df;
  const auto n = static_cast<std::int64_t>(hn::Lanes(df));
  const std::int64_t dim = cols.dim;
  const bool streamable = stream && StreamableTag(df);
  std::int64_t j = 0;
  for (; j + 2 * n <= dim; j += 2 * n) {
    Tile(cols, first_position, rows, j, [&](std::int64_t r, auto lo, auto hi) {
      const float* src = x + r * x_row_stride + j;
      float* dst = out + r * out_row_stride + j;
      const auto sum_lo = hn::Add(hn::LoadU(df, src), lo);
      const auto sum_hi = hn::Add(hn::LoadU(df, src + n), hi);
      StoreOrStream(sum_lo, df, dst, streamable);
      StoreOrStream(sum_hi, df, dst + n, streamable);
    });
  }
  if (j < dim) {
    const auto valid = static_cast<size_t>(dim - j);
    Tile(cols, first_position, rows, j, [&](std::int64_t r, auto lo, auto hi) {
      // Only `valid` columns of x may be read, and of out written.
      hn::Vec<DF> x_lo, x_hi;
      LoadPartial(x + r * x_row_stride + j, valid, x_lo, x_hi);
      StorePartial(hn::Add(x_lo, lo), hn::Add(x_hi, hi), out + r * out_row_stride + j, valid);
    });
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace posenc::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace posenc::kernels {

HWY_EXPORT(SinusoidRunF32);
HWY_EXPORT(SinusoidAddRunF32);

void sinusoid_run_f32(const SinusoidColumns& cols, double first_position, std::int64_t rows, float* out,
                      std::int64_t out_row_stride, bool stream) {
  HWY_DYNAMIC_DISPATCH(SinusoidRunF32)(cols, first_position, rows, out, out_row_stride, stream);
}
void sinusoid_add_run_f32(const SinusoidColumns& cols, double first_position, std::int64_t rows, const float* x,
                          std::int64_t x_row_stride, float* out, std::int64_t out_row_stride, bool stream) {
  HWY_DYNAMIC_DISPATCH(SinusoidAddRunF32)(cols, first_position, rows, x, x_row_stride, out, out_row_stride, stream);
}

}  // namespace posenc::kernels
#endif  // HWY_ONCE
