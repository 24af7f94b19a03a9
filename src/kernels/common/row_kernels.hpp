// Row kernels shared by several kernel families (absolute encodings, score biases, rotary): copies
// and sums of f32 rows with optional non-temporal stores, the fence that orders those stores, and
// which Highway target the dispatch chose. Dispatched at run time (row_kernels.cpp).
#pragma once

#include <cstdint>

namespace posenc::kernels {

// dst[t] = src[t], t < n. With `stream`, aligned vectors use non-temporal stores (call
// flush_streams() before the output is read).
void copy_row_f32(const float* src, float* dst, std::int64_t n, bool stream);
// out[j] = a[j] + b[j] for j < n. `out` may equal `a` or `b` (then without `stream`); with
// `stream`, aligned vectors of out use non-temporal stores.
void add_rows_f32(const float* a, const float* b, float* out, std::int64_t n, bool stream = false);
// Orders this thread's non-temporal stores before later loads and stores.
void flush_streams();
// The Highway target bit (HWY_AVX3, HWY_AVX2, …) the kernels currently dispatch to.
std::int64_t dispatched_target();

}  // namespace posenc::kernels
