// Relative encodings with query or value terms: Shaw et al. 2018 (score and value terms, both
// backwards) and Transformer-XL (position terms and their backward), on every target against the
// fp64 reference over random shapes, layouts, positions and dtypes; gradients against finite
// differences of the reference; thread-count determinism; errors.
#include <cmath>
#include <cstring>

#include "testing.hpp"

namespace posenc {
namespace {

using testing::element;
using testing::EveryTarget;
using testing::expect_error;
using testing::uniform;
using testing::uniform_int;

struct ShawCase {
  std::int64_t batch, q_len, k_len, heads, dim, k;
  bool bhsd;  // tokens stored [B, H, S, D] (viewed as [B, S, H, D] through strides)
  int position_kind;
  DType dtype;
  std::vector<std::int64_t> starts, q_ids, k_ids, cu;
};

ShawCase random_case() {
  ShawCase c{};
  c.position_kind = static_cast<int>(uniform_int(0, 3));
  c.batch = c.position_kind == 3 ? 1 : uniform_int(1, 2);
  c.q_len = uniform_int(1, 13);
  c.k_len = c.position_kind == 3 ? c.q_len : uniform_int(1, 17);
  c.heads = uniform_int(1, 3);
  c.dim = uniform_int(1, 9);
  c.k = uniform_int(0, 6);
  c.bhsd = uniform_int(0, 1) == 1;
  c.dtype = uniform_int(0, 1) ? DType::kF32 : DType::kF64;
  for (std::int64_t b = 0; b < c.batch; ++b) c.starts.push_back(uniform_int(0, 50));
  for (std::int64_t t = 0; t < c.batch * c.q_len; ++t) c.q_ids.push_back(uniform_int(0, 40));
  for (std::int64_t t = 0; t < c.batch * c.k_len; ++t) c.k_ids.push_back(uniform_int(0, 40));
  c.cu = {0};
  while (c.cu.back() < c.q_len) c.cu.push_back(std::min(c.q_len, c.cu.back() + uniform_int(1, 5)));
  return c;
}

std::pair<Positions, Positions> positions_of(const ShawCase& c) {
  switch (c.position_kind) {
    case 0:
      return {Positions::ranges(c.starts, c.q_len), Positions::ranges(c.starts, c.k_len)};
    case 1:
      return {Positions::range(c.q_len, c.k_len), Positions::range(c.k_len)};
    case 2:
      return {Positions::ids(c.q_ids, c.batch, c.q_len), Positions::ids(c.k_ids, c.batch, c.k_len)};
    default:
      return {Positions::packed(c.cu), Positions::packed(c.cu)};
  }
}

// A [B, S, H, D] view of `data`, stored BSHD or BHSD.
template <class T>
BasicTensorView<!std::is_const_v<T>> tokens_view(T* data, DType dtype, const ShawCase& c) {
  const std::vector<std::int64_t> shape = {c.batch, c.q_len, c.heads, c.dim};
  const std::vector<std::int64_t> strides =
      c.bhsd ? std::vector<std::int64_t>{c.heads * c.q_len * c.dim, c.dim, c.q_len * c.dim, 1}
             : std::vector<std::int64_t>{c.q_len * c.heads * c.dim, c.heads * c.dim, c.dim, 1};
  return BasicTensorView<!std::is_const_v<T>>(data, dtype, shape, strides);
}

std::vector<std::int64_t> score_shape(const ShawCase& c) { return {c.batch, c.heads, c.q_len, c.k_len}; }

std::vector<double> random_values(std::int64_t n) {
  std::vector<double> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = uniform(-1, 1);
  return v;
}

// got (in c.dtype) against the fp64 reference: f32 outputs are rounded once (2^-23 relative,
// one unit either way) and the fast path may sum in another order (1e-12 of the terms' scale).
void expect_close(const std::vector<unsigned char>& got, DType dtype, const std::vector<double>& want, double scale,
                  const char* what) {
  int reported = 0;
  for (std::size_t e = 0; e < want.size(); ++e) {
    const double g = element(got.data(), dtype, static_cast<std::int64_t>(e));
    const double tol = (dtype == DType::kF32 ? std::ldexp(std::fabs(want[e]), -23) : 0.0) + 1e-12 * scale;
    if (!(std::fabs(g - want[e]) <= tol) && reported++ < 5) {
      ADD_FAILURE() << what << " element " << e << ": got " << g << ", reference " << want[e];
    }
  }
}

TEST_P(EveryTarget, ShawMatchesReference) {
  for (int trial = 0; trial < 40; ++trial) {
    const ShawCase c = random_case();
    const auto [qp, kp] = positions_of(c);
    const ShawParams p = ShawParams::init(c.k, c.dim, 0.5, static_cast<std::uint64_t>(trial));
    const std::int64_t tokens = c.batch * c.q_len * c.heads * c.dim, scores = c.batch * c.heads * c.q_len * c.k_len;
    const std::vector<double> q = random_values(tokens), probs = random_values(scores);
    const std::vector<double> d_scores = random_values(scores), d_out = random_values(tokens);
    const std::vector<double> base_scores = random_values(scores), base_tokens = random_values(tokens);
    auto as = [&](const std::vector<double>& v) { return testing::to_dtype(v, c.dtype); };
    const auto q_t = as(q), probs_t = as(probs), ds_t = as(d_scores), dout_t = as(d_out);
    // Inputs as the dtype rounds them, for the reference.
    auto widened = [&](const std::vector<unsigned char>& raw, std::int64_t n) {
      std::vector<double> v(static_cast<std::size_t>(n));
      for (std::int64_t e = 0; e < n; ++e) v[static_cast<std::size_t>(e)] = element(raw.data(), c.dtype, e);
      return v;
    };
    const std::vector<double> q64 = widened(q_t, tokens), probs64 = widened(probs_t, scores);
    const std::vector<double> ds64 = widened(ds_t, scores), dout64 = widened(dout_t, tokens);
    const std::vector<double> base_s64 = widened(as(base_scores), scores), base_t64 = widened(as(base_tokens), tokens);
    const double scale = static_cast<double>(c.k_len + c.dim) * 4;

    // Score term (adds onto existing scores).
    std::vector<unsigned char> s_got = as(base_scores);
    std::vector<double> s_want = base_s64;
    shaw_add_score_term(p, tokens_view(q_t.data(), c.dtype, c), qp, kp,
                        TensorView::contiguous(s_got.data(), c.dtype, score_shape(c)));
    ref::shaw_add_score_term(p, tokens_view(q64.data(), DType::kF64, c), qp, kp,
                             TensorView::contiguous(s_want.data(), DType::kF64, score_shape(c)));
    expect_close(s_got, c.dtype, s_want, scale, "score term");

    // Value term.
    std::vector<unsigned char> o_got = as(base_tokens);
    std::vector<double> o_want = base_t64;
    shaw_add_value_term(p, ConstTensorView::contiguous(probs_t.data(), c.dtype, score_shape(c)), qp, kp,
                        tokens_view(o_got.data(), c.dtype, c));
    ref::shaw_add_value_term(p, ConstTensorView::contiguous(probs64.data(), DType::kF64, score_shape(c)), qp, kp,
                             tokens_view(o_want.data(), DType::kF64, c));
    expect_close(o_got, c.dtype, o_want, scale, "value term");

    // Score-term backward: dq (onto existing values) and the key table.
    std::vector<unsigned char> dq_got = as(base_tokens);
    std::vector<double> dq_want = base_t64, dk_got(static_cast<std::size_t>(p.rows() * c.dim), 0.25), dk_want = dk_got;
    shaw_score_term_backward(p, tokens_view(q_t.data(), c.dtype, c),
                             ConstTensorView::contiguous(ds_t.data(), c.dtype, score_shape(c)), qp, kp,
                             tokens_view(dq_got.data(), c.dtype, c), dk_got);
    ref::shaw_score_term_backward(p, tokens_view(q64.data(), DType::kF64, c),
                                  ConstTensorView::contiguous(ds64.data(), DType::kF64, score_shape(c)), qp, kp,
                                  tokens_view(dq_want.data(), DType::kF64, c), dk_want);
    expect_close(dq_got, c.dtype, dq_want, scale, "dq");
    for (std::size_t e = 0; e < dk_got.size(); ++e) {
      EXPECT_NEAR(dk_got[e], dk_want[e], 1e-12 * static_cast<double>(scores)) << "d_key_table " << e;
    }

    // Value-term backward: d_probs and the value table.
    std::vector<unsigned char> dp_got = as(base_scores);
    std::vector<double> dp_want = base_s64, dv_got(static_cast<std::size_t>(p.rows() * c.dim), -0.5), dv_want = dv_got;
    shaw_value_term_backward(p, ConstTensorView::contiguous(probs_t.data(), c.dtype, score_shape(c)),
                             tokens_view(dout_t.data(), c.dtype, c), qp, kp,
                             TensorView::contiguous(dp_got.data(), c.dtype, score_shape(c)), dv_got);
    ref::shaw_value_term_backward(p, ConstTensorView::contiguous(probs64.data(), DType::kF64, score_shape(c)),
                                  tokens_view(dout64.data(), DType::kF64, c), qp, kp,
                                  TensorView::contiguous(dp_want.data(), DType::kF64, score_shape(c)), dv_want);
    expect_close(dp_got, c.dtype, dp_want, scale, "d_probs");
    for (std::size_t e = 0; e < dv_got.size(); ++e) {
      EXPECT_NEAR(dv_got[e], dv_want[e], 1e-12 * static_cast<double>(scores)) << "d_value_table " << e;
    }
  }
}

// The reference's gradients against central differences of L = Σ w·(term): both terms are
// linear in every input, so the differences are exact up to rounding (1e-9 relative).
TEST(Shaw, GradientsMatchFiniteDifferences) {
  for (int trial = 0; trial < 10; ++trial) {
    ShawCase c = random_case();
    c.dtype = DType::kF64;
    // Named, not a structured binding: lambdas below capture them (clang 14 cannot capture bindings).
    const std::pair<Positions, Positions> positions = positions_of(c);
    const Positions& qp = positions.first;
    const Positions& kp = positions.second;
    const ShawParams p = ShawParams::init(c.k, c.dim, 0.5, static_cast<std::uint64_t>(trial + 100));
    const std::int64_t tokens = c.batch * c.q_len * c.heads * c.dim, scores = c.batch * c.heads * c.q_len * c.k_len;
    std::vector<double> q = random_values(tokens), probs = random_values(scores);
    const std::vector<double> ws = random_values(scores), wt = random_values(tokens);
    auto score_loss = [&](const ShawParams& params) {
      std::vector<double> s(static_cast<std::size_t>(scores), 0.0);
      ref::shaw_add_score_term(params, tokens_view(q.data(), DType::kF64, c), qp, kp,
                               TensorView::contiguous(s.data(), DType::kF64, score_shape(c)));
      double sum = 0;
      for (std::size_t e = 0; e < s.size(); ++e) sum += ws[e] * s[e];
      return sum;
    };
    auto value_loss = [&](const ShawParams& params) {
      std::vector<double> o(static_cast<std::size_t>(tokens), 0.0);
      ref::shaw_add_value_term(params, ConstTensorView::contiguous(probs.data(), DType::kF64, score_shape(c)), qp, kp,
                               tokens_view(o.data(), DType::kF64, c));
      double sum = 0;
      for (std::size_t e = 0; e < o.size(); ++e) sum += wt[e] * o[e];
      return sum;
    };
    std::vector<double> dq(static_cast<std::size_t>(tokens), 0.0), dk(static_cast<std::size_t>(p.rows() * c.dim), 0.0);
    std::vector<double> dp(static_cast<std::size_t>(scores), 0.0), dv(dk.size(), 0.0);
    shaw_score_term_backward(p, tokens_view(q.data(), DType::kF64, c),
                             ConstTensorView::contiguous(ws.data(), DType::kF64, score_shape(c)), qp, kp,
                             tokens_view(dq.data(), DType::kF64, c), dk);
    shaw_value_term_backward(p, ConstTensorView::contiguous(probs.data(), DType::kF64, score_shape(c)),
                             tokens_view(wt.data(), DType::kF64, c), qp, kp,
                             TensorView::contiguous(dp.data(), DType::kF64, score_shape(c)), dv);
    const double step = 1e-3;
    // One entry of each gradient.
    const auto t = static_cast<std::size_t>(uniform_int(0, p.rows() * c.dim - 1));
    auto with_key = [&](double delta) {
      std::vector<double> kt = p.key_table();
      kt[t] += delta;
      return ShawParams(c.k, c.dim, kt, p.value_table());
    };
    auto with_value = [&](double delta) {
      std::vector<double> vt = p.value_table();
      vt[t] += delta;
      return ShawParams(c.k, c.dim, p.key_table(), vt);
    };
    EXPECT_NEAR(dk[t], (score_loss(with_key(step)) - score_loss(with_key(-step))) / (2 * step),
                1e-9 * (1 + std::fabs(dk[t])));
    EXPECT_NEAR(dv[t], (value_loss(with_value(step)) - value_loss(with_value(-step))) / (2 * step),
                1e-9 * (1 + std::fabs(dv[t])));
    // dq in storage order (the view maps it); d_probs at one score.
    const auto qi = static_cast<std::size_t>(uniform_int(0, tokens - 1));
    const double saved = q[qi];
    q[qi] = saved + step;
    const double up = score_loss(p);
    q[qi] = saved - step;
    const double down = score_loss(p);
    q[qi] = saved;
    EXPECT_NEAR(dq[qi], (up - down) / (2 * step), 1e-9 * (1 + std::fabs(dq[qi])));
    const auto pi = static_cast<std::size_t>(uniform_int(0, scores - 1));
    const double saved_p = probs[pi];
    probs[pi] = saved_p + step;
    const double pu = value_loss(p);
    probs[pi] = saved_p - step;
    const double pd = value_loss(p);
    probs[pi] = saved_p;
    EXPECT_NEAR(dp[pi], (pu - pd) / (2 * step), 1e-9 * (1 + std::fabs(dp[pi])));
  }
}

TEST_P(EveryTarget, ShawTableGradientsAreThreadCountFree) {
  const std::int64_t seq = 200, heads = 4, dim = 16;
  const ShawParams p = ShawParams::init(8, dim, 0.1, 3);
  std::vector<float> q(static_cast<std::size_t>(seq * heads * dim)), ds(static_cast<std::size_t>(heads * seq * seq));
  for (auto& v : q) v = static_cast<float>(uniform(-1, 1));
  for (auto& v : ds) v = static_cast<float>(uniform(-1, 1));
  std::vector<double> one(static_cast<std::size_t>(p.rows() * dim), 0.0), two(one.size(), 0.0);
  for (const int threads : {1, 2}) {
    set_num_threads(threads);
    shaw_score_term_backward(p, ConstTensorView::of(q.data(), {seq, heads, dim}),
                             ConstTensorView::of(ds.data(), {heads, seq, seq}), Positions::range(seq),
                             Positions::range(seq), TensorView(), threads == 1 ? one : two);
  }
  EXPECT_EQ(std::memcmp(one.data(), two.data(), one.size() * sizeof(double)), 0);
}

TEST(Shaw, RejectsBadArguments) {
  expect_error([] { ShawParams(-1, 4); }, {"ShawParams: max_distance = -1", ">= 0"});
  expect_error([] { ShawParams(2, 0); }, {"head_dim = 0", ">= 1"});
  expect_error([] { ShawParams(1, 2, std::vector<double>(5)); }, {"key_table.size() = 5", "(2k + 1)·head_dim = 6"});
  expect_error([] { ShawParams(0, 1, {}, {std::nan("")}); }, {"value_table[0] = nan", "finite"});
  const ShawParams p(2, 4);
  std::vector<float> q(3 * 2 * 4), s(2 * 3 * 5), wrong(3 * 2 * 3);
  expect_error(
      [&] {
        shaw_add_score_term(p, ConstTensorView::of(wrong.data(), {3, 2, 3}), Positions::range(3), Positions::range(5),
                            TensorView::of(s.data(), {2, 3, 5}));
      },
      {"shaw_add_score_term: q.size(-1) = 3", "params.head_dim() = 4"});
  expect_error(
      [&] {
        shaw_add_score_term(p, ConstTensorView::of(q.data(), {3, 2, 4}), Positions::range(3), Positions::range(5),
                            TensorView::of(s.data(), {3, 2, 5}));
      },
      {"shaw_add_score_term: scores.size(0) = 3", "heads = 2"});
  std::vector<double> small(3);
  expect_error(
      [&] {
        shaw_score_term_backward(p, ConstTensorView::of(q.data(), {3, 2, 4}), ConstTensorView::of(s.data(), {2, 3, 5}),
                                 Positions::range(3), Positions::range(5), TensorView(), small);
      },
      {"d_key_table.size() = 3", "20"});
  EXPECT_EQ(p.row_of(-100), 0);
  EXPECT_EQ(p.row_of(0), 2);
  EXPECT_EQ(p.row_of(1), 3);
  EXPECT_EQ(p.row_of(7), 4);
}

// ------------------------------------------------------------------------------ Transformer-XL

// k tokens: [B, Sk, H, D] stored BSHD or BHSD like q.
template <class T>
BasicTensorView<!std::is_const_v<T>> key_view(T* data, DType dtype, const ShawCase& c) {
  const std::vector<std::int64_t> shape = {c.batch, c.k_len, c.heads, c.dim};
  const std::vector<std::int64_t> strides =
      c.bhsd ? std::vector<std::int64_t>{c.heads * c.k_len * c.dim, c.dim, c.k_len * c.dim, 1}
             : std::vector<std::int64_t>{c.k_len * c.heads * c.dim, c.heads * c.dim, c.dim, 1};
  return BasicTensorView<!std::is_const_v<T>>(data, dtype, shape, strides);
}

TEST_P(EveryTarget, TransformerXlMatchesReference) {
  for (int trial = 0; trial < 30; ++trial) {
    ShawCase c = random_case();
    if (trial % 5 == 4 && c.position_kind == 2) {  // ids far apart: the sparse table of δ
      for (auto& id : c.q_ids) id *= 100000;
      for (auto& id : c.k_ids) id *= 77777;
    }
    const auto [qp, kp] = positions_of(c);
    const std::int64_t d_model = 2 * uniform_int(1, 6);
    const XlParams p = XlParams::init(c.heads, c.dim, d_model, 0.5, static_cast<std::uint64_t>(trial));
    const std::int64_t q_count = c.batch * c.q_len * c.heads * c.dim, k_count = c.batch * c.k_len * c.heads * c.dim;
    const std::int64_t scores = c.batch * c.heads * c.q_len * c.k_len;
    auto as = [&](const std::vector<double>& v) { return testing::to_dtype(v, c.dtype); };
    auto widened = [&](const std::vector<unsigned char>& raw, std::int64_t n) {
      std::vector<double> v(static_cast<std::size_t>(n));
      for (std::int64_t e = 0; e < n; ++e) v[static_cast<std::size_t>(e)] = element(raw.data(), c.dtype, e);
      return v;
    };
    const auto q_t = as(random_values(q_count)), k_t = as(random_values(k_count)), ds_t = as(random_values(scores));
    const auto base_s = as(random_values(scores)), base_q = as(random_values(q_count)),
               base_k = as(random_values(k_count));
    const std::vector<double> q64 = widened(q_t, q_count), k64 = widened(k_t, k_count), ds64 = widened(ds_t, scores);
    const double scale = static_cast<double>((c.k_len + c.q_len) * (c.dim + d_model)) * 4;

    std::vector<unsigned char> s_got = base_s;
    std::vector<double> s_want = widened(base_s, scores);
    xl_add_position_terms(p, tokens_view(q_t.data(), c.dtype, c), key_view(k_t.data(), c.dtype, c), qp, kp,
                          TensorView::contiguous(s_got.data(), c.dtype, score_shape(c)));
    ref::xl_add_position_terms(p, tokens_view(q64.data(), DType::kF64, c), key_view(k64.data(), DType::kF64, c), qp, kp,
                               TensorView::contiguous(s_want.data(), DType::kF64, score_shape(c)));
    expect_close(s_got, c.dtype, s_want, scale, "xl scores");

    std::vector<unsigned char> dq_got = base_q, dk_got = base_k;
    std::vector<double> dq_want = widened(base_q, q_count), dk_want = widened(base_k, k_count);
    XlGradients got(p), want(p);
    xl_position_terms_backward(p, tokens_view(q_t.data(), c.dtype, c), key_view(k_t.data(), c.dtype, c),
                               ConstTensorView::contiguous(ds_t.data(), c.dtype, score_shape(c)), qp, kp,
                               tokens_view(dq_got.data(), c.dtype, c), key_view(dk_got.data(), c.dtype, c), got);
    ref::xl_position_terms_backward(p, tokens_view(q64.data(), DType::kF64, c), key_view(k64.data(), DType::kF64, c),
                                    ConstTensorView::contiguous(ds64.data(), DType::kF64, score_shape(c)), qp, kp,
                                    tokens_view(dq_want.data(), DType::kF64, c),
                                    key_view(dk_want.data(), DType::kF64, c), want);
    expect_close(dq_got, c.dtype, dq_want, scale, "xl dq");
    expect_close(dk_got, c.dtype, dk_want, scale, "xl dk");
    for (std::size_t e = 0; e < got.u.size(); ++e) {
      EXPECT_NEAR(got.u[e], want.u[e], 1e-12 * scale) << "du " << e;
      EXPECT_NEAR(got.v[e], want.v[e], 1e-12 * scale) << "dv " << e;
    }
    for (std::size_t e = 0; e < got.w_r.size(); ++e)
      EXPECT_NEAR(got.w_r[e], want.w_r[e], 1e-12 * scale) << "dW_R " << e;
  }
}

// The reference gradients against central differences of L = Σ w·scores: the terms are linear
// in u, W_R and k, and bilinear in (q + v, W_R): central differences are exact up to rounding.
TEST(TransformerXl, GradientsMatchFiniteDifferences) {
  for (int trial = 0; trial < 8; ++trial) {
    ShawCase c = random_case();
    c.dtype = DType::kF64;
    // Named, not a structured binding: lambdas below capture them (clang 14 cannot capture bindings).
    const std::pair<Positions, Positions> positions = positions_of(c);
    const Positions& qp = positions.first;
    const Positions& kp = positions.second;
    const std::int64_t d_model = 2 * uniform_int(1, 4);
    const XlParams p = XlParams::init(c.heads, c.dim, d_model, 0.5, static_cast<std::uint64_t>(trial + 50));
    const std::int64_t q_count = c.batch * c.q_len * c.heads * c.dim, k_count = c.batch * c.k_len * c.heads * c.dim;
    const std::int64_t scores = c.batch * c.heads * c.q_len * c.k_len;
    std::vector<double> q = random_values(q_count), k = random_values(k_count);
    const std::vector<double> w = random_values(scores);
    auto loss = [&](const XlParams& params) {
      std::vector<double> s(static_cast<std::size_t>(scores), 0.0);
      ref::xl_add_position_terms(params, tokens_view(q.data(), DType::kF64, c), key_view(k.data(), DType::kF64, c), qp,
                                 kp, TensorView::contiguous(s.data(), DType::kF64, score_shape(c)));
      double sum = 0;
      for (std::size_t e = 0; e < s.size(); ++e) sum += w[e] * s[e];
      return sum;
    };
    std::vector<double> dq(static_cast<std::size_t>(q_count), 0.0), dk(static_cast<std::size_t>(k_count), 0.0);
    XlGradients grads(p);
    xl_position_terms_backward(p, tokens_view(q.data(), DType::kF64, c), key_view(k.data(), DType::kF64, c),
                               ConstTensorView::contiguous(w.data(), DType::kF64, score_shape(c)), qp, kp,
                               tokens_view(dq.data(), DType::kF64, c), key_view(dk.data(), DType::kF64, c), grads);
    const double step = 1e-4;
    auto with = [&](int which, std::size_t e, double delta) {
      std::vector<double> u = p.u(), v = p.v(), wr = p.w_r();
      (which == 0 ? u : which == 1 ? v : wr)[e] += delta;
      return XlParams(p.heads(), p.head_dim(), p.d_model(), u, v, wr);
    };
    const std::size_t e_hd = static_cast<std::size_t>(uniform_int(0, c.heads * c.dim - 1));
    const std::size_t e_w = static_cast<std::size_t>(uniform_int(0, c.heads * c.dim * d_model - 1));
    const double analytic[] = {grads.u[e_hd], grads.v[e_hd], grads.w_r[e_w]};
    for (int which = 0; which < 3; ++which) {
      const std::size_t e = which == 2 ? e_w : e_hd;
      const double fd = (loss(with(which, e, step)) - loss(with(which, e, -step))) / (2 * step);
      // Bilinear terms: the central difference is exact in real arithmetic; rounding of L
      // (|L| <= ~1e3) over a step of 1e-4 leaves ~1e-9.
      EXPECT_NEAR(analytic[which], fd, 1e-7 * (1 + std::fabs(analytic[which])))
          << "trial " << trial << " parameter " << which;
    }
    for (auto* tensor : {&q, &k}) {
      const auto e = static_cast<std::size_t>(uniform_int(0, static_cast<std::int64_t>(tensor->size()) - 1));
      const double saved = (*tensor)[e];
      (*tensor)[e] = saved + step;
      const double up = loss(p);
      (*tensor)[e] = saved - step;
      const double down = loss(p);
      (*tensor)[e] = saved;
      const double analytic_t = tensor == &q ? dq[e] : dk[e];
      EXPECT_NEAR(analytic_t, (up - down) / (2 * step), 1e-7 * (1 + std::fabs(analytic_t))) << "trial " << trial;
    }
  }
}

TEST_P(EveryTarget, TransformerXlGradientsAreThreadCountFree) {
  const std::int64_t seq = 60, heads = 4, dim = 8, d_model = 16;
  const XlParams p = XlParams::init(heads, dim, d_model, 0.1, 9);
  std::vector<float> q(static_cast<std::size_t>(seq * heads * dim)), ds(static_cast<std::size_t>(heads * seq * seq));
  for (auto& v : q) v = static_cast<float>(uniform(-1, 1));
  for (auto& v : ds) v = static_cast<float>(uniform(-1, 1));
  XlGradients one(p), two(p);
  for (const int threads : {1, 2}) {
    set_num_threads(threads);
    xl_position_terms_backward(p, ConstTensorView::of(q.data(), {seq, heads, dim}),
                               ConstTensorView::of(q.data(), {seq, heads, dim}),
                               ConstTensorView::of(ds.data(), {heads, seq, seq}), Positions::range(seq),
                               Positions::range(seq), TensorView(), TensorView(), threads == 1 ? one : two);
  }
  EXPECT_EQ(std::memcmp(one.w_r.data(), two.w_r.data(), one.w_r.size() * sizeof(double)), 0);
  EXPECT_EQ(std::memcmp(one.u.data(), two.u.data(), one.u.size() * sizeof(double)), 0);
  EXPECT_EQ(std::memcmp(one.v.data(), two.v.data(), one.v.size() * sizeof(double)), 0);
}

TEST(TransformerXl, DefinitionAndErrors) {
  // One head, D = 1, d_model = 2: r(δ) = [sin δ, cos δ]; W_R = [a, b]; u, v scalars.
  const XlParams p(1, 1, 2, {0.5}, {-0.25}, {2.0, 3.0}, 1.0);
  const std::vector<double> q = {0.7}, k = {1.3};
  double score = 0;
  const std::vector<std::int64_t> qi = {10}, ki = {4};
  xl_add_position_terms(p, ConstTensorView::of(q.data(), {1, 1, 1}), ConstTensorView::of(k.data(), {1, 1, 1}),
                        Positions::ids(qi), Positions::ids(ki), TensorView::of(&score, {1, 1, 1}));
  EXPECT_NEAR(score, 0.5 * 1.3 + (0.7 - 0.25) * (2.0 * std::sin(6.0) + 3.0 * std::cos(6.0)), 1e-15);
  EXPECT_NEAR(XlParams::init(2, 4, 8).scale(), 0.5, 0);  // 1/sqrt(head_dim) by default
  expect_error([] { XlParams(1, 1, 3, {0.0}, {0.0}, {0.0, 0.0, 0.0}); }, {"XlParams: d_model = 3", "even"});
  expect_error(
      [] {
        XlParams(1, 2, 2, {0.0}, {0.0, 0.0}, {0.0, 0.0, 0.0, 0.0});
      },
      {"u.size() = 1", "heads·head_dim = 2"});
  expect_error([] { XlParams(1, 1, 2, {0.0}, {0.0}, {0.0, 0.0}, -1.0); }, {"scale = -1"});
  std::vector<double> s(4);
  expect_error(
      [&] {
        xl_add_position_terms(p, ConstTensorView::of(q.data(), {1, 1, 1}), ConstTensorView::of(s.data(), {1, 2, 2, 1}),
                              Positions::range(1), Positions::range(2), TensorView::of(s.data(), {1, 1, 2}));
      },
      {"xl_add_position_terms: k [heads, head_dim] = 2, 1", "params' 1, 1"});
}

// The tile-loop evaluators against the fp64 reference, one query row at a time. f32 math over
// D-long dot products of values <= 1 (and tables of N(0, 0.25)): within 1e-5·(1 + |want|).
TEST(Evaluators, ShawRowsMatchTheReference) {
  for (int trial = 0; trial < 10; ++trial) {
    const std::int64_t q_len = uniform_int(1, 9), k_len = uniform_int(1, 30), dim = uniform_int(1, 12),
                       k = uniform_int(0, 7);
    const std::int64_t q0 = uniform_int(0, 40), k0 = uniform_int(0, 40);
    const ShawParams p = ShawParams::init(k, dim, 0.5, static_cast<std::uint64_t>(trial));
    const ShawEvaluator eval(p);
    std::vector<double> q = random_values(q_len * dim), probs = random_values(q_len * k_len);
    std::vector<double> want_scores(static_cast<std::size_t>(q_len * k_len), 0.0),
        want_out(static_cast<std::size_t>(q_len * dim), 0.0);
    ref::shaw_add_score_term(p, ConstTensorView::of(q.data(), {q_len, 1, dim}), Positions::range(q_len, q0),
                             Positions::range(k_len, k0), TensorView::of(want_scores.data(), {1, q_len, k_len}));
    ref::shaw_add_value_term(p, ConstTensorView::of(probs.data(), {1, q_len, k_len}), Positions::range(q_len, q0),
                             Positions::range(k_len, k0), TensorView::of(want_out.data(), {q_len, 1, dim}));
    std::vector<float> dots(static_cast<std::size_t>(eval.width())), row(static_cast<std::size_t>(k_len)),
        out(static_cast<std::size_t>(dim));
    for (std::int64_t i = 0; i < q_len; ++i) {
      const std::vector<float> qi(q.begin() + i * dim, q.begin() + (i + 1) * dim);
      const std::vector<float> pi(probs.begin() + i * k_len, probs.begin() + (i + 1) * k_len);
      eval.query_dots(qi.data(), dots.data());
      std::fill(row.begin(), row.end(), 0.0f);
      eval.add_row(dots.data(), q0 + i, k0, k_len, row.data());
      for (std::int64_t j = 0; j < k_len; ++j) {
        const double w = want_scores[static_cast<std::size_t>(i * k_len + j)];
        EXPECT_NEAR(row[static_cast<std::size_t>(j)], w, 1e-5 * (1 + std::fabs(w)));
      }
      std::fill(out.begin(), out.end(), 0.0f);
      eval.add_values(pi.data(), q0 + i, k0, k_len, out.data());
      for (std::int64_t d = 0; d < dim; ++d) {
        const double w = want_out[static_cast<std::size_t>(i * dim + d)];
        EXPECT_NEAR(out[static_cast<std::size_t>(d)], w, 1e-5 * (1 + std::fabs(w)) * static_cast<double>(k_len));
      }
    }
  }
}

TEST(Evaluators, TransformerXlRowsMatchTheReference) {
  for (int trial = 0; trial < 10; ++trial) {
    const std::int64_t heads = uniform_int(1, 3), dim = uniform_int(1, 8), d_model = 2 * uniform_int(1, 6);
    const std::int64_t q_len = uniform_int(1, 7), k_len = uniform_int(1, 20);
    const XlParams p = XlParams::init(heads, dim, d_model, 0.5, static_cast<std::uint64_t>(trial));
    // A table narrower than the call's δ on purpose (the rest is projected on the spot).
    const XlEvaluator eval(p, -5, 5);
    std::vector<double> q = random_values(q_len * heads * dim), k = random_values(k_len * heads * dim);
    std::vector<double> want(static_cast<std::size_t>(heads * q_len * k_len), 0.0);
    ref::xl_add_position_terms(p, ConstTensorView::of(q.data(), {q_len, heads, dim}),
                               ConstTensorView::of(k.data(), {k_len, heads, dim}), Positions::range(q_len, k_len),
                               Positions::range(k_len), TensorView::of(want.data(), {heads, q_len, k_len}));
    const std::vector<float> q32(q.begin(), q.end()), k32(k.begin(), k.end());
    std::vector<float> row(static_cast<std::size_t>(k_len));
    for (std::int64_t h = 0; h < heads; ++h) {
      for (std::int64_t i = 0; i < q_len; ++i) {
        std::fill(row.begin(), row.end(), 0.0f);
        eval.add_row(h, q32.data() + (i * heads + h) * dim, k_len + i, k32.data() + h * dim, heads * dim, 0, k_len,
                     row.data());
        for (std::int64_t j = 0; j < k_len; ++j) {
          const double w = want[static_cast<std::size_t>((h * q_len + i) * k_len + j)];
          EXPECT_NEAR(row[static_cast<std::size_t>(j)], w, 1e-5 * (1 + std::fabs(w)) * static_cast<double>(dim))
              << trial;
        }
      }
    }
  }
}

TEST(Evaluators, TupeRowsMatchTheScheme) {
  for (const bool cls : {false, true}) {
    const TupeParams p = TupeParams::init(2, 4, 6, 50, cls, 0.5, 3);
    const TupeEvaluator eval(p, 0, 20);  // positions 21 … 49 are projected on the spot
    std::vector<float> row(30);
    for (const std::int64_t q_pos : {0, 5, 20, 33}) {
      std::fill(row.begin(), row.end(), 0.0f);
      eval.add_row(1, q_pos, 0, 30, row.data());
      for (std::int64_t j = 0; j < 30; ++j) {
        const double w = bias_value(p, 1, q_pos, j);
        EXPECT_NEAR(row[static_cast<std::size_t>(j)], w, 1e-5 * (1 + std::fabs(w))) << cls << " " << q_pos << " " << j;
      }
    }
  }
  expect_error([] { TupeEvaluator(TupeParams::init(1, 1, 1, 10), 0, 10); }, {"TupeEvaluator", "< max_len = 10"});
}

INSTANTIATE_TEST_SUITE_P(Targets, EveryTarget, ::testing::ValuesIn(testing::all_targets()),
                         [](const ::testing::TestParamInfo<std::string>& target) { return target.param; });

}  // namespace
}  // namespace posenc
