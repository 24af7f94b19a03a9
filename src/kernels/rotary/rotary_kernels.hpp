// SIMD kernels of rotary position embedding: declarations of the dispatched entry points
// (implemented in rotary_kernels.cpp for every Highway target).
#pragma once

#include <cstdint>

#include "posenc/dtype.hpp"

namespace posenc::kernels {

// Per-token rotation coefficients in the layout of the head vector: for every rotated entry j
// (j < r), out[j] = x[j]·cos_e[j] + x[partner(j)]·sin_e[j], where partner(j) is the other member
// of j's pair (j ^ 1 interleaved; j ± r/2 half-split) and sin_e carries the sign (−sin for the
// first member of a pair, +sin for the second; negated again for the inverse rotation).
//
// Per-call tables, expanded to the layout (r entries each, then kRopePadding zeros):
//   freq[j]      ω of j's pair
//   step_cos[j]  cos ω, step_sin[j] = sin ω        (one position further)
//   sign[j]      −1 for the first member of a pair, +1 for the second (negated for the inverse)
//   pair_freq[i] ω of pair i (r/2 entries, then kRopePadding zeros)
struct RopeColumns {
  const double* freq = nullptr;
  const double* step_cos = nullptr;
  const double* step_sin = nullptr;
  const double* sign = nullptr;
  const double* pair_freq = nullptr;
  std::int64_t rotary_dim = 0;
  bool interleaved = false;
};
inline constexpr std::int64_t kRopePadding = 16;

// Runs of consecutive positions share their coefficients' computation: the first position's
// (cos θ, sin θ) exactly (fp64 angle, exact reduction), each next one by rotating that fp64 state
// by ω (error < 64·2^-51 over a run of at most kRopeMaxRun positions).
inline constexpr std::int64_t kRopeMaxRun = 64;
// state: 2·(r + kRopePadding) doubles, cos θ then sin θ, per entry of the expanded layout.
void rope_state_start(const RopeColumns& cols, double position, double* state);
void rope_state_step(const RopeColumns& cols, double* state);
// cos_e = α·cos θ, sin_e = sign·α·sin θ, rounded to f32 (r entries each).
void rope_state_emit(const RopeColumns& cols, const double* state, double alpha, float* cos_e, float* sin_e);

// Rotates `heads` head vectors of one token: head h at x + h·x_head_stride → out + h·out_head_stride,
// each of head_dim contiguous entries of `dtype` (f32, bf16 or f16; raw bits for the 16-bit
// types), computing in f32 and rounding to nearest even; entries r … head_dim−1 are copied when
// out != x. With `stream`, aligned vectors of out use non-temporal stores (flush_streams()
// afterwards). Throws posenc::Error for f64 (the reference handles it).
void rope_rotate(const float* cos_e, const float* sin_e, std::int64_t rotary_dim, bool interleaved,
                 std::int64_t head_dim, std::int64_t heads, DType dtype, const void* x, std::int64_t x_head_stride,
                 void* out, std::int64_t out_head_stride, bool stream);

// How far ahead of its loads the rotation prefetches. Measured with q [1, 4096, 32, 128] and
// k [1, 4096, 8, 128] f32 on 2 threads (AVX-512): no prefetch 0.70–0.76 of the non-temporal copy,
// 1 KiB ahead 0.82–0.91, 2 KiB 0.86–0.96, 4 KiB 0.88–0.97, 8 KiB 0.87–0.9.
inline constexpr std::int64_t kRopePrefetchBytes = 4096;

}  // namespace posenc::kernels
