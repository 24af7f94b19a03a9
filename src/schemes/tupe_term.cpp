// TUPE (Ke et al. 2021) inside the fused attention (a group's bias, TupeParams), as a ScoreTerm:
// its bias is a product of per-position projections, PQ_i·PK_j with
//   pq = p[pos]·U^Q_h / sqrt(2D),   pk = p[pos]·U^K_h
// tabulated for the call's positions; a tile's biases are a second matrix product per head run
// (keys' PK rows straight from the table when their positions are consecutive), and backward
// takes two more (dPQ += dS·PK, dPK = dSᵀ·PQ), like the content products. With the [CLS] reset,
// position 0's rows are zero and θ1 (query at 0) / θ2 (only the key at 0) are added on their own.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <string>
#include <variant>

#include "attention/engine.hpp"
#include "attention/score_term.hpp"
#include "schemes/fused_terms.hpp"
#include "bias_checks.hpp"
#include "kernels/attention/attention_kernels.hpp"
#include "posenc/error.hpp"

namespace posenc::detail {
namespace {

// The group's projections in f32 for the positions [first, first + count),
// [heads][count][Dp] zero-padded (head-major, as XL's tables, for the same reason).
struct TupeTables {
  std::int64_t heads = 0;
  bool cls_reset = false;
  AlignedFloats pq, pk, theta1, theta2;
};

// The term state's buffers: PQ of the rows transposed [Dp][rows] and as rows [rows][Dp]; keys'
// PK gathered [keys][Dp] (decode: a row's dots over a tile of consecutive keys, [keys]);
// backward: dPQ rows [rows][Dp], a tile's dPK [keys][Dp], the unit's dPK by position [count][G][Dp].
enum Buffer { kPqT, kPq, kPk, kDpq, kDpk, kDpkPositions };

class TupeTerm final : public GroupTerm<TupeTables> {
 public:
  // The bias of group `group`, `params` the plan's own.
  TupeTerm(const AttentionPlan& p, std::int64_t group, const TupeParams& params);

  bool merges_decode_heads() const override { return false; }
  std::int64_t bytes() const override {
    return static_cast<std::int64_t>((table_.pq.size() + table_.pk.size()) * sizeof(float));
  }
  void begin(const TermRows& rows, TermState& s) const override {
    s.rows = rows;
    load_rows(*rows.rows, s, rows.qt == nullptr);
  }
  void add_scores(const TermTile& tile, float* st, TermState& s) const override {
    if (tile.decode) {
      add_direct(*tile.rows, tile.keys, tile.kpos, s.buffers[kPq].data(), st, s);
    } else {
      add_tile(*tile.rows, tile.r0, padded_stride(s.rows.rows->width), tile.keys, tile.kpos, s, st);
    }
  }
  std::int64_t unit_gradient_size() const override {
    return 2 * count_ * p_.group_size * p_.dim_padded + 2 * p_.group_size;
  }
  void begin_backward(const TermRows& rows, double* unit_grads, TermState& s) const override {
    s.rows = rows;
    s.unit_grads = unit_grads;
    load_rows(*rows.rows, s, true);
    if (unit_grads == nullptr) return;  // dPQ and dPK serve only the parameters' gradients
    const std::int64_t w = rows.rows->width, dp = p_.dim_padded, n = count_ * p_.group_size * dp;
    grow(s.buffers[kDpq], w * dp);
    std::fill(s.buffers[kDpq].begin(), s.buffers[kDpq].begin() + w * dp, 0.0f);
    grow(s.buffers[kDpkPositions], n);
    std::fill(s.buffers[kDpkPositions].begin(), s.buffers[kDpkPositions].begin() + n, 0.0f);
  }
  void backward_tile(const TermTile& tile, const float* pt, const float* dst, TermState& s) const override;
  void finish_backward(TermState& s) const override;
  void reduce(std::span<const TermUnit> units, AttentionGradients& grads) const override;

 private:
  // Row of pq or pk (is_q) for position pos and head h.
  const float* row(const TupeTables& t, bool is_q, std::int64_t pos, std::int64_t h) const {
    return (is_q ? t.pq : t.pk).data() + (local_head(h) * count_ + (pos - first_)) * p_.dim_padded;
  }
  void load_rows(const RowBlock& rb, TermState& s, bool as_rows) const;
  const float* keys_of(const TupeTables& t, std::int64_t h, std::int64_t keys, const std::int64_t* kpos,
                       TermState& s) const;
  void add_tile(const RowBlock& rb, std::int64_t r0, std::int64_t ld_rows, std::int64_t keys, const std::int64_t* kpos,
                TermState& s, float* st) const;
  void add_direct(const RowBlock& rb, std::int64_t keys, const std::int64_t* kpos, const float* pq_rows, float* st,
                  TermState& s) const;

  const TupeParams& params_;
  std::int64_t first_ = 0, count_ = 0;
};

// Each position's projections for the call's position range, one f32 matrix product per table
// (p·U, blocked_gemm); pq carries 1/sqrt(2D).
TupeTerm::TupeTerm(const AttentionPlan& p, std::int64_t group, const TupeParams& params)
    : GroupTerm(p, group), params_(params) {
  const std::int64_t dim = p.dim, dp = p.dim_padded;
  first_ = std::min(p.position_range.q_min, p.position_range.k_min);
  count_ = std::max(p.position_range.q_max, p.position_range.k_max) - first_ + 1;
  init_dispatch();
  check_tupe_positions(AttentionPlan::kWhere, params, *p.q_positions, *p.k_positions);
  if (params.head_dim() != dim) {
    throw Error(AttentionPlan::kWhere, ("groups[" + std::to_string(group) + "].bias (TUPE) head_dim").c_str(),
                std::to_string(params.head_dim()),
                "the head_dim of q, " + std::to_string(dim) + " (its projections meet in the score tiles)");
  }
  TupeTables& t = table_;
  const std::int64_t hg = params.heads(), dm = params.d_model(), dmp = round_up(dm, kAttnAlign);
  const std::int64_t cols = hg * dp, hd = hg * dim;
  t.heads = hg;
  t.cls_reset = params.cls_reset();
  std::vector<float> rows(static_cast<std::size_t>(count_ * dmp), 0.0f), u(static_cast<std::size_t>(dmp * cols), 0.0f);
  for (std::int64_t n = 0; n < count_; ++n) {
    for (std::int64_t m = 0; m < dm; ++m) {
      rows[static_cast<std::size_t>(n * dmp + m)] =
          static_cast<float>(params.table()[static_cast<std::size_t>((first_ + n) * dm + m)]);
    }
  }
  const double pq_scale = 1.0 / std::sqrt(2.0 * static_cast<double>(dim));
  for (const bool is_q : {true, false}) {
    const std::vector<double>& weights = is_q ? params.u_q() : params.u_k();
    for (std::int64_t m = 0; m < dm; ++m) {
      for (std::int64_t h = 0; h < hg; ++h) {
        for (std::int64_t d = 0; d < dim; ++d) {
          const double w = weights[static_cast<std::size_t>(m * hd + h * dim + d)] * (is_q ? pq_scale : 1.0);
          u[static_cast<std::size_t>(m * cols + h * dp + d)] = static_cast<float>(w);
        }
      }
    }
    std::vector<float> by_position(static_cast<std::size_t>(count_ * cols), 0.0f);
    blocked_gemm(rows.data(), dmp, 1, u.data(), cols, by_position.data(), cols, count_, cols, dm);
    if (t.cls_reset && first_ == 0) std::fill(by_position.begin(), by_position.begin() + cols, 0.0f);
    (is_q ? t.pq : t.pk) = heads_major(by_position, count_, hg, dp);
  }
  t.theta1.assign(params.theta1().begin(), params.theta1().end());
  t.theta2.assign(params.theta2().begin(), params.theta2().end());
}

// PQ of the block's rows: transposed [Dp][padded_stride(w)] (tile products; the padding keeps
// the columns of a long unit off one L1 set, as for qt) and, as_rows, [w][Dp]. Blocks of 16 rows,
// so that each write of the transpose fills a cache line.
void TupeTerm::load_rows(const RowBlock& rb, TermState& s, bool as_rows) const {
  const std::int64_t w = rb.width, dp = p_.dim_padded, ld = padded_stride(w);
  AlignedFloats &pqt = s.buffers[kPqT], &pq = s.buffers[kPq];
  grow(pqt, dp * ld);
  if (as_rows) grow(pq, w * dp);
  constexpr std::int64_t kBlock = 16;
  std::array<const float*, kBlock> rows{};
  for (std::int64_t r0 = 0; r0 < w; r0 += kBlock) {
    const std::int64_t n = std::min(kBlock, w - r0);
    for (std::int64_t r = 0; r < n; ++r) {
      const std::int64_t h = rb.head[static_cast<std::size_t>(r0 + r)];
      const TupeTables* t = h < 0 ? nullptr : of_head(h);
      rows[static_cast<std::size_t>(r)] =
          t == nullptr ? nullptr : row(*t, true, rb.position[static_cast<std::size_t>(r0 + r)], h);
    }
    for (std::int64_t d = 0; d < dp; ++d) {
      float* to = pqt.data() + d * ld + r0;
      for (std::int64_t r = 0; r < n; ++r) {
        const float* from = rows[static_cast<std::size_t>(r)];
        to[r] = from == nullptr ? 0.0f : from[d];
      }
    }
    if (!as_rows) continue;
    for (std::int64_t r = 0; r < n; ++r) {
      const float* from = rows[static_cast<std::size_t>(r)];
      float* to = pq.data() + (r0 + r) * dp;
      if (from == nullptr) {
        std::fill(to, to + dp, 0.0f);
      } else {
        std::copy(from, from + dp, to);
      }
    }
  }
}

// The keys' PK rows of head h (Dp apart): a view into the table when their positions are
// consecutive, else gathered into the state.
const float* TupeTerm::keys_of(const TupeTables& t, std::int64_t h, std::int64_t keys, const std::int64_t* kpos,
                               TermState& s) const {
  const std::int64_t dp = p_.dim_padded;
  if (positions_consecutive(kpos, keys)) return row(t, false, kpos[0], h);
  grow(s.buffers[kPk], keys * dp);
  for (std::int64_t j = 0; j < keys; ++j) {
    std::memcpy(s.buffers[kPk].data() + j * dp, row(t, false, kpos[j], h),
                static_cast<std::size_t>(dp) * sizeof(float));
  }
  return s.buffers[kPk].data();
}

// S^T[j][r] += PK_j·PQ_r (PQ^T columns r0 + r, ld_rows apart), and the [CLS] values.
void TupeTerm::add_tile(const RowBlock& rb, std::int64_t r0, std::int64_t ld_rows, std::int64_t keys,
                        const std::int64_t* kpos, TermState& s, float* st) const {
  const std::int64_t w = rb.width;
  for_each_run(rb, [&](std::int64_t ra, std::int64_t n, std::int64_t h) {
    const TupeTables& t = *of_head(h);
    const float* pk = keys_of(t, h, keys, kpos, s);
    kernels::attn_gemm(pk, p_.dim_padded, 1, s.buffers[kPqT].data() + r0 + ra, ld_rows, st + ra, w, keys, n, p_.dim,
                       true);
    if (!t.cls_reset) return;
    const std::int64_t lh = local_head(h);
    const float theta1 = t.theta1[static_cast<std::size_t>(lh)], theta2 = t.theta2[static_cast<std::size_t>(lh)];
    for (std::int64_t r = ra; r < ra + n; ++r) {
      if (rb.head[static_cast<std::size_t>(r)] != h) continue;
      const bool cls_query = rb.position[static_cast<std::size_t>(r)] == 0;
      for (std::int64_t j = 0; j < keys; ++j) {
        if (cls_query) {
          st[j * w + r] += theta1;
        } else if (kpos[j] == 0) {
          st[j * w + r] += theta2;
        }
      }
    }
  });
}

// Decode rows: st[j][r] += b(h, q, k_j) by dot products (pq_rows: [rows][Dp]).
void TupeTerm::add_direct(const RowBlock& rb, std::int64_t keys, const std::int64_t* kpos, const float* pq_rows,
                          float* st, TermState& s) const {
  const std::int64_t w = rb.width, dp = p_.dim_padded;
  // Keys at consecutive positions read consecutive PK rows: one block for the decode score
  // kernel, in vectors.
  const bool consecutive = keys > 0 && positions_consecutive(kpos, keys);
  if (consecutive) grow(s.buffers[kPk], keys);
  for (std::int64_t r = 0; r < w; ++r) {
    const std::int64_t h = rb.head[static_cast<std::size_t>(r)];
    const TupeTables* t = h < 0 ? nullptr : of_head(h);
    if (t == nullptr) continue;
    const std::int64_t lh = local_head(h), qp = rb.position[static_cast<std::size_t>(r)];
    const float* a = pq_rows + r * dp;
    const bool query_cls = t->cls_reset && qp == 0;
    if (consecutive && !query_cls) {
      float* dots = s.buffers[kPk].data();
      kernels::attn_decode_scores(row(*t, false, kpos[0], h), DType::kF32, dp, 0, keys, 1, &a, dp, 1, p_.dim, &dots, 1,
                                  kernels::RowPrefetch{}, false);
      for (std::int64_t j = 0; j < keys; ++j)
        st[j * w + r] += t->cls_reset && kpos[j] == 0 ? t->theta2[static_cast<std::size_t>(lh)] : dots[j];
      continue;
    }
    for (std::int64_t j = 0; j < keys; ++j) {
      float b;
      if (query_cls) {
        b = t->theta1[static_cast<std::size_t>(lh)];
      } else if (t->cls_reset && kpos[j] == 0) {
        b = t->theta2[static_cast<std::size_t>(lh)];
      } else {
        const float* c = row(*t, false, kpos[j], h);
        b = 0;
        for (std::int64_t e = 0; e < p_.dim; ++e) b += a[e] * c[e];
      }
      st[j * w + r] += b;
    }
  }
}

// Backward of one (tile, row block): dPQ rows += dS·PK; the tile's dPK = dSᵀ·PQ into the unit's
// table by key position; the [CLS] values' sums (fp64). Its term does not depend on q or k, so
// without the parameters' gradients there is nothing to do.
void TupeTerm::backward_tile(const TermTile& tile, const float* /* pt */, const float* dst, TermState& s) const {
  if (s.unit_grads == nullptr) return;
  const RowBlock& sub = *tile.rows;
  const std::int64_t bw = sub.width, dp = p_.dim_padded, r0 = tile.r0, keys = tile.keys, g_count = p_.group_size;
  const std::int64_t* kpos = tile.kpos;
  for_each_run(sub, [&](std::int64_t ra, std::int64_t n, std::int64_t h) {
    const TupeTables& t = *of_head(h);
    const float* pk = keys_of(t, h, keys, kpos, s);
    kernels::attn_gemm(dst + ra, 1, bw, pk, dp, s.buffers[kDpq].data() + (r0 + ra) * dp, dp, n, dp, keys, true);
    const std::int64_t g = h - s.rows.kvh * g_count;
    grow(s.buffers[kDpk], keys * dp);
    kernels::attn_gemm(dst + ra, bw, 1, s.buffers[kPq].data() + (r0 + ra) * dp, dp, s.buffers[kDpk].data(), dp, keys,
                       dp, n, false);
    for (std::int64_t j = 0; j < keys; ++j) {
      if (t.cls_reset && kpos[j] == 0) continue;  // the [CLS] key's projection is not used
      float* to = s.buffers[kDpkPositions].data() + ((kpos[j] - first_) * g_count + g) * dp;
      const float* from = s.buffers[kDpk].data() + j * dp;
      for (std::int64_t d = 0; d < dp; ++d) to[d] += from[d];
    }
    if (!t.cls_reset) return;
    double* theta = s.unit_grads + 2 * count_ * g_count * dp;
    for (std::int64_t r = ra; r < ra + n; ++r) {
      if (sub.head[static_cast<std::size_t>(r)] != h) continue;
      const bool cls_query = sub.position[static_cast<std::size_t>(r)] == 0;
      for (std::int64_t j = 0; j < keys; ++j) {
        const double ds = dst[j * bw + r];
        if (cls_query) {
          theta[g] += ds;
        } else if (kpos[j] == 0) {
          theta[g_count + g] += ds;
        }
      }
    }
  });
}

// The unit's slot: [dPQ by position [count][G][Dp] | dPK likewise | θ1 [G] | θ2 [G]] (fp64); the
// [CLS] query's dPQ is not used.
void TupeTerm::finish_backward(TermState& s) const {
  if (s.unit_grads == nullptr) return;
  const RowBlock& rb = *s.rows.rows;
  const std::int64_t dp = p_.dim_padded, g_count = p_.group_size;
  for (std::int64_t r = 0; r < rb.width; ++r) {
    const std::int64_t h = rb.head[static_cast<std::size_t>(r)];
    const TupeTables* t = h < 0 ? nullptr : of_head(h);
    const std::int64_t qp = rb.position[static_cast<std::size_t>(r)];
    if (t == nullptr || (t->cls_reset && qp == 0)) continue;
    double* to = s.unit_grads + ((qp - first_) * g_count + (h - s.rows.kvh * g_count)) * dp;
    for (std::int64_t e = 0; e < dp; ++e)
      to[e] += static_cast<double>(s.buffers[kDpq][static_cast<std::size_t>(r * dp + e)]);
  }
  double* dpk = s.unit_grads + count_ * g_count * dp;
  for (std::int64_t e = 0; e < count_ * g_count * dp; ++e)
    dpk[e] += static_cast<double>(s.buffers[kDpkPositions][static_cast<std::size_t>(e)]);
}

// The parameters' gradients from the per-KV-head totals (fp64; dPQ against the scaled pq, so
// times 1/sqrt(2D) here):
//   dU^Q[m][h·D + d] += Σ_pos p[pos][m]·dPQ_h[pos][d],  dp[pos][m] += Σ_c U^Q[m][c]·dPQ[pos][c]
// and the same for K — f32 matrix products (blocked_gemm) added in fp64.
void TupeTerm::reduce(std::span<const TermUnit> units, AttentionGradients& grads) const {
  const std::int64_t per_kv = unit_gradient_size(), dp = p_.dim_padded, g_count = p_.group_size, dim = p_.dim;
  const std::vector<double>& totals = sum_slots_per_kv_head(units, per_kv, p_.kv_heads, CallBuffer::kTermTotals);
  const double pq_scale = 1.0 / std::sqrt(2.0 * static_cast<double>(dim));
  const auto gi = static_cast<std::size_t>(group_);
  const TupeTables& t = table_;
  const TupeParams& params = params_;
  // GroupGradients::bias in the registered order: [table | U^Q | U^K | θ1 | θ2].
  double* const d_table = grads.groups[gi].bias.data();
  double* const d_uq = d_table + params.table().size();
  double* const d_uk = d_uq + params.u_q().size();
  double* const d_theta1 = d_uk + params.u_k().size();
  double* const d_theta2 = d_theta1 + params.theta1().size();
  const std::int64_t hg = t.heads, h_first = p_.group_first_head[gi], cols = hg * dp, hd = hg * dim;
  const std::int64_t dm = params.d_model(), dmp = round_up(dm, kAttnAlign);
  AlignedFloats& rows = zeroed_floats(CallBuffer::kTerm0, static_cast<std::size_t>(count_ * dmp));
  // Every loop below writes disjoint elements, each from its own inputs: in parallel, the same
  // bits for any thread count.
#pragma omp parallel for schedule(static) num_threads(threads_for(count_* dm))
  for (std::int64_t n = 0; n < count_; ++n) {
    for (std::int64_t m = 0; m < dm; ++m) {
      rows[static_cast<std::size_t>(n * dmp + m)] =
          static_cast<float>(params.table()[static_cast<std::size_t>((first_ + n) * dm + m)]);
    }
  }
  for (const bool is_q : {true, false}) {
    // d(projection) [count][hg·Dp] in f32 from the per-KV-head totals.
    AlignedFloats& d_proj = zeroed_floats(CallBuffer::kTerm1, static_cast<std::size_t>(count_ * cols));
#pragma omp parallel for schedule(static) num_threads(std::min <int>(threads_for(count_ * cols), static_cast <int>(hg)))
    for (std::int64_t lh = 0; lh < hg; ++lh) {
      const std::int64_t h = h_first + lh, kvh = h / g_count, g = h % g_count;
      const double* part = totals.data() + kvh * per_kv + (is_q ? 0 : count_ * g_count * dp);
      const double factor = is_q ? pq_scale : 1.0;
      for (std::int64_t n = 0; n < count_; ++n) {
        for (std::int64_t d = 0; d < dim; ++d) {
          d_proj[static_cast<std::size_t>(n * cols + lh * dp + d)] =
              static_cast<float>(factor * part[(n * g_count + g) * dp + d]);
        }
      }
      const double* theta = totals.data() + kvh * per_kv + 2 * count_ * g_count * dp;
      if (is_q && t.cls_reset) {
        d_theta1[lh] += theta[g];
        d_theta2[lh] += theta[g_count + g];
      }
    }
    // dU[m][c] = Σ_n rows[n][m]·d_proj[n][c].
    AlignedFloats& du = zeroed_floats(CallBuffer::kTerm2, static_cast<std::size_t>(dmp * cols));
    blocked_gemm(rows.data(), 1, dmp, d_proj.data(), cols, du.data(), cols, dm, cols, count_);
    double* const u_grad = is_q ? d_uq : d_uk;
    const std::vector<double>& weights = is_q ? params.u_q() : params.u_k();
#pragma omp parallel for schedule(static) num_threads(threads_for(dm* cols))
    for (std::int64_t m = 0; m < dm; ++m) {
      for (std::int64_t lh = 0; lh < hg; ++lh) {
        for (std::int64_t d = 0; d < dim; ++d) {
          u_grad[m * hd + lh * dim + d] += du[static_cast<std::size_t>(m * cols + lh * dp + d)];
        }
      }
    }
    // d table[n][m] = Σ_c d_proj[n][c]·U[m][c]: B = Uᵀ as [cols][dmp].
    AlignedFloats& ut = zeroed_floats(CallBuffer::kTerm3, static_cast<std::size_t>(cols * dmp));
    AlignedFloats& dtable = zeroed_floats(CallBuffer::kTerm4, static_cast<std::size_t>(count_ * dmp));
#pragma omp parallel for schedule(static) num_threads(threads_for(dm* cols))
    for (std::int64_t m = 0; m < dm; ++m) {
      for (std::int64_t lh = 0; lh < hg; ++lh) {
        for (std::int64_t d = 0; d < dim; ++d) {
          ut[static_cast<std::size_t>((lh * dp + d) * dmp + m)] =
              static_cast<float>(weights[static_cast<std::size_t>(m * hd + lh * dim + d)]);
        }
      }
    }
    blocked_gemm(d_proj.data(), cols, 1, ut.data(), dmp, dtable.data(), dmp, count_, dmp, cols);
#pragma omp parallel for schedule(static) num_threads(threads_for(count_* dm))
    for (std::int64_t n = 0; n < count_; ++n) {
      for (std::int64_t m = 0; m < dm; ++m) {
        d_table[(first_ + n) * dm + m] += dtable[static_cast<std::size_t>(n * dmp + m)];
      }
    }
  }
}

}  // namespace

}  // namespace posenc::detail

namespace posenc {

std::unique_ptr<detail::ScoreTerm> detail::fused_form(const TupeParams& tupe, const AttentionPlan& plan,
                                                      std::int64_t group) {
  return std::make_unique<TupeTerm>(plan, group, tupe);
}

}  // namespace posenc
