// SIMD kernels of the score biases (bias.hpp): rows of dL/dscores summed into fp64 histograms over
// relative positions (rows are copied by kernels/common/row_kernels.hpp). Dispatched at run time.
#pragma once

#include <cstdint>

namespace posenc::kernels {

// Rows k < rows of ds (row k at ds + k·row_stride, n entries each) summed along diagonals:
// sums[u] += Σ_k ds[k][u + k] for u in [−(rows − 1), n) (sums must be valid there), the terms of
// each u added in k order. This is the histogram over r = key − query of `rows` consecutive
// queries against n consecutive keys, with `sums` at r = k_first − q_first; it reads each sum
// once per block of rows instead of once per row.
inline constexpr std::int64_t kDiagonalRows = 8;
void accumulate_diagonals_f64(const float* ds, std::int64_t row_stride, std::int64_t rows, std::int64_t n,
                              double* sums);

}  // namespace posenc::kernels
