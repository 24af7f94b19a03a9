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

constexpr double kUnset = std::numeric_limits<double>::quiet_NaN();

struct RopeFreqsOptions {
  std::string config_path;
  std::optional<std::int64_t> layer;
  std::string against;  // "ggml": compare with llama.cpp's convention
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
  sub->add_option("--scaling", o->scaling,
                  "rope_type: default, linear, ntk, dynamic, yarn, longrope, llama3, proportional");
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
