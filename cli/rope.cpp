// posenc rope-freqs --config config.json [--layer N] [--seq-len N]   (or flags instead of a file)
// Prints {"rope_type", "head_dim", "rotary_dim", "base", "inv_freq", "attention_factor"} (and
// "layer_type" for a config that differs by layer) for a Hugging Face config (or any JSON object
// holding the same keys).
#include <fmt/core.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <optional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "commands.hpp"
#include "posenc/posenc.hpp"

namespace posenc::cli {
namespace {

// Every flag is optional: given, it overrides the config (and is checked like a config's value);
// absent, the config's value (or transformers' default) stands. No value means "unset".
struct RopeFreqsOptions {
  std::string config_path;
  std::optional<std::int64_t> layer;
  std::string against;  // "ggml": compare with llama.cpp's convention
  std::int64_t seq_len = 0;
  std::optional<std::string> scaling;
  std::optional<std::int64_t> head_dim, rotary_dim, max_position_embeddings, original_max_position_embeddings;
  std::optional<double> base, factor, beta_fast, beta_slow, low_freq_factor, high_freq_factor, attention_factor;
};

std::int64_t at_least(const char* flag, std::int64_t value, std::int64_t minimum) {
  if (value < minimum) throw Error("rope-freqs", flag, std::to_string(value), ">= " + std::to_string(minimum));
  return value;
}

// NaN stands for "unset" in HfRopeConfig: a NaN flag would vanish there, so it is refused here.
double number(const char* flag, double value) {
  if (std::isnan(value)) throw Error("rope-freqs", flag, "nan", "a number");
  return value;
}

void run_rope_freqs(const RopeFreqsOptions& o) {
  HfRopeConfig c;
  if (!o.config_path.empty()) {
    std::ifstream file(o.config_path);
    if (!file) throw Error("rope-freqs", "--config", o.config_path, "a readable JSON file");
    std::stringstream text;
    text << file.rdbuf();
    c = hf_rope_config_from_json(text.str(), o.layer);
  } else if (o.layer) {
    throw Error("rope-freqs", "--layer", std::to_string(*o.layer), "given with --config (a layer of that model)");
  }
  if (o.scaling) c.rope_type = *o.scaling;
  if (o.head_dim) c.head_dim = at_least("--head-dim", *o.head_dim, 1);
  if (o.base) c.rope_theta = number("--base", *o.base);
  if (o.factor) c.factor = number("--factor", *o.factor);
  if (o.max_position_embeddings)
    c.max_position_embeddings = at_least("--max-position-embeddings", *o.max_position_embeddings, 1);
  if (o.original_max_position_embeddings) {  // the flag wins over both places a config may hold M0
    c.original_max_position_embeddings =
        at_least("--original-max-position-embeddings", *o.original_max_position_embeddings, 1);
    c.top_level_original_max_position_embeddings = 0;
  }
  if (o.beta_fast) c.beta_fast = number("--beta-fast", *o.beta_fast);
  if (o.beta_slow) c.beta_slow = number("--beta-slow", *o.beta_slow);
  if (o.low_freq_factor) c.low_freq_factor = number("--low-freq-factor", *o.low_freq_factor);
  if (o.high_freq_factor) c.high_freq_factor = number("--high-freq-factor", *o.high_freq_factor);
  if (o.attention_factor) c.attention_factor = number("--attention-factor", *o.attention_factor);
  if (o.rotary_dim) {
    at_least("--rotary-dim", *o.rotary_dim, 2);
    if (c.head_dim <= 0) {
      c.head_dim =
          c.hidden_size > 0 && c.num_attention_heads > 0 ? c.hidden_size / c.num_attention_heads : *o.rotary_dim;
    }
    if (*o.rotary_dim > c.head_dim) {
      throw Error("rope-freqs", "--rotary-dim", std::to_string(*o.rotary_dim),
                  "<= head_dim = " + std::to_string(c.head_dim));
    }
    // transformers truncates head_dim · factor: half a dimension above rotary_dim truncates back to
    // it exactly, where rotary_dim / head_dim itself may fall just below (44 · (30/44) = 29.99…).
    c.partial_rotary_factor = *o.rotary_dim == c.head_dim
                                  ? 1.0
                                  : (static_cast<double>(*o.rotary_dim) + 0.5) / static_cast<double>(c.head_dim);
  }
  if (o.seq_len < 0) throw Error("rope-freqs", "--seq-len", std::to_string(o.seq_len), ">= 0");
  // Neither a config nor --head-dim says: Llama's 128.
  if (c.head_dim <= 0 && (c.hidden_size <= 0 || c.num_attention_heads <= 0)) c.head_dim = 128;
  const RopeParams params = rope_params_from_hf(c);
  nlohmann::json doc = {{"rope_type", std::string(rope_type_name(params.scaling().type))},
                        {"head_dim", params.head_dim()},
                        {"rotary_dim", params.rotary_dim()},
                        {"base", params.base()},
                        {"seq_len", o.seq_len},
                        {"inv_freq", params.inv_frequencies(o.seq_len)},
                        {"attention_factor", params.attention_factor()}};
  if (!c.layer_type.empty()) doc["layer_type"] = c.layer_type;
  if (c.qk_head_dim > 0) doc["softmax_scale"] = mla_softmax_scale(c);  // MLA: DeepSeek's scale
  if (!c.mrope_section.empty()) {                                      // M-RoPE: each pair's axis (rope_apply_axes)
    doc["mrope_section"] = c.mrope_section;
    doc["mrope_interleaved"] = c.mrope_interleaved;
    doc["axis_of_pair"] =
        mrope_axis_of_pair(c.mrope_section, c.mrope_interleaved ? MropeLayout::kInterleaved : MropeLayout::kSections);
  }
  if (!o.against.empty()) {
    if (o.against != "ggml") throw Error("rope-freqs", "--against", o.against, "ggml");
    doc["conformance"] = compare_with_ggml(c, params);
  }
  fmt::print("{}\n", doc.dump());
}

}  // namespace

Runner add_rope_freqs(CLI::App& app) {
  auto o = std::make_shared<RopeFreqsOptions>();
  CLI::App* sub =
      app.add_subcommand("rope-freqs", "RoPE inverse frequencies and attention factor of a Hugging Face config");
  sub->add_option("--config", o->config_path, "config.json (or a JSON object with the same keys)");
  sub->add_option_function<std::int64_t>(
      "--layer", [o](std::int64_t layer) { o->layer = layer; },
      "Layer N of a config whose RoPE differs by layer (layer_types with per-type rope_parameters, Gemma 3's "
      "rope_local_base_freq)");
  sub->add_option("--against", o->against,
                  "ggml: also print llama.cpp's frequencies and attention factor for this config and the largest "
                  "differences from transformers'");
  sub->add_option("--seq-len", o->seq_len, "Sequence length (dynamic and longrope depend on it; 0: initial)");
  add_optional(sub, "--scaling", o->scaling,
               "rope_type: default, linear, ntk, dynamic, yarn, longrope, llama3, proportional");
  add_optional(sub, "--head-dim", o->head_dim, "head_dim (default: the config's, else 128)");
  add_optional(sub, "--rotary-dim", o->rotary_dim, "rotary_dim (partial rotary)");
  add_optional(sub, "--base", o->base, "rope_theta");
  add_optional(sub, "--factor", o->factor, "Scaling factor");
  add_optional(sub, "--max-position-embeddings", o->max_position_embeddings, "max_position_embeddings");
  add_optional(sub, "--original-max-position-embeddings", o->original_max_position_embeddings,
               "M0 of yarn, longrope, llama3");
  add_optional(sub, "--beta-fast", o->beta_fast, "yarn beta_fast");
  add_optional(sub, "--beta-slow", o->beta_slow, "yarn beta_slow");
  add_optional(sub, "--low-freq-factor", o->low_freq_factor, "llama3 low_freq_factor");
  add_optional(sub, "--high-freq-factor", o->high_freq_factor, "llama3 high_freq_factor");
  add_optional(sub, "--attention-factor", o->attention_factor, "attention_factor");
  return [o] { run_rope_freqs(*o); };
}

}  // namespace posenc::cli
