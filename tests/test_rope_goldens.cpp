// Golden inverse frequencies from Hugging Face transformers' own regression snapshots.
//
// Source: huggingface/transformers, tests/utils/test_modeling_rope_utils.py (commit 087e800), the
// EXPECTED_INV_FREQ tensors of test_default_rope_numerically, test_dynamic_rope_numerically,
// test_yarn_rope_numerically and test_llama3_rope_numerically. Their configuration is
// LlamaConfig's defaults: hidden_size 4096, 32 heads (head_dim 128), rope_theta 10000,
// max_position_embeddings 2048, and
//   dynamic  factor 10 at seq_len 16384
//   yarn     factor 10, beta_fast 32, beta_slow 1 (M0 = max_position_embeddings)
//   llama3   factor 10, original_max_position_embeddings 2048, low 1, high 4.
// transformers prints them with five significant digits; they are data (published figures), and
// posenc computes its values independently in fp64 (src/rotary.cpp, docs/hf-rope-semantics.md).
#include <cmath>

#include "testing.hpp"

namespace posenc {
namespace {

// clang-format off
const double kDefault[64] = {
    1.0000e+00, 8.6596e-01, 7.4989e-01, 6.4938e-01, 5.6234e-01, 4.8697e-01, 4.2170e-01, 3.6517e-01,
    3.1623e-01, 2.7384e-01, 2.3714e-01, 2.0535e-01, 1.7783e-01, 1.5399e-01, 1.3335e-01, 1.1548e-01,
    1.0000e-01, 8.6596e-02, 7.4989e-02, 6.4938e-02, 5.6234e-02, 4.8697e-02, 4.2170e-02, 3.6517e-02,
    3.1623e-02, 2.7384e-02, 2.3714e-02, 2.0535e-02, 1.7783e-02, 1.5399e-02, 1.3335e-02, 1.1548e-02,
    1.0000e-02, 8.6596e-03, 7.4989e-03, 6.4938e-03, 5.6234e-03, 4.8697e-03, 4.2170e-03, 3.6517e-03,
    3.1623e-03, 2.7384e-03, 2.3714e-03, 2.0535e-03, 1.7783e-03, 1.5399e-03, 1.3335e-03, 1.1548e-03,
    1.0000e-03, 8.6596e-04, 7.4989e-04, 6.4938e-04, 5.6234e-04, 4.8697e-04, 4.2170e-04, 3.6517e-04,
    3.1623e-04, 2.7384e-04, 2.3714e-04, 2.0535e-04, 1.7783e-04, 1.5399e-04, 1.3335e-04, 1.1548e-04};
const double kDynamic[64] = {
    1.0000e+00, 8.0931e-01, 6.5498e-01, 5.3008e-01, 4.2900e-01, 3.4720e-01, 2.8099e-01, 2.2741e-01,
    1.8404e-01, 1.4895e-01, 1.2055e-01, 9.7558e-02, 7.8955e-02, 6.3899e-02, 5.1714e-02, 4.1853e-02,
    3.3872e-02, 2.7413e-02, 2.2185e-02, 1.7955e-02, 1.4531e-02, 1.1760e-02, 9.5176e-03, 7.7027e-03,
    6.2339e-03, 5.0451e-03, 4.0831e-03, 3.3045e-03, 2.6744e-03, 2.1644e-03, 1.7517e-03, 1.4176e-03,
    1.1473e-03, 9.2852e-04, 7.5146e-04, 6.0817e-04, 4.9220e-04, 3.9834e-04, 3.2238e-04, 2.6091e-04,
    2.1115e-04, 1.7089e-04, 1.3830e-04, 1.1193e-04, 9.0585e-05, 7.3312e-05, 5.9332e-05, 4.8018e-05,
    3.8861e-05, 3.1451e-05, 2.5453e-05, 2.0600e-05, 1.6672e-05, 1.3492e-05, 1.0920e-05, 8.8374e-06,
    7.1522e-06, 5.7883e-06, 4.6845e-06, 3.7912e-06, 3.0683e-06, 2.4832e-06, 2.0097e-06, 1.6265e-06};
const double kYarn[64] = {
    1.0000e+00, 8.6596e-01, 7.4989e-01, 6.4938e-01, 5.6234e-01, 4.8697e-01, 4.2170e-01, 3.6517e-01,
    3.1623e-01, 2.7384e-01, 2.3714e-01, 2.0535e-01, 1.7783e-01, 1.5399e-01, 1.3335e-01, 1.1548e-01,
    1.0000e-01, 8.3479e-02, 6.9590e-02, 5.7925e-02, 4.8136e-02, 3.9931e-02, 3.3061e-02, 2.7315e-02,
    2.2515e-02, 1.8512e-02, 1.5177e-02, 1.2403e-02, 1.0101e-02, 8.1924e-03, 6.6143e-03, 5.3120e-03,
    4.2400e-03, 3.3599e-03, 2.6396e-03, 2.0520e-03, 1.5746e-03, 1.1882e-03, 8.7713e-04, 6.2810e-04,
    4.3007e-04, 2.7384e-04, 2.3714e-04, 2.0535e-04, 1.7783e-04, 1.5399e-04, 1.3335e-04, 1.1548e-04,
    1.0000e-04, 8.6596e-05, 7.4989e-05, 6.4938e-05, 5.6234e-05, 4.8697e-05, 4.2170e-05, 3.6517e-05,
    3.1623e-05, 2.7384e-05, 2.3714e-05, 2.0535e-05, 1.7783e-05, 1.5399e-05, 1.3335e-05, 1.1548e-05};
const double kLlama3[64] = {
    1.0000e+00, 8.6596e-01, 7.4989e-01, 6.4938e-01, 5.6234e-01, 4.8697e-01, 4.2170e-01, 3.6517e-01,
    3.1623e-01, 2.7384e-01, 2.3714e-01, 2.0535e-01, 1.7783e-01, 1.5399e-01, 1.3335e-01, 1.1548e-01,
    1.0000e-01, 8.6596e-02, 7.4989e-02, 6.4938e-02, 5.6234e-02, 4.8697e-02, 4.2170e-02, 3.6517e-02,
    3.1623e-02, 2.7384e-02, 2.3714e-02, 2.0535e-02, 1.7783e-02, 1.5399e-02, 1.3335e-02, 1.0730e-02,
    7.7785e-03, 5.6009e-03, 3.9991e-03, 2.8248e-03, 1.9675e-03, 1.3449e-03, 8.9549e-04, 5.7363e-04,
    3.4539e-04, 2.7384e-04, 2.3714e-04, 2.0535e-04, 1.7783e-04, 1.5399e-04, 1.3335e-04, 1.1548e-04,
    1.0000e-04, 8.6596e-05, 7.4989e-05, 6.4938e-05, 5.6234e-05, 4.8697e-05, 4.2170e-05, 3.6517e-05,
    3.1623e-05, 2.7384e-05, 2.3714e-05, 2.0535e-05, 1.7783e-05, 1.5399e-05, 1.3335e-05, 1.1548e-05};
// clang-format on

// Five significant digits: the printed value is within half a unit of its fifth digit of the
// true one (transformers computes in fp32, whose error is far below that). Checked exactly that
// tight: |got − want| <= 0.5·10^(e−4) for want = m·10^e, 1 <= m < 10 (plus 1e-12 relative for the
// decimal-to-binary conversion of the bound itself).
void expect_matches_printed(const std::vector<double>& got, const double (&want)[64], const char* what) {
  ASSERT_EQ(got.size(), 64u) << what;
  for (std::size_t i = 0; i < 64; ++i) {
    const double exponent = std::floor(std::log10(want[i]));
    const double half_unit = 0.5 * std::pow(10.0, exponent - 4) * (1 + 1e-12);
    EXPECT_LE(std::fabs(got[i] - want[i]), half_unit)
        << what << " inv_freq[" << i << "] = " << got[i] << ", transformers " << want[i];
  }
}

HfRopeConfig llama_config() {
  HfRopeConfig c;
  c.hidden_size = 4096;
  c.num_attention_heads = 32;
  c.rope_theta = 10000;
  c.max_position_embeddings = 2048;
  return c;
}

TEST(RopeGoldens, TransformersDefault) {
  const RopeParams p = rope_params_from_hf(llama_config());
  expect_matches_printed(p.inv_frequencies(), kDefault, "default");
  EXPECT_EQ(p.attention_factor(), 1.0);
}

TEST(RopeGoldens, TransformersDynamicAt16384) {
  HfRopeConfig c = llama_config();
  c.rope_type = "dynamic";
  c.factor = 10;
  const RopeParams p = rope_params_from_hf(c);
  expect_matches_printed(p.inv_frequencies(16384), kDynamic, "dynamic");
  // Within the original length dynamic is the default table (transformers' "Check 1").
  expect_matches_printed(p.inv_frequencies(2048), kDefault, "dynamic at 2048");
  EXPECT_EQ(p.attention_factor(), 1.0);
}

TEST(RopeGoldens, TransformersYarn) {
  HfRopeConfig c = llama_config();
  c.rope_type = "yarn";
  c.factor = 10;
  c.beta_fast = 32;
  c.beta_slow = 1;
  const RopeParams p = rope_params_from_hf(c);
  expect_matches_printed(p.inv_frequencies(), kYarn, "yarn");
  EXPECT_DOUBLE_EQ(p.attention_factor(), 0.1 * std::log(10.0) + 1.0);
}

TEST(RopeGoldens, TransformersLlama3) {
  HfRopeConfig c = llama_config();
  c.rope_type = "llama3";
  c.factor = 10;
  c.original_max_position_embeddings = 2048;
  c.low_freq_factor = 1;
  c.high_freq_factor = 4;
  const RopeParams p = rope_params_from_hf(c);
  expect_matches_printed(p.inv_frequencies(), kLlama3, "llama3");
  EXPECT_EQ(p.attention_factor(), 1.0);
}

// transformers' longrope checks are relations, reproduced here: factor 1 applies the short
// factors, factor 10 the long ones (1, 2, …, 64), and α = sqrt(1 + ln s / ln M0).
TEST(RopeGoldens, TransformersLongropeRelations) {
  HfRopeConfig c = llama_config();
  c.rope_type = "longrope";
  c.short_factor.assign(64, 2.0);
  for (int i = 0; i < 64; ++i) c.long_factor.push_back(i + 1.0);
  for (const double factor : {2.0, 10.0, 20.0}) {
    c.factor = factor;
    EXPECT_DOUBLE_EQ(rope_params_from_hf(c).attention_factor(), std::sqrt(1 + std::log(factor) / std::log(2048.0)));
  }
  c.factor = 10;
  const std::vector<double> base = rope_params_from_hf(llama_config()).inv_frequencies();  // checked above
  const std::vector<double> longs = rope_params_from_hf(c).inv_frequencies(4096);          // past M0 = 2048
  const std::vector<double> shorts = rope_params_from_hf(c).inv_frequencies(1024);
  for (std::size_t i = 0; i < 64; ++i) {
    // 1e-15 relative: a division by a small integer, rounded once in fp64 (2^-53 ≈ 1.1e-16) on
    // each side of the comparison.
    EXPECT_NEAR(longs[i], base[i] / static_cast<double>(i + 1), 1e-15 * base[i]) << i;
    EXPECT_NEAR(shorts[i], base[i] / 2.0, 1e-15 * base[i]) << i;
  }
}

}  // namespace
}  // namespace posenc
