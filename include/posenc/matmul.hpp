// posenc/matmul.hpp — a matrix product whose bits depend on its inputs alone.
//
//     out[i, j] = Σ_k a[i, k] · b[k, j]  (+ bias[j])        a: [M, K], b: [K, N], out: [M, N]
//
// Order of operations (the contract, not an implementation detail): each out[i, j] is one chain
// of fused multiply-adds in k order, from zero, then the bias added with one rounding:
//
//     acc = 0;  for k = 0 … K − 1:  acc = fma(a[i, k], b[k, j], acc);   out[i, j] = acc + bias[j]
//
// The vector lanes hold different j, never parts of one sum, so on the targets with fused
// multiply-add (avx512, avx2) the result is the same to the last bit on every target, for every
// thread count, every stride and every host. (sse4 and scalar have no fused multiply-add: there
// each product is rounded before its add; still one fixed order.) A BLAS picks its kernel, and
// with it the summation order, by CPU: MKL's conditional reproducibility fixes the order on Intel
// CPUs only (its documentation: on other CPUs the AUTO branch runs instead), and OpenBLAS's
// DYNAMIC_ARCH picks per core type. This is what the study trains with, so that a seed gives the
// same numbers on every host.
//
// Error: |out − exact| <= γ_K · Σ_k |a[i, k]·b[k, j]| + |out|·2^-24 with γ_K = K·2^-24/(1 − K·2^-24)
// (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., §3.1; the fused form is no
// worse).
//
// Views: rank 2 with any non-negative strides (0 broadcasts an input); bias rank 1 of N elements
// or an empty view (none). f32 runs the SIMD kernel; f64 (all four tensors) and POSENC_TARGET=ref
// run the fp64 reference (posenc::ref::matmul: products summed in fp64 in k order; f32 data is
// rounded once, at the end). out must not overlap an input and must not name one element twice.
// Non-finite inputs propagate as the chain above does (an inf times 0 is NaN). Work is split over
// OpenMP threads by rows.
#pragma once

#include "posenc/tensor.hpp"

namespace posenc {

void matmul(ConstTensorView a, ConstTensorView b, TensorView out, ConstTensorView bias = {});

namespace ref {
void matmul(ConstTensorView a, ConstTensorView b, TensorView out, ConstTensorView bias = {});
}  // namespace ref

}  // namespace posenc
