// SIMD kernels of the score biases (bias.hpp): rows copied out of the per-head tables, and rows of
// dL/dscores summed into fp64 histograms over relative positions. Dispatched at run time.
#pragma once

#include <cstdint>

namespace posenc::kernels {

// dst[t] = src[t], t < n. With `stream`, aligned vectors use non-temporal stores (call
// flush_streams() from absolute_kernels.hpp before the output is read).
void copy_row_f32(const float* src, float* dst, std::int64_t n, bool stream);
// sum[t] += src[t] (widened exactly to fp64), t < n.
void accumulate_row_f64(const float* src, double* sum, std::int64_t n);

}  // namespace posenc::kernels
