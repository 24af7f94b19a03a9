// Validation of stick-breaking attention (stickbreaking.hpp), shared by the fused entry points
// (stickbreaking.cpp) and the fp64 reference (ref/stickbreaking_ref.cpp), so that both reject
// exactly the same input.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "internal.hpp"
#include "posenc/stickbreaking.hpp"

namespace posenc::detail {

inline constexpr const char* kStickBreaking = "stickbreaking_attention";

// The semantics both the fused passes and the reference keep (stickbreaking.hpp): a weight or a
// sigmoid below FLT_MIN (an exponent below −87.3, kernels::kSbDead) is 0.
inline double sb_exp(double x) { return x < -87.3 ? 0.0 : std::exp(x); }
inline double sb_sigmoid(double z) { return z >= 0 ? 1.0 / (1.0 + std::exp(-z)) : sb_exp(z) / (1.0 + std::exp(z)); }

// The shapes of a validated spec.
struct SbShape {
  bool packed = false;
  DType dtype = DType::kF32;
  HeadsGrid qg, kg, vg;
  std::int64_t batch = 0, q_len = 0, k_len = 0, heads = 0, kv_heads = 0, group = 0, dim = 0, dim_v = 0;
  double scale = 0;
  HeadsGrid out_grid() const {
    HeadsGrid g = qg;
    g.dim = dim_v;
    return g;
  }
};
SbShape check_stickbreaking(const StickBreakingSpec& spec);

// rem or d_rem: [B, Sq, H] (packed [Tq, H]) f32; element (b, s, h) at b·batch + s·seq + h·head.
struct RemGrid {
  std::int64_t batch = 0, seq = 0, head = 0;
  std::int64_t offset(std::int64_t b, std::int64_t s, std::int64_t h) const { return b * batch + s * seq + h * head; }
};
RemGrid check_rem(const SbShape& shape, const char* name, ConstTensorView rem, bool writable);

// Forward's outputs: out like q with Dv columns, in q's dtype; rem (optional). Neither may share
// memory with an input or with the other.
HeadsGrid check_sb_forward_outputs(const StickBreakingSpec& spec, const SbShape& shape, ConstTensorView out,
                                   ConstTensorView rem);
// Backward's arguments: out, d_out like out; rem when d_rem is given; dq, dk, dv (each optional)
// like q, k, v and disjoint from everything else.
struct SbBackwardGrids {
  HeadsGrid og, dog, dqg, dkg, dvg;
  RemGrid rem, d_rem;
};
SbBackwardGrids check_sb_backward(const StickBreakingSpec& spec, const SbShape& shape, ConstTensorView out,
                                  ConstTensorView rem, ConstTensorView d_out, ConstTensorView d_rem, ConstTensorView dq,
                                  ConstTensorView dk, ConstTensorView dv);

}  // namespace posenc::detail
