// posenc/term.hpp — a term of the fused attention: a part of the logit that may read the pair's
// positions, per-token inputs or the q and k rows, a part of the output, or a sink in the
// softmax's denominator. The interface through which Shaw's and Transformer-XL's terms
// (relative.hpp), Forgetting Attention (forgetting.hpp) and attention sinks (sinks.hpp) enter a
// head group (HeadGroup::terms, attention.hpp) without the engine knowing them by name.
//
//   x_ij = scale·⟨T_q(q_i), T_k(k_j)⟩ + b_h(p_i, p'_j) + Σ_terms t_h(pair(i, j))
//   P_ij = exp(x_ij) / (Σ_terms exp(s_h) + Σ_j exp(x_ij))
//
// A term says what it adds for one visible (query, key) pair in fp64 (value, or row_value when it
// reads q or k; output_value when it adds to the output) and how that depends on its inputs
// (accumulate_gradient: learned parameters or activations such as a gate, one flat vector). That
// is enough to run it fused and trainable: the engine evaluates value and accumulate_gradient
// pair by pair inside its tiles (the generic fused form), unless the library has a faster form
// written for the term's type (the four terms above; src/schemes/fused_terms.cpp). The generic
// form refuses a term that reads q or k, adds to the output or is a sink, by name. The fp64
// attention reference (reference.hpp) reads only the TermDefinition, so it stays an oracle
// independent of both.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

namespace posenc {

// One (query, key) pair of a sequence as a term sees it. Tokens are indices on the key grid (the
// token axis of k: [0, Sk) of batch row `batch`, or packed [0, Tk)); a query is the key token it
// stands for, query i of a sequence with Lq queries and Lk keys being key Lk − Lq + i (the
// alignment of the causal mask, attention.hpp).
struct TokenPair {
  std::int64_t batch = 0;           // batch row (0 when packed)
  std::int64_t sequence_start = 0;  // the key token of the sequence's first key
  std::int64_t query_token = 0, key_token = 0;
  std::int64_t query_position = 0, key_position = 0;
};

// Scratch that one reference call keeps for one term over the pairs of one (sequence, head), for
// the term to use as it likes: tables it memoises (Transformer-XL's W_R r(δ) per δ), sums it
// defers to finish_row_gradients. Never shared between calls or threads.
struct TermScratch {
  std::array<std::map<std::int64_t, std::vector<double>>, 3> tables;
};

// The rows a term's definition may read for one pair, for a term whose logit reads the query or
// the key (Shaw's key term, Transformer-XL's): the head's query row after the group's transform
// and the temperature, its key row after the transform, both unscaled, and the call's scale.
// naive_f32: compute as a plain f32 implementation would (reference.hpp's naive composition).
// scratch: the (sequence, head)'s, or null (compute on the spot).
struct PairRows {
  std::span<const double> q, k;
  double scale = 1.0;
  bool naive_f32 = false;
  TermScratch* scratch = nullptr;
};

// A term's fp64 definition: all that the attention reference (reference.hpp) reads of it, so the
// reference stays an oracle independent of the fused form.
class TermDefinition {
 public:
  virtual ~TermDefinition() = default;

  // The term's part of the logit of the group's head `head` for a pair the mask lets through
  // (fp64; the engine rounds to f32 where its fused form says). 0 by default (a sink).
  virtual double value(std::int64_t /* head */, const TokenPair& /* pair */) const { return 0.0; }
  // The size of the term's input gradient (GroupGradients::terms), and
  // grads[t] += weight·∂value(head, pair)/∂input_t.
  virtual std::int64_t gradient_size() const { return 0; }
  virtual void accumulate_gradient(std::int64_t /* head */, const TokenPair& /* pair */, double /* weight */,
                                   std::span<double> /* grads */) const {}
  // The part of the logit of a term that reads the pair's rows (by default value(head, pair); a
  // term that overrides it overrides accumulate_row_gradient too, says so in reads_rows, and value
  // is then not read), and its gradient: grads as above (empty: only dq and dk are wanted), dq and
  // dk += weight·∂/∂q and ∂/∂k of the rows given. After the last pair of a (sequence, head), the
  // reference calls finish_row_gradients with that scratch, for sums a term deferred.
  virtual bool reads_rows() const { return false; }
  virtual double row_value(std::int64_t head, const TokenPair& pair, const PairRows& /* rows */) const {
    return value(head, pair);
  }
  virtual void accumulate_row_gradient(std::int64_t head, const TokenPair& pair, const PairRows& /* rows */,
                                       double weight, std::span<double> grads, std::span<double> /* dq */,
                                       std::span<double> /* dk */) const {
    if (!grads.empty()) accumulate_gradient(head, pair, weight, grads);
  }
  virtual void finish_row_gradients(std::int64_t /* head */, TermScratch& /* scratch */,
                                    std::span<double> /* grads */) const {}
  // A term that also adds to the output: out_i += Σ_j P_ij·w(pair) (Shaw's value term), w as wide
  // as the values. output_value writes w; accumulate_output_gradient adds weight·∂⟨d_out, w⟩/∂input
  // to grads (weight: P_ij).
  virtual bool adds_to_output() const { return false; }
  virtual void output_value(std::int64_t /* head */, const TokenPair& /* pair */, std::span<double> /* w */) const {}
  virtual void accumulate_output_gradient(std::int64_t /* head */, const TokenPair& /* pair */, double /* weight */,
                                          std::span<const double> /* d_out */, std::span<double> /* grads */) const {}
  // A sink: a logit s_h that joins every row's softmax denominator and has no value,
  //   P_ij = exp(x_ij) / (exp(s_h) + Σ_j exp(x_ij))
  // (none: nullopt), and grads[t] += weight·∂s_head/∂input_t.
  virtual std::optional<double> sink(std::int64_t /* head */) const { return std::nullopt; }
  virtual void accumulate_sink_gradient(std::int64_t /* head */, double /* weight */,
                                        std::span<double> /* grads */) const {}
};

// A term of a head group. Fused, by the generic form (docs/schemes.md): each visible pair's value
// rounded to f32 and added to its score, and accumulate_gradient with the pair's dS as the
// weight, summed per backward unit in fp64 and reduced in unit order (the same bits for any
// thread count); a virtual call per pair, gradient_size() doubles per backward unit.
class AttentionTerm : public TermDefinition {
 public:
  virtual std::string_view name() const = 0;
  virtual std::int64_t heads() const = 0;
};

// A term held by a head group: shared, immutable (it may view tensors that must outlive the
// Attention, as q, k and v do).
using AttentionTermRef = std::shared_ptr<const AttentionTerm>;

}  // namespace posenc
