// posenc/reference.hpp — the scalar fp64 reference of every kernel.
//
// Plain loops, fp64 arithmetic inside whatever the tensor dtype, libm sin/cos. These are the test
// oracle for the SIMD kernels, the fallback for f64 tensors, and what runs under
// POSENC_TARGET=ref (the CLI's `--target ref`). Signatures and contracts are those of the public
// functions of the same name (absolute.hpp, rotary.hpp, bias.hpp, relative.hpp); inputs are validated the same way.
#pragma once

#include "posenc/absolute.hpp"
#include "posenc/attention.hpp"
#include "posenc/cope.hpp"
#include "posenc/stickbreaking.hpp"
#include "posenc/bias.hpp"
#include "posenc/relative.hpp"
#include "posenc/rotary.hpp"

namespace posenc::ref {

void sinusoidal_table(const SinusoidalParams& params, const Positions& positions, TensorView out);
void sinusoidal_add(const SinusoidalParams& params, ConstTensorView x, const Positions& positions, TensorView out);
void learned_forward(ConstTensorView table, ConstTensorView x, const Positions& positions, TensorView y);
void learned_backward(ConstTensorView dy, const Positions& positions, TensorView d_table, TensorView dx = {});

void rope_apply(const RopeParams& params, const Positions& positions, ConstTensorView q, ConstTensorView k,
                TensorView q_out, TensorView k_out, RopeDirection direction = RopeDirection::kForward,
                std::int64_t seq_len = 0);
void rope_cos_sin(const RopeParams& params, const Positions& positions, TensorView cos, TensorView sin,
                  std::int64_t seq_len = 0);
void rope_apply_multi(const RopeParams& params, std::span<const std::int64_t> sections,
                      std::span<const Positions> axis_positions, ConstTensorView q, ConstTensorView k, TensorView q_out,
                      TensorView k_out, RopeDirection direction = RopeDirection::kForward,
                      bool restart_frequencies = false, std::int64_t seq_len = 0);
void rope_apply_axes(const RopeParams& params, std::span<const std::int64_t> axis_of_pair,
                     std::span<const Positions> axis_positions, ConstTensorView q, ConstTensorView k, TensorView q_out,
                     TensorView k_out, RopeDirection direction = RopeDirection::kForward,
                     bool restart_frequencies = false, std::int64_t seq_len = 0);
void rope_rerotate(const RopeParams& from, const Positions& from_positions, std::int64_t from_seq_len,
                   const RopeParams& to, const Positions& to_positions, std::int64_t to_seq_len, ConstTensorView k,
                   TensorView k_out);

// A head group's transform of queries (is_q) or keys (QKTransform: RoPE, Shortformer's sinusoid,
// any registered transform) by its fp64 definition, in place on `rows` [n, d] row-major, row t at
// positions[t]; seq_len: the call's default (its largest position + 1), which a RoPE without its
// own reads. A cache of rotated keys (RotaryQK::keys_rotated) leaves keys as they are.
void qk_transform_rows(const QKTransform& transform, bool is_q, std::span<const std::int64_t> positions,
                       std::int64_t seq_len, std::int64_t d, std::span<double> rows);

void bias_materialize(const BiasScheme& scheme, const Positions& q_positions, const Positions& k_positions,
                      TensorView out);
void alibi_backward(const AlibiParams& params, const Positions& q_positions, const Positions& k_positions,
                    ConstTensorView d_scores, std::span<double> d_slopes);
void t5_bias_backward(const T5BiasParams& params, const Positions& q_positions, const Positions& k_positions,
                      ConstTensorView d_scores, std::span<double> d_table);
void kerple_backward(const KerpleParams& params, const Positions& q_positions, const Positions& k_positions,
                     ConstTensorView d_scores, std::span<double> d_r1, std::span<double> d_r2);
void relative_bias_backward(const RelativeBias& scheme, const Positions& q_positions, const Positions& k_positions,
                            ConstTensorView d_scores, std::span<double> d_params);
void fire_backward(const FireParams& params, const Positions& q_positions, const Positions& k_positions,
                   ConstTensorView d_scores, FireGradients& grads);
void tupe_backward(const TupeParams& params, const Positions& q_positions, const Positions& k_positions,
                   ConstTensorView d_scores, TupeGradients& grads);
// Any BiasScheme: d_params += the gradient of its learned parameters, flat in its registered order
// (bias_parameter_count entries; GroupGradients::bias): each scheme's own reference above, a
// PositionBias's reference_backward. Nothing for NoPE.
void bias_backward(const BiasScheme& scheme, const Positions& q_positions, const Positions& k_positions,
                   ConstTensorView d_scores, std::span<double> d_params);

void shaw_add_score_term(const ShawParams& params, ConstTensorView q, const Positions& q_positions,
                         const Positions& k_positions, TensorView scores);
void shaw_add_value_term(const ShawParams& params, ConstTensorView probs, const Positions& q_positions,
                         const Positions& k_positions, TensorView out);
void shaw_score_term_backward(const ShawParams& params, ConstTensorView q, ConstTensorView d_scores,
                              const Positions& q_positions, const Positions& k_positions, TensorView dq,
                              std::span<double> d_key_table);
void shaw_value_term_backward(const ShawParams& params, ConstTensorView probs, ConstTensorView d_out,
                              const Positions& q_positions, const Positions& k_positions, TensorView d_probs,
                              std::span<double> d_value_table);

void xl_add_position_terms(const XlParams& params, ConstTensorView q, ConstTensorView k, const Positions& q_positions,
                           const Positions& k_positions, TensorView scores);
void xl_position_terms_backward(const XlParams& params, ConstTensorView q, ConstTensorView k, ConstTensorView d_scores,
                                const Positions& q_positions, const Positions& k_positions, TensorView dq,
                                TensorView dk, XlGradients& grads);

// Attention: the unfused composition per (sequence, head) — materialised scores with the biases
// of bias_value, soft-cap, mask, softmax, P·V — in fp64, or with naive_f32 in plain f32 (how a
// straightforward f32 implementation computes it: the yardstick of the fused kernel's accuracy).
void attention_forward(const Attention& attention, TensorView out, TensorView lse, bool naive_f32 = false);
// The naive f32 composition as a bf16 implementation computes it (flash-attention's, PyTorch's
// bf16 matrix products): the transformed queries and keys rounded to bf16 before their products,
// the probabilities rounded to bf16 before P·V: the yardstick of the native bf16 products
// (AttentionSpec::bf16_products).
void attention_forward_bf16_products(const Attention& attention, TensorView out, TensorView lse);
// Its backward (fp64 sums): the transformed queries and keys rounded to bf16, P and dS rounded to
// bf16 before dV += Pᵀ·dO, dK += dSᵀ·Q and dQ += dS·K.
void attention_backward_bf16_products(const Attention& attention, ConstTensorView out, ConstTensorView lse,
                                      ConstTensorView d_out, TensorView dq, TensorView dk, TensorView dv);
void attention_backward(const Attention& attention, ConstTensorView out, ConstTensorView lse, ConstTensorView d_out,
                        TensorView dq, TensorView dk, TensorView dv, AttentionGradients* grads,
                        ConstTensorView d_lse = {});

// Stick-breaking attention (stickbreaking.hpp), each row walked leftwards in fp64; rem = 1 − Σ A.
// Backward recomputes the weights (out and rem are only checked) and adds into dq, dk, dv.
void stickbreaking_forward(const StickBreakingAttention& attention, TensorView out, TensorView rem);
void stickbreaking_backward(const StickBreakingAttention& attention, ConstTensorView out, ConstTensorView rem,
                            ConstTensorView d_out, ConstTensorView d_rem, TensorView dq, TensorView dk, TensorView dv);

// CoPE (cope.hpp), each row walked leftwards in fp64, then a materialised softmax. Backward
// recomputes everything (out and lse are only checked) and adds into dq, dk, dv and d_table.
void cope_forward(const CopeAttention& attention, TensorView out, TensorView lse);
void cope_backward(const CopeAttention& attention, ConstTensorView out, ConstTensorView lse, ConstTensorView d_out,
                   TensorView dq, TensorView dk, TensorView dv, TensorView d_table);

}  // namespace posenc::ref
