// Shaw et al. 2018 inside the fused attention (ShawTerm, relative.hpp): the relative key
// term scale·⟨q_i, a^K[r]⟩ added to the logit and the value term Σ_j p_ij·a^V[r] to the output,
// r = clip(k_pos − q_pos, ±k), forward, decode and backward, as a ScoreTerm.
//
// Per-row arrays over the table rows are kept transposed, [table row u][row r] with row stride
// width, so that a tile whose keys all clip to one table row for every row (every tile outside
// the ±k band around the diagonal) is one vector add per key. A block with rows of other groups
// (decode's block of every KV head) takes the per-row forms, skipping theirs.
#include <algorithm>
#include <string>

#include "attention/engine.hpp"
#include "attention/score_term.hpp"
#include "schemes/fused_terms.hpp"
#include "kernels/attention/attention_kernels.hpp"
#include "posenc/error.hpp"

namespace posenc::detail {
namespace {

// Shaw's tables of a head group in f32: key [width][D] (and zero-padded [width][Dp]), value
// [width][Dp] (zero-padded).
struct ShawTables {
  std::int64_t max_distance = 0, width = 0;
  AlignedFloats key, value, key_padded;
  std::int64_t row_of(std::int64_t relative) const {
    return std::clamp(relative, -max_distance, max_distance) + max_distance;
  }
};

// The term state's buffers, each [width of the table][rows of the block].
enum Buffer { kKeyDots, kValueDots, kGrads, kProbs, kTableGrads };

class ShawScore final : public GroupTerm<ShawTables> {
 public:
  ShawScore(const AttentionPlan& p, std::int64_t group, std::int64_t index, const ShawParams& params);

  void begin(const TermRows& rows, TermState& s) const override {
    s.rows = rows;
    const std::int64_t w = rows.rows->width;
    grow(s.buffers[kKeyDots], w * width_);
    grow(s.buffers[kProbs], w * width_);
    std::fill(s.buffers[kProbs].begin(), s.buffers[kProbs].begin() + w * width_, 0.0f);
    row_dots(*rows.rows, rows.q, p_.dim_padded, rows.qt, rows.ldt, false, s.buffers[kKeyDots].data(), w);
  }
  void add_scores(const TermTile& tile, float* st, TermState& s) const override {
    add_rows(*tile.rows, tile.keys, tile.kpos, s.buffers[kKeyDots].data() + tile.r0, s.rows.rows->width, st);
  }
  void add_probabilities(const TermTile& tile, const float* pt, const float* corr, TermState& s) const override {
    collect(*tile.rows, tile.keys, tile.kpos, pt, corr, s.buffers[kProbs].data(), s.rows.rows->width);
  }
  void finish(float* o, TermState& s) const override {
    add_values(*s.rows.rows, s.buffers[kProbs].data(), s.rows.rows->width, o);
  }

  std::int64_t unit_gradient_size() const override { return 2 * width_ * p_.dim; }
  void begin_backward(const TermRows& rows, double* unit_grads, TermState& s) const override {
    s.rows = rows;
    s.unit_grads = unit_grads;
    const std::int64_t w = rows.rows->width;
    // q·a^K and dO·a^V per row and table row; the tiles then sum dS and P per table row.
    for (const int b : {kKeyDots, kValueDots, kGrads, kProbs}) grow(s.buffers[b], w * width_);
    row_dots(*rows.rows, rows.q, p_.dim_padded, rows.qt, rows.ldt, false, s.buffers[kKeyDots].data(), w);
    row_dots(*rows.rows, rows.dout, p_.dim_padded, rows.doutt, rows.ldt, true, s.buffers[kValueDots].data(), w);
    std::fill(s.buffers[kGrads].begin(), s.buffers[kGrads].begin() + w * width_, 0.0f);
    std::fill(s.buffers[kProbs].begin(), s.buffers[kProbs].begin() + w * width_, 0.0f);
  }
  // The value term: dP_ij += dO_i·a^V[row].
  void add_dp(const TermTile& tile, float* dpt, TermState& s) const override {
    add_rows(*tile.rows, tile.keys, tile.kpos, s.buffers[kValueDots].data() + tile.r0, s.rows.rows->width, dpt);
  }
  void backward_tile(const TermTile& tile, const float* pt, const float* dst, TermState& s) const override {
    const std::int64_t w = s.rows.rows->width;
    collect(*tile.rows, tile.keys, tile.kpos, dst, nullptr, s.buffers[kGrads].data() + tile.r0, w);
    collect(*tile.rows, tile.keys, tile.kpos, pt, nullptr, s.buffers[kProbs].data() + tile.r0, w);
  }
  void finish_backward(TermState& s) const override;
  void reduce(std::span<const TermUnit> units, AttentionGradients& grads) const override;

 private:
  template <class Fn>
  void for_each_row(const RowBlock& rb, Fn&& fn) const {
    for (std::int64_t r = 0; r < rb.width; ++r) {
      const std::int64_t h = rb.head[static_cast<std::size_t>(r)];
      const ShawTables* t = h < 0 ? nullptr : of_head(h);
      if (t != nullptr) fn(r, *t, rb.position[static_cast<std::size_t>(r)]);
    }
  }
  const ShawTables* of_block(const RowBlock& rb) const;
  void row_dots(const RowBlock& rb, const float* rows, std::int64_t ld_rows, const float* rows_t, std::int64_t ld_t,
                bool value_table, float* dots, std::int64_t ld) const;
  std::int64_t uniform_row(const RowBlock& rb, std::int64_t keys, const std::int64_t* kpos) const;
  void add_rows(const RowBlock& rb, std::int64_t keys, const std::int64_t* kpos, const float* dots, std::int64_t ld,
                float* st) const;
  void collect(const RowBlock& rb, std::int64_t keys, const std::int64_t* kpos, const float* pt, const float* corr,
               float* sums, std::int64_t ld) const;
  void add_values(const RowBlock& rb, const float* probs, std::int64_t ld, float* o) const;

  std::int64_t width_ = 0;  // the table's 2k + 1; a unit's slot is [key table | value table]
  std::int64_t index_;      // the term's entry in its group's terms
};

ShawScore::ShawScore(const AttentionPlan& p, std::int64_t group, std::int64_t index, const ShawParams& params)
    : GroupTerm(p, group), index_(index) {
  const std::int64_t dim = p.dim, dp = p.dim_padded;
  const std::string name = "groups[" + std::to_string(group) + "].terms[" + std::to_string(index) + "]";
  if (p.dim_v != dim) {
    throw Error(AttentionPlan::kWhere, name.c_str(), "given with values " + std::to_string(p.dim_v) + " wide",
                "values as wide as the keys (" + std::to_string(dim) + "): Shaw's value term has head_dim columns");
  }
  if (params.head_dim() != dim) {
    throw Error(AttentionPlan::kWhere, (name + ".params.head_dim").c_str(), std::to_string(params.head_dim()),
                "the head_dim of q, " + std::to_string(dim));
  }
  ShawTables& st = table_;
  st.max_distance = params.max_distance();
  st.width = params.rows();
  st.key.assign(static_cast<std::size_t>(st.width * dim), 0.0f);
  st.value.assign(static_cast<std::size_t>(st.width * dp), 0.0f);
  st.key_padded.assign(static_cast<std::size_t>(st.width * dp), 0.0f);
  for (std::int64_t t = 0; t < st.width; ++t) {
    for (std::int64_t e = 0; e < dim; ++e) {
      if (!params.key_table().empty()) {
        const auto value = static_cast<float>(params.key_table()[static_cast<std::size_t>(t * dim + e)]);
        st.key[static_cast<std::size_t>(t * dim + e)] = value;
        st.key_padded[static_cast<std::size_t>(t * dp + e)] = value;
      }
      if (!params.value_table().empty()) {
        st.value[static_cast<std::size_t>(t * dp + e)] =
            static_cast<float>(params.value_table()[static_cast<std::size_t>(t * dim + e)]);
      }
    }
  }
  width_ = st.width;
}

// The tables every valid row of the block uses, when they all use the same ones.
const ShawTables* ShawScore::of_block(const RowBlock& rb) const {
  const ShawTables* common = nullptr;
  for (std::int64_t r = 0; r < rb.width; ++r) {
    const std::int64_t h = rb.head[static_cast<std::size_t>(r)];
    if (h < 0) continue;
    const ShawTables* t = of_head(h);
    if (t == nullptr || (common != nullptr && t != common)) return nullptr;
    common = t;
  }
  return common;
}

// dots[u][r] = rows_r · table[u] (the key table, or the value table) for rows with Shaw; 0 for
// the other rows and table rows past their group's width. rows_t: the rows transposed, [d][r]
// with stride ld_t, when available: one matrix product then does it (a block of one group).
void ShawScore::row_dots(const RowBlock& rb, const float* rows, std::int64_t ld_rows, const float* rows_t,
                         std::int64_t ld_t, bool value_table, float* dots, std::int64_t ld) const {
  const std::int64_t dim = p_.dim, dp = p_.dim_padded;
  for (std::int64_t u = 0; u < width_; ++u) std::fill(dots + u * ld, dots + u * ld + rb.width, 0.0f);
  if (const ShawTables* t = of_block(rb); t != nullptr && rows_t != nullptr) {
    kernels::attn_gemm(value_table ? t->value.data() : t->key.data(), value_table ? dp : dim, 1, rows_t, ld_t, dots, ld,
                       t->width, rb.width, dim, false);
    return;
  }
  for_each_row(rb, [&](std::int64_t r, const ShawTables& t, std::int64_t /* q_position */) {
    const float* row = rows + r * ld_rows;
    for (std::int64_t u = 0; u < t.width; ++u) {
      const float* a = value_table ? t.value.data() + u * dp : t.key.data() + u * dim;
      float sum = 0;
      for (std::int64_t e = 0; e < dim; ++e) sum += row[e] * a[e];
      dots[u * ld + r] = sum;
    }
  });
}

// The one table row every (row, key) pair of the tile clips to, or −1.
std::int64_t ShawScore::uniform_row(const RowBlock& rb, std::int64_t keys, const std::int64_t* kpos) const {
  const auto [k_min, k_max] = std::minmax_element(kpos, kpos + keys);
  std::int64_t uniform = -2;  // −2: no Shaw row seen yet
  for (std::int64_t r = 0; r < rb.width; ++r) {
    const std::int64_t h = rb.head[static_cast<std::size_t>(r)];
    const ShawTables* t = h < 0 ? nullptr : of_head(h);
    if (t == nullptr) continue;
    const std::int64_t qp = rb.position[static_cast<std::size_t>(r)];
    const std::int64_t lo = t->row_of(*k_min - qp), hi = t->row_of(*k_max - qp);
    if (lo != hi || (uniform != -2 && lo != uniform)) return -1;
    uniform = lo;
  }
  return uniform < 0 ? -1 : uniform;
}

// st[j][r] += dots[row(k_j − q_r)][r].
void ShawScore::add_rows(const RowBlock& rb, std::int64_t keys, const std::int64_t* kpos, const float* dots,
                         std::int64_t ld, float* st) const {
  const std::int64_t w = rb.width, u0 = uniform_row(rb, keys, kpos);
  if (u0 >= 0) {
    const float* d = dots + u0 * ld;
    for (std::int64_t j = 0; j < keys; ++j) {
      float* row = st + j * w;
      for (std::int64_t r = 0; r < w; ++r) row[r] += d[r];
    }
    return;
  }
  for_each_row(rb, [&](std::int64_t r, const ShawTables& t, std::int64_t qp) {
    for (std::int64_t j = 0; j < keys; ++j) st[j * w + r] += dots[t.row_of(kpos[j] - qp) * ld + r];
  });
}

// sums[row(k_j − q_r)][r] += pt[j][r] over the tile's keys, after scaling every sum of row r by
// corr[r] when given (the online softmax's rescaling of what came before).
void ShawScore::collect(const RowBlock& rb, std::int64_t keys, const std::int64_t* kpos, const float* pt,
                        const float* corr, float* sums, std::int64_t ld) const {
  const std::int64_t w = rb.width;
  if (corr != nullptr) {
    bool rescale = false;
    for (std::int64_t r = 0; r < w && !rescale; ++r) rescale = corr[r] != 1.0f;
    if (rescale) {
      for (std::int64_t u = 0; u < width_; ++u) {
        float* row = sums + u * ld;
        for (std::int64_t r = 0; r < w; ++r) row[r] *= corr[r];
      }
    }
  }
  const std::int64_t u0 = uniform_row(rb, keys, kpos);
  if (u0 >= 0) {
    float* row = sums + u0 * ld;
    for (std::int64_t j = 0; j < keys; ++j) {
      const float* pj = pt + j * w;
      for (std::int64_t r = 0; r < w; ++r) row[r] += pj[r];
    }
    return;
  }
  for_each_row(rb, [&](std::int64_t r, const ShawTables& t, std::int64_t qp) {
    for (std::int64_t j = 0; j < keys; ++j) sums[t.row_of(kpos[j] - qp) * ld + r] += pt[j * w + r];
  });
}

// o_r += Σ_u probs[u][r]·a^V[u] (unnormalised, as o): a matrix product for a block of one group.
void ShawScore::add_values(const RowBlock& rb, const float* probs, std::int64_t ld, float* o) const {
  const std::int64_t dim = p_.dim, dp = p_.dim_padded;
  if (const ShawTables* t = of_block(rb); t != nullptr) {
    kernels::attn_gemm(probs, 1, ld, t->value.data(), dp, o, dp, rb.width, dp, t->width, true);
    return;
  }
  for_each_row(rb, [&](std::int64_t r, const ShawTables& t, std::int64_t /* q_position */) {
    float* row = o + r * dp;
    for (std::int64_t u = 0; u < t.width; ++u) {
      const float pu = probs[u * ld + r];
      if (pu == 0.0f) continue;
      const float* a = t.value.data() + u * dp;
      for (std::int64_t e = 0; e < dim; ++e) row[e] += pu * a[e];
    }
  });
}

// dL/dQs += dS-sumᵀ·a^K; the tables' gradients a^K += dS-sum·Qs and a^V += P-sum·dO.
void ShawScore::finish_backward(TermState& s) const {
  const RowBlock& rb = *s.rows.rows;
  const std::int64_t w = rb.width, dim = p_.dim, dp = p_.dim_padded;
  const float* grads = s.buffers[kGrads].data();
  const float* probs = s.buffers[kProbs].data();
  double* slot = s.unit_grads;
  if (const ShawTables* t = of_block(rb); t != nullptr) {
    // One group: matrix products, summed in f32 over the unit's rows (in a fixed order) and
    // added in fp64.
    kernels::attn_gemm(grads, 1, w, t->key_padded.data(), dp, s.rows.dq, dp, w, dp, t->width, true);
    if (slot == nullptr) return;
    grow(s.buffers[kTableGrads], 2 * t->width * dp);
    float* key_part = s.buffers[kTableGrads].data();
    float* value_part = key_part + t->width * dp;
    if (!rows_non_finite(s.rows.q, dp, w, dim) && !rows_non_finite(s.rows.dout, dp, w, dim)) {
      kernels::attn_gemm(grads, w, 1, s.rows.q, dp, key_part, dp, t->width, dp, w, false);
      kernels::attn_gemm(probs, w, 1, s.rows.dout, dp, value_part, dp, t->width, dp, w, false);
    } else {
      // An inf or NaN in q or dO: the buckets no pair of the block reaches hold zeros, whose
      // products with it the reference never forms (0·inf would make them NaN). Skipped.
      std::fill(key_part, key_part + 2 * t->width * dp, 0.0f);
      for (std::int64_t u = 0; u < t->width; ++u) {
        for (std::int64_t r = 0; r < w; ++r) {
          const float dsu = grads[u * w + r], psu = probs[u * w + r];
          for (std::int64_t e = 0; dsu != 0.0f && e < dim; ++e) key_part[u * dp + e] += dsu * s.rows.q[r * dp + e];
          for (std::int64_t e = 0; psu != 0.0f && e < dim; ++e) value_part[u * dp + e] += psu * s.rows.dout[r * dp + e];
        }
      }
    }
    double* key_grad = slot;
    double* value_grad = key_grad + t->width * dim;
    for (std::int64_t u = 0; u < t->width; ++u) {
      for (std::int64_t e = 0; e < dim; ++e) {
        key_grad[u * dim + e] += key_part[u * dp + e];
        value_grad[u * dim + e] += value_part[u * dp + e];
      }
    }
    return;
  }
  // Rows of several groups: row by row (fp64, rows in order).
  for (std::int64_t r = 0; r < w; ++r) {
    const std::int64_t h = rb.head[static_cast<std::size_t>(r)];
    const ShawTables* t = h < 0 ? nullptr : of_head(h);
    if (t == nullptr) continue;
    const float* ds = grads + r;  // [u][r], stride w
    const float* ps = probs + r;
    float* dq_row = s.rows.dq + r * dp;
    double* key_grad = slot;
    double* value_grad = key_grad == nullptr ? nullptr : key_grad + t->width * dim;
    for (std::int64_t u = 0; u < t->width; ++u) {
      const float dsu = ds[u * w], psu = ps[u * w];
      const float* a = t->key.data() + u * dim;
      for (std::int64_t e = 0; e < dim; ++e) dq_row[e] += dsu * a[e];
      if (key_grad == nullptr) continue;
      // Zeros (buckets the row's pairs do not reach) skipped: as above, for an inf or NaN in q or dO.
      for (std::int64_t e = 0; dsu != 0.0f && e < dim; ++e)
        key_grad[u * dim + e] += static_cast<double>(dsu) * s.rows.q[r * dp + e];
      for (std::int64_t e = 0; psu != 0.0f && e < dim; ++e)
        value_grad[u * dim + e] += static_cast<double>(psu) * s.rows.dout[r * dp + e];
    }
  }
}

// Units in order; then each group's [key | value] block into its tables' gradients.
void ShawScore::reduce(std::span<const TermUnit> units, AttentionGradients& grads) const {
  const std::int64_t size = unit_gradient_size();
  std::vector<double> total(static_cast<std::size_t>(size), 0.0);
  for (const TermUnit& unit : units) {
    for (std::int64_t t = 0; t < size; ++t) total[static_cast<std::size_t>(t)] += unit.slot[t];
  }
  std::vector<double>& out = grads.groups[static_cast<std::size_t>(group_)].terms[static_cast<std::size_t>(index_)];
  const double* at = total.data();
  for (std::size_t t = 0; t < out.size(); ++t) out[t] += at[t];
}

}  // namespace

}  // namespace posenc::detail

namespace posenc {

std::unique_ptr<detail::ScoreTerm> detail::fused_form(const ShawTerm& term, const AttentionPlan& plan,
                                                      std::int64_t group, std::int64_t index) {
  return std::make_unique<ShawScore>(plan, group, index, term.params());
}

}  // namespace posenc
