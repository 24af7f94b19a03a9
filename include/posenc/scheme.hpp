// posenc/scheme.hpp — the interfaces of the two families of positional score biases and of the
// query/key transforms, through which the library and the fused attention use them without
// naming them.
//
// RelativeBias: a bias of the head and the relative position only,
//
//   score(h, i, j) = q_i · k_j · scale + b_h(r),   r = p'_j − p_i  (key minus query position)
//
// A scheme of this family (ALiBi, T5, Kerple, Sandwich, …) says what b is and how it depends on
// its learned parameters θ (a flat fp64 vector, possibly empty); everything else is generic:
//   - bias_materialize / bias_value (bias.hpp) evaluate it, tables included;
//   - the fused attention (attention.hpp) tabulates b over the relative positions a call meets
//     (rounded once to f32), adds the table to its score tiles and to decode rows, and for the
//     backward sums dL/dscore per (head, r) and hands each sum to accumulate_gradient;
//   - relative_bias_backward (bias.hpp) does the same for materialised score gradients;
//   - the generic test matrix (tests/test_schemes.cpp) checks every registered scheme.
// A new scheme of this family is one class implementing this interface in its own file and one
// line in the registry (registry.hpp): see src/schemes/sandwich.cpp.
//
// PositionBias: a bias of the head and both positions themselves, b_h(p_i, p'_j) (FIRE, TUPE),
// which no table over r holds. Such a scheme brings its fp64 definition (value, and its gradient
// per pair or over a block of score gradients, what the references read) and, if it likes, fast
// forms of the materialised bias and its backward. In the fused attention it runs by the generic
// form: value for every pair the mask lets through, rounded to f32, and accumulate_gradient with
// the pair's dS. The library's own, FireParams and TupeParams, have hand-written fused forms,
// found by their type.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "posenc/positions.hpp"
#include "posenc/tensor.hpp"

namespace posenc {

class RelativeBias {
 public:
  virtual ~RelativeBias() = default;

  // The registry name (registry.hpp), e.g. "alibi".
  virtual std::string_view scheme_name() const = 0;
  virtual std::int64_t heads() const = 0;
  // b_h(r) in fp64, for head in [0, heads()) and any r (the caller checks the head).
  virtual double value(std::int64_t head, std::int64_t relative_position) const = 0;
  // b_h(r) of every head for r = r_first … r_first + count − 1: out[h·count + t] = b_h(r_first + t),
  // fp64. The default calls value(); a scheme whose values are costly (a sum of cosines) may
  // compute the rows faster, to within its stated error of value() (the engine rounds them to f32).
  // The engine asks for a long range in pieces that start at r_first + 64·m, on several threads
  // at once: a scheme whose rows depend on where a call starts keeps the same bits if it restarts
  // every 64 r from r_first.
  virtual void tabulate(std::int64_t r_first, std::int64_t count, double* out) const {
    for (std::int64_t h = 0; h < heads(); ++h) {
      for (std::int64_t t = 0; t < count; ++t) out[h * count + t] = value(h, r_first + t);
    }
  }

  // The learned parameters θ as one flat vector (empty: a parameter-free scheme), and
  // grads[t] += weight · ∂b_h(r)/∂θ_t for every t (grads has parameter_count() entries).
  virtual std::int64_t parameter_count() const { return 0; }
  virtual std::vector<double> parameters() const { return {}; }
  virtual void accumulate_gradient(std::int64_t /* head */, std::int64_t /* relative_position */, double /* weight */,
                                   std::span<double> /* grads */) const {}
  // Whether accumulate_gradient for head h touches only entries of θ that no other head's does, so
  // that relative_bias_backward may call it for several heads on threads at once. By default (θ
  // may be shared by heads) the calls run in one thread.
  virtual bool gradients_per_head() const { return false; }
};

// A scheme of this family held by the library (HeadGroup::bias, BiasScheme): shared, immutable.
using RelativeBiasRef = std::shared_ptr<const RelativeBias>;

class PositionBias {
 public:
  virtual ~PositionBias() = default;

  // The registry name (registry.hpp), e.g. "fire".
  virtual std::string_view scheme_name() const = 0;
  virtual std::int64_t heads() const = 0;
  // The learned parameters θ, flat in the scheme's registered order (empty: none).
  virtual std::int64_t parameter_count() const { return 0; }
  virtual std::vector<double> parameters() const { return {}; }
  // b_h(p_i, p'_j) in fp64, the definition, for head in [0, heads()) (the caller checks it).
  // Throws posenc::Error for positions the scheme cannot take, as check_positions does.
  virtual double value(std::int64_t head, std::int64_t q_position, std::int64_t k_position) const = 0;
  // Throws posenc::Error, naming `where`, when a position of either grid is one the scheme cannot
  // take (TUPE: at or past its table); every position is fine by default.
  virtual void check_positions(const char* /* where */, const Positions& /* q_positions */,
                               const Positions& /* k_positions */) const {}

  // The gradient, in two forms of which a scheme overrides at least one (each defaults to the
  // other; a scheme that overrides neither is refused by name when one is called):
  // - grads[t] += weight·∂b_head(q_position, k_position)/∂θ_t for one pair, what the fused
  //   attention's generic form calls; by default reference_backward over a block of that pair;
  // - grads[t] += Σ d_scores[b, h, i, j]·∂b_h(q_pos(b, i), k_pos(b, j))/∂θ_t over a block of
  //   score gradients ([B, H, Sq, Sk] or [H, Sq, Sk], any dtype), in fp64 by the definition (the
  //   references read it), validating its arguments; by default accumulate_gradient per element.
  // grads has parameter_count() entries.
  virtual void accumulate_gradient(std::int64_t head, std::int64_t q_position, std::int64_t k_position, double weight,
                                   std::span<double> grads) const;
  virtual void reference_backward(const Positions& q_positions, const Positions& k_positions, ConstTensorView d_scores,
                                  std::span<double> grads) const;
  // The fast forms, which a scheme may give: backward as reference_backward, deterministic for any
  // thread count (by default reference_backward itself), and the materialised bias out[b, h, i, j]
  // = b_h(q_pos(b, i), k_pos(b, j)) (bias_materialize calls it with `out` checked: [B, H, Sq, Sk]
  // or [H, Sq, Sk], writable, not fp64; by default value() per element).
  virtual void backward(const Positions& q_positions, const Positions& k_positions, ConstTensorView d_scores,
                        std::span<double> grads) const;
  virtual void materialize(const Positions& q_positions, const Positions& k_positions, TensorView out) const;
};

// A scheme of this family held by the library (HeadGroup::bias, BiasScheme): shared, immutable.
using PositionBiasRef = std::shared_ptr<const PositionBias>;

// QKTransformScheme: a transform of the queries and keys by their own positions before the
// product (HeadGroup::transform), in one of the two forms the kernels run:
//   rotation  rotary_pairs() pairs of entries from rotary_offset(), (x[o + 2i], x[o + 2i + 1])
//             when interleaved, else (x[o + i], x[o + i + pairs]), each turned by θ(p, i) and
//             scaled by s(p, i) on queries, 1/s on keys (1 unless scaled(); xPos's form):
//               (a, b) → s·(a cos θ − b sin θ, a sin θ + b cos θ)
//   addition  a row of the position added to the queries and the keys (Shortformer's form).
// A scheme gives its fp64 definition and nothing else: the fused attention tabulates it per call
// over the positions the call meets (cos θ and sin θ computed in fp64, rounded once to f32) and
// runs it as the built-in RoPE and Shortformer, forward, backward and decode (keys rotated as the
// cache is read); the reference applies the definition in fp64. It has no learned parameters.
class QKTransformScheme {
 public:
  enum class Form : std::uint8_t { kRotation, kAddition };
  virtual ~QKTransformScheme() = default;

  virtual std::string_view scheme_name() const = 0;
  virtual Form form() const = 0;
  // The head size it transforms (an Attention refuses a q of another).
  virtual std::int64_t head_dim() const = 0;

  // Rotation. angle and scale must be finite (scale > 0): an Attention refuses another value by
  // position and pair. angle's default throws posenc::Error (not a rotation).
  virtual std::int64_t rotary_pairs() const { return head_dim() / 2; }
  virtual std::int64_t rotary_offset() const { return 0; }
  virtual bool interleaved() const { return false; }
  virtual double angle(std::int64_t position, std::int64_t pair) const;
  virtual bool scaled() const { return false; }
  virtual double scale(std::int64_t /* position */, std::int64_t /* pair */) const { return 1.0; }

  // Addition: row[d] for d < head_dim(), added at `position` (finite). The default throws
  // posenc::Error (not an addition).
  virtual void addition(std::int64_t position, std::span<double> row) const;
};

}  // namespace posenc
