// SIMD kernels of the absolute encodings: declarations of the dispatched entry points.
// Implemented once, target-generically, in absolute_kernels.cpp, which Highway recompiles for
// every target (scalar, SSE4, AVX2, AVX-512); each entry point uses the target chosen at run
// time (posenc/runtime.hpp).
#pragma once

#include <cstdint>

namespace posenc::kernels {

// Per-pair description of a sinusoidal encoding, prepared once per (dim, base, layout). Pair
// i < dim/2 has frequency freq[i] and two columns, sin(p·freq[i]) and cos(p·freq[i]): columns 2i
// and 2i+1 when `interleaved`, else i and dim/2 + i. Stepping a position by one rotates the pair:
//   sin(p+1) = sin(p)·step_cos[i] + cos(p)·step_sin[i]
//   cos(p+1) = cos(p)·step_cos[i] - sin(p)·step_sin[i]
// with step_cos = cos(freq), step_sin = sin(freq). Every array holds dim/2 entries followed by
// kColumnPadding zeros, so that full vectors load at any pair < dim/2.
struct SinusoidColumns {
  const double* freq = nullptr;
  const double* step_cos = nullptr;
  const double* step_sin = nullptr;
  std::int64_t dim = 0;
  bool interleaved = true;
};
inline constexpr std::int64_t kColumnPadding = 32;

// Longest run of consecutive positions computed by rotation from one exactly computed row. Each
// rotation adds at most ~2^-51 of error, so a run's error stays below 64·2^-51 ≈ 3e-14.
inline constexpr std::int64_t kMaxRun = 64;

// A run is written kGroupRows rows at a time across all its columns: walking a column tile down
// more rows 4 KiB apart costs write bandwidth (on a Zen 3 host, non-temporal lines written 64
// rows deep reached 31 GB/s, 16 rows deep 47). Runs longer than this keep their rotation state
// between groups in `state`, sinusoid_state_doubles(dim) doubles per thread.
inline constexpr std::int64_t kGroupRows = 16;
inline constexpr std::int64_t sinusoid_state_doubles(std::int64_t dim) { return 2 * dim + 8 * kColumnPadding; }

// Rows r = 0 … rows-1 of positions first_position + r (rows <= kMaxRun):
//   out[r·out_row_stride + j] = column j at position first_position + r, in f32.
// With `stream`, full tiles use non-temporal stores when every row keeps the first row's 64-byte
// alignment (call flush_streams(), row_kernels.hpp, at the end). `state` may be null when
// rows <= kGroupRows.
void sinusoid_run_f32(const SinusoidColumns& cols, double first_position, std::int64_t rows, float* out,
                      std::int64_t out_row_stride, bool stream, double* state);
// out[r·out_row_stride + j] = x[r·x_row_stride + j] + column j at first_position + r; out may be x.
// With `stream` (only for out != x), as sinusoid_run_f32.
void sinusoid_add_run_f32(const SinusoidColumns& cols, double first_position, std::int64_t rows, const float* x,
                          std::int64_t x_row_stride, float* out, std::int64_t out_row_stride, bool stream,
                          double* state);

}  // namespace posenc::kernels
