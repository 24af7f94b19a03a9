// Stick-breaking attention (posenc/stickbreaking.hpp): the definition worked by hand, the fused
// passes against the fp64 reference on every target (layouts, dtypes, GQA, packed sequences,
// decode, attend_current, values narrower or wider than the keys), the reference's gradients by
// finite differences, thread counts, the vanishing-tile skip, non-finite inputs and bad input.
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "attention_testing.hpp"
#include "posenc/stickbreaking.hpp"
#include "testing.hpp"

namespace posenc {
namespace {

using namespace attention_testing;
using testing::expect_error;

// A problem with values of their own head size dv (Problem's v is unused).
struct SbProblem {
  Problem p;
  std::int64_t dv = 0;
  std::vector<double> v;
  std::vector<unsigned char> vb;
  std::vector<double> v64;
  std::int64_t rows() const { return (p.packed() ? 1 : p.batch) * p.q_len * p.heads; }
  std::int64_t out_count() const { return rows() * dv; }
  std::int64_t v_count() const { return (p.packed() ? 1 : p.batch) * p.k_len * p.kv_heads * dv; }
  std::vector<std::int64_t> vshape(std::int64_t seq, std::int64_t h) const {
    return p.packed() ? std::vector<std::int64_t>{seq, h, dv} : std::vector<std::int64_t>{p.batch, seq, h, dv};
  }
  ConstTensorView values(DType dt) const {
    return ConstTensorView::contiguous(dt == DType::kF64 ? static_cast<const void*>(v.data()) : vb.data(), dt,
                                       vshape(p.k_len, p.kv_heads));
  }
  StickBreakingSpec spec(bool f64 = false) const {
    StickBreakingSpec s;
    const DType dt = f64 ? DType::kF64 : p.dtype;
    s.q = f64 ? ConstTensorView(p.q.data(), dt, p.shape(p.q_len, p.heads), p.strides(p.q_len, p.heads)) : p.qv();
    s.k = f64 ? ConstTensorView(p.k.data(), dt, p.shape(p.k_len, p.kv_heads), p.strides(p.k_len, p.kv_heads)) : p.kv();
    s.v = values(dt);
    s.cu_seqlens_q = p.cu_q;
    s.cu_seqlens_k = p.cu_k;
    return s;
  }
};

SbProblem make_sb(Problem p, std::int64_t dv) {
  SbProblem s;
  s.p = std::move(p);
  s.dv = dv;
  fill(s.v, s.vb, s.v_count(), s.p.dtype, 1.0);
  return s;
}

// out and rem of one forward, widened to double.
struct Result {
  std::vector<double> out, rem;
  AttentionStats stats;
};

Result run(const SbProblem& s, const StickBreakingAttention& att, DType dt) {
  std::vector<unsigned char> out = testing::garbage_buffer(dt, s.out_count());
  std::vector<float> rem(static_cast<std::size_t>(s.rows()), 7.0f);
  const TensorView ov = TensorView::contiguous(out.data(), dt, s.vshape(s.p.q_len, s.p.heads));
  const std::vector<std::int64_t> rs = s.p.packed() ? std::vector<std::int64_t>{s.p.q_len, s.p.heads}
                                                    : std::vector<std::int64_t>{s.p.batch, s.p.q_len, s.p.heads};
  Result r;
  r.stats = att.forward(ov, TensorView::contiguous(rem.data(), DType::kF32, rs));
  for (std::int64_t i = 0; i < s.out_count(); ++i) r.out.push_back(testing::element(out.data(), dt, i));
  r.rem.assign(rem.begin(), rem.end());
  return r;
}

// dq, dk, dv of one backward with d_out and d_rem, after a forward on the same object.
struct Grads {
  std::vector<double> dq, dk, dv;
};

Grads run_backward(const SbProblem& s, const StickBreakingAttention& att, DType dt, const std::vector<double>& d_out,
                   const std::vector<double>& d_rem, DType out_dt = DType::kF64) {
  if (out_dt == DType::kF64) out_dt = dt;
  const Problem& p = s.p;
  const std::vector<std::int64_t> oshape = s.vshape(p.q_len, p.heads);
  const std::vector<std::int64_t> rs =
      p.packed() ? std::vector<std::int64_t>{p.q_len, p.heads} : std::vector<std::int64_t>{p.batch, p.q_len, p.heads};
  std::vector<unsigned char> out = testing::garbage_buffer(out_dt, s.out_count());
  std::vector<float> rem(static_cast<std::size_t>(s.rows()));
  att.forward(TensorView::contiguous(out.data(), out_dt, oshape), TensorView::contiguous(rem.data(), DType::kF32, rs));
  const std::vector<unsigned char> dob = testing::to_dtype(d_out, dt);
  std::vector<float> drem(d_rem.begin(), d_rem.end());
  std::vector<unsigned char> dq =
      testing::to_dtype(std::vector<double>(static_cast<std::size_t>(p.q_count()), 0.0), dt);
  std::vector<unsigned char> dk =
      testing::to_dtype(std::vector<double>(static_cast<std::size_t>(p.k_count()), 0.0), dt);
  std::vector<unsigned char> dv =
      testing::to_dtype(std::vector<double>(static_cast<std::size_t>(s.v_count()), 0.0), dt);
  att.backward(ConstTensorView::contiguous(out.data(), out_dt, oshape),
               ConstTensorView::contiguous(rem.data(), DType::kF32, rs),
               ConstTensorView::contiguous(dob.data(), dt, oshape),
               d_rem.empty() ? ConstTensorView{} : ConstTensorView::contiguous(drem.data(), DType::kF32, rs),
               TensorView(dq.data(), dt, p.shape(p.q_len, p.heads), p.strides(p.q_len, p.heads)),
               TensorView(dk.data(), dt, p.shape(p.k_len, p.kv_heads), p.strides(p.k_len, p.kv_heads)),
               TensorView::contiguous(dv.data(), dt, s.vshape(p.k_len, p.kv_heads)));
  Grads g;
  for (std::int64_t i = 0; i < p.q_count(); ++i) g.dq.push_back(testing::element(dq.data(), dt, i));
  for (std::int64_t i = 0; i < p.k_count(); ++i) g.dk.push_back(testing::element(dk.data(), dt, i));
  for (std::int64_t i = 0; i < s.v_count(); ++i) g.dv.push_back(testing::element(dv.data(), dt, i));
  return g;
}

// Three tokens, one head, D = 1, q = k = 1 except k_1 = 2, scale 1: query 2 sees keys 1 then 0.
TEST(StickBreaking, WorkedByHand) {
  const std::vector<float> q = {1, 1, 1}, k = {1, 2, 1}, v = {10, 20, 30};
  StickBreakingSpec spec;
  spec.q = ConstTensorView::of(q.data(), {1, 3, 1, 1});
  spec.k = ConstTensorView::of(k.data(), {1, 3, 1, 1});
  spec.v = ConstTensorView::of(v.data(), {1, 3, 1, 1});
  spec.scale = 1.0;
  const auto sig = [](double x) { return 1 / (1 + std::exp(-x)); };
  for (const bool current : {false, true}) {
    SCOPED_TRACE(current ? "attend_current" : "default");
    spec.attend_current = current;
    std::vector<float> out(3), rem(3);
    StickBreakingAttention(spec).forward(TensorView::of(out.data(), {1, 3, 1, 1}),
                                         TensorView::of(rem.data(), {1, 3, 1}));
    // Query 2 (default): A_21 = σ(2), A_20 = σ(1)(1 − σ(2)); with the diagonal A_22 = σ(1) first.
    const double lead = current ? 1 - sig(1) : 1.0;
    const double a21 = lead * sig(2), a20 = lead * (1 - sig(2)) * sig(1);
    const double a22 = current ? sig(1) : 0.0;
    EXPECT_NEAR(out[2], a22 * 30 + a21 * 20 + a20 * 10, 1e-5);
    EXPECT_NEAR(rem[2], 1 - a22 - a21 - a20, 1e-6);
    // Query 0 sees nothing by default: out 0, rem 1.
    EXPECT_EQ(out[0], current ? static_cast<float>(sig(1) * 10) : 0.0f);
    EXPECT_NEAR(rem[0], current ? 1 - sig(1) : 1.0, 1e-7);
  }
}

class StickBreakingTargets : public testing::EveryTarget {};

// Forward within a few f32 rounding steps of the fp64 reference (16-bit outputs: half their ulp
// more) and backward within 1e-4 of the gradients' size in f32 (the total G minus the running
// suffix cancels). 16-bit backward reads an f32 out (stickbreaking.hpp: a 16-bit one costs
// percents) and rounds its gradients once to the dtype: 2^−8 of their size (bf16's half ulp is
// 2^−9 relative).
TEST_P(StickBreakingTargets, MatchesTheReference) {
  struct Case {
    const char* what;
    std::int64_t batch, q_len, k_len, heads, kv_heads, dim, dv;
    DType dtype;
    bool head_major, current;
  };
  const Case cases[] = {
      {"MHA prefill", 2, 150, 150, 2, 2, 32, 32, DType::kF32, false, false},
      {"GQA, [B, H, S, D] memory", 1, 130, 130, 6, 2, 64, 64, DType::kF32, true, false},
      {"attend_current", 1, 100, 100, 4, 4, 16, 16, DType::kF32, false, true},
      {"queries at the end of longer keys", 2, 37, 200, 4, 1, 32, 32, DType::kF32, false, false},
      {"decode", 3, 1, 300, 8, 2, 64, 64, DType::kF32, false, false},
      {"values narrower (MLA-like) and a D off the lanes", 1, 70, 70, 2, 1, 40, 24, DType::kF32, false, false},
      {"values wider", 1, 70, 70, 2, 2, 16, 48, DType::kF32, true, true},
      {"bf16", 1, 90, 90, 4, 2, 32, 32, DType::kBF16, false, false},
      {"f16", 1, 90, 90, 4, 2, 32, 32, DType::kF16, true, true},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    // q and k of scale 2: logits of a few units, so that rows keep weight over tens of keys.
    const SbProblem s =
        make_sb(make_problem(c.batch, c.q_len, c.k_len, c.heads, c.kv_heads, c.dim, c.dtype, c.head_major, 2.0), c.dv);
    StickBreakingSpec spec = s.spec(), spec64 = s.spec(true);
    spec.attend_current = spec64.attend_current = c.current;
    const StickBreakingAttention fused(spec), ref(spec64);
    const Result got = run(s, fused, c.dtype), want = run(s, ref, DType::kF64);
    const double out_tol = c.dtype == DType::kF32 ? 2e-5 : c.dtype == DType::kBF16 ? 8e-3 : 1e-3;
    testing::expect_near_all(got.out, want.out, out_tol * std::max(1.0, testing::largest(want.out)), "out");
    testing::expect_near_all(got.rem, want.rem, 2e-5, "rem");
    std::vector<double> d_out(static_cast<std::size_t>(s.out_count())), d_rem(static_cast<std::size_t>(s.rows()));
    for (auto& x : d_out) x = testing::round_to(uniform(-1, 1), c.dtype);
    for (auto& x : d_rem) x = uniform(-1, 1);
    const Grads g = run_backward(s, fused, c.dtype, d_out, d_rem, DType::kF32);
    const Grads w = run_backward(s, ref, DType::kF64, d_out, d_rem);
    const double rel = c.dtype == DType::kF32 ? 1e-4 : 1.0 / 256;
    testing::expect_near_all(g.dq, w.dq, rel * testing::largest(w.dq) + 1e-6, "dq");
    testing::expect_near_all(g.dk, w.dk, rel * testing::largest(w.dk) + 1e-6, "dk");
    testing::expect_near_all(g.dv, w.dv, rel * testing::largest(w.dv) + 1e-6, "dv");
  }
}

// Packed sequences, empty and one-token ones among them, each its own stick.
TEST_P(StickBreakingTargets, PackedSequences) {
  for (const bool current : {false, true}) {
    const SbProblem s = make_sb(make_packed({{40, 40}, {1, 1}, {70, 70}, {0, 0}, {20, 33}}, 4, 2, 32), 32);
    StickBreakingSpec spec = s.spec(), spec64 = s.spec(true);
    spec.attend_current = spec64.attend_current = current;
    const StickBreakingAttention fused(spec), ref(spec64);
    const Result got = run(s, fused, DType::kF32), want = run(s, ref, DType::kF64);
    testing::expect_near_all(got.out, want.out, 2e-5, "out");
    testing::expect_near_all(got.rem, want.rem, 2e-5, "rem");
    std::vector<double> d_out(static_cast<std::size_t>(s.out_count()));
    for (auto& x : d_out) x = uniform(-1, 1);
    const Grads g = run_backward(s, fused, DType::kF32, d_out, {}), w = run_backward(s, ref, DType::kF64, d_out, {});
    testing::expect_near_all(g.dq, w.dq, 1e-4 * testing::largest(w.dq) + 1e-6, "dq");
    testing::expect_near_all(g.dk, w.dk, 1e-4 * testing::largest(w.dk) + 1e-6, "dk");
    testing::expect_near_all(g.dv, w.dv, 1e-4 * testing::largest(w.dv) + 1e-6, "dv");
  }
}

INSTANTIATE_TEST_SUITE_P(Targets, StickBreakingTargets, ::testing::ValuesIn(testing::all_targets()));

// The reference's backward against central differences of L = Σ w·out + Σ u·rem in fp64.
TEST(StickBreaking, ReferenceGradientsMatchFiniteDifferences) {
  for (const bool current : {false, true}) {
    SCOPED_TRACE(current ? "attend_current" : "default");
    SbProblem s = make_sb(make_problem(1, 6, 9, 2, 1, 4, DType::kF32, false, 1.5), 3);
    std::vector<double> w(static_cast<std::size_t>(s.out_count())), u(static_cast<std::size_t>(s.rows()));
    for (auto& x : w) x = uniform(-1, 1);
    for (auto& x : u) x = uniform(-1, 1);
    const auto loss = [&] {
      StickBreakingSpec spec = s.spec(true);
      spec.attend_current = current;
      const Result r = run(s, StickBreakingAttention(spec), DType::kF64);
      double l = 0;
      for (std::size_t i = 0; i < w.size(); ++i) l += w[i] * r.out[i];
      for (std::size_t i = 0; i < u.size(); ++i) l += u[i] * r.rem[i];
      return l;
    };
    StickBreakingSpec spec = s.spec(true);
    spec.attend_current = current;
    const Grads g = run_backward(s, StickBreakingAttention(spec), DType::kF64, w, u);
    // rem is stored in f32: its part of L moves by u·2^−24 per element, so the step is 1e-3 and the
    // tolerance 1e-5 (central differences err by O(h²) = 1e-6 here).
    const double h = 1e-3;
    const auto check = [&](std::vector<double>& x, const std::vector<double>& grad, const char* what) {
      for (std::size_t i = 0; i < x.size(); ++i)
        EXPECT_NEAR(grad[i], testing::central_difference(x[i], h, loss), 1e-5) << what << " " << i;
    };
    check(s.p.q, g.dq, "dq");
    check(s.p.k, g.dk, "dk");
    check(s.v, g.dv, "dv");
  }
}

// Query ranges (one (sequence, KV head) pair: split into ranges whose dK, dV sum in order) and
// the tile walk give the same bits for 1, 2 and 3 threads.
TEST(StickBreaking, BitwiseIdenticalForAnyThreadCount) {
  const SbProblem s = make_sb(make_problem(1, 700, 700, 2, 1, 32, DType::kF32, false, 0.5), 32);
  const StickBreakingAttention att(s.spec());
  std::vector<double> d_out(static_cast<std::size_t>(s.out_count())), d_rem(static_cast<std::size_t>(s.rows()));
  for (auto& x : d_out) x = uniform(-1, 1);
  for (auto& x : d_rem) x = uniform(-1, 1);
  const int before = num_threads();
  set_num_threads(1);
  const Result r1 = run(s, att, DType::kF32);
  const Grads g1 = run_backward(s, att, DType::kF32, d_out, d_rem);
  for (const int n : {2, 3}) {
    set_num_threads(n);
    const Result r = run(s, att, DType::kF32);
    const Grads g = run_backward(s, att, DType::kF32, d_out, d_rem);
    EXPECT_TRUE(testing::same_bits(r.out, r1.out) && testing::same_bits(r.rem, r1.rem)) << n << " threads";
    EXPECT_TRUE(testing::same_bits(g.dq, g1.dq) && testing::same_bits(g.dk, g1.dk) && testing::same_bits(g.dv, g1.dv))
        << n << " threads";
  }
  set_num_threads(before);
}

// Large logits use the stick up within a few tiles: the skip must drop tiles and change no bit,
// forward and backward; a NaN value far to the left must still reach every later row.
TEST(StickBreaking, VanishingTilesAreSkippedWithoutChangingABit) {
  SbProblem s = make_sb(make_problem(1, 600, 600, 2, 2, 32, DType::kF32, false, 3.0), 32);
  std::vector<double> d_out(static_cast<std::size_t>(s.out_count())), d_rem(static_cast<std::size_t>(s.rows()));
  for (auto& x : d_out) x = uniform(-1, 1);
  for (auto& x : d_rem) x = uniform(-1, 1);
  for (const bool poison : {false, true}) {
    SCOPED_TRACE(poison ? "a NaN value at key 5" : "finite");
    if (poison) {
      s.v[static_cast<std::size_t>(5 * s.p.kv_heads * s.dv)] = std::nan("");
      s.vb = testing::to_dtype(s.v, DType::kF32);
    }
    StickBreakingSpec on = s.spec(), off = s.spec();
    off.skip_vanishing_tiles = false;
    const StickBreakingAttention a(on), b(off);
    const Result ra = run(s, a, DType::kF32), rb = run(s, b, DType::kF32);
    EXPECT_TRUE(testing::same_bits(ra.out, rb.out));
    EXPECT_TRUE(testing::same_bits(ra.rem, rb.rem));
    if (!poison) {
      EXPECT_GT(ra.stats.skipped, ra.stats.tiles / 2);
      EXPECT_EQ(rb.stats.skipped, 0);
    } else {
      // Row of query 6, head 0: it sees key 5 (its weight underflows to 0, and 0·NaN is NaN).
      EXPECT_TRUE(std::isnan(ra.out[static_cast<std::size_t>((599 * s.p.heads) * s.dv)]));
      EXPECT_FALSE(std::isnan(ra.out[static_cast<std::size_t>((5 * s.p.heads) * s.dv)]));
    }
    const Grads ga = run_backward(s, a, DType::kF32, d_out, d_rem), gb = run_backward(s, b, DType::kF32, d_out, d_rem);
    EXPECT_TRUE(testing::same_bits(ga.dq, gb.dq) && testing::same_bits(ga.dk, gb.dk) &&
                testing::same_bits(ga.dv, gb.dv));
  }
}

// The query's own token is masked by default: a NaN or inf in its key or value reaches only the
// later queries, as in the reference (masked pairs are absent, not multiplied by 0).
TEST(StickBreaking, ANonFiniteTokenReachesOnlyTheQueriesThatSeeIt) {
  for (const double bad : {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()}) {
    SbProblem s = make_sb(make_problem(1, 80, 80, 2, 1, 16), 16);
    const std::int64_t t = 70;
    s.v[static_cast<std::size_t>(t * s.dv + 3)] = bad;
    s.p.k[static_cast<std::size_t>(t * s.p.dim + 2)] = bad;
    s.vb = testing::to_dtype(s.v, DType::kF32);
    s.p.kb = testing::to_dtype(s.p.k, DType::kF32);
    const Result got = run(s, StickBreakingAttention(s.spec()), DType::kF32);
    const Result want = run(s, StickBreakingAttention(s.spec(true)), DType::kF64);
    for (std::int64_t i = 0; i < 80; ++i) {
      for (std::int64_t c = 0; c < s.dv; ++c) {
        const auto at = static_cast<std::size_t>((i * s.p.heads) * s.dv + c);
        EXPECT_EQ(std::isnan(got.out[at]), std::isnan(want.out[at])) << "query " << i << " column " << c;
        if (i <= t) {
          EXPECT_TRUE(std::isfinite(got.out[at])) << "query " << i;
        }
      }
    }
  }
}

int kind(double x) { return std::isnan(x) ? 1 : std::isinf(x) ? (x > 0 ? 2 : 3) : 0; }

// The gradients where an input holds an inf or NaN: NaN, +inf, −inf and finite values in the same
// places as the reference (which sums Σ_{m<j} g from the left), finite ones within tolerance.
TEST(StickBreaking, ANonFiniteInputReachesTheGradientsAsInTheReference) {
  const double inf = std::numeric_limits<double>::infinity();
  struct Case {
    const char* what;
    int where;  // 0 d_out, 1 v, 2 k, 3 q, 4 d_rem
    double value;
  };
  const Case cases[] = {{"+inf in d_out", 0, inf}, {"-inf in d_out", 0, -inf}, {"NaN in v", 1, std::nan("")},
                        {"+inf in v", 1, inf},     {"+inf in k", 2, inf},      {"-inf in q", 3, -inf},
                        {"+inf in d_rem", 4, inf}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    SbProblem s = make_sb(make_problem(1, 150, 150, 2, 1, 16, DType::kF32, false, 0.5), 16);
    std::vector<double> d_out(static_cast<std::size_t>(s.out_count())), d_rem(static_cast<std::size_t>(s.rows()));
    for (auto& x : d_out) x = uniform(-1, 1);
    for (auto& x : d_rem) x = uniform(-1, 1);
    const std::int64_t token = 100;
    if (c.where == 0) d_out[static_cast<std::size_t>((token * s.p.heads) * s.dv + 3)] = c.value;
    if (c.where == 1) s.v[static_cast<std::size_t>(token * s.dv + 3)] = c.value;
    if (c.where == 2) s.p.k[static_cast<std::size_t>(token * s.p.dim + 3)] = c.value;
    if (c.where == 3) s.p.q[static_cast<std::size_t>((token * s.p.heads + 1) * s.p.dim + 3)] = c.value;
    if (c.where == 4) d_rem[static_cast<std::size_t>(token * s.p.heads)] = c.value;
    s.vb = testing::to_dtype(s.v, DType::kF32);
    s.p.kb = testing::to_dtype(s.p.k, DType::kF32);
    s.p.qb = testing::to_dtype(s.p.q, DType::kF32);
    const Grads g = run_backward(s, StickBreakingAttention(s.spec()), DType::kF32, d_out, d_rem);
    const Grads w = run_backward(s, StickBreakingAttention(s.spec(true)), DType::kF64, d_out, d_rem);
    std::int64_t non_finite = 0;
    for (const auto& [got, want, name] :
         {std::tuple{&g.dq, &w.dq, "dq"}, std::tuple{&g.dk, &w.dk, "dk"}, std::tuple{&g.dv, &w.dv, "dv"}}) {
      double size = 0;
      for (const double x : *want) size = std::isfinite(x) ? std::max(size, std::abs(x)) : size;
      for (std::size_t i = 0; i < want->size(); ++i) {
        ASSERT_EQ(kind((*got)[i]), kind((*want)[i])) << name << " " << i << ": " << (*got)[i] << " vs " << (*want)[i];
        if (kind((*want)[i]) == 0) {
          ASSERT_NEAR((*got)[i], (*want)[i], 1e-4 * size + 1e-6) << name << " " << i;
        } else {
          ++non_finite;
        }
      }
    }
    EXPECT_GT(non_finite, 0);  // the case reaches the gradients
  }
}

TEST(StickBreaking, RefusesBadInput) {
  const SbProblem s = make_sb(make_problem(2, 10, 12, 4, 2, 16), 8);
  const auto build = [&](auto&& edit) {
    StickBreakingSpec spec = s.spec();
    edit(spec);
    StickBreakingAttention att(spec);
  };
  expect_error([&] { build([](StickBreakingSpec& sp) { sp.scale = std::nan(""); }); },
               {"scale", "nan", "f32's normal range"});
  expect_error([&] { build([](StickBreakingSpec& sp) { sp.scale = 1e39; }); }, {"scale", "1e+39"});
  expect_error([&] { build([](StickBreakingSpec& sp) { sp.scale = -1e-39; }); }, {"scale", "-1e-39"});
  expect_error([&] { build([&](StickBreakingSpec& sp) { std::swap(sp.q, sp.k); }); },
               {"k", "a KV head count dividing"});
  {
    const SbProblem longer = make_sb(make_problem(1, 12, 10, 2, 2, 16), 8);
    expect_error([&] { StickBreakingAttention att(longer.spec()); }, {"q", "at most as many queries as keys, 10"});
  }
  expect_error([&] { build([](StickBreakingSpec& sp) { sp.cu_seqlens_q = {0, 10}; }); }, {"cu_seqlens"});
  const StickBreakingAttention att(s.spec());
  std::vector<float> out(static_cast<std::size_t>(s.out_count())), rem(static_cast<std::size_t>(s.rows()));
  const TensorView ov = TensorView::contiguous(out.data(), DType::kF32, s.vshape(10, 4));
  expect_error([&] { att.forward(ov, TensorView::of(rem.data(), {2, 4, 10})); }, {"rem", "[B, Sq, H] = [2, 10, 4]"});
  expect_error([&] { att.forward(TensorView::of(out.data(), {2, 10, 4, 16})); }, {"out"});
  // out over q's memory.
  const std::vector<std::int64_t> q_as_out = {2, 10, 4, 8}, q_strides = {640, 64, 16, 1};
  expect_error(
      [&] { att.forward(TensorView(const_cast<unsigned char*>(s.p.qb.data()), DType::kF32, q_as_out, q_strides)); },
      {"out", "q"});
  expect_error(
      [&] {
        att.backward(ov, {}, ov, TensorView::of(rem.data(), {2, 10, 4}), {}, {}, {});
      },
      {"rem", "when d_rem is given"});
}

}  // namespace
}  // namespace posenc
