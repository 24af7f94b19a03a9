// Attention sinks' own tests (posenc/sinks.hpp): the fused forward, decode and backward against
// the fp64 reference on every target (with ALiBi and its far-tile skip, RoPE, windows, soft-caps,
// GQA, packed sequences, chunked decode, 16-bit inputs), the sink's gradient by finite
// differences, rows that see no key, thread counts and bad input.
#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "attention_testing.hpp"
#include "posenc/sinks.hpp"
#include "testing.hpp"

namespace posenc {
namespace {

using namespace attention_testing;

AttentionTermRef sinks_of(std::int64_t heads, double lo = -1.0, double hi = 3.0) {
  std::vector<double> logits(static_cast<std::size_t>(heads));
  for (auto& x : logits) x = uniform(lo, hi);
  return std::make_shared<AttentionSinks>(logits);
}

// A causal spec whose one head group (every head of p) carries the given sinks.
AttentionSpec causal_with_sinks(const Problem& p, AttentionTermRef sinks) {
  AttentionSpec spec = spec_of(p);
  spec.mask.causal = true;
  HeadGroup group{p.heads, {}, {}};
  group.terms = {std::move(sinks)};
  spec.groups = {group};
  return spec;
}

class AttentionSinkTargets : public testing::EveryTarget {};

TEST_P(AttentionSinkTargets, MatchTheReference) {
  struct Case {
    const char* what;
    std::int64_t batch, q_len, k_len, heads, kv_heads, dim;
    DType dtype;
    bool causal;
    std::int64_t window_left;
    double softcap;
    int extra;  // 0 none, 1 RoPE, 2 ALiBi (the far-tile skip on)
  };
  const Case cases[] = {
      {"causal MHA", 2, 70, 70, 4, 4, 32, DType::kF32, true, -1, 0.0, 0},
      {"GQA, bidirectional", 1, 90, 90, 6, 2, 64, DType::kF32, false, -1, 0.0, 0},
      {"RoPE", 1, 100, 100, 4, 2, 32, DType::kF32, true, -1, 0.0, 1},
      {"ALiBi", 1, 300, 300, 4, 4, 32, DType::kF32, true, -1, 0.0, 2},
      {"window and soft-cap", 2, 80, 80, 2, 1, 16, DType::kF32, true, 10, 4.0, 0},
      {"decode over chunks", 2, 1, 9000, 8, 2, 64, DType::kF32, true, -1, 0.0, 0},
      {"bf16", 1, 64, 64, 4, 2, 32, DType::kBF16, true, -1, 0.0, 1},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    Problem p = make_problem(c.batch, c.q_len, c.k_len, c.heads, c.kv_heads, c.dim, c.dtype);
    AttentionSpec spec = spec_of(p);
    spec.mask.causal = c.causal;
    spec.mask.window_left = c.window_left;
    spec.mask.softcap = c.softcap;
    HeadGroup group{c.heads, {}, {}};
    if (c.extra == 1) group.transform = RotaryQK{RopeParams(c.dim, c.dim)};
    if (c.extra == 2) {
      group.bias = AlibiParams(std::vector<double>(static_cast<std::size_t>(c.heads), 2.0));  // steep: tiles vanish
    }
    group.terms = {sinks_of(c.heads)};
    spec.groups = {group};
    expect_accurate(p, spec, c.what);
    const Attention att(spec);
    if (c.extra == 2 && GetParam() != "ref") {
      EXPECT_GT(run_forward(p, att, 0).stats.skipped, 0) << "the far-tile skip stays on";
    }
    if (c.dtype == DType::kF32 && c.k_len < 1000) {
      expect_backward_matches_reference(p, att, random_values(static_cast<std::size_t>(p.q_count())));
    }
  }
}

// Two sinks on the same heads both join the denominator (the reference sums them): the registry's
// "sinks" group with the attention's sinks argument gives this. Decode (one chunk and several)
// and backward too, with a −inf sink (none) on one head of the second.
TEST_P(AttentionSinkTargets, TwoSinksOnTheSameHeadsBothCount) {
  for (const std::int64_t k_len : {std::int64_t{40}, std::int64_t{9000}}) {
    SCOPED_TRACE(k_len);
    Problem p = make_problem(1, k_len == 40 ? 40 : 1, k_len, 4, 2, 32, DType::kF32);
    AttentionSpec spec = spec_of(p);
    spec.mask.causal = true;
    std::vector<double> second = {0.5, -std::numeric_limits<double>::infinity(), 2.0, -1.0};
    HeadGroup group{4, {}, {}};
    group.terms = {sinks_of(4), std::make_shared<AttentionSinks>(second)};
    spec.groups = {group};
    expect_accurate(p, spec, "two sinks");
    if (k_len == 40)
      expect_backward_matches_reference(p, Attention(spec), random_values(static_cast<std::size_t>(p.q_count())));
  }
}

TEST_P(AttentionSinkTargets, PackedSequencesAndPartOfTheHeads) {
  Problem p = make_packed({{30, 30}, {1, 1}, {50, 50}, {0, 0}}, 4, 2, 32);
  AttentionSpec spec = spec_of(p);
  spec.mask.causal = true;
  HeadGroup sinks{2, {}, {}};
  sinks.terms = {sinks_of(2)};
  spec.groups = {HeadGroup{2, {}, AlibiParams(2)}, sinks};
  expect_accurate(p, spec, "packed");
  expect_backward_matches_reference(p, Attention(spec), random_values(static_cast<std::size_t>(p.q_count())));
}

// A row whose dO holds an inf: every dS is NaN, but δ = Σ_j P_ij·dP_ij and with it the sink's
// gradient −Σ_i p_sink·δ_i is an infinity when every visible dO·v_j is one (v_j[0] > 0 against
// dO[0] = ±inf), NaN when the signs differ. Over several key tiles and row blocks, GQA.
TEST_P(AttentionSinkTargets, AnInfiniteDOutGivesTheSinkGradientOfTheEagerComposition) {
  for (const double bad : {std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity()}) {
    for (const bool mixed_signs : {false, true}) {
      SCOPED_TRACE(std::to_string(bad) + (mixed_signs ? ", v of both signs" : ", v > 0"));
      Problem p = make_problem(1, 300, 300, 4, 2, 16);
      for (std::size_t at = 0; at < p.v.size(); at += static_cast<std::size_t>(p.dim)) {
        p.v[at] = mixed_signs && (at / static_cast<std::size_t>(p.dim)) % 7 == 3 ? -0.5 : 0.25 + std::abs(p.v[at]);
      }
      p.vb = testing::to_dtype(p.v, p.dtype);
      const Attention att(causal_with_sinks(p, sinks_of(4)));
      std::vector<double> d_out = random_values(static_cast<std::size_t>(p.q_count()));
      const std::int64_t row = 250, head = 1;  // [B, S, H, D]
      d_out[static_cast<std::size_t>((row * p.heads + head) * p.dim)] = bad;
      const Grads fused = run_backward(p, att, d_out, false), exact = run_backward(p, att, d_out, true);
      const std::vector<double>& got = fused.params.groups[0].terms[0];
      const std::vector<double>& want = exact.params.groups[0].terms[0];
      ASSERT_EQ(got.size(), want.size());
      for (std::size_t h = 0; h < want.size(); ++h) {
        // The other heads' sums are finite: f32 backward terms against fp64, 300 rows each.
        if (h != static_cast<std::size_t>(head)) {
          EXPECT_NEAR(got[h], want[h], 1e-4 * std::max(1.0, std::abs(want[h]))) << h;
          continue;
        }
        if (mixed_signs) {
          EXPECT_TRUE(std::isnan(want[h]) && std::isnan(got[h])) << got[h] << " vs " << want[h];
        } else {
          // ∂L/∂s = −p_sink·δ: the opposite infinity of dO[0]'s.
          EXPECT_EQ(want[h], -bad);
          EXPECT_EQ(got[h], want[h]);
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Targets, AttentionSinkTargets, ::testing::ValuesIn(testing::all_targets()));

// A row that sees no key (a window of 0 keys to the left, and a query before the first key): its
// weight is all on the sink: out = 0, lse = s.
TEST(AttentionSinks, ARowWithoutKeysHasOnlyTheSink) {
  Problem p = make_problem(1, 4, 3, 1, 1, 8);
  AttentionSpec spec = spec_of(p);
  spec.mask.causal = true;
  spec.mask.key_lengths = {0};
  HeadGroup group{1, {}, {}};
  group.terms = {std::make_shared<AttentionSinks>(std::vector<double>{0.75})};
  spec.groups = {group};
  const Attention att(spec);
  for (const int mode : {0, 1}) {
    const Outputs o = run_forward(p, att, mode);
    for (double x : o.out) EXPECT_EQ(x, 0.0) << mode;
    for (double x : o.lse) EXPECT_FLOAT_EQ(x, 0.75) << mode;
  }
}

// The reference's sink gradient against central differences of its forward's L = Σ d_out·out;
// h = 1e-6 on O(1) logits: truncation ~h², rounding ~1e-16/h, so 1e-8.
TEST(AttentionSinks, GradientMatchesFiniteDifferences) {
  Problem p = make_problem(1, 10, 10, 3, 1, 8);
  std::vector<double> logits = {0.5, -1.0, 2.0};
  const std::vector<double> d_out = random_values(static_cast<std::size_t>(p.q_count()));
  const auto spec_with = [&](const std::vector<double>& s) {
    AttentionSpec spec = spec_of(p);
    spec.mask.causal = true;
    HeadGroup group{3, {}, {}};
    group.terms = {std::make_shared<AttentionSinks>(s)};
    spec.groups = {group};
    return spec;
  };
  expect_term_gradient_matches_differences(p, spec_with, logits, d_out, 1e-8);
}

TEST(AttentionSinks, BitwiseIdenticalForAnyThreadCount) {
  Problem p = make_problem(1, 600, 600, 4, 2, 32);
  const AttentionSpec spec = causal_with_sinks(p, sinks_of(4));
  const Attention att(spec);
  Problem d = make_problem(1, 1, 20000, 4, 2, 32);
  AttentionSpec ds = spec_of(d);
  ds.groups = spec.groups;
  const Attention dec(ds);
  expect_same_bits_for_any_thread_count(p, att, d, &dec);
}

TEST(AttentionSinks, RefusesBadInput) {
  testing::expect_error([] { AttentionSinks s(std::vector<double>{}); }, {"logits"});
  testing::expect_error([] { AttentionSinks s({0.0, std::nan("")}); }, {"logits[1]"});
  testing::expect_error([] { AttentionSinks s({std::numeric_limits<double>::infinity()}); }, {"logits[0]"});
  EXPECT_NO_THROW(AttentionSinks({-std::numeric_limits<double>::infinity()}));
  Problem p = make_problem(1, 5, 5, 2, 1, 8);
  AttentionSpec spec = spec_of(p);
  HeadGroup group{2, {}, {}};
  group.terms = {std::make_shared<AttentionSinks>(std::vector<double>{0.0, 0.0, 0.0})};
  spec.groups = {group};
  testing::expect_error([&] { Attention att(spec); }, {"heads"});
}

}  // namespace
}  // namespace posenc
