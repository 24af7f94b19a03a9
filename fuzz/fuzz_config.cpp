// config.json → RoPE: any text, any layer. The reader returns a config or names the bad key; a
// config it accepts gives RoPE parameters (or an error naming the key) whose frequencies and
// attention factor are finite, as are the frequencies ggml's comparison and MLA's scale derive.
#include <cmath>
#include <optional>
#include <string>

#include "fuzzing.hpp"

using namespace posenc;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::set_up();
  fuzz::Input in(data, size);
  std::optional<std::int64_t> layer;
  const std::uint8_t how = in.byte();
  if (how & 1) layer = (how & 2) ? in.any_integer() : in.integer(0, 63);
  const RopeLayout layout = (how & 4) ? RopeLayout::kInterleaved : RopeLayout::kHalfSplit;
  const std::string json = in.rest();

  std::optional<HfRopeConfig> config;
  fuzz::accepted("hf_rope_config_from_json", [&] { config = hf_rope_config_from_json(json, layer); });
  if (!config) return 0;
  if (config->qk_head_dim > 0) {
    fuzz::accepted("mla_softmax_scale", [&] {
      const double s = mla_softmax_scale(*config);
      fuzz::require(std::isfinite(s) && s > 0, "mla_softmax_scale is " + std::to_string(s));
    });
  }
  std::optional<RopeParams> params;
  fuzz::accepted("rope_params_from_hf", [&] { params = rope_params_from_hf(*config, layout); });
  if (!params) return 0;
  const double alpha = params->attention_factor();
  fuzz::require(std::isfinite(alpha) && alpha > 0, "attention factor " + std::to_string(alpha));
  const std::int64_t m = params->max_position_embeddings();
  for (const std::int64_t seq_len :
       {std::int64_t{0}, std::int64_t{1}, m, m < (std::int64_t{1} << 40) ? 2 * m + 1 : m}) {
    for (const double w : params->inv_frequencies(seq_len)) {
      fuzz::require(std::isfinite(w) && w >= 0,
                    "inverse frequency " + std::to_string(w) + " at seq_len " + std::to_string(seq_len));
    }
  }
  return 0;
}
