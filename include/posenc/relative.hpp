// posenc/relative.hpp — relative encodings that involve the query or the values, not only a bias:
// Shaw et al. (below) and Transformer-XL (further below).
//
// Shaw et al. 2018 ("Self-Attention with Relative Position Representations"): relative distances
// r = j − i (key minus query position) clipped to [−k, k] select rows of two learned tables of
// head_dim columns, shared by the heads of a layer:
//
//   score term   e[b, h, i, j] += q[b, i, h]·a^K[clip(r) + k] / sqrt(D)
//   value term   out[b, i, h]  += Σ_j p[b, h, i, j]·a^V[clip(r) + k]
//
//   a^K, a^V: [2k + 1, D] row-major     row 0 ↔ r <= −k, row k ↔ r = 0, row 2k ↔ r >= k
//
// Views: q, out, dq are [B, S, H, D] or packed [T, H, D] (any strides, D innermost or not);
// scores, probs and their gradients are [B, H, Sq, Sk] or [H, Sq, Sk]. Positions are per token
// ([B, Sq] for queries, [B, Sk] for keys). Every function *adds* to its outputs, as attention
// sums its terms and as backward accumulates gradients; the table gradients (spans of
// (2k + 1)·D doubles) are summed in fp64 in a fixed order, bitwise identical for any thread count.
//
// Cost: each query computes its 2k + 1 distinct dot products once (O((2k + 1)·D) instead of
// O(Sk·D)), and each value row sums its probabilities per clipped distance first.
//
// Errors: posenc::Error naming the parameter for k < 0, tables of the wrong size or with
// non-finite values, and views whose shapes, heads or positions do not match.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "posenc/positions.hpp"
#include "posenc/tensor.hpp"
#include "posenc/term.hpp"

namespace posenc {

class ShawParams {
 public:
  // key_table, value_table: [2k + 1, head_dim] row-major; empty means zeros.
  ShawParams(std::int64_t max_distance, std::int64_t head_dim, std::vector<double> key_table = {},
             std::vector<double> value_table = {});
  // Tables drawn from N(0, std²) with a seeded counter-based generator.
  static ShawParams init(std::int64_t max_distance, std::int64_t head_dim, double std = 0.02, std::uint64_t seed = 0);

  std::int64_t max_distance() const { return max_distance_; }  // k
  std::int64_t head_dim() const { return head_dim_; }
  std::int64_t rows() const { return 2 * max_distance_ + 1; }
  const std::vector<double>& key_table() const { return key_table_; }
  const std::vector<double>& value_table() const { return value_table_; }
  // The table row of relative position r = key − query: clip(r, −k, k) + k.
  std::int64_t row_of(std::int64_t relative_position) const {
    const std::int64_t r = relative_position < -max_distance_  ? -max_distance_
                           : relative_position > max_distance_ ? max_distance_
                                                               : relative_position;
    return r + max_distance_;
  }

 private:
  std::int64_t max_distance_, head_dim_;
  std::vector<double> key_table_, value_table_;
};

// scores[b, h, i, j] += q[b, i, h]·a^K[row_of(k_pos(b, j) − q_pos(b, i))] / sqrt(D).
void shaw_add_score_term(const ShawParams& params, ConstTensorView q, const Positions& q_positions,
                         const Positions& k_positions, TensorView scores);
// out[b, i, h] += Σ_j probs[b, h, i, j]·a^V[row_of(k_pos(b, j) − q_pos(b, i))].
void shaw_add_value_term(const ShawParams& params, ConstTensorView probs, const Positions& q_positions,
                         const Positions& k_positions, TensorView out);
// Backward of the score term given d_scores: dq += Σ_j d_scores·a^K[row]/sqrt(D) (dq may be an
// empty view to skip it), d_key_table[row] += Σ d_scores·q/sqrt(D).
void shaw_score_term_backward(const ShawParams& params, ConstTensorView q, ConstTensorView d_scores,
                              const Positions& q_positions, const Positions& k_positions, TensorView dq,
                              std::span<double> d_key_table);
// Backward of the value term given d_out: d_probs[b, h, i, j] += d_out[b, i, h]·a^V[row] (or an
// empty view to skip it), d_value_table[row] += Σ probs·d_out.
void shaw_value_term_backward(const ShawParams& params, ConstTensorView probs, ConstTensorView d_out,
                              const Positions& q_positions, const Positions& k_positions, TensorView d_probs,
                              std::span<double> d_value_table);

// The Shaw terms for attention's tile loop, one query at a time (f32 tables, fp32 math):
//
//   query_dots(q, dots)      dots[t] = q·a^K[t] / sqrt(D) for the 2k + 1 table rows, once per query
//   add_row(dots, …)         scores[j] += dots[row_of(k_first + j − q_position)]
//   add_values(probs, …)     out += Σ_j probs[j]·a^V[row_of(k_first + j − q_position)]
//                            (probabilities summed per table row first)
class ShawEvaluator {
 public:
  explicit ShawEvaluator(const ShawParams& params);
  std::int64_t width() const { return width_; }  // 2k + 1
  std::int64_t head_dim() const { return dim_; }
  void query_dots(const float* q, float* dots) const;
  void add_row(const float* dots, std::int64_t q_position, std::int64_t k_first, std::int64_t count,
               float* scores) const;
  void add_values(const float* probs, std::int64_t q_position, std::int64_t k_first, std::int64_t count,
                  float* out) const;

 private:
  std::int64_t k_, width_, dim_;
  float scale_;
  std::vector<float> key_table_, value_table_;
  std::int64_t row_of(std::int64_t r) const { return (r < -k_ ? -k_ : r > k_ ? k_ : r) + k_; }
};

// ---------------------------------------------------------------------------------- Transformer-XL
// Dai et al. 2019, section 3.3: the score of query i and key j is
//
//   A_ij = scale·( q_i·k_j  +  u·k_j  +  (q_i + v)·(W_R r(i − j)) )
//                  content     global     position (their terms (b) and (d))
//                              content
//
// per head, with u, v: [H, D] learned biases, W_R: [H·D, d_model] (the weight of a
// Linear(d_model, H·D)) and r(δ) the sinusoid of d_model dimensions in split halves,
// r(δ) = [sin(δ·ω_0) … sin(δ·ω_{d/2−1}) | cos(δ·ω_0) … cos(δ·ω_{d/2−1})], ω_i = base^(−2i/d_model),
// as the authors' code builds it. Note the sign: δ = i − j is query minus key position (keys in
// the past have δ > 0), the opposite of Hugging Face's key − query; δ < 0 is allowed (r is
// defined for any integer).
//
// posenc adds the last two terms (the content term q·k is attention's): each query computes
// (q_i + v)·P(δ) for the δ its keys span, with P(δ) = W_R r(δ) tabulated once per call, and
// u·k_j once per key.
class XlParams {
 public:
  // u, v: [heads, head_dim]; w_r: [heads·head_dim, d_model] row-major; d_model even; scale > 0
  // (0 means 1/sqrt(head_dim)); base > 1.
  XlParams(std::int64_t heads, std::int64_t head_dim, std::int64_t d_model, std::vector<double> u,
           std::vector<double> v, std::vector<double> w_r, double scale = 0.0, double base = 10000.0);
  // u, v ~ N(0, std²), W_R ~ N(0, 1/d_model), seeded.
  static XlParams init(std::int64_t heads, std::int64_t head_dim, std::int64_t d_model, double std = 0.02,
                       std::uint64_t seed = 0);

  std::int64_t heads() const { return heads_; }
  std::int64_t head_dim() const { return head_dim_; }
  std::int64_t d_model() const { return d_model_; }
  const std::vector<double>& u() const { return u_; }
  const std::vector<double>& v() const { return v_; }
  const std::vector<double>& w_r() const { return w_r_; }
  double scale() const { return scale_; }
  double base() const { return base_; }
  // r(δ) (d_model values, fp64).
  std::vector<double> sinusoid(std::int64_t delta) const;

 private:
  std::int64_t heads_, head_dim_, d_model_;
  std::vector<double> u_, v_, w_r_;
  double scale_, base_;
};

// Gradients of u, v and W_R, accumulated (+=); sizes as XlParams'.
struct XlGradients {
  explicit XlGradients(const XlParams& params);
  std::vector<double> u, v, w_r;
};

// scores[b, h, i, j] += scale·(u_h·k[b, j, h] + (q[b, i, h] + v_h)·(W_R r(q_pos − k_pos))_h).
// q: [B, Sq, H, D] (or packed [T, H, D]), k: [B, Sk, H, D], scores: [B, H, Sq, Sk].
void xl_add_position_terms(const XlParams& params, ConstTensorView q, ConstTensorView k, const Positions& q_positions,
                           const Positions& k_positions, TensorView scores);
// Backward given d_scores: dq, dk (+=; empty views skip them) and grads (+=). Deterministic for
// any thread count (each head's sums run in a fixed order).
void xl_position_terms_backward(const XlParams& params, ConstTensorView q, ConstTensorView k, ConstTensorView d_scores,
                                const Positions& q_positions, const Positions& k_positions, TensorView dq,
                                TensorView dk, XlGradients& grads);

// The Transformer-XL terms row by row, for a caller's own score loop (posenc::Attention fuses XL
// with its own windows of dot products): P(δ) = W_R r(δ) tabulated (f32, computed in
// fp64) for δ = q_pos − k_pos in [min_delta, max_delta]; δ outside are computed on the spot.
//   add_row(h, q, q_position, k, k_stride, k_first, count, scores):
//     scores[j] += scale·(u_h·k_j + (q + v_h)·P_h(q_position − k_first − j)),
//     q: head h's D floats, key j's D floats at k + j·k_stride.
class XlEvaluator {
 public:
  XlEvaluator(const XlParams& params, std::int64_t min_delta, std::int64_t max_delta);
  void add_row(std::int64_t head, const float* q, std::int64_t q_position, const float* k, std::int64_t k_stride,
               std::int64_t k_first, std::int64_t count, float* scores) const;

 private:
  XlParams params_;
  std::int64_t min_delta_, width_, hd_, dim_;
  std::vector<float> projected_;  // [width, H·D]
  std::vector<float> u_, v_;
};

// --------------------------------------------------------------------------- inside the attention
// Both schemes as terms of a head group (HeadGroup::terms, attention.hpp; term.hpp). Their fp64
// definitions (the reference's) live in src/ref/, their fused forms in src/schemes/.
//
// ShawTerm: the key term in the logit and the value term in the output, r = clip(k_pos − q_pos, ±k),
//   x_ij += scale·⟨T_q(q_i), a^K[r]⟩        out_i += Σ_j p_ij·a^V[r]
// (scale·(q·k + q·a^K) is the paper's e_ij when scale = 1/sqrt(D)); one table pair for the
// group's `heads`, head_dim == D, values as wide as the keys. Gradient: [key table | value table],
// each [(2k + 1)·D] (an empty table's gradient too).
class ShawTerm final : public AttentionTerm {
 public:
  ShawTerm(std::int64_t heads, ShawParams params);
  const ShawParams& params() const { return params_; }

  std::string_view name() const override { return "shaw"; }
  std::int64_t heads() const override { return heads_; }
  std::int64_t gradient_size() const override { return 2 * params_.rows() * params_.head_dim(); }
  bool reads_rows() const override { return true; }
  double row_value(std::int64_t head, const TokenPair& pair, const PairRows& rows) const override;
  void accumulate_row_gradient(std::int64_t head, const TokenPair& pair, const PairRows& rows, double weight,
                               std::span<double> grads, std::span<double> dq, std::span<double> dk) const override;
  bool adds_to_output() const override { return true; }
  void output_value(std::int64_t head, const TokenPair& pair, std::span<double> w) const override;
  void accumulate_output_gradient(std::int64_t head, const TokenPair& pair, double weight,
                                  std::span<const double> d_out, std::span<double> grads) const override;

 private:
  std::int64_t heads_;
  ShawParams params_;
};

// XlTerm: with δ = p_i − p'_j,
//   x_ij += scale·(u_h·k_j + (q_i + v_h)·P_h(δ)),   P(δ) = W_R r(δ)
// on params.heads() heads, head_dim == D, params' scale equal to the attention's; the whole
// scheme of its heads (no transform, bias or Shaw beside it). Gradient: [u | v | W_R], the
// parameters' layout.
class XlTerm final : public AttentionTerm {
 public:
  explicit XlTerm(XlParams params);
  const XlParams& params() const { return params_; }

  std::string_view name() const override { return "xl"; }
  std::int64_t heads() const override { return params_.heads(); }
  std::int64_t gradient_size() const override;
  bool reads_rows() const override { return true; }
  double row_value(std::int64_t head, const TokenPair& pair, const PairRows& rows) const override;
  void accumulate_row_gradient(std::int64_t head, const TokenPair& pair, const PairRows& rows, double weight,
                               std::span<double> grads, std::span<double> dq, std::span<double> dk) const override;
  void finish_row_gradients(std::int64_t head, TermScratch& scratch, std::span<double> grads) const override;

 private:
  XlParams params_;
};

}  // namespace posenc
