// The PyTorch ops of the fused attention and of the scheme registry (list in ops.cpp's header).
#include <torch/library.h>
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
// (a 1-D empty tensor for a scheme without any), or undefined for the scheme's initial values.
HeadGroup attention_group(const char* where, const std::string& name, const SchemeClass& scheme,
                          const at::Tensor& params, std::int64_t head_dim, double scale,
                          std::map<std::string, ConstTensorView, std::less<>> inputs = {}) {
  SchemeArgs args = scheme.given_args(head_dim, scale);
  args.inputs = std::move(inputs);
  if (params.defined()) {
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

// Any registered relative-bias scheme (registry.hpp) materialised as [B, H, Sq, Sk], differentiable
// in its parameters (params: the registry's parameter_shape; None: its initial values).
class RelativeBiasFunction : public torch::autograd::Function<RelativeBiasFunction> {
 public:
  static BiasScheme scheme_of(const SchemeClass& scheme, const at::Tensor& params) {
    TORCH_CHECK_VALUE(scheme.entry->family == "relative-bias", "relative_bias: scheme = ", scheme.entry->name,
                      "; expected a scheme of the relative-bias family (posenc.schemes())");
    const HeadGroup g = attention_group("relative_bias", "params", scheme, params, 1, 0.0);
    TORCH_CHECK_VALUE(g.bias.has_value(), "relative_bias: scheme = ", scheme.entry->name, " builds no bias");
    return *g.bias;
  }
  static at::Tensor forward(AutogradContext* ctx, const c10::intrusive_ptr<SchemeClass>& scheme,
                            const c10::optional<at::Tensor>& params, const at::Tensor& q_positions,
                            const at::Tensor& k_positions, c10::ScalarType dtype) {
    const at::Tensor qi = q_positions.contiguous(), ki = k_positions.contiguous();
    const at::Tensor p = params ? *params : at::Tensor();
    ctx->saved_data["scheme"] = scheme;
    ctx->saved_data["given"] = p.defined();
    ctx->save_for_backward({p.defined() ? p : at::empty({0}), qi, ki});
    return translating([&] { return materialize(scheme_of(*scheme, p), qi, ki, dtype); });
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    return translating([&] {
      at::Tensor d_params;
      if (ctx->saved_data["given"].toBool() && saved[0].numel() > 0) {
        const BiasScheme b = scheme_of(*ctx->saved_data["scheme"].toCustomClass<SchemeClass>(), saved[0]);
        const RelativeBias& rb = *relative_bias(b);
        std::vector<double> d(static_cast<std::size_t>(rb.parameter_count()), 0.0);
        const at::Tensor ds = grads[0].contiguous();
        relative_bias_backward(rb, positions_of("relative_bias", "q_positions", saved[1]),
                               positions_of("relative_bias", "k_positions", saved[2]),
                               const_view("relative_bias", "grad", ds), d);
        d_params = tensor_of(d, saved[0]);
      }
      return variable_list{at::Tensor(), d_params, at::Tensor(), at::Tensor(), at::Tensor()};
    });
  }
};

at::Tensor relative_bias_op(const c10::intrusive_ptr<SchemeClass>& scheme, const c10::optional<at::Tensor>& params,
                            const at::Tensor& q_positions, const at::Tensor& k_positions, c10::ScalarType dtype) {
  return RelativeBiasFunction::apply(scheme, params, q_positions, k_positions, dtype);
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
  spec.k = const_view(where, "k", k);
  spec.v = const_view(where, "v", v);
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
    out.push_back(params.empty() ? at::tensor(d, at::kDouble) : tensor_of(d, params[g]));
  }
  return out;
}

class AttentionFunction : public torch::autograd::Function<AttentionFunction> {
 public:
  // The tensor lists go through apply() as TensorLists so that autograd gives each of their
  // tensors a gradient; the rest rides in AttentionArgs.
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               at::TensorList params, at::TensorList gates, const c10::optional<at::Tensor>& sinks,
                               const std::shared_ptr<AttentionArgs>& args) {
    return translating([&] {
      AttentionArgs a = *args;
      a.params = params.vec();
      a.gates = gates.vec();
      a.sinks = sinks;
      auto holder = c10::make_intrusive<AttentionPlanHolder>();
      holder->call = make_attention("attention", q, k, v, a);
      const AttentionCall& call = holder->call;
      std::vector<std::int64_t> out_shape(q.sizes().begin(), q.sizes().end());
      out_shape.back() = v.size(-1);  // MLA: values narrower than q and k
      at::Tensor out = empty_output(out_shape, q.scalar_type());
      // [B, H, Sq], or [H, Tq] for packed sequences.
      at::Tensor lse = q.dim() == 3 ? at::empty({q.size(1), q.size(0)}, q.options().dtype(at::kFloat))
                                    : at::empty({q.size(0), q.size(2), q.size(1)}, q.options().dtype(at::kFloat));
      call.attention->forward(mutable_view("attention", "out", out), mutable_view("attention", "lse", lse));
      ctx->saved_data["plan"] = holder;
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
      ctx->saved_data["param_count"] = static_cast<std::int64_t>(params.size());
      ctx->save_for_backward(saved);
      ctx->mark_non_differentiable({lse});
      return variable_list{out, lse};
    });
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    return translating([&] {
      const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2];
      const auto param_end = saved.begin() + 6 + ctx->saved_data["param_count"].toInt();
      const std::vector<at::Tensor> params(saved.begin() + 6, param_end);
      const AttentionCall& call = ctx->saved_data["plan"].toCustomClass<AttentionPlanHolder>()->call;
      const at::Tensor d_out = grads[0].defined() ? grads[0].contiguous() : at::zeros_like(saved[3]);
      at::Tensor dq = at::zeros_like(q), dk = at::zeros_like(k), dv = at::zeros_like(v);
      AttentionGradients param_grads = call.attention->zero_gradients();
      const c10::List<bool> wants_param = ctx->saved_data["param_grads"].toBoolList();
      const c10::List<bool> wants_gate = ctx->saved_data["gate_grads"].toBoolList();
      const bool wants_sinks = ctx->saved_data["sinks_grad"].toBool();
      bool trainable = wants_sinks;
      for (const bool w : wants_param) trainable = trainable || w;
      for (const bool w : wants_gate) trainable = trainable || w;
      call.attention->backward(const_view("attention", "out", saved[3]), const_view("attention", "lse", saved[4]),
                               const_view("attention", "d_out", d_out), mutable_view("attention", "dq", dq),
                               mutable_view("attention", "dk", dk), mutable_view("attention", "dv", dv),
                               trainable ? &param_grads : nullptr);
      variable_list result{dq, dk, dv};
      const std::vector<at::Tensor> d_params =
          trainable ? parameter_gradients(call, param_grads, params) : std::vector<at::Tensor>{};
      for (std::size_t g = 0; g < wants_param.size(); ++g)
        result.push_back(wants_param.get(g) ? d_params[g] : at::Tensor());
      // One gradient per gate, in the gate's shape: a scheme's input's as its entry gives it, an
      // added gate's from its own term (after the scheme's terms, before the sinks argument's).
      for (std::size_t g = 0; g < wants_gate.size(); ++g) {
        at::Tensor d_gate;
        if (wants_gate.get(g) && call.gates[g].defined()) {
          const SchemeEntry& entry = *call.entries[g];
          d_gate = tensor_of(entry.inputs.empty() ? param_grads.groups[g].terms[call.gate_terms[g]]
                                                  : scheme_input_gradients(entry, param_grads.groups[g])[0],
                             call.gates[g]);
        }
        result.push_back(d_gate);
      }
      // The sinks: each group's last term, concatenated over the groups.
      at::Tensor d_sinks;
      if (wants_sinks) {
        std::vector<double> flat;
        for (const GroupGradients& g : param_grads.groups)
          flat.insert(flat.end(), g.terms.back().begin(), g.terms.back().end());
        d_sinks = tensor_of(flat, saved[5]);
      }
      result.push_back(d_sinks);
      result.emplace_back();  // args
      return result;
    });
  }
};

std::tuple<at::Tensor, at::Tensor> attention_op(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const SchemeList& schemes,
    const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& gates, const c10::optional<at::Tensor>& sinks,
    bool causal, std::int64_t window_left, std::int64_t window_right, c10::optional<std::int64_t> chunk_size,
    const OptionalTemperature& temperature, double softcap, c10::optional<double> scale,
    const c10::optional<at::Tensor>& q_positions, const c10::optional<at::Tensor>& k_positions,
    std::vector<std::int64_t> cu_seqlens_q, std::vector<std::int64_t> cu_seqlens_k, bool skip_vanishing_tiles) {
  auto args = std::make_shared<AttentionArgs>(
      call_args(schemes, causal, window_left, window_right, chunk_size, temperature, softcap, scale, q_positions,
                k_positions, std::move(cu_seqlens_q), std::move(cu_seqlens_k), skip_vanishing_tiles));
  const variable_list out =
      AttentionFunction::apply(q, k, v, at::TensorList(params), at::TensorList(gates), sinks, args);
  return {out[0], out[1]};
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
  m.def(
      "relative_bias(__torch__.torch.classes.posenc.Scheme scheme, Tensor? params, Tensor q_positions, "
      "Tensor k_positions, ScalarType dtype) -> Tensor",
      &relative_bias_op);
  m.def(
      "attention(Tensor q, Tensor k, Tensor v, __torch__.torch.classes.posenc.Scheme[] schemes, Tensor[] params, "
      "Tensor[] gates, Tensor? sinks, bool causal, int window_left, int window_right, int? chunk_size, "
      "__torch__.torch.classes.posenc.Temperature? temperature, float softcap, float? scale, Tensor? q_positions, "
      "Tensor? k_positions, int[] cu_seqlens_q=[], int[] cu_seqlens_k=[], bool skip_vanishing_tiles=True) -> (Tensor, "
      "Tensor)",
      &attention_op);
  m.def(
      "attention_backward(Tensor q, Tensor k, Tensor v, __torch__.torch.classes.posenc.Scheme[] schemes, "
      "Tensor[] params, bool causal, int window_left, int window_right, int? chunk_size, "
      "__torch__.torch.classes.posenc.Temperature? temperature, float softcap, float? scale, Tensor? q_positions, "
      "Tensor? k_positions, Tensor out, Tensor lse, Tensor d_out, int[] cu_seqlens_q=[], int[] cu_seqlens_k=[], "
      "bool skip_vanishing_tiles=True) -> (Tensor, Tensor, Tensor, Tensor[])",
      &attention_backward_op);
}

}  // namespace posenc::torch_adapter
