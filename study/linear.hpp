// The study's linear layers: y = x·Wᵀ + b and both gradients through posenc::matmul, whose
// every element is one fused multiply-add chain in a fixed order (posenc/matmul.hpp). Through
// libtorch, the products go to its BLAS (MKL in PyPI's wheels), which picks its kernel, and so its
// summation order, by CPU: the same seed trained to other last bits on AMD and Intel hosts. The
// parameters stay torch::nn::Linear's (same initialisation); only the products change hands.
#pragma once

#include <torch/torch.h>

namespace posenc::study {

// x [..., in], weight [out, in] (f32), bias [out] or undefined: [..., out]; differentiable in all three.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias);
inline torch::Tensor linear(const torch::Tensor& x, const torch::nn::Linear& layer) {
  return linear(x, layer->weight, layer->bias);
}

}  // namespace posenc::study
