// Per-layer RoPE from published config.json files (tests/data/) and proportional RoPE.
//
// Configs (rope-relevant keys as published on the Hugging Face Hub):
//   gemma-3-4b-it.json  google/gemma-3-4b-it: text_config with linear ×8 scaling, 34 layers; the
//                       rest are Gemma3TextConfig's defaults (rope_theta 1e6, rope_local_base_freq
//                       1e4, sliding_window_pattern 6, head_dim 256) — transformers'
//                       models/gemma3/configuration_gemma3.py
//   gpt-oss-20b.json    openai/gpt-oss-20b: yarn ×32 (beta 32 / 1, M0 4096, truncate false), θ 1.5e5,
//                       head_dim 64, layer_types alternating sliding / full
//   gemma-4-e2b.json    google/gemma-4-E2B: rope_parameters by layer type — sliding: default θ 1e4;
//                       full: proportional, θ 1e6, partial_rotary_factor 0.25 — head_dim 256,
//                       global_head_dim 512, every fifth layer full
//   llama-4-scout.json  meta-llama/Llama-4-Scout-17B-16E-Instruct's text_config: llama3 ×16 with
//                       low_freq_factor = high_freq_factor = 1, M0 8192, θ 5e5, chunks of 8192,
//                       floor_scale 8192, attn_scale 0.1 (an earlier base revision had ×8, high 4)
//   qwen3-vl.json       Qwen/Qwen3-VL-30B-A3B's text_config: default RoPE, θ 5e6, head_dim 128,
//                       mrope_section [24, 20, 20], mrope_interleaved
//   deepseek-v3.json    below
// Expected frequencies follow transformers' formulas (modeling_rope_utils.py:
// _compute_default_rope_parameters, _compute_linear_scaling_rope_parameters,
// _compute_proportional_rope_parameters), written here in fp64.
#include <cmath>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "testing.hpp"

namespace posenc {
namespace {

std::string read_data(const std::string& name) {
  std::ifstream file(std::string(POSENC_TEST_DATA_DIR) + "/" + name);
  std::stringstream text;
  text << file.rdbuf();
  EXPECT_FALSE(text.str().empty()) << name;
  return text.str();
}

// ω_i = θ^(−2i/d)/factor for i < turning, else 0 (i < d/2): transformers' default, linear and
// proportional frequencies.
std::vector<double> expected_frequencies(double theta, std::int64_t d, double factor, std::int64_t turning) {
  std::vector<double> w(static_cast<std::size_t>(d / 2));
  for (std::int64_t i = 0; i < d / 2; ++i) {
    w[static_cast<std::size_t>(i)] =
        i < turning ? std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(d)) / factor : 0.0;
  }
  return w;
}

// 4 ulps: posenc raises θ to −2i/d in long double and rounds once; std::pow in fp64 errs by an ulp.
void expect_frequencies(const RopeParams& p, const std::vector<double>& want, const std::string& what) {
  SCOPED_TRACE(what);
  const std::vector<double> got = p.inv_frequencies();
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 4 * std::ldexp(want[i], -52)) << i;
}

TEST(RopeConfigs, Gemma3SlidingLayersUseTheLocalBaseAndFullLayersTheScaling) {
  const std::string config = read_data("gemma-3-4b-it.json");
  for (const std::int64_t layer : {0, 4, 6, 33}) {  // (layer + 1) % 6 != 0: sliding
    const HfRopeConfig c = hf_rope_config_from_json(config, layer);
    EXPECT_EQ(c.layer_type, "sliding_attention") << layer;
    const RopeParams p = rope_params_from_hf(c);
    EXPECT_EQ(p.scaling().type, RopeType::kDefault);
    EXPECT_EQ(p.head_dim(), 256);
    expect_frequencies(p, expected_frequencies(1e4, 256, 1.0, 128), "sliding layer " + std::to_string(layer));
  }
  for (const std::int64_t layer : {5, 11, 29}) {
    const RopeParams p = rope_params_from_hf(config, layer);
    EXPECT_EQ(p.scaling().type, RopeType::kLinear);
    expect_frequencies(p, expected_frequencies(1e6, 256, 8.0, 128), "full layer " + std::to_string(layer));
  }
  testing::expect_error([&] { rope_params_from_hf(config); }, {"layer = missing", "rope_local_base_freq"});
  testing::expect_error([&] { rope_params_from_hf(config, 34); }, {"layer = 34", "[0, 34)"});
  testing::expect_error([&] { rope_params_from_hf(config, -1); }, {"layer = -1"});
}

TEST(RopeConfigs, GptOssLayersShareTheirYarn) {
  const std::string config = read_data("gpt-oss-20b.json");
  const HfRopeConfig sliding = hf_rope_config_from_json(config, 0), full = hf_rope_config_from_json(config, 23);
  EXPECT_EQ(sliding.layer_type, "sliding_attention");
  EXPECT_EQ(full.layer_type, "full_attention");
  const RopeParams a = rope_params_from_hf(sliding), b = rope_params_from_hf(full);
  EXPECT_EQ(a.inv_frequencies(), b.inv_frequencies());
  EXPECT_EQ(a.scaling().type, RopeType::kYarn);
  EXPECT_FALSE(a.scaling().truncate);
  EXPECT_EQ(a.scaling().factor, 32.0);
  EXPECT_EQ(a.original_max_position_embeddings(), 4096);
  EXPECT_EQ(a.head_dim(), 64);
  EXPECT_DOUBLE_EQ(a.attention_factor(), 0.1 * std::log(32.0) + 1.0);             // yarn's mscale(32)
  EXPECT_EQ(rope_params_from_hf(config).inv_frequencies(), a.inv_frequencies());  // no layer: the same
}

TEST(RopeConfigs, Gemma4FullLayersUseProportionalRopeOverTheGlobalHeadDim) {
  const std::string config = read_data("gemma-4-e2b.json");
  const RopeParams sliding = rope_params_from_hf(config, 0);
  EXPECT_EQ(sliding.head_dim(), 256);
  expect_frequencies(sliding, expected_frequencies(1e4, 256, 1.0, 128), "sliding");
  const HfRopeConfig c = hf_rope_config_from_json(config, 4);
  EXPECT_EQ(c.layer_type, "full_attention");
  const RopeParams full = rope_params_from_hf(c);
  EXPECT_EQ(full.scaling().type, RopeType::kProportional);
  EXPECT_EQ(full.head_dim(), 512);
  EXPECT_EQ(full.rotary_dim(), 512);  // the frequencies spread over the whole head
  // int(0.25 · 512 // 2) = 64 pairs turn with θ^(−2i/512); 192 do not.
  expect_frequencies(full, expected_frequencies(1e6, 512, 1.0, 64), "full");
  EXPECT_EQ(full.attention_factor(), 1.0);
  testing::expect_error([&] { rope_params_from_hf(config); }, {"layer = missing", "differs by layer type"});
}

// transformers serialises a Gemma 4 config (to_dict, save_pretrained) with per_layer_config in
// place of global_head_dim: the full layers' width comes from there.
TEST(RopeConfigs, Gemma4PerLayerConfigGivesTheFullLayersWidth) {
  const std::string body = R"("head_dim": 256, "num_hidden_layers": 2,
      "layer_types": ["sliding_attention", "full_attention"],
      "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                          "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                             "rope_theta": 1e6}})";
  const std::string config = "{" + body + R"(, "per_layer_config": {"1": {"head_dim": 512}}})";
  EXPECT_EQ(rope_params_from_hf(config, 0).head_dim(), 256);
  const RopeParams full = rope_params_from_hf(config, 1);
  EXPECT_EQ(full.head_dim(), 512);
  expect_frequencies(full, expected_frequencies(1e6, 512, 1.0, 64), "full");
  testing::expect_error(
      [&] { rope_params_from_hf("{" + body + R"(, "per_layer_config": {"1": {"rope_theta": 5e5}}})", 1); },
      {"per_layer_config.1.rope_theta = 500000.0", "no per-layer override"});
  testing::expect_error(
      [&] { rope_params_from_hf("{" + body + R"(, "per_layer_config": {"1": {"head_dim": 0}}})", 1); },
      {"per_layer_config.1.head_dim = 0"});
  testing::expect_error([&] { rope_params_from_hf("{" + body + R"(, "per_layer_config": [512]})", 1); },
                        {"per_layer_config = [512]", "an object keyed by layer index"});
}

// DeepSeek-V3 (tests/data/deepseek-v3.json, deepseek-ai/DeepSeek-V3's config.json: yarn ×40 with
// mscale = mscale_all_dim = 1, legacy key "type"; MLA heads of 128 + 64 dims): RoPE over the 64
// rotated dims, α = 1 (the mscales cancel), and the softmax scale 192^−½·(0.1·ln 40 + 1)².
TEST(RopeConfigs, DeepSeekV3RotatesItsRopeDimsAndScalesTheSoftmax) {
  const HfRopeConfig c = hf_rope_config_from_json(read_data("deepseek-v3.json"));
  const RopeParams p = rope_params_from_hf(c);
  EXPECT_EQ(p.head_dim(), 64);
  EXPECT_EQ(p.rotary_dim(), 64);
  EXPECT_EQ(p.scaling().type, RopeType::kYarn);
  EXPECT_EQ(p.original_max_position_embeddings(), 4096);
  EXPECT_EQ(p.attention_factor(), 1.0);
  EXPECT_EQ(c.qk_head_dim, 192);
  const double m = 0.1 * std::log(40.0) + 1.0;
  EXPECT_DOUBLE_EQ(mla_softmax_scale(c), m * m / std::sqrt(192.0));
  testing::expect_error([&] { mla_softmax_scale(hf_rope_config_from_json(read_data("gpt-oss-20b.json"))); },
                        {"qk_rope_head_dim = missing"});
}

// Llama 4 Scout's llama3 scaling has equal low and high factors, so no band is blended (transformers
// only warns): wavelengths above M0 = 8192 are divided by 16, the others kept.
TEST(RopeConfigs, Llama4ScoutDividesOnlyTheLongWavelengths) {
  const RopeParams p = rope_params_from_hf(read_data("llama-4-scout.json"));
  EXPECT_EQ(p.scaling().type, RopeType::kLlama3);
  const std::vector<double> plain = expected_frequencies(5e5, 128, 1.0, 64), got = p.inv_frequencies();
  int divided = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const bool long_wave = 2 * M_PI / plain[i] > 8192.0;
    divided += long_wave ? 1 : 0;
    EXPECT_NEAR(got[i], long_wave ? plain[i] / 16 : plain[i], 4 * std::ldexp(plain[i], -52)) << i;
  }
  EXPECT_GT(divided, 0);
  EXPECT_LT(divided, 64);
}

// Qwen3-VL's rope_scaling names its M-RoPE: the config gives the sections and the interleaving
// that rope_apply_axes takes.
TEST(RopeConfigs, Qwen3VlNamesItsInterleavedSections) {
  const HfRopeConfig c = hf_rope_config_from_json(read_data("qwen3-vl.json"));
  EXPECT_EQ(c.mrope_section, (std::vector<std::int64_t>{24, 20, 20}));
  EXPECT_TRUE(c.mrope_interleaved);
  const RopeParams p = rope_params_from_hf(c);
  EXPECT_EQ(p.scaling().type, RopeType::kDefault);
  expect_frequencies(p, expected_frequencies(5e6, 128, 1.0, 64), "qwen3-vl");
  testing::expect_error(
      [] { hf_rope_config_from_json(R"({"rope_scaling": {"rope_type": "default", "mrope_section": [24, 2.5]}})"); },
      {"rope_scaling.mrope_section", "integers >= 1"});
  // Sections that do not cover the rotary pairs (transformers' split of cos and sin fails).
  HfRopeConfig wrong = c;
  wrong.mrope_section = {16, 24, 99};
  testing::expect_error([&] { rope_params_from_hf(wrong); },
                        {"mrope_section = [16, 24, 99]", "sum to rotary_dim / 2 = 64"});
}

// transformers looks rope_scaling's type up and fails without one: so does posenc, by name.
TEST(RopeConfigs, RopeScalingWithoutATypeIsRefused) {
  testing::expect_error([] { hf_rope_config_from_json(R"({"rope_scaling": {"factor": 2.0}, "head_dim": 64})"); },
                        {"rope_scaling.rope_type = missing"});
  testing::expect_error([] { hf_rope_config_from_json(R"({"rope_scaling": {}, "head_dim": 64})"); },
                        {"rope_scaling.rope_type = missing"});
  EXPECT_EQ(hf_rope_config_from_json(R"({"rope_scaling": {"type": "linear", "factor": 2.0}})").rope_type, "linear");
}

// Proportional RoPE rotates only its first pairs: the others are copied exactly, and a turning
// pair at position p has turned by p·ω_i.
TEST(RopeConfigs, ProportionalRopeLeavesTheOtherPairsUnchanged) {
  RopeScaling s;
  s.type = RopeType::kProportional;
  s.partial_rotary_factor = 0.25;
  s.factor = 2.0;
  const RopeParams p(16, 16, 10000.0, RopeLayout::kHalfSplit, s);
  const std::vector<double> w = p.inv_frequencies();
  EXPECT_EQ(w, expected_frequencies(10000.0, 16, 2.0, 2));  // ⌊0.25·16/2⌋ = 2 pairs
  std::vector<float> q(3 * 16), out(q.size());
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = static_cast<float>(0.25 * static_cast<double>(i % 7) - 0.5);
  rope_apply(p, Positions::range(3, 40), ConstTensorView::of(q.data(), {3, 1, 16}), ConstTensorView{},
             TensorView::of(out.data(), {3, 1, 16}), TensorView{});
  for (std::int64_t s0 = 0; s0 < 3; ++s0) {
    for (std::int64_t i = 0; i < 8; ++i) {
      const auto a = static_cast<std::size_t>(s0 * 16 + i), b = a + 8;
      if (i >= 2) {
        EXPECT_EQ(out[a], q[a]);
        EXPECT_EQ(out[b], q[b]);
        continue;
      }
      const double angle = static_cast<double>(40 + s0) * w[static_cast<std::size_t>(i)];
      EXPECT_NEAR(out[a], q[a] * std::cos(angle) - q[b] * std::sin(angle), 1e-6);
      EXPECT_NEAR(out[b], q[b] * std::cos(angle) + q[a] * std::sin(angle), 1e-6);
    }
  }
  s.partial_rotary_factor = 1.5;
  testing::expect_error([&] { RopeParams bad(16, 16, 10000.0, RopeLayout::kHalfSplit, s); },
                        {"partial_rotary_factor = 1.5", "proportional"});
}

TEST(RopeConfigs, RefusesConfigsThatDoNotMatchTheirLayers) {
  const std::string types = R"("num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"])";
  const std::string both = R"("rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                                  "full_attention": {"rope_type": "default", "rope_theta": 1e6}})";
  const auto config = [](const std::string& body) { return "{\"head_dim\": 64, " + body + "}"; };
  EXPECT_EQ(rope_params_from_hf(config(types + ", " + both), 1).base(), 1e6);
  // A layer type without its entry, an entry for a type no layer has, no layer_types, no layer.
  testing::expect_error(
      [&] {
        rope_params_from_hf(config(types + R"(, "rope_parameters": {"full_attention": {"rope_theta": 1e6}})"), 0);
      },
      {"rope_parameters.sliding_attention = missing", "layer 0"});
  testing::expect_error(
      [&] {
        rope_params_from_hf(config(types + R"(, "rope_parameters": {"full_attention": {}, "chunked_attention": {}})"),
                            1);
      },
      {"rope_parameters.chunked_attention", "layer type that layer_types names"});
  testing::expect_error([&] { rope_params_from_hf(config(both), 0); }, {"layer_types = missing"});
  testing::expect_error([&] { rope_params_from_hf(config(types + ", " + both)); }, {"layer = missing"});
  testing::expect_error([&] { rope_params_from_hf(config(R"("num_hidden_layers": 3, "layer_types": ["a", "b"])")); },
                        {"layer_types = 2 entries", "num_hidden_layers = 3"});
  // sliding_window_pattern gives the layers' types only when a layer is asked for.
  EXPECT_NO_THROW(rope_params_from_hf(R"({"head_dim": 64, "sliding_window_pattern": 4})"));
  testing::expect_error([&] { rope_params_from_hf(R"({"head_dim": 64, "sliding_window_pattern": 4})", 2); },
                        {"num_hidden_layers = missing"});
  // Explicit values are checked, never taken as unset.
  testing::expect_error([&] { rope_params_from_hf(R"({"hidden_size": 4096, "num_attention_heads": -32})"); },
                        {"num_attention_heads = -32"});
  testing::expect_error([&] { rope_params_from_hf(R"({"head_dim": 64, "rope_theta": "big"})"); },
                        {"rope_theta = \"big\"", "a number"});
  testing::expect_error([&] { rope_params_from_hf("{\"head_dim\": 64,"); }, {"valid JSON"});
}

}  // namespace
}  // namespace posenc
