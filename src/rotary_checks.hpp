// Argument validation of rotary embedding, shared by the SIMD entry points (rotary.cpp) and the
// fp64 reference (ref/rotary_ref.cpp).
#pragma once

#include <span>
#include <vector>

#include "internal.hpp"
#include "posenc/rotary.hpp"

namespace posenc::detail {

struct RopeGrids {
  HeadsGrid q, k, q_out, k_out;
  bool has_k = false;
};

RopeGrids check_rope(const RopeParams& params, const Positions& positions, ConstTensorView q, ConstTensorView k,
                     ConstTensorView q_out, ConstTensorView k_out);
// Multi-axis RoPE: validates sections and axes (and the views, through check_rope); returns the
// views' grids and, per rotary pair, its axis and frequency.
struct MultiAxis {
  RopeGrids grids;
  std::vector<std::int64_t> pair_axis;
  std::vector<double> pair_freq;
};
MultiAxis check_rope_multi(const RopeParams& params, std::span<const std::int64_t> axis_of_pair,
                           std::span<const Positions> axis_positions, ConstTensorView q, ConstTensorView k,
                           ConstTensorView q_out, ConstTensorView k_out, bool restart_frequencies,
                           std::int64_t seq_len);
// M-RoPE's sections as a pair → axis map (rotary.hpp: mrope_axis_of_pair), errors named for `where`;
// pairs > 0: the sections must add up to it (rotary_dim / 2).
std::vector<std::int64_t> sections_to_axes(const char* where, std::span<const std::int64_t> sections,
                                           MropeLayout layout, std::int64_t pairs);

// xPos scales by ζ_0^(±(p − c)/scale_base) with ζ_0 = 0.4/1.4: beyond e^±80 the scale would
// overflow or vanish in f32. Throws posenc::Error naming the farthest position.
void check_xpos_range(const RopeParams& params, const Positions& positions, std::int64_t batch, std::int64_t seq);

// cos and sin: [N, r/2] each, same dtype.
Grid check_rope_cos_sin(const RopeParams& params, const Positions& positions, ConstTensorView cos, ConstTensorView sin);

}  // namespace posenc::detail
