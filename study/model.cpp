#include "model.hpp"

#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <cmath>
#include <tuple>

#include "linear.hpp"
#include "posenc/error.hpp"
#include "posenc/registry.hpp"
#include "posenc/torch/ops.hpp"

namespace posenc::study {
namespace {

using SchemeList = torch_adapter::SchemeList;
using SinusoidOp = at::Tensor(const at::Tensor&, std::int64_t, double, bool, at::ScalarType);
using QuantizeOp = at::Tensor(const at::Tensor&, const std::string&);
using RopeOp = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                  const c10::intrusive_ptr<torch_adapter::RopeClass>&, std::int64_t,
                                                  std::int64_t);

}  // namespace

// The study's default arms, in the order that seeds them (known_schemes). sinusoidal and learned
// are its own: embeddings of the input, added to the residual stream, not terms of the attention
// that the registry describes. The others are registry names or aliases (nope: none), and
// <scheme>-<variant> for an entry's length variants.
const std::vector<std::string>& all_schemes() {
  static const std::vector<std::string> schemes = {"sinusoidal", "learned", "rope",   "rope-ntk", "rope-yarn", "xpos",
                                                   "t5",         "alibi",   "kerple", "fire",     "nope"};
  return schemes;
}

namespace {
// Whether a decoder trains the entry: no positions (none), a transform of q and k, a score bias of
// the positions (families relative-bias and bias), a term of per-token inputs that a decoder makes
// (token-term), or a normaliser in place of the softmax.
bool trainable(const posenc::SchemeEntry& e) {
  const bool inputs_made = !e.inputs.empty() && std::all_of(e.inputs.begin(), e.inputs.end(),
                                                            [](const auto& in) { return in.decoder_log_sigmoid; });
  return e.family == "none" || e.family == "transform" || e.family == "relative-bias" || e.family == "bias" ||
         e.family == "normaliser" || (e.family == "token-term" && inputs_made);
}

// The name the study reports an entry by: its first alias where it has one (forgetting: fox, as
// its paper calls it; none: nope).
std::string study_name(const posenc::SchemeEntry& e) { return e.aliases.empty() ? e.name : e.aliases.front(); }

// A registry scheme as the study holds it: its entry, and the length variant it is evaluated under
// (rope-ntk: rope's ntk).
struct Arm {
  const posenc::SchemeEntry* entry = nullptr;
  const posenc::LengthVariant* variant = nullptr;
};
// The arm of a study name: an entry's name or alias, or <study name>-<variant>; no entry for the
// input embeddings and for schemes a decoder does not train.
Arm study_arm(const std::string& scheme) {
  for (const posenc::SchemeEntry& e : posenc::schemes()) {
    if (!trainable(e)) continue;
    if (e.name == scheme || std::find(e.aliases.begin(), e.aliases.end(), scheme) != e.aliases.end()) return {&e};
    for (const posenc::LengthVariant& v : e.length_variants) {
      if (scheme == study_name(e) + "-" + v.name) return {&e, &v};
    }
  }
  return {};
}

// The entry's options as a decoder of train_length holds it (decoder_preset), the rest absent.
posenc::SchemeArgs decoder_preset(const posenc::SchemeEntry& entry, std::int64_t heads, std::int64_t head_dim,
                                  std::int64_t train_length) {
  posenc::SchemeArgs args{.heads = heads, .head_dim = head_dim};
  if (entry.decoder_preset) entry.decoder_preset(args, train_length);
  return args;
}
// The same with the defaults filled in.
posenc::SchemeArgs decoder_args(const posenc::SchemeEntry& entry, std::int64_t heads, std::int64_t head_dim,
                                std::int64_t train_length) {
  return posenc::complete_scheme_args(entry, decoder_preset(entry, heads, head_dim, train_length));
}
}  // namespace

const std::vector<std::string>& known_schemes() {
  static const std::vector<std::string> known = [] {
    std::vector<std::string> all = all_schemes();
    const auto add = [&all](const std::string& name) {
      if (std::find(all.begin(), all.end(), name) == all.end()) all.push_back(name);
    };
    for (const posenc::SchemeEntry& e : posenc::schemes()) {
      if (e.family == "relative-bias") add(e.name);
    }
    // Then the schemes whose logits or weights depend on the content, then the other transforms
    // and their length variants: later, so that the others keep their seeds.
    for (const posenc::SchemeEntry& e : posenc::schemes()) {
      if ((e.family == "token-term" || e.family == "normaliser") && trainable(e)) add(study_name(e));
    }
    for (const posenc::SchemeEntry& e : posenc::schemes()) {
      if (e.family != "transform" && e.family != "none") continue;
      add(study_name(e));
      for (const posenc::LengthVariant& v : e.length_variants) add(study_name(e) + "-" + v.name);
    }
    return all;
  }();
  return known;
}

bool replaces_softmax(const std::string& scheme) {
  const Arm arm = study_arm(scheme);
  return arm.entry != nullptr && arm.entry->family == "normaliser";
}

std::string known_schemes_text() {
  std::string text;
  for (const std::string& s : known_schemes()) text += (text.empty() ? "one of " : ", ") + s;
  return text;
}

std::string training_scheme(const std::string& scheme) {
  const Arm arm = study_arm(scheme);
  return arm.variant ? study_name(*arm.entry) : scheme;
}

void LanguageModelImpl::set_scheme(const std::string& scheme) {
  if (training_scheme(scheme) != training_scheme(config_.scheme)) {
    throw Error("study", "scheme", scheme, "a scheme sharing the parameters of " + config_.scheme);
  }
  config_.scheme = scheme;
}

posenc::SchemeArgs LanguageModelImpl::attention_args(std::int64_t context_length) const {
  const Arm arm = study_arm(config_.scheme);
  const std::int64_t head_dim = config_.width / config_.heads;
  posenc::SchemeArgs args = decoder_preset(*arm.entry, config_.heads, head_dim, config_.train_length);
  if (arm.variant) {
    args = posenc::complete_scheme_args(*arm.entry, std::move(args));
    arm.variant->at_length(args, config_.train_length, context_length);
  }
  return args;
}

std::optional<RopeParams> LanguageModelImpl::rotation(std::int64_t context_length) const {
  const Arm arm = study_arm(config_.scheme);
  if (arm.entry == nullptr || arm.entry->family != "transform") return std::nullopt;
  const posenc::HeadGroup group = posenc::make_head_group(arm.entry->name, attention_args(context_length));
  const auto* rotary = std::get_if<RotaryQK>(&group.transform);
  return rotary ? std::optional<RopeParams>(rotary->params) : std::nullopt;
}

bool LanguageModelImpl::has_rope() const { return rotation(config_.train_length).has_value(); }

void LanguageModelImpl::set_kv_cache(const std::string& format, bool post_rope) {
  if (!format.empty() && replaces_softmax(config_.scheme)) {
    throw Error("study", "--kv-formats", format,
                "schemes with the softmax (" + config_.scheme + " replaces it, on k and v tensors)");
  }
  const std::int64_t head_dim = config_.width / config_.heads;
  if ((format == "q8_0" || format == "q4_0") && head_dim % 32 != 0) {
    throw Error("study", "--kv-formats", format,
                "a head size that is a multiple of 32 (ggml's blocks; --width / --heads is " +
                    std::to_string(head_dim) + "), or fp8_e4m3");
  }
  kv_format_ = format;
  kv_post_rope_ = post_rope && has_rope();
}

LanguageModelImpl::LanguageModelImpl(const ModelConfig& config) : config_(config) {
  bool known = false;
  for (const std::string& s : known_schemes()) known = known || s == config.scheme;
  if (!known) throw Error("study", "scheme", config.scheme, known_schemes_text());
  if (config.width % config.heads != 0 || (config.width / config.heads) % 2 != 0) {
    throw Error("study", "width", std::to_string(config.width),
                "a multiple of 2·heads (" + std::to_string(2 * config.heads) + ")");
  }
  const std::int64_t d = config.width, h = config.heads;
  embed_ = register_module("embed", torch::nn::Embedding(256, d));
  if (config.scheme == "learned") {
    positions_ = register_module("positions", torch::nn::Embedding(config.train_length, d));
    torch::nn::init::normal_(positions_->weight, 0.0, 0.02);
  }
  for (std::int64_t l = 0; l < config.layers; ++l) {
    Layer layer;
    const std::string p = "layer" + std::to_string(l) + "_";
    layer.norm1 = register_module(p + "norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    layer.norm2 = register_module(p + "norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    layer.qkv = register_module(p + "qkv", torch::nn::Linear(d, 3 * d));
    layer.out = register_module(p + "out", torch::nn::Linear(d, d));
    layer.up = register_module(p + "up", torch::nn::Linear(d, 4 * d));
    layer.down = register_module(p + "down", torch::nn::Linear(4 * d, d));
    const auto param = [&](const std::string& name, torch::Tensor value) {
      layer.raw.push_back(register_parameter(p + name, std::move(value)));
    };
    const posenc::SchemeEntry* entry = study_arm(config.scheme).entry;
    if (entry && entry->parameters_fixed) {
      // The definition's parameters (ALiBi's slopes): none trained.
    } else if (entry && entry->training) {
      // The entry's trained slices, drawn in order (torch's generator: the same draws on any host).
      using enum posenc::TrainedSlice::Init;
      for (const posenc::TrainedSlice& t :
           entry->training(decoder_args(*entry, h, d / h, config.train_length), config.train_length)) {
        const auto dtype = t.dtype == posenc::DType::kF32 ? torch::kFloat32 : torch::kFloat64;
        param(entry->name + "_" + t.name, t.init == kZeros      ? torch::zeros(t.shape, dtype)
                                          : t.init == kConstant ? torch::full(t.shape, t.value, dtype)
                                                                : torch::randn(t.shape, dtype) / t.value);
      }
    } else if (entry) {
      // The registry's initial parameters, learned as they are (none for Sandwich).
      const posenc::SchemeArgs args = decoder_args(*entry, h, d / h, config.train_length);
      if (!entry->parameter_shape(args).empty()) {
        const std::vector<double> initial = posenc::scheme_parameters(*entry, entry->make(args));
        if (!initial.empty()) {
          param("registry_params", torch::tensor(initial, torch::kFloat64).reshape(entry->parameter_shape(args)));
        }
      }
    }
    // Per-token inputs: log σ of a linear map of the block's normalised input (default init).
    for (const posenc::SchemeInput& in : entry ? entry->inputs : std::vector<posenc::SchemeInput>{})
      layer.inputs.push_back(register_module(p + in.name, torch::nn::Linear(d, h)));
    if (entry && entry->decoder_statistic_bias)
      layer.statistic_bias = register_parameter(p + "statistic_bias", torch::zeros({h, d / h}));
    layers_.push_back(std::move(layer));
  }
  final_norm_ = register_module("final_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
  head_ = register_module("head", torch::nn::Linear(d, 256));
}

c10::intrusive_ptr<torch_adapter::SchemeClass> LanguageModelImpl::attention_scheme(std::int64_t context_length) const {
  const Arm arm = study_arm(config_.scheme);
  if (arm.entry == nullptr) {  // an input embedding: no term in the attention
    return c10::make_intrusive<torch_adapter::SchemeClass>("none", config_.heads, c10::Dict<std::string, double>(),
                                                           c10::nullopt);
  }
  const posenc::SchemeArgs args = attention_args(context_length);
  c10::Dict<std::string, double> options;
  for (const auto& [option, value] : args.options) options.insert(option, value);
  if (!kv_format_.empty() && kv_post_rope_) options.insert_or_assign("keys_rotated", 1.0);
  c10::optional<c10::intrusive_ptr<torch_adapter::RopeClass>> rope;
  if (args.rope) rope = c10::make_intrusive<torch_adapter::RopeClass>(*args.rope);
  return c10::make_intrusive<torch_adapter::SchemeClass>(arm.entry->name, config_.heads, options, rope);
}

torch::Tensor LanguageModelImpl::layer_bias_params(const Layer& layer) const {
  const posenc::SchemeEntry* entry = study_arm(config_.scheme).entry;
  if (entry == nullptr || layer.raw.empty()) return {};  // the scheme's initial values (none for the others)
  if (!entry->training) return layer.raw[0];
  // The trained slices through their reparametrisation: one as it is, several flat and joined in
  // the entry's order.
  const std::int64_t head_dim = config_.width / config_.heads;
  const std::vector<posenc::TrainedSlice> slices =
      entry->training(decoder_args(*entry, config_.heads, head_dim, config_.train_length), config_.train_length);
  std::vector<torch::Tensor> parts;
  for (std::size_t i = 0; i < slices.size(); ++i) {
    const torch::Tensor& raw = layer.raw[i];
    parts.push_back(slices[i].softplus ? torch::nn::functional::softplus(raw) : raw);
  }
  if (parts.size() == 1) return parts[0];
  for (torch::Tensor& part : parts) part = part.reshape({-1});
  return torch::cat(parts);
}

torch::Tensor LanguageModelImpl::forward(const torch::Tensor& bytes, std::int64_t context_length) {
  static const auto sinusoid =
      c10::Dispatcher::singleton().findSchemaOrThrow("posenc::sinusoidal_table", "").typed<SinusoidOp>();
  static const auto quantize =
      c10::Dispatcher::singleton().findSchemaOrThrow("posenc::quantize_kv", "").typed<QuantizeOp>();
  static const auto rotate = c10::Dispatcher::singleton().findSchemaOrThrow("posenc::rope", "").typed<RopeOp>();
  const std::int64_t b = bytes.size(0), s = bytes.size(1), d = config_.width, h = config_.heads, hd = d / h;
  if (context_length <= 0) context_length = s;
  torch::Tensor x = embed_->forward(bytes);
  const torch::Tensor positions = torch::arange(s, torch::kInt64);
  if (config_.scheme == "sinusoidal") {
    x = x + sinusoid.call(positions, d, 10000.0, true, torch::kFloat32).unsqueeze(0);
  } else if (config_.scheme == "learned") {
    x = x + positions_->forward(positions.clamp_max(config_.train_length - 1)).unsqueeze(0);
  }
  SchemeList schemes;
  schemes.push_back(attention_scheme(context_length));
  // A post-RoPE cache's rotation of the keys, one for every layer.
  const auto key_rotation = kv_post_rope_ ? c10::make_intrusive<torch_adapter::RopeClass>(*rotation(context_length))
                                          : c10::intrusive_ptr<torch_adapter::RopeClass>();
  for (Layer& layer : layers_) {
    const torch::Tensor normed = layer.norm1->forward(x);
    const torch::Tensor qkv = linear(normed, layer.qkv).view({b, s, 3, h, hd});
    const torch::Tensor q = qkv.select(2, 0), k = qkv.select(2, 1), v = qkv.select(2, 2);
    torch::Tensor attended;
    torch_adapter::AttentionArgs args;
    args.schemes = schemes;
    for (const torch::nn::Linear& input : layer.inputs) args.gates.push_back(torch::log_sigmoid(linear(normed, input)));
    if (const torch::Tensor params = layer_bias_params(layer); params.defined()) args.params.push_back(params);
    args.causal = true;
    if (kv_format_.empty()) {
      const auto [o, lse] = torch_adapter::call_attention(q, k, v, args);
      // The row statistic [B, H, S] (stick-breaking's rem, the stick left over) times b_h.
      attended = layer.statistic_bias.defined() ? o + lse.transpose(1, 2).unsqueeze(-1) * layer.statistic_bias : o;
    } else {
      torch::Tensor keys = k;
      if (kv_post_rope_) keys = std::get<1>(rotate.call(q, k, positions, key_rotation, s, 0));
      args.kv_format = kv_format_;
      attended = std::get<0>(torch_adapter::call_attention(q, quantize.call(keys.contiguous(), kv_format_),
                                                           quantize.call(v.contiguous(), kv_format_), args));
    }
    x = x + linear(attended.reshape({b, s, d}), layer.out);
    x = x + linear(torch::gelu(linear(layer.norm2->forward(x), layer.up)), layer.down);
  }
  return linear(final_norm_->forward(x), head_);
}

}  // namespace posenc::study
