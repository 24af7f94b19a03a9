// Fused attention, backward: dq, dk, dv and the schemes' parameter gradients against the fp64
// reference, which is itself checked by finite differences; one object from several threads;
// bitwise determinism over thread counts; accuracy at 4096 tokens; errors.
#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "../src/kernels/attention/attention_kernels.hpp"  // attn_gemm: the matrix kernel under test
#include "attention_testing.hpp"
#include "testing.hpp"

namespace posenc {
namespace {

using testing::EveryTarget;
using testing::expect_error;
using testing::uniform;
using testing::uniform_int;
using namespace attention_testing;

class AttentionBackward : public EveryTarget {};

TEST_P(AttentionBackward, MatchesTheReferenceForEveryTrainableScheme) {
  const std::int64_t heads = 4, kv = 2, dim = 48;
  Problem p = make_problem(2, 37, 53, heads, kv, dim, DType::kF32, true);
  std::vector<double> t5_table(static_cast<std::size_t>(16 * 2));
  for (auto& x : t5_table) x = uniform(-1, 1);
  const std::vector<std::vector<HeadGroup>> cases = {
      {},
      {{heads, RotaryQK{RopeParams(dim, dim)}, AlibiParams(heads)}},
      {{2, RotaryQK{RopeParams(dim, 32, 10000.0, RopeLayout::kInterleaved).with_xpos(32.0)},
        T5BiasParams(2, 16, 32, false, t5_table)},
       {2, AbsoluteQK{SinusoidalParams(dim)}, KerpleParams(KerpleForm::kPower, {1.0, 0.5}, {0.7, 1.3})}},
      {{heads, RotaryQK{RopeParams(dim, dim)}, {}, {shaw_term(heads, ShawParams::init(5, dim, 0.5, 3))}}},
      {{heads, {}, FireParams::init(heads, 8, 5, 0.7, 16.0)}},
      // A KV group whose heads mix Shaw and no Shaw (the per-row paths). The bias head is T5, not
      // ALiBi: one head's slope gradient −Σ dS·δ cancels (every row's dS sums to 0) far below the
      // size of its terms, so a tolerance relative to the gradient cannot judge its f32 error (an
      // ALiBi head here gave 0.0133 with an error of 1.5e-5); T5's table gradient is the same δ
      // histogram without the cancellation. Case 1 checks the slopes (four heads).
      {{1, {}, {}, {shaw_term(1, ShawParams::init(4, dim, 0.5, 7))}},
       {1, {}, T5BiasParams(1, 16, 32, false, std::vector<double>(t5_table.begin(), t5_table.begin() + 16))},
       {2, {}, {}, {shaw_term(2, ShawParams::init(2, dim, 0.5, 8))}}},
      {{heads, {}, {}, {xl_term(XlParams::init(heads, dim, 24, 0.5, 9))}}},
      {{heads, {}, tupe_with_cls(heads, dim, 24, 60, 4)}},
      // TUPE without the [CLS] reset beside ALiBi inside one KV group.
      {{1, {}, TupeParams::init(1, dim, 16, 60, false, 0.5, 5)}, {3, {}, AlibiParams(3)}},
      // XL beside ALiBi inside one KV group.
      {{1, {}, AlibiParams(1)}, {3, {}, {}, {xl_term(XlParams::init(3, dim, 16, 0.5, 10))}}},
      // FIRE without a causal mask (the last case): keys after the query, on both sides of it.
      {{heads, {}, FireParams::init(heads, 8, 6, 0.7, 16.0)}},
  };
  for (std::size_t c = 0; c < cases.size(); ++c) {
    for (const bool softcap : {false, true}) {
      SCOPED_TRACE("case " + std::to_string(c) + (softcap ? " soft-cap" : ""));
      AttentionSpec spec = spec_of(p);
      spec.groups = cases[c];
      spec.mask.causal = c != 0 && c + 1 != cases.size();
      spec.mask.window_left = c == 0 ? 20 : -1;
      spec.mask.softcap = softcap ? 3.0 : 0.0;
      const Attention att(spec);
      const std::vector<double> d_out = random_values(static_cast<std::size_t>(p.q_count()));
      expect_backward_matches_reference(p, att, d_out);
    }
  }
}

TEST_P(AttentionBackward, PackedAndSixteenBit) {
  Problem p = make_packed({{9, 9}, {20, 31}, {1, 5}}, 2, 1, 32);
  AttentionSpec spec = spec_of(p);
  spec.mask.causal = true;
  spec.groups = {{2, RotaryQK{RopeParams(32, 32)}, AlibiParams(2)}};
  const Attention att(spec);
  expect_backward_matches_reference(p, att, random_values(static_cast<std::size_t>(p.q_count())));

  Problem b = make_problem(1, 30, 30, 2, 2, 64, DType::kBF16);
  const Attention bat(spec_of(b));
  const std::vector<double> d_out_b = random_values(static_cast<std::size_t>(b.q_count()));
  const Grads fb = run_backward(b, bat, d_out_b, false), eb = run_backward(b, bat, d_out_b, true);
  // bf16 gradients: rounded once to bf16 (half an ulp, 2^-9 relative), and — as in
  // flash-attention — δ_i = Σ dO·O comes from the bf16-rounded output (another 2^-9 relative on
  // each product, carried into every dS = P·(dP − δ)): 2^-7 of the largest gradient covers both.
  for (const auto& [got, want] : {std::pair{&fb.dq, &eb.dq}, std::pair{&fb.dk, &eb.dk}, std::pair{&fb.dv, &eb.dv}}) {
    EXPECT_LE(max_abs_diff(*got, *want), std::ldexp(1.0, -7) * max_abs(*want));
  }
}

TEST_P(AttentionBackward, BF16ProductsOnHostsThatHaveThem) {
  // Backward over bf16 inputs takes the host's bf16 dot products for its five products where
  // bf16_dot_products() says so (P and dS rounded to bf16 before the three that take them). Each
  // gradient is then within twice the error of the naive composition with the same roundings
  // (flash-attention's criterion) plus half a bf16 ulp of the largest gradient (both store bf16,
  // and where their unrounded values differ slightly the two roundings may fall apart by an ulp);
  // elsewhere the widened bound of PackedAndSixteenBit. Odd head dims and key counts, GQA, RoPE's
  // rotated keys, ALiBi's skipped tiles; one thread and two give the same bits.
  const bool native = bf16_dot_products();
  for (int trial = 0; trial < 4; ++trial) {
    const std::int64_t dim = std::vector<std::int64_t>{64, 80, 33, 128}[static_cast<std::size_t>(trial)];
    const std::int64_t kv = 1 + trial % 2, heads = kv * (1 + trial % 3);
    const std::int64_t q_len = uniform_int(30, 150), k_len = q_len + uniform_int(0, 41);
    Problem p = make_problem(1, q_len, k_len, heads, kv, dim, DType::kBF16);
    AttentionSpec spec = spec_of(p);
    spec.mask.causal = trial != 2;
    if (trial == 1) spec.groups = {{heads, RotaryQK{RopeParams(dim, dim)}, {}}};
    if (trial == 3) spec.groups = {{heads, {}, AlibiParams(heads)}};
    const std::string what = "D " + std::to_string(dim) + ", " + std::to_string(q_len) + " × " + std::to_string(k_len);
    SCOPED_TRACE(what);
    const Attention att(spec);
    const std::vector<double> d_out = random_values(static_cast<std::size_t>(p.q_count()));
    const Grads fused = run_backward(p, att, d_out, 0), exact = run_backward(p, att, d_out, 1);
    EXPECT_EQ(fused.stats.bf16_products, native);
    const Grads naive = run_backward(p, att, d_out, 2);
    for (const auto& [name, got, want, yardstick] :
         {std::tuple{"dq", &fused.dq, &exact.dq, &naive.dq}, std::tuple{"dk", &fused.dk, &exact.dk, &naive.dk},
          std::tuple{"dv", &fused.dv, &exact.dv, &naive.dv}}) {
      const double err = max_abs_diff(*got, *want), naive_err = max_abs_diff(*yardstick, *want);
      if (native) {
        EXPECT_LE(err, 2 * naive_err + std::ldexp(1.0, -9) * max_abs(*want)) << name << ", naive " << naive_err;
      } else {
        EXPECT_LE(err, std::ldexp(1.0, -7) * max_abs(*want)) << name;
      }
    }
    set_num_threads(1);
    const Grads one = run_backward(p, att, d_out, 0);
    set_num_threads(2);
    EXPECT_EQ(one.dq, fused.dq);
    EXPECT_EQ(one.dk, fused.dk);
    EXPECT_EQ(one.dv, fused.dv);
  }
}

// An Attention holds no state that a call changes: several threads may run one object's forward
// and backward at once (a model's layer shared by server threads), each getting the bits and the
// statistics of a call made alone. Decode (one query) and prefill, with the far-tile skip.
TEST_P(AttentionBackward, OneObjectServesSeveralThreadsAtOnce) {
  for (const std::int64_t q_len : {std::int64_t{1}, std::int64_t{190}}) {
    SCOPED_TRACE("Sq " + std::to_string(q_len));
    const Problem p = make_problem(2, q_len, 260, 4, 2, 64);
    AttentionSpec spec = spec_of(p);
    spec.mask.causal = true;
    // Steep slopes on both groups, so that prefill skips far tiles.
    spec.groups = {{2, RotaryQK{RopeParams(64, 64)}, AlibiParams(std::vector<double>{4.0, 2.0})},
                   {2, {}, AlibiParams(std::vector<double>{2.0, 1.0})}};
    const Attention att(spec);
    const std::vector<double> d_out = random_values(static_cast<std::size_t>(p.q_count()));
    const Outputs alone = run_forward(p, att, 0);
    const Grads alone_grads = run_backward(p, att, d_out, false);
    constexpr int kThreads = 4, kRounds = 3;
    std::vector<Outputs> outs(kThreads * kRounds);
    std::vector<Grads> grads(kThreads * kRounds);
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        for (int r = 0; r < kRounds; ++r) {
          outs[static_cast<std::size_t>(t * kRounds + r)] = run_forward(p, att, 0);
          grads[static_cast<std::size_t>(t * kRounds + r)] = run_backward(p, att, d_out, false);
        }
      });
    }
    for (std::thread& th : threads) th.join();
    for (std::size_t c = 0; c < outs.size(); ++c) {
      EXPECT_EQ(outs[c].out, alone.out) << "call " << c;
      EXPECT_EQ(outs[c].lse, alone.lse) << "call " << c;
      EXPECT_EQ(outs[c].stats.tiles, alone.stats.tiles) << "call " << c;
      EXPECT_EQ(outs[c].stats.skipped, alone.stats.skipped) << "call " << c;
      EXPECT_EQ(grads[c].dq, alone_grads.dq) << "call " << c;
      EXPECT_EQ(grads[c].dk, alone_grads.dk) << "call " << c;
      EXPECT_EQ(grads[c].dv, alone_grads.dv) << "call " << c;
      EXPECT_EQ(grads[c].params.groups[1].bias, alone_grads.params.groups[1].bias) << "call " << c;
      EXPECT_EQ(grads[c].stats.skipped, alone_grads.stats.skipped) << "call " << c;
    }
  }
}

// The first backward of an object with XL builds XL's r(δ) table once (call_once) and TUPE's
// and XL's slots per call: threads that start at once on a fresh object get the bits of a call
// made alone afterwards.
TEST_P(AttentionBackward, AFreshObjectWithXlAndTupeServesSeveralThreadsAtOnce) {
  const std::int64_t dim = 32;
  const Problem p = make_problem(2, 70, 96, 4, 2, dim);
  AttentionSpec spec = spec_of(p);
  spec.mask.causal = true;
  spec.groups = {{2, {}, {}, {xl_term(XlParams::init(2, dim, 24, 0.5, 9))}},
                 {2, {}, tupe_with_cls(2, dim, 16, 100, 4)}};
  const Attention att(spec);
  const std::vector<double> d_out = random_values(static_cast<std::size_t>(p.q_count()));
  constexpr int kThreads = 4;
  std::vector<Grads> grads(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] { grads[static_cast<std::size_t>(t)] = run_backward(p, att, d_out, false); });
  for (std::thread& th : threads) th.join();
  const Grads alone = run_backward(p, att, d_out, false);
  for (std::size_t c = 0; c < grads.size(); ++c) {
    EXPECT_EQ(grads[c].dq, alone.dq) << "call " << c;
    EXPECT_EQ(grads[c].dk, alone.dk) << "call " << c;
    EXPECT_EQ(grads[c].dv, alone.dv) << "call " << c;
    EXPECT_EQ(grads[c].params.groups[0].terms, alone.params.groups[0].terms) << "call " << c;
    EXPECT_EQ(grads[c].params.groups[1].bias, alone.params.groups[1].bias) << "call " << c;
  }
}

INSTANTIATE_TEST_SUITE_P(Targets, AttentionBackward, ::testing::ValuesIn(testing::all_targets()));

// The fp64 reference backward against central differences of the fp64 reference forward, on
// L = Σ out·W: every gradient, including the schemes' parameters.
TEST(AttentionReference, BackwardMatchesFiniteDifferences) {
  const std::int64_t heads = 2, dim = 8;
  Problem p = make_problem(1, 6, 9, heads, 2, dim, DType::kF64);
  std::vector<double> t5_table(static_cast<std::size_t>(8 * 1));
  for (auto& x : t5_table) x = uniform(-1, 1);
  const std::vector<double> w = random_values(static_cast<std::size_t>(p.q_count()));
  const auto make_spec = [&](double slope, double t5_entry3) {
    AttentionSpec spec = spec_of(p);
    std::vector<double> table = t5_table;
    table[3] = t5_entry3;
    spec.groups = {{1, RotaryQK{RopeParams(dim, dim).with_xpos(16.0)}, AlibiParams(std::vector<double>{slope})},
                   {1, {}, T5BiasParams(1, 8, 16, true, table)}};
    spec.mask.causal = true;
    spec.mask.softcap = 2.0;
    return spec;
  };
  const auto loss = [&](const Problem& prob, double slope, double t5_entry3) {
    const Attention att(make_spec(slope, t5_entry3));
    std::vector<double> out(static_cast<std::size_t>(prob.q_count()));
    ref::attention_forward(att, prob.view<true>(out.data(), prob.q_len, prob.heads, DType::kF64), {});
    double l = 0;
    for (std::size_t i = 0; i < out.size(); ++i) l += out[i] * w[i];  // same (contiguous) order as w
    return l;
  };
  const double slope = 0.3, entry = t5_table[3];
  const Attention att(make_spec(slope, entry));
  const Grads g = run_backward(p, att, w, true);
  // Central differences: O(h²) truncation with h = 1e-5 and |third derivatives| ~1 gives ~1e-10;
  // cancellation adds ~1e-16/1e-5 = 1e-11. 1e-7 is far above both, far below any real error.
  const double h = 1e-5, tol = 1e-7;
  const auto check_input = [&](std::vector<double>& values, std::vector<unsigned char>& bytes,
                               const std::vector<double>& grad, const char* name) {
    for (std::size_t i = 0; i < values.size(); i += 7) {
      const double saved = values[i];
      values[i] = saved + h;
      bytes = testing::to_dtype(values, DType::kF64);
      const double up = loss(p, slope, entry);
      values[i] = saved - h;
      bytes = testing::to_dtype(values, DType::kF64);
      const double down = loss(p, slope, entry);
      values[i] = saved;
      bytes = testing::to_dtype(values, DType::kF64);
      const double fd = (up - down) / (2 * h);
      // grad is in [B, S, H, D] order, which is also the raw order here (contiguous).
      EXPECT_NEAR(grad[i], fd, tol) << name << "[" << i << "]";
    }
  };
  check_input(p.q, p.qb, g.dq, "dq");
  check_input(p.k, p.kb, g.dk, "dk");
  check_input(p.v, p.vb, g.dv, "dv");
  EXPECT_NEAR(g.params.groups[0].bias[0], (loss(p, slope + h, entry) - loss(p, slope - h, entry)) / (2 * h), tol);
  EXPECT_NEAR(g.params.groups[1].bias[3], (loss(p, slope, entry + h) - loss(p, slope, entry - h)) / (2 * h), tol);
}

// The same for Shaw's tables: every entry of both, by central differences of the reference.
TEST(AttentionReference, ShawBackwardMatchesFiniteDifferences) {
  const std::int64_t dim = 4, k_max = 2, width = 2 * k_max + 1;
  Problem p = make_problem(1, 5, 7, 2, 1, dim, DType::kF64);
  std::vector<double> key_table(static_cast<std::size_t>(width * dim)), value_table(key_table.size());
  for (auto& x : key_table) x = uniform(-1, 1);
  for (auto& x : value_table) x = uniform(-1, 1);
  const std::vector<double> w = random_values(static_cast<std::size_t>(p.q_count()));
  const auto loss = [&](const std::vector<double>& kt, const std::vector<double>& vt) {
    AttentionSpec spec = spec_of(p);
    spec.groups = {{2, {}, {}, {shaw_term(2, ShawParams(k_max, dim, kt, vt))}}};
    spec.mask.causal = true;
    const Attention att(spec);
    std::vector<double> out(static_cast<std::size_t>(p.q_count()));
    ref::attention_forward(att, p.view<true>(out.data(), p.q_len, p.heads, DType::kF64), {});
    double l = 0;
    for (std::size_t i = 0; i < out.size(); ++i) l += out[i] * w[i];
    return l;
  };
  AttentionSpec spec = spec_of(p);
  spec.groups = {{2, {}, {}, {shaw_term(2, ShawParams(k_max, dim, key_table, value_table))}}};
  spec.mask.causal = true;
  const Attention att(spec);
  const Grads g = run_backward(p, att, w, true);
  // Central differences, h = 1e-5: truncation ~1e-10, cancellation ~1e-11 (as above). The term's
  // gradient is [key table | value table].
  const double h = 1e-5, tol = 1e-7;
  const std::vector<double>& tables = g.params.groups[0].terms[0];
  ASSERT_EQ(tables.size(), 2 * key_table.size());
  for (std::size_t e = 0; e < key_table.size(); ++e) {
    std::vector<double> up = key_table, down = key_table;
    up[e] += h;
    down[e] -= h;
    EXPECT_NEAR(tables[e], (loss(up, value_table) - loss(down, value_table)) / (2 * h), tol) << e;
    up = value_table;
    down = value_table;
    up[e] += h;
    down[e] -= h;
    EXPECT_NEAR(tables[key_table.size() + e], (loss(key_table, up) - loss(key_table, down)) / (2 * h), tol) << e;
  }
}

// XlTerm's definition gives the same values and gradients with the reference's scratch (P per δ
// memoised, dW_R deferred to finish_row_gradients) as computed on the spot, for a caller without
// one. The naive f32 logit is asked first, so that an f32 P served to the fp64 hooks would show.
TEST(AttentionReference, XlDefinitionWithAndWithoutScratch) {
  const std::int64_t heads = 2, dim = 4, d_model = 6;
  const XlTerm term(XlParams::init(heads, dim, d_model, 0.5, 5));
  std::vector<double> q = random_values(dim), k = random_values(dim);
  const auto size = static_cast<std::size_t>(term.gradient_size());
  std::vector<double> grads_spot(size), grads_memo(size), dq_spot(dim), dk_spot(dim), dq_memo(dim), dk_memo(dim);
  TermScratch scratch;
  for (const auto& [qp, kp] : {std::pair<std::int64_t, std::int64_t>{7, 3}, {5, 9}, {7, 3}}) {
    TokenPair pair;
    pair.query_position = qp;
    pair.key_position = kp;
    PairRows spot{q, k, 0.3, true, nullptr}, memo{q, k, 0.3, true, &scratch};
    EXPECT_EQ(term.row_value(1, pair, spot), term.row_value(1, pair, memo));
    spot.naive_f32 = memo.naive_f32 = false;
    EXPECT_EQ(term.row_value(1, pair, spot), term.row_value(1, pair, memo));
    term.accumulate_row_gradient(1, pair, spot, 0.7, grads_spot, dq_spot, dk_spot);
    term.accumulate_row_gradient(1, pair, memo, 0.7, grads_memo, dq_memo, dk_memo);
  }
  term.finish_row_gradients(1, scratch, grads_memo);
  const std::vector<double> finished = grads_memo;
  term.finish_row_gradients(1, scratch, grads_memo);  // the deferred sums were used up
  EXPECT_EQ(grads_memo, finished);
  EXPECT_EQ(dq_spot, dq_memo);
  EXPECT_EQ(dk_spot, dk_memo);
  // dW_R sums a δ's two pairs before it meets r(δ): a few ulps of values below 1.
  for (std::size_t e = 0; e < size; ++e) EXPECT_NEAR(grads_spot[e], grads_memo[e], 1e-15) << e;
  EXPECT_GT(max_abs(grads_memo), 0.0);
}

// Transformer-XL's reference gradients (u, v, W_R, and dq, dk through its terms) by central
// differences of the reference forward.
TEST(AttentionReference, XlBackwardMatchesFiniteDifferences) {
  const std::int64_t heads = 2, dim = 4, d_model = 6;
  Problem p = make_problem(1, 5, 7, heads, 1, dim, DType::kF64);
  const XlParams base = XlParams::init(heads, dim, d_model, 0.5, 3);
  const std::vector<double> w = random_values(static_cast<std::size_t>(p.q_count()));
  const auto spec_with = [&](const XlParams& xl) {
    AttentionSpec spec = spec_of(p);
    spec.groups = {{heads, {}, {}, {xl_term(xl)}}};
    spec.mask.causal = true;
    spec.mask.softcap = 2.0;
    return spec;
  };
  const auto loss = [&](const XlParams& xl) {
    const Attention att(spec_with(xl));
    std::vector<double> out(static_cast<std::size_t>(p.q_count()));
    ref::attention_forward(att, p.view<true>(out.data(), p.q_len, p.heads, DType::kF64), {});
    double l = 0;
    for (std::size_t i = 0; i < out.size(); ++i) l += out[i] * w[i];
    return l;
  };
  const Attention att(spec_with(base));
  const Grads g = run_backward(p, att, w, true);
  // The term's gradient is [u | v | W_R].
  const std::vector<double>& flat = g.params.groups[0].terms[0];
  const auto hd = static_cast<std::ptrdiff_t>(heads * dim);
  ASSERT_EQ(flat.size(), static_cast<std::size_t>(2 * hd + hd * d_model));
  XlGradients xg(base);
  xg.u.assign(flat.begin(), flat.begin() + hd);
  xg.v.assign(flat.begin() + hd, flat.begin() + 2 * hd);
  xg.w_r.assign(flat.begin() + 2 * hd, flat.end());
  // Central differences, h = 1e-5: truncation ~1e-10, cancellation ~1e-11 (as above).
  const double h = 1e-5, tol = 1e-7;
  const auto fd = [&](int which, std::size_t e) {
    std::vector<double> plus[3] = {base.u(), base.v(), base.w_r()}, minus[3] = {base.u(), base.v(), base.w_r()};
    plus[which][e] += h;
    minus[which][e] -= h;
    const XlParams up(heads, dim, d_model, plus[0], plus[1], plus[2]),
        down(heads, dim, d_model, minus[0], minus[1], minus[2]);
    return (loss(up) - loss(down)) / (2 * h);
  };
  for (std::size_t e = 0; e < xg.u.size(); ++e) {
    EXPECT_NEAR(xg.u[e], fd(0, e), tol) << "u " << e;
    EXPECT_NEAR(xg.v[e], fd(1, e), tol) << "v " << e;
  }
  for (std::size_t e = 0; e < xg.w_r.size(); e += 5) EXPECT_NEAR(xg.w_r[e], fd(2, e), tol) << "w_r " << e;
  // dq and dk carry XL's terms too (q + v meets P; u meets k).
  for (auto [values, bytes, grad, name] :
       {std::tuple{&p.q, &p.qb, &g.dq, "dq"}, std::tuple{&p.k, &p.kb, &g.dk, "dk"}}) {
    for (std::size_t i = 0; i < values->size(); i += 3) {
      const double saved = (*values)[i];
      (*values)[i] = saved + h;
      *bytes = testing::to_dtype(*values, DType::kF64);
      const double up = loss(base);
      (*values)[i] = saved - h;
      *bytes = testing::to_dtype(*values, DType::kF64);
      const double down = loss(base);
      (*values)[i] = saved;
      *bytes = testing::to_dtype(*values, DType::kF64);
      EXPECT_NEAR((*grad)[i], (up - down) / (2 * h), tol) << name << "[" << i << "]";
    }
  }
}

// ─── Determinism and errors ──────────────────────────────────────────────────────────────────

TEST(Attention, AccurateAtFourThousandTokens) {
  // The accuracy criterion at the longest S: 4096 queries over 4096 keys, where the online
  // softmax runs over 64 key tiles. First RoPE with ALiBi (whose KV head runs its tiles from the
  // diagonal down and skips the vanishing far ones) beside Kerple (its KV head in key order: summed
  // the other way, its far terms, which do not vanish, would cost 3.6× the naive f32 error); then T5
  // and FIRE with a sliding window. GQA, D 80. The best target only: the fp64 reference and the
  // naive f32 composition take about 20 s per call here.
  const Problem p = make_problem(1, 4096, 4096, 4, 2, 80);
  AttentionSpec spec = spec_of(p);
  spec.mask.causal = true;
  spec.groups = {{2, RotaryQK{RopeParams(80, 80)}, AlibiParams(2)},
                 {2, {}, KerpleParams(KerpleForm::kLog, {1.5, 0.5}, {1.0, 2.0})}};
  expect_accurate(p, spec, "RoPE + ALiBi, Kerple; causal");
  std::vector<double> t5_table(32 * 2);
  for (std::size_t i = 0; i < t5_table.size(); ++i) t5_table[i] = 0.1 * static_cast<double>(i % 11) - 0.5;
  spec.groups = {{2, {}, T5BiasParams(2, 32, 128, true, t5_table)}, {2, {}, FireParams::init(2, 16, 3)}};
  spec.mask.window_left = 1000;
  expect_accurate(p, spec, "T5, FIRE; sliding window of 1000");
}

// Two attentions that must agree to the bit: forward, and backward fused and by the reference,
// every gradient.
void expect_same_bits(const Problem& p, const Attention& a, const Attention& b, const std::vector<double>& d_out) {
  EXPECT_EQ(run_forward(p, a, 0).out, run_forward(p, b, 0).out);
  for (const bool reference : {false, true}) {
    SCOPED_TRACE(reference ? "reference" : "fused");
    const Grads x = run_backward(p, a, d_out, reference), y = run_backward(p, b, d_out, reference);
    EXPECT_EQ(x.dq, y.dq);
    EXPECT_EQ(x.dk, y.dk);
    EXPECT_EQ(x.dv, y.dv);
    ASSERT_EQ(x.params.groups.size(), y.params.groups.size());
    for (std::size_t g = 0; g < x.params.groups.size(); ++g) {
      EXPECT_EQ(x.params.groups[g].bias, y.params.groups[g].bias);
      EXPECT_EQ(x.params.groups[g].terms, y.params.groups[g].terms);
    }
  }
}

// A scheme of both positions held through PositionBiasRef, the open end of BiasScheme: it
// forwards every hook to the scheme it holds and counts the calls, so the results keep their bits
// only if the library reaches it through the interface (scheme.hpp), and the counts say which
// hook each path took. The attention runs it by the generic form (its value pair by pair), the
// hand-written forms being found by type.
class HeldPositionBias final : public PositionBias {
 public:
  enum Hook { kValue, kReferenceBackward, kBackward, kMaterialize, kHooks };
  explicit HeldPositionBias(BiasScheme held) : held_(std::move(held)), bias_(*position_bias(held_)) {}
  HeldPositionBias(const HeldPositionBias&) = delete;  // bias_ points into held_
  HeldPositionBias& operator=(const HeldPositionBias&) = delete;

  std::string_view scheme_name() const override { return bias_.scheme_name(); }
  std::int64_t heads() const override { return bias_.heads(); }
  std::int64_t parameter_count() const override { return bias_.parameter_count(); }
  std::vector<double> parameters() const override { return bias_.parameters(); }
  double value(std::int64_t head, std::int64_t q_position, std::int64_t k_position) const override {
    ++calls[kValue];
    return bias_.value(head, q_position, k_position);
  }
  void check_positions(const char* where, const Positions& q, const Positions& k) const override {
    bias_.check_positions(where, q, k);
  }
  void reference_backward(const Positions& q, const Positions& k, ConstTensorView ds,
                          std::span<double> grads) const override {
    ++calls[kReferenceBackward];
    bias_.reference_backward(q, k, ds, grads);
  }
  void backward(const Positions& q, const Positions& k, ConstTensorView ds, std::span<double> grads) const override {
    ++calls[kBackward];
    bias_.backward(q, k, ds, grads);
  }
  void materialize(const Positions& q, const Positions& k, TensorView out) const override {
    ++calls[kMaterialize];
    bias_.materialize(q, k, out);
  }

  mutable std::array<std::atomic<int>, kHooks> calls{};

 private:
  BiasScheme held_;
  const PositionBias& bias_;
};

TEST(Attention, APositionBiasHeldByReferenceRunsAsItself) {
  using Hook = HeldPositionBias::Hook;
  const std::int64_t dim = 32;
  const Problem p = make_problem(2, 29, 41, 4, 2, dim);
  const BiasScheme fire = FireParams::init(2, 8, 5, 0.7, 16.0), tupe = tupe_with_cls(2, dim, 16, 60, 4);
  const auto held_fire = std::make_shared<HeldPositionBias>(fire);
  const auto held_tupe = std::make_shared<HeldPositionBias>(tupe);
  const std::array<const HeldPositionBias*, 2> held = {held_fire.get(), held_tupe.get()};
  AttentionSpec through = spec_of(p);
  through.mask.causal = true;
  through.groups = {{2, {}, PositionBiasRef(held_fire)}, {2, {}, fire}};
  const Attention generic(through);
  const int values_before = held_fire->calls[Hook::kValue];
  (void)run_forward(p, generic, 0);
  EXPECT_GT(held_fire->calls[Hook::kValue], values_before);
  // The bias API reads the fast forms through the same interface.
  const Positions pos = Positions::range(7);
  const std::array<BiasScheme, 2> direct_schemes = {fire, tupe};
  for (std::size_t s = 0; s < 2; ++s) {
    const BiasScheme through_scheme = PositionBiasRef(s == 0 ? held_fire : held_tupe);
    std::vector<float> x(2 * 7 * 7), y(x.size());
    bias_materialize(direct_schemes[s], pos, pos, TensorView::of(x.data(), {2, 7, 7}));
    bias_materialize(through_scheme, pos, pos, TensorView::of(y.data(), {2, 7, 7}));
    EXPECT_EQ(x, y);
    EXPECT_EQ(held[s]->calls[Hook::kMaterialize], 1);
    std::vector<float> ds(x.size());
    for (std::size_t t = 0; t < ds.size(); ++t) ds[t] = static_cast<float>(uniform(-1, 1));
    const auto n = static_cast<std::size_t>(bias_parameter_count(direct_schemes[s]));
    std::vector<double> gx(n, 0.0), gy(n, 0.0);
    position_bias(direct_schemes[s])->backward(pos, pos, TensorView::of(ds.data(), {2, 7, 7}), gx);
    position_bias(through_scheme)->backward(pos, pos, TensorView::of(ds.data(), {2, 7, 7}), gy);
    EXPECT_EQ(gx, gy);
    EXPECT_EQ(held[s]->calls[Hook::kBackward], 1);
    EXPECT_EQ(bias_value(direct_schemes[s], 1, 5, 2), bias_value(through_scheme, 1, 5, 2));
    EXPECT_EQ(bias_parameter_count(through_scheme), static_cast<std::int64_t>(n));
    EXPECT_EQ(position_bias(through_scheme)->parameters(), position_bias(direct_schemes[s])->parameters());
    expect_error([&] { bias_value(through_scheme, 0, 3); },
                 {"bias_value: scheme = ", "bias_value(scheme, head, q_position, k_position)"});
  }
  std::vector<float> wide(2 * 61 * 61);
  expect_error(
      [&] {
        bias_materialize(PositionBiasRef(held_tupe), Positions::range(61), Positions::range(61),
                         TensorView::of(wide.data(), {2, 61, 61}));
      },
      {"bias_materialize: position = 60", "max_len = 60"});
  expect_error([] { bias_heads(BiasScheme(PositionBiasRef())); }, {"PositionBiasRef = null", "a scheme object"});
}

// Held, FIRE and TUPE are position biases of another type: the attention runs them by the
// generic form, their definitions pair by pair, which agrees with their hand-written forms.
TEST(Attention, FireAndTupeHeldRunByTheirDefinitionsAsTheirHandWrittenForms) {
  const Problem p = make_problem(2, 29, 41, 4, 2, 32);
  const std::vector<double> d_out = random_values(static_cast<std::size_t>(p.q_count()));
  const BiasScheme fire = FireParams::init(4, 8, 5, 0.7, 16.0), tupe = tupe_with_cls(4, 32, 16, 60, 4);
  for (const BiasScheme& scheme : {fire, tupe}) {
    const std::string name(position_bias(scheme)->scheme_name());
    SCOPED_TRACE(name);
    AttentionSpec own = spec_of(p), generic = spec_of(p);
    own.mask.causal = generic.mask.causal = true;
    own.groups = {HeadGroup{4, {}, scheme}};
    generic.groups = {HeadGroup{4, {}, PositionBiasRef(std::make_shared<HeldPositionBias>(scheme))}};
    expect_accurate(p, generic, name + " generic");
    expect_backward_matches_reference(p, Attention(generic), d_out);
    // Both forms against each other: f32 results of one definition.
    const Grads a = run_backward(p, Attention(own), d_out, false),
                b = run_backward(p, Attention(generic), d_out, false);
    expect_close(b.dq, a.dq, "dq");
    expect_close(b.dk, a.dk, "dk");
    expect_close(b.params.groups[0].bias, a.params.groups[0].bias, "bias parameters");
  }
  // TUPE's table refuses positions past it through the generic form too, when the Attention is built.
  AttentionSpec far = spec_of(p);
  std::vector<std::int64_t> ids(41);
  for (std::size_t t = 0; t < ids.size(); ++t) ids[t] = 40 + static_cast<std::int64_t>(t);
  far.k_positions = Positions::ids(ids);
  far.groups = {HeadGroup{4, {}, PositionBiasRef(std::make_shared<HeldPositionBias>(tupe))}};
  expect_error([&] { Attention{far}; }, {"max_len = 60"});
}

// Where no group changes the keys (RoPE over a cache of rotated keys), the transform tables cover
// the queries' positions alone: by position (a decode step's one row), or by token where the
// positions lie far apart; beside a group that rotates its keys, the keys' rows again.
TEST(Attention, RotatedKeysTabulateTheQueriesAlone) {
  const std::int64_t dim = 32;
  const RopeParams rope(dim, dim);
  const Problem p = make_problem(2, 20, 30, 4, 2, dim);
  std::vector<std::int64_t> q_ids(2 * 20), k_ids(2 * 30);
  for (std::size_t t = 0; t < q_ids.size(); ++t) q_ids[t] = 1000000 * static_cast<std::int64_t>(t / 20) + 37 * (t % 20);
  for (std::size_t t = 0; t < k_ids.size(); ++t) k_ids[t] = 1000000 * static_cast<std::int64_t>(t / 30) + 41 * (t % 30);
  const std::vector<std::vector<HeadGroup>> groupings = {
      {{4, RotaryQK{rope, true}, {}}},
      {{2, RotaryQK{rope, true}, AlibiParams(2)},
       {2, RotaryQK{RopeParams(dim, dim, 10000.0, RopeLayout::kInterleaved)}, {}}}};
  for (const auto& groups : groupings) {
    for (const bool scattered : {false, true}) {
      SCOPED_TRACE(std::to_string(groups.size()) + " groups" + (scattered ? ", scattered positions" : ""));
      AttentionSpec spec = spec_of(p);
      spec.groups = groups;
      spec.mask.causal = !scattered;
      if (scattered) {
        spec.q_positions = Positions::ids(q_ids, 2, 20);
        spec.k_positions = Positions::ids(k_ids, 2, 30);
      }
      expect_accurate(p, spec, "forward");
      expect_backward_matches_reference(p, Attention(spec), random_values(static_cast<std::size_t>(p.q_count())));
    }
    const Problem d = make_problem(2, 1, 9000, 4, 2, dim);
    AttentionSpec ds = spec_of(d);
    ds.groups = groups;
    expect_accurate(d, ds, "decode");
  }
}

// A decode step's forward never skips far tiles, so its plan leaves the tables' running maxima
// to the first pass that can (build_tile_maxima): a backward through the same object, after the
// decode, builds them and skips tiles with the bits of the pass without the skip; the forward
// after it gives its first bits.
TEST(Attention, ADecodeStepLeavesTheTileMaximaToThePassesThatSkip) {
  const Problem d = make_problem(1, 1, 3000, 4, 2, 32);
  AttentionSpec spec = spec_of(d);
  spec.mask.causal = true;
  spec.groups = {{4, {}, AlibiParams(kSteepSlopes)}};
  const auto [skipping, running] = with_and_without_skip(spec);
  const Outputs before = run_forward(d, skipping, 0);
  expect_accurate(d, spec, "decode");
  const std::vector<double> d_out = random_values(static_cast<std::size_t>(d.q_count()));
  for (const int threads : {1, 2}) {
    set_num_threads(threads);
    const Grads a = run_backward(d, skipping, d_out, false), b = run_backward(d, running, d_out, false);
    EXPECT_GT(a.stats.skipped, 0);
    EXPECT_EQ(a.dq, b.dq);
    EXPECT_EQ(a.dk, b.dk);
    EXPECT_EQ(a.dv, b.dv);
    EXPECT_EQ(a.params.groups[0].bias, b.params.groups[0].bias);
  }
  set_num_threads(2);
  EXPECT_EQ(run_forward(d, skipping, 0).out, before.out);
}

// RoPE's rows over positions from 0 are kept across calls (a decode step meets every cache
// position again): a call's bits do not depend on what ran before it — a longer table already
// kept, a shorter one grown, none — nor on posenc::empty_cache() while its Attention lives.
// YaRN's frequencies are fixed; dynamic NTK's move with the length (then nothing is shared).
TEST(Attention, RopeRowsKeptAcrossCallsGiveEachCallItsOwnBits) {
  const std::int64_t dim = 64;
  RopeScaling yarn;
  yarn.type = RopeType::kYarn;
  yarn.factor = 4.0;
  RopeScaling dynamic;
  dynamic.type = RopeType::kDynamic;
  dynamic.factor = 2.0;
  for (const RopeParams& rope : {RopeParams(dim, dim), RopeParams(dim, 48, 500000.0, RopeLayout::kInterleaved, yarn),
                                 RopeParams(dim, dim, 10000.0, RopeLayout::kHalfSplit, dynamic, 4096)}) {
    std::map<std::int64_t, Problem> problems;  // one per length: the same inputs at every call
    for (const std::int64_t keys : {2000, 3000, 5000, 9000, 20000})
      problems.emplace(keys, make_problem(1, 1, keys, 4, 2, dim));
    const auto step = [&](std::int64_t keys) {
      const Problem& d = problems.at(keys);
      AttentionSpec spec = spec_of(d);
      spec.mask.causal = true;
      spec.groups = {{4, RotaryQK{rope}, {}}};
      return run_forward(d, Attention(spec), 0).out;
    };
    posenc::empty_cache();
    const std::vector<double> alone = step(3000), grown_alone = step(20000);
    posenc::empty_cache();
    (void)step(9000);
    EXPECT_EQ(step(3000), alone);  // inside a longer table
    posenc::empty_cache();
    (void)step(2000);
    EXPECT_EQ(step(20000), grown_alone);  // a table grown from a shorter one
    // Nor on the target that ran before: set_target empties the cache, so rows made by another
    // target's kernels (the same bits on this host's targets today) never serve this one.
    for (const std::string& target : available_targets()) {
      set_target(target);
      (void)step(3000);
      set_target("auto");
      EXPECT_EQ(step(3000), alone) << target;
    }
    // A prefill from position 0 shares the rows too; its Attention keeps them through empty_cache.
    const Problem p = make_problem(1, 300, 300, 4, 2, dim);
    AttentionSpec spec = spec_of(p);
    spec.mask.causal = true;
    spec.groups = {{4, RotaryQK{rope}, {}}};
    const Attention att(spec);
    const std::vector<double> before = run_forward(p, att, 0).out;
    posenc::empty_cache();
    (void)step(5000);
    EXPECT_EQ(run_forward(p, att, 0).out, before);
    expect_accurate(p, spec, "prefill");
    const std::vector<double> d_out = random_values(static_cast<std::size_t>(p.q_count()));
    expect_backward_matches_reference(p, att, d_out);
    const Problem d = make_problem(1, 1, 7000, 4, 2, dim);
    AttentionSpec ds = spec_of(d);
    ds.mask.causal = true;
    ds.groups = {{4, RotaryQK{rope}, {}}};
    expect_accurate(d, ds, "decode");
  }
}

TEST(Attention, BitwiseIdenticalForAnyThreadCount) {
  Problem p = make_problem(2, 150, 150, 4, 2, 64);
  AttentionSpec spec = spec_of(p);
  spec.mask.causal = true;
  spec.groups = {{4, RotaryQK{RopeParams(64, 64)}, AlibiParams(4)}};
  const Attention att(spec);
  const std::vector<double> d_out = random_values(static_cast<std::size_t>(p.q_count()));
  Problem d = make_problem(1, 1, 9000, 4, 1, 64);
  const Attention dec(spec_of(d));
  std::vector<Grads> runs;
  std::vector<Outputs> decodes;
  for (const int threads : {1, 2, 3}) {
    set_num_threads(threads);
    runs.push_back(run_backward(p, att, d_out, false));
    decodes.push_back(run_forward(d, dec, 0));
  }
  set_num_threads(2);
  for (std::size_t r = 1; r < runs.size(); ++r) {
    EXPECT_EQ(runs[r].dq, runs[0].dq);
    EXPECT_EQ(runs[r].dk, runs[0].dk);
    EXPECT_EQ(runs[r].dv, runs[0].dv);
    EXPECT_EQ(runs[r].params.groups[0].bias, runs[0].params.groups[0].bias);
    EXPECT_EQ(decodes[r].out, decodes[0].out);
  }
  // Transformer-XL's and TUPE's gradients (tables summed per unit, units in order).
  AttentionSpec xs = spec_of(p);
  xs.mask.causal = true;
  xs.groups = {{2, {}, {}, {xl_term(XlParams::init(2, 64, 32, 0.5, 2))}},
               {2, {}, TupeParams::init(2, 64, 16, 150, true, 0.5, 3)}};
  const Attention xatt(xs);
  std::vector<Grads> xruns;
  for (const int threads : {1, 2, 3}) {
    set_num_threads(threads);
    xruns.push_back(run_backward(p, xatt, d_out, false));
  }
  set_num_threads(2);
  for (std::size_t r = 1; r < xruns.size(); ++r) {
    EXPECT_EQ(xruns[r].dq, xruns[0].dq);
    EXPECT_EQ(xruns[r].params.groups[0].terms[0], xruns[0].params.groups[0].terms[0]);  // u, v, W_R
    EXPECT_EQ(xruns[r].params.groups[1].bias, xruns[0].params.groups[1].bias);
  }
}

// Backward skips the (tile, row block) steps whose probabilities all vanish against the rows'
// lse: the gradients must keep every bit (dV of a skipped key's step is exactly 0 only if every
// probability there was), including the ALiBi slopes' — for one and two threads.
TEST(Attention, BackwardSkipsVanishingTilesWithoutChangingABit) {
  const std::vector<double> steep = kSteepSlopes;
  const std::vector<VanishingCase> cases = {
      {"causal", 300, 300, true, -1, {{4, {}, AlibiParams(steep)}}},
      {"queries at the end of longer keys", 150, 420, true, -1, {{4, {}, AlibiParams(steep)}}},
      {"bidirectional, symmetric", 260, 260, false, -1, {{4, {}, AlibiParams(steep, AlibiForm::kSymmetric)}}},
      {"sliding window, large logits", 300, 300, true, 150, {{4, {}, AlibiParams(steep)}}, true, 4.0},
  };
  for (const VanishingCase& c : cases) {
    SCOPED_TRACE(c.what);
    const Problem p = c.problem();
    const AttentionSpec spec = c.spec(p);
    const auto [skipping, running] = with_and_without_skip(spec);
    const std::vector<double> d_out = random_values(static_cast<std::size_t>(p.q_count()));
    for (const int threads : {1, 2}) {
      set_num_threads(threads);
      const Grads a = run_backward(p, skipping, d_out, false), b = run_backward(p, running, d_out, false);
      EXPECT_EQ(a.dq, b.dq);
      EXPECT_EQ(a.dk, b.dk);
      EXPECT_EQ(a.dv, b.dv);
      EXPECT_EQ(a.params.groups[0].bias, b.params.groups[0].bias);
      EXPECT_GT(a.stats.skipped, 0);
      EXPECT_EQ(b.stats.skipped, 0);
      EXPECT_EQ(a.stats.tiles, b.stats.tiles);
    }
    set_num_threads(2);
  }
  // Far keys aligned with the queries (SkippedTilesHoldOnlyFlushedProbabilities): a step skipped
  // with a probability of FLT_MIN or more would leave its keys' dV at exactly 0.
  const Problem p = aligned_far_keys();
  const auto [skipping, running] = with_and_without_skip(aligned_far_keys_spec(p));
  const std::vector<double> d_out = random_values(static_cast<std::size_t>(p.q_count()));
  const Grads a = run_backward(p, skipping, d_out, false), b = run_backward(p, running, d_out, false);
  EXPECT_GT(a.stats.skipped, 0);
  EXPECT_EQ(a.dq, b.dq);
  EXPECT_EQ(a.dk, b.dk);
  EXPECT_EQ(a.dv, b.dv);
}

TEST(Attention, BackwardSplitsTheQueriesOfFewLongSequences) {
  // One sequence × one KV head is a single (sequence, KV head) unit: backward splits its queries
  // into ranges of >= 256 (here 2 and then 3), each with its own dK, dV rows summed afterwards. The
  // packed problem mixes a split sequence with one too short to split. Checked against the fp64
  // reference, with the parameters' gradients (summed per range), and bitwise across threads.
  Problem p = make_problem(1, 600, 600, 2, 1, 32);
  Problem packed = make_packed({{800, 800}, {30, 45}}, 2, 1, 32);
  std::vector<double> t5_table(32);
  for (auto& x : t5_table) x = uniform(-1, 1);
  const std::vector<std::vector<HeadGroup>> cases = {
      {{2, RotaryQK{RopeParams(32, 32)}, AlibiParams(2)}},
      {{1, {}, {}, {shaw_term(1, ShawParams::init(6, 32, 0.5, 3))}},
       {1, {}, T5BiasParams(1, 16, 64, false, std::vector<double>(t5_table.begin(), t5_table.begin() + 16))}},
      {{2, {}, tupe_with_cls(2, 32, 24, 600, 4)}},
  };
  for (std::size_t c = 0; c < cases.size(); ++c) {
    for (const Problem* prob : {&p, &packed}) {
      if (c == 2 && prob == &packed) continue;  // TUPE's fp64 reference is slow; one problem does
      SCOPED_TRACE("case " + std::to_string(c) + (prob == &packed ? ", packed" : ""));
      AttentionSpec spec = spec_of(*prob);
      spec.groups = cases[c];
      spec.mask.causal = true;
      const Attention att(spec);
      const std::vector<double> d_out = random_values(static_cast<std::size_t>(prob->q_count()));
      expect_backward_matches_reference(*prob, att, d_out);
      if (c != 1) continue;
      std::vector<Grads> runs;
      for (const int threads : {1, 2, 3}) {
        set_num_threads(threads);
        runs.push_back(run_backward(*prob, att, d_out, false));
      }
      set_num_threads(2);
      for (std::size_t r = 1; r < runs.size(); ++r) {
        EXPECT_EQ(runs[r].dq, runs[0].dq);
        EXPECT_EQ(runs[r].dk, runs[0].dk);
        EXPECT_EQ(runs[r].params.groups[0].terms[0], runs[0].params.groups[0].terms[0]);  // Shaw's tables
        EXPECT_EQ(runs[r].params.groups[1].bias, runs[0].params.groups[1].bias);
      }
    }
  }
}

TEST(Attention, ClearErrors) {
  Problem p = make_problem(1, 8, 8, 4, 2, 16);
  Problem bad_heads = make_problem(1, 8, 8, 4, 3, 16);
  expect_error([&] { Attention a(spec_of(bad_heads)); }, {"Attention", "k", "KV head count dividing"});
  AttentionSpec s = spec_of(p);
  s.mask.window_left = -2;
  expect_error([&] { Attention a(s); }, {"mask.window_left", "-2", ">= -1"});
  s = spec_of(p);
  s.groups = {{3, {}, AlibiParams(3)}};
  expect_error([&] { Attention a(s); }, {"groups", "3 heads", "tiled"});
  s.groups = {{1, RotaryQK{RopeParams(16, 16)}, {}}, {3, {}, {}}};
  expect_error([&] { Attention a(s); }, {"groups[0].heads", "whole KV groups"});
  s.groups = {{4, {}, AlibiParams(2)}};
  expect_error([&] { Attention a(s); }, {"groups[0].bias", "2 heads"});
  expect_error([] { ShawTerm(0, ShawParams(1, 4)); }, {"ShawTerm", "heads", "0", ">= 1"});
  s.groups = {{4, {}, {}, {shaw_term(4, ShawParams::init(3, 8))}}};
  expect_error([&] { Attention a(s); }, {"groups[0].terms[0].params.head_dim", "8", "16"});
  s.groups = {{4, {}, AlibiParams(4), {xl_term(XlParams::init(4, 16, 8))}}};
  expect_error([&] { Attention a(s); }, {"groups[0].terms[0]", "alone"});
  s.groups = {{4, {}, {}, {xl_term(XlParams::init(4, 16, 8)), shaw_term(4, ShawParams::init(3, 16))}}};
  expect_error([&] { Attention a(s); }, {"groups[0].terms[0]", "another Shaw or XL term", "alone"});
  s.groups = {{4, {}, {}, {xl_term(XlParams::init(4, 16, 8)), xl_term(XlParams::init(4, 16, 8))}}};
  expect_error([&] { Attention a(s); }, {"groups[0].terms[0]", "another Shaw or XL term", "alone"});
  s.groups = {{4, {}, {}, {xl_term(XlParams::init(2, 16, 8))}}};
  expect_error([&] { Attention a(s); }, {"groups[0].terms[0].heads", "2", "4 (the group's heads)"});
  s.groups = {
      {4,
       {},
       {},
       {xl_term(XlParams(4, 16, 8, std::vector<double>(64), std::vector<double>(64), std::vector<double>(512), 0.5))}}};
  expect_error([&] { Attention a(s); }, {"groups[0].terms[0].params.scale", "0.5", "the attention's scale"});
  s = spec_of(p);
  s.mask.softcap = std::nan("");
  expect_error([&] { Attention a(s); }, {"mask.softcap", "nan"});
  s = spec_of(p);
  s.mask.key_lengths = {9};
  expect_error([&] { Attention a(s); }, {"mask.key_lengths", "[0] = 9", "[0, 8]"});
  Problem packed = make_packed({{3, 3}, {5, 5}}, 4, 2, 16);
  s = spec_of(packed);
  s.cu_seqlens_q = {0, 5, 3, 8};
  s.cu_seqlens_k = {0, 3, 5, 8};
  expect_error([&] { Attention a(s); }, {"cu_seqlens_q", "[2] = 3", "non-decreasing"});
  s = spec_of(packed);
  s.cu_seqlens_k = {0, 3, 7};
  expect_error([&] { Attention a(s); }, {"cu_seqlens_k", "last = 7", "8"});
  const Attention att(spec_of(p));
  std::vector<float> out(static_cast<std::size_t>(p.q_count())), small(3);
  expect_error([&] { att.forward(TensorView::of(small.data(), {3})); }, {"Attention", "out"});
  std::vector<float> lse(5);
  expect_error(
      [&] {
        att.forward(TensorView::of(out.data(), {1, 8, 4, 16}), TensorView::of(lse.data(), {5}));
      },
      {"lse", "[B, H, Sq] = [1, 4, 8]"});
  s = spec_of(p);
  s.groups = {{4, {}, TupeParams::init(4, 16, 8, 6)}};
  expect_error([&] { Attention a(s); }, {"position", "max_len"});
  s.groups = {{4, {}, TupeParams::init(4, 8, 8, 16)}};
  expect_error([&] { Attention a(s); }, {"TUPE", "head_dim", "8", "16"});
  // Gradients shaped for another scheme.
  s.groups = {{4, {}, TupeParams::init(4, 16, 8, 16)}};
  const Attention tupe(s);
  AttentionGradients grads = tupe.zero_gradients();
  grads.groups[0].bias.pop_back();
  std::vector<float> zeros(static_cast<std::size_t>(p.q_count()));
  std::vector<float> l2(32);
  tupe.forward(TensorView::of(out.data(), {1, 8, 4, 16}), TensorView::of(l2.data(), {1, 4, 8}));
  expect_error(
      [&] {
        tupe.backward(TensorView::of(out.data(), {1, 8, 4, 16}), TensorView::of(l2.data(), {1, 4, 8}),
                      TensorView::of(zeros.data(), {1, 8, 4, 16}), {}, {}, {}, &grads);
      },
      {"grads.groups[0].bias"});
  // Shaw's and XL's gradients are their terms' (GroupGradients::terms), checked all the same.
  const auto refuses_gradients = [&](const HeadGroup& group, const auto& spoil,
                                     std::initializer_list<std::string> words) {
    s = spec_of(p);
    s.groups = {group};
    const Attention a(s);
    AttentionGradients g = a.zero_gradients();
    spoil(g.groups[0]);
    a.forward(TensorView::of(out.data(), {1, 8, 4, 16}), TensorView::of(l2.data(), {1, 4, 8}));
    expect_error(
        [&] {
          a.backward(TensorView::of(out.data(), {1, 8, 4, 16}), TensorView::of(l2.data(), {1, 4, 8}),
                     TensorView::of(zeros.data(), {1, 8, 4, 16}), {}, {}, {}, &g);
        },
        words);
  };
  const HeadGroup shaw_group{4, {}, {}, {shaw_term(4, ShawParams::init(3, 16))}};
  refuses_gradients(shaw_group, [](GroupGradients& g) { g.terms[0].pop_back(); }, {"grads.groups[0].terms[0]"});
  refuses_gradients(shaw_group, [](GroupGradients& g) { g.terms[0].clear(); }, {"grads.groups[0].terms[0]"});
  const HeadGroup xl_group{4, {}, {}, {xl_term(XlParams::init(4, 16, 8))}};
  refuses_gradients(xl_group, [](GroupGradients& g) { g.terms[0].push_back(0.0); }, {"grads.groups[0].terms[0]"});
  refuses_gradients(xl_group, [](GroupGradients& g) { g.terms.clear(); }, {"grads.groups[0].terms", "size 0"});
  // Shaw's value term has head_dim columns: values narrower than the keys are refused.
  s = spec_of(p);
  s.groups = {shaw_group};
  const std::vector<std::int64_t> narrow = {s.v.size(0), s.v.size(1), s.v.size(2), 8};
  const std::vector<std::int64_t> v_strides = {s.v.stride(0), s.v.stride(1), s.v.stride(2), s.v.stride(3)};
  s.v = ConstTensorView(s.v.data(), s.v.dtype(), narrow, v_strides);
  expect_error([&] { Attention a(s); }, {"groups[0].terms[0]", "values 8 wide", "values as wide as the keys (16)"});
}

// Every output of a call must lie apart from its inputs and from the other outputs: out on k's
// memory read wrong keys, lse inside out corrupted one of them, and the gradients (+=) on an input
// change what later tiles read. Exactly the same view counts too (no output is written in place).
TEST(Attention, RefusesOutputsThatShareMemoryWithInputsOrEachOther) {
  for (const char* target : {"auto", "ref"}) {
    SCOPED_TRACE(target);
    set_target(target);
    Problem p = make_problem(1, 8, 8, 4, 4, 16);  // k and v shaped like q: an out on them fits
    const Attention att(spec_of(p));
    const std::vector<std::int64_t> shape = {1, 8, 4, 16};
    const TensorView on_k = TensorView::contiguous(p.kb.data(), DType::kF32, shape);
    const TensorView on_q = TensorView::contiguous(p.qb.data(), DType::kF32, shape);
    std::vector<float> out(static_cast<std::size_t>(p.q_count())), lse(32), grad(out.size()), grad2(out.size());
    const TensorView out_view = TensorView::of(out.data(), {1, 8, 4, 16});
    expect_error([&] { att.forward(on_k); }, {"Attention", "out", "memory disjoint from k"});
    expect_error([&] { att.forward(on_q); }, {"out", "memory disjoint from q"});
    // lse over the first 32 floats of out.
    expect_error(
        [&] {
          att.forward(out_view, TensorView::of(out.data(), {1, 4, 8}));
        },
        {"out", "memory disjoint from lse"});
    att.forward(out_view, TensorView::of(lse.data(), {1, 4, 8}));
    const TensorView lse_view = TensorView::of(lse.data(), {1, 4, 8});
    const TensorView d_out = TensorView::of(grad.data(), {1, 8, 4, 16});
    const TensorView dq = TensorView::of(grad2.data(), {1, 8, 4, 16});
    expect_error([&] { att.backward(out_view, lse_view, d_out, on_q, {}, {}); }, {"dq", "memory disjoint from q"});
    expect_error([&] { att.backward(out_view, lse_view, d_out, dq, dq, {}); }, {"dq", "memory disjoint from dk"});
    expect_error([&] { att.backward(out_view, lse_view, d_out, {}, {}, out_view); }, {"dv", "disjoint from out"});
    expect_error([&] { att.backward(out_view, lse_view, d_out, d_out, {}, {}); }, {"dq", "disjoint from d_out"});
    // Apart, everything runs.
    att.backward(out_view, lse_view, d_out, dq, {}, {});
  }
  set_target("auto");
}

}  // namespace
}  // namespace posenc
