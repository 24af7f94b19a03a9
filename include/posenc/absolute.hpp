// posenc/absolute.hpp — absolute position encodings: sinusoidal (Vaswani et al. 2017) and a
// learned table (GPT-2, BERT).
//
// ─── Sinusoidal ────────────────────────────────────────────────────────────────────────────────
// For a token at position p and a width d (even), with ω_i = base^(-2i/d), i = 0 … d/2 - 1:
//
//     PE(p, 2i) = sin(p · ω_i)        PE(p, 2i+1) = cos(p · ω_i)        (Vaswani et al. 2017, §3.5)
//
// Two layouts of the same numbers along the last axis (d = 8 shown, s_i = sin(p·ω_i), c_i = cos):
//
//   kInterleaved   [s0 c0 s1 c1 s2 c2 s3 c3]    the paper; PyTorch tutorials; fairseq "interleaved"
//   kSplitHalves   [s0 s1 s2 s3 c0 c1 c2 c3]    tensor2tensor, fairseq, Hugging Face Marian/M2M100
//
// Numerics: ω_i is computed in extended precision and rounded to fp64; p·ω_i is formed in fp64
// and reduced modulo π/2 with a two-part π/2 (the reduction is exact to ~1e-16), so no bits are
// lost at long positions — the usual fp32 `p * div_term` is off by up to ~0.06 at p = 2^20.
// Error of every value against the true sin/cos of the exact angle p·base^(-2i/d):
//     f32 output   |err| <= 2^-25 (rounding to f32) + p·2^-52 + 1e-11   (< 2^-24 for p <= 2^24)
//     f64 output   |err| <= p·2^-52 + 2^-53                             (libm sin/cos in fp64)
//     bf16 / f16   within one unit in the last place of the output type
// Valid input: d even, 2 <= d <= 2^20; base > 1 and finite; 0 <= p <= kMaxPosition (2^40).
//
// ─── Learned table ─────────────────────────────────────────────────────────────────────────────
// A table W[max_len, d]; forward y[b, s] = x[b, s] + W[pos(b, s)]; backward dW[pos] += dy,
// dx += dy. A position >= max_len is an error: a learned table has no row for it and does not
// extrapolate.
//
// ─── Views, dtypes and threads ─────────────────────────────────────────────────────────────────
// Embeddings are [B, S, d] or [S, d] (B = 1) with any non-negative strides; tables are [N, d].
// All tensors of one call share a dtype (f32, f64, bf16, f16). f32 runs the SIMD kernels; bf16
// and f16 compute in f32; f64 runs the fp64 reference. Work is split over OpenMP threads; every
// result is bitwise identical for any thread count, including the learned backward with repeated
// positions (each table row sums its tokens in token order).
// Outputs may alias inputs exactly (in place) but must not partially overlap them.
#pragma once

#include <cstdint>
#include <vector>

#include "posenc/positions.hpp"
#include "posenc/tensor.hpp"

namespace posenc {

enum class SinusoidalLayout : std::uint8_t {
  kInterleaved,  // [s0 c0 s1 c1 …]
  kSplitHalves,  // [s0 s1 … | c0 c1 …]
};

// Validated at construction: throws posenc::Error naming the field.
class SinusoidalParams {
 public:
  explicit SinusoidalParams(std::int64_t dim, double base = 10000.0,
                            SinusoidalLayout layout = SinusoidalLayout::kInterleaved);

  std::int64_t dim() const { return dim_; }
  double base() const { return base_; }
  SinusoidalLayout layout() const { return layout_; }

  // ω_i = base^(-2i/d) for i in [0, d/2), in fp64 (computed in extended precision).
  std::vector<double> inv_frequencies() const;

 private:
  std::int64_t dim_;
  double base_;
  SinusoidalLayout layout_;
};

// out[n, :] = PE(positions.at(0, n)).   out: [N, d]; positions: batch() in {0, 1}, seq_len() = N.
void sinusoidal_table(const SinusoidalParams& params, const Positions& positions, TensorView out);

// out[b, s, :] = x[b, s, :] + PE(positions.at(b, s)).   x, out: [B, S, d] or [S, d].
// `out` may be `x` itself (in place).
void sinusoidal_add(const SinusoidalParams& params, ConstTensorView x, const Positions& positions, TensorView out);
inline void sinusoidal_add_inplace(const SinusoidalParams& params, TensorView x, const Positions& positions) {
  sinusoidal_add(params, x, positions, x);
}

// ─── Learned ───────────────────────────────────────────────────────────────────────────────────

// y[b, s, :] = x[b, s, :] + table[pos(b, s), :].   table: [max_len, d]; x, y: [B, S, d] or [S, d].
void learned_forward(ConstTensorView table, ConstTensorView x, const Positions& positions, TensorView y);

// Backward of learned_forward. Restating the forward: y = x + W[pos]. Then
//   d_table[pos(b, s), :] += dy[b, s, :]   (rows of repeated positions sum in token order)
//   dx += dy                                (skipped when dx is an empty view)
// Like every posenc backward, it accumulates into the gradients, so that contributions from
// several ops sum without temporaries; zero dx first for the plain dx = dy. dx, d_table and dy
// must not overlap one another.
void learned_backward(ConstTensorView dy, const Positions& positions, TensorView d_table, TensorView dx = {});

// Initialisers. Values depend only on (seed, row, column), never on the thread count:
// a counter-based generator (SplitMix64) feeds a Box–Muller transform.
void learned_init_normal(TensorView table, double std, std::uint64_t seed);
void learned_init_zeros(TensorView table);

// A table that posenc owns (f32). Callers who own their memory use the functions above directly.
class LearnedTable {
 public:
  LearnedTable(std::int64_t max_len, std::int64_t dim);
  std::int64_t max_len() const { return max_len_; }
  std::int64_t dim() const { return dim_; }
  TensorView view() { return TensorView::of(values_.data(), {max_len_, dim_}); }
  ConstTensorView view() const { return ConstTensorView::of(values_.data(), {max_len_, dim_}); }

 private:
  std::int64_t max_len_;
  std::int64_t dim_;
  std::vector<float> values_;
};

}  // namespace posenc
