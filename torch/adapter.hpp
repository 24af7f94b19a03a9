// Shared by the PyTorch adapter's files (ops.cpp, attention_ops.cpp): tensors as posenc views,
// positions, errors as Python exceptions, and the outputs' block cache.
#pragma once

#include <torch/library.h>
#include <torch/torch.h>

#include <map>
#include <mutex>
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

// Calls the op posenc::NAME below autograd with a boxed stack, returning its outputs: its CPU
// kernel, or its fake kernel while a tracer runs. An autograd kernel calls its forward and backward
// ops this way, so that torch.compile and opcheck record them.
torch::jit::Stack call_below_autograd(const char* name, torch::jit::Stack stack);

// While torch.compile or torch.library.opcheck traces, the tensors are subclasses (fake or
// functional tensors: the Python dispatch key) that hold no data; an autograd kernel then goes
// through the ops, so that the tracer records them and runs their fake kernels.
bool traced(const at::Tensor& t);
bool traced(at::TensorList ts);

// A traced call passes its typed objects (Rope, Scheme, Temperature) as their pickled bytes, a uint8
// [n] tensor: a constant of the compiled graph that its cache keeps and another process reads,
// where torchbind objects would be lost (torch 2.15's AOTAutograd refuses them as values saved for
// the backward, and its inductor cache does not restore them). The classes' __setstate__ checks
// every value again when the bytes are read.
at::Tensor pickled(const c10::IValue& value);
// The value in such bytes; bytes that are not one are the caller's bad value: a ValueError
// "WHERE: NAME are not EXPECTED (why)". bytes_of checks the tensor and copies its bytes.
std::string bytes_of(const char* where, const char* name, const at::Tensor& bytes, const char* expected);
c10::IValue unpickled(const char* where, const char* name, const std::string& bytes, const char* expected);
c10::IValue unpickled(const char* where, const char* name, const at::Tensor& bytes, const char* expected);
// The object of class T in such bytes. A compiled graph passes the same bytes at every run: the
// objects read are kept (at most 64 per class, one per distinct configuration), so a run does not
// rebuild them.
template <class T>
c10::intrusive_ptr<T> unpickled_object(const char* where, const char* name, const at::Tensor& bytes,
                                       const char* expected) {
  static std::mutex mutex;
  static std::map<std::string, c10::intrusive_ptr<T>, std::less<>> read;
  std::string key = bytes_of(where, name, bytes, expected);
  {
    const std::lock_guard<std::mutex> lock(mutex);
    if (const auto it = read.find(key); it != read.end()) return it->second;
  }
  const c10::IValue value = unpickled(where, name, key, expected);
  c10::intrusive_ptr<T> object;
  try {
    object = value.toCustomClass<T>();
  } catch (const c10::Error& e) {
    TORCH_CHECK_VALUE(false, where, ": ", name, " are not ", expected, " (", e.what_without_backtrace(), ")");
  }
  const std::lock_guard<std::mutex> lock(mutex);
  if (read.size() >= 64) read.clear();
  read.emplace(std::move(key), object);
  return object;
}

// Defines posenc::NAME from its schema "NAME(…) -> …" with its CPU kernel and, when given, its
// autograd kernel (a TORCH_FN or a torch::CppFunction).
template <class Cpu, class... Autograd>
void define_op(torch::Library& m, const std::string& schema, Cpu cpu, Autograd&&... autograd) {
  static_assert(sizeof...(Autograd) <= 1, "one autograd kernel at most");
  const std::string name = schema.substr(0, schema.find('('));
  m.def(schema.c_str());
  m.impl(name.c_str(), torch::dispatch(c10::DispatchKey::CPU, cpu));
  (m.impl(name.c_str(), torch::dispatch(c10::DispatchKey::Autograd, std::forward<Autograd>(autograd))), ...);
}

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

}  // namespace posenc::torch_adapter
