// posenc/sinks.hpp — attention sinks (gpt-oss, OpenAI 2025; the "off-by-one" softmax): a learned
// logit s_h per head that joins every row's softmax denominator and has no value,
//
//   P_ij = exp(x_ij) / (exp(s_h) + Σ_j exp(x_ij)),   out_i = Σ_j P_ij·v_j,
//   lse_i = log(exp(s_h) + Σ_j exp(x_ij))
//
// so a head may put weight "nowhere" (Σ_j P_ij < 1). The same as ggml's flash_attn_ext_add_sinks
// and transformers' gpt-oss eager attention, which concatenate the sink as an extra column of the
// scores and drop it after the softmax. An attention term (term.hpp) of a head group, e.g.
// `HeadGroup::terms = {std::make_shared<AttentionSinks>(logits)}`; it composes with every scheme
// and mask (causal, windows, soft-caps: the sink is not capped, as gpt-oss has no soft-cap), and
// with decode. A row that sees no key has out = 0 and lse = s_h.
//
// Fused: each row's online softmax starts from the sink (max s_h, sum 1) instead of (−inf, 0), so
// a tile meets it like an earlier key with no value; decode puts it in the first key chunk only.
// Backward: the keys' gradients come from lse as without sinks, and
//   ∂L/∂s_h = −Σ_i exp(s_h − lse_i)·(dO_i·out_i)
// summed in fp64 in a fixed order (the same bits for any thread count); the gradient is
// GroupGradients::terms [heads].
//
// Errors (posenc::Error): no logits, a NaN or +inf one (−inf is allowed: no sink); in an
// Attention, heads other than the group's.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "posenc/term.hpp"

namespace posenc {

class AttentionSinks final : public AttentionTerm {
 public:
  explicit AttentionSinks(std::vector<double> logits);

  std::string_view name() const override { return "sinks"; }
  std::int64_t heads() const override { return static_cast<std::int64_t>(logits_.size()); }
  const std::vector<double>& logits() const { return logits_; }

  double value(std::int64_t /* head */, const TokenPair& /* pair */) const override { return 0.0; }
  std::int64_t gradient_size() const override { return heads(); }
  std::optional<double> sink(std::int64_t head) const override { return logits_[static_cast<std::size_t>(head)]; }
  void accumulate_sink_gradient(std::int64_t head, double weight, std::span<double> grads) const override {
    grads[static_cast<std::size_t>(head)] += weight;
  }

 private:
  std::vector<double> logits_;
};

}  // namespace posenc
