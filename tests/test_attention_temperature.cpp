// Position-dependent attention temperature (posenc/temperature.hpp): the factors against Llama 4's
// and Mistral's formulas, the fused forward, decode and backward against the fp64 reference on
// every target, the reference against queries scaled by hand, and bad parameters.
#include <cmath>
#include <cstdint>
#include <vector>

#include "attention_testing.hpp"
#include "testing.hpp"

namespace posenc {
namespace {

using namespace attention_testing;

// transformers' Llama4TextAttention: log(floor((p + 1) / 8192) + 1)·0.1 + 1; Ministral 3:
// 1 + 0.1·log(1 + floor(p / 16384)).
TEST(PositionTemperature, FactorsFollowTheModels) {
  const PositionTemperature llama4 = PositionTemperature::llama4(8192, 0.1);
  EXPECT_EQ(llama4.factor(0), 1.0);
  EXPECT_EQ(llama4.factor(8190), 1.0);
  EXPECT_DOUBLE_EQ(llama4.factor(8191), 1.0 + 0.1 * std::log(2.0));
  EXPECT_DOUBLE_EQ(llama4.factor(3 * 8192 - 1), 1.0 + 0.1 * std::log(4.0));
  EXPECT_DOUBLE_EQ(llama4.factor(10'000'000), 1.0 + 0.1 * std::log(std::floor(10'000'001.0 / 8192) + 1));
  const PositionTemperature mistral = PositionTemperature::mistral(0.1, 16384);
  EXPECT_EQ(mistral.factor(16383), 1.0);
  EXPECT_DOUBLE_EQ(mistral.factor(16384), 1.0 + 0.1 * std::log(2.0));
  EXPECT_DOUBLE_EQ(mistral.factor(3 * 16384 + 5), 1.0 + 0.1 * std::log(4.0));
  testing::expect_error([] { PositionTemperature::llama4(0.0, 0.1); }, {"floor_scale = 0", "> 0"});
  testing::expect_error([] { PositionTemperature::llama4(8192, std::nan("")); }, {"attn_scale = nan"});
  testing::expect_error([] { PositionTemperature::mistral(0.1, 0); }, {"original_max_position_embeddings = 0"});
  // A negative scale would reach a factor of 0 and flip the attention at long positions.
  testing::expect_error([] { PositionTemperature::llama4(8192, -0.1); }, {"attn_scale = -0.1", ">= 0"});
  testing::expect_error([] { PositionTemperature::mistral(-0.1, 4); }, {"beta = -0.1", ">= 0"});
  testing::expect_error([] { PositionTemperature::mistral(std::numeric_limits<double>::infinity(), 4); },
                        {"beta = inf"});
  testing::expect_error([&] { llama4.factor(-1); }, {"position = -1", ">= 0"});
}

class AttentionTemperatureTargets : public testing::EveryTarget {};

// Small floor scales, so that the factor changes within the test's positions.
TEST_P(AttentionTemperatureTargets, MatchTheReference) {
  struct Case {
    const char* what;
    std::int64_t batch, q_len, k_len, heads, kv_heads, dim;
    bool llama4, rope;
  };
  const Case cases[] = {
      {"llama4, causal GQA", 2, 150, 150, 4, 2, 32, true, false},
      {"mistral with RoPE, queries at the end of a cache", 1, 60, 200, 4, 4, 32, false, true},
      {"decode", 2, 1, 3000, 8, 2, 64, true, true},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    Problem p = make_problem(c.batch, c.q_len, c.k_len, c.heads, c.kv_heads, c.dim);
    AttentionSpec spec = spec_of(p);
    spec.mask.causal = true;
    spec.temperature = c.llama4 ? PositionTemperature::llama4(16, 0.5) : PositionTemperature::mistral(0.3, 32);
    if (c.rope) spec.groups = {HeadGroup{c.heads, RotaryQK{RopeParams(c.dim, c.dim)}, {}}};
    expect_accurate(p, spec, c.what);
    if (c.k_len < 1000) {
      expect_backward_matches_reference(p, Attention(spec), random_values(static_cast<std::size_t>(p.q_count())));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Targets, AttentionTemperatureTargets, ::testing::ValuesIn(testing::all_targets()));

// The reference with a temperature equals the reference without one on queries multiplied by
// s(p) beforehand (out and dq = s·d(scaled q)): the composition the temperature stands for.
TEST(AttentionTemperature, EqualsQueriesScaledByHand) {
  Problem p = make_problem(1, 40, 40, 2, 1, 16, DType::kF64);
  const PositionTemperature temp = PositionTemperature::llama4(8, 0.7);
  Problem scaled = p;
  for (std::int64_t i = 0; i < p.q_len; ++i) {
    for (std::int64_t t = 0; t < p.heads * p.dim; ++t)
      scaled.q[static_cast<std::size_t>(i * p.heads * p.dim + t)] *= temp.factor(i);
  }
  scaled.qb = testing::to_dtype(scaled.q, DType::kF64);
  AttentionSpec with = spec_of(p), by_hand = spec_of(scaled);
  with.mask.causal = by_hand.mask.causal = true;
  with.temperature = temp;
  const Attention a(with), b(by_hand);
  const Outputs oa = run_forward(p, a, 1), ob = run_forward(scaled, b, 1);
  for (std::size_t i = 0; i < oa.out.size(); ++i) EXPECT_NEAR(oa.out[i], ob.out[i], 1e-14) << i;
  const std::vector<double> d_out = random_values(static_cast<std::size_t>(p.q_count()));
  const Grads ga = run_backward(p, a, d_out, true), gb = run_backward(scaled, b, d_out, true);
  for (std::int64_t i = 0; i < p.q_len; ++i) {
    for (std::int64_t t = 0; t < p.heads * p.dim; ++t) {
      const auto at = static_cast<std::size_t>(i * p.heads * p.dim + t);
      EXPECT_NEAR(ga.dq[at], temp.factor(i) * gb.dq[at], 1e-13) << at;
    }
  }
  for (std::size_t i = 0; i < ga.dk.size(); ++i) EXPECT_NEAR(ga.dk[i], gb.dk[i], 1e-13) << i;
}

}  // namespace
}  // namespace posenc
