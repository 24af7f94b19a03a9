// SIMD kernels of the absolute encodings: declarations of the dispatched entry points.
// Implemented once, target-generically, in absolute_kernels.cpp, which Highway recompiles for
// every target (scalar, SSE4, AVX2, AVX-512); each entry point uses the target chosen at run
// time (posenc/runtime.hpp).
#pragma once

#include <cstdint>

namespace posenc::kernels {

// Per-column description of a sinusoidal encoding, prepared once per (dim, base, layout).
// Column j holds value(p, j) = sin(p·freq[j] + quadrant[j]·π/2)  (quadrant 0 → sin, 1 → cos); its
// partner column (the other member of its sin/cos pair) has quadrant 1 - quadrant[j]. Stepping a
// position by one rotates each pair by freq[j]:
//   value(p+1, j)   = value(p, j)·step_cos[j] + partner(p, j)·step_sin[j]
//   partner(p+1, j) = partner(p, j)·step_cos[j] - value(p, j)·step_sin[j]
// with step_cos = cos(freq), step_sin = ±sin(freq) (+ for sin columns, - for cos columns).
// Every array holds `dim` entries followed by kColumnPadding zeros, so that full vectors load at
// any column < dim.
struct SinusoidColumns {
  const double* freq = nullptr;
  const double* quadrant = nullptr;
  const double* step_cos = nullptr;
  const double* step_sin = nullptr;
  std::int64_t dim = 0;
};
inline constexpr std::int64_t kColumnPadding = 32;

// Longest run of consecutive positions computed by rotation from one exactly computed row. Each
// rotation adds at most ~2^-51 of error, so a run's error stays below 64·2^-51 ≈ 3e-14.
inline constexpr std::int64_t kMaxRun = 64;

// Rows r = 0 … rows-1 of positions first_position + r (rows <= kMaxRun):
//   out[r·out_row_stride + j] = value(first_position + r, j)   in f32.
// With `stream`, aligned vectors use non-temporal stores (call flush_streams(), row_kernels.hpp, at the end).
void sinusoid_run_f32(const SinusoidColumns& cols, double first_position, std::int64_t rows, float* out,
                      std::int64_t out_row_stride, bool stream);
// out[r·out_row_stride + j] = x[r·x_row_stride + j] + value(first_position + r, j); out may be x.
// With `stream` (only for out != x), aligned vectors of out use non-temporal stores.
void sinusoid_add_run_f32(const SinusoidColumns& cols, double first_position, std::int64_t rows, const float* x,
                          std::int64_t x_row_stride, float* out, std::int64_t out_row_stride, bool stream);

}  // namespace posenc::kernels
