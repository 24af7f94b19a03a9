// Shared by the fused attention's tests (test_attention.cpp, test_attention_backward.cpp): problems
// in every layout and dtype, running the fused call and the references, and the accuracy checks.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "testing.hpp"

namespace posenc::attention_testing {

using testing::uniform;
using testing::uniform_int;

// A problem: q [B, Sq, H, D], k, v [B, Sk, G, D] (or packed [T, ·, D]), as f64 values, stored in
// the test's dtype (optionally with [B, H, S, D] memory order: strided views).
struct Problem {
  std::int64_t batch = 1, q_len = 0, k_len = 0, heads = 1, kv_heads = 1, dim = 16;
  DType dtype = DType::kF32;
  bool head_major = false;  // memory [B, H, S, D]
  std::vector<std::int64_t> cu_q, cu_k;
  std::vector<double> q, k, v;  // values already rounded to dtype
  std::vector<unsigned char> qb, kb, vb;

  bool packed() const { return !cu_q.empty(); }
  std::vector<std::int64_t> shape(std::int64_t seq, std::int64_t h) const {
    return packed() ? std::vector<std::int64_t>{seq, h, dim} : std::vector<std::int64_t>{batch, seq, h, dim};
  }
  std::vector<std::int64_t> strides(std::int64_t seq, std::int64_t h) const {
    if (packed())
      return head_major ? std::vector<std::int64_t>{dim, seq * dim, 1} : std::vector<std::int64_t>{h * dim, dim, 1};
    return head_major ? std::vector<std::int64_t>{h * seq * dim, dim, seq * dim, 1}
                      : std::vector<std::int64_t>{seq * h * dim, h * dim, dim, 1};
  }
  template <bool kMutable>
  BasicTensorView<kMutable> view(std::conditional_t<kMutable, void*, const void*> data, std::int64_t seq,
                                 std::int64_t h, DType dt) const {
    const auto s = shape(seq, h), st = strides(seq, h);
    return BasicTensorView<kMutable>(data, dt, s, st);
  }
  ConstTensorView qv() const { return view<false>(qb.data(), q_len, heads, dtype); }
  ConstTensorView kv() const { return view<false>(kb.data(), k_len, kv_heads, dtype); }
  ConstTensorView vv() const { return view<false>(vb.data(), k_len, kv_heads, dtype); }
  std::int64_t q_count() const { return (packed() ? 1 : batch) * q_len * heads * dim; }
  std::int64_t k_count() const { return (packed() ? 1 : batch) * k_len * kv_heads * dim; }
};

inline void fill(std::vector<double>& values, std::vector<unsigned char>& bytes, std::int64_t count, DType dtype,
                 double scale) {
  values.resize(static_cast<std::size_t>(count));
  for (auto& x : values) x = testing::round_to(uniform(-scale, scale), dtype);
  bytes = testing::to_dtype(values, dtype);
}

inline Problem make_problem(std::int64_t batch, std::int64_t q_len, std::int64_t k_len, std::int64_t heads,
                            std::int64_t kv_heads, std::int64_t dim, DType dtype = DType::kF32, bool head_major = false,
                            double scale = 1.0) {
  Problem p;
  p.batch = batch;
  p.q_len = q_len;
  p.k_len = k_len;
  p.heads = heads;
  p.kv_heads = kv_heads;
  p.dim = dim;
  p.dtype = dtype;
  p.head_major = head_major;
  fill(p.q, p.qb, p.q_count(), dtype, scale);
  fill(p.k, p.kb, p.k_count(), dtype, scale);
  fill(p.v, p.vb, p.k_count(), dtype, 1.0);
  return p;
}

// Packed sequences of the given (q, k) lengths.
inline Problem make_packed(const std::vector<std::pair<std::int64_t, std::int64_t>>& lengths, std::int64_t heads,
                           std::int64_t kv_heads, std::int64_t dim) {
  Problem p;
  p.cu_q = {0};
  p.cu_k = {0};
  for (const auto& [lq, lk] : lengths) {
    p.cu_q.push_back(p.cu_q.back() + lq);
    p.cu_k.push_back(p.cu_k.back() + lk);
  }
  p.q_len = p.cu_q.back();
  p.k_len = p.cu_k.back();
  p.heads = heads;
  p.kv_heads = kv_heads;
  p.dim = dim;
  fill(p.q, p.qb, p.q_count(), p.dtype, 1.0);
  fill(p.k, p.kb, p.k_count(), p.dtype, 1.0);
  fill(p.v, p.vb, p.k_count(), p.dtype, 1.0);
  return p;
}

// Shaw's and Transformer-XL's terms of a head group (relative.hpp).
inline AttentionTermRef shaw_term(std::int64_t heads, ShawParams params) {
  return std::make_shared<ShawTerm>(heads, std::move(params));
}
inline AttentionTermRef xl_term(XlParams params) { return std::make_shared<XlTerm>(std::move(params)); }

inline AttentionSpec spec_of(const Problem& p) {
  AttentionSpec s;
  s.q = p.qv();
  s.k = p.kv();
  s.v = p.vv();
  s.cu_seqlens_q = p.cu_q;
  s.cu_seqlens_k = p.cu_k;
  return s;
}

struct Outputs {
  std::vector<double> out, lse;
  AttentionStats stats;  // the fused call's (zero for the references)
};

// Runs forward (fused, or a reference) and returns out and lse as doubles in [B, S, H, D] order.
inline Outputs run_forward(const Problem& p, const Attention& att,
                           int mode /* 0 fused, 1 ref f64, 2 naive f32, 3 naive with bf16 products */) {
  const DType out_dtype = mode == 1 ? DType::kF64 : p.dtype;
  std::vector<unsigned char> out = testing::garbage_buffer(out_dtype, p.q_count());
  const std::int64_t rows = p.heads * (p.packed() ? 1 : p.batch) * p.q_len;
  std::vector<float> lse(static_cast<std::size_t>(rows), 7.0f);
  TensorView lse_view = p.packed() ? TensorView::of(lse.data(), {p.heads, p.q_len})
                                   : TensorView::of(lse.data(), {p.batch, p.heads, p.q_len});
  TensorView out_view = p.view<true>(out.data(), p.q_len, p.heads, out_dtype);
  AttentionStats stats;
  if (mode == 0) {
    stats = att.forward(out_view, lse_view);
  } else {
    // The reference writes any dtype; the fp64 reference writes f64 here (no rounding).
    if (mode == 3) {
      ref::attention_forward_bf16_products(att, out_view, lse_view);
    } else {
      ref::attention_forward(att, out_view, lse_view, mode == 2);
    }
  }
  Outputs o;
  o.stats = stats;
  o.out.resize(static_cast<std::size_t>(p.q_count()));
  // Gather back in [B, S, H, D] order through the view's strides.
  const auto st = p.strides(p.q_len, p.heads);
  const std::int64_t B = p.packed() ? 1 : p.batch;
  std::size_t n = 0;
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t s = 0; s < p.q_len; ++s) {
      for (std::int64_t h = 0; h < p.heads; ++h) {
        for (std::int64_t d = 0; d < p.dim; ++d) {
          const std::int64_t at = p.packed() ? s * st[0] + h * st[1] + d : b * st[0] + s * st[1] + h * st[2] + d;
          o.out[n++] = testing::element(out.data(), out_dtype, at);
        }
      }
    }
  }
  o.lse.assign(lse.begin(), lse.end());
  return o;
}

// TUPE with the [CLS] reset and non-zero θ1, θ2 (init leaves them 0, which would hide them).
inline TupeParams tupe_with_cls(std::int64_t heads, std::int64_t dim, std::int64_t d_model, std::int64_t max_len,
                                std::uint64_t seed) {
  const TupeParams base = TupeParams::init(heads, dim, d_model, max_len, true, 0.5, seed);
  std::vector<double> theta1(static_cast<std::size_t>(heads)), theta2(theta1.size());
  for (auto& x : theta1) x = uniform(-1, 1);
  for (auto& x : theta2) x = uniform(-1, 1);
  return TupeParams(heads, dim, d_model, base.table(), base.u_q(), base.u_k(), true, theta1, theta2);
}

inline double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::isinf(a[i]) && std::isinf(b[i]) && (a[i] > 0) == (b[i] > 0)) continue;
    m = std::max(m, std::fabs(a[i] - b[i]));
  }
  return m;
}

// The native bf16 products (AttentionSpec::bf16_products) against fp64, two ways. The bound of
// docs/attention.md: the output's rounding (2^-9·|out|), P's rounding (2^-9·max|v|) and the
// logits' (at most η = 2^-8·(1 + 2^-6)·scale·max|q|·max|k| each: the transformed q and k rounded
// once) moving the softmax weights by at most a factor e^{±2η} (|Δout| <= (e^{2η} − 1)·max|v|),
// plus the f32 floor; |q|, |k| <= sqrt(D)·their largest element, as no scheme of these tests grows
// norms (a rotation keeps them; biases are not rounded). And flash-attention's criterion for its bf16
// kernels: at most twice the error of the naive composition with the same roundings.
// Returns η, which also bounds the logits' and so lse's added error.
inline double expect_bf16_products_accurate(const Problem& p, const Attention& att, const Outputs& fused,
                                            const Outputs& exact) {
  const double scale = att.spec().scale > 0 ? att.spec().scale : 1.0 / std::sqrt(static_cast<double>(p.dim));
  const auto largest = [](const std::vector<double>& x) {
    double m = 0;
    for (const double e : x) m = std::max(m, std::fabs(e));
    return m;
  };
  const double root_d = std::sqrt(static_cast<double>(p.dim)), v_max = largest(p.v);
  const double eta =
      std::ldexp(1.0, -8) * (1 + std::ldexp(1.0, -6)) * scale * root_d * largest(p.q) * root_d * largest(p.k);
  const double bound =
      std::ldexp(1.0, -9) * (largest(exact.out) + v_max) + std::expm1(2 * eta) * v_max + std::ldexp(1.0, -22);
  const double err = max_abs_diff(fused.out, exact.out);
  EXPECT_LE(err, bound) << "native bf16 products: η " << eta;
  const Outputs naive = run_forward(p, att, 3);
  const double naive_err = max_abs_diff(naive.out, exact.out);
  EXPECT_LE(err, 2 * naive_err + std::ldexp(1.0, -22)) << "naive bf16-product error " << naive_err;
  return eta;
}

// flash-attention's criterion: the fused result's max error against fp64 at most twice the naive
// f32 composition's. Floor: 2^-22 (4 f32 ulps at 1, the size of |out| <= max|v| = 1) for cases
// where the naive error happens to be tiny — storing one f32 result costs half an ulp by itself.
inline void expect_accurate(const Problem& p, const AttentionSpec& spec, const std::string& what) {
  SCOPED_TRACE(what);
  const Attention att(spec);
  const Outputs fused = run_forward(p, att, 0), exact = run_forward(p, att, 1);
  const double floor = std::ldexp(1.0, -22);
  double rounded_logits = 0;  // the native bf16 products' η
  if (p.dtype == DType::kF32) {
    const Outputs naive = run_forward(p, att, 2);
    const double naive_err = max_abs_diff(naive.out, exact.out), fused_err = max_abs_diff(fused.out, exact.out);
    EXPECT_LE(fused_err, 2 * naive_err + floor) << "naive f32 error " << naive_err;
  } else if (fused.stats.bf16_products) {
    rounded_logits = expect_bf16_products_accurate(p, att, fused, exact);
  } else {
    // 16-bit outputs: the fp64 result rounded once to the dtype is off by half its ulp (2^-9 for
    // bf16, 2^-12 for f16 relative; |out| <= 1), plus the f32 computation's error (the floor).
    const double half_ulp = p.dtype == DType::kBF16 ? std::ldexp(1.0, -9) : std::ldexp(1.0, -12);
    EXPECT_LE(max_abs_diff(fused.out, exact.out), half_ulp + floor);
  }
  // lse: a log of a sum of up to Sk terms; f32 carries 2^-24 relative on |lse| plus the logits'
  // own f32 error, bounded by 2^-20 per unit of logit magnitude here (|logits| <= ~D·scale).
  double lse_scale = 1;
  for (double x : exact.lse) {
    if (std::isfinite(x)) lse_scale = std::max(lse_scale, std::fabs(x));
  }
  EXPECT_LE(max_abs_diff(fused.lse, exact.lse), std::ldexp(1.0, -18) * lse_scale + rounded_logits);
}

// The plan of `spec` with the vanishing-tile skip on, then off.
inline std::pair<Attention, Attention> with_and_without_skip(AttentionSpec spec) {
  Attention skipping(spec);
  spec.skip_vanishing_tiles = false;
  return {std::move(skipping), Attention(spec)};
}

// Steep slopes make keys vanish within a few tiles (a bias of −100 at 25 to 100 keys); the last
// head has no ALiBi, so its KV head's blocks never skip.
inline const std::vector<double> kSteepSlopes = {4.0, 2.0, 1.0, 0.0};

// A case of the vanishing-tile tests: one sequence, 4 heads over 2 KV heads, D 64.
struct VanishingCase {
  const char* what;
  std::int64_t q_len, k_len;
  bool causal;
  std::int64_t window_left;
  std::vector<HeadGroup> groups;
  bool skips = true;   // whether some tile must vanish
  double scale = 1.0;  // of q and k: 4 gives logits up to about ±40, which the bound must count
  Problem problem() const { return make_problem(1, q_len, k_len, 4, 2, 64, DType::kF32, false, scale); }
  AttentionSpec spec(const Problem& p) const {
    AttentionSpec s = spec_of(p);
    s.mask.causal = causal;
    s.mask.window_left = window_left;
    s.groups = groups;
    return s;
  }
};

// A tile may be skipped only if every probability in it is below FLT_MIN. Far keys here align
// with the queries (q·k·scale = 32, more than the near keys' 0) and carry values of 1e30, so any
// probability of 1e-37 or more that a skip dropped would show in the output: the last far tile
// has logits up to 32 − 103 = −71 against a max of 0, so it must run (bounding q·k by 0 instead
// of |q|·|k| would skip it); the tiles behind it vanish and must be skipped.
inline Problem aligned_far_keys() {
  const std::int64_t q_len = 64, k_len = 550, dim = 64, near_first = 384;
  Problem p = make_problem(1, q_len, k_len, 1, 1, dim);
  for (std::int64_t i = 0; i < q_len * dim; ++i) p.q[static_cast<std::size_t>(i)] = 2.0;  // |q|² = 256
  for (std::int64_t j = 0; j < k_len; ++j) {
    const bool far = j < near_first;
    for (std::int64_t d = 0; d < dim; ++d) {
      const auto at = static_cast<std::size_t>(j * dim + d);
      p.k[at] = far && j % 8 != 0 ? 2.0 : 0.0;  // every 8th key 0: the bound must take the tile's largest
      if (far) p.v[at] = 1e30;
    }
  }
  p.qb = testing::to_dtype(p.q, p.dtype);
  p.kb = testing::to_dtype(p.k, p.dtype);
  p.vb = testing::to_dtype(p.v, p.dtype);
  return p;
}

// Causal, slope 1: the plan the aligned_far_keys tests run.
inline AttentionSpec aligned_far_keys_spec(const Problem& p) {
  AttentionSpec spec = spec_of(p);
  spec.mask.causal = true;
  spec.groups = {{1, {}, AlibiParams(std::vector<double>{1.0})}};
  return spec;
}

struct Grads {
  std::vector<double> dq, dk, dv;
  AttentionGradients params;
  AttentionStats stats;  // the fused backward's (zero for the reference)
};

inline std::vector<double> gather(const Problem& p, const std::vector<double>& raw, std::int64_t seq, std::int64_t h) {
  // raw is laid out like the problem's views; return [B, S, H, D] order.
  std::vector<double> out;
  const auto st = p.strides(seq, h);
  const std::int64_t B = p.packed() ? 1 : p.batch;
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t s = 0; s < seq; ++s) {
      for (std::int64_t hh = 0; hh < h; ++hh) {
        for (std::int64_t d = 0; d < p.dim; ++d) {
          out.push_back(raw[static_cast<std::size_t>(p.packed() ? s * st[0] + hh * st[1] + d
                                                                : b * st[0] + s * st[1] + hh * st[2] + d)]);
        }
      }
    }
  }
  return out;
}

// Backward with d_out given in [B, S, H, D]-view order as f64 values (stored in the dtype).
// reference: 0 (false) the fused passes, 1 (true) the fp64 references, 2 the naive compositions
// with bf16 products (in the inputs' dtype, as the fused passes store; no parameter gradients).
inline Grads run_backward(const Problem& p, const Attention& att, const std::vector<double>& d_out, int reference,
                          bool with_params = true) {
  const DType dt = reference == 1 ? DType::kF64 : p.dtype;
  const std::int64_t rows = p.heads * (p.packed() ? 1 : p.batch) * p.q_len;
  std::vector<unsigned char> out = testing::garbage_buffer(dt, p.q_count());
  std::vector<float> lse(static_cast<std::size_t>(rows));
  TensorView lse_view = p.packed() ? TensorView::of(lse.data(), {p.heads, p.q_len})
                                   : TensorView::of(lse.data(), {p.batch, p.heads, p.q_len});
  TensorView out_view = p.view<true>(out.data(), p.q_len, p.heads, dt);
  if (reference == 2) {
    ref::attention_forward_bf16_products(att, out_view, lse_view);
  } else if (reference == 1) {
    ref::attention_forward(att, out_view, lse_view);
  } else {
    att.forward(out_view, lse_view);
  }
  const std::vector<unsigned char> dout_bytes = testing::to_dtype(d_out, dt);
  std::vector<double> dq(static_cast<std::size_t>(p.q_count())), dk(static_cast<std::size_t>(p.k_count())),
      dv(dk.size());
  std::vector<unsigned char> dqb = testing::to_dtype(dq, dt), dkb = testing::to_dtype(dk, dt),
                             dvb = testing::to_dtype(dv, dt);
  Grads g;
  g.params = att.zero_gradients();
  const ConstTensorView dov = p.view<false>(dout_bytes.data(), p.q_len, p.heads, dt);
  TensorView dqv = p.view<true>(dqb.data(), p.q_len, p.heads, dt),
             dkv = p.view<true>(dkb.data(), p.k_len, p.kv_heads, dt),
             dvv = p.view<true>(dvb.data(), p.k_len, p.kv_heads, dt);
  if (reference == 2) {
    ref::attention_backward_bf16_products(att, out_view, lse_view, dov, dqv, dkv, dvv);
  } else if (reference == 1) {
    ref::attention_backward(att, out_view, lse_view, dov, dqv, dkv, dvv, with_params ? &g.params : nullptr);
  } else {
    g.stats = att.backward(out_view, lse_view, dov, dqv, dkv, dvv, with_params ? &g.params : nullptr);
  }
  for (std::int64_t i = 0; i < p.q_count(); ++i) dq[static_cast<std::size_t>(i)] = testing::element(dqb.data(), dt, i);
  for (std::int64_t i = 0; i < p.k_count(); ++i) {
    dk[static_cast<std::size_t>(i)] = testing::element(dkb.data(), dt, i);
    dv[static_cast<std::size_t>(i)] = testing::element(dvb.data(), dt, i);
  }
  g.dq = gather(p, dq, p.q_len, p.heads);
  g.dk = gather(p, dk, p.k_len, p.kv_heads);
  g.dv = gather(p, dv, p.k_len, p.kv_heads);
  return g;
}

inline double max_abs(const std::vector<double>& a) {
  double m = 0;
  for (double x : a) m = std::max(m, std::fabs(x));
  return m;
}

// f32 backward against fp64: each gradient element is a sum of up to Sk (or Sq·G) products of
// f32-rounded terms, so its error is ~n·2^-24 of the largest contribution; 2^-13 of the
// gradient's max magnitude covers n up to ~2^10 with the usual √n growth to spare.
inline void expect_close(const std::vector<double>& got, const std::vector<double>& want, const char* name) {
  const double tol = std::ldexp(1.0, -13) * std::max(max_abs(want), 1e-3);
  EXPECT_LE(max_abs_diff(got, want), tol) << name << " (max |want| " << max_abs(want) << ")";
}

// A term's gradients, each of its parameters on its own scale: Shaw's two tables, XL's u, v and
// W_R; another term's (a gate's, the sinks') as one.
inline void expect_term_gradients_close(const AttentionTerm& term, const std::vector<double>& fused,
                                        const std::vector<double>& exact) {
  const auto part = [](const std::vector<double>& all, std::size_t at, std::size_t n) {
    return std::vector<double>(all.begin() + static_cast<std::ptrdiff_t>(at),
                               all.begin() + static_cast<std::ptrdiff_t>(std::min(all.size(), at + n)));
  };
  std::vector<std::pair<const char*, std::size_t>> parts;
  if (const auto* shaw = dynamic_cast<const ShawTerm*>(&term)) {
    const auto n = static_cast<std::size_t>(shaw->params().rows() * shaw->params().head_dim());
    parts = {{"shaw key table", n}, {"shaw value table", n}};
  } else if (const auto* xl = dynamic_cast<const XlTerm*>(&term)) {
    const auto hd = static_cast<std::size_t>(xl->params().heads() * xl->params().head_dim());
    parts = {{"xl u", hd}, {"xl v", hd}, {"xl w_r", hd * static_cast<std::size_t>(xl->params().d_model())}};
  } else {
    parts = {{"a term's input gradient", exact.size()}};
  }
  ASSERT_EQ(fused.size(), exact.size()) << term.name() << " gradient size";
  std::size_t at = 0;
  for (const auto& [name, n] : parts) {
    expect_close(part(fused, at, n), part(exact, at, n), name);
    at += n;
  }
}

// As expect_close, with the gradient's scale given (for sums that cancel to ~0).
inline void expect_close_to_scale(const std::vector<double>& got, const std::vector<double>& want, double scale,
                                  const char* name) {
  EXPECT_LE(max_abs_diff(got, want), std::ldexp(1.0, -13) * std::max(scale, 1e-3))
      << name << " (scale " << scale << ")";
}

inline std::vector<double> random_values(std::size_t n) {
  std::vector<double> v(n);
  for (auto& x : v) x = uniform(-1, 1);
  return v;
}

// A group's score-bias gradients (GroupGradients::bias, flat in the registered order), fused
// against fp64; FIRE's and TUPE's split into their parameters, where some need their own scale.
inline void expect_bias_gradients_close(const Attention& att, std::size_t g, const std::vector<double>& fused,
                                        const std::vector<double>& exact) {
  ASSERT_EQ(fused.size(), exact.size()) << "bias gradients of group " << g;
  const auto& groups = att.spec().groups;
  const BiasScheme* scheme = g < groups.size() && groups[g].bias ? &*groups[g].bias : nullptr;
  std::size_t at = 0;
  // The next n entries of both, as a pair.
  const auto next = [&](std::size_t n) {
    const auto from = static_cast<std::ptrdiff_t>(at), to = static_cast<std::ptrdiff_t>(at + n);
    at += n;
    return std::pair{std::vector<double>(fused.begin() + from, fused.begin() + to),
                     std::vector<double>(exact.begin() + from, exact.begin() + to)};
  };
  if (const auto* fire = scheme ? scheme->get_if<FireParams>() : nullptr) {
    const auto [aw1, bw1] = next(fire->w1().size());
    const auto [ab1, bb1] = next(fire->b1().size());
    const auto [aw2, bw2] = next(fire->w2().size());
    const auto [ab2, bb2] = next(fire->b2().size());
    expect_close(aw1, bw1, "fire w1");
    expect_close(ab1, bb1, "fire b1");
    expect_close(aw2, bw2, "fire w2");
    // ∂L/∂b2 is Σ dS over whole rows, which softmax makes 0 up to rounding: judge its f32 error
    // against the size of the dS sums that also feed w2 (same terms, O(1) weights).
    expect_close_to_scale(ab2, bb2, std::max(max_abs(bw2), max_abs(bb1)), "fire b2");
    const auto [a_cl, b_cl] = next(2);
    expect_close(a_cl, b_cl, "fire c, L");
  } else if (const auto* tupe = scheme ? scheme->get_if<TupeParams>() : nullptr) {
    const auto [at_, bt] = next(tupe->table().size());
    const auto [auq, buq] = next(tupe->u_q().size());
    const auto [auk, buk] = next(tupe->u_k().size());
    const auto [ath1, bth1] = next(tupe->theta1().size());
    const auto [ath2, bth2] = next(tupe->theta2().size());
    expect_close(at_, bt, "tupe table");
    expect_close(auq, buq, "tupe u_q");
    expect_close(auk, buk, "tupe u_k");
    // θ1's gradient is the [CLS] query's Σ dS over the other keys, which under a causal mask is
    // 0 (that row sees only its own key, so P = 1 and dS = dP − δ = 0) up to f32 rounding: judge
    // both θ against the size of the dS sums that feed U^Q and U^K (same terms, O(1) weights).
    const double theta_scale = std::max({max_abs(bth1), max_abs(bth2), max_abs(buq), max_abs(buk)});
    expect_close_to_scale(ath1, bth1, theta_scale, "tupe theta1");
    expect_close_to_scale(ath2, bth2, theta_scale, "tupe theta2");
  } else if (const auto* kerple = scheme ? scheme->get_if<KerpleParams>() : nullptr) {
    // r1 and r2 apart: each against its own size.
    const auto [ar1, br1] = next(static_cast<std::size_t>(kerple->heads()));
    const auto [ar2, br2] = next(static_cast<std::size_t>(kerple->heads()));
    expect_close(ar1, br1, "kerple r1");
    expect_close(ar2, br2, "kerple r2");
  } else {
    expect_close(fused, exact, "bias parameters");
  }
}

// The fused backward (this target) against the fp64 reference: dq, dk, dv and every scheme's
// parameter gradients.
inline void expect_backward_matches_reference(const Problem& p, const Attention& att,
                                              const std::vector<double>& d_out) {
  const Grads fused = run_backward(p, att, d_out, false), exact = run_backward(p, att, d_out, true);
  expect_close(fused.dq, exact.dq, "dq");
  expect_close(fused.dk, exact.dk, "dk");
  expect_close(fused.dv, exact.dv, "dv");
  // Without the parameters' gradients (work that only they need is skipped) dq, dk and dv keep
  // every bit.
  const Grads inputs_only = run_backward(p, att, d_out, false, false);
  EXPECT_EQ(inputs_only.dq, fused.dq) << "dq without parameter gradients";
  EXPECT_EQ(inputs_only.dk, fused.dk) << "dk without parameter gradients";
  EXPECT_EQ(inputs_only.dv, fused.dv) << "dv without parameter gradients";
  for (std::size_t g = 0; g < exact.params.groups.size(); ++g) {
    expect_bias_gradients_close(att, g, fused.params.groups[g].bias, exact.params.groups[g].bias);
    for (std::size_t t = 0; t < exact.params.groups[g].terms.size(); ++t)
      expect_term_gradients_close(*att.spec().groups[g].terms[t], fused.params.groups[g].terms[t],
                                  exact.params.groups[g].terms[t]);
  }
}

// expect_accurate, then the backward against the reference for f32 calls of fewer than 1000 keys
// (the fp64 backward's cost grows with Sq·Sk·D).
inline void expect_forward_and_backward_accurate(const Problem& p, const AttentionSpec& spec, const std::string& what) {
  expect_accurate(p, spec, what);
  if (p.dtype == DType::kF32 && p.k_len < 1000) {
    expect_backward_matches_reference(p, Attention(spec), random_values(static_cast<std::size_t>(p.q_count())));
  }
}

// The fp64 reference's gradient of the first term of group 0 (of its bias: of_bias; parameters
// θ, spec_with(θ) the call) against central differences of its forward's L = Σ d_out·out;
// h = 1e-6 on O(1) parameters: truncation ~h², rounding ~1e-16/h.
template <class SpecWith>
void expect_term_gradient_matches_differences(const Problem& p, SpecWith&& spec_with, const std::vector<double>& theta,
                                              const std::vector<double>& d_out, double tolerance,
                                              bool of_bias = false) {
  const Grads exact = run_backward(p, Attention(spec_with(theta)), d_out, true);
  const auto loss = [&](const std::vector<double>& t) {
    const Outputs o = run_forward(p, Attention(spec_with(t)), 1);
    double l = 0;
    for (std::size_t i = 0; i < o.out.size(); ++i) l += d_out[i] * o.out[i];
    return l;
  };
  for (std::size_t t = 0; t < theta.size(); ++t) {
    std::vector<double> up = theta, down = theta;
    up[t] += 1e-6;
    down[t] -= 1e-6;
    const GroupGradients& g = exact.params.groups[0];
    EXPECT_NEAR(of_bias ? g.bias[t] : g.terms[0][t], (loss(up) - loss(down)) / 2e-6, tolerance) << t;
  }
}

// Backward of `att` (on p) and forward of `dec` (on d, e.g. a decode call; may be null) give the
// same bits for 1, 2 and 3 threads: dq, dk, dv, the groups' parameter and term gradients, out, lse.
inline void expect_same_bits_for_any_thread_count(const Problem& p, const Attention& att, const Problem& d,
                                                  const Attention* dec) {
  const std::vector<double> d_out = random_values(static_cast<std::size_t>(p.q_count()));
  std::vector<Grads> runs;
  std::vector<Outputs> forwards;
  for (const int threads : {1, 2, 3}) {
    set_num_threads(threads);
    runs.push_back(run_backward(p, att, d_out, false));
    if (dec != nullptr) forwards.push_back(run_forward(d, *dec, 0));
  }
  set_num_threads(2);
  for (std::size_t r = 1; r < runs.size(); ++r) {
    SCOPED_TRACE("threads " + std::to_string(r + 1));
    EXPECT_EQ(runs[r].dq, runs[0].dq);
    EXPECT_EQ(runs[r].dk, runs[0].dk);
    EXPECT_EQ(runs[r].dv, runs[0].dv);
    for (std::size_t g = 0; g < runs[0].params.groups.size(); ++g) {
      const GroupGradients &a = runs[r].params.groups[g], &b = runs[0].params.groups[g];
      EXPECT_EQ(a.bias, b.bias);
      EXPECT_EQ(a.terms, b.terms);
    }
    if (dec != nullptr) {
      EXPECT_EQ(forwards[r].out, forwards[0].out);
      EXPECT_EQ(forwards[r].lse, forwards[0].lse);
    }
  }
}

}  // namespace posenc::attention_testing
