// Argument validation of rotary embedding, shared by the SIMD entry points (rotary.cpp) and the
// fp64 reference (ref/rotary_ref.cpp).
#pragma once

#include "internal.hpp"
#include "posenc/rotary.hpp"

namespace posenc::detail {

// A [B, S, H, D] view, or a packed [T, H, D] one (B = 1, S = T).
struct HeadsGrid {
  std::int64_t batch = 1, seq = 0, heads = 0, dim = 0;
  std::int64_t batch_stride = 0, seq_stride = 0, head_stride = 0, dim_stride = 1;

  std::int64_t offset(std::int64_t b, std::int64_t s) const { return b * batch_stride + s * seq_stride; }
};

struct RopeGrids {
  HeadsGrid q, k, q_out, k_out;
  bool has_k = false;
};

RopeGrids check_rope(const RopeParams& params, const Positions& positions, ConstTensorView q,
                     ConstTensorView k, ConstTensorView q_out, ConstTensorView k_out);
// cos and sin: [N, r/2] each, same dtype.
Grid check_rope_cos_sin(const RopeParams& params, const Positions& positions, ConstTensorView cos,
                        ConstTensorView sin);

}  // namespace posenc::detail
