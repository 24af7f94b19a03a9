// SIMD kernels of rotary position embedding: declarations of the dispatched entry points
// (implemented in rotary_kernels.cpp for every Highway target).
#pragma once

#include <cstdint>

namespace posenc::kernels {

// Per-token rotation coefficients in the layout of the head vector: for every rotated entry j
// (j < r), out[j] = x[j]·cos_e[j] + x[partner(j)]·sin_e[j], where partner(j) is the other member
// of j's pair (j ^ 1 interleaved; j ± r/2 half-split) and sin_e carries the sign (−sin for the
// first member of a pair, +sin for the second; negated again for the inverse rotation).
//
// Fills cos_e[0, r) and sin_e[0, r) for one position: θ_i = position·inv_freq[i] in fp64,
// reduced exactly, times `alpha`, rounded to f32. inv_freq holds r/2 values followed by at
// least kRopeFreqPadding zeros.
inline constexpr std::int64_t kRopeFreqPadding = 16;
void rope_coefficients(const double* inv_freq, std::int64_t rotary_dim, bool interleaved,
                       bool inverse, double alpha, double position, float* cos_e, float* sin_e);

// Rotates `heads` head vectors of one token: head h at x + h·x_head_stride → out + h·out_head_stride,
// each of head_dim contiguous f32 entries; entries r … head_dim−1 are copied when out != x.
void rope_rotate_f32(const float* cos_e, const float* sin_e, std::int64_t rotary_dim,
                     bool interleaved, std::int64_t head_dim, std::int64_t heads, const float* x,
                     std::int64_t x_head_stride, float* out, std::int64_t out_head_stride);

}  // namespace posenc::kernels
