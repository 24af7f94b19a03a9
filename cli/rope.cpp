// posenc rope-freqs --config config.json [--seq-len N]   (or flags instead of a file)
// Prints {"rope_type", "head_dim", "rotary_dim", "base", "inv_freq", "attention_factor"} for a
// Hugging Face config (or any JSON object holding the same keys).
#include <fmt/core.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "commands.hpp"
#include "posenc/posenc.hpp"

namespace posenc::cli {
namespace {

constexpr double kUnset = std::numeric_limits<double>::quiet_NaN();

struct RopeFreqsOptions {
  std::string config_path;
  std::int64_t seq_len = 0;
  // Flags (used without --config, or to override it)
  std::string scaling;
  std::int64_t head_dim = 0;
  std::int64_t rotary_dim = 0;
  double base = kUnset;
  double factor = kUnset;
  std::int64_t max_position_embeddings = 0;
  std::int64_t original_max_position_embeddings = 0;
  double beta_fast = kUnset, beta_slow = kUnset;
  double low_freq_factor = kUnset, high_freq_factor = kUnset;
  double attention_factor = kUnset;
};

double number(const nlohmann::json& object, const char* key, double fallback) {
  const auto it = object.find(key);
  if (it == object.end() || it->is_null()) return fallback;
  if (!it->is_number()) throw Error("config", key, it->dump(), "a number");
  return it->get<double>();
}

std::int64_t integer(const nlohmann::json& object, const char* key, std::int64_t fallback) {
  const double value = number(object, key, static_cast<double>(fallback));
  if (value != std::floor(value) || std::fabs(value) > 0x1p62) {
    throw Error("config", key, fmt::format("{}", value), "an integer of magnitude <= 2^62");
  }
  return static_cast<std::int64_t>(value);
}

std::vector<double> numbers(const nlohmann::json& object, const char* key) {
  const auto it = object.find(key);
  if (it == object.end() || it->is_null()) return {};
  if (!it->is_array()) throw Error("config", key, it->dump(), "a list of numbers");
  std::vector<double> values;
  for (const auto& v : *it) {
    if (!v.is_number()) throw Error("config", key, v.dump(), "a list of numbers");
    values.push_back(v.get<double>());
  }
  return values;
}

// The keys of Hugging Face's config.json that define RoPE (docs/hf-rope-semantics.md).
HfRopeConfig parse_config(const nlohmann::json& doc) {
  if (!doc.is_object()) throw Error("config", "document", doc.type_name(), "a JSON object");
  HfRopeConfig c;
  // GPT-NeoX configs spell rope_theta and partial_rotary_factor rotary_emb_base and rotary_pct.
  c.rope_theta = number(doc, "rope_theta", number(doc, "rotary_emb_base", 10000.0));
  c.hidden_size = integer(doc, "hidden_size", 0);
  c.num_attention_heads = integer(doc, "num_attention_heads", 0);
  c.head_dim = integer(doc, "head_dim", 0);
  c.partial_rotary_factor = number(doc, "partial_rotary_factor", number(doc, "rotary_pct", 1.0));
  c.max_position_embeddings = integer(doc, "max_position_embeddings", 2048);
  c.top_level_original_max_position_embeddings = integer(doc, "original_max_position_embeddings", 0);
  const char* scaling_key = doc.contains("rope_scaling") && !doc["rope_scaling"].is_null() ? "rope_scaling"
                            : doc.contains("rope_parameters")                              ? "rope_parameters"
                                                                                           : nullptr;
  if (scaling_key == nullptr) return c;
  const nlohmann::json& s = doc[scaling_key];
  if (s.is_null()) return c;
  if (!s.is_object()) throw Error("config", scaling_key, s.dump(), "an object");
  for (const auto& [key, value] : s.items()) {
    if (value.is_object()) {  // transformers v5 per-layer form: {"full_attention": {...}, ...}
      throw Error("config", std::string(scaling_key) + "." + key, "an object",
                  "one set of RoPE keys (per-layer rope_parameters: pass that layer's object)");
    }
  }
  if (s.contains("rope_type")) {
    c.rope_type = s["rope_type"].get<std::string>();
  } else if (s.contains("type")) {
    c.rope_type = s["type"].get<std::string>();
  }
  c.rope_theta = number(s, "rope_theta", c.rope_theta);  // rope_parameters may carry it
  c.partial_rotary_factor = number(s, "partial_rotary_factor", c.partial_rotary_factor);
  c.original_max_position_embeddings = integer(s, "original_max_position_embeddings", 0);
  c.factor = number(s, "factor", kUnset);
  c.beta_fast = number(s, "beta_fast", kUnset);
  c.beta_slow = number(s, "beta_slow", kUnset);
  c.mscale = number(s, "mscale", 0.0);
  c.mscale_all_dim = number(s, "mscale_all_dim", 0.0);
  if (s.contains("truncate")) c.truncate = s["truncate"].get<bool>();
  c.attention_factor = number(s, "attention_factor", kUnset);
  c.low_freq_factor = number(s, "low_freq_factor", kUnset);
  c.high_freq_factor = number(s, "high_freq_factor", kUnset);
  c.short_factor = numbers(s, "short_factor");
  c.long_factor = numbers(s, "long_factor");
  return c;
}

void run_rope_freqs(const RopeFreqsOptions& o) {
  HfRopeConfig c;
  if (!o.config_path.empty()) {
    std::ifstream file(o.config_path);
    if (!file) throw Error("rope-freqs", "--config", o.config_path, "a readable JSON file");
    nlohmann::json doc;
    try {
      doc = nlohmann::json::parse(file);
    } catch (const nlohmann::json::exception& e) {
      throw Error("rope-freqs", "--config", o.config_path, std::string("valid JSON (") + e.what() + ")");
    }
    c = parse_config(doc);
  }
  if (!o.scaling.empty()) c.rope_type = o.scaling;
  if (o.head_dim > 0) c.head_dim = o.head_dim;
  if (!std::isnan(o.base)) c.rope_theta = o.base;
  if (!std::isnan(o.factor)) c.factor = o.factor;
  if (o.max_position_embeddings > 0) c.max_position_embeddings = o.max_position_embeddings;
  if (o.original_max_position_embeddings > 0) {  // the flag wins over both places a config may hold M0
    c.original_max_position_embeddings = o.original_max_position_embeddings;
    c.top_level_original_max_position_embeddings = 0;
  }
  if (!std::isnan(o.beta_fast)) c.beta_fast = o.beta_fast;
  if (!std::isnan(o.beta_slow)) c.beta_slow = o.beta_slow;
  if (!std::isnan(o.low_freq_factor)) c.low_freq_factor = o.low_freq_factor;
  if (!std::isnan(o.high_freq_factor)) c.high_freq_factor = o.high_freq_factor;
  if (!std::isnan(o.attention_factor)) c.attention_factor = o.attention_factor;
  if (o.rotary_dim > 0) {
    if (c.head_dim <= 0) {
      c.head_dim =
          c.hidden_size > 0 && c.num_attention_heads > 0 ? c.hidden_size / c.num_attention_heads : o.rotary_dim;
    }
    c.partial_rotary_factor = static_cast<double>(o.rotary_dim) / static_cast<double>(c.head_dim);
  }
  if (c.head_dim <= 0 && (c.hidden_size <= 0 || c.num_attention_heads <= 0)) c.head_dim = 128;
  const RopeParams params = rope_params_from_hf(c);
  const nlohmann::json doc = {{"rope_type", std::string(rope_type_name(params.scaling().type))},
                              {"head_dim", params.head_dim()},
                              {"rotary_dim", params.rotary_dim()},
                              {"base", params.base()},
                              {"seq_len", o.seq_len},
                              {"inv_freq", params.inv_frequencies(o.seq_len)},
                              {"attention_factor", params.attention_factor()}};
  fmt::print("{}\n", doc.dump());
}

}  // namespace

Runner add_rope_freqs(CLI::App& app) {
  auto o = std::make_shared<RopeFreqsOptions>();
  CLI::App* sub =
      app.add_subcommand("rope-freqs", "RoPE inverse frequencies and attention factor of a Hugging Face config");
  sub->add_option("--config", o->config_path, "config.json (or a JSON object with the same keys)");
  sub->add_option("--seq-len", o->seq_len, "Sequence length (dynamic and longrope depend on it; 0: initial)");
  sub->add_option("--scaling", o->scaling, "rope_type: default, linear, ntk, dynamic, yarn, longrope, llama3");
  sub->add_option("--head-dim", o->head_dim, "head_dim");
  sub->add_option("--rotary-dim", o->rotary_dim, "rotary_dim (partial rotary)");
  sub->add_option("--base", o->base, "rope_theta");
  sub->add_option("--factor", o->factor, "Scaling factor");
  sub->add_option("--max-position-embeddings", o->max_position_embeddings, "max_position_embeddings");
  sub->add_option("--original-max-position-embeddings", o->original_max_position_embeddings,
                  "M0 of yarn, longrope, llama3");
  sub->add_option("--beta-fast", o->beta_fast, "yarn beta_fast");
  sub->add_option("--beta-slow", o->beta_slow, "yarn beta_slow");
  sub->add_option("--low-freq-factor", o->low_freq_factor, "llama3 low_freq_factor");
  sub->add_option("--high-freq-factor", o->high_freq_factor, "llama3 high_freq_factor");
  sub->add_option("--attention-factor", o->attention_factor, "attention_factor");
  return [o] { run_rope_freqs(*o); };
}

}  // namespace posenc::cli
