// torch.ops.posenc.attention from C++ by named arguments. The op's schema
// (torch/attention_ops.cpp) takes twenty positional ones; a caller that fills AttentionArgs by name
// keeps compiling, with the same meaning, when the schema gains a trailing argument.
//
//   posenc::torch_adapter::AttentionArgs args;
//   args.schemes.push_back(c10::make_intrusive<posenc::torch_adapter::SchemeClass>(
//       "alibi", 8, c10::Dict<std::string, double>(), c10::nullopt));
//   args.causal = true;
//   const auto [out, lse] = posenc::torch_adapter::call_attention(q, k, v, args);
//
// The call goes through the dispatcher (autograd included), as Python's posenc.attention does.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "posenc/torch/classes.hpp"

namespace posenc::torch_adapter {

using SchemeList = c10::List<c10::intrusive_ptr<SchemeClass>>;

// The op's arguments after q, k and v, with the op's defaults (posenc/attention.hpp: their meaning).
struct AttentionArgs {
  SchemeList schemes;               // one per head group, covering the heads in order; empty: none
  std::vector<at::Tensor> params;   // each group's learned parameters; empty: the schemes' initial values
  std::vector<at::Tensor> gates;    // the groups' per-token inputs (FoX's log forget gates)
  c10::optional<at::Tensor> sinks;  // [H] attention-sink logits
  bool causal = false;
  std::int64_t window_left = -1, window_right = -1;  // -1: unlimited
  c10::optional<std::int64_t> chunk_size;
  c10::optional<c10::intrusive_ptr<TemperatureClass>> temperature;
  double softcap = 0.0;
  c10::optional<double> scale;  // none: 1/sqrt(head_dim)
  c10::optional<at::Tensor> q_positions, k_positions;
  std::vector<std::int64_t> cu_seqlens_q, cu_seqlens_k;  // packed sequences
  bool skip_vanishing_tiles = true;
  c10::optional<std::string> kv_format;  // "q8_0", "q4_0", "fp8_e4m3": k and v are a quantized cache
};

// (out, lse) of torch.ops.posenc.attention(q, k, v, ...).
inline std::tuple<at::Tensor, at::Tensor> call_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                         const AttentionArgs& a) {
  using Op = std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const SchemeList&, const std::vector<at::Tensor>&,
      const std::vector<at::Tensor>&, const c10::optional<at::Tensor>&, bool, std::int64_t, std::int64_t,
      c10::optional<std::int64_t>, const c10::optional<c10::intrusive_ptr<TemperatureClass>>&, double,
      c10::optional<double>, const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&,
      std::vector<std::int64_t>, std::vector<std::int64_t>, bool, c10::optional<std::string>);
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("posenc::attention", "").typed<Op>();
  return op.call(q, k, v, a.schemes, a.params, a.gates, a.sinks, a.causal, a.window_left, a.window_right, a.chunk_size,
                 a.temperature, a.softcap, a.scale, a.q_positions, a.k_positions, a.cu_seqlens_q, a.cu_seqlens_k,
                 a.skip_vanishing_tiles, a.kv_format);
}

}  // namespace posenc::torch_adapter
