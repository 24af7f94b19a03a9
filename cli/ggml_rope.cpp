// posenc rope-freqs … --against ggml: how llama.cpp's ggml would compute the same config's RoPE,
// and how far that is from transformers' semantics (which posenc follows, in fp64).
//
// ggml's convention (ggml/src/ggml-cpu/ops.cpp, ggml_rope_cache_init / rope_yarn, and
// ggml_rope_yarn_corr_dims in ggml.c), all in f32:
//   θ_scale = base^(−2/n_dims) (powf), the pairs' angles p·θ_scale^i by repeated f32 products;
//   freq_scale = 1/factor; with ext_factor (yarn) each angle blends p·ω_i·freq_scale and p·ω_i by
//   1 − clamp((i − low)/max(0.001, high − low), 0, 1), low and high always floored and ceiled
//   (transformers skips that when rope_scaling.truncate is false, as gpt-oss sets it);
//   cos and sin are multiplied by attn_factor·(1 + 0.1·ln factor) under yarn.
// llama.cpp maps rope types onto these parameters: linear and yarn directly; llama3 and longrope
// through per-pair frequency factors its converter writes in f32 (rope_freqs, rope_factors_*);
// DeepSeek's MLA (deepseek2) sets attn_factor so that the cos/sin factor is 1 and moves mscale²
// into the softmax scale, as transformers does. Dynamic NTK, posenc's static ntk and proportional
// (zero frequencies) have no ggml form.
#include <cmath>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "commands.hpp"
#include "posenc/posenc.hpp"

namespace posenc::cli {

namespace {

// ggml_rope_yarn_corr_dim in f32.
float ggml_corr_dim(int n_dims, int n_ctx_orig, float n_rot, float base) {
  return static_cast<float>(n_dims) *
         std::log(static_cast<float>(n_ctx_orig) / (n_rot * 2.0f * static_cast<float>(M_PI))) / (2.0f * std::log(base));
}

}  // namespace

nlohmann::json compare_with_ggml(const HfRopeConfig& config, const RopeParams& hf) {
  nlohmann::json out = {{"against", "ggml"}};
  const RopeScaling& s = hf.scaling();
  const char* missing = nullptr;
  switch (s.type) {
    case RopeType::kDynamic:
      missing = "dynamic NTK: ggml has no length-dependent base (llama.cpp keeps the frequencies fixed)";
      break;
    case RopeType::kNtk:
      missing = "static NTK: ggml takes the base as given (pass base*factor^(r/(r-2)) as freq_base instead)";
      break;
    case RopeType::kProportional:
      missing = "proportional: ggml's frequency factors cannot stop a pair (its frequency would be 0)";
      break;
    default:
      break;
  }
  if (missing != nullptr) {
    out["expressible"] = false;
    out["reason"] = missing;
    return out;
  }
  out["expressible"] = true;
  const int n_dims = static_cast<int>(hf.rotary_dim());
  const std::int64_t pairs = hf.rotary_dim() / 2;
  const auto base = static_cast<float>(hf.base());
  const float theta_scale = std::pow(base, -2.0f / static_cast<float>(n_dims));
  const std::vector<double> want = hf.inv_frequencies();
  // Per-pair factors as llama.cpp's converter stores them (f32): llama3's and longrope's scaled
  // frequencies relative to the default ones.
  std::vector<float> freq_factors(static_cast<std::size_t>(pairs), 1.0f);
  if (s.type == RopeType::kLlama3 || s.type == RopeType::kLongRope) {
    const std::vector<double> plain = RopeParams(hf.head_dim(), hf.rotary_dim(), hf.base()).inv_frequencies();
    for (std::size_t i = 0; i < freq_factors.size(); ++i) freq_factors[i] = static_cast<float>(plain[i] / want[i]);
  }
  const bool yarn = s.type == RopeType::kYarn;
  const float freq_scale = s.type == RopeType::kLinear || yarn ? static_cast<float>(1.0 / s.factor) : 1.0f;
  float low = 0, high = 0;
  if (yarn) {
    const auto m0 = static_cast<int>(hf.original_max_position_embeddings());
    low = std::max(0.0f, std::floor(ggml_corr_dim(n_dims, m0, static_cast<float>(s.beta_fast), base)));
    high = std::min(static_cast<float>(n_dims - 1),
                    std::ceil(ggml_corr_dim(n_dims, m0, static_cast<float>(s.beta_slow), base)));
    // transformers' range (fp64; floored and ceiled only when truncate is set).
    const auto hf_dim = [&](double rotations) {
      return static_cast<double>(n_dims) * std::log(static_cast<double>(m0) / (rotations * 2.0 * M_PI)) /
             (2.0 * std::log(hf.base()));
    };
    double hf_low = hf_dim(s.beta_fast), hf_high = hf_dim(s.beta_slow);
    if (s.truncate) hf_low = std::floor(hf_low), hf_high = std::ceil(hf_high);
    out["yarn_correction_range"] = {{"ggml", {low, high}},
                                    {"transformers", {std::max(hf_low, 0.0), std::min(hf_high, n_dims - 1.0)}}};
  }
  // Each pair's frequency as ggml forms the angle at position 1 (θ = p·θ_scale^i, then the blend).
  double worst = 0, worst_angle = 0;
  std::int64_t worst_pair = 0;
  const auto far = static_cast<double>(hf.max_position_embeddings());
  std::vector<double> ggml_freq(static_cast<std::size_t>(pairs));
  float theta_extrap = 1.0f;
  for (std::int64_t i = 0; i < pairs; ++i) {
    const float extrap = theta_extrap / freq_factors[static_cast<std::size_t>(i)];
    float theta = freq_scale * extrap;
    if (yarn) {
      const float y = (static_cast<float>(i) - low) / std::max(0.001f, high - low);
      const float ramp_mix = 1.0f - std::min(1.0f, std::max(0.0f, y));
      theta = theta * (1.0f - ramp_mix) + extrap * ramp_mix;
    }
    ggml_freq[static_cast<std::size_t>(i)] = theta;
    const double rel =
        std::fabs(static_cast<double>(theta) - want[static_cast<std::size_t>(i)]) / want[static_cast<std::size_t>(i)];
    if (rel > worst) worst = rel, worst_pair = i;
    worst_angle =
        std::max(worst_angle, std::fabs(static_cast<double>(theta) - want[static_cast<std::size_t>(i)]) * far);
    theta_extrap *= theta_scale;
  }
  // cos/sin factor: ggml multiplies attn_factor by 1 + 0.1·ln factor under yarn; llama.cpp passes
  // attn_factor 1 except for MLA (deepseek2: the product is 1) and longrope (the converter's α).
  double ggml_alpha = 1.0;
  if (yarn && config.qk_head_dim == 0) ggml_alpha = 1.0 + 0.1 * std::log(s.factor);
  if (s.type == RopeType::kLongRope) ggml_alpha = hf.attention_factor();
  out["max_relative_inv_freq_difference"] = worst;
  out["at_pair"] = worst_pair;
  out["inv_freq_ggml"] = ggml_freq;
  out["attention_factor"] = {{"transformers", hf.attention_factor()}, {"ggml", ggml_alpha}};
  out["attention_factor_relative_difference"] = std::fabs(ggml_alpha - hf.attention_factor()) / hf.attention_factor();
  // The largest angle error those frequencies make at the model's longest position.
  out["angle_difference_at_max_position"] = {{"position", hf.max_position_embeddings()}, {"radians", worst_angle}};
  return out;
}

}  // namespace posenc::cli
