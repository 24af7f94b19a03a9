// The plan's tables of the query-dependent terms (TUPE's projections, Transformer-XL's P(δ) and
// c(δ)) and the contraction of their gradients, as f32 matrix products (blocked_gemm).
#include "attention/attention_plan.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <string>
#include <variant>

#include "bias_checks.hpp"
#include "kernels/attention/attention_kernels.hpp"
#include "posenc/error.hpp"
#include "rotary_checks.hpp"

namespace posenc::detail {
namespace {

inline std::int64_t round_up(std::int64_t x, std::int64_t to) { return (x + to - 1) / to * to; }

// C[m][n] = Σ_t A(m, t)·B[t][n] for large operands (XL's and TUPE's tables and gradients):
// attn_gemm streams all of B for every few rows of A, so the work is cut into tiles of kRows ×
// kCols, run in parallel, each summing its depth panels of kDepth in order — the same bits for
// any thread count. The operands are copied into aligned per-thread buffers with strides off a
// multiple of 4 KiB first: the callers' operands have row strides of H·D or d_model floats (4 KiB
// at 1024), which put every row of a panel in the same few L1 sets.
//   A   a strip of kRows rows over the whole depth, copied once per row block and kept while the
//       thread's tiles stay in that block (the static schedule gives each thread consecutive
//       tiles, row block major). A transposed source (a_row = 1, as XL's dW_R and TUPE's dU read
//       theirs) is kept transposed, [t][m], so that every copy is a contiguous run and attn_gemm
//       reads it with a_row = 1; a row source as rows, [m][t]. A strip holds (kRows + 16) × depth
//       floats per thread: 10 MiB at a depth of 32768, a small part of the operands it is cut
//       from (XL's dW_R reads a [δ span, H·D] matrix: 128 MiB at that span and H·D = 1024).
//   B   a panel of kDepth × kCols per tile and depth step.
// attn_gemm sums every element in depth order whatever A's layout, so the layout does not move a
// bit. Measured by perf on an XL backward (S 2048, H 8, D 128, 2 threads, one run each): with A's
// panel copied per tile and depth step, element by element when transposed, blocked_gemm's own
// samples and memmove's were 5.8% of the run's; with the strip, at most 3.8%.
// cols: a multiple of kAttnAlign.
void blocked_gemm(const float* a, std::int64_t a_row, std::int64_t a_depth, const float* b, std::int64_t ldb, float* c,
                  std::int64_t ldc, std::int64_t rows, std::int64_t cols, std::int64_t depth) {
  constexpr std::int64_t kRows = 64, kCols = 128, kDepth = 256;
  constexpr std::int64_t kLdb = kCols + kernels::kAttnAlign;
  const bool a_transposed = a_depth != 1;
  // The strip's stride: kRows + pad floats per depth step when transposed, else depth + pad per row.
  const std::int64_t lda =
      a_transposed ? kRows + kernels::kAttnAlign : round_up(depth, kernels::kAttnAlign) + kernels::kAttnAlign;
  const std::int64_t row_blocks = (rows + kRows - 1) / kRows, col_blocks = (cols + kCols - 1) / kCols;
  const std::int64_t tiles = row_blocks * col_blocks;
  const int threads =
      std::min<int>(threads_for(rows * cols * depth), static_cast<int>(std::max<std::int64_t>(tiles, 1)));
#pragma omp parallel num_threads(threads)
  {
    thread_local AlignedFloats a_strip, b_panel;
    a_strip.resize(static_cast<std::size_t>(a_transposed ? depth * lda : kRows * lda));
    b_panel.resize(static_cast<std::size_t>(kDepth * kLdb));
    std::int64_t strip_m0 = -1;  // the row block a_strip holds
#pragma omp for schedule(static)
    for (std::int64_t tile = 0; tile < tiles; ++tile) {
      const std::int64_t m0 = tile / col_blocks * kRows, n0 = tile % col_blocks * kCols;
      const std::int64_t m = std::min(kRows, rows - m0), n = std::min(kCols, cols - n0);
      if (m0 != strip_m0) {
        if (a_transposed) {
          for (std::int64_t t = 0; t < depth; ++t) {
            const float* from = a + m0 * a_row + t * a_depth;
            float* to = a_strip.data() + t * lda;
            if (a_row == 1) {
              std::copy(from, from + m, to);
            } else {
              for (std::int64_t i = 0; i < m; ++i) to[i] = from[i * a_row];
            }
          }
        } else {
          for (std::int64_t i = 0; i < m; ++i) {
            const float* from = a + (m0 + i) * a_row;
            std::copy(from, from + depth, a_strip.data() + i * lda);
          }
        }
        strip_m0 = m0;
      }
      for (std::int64_t t0 = 0; t0 < depth; t0 += kDepth) {
        const std::int64_t k = std::min(kDepth, depth - t0);
        for (std::int64_t t = 0; t < k; ++t) {
          const float* from = b + (t0 + t) * ldb + n0;
          std::copy(from, from + n, b_panel.data() + t * kLdb);
        }
        if (a_transposed) {
          kernels::attn_gemm(a_strip.data() + t0 * lda, 1, lda, b_panel.data(), kLdb, c + m0 * ldc + n0, ldc, m, n, k,
                             t0 > 0);
        } else {
          kernels::attn_gemm(a_strip.data() + t0, lda, 1, b_panel.data(), kLdb, c + m0 * ldc + n0, ldc, m, n, k,
                             t0 > 0);
        }
      }
    }
  }
}

// [rows][heads][dp] → [heads][rows][dp]: one head's rows contiguous (see XlTables).
AlignedFloats heads_major(const std::vector<float>& by_row, std::int64_t rows, std::int64_t heads, std::int64_t dp) {
  AlignedFloats out(by_row.size());
  for (std::int64_t h = 0; h < heads; ++h) {
    for (std::int64_t r = 0; r < rows; ++r) {
      const float* from = by_row.data() + (r * heads + h) * dp;
      std::copy(from, from + dp, out.data() + (h * rows + r) * dp);
    }
  }
  return out;
}

}  // namespace

// ── TUPE: each position's projections for the call's position range, one f32 matrix product
// per table (p·U, blocked_gemm); pq carries 1/sqrt(2D).
void AttentionPlan::build_tupe_tables(const std::vector<HeadGroup>& groups, std::int64_t p_min, std::int64_t p_max) {
  tupe.resize(groups.size());
  for (std::size_t gi = 0; gi < groups.size(); ++gi) {
    const TupeParams* params = groups[gi].bias ? std::get_if<TupeParams>(&*groups[gi].bias) : nullptr;
    if (params == nullptr) continue;
    check_tupe_positions(kWhere, *params, *q_positions, *k_positions);
    if (params->head_dim() != dim) {
      throw Error(kWhere, ("groups[" + std::to_string(gi) + "].bias (TUPE) head_dim").c_str(),
                  std::to_string(params->head_dim()),
                  "the head_dim of q, " + std::to_string(dim) + " (its projections meet in the score tiles)");
    }
    if (!any_tupe) {
      any_tupe = true;
      tupe_first = p_min;
      tupe_count = p_max - p_min + 1;
      detail::init_dispatch();
    }
    TupeTables& t = tupe[gi];
    const std::int64_t hg = groups[gi].heads, dm = params->d_model(), dmp = round_up(dm, kernels::kAttnAlign);
    const std::int64_t cols = hg * dim_padded, hd = hg * dim;
    t.heads = hg;
    t.cls_reset = params->cls_reset();
    std::vector<float> rows(static_cast<std::size_t>(tupe_count * dmp), 0.0f),
        u(static_cast<std::size_t>(dmp * cols), 0.0f);
    for (std::int64_t n = 0; n < tupe_count; ++n) {
      for (std::int64_t m = 0; m < dm; ++m) {
        rows[static_cast<std::size_t>(n * dmp + m)] =
            static_cast<float>(params->table()[static_cast<std::size_t>((tupe_first + n) * dm + m)]);
      }
    }
    const double pq_scale = 1.0 / std::sqrt(2.0 * static_cast<double>(dim));
    for (const bool is_q : {true, false}) {
      const std::vector<double>& weights = is_q ? params->u_q() : params->u_k();
      for (std::int64_t m = 0; m < dm; ++m) {
        for (std::int64_t h = 0; h < hg; ++h) {
          for (std::int64_t d = 0; d < dim; ++d) {
            const double w = weights[static_cast<std::size_t>(m * hd + h * dim + d)] * (is_q ? pq_scale : 1.0);
            u[static_cast<std::size_t>(m * cols + h * dim_padded + d)] = static_cast<float>(w);
          }
        }
      }
      AlignedFloats& out = is_q ? t.pq : t.pk;
      out.assign(static_cast<std::size_t>(tupe_count * cols), 0.0f);
      std::vector<float> by_position(static_cast<std::size_t>(tupe_count * cols), 0.0f);
      blocked_gemm(rows.data(), dmp, 1, u.data(), cols, by_position.data(), cols, tupe_count, cols, dm);
      if (t.cls_reset && tupe_first == 0) std::fill(by_position.begin(), by_position.begin() + cols, 0.0f);
      out = heads_major(by_position, tupe_count, hg, dim_padded);
    }
    t.theta1.assign(params->theta1().begin(), params->theta1().end());
    t.theta2.assign(params->theta2().begin(), params->theta2().end());
  }
}

// TUPE's parameter gradients from the per-KV-head totals of the units' [dPQ | dPK | θ1 | θ2]
// by position (fp64; dPQ against the scaled pq, so times 1/sqrt(2D) here):
//   dU^Q[m][h·D + d] += Σ_pos p[pos][m]·dPQ_h[pos][d],  dp[pos][m] += Σ_c U^Q[m][c]·dPQ[pos][c]
// and the same for K — f32 matrix products (blocked_gemm) added in fp64.
void AttentionPlan::finish_tupe_gradients(const std::vector<double>& totals, AttentionGradients& grads) const {
  const std::int64_t per_kv = tupe_unit_gradient_size(), dp = dim_padded, g_count = group_size;
  const double pq_scale = 1.0 / std::sqrt(2.0 * static_cast<double>(dim));
  for (std::size_t gi = 0; gi < tupe.size(); ++gi) {
    const TupeTables& t = tupe[gi];
    if (t.heads == 0) continue;
    const TupeParams& params = std::get<TupeParams>(*spec.groups[gi].bias);
    TupeGradients& out = *grads.groups[gi].tupe;
    const std::int64_t hg = t.heads, h_first = group_first_head[gi], cols = hg * dp, hd = hg * dim;
    const std::int64_t dm = params.d_model(), dmp = round_up(dm, kernels::kAttnAlign);
    AlignedFloats& rows = zeroed_floats(CallBuffer::kTupeRows, static_cast<std::size_t>(tupe_count * dmp));
    // Every loop below writes disjoint elements, each from its own inputs: in parallel, the same
    // bits for any thread count.
#pragma omp parallel for schedule(static) num_threads(threads_for(tupe_count* dm))
    for (std::int64_t n = 0; n < tupe_count; ++n) {
      for (std::int64_t m = 0; m < dm; ++m) {
        rows[static_cast<std::size_t>(n * dmp + m)] =
            static_cast<float>(params.table()[static_cast<std::size_t>((tupe_first + n) * dm + m)]);
      }
    }
    for (const bool is_q : {true, false}) {
      // d(projection) [count][hg·Dp] in f32 from the per-KV-head totals.
      AlignedFloats& d_proj = zeroed_floats(CallBuffer::kTupeProjected, static_cast<std::size_t>(tupe_count * cols));
#pragma omp parallel for schedule(static) \
    num_threads(std::min <int>(threads_for(tupe_count * cols), static_cast <int>(hg)))
      for (std::int64_t lh = 0; lh < hg; ++lh) {
        const std::int64_t h = h_first + lh, kvh = h / g_count, g = h % g_count;
        const double* part = totals.data() + kvh * per_kv + (is_q ? 0 : tupe_count * g_count * dp);
        const double factor = is_q ? pq_scale : 1.0;
        for (std::int64_t n = 0; n < tupe_count; ++n) {
          for (std::int64_t d = 0; d < dim; ++d) {
            d_proj[static_cast<std::size_t>(n * cols + lh * dp + d)] =
                static_cast<float>(factor * part[(n * g_count + g) * dp + d]);
          }
        }
        const double* theta = totals.data() + kvh * per_kv + 2 * tupe_count * g_count * dp;
        if (is_q && t.cls_reset) {
          out.theta1[static_cast<std::size_t>(lh)] += theta[g];
          out.theta2[static_cast<std::size_t>(lh)] += theta[g_count + g];
        }
      }
      // dU[m][c] = Σ_n rows[n][m]·d_proj[n][c].
      AlignedFloats& du = zeroed_floats(CallBuffer::kTupeDu, static_cast<std::size_t>(dmp * cols));
      blocked_gemm(rows.data(), 1, dmp, d_proj.data(), cols, du.data(), cols, dm, cols, tupe_count);
      std::vector<double>& u_grad = is_q ? out.u_q : out.u_k;
      const std::vector<double>& weights = is_q ? params.u_q() : params.u_k();
#pragma omp parallel for schedule(static) num_threads(threads_for(dm* cols))
      for (std::int64_t m = 0; m < dm; ++m) {
        for (std::int64_t lh = 0; lh < hg; ++lh) {
          for (std::int64_t d = 0; d < dim; ++d) {
            u_grad[static_cast<std::size_t>(m * hd + lh * dim + d)] +=
                du[static_cast<std::size_t>(m * cols + lh * dp + d)];
          }
        }
      }
      // d table[n][m] = Σ_c d_proj[n][c]·U[m][c]: B = Uᵀ as [cols][dmp].
      AlignedFloats& ut = zeroed_floats(CallBuffer::kTupeUt, static_cast<std::size_t>(cols * dmp));
      AlignedFloats& dtable = zeroed_floats(CallBuffer::kTupeDtable, static_cast<std::size_t>(tupe_count * dmp));
#pragma omp parallel for schedule(static) num_threads(threads_for(dm* cols))
      for (std::int64_t m = 0; m < dm; ++m) {
        for (std::int64_t lh = 0; lh < hg; ++lh) {
          for (std::int64_t d = 0; d < dim; ++d) {
            ut[static_cast<std::size_t>((lh * dp + d) * dmp + m)] =
                static_cast<float>(weights[static_cast<std::size_t>(m * hd + lh * dim + d)]);
          }
        }
      }
      blocked_gemm(d_proj.data(), cols, 1, ut.data(), dmp, dtable.data(), dmp, tupe_count, dmp, cols);
#pragma omp parallel for schedule(static) num_threads(threads_for(tupe_count* dm))
      for (std::int64_t n = 0; n < tupe_count; ++n) {
        for (std::int64_t m = 0; m < dm; ++m) {
          out.table[static_cast<std::size_t>((tupe_first + n) * dm + m)] +=
              dtable[static_cast<std::size_t>(n * dmp + m)];
        }
      }
    }
  }
}

// r(δ) for the table's δ, as XlParams::sinusoid computes it (same frequencies, same fp64 angle
// δ·ω_i), rounded to f32; the frequencies once, not per δ.
std::vector<float> AttentionPlan::xl_sinusoids(const XlParams& params, std::int64_t padded_d_model) const {
  const std::int64_t half = params.d_model() / 2;
  std::vector<double> frequency(static_cast<std::size_t>(half));
  for (std::int64_t i = 0; i < half; ++i) {
    frequency[static_cast<std::size_t>(i)] = sinusoid_inv_frequency(params.base(), params.d_model(), i);
  }
  std::vector<float> r(static_cast<std::size_t>(xl_width * padded_d_model), 0.0f);
  for (std::int64_t u = 0; u < xl_width; ++u) {
    float* row = r.data() + u * padded_d_model;
    for (std::int64_t i = 0; i < half; ++i) {
      const double angle = static_cast<double>(xl_delta_min + u) * frequency[static_cast<std::size_t>(i)];
      row[i] = static_cast<float>(std::sin(angle));
      row[half + i] = static_cast<float>(std::cos(angle));
    }
  }
  return r;
}

// ── Transformer-XL: P_h(δ) = W_R r(δ) for the δ of the pairs the mask lets through (exact per
// query with default key positions; the sequence's key-position range otherwise), as one f32
// matrix product r·W_Rᵀ (blocked_gemm); c_h(δ) from P in fp64.
void AttentionPlan::build_xl_tables(const std::vector<HeadGroup>& groups) {
  xl.resize(groups.size());
  std::int64_t xl_heads = 0;
  for (const HeadGroup& grp : groups) xl_heads += grp.xl ? grp.heads : 0;
  if (xl_heads == 0) return;
  any_xl = true;
  std::int64_t lo = std::numeric_limits<std::int64_t>::max(), hi = std::numeric_limits<std::int64_t>::min();
  const bool default_keys = !spec.k_positions.has_value();
  for (const Sequence& seq : sequences) {
    std::int64_t k_lo = std::numeric_limits<std::int64_t>::max(), k_hi = std::numeric_limits<std::int64_t>::min();
    if (!default_keys) {
      for (std::int64_t j = 0; j < seq.lk; ++j) {
        k_lo = std::min(k_lo, k_position(seq, j));
        k_hi = std::max(k_hi, k_position(seq, j));
      }
    }
    const std::int64_t offset = seq.lk - seq.lq;
    for (std::int64_t i = 0; i < seq.lq; ++i) {
      std::int64_t first = 0, last = seq.lk;  // visible keys [first, last), layout_rows' rule
      if (mask.window_left >= 0) first = std::max<std::int64_t>(0, i + offset - mask.window_left);
      if (window_right >= 0) last = std::min<std::int64_t>(seq.lk, i + offset + window_right + 1);
      if (last <= first) continue;
      const std::int64_t qp = q_position(seq, i);
      lo = std::min(lo, qp - (default_keys ? last - 1 : k_hi));
      hi = std::max(hi, qp - (default_keys ? first : k_lo));
    }
  }
  if (lo > hi) lo = hi = 0;  // nothing visible: a one-row table keeps the code paths uniform
  xl_delta_min = lo;
  xl_width = hi - lo + 1;
  // The table is [δ span, XL heads, Dp] floats; past 2^29 (2 GiB) the positions are too scattered
  // for tabulation: say so rather than allocate it.
  constexpr std::int64_t kMaxXlTable = std::int64_t{1} << 29;
  if (xl_width > kMaxXlTable / (xl_heads * dim_padded)) {
    throw Error(kWhere, "groups[].xl", "a δ = q − k span of " + std::to_string(xl_width) + " positions",
                "at most " + std::to_string(kMaxXlTable / (xl_heads * dim_padded)) +
                    " for fused Transformer-XL (P(δ) is tabulated); use xl_add_position_terms for scattered positions");
  }
  detail::init_dispatch();
  for (std::size_t gi = 0; gi < groups.size(); ++gi) {
    if (!groups[gi].xl) continue;
    const XlParams& params = *groups[gi].xl;
    XlTables& t = xl[gi];
    const std::int64_t hg = groups[gi].heads, dm = params.d_model(), dmp = round_up(dm, kernels::kAttnAlign);
    const std::int64_t cols = hg * dim_padded;
    t.heads = hg;
    t.sinusoids = xl_sinusoids(params, dmp);
    t.d_model_padded = dmp;
    const std::vector<float>& r = t.sinusoids;
    std::vector<float> wt(static_cast<std::size_t>(dmp * cols), 0.0f);
    for (std::int64_t h = 0; h < hg; ++h) {
      for (std::int64_t d = 0; d < dim; ++d) {
        for (std::int64_t m = 0; m < dm; ++m) {
          wt[static_cast<std::size_t>(m * cols + h * dim_padded + d)] =
              static_cast<float>(params.w_r()[static_cast<std::size_t>((h * dim + d) * dm + m)]);
        }
      }
    }
    std::vector<float> by_delta(static_cast<std::size_t>(xl_width * cols), 0.0f);
    blocked_gemm(r.data(), dmp, 1, wt.data(), cols, by_delta.data(), cols, xl_width, cols, dm);
    t.width = xl_width;
    t.projected = heads_major(by_delta, xl_width, hg, dim_padded);
    t.u.assign(static_cast<std::size_t>(hg * dim), 0.0f);
    t.constant.assign(static_cast<std::size_t>(hg * xl_width), 0.0f);
    for (std::int64_t h = 0; h < hg; ++h) {
      for (std::int64_t d = 0; d < dim; ++d)
        t.u[static_cast<std::size_t>(h * dim + d)] =
            static_cast<float>(params.u()[static_cast<std::size_t>(h * dim + d)]);
      for (std::int64_t u = 0; u < xl_width; ++u) {
        const float* row = t.p_row(u, h, dim_padded);
        double c = 0;
        for (std::int64_t d = 0; d < dim; ++d) {
          const auto at = static_cast<std::size_t>(h * dim + d);
          c += (params.v()[at] - params.u()[at]) * static_cast<double>(row[d]);
        }
        t.constant[static_cast<std::size_t>(h * xl_width + u)] = static_cast<float>(scale_f64 * c);
      }
    }
  }
}

// XL's parameter gradients from the per-KV-head totals of the units' [dP | Σ dS | Σ dQs] (fp64):
//   dP_h(δ) = Σ dS·Qs + scale·(v_h − u_h)·Σ dS      (the second part through c_h(δ))
//   dv_h = scale·Σ_δ (Σ dS)·P_h(δ),   du_h = Σ_i d(q + u)_i − dv_h,
//   dW_R[h·D + d][m] = Σ_δ dP_h(δ)[d]·r(δ)[m]  (an f32 matrix product, blocked_gemm).
void AttentionPlan::finish_xl_gradients(const std::vector<double>& totals, AttentionGradients& grads) const {
  const std::int64_t per_kv = xl_unit_gradient_size(), dp = dim_padded, g_count = group_size;
  for (std::size_t gi = 0; gi < xl.size(); ++gi) {
    const XlTables& t = xl[gi];
    if (t.heads == 0) continue;
    const XlParams& params = *spec.groups[gi].xl;
    XlGradients& out = *grads.groups[gi].xl;
    const std::int64_t hg = t.heads, h_first = group_first_head[gi], cols = hg * dp;
    AlignedFloats& d_projected = zeroed_floats(CallBuffer::kXlProjected, static_cast<std::size_t>(xl_width * cols));
    // Heads are independent (their own columns of d_projected, their own u and v): in parallel.
#pragma omp parallel for schedule(static) \
    num_threads(std::min <int>(threads_for(xl_width * cols), static_cast <int>(hg)))
    for (std::int64_t lh = 0; lh < hg; ++lh) {
      const std::int64_t h = h_first + lh, kvh = h / g_count, g = h % g_count;
      const double* dp_total = totals.data() + kvh * per_kv;
      const double* hist = dp_total + xl_width * g_count * dp + g * xl_width;
      const double* dqs = dp_total + xl_width * g_count * (dp + 1) + g * dim;
      // δ outer, so that every row walks in memory order; each dv[d] still sums over δ in order.
      std::vector<double> dv(static_cast<std::size_t>(dim), 0.0);
      for (std::int64_t u = 0; u < xl_width; ++u) {
        const double sum = hist[u];
        const float* p_row = t.p_row(u, lh, dp);
        const double* dp_row = dp_total + (u * g_count + g) * dp;
        float* to = d_projected.data() + u * cols + lh * dp;
        for (std::int64_t d = 0; d < dim; ++d) {
          const auto at = static_cast<std::size_t>(lh * dim + d);
          dv[static_cast<std::size_t>(d)] += sum * static_cast<double>(p_row[d]);
          to[d] = static_cast<float>(dp_row[d] + scale_f64 * (params.v()[at] - params.u()[at]) * sum);
        }
      }
      for (std::int64_t d = 0; d < dim; ++d) {
        const auto at = static_cast<std::size_t>(lh * dim + d);
        const double dv_d = dv[static_cast<std::size_t>(d)] * scale_f64;
        out.v[at] += dv_d;
        out.u[at] += dqs[d] - dv_d;
      }
    }
    const std::int64_t dm = params.d_model(), dmp = t.d_model_padded;
    const std::vector<float>& r = t.sinusoids;
    AlignedFloats& dw = zeroed_floats(CallBuffer::kXlDw, static_cast<std::size_t>(cols * dmp));
    blocked_gemm(d_projected.data(), 1, cols, r.data(), dmp, dw.data(), dmp, cols, dmp, xl_width);
#pragma omp parallel for schedule(static) num_threads(threads_for(cols* dm))
    for (std::int64_t row = 0; row < hg * dim; ++row) {
      const std::int64_t lh = row / dim, d = row % dim;
      for (std::int64_t m = 0; m < dm; ++m) {
        out.w_r[static_cast<std::size_t>((lh * dim + d) * dm + m)] +=
            dw[static_cast<std::size_t>((lh * dp + d) * dmp + m)];
      }
    }
  }
}

}  // namespace posenc::detail
