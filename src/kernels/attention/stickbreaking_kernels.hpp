// SIMD kernels of stick-breaking attention (Highway, dynamic dispatch; stickbreaking_kernels.cpp).
// Tiles are transposed as the softmax engine's (attention_kernels.hpp): T[j][r] for key j and
// query row r, rows in the vector lanes, so each row's running sum from the diagonal leftwards
// stays in a lane while the kernel walks the keys from the last to the first.
#pragma once

#include <cstdint>

namespace posenc::kernels {

// A weight exp(x) with x below this is flushed to 0 (as the softmax's probabilities are): once a
// row's carry is below it, every key further left has weight exactly 0.
inline constexpr float kSbDead = -87.3f;

// Forward: st holds the tile's logits z (scale included) and becomes A^T. For j = keys − 1 … 0
// and each lane r whose key k_first + j is visible (masked: k_first + j < hi[r]; else every key):
//   A = exp(carry[r] − softplus(−z)),  carry[r] −= softplus(z);  invisible keys get A = 0.
// width is a multiple of kAttnAlign.
void sb_forward_tile(float* st, std::int64_t keys, std::int64_t width, std::int64_t k_first, const std::int32_t* hi,
                     bool masked, float* carry);

// Backward: st holds z (becomes A^T), dpt holds d_out_r·v_j (becomes dz^T, the logits' gradient
// without the scale). Leftwards as in forward, with total[r] = G_r = Σ_j A_rj·dA_rj and suffix[r]
// the sum of g over the keys to the right (updated):
//   g = A·(dpt − d_rem[r]);  suffix += g;  R = G − suffix (0 once the carry is below kSbDead: every
//   weight to the left is then 0);  dz = g·σ(−z) − σ(z)·R.
void sb_backward_tile(float* st, float* dpt, std::int64_t keys, std::int64_t width, std::int64_t k_first,
                      const std::int32_t* hi, bool masked, const float* total, const float* d_rem, float* carry,
                      float* suffix);

}  // namespace posenc::kernels
