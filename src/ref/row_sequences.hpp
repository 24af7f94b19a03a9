// The sequences of q, k, v as the references of the row-block engines (stick-breaking, CoPE) read
// them from their specs — not from the fused plans — and their elements in fp64.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "internal.hpp"
#include "row_blocks.hpp"

namespace posenc::ref {

struct Sequence {
  std::int64_t b, q0, lq, k0, lk;
};

inline std::vector<Sequence> sequences_of(const detail::QkvShape& shape, const std::vector<std::int64_t>& cu_q,
                                          const std::vector<std::int64_t>& cu_k) {
  std::vector<Sequence> out;
  if (shape.packed) {
    for (std::size_t t = 0; t + 1 < cu_q.size(); ++t)
      out.push_back({0, cu_q[t], cu_q[t + 1] - cu_q[t], cu_k[t], cu_k[t + 1] - cu_k[t]});
  } else {
    for (std::int64_t b = 0; b < shape.batch; ++b) out.push_back({b, 0, shape.q_len, 0, shape.k_len});
  }
  return out;
}

// Element (b, s, h, d) of a [B, S, H, D] (or packed) view.
inline double at(const void* base, DType dtype, const detail::HeadsGrid& g, std::int64_t b, std::int64_t s,
                 std::int64_t h, std::int64_t d) {
  return detail::load(base, dtype, g.offset(b, s) + h * g.head_stride + d * g.dim_stride);
}

// dst[b, s, h, ·] += row (width values) in dst's dtype.
inline void add_row(TensorView dst, DType dtype, const detail::HeadsGrid& g, std::int64_t b, std::int64_t s,
                    std::int64_t h, const std::vector<double>& row) {
  for (std::size_t t = 0; t < row.size(); ++t) {
    const std::int64_t o = g.offset(b, s) + h * g.head_stride + static_cast<std::int64_t>(t) * g.dim_stride;
    detail::store(dst.data(), dtype, o, detail::load(dst.data(), dtype, o) + row[t]);
  }
}

// dst[j, kvh, ·] += sums[(j·G + kvh)·width + ·] for every key j of seq (an empty view: skipped).
inline void add_keys(TensorView dst, DType dtype, const detail::HeadsGrid& g, const Sequence& seq,
                     std::int64_t kv_heads, const std::vector<double>& sums, std::int64_t width) {
  if (dst.rank() == 0) return;
  std::vector<double> row(static_cast<std::size_t>(width));
  for (std::int64_t j = 0; j < seq.lk; ++j) {
    for (std::int64_t kvh = 0; kvh < kv_heads; ++kvh) {
      const auto first = sums.begin() + (j * kv_heads + kvh) * width;
      std::copy(first, first + width, row.begin());
      add_row(dst, dtype, g, seq.b, seq.k0 + j, kvh, row);
    }
  }
}

}  // namespace posenc::ref
