// posenc/reference.hpp — the scalar fp64 reference of every kernel.
//
// Plain loops, fp64 arithmetic inside whatever the tensor dtype, libm sin/cos. These are the test
// oracle for the SIMD kernels, the fallback for f64 tensors, and what runs under
// POSENC_TARGET=ref (the CLI's `--target ref`). Signatures and contracts are those of the public
// functions of the same name (absolute.hpp); inputs are validated the same way.
#pragma once

#include "posenc/absolute.hpp"

namespace posenc::ref {

void sinusoidal_table(const SinusoidalParams& params, const Positions& positions, TensorView out);
void sinusoidal_add(const SinusoidalParams& params, ConstTensorView x, const Positions& positions,
                    TensorView out);
void learned_forward(ConstTensorView table, ConstTensorView x, const Positions& positions,
                     TensorView y);
void learned_backward(ConstTensorView dy, const Positions& positions, TensorView d_table,
                      TensorView dx = {});

}  // namespace posenc::ref
