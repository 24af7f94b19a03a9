// posenc/stickbreaking.hpp — stick-breaking attention (Tan, Shen, Yang, Courville and Panda 2025,
// "Scaling Stick-Breaking Attention: An Efficient Implementation and In-depth Study", ICLR):
// no softmax and no positional encoding. Each query breaks a stick of length 1 from its nearest
// key leftwards, every key taking the fraction σ(z_ij) of what the nearer keys left:
//
//   z_ij = scale·⟨q_i, k_j⟩                         (scale 0: 1/sqrt(D))
//   A_ij = σ(z_ij)·Π_{j<m<e_i} (1 − σ(z_im))        for keys j < e_i of the query's sequence
//   out_i = Σ_j A_ij·v_j,     rem_i = 1 − Σ_j A_ij = Π_{j<e_i} (1 − σ(z_ij))
//
// with e_i = t_i, the query's own token t_i excluded (the authors' default), or e_i = t_i + 1 with
// `attend_current`. Query i of a sequence with Lq queries and Lk keys is its key token
// t_i = Lk − Lq + i (queries are the last Lq tokens: prefill has Lq = Lk, decode Lq = 1).
// The first token sees no key: out = 0, rem = 1. The remainder rem is returned for the model to
// use (the authors' models add rem_i·b_h, a learned per-head vector, to the output).
//
// A weight (or, in backward, a σ(z)) below FLT_MIN is 0, in the fused kernels and in the fp64
// reference alike: an inf or NaN in a value or d_out then meets 0·inf = NaN on both sides, as in
// an f32 composition.
//
// Computed in log space from the diagonal leftwards, as the authors' kernels do:
//   log A_ij = −softplus(−z_ij) − Σ_{j<m<e_i} softplus(z_im),  softplus(x) = max(x, 0) + log1p(e^−|x|)
// (the running sum is the row's "carry"); rem_i = exp(carry after every key) — the product
// above, with a relative accuracy that 1 − Σ A lacks when the stick is nearly used up.
//
// ─── Layout (as attention.hpp) ─────────────────────────────────────────────────────────────────
//   q, dq        [B, Sq, H, D]  (or packed [Tq, H, D] with cu_seqlens_q)
//   k, dk        [B, Sk, G, D]  (or packed [Tk, G, D] with cu_seqlens_k), G dividing H (GQA)
//   v, dv        [B, Sk, G, Dv] (any Dv >= 1)
//   out, d_out   [B, Sq, H, Dv]
//   rem, d_rem   [B, Sq, H] f32 (or [Tq, H])
// Any strides; q, k, v in f32, bf16 or f16 (math in f32, outputs in the inputs' dtype) or f64
// (the fp64 reference, reference.hpp). Lq <= Lk in every sequence.
//
// ─── Fused (flash-style, O(tile) workspace per thread in forward) ──────────────────────────────
// Blocks of query rows (64 rows: the queries of one head, or of every head of a KV group) run
// their key tiles from the diagonal leftwards, the carry of each row in a register lane; no
// Sq×Sk matrix is stored. Backward recomputes the tile's A and takes
//   dA_ij = d_out_i·v_j − d_rem_i,   g_ij = A_ij·dA_ij,   G_i = Σ_j g_ij = d_out_i·out_i − d_rem_i·(1 − rem_i)
//   dz_ij = g_ij·σ(−z_ij) − σ(z_ij)·Σ_{m<j} g_im,        Σ_{m<j} g_im = G_i − Σ_{m>=j} g_im
// (so it reads out and, with d_rem, rem of the forward); dq, dk, dv += their gradients. out may
// be f32 for 16-bit inputs: R = G − Σ_{m>=j} g_im carries G's error to every key a row still
// sees, and a bf16 out (2^−9 relative) cost the gradients 1–4% of their size in tests, an f32
// out 0.2% (the gradients' own rounding). Work is
// split by (sequence, KV head) and, when there are fewer than 8 of those, by fixed query ranges
// whose dk, dv sum in range order; the rules look at the shapes only, so results are bitwise
// identical for any thread count.
//
// Vanishing tiles (skip_vanishing_tiles): once every row of a block has a carry below −87.3, no
// key further left can get a weight of FLT_MIN (the kernels flush such weights to 0, as their
// softmax does), so the block stops — unless its queries, or a key or value row further left,
// hold an inf or NaN, which must still spread as the unfused composition spreads it (backward
// also needs finite d_out and d_rem rows). The result is the same to the bit either way, and a
// trained model's short-range heads then cost O(S·span) rather than O(S²). AttentionStats
// counts the tiles met and skipped.
//
// Non-finite inputs: a block whose queries, d_out, d_rem, out or any key or value row it sees hold
// an inf or NaN takes Σ_{m<j} g_im as a sum from the left, in two passes (G − Σ_{m>=j} would turn
// an infinite G into NaN where the composition has ±inf): its gradients are ±inf and NaN where
// the reference's are.
//
// Errors (posenc::Error naming the parameter): ranks, shapes and dtypes that do not match, a KV
// head count that does not divide H, a sequence with more queries than keys, a scale that is not
// 0 or of a magnitude in [FLT_MIN, FLT_MAX] (the logits are f32), cu_seqlens that do not start at
// 0, decrease, differ in size or end elsewhere than the token count, outputs that share memory
// with an input or with each other, a rem of the wrong shape or dtype, and a d_rem without rem.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "posenc/attention.hpp"
#include "posenc/tensor.hpp"

namespace posenc {

struct StickBreakingSpec {
  ConstTensorView q, k, v;
  double scale = 0.0;                                    // 0: 1/sqrt(D)
  bool attend_current = false;                           // the query's own token takes the first break
  std::vector<std::int64_t> cu_seqlens_q, cu_seqlens_k;  // packed sequences (both or neither)
  bool skip_vanishing_tiles = true;
};

class StickBreakingAttention : public AttentionSizes {
 public:
  explicit StickBreakingAttention(StickBreakingSpec spec);
  ~StickBreakingAttention();
  StickBreakingAttention(StickBreakingAttention&&) noexcept;
  StickBreakingAttention& operator=(StickBreakingAttention&&) noexcept;

  const StickBreakingSpec& spec() const;

  // out like q with Dv columns (in q's dtype, or f32); rem [B, Sq, H] f32 or an empty view.
  AttentionStats forward(TensorView out, TensorView rem = {}) const;
  // out (and rem, needed when d_rem is given) from forward; d_rem may be empty (no gradient
  // reaches rem). dq, dk, dv (+=) like q, k, v; empty views skip them.
  AttentionStats backward(ConstTensorView out, ConstTensorView rem, ConstTensorView d_out, ConstTensorView d_rem,
                          TensorView dq, TensorView dk, TensorView dv) const;

 private:
  struct Plan;  // validated shapes and sequences (src/stickbreaking.cpp)
  std::unique_ptr<Plan> plan_;
};

}  // namespace posenc
