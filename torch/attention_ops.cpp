// The PyTorch ops of the fused attention and of the scheme registry (list in ops.cpp's header).
#include <torch/library.h>
#include <torch/torch.h>

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "adapter.hpp"
#include "posenc/posenc.hpp"

namespace posenc::torch_adapter {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// ─── Fused attention ─────────────────────────────────────────────────────────────────────────

// A JSON scheme {"kind": name, option: value, …} as the registry's arguments (registry.hpp):
// numbers and booleans are options, "rope" holds RoPE's parameters; the registry refuses names
// the scheme does not declare.
SchemeArgs scheme_args(const char* where, const nlohmann::json& j, std::int64_t heads, std::int64_t head_dim,
                       double scale) {
  SchemeArgs args;
  args.heads = heads;
  args.head_dim = head_dim;
  args.scale = scale;
  for (const auto& [key, value] : j.items()) {
    if (key == "kind") continue;
    if (key == "rope") {
      args.rope = rope_params_from_json(value.dump());
    } else if (value.is_boolean()) {
      args.options[key] = value.get<bool>() ? 1.0 : 0.0;
    } else if (value.is_number()) {
      args.options[key] = value.get<double>();
    } else {
      throw Error(where, "scheme." + key, value.dump(), "a number or a boolean");
    }
  }
  return args;
}

// The head group of a JSON scheme and its learned parameters (bias_params: the registry's
// parameter_shape, any float dtype; empty: the scheme's initial values).
HeadGroup attention_group(const nlohmann::json& j, const at::Tensor& bias_params, std::int64_t heads,
                          std::int64_t head_dim, double scale) {
  const char* where = "attention";
  const SchemeEntry& entry = find_scheme(j.value("kind", std::string("none")));
  SchemeArgs args = scheme_args(where, j, heads, head_dim, scale);
  const bool given = !absent(bias_params) && bias_params.numel() > 0;
  if (given) args.parameters = doubles_of(where, "bias_params", bias_params);
  // The registry checks the count (and refuses any for a parameter-free scheme); the tensor's
  // shape must also be the declared one.
  const SchemeArgs complete = complete_scheme_args(entry, std::move(args));
  if (given) {
    const std::vector<std::int64_t> shape = entry.parameter_shape(complete);
    TORCH_CHECK_VALUE(bias_params.sizes() == at::IntArrayRef(shape), where, ": bias_params shape ", bias_params.sizes(),
                      "; expected ", at::IntArrayRef(shape), " (", entry.name, ": ",
                      entry.parameters.empty() ? std::string("no parameters") : entry.parameters, ")");
  }
  return entry.make(complete);
}

// Any registered relative-bias scheme (registry.hpp) materialised as [B, H, Sq, Sk], differentiable
// in its parameters (params: the registry's parameter_shape, or empty for its initial values).
class RelativeBiasFunction : public torch::autograd::Function<RelativeBiasFunction> {
 public:
  static BiasScheme scheme_of(const std::string& scheme, const at::Tensor& params, std::int64_t heads) {
    const nlohmann::json j = nlohmann::json::parse(scheme);
    const HeadGroup g = attention_group(j, params, heads, 1, 0.0);
    const SchemeEntry& entry = find_scheme(j.value("kind", std::string("none")));
    TORCH_CHECK_VALUE(entry.family == "relative-bias" && g.bias, "relative_bias: scheme.kind = ", entry.name,
                      "; expected a scheme of the relative-bias family (posenc.schemes())");
    return *g.bias;
  }
  static at::Tensor forward(AutogradContext* ctx, const std::string& scheme, const at::Tensor& params,
                            const at::Tensor& q_positions, const at::Tensor& k_positions, std::int64_t heads,
                            c10::ScalarType dtype) {
    const at::Tensor qi = q_positions.contiguous(), ki = k_positions.contiguous();
    ctx->saved_data["scheme"] = scheme;
    ctx->saved_data["heads"] = heads;
    ctx->save_for_backward({params, qi, ki});
    return translating([&] { return materialize(scheme_of(scheme, params, heads), qi, ki, dtype); });
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    return translating([&] {
      at::Tensor d_params;
      if (saved[0].numel() > 0) {
        const BiasScheme b =
            scheme_of(ctx->saved_data["scheme"].toStringRef(), saved[0], ctx->saved_data["heads"].toInt());
        const RelativeBias& rb = *relative_bias(b);
        std::vector<double> d(static_cast<std::size_t>(rb.parameter_count()), 0.0);
        const at::Tensor ds = grads[0].contiguous();
        relative_bias_backward(rb, positions_of("relative_bias", "q_positions", saved[1]),
                               positions_of("relative_bias", "k_positions", saved[2]),
                               const_view("relative_bias", "grad", ds), d);
        d_params = tensor_of(d, saved[0]);
      }
      return variable_list{at::Tensor(), d_params, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    });
  }
};

at::Tensor relative_bias_op(const std::string& scheme, const at::Tensor& params, const at::Tensor& q_positions,
                            const at::Tensor& k_positions, std::int64_t heads, c10::ScalarType dtype) {
  return RelativeBiasFunction::apply(scheme, params, q_positions, k_positions, heads, dtype);
}

// A registered scheme's initial parameters in its parameter_shape (float64; empty when it has none).
at::Tensor scheme_parameters_op(const std::string& scheme, std::int64_t heads, std::int64_t head_dim) {
  return translating([&] {
    const nlohmann::json j = nlohmann::json::parse(scheme);
    const SchemeEntry& entry = find_scheme(j.value("kind", std::string("none")));
    const SchemeArgs args = complete_scheme_args(entry, scheme_args("scheme_parameters", j, heads, head_dim, 0.0));
    const std::vector<double> values = scheme_parameters(entry, entry.make(args));
    const std::vector<std::int64_t> shape = entry.parameter_shape(args);
    return at::tensor(values, at::kDouble).reshape(shape.empty() ? std::vector<std::int64_t>{0} : shape);
  });
}

// The registry as JSON: [{name, family, summary, source, parameters, options: [{name, default,
// integer, description}]}].
std::string schemes_op() {
  nlohmann::json all = nlohmann::json::array();
  for (const SchemeEntry& e : schemes()) {
    nlohmann::json options = nlohmann::json::array();
    for (const SchemeOption& o : e.options) {
      options.push_back(
          {{"name", o.name}, {"default", o.default_value}, {"integer", o.integer}, {"description", o.description}});
    }
    all.push_back({{"name", e.name},
                   {"family", e.family},
                   {"summary", e.summary},
                   {"source", e.source},
                   {"parameters", e.parameters},
                   {"options", options}});
  }
  return all.dump();
}

struct AttentionCall {
  std::unique_ptr<Attention> attention;
  at::Tensor q_ids, k_ids;        // kept alive: Positions borrow them
  std::vector<at::Tensor> gates;  // per head group: its ForgetGate's tensor (viewed: kept alive), or undefined
};

// Sinks (posenc/sinks.hpp): one logit per query head, split over the head groups.
void add_sinks(const char* where, const at::Tensor& sinks, AttentionSpec& spec) {
  if (absent(sinks) || sinks.numel() == 0) return;
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

// Group g's forget gate (Forgetting Attention, posenc/forgetting.hpp), if `gates` gives it one:
// one entry per head group, an empty tensor for none.
void add_gates(const char* where, const std::vector<at::Tensor>& gates, AttentionSpec& spec, AttentionCall& call) {
  call.gates.resize(spec.groups.size());
  if (gates.empty()) return;
  TORCH_CHECK_VALUE(gates.size() == spec.groups.size(), where, ": ", gates.size(),
                    " forget gates; expected one per head group (", spec.groups.size(), "), empty for none");
  for (std::size_t g = 0; g < gates.size(); ++g) {
    if (absent(gates[g]) || gates[g].numel() == 0) continue;
    call.gates[g] = gates[g].detach();
    spec.groups[g].terms.push_back(std::make_shared<ForgetGate>(const_view(where, "log_fgate", call.gates[g])));
  }
}

// {"kind": "llama4", "floor_scale", "attn_scale"} or {"kind": "mistral", "beta",
// "original_max_position_embeddings"} (posenc/temperature.hpp), every key required, no other.
PositionTemperature temperature_of(const char* where, const std::string& text) {
  const nlohmann::json j = nlohmann::json::parse(text);
  TORCH_CHECK_VALUE(j.is_object() && j.contains("kind") && j.at("kind").is_string(), where,
                    ": temperature = ", j.dump(), "; expected an object with a \"kind\"");
  const std::string kind = j.at("kind").get<std::string>();
  const auto keys = kind == "llama4"    ? std::vector<std::string>{"kind", "floor_scale", "attn_scale"}
                    : kind == "mistral" ? std::vector<std::string>{"kind", "beta", "original_max_position_embeddings"}
                                        : std::vector<std::string>{};
  TORCH_CHECK_VALUE(!keys.empty(), where, ": temperature kind = ", kind, "; expected llama4 or mistral");
  for (const auto& [key, value] : j.items()) {
    TORCH_CHECK_VALUE(std::find(keys.begin(), keys.end(), key) != keys.end(), where, ": temperature.", key,
                      " given; expected only ", keys[1], " and ", keys[2], " for ", kind);
    TORCH_CHECK_VALUE(key == "kind" || value.is_number(), where, ": temperature.", key, " = ", value.dump(),
                      "; expected a number");
  }
  for (const std::string& key : keys) {
    TORCH_CHECK_VALUE(j.contains(key), where, ": temperature.", key, " missing for ", kind);
  }
  if (kind == "llama4")
    return PositionTemperature::llama4(j.at("floor_scale").get<double>(), j.at("attn_scale").get<double>());
  const nlohmann::json& l0 = j.at("original_max_position_embeddings");
  TORCH_CHECK_VALUE(l0.is_number_integer(), where, ": temperature.original_max_position_embeddings = ", l0.dump(),
                    "; expected an integer");
  return PositionTemperature::mistral(j.at("beta").get<double>(), l0.get<std::int64_t>());
}

AttentionCall make_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::string& scheme,
                             const at::Tensor& bias_params, bool causal, std::int64_t window_left,
                             std::int64_t window_right, c10::optional<std::int64_t> chunk_size,
                             const c10::optional<std::string>& temperature, double softcap, double scale,
                             const at::Tensor& q_positions, const at::Tensor& k_positions,
                             const std::vector<at::Tensor>& gates, const at::Tensor& sinks,
                             at::IntArrayRef cu_seqlens_q, at::IntArrayRef cu_seqlens_k) {
  const char* where = "attention";
  // Packed sequences (cu_seqlens, both or neither): q [Tq, H, D], k and v [Tk, G, D].
  const bool packed = !cu_seqlens_q.empty() || !cu_seqlens_k.empty();
  TORCH_CHECK_VALUE(q.dim() == (packed ? 3 : 4), where, ": q shape ", q.sizes(), "; expected ",
                    packed ? "[Tq, H, D] with cu_seqlens" : "[B, Sq, H, D]");
  AttentionCall call;
  AttentionSpec spec;
  spec.cu_seqlens_q.assign(cu_seqlens_q.begin(), cu_seqlens_q.end());
  spec.cu_seqlens_k.assign(cu_seqlens_k.begin(), cu_seqlens_k.end());
  spec.q = const_view(where, "q", q);
  spec.k = const_view(where, "k", k);
  spec.v = const_view(where, "v", v);
  nlohmann::json scheme_json = nlohmann::json::parse(scheme);
  // The plan's option rides along at the top level (absent: the library's default).
  if (scheme_json.contains("skip_vanishing_tiles")) {
    const nlohmann::json& skip = scheme_json.at("skip_vanishing_tiles");
    TORCH_CHECK_VALUE(skip.is_boolean(), where, ": scheme.skip_vanishing_tiles = ", skip.dump(), "; expected a bool");
    spec.skip_vanishing_tiles = skip.get<bool>();
    scheme_json.erase("skip_vanishing_tiles");
  }
  if (scheme_json.contains("groups")) {
    for (const auto& [key, value] : scheme_json.items()) {
      TORCH_CHECK_VALUE(key == "groups", where, ": scheme.", key, " = ", value.dump(),
                        "; expected only \"groups\" (and skip_vanishing_tiles) beside the groups");
    }
    // Several head groups: {"groups": [{"kind", "heads", options…}, …]} covering the heads in order;
    // bias_params is every group's parameters flattened and concatenated (or empty).
    const at::Tensor flat = absent(bias_params) ? bias_params : bias_params.reshape({-1});
    std::int64_t offset = 0;
    for (nlohmann::json g : scheme_json.at("groups")) {
      TORCH_CHECK_VALUE(g.is_object() && g.contains("heads") && g.at("heads").is_number_integer(), where,
                        ": scheme group ", g.dump(), "; expected an object with an integer \"heads\"");
      const std::int64_t heads = g.at("heads").get<std::int64_t>();
      TORCH_CHECK_VALUE(heads >= 1, where, ": scheme groups' heads = ", heads, "; expected >= 1");
      g.erase("heads");
      const SchemeEntry& entry = find_scheme(g.value("kind", std::string("none")));
      const SchemeArgs args = complete_scheme_args(entry, scheme_args(where, g, heads, q.size(-1), scale));
      std::int64_t count = entry.parameter_shape(args).empty() ? 0 : 1;
      for (const std::int64_t extent : entry.parameter_shape(args)) count *= extent;  // checked by the registry
      at::Tensor part = at::empty({0}, at::kDouble);
      if (!absent(flat) && flat.numel() > 0 && count > 0) {
        TORCH_CHECK_VALUE(offset + count <= flat.numel(), where, ": bias_params has ", flat.numel(),
                          " values; the groups' parameters need more (", entry.name, ": ", entry.parameters, ")");
        part = flat.narrow(0, offset, count).reshape(at::IntArrayRef(entry.parameter_shape(args)));
      }
      offset += count;
      spec.groups.push_back(attention_group(g, part, heads, q.size(-1), scale));
    }
    TORCH_CHECK_VALUE(absent(flat) || flat.numel() == 0 || offset == flat.numel(), where, ": bias_params has ",
                      flat.numel(), " values; the groups' parameters take ", offset);
  } else {
    TORCH_CHECK_VALUE(!scheme_json.contains("heads"), where, ": scheme.heads = ", scheme_json.value("heads", 0),
                      "; expected it only inside \"groups\" (one scheme covers every head)");
    spec.groups = {attention_group(scheme_json, bias_params, q.size(-2), q.size(-1), scale)};
  }
  add_gates(where, gates, spec, call);
  add_sinks(where, sinks, spec);
  spec.mask.causal = causal;
  spec.mask.window_left = window_left;
  spec.mask.window_right = window_right;
  if (chunk_size) spec.mask.chunk_size = *chunk_size;
  if (temperature) spec.temperature = temperature_of(where, *temperature);
  spec.mask.softcap = softcap;
  spec.scale = scale;
  if (!absent(q_positions)) {
    call.q_ids = q_positions.contiguous();
    spec.q_positions = positions_of(where, "q_positions", call.q_ids);
  }
  if (!absent(k_positions)) {
    call.k_ids = k_positions.contiguous();
    spec.k_positions = positions_of(where, "k_positions", call.k_ids);
  }
  call.attention = std::make_unique<Attention>(spec);
  return call;
}

// The plan of a forward call, kept in the autograd context for its backward: building it again
// would redo its tables, among them XL's r·W_Rᵀ (2·Δ·d_model·H·D flops: half of the forward
// attention's own at S = 2048, H·D = d_model = 1024) and TUPE's projections. Its views point into q, k, v, which
// the context saves (autograd refuses a backward after they change in place).
struct AttentionPlanHolder : torch::CustomClassHolder {
  AttentionCall call;
};

// The learned parameters' gradients of every group, flattened and concatenated as bias_params is.
std::vector<double> flat_parameter_gradients(const std::string& scheme, const AttentionGradients& grads) {
  const nlohmann::json j = nlohmann::json::parse(scheme);
  const nlohmann::json groups = j.contains("groups") ? j.at("groups") : nlohmann::json::array({j});
  std::vector<double> flat;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const std::vector<double> part =
        scheme_gradients(find_scheme(groups[g].value("kind", std::string("none"))), grads.groups[g]);
    flat.insert(flat.end(), part.begin(), part.end());
  }
  return flat;
}

class AttentionFunction : public torch::autograd::Function<AttentionFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const std::string& scheme, const at::Tensor& bias_params, at::TensorList gates,
                               const at::Tensor& sinks, bool causal, std::int64_t window_left,
                               std::int64_t window_right, c10::optional<std::int64_t> chunk_size,
                               const c10::optional<std::string>& temperature, double softcap, double scale,
                               const at::Tensor& q_positions, const at::Tensor& k_positions,
                               const std::vector<std::int64_t>& cu_seqlens_q,
                               const std::vector<std::int64_t>& cu_seqlens_k) {
    return translating([&] {
      auto holder = c10::make_intrusive<AttentionPlanHolder>();
      holder->call =
          make_attention(q, k, v, scheme, bias_params, causal, window_left, window_right, chunk_size, temperature,
                         softcap, scale, q_positions, k_positions, gates.vec(), sinks, cu_seqlens_q, cu_seqlens_k);
      const AttentionCall& call = holder->call;
      std::vector<std::int64_t> out_shape(q.sizes().begin(), q.sizes().end());
      out_shape.back() = v.size(-1);  // MLA: values narrower than q and k
      at::Tensor out = empty_output(out_shape, q.scalar_type());
      // [B, H, Sq], or [H, Tq] for packed sequences.
      at::Tensor lse = q.dim() == 3 ? at::empty({q.size(1), q.size(0)}, q.options().dtype(at::kFloat))
                                    : at::empty({q.size(0), q.size(2), q.size(1)}, q.options().dtype(at::kFloat));
      call.attention->forward(mutable_view("attention", "out", out), mutable_view("attention", "lse", lse));
      ctx->saved_data["plan"] = holder;
      ctx->saved_data["scheme"] = scheme;
      c10::List<bool> gate_grads;
      for (const at::Tensor& g : gates) gate_grads.push_back(g.defined() && g.requires_grad());
      ctx->saved_data["gate_grads"] = gate_grads;
      ctx->save_for_backward({q, k, v, bias_params, q_positions, k_positions, out, lse, sinks});
      ctx->mark_non_differentiable({lse});
      return variable_list{out, lse};
    });
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    return translating([&] {
      const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &bias_params = saved[3];
      const AttentionCall& call = ctx->saved_data["plan"].toCustomClass<AttentionPlanHolder>()->call;
      const at::Tensor d_out = grads[0].defined() ? grads[0].contiguous() : at::zeros_like(saved[6]);
      at::Tensor dq = at::zeros_like(q), dk = at::zeros_like(k), dv = at::zeros_like(v);
      AttentionGradients param_grads = call.attention->zero_gradients();
      const c10::List<bool> gate_grads = ctx->saved_data["gate_grads"].toBoolList();
      bool any_gate_grad = false;
      for (const bool g : gate_grads) any_gate_grad = any_gate_grad || g;
      const at::Tensor& sinks = saved[8];
      const bool sinks_grad = !absent(sinks) && sinks.numel() > 0 && sinks.requires_grad();
      const bool trainable = (!absent(bias_params) && bias_params.requires_grad()) || any_gate_grad || sinks_grad;
      call.attention->backward(const_view("attention", "out", saved[6]), const_view("attention", "lse", saved[7]),
                               const_view("attention", "d_out", d_out), mutable_view("attention", "dq", dq),
                               mutable_view("attention", "dk", dk), mutable_view("attention", "dv", dv),
                               trainable ? &param_grads : nullptr);
      at::Tensor d_bias;
      if (trainable && !absent(bias_params) && bias_params.requires_grad()) {
        d_bias = tensor_of(flat_parameter_gradients(ctx->saved_data["scheme"].toStringRef(), param_grads), bias_params);
      }
      variable_list result{dq, dk, dv, at::Tensor(), d_bias};
      // One gradient per gate (the list's tensors are inputs of their own), in the gate's shape.
      for (std::size_t g = 0; g < gate_grads.size(); ++g) {
        at::Tensor d_gate;
        if (gate_grads.get(g) && call.gates[g].defined())
          d_gate = tensor_of(param_grads.groups[g].terms[0], call.gates[g]);
        result.push_back(d_gate);
      }
      // The sinks: each group's last term, concatenated over the groups.
      at::Tensor d_sinks;
      if (sinks_grad) {
        std::vector<double> flat;
        for (const GroupGradients& g : param_grads.groups)
          flat.insert(flat.end(), g.terms.back().begin(), g.terms.back().end());
        d_sinks = tensor_of(flat, sinks);
      }
      result.push_back(d_sinks);
      for (int i = 0; i < 11; ++i) result.emplace_back();  // causal … cu_seqlens_k
      return result;
    });
  }
};

std::tuple<at::Tensor, at::Tensor> attention_op(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, std::string scheme, const at::Tensor& bias_params,
    const std::vector<at::Tensor>& gates, const at::Tensor& sinks, bool causal, std::int64_t window_left,
    std::int64_t window_right, c10::optional<std::int64_t> chunk_size, const c10::optional<std::string>& temperature,
    double softcap, double scale, const at::Tensor& q_positions, const at::Tensor& k_positions,
    std::vector<std::int64_t> cu_seqlens_q, std::vector<std::int64_t> cu_seqlens_k) {
  const variable_list out = AttentionFunction::apply(q, k, v, scheme, bias_params, at::TensorList(gates), sinks, causal,
                                                     window_left, window_right, chunk_size, temperature, softcap, scale,
                                                     q_positions, k_positions, cu_seqlens_q, cu_seqlens_k);
  return {out[0], out[1]};
}

// The backward of one attention call given the output and log-sum-exp it is part of: context
// parallelism (posenc.distributed) runs it per block of keys with the whole sequence's out and lse,
// so that P = exp(S − lse) and δ = dO·out are the global ones and the blocks' gradients add up.
// Returns dq, dk, dv and the learned parameters' gradient (float64, flattened as bias_params;
// empty without parameters). No forget gates or sinks: their terms span the blocks.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_op(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, std::string scheme, const at::Tensor& bias_params,
    bool causal, std::int64_t window_left, std::int64_t window_right, c10::optional<std::int64_t> chunk_size,
    const c10::optional<std::string>& temperature, double softcap, double scale, const at::Tensor& q_positions,
    const at::Tensor& k_positions, const at::Tensor& out, const at::Tensor& lse, const at::Tensor& d_out,
    std::vector<std::int64_t> cu_seqlens_q, std::vector<std::int64_t> cu_seqlens_k) {
  return translating([&] {
    const AttentionCall call =
        make_attention(q, k, v, scheme, bias_params, causal, window_left, window_right, chunk_size, temperature,
                       softcap, scale, q_positions, k_positions, {}, at::Tensor(), cu_seqlens_q, cu_seqlens_k);
    at::Tensor dq = at::zeros_like(q), dk = at::zeros_like(k), dv = at::zeros_like(v);
    const bool trainable = !absent(bias_params) && bias_params.numel() > 0;
    AttentionGradients grads = call.attention->zero_gradients();
    const at::Tensor d_out_c = d_out.contiguous();
    call.attention->backward(const_view("attention_backward", "out", out), const_view("attention_backward", "lse", lse),
                             const_view("attention_backward", "d_out", d_out_c),
                             mutable_view("attention_backward", "dq", dq), mutable_view("attention_backward", "dk", dk),
                             mutable_view("attention_backward", "dv", dv), trainable ? &grads : nullptr);
    const std::vector<double> flat = trainable ? flat_parameter_gradients(scheme, grads) : std::vector<double>{};
    at::Tensor d_params = at::empty({static_cast<std::int64_t>(flat.size())}, at::kDouble);
    std::copy(flat.begin(), flat.end(), d_params.data_ptr<double>());
    return std::make_tuple(dq, dk, dv, d_params);
  });
}

// s(position) of a temperature given as attention's op takes it (validates it, for Python).
double attention_temperature_op(const std::string& temperature, std::int64_t position) {
  return translating([&] { return temperature_of("PositionTemperature", temperature).factor(position); });
}

}  // namespace

void define_attention_ops(torch::Library& m) {
  m.class_<AttentionPlanHolder>("AttentionPlan");
  m.def("schemes() -> str", &schemes_op);
  m.def("attention_temperature(str temperature, int position) -> float", &attention_temperature_op);
  m.def("scheme_parameters(str scheme, int heads, int head_dim) -> Tensor", &scheme_parameters_op);
  m.def(
      "relative_bias(str scheme, Tensor params, Tensor q_positions, Tensor k_positions, int heads, ScalarType dtype) "
      "-> Tensor",
      &relative_bias_op);
  m.def(
      "attention(Tensor q, Tensor k, Tensor v, str scheme, Tensor bias_params, Tensor[] gates, Tensor sinks, "
      "bool causal, int window_left, "
      "int window_right, int? chunk_size, str? temperature, float softcap, float scale, Tensor q_positions, Tensor "
      "k_positions, int[] cu_seqlens_q=[], int[] cu_seqlens_k=[]) -> (Tensor, Tensor)",
      &attention_op);
  m.def(
      "attention_backward(Tensor q, Tensor k, Tensor v, str scheme, Tensor bias_params, bool causal, int window_left, "
      "int window_right, int? chunk_size, str? temperature, float softcap, float scale, Tensor q_positions, Tensor "
      "k_positions, Tensor out, Tensor lse, Tensor d_out, int[] cu_seqlens_q=[], int[] cu_seqlens_k=[]) -> (Tensor, "
      "Tensor, Tensor, Tensor)",
      &attention_backward_op);
}

}  // namespace posenc::torch_adapter
