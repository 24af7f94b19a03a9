// posenc/cope.hpp — CoPE, contextual position encoding (Golovneva, Wang, Weston and Sukhbaatar
// 2024, "Contextual Position Encoding: Learning to Count What's Important", arXiv:2405.18719):
// causal softmax attention whose positions are counted by gates computed from the content. For
// query i (key token t_i) and each key j <= t_i of its sequence:
//
//   z_ij = scale·⟨q_i, k_j⟩                       (scale 0: 1/sqrt(D))
//   g_ij = σ(z_ij)                                the gate: does key j count for query i?
//   p_ij = min(Σ_{m=j..t_i} g_im, npos − 1)        its position: the gates from j to the query
//   s_ij = z_ij + (1 − w)·⟨q_i, e[⌊p⌋]⟩ + w·⟨q_i, e[⌈p⌉]⟩,   w = p − ⌊p⌋
//   out_i = Σ_j softmax_j(s_ij)·v_j,   lse_i = log Σ_j exp(s_ij)
//
// e is the learned table [npos, D] of the layer, shared by the heads; ⟨q_i, e[n]⟩ is taken once
// per query row for every n and interpolated. This is the paper's Figure 1 code (gates from the
// scaled logits, the position logits from the raw query added to them). The authors' training
// code divides the sum q·k + position logits by sqrt(D) instead: the same model with e/sqrt(D).
// Query i of a sequence with Lq queries and Lk keys is its key token t_i = Lk − Lq + i (decode:
// Lq = 1). A gate or probability below FLT_MIN is 0, in the kernels and in the fp64 reference
// alike; a NaN gate makes the positions left of it NaN, and a NaN position gives a NaN logit.
//
// Gradients (backward), with dS_ij = P_ij·(d_out_i·v_j − Δ_i), Δ_i = d_out_i·out_i:
//   ⟨q_i, e[⌊p⌋]⟩ gets dS·(1 − w), ⟨q_i, e[⌈p⌉]⟩ gets dS·w   (dqe_i, a row of npos)
//   dp_ij = dS_ij·(⟨q_i, e[⌈p⌉]⟩ − ⟨q_i, e[⌊p⌋]⟩) where the sum is below npos − 1, else 0
//   dz_ij = dS_ij + g_ij·(1 − g_ij)·Σ_{m<=j} dp_im          (every position left of j counts g_ij)
//   dq_i = scale·Σ_j dz_ij·k_j + Σ_n dqe_i[n]·e[n],  dk_j = scale·Σ_i dz_ij·q_i,
//   dv_j = Σ_i P_ij·d_out_i,  de[n] = Σ_i dqe_i[n]·q_i
// (⌈p⌉ = ⌊p⌋ at an integer p, as the composition's ceil, so dp is 0 there.)
//
// ─── Layout (as attention.hpp) ─────────────────────────────────────────────────────────────────
//   q, dq        [B, Sq, H, D]  (or packed [Tq, H, D] with cu_seqlens_q)
//   k, dk        [B, Sk, G, D]  (or packed [Tk, G, D] with cu_seqlens_k), G dividing H (GQA)
//   v, dv        [B, Sk, G, Dv] (any Dv >= 1)
//   table, d_table [npos, D], 1 <= npos <= 65536, in q's dtype or f32
//   out, d_out   [B, Sq, H, Dv] (out in q's dtype or f32)
//   lse          [B, Sq, H] f32 (or [Tq, H])
// Any strides; q, k, v in f32, bf16 or f16 (math in f32) or f64 (the fp64 reference,
// reference.hpp). Lq <= Lk in every sequence.
//
// ─── Fused (flash-style, O(tile) workspace per thread) ────────────────────────────────────────
// Blocks of query rows (64 rows: the queries of one head, or of every head of a KV group) take
// ⟨q, e[n]⟩ for their rows in one product, then run their key tiles from the diagonal leftwards,
// each row's gate sum in a vector lane, with an online softmax. Once every row of a block has
// counted npos − 1, the gates no longer matter: the remaining tiles add ⟨q, e[npos − 1]⟩ only.
// Backward takes Σ_{m<=j} dp from the left without subtracting from a total (which would turn an
// infinite total into NaN): a first walk over the tiles that still count sums each tile's dp
// per row, the second adds the tiles left of the current one. dk, dv are summed per (sequence,
// KV head) as stick-breaking's (row_blocks.hpp), d_table per fixed group of units in unit order:
// results are bitwise identical for any thread count.
//
// Errors (posenc::Error naming the parameter): as stick-breaking's for q, k, v, scale and
// cu_seqlens; a table that is not [npos, D] with npos in [1, 65536] (each block keeps a row of npos
// floats per query) or of another dtype; outputs that share memory with an input or each other.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "posenc/attention.hpp"
#include "posenc/tensor.hpp"

namespace posenc {

struct CopeSpec {
  ConstTensorView q, k, v;
  ConstTensorView table;                                 // e [npos, D]
  double scale = 0.0;                                    // 0: 1/sqrt(D)
  std::vector<std::int64_t> cu_seqlens_q, cu_seqlens_k;  // packed sequences (both or neither)
};

class CopeAttention : public AttentionSizes {
 public:
  explicit CopeAttention(CopeSpec spec);
  ~CopeAttention();
  CopeAttention(CopeAttention&&) noexcept;
  CopeAttention& operator=(CopeAttention&&) noexcept;

  const CopeSpec& spec() const;
  std::int64_t positions() const;  // npos

  // out like q with Dv columns (q's dtype or f32); lse [B, Sq, H] f32 or an empty view.
  AttentionStats forward(TensorView out, TensorView lse = {}) const;
  // out and lse from forward; dq, dk, dv (+=) like q, k, v, d_table (+=) like table; empty
  // views skip them.
  AttentionStats backward(ConstTensorView out, ConstTensorView lse, ConstTensorView d_out, TensorView dq, TensorView dk,
                          TensorView dv, TensorView d_table) const;

 private:
  struct Plan;  // validated shapes and sequences (src/cope.cpp)
  std::unique_ptr<Plan> plan_;
};

}  // namespace posenc
