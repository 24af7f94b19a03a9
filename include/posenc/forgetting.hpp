// posenc/forgetting.hpp — Forgetting Attention (Lin, Nikishin, He and Courville 2025, "Forgetting
// Transformer: Softmax Attention with a Forget Gate", ICLR; FoX): a per-token, per-head forget
// gate f_t = σ(w_f·x_t + b_f) in (0, 1] decays the logits of older keys,
//
//   x_ij += D_ij = Σ_{l=j+1}^{i} log f_l = c_i − c_j,    c_t = Σ_{l=first}^{t} log f_l
//
// with c the running sum of log f within the sequence (packed sequences restart at their first
// token, as the paper's varlen kernels do). It is an attention term (term.hpp) of a head group,
// `HeadGroup::terms = {std::make_shared<ForgetGate>(log_fgate)}`, that composes with RoPE ("FoX
// Pro"), ALiBi-like biases, sliding windows and soft-caps; the paper uses it without a positional
// scheme (NoPE), as the registry's `forgetting` entry builds it:
// `make_head_group("forgetting", {.heads = H, .head_dim = D, .inputs = {{"log_fgate", view}}})`.
//
// Layout: log_fgate [B, Sk, heads] over the keys' token grid (any strides; f32, f64, bf16 or f16),
// or [Tk, heads] for packed sequences. Query i of a sequence with Lq queries and Lk keys is the key
// token Lk − Lq + i (the causal alignment of attention.hpp), so decode reads its own gate from the
// last key rows. The view must outlive every Attention built with it.
//
// Fused: c is summed once per call in fp64, and each score gets c_i − c_j taken in fp64 and
// rounded once to f32 — as exact as the logit's own rounding, however large |c| grows along the
// sequence (an f32 running sum, or the difference of two f32 values of c, would lose the decay
// of nearby keys once |c| reaches a few hundred). Backward: dc_t = (row sums of
// dS at query t) − (column sums at key t), then d log f_l = Σ_{t >= l} dc_t within the sequence
// (fp64 sums in a fixed order: the same bits for any thread count); the gradient has the gate's
// shape, flat in (b, s, h) order (GroupGradients::terms). The first token's gate never enters a
// logit: its gradient is 0 up to rounding.
//
// Errors (posenc::Error naming the parameter): a log gate above 0 (+inf included; NaN and −inf
// propagate as the cumulative-sum composition gives them), a rank other than 2 or 3, heads < 1;
// in an Attention: a mask that is not causal (unless every sequence has one query, as in decode),
// a grid other than the keys', heads other than the group's, a sequence with more queries than
// keys.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>

#include "posenc/tensor.hpp"
#include "posenc/term.hpp"

namespace posenc {

class ForgetGate final : public AttentionTerm {
 public:
  explicit ForgetGate(ConstTensorView log_fgate);

  std::string_view name() const override { return "forgetting"; }
  std::int64_t heads() const override { return log_fgate_.size(log_fgate_.rank() - 1); }
  ConstTensorView log_fgate() const { return log_fgate_; }
  double log_gate(std::int64_t batch, std::int64_t token, std::int64_t head) const;

  double value(std::int64_t head, const TokenPair& pair) const override;
  std::int64_t gradient_size() const override { return log_fgate_.numel(); }
  void accumulate_gradient(std::int64_t head, const TokenPair& pair, double weight,
                           std::span<double> grads) const override;

 private:
  ConstTensorView log_fgate_;
};

}  // namespace posenc
