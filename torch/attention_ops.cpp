// The PyTorch ops of the fused attention and of the scheme registry (list in ops.cpp's header).
#include <torch/library.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/torch.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "adapter.hpp"
#include "posenc/torch/classes.hpp"
#include "posenc/posenc.hpp"

namespace posenc::torch_adapter {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// ─── Fused attention ─────────────────────────────────────────────────────────────────────────

using SchemeList = c10::List<c10::intrusive_ptr<SchemeClass>>;
using OptionalTemperature = c10::optional<c10::intrusive_ptr<TemperatureClass>>;

// A Scheme's head group with its learned parameters: `params` in the registry's parameter_shape
// (a 1-D empty tensor for a scheme without any), or undefined for the scheme's initial values, as
// is an empty tensor for a scheme whose parameters its definition fixes (parameters_fixed: ALiBi's
// slopes, which a name alone gives).
HeadGroup attention_group(const char* where, const std::string& name, const SchemeClass& scheme,
                          const at::Tensor& params, std::int64_t head_dim, double scale,
                          std::map<std::string, ConstTensorView, std::less<>> inputs = {}) {
  SchemeArgs args = scheme.given_args(head_dim, scale);
  args.inputs = std::move(inputs);
  const bool fixed = scheme.entry->parameters_fixed && params.defined() && params.dim() == 1 && params.numel() == 0;
  if (params.defined() && !fixed) {
    const std::vector<std::int64_t> shape = scheme.entry->parameter_shape(scheme.args(head_dim, scale));
    // A scheme without parameters takes a 1-D empty tensor (a 0-d tensor is one value, not none).
    const bool fits =
        shape.empty() ? params.dim() == 1 && params.numel() == 0 : params.sizes() == at::IntArrayRef(shape);
    TORCH_CHECK_VALUE(
        fits, where, ": ", name, " shape ", params.sizes(), "; expected ",
        shape.empty() ? std::string("[0]") : c10::str(at::IntArrayRef(shape)), " (", scheme.entry->name, ": ",
        scheme.entry->parameters.empty() ? std::string("no learned parameters") : scheme.entry->parameters, ")");
    args.parameters = doubles_of(where, name.c_str(), params);
  }
  return make_head_group(scheme.entry->name, std::move(args));
}

// Any registered score-bias scheme (registry.hpp: the relative-bias and bias families)
// materialised as [B, H, Sq, Sk], differentiable in its parameters (params: the registry's
// parameter_shape for head_dim, which only some shapes read (TUPE's U^Q, U^K); None: its initial
// values). The scheme is the object (score_bias) or its pickled bytes (score_bias_pickled, which a
// traced call records; its `heads` is the scheme's, given for the fake kernel, which cannot read
// the bytes).
c10::intrusive_ptr<SchemeClass> scheme_object(const char* where, const c10::IValue& scheme) {
  if (scheme.isTensor()) {
    return unpickled_object<SchemeClass>(where, "scheme", scheme.toTensor(), "a pickled torch.classes.posenc.Scheme");
  }
  return scheme.toCustomClass<SchemeClass>();
}
BiasScheme bias_scheme_of(const char* where, const SchemeClass& scheme, const at::Tensor& params,
                          std::int64_t head_dim) {
  const std::string& family = scheme.entry->family;
  TORCH_CHECK_VALUE(family == "relative-bias" || family == "bias", where, ": scheme = ", scheme.entry->name,
                    " (family ", family, "); expected a scheme of the relative-bias or bias family (posenc.schemes())");
  TORCH_CHECK_VALUE(head_dim >= 1, where, ": head_dim = ", head_dim, "; expected >= 1");
  const HeadGroup g = attention_group(where, "params", scheme, params, head_dim, 0.0);
  TORCH_CHECK_VALUE(g.bias.has_value(), where, ": scheme = ", scheme.entry->name, " builds no bias");
  return *g.bias;
}
at::Tensor score_bias_cpu(const c10::intrusive_ptr<SchemeClass>& scheme, const c10::optional<at::Tensor>& params,
                          const at::Tensor& q_positions, const at::Tensor& k_positions, c10::ScalarType dtype,
                          std::int64_t head_dim) {
  const at::Tensor p = params ? *params : at::Tensor();
  return translating([&] {
    return materialize(bias_scheme_of("score_bias", *scheme, p, head_dim), q_positions.contiguous(),
                       k_positions.contiguous(), dtype);
  });
}
at::Tensor score_bias_pickled_cpu(const at::Tensor& scheme, const c10::optional<at::Tensor>& params,
                                  const at::Tensor& q_positions, const at::Tensor& k_positions, c10::ScalarType dtype,
                                  std::int64_t heads, std::int64_t head_dim) {
  const auto object = scheme_object("score_bias_pickled", scheme);
  TORCH_CHECK_VALUE(heads == object->heads, "score_bias_pickled: heads = ", heads, "; expected the scheme's (",
                    object->heads, ")");
  return score_bias_cpu(object, params, q_positions, k_positions, dtype, head_dim);
}
// The gradient of params (given, non-empty) for grad [B, H, Sq, Sk], in params' shape.
at::Tensor score_bias_gradient(const char* where, const SchemeClass& scheme, const at::Tensor& grad,
                               const at::Tensor& params, const at::Tensor& q_positions, const at::Tensor& k_positions,
                               std::int64_t head_dim) {
  return translating([&] {
    const BiasScheme b = bias_scheme_of(where, scheme, params, head_dim);
    std::vector<double> d(static_cast<std::size_t>(bias_parameter_count(b)), 0.0);
    const at::Tensor ds = grad.contiguous(), qi = q_positions.contiguous(), ki = k_positions.contiguous();
    bias_backward(b, positions_of(where, "q_positions", qi), positions_of(where, "k_positions", ki),
                  const_view(where, "grad", ds), d);
    return tensor_of(d, params);
  });
}
at::Tensor score_bias_backward_cpu(const at::Tensor& grad, const at::Tensor& scheme, const at::Tensor& params,
                                   const at::Tensor& q_positions, const at::Tensor& k_positions,
                                   std::int64_t head_dim) {
  const char* where = "score_bias_backward";
  return score_bias_gradient(where, *scheme_object(where, scheme), grad, params, q_positions, k_positions, head_dim);
}

class ScoreBiasFunction : public torch::autograd::Function<ScoreBiasFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, c10::IValue scheme, const c10::optional<at::Tensor>& params,
                            const at::Tensor& q_positions, const at::Tensor& k_positions, c10::ScalarType dtype,
                            std::int64_t heads, std::int64_t head_dim) {
    const at::Tensor p = params ? *params : at::Tensor();
    if (!scheme.isTensor() && traced({p, q_positions, k_positions})) scheme = pickled(scheme);
    ctx->saved_data["scheme"] = scheme;
    ctx->saved_data["head_dim"] = head_dim;
    // A gradient for given parameters (a scheme without any takes an empty tensor); sizes may be symbolic.
    ctx->saved_data["given"] = p.defined() && p.sym_numel().sym_ne(0).guard_bool(__FILE__, __LINE__);
    ctx->save_for_backward({p.defined() ? p : at::empty({0}), q_positions.contiguous(), k_positions.contiguous()});
    if (scheme.isTensor()) {
      return call_below_autograd("posenc::score_bias_pickled",
                                 {scheme, params, q_positions, k_positions, dtype, heads, head_dim})[0]
          .toTensor();
    }
    return call_below_autograd("posenc::score_bias", {scheme, params, q_positions, k_positions, dtype, head_dim})[0]
        .toTensor();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    at::Tensor d_params;
    if (ctx->saved_data["given"].toBool() && grads[0].defined()) {
      const c10::IValue scheme = ctx->saved_data["scheme"];
      const std::int64_t head_dim = ctx->saved_data["head_dim"].toInt();
      // Traced (bytes): through the op, which the tracer records; eager (the object): directly.
      d_params = scheme.isTensor() ? call_below_autograd("posenc::score_bias_backward",
                                                         {grads[0], scheme, saved[0], saved[1], saved[2], head_dim})[0]
                                         .toTensor()
                                   : score_bias_gradient("score_bias", *scheme.toCustomClass<SchemeClass>(), grads[0],
                                                         saved[0], saved[1], saved[2], head_dim);
    }
    return variable_list{at::Tensor(), d_params, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor score_bias_autograd(const c10::intrusive_ptr<SchemeClass>& scheme, const c10::optional<at::Tensor>& params,
                               const at::Tensor& q_positions, const at::Tensor& k_positions, c10::ScalarType dtype,
                               std::int64_t head_dim) {
  return ScoreBiasFunction::apply(c10::IValue(scheme), params, q_positions, k_positions, dtype, scheme->heads,
                                  head_dim);
}
at::Tensor score_bias_pickled_autograd(const at::Tensor& scheme, const c10::optional<at::Tensor>& params,
                                       const at::Tensor& q_positions, const at::Tensor& k_positions,
                                       c10::ScalarType dtype, std::int64_t heads, std::int64_t head_dim) {
  return ScoreBiasFunction::apply(c10::IValue(scheme), params, q_positions, k_positions, dtype, heads, head_dim);
}

// A registered transform scheme (family "transform": RoPE, Shortformer's sinusoid, …) applied to
// rows x [P, D] at positions [P] by its fp64 definition (posenc::ref::qk_transform_rows): queries,
// or keys with `keys`; seq_len as the attention's default (the call's largest position + 1).
// float64 in and out, no gradient: what posenc.flex reads a transform's tables from.
at::Tensor qk_transform_cpu(const c10::intrusive_ptr<SchemeClass>& scheme, const at::Tensor& x,
                            const at::Tensor& positions, bool keys, std::int64_t seq_len) {
  const char* where = "qk_transform";
  const std::string& family = scheme->entry->family;
  TORCH_CHECK_VALUE(family == "transform", where, ": scheme = ", scheme->entry->name, " (family ", family,
                    "); expected a scheme of the transform family (posenc.schemes())");
  TORCH_CHECK_TYPE(x.scalar_type() == at::kDouble, where, ": x dtype ", x.scalar_type(), "; expected Double");
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(1) >= 1, where, ": x shape ", x.sizes(), "; expected [positions, head_dim]");
  TORCH_CHECK_TYPE(positions.scalar_type() == at::kLong, where, ": positions dtype ", positions.scalar_type(),
                   "; expected Long");
  TORCH_CHECK_VALUE(positions.dim() == 1 && positions.size(0) == x.size(0), where, ": positions shape ",
                    positions.sizes(), "; expected [", x.size(0), "], a position per row of x");
  return translating([&] {
    const HeadGroup g = attention_group(where, "params", *scheme, at::Tensor(), x.size(1), 0.0);
    const at::Tensor xc = x.contiguous(), pc = positions.contiguous();
    std::vector<double> rows(xc.data_ptr<double>(), xc.data_ptr<double>() + xc.numel());
    ref::qk_transform_rows(g.transform, !keys, {pc.data_ptr<std::int64_t>(), static_cast<std::size_t>(pc.numel())},
                           seq_len, x.size(1), rows);
    return at::tensor(rows, x.options()).reshape(x.sizes());
  });
}

// The registry as JSON (posenc/registry.hpp: schemes_json).
std::string schemes_op() { return schemes_json(); }

struct AttentionCall {
  std::unique_ptr<Attention> attention;
  at::Tensor q_ids, k_ids;                  // kept alive: Positions borrow them
  std::vector<at::Tensor> gates;            // per head group: its gate or input (viewed: kept alive), or undefined
  std::vector<std::size_t> gate_terms;      // per head group: the index of its gate's term in HeadGroup::terms
  std::vector<const SchemeEntry*> entries;  // per head group: its registered scheme
};

// Sinks (posenc/sinks.hpp): one logit per query head, split over the head groups.
void add_sinks(const char* where, const at::Tensor& sinks, AttentionSpec& spec) {
  const std::int64_t heads = spec.q.size(spec.q.rank() - 2);
  TORCH_CHECK_VALUE(sinks.dim() == 1 && sinks.size(0) == heads, where, ": sinks shape ", sinks.sizes(), "; expected [",
                    heads, "] (one logit per query head)");
  const std::vector<double> logits = doubles_of(where, "sinks", sinks);
  std::size_t first = 0;
  for (HeadGroup& g : spec.groups) {
    const auto n = static_cast<std::size_t>(g.heads);
    g.terms.push_back(std::make_shared<AttentionSinks>(std::vector<double>(
        logits.begin() + static_cast<std::ptrdiff_t>(first), logits.begin() + static_cast<std::ptrdiff_t>(first + n))));
    first += n;
  }
}

// `gates`: empty, or one tensor per head group. A group whose registered scheme reads a per-token
// input (SchemeEntry::inputs: Forgetting's log_fgate) takes it from there (input_of); another
// group's non-empty tensor is a forget gate (posenc/forgetting.hpp) added to its scheme, as FoX
// Pro adds one to RoPE (add_gates).
void check_gates(const char* where, const std::vector<at::Tensor>& gates, std::size_t groups) {
  TORCH_CHECK_VALUE(gates.empty() || gates.size() == groups, where, ": ", gates.size(),
                    " gates; expected one per head group (", groups, "), or none");
}
std::map<std::string, ConstTensorView, std::less<>> input_of(const char* where, const SchemeEntry& entry,
                                                             const std::vector<at::Tensor>& gates, std::size_t g,
                                                             AttentionCall& call) {
  if (entry.inputs.empty()) return {};
  // The op carries one per-token tensor per group.
  TORCH_CHECK_VALUE(entry.inputs.size() == 1, where, ": scheme ", entry.name, " reads ", entry.inputs.size(),
                    " per-token inputs; expected at most one per group");
  const std::string name = "gates[" + std::to_string(g) + "]";
  // A defined tensor with no elements (a batch of none) is the input, not a missing one.
  TORCH_CHECK_VALUE(g < gates.size() && !absent(gates[g]), where, ": ", name, " is absent; expected scheme ",
                    entry.name, "'s ", entry.inputs[0].name, ", ", entry.inputs[0].description);
  call.gates.resize(std::max(call.gates.size(), g + 1));
  call.gates[g] = gates[g].detach();
  return {{entry.inputs[0].name, const_view(where, entry.inputs[0].name.c_str(), call.gates[g])}};
}
void add_gates(const char* where, const std::vector<at::Tensor>& gates, AttentionSpec& spec, AttentionCall& call) {
  call.gates.resize(spec.groups.size());
  call.gate_terms.assign(spec.groups.size(), 0);
  if (gates.empty()) return;
  for (std::size_t g = 0; g < gates.size(); ++g) {
    if (absent(gates[g]) || gates[g].numel() == 0 || !call.entries[g]->inputs.empty()) continue;
    call.gates[g] = gates[g].detach();
    // After the scheme's own terms (the sinks entry's logits come first).
    call.gate_terms[g] = spec.groups[g].terms.size();
    spec.groups[g].terms.push_back(std::make_shared<ForgetGate>(const_view(where, "log_fgate", call.gates[g])));
  }
}

// The attention op's arguments besides q, k, v (their schema is in define_attention_ops).
struct AttentionArgs {
  SchemeList schemes;
  std::vector<at::Tensor> params, gates;
  c10::optional<at::Tensor> sinks;
  bool causal = false;
  std::int64_t window_left = -1, window_right = -1;
  c10::optional<std::int64_t> chunk_size;
  OptionalTemperature temperature;
  double softcap = 0.0;
  c10::optional<double> scale;
  c10::optional<at::Tensor> q_positions, k_positions;
  std::vector<std::int64_t> cu_seqlens_q, cu_seqlens_k;
  bool skip_vanishing_tiles = true;
  c10::optional<std::string> kv_format;  // k and v: uint8 rows of a quantized cache (quantized.hpp)

  // These arguments with a call's tensor lists and sinks.
  AttentionArgs with(std::vector<at::Tensor> p, std::vector<at::Tensor> g, c10::optional<at::Tensor> s) const {
    AttentionArgs a = *this;
    a.params = std::move(p);
    a.gates = std::move(g);
    a.sinks = std::move(s);
    return a;
  }
};

// The arguments the forward and backward ops share, as make_attention takes them.
AttentionArgs call_args(const SchemeList& schemes, bool causal, std::int64_t window_left, std::int64_t window_right,
                        c10::optional<std::int64_t> chunk_size, const OptionalTemperature& temperature, double softcap,
                        c10::optional<double> scale, const c10::optional<at::Tensor>& q_positions,
                        const c10::optional<at::Tensor>& k_positions, std::vector<std::int64_t> cu_seqlens_q,
                        std::vector<std::int64_t> cu_seqlens_k, bool skip_vanishing_tiles) {
  AttentionArgs a;
  a.schemes = schemes;
  a.causal = causal;
  a.window_left = window_left;
  a.window_right = window_right;
  a.chunk_size = chunk_size;
  a.temperature = temperature;
  a.softcap = softcap;
  a.scale = scale;
  a.q_positions = q_positions;
  a.k_positions = k_positions;
  a.cu_seqlens_q = std::move(cu_seqlens_q);
  a.cu_seqlens_k = std::move(cu_seqlens_k);
  a.skip_vanishing_tiles = skip_vanishing_tiles;
  return a;
}

// k and v as a quantized cache: uint8 [B, S, G, row bytes] with unit stride in the row (the
// engine checks the rest by name).
QuantizedCache quantized_cache(const char* where, const std::string& format, const at::Tensor& k, const at::Tensor& v) {
  const std::optional<CacheFormat> f = parse_cache_format(format);
  TORCH_CHECK_VALUE(f.has_value(), where, ": kv_format = '", format, "'; expected 'q8_0', 'q4_0' or 'fp8_e4m3'");
  const auto rows = [&](const char* name, const at::Tensor& t) {
    TORCH_CHECK_TYPE(t.scalar_type() == at::kByte, where, ": ", name, " is ", t.scalar_type(), " with kv_format = '",
                     format, "'; expected torch.uint8 rows of the format's bytes");
    TORCH_CHECK_VALUE(t.dim() == 4 && t.stride(3) == 1, where, ": ", name, " shape ", t.sizes(), " strides ",
                      t.strides(), "; expected [B, S, G, row bytes] with the row's bytes contiguous");
    TORCH_CHECK_VALUE(t.device().is_cpu(), where, ": ", name, " is on ", t.device(), "; expected the CPU");
    return QuantizedRows{t.data_ptr(), t.size(0),   t.size(1),  t.size(2), cache_row_dim(*f, t.size(3)),
                         t.stride(0),  t.stride(1), t.stride(2)};
  };
  return QuantizedCache{*f, rows("k", k), rows("v", v)};
}

AttentionCall make_attention(const char* where, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const AttentionArgs& a) {
  // Packed sequences (cu_seqlens, both or neither): q [Tq, H, D], k and v [Tk, G, D].
  const bool packed = !a.cu_seqlens_q.empty() || !a.cu_seqlens_k.empty();
  TORCH_CHECK_VALUE(q.dim() == (packed ? 3 : 4), where, ": q shape ", q.sizes(), "; expected ",
                    packed ? "[Tq, H, D] with cu_seqlens" : "[B, Sq, H, D]");
  TORCH_CHECK_VALUE(!a.scale || (std::isfinite(*a.scale) && *a.scale > 0), where, ": scale = ", *a.scale,
                    "; expected a finite number > 0, or None for 1/sqrt(head_dim)");
  const double scale = a.scale ? *a.scale : 0.0;  // the engine's default: 1/sqrt(head_dim)
  TORCH_CHECK_VALUE(!a.schemes.empty(), where, ": schemes is empty; expected one Scheme per head group");
  TORCH_CHECK_VALUE(a.params.empty() || a.params.size() == a.schemes.size(), where, ": ", a.params.size(),
                    " parameter tensors; expected one per head group (", a.schemes.size(),
                    "), or none for the schemes' initial values");
  AttentionCall call;
  AttentionSpec spec;
  spec.cu_seqlens_q = a.cu_seqlens_q;
  spec.cu_seqlens_k = a.cu_seqlens_k;
  spec.q = const_view(where, "q", q);
  if (a.kv_format) {
    spec.cache = quantized_cache(where, *a.kv_format, k, v);
  } else {
    spec.k = const_view(where, "k", k);
    spec.v = const_view(where, "v", v);
  }
  std::int64_t heads = 0;
  check_gates(where, a.gates, a.schemes.size());
  for (std::size_t g = 0; g < a.schemes.size(); ++g) {
    const c10::intrusive_ptr<SchemeClass> scheme = a.schemes.get(g);
    const std::string name = "params[" + std::to_string(g) + "]";
    spec.groups.push_back(attention_group(where, name, *scheme, a.params.empty() ? at::Tensor() : a.params[g],
                                          q.size(-1), scale, input_of(where, *scheme->entry, a.gates, g, call)));
    call.entries.push_back(scheme->entry);
    heads += scheme->heads;
  }
  TORCH_CHECK_VALUE(heads == q.size(-2), where, ": the schemes' heads sum to ", heads, "; expected q's ", q.size(-2));
  spec.skip_vanishing_tiles = a.skip_vanishing_tiles;
  add_gates(where, a.gates, spec, call);
  if (a.sinks) add_sinks(where, *a.sinks, spec);
  spec.mask.causal = a.causal;
  spec.mask.window_left = a.window_left;
  spec.mask.window_right = a.window_right;
  if (a.chunk_size) spec.mask.chunk_size = *a.chunk_size;
  if (a.temperature) spec.temperature = (*a.temperature)->temperature;
  spec.mask.softcap = a.softcap;
  spec.scale = scale;
  if (a.q_positions) {
    // A copy: Positions borrow it, and the caller may change its tensor before the backward.
    call.q_ids = a.q_positions->clone(at::MemoryFormat::Contiguous);
    spec.q_positions = positions_of(where, "q_positions", call.q_ids);
  }
  if (a.k_positions) {
    call.k_ids = a.k_positions->clone(at::MemoryFormat::Contiguous);
    spec.k_positions = positions_of(where, "k_positions", call.k_ids);
  }
  call.attention = std::make_unique<Attention>(spec);
  return call;
}

// The plan of a forward call, kept in the autograd context for its backward: building it again
// would redo its tables, among them XL's r·W_Rᵀ (2·Δ·d_model·H·D flops: half of the forward
// attention's own at S = 2048, H·D = d_model = 1024) and TUPE's projections. Its views point into
// q, k, v and the gates, which the context saves (autograd refuses a backward after they change in
// place).
struct AttentionPlanHolder : torch::CustomClassHolder {
  AttentionCall call;
};

// Each group's learned parameters' gradient, in the shape of its params tensor (float64 when the
// params were not given).
std::vector<at::Tensor> parameter_gradients(const AttentionCall& call, const AttentionGradients& grads,
                                            const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> out;
  for (std::size_t g = 0; g < call.entries.size(); ++g) {
    const std::vector<double> d = scheme_gradients(*call.entries[g], grads.groups[g]);
    // An empty tensor stood for fixed parameters (attention_group): nothing of them is learned.
    const bool fixed = !params.empty() && params[g].numel() == 0 && call.entries[g]->parameters_fixed;
    out.push_back(params.empty() ? at::tensor(d, at::kDouble)
                  : fixed        ? params[g].new_empty({0})
                                 : tensor_of(d, params[g]));
  }
  return out;
}

// The forward of a planned call: out like q (v's head size: MLA's values may be narrower) and the
// log-sum-exp, float32 [B, H, Sq] (or [H, Tq] for packed sequences); both contiguous, as the fake
// kernel in python/posenc/_fake.py says.
std::tuple<at::Tensor, at::Tensor> attention_forward(const AttentionCall& call, const at::Tensor& q,
                                                     const at::Tensor& v) {
  std::vector<std::int64_t> out_shape(q.sizes().begin(), q.sizes().end());
  out_shape.back() = call.attention->value_dim();
  (void)v;
  at::Tensor out = empty_output(out_shape, q.scalar_type());
  at::Tensor lse = q.dim() == 3 ? at::empty({q.size(1), q.size(0)}, q.options().dtype(at::kFloat))
                                : at::empty({q.size(0), q.size(2), q.size(1)}, q.options().dtype(at::kFloat));
  call.attention->forward(mutable_view("attention", "out", out), mutable_view("attention", "lse", lse));
  return {out, lse};
}

// Which of a call's inputs want a gradient (the autograd context's, or attention_grad's flags).
struct WantedGradients {
  std::vector<bool> params, gates;
  bool sinks = false;
  bool any() const {
    return sinks || std::find(params.begin(), params.end(), true) != params.end() ||
           std::find(gates.begin(), gates.end(), true) != gates.end();
  }
};

// The backward of a planned call: dq, dk, dv (zeros_like the inputs, then accumulated), and for
// each wanted parameter tensor, gate and the sinks a gradient in its shape (undefined otherwise).
struct AttentionGrads {
  at::Tensor dq, dk, dv;
  std::vector<at::Tensor> d_params, d_gates;
  at::Tensor d_sinks;
};
AttentionGrads attention_gradients(const AttentionCall& call, const at::Tensor& q, const at::Tensor& k,
                                   const at::Tensor& v, const std::vector<at::Tensor>& params,
                                   const c10::optional<at::Tensor>& sinks, const at::Tensor& out, const at::Tensor& lse,
                                   const at::Tensor& grad_out, const WantedGradients& wanted,
                                   const at::Tensor& grad_lse = {}) {
  AttentionGrads r;
  const at::Tensor d_out = grad_out.defined() ? grad_out.contiguous() : at::zeros_like(out);
  r.dq = at::zeros_like(q);
  r.dk = at::zeros_like(k);
  r.dv = at::zeros_like(v);
  AttentionGradients param_grads = call.attention->zero_gradients();
  const bool trainable = wanted.any();
  const at::Tensor d_lse = grad_lse.defined() ? grad_lse.contiguous() : at::Tensor();
  call.attention->backward(const_view("attention", "out", out), const_view("attention", "lse", lse),
                           const_view("attention", "d_out", d_out), mutable_view("attention", "dq", r.dq),
                           mutable_view("attention", "dk", r.dk), mutable_view("attention", "dv", r.dv),
                           trainable ? &param_grads : nullptr,
                           d_lse.defined() ? const_view("attention", "d_lse", d_lse) : ConstTensorView{});
  const std::vector<at::Tensor> d_params =
      trainable ? parameter_gradients(call, param_grads, params) : std::vector<at::Tensor>{};
  for (std::size_t g = 0; g < wanted.params.size(); ++g)
    r.d_params.push_back(wanted.params[g] ? d_params[g] : at::Tensor());
  // One gradient per gate, in the gate's shape: a scheme's input's as its entry gives it, an added
  // gate's from its own term (after the scheme's terms, before the sinks argument's).
  for (std::size_t g = 0; g < wanted.gates.size(); ++g) {
    at::Tensor d_gate;
    if (wanted.gates[g] && g < call.gates.size() && call.gates[g].defined()) {
      const SchemeEntry& entry = *call.entries[g];
      d_gate = tensor_of(entry.inputs.empty() ? param_grads.groups[g].terms[call.gate_terms[g]]
                                              : scheme_input_gradients(entry, param_grads.groups[g])[0],
                         call.gates[g]);
    }
    r.d_gates.push_back(d_gate);
  }
  // The sinks: each group's last term, concatenated over the groups.
  if (wanted.sinks && sinks) {
    std::vector<double> flat;
    for (const GroupGradients& g : param_grads.groups)
      flat.insert(flat.end(), g.terms.back().begin(), g.terms.back().end());
    r.d_sinks = tensor_of(flat, *sinks);
  }
  return r;
}

// An eager call computes directly and keeps its plan for the backward, which saves building XL's
// and TUPE's tables a second time; a traced one goes through attention_planned and attention_grad.
at::Tensor objects_tensor(const SchemeList& schemes, const OptionalTemperature& temperature) {
  return pickled(
      c10::ivalue::Tuple::create({c10::IValue(schemes), temperature ? c10::IValue(*temperature) : c10::IValue()}));
}
std::pair<SchemeList, OptionalTemperature> objects_of(const char* where, const at::Tensor& objects) {
  const char* expected = "the pickled (schemes, temperature) of an attention call";
  const c10::IValue value = unpickled(where, "objects", objects, expected);
  std::pair<SchemeList, OptionalTemperature> result;
  try {
    TORCH_CHECK(value.isTuple() && value.toTupleRef().elements().size() == 2, "not a pair");
    const auto& items = value.toTupleRef().elements();
    result.first = items[0].to<SchemeList>();
    if (!items[1].isNone()) result.second = items[1].toCustomClass<TemperatureClass>();
  } catch (const c10::Error& e) {
    TORCH_CHECK_VALUE(false, where, ": objects are not ", expected, " (", e.what_without_backtrace(), ")");
  }
  return result;
}

// attention_planned's arguments as a boxed stack, in its schema's order.
torch::jit::Stack planned_stack(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const AttentionArgs& a) {
  return torch::jit::Stack{q,
                           k,
                           v,
                           objects_tensor(a.schemes, a.temperature),
                           a.params,
                           a.gates,
                           a.sinks,
                           a.causal,
                           a.window_left,
                           a.window_right,
                           a.chunk_size,
                           a.softcap,
                           a.scale,
                           a.q_positions,
                           a.k_positions,
                           a.cu_seqlens_q,
                           a.cu_seqlens_k,
                           a.skip_vanishing_tiles};
}

// attention_grad's outputs: an empty tensor stands for a gradient not asked for (an op returns
// tensors, not None); a wanted one is in its input's shape (zeros where the input has no term).
AttentionGrads grads_of_op(const torch::jit::Stack& result, const WantedGradients& wanted) {
  AttentionGrads r{result[0].toTensor(), result[1].toTensor(), result[2].toTensor(), {}, {}, {}};
  const std::vector<at::Tensor> d_params = result[3].toTensorVector(), d_gates = result[4].toTensorVector();
  for (std::size_t g = 0; g < wanted.params.size(); ++g)
    r.d_params.push_back(wanted.params[g] ? d_params[g] : at::Tensor());
  for (std::size_t g = 0; g < wanted.gates.size(); ++g)
    r.d_gates.push_back(wanted.gates[g] ? d_gates[g] : at::Tensor());
  r.d_sinks = wanted.sinks ? result[5].toTensor() : at::Tensor();
  return r;
}

c10::List<bool> bool_list(const std::vector<bool>& flags) {
  c10::List<bool> out;
  for (const bool f : flags) out.push_back(f);
  return out;
}

// The arguments of attention_planned's calls, by the id that each call's plan tensor (int64 [1])
// holds: an entry lives as long as its tensor. A traced forward returns the tensor, and the traced
// backward (attention_grad) finds the call's schemes, mask and positions by it: the typed objects
// need not be saved between the compiled graphs (torch.compile's autograd does not save them).
class PlanTable {
 public:
  static PlanTable& instance() {
    static auto* table = new PlanTable();  // never destroyed: plan tensors may outlive static destruction
    return *table;
  }
  at::Tensor add(AttentionArgs args) {
    std::int64_t id = 0;
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      id = next_++;
      entries_.emplace(id, std::move(args));
    }
    return at::from_blob(
        new std::int64_t(id), {1},
        [](void* p) {
          auto* box = static_cast<std::int64_t*>(p);
          PlanTable::instance().erase(*box);
          delete box;
        },
        at::TensorOptions().dtype(at::kLong));
  }
  AttentionArgs find(const char* where, const at::Tensor& plan) {
    TORCH_CHECK_VALUE(plan.device().is_cpu() && plan.scalar_type() == at::kLong && plan.numel() == 1, where,
                      ": plan shape ", plan.sizes(), " (", plan.scalar_type(), ", ", plan.device().str(),
                      "); expected the int64 [1] plan tensor of an attention_planned call");
    const std::int64_t id = plan.item<std::int64_t>();
    const std::lock_guard<std::mutex> lock(mutex_);
    const auto it = entries_.find(id);
    TORCH_CHECK_VALUE(it != entries_.end(), where, ": plan = ", id,
                      "; expected the plan tensor of an attention_planned call that is still alive");
    return it->second;
  }
  void erase(std::int64_t id) {
    const std::lock_guard<std::mutex> lock(mutex_);
    entries_.erase(id);
  }

 private:
  std::mutex mutex_;
  std::int64_t next_ = 1;
  std::map<std::int64_t, AttentionArgs> entries_;
};

// Whether the call's lse is a statistic with a gradient: a single group whose registered scheme
// says so (SchemeEntry::statistic_has_gradient).
bool statistic_has_gradient(const AttentionArgs& a) {
  return a.schemes.size() == 1 && a.schemes.get(0)->entry->statistic_has_gradient;
}

class AttentionFunction : public torch::autograd::Function<AttentionFunction> {
 public:
  // The tensor lists go through apply() as TensorLists so that autograd gives each of their
  // tensors a gradient; the rest rides in AttentionArgs.
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               at::TensorList params, at::TensorList gates, const c10::optional<at::Tensor>& sinks,
                               const std::shared_ptr<AttentionArgs>& args) {
    return translating([&] {
      const AttentionArgs a = args->with(params.vec(), gates.vec(), sinks);
      at::Tensor out, lse, plan;
      if (traced(q) || traced(k) || traced(v) || traced(params) || traced(gates) || (sinks && traced(*sinks))) {
        const torch::jit::Stack result = call_below_autograd("posenc::attention_planned", planned_stack(q, k, v, a));
        out = result[0].toTensor();
        lse = result[1].toTensor();
        plan = result[2].toTensor();
      } else {
        auto holder = c10::make_intrusive<AttentionPlanHolder>();
        holder->call = make_attention("attention", q, k, v, a);
        std::tie(out, lse) = attention_forward(holder->call, q, v);
        ctx->saved_data["plan"] = holder;
      }
      c10::List<bool> param_grads, gate_grads;
      for (const at::Tensor& p : params) param_grads.push_back(p.defined() && p.requires_grad());
      for (const at::Tensor& g : gates) gate_grads.push_back(g.defined() && g.requires_grad());
      ctx->saved_data["param_grads"] = param_grads;
      ctx->saved_data["gate_grads"] = gate_grads;
      ctx->saved_data["sinks_grad"] = sinks && sinks->requires_grad();
      std::vector<at::Tensor> saved{q, k, v, out, lse, sinks ? *sinks : at::Tensor()};
      saved.insert(saved.end(), params.begin(), params.end());
      // The plan views the gates: saved so that autograd refuses a backward after they change in place.
      saved.insert(saved.end(), gates.begin(), gates.end());
      saved.push_back(plan);  // undefined in an eager call
      ctx->saved_data["param_count"] = static_cast<std::int64_t>(params.size());
      ctx->save_for_backward(saved);
      // The lse is differentiable where the call's normaliser says its statistic is (stick-breaking's rem).
      const bool lse_grad = statistic_has_gradient(a);
      ctx->saved_data["lse_grad"] = lse_grad;
      if (!lse_grad) ctx->mark_non_differentiable({lse});
      return variable_list{out, lse};
    });
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    return translating([&] {
      const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2];
      const std::int64_t param_count = ctx->saved_data["param_count"].toInt();
      const std::vector<at::Tensor> params(saved.begin() + 6, saved.begin() + 6 + param_count);
      const std::vector<at::Tensor> gates(saved.begin() + 6 + param_count, saved.end() - 1);
      const at::Tensor& plan = saved.back();
      const c10::optional<at::Tensor> sinks = saved[5].defined() ? c10::optional<at::Tensor>(saved[5]) : c10::nullopt;
      WantedGradients wanted;
      for (const bool w : ctx->saved_data["param_grads"].toBoolList()) wanted.params.push_back(w);
      for (const bool w : ctx->saved_data["gate_grads"].toBoolList()) wanted.gates.push_back(w);
      wanted.sinks = ctx->saved_data["sinks_grad"].toBool();
      // (Autograd hands a non-differentiable lse a gradient of zeros.)
      const at::Tensor d_lse = ctx->saved_data["lse_grad"].toBool() ? grads[1] : at::Tensor();
      AttentionGrads r;
      if (ctx->saved_data.count("plan")) {
        const AttentionCall& call = ctx->saved_data["plan"].toCustomClass<AttentionPlanHolder>()->call;
        r = attention_gradients(call, q, k, v, params, sinks, saved[3], saved[4], grads[0], wanted, d_lse);
      } else {
        torch::jit::Stack stack{plan,
                                q,
                                k,
                                v,
                                params,
                                gates,
                                sinks,
                                saved[3],
                                saved[4],
                                grads[0].defined() ? grads[0] : at::zeros_like(saved[3]),
                                d_lse.defined() ? c10::IValue(d_lse) : c10::IValue(),
                                bool_list(wanted.params),
                                bool_list(wanted.gates),
                                wanted.sinks};
        r = grads_of_op(call_below_autograd("posenc::attention_grad", std::move(stack)), wanted);
      }
      variable_list result{r.dq, r.dk, r.dv};
      result.insert(result.end(), r.d_params.begin(), r.d_params.end());
      result.insert(result.end(), r.d_gates.begin(), r.d_gates.end());
      result.push_back(r.d_sinks);
      result.emplace_back();  // args
      return result;
    });
  }
};

// Rows [..., D] (any float dtype, taken as float32) quantized into uint8 [..., row bytes], and back
// into float32 [..., D]: posenc::quantize_rows and dequantize_rows.
CacheFormat cache_format_of(const char* where, const std::string& format) {
  const std::optional<CacheFormat> f = parse_cache_format(format);
  TORCH_CHECK_VALUE(f.has_value(), where, ": format = '", format, "'; expected 'q8_0', 'q4_0' or 'fp8_e4m3'");
  return *f;
}

at::Tensor quantize_kv_cpu(const at::Tensor& x, const std::string& format) {
  return translating([&] {
    const CacheFormat f = cache_format_of("quantize_kv", format);
    TORCH_CHECK_TYPE(at::isFloatingType(x.scalar_type()), "quantize_kv: x is ", x.scalar_type(),
                     "; expected a floating-point tensor");
    TORCH_CHECK_VALUE(x.dim() >= 1, "quantize_kv: x is a scalar; expected rows [..., D]");
    const at::Tensor rows = x.to(at::kFloat).contiguous();
    const std::int64_t dim = x.size(-1), row_bytes = cache_row_bytes(f, dim);
    std::vector<std::int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = row_bytes;
    at::Tensor out = at::empty(shape, x.options().dtype(at::kByte));
    quantize_rows(f, rows.data_ptr<float>(), dim == 0 ? 0 : rows.numel() / dim, dim, out.data_ptr(), row_bytes);
    return out;
  });
}

at::Tensor dequantize_kv_cpu(const at::Tensor& bytes, const std::string& format) {
  return translating([&] {
    const CacheFormat f = cache_format_of("dequantize_kv", format);
    TORCH_CHECK_TYPE(bytes.scalar_type() == at::kByte, "dequantize_kv: bytes is ", bytes.scalar_type(),
                     "; expected torch.uint8");
    TORCH_CHECK_VALUE(bytes.dim() >= 1, "dequantize_kv: bytes is a scalar; expected rows [..., row bytes]");
    const at::Tensor rows = bytes.contiguous();
    const std::int64_t row_bytes = bytes.size(-1), dim = cache_row_dim(f, row_bytes);
    std::vector<std::int64_t> shape(bytes.sizes().begin(), bytes.sizes().end());
    shape.back() = dim;
    at::Tensor out = at::empty(shape, bytes.options().dtype(at::kFloat));
    dequantize_rows(f, rows.data_ptr(), row_bytes, rows.numel() / row_bytes, dim, out.data_ptr<float>());
    return out;
  });
}

// The op's kernels. Autograd: AttentionFunction. CPU: the forward alone; and attention_grad, the
// backward of one call from its inputs (the plan built again), its output and lse, the output's
// gradient and which gradients are wanted.
std::tuple<at::Tensor, at::Tensor> attention_autograd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const SchemeList& schemes,
    const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& gates, const c10::optional<at::Tensor>& sinks,
    bool causal, std::int64_t window_left, std::int64_t window_right, c10::optional<std::int64_t> chunk_size,
    const OptionalTemperature& temperature, double softcap, c10::optional<double> scale,
    const c10::optional<at::Tensor>& q_positions, const c10::optional<at::Tensor>& k_positions,
    std::vector<std::int64_t> cu_seqlens_q, std::vector<std::int64_t> cu_seqlens_k, bool skip_vanishing_tiles,
    c10::optional<std::string> kv_format) {
  if (kv_format) {
    // A quantized cache has no gradient, and the engine no backward against one: refused before
    // the forward rather than at a backward that cannot run.
    const bool wants_grad =
        at::GradMode::is_enabled() &&
        (q.requires_grad() || (sinks && sinks->requires_grad()) ||
         std::any_of(params.begin(), params.end(), [](const at::Tensor& t) { return t.requires_grad(); }) ||
         std::any_of(gates.begin(), gates.end(), [](const at::Tensor& t) { return t.requires_grad(); }));
    TORCH_CHECK_VALUE(!wants_grad, "attention: kv_format = '", *kv_format,
                      "' with inputs that require grad; expected torch.no_grad() (a quantized cache has no backward)");
    const torch::jit::Stack result = call_below_autograd("posenc::attention", {q,
                                                                               k,
                                                                               v,
                                                                               schemes,
                                                                               params,
                                                                               gates,
                                                                               sinks,
                                                                               causal,
                                                                               window_left,
                                                                               window_right,
                                                                               chunk_size,
                                                                               temperature,
                                                                               softcap,
                                                                               scale,
                                                                               q_positions,
                                                                               k_positions,
                                                                               cu_seqlens_q,
                                                                               cu_seqlens_k,
                                                                               skip_vanishing_tiles,
                                                                               kv_format});
    return {result[0].toTensor(), result[1].toTensor()};
  }
  auto args = std::make_shared<AttentionArgs>(
      call_args(schemes, causal, window_left, window_right, chunk_size, temperature, softcap, scale, q_positions,
                k_positions, std::move(cu_seqlens_q), std::move(cu_seqlens_k), skip_vanishing_tiles));
  const variable_list out =
      AttentionFunction::apply(q, k, v, at::TensorList(params), at::TensorList(gates), sinks, args);
  return {out[0], out[1]};
}

std::tuple<at::Tensor, at::Tensor> attention_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const SchemeList& schemes,
    const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& gates, const c10::optional<at::Tensor>& sinks,
    bool causal, std::int64_t window_left, std::int64_t window_right, c10::optional<std::int64_t> chunk_size,
    const OptionalTemperature& temperature, double softcap, c10::optional<double> scale,
    const c10::optional<at::Tensor>& q_positions, const c10::optional<at::Tensor>& k_positions,
    std::vector<std::int64_t> cu_seqlens_q, std::vector<std::int64_t> cu_seqlens_k, bool skip_vanishing_tiles,
    c10::optional<std::string> kv_format) {
  return translating([&] {
    AttentionArgs a =
        call_args(schemes, causal, window_left, window_right, chunk_size, temperature, softcap, scale, q_positions,
                  k_positions, std::move(cu_seqlens_q), std::move(cu_seqlens_k), skip_vanishing_tiles)
            .with(params, gates, sinks);
    a.kv_format = std::move(kv_format);
    const AttentionCall call = make_attention("attention", q, k, v, a);
    return attention_forward(call, q, v);
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_planned_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& objects,
    const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& gates, const c10::optional<at::Tensor>& sinks,
    bool causal, std::int64_t window_left, std::int64_t window_right, c10::optional<std::int64_t> chunk_size,
    double softcap, c10::optional<double> scale, const c10::optional<at::Tensor>& q_positions,
    const c10::optional<at::Tensor>& k_positions, std::vector<std::int64_t> cu_seqlens_q,
    std::vector<std::int64_t> cu_seqlens_k, bool skip_vanishing_tiles) {
  return translating([&] {
    const auto [schemes, temperature] = objects_of("attention_planned", objects);
    AttentionArgs a =
        call_args(schemes, causal, window_left, window_right, chunk_size, temperature, softcap, scale, q_positions,
                  k_positions, std::move(cu_seqlens_q), std::move(cu_seqlens_k), skip_vanishing_tiles)
            .with(params, gates, sinks);
    const AttentionCall call = make_attention("attention", q, k, v, a);
    auto [out, lse] = attention_forward(call, q, v);
    // The positions as the call used them (make_attention's copies): the caller may change its tensors.
    if (a.q_positions) a.q_positions = call.q_ids;
    if (a.k_positions) a.k_positions = call.k_ids;
    a.params.clear();
    a.gates.clear();
    a.sinks.reset();
    return std::make_tuple(out, lse, PlanTable::instance().add(std::move(a)));
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>, at::Tensor>
attention_grad_cpu(const at::Tensor& plan, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& gates,
                   const c10::optional<at::Tensor>& sinks, const at::Tensor& out, const at::Tensor& lse,
                   const at::Tensor& d_out, const c10::optional<at::Tensor>& d_lse, c10::List<bool> params_grad,
                   c10::List<bool> gates_grad, bool sinks_grad) {
  return translating([&] {
    const char* where = "attention_grad";
    TORCH_CHECK_VALUE(params_grad.size() == params.size(), where, ": params_grad has ", params_grad.size(),
                      " flags; expected one per params tensor (", params.size(), ")");
    TORCH_CHECK_VALUE(gates_grad.size() == gates.size(), where, ": gates_grad has ", gates_grad.size(),
                      " flags; expected one per gate (", gates.size(), ")");
    const AttentionArgs a = PlanTable::instance().find(where, plan).with(params, gates, sinks);
    const AttentionCall call = make_attention("attention", q, k, v, a);
    WantedGradients wanted;
    for (const bool w : params_grad) wanted.params.push_back(w);
    for (const bool w : gates_grad) wanted.gates.push_back(w);
    wanted.sinks = sinks_grad;
    AttentionGrads r =
        attention_gradients(call, q, k, v, params, sinks, out, lse, d_out, wanted, d_lse ? *d_lse : at::Tensor());
    // As the fake kernel gives them: a wanted gradient in its input's shape (zeros where the input
    // has no term), an empty tensor for one not wanted.
    for (std::size_t g = 0; g < r.d_params.size(); ++g)
      if (!r.d_params[g].defined()) r.d_params[g] = at::empty({0}, params[g].options());
    for (std::size_t g = 0; g < r.d_gates.size(); ++g)
      if (!r.d_gates[g].defined())
        r.d_gates[g] =
            wanted.gates[g] ? at::zeros(gates[g].sizes(), gates[g].options()) : at::empty({0}, gates[g].options());
    if (!r.d_sinks.defined())
      r.d_sinks = wanted.sinks && sinks ? at::zeros(sinks->sizes(), sinks->options())
                                        : at::empty({0}, q.options().dtype(at::kFloat));
    return std::make_tuple(r.dq, r.dk, r.dv, r.d_params, r.d_gates, r.d_sinks);
  });
}

// The backward of one attention call given the output and log-sum-exp it is part of: context
// parallelism (posenc.distributed) runs it per block of keys with the whole sequence's out and lse,
// so that P = exp(S − lse) and δ = dO·out are the global ones and the blocks' gradients add up.
// Returns dq, dk, dv and each group's learned parameters' gradient (in its params tensor's shape;
// none without params). No forget gates or sinks: their terms span the blocks.
std::tuple<at::Tensor, at::Tensor, at::Tensor, std::vector<at::Tensor>> attention_backward_op(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const SchemeList& schemes,
    const std::vector<at::Tensor>& params, bool causal, std::int64_t window_left, std::int64_t window_right,
    c10::optional<std::int64_t> chunk_size, const OptionalTemperature& temperature, double softcap,
    c10::optional<double> scale, const c10::optional<at::Tensor>& q_positions,
    const c10::optional<at::Tensor>& k_positions, const at::Tensor& out, const at::Tensor& lse, const at::Tensor& d_out,
    std::vector<std::int64_t> cu_seqlens_q, std::vector<std::int64_t> cu_seqlens_k, bool skip_vanishing_tiles) {
  return translating([&] {
    const char* where = "attention_backward";
    for (std::size_t g = 0; g < schemes.size(); ++g) {
      const SchemeEntry& entry = *schemes.get(g)->entry;
      TORCH_CHECK_VALUE(entry.inputs.empty(), where, ": schemes[", g, "] = ", entry.name,
                        ", a scheme of per-token inputs; expected none (their terms span the blocks)");
    }
    AttentionArgs a =
        call_args(schemes, causal, window_left, window_right, chunk_size, temperature, softcap, scale, q_positions,
                  k_positions, std::move(cu_seqlens_q), std::move(cu_seqlens_k), skip_vanishing_tiles);
    a.params = params;
    const AttentionCall call = make_attention(where, q, k, v, a);
    at::Tensor dq = at::zeros_like(q), dk = at::zeros_like(k), dv = at::zeros_like(v);
    AttentionGradients grads = call.attention->zero_gradients();
    const at::Tensor d_out_c = d_out.contiguous();
    call.attention->backward(const_view(where, "out", out), const_view(where, "lse", lse),
                             const_view(where, "d_out", d_out_c), mutable_view(where, "dq", dq),
                             mutable_view(where, "dk", dk), mutable_view(where, "dv", dv),
                             params.empty() ? nullptr : &grads);
    return std::make_tuple(dq, dk, dv,
                           params.empty() ? std::vector<at::Tensor>{} : parameter_gradients(call, grads, params));
  });
}

}  // namespace

void define_attention_ops(torch::Library& m) {
  m.class_<AttentionPlanHolder>("AttentionPlan");
  m.def("schemes() -> str", &schemes_op);
  define_op(m,
            "score_bias(__torch__.torch.classes.posenc.Scheme scheme, Tensor? params, Tensor q_positions, "
            "Tensor k_positions, ScalarType dtype, int head_dim=1) -> Tensor",
            TORCH_FN(score_bias_cpu), TORCH_FN(score_bias_autograd));
  define_op(m,
            "score_bias_pickled(Tensor scheme, Tensor? params, Tensor q_positions, Tensor k_positions, "
            "ScalarType dtype, int heads, int head_dim=1) -> Tensor",
            TORCH_FN(score_bias_pickled_cpu), TORCH_FN(score_bias_pickled_autograd));
  define_op(m,
            "score_bias_backward(Tensor grad, Tensor scheme, Tensor params, Tensor q_positions, Tensor k_positions, "
            "int head_dim=1) -> Tensor",
            TORCH_FN(score_bias_backward_cpu));
  define_op(m,
            "qk_transform(__torch__.torch.classes.posenc.Scheme scheme, Tensor x, Tensor positions, bool keys, "
            "int seq_len) -> Tensor",
            TORCH_FN(qk_transform_cpu));
  define_op(
      m,
      "attention(Tensor q, Tensor k, Tensor v, __torch__.torch.classes.posenc.Scheme[] schemes, Tensor[] params, "
      "Tensor[] gates, Tensor? sinks, bool causal, int window_left, int window_right, int? chunk_size, "
      "__torch__.torch.classes.posenc.Temperature? temperature, float softcap, float? scale, Tensor? q_positions, "
      "Tensor? k_positions, int[] cu_seqlens_q=[], int[] cu_seqlens_k=[], bool skip_vanishing_tiles=True, "
      "str? kv_format=None) -> (Tensor, Tensor)",
      TORCH_FN(attention_cpu), TORCH_FN(attention_autograd));
  define_op(m, "quantize_kv(Tensor x, str format) -> Tensor", TORCH_FN(quantize_kv_cpu));
  define_op(m, "dequantize_kv(Tensor bytes, str format) -> Tensor", TORCH_FN(dequantize_kv_cpu));
  // The traced path of attention's autograd kernel: the forward with its plan tensor, and the backward.
  define_op(
      m,
      "attention_planned(Tensor q, Tensor k, Tensor v, Tensor objects, Tensor[] params, Tensor[] gates, "
      "Tensor? sinks, bool causal, int window_left, int window_right, int? chunk_size, float softcap, float? scale, "
      "Tensor? q_positions, Tensor? k_positions, int[] cu_seqlens_q, int[] cu_seqlens_k, bool skip_vanishing_tiles) "
      "-> (Tensor, Tensor, Tensor)",
      TORCH_FN(attention_planned_cpu));
  define_op(m,
            "attention_grad(Tensor plan, Tensor q, Tensor k, Tensor v, Tensor[] params, Tensor[] gates, Tensor? sinks, "
            "Tensor out, Tensor lse, Tensor d_out, Tensor? d_lse, bool[] params_grad, bool[] gates_grad, "
            "bool sinks_grad) "
            "-> (Tensor, Tensor, Tensor, Tensor[], Tensor[], Tensor)",
            TORCH_FN(attention_grad_cpu));
  define_op(
      m,
      "attention_backward(Tensor q, Tensor k, Tensor v, __torch__.torch.classes.posenc.Scheme[] schemes, "
      "Tensor[] params, bool causal, int window_left, int window_right, int? chunk_size, "
      "__torch__.torch.classes.posenc.Temperature? temperature, float softcap, float? scale, Tensor? q_positions, "
      "Tensor? k_positions, Tensor out, Tensor lse, Tensor d_out, int[] cu_seqlens_q=[], int[] cu_seqlens_k=[], "
      "bool skip_vanishing_tiles=True) -> (Tensor, Tensor, Tensor, Tensor[])",
      TORCH_FN(attention_backward_op),
      // A backward itself: its outputs have no gradient (an error if one is asked for).
      torch::autograd::autogradNotImplementedFallback());
}

}  // namespace posenc::torch_adapter
