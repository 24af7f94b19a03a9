// posenc/bias.hpp — positional biases added to attention scores.
//
// These schemes leave queries and keys alone and add a term b(h, i, j) to the score of head h,
// query position i and key position j (positions are the tokens' ids, not their rows):
//
//     score(h, i, j) = q_i · k_j / sqrt(d) + b(h, i, j)          (then mask, softmax)
//
// Every scheme here depends on the relative position r = j − i only (key minus query, the
// convention of Hugging Face transformers), so b is a per-head function of r:
//
//   NoPE        b = 0: no positional signal besides the causal mask (Kazemnejad et al. 2023)
//   ALiBi       causal    b = −m_h·(i − j) = m_h·r          (Press et al. 2022)
//               symmetric b = −m_h·|r|                       (the encoder form)
//   T5          b = table[bucket(r), h], a learned table [num_buckets, H] (Raffel et al. 2020)
//   Kerple log  b = −r1_h·log(1 + r2_h·|r|)                  (Chi et al. 2022)
//   Kerple pow  b = −r1_h·|r|^r2_h, 0 < r2_h <= 2
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

#include <cstdint>
#include <span>
#include <variant>
#include <vector>

#include "posenc/positions.hpp"
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

class AlibiParams {
 public:
  // The paper's slopes for `heads` heads.
  explicit AlibiParams(std::int64_t heads, AlibiForm form = AlibiForm::kCausal, double max_bias = 8.0);
  // Custom or trained slopes, one per head, each >= 0 and finite (0: a head without ALiBi).
  explicit AlibiParams(std::vector<double> slopes, AlibiForm form = AlibiForm::kCausal);
  // ALiBi on a subset of `heads` heads: the listed heads (distinct, in [0, heads)) get the
  // paper's slopes for alibi_heads.size() heads, in the order listed; the others get 0.
  static AlibiParams on_heads(std::int64_t heads, std::span<const std::int64_t> alibi_heads,
                              AlibiForm form = AlibiForm::kCausal, double max_bias = 8.0);

  std::int64_t heads() const { return static_cast<std::int64_t>(slopes_.size()); }
  AlibiForm form() const { return form_; }
  const std::vector<double>& slopes() const { return slopes_; }

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
std::int64_t t5_bucket(std::int64_t relative_position, std::int64_t num_buckets = 32,
                       std::int64_t max_distance = 128, bool bidirectional = true);

class T5BiasParams {
 public:
  // table: [num_buckets, heads] row-major (the weight of transformers' nn.Embedding(num_buckets,
  // n_heads)); empty means zeros (a fresh model).
  T5BiasParams(std::int64_t heads, std::int64_t num_buckets = 32, std::int64_t max_distance = 128,
               bool bidirectional = true, std::vector<double> table = {});

  std::int64_t heads() const { return heads_; }
  std::int64_t num_buckets() const { return num_buckets_; }
  std::int64_t max_distance() const { return max_distance_; }
  bool bidirectional() const { return bidirectional_; }
  const std::vector<double>& table() const { return table_; }
  std::int64_t bucket(std::int64_t relative_position) const {
    return t5_bucket(relative_position, num_buckets_, max_distance_, bidirectional_);
  }

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

class KerpleParams {
 public:
  // One r1 and one r2 per head (equal lengths >= 1), all > 0 and finite; r2 <= 2 for kPower
  // (the kernel is conditionally positive definite only there).
  KerpleParams(KerpleForm form, std::vector<double> r1, std::vector<double> r2);
  std::int64_t heads() const { return static_cast<std::int64_t>(r1_.size()); }
  KerpleForm form() const { return form_; }
  const std::vector<double>& r1() const { return r1_; }
  const std::vector<double>& r2() const { return r2_; }

 private:
  KerpleForm form_;
  std::vector<double> r1_, r2_;
};

// ---------------------------------------------------------------------------------- schemes
using BiasScheme = std::variant<NoPE, AlibiParams, T5BiasParams, KerpleParams>;

std::int64_t bias_heads(const BiasScheme& scheme);
// b(h, r) in fp64, r = key − query position. h in [0, heads).
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

// The evaluator the fused attention calls inside its tile loop: per-head tables of b against the
// relative positions a call can meet, [min_relative, max_relative], rounded once to f32, so a row
// of biases is a copy (contiguous keys) or a gather. Relative positions outside the range, and
// ranges too large to tabulate (more than 2^24 entries over all heads), are evaluated directly.
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
  void fill_row(std::int64_t head, std::int64_t q_position, std::int64_t k_first, std::int64_t count,
                float* out) const;
  // The tabulated row itself (count values of consecutive keys from k_first), or nullptr when it
  // is not tabulated (NoPE, a range too wide, or keys outside the range).
  const float* table_row(std::int64_t head, std::int64_t q_position, std::int64_t k_first, std::int64_t count) const;

 private:
  BiasScheme scheme_;
  std::int64_t heads_ = 0;
  std::int64_t min_relative_ = 0, width_ = 0;  // table covers [min_relative_, min_relative_ + width_)
  std::vector<float> table_;                   // [heads, width_], empty when not tabulated
  bool zero_ = false;                          // NoPE
  float direct(std::int64_t head, std::int64_t relative) const;
};

}  // namespace posenc
