// Argument checks of posenc::matmul, shared by the SIMD path and the fp64 reference.
#pragma once

#include <cstdint>

#include "posenc/tensor.hpp"

namespace posenc::detail {

struct MatmulShape {
  std::int64_t m = 0, k = 0, n = 0;
  bool bias = false;
};

// Ranks, extents, one dtype (f32 or f64), a writable out disjoint from every input: throws
// posenc::Error naming the parameter.
MatmulShape check_matmul(ConstTensorView a, ConstTensorView b, ConstTensorView out, ConstTensorView bias);

}  // namespace posenc::detail
