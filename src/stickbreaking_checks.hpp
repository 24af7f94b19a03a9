// Validation of stick-breaking attention (stickbreaking.hpp), shared by the fused entry points
// (stickbreaking.cpp) and the fp64 reference (ref/stickbreaking_ref.cpp), so that both reject
// exactly the same input.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "internal.hpp"
#include "row_blocks.hpp"
#include "posenc/stickbreaking.hpp"

namespace posenc::detail {

inline constexpr const char* kStickBreaking = "stickbreaking_attention";

// The semantics both the fused passes and the reference keep (stickbreaking.hpp): a weight or a
// sigmoid below FLT_MIN (an exponent below −87.3, kernels::kSbDead) is 0.
inline double sb_exp(double x) { return x < -87.3 ? 0.0 : std::exp(x); }
inline double sb_sigmoid(double z) { return z >= 0 ? 1.0 / (1.0 + std::exp(-z)) : sb_exp(z) / (1.0 + std::exp(z)); }

// The shapes of a validated spec.
using SbShape = QkvShape;
SbShape check_stickbreaking(const StickBreakingSpec& spec);

// rem or d_rem: [B, Sq, H] (packed [Tq, H]) f32.
using RemGrid = RowStatGrid;
RemGrid check_rem(const SbShape& shape, const char* name, ConstTensorView rem, bool writable);

// Forward's outputs: out like q with Dv columns, in q's dtype; rem (optional). Neither may share
// memory with an input or with the other.
HeadsGrid check_sb_forward_outputs(const StickBreakingSpec& spec, const SbShape& shape, ConstTensorView out,
                                   ConstTensorView rem);
// Backward's arguments: out, d_out like out; rem when d_rem is given; dq, dk, dv (each optional)
// like q, k, v and disjoint from everything else.
struct SbBackwardGrids : QkvBackwardGrids {
  RemGrid rem, d_rem;
};
SbBackwardGrids check_sb_backward(const StickBreakingSpec& spec, const SbShape& shape, ConstTensorView out,
                                  ConstTensorView rem, ConstTensorView d_out, ConstTensorView d_rem, ConstTensorView dq,
                                  ConstTensorView dk, ConstTensorView dv);

}  // namespace posenc::detail
