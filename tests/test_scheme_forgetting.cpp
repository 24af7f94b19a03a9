// Forgetting Attention's own tests (posenc/forgetting.hpp): the gate's definition, the fused term
// against the fp64 reference on every target (layouts, dtypes, packed sequences, GQA, decode,
// windows, soft-caps, RoPE and ALiBi beside it), gradients by finite differences, thread counts,
// non-finite gates and bad input.
#include <cmath>
#include <memory>
#include <vector>

#include "attention_testing.hpp"
#include "posenc/forgetting.hpp"
#include "posenc/sinks.hpp"
#include "testing.hpp"

namespace posenc {
namespace {

using namespace attention_testing;

// Log gates as FoX makes them, logsigmoid of a logit, stored [B, S, heads] in `dtype` bytes
// (with `pad` extra heads per token, so that the view is a strided slice).
struct Gates {
  std::vector<double> values;
  std::vector<unsigned char> bytes;
  std::int64_t batch = 1, tokens = 0, heads = 0, pad = 0;
  DType dtype = DType::kF32;
  ConstTensorView view(bool packed = false) const {
    const std::int64_t row = heads + pad;
    const std::vector<std::int64_t> shape =
        packed ? std::vector<std::int64_t>{tokens, heads} : std::vector<std::int64_t>{batch, tokens, heads};
    const std::vector<std::int64_t> strides =
        packed ? std::vector<std::int64_t>{row, 1} : std::vector<std::int64_t>{tokens * row, row, 1};
    return ConstTensorView(bytes.data(), dtype, shape, strides);
  }
  double at(std::int64_t b, std::int64_t t, std::int64_t h) const {
    return values[static_cast<std::size_t>((b * tokens + t) * (heads + pad) + h)];
  }
};

Gates make_gates(std::int64_t batch, std::int64_t tokens, std::int64_t heads, double logit_lo = -1.0,
                 double logit_hi = 4.0, std::int64_t pad = 1, DType dtype = DType::kF32) {
  Gates g;
  g.batch = batch;
  g.tokens = tokens;
  g.heads = heads;
  g.pad = pad;
  g.dtype = dtype;
  g.values.resize(static_cast<std::size_t>(batch * tokens * (heads + pad)));
  for (auto& x : g.values) {
    const double logit = uniform(logit_lo, logit_hi);
    x = testing::round_to(-std::log1p(std::exp(-logit)), dtype);  // log σ(logit) <= 0
  }
  g.bytes = testing::to_dtype(g.values, dtype);
  return g;
}

AttentionTermRef gate_of(const Gates& g, bool packed = false) { return std::make_shared<ForgetGate>(g.view(packed)); }

// A spec whose one head group (every head of p) carries the gates.
AttentionSpec gated_spec(const Problem& p, const Gates& gates, bool causal) {
  AttentionSpec spec = spec_of(p);
  spec.mask.causal = causal;
  HeadGroup group{p.heads, {}, {}};
  group.terms = {gate_of(gates)};
  spec.groups = {group};
  return spec;
}

// Hand-worked: gates log f = −0.1, −0.2, −0.3, −0.4 on one head; D(3, 1) = −0.3 − 0.4.
TEST(ForgetGate, ValueIsTheDecayBetweenQueryAndKey) {
  std::vector<float> lf = {-0.1f, -0.2f, -0.3f, -0.4f};
  const ForgetGate gate(ConstTensorView::of(static_cast<const float*>(lf.data()), {1, 4, 1}));
  TokenPair pair;
  pair.query_token = 3;
  pair.key_token = 1;
  EXPECT_NEAR(gate.value(0, pair), -0.3 - 0.4, 1e-7);
  pair.key_token = 3;
  EXPECT_EQ(gate.value(0, pair), 0.0);
  pair.key_token = 0;
  EXPECT_NEAR(gate.value(0, pair), -0.2 - 0.3 - 0.4, 1e-7);
  // A sequence that starts at token 2: the running sums restart there, the difference does not
  // change.
  pair.sequence_start = 2;
  pair.key_token = 2;
  EXPECT_NEAR(gate.value(0, pair), -0.4, 1e-7);
  std::vector<double> grads(4, 0.0);
  pair.sequence_start = 0;
  pair.key_token = 1;
  gate.accumulate_gradient(0, pair, 2.0, grads);
  EXPECT_EQ(grads, (std::vector<double>{0, 0, 2, 2}));
}

class ForgettingAttention : public testing::EveryTarget {};

// The fused forward within flash-attention's criterion of the fp64 reference and the backward
// within expect_close of it (gate gradient included), for the layouts and masks FoX meets.
TEST_P(ForgettingAttention, MatchesTheReference) {
  struct Case {
    const char* what;
    std::int64_t batch, q_len, k_len, heads, kv_heads, dim;
    DType dtype;
    bool head_major;
    std::int64_t window_left;
    double softcap;
    int extra;  // 0 none, 1 RoPE in the group (FoX Pro), 2 ALiBi, 3 Shaw's terms and sinks, 4 Transformer-XL
  };
  const Case cases[] = {
      {"self-attention, MHA", 2, 77, 77, 4, 4, 32, DType::kF32, false, -1, 0.0, 0},
      {"GQA, [B, H, S, D] memory", 1, 150, 150, 6, 2, 64, DType::kF32, true, -1, 0.0, 0},
      {"FoX Pro: RoPE", 1, 130, 130, 4, 2, 32, DType::kF32, false, -1, 0.0, 1},
      {"with ALiBi", 1, 130, 130, 4, 4, 32, DType::kF32, false, -1, 0.0, 2},
      {"after Shaw's terms, before sinks", 1, 110, 110, 4, 2, 32, DType::kF32, false, -1, 0.0, 3},
      {"after Transformer-XL", 1, 110, 110, 4, 2, 32, DType::kF32, false, -1, 0.0, 4},
      {"sliding window and soft-cap", 2, 100, 100, 2, 1, 16, DType::kF32, false, 20, 5.0, 0},
      {"queries at the end of longer keys", 2, 37, 120, 4, 2, 32, DType::kF32, false, -1, 0.0, 0},
      {"decode", 3, 1, 200, 8, 2, 64, DType::kF32, false, -1, 0.0, 0},
      {"bf16", 1, 90, 90, 4, 2, 32, DType::kBF16, false, -1, 0.0, 1},
      {"f16", 1, 90, 90, 4, 2, 32, DType::kF16, true, -1, 0.0, 0},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    Problem p = make_problem(c.batch, c.q_len, c.k_len, c.heads, c.kv_heads, c.dim, c.dtype, c.head_major);
    const Gates gates = make_gates(c.batch, c.k_len, c.heads);
    AttentionSpec spec = spec_of(p);
    spec.mask.causal = true;
    spec.mask.window_left = c.window_left;
    spec.mask.softcap = c.softcap;
    HeadGroup group{c.heads, {}, {}};
    if (c.extra == 1) group.transform = RotaryQK{RopeParams(c.dim, c.dim)};
    if (c.extra == 2) group.bias = AlibiParams(c.heads);
    group.terms = {gate_of(gates)};
    if (c.extra == 3) {
      group.terms.insert(group.terms.begin(), shaw_term(c.heads, ShawParams::init(5, c.dim, 0.5, 7)));
      group.terms.push_back(
          std::make_shared<AttentionSinks>(std::vector<double>(static_cast<std::size_t>(c.heads), 0.5)));
    }
    if (c.extra == 4) group.terms.insert(group.terms.begin(), xl_term(XlParams::init(c.heads, c.dim, 16, 0.5, 8)));
    spec.groups = {group};
    expect_accurate(p, spec, c.what);
    if (c.dtype == DType::kF32) {
      const Attention att(spec);
      const std::vector<double> d_out = random_values(static_cast<std::size_t>(p.q_count()));
      expect_backward_matches_reference(p, att, d_out);
      if (c.extra >= 3) {  // the reference without parameter gradients: dq, dk, dv to the bit
        const Grads with = run_backward(p, att, d_out, true), without = run_backward(p, att, d_out, true, false);
        EXPECT_EQ(without.dq, with.dq);
        EXPECT_EQ(without.dk, with.dk);
        EXPECT_EQ(without.dv, with.dv);
      }
    }
  }
}

// Packed sequences restart their running sums; a group of some heads only (the others NoPE).
TEST_P(ForgettingAttention, PackedSequencesAndPartOfTheHeads) {
  Problem p = make_packed({{40, 40}, {1, 1}, {70, 70}, {0, 0}, {33, 33}}, 4, 2, 32);
  const Gates gates = make_gates(1, p.k_len, 2, -1.0, 4.0, 3);
  AttentionSpec spec = spec_of(p);
  spec.mask.causal = true;
  HeadGroup fox{2, {}, {}};
  fox.terms = {gate_of(gates, true)};
  spec.groups = {HeadGroup{2, {}, {}}, fox};
  expect_accurate(p, spec, "packed");
  const Attention att(spec);
  expect_backward_matches_reference(p, att, random_values(static_cast<std::size_t>(p.q_count())));
}

// Decode's block holds every KV head's rows: those of the gated heads read their heads' columns of
// the running sums, the others (and the padding) keep their scores.
TEST_P(ForgettingAttention, DecodeRowsOfPartOfTheHeads) {
  for (const std::int64_t q_len : {1, 2}) {
    Problem p = make_problem(2, q_len, 300, 6, 3, 32);
    const Gates gates = make_gates(2, 300, 3);
    AttentionSpec spec = spec_of(p);
    spec.mask.causal = true;
    HeadGroup fox{3, {}, {}};
    fox.terms = {gate_of(gates)};
    spec.groups = {HeadGroup{1, {}, AlibiParams(1)}, fox, HeadGroup{2, {}, {}}};
    expect_accurate(p, spec, "decode, gates on heads 1-3");
  }
}

// Strong forgetting over a long sequence: c falls below −500, where f32 keeps only ~3e-5 of an
// absolute c; D_ij = c_i − c_j taken in fp64 keeps the decays themselves to f32 precision.
TEST_P(ForgettingAttention, AccurateWhereTheRunningSumIsLarge) {
  Problem p = make_problem(1, 700, 700, 2, 1, 32);
  const Gates gates = make_gates(1, 700, 2, -3.0, 0.5);
  AttentionSpec spec = gated_spec(p, gates, true);
  double c_min = 0;
  for (std::int64_t t = 0; t < 700; ++t) c_min += gates.at(0, t, 0);
  ASSERT_LT(c_min, -500.0);
  expect_accurate(p, spec, "long");
}

// From fuzz_attention: one query over 245 keys with c down to about −245. Unmasked, the backward's
// padding rows (15 of a 16-row block) would take c_{k0} − c_j, up to +150: exp() is infinite there
// and 0·inf would reach dK through their zero queries.
TEST_P(ForgettingAttention, PaddingRowsStayOutOfTheBackward) {
  for (const bool causal : {true, false}) {
    Problem p = make_problem(1, 1, 245, 1, 1, 4);
    const Gates gates = make_gates(1, 245, 1, -3.0, 0.5);
    const AttentionSpec spec = gated_spec(p, gates, causal);
    expect_backward_matches_reference(p, Attention(spec), random_values(static_cast<std::size_t>(p.q_count())));
  }
}

INSTANTIATE_TEST_SUITE_P(Targets, ForgettingAttention, ::testing::ValuesIn(testing::all_targets()));

// The reference's gate gradient against central differences of the fp64 reference forward's
// L = Σ d_out·out (the fused backward is held to the reference above). h = 1e-6 on O(1) logits
// leaves a truncation error ~h² and a rounding error ~1e-16/h: 1e-8 covers both with room.
TEST(ForgettingAttention, GateGradientMatchesFiniteDifferences) {
  Problem p = make_problem(1, 12, 12, 2, 1, 8);
  Gates gates = make_gates(1, 12, 2, -1.0, 4.0, 0, DType::kF64);
  AttentionSpec spec = gated_spec(p, gates, true);
  const std::vector<double> d_out = random_values(static_cast<std::size_t>(p.q_count()));
  const Grads exact = run_backward(p, Attention(spec), d_out, true);
  const auto loss = [&] {
    const Outputs o = run_forward(p, Attention(spec), 1);
    double l = 0;
    for (std::size_t i = 0; i < o.out.size(); ++i) l += d_out[i] * o.out[i];
    return l;
  };
  double* raw = reinterpret_cast<double*>(gates.bytes.data());
  for (const std::int64_t at : {0, 3, 8, 13, 22, 23}) {
    EXPECT_NEAR(exact.params.groups[0].terms[0][static_cast<std::size_t>(at)],
                testing::central_difference(raw[at], 1e-6, loss), 1e-8)
        << at;
  }
  // The first token's gate never enters a logit.
  EXPECT_EQ(exact.params.groups[0].terms[0][0], 0.0);
  EXPECT_EQ(exact.params.groups[0].terms[0][1], 0.0);
}

TEST(ForgettingAttention, BitwiseIdenticalForAnyThreadCount) {
  Problem p = make_problem(1, 600, 600, 4, 2, 32);
  const Gates gates = make_gates(1, 600, 4);
  AttentionSpec spec = gated_spec(p, gates, true);
  const Attention att(spec);
  const std::vector<double> d_out = random_values(static_cast<std::size_t>(p.q_count()));
  std::vector<Grads> runs;
  for (const int threads : {1, 2, 3}) {
    set_num_threads(threads);
    runs.push_back(run_backward(p, att, d_out, false));
  }
  set_num_threads(2);
  for (std::size_t r = 1; r < runs.size(); ++r) {
    EXPECT_EQ(runs[r].dq, runs[0].dq);
    EXPECT_EQ(runs[r].dk, runs[0].dk);
    EXPECT_EQ(runs[r].params.groups[0].terms[0], runs[0].params.groups[0].terms[0]);
  }
}

// Strong decay (gates of 0.27–0.5: log f of −1.3 to −0.7) makes far tiles vanish: they are
// skipped, forward and backward, without changing a bit for finite inputs. A NaN value in a
// vanishing tile is the skip's documented exception (AttentionSpec::skip_vanishing_tiles): the
// full run spreads it through 0·NaN, the skip does not.
TEST(ForgettingAttention, VanishingFarTilesAreSkippedWithoutChangingABit) {
  Problem p = make_problem(1, 700, 700, 4, 2, 32);
  const Gates gates = make_gates(1, 700, 4, -1.0, 0.0);
  for (const bool poison : {false, true}) {
    SCOPED_TRACE(poison ? "a NaN value at key 3" : "finite");
    if (poison) {
      p.v[3 * 2 * 32] = std::nan("");
      p.vb = testing::to_dtype(p.v, DType::kF32);
    }
    AttentionSpec on = gated_spec(p, gates, true), off = on;
    off.skip_vanishing_tiles = false;
    const Attention a(on), b(off);
    const Outputs fa = run_forward(p, a, 0), fb = run_forward(p, b, 0);
    if (!poison) {
      EXPECT_GT(fa.stats.skipped, fa.stats.tiles / 4);
      EXPECT_EQ(fb.stats.skipped, 0);
      EXPECT_EQ(fa.out, fb.out);
      EXPECT_EQ(fa.lse, fb.lse);
      const std::vector<double> d_out = random_values(static_cast<std::size_t>(p.q_count()));
      const Grads ga = run_backward(p, a, d_out, false), gb = run_backward(p, b, d_out, false);
      EXPECT_EQ(ga.dq, gb.dq);
      EXPECT_EQ(ga.dk, gb.dk);
      EXPECT_EQ(ga.dv, gb.dv);
      EXPECT_EQ(ga.params.groups[0].terms[0], gb.params.groups[0].terms[0]);
    } else {
      // Query 699 sees key 3 with a probability far below FLT_MIN.
      EXPECT_FALSE(std::isnan(fa.out[static_cast<std::size_t>(699 * 4 * 32)]));
      EXPECT_TRUE(std::isnan(fb.out[static_cast<std::size_t>(699 * 4 * 32)]));
    }
  }
}

// A NaN gate at token t makes every c from t on NaN: the rows of queries before t do not see it
// (their keys' c are finite), and the fused rows from t on are non-finite exactly where the fp64
// reference's are (attention.hpp's policy for a row whose every logit is NaN).
TEST(ForgettingAttention, ANaNGateReachesOnlyLaterQueries) {
  Problem p = make_problem(1, 150, 150, 1, 1, 16);
  Gates gates = make_gates(1, 150, 1, -1.0, 4.0, 0);
  reinterpret_cast<float*>(gates.bytes.data())[100] = std::nanf("");
  AttentionSpec spec = gated_spec(p, gates, true);
  const Attention att(spec);
  const Outputs fused = run_forward(p, att, 0), exact = run_forward(p, att, 1);
  for (std::int64_t i = 0; i < 150; ++i) {
    const auto at = static_cast<std::size_t>(i * 16);
    EXPECT_EQ(std::isfinite(fused.out[at]), std::isfinite(exact.out[at])) << i;
    EXPECT_EQ(std::isfinite(fused.lse[static_cast<std::size_t>(i)]),
              std::isfinite(exact.lse[static_cast<std::size_t>(i)]))
        << i;
    if (i < 100) {
      EXPECT_NEAR(fused.out[at], exact.out[at], 1e-5) << i;
    }
  }
}

TEST(ForgettingAttention, RefusesBadInput) {
  std::vector<float> lf(2 * 10 * 2, -0.5f);
  const auto gate = [&](std::initializer_list<std::int64_t> shape) {
    return std::make_shared<ForgetGate>(ConstTensorView::of(static_cast<const float*>(lf.data()), shape));
  };
  lf[7] = 0.25f;
  testing::expect_error([&] { gate({2, 10, 2}); }, {"log_fgate", "[0, 3, 1] = 0.25", "<= 0"});
  // A head-major view (strides 10, 1, 20) names the same element by its own indices.
  const std::vector<std::int64_t> shape = {2, 10, 2}, head_major = {10, 1, 20};
  testing::expect_error([&] { ForgetGate(ConstTensorView(lf.data(), DType::kF32, shape, head_major)); },
                        {"log_fgate", "[0, 7, 0] = 0.25"});
  lf[7] = std::numeric_limits<float>::infinity();
  testing::expect_error([&] { gate({2, 10, 2}); }, {"log_fgate"});
  lf[7] = -0.5f;
  testing::expect_error([&] { gate({40}); }, {"log_fgate"});
  Problem p = make_problem(2, 10, 10, 2, 1, 8);
  const auto attention = [&](AttentionTermRef term, bool causal, std::int64_t heads) {
    AttentionSpec spec = spec_of(p);
    spec.mask.causal = causal;
    HeadGroup g{heads, {}, {}};
    g.terms = {std::move(term)};
    spec.groups = {g, HeadGroup{2 - heads, {}, {}}};
    if (heads == 2) spec.groups.pop_back();
    return Attention(spec);
  };
  EXPECT_NO_THROW(attention(gate({2, 10, 2}), true, 2));
  testing::expect_error([&] { attention(gate({2, 10, 2}), false, 2); }, {"mask"});
  testing::expect_error([&] { attention(gate({2, 10, 2}), true, 1); }, {"heads"});
  testing::expect_error([&] { attention(gate({1, 10, 2}), true, 2); }, {"log_fgate"});
  testing::expect_error([&] { attention(gate({20, 2}), true, 2); }, {"log_fgate"});
  Problem wide = make_problem(1, 12, 10, 2, 1, 8);
  AttentionSpec spec = spec_of(wide);
  spec.mask.causal = true;
  HeadGroup g{2, {}, {}};
  g.terms = {gate({1, 10, 2})};
  spec.groups = {g};
  testing::expect_error([&] { Attention att(spec); }, {"queries"});
}

}  // namespace
}  // namespace posenc
