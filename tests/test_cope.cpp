// CoPE (posenc/cope.hpp): the definition worked by hand, the fused passes against the fp64
// reference on every target (layouts, dtypes, GQA, packed sequences, decode, tables that clamp
// early and never, values narrower or wider than the keys), the reference's gradients by finite
// differences, thread counts, non-finite inputs and bad input.
#include <cmath>
#include <limits>
#include <vector>

#include "attention_testing.hpp"
#include "posenc/cope.hpp"
#include "testing.hpp"

namespace posenc {
namespace {

using namespace attention_testing;
using testing::expect_error;

// A problem with values of their own head size dv (Problem's v is unused) and a table of npos
// rows in table_dtype.
struct CopeProblem {
  Problem p;
  std::int64_t dv = 0, npos = 0;
  DType table_dtype = DType::kF32;
  std::vector<double> v, table;
  std::vector<unsigned char> vb, tb;
  std::int64_t rows() const { return (p.packed() ? 1 : p.batch) * p.q_len * p.heads; }
  std::int64_t out_count() const { return rows() * dv; }
  std::int64_t v_count() const { return (p.packed() ? 1 : p.batch) * p.k_len * p.kv_heads * dv; }
  std::int64_t table_count() const { return npos * p.dim; }
  std::vector<std::int64_t> vshape(std::int64_t seq, std::int64_t h) const {
    return p.packed() ? std::vector<std::int64_t>{seq, h, dv} : std::vector<std::int64_t>{p.batch, seq, h, dv};
  }
  std::vector<std::int64_t> lse_shape() const {
    return p.packed() ? std::vector<std::int64_t>{p.q_len, p.heads}
                      : std::vector<std::int64_t>{p.batch, p.q_len, p.heads};
  }
  CopeSpec spec(bool f64 = false) {
    CopeSpec s;
    const DType dt = f64 ? DType::kF64 : p.dtype;
    s.q = f64 ? ConstTensorView(p.q.data(), dt, p.shape(p.q_len, p.heads), p.strides(p.q_len, p.heads)) : p.qv();
    s.k = f64 ? ConstTensorView(p.k.data(), dt, p.shape(p.k_len, p.kv_heads), p.strides(p.k_len, p.kv_heads)) : p.kv();
    s.v = ConstTensorView::contiguous(f64 ? static_cast<const void*>(v.data()) : vb.data(), dt,
                                      vshape(p.k_len, p.kv_heads));
    s.table = ConstTensorView::contiguous(f64 ? static_cast<const void*>(table.data()) : tb.data(),
                                          f64 ? DType::kF64 : table_dtype, std::vector<std::int64_t>{npos, p.dim});
    s.cu_seqlens_q = p.cu_q;
    s.cu_seqlens_k = p.cu_k;
    return s;
  }
};

// The table: random rows, or rows on a line (e[n] = a + n·b/8 with a, b random): ⟨q, e[n]⟩ is then
// linear in n, so the interpolation has no step in its derivative at integer positions.
CopeProblem make_cope(Problem p, std::int64_t dv, std::int64_t npos, DType table_dtype = DType::kF64,
                      bool linear = false) {
  CopeProblem s;
  s.p = std::move(p);
  s.dv = dv;
  s.npos = npos;
  s.table_dtype = table_dtype == DType::kF64 ? s.p.dtype : table_dtype;
  fill(s.v, s.vb, s.v_count(), s.p.dtype, 1.0);
  fill(s.table, s.tb, s.table_count(), s.table_dtype, 1.0);
  if (linear) {
    const std::int64_t d = s.p.dim;
    for (std::int64_t n = 1; n < npos; ++n) {
      for (std::int64_t t = 0; t < d; ++t) {
        s.table[static_cast<std::size_t>(n * d + t)] =
            testing::round_to(s.table[static_cast<std::size_t>(t)] +
                                  static_cast<double>(n) * s.table[static_cast<std::size_t>(d + t)] / 8,
                              s.table_dtype);
      }
    }
    s.tb = testing::to_dtype(s.table, s.table_dtype);
  }
  return s;
}

struct Result {
  std::vector<double> out, lse;
};

Result run(CopeProblem& s, const CopeAttention& att, DType dt) {
  std::vector<unsigned char> out = testing::garbage_buffer(dt, s.out_count());
  std::vector<float> lse(static_cast<std::size_t>(s.rows()), 7.0f);
  att.forward(TensorView::contiguous(out.data(), dt, s.vshape(s.p.q_len, s.p.heads)),
              TensorView::contiguous(lse.data(), DType::kF32, s.lse_shape()));
  Result r;
  for (std::int64_t i = 0; i < s.out_count(); ++i) r.out.push_back(testing::element(out.data(), dt, i));
  r.lse.assign(lse.begin(), lse.end());
  return r;
}

struct Grads {
  std::vector<double> dq, dk, dv, de;
};

// dq, dk, dv, d_table of one backward with d_out, after a forward (out in out_dt) on the same object.
Grads run_backward(CopeProblem& s, const CopeAttention& att, DType dt, const std::vector<double>& d_out,
                   DType out_dt = DType::kF64) {
  if (out_dt == DType::kF64) out_dt = dt;
  const Problem& p = s.p;
  const DType tdt = dt == DType::kF64 ? DType::kF64 : s.table_dtype;
  const std::vector<std::int64_t> oshape = s.vshape(p.q_len, p.heads);
  std::vector<unsigned char> out = testing::garbage_buffer(out_dt, s.out_count());
  std::vector<float> lse(static_cast<std::size_t>(s.rows()));
  att.forward(TensorView::contiguous(out.data(), out_dt, oshape),
              TensorView::contiguous(lse.data(), DType::kF32, s.lse_shape()));
  const std::vector<unsigned char> dob = testing::to_dtype(d_out, dt);
  const auto zeros = [](std::int64_t n, DType t) {
    return testing::to_dtype(std::vector<double>(static_cast<std::size_t>(n), 0.0), t);
  };
  std::vector<unsigned char> dq = zeros(p.q_count(), dt), dk = zeros(p.k_count(), dt), dv = zeros(s.v_count(), dt),
                             de = zeros(s.table_count(), tdt);
  att.backward(ConstTensorView::contiguous(out.data(), out_dt, oshape),
               ConstTensorView::contiguous(lse.data(), DType::kF32, s.lse_shape()),
               ConstTensorView::contiguous(dob.data(), dt, oshape),
               TensorView(dq.data(), dt, p.shape(p.q_len, p.heads), p.strides(p.q_len, p.heads)),
               TensorView(dk.data(), dt, p.shape(p.k_len, p.kv_heads), p.strides(p.k_len, p.kv_heads)),
               TensorView::contiguous(dv.data(), dt, s.vshape(p.k_len, p.kv_heads)),
               TensorView::contiguous(de.data(), tdt, std::vector<std::int64_t>{s.npos, p.dim}));
  Grads g;
  for (std::int64_t i = 0; i < p.q_count(); ++i) g.dq.push_back(testing::element(dq.data(), dt, i));
  for (std::int64_t i = 0; i < p.k_count(); ++i) g.dk.push_back(testing::element(dk.data(), dt, i));
  for (std::int64_t i = 0; i < s.v_count(); ++i) g.dv.push_back(testing::element(dv.data(), dt, i));
  for (std::int64_t i = 0; i < s.table_count(); ++i) g.de.push_back(testing::element(de.data(), tdt, i));
  return g;
}

// Three tokens, one head, D = 1, q = 1 and k = 0 (every gate σ(0) = 1/2), e = (0, 2, 4, 8): query
// 2 counts keys 2, 1, 0 at positions 0.5, 1, 1.5, so its logits are 1, 2 and 3 (keys 2, 1, 0);
// with npos = 2 key 0 is clamped to position 1 (logit 2).
TEST(Cope, WorkedByHand) {
  const std::vector<float> q = {1, 1, 1}, k = {0, 0, 0}, v = {10, 20, 30}, e = {0, 2, 4, 8};
  for (const std::int64_t npos : {4, 2}) {
    CopeSpec spec;
    spec.q = ConstTensorView::of(q.data(), {1, 3, 1, 1});
    spec.k = ConstTensorView::of(k.data(), {1, 3, 1, 1});
    spec.v = ConstTensorView::of(v.data(), {1, 3, 1, 1});
    spec.table = ConstTensorView::of(e.data(), {npos, 1});
    spec.scale = 1.0;
    for (const bool f64 : {false, true}) {
      std::vector<double> q64(q.begin(), q.end()), k64(k.begin(), k.end()), v64(v.begin(), v.end()),
          e64(e.begin(), e.end());
      CopeSpec s = spec;
      if (f64) {
        s.q = ConstTensorView::of(q64.data(), {1, 3, 1, 1});
        s.k = ConstTensorView::of(k64.data(), {1, 3, 1, 1});
        s.v = ConstTensorView::of(v64.data(), {1, 3, 1, 1});
        s.table = ConstTensorView::of(e64.data(), {npos, 1});
      }
      const CopeAttention att(s);
      std::vector<double> out64(3);
      std::vector<float> out32(3), lse(3);
      att.forward(f64 ? TensorView::of(out64.data(), {1, 3, 1, 1}) : TensorView::of(out32.data(), {1, 3, 1, 1}),
                  TensorView::of(lse.data(), {1, 3, 1}));
      const double last = f64 ? out64[2] : out32[2];
      const double l0 = npos == 4 ? 3.0 : 2.0;
      const double z = std::exp(l0) + std::exp(2.0) + std::exp(1.0);
      EXPECT_NEAR(last, (10 * std::exp(l0) + 20 * std::exp(2.0) + 30 * std::exp(1.0)) / z, 1e-5) << npos;
      EXPECT_NEAR(lse[2], std::log(z), 1e-6) << npos;
      // Query 0 sees only itself.
      EXPECT_NEAR(f64 ? out64[0] : out32[0], 10.0, 1e-6);
    }
  }
}

class CopeTargets : public testing::EveryTarget {};

// Forward within a few f32 rounding steps of the fp64 reference (16-bit outputs: half their ulp
// more). Backward within 2e-4 of the gradients' size in f32 (d_table sums dS·q over every row and
// key of a head). The derivative through the positions steps where a gate sum crosses an integer
// (and the clamp): an f32 sum within its rounding of an integer may take the other side than the
// fp64 one and move a row's dq and dk by percents, which random tables hit in about one row of a
// few hundred. So dq and dk are compared on tables whose ⟨q, e[n]⟩ is linear in n (no step at the
// integers; a clamp crossing within rounding stays rare), out, lse, dv and d_table (continuous in
// the positions) on random ones too. 16-bit backward reads an f32 out and rounds its gradients once
// to the dtype: 2^−8 of their size.
TEST_P(CopeTargets, MatchesTheReference) {
  struct Case {
    const char* what;
    std::int64_t batch, q_len, k_len, heads, kv_heads, dim, dv, npos;
    DType dtype, table_dtype;
    bool head_major;
  };
  const Case cases[] = {
      {"MHA prefill, positions clamped within a few tiles", 2, 150, 150, 2, 2, 32, 32, 16, DType::kF32, DType::kF32,
       false},
      {"GQA, [B, H, S, D] memory, never clamped", 1, 130, 130, 6, 2, 64, 64, 200, DType::kF32, DType::kF32, true},
      {"queries at the end of longer keys", 2, 37, 200, 4, 1, 32, 32, 64, DType::kF32, DType::kF32, false},
      {"decode", 3, 1, 300, 8, 2, 64, 64, 40, DType::kF32, DType::kF32, false},
      {"one position: every logit offset alike", 1, 50, 50, 2, 1, 16, 16, 1, DType::kF32, DType::kF32, false},
      {"values narrower and a D off the lanes", 1, 70, 70, 2, 1, 40, 24, 20, DType::kF32, DType::kF32, false},
      {"values wider", 1, 70, 70, 2, 2, 16, 48, 33, DType::kF32, DType::kF32, true},
      {"bf16 with an f32 table", 1, 90, 90, 4, 2, 32, 32, 24, DType::kBF16, DType::kF32, false},
      {"f16", 1, 90, 90, 4, 2, 32, 32, 24, DType::kF16, DType::kF16, true},
  };
  for (const Case& c : cases) {
    for (const bool linear : {false, true}) {
      SCOPED_TRACE(c.what);
      SCOPED_TRACE(linear ? "linear table" : "random table");
      CopeProblem s =
          make_cope(make_problem(c.batch, c.q_len, c.k_len, c.heads, c.kv_heads, c.dim, c.dtype, c.head_major, 1.0),
                    c.dv, c.npos, c.table_dtype, linear);
      const CopeAttention fused(s.spec()), ref(s.spec(true));
      const Result got = run(s, fused, c.dtype), want = run(s, ref, DType::kF64);
      const double out_tol = c.dtype == DType::kF32 ? 5e-5 : c.dtype == DType::kBF16 ? 8e-3 : 1e-3;
      testing::expect_near_all(got.out, want.out, out_tol * std::max(1.0, testing::largest(want.out)), "out");
      // lse is f32 math for every dtype (16-bit inputs are read exactly, as the reference reads them).
      testing::expect_near_all(got.lse, want.lse, 1e-5 * testing::largest(want.lse), "lse");
      std::vector<double> d_out(static_cast<std::size_t>(s.out_count()));
      for (auto& x : d_out) x = testing::round_to(uniform(-1, 1), c.dtype);
      const Grads g = run_backward(s, fused, c.dtype, d_out, DType::kF32);
      const Grads w = run_backward(s, ref, DType::kF64, d_out);
      const double rel = c.dtype == DType::kF32 ? 2e-4 : 1.0 / 256;
      if (linear) {
        testing::expect_near_all(g.dq, w.dq, rel * testing::largest(w.dq) + 1e-6, "dq");
        testing::expect_near_all(g.dk, w.dk, rel * testing::largest(w.dk) + 1e-6, "dk");
      }
      testing::expect_near_all(g.dv, w.dv, rel * testing::largest(w.dv) + 1e-6, "dv");
      testing::expect_near_all(g.de, w.de, rel * testing::largest(w.de) + 1e-6, "d_table");
    }
  }
}

// Packed sequences, empty and one-token ones among them, each counting its own positions.
TEST_P(CopeTargets, PackedSequences) {
  CopeProblem s =
      make_cope(make_packed({{40, 40}, {1, 1}, {70, 70}, {0, 0}, {20, 33}}, 4, 2, 32), 32, 30, DType::kF64, true);
  const CopeAttention fused(s.spec()), ref(s.spec(true));
  const Result got = run(s, fused, DType::kF32), want = run(s, ref, DType::kF64);
  testing::expect_near_all(got.out, want.out, 5e-5, "out");
  std::vector<double> d_out(static_cast<std::size_t>(s.out_count()));
  for (auto& x : d_out) x = uniform(-1, 1);
  const Grads g = run_backward(s, fused, DType::kF32, d_out), w = run_backward(s, ref, DType::kF64, d_out);
  testing::expect_near_all(g.dq, w.dq, 2e-4 * testing::largest(w.dq) + 1e-6, "dq");
  testing::expect_near_all(g.dk, w.dk, 2e-4 * testing::largest(w.dk) + 1e-6, "dk");
  testing::expect_near_all(g.dv, w.dv, 2e-4 * testing::largest(w.dv) + 1e-6, "dv");
  testing::expect_near_all(g.de, w.de, 2e-4 * testing::largest(w.de) + 1e-6, "d_table");
}

INSTANTIATE_TEST_SUITE_P(Targets, CopeTargets, ::testing::ValuesIn(testing::all_targets()));

// The reference's backward against central differences of L = Σ w·out in fp64, through q, k, v
// and the table, with positions that cross integers and the clamp.
TEST(Cope, ReferenceGradientsMatchFiniteDifferences) {
  CopeProblem s = make_cope(make_problem(1, 6, 9, 2, 1, 4, DType::kF32, false, 1.5), 3, 5);
  std::vector<double> w(static_cast<std::size_t>(s.out_count()));
  for (auto& x : w) x = uniform(-1, 1);
  const auto loss = [&] {
    const Result r = run(s, CopeAttention(s.spec(true)), DType::kF64);
    double l = 0;
    for (std::size_t i = 0; i < w.size(); ++i) l += w[i] * r.out[i];
    return l;
  };
  const Grads g = run_backward(s, CopeAttention(s.spec(true)), DType::kF64, w);
  // Central differences err by O(h²) = 1e-12 on smooth pieces; a step across an integer position
  // or the clamp would err by O(h), which the random inputs make unlikely at h = 1e-6.
  const double h = 1e-6;
  const auto check = [&](std::vector<double>& x, const std::vector<double>& grad, const char* what) {
    for (std::size_t i = 0; i < x.size(); ++i)
      EXPECT_NEAR(grad[i], testing::central_difference(x[i], h, loss), 1e-7) << what << " " << i;
  };
  check(s.p.q, g.dq, "dq");
  check(s.p.k, g.dk, "dk");
  check(s.v, g.dv, "dv");
  check(s.table, g.de, "d_table");
}

// Query ranges (one (sequence, KV head) pair split into ranges), the tile walk and the d_table
// bins give the same bits for 1, 2 and 3 threads.
TEST(Cope, BitwiseIdenticalForAnyThreadCount) {
  CopeProblem s = make_cope(make_problem(1, 700, 700, 2, 1, 32, DType::kF32, false, 0.5), 32, 48);
  const CopeAttention att(s.spec());
  std::vector<double> d_out(static_cast<std::size_t>(s.out_count()));
  for (auto& x : d_out) x = uniform(-1, 1);
  const int before = num_threads();
  set_num_threads(1);
  const Result r1 = run(s, att, DType::kF32);
  const Grads g1 = run_backward(s, att, DType::kF32, d_out);
  for (const int n : {2, 3}) {
    set_num_threads(n);
    const Result r = run(s, att, DType::kF32);
    const Grads g = run_backward(s, att, DType::kF32, d_out);
    EXPECT_TRUE(testing::same_bits(r.out, r1.out) && testing::same_bits(r.lse, r1.lse)) << n << " threads";
    EXPECT_TRUE(testing::same_bits(g.dq, g1.dq) && testing::same_bits(g.dk, g1.dk) && testing::same_bits(g.dv, g1.dv) &&
                testing::same_bits(g.de, g1.de))
        << n << " threads";
  }
  set_num_threads(before);
}

// A NaN in key j makes the gates of every query from j on NaN, hence their positions left of j and
// their rows; the queries before j never see it. Fused and reference agree on which.
TEST(Cope, ANonFiniteKeyReachesOnlyTheQueriesThatSeeIt) {
  CopeProblem s = make_cope(make_problem(1, 80, 80, 2, 1, 16), 16, 12);
  s.p.k[static_cast<std::size_t>(50 * 16 + 3)] = std::nan("");
  s.p.kb = testing::to_dtype(s.p.k, DType::kF32);
  const Result got = run(s, CopeAttention(s.spec()), DType::kF32);
  const Result want = run(s, CopeAttention(s.spec(true)), DType::kF64);
  for (std::int64_t i = 0; i < 80; ++i) {
    for (std::int64_t h = 0; h < 2; ++h) {
      const auto at = static_cast<std::size_t>((i * 2 + h) * 16);
      EXPECT_EQ(std::isnan(got.out[at]), i >= 50) << i;
      EXPECT_EQ(std::isnan(want.out[at]), i >= 50) << i;
    }
  }
  std::vector<double> d_out(static_cast<std::size_t>(s.out_count()));
  for (auto& x : d_out) x = uniform(-1, 1);
  const Grads g = run_backward(s, CopeAttention(s.spec()), DType::kF32, d_out);
  const Grads w = run_backward(s, CopeAttention(s.spec(true)), DType::kF64, d_out);
  for (std::size_t i = 0; i < g.dq.size(); ++i) EXPECT_EQ(std::isnan(g.dq[i]), std::isnan(w.dq[i])) << "dq " << i;
  for (std::size_t i = 0; i < g.dk.size(); ++i) EXPECT_EQ(std::isnan(g.dk[i]), std::isnan(w.dk[i])) << "dk " << i;
  for (std::size_t i = 0; i < g.dv.size(); ++i) EXPECT_EQ(std::isnan(g.dv[i]), std::isnan(w.dv[i])) << "dv " << i;
}

TEST(Cope, RefusesBadInput) {
  CopeProblem s = make_cope(make_problem(2, 10, 12, 4, 2, 16), 8, 6);
  const auto build = [&](auto&& edit) {
    CopeSpec spec = s.spec();
    edit(spec);
    CopeAttention att(spec);
  };
  const std::vector<float> big(static_cast<std::size_t>(65537 * 16));
  const std::vector<std::uint16_t> half(96);
  expect_error([&] { build([](CopeSpec& sp) { sp.scale = std::nan(""); }); }, {"scale", "nan"});
  expect_error([&] { build([&](CopeSpec& sp) {
                       sp.table = ConstTensorView::of(big.data(), {6, 15});
                     }); },
               {"table", "D = 16"});
  expect_error([&] { build([&](CopeSpec& sp) {
                       sp.table = ConstTensorView::of(big.data(), {0, 16});
                     }); },
               {"table", "1 <= npos <= 65536"});
  expect_error([&] { build([&](CopeSpec& sp) {
                       sp.table = ConstTensorView::of(big.data(), {65537, 16});
                     }); },
               {"table", "1 <= npos <= 65536"});
  expect_error(
      [&] {
        build([&](CopeSpec& sp) {
          sp.table = ConstTensorView::contiguous(half.data(), DType::kF16, std::vector<std::int64_t>{6, 16});
        });
      },
      {"table.dtype", "f16", "f32"});
  expect_error([&] { build([](CopeSpec& sp) { sp.table = {}; }); }, {"table"});
  expect_error([&] { build([](CopeSpec& sp) { sp.cu_seqlens_q = {0, 10}; }); }, {"cu_seqlens"});
  const CopeAttention att(s.spec());
  std::vector<float> out(static_cast<std::size_t>(s.out_count())), lse(static_cast<std::size_t>(s.rows()));
  const TensorView ov = TensorView::contiguous(out.data(), DType::kF32, s.vshape(10, 4));
  expect_error([&] { att.forward(ov, TensorView::of(lse.data(), {2, 4, 10})); }, {"lse", "[B, Sq, H] = [2, 10, 4]"});
  // out over the table's memory.
  expect_error(
      [&] {
        att.forward(TensorView::contiguous(const_cast<unsigned char*>(s.tb.data()), DType::kF32,
                                           std::vector<std::int64_t>{2, 10, 4, 8}));
      },
      {"out", "table"});
  std::vector<float> de(static_cast<std::size_t>(5 * 16));
  const TensorView lv = TensorView::of(lse.data(), {2, 10, 4});
  expect_error([&] { att.backward(ov, {}, ov, {}, {}, {}, {}); }, {"lse", "the forward's lse"});
  expect_error(
      [&] {
        att.backward(ov, lv, ov, {}, {}, {}, TensorView::of(de.data(), {5, 16}));
      },
      {"d_table", "the shape and dtype of table"});
}

}  // namespace
}  // namespace posenc
