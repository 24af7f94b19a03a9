// SIMD kernels of the fused attention (Highway, dynamic dispatch). See attention_kernels.hpp.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/attention/attention_kernels.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>
#include <hwy/cache_control.h>
#include <hwy/contrib/math/math-inl.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "kernels/attention/attention_kernels.hpp"
#include "posenc/error.hpp"

HWY_BEFORE_NAMESPACE();
namespace posenc::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

// Register blocking of the matrix kernel: kRows broadcast rows × kVecs vectors of accumulators.
// AVX-512 has 32 vector registers: 6 × 4 accumulators, 4 B vectors and a broadcast fit. AVX2's 16
// take 6 × 2 (15 registers): 12 chains of multiply-adds hide the 4-cycle latency on two pipes
// with room to spare, where 4 × 2 has exactly 8 (Zen 3 host, S = 2048 causal, alternating runs:
// forward 0.64-0.65 of the FMA peak against 0.63 with 4 × 2, RoPE and no scheme; backward 2-6%
// faster). SSE4 keeps 4 × 2.
#if HWY_TARGET != HWY_SCALAR && HWY_MAX_BYTES >= 64
constexpr int kRows = 6;
constexpr int kVecs = 4;
#elif HWY_TARGET == HWY_AVX2
constexpr int kRows = 6;
constexpr int kVecs = 2;
#else
constexpr int kRows = 4;
constexpr int kVecs = 2;
#endif

// How the matrix kernel meets C: kSet C = chain from 0; kChain C = chain from C; kAddSum
// C = C + chain from 0 (attn_gemm_add).
enum GemmMode : int { kSet = 0, kChain = 1, kAddSum = 2 };

template <int R, int V>
HWY_INLINE void GemmBlock(const float* HWY_RESTRICT a, std::int64_t a_row, std::int64_t a_depth,
                          const float* HWY_RESTRICT b, std::int64_t ldb, float* HWY_RESTRICT c, std::int64_t ldc,
                          std::int64_t depth, int mode) {
  const DF d;
  const auto n = static_cast<std::int64_t>(hn::Lanes(d));
  VF acc[R][V];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) acc[r][v] = mode == kChain ? hn::LoadU(d, c + r * ldc + v * n) : hn::Zero(d);
  }
  for (std::int64_t t = 0; t < depth; ++t) {
    VF bv[V];
    for (int v = 0; v < V; ++v) bv[v] = hn::LoadU(d, b + t * ldb + v * n);
    for (int r = 0; r < R; ++r) {
      const VF av = hn::Set(d, a[r * a_row + t * a_depth]);
      for (int v = 0; v < V; ++v) acc[r][v] = hn::MulAdd(av, bv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) {
      float* cv = c + r * ldc + v * n;
      hn::StoreU(mode == kAddSum ? hn::Add(hn::LoadU(d, cv), acc[r][v]) : acc[r][v], d, cv);
    }
  }
}

template <int V>
HWY_INLINE void GemmRows(std::int64_t rows, const float* a, std::int64_t a_row, std::int64_t a_depth, const float* b,
                         std::int64_t ldb, float* c, std::int64_t ldc, std::int64_t depth, int mode) {
  std::int64_t m = 0;
  for (; m + kRows <= rows; m += kRows) {
    GemmBlock<kRows, V>(a + m * a_row, a_row, a_depth, b, ldb, c + m * ldc, ldc, depth, mode);
  }
  const float* at = a + m * a_row;
  float* ct = c + m * ldc;
  switch (rows - m) {
    case 1:
      GemmBlock<1, V>(at, a_row, a_depth, b, ldb, ct, ldc, depth, mode);
      break;
    case 2:
      GemmBlock<2, V>(at, a_row, a_depth, b, ldb, ct, ldc, depth, mode);
      break;
    case 3:
      GemmBlock<3, V>(at, a_row, a_depth, b, ldb, ct, ldc, depth, mode);
      break;
#if HWY_TARGET != HWY_SCALAR && (HWY_MAX_BYTES >= 64 || HWY_TARGET == HWY_AVX2)
    case 4:
      GemmBlock<4, V>(at, a_row, a_depth, b, ldb, ct, ldc, depth, mode);
      break;
    case 5:
      GemmBlock<5, V>(at, a_row, a_depth, b, ldb, ct, ldc, depth, mode);
      break;
#endif
    default:
      break;
  }
}

// Depth per pass of the matrix kernel: a column strip of B (kDepthBlockBytes of kVecs-vector rows)
// stays in L1, together with the lines of A that the pass broadcasts from, while every row block
// walks it. Deeper products (XL's dQs over a 1024-δ window, Shaw's and TUPE's per-unit sums), if
// each row block walked the whole depth, would fetch their strip — 64 KiB at depth 1024 on AVX2 —
// and A's lines (a new one per depth step when A's rows are contiguous) from L2 each time. One Zen 3
// core, XL's dQs += sumsᵀ·P (64 × 128 × 1024), alternating runs: whole depth 37.5-40.3 GFLOP/s,
// 16 KiB passes 40.0-46.4, 8 KiB 54.7-58.6, 4 KiB 52.5-61.2 (a tile's product, 128 × 64 × 128:
// 55-88 in all four). Passes never go below 128, so the tiles' products (depth <= 128) run in one pass on
// every target. Between passes C goes through memory as f32 and comes back unchanged, so every
// element still takes its fused multiply-adds in t order: the bits do not depend on the blocking.
constexpr std::int64_t kDepthBlockBytes = 8 << 10;
constexpr std::int64_t kMinDepthBlock = 128;

void AttnGemm(const float* a, std::int64_t a_row, std::int64_t a_depth, const float* b, std::int64_t ldb, float* c,
              std::int64_t ldc, std::int64_t rows, std::int64_t cols, std::int64_t depth, int mode) {
  const DF d;
  const auto n = static_cast<std::int64_t>(hn::Lanes(d));
  const std::int64_t vecs = cols / n;
  const std::int64_t depth_block =
      std::max<std::int64_t>(kMinDepthBlock, kDepthBlockBytes / static_cast<std::int64_t>(kVecs * n * sizeof(float)));
  // At least one pass: with depth 0 and no accumulation, C is still set to 0.
  std::int64_t t0 = 0;
  do {
    const std::int64_t dt = std::min(depth_block, depth - t0);
    const float* at0 = a + t0 * a_depth;
    const float* bt0 = b + t0 * ldb;
    // Later passes chain from C (attn_gemm_add never takes more than one: its depth <= kMinDepthBlock).
    const int acc = t0 > 0 ? kChain : mode;
    std::int64_t v = 0;
    for (; v + kVecs <= vecs; v += kVecs)
      GemmRows<kVecs>(rows, at0, a_row, a_depth, bt0 + v * n, ldb, c + v * n, ldc, dt, acc);
    switch (vecs - v) {
      case 1:
        GemmRows<1>(rows, at0, a_row, a_depth, bt0 + v * n, ldb, c + v * n, ldc, dt, acc);
        break;
#if HWY_TARGET != HWY_SCALAR && HWY_MAX_BYTES >= 64
      case 2:
        GemmRows<2>(rows, at0, a_row, a_depth, bt0 + v * n, ldb, c + v * n, ldc, dt, acc);
        break;
      case 3:
        GemmRows<3>(rows, at0, a_row, a_depth, bt0 + v * n, ldb, c + v * n, ldc, dt, acc);
        break;
#endif
      default:
        break;
    }
    t0 += depth_block;
  } while (t0 < depth);
}

// exp, with results below FLT_MIN (arguments below −87.3) flushed to 0: ALiBi's long distances
// would otherwise produce denormals, which cost ~100 cycles each on x86 when multiplied. NaN stays
// NaN (Highway's Exp clamps its argument, which would turn it into 0): a NaN score, or
// +inf − +inf, reaches its row as in the reference.
HWY_INLINE VF ExpFlushed(DF d, VF x) {
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
  // Highway's Exp with its reconstruction, two multiplies by powers of two built in integer lanes
  // (eight operations), done by one vscalefps, and the NaN test left to the polynomial, which
  // carries a NaN through: the same bits for every argument below 177 and every quiet NaN
  // (checked exhaustively; above 177 this gives inf where Highway's gives NaN), with about a
  // third fewer operations in the softmax's exp pass.
  const hn::RebindToSigned<DF> di;
  hn::impl::ExpImpl<float> impl;
  const auto q = hn::ConvertTo(di, hn::MulAdd(x, hn::Set(d, 1.442695040888963407359924681f),
                                              hn::Or(hn::Set(d, 0.5f), hn::And(x, hn::Set(d, -0.0f)))));
  const VF p = hn::Add(impl.ExpPoly(d, impl.ExpReduce(d, x, q)), hn::Set(d, 1.0f));
  return hn::IfThenZeroElse(hn::Lt(x, hn::Set(d, -87.3f)), VF{_mm512_scalef_ps(p.raw, hn::ConvertTo(d, q).raw)});
#else
  return hn::IfThenElse(hn::IsNaN(x), x, hn::IfThenZeroElse(hn::Lt(x, hn::Set(d, -87.3f)), hn::Exp(d, x)));
#endif
}

void AttnSoftmaxTile(float* HWY_RESTRICT st, std::int64_t keys, std::int64_t width, float* HWY_RESTRICT m,
                     float* HWY_RESTRICT l, float* HWY_RESTRICT correction) {
  const DF d;
  const auto n = static_cast<std::int64_t>(hn::Lanes(d));
  const VF neg_inf = hn::Set(d, -std::numeric_limits<float>::infinity());
  for (std::int64_t r = 0; r < width; r += n) {
    // Four running maxima: one chain of Max waits its latency (4 cycles) per key, which made the
    // max pass as slow as the exp pass (perf: the pass's loop held ~14% of the kernel's samples).
    // The maximum does not depend on the order, so the bits stay the same.
    VF mx = hn::LoadU(d, m + r), mx1 = mx, mx2 = mx, mx3 = mx;
    std::int64_t key = 0;
    for (; key + 4 <= keys; key += 4) {
      mx = hn::Max(mx, hn::LoadU(d, st + key * width + r));
      mx1 = hn::Max(mx1, hn::LoadU(d, st + (key + 1) * width + r));
      mx2 = hn::Max(mx2, hn::LoadU(d, st + (key + 2) * width + r));
      mx3 = hn::Max(mx3, hn::LoadU(d, st + (key + 3) * width + r));
    }
    for (; key < keys; ++key) mx = hn::Max(mx, hn::LoadU(d, st + key * width + r));
    mx = hn::Max(hn::Max(mx, mx1), hn::Max(mx2, mx3));
    const VF m_old = hn::LoadU(d, m + r);
    // Lanes still at −inf subtract 0 instead (their logits are all −inf: P = 0, no NaN).
    const auto dead = hn::Eq(mx, neg_inf);
    const VF shift = hn::IfThenZeroElse(dead, mx);
    const VF corr = hn::IfThenElse(hn::Eq(m_old, neg_inf), hn::Set(d, 1.0f), ExpFlushed(d, hn::Sub(m_old, shift)));
    VF sum = hn::Zero(d);
    for (std::int64_t j = 0; j < keys; ++j) {
      const VF p = ExpFlushed(d, hn::Sub(hn::LoadU(d, st + j * width + r), shift));
      hn::StoreU(p, d, st + j * width + r);
      sum = hn::Add(sum, p);
    }
    hn::StoreU(mx, d, m + r);
    hn::StoreU(hn::MulAdd(hn::LoadU(d, l + r), corr, sum), d, l + r);
    hn::StoreU(corr, d, correction + r);
  }
}

// Whether this target's f64 → f32 DemoteTo rounds as static_cast does: Highway's emulated
// targets clamp ±inf and values beyond FLT_MAX to ±FLT_MAX, where FoX's −inf decay must stay −inf.
constexpr bool DemotesAsCast() { return HWY_TARGET != HWY_EMU128 && HWY_TARGET != HWY_SCALAR; }

// S^T[j][r0 + t] += f32(row[r0 + t] − key_jt), key_jt = key[j·ld_key + t] per row (`per_row`)
// or key[j·ld_key] for every row: attn_add_differences and attn_add_head_differences.
void AttnAddDifferences(float* HWY_RESTRICT st, std::int64_t keys, std::int64_t width, std::int64_t r0, std::int64_t n,
                        const double* HWY_RESTRICT row, const double* HWY_RESTRICT key, std::int64_t ld_key,
                        bool per_row) {
  if (n <= 0) return;
  const hn::ScalableTag<double> dd;
  const hn::Rebind<float, decltype(dd)> df;  // half a float vector: one lane per double
  const auto lanes = static_cast<std::int64_t>(hn::Lanes(dd));
  const std::int64_t whole = DemotesAsCast() ? n - n % lanes : 0;
  for (std::int64_t j = 0; j < keys; ++j) {
    const double* HWY_RESTRICT kj = key + j * ld_key;
    const auto k_all = hn::Set(dd, kj[0]);
    float* HWY_RESTRICT out = st + j * width + r0;
    std::int64_t t = 0;
    for (; t < whole; t += lanes) {
      const auto k = per_row ? hn::LoadU(dd, kj + t) : k_all;
      const auto diff = hn::DemoteTo(df, hn::Sub(hn::LoadU(dd, row + r0 + t), k));
      hn::StoreU(hn::Add(hn::LoadU(df, out + t), diff), df, out + t);
    }
    for (; t < n; ++t) out[t] += static_cast<float>(row[r0 + t] - kj[per_row ? t : 0]);
  }
}

void AttnSoftcapTile(float* HWY_RESTRICT st, std::int64_t keys, std::int64_t width, float cap) {
  const DF d;
  const auto n = static_cast<std::int64_t>(hn::Lanes(d));
  const VF c = hn::Set(d, cap), inv = hn::Set(d, 1.0f / cap);
  for (std::int64_t t = 0; t < keys * width; t += n) {
    const VF x = hn::LoadU(d, st + t);
    // Masks apply after the cap, so an infinite logit here is a real one: ±inf caps to ±cap, as
    // cap·tanh(x/cap) does; NaN stays NaN.
    const VF capped = hn::IfThenElse(hn::IsInf(x), hn::CopySign(c, x), hn::Mul(c, hn::Tanh(d, hn::Mul(x, inv))));
    hn::StoreU(hn::IfThenElse(hn::IsNaN(x), x, capped), d, st + t);
  }
}

void AttnScaleRows(float* HWY_RESTRICT rows, std::int64_t ld, std::int64_t count, std::int64_t cols,
                   const float* HWY_RESTRICT factor) {
  const DF d;
  const auto n = static_cast<std::int64_t>(hn::Lanes(d));
  for (std::int64_t r = 0; r < count; ++r) {
    if (factor[r] == 1.0f) continue;
    const VF f = hn::Set(d, factor[r]);
    float* row = rows + r * ld;
    for (std::int64_t t = 0; t < cols; t += n) hn::StoreU(hn::Mul(hn::LoadU(d, row + t), f), d, row + t);
  }
}

void AttnBackwardTile(float* HWY_RESTRICT st, float* HWY_RESTRICT dpt, std::int64_t keys, std::int64_t width,
                      const float* HWY_RESTRICT lse, const float* HWY_RESTRICT delta, float cap) {
  const DF d;
  const auto n = static_cast<std::int64_t>(hn::Lanes(d));
  const VF neg_inf = hn::Set(d, -std::numeric_limits<float>::infinity());
  // The soft-cap's derivative 1 − (z/c)² as ((c − z)/c)·((c + z)/c): exactly 0 where the cap
  // saturates (z = ±c, as the reference's 1 − tanh² is), without 1 − u²'s cancellation near it.
  const VF c = hn::Set(d, cap), inv_cap = hn::Set(d, cap > 0 ? 1.0f / cap : 0.0f);
  for (std::int64_t r = 0; r < width; r += n) {
    const VF lv = hn::LoadU(d, lse + r);
    const auto dead = hn::Eq(lv, neg_inf);
    const VF shift = hn::IfThenZeroElse(dead, lv);
    const VF dv = hn::LoadU(d, delta + r);
    for (std::int64_t j = 0; j < keys; ++j) {
      const VF z = hn::LoadU(d, st + j * width + r);
      const VF p = hn::IfThenZeroElse(dead, ExpFlushed(d, hn::Sub(z, shift)));
      VF ds = hn::Mul(p, hn::Sub(hn::LoadU(d, dpt + j * width + r), dv));
      if (cap > 0) {
        const VF slope = hn::Mul(hn::Mul(hn::Sub(c, z), inv_cap), hn::Mul(hn::Add(c, z), inv_cap));
        // Capped logits are finite: −inf is a masked pair, which passes nothing (the slope would
        // be −inf there); a visible pair whose p underflows still multiplies, as 0·NaN must.
        ds = hn::IfThenZeroElse(hn::Eq(z, neg_inf), hn::Mul(ds, slope));
      }
      hn::StoreU(p, d, st + j * width + r);
      hn::StoreU(ds, d, dpt + j * width + r);
    }
  }
}

void AttnAddBiasTile(float* HWY_RESTRICT st, std::int64_t keys, std::int64_t width, const float* HWY_RESTRICT table,
                     std::int64_t base) {
  const DF d;
  const auto n = static_cast<std::int64_t>(hn::Lanes(d));
  for (std::int64_t j = 0; j < keys; ++j) {
    float* row = st + j * width;
    const float* t = table + base - j;
    for (std::int64_t l = 0; l < kAttnAlign; l += n)
      hn::StoreU(hn::Add(hn::LoadU(d, row + l), hn::LoadU(d, t + l)), d, row + l);
  }
}

void AttnAddBiasRows(float* HWY_RESTRICT st, std::int64_t keys, std::int64_t width, const float* HWY_RESTRICT table,
                     std::int64_t base, std::int64_t rows) {
  const DF d;
  const auto n = static_cast<std::int64_t>(hn::Lanes(d));
  for (std::int64_t j = 0; j < keys; ++j) {
    float* row = st + j * width;
    const float* t = table + (base - j) * rows;
    std::int64_t r = 0;
    for (; r + n <= rows; r += n) hn::StoreU(hn::Add(hn::LoadU(d, row + r), hn::LoadU(d, t + r)), d, row + r);
    for (; r < rows; ++r) row[r] += t[r];
  }
}

// Transformer-XL's pairs (attn_xl_add / attn_xl_collect): the side that is only read is const.
template <bool kCollect, class Tile, class Window>
HWY_INLINE void XlPairs(Tile* HWY_RESTRICT st, std::int64_t keys, std::int64_t width, Window* HWY_RESTRICT window,
                        std::int64_t ld, std::int64_t span, const std::int32_t* HWY_RESTRICT base,
                        const std::int32_t* HWY_RESTRICT key_offset) {
  const DF d;
  const hn::RebindToSigned<DF> di;
  const auto n = static_cast<std::int64_t>(hn::Lanes(d));
  const auto ld_v = hn::Set(di, static_cast<std::int32_t>(ld));
  const auto span_v = hn::Set(di, static_cast<std::int32_t>(span));
  for (std::int64_t l = 0; l < kAttnAlign; l += n) {
    const auto lane = hn::Iota(di, static_cast<std::int32_t>(l));
    const auto b = hn::LoadU(di, base + l);
    for (std::int64_t j = 0; j < keys; ++j) {
      const auto u = hn::Sub(b, hn::Set(di, key_offset[j]));
      const auto inside =
          hn::And(hn::Gt(u, hn::Set(di, -1)), hn::Lt(u, span_v));  // 0 <= u < span (no integer Ge in this Highway)
      if (hn::AllFalse(di, inside)) continue;
      // Lanes outside the window read (and, collecting, write back unchanged) their own column of
      // the window's first row: every lane's index stays distinct, so the scatter cannot collide.
      const auto index = hn::IfThenElse(inside, hn::Add(hn::Mul(u, ld_v), lane), lane);
      const auto keep = hn::RebindMask(d, inside);
      Tile* row = st + j * width + l;
      const VF gathered = hn::GatherIndex(d, window, index);
      if constexpr (kCollect) {
        hn::ScatterIndex(hn::Add(gathered, hn::IfThenElseZero(keep, hn::LoadU(d, row))), d, window, index);
      } else {
        hn::StoreU(hn::Add(hn::LoadU(d, row), hn::IfThenElseZero(keep, gathered)), d, row);
      }
    }
  }
}
void AttnXlAdd(float* HWY_RESTRICT st, std::int64_t keys, std::int64_t width, const float* HWY_RESTRICT window,
               std::int64_t ld, std::int64_t span, const std::int32_t* HWY_RESTRICT base,
               const std::int32_t* HWY_RESTRICT key_offset) {
  XlPairs<false>(st, keys, width, window, ld, span, base, key_offset);
}
void AttnXlCollect(const float* HWY_RESTRICT st, std::int64_t keys, std::int64_t width, float* HWY_RESTRICT window,
                   std::int64_t ld, std::int64_t span, const std::int32_t* HWY_RESTRICT base,
                   const std::int32_t* HWY_RESTRICT key_offset) {
  XlPairs<true>(st, keys, width, window, ld, span, base, key_offset);
}

std::int64_t AttnFireKeys(float* HWY_RESTRICT st, std::int64_t keys, std::int64_t width, const double* HWY_RESTRICT psi,
                          std::int64_t base, const double* HWY_RESTRICT inv_norm, const double* HWY_RESTRICT lo,
                          const double* HWY_RESTRICT hi, const double* HWY_RESTRICT slope,
                          const double* HWY_RESTRICT intercept) {
  const hn::ScalableTag<double> dd;
  const hn::Rebind<float, decltype(dd)> df;
  const auto n = static_cast<std::int64_t>(hn::Lanes(dd));
  for (std::int64_t j = 0; j < keys; ++j) {
    const double* p = psi + base - j;
    // Every lane still on its piece? (x is recomputed below: a multiply, cheaper than keeping it.)
    for (std::int64_t l = 0; l < kAttnAlign; l += n) {
      const auto x = hn::Mul(hn::LoadU(dd, p + l), hn::LoadU(dd, inv_norm + l));
      if (!hn::AllTrue(dd, hn::And(hn::Ge(x, hn::LoadU(dd, lo + l)), hn::Lt(x, hn::LoadU(dd, hi + l))))) return j;
    }
    float* row = st + j * width;
    for (std::int64_t l = 0; l < kAttnAlign; l += n) {
      const auto x = hn::Mul(hn::LoadU(dd, p + l), hn::LoadU(dd, inv_norm + l));
      const auto b = hn::MulAdd(hn::LoadU(dd, slope + l), x, hn::LoadU(dd, intercept + l));
      hn::StoreU(hn::Add(hn::LoadU(df, row + l), hn::DemoteTo(df, b)), df, row + l);
    }
  }
  return keys;
}

std::int64_t AttnFireMoments(const float* HWY_RESTRICT ds, std::int64_t keys, std::int64_t width,
                             const double* HWY_RESTRICT psi, const double* HWY_RESTRICT dpsi, std::int64_t base,
                             const double* HWY_RESTRICT inv_norm, const double* HWY_RESTRICT lo,
                             const double* HWY_RESTRICT hi, const double* HWY_RESTRICT slope,
                             double* HWY_RESTRICT moments) {
  const hn::ScalableTag<double> dd;
  const hn::Rebind<float, decltype(dd)> df;
  const auto n = static_cast<std::int64_t>(hn::Lanes(dd));
  double* s0 = moments;
  double* s1 = moments + kAttnAlign;
  double* t1 = moments + 2 * kAttnAlign;
  double* t2 = moments + 3 * kAttnAlign;
  for (std::int64_t j = 0; j < keys; ++j) {
    const double* p = psi + base - j;
    // Every lane still on its piece? (x is recomputed below: a multiply, cheaper than keeping it.)
    for (std::int64_t l = 0; l < kAttnAlign; l += n) {
      const auto x = hn::Mul(hn::LoadU(dd, p + l), hn::LoadU(dd, inv_norm + l));
      if (!hn::AllTrue(dd, hn::And(hn::Ge(x, hn::LoadU(dd, lo + l)), hn::Lt(x, hn::LoadU(dd, hi + l))))) return j;
    }
    const double* dp = dpsi + base - j;
    const float* row = ds + j * width;
    for (std::int64_t l = 0; l < kAttnAlign; l += n) {
      const auto x = hn::Mul(hn::LoadU(dd, p + l), hn::LoadU(dd, inv_norm + l));
      const auto g_ds = hn::PromoteTo(dd, hn::LoadU(df, row + l));
      const auto g = hn::Mul(g_ds, hn::LoadU(dd, slope + l));
      hn::StoreU(hn::Add(hn::LoadU(dd, s0 + l), g_ds), dd, s0 + l);
      hn::StoreU(hn::MulAdd(g_ds, x, hn::LoadU(dd, s1 + l)), dd, s1 + l);
      hn::StoreU(hn::MulAdd(g, hn::LoadU(dd, dp + l), hn::LoadU(dd, t1 + l)), dd, t1 + l);
      hn::StoreU(hn::MulAdd(g, x, hn::LoadU(dd, t2 + l)), dd, t2 + l);
    }
  }
  return keys;
}

void AttnMaskTile(float* HWY_RESTRICT st, std::int64_t keys, std::int64_t width, std::int64_t k_first,
                  const std::int32_t* HWY_RESTRICT lo, const std::int32_t* HWY_RESTRICT hi) {
  const DF d;
  const hn::RebindToSigned<DF> di;
  const auto n = static_cast<std::int64_t>(hn::Lanes(d));
  const VF neg_inf = hn::Set(d, -std::numeric_limits<float>::infinity());
  for (std::int64_t r = 0; r < width; r += n) {
    const auto lv = hn::LoadU(di, lo + r), hv = hn::LoadU(di, hi + r);
    for (std::int64_t j = 0; j < keys; ++j) {
      const auto key = hn::Set(di, static_cast<std::int32_t>(k_first + j));
      const auto visible = hn::RebindMask(d, hn::AndNot(hn::Lt(key, lv), hn::Lt(key, hv)));
      float* at = st + j * width + r;
      hn::StoreU(hn::IfThenElse(visible, hn::LoadU(d, at), neg_inf), d, at);
    }
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace posenc::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace posenc::kernels {

HWY_EXPORT(AttnGemm);
HWY_EXPORT(AttnSoftmaxTile);
HWY_EXPORT(AttnSoftcapTile);
HWY_EXPORT(AttnScaleRows);
HWY_EXPORT(AttnBackwardTile);
HWY_EXPORT(AttnAddBiasTile);
HWY_EXPORT(AttnXlAdd);
HWY_EXPORT(AttnXlCollect);
HWY_EXPORT(AttnFireKeys);
HWY_EXPORT(AttnFireMoments);

HWY_EXPORT(AttnMaskTile);
HWY_EXPORT(AttnAddDifferences);

HWY_EXPORT(AttnAddBiasRows);
void attn_add_bias_rows(float* st, std::int64_t keys, std::int64_t width, const float* table, std::int64_t base,
                        std::int64_t rows) {
  HWY_DYNAMIC_DISPATCH(AttnAddBiasRows)(st, keys, width, table, base, rows);
}
void attn_add_bias_tile(float* st, std::int64_t keys, std::int64_t width, const float* table, std::int64_t base) {
  HWY_DYNAMIC_DISPATCH(AttnAddBiasTile)(st, keys, width, table, base);
}
void attn_xl_add(float* st, std::int64_t keys, std::int64_t width, const float* window, std::int64_t ld,
                 std::int64_t span, const std::int32_t* base, const std::int32_t* key_offset) {
  HWY_DYNAMIC_DISPATCH(AttnXlAdd)(st, keys, width, window, ld, span, base, key_offset);
}
void attn_xl_collect(const float* st, std::int64_t keys, std::int64_t width, float* window, std::int64_t ld,
                     std::int64_t span, const std::int32_t* base, const std::int32_t* key_offset) {
  HWY_DYNAMIC_DISPATCH(AttnXlCollect)(st, keys, width, window, ld, span, base, key_offset);
}
std::int64_t attn_fire_keys(float* st, std::int64_t keys, std::int64_t width, const double* psi, std::int64_t base,
                            const double* inv_norm, const double* lo, const double* hi, const double* slope,
                            const double* intercept) {
  return HWY_DYNAMIC_DISPATCH(AttnFireKeys)(st, keys, width, psi, base, inv_norm, lo, hi, slope, intercept);
}
std::int64_t attn_fire_moments(const float* ds, std::int64_t keys, std::int64_t width, const double* psi,
                               const double* dpsi, std::int64_t base, const double* inv_norm, const double* lo,
                               const double* hi, const double* slope, double* moments) {
  return HWY_DYNAMIC_DISPATCH(AttnFireMoments)(ds, keys, width, psi, dpsi, base, inv_norm, lo, hi, slope, moments);
}
void attn_mask_tile(float* st, std::int64_t keys, std::int64_t width, std::int64_t k_first, const std::int32_t* lo,
                    const std::int32_t* hi) {
  HWY_DYNAMIC_DISPATCH(AttnMaskTile)(st, keys, width, k_first, lo, hi);
}

void attn_gemm(const float* a, std::int64_t a_row, std::int64_t a_depth, const float* b, std::int64_t ldb, float* c,
               std::int64_t ldc, std::int64_t rows, std::int64_t cols, std::int64_t depth, bool accumulate) {
  HWY_DYNAMIC_DISPATCH(AttnGemm)
  (a, a_row, a_depth, b, ldb, c, ldc, rows, cols, depth, accumulate ? 1 : 0);  // kChain : kSet
}
void attn_gemm_add(const float* a, std::int64_t a_row, std::int64_t a_depth, const float* b, std::int64_t ldb, float* c,
                   std::int64_t ldc, std::int64_t rows, std::int64_t cols, std::int64_t depth) {
  if (depth > kAttnGemmAddDepth) {
    throw Error("attention kernel", "depth", std::to_string(depth),
                "<= " + std::to_string(kAttnGemmAddDepth) + " (attn_gemm_add)");
  }
  HWY_DYNAMIC_DISPATCH(AttnGemm)(a, a_row, a_depth, b, ldb, c, ldc, rows, cols, depth, 2);  // kAddSum
}
void attn_add_differences(float* st, std::int64_t keys, std::int64_t width, std::int64_t r0, std::int64_t n,
                          const double* row, const double* key) {
  HWY_DYNAMIC_DISPATCH(AttnAddDifferences)(st, keys, width, r0, n, row, key, 1, false);
}

void attn_add_head_differences(float* st, std::int64_t keys, std::int64_t width, std::int64_t r0, std::int64_t n,
                               const double* row, const double* key, std::int64_t ld_key) {
  HWY_DYNAMIC_DISPATCH(AttnAddDifferences)(st, keys, width, r0, n, row, key, ld_key, true);
}

void attn_softmax_tile(float* st, std::int64_t keys, std::int64_t width, float* m, float* l, float* correction) {
  HWY_DYNAMIC_DISPATCH(AttnSoftmaxTile)(st, keys, width, m, l, correction);
}
void attn_softcap_tile(float* st, std::int64_t keys, std::int64_t width, float cap) {
  HWY_DYNAMIC_DISPATCH(AttnSoftcapTile)(st, keys, width, cap);
}
void attn_scale_rows(float* rows, std::int64_t ld, std::int64_t count, std::int64_t cols, const float* factor) {
  HWY_DYNAMIC_DISPATCH(AttnScaleRows)(rows, ld, count, cols, factor);
}
void attn_backward_tile(float* st, float* dpt, std::int64_t keys, std::int64_t width, const float* lse,
                        const float* delta, float cap) {
  HWY_DYNAMIC_DISPATCH(AttnBackwardTile)(st, dpt, keys, width, lse, delta, cap);
}
void attn_store(const float* src, std::int64_t n, DType dtype, void* dst, bool accumulate) {
  switch (dtype) {
    case DType::kF32: {
      auto* out = static_cast<float*>(dst);
      if (accumulate) {
        for (std::int64_t t = 0; t < n; ++t) out[t] += src[t];
      } else {
        std::memcpy(out, src, static_cast<std::size_t>(n) * sizeof(float));
      }
      return;
    }
    case DType::kBF16: {
      attn_store_bf16(src, n, static_cast<std::uint16_t*>(dst), accumulate);
      return;
    }
    case DType::kF16: {
      auto* out = static_cast<f16*>(dst);
      for (std::int64_t t = 0; t < n; ++t) out[t] = to_f16(accumulate ? from_f16(out[t]) + src[t] : src[t]);
      return;
    }
    case DType::kF64:
      break;
  }
  throw Error("attention kernel", "dtype", std::string(dtype_name(dtype)), "f32, bf16 or f16");
}

}  // namespace posenc::kernels
#endif  // HWY_ONCE
