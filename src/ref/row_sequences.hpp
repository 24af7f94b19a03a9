// The sequences of q, k, v as the references of the row-block engines (stick-breaking, CoPE) read
// them from their specs — not from the fused plans — and their elements in fp64.
#pragma once

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

}  // namespace posenc::ref
