// Hugging Face config.json → HfRopeConfig, for one layer (rotary.hpp: hf_rope_config_from_json).
// The rules follow transformers (modeling_rope_utils.py's RotaryEmbeddingConfigMixin and the
// Gemma 3 / Gemma 4 configurations); docs/hf-rope-semantics.md states them.
#include <cmath>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "internal.hpp"
#include "posenc/error.hpp"
#include "posenc/rotary.hpp"

namespace posenc {

namespace {

constexpr const char* kWhere = "config";
constexpr double kUnset = std::numeric_limits<double>::quiet_NaN();
using Json = nlohmann::json;

double number(const Json& object, const std::string& prefix, const char* key, double fallback) {
  const auto it = object.find(key);
  if (it == object.end() || it->is_null()) return fallback;
  if (!it->is_number()) throw Error(kWhere, (prefix + key).c_str(), it->dump(), "a number");
  return it->get<double>();
}

// An integer key; when present it must be >= minimum (a bad explicit value is never "unset").
std::int64_t integer(const Json& object, const std::string& prefix, const char* key, std::int64_t fallback,
                     std::int64_t minimum) {
  const auto it = object.find(key);
  if (it == object.end() || it->is_null()) return fallback;
  const double value = number(object, prefix, key, 0.0);
  if (value != std::floor(value) || value < static_cast<double>(minimum) || value > 0x1p62) {
    throw Error(kWhere, (prefix + key).c_str(), it->dump(), "an integer in [" + std::to_string(minimum) + ", 2^62]");
  }
  return static_cast<std::int64_t>(value);
}

std::vector<double> numbers(const Json& object, const std::string& prefix, const char* key) {
  const auto it = object.find(key);
  if (it == object.end() || it->is_null()) return {};
  if (!it->is_array()) throw Error(kWhere, (prefix + key).c_str(), it->dump(), "a list of numbers");
  std::vector<double> values;
  for (const auto& v : *it) {
    if (!v.is_number()) throw Error(kWhere, (prefix + key).c_str(), v.dump(), "a list of numbers");
    values.push_back(v.get<double>());
  }
  return values;
}

// The keys of one set of RoPE parameters (rope_scaling, rope_parameters, or one layer type's
// entry of a per-layer rope_parameters), over what the top level gave.
void read_rope_keys(const Json& s, const std::string& prefix, HfRopeConfig& c) {
  if (s.contains("rope_type") && !s["rope_type"].is_null()) {
    if (!s["rope_type"].is_string())
      throw Error(kWhere, (prefix + "rope_type").c_str(), s["rope_type"].dump(), "a string");
    c.rope_type = s["rope_type"].get<std::string>();
  } else if (s.contains("type") && !s["type"].is_null()) {
    if (!s["type"].is_string()) throw Error(kWhere, (prefix + "type").c_str(), s["type"].dump(), "a string");
    c.rope_type = s["type"].get<std::string>();
  }
  c.rope_theta = number(s, prefix, "rope_theta", c.rope_theta);
  c.partial_rotary_factor = number(s, prefix, "partial_rotary_factor", c.partial_rotary_factor);
  c.original_max_position_embeddings = integer(s, prefix, "original_max_position_embeddings", 0, 1);
  c.factor = number(s, prefix, "factor", kUnset);
  c.beta_fast = number(s, prefix, "beta_fast", kUnset);
  c.beta_slow = number(s, prefix, "beta_slow", kUnset);
  c.mscale = number(s, prefix, "mscale", 0.0);
  c.mscale_all_dim = number(s, prefix, "mscale_all_dim", 0.0);
  if (s.contains("truncate") && !s["truncate"].is_null()) {
    if (!s["truncate"].is_boolean()) throw Error(kWhere, (prefix + "truncate").c_str(), s["truncate"].dump(), "a bool");
    c.truncate = s["truncate"].get<bool>();
  }
  c.attention_factor = number(s, prefix, "attention_factor", kUnset);
  c.low_freq_factor = number(s, prefix, "low_freq_factor", kUnset);
  c.high_freq_factor = number(s, prefix, "high_freq_factor", kUnset);
  c.short_factor = numbers(s, prefix, "short_factor");
  c.long_factor = numbers(s, prefix, "long_factor");
  for (const double n : numbers(s, prefix, "mrope_section")) {
    if (n != std::floor(n) || n < 1 || n > 0x1p30) {
      throw Error(kWhere, (prefix + "mrope_section").c_str(), s["mrope_section"].dump(), "a list of integers >= 1");
    }
    c.mrope_section.push_back(static_cast<std::int64_t>(n));
  }
  if (s.contains("mrope_interleaved") && !s["mrope_interleaved"].is_null()) {
    if (!s["mrope_interleaved"].is_boolean()) {
      throw Error(kWhere, (prefix + "mrope_interleaved").c_str(), s["mrope_interleaved"].dump(), "a bool");
    }
    c.mrope_interleaved = s["mrope_interleaved"].get<bool>();
  }
}

bool is_gemma3(const Json& doc) {
  const auto it = doc.find("model_type");
  return it != doc.end() && it->is_string() && it->get<std::string>().rfind("gemma3", 0) == 0;
}

// Each layer's type: `layer_types`, or (when a layer is asked for) Gemma 3's rule from
// sliding_window_pattern (layer i is full when (i + 1) % pattern == 0; Gemma3TextConfig, pattern 6
// by default); empty when the config does not vary by layer.
std::vector<std::string> layer_types_of(const Json& doc, std::int64_t layers, bool derive) {
  std::vector<std::string> types;
  if (const auto it = doc.find("layer_types"); it != doc.end() && !it->is_null()) {
    if (!it->is_array()) throw Error(kWhere, "layer_types", it->dump(), "a list of layer type names");
    for (const auto& t : *it) {
      if (!t.is_string()) throw Error(kWhere, "layer_types", t.dump(), "a list of layer type names (strings)");
      types.push_back(t.get<std::string>());
    }
    if (layers > 0 && static_cast<std::int64_t>(types.size()) != layers) {
      throw Error(kWhere, "layer_types", std::to_string(types.size()) + " entries",
                  "num_hidden_layers = " + std::to_string(layers));
    }
    return types;
  }
  const bool gemma3 = is_gemma3(doc);
  if (!derive || (!gemma3 && !doc.contains("sliding_window_pattern"))) return types;
  const std::int64_t pattern = integer(doc, "", "sliding_window_pattern", 6, 1);
  if (layers <= 0) {
    throw Error(kWhere, "num_hidden_layers", "missing",
                "the layer count (the layers' types follow from sliding_window_pattern)");
  }
  for (std::int64_t i = 0; i < layers; ++i)
    types.push_back((i + 1) % pattern == 0 ? "full_attention" : "sliding_attention");
  return types;
}

}  // namespace

HfRopeConfig hf_rope_config_from_json(std::string_view text, std::optional<std::int64_t> layer) {
  Json root;
  try {
    root = Json::parse(text);
  } catch (const Json::exception& e) {
    throw Error(kWhere, "json", std::string(text.substr(0, 40)), std::string("valid JSON (") + e.what() + ")");
  }
  if (!root.is_object()) throw Error(kWhere, "document", root.type_name(), "a JSON object");
  // A multimodal model's RoPE is its language model's (Gemma 3, Llama 4, Qwen3-VL: text_config).
  const Json& doc = root.contains("text_config") && root["text_config"].is_object() ? root["text_config"] : root;
  const bool gemma3 = is_gemma3(doc);
  HfRopeConfig c;
  // GPT-NeoX configs spell rope_theta and partial_rotary_factor rotary_emb_base and rotary_pct;
  // Gemma3TextConfig's defaults stand for keys its configs leave out (rope_theta 1e6, head_dim 256,
  // 8 heads, 131072 positions).
  c.rope_theta = number(doc, "", "rope_theta", number(doc, "", "rotary_emb_base", gemma3 ? 1e6 : 10000.0));
  c.hidden_size = integer(doc, "", "hidden_size", 0, 1);
  c.num_attention_heads = integer(doc, "", "num_attention_heads", gemma3 ? 8 : 0, 1);
  c.head_dim = integer(doc, "", "head_dim", gemma3 ? 256 : 0, 1);
  c.partial_rotary_factor = number(doc, "", "partial_rotary_factor", number(doc, "", "rotary_pct", 1.0));
  c.max_position_embeddings = integer(doc, "", "max_position_embeddings", gemma3 ? 131072 : 2048, 1);
  c.top_level_original_max_position_embeddings = integer(doc, "", "original_max_position_embeddings", 0, 1);
  const std::int64_t layers = integer(doc, "", "num_hidden_layers", 0, 1);
  const std::vector<std::string> types = layer_types_of(doc, layers, layer.has_value());
  if (layer) {
    const auto count = types.empty() ? layers : static_cast<std::int64_t>(types.size());
    if (*layer < 0 || (count > 0 && *layer >= count)) {
      throw Error(kWhere, "layer", std::to_string(*layer),
                  count > 0 ? "in [0, " + std::to_string(count) + ") (the model's layers)" : ">= 0");
    }
    if (!types.empty()) c.layer_type = types[static_cast<std::size_t>(*layer)];
  }
  const char* block_key = doc.contains("rope_scaling") && !doc["rope_scaling"].is_null() ? "rope_scaling"
                          : doc.contains("rope_parameters")                              ? "rope_parameters"
                                                                                         : nullptr;
  const Json* block = block_key != nullptr && !doc[block_key].is_null() ? &doc[block_key] : nullptr;
  if (block != nullptr && !block->is_object()) throw Error(kWhere, block_key, block->dump(), "an object");
  bool per_layer = false;
  if (block != nullptr) {
    for (const auto& [key, value] : block->items()) per_layer = per_layer || value.is_object();
  }
  if (per_layer) {
    // transformers v5: rope_parameters keyed by layer type ({"full_attention": {...}, ...}).
    const std::string prefix = std::string(block_key) + ".";
    const std::set<std::string> known(types.begin(), types.end());
    for (const auto& [key, value] : block->items()) {
      if (value.is_null()) continue;  // some exports leave flat keys set to null beside the layer types
      if (!value.is_object()) {
        throw Error(kWhere, (prefix + key).c_str(), value.dump(), "an object of RoPE keys for a layer type (or null)");
      }
      if (!types.empty() && known.count(key) == 0) {
        throw Error(kWhere, (prefix + key).c_str(), "an entry", "a layer type that layer_types names");
      }
    }
    if (types.empty()) {
      throw Error(kWhere, "layer_types", "missing",
                  std::string("a type per layer (") + block_key + " is keyed by layer type)");
    }
    if (!layer) {
      throw Error(kWhere, "layer", "missing", std::string("a layer (") + block_key + " differs by layer type)");
    }
    const auto entry = block->find(c.layer_type);
    if (entry == block->end() || entry->is_null()) {
      throw Error(kWhere, (prefix + c.layer_type).c_str(), "missing",
                  "the RoPE parameters of layer " + std::to_string(*layer) + "'s type");
    }
    read_rope_keys(*entry, prefix + c.layer_type + ".", c);
  } else if ((gemma3 || doc.contains("rope_local_base_freq")) && !layer) {
    throw Error(kWhere, "layer", "missing",
                "a layer (sliding layers turn at rope_local_base_freq, full ones at rope_theta)");
  } else if (c.layer_type == "sliding_attention" && (gemma3 || doc.contains("rope_local_base_freq"))) {
    // Gemma 3's sliding layers: default RoPE at rope_local_base_freq (1e4 by default); the scaling
    // applies to the full layers only (transformers v5 moves it to rope_parameters["full_attention"]).
    c.rope_type = "default";
    c.rope_theta = number(doc, "", "rope_local_base_freq", 10000.0);
  } else if (block != nullptr) {
    // transformers looks up rope_scaling's rope_type (or the older "type") in its table of init
    // functions; a block without one fails there, so it is refused here rather than read as default.
    if (std::string_view(block_key) == "rope_scaling" && !block->contains("rope_type") && !block->contains("type")) {
      throw Error(kWhere, "rope_scaling.rope_type", "missing",
                  "a rope type (default, linear, dynamic, yarn, longrope, llama3, …): transformers cannot build the "
                  "rotary embedding without one");
    }
    read_rope_keys(*block, std::string(block_key) + ".", c);
  }
  // Gemma 4's full-attention layers are wider: global_head_dim in its config.json, per_layer_config
  // {"5": {"head_dim": 512}} where transformers serialises the model's config (to_dict()).
  if (c.layer_type == "full_attention") c.head_dim = integer(doc, "", "global_head_dim", c.head_dim, 1);
  if (const auto it = doc.find("per_layer_config"); layer && it != doc.end() && !it->is_null()) {
    if (!it->is_object()) throw Error(kWhere, "per_layer_config", it->dump(), "an object keyed by layer index");
    if (const auto entry = it->find(std::to_string(*layer)); entry != it->end() && !entry->is_null()) {
      const std::string prefix = "per_layer_config." + std::to_string(*layer) + ".";
      if (!entry->is_object())
        throw Error(kWhere, prefix.substr(0, prefix.size() - 1).c_str(), entry->dump(), "an object");
      for (const char* key : {"rope_theta", "rope_parameters", "rope_scaling", "partial_rotary_factor"}) {
        if (entry->contains(key)) {
          throw Error(kWhere, (prefix + key).c_str(), (*entry)[key].dump(),
                      "no per-layer override of RoPE's parameters (rope_parameters by layer type carries them)");
        }
      }
      c.head_dim = integer(*entry, prefix, "head_dim", c.head_dim, 1);
    }
  }
  // MLA rotates qk_rope_head_dim of each query/key head (DeepseekV3Config sets head_dim to it).
  if (doc.contains("qk_rope_head_dim")) {
    c.head_dim = integer(doc, "", "qk_rope_head_dim", 0, 2);
    c.qk_head_dim = c.head_dim + integer(doc, "", "qk_nope_head_dim", 0, 0);
  }
  return c;
}

double mla_softmax_scale(const HfRopeConfig& c) {
  if (c.qk_head_dim <= 0) throw Error(kWhere, "qk_rope_head_dim", "missing", "an MLA config (DeepSeek's keys)");
  double scale = 1.0 / std::sqrt(static_cast<double>(c.qk_head_dim));
  const bool yarn = c.rope_type == "yarn";
  if (yarn && c.mscale_all_dim != 0.0 && !std::isnan(c.factor) && c.factor > 1.0) {
    const double m = 0.1 * c.mscale_all_dim * std::log(c.factor) + 1.0;
    scale *= m * m;
  }
  return scale;
}

RopeParams rope_params_from_hf(std::string_view json, std::optional<std::int64_t> layer, RopeLayout layout) {
  return rope_params_from_hf(hf_rope_config_from_json(json, layer), layout);
}

}  // namespace posenc
