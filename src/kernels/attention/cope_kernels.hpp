// SIMD kernels of CoPE (cope.hpp; Highway, dynamic dispatch; cope_kernels.cpp). Tiles are
// transposed as the softmax engine's (attention_kernels.hpp): T[j][r] for key j and query row r,
// rows in the vector lanes, so each row's gate sum from its own token leftwards stays in a lane
// while the kernels walk the keys from the last to the first.
//
// Positions: with c the row's gate sum after key j, p = c clamped to cap = npos − 1 (c >= cap:
// clamped; a NaN c stays NaN), interpolated between qe[⌊p⌋] and qe[⌈p⌉] of the row's
// ⟨q, e[n]⟩ (row r at qe + r·ldqe), ⌈p⌉ = ⌊p⌋ at an integer, a NaN p at index 0 with weight NaN.
// Lanes whose sum has reached cap before a tile take qe[cap] for every key without gates.
#pragma once

#include <cstdint>

namespace posenc::kernels {

// Forward: st holds the tile's logits z (scale included) and becomes s = z + the interpolated
// position logit; invisible keys (masked: k_first + j >= hi[r]) get −inf and leave the sum as is.
// width is a multiple of kAttnAlign; carry[r] is the row's gate sum and carry[width + r] its
// compensation (a Kahan sum; both updated).
void cope_forward_tile(float* st, std::int64_t keys, std::int64_t width, std::int64_t k_first, const std::int32_t* hi,
                       bool masked, const float* qe, std::int64_t ldqe, float cap, float* carry);

// Backward on a tile, leftwards as in forward: st holds z and becomes P = exp(s − lse[r]) (0 for
// an lse of −inf), dpt holds d_out_r·v_j and becomes dS = P·(dpt − delta[r]); dpp gets dp
// (0 where clamped) and gg g·(1 − g) (0 for invisible keys). dqe (rows ldqe apart, null: not
// wanted) gets dS·(1 − w) at ⌊p⌋ and dS·w at ⌈p⌉; tile_sum (null: not wanted) each row's Σ dp.
void cope_backward_tile(float* st, float* dpt, float* dpp, float* gg, std::int64_t keys, std::int64_t width,
                        std::int64_t k_first, const std::int32_t* hi, bool masked, const float* qe, std::int64_t ldqe,
                        float cap, const float* lse, const float* delta, float* carry, float* dqe, float* tile_sum);

// Then, rightwards from the tile's first key: run = left[r] + Σ_{j'<=j} dpp, and
// dpt = dS + gg·run (0 for invisible keys) — the logits' gradient without the scale; left[r]
// becomes the sum after the tile.
void cope_backward_finish(float* dpt, const float* dpp, const float* gg, std::int64_t keys, std::int64_t width,
                          std::int64_t k_first, const std::int32_t* hi, bool masked, float* left);

}  // namespace posenc::kernels
