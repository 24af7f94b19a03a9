// Validation of CoPE (cope.hpp), shared by the fused entry points (cope.cpp) and the fp64
// reference (ref/cope_ref.cpp), so that both reject exactly the same input, and the flushing
// rules both keep.
#pragma once

#include <cmath>
#include <cstdint>

#include "internal.hpp"
#include "posenc/cope.hpp"
#include "row_blocks.hpp"

namespace posenc::detail {

inline constexpr const char* kCope = "cope_attention";
// Each block keeps ⟨q, e[n]⟩ for all n: 65536 positions are 16 MiB per thread.
inline constexpr std::int64_t kCopeMaxPositions = 65536;

// A gate or a probability below FLT_MIN (an exponent below −87.3) is 0 (cope.hpp).
inline double cope_exp(double x) { return x < -87.3 ? 0.0 : std::exp(x); }
inline double cope_sigmoid(double z) { return z >= 0 ? 1.0 / (1.0 + std::exp(-z)) : cope_exp(z) / (1.0 + std::exp(z)); }

// The table [npos, D]: element (n, d) at n·row + d·col, in q's dtype or f32.
struct TableGrid {
  std::int64_t row = 0, col = 0;
  DType dtype = DType::kF32;
  std::int64_t offset(std::int64_t n, std::int64_t d) const { return n * row + d * col; }
};

struct CopeShape : QkvShape {
  std::int64_t npos = 0;
  TableGrid table;
};
CopeShape check_cope(const CopeSpec& spec);

HeadsGrid check_cope_forward_outputs(const CopeSpec& spec, const CopeShape& shape, ConstTensorView out,
                                     ConstTensorView lse);
struct CopeBackwardGrids : QkvBackwardGrids {
  RowStatGrid lse;
  TableGrid d_table;
};
// out, lse (both required), d_out like out in q's dtype; dq, dk, dv, d_table (each optional)
// like q, k, v, table and disjoint from everything else.
CopeBackwardGrids check_cope_backward(const CopeSpec& spec, const CopeShape& shape, ConstTensorView out,
                                      ConstTensorView lse, ConstTensorView d_out, ConstTensorView dq,
                                      ConstTensorView dk, ConstTensorView dv, ConstTensorView d_table);

}  // namespace posenc::detail
