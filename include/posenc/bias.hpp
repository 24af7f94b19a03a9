// posenc/bias.hpp — positional biases added to attention scores.
//
// These schemes leave queries and keys alone and add a term b(h, i, j) to the score of head h,
// query position i and key position j (positions are the tokens' ids, not their rows):
//
//     score(h, i, j) = q_i · k_j / sqrt(d) + b(h, i, j)          (then mask, softmax)
//
// All but FIRE depend on the relative position r = j − i only (key minus query, the convention
// of Hugging Face transformers), so b is a per-head function of r:
//
//   NoPE        b = 0: no positional signal besides the causal mask (Kazemnejad et al. 2023)
//   ALiBi       causal    b = −m_h·(i − j) = m_h·r          (Press et al. 2022)
//               symmetric b = −m_h·|r|                       (the encoder form)
//   T5          b = table[bucket(r), h], a learned table [num_buckets, H] (Raffel et al. 2020)
//   Kerple log  b = −r1_h·log(1 + r2_h·|r|)                  (Chi et al. 2022)
//   Kerple pow  b = −r1_h·|r|^r2_h, 0 < r2_h <= 2
//   FIRE        b = f_θ(ψ(|i − j|) / ψ(max(L, i)))_h, ψ(x) = log(c·x + 1)   (Li et al. 2023)
//               f_θ: R → R^H, a one-hidden-layer ReLU MLP; c > 0 and L > 0 learned too
//   TUPE        b = (p_i U^Q_h)·(p_j U^K_h) / sqrt(2D), p a learned absolute table   (Ke et al. 2021)
//               optionally with the [CLS] reset (position 0 gets learned θ1, θ2)
//
// Materialised biases have the layout of attention scores, keys innermost:
//
//     out [B, H, Sq, Sk] (or [H, Sq, Sk] for B = 1), any strides
//            b  h  i   j          out[b, h, i, j] = bias(h, q_pos(b, i), k_pos(b, j))
//
// and the backward takes dL/dscores in the same layout and *accumulates* (+=) the gradients of
// the scheme's learned parameters (ALiBi slopes, the T5 table, Kerple's r1 and r2), summing in
// fp64 in a fixed order: results are bitwise identical for any thread count.
//
// Error contract: parameters are validated when the struct is built and every call checks its
// views and positions; anything invalid throws posenc::Error naming the parameter, its value and
// what was expected. Values are computed in fp64 and rounded once to the output dtype.
#pragma once

#include <concepts>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "posenc/positions.hpp"
#include "posenc/scheme.hpp"
#include "posenc/tensor.hpp"

namespace posenc {

// ---------------------------------------------------------------------------------- NoPE
struct NoPE {
  explicit NoPE(std::int64_t heads);  // heads >= 1
  std::int64_t heads;
};

// ---------------------------------------------------------------------------------- ALiBi
enum class AlibiForm : std::uint8_t {
  kCausal,     // b = −m·(i − j): 0 on the diagonal, more negative for older keys
  kSymmetric,  // b = −m·|i − j|: bidirectional (encoder) attention
};

// The slopes of Press et al. for any head count, with llama.cpp's max_bias generalisation:
// n = 2^floor(log2 H); heads h < n get 2^(−max_bias·(h + 1)/n); the remaining H − n heads get
// every other slope of 2n heads, 2^(−max_bias·(2k + 1)/(2n)), k = 0, 1, …  max_bias = 8 is the
// paper's rule (for H = 8: 1/2, 1/4, …, 1/256). H >= 1, max_bias > 0 and finite.
std::vector<double> alibi_slopes(std::int64_t heads, double max_bias = 8.0);

class AlibiParams : public RelativeBias {
 public:
  // The paper's slopes for `heads` heads.
  explicit AlibiParams(std::int64_t heads, AlibiForm form = AlibiForm::kCausal, double max_bias = 8.0);
  // Custom or trained slopes, one per head, each >= 0 and finite (0: a head without ALiBi).
  explicit AlibiParams(std::vector<double> slopes, AlibiForm form = AlibiForm::kCausal);
  // ALiBi on a subset of `heads` heads: the listed heads (distinct, in [0, heads)) get the
  // paper's slopes for alibi_heads.size() heads, in the order listed; the others get 0.
  static AlibiParams on_heads(std::int64_t heads, std::span<const std::int64_t> alibi_heads,
                              AlibiForm form = AlibiForm::kCausal, double max_bias = 8.0);

  std::int64_t heads() const override { return static_cast<std::int64_t>(slopes_.size()); }
  AlibiForm form() const { return form_; }
  const std::vector<double>& slopes() const { return slopes_; }

  // RelativeBias (scheme.hpp): θ = the slopes, [heads].
  std::string_view scheme_name() const override { return "alibi"; }
  double value(std::int64_t head, std::int64_t relative_position) const override;
  void tabulate(std::int64_t r_first, std::int64_t count, double* out) const override;  // value()'s bits
  std::int64_t parameter_count() const override { return heads(); }
  std::vector<double> parameters() const override { return slopes_; }
  void accumulate_gradient(std::int64_t head, std::int64_t relative_position, double weight,
                           std::span<double> grads) const override;
  bool gradients_per_head() const override { return true; }

 private:
  std::vector<double> slopes_;
  AlibiForm form_;
};

// ---------------------------------------------------------------------------------- T5
// The bucket of relative position r = key − query, exactly as Hugging Face transformers'
// `_relative_position_bucket` computes it (float32 arithmetic in PyTorch, bit for bit):
//
//   bidirectional: n = num_buckets / 2, offset n if r > 0, distance |r|;
//   causal:        n = num_buckets, offset 0, distance max(−r, 0) (keys after the query share 0);
//   max_exact = n / 2; distance < max_exact is its own bucket; otherwise
//   min(n − 1, max_exact + trunc(f32(log(f32(distance) / max_exact) / f32(ln(max_distance /
//   max_exact)) · (n − max_exact)))).
//
// Valid: max_exact >= 1 (num_buckets >= 4 bidirectional, >= 2 causal) and max_distance >
// max_exact (otherwise the log formula divides by zero or turns around).
std::int64_t t5_bucket(std::int64_t relative_position, std::int64_t num_buckets = 32, std::int64_t max_distance = 128,
                       bool bidirectional = true);

class T5BiasParams : public RelativeBias {
 public:
  // table: [num_buckets, heads] row-major (the weight of transformers' nn.Embedding(num_buckets,
  // n_heads)); empty means zeros (a fresh model).
  T5BiasParams(std::int64_t heads, std::int64_t num_buckets = 32, std::int64_t max_distance = 128,
               bool bidirectional = true, std::vector<double> table = {});

  std::int64_t heads() const override { return heads_; }
  std::int64_t num_buckets() const { return num_buckets_; }
  std::int64_t max_distance() const { return max_distance_; }
  bool bidirectional() const { return bidirectional_; }
  const std::vector<double>& table() const { return table_; }
  std::int64_t bucket(std::int64_t relative_position) const {
    return t5_bucket(relative_position, num_buckets_, max_distance_, bidirectional_);
  }

  // RelativeBias (scheme.hpp): θ = the table, [num_buckets, heads] row-major.
  std::string_view scheme_name() const override { return "t5"; }
  double value(std::int64_t head, std::int64_t relative_position) const override;
  // value()'s bits, each r's bucket found once for every head.
  void tabulate(std::int64_t r_first, std::int64_t count, double* out) const override;
  std::int64_t parameter_count() const override { return num_buckets_ * heads_; }
  std::vector<double> parameters() const override { return table_; }
  void accumulate_gradient(std::int64_t head, std::int64_t relative_position, double weight,
                           std::span<double> grads) const override;
  bool gradients_per_head() const override { return true; }

 private:
  std::int64_t heads_, num_buckets_, max_distance_;
  bool bidirectional_;
  std::vector<double> table_;
};

// ---------------------------------------------------------------------------------- Kerple
enum class KerpleForm : std::uint8_t {
  kLog,    // b = −r1·log(1 + r2·|r|)
  kPower,  // b = −r1·|r|^r2
};

class KerpleParams : public RelativeBias {
 public:
  // One r1 and one r2 per head (equal lengths >= 1), all > 0 and finite; r2 <= 2 for kPower
  // (the kernel is conditionally positive definite only there).
  KerpleParams(KerpleForm form, std::vector<double> r1, std::vector<double> r2);
  std::int64_t heads() const override { return static_cast<std::int64_t>(r1_.size()); }
  KerpleForm form() const { return form_; }
  const std::vector<double>& r1() const { return r1_; }
  const std::vector<double>& r2() const { return r2_; }

  // RelativeBias (scheme.hpp): θ = [r1 (heads) | r2 (heads)].
  std::string_view scheme_name() const override { return "kerple"; }
  double value(std::int64_t head, std::int64_t relative_position) const override;
  std::int64_t parameter_count() const override { return 2 * heads(); }
  std::vector<double> parameters() const override;
  void accumulate_gradient(std::int64_t head, std::int64_t relative_position, double weight,
                           std::span<double> grads) const override;
  bool gradients_per_head() const override { return true; }

 private:
  KerpleForm form_;
  std::vector<double> r1_, r2_;
};

// ---------------------------------------------------------------------------------- FIRE
// FIRE (Li et al. 2023, "Functional Interpolation for Relative Positions"): a learned function of
// the distance normalised by the query's position, so that a model trained on short sequences
// sees the same inputs in [0, 1] at any length:
//
//   x = ψ(|i − j|) / ψ(max(L, i)),  ψ(t) = log(1 + c·t)
//   b(h, i, j) = Σ_k W2[h, k]·relu(W1[k]·x + B1[k]) + B2[h]
//
// The paper applies it to causal attention (i >= j); posenc uses the distance |i − j|, so keys
// after the query (masked there) get the value of their mirror image, and bidirectional models
// can use it as is. f_θ is piecewise linear in x (its kinks at x = −B1[k]/W1[k]); posenc evaluates
// it per segment, in fp64, which makes a bias one multiply-add per head.
class FireParams : public PositionBias {
 public:
  // w1, b1: [hidden]; w2: [heads, hidden] row-major; b2: [heads]. c > 0, threshold L > 0, all
  // finite.
  FireParams(std::int64_t heads, std::vector<double> w1, std::vector<double> b1, std::vector<double> w2,
             std::vector<double> b2, double c = 1.0, double threshold = 512.0);
  // A fresh layer: W1, B1 ~ N(0, 1), W2 ~ N(0, 1/hidden), B2 = 0, from a seeded counter-based
  // generator (the same values for any thread count).
  static FireParams init(std::int64_t heads, std::int64_t hidden = 32, std::uint64_t seed = 0, double c = 1.0,
                         double threshold = 512.0);

  std::int64_t heads() const override { return heads_; }
  std::int64_t hidden() const { return static_cast<std::int64_t>(w1_.size()); }
  const std::vector<double>& w1() const { return w1_; }
  const std::vector<double>& b1() const { return b1_; }
  const std::vector<double>& w2() const { return w2_; }
  const std::vector<double>& b2() const { return b2_; }
  double c() const { return c_; }
  double threshold() const { return threshold_; }

  // x for a query and key position, and f_θ(x) for one head, both by the definition (fp64).
  double normalized_distance(std::int64_t q_position, std::int64_t k_position) const;
  double mlp(std::int64_t head, double x) const;
  // f_θ as pieces: kinks() sorted; on piece s (x between kinks[s − 1] and kinks[s]),
  // f_θ(x)_h = slope(s, h)·x + intercept(s, h).
  const std::vector<double>& kinks() const { return kinks_; }
  std::int64_t piece_of(double x) const;
  double slope(std::int64_t piece, std::int64_t head) const {
    return slopes_[static_cast<std::size_t>(piece * heads_ + head)];
  }
  double intercept(std::int64_t piece, std::int64_t head) const {
    return intercepts_[static_cast<std::size_t>(piece * heads_ + head)];
  }
  // Whether hidden unit k is active (W1[k]·x + B1[k] > 0) on piece s.
  bool active(std::int64_t piece, std::int64_t unit) const {
    return active_[static_cast<std::size_t>(piece * hidden() + unit)] != 0;
  }

  // As a PositionBias (scheme.hpp): θ = [W1 | B1 | W2 | B2 | c | L] (FireGradients::flat).
  std::string_view scheme_name() const override { return "fire"; }
  std::int64_t parameter_count() const override;
  std::vector<double> parameters() const override;
  double value(std::int64_t head, std::int64_t q_position, std::int64_t k_position) const override;
  void reference_backward(const Positions& q_positions, const Positions& k_positions, ConstTensorView d_scores,
                          std::span<double> grads) const override;
  void backward(const Positions& q_positions, const Positions& k_positions, ConstTensorView d_scores,
                std::span<double> grads) const override;
  void materialize(const Positions& q_positions, const Positions& k_positions, TensorView out) const override;

 private:
  std::int64_t heads_;
  std::vector<double> w1_, b1_, w2_, b2_;
  double c_, threshold_;
  std::vector<double> kinks_, slopes_, intercepts_;
  std::vector<unsigned char> active_;
};

// Gradients of FIRE's parameters, accumulated (+=) by fire_backward; sizes as FireParams'.
struct FireGradients {
  explicit FireGradients(const FireParams& params);
  std::vector<double> w1, b1, w2, b2;
  double c = 0, threshold = 0;
  // [w1 | b1 | w2 | b2 | c | L]: the registry's "fire" parameter order (GroupGradients::bias).
  std::vector<double> flat() const;
};

// ---------------------------------------------------------------------------------- TUPE
// TUPE (Ke et al. 2021, "Rethinking Positional Encoding in Language Pre-training"): positions
// enter attention only through their own projections of a learned absolute table p:
//
//   b(h, i, j) = (p[i] U^Q_h)·(p[j] U^K_h) / sqrt(2·D)
//
//   p: [max_len, d_model]; U^Q, U^K: [d_model, H·D] row-major (columns h·D … h·D + D − 1 are
//   head h's); i, j index p by the tokens' position ids (each must be < max_len).
//
// With the [CLS] reset (their "untied [CLS]"), a token at position 0 is a [CLS] token whose
// positional correlations are replaced by learned per-head values: b = θ1_h when the query is at
// position 0, b = θ2_h when only the key is.
class TupeParams : public PositionBias {
 public:
  TupeParams(std::int64_t heads, std::int64_t head_dim, std::int64_t d_model, std::vector<double> table,
             std::vector<double> u_q, std::vector<double> u_k, bool cls_reset = false, std::vector<double> theta1 = {},
             std::vector<double> theta2 = {});
  // table ~ N(0, std²), U ~ N(0, 1/d_model), θ = 0; seeded.
  static TupeParams init(std::int64_t heads, std::int64_t head_dim, std::int64_t d_model, std::int64_t max_len,
                         bool cls_reset = false, double std = 0.02, std::uint64_t seed = 0);

  std::int64_t heads() const override { return heads_; }
  std::int64_t head_dim() const { return head_dim_; }
  std::int64_t d_model() const { return d_model_; }
  std::int64_t max_len() const { return static_cast<std::int64_t>(table_.size()) / d_model_; }
  const std::vector<double>& table() const { return table_; }
  const std::vector<double>& u_q() const { return u_q_; }
  const std::vector<double>& u_k() const { return u_k_; }
  bool cls_reset() const { return cls_reset_; }
  const std::vector<double>& theta1() const { return theta1_; }
  const std::vector<double>& theta2() const { return theta2_; }
  // p[position]·U_h for one head (U = U^Q or U^K), D values, fp64.
  std::vector<double> project(const std::vector<double>& u, std::int64_t position, std::int64_t head) const;

  // As a PositionBias (scheme.hpp): θ = [table | U^Q | U^K | θ1 | θ2] (TupeGradients::flat);
  // every position must be < max_len().
  std::string_view scheme_name() const override { return "tupe"; }
  std::int64_t parameter_count() const override;
  std::vector<double> parameters() const override;
  double value(std::int64_t head, std::int64_t q_position, std::int64_t k_position) const override;
  void check_positions(const char* where, const Positions& q_positions, const Positions& k_positions) const override;
  void reference_backward(const Positions& q_positions, const Positions& k_positions, ConstTensorView d_scores,
                          std::span<double> grads) const override;
  void backward(const Positions& q_positions, const Positions& k_positions, ConstTensorView d_scores,
                std::span<double> grads) const override;
  void materialize(const Positions& q_positions, const Positions& k_positions, TensorView out) const override;

 private:
  std::int64_t heads_, head_dim_, d_model_;
  std::vector<double> table_, u_q_, u_k_;
  bool cls_reset_;
  std::vector<double> theta1_, theta2_;
};

// TUPE row by row, for a caller's own score loop (posenc::Attention fuses TUPE as matrix
// products instead): each position's projections p[pos]·U^Q and p[pos]·U^K for the
// positions in [first, last] once (f32, computed in fp64; positions outside are projected on the
// spot); add_row adds head h's biases of one query against consecutive key positions.
class TupeEvaluator {
 public:
  TupeEvaluator(const TupeParams& params, std::int64_t first_position, std::int64_t last_position);
  void add_row(std::int64_t head, std::int64_t q_position, std::int64_t k_first, std::int64_t count,
               float* scores) const;

 private:
  TupeParams params_;
  std::int64_t first_, hd_, dim_;
  float scale_;
  std::vector<float> pq_, pk_;  // [positions, H·D]
};

struct TupeGradients {
  explicit TupeGradients(const TupeParams& params);
  std::vector<double> table, u_q, u_k, theta1, theta2;
  // [table | U^Q | U^K | θ1 | θ2]: the registry's "tupe" parameter order (GroupGradients::bias).
  std::vector<double> flat() const;
};

// ---------------------------------------------------------------------------------- schemes
// Any score bias: none (NoPE), a scheme of the relative position only (RelativeBias) or one of both
// positions (PositionBias, scheme.hpp). The library's (AlibiParams, FireParams, …), the
// registry's others (Sandwich) and one's own convert to it alike, by value or held by shared
// pointer; it keeps the scheme shared and immutable, so copies are cheap.
class BiasScheme {
 public:
  BiasScheme(NoPE none) : heads_(none.heads) {}  // NOLINT(google-explicit-constructor)
  template <class S>
  requires(std::derived_from<S, RelativeBias> || std::derived_from<S, PositionBias>)
      BiasScheme(S scheme) {  // NOLINT(google-explicit-constructor)
    auto held = std::make_shared<const S>(std::move(scheme));
    if constexpr (std::derived_from<S, RelativeBias>) {
      relative_ = std::move(held);
    } else {
      position_ = std::move(held);
    }
  }
  // Throw posenc::Error for a null pointer.
  BiasScheme(RelativeBiasRef scheme);  // NOLINT(google-explicit-constructor)
  BiasScheme(PositionBiasRef scheme);  // NOLINT(google-explicit-constructor)

  // The scheme in its family, or nullptr (NoPE, or the other family).
  const RelativeBias* relative() const { return relative_.get(); }
  const PositionBias* position() const { return position_.get(); }
  bool is_none() const { return !relative_ && !position_; }
  std::int64_t heads() const;
  // The scheme as its own type S (AlibiParams, a class of one's own), or nullptr.
  template <class S>
  const S* get_if() const {
    if constexpr (std::derived_from<S, RelativeBias>) {
      return dynamic_cast<const S*>(relative_.get());
    } else {
      return dynamic_cast<const S*>(position_.get());
    }
  }

 private:
  RelativeBiasRef relative_;
  PositionBiasRef position_;
  std::int64_t heads_ = 0;  // NoPE's
};

std::int64_t bias_heads(const BiasScheme& scheme);
// How many learned parameters the scheme has, flat in its registered parameter order
// (GroupGradients::bias): ALiBi's slopes, T5's table, Kerple's [r1 | r2], a RelativeBiasRef's or
// PositionBiasRef's θ, FIRE's and TUPE's as FireGradients::flat and TupeGradients::flat order
// them; 0 for NoPE.
std::int64_t bias_parameter_count(const BiasScheme& scheme);
// scheme.relative() and scheme.position(): the scheme as a RelativeBias (ALiBi, T5, Kerple, …) or
// as a PositionBias (FIRE, TUPE, …), or nullptr (NoPE and the other family).
const RelativeBias* relative_bias(const BiasScheme& scheme);
const PositionBias* position_bias(const BiasScheme& scheme);
// b(h, i, j) in fp64 for a query and a key position. h in [0, heads).
double bias_value(const BiasScheme& scheme, std::int64_t head, std::int64_t q_position, std::int64_t k_position);
// b(h, r) in fp64, r = key − query position, for the schemes that depend on r only (it throws
// posenc::Error for a PositionBias).
double bias_value(const BiasScheme& scheme, std::int64_t head, std::int64_t relative_position);

// out[b, h, i, j] = b(h, k_pos(b, j) − q_pos(b, i)). out: [B, H, Sq, Sk] or [H, Sq, Sk], any
// dtype, writable (no overlapping elements); q_positions a [B, Sq] grid, k_positions [B, Sk].
void bias_materialize(const BiasScheme& scheme, const Positions& q_positions, const Positions& k_positions,
                      TensorView out);

// Gradients of the learned parameters given d_scores = dL/dscores ([B, H, Sq, Sk] or
// [H, Sq, Sk], any dtype), accumulated (+=) into spans of the parameters' sizes:
//   ALiBi   d_slopes[h]                   += Σ d_scores·∂b/∂m_h
//   T5      d_table[bucket·H + h]         += Σ d_scores over the pairs in that bucket
//   Kerple  d_r1[h], d_r2[h]              += Σ d_scores·∂b/∂r1_h, Σ d_scores·∂b/∂r2_h
//           (∂b/∂r2 of the power form is −r1·|r|^r2·ln|r|, 0 at r = 0)
void alibi_backward(const AlibiParams& params, const Positions& q_positions, const Positions& k_positions,
                    ConstTensorView d_scores, std::span<double> d_slopes);
void t5_bias_backward(const T5BiasParams& params, const Positions& q_positions, const Positions& k_positions,
                      ConstTensorView d_scores, std::span<double> d_table);
void kerple_backward(const KerpleParams& params, const Positions& q_positions, const Positions& k_positions,
                     ConstTensorView d_scores, std::span<double> d_r1, std::span<double> d_r2);
// Any RelativeBias: d_params[t] += Σ d_scores·∂b/∂θ_t (parameter_count() entries; sums of d_scores
// per (head, r) first, in a fixed order: the same bits for any thread count).
void relative_bias_backward(const RelativeBias& scheme, const Positions& q_positions, const Positions& k_positions,
                            ConstTensorView d_scores, std::span<double> d_params);
// FIRE: every parameter (W1, B1, W2, B2, c, L); ∂x/∂L is 0 where the query is at or past L. A
// pair whose x falls exactly on a kink takes the piece to its right (the reference takes
// relu'(0) = 0, as PyTorch does); elsewhere both agree. Deterministic for any thread count: the
// pairs are summed in blocks of fixed size, the blocks in order.
void fire_backward(const FireParams& params, const Positions& q_positions, const Positions& k_positions,
                   ConstTensorView d_scores, FireGradients& grads);
// TUPE: the table rows used, U^Q, U^K, and θ1, θ2 with the [CLS] reset. Deterministic for any
// thread count (U's columns per head, the table's columns per thread, each in a fixed order).
void tupe_backward(const TupeParams& params, const Positions& q_positions, const Positions& k_positions,
                   ConstTensorView d_scores, TupeGradients& grads);
// Any BiasScheme: d_params += the gradient of its learned parameters, flat in its registered
// order (bias_parameter_count entries; GroupGradients::bias): a RelativeBias's through
// relative_bias_backward, a PositionBias's through its backward. Nothing for NoPE.
void bias_backward(const BiasScheme& scheme, const Positions& q_positions, const Positions& k_positions,
                   ConstTensorView d_scores, std::span<double> d_params);

// The evaluator the fused attention calls inside its tile loop: per-head tables of b against the
// relative positions a call can meet, [min_relative, max_relative], rounded once to f32, so a row
// of biases is a copy (contiguous keys) or a gather. Relative positions outside the range, ranges
// too large to tabulate (more than 2^24 entries over all heads) and PositionBias schemes (which
// depend on the positions themselves) are evaluated directly.
class BiasEvaluator {
 public:
  BiasEvaluator(const BiasScheme& scheme, std::int64_t min_relative, std::int64_t max_relative);
  // The range of k − q over two position grids ([B, Sq] and [B, Sk]).
  static BiasEvaluator for_positions(const BiasScheme& scheme, const Positions& q_positions,
                                     const Positions& k_positions, std::int64_t batch, std::int64_t q_len,
                                     std::int64_t k_len);

  std::int64_t heads() const { return heads_; }
  float operator()(std::int64_t head, std::int64_t q_position, std::int64_t k_position) const;
  // scores[t] (+)= b(h, k_first + t − q_position), t < count: keys at consecutive positions.
  void add_row(std::int64_t head, std::int64_t q_position, std::int64_t k_first, std::int64_t count,
               float* scores) const;
  void fill_row(std::int64_t head, std::int64_t q_position, std::int64_t k_first, std::int64_t count, float* out) const;
  // The tabulated row itself (count values of consecutive keys from k_first), or nullptr when it
  // is not tabulated (NoPE, a range too wide, or keys outside the range).
  const float* table_row(std::int64_t head, std::int64_t q_position, std::int64_t k_first, std::int64_t count) const;

 private:
  BiasScheme scheme_;
  std::int64_t heads_ = 0;
  std::int64_t min_relative_ = 0, width_ = 0;  // table covers [min_relative_, min_relative_ + width_)
  std::vector<float> table_;                   // [heads, width_], empty when not tabulated
  bool zero_ = false;                          // NoPE
  float direct(std::int64_t head, std::int64_t q_position, std::int64_t k_position) const;
};

}  // namespace posenc
