// Shared by the PyTorch adapter's files (ops.cpp, attention_ops.cpp): tensors as posenc views,
// positions, errors as Python exceptions, and the outputs' block cache.
#pragma once

#include <torch/library.h>
#include <torch/torch.h>

#include <string>
#include <tuple>
#include <vector>

#include "posenc/posenc.hpp"

namespace posenc::torch_adapter {

void check_cpu(const char* where, const char* name, const at::Tensor& t);
ConstTensorView const_view(const char* where, const char* name, const at::Tensor& t);
TensorView mutable_view(const char* where, const char* name, at::Tensor& t);
// int64 [S] or [B, S], contiguous; the tensor must outlive the Positions.
Positions positions_of(const char* where, const char* name, const at::Tensor& ids);
// An optional tensor argument left out: undefined or a 1-D empty tensor.
bool absent(const at::Tensor& t);
// An output tensor from the block cache (see ops.cpp).
at::Tensor empty_output(at::IntArrayRef sizes, c10::ScalarType dtype);
// A bias scheme materialised as [B, H, Sq, Sk] of dtype.
at::Tensor materialize(const BiasScheme& scheme, const at::Tensor& q_ids, const at::Tensor& k_ids,
                       c10::ScalarType dtype);
std::vector<double> doubles_of(const char* where, const char* name, const at::Tensor& t);
at::Tensor tensor_of(const std::vector<double>& values, const at::Tensor& like);

// The outputs of an attention with a kernel of its own (stick-breaking, CoPE): out like q with v's
// head size — in f32 for 16-bit inputs, since backward reads it without their rounding — and a
// float32 value per row, [B, Sq, H] or [Tq, H] (rem, lse).
bool is_16_bit(const at::Tensor& t);
struct RowOutputs {
  at::Tensor out, row;
};
RowOutputs row_outputs(const at::Tensor& q, const at::Tensor& v);
// What the forward op returns: out in q's dtype, the row values, and the f32 out of 16-bit inputs
// (an empty float32 tensor for f32 and f64, whose out is exact as it is).
std::tuple<at::Tensor, at::Tensor, at::Tensor> returned(const at::Tensor& q, const RowOutputs& o);

// Calls the op posenc::NAME below autograd with a boxed stack, returning its outputs: its CPU
// kernel, or its fake kernel while a tracer runs. An autograd kernel calls its forward and backward
// ops this way, so that torch.compile and opcheck record them.
torch::jit::Stack call_below_autograd(const char* name, torch::jit::Stack stack);

// posenc::Error → ValueError (the Python exception for bad values and shapes).
template <class Fn>
auto translating(Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const Error& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
}

// The fused attention's ops and the registry's (attention_ops.cpp).
void define_attention_ops(torch::Library& m);
// Stick-breaking attention's op (stickbreaking_ops.cpp).
void define_stickbreaking_ops(torch::Library& m);
// CoPE's op (cope_ops.cpp).
void define_cope_ops(torch::Library& m);

}  // namespace posenc::torch_adapter
