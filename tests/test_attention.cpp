// Fused attention: forward against the fp64 reference with flash-attention's accuracy criterion
// (the fused f32 error at most twice the naive f32 composition's), for every scheme, mask, head
// grouping, layout and dtype on every target; decode's split keys; backward (dq, dk, dv and the
// schemes' parameter gradients) against the fp64 reference, which is itself checked by finite
// differences; bitwise determinism over thread counts; errors.
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

#include "../src/kernels/attention/attention_kernels.hpp"  // attn_gemm: the matrix kernel under test
#include "testing.hpp"

namespace posenc {
namespace {

using testing::EveryTarget;
using testing::expect_error;
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

void fill(std::vector<double>& values, std::vector<unsigned char>& bytes, std::int64_t count, DType dtype,
          double scale) {
  values.resize(static_cast<std::size_t>(count));
  for (auto& x : values) x = testing::round_to(uniform(-scale, scale), dtype);
  bytes = testing::to_dtype(values, dtype);
}

Problem make_problem(std::int64_t batch, std::int64_t q_len, std::int64_t k_len, std::int64_t heads,
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
Problem make_packed(const std::vector<std::pair<std::int64_t, std::int64_t>>& lengths, std::int64_t heads,
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

AttentionSpec spec_of(const Problem& p) {
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
Outputs run_forward(const Problem& p, const Attention& att, int mode /* 0 fused, 1 ref f64, 2 naive f32 */) {
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
    ref::attention_forward(att, out_view, lse_view, mode == 2);
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
TupeParams tupe_with_cls(std::int64_t heads, std::int64_t dim, std::int64_t d_model, std::int64_t max_len,
                         std::uint64_t seed) {
  const TupeParams base = TupeParams::init(heads, dim, d_model, max_len, true, 0.5, seed);
  std::vector<double> theta1(static_cast<std::size_t>(heads)), theta2(theta1.size());
  for (auto& x : theta1) x = uniform(-1, 1);
  for (auto& x : theta2) x = uniform(-1, 1);
  return TupeParams(heads, dim, d_model, base.table(), base.u_q(), base.u_k(), true, theta1, theta2);
}

double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::isinf(a[i]) && std::isinf(b[i]) && (a[i] > 0) == (b[i] > 0)) continue;
    m = std::max(m, std::fabs(a[i] - b[i]));
  }
  return m;
}

// flash-attention's criterion: the fused result's max error against fp64 at most twice the naive
// f32 composition's. Floor: 2^-22 (4 f32 ulps at 1, the size of |out| <= max|v| = 1) for cases
// where the naive error happens to be tiny — storing one f32 result costs half an ulp by itself.
void expect_accurate(const Problem& p, const AttentionSpec& spec, const std::string& what) {
  SCOPED_TRACE(what);
  const Attention att(spec);
  const Outputs fused = run_forward(p, att, 0), exact = run_forward(p, att, 1);
  const double floor = std::ldexp(1.0, -22);
  if (p.dtype == DType::kF32) {
    const Outputs naive = run_forward(p, att, 2);
    const double naive_err = max_abs_diff(naive.out, exact.out), fused_err = max_abs_diff(fused.out, exact.out);
    EXPECT_LE(fused_err, 2 * naive_err + floor) << "naive f32 error " << naive_err;
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
  EXPECT_LE(max_abs_diff(fused.lse, exact.lse), std::ldexp(1.0, -18) * lse_scale);
}

class AttentionForward : public EveryTarget {};

TEST_P(AttentionForward, NoPositionalSchemeAcrossShapesMasksAndLayouts) {
  for (int trial = 0; trial < 6; ++trial) {
    const std::int64_t dim = std::vector<std::int64_t>{64, 80, 96, 128, 24, 256}[static_cast<std::size_t>(trial)];
    const std::int64_t kv = uniform_int(1, 2), heads = kv * uniform_int(1, 3);
    const std::int64_t q_len = uniform_int(1, 150), k_len = q_len + uniform_int(0, 90);
    Problem p = make_problem(uniform_int(1, 2), q_len, k_len, heads, kv, dim, DType::kF32, trial % 2 == 1);
    AttentionSpec spec = spec_of(p);
    expect_accurate(p, spec, "none, D " + std::to_string(dim));
    spec.mask.causal = true;
    expect_accurate(p, spec, "causal, D " + std::to_string(dim));
    spec.mask.window_left = uniform_int(0, 40);
    expect_accurate(p, spec, "sliding window");
    spec.mask = {};
    spec.mask.window_left = 7;
    spec.mask.window_right = 3;
    spec.mask.softcap = 2.5;
    expect_accurate(p, spec, "two-sided window with soft-cap");
    spec.mask = {};
    spec.mask.causal = true;
    for (std::int64_t b = 0; b < p.batch; ++b) spec.mask.key_lengths.push_back(uniform_int(0, k_len));
    expect_accurate(p, spec, "key lengths");
    spec.mask = {};
    spec.scale = 0.3;
    expect_accurate(p, spec, "explicit scale");
  }
}

TEST_P(AttentionForward, EveryPositionalScheme) {
  const std::int64_t heads = 4, kv = 2, dim = 64;
  Problem p = make_problem(2, 70, 97, heads, kv, dim);
  const auto with = [&](std::vector<HeadGroup> groups, bool causal, const std::string& what) {
    AttentionSpec spec = spec_of(p);
    spec.groups = std::move(groups);
    spec.mask.causal = causal;
    expect_accurate(p, spec, what);
  };
  const RopeParams rope(dim, dim);
  with({{heads, RotaryQK{rope}, {}}}, true, "rope half-split");
  with({{heads, RotaryQK{RopeParams(dim, 32, 500.0, RopeLayout::kInterleaved)}, {}}}, true,
       "rope interleaved, partial");
  with({{heads, RotaryQK{rope.with_xpos(64.0, 40.0)}, {}}}, true, "xpos");
  RopeScaling yarn;
  yarn.type = RopeType::kYarn;
  yarn.factor = 4.0;
  yarn.original_max_position_embeddings = 32;
  with({{heads, RotaryQK{RopeParams(dim, dim, 10000.0, RopeLayout::kHalfSplit, yarn, 128)}, {}}}, false, "rope yarn");
  with({{heads, RotaryQK{rope, true}, {}}}, true, "rope, keys already rotated");
  with({{heads, AbsoluteQK{SinusoidalParams(dim)}, {}}}, true, "shortformer");
  with({{heads, {}, AlibiParams(heads)}}, true, "alibi");
  with({{heads, {}, AlibiParams(heads, AlibiForm::kSymmetric)}}, false, "alibi symmetric");
  std::vector<double> t5_table(static_cast<std::size_t>(32 * heads));
  for (auto& x : t5_table) x = uniform(-2, 2);
  with({{heads, {}, T5BiasParams(heads, 32, 128, true, t5_table)}}, false, "t5");
  with({{heads, {}, KerpleParams(KerpleForm::kLog, {1.5, 0.5, 2.0, 1.0}, {1.0, 2.0, 0.5, 1.5})}}, true, "kerple log");
  with({{heads, {}, FireParams::init(heads, 16, 3)}}, true, "fire");
  // Keys on both sides of each query: FIRE's row walk goes down its pieces, then up again.
  with({{heads, {}, FireParams::init(heads, 16, 3, 0.5, 8.0)}}, false, "fire, keys on both sides");
  with({{heads, {}, tupe_with_cls(heads, dim, 32, 200, 4)}}, false, "tupe");
  with({{heads, {}, TupeParams::init(heads, dim, 32, 200, false, 0.5, 5)}}, true, "tupe without the [CLS] reset");
  const ShawParams shaw = ShawParams::init(6, dim, 0.5, 11);
  with({{heads, {}, {}, shaw}}, true, "shaw");
  with({{2, RotaryQK{rope}, AlibiParams(2), shaw}, {2, {}, {}, ShawParams::init(3, dim, 0.5, 12)}}, false,
       "shaw with rope + alibi, and another shaw width");
  // Transformer-XL: u, v of magnitude ~0.5 so that every term moves the logits.
  with({{heads, {}, {}, {}, XlParams::init(heads, dim, 40, 0.5, 21)}}, true, "transformer-xl");
  with({{heads, {}, {}, {}, XlParams::init(heads, dim, 32, 0.5, 22)}}, false, "transformer-xl, keys on both sides");
  // d_model past one depth step (256) of the table products (blocked_gemm), and not a multiple of
  // the lane padding.
  with({{heads, {}, {}, {}, XlParams::init(heads, dim, 300, 0.5, 27)}}, true, "transformer-xl, d_model 300");
  with({{heads, {}, TupeParams::init(heads, dim, 300, 200, false, 0.5, 6)}}, true, "tupe, d_model 300");
  // One head of a KV group XL, the other ALiBi (XL transforms nothing, so it may split a group).
  with({{1, {}, {}, {}, XlParams::init(1, dim, 16, 0.5, 23)},
        {1, {}, AlibiParams(1)},
        {2, {}, {}, {}, XlParams::init(2, dim, 16, 0.5, 24)}},
       true, "xl | alibi | xl");
  // Half the heads RoPE, half ALiBi (KV group boundaries: 2 heads per KV head).
  with({{2, RotaryQK{rope}, {}}, {2, {}, AlibiParams(2)}}, true, "rope + alibi by head group");
  with({{1, {}, AlibiParams(1)},
        {1, {}, NoPE(1)},
        {2, RotaryQK{rope}, T5BiasParams(2, 16, 64, false, std::vector<double>(32, 0.25))}},
       true, "alibi | nope | rope + t5");
}

TEST_P(AttentionForward, PackedSequencesAndExplicitPositions) {
  Problem p = make_packed({{5, 5}, {0, 3}, {33, 40}, {17, 17}, {1, 9}}, 4, 1, 48);
  AttentionSpec spec = spec_of(p);
  spec.mask.causal = true;
  expect_accurate(p, spec, "packed causal");
  spec.groups = {{4, RotaryQK{RopeParams(48, 48)}, AlibiParams(4)}};
  expect_accurate(p, spec, "packed rope + alibi");
  // Arbitrary, far-apart positions (tables by token, bias evaluated per element).
  Problem d = make_problem(1, 20, 40, 2, 2, 32);
  std::vector<std::int64_t> q_ids(20), k_ids(40);
  for (auto& x : q_ids) x = uniform_int(0, std::int64_t{1} << 30);
  for (auto& x : k_ids) x = uniform_int(0, std::int64_t{1} << 30);
  AttentionSpec s2 = spec_of(d);
  s2.q_positions = Positions::ids(q_ids);
  s2.k_positions = Positions::ids(k_ids);
  s2.groups = {{2, RotaryQK{RopeParams(32, 32)}, AlibiParams(2, AlibiForm::kSymmetric)}};
  expect_accurate(d, s2, "scattered positions");
  // XL over explicit positions with gaps (its P(δ) table spans their differences).
  Problem x = make_problem(2, 30, 50, 2, 1, 32);
  std::vector<std::int64_t> xq(60), xk(100);
  for (auto& v : xq) v = uniform_int(0, 300);
  for (auto& v : xk) v = uniform_int(0, 300);
  AttentionSpec s3 = spec_of(x);
  s3.q_positions = Positions::ids(xq, 2, 30);
  s3.k_positions = Positions::ids(xk, 2, 50);
  s3.groups = {{2, {}, {}, {}, XlParams::init(2, 32, 16, 0.5, 25)}};
  expect_accurate(x, s3, "xl, explicit positions");
  Problem xp = make_packed({{5, 9}, {40, 40}, {1, 7}}, 2, 2, 32);
  AttentionSpec s4 = spec_of(xp);
  s4.mask.causal = true;
  s4.groups = {{2, {}, {}, {}, XlParams::init(2, 32, 24, 0.5, 26)}};
  expect_accurate(xp, s4, "xl, packed");
}

TEST_P(AttentionForward, DecodeSplitsLongCachesExactly) {
  // 1 and 2 queries × 4 heads over 1 KV head: dot-product scores; 9000 keys: two chunks (of
  // 8192 keys: 4 MiB of 512-byte keys and values).
  for (const std::int64_t q_len : {1, 2}) {
    Problem p = make_problem(1, q_len, 9000, 4, 1, 64);
    AttentionSpec spec = spec_of(p);
    spec.mask.causal = true;
    expect_accurate(p, spec, "decode");
    spec.groups = {{4, RotaryQK{RopeParams(64, 64)}, AlibiParams(4)}};
    expect_accurate(p, spec, "decode rope + alibi");
    spec.groups = {{4, {}, {}, ShawParams::init(16, 64, 0.5, 5)}};
    expect_accurate(p, spec, "decode shaw");
    spec.groups = {{4, {}, {}, {}, XlParams::init(4, 64, 32, 0.5, 6)}};
    expect_accurate(p, spec, "decode xl");
    spec.groups = {{4, {}, tupe_with_cls(4, 64, 16, 9000, 7)}};
    expect_accurate(p, spec, "decode tupe");
  }
}

TEST_P(AttentionForward, DecodeSizesTilesAndChunksByBytes) {
  // Wide caches get shorter key tiles (about 256 KiB of keys per tile) and shorter parallel
  // chunks (about 4 MiB of keys and values): 16 KV heads × D 128 in f32 take tiles of 32 keys
  // and chunks of 256 (700 keys: 3 chunks, the last partial); 32 KV heads tiles of 16 and chunks
  // of 128 (6 chunks); bf16 is counted as f32 (the same tiles and chunks as the f32 cache of its
  // values: DecodeReadsSixteenBitCachesAsTheirF32Values). Accurate, and the same bits for 1, 2
  // and 3 threads.
  struct Shape {
    std::int64_t heads, kv_heads, q_len;
    DType dtype;
  };
  for (const Shape& sh : {Shape{16, 16, 1, DType::kF32}, Shape{32, 32, 1, DType::kF32}, Shape{16, 16, 1, DType::kBF16},
                          Shape{16, 16, 4, DType::kF32}, Shape{32, 8, 2, DType::kF32}}) {
    const std::string what = std::to_string(sh.heads) + "/" + std::to_string(sh.kv_heads) + " heads, " +
                             std::to_string(sh.q_len) + " queries, " + std::string(dtype_name(sh.dtype));
    const Problem p = make_problem(1, sh.q_len, 700, sh.heads, sh.kv_heads, 128, sh.dtype);
    AttentionSpec spec = spec_of(p);
    spec.mask.causal = true;
    spec.groups = {{sh.heads, RotaryQK{RopeParams(128, 128)}, {}}};
    expect_accurate(p, spec, what);
    const Attention att(spec);
    std::vector<Outputs> runs;
    for (const int threads : {1, 2, 3}) {
      set_num_threads(threads);
      runs.push_back(run_forward(p, att, 0));
    }
    set_num_threads(2);
    for (std::size_t r = 1; r < runs.size(); ++r) {
      EXPECT_EQ(runs[r].out, runs[0].out) << what;
      EXPECT_EQ(runs[r].lse, runs[0].lse) << what;
    }
  }
}

TEST_P(AttentionForward, DecodeRunsEveryKvHeadAsOneBlock) {
  // Decode lays every KV head's rows side by side in one score tile (head g's rows at lanes g·R …):
  // a scheme that differs from head to head, masks, the soft-cap and key lengths must each reach
  // their own lanes. 4 KV heads; 2 rows (1 query × 2 heads, 2 queries × 1 head) or 4 rows per KV
  // head; 700 keys (tiles and a partial block), 9000 (three chunks).
  for (const auto& [q_len, heads, k_len] :
       std::vector<std::array<std::int64_t, 3>>{{1, 8, 700}, {2, 4, 700}, {1, 16, 9000}}) {
    const std::int64_t dim = 64;
    Problem p = make_problem(k_len > 1000 ? 1 : 2, q_len, k_len, heads, 4, dim);
    const std::string shape =
        std::to_string(q_len) + " × " + std::to_string(heads) + " heads, " + std::to_string(k_len) + " keys: ";
    const auto with = [&](std::vector<HeadGroup> groups, const std::string& what,
                          const std::function<void(AttentionMask&)>& mask) {
      AttentionSpec spec = spec_of(p);
      spec.groups = std::move(groups);
      spec.mask.causal = true;
      mask(spec.mask);
      expect_accurate(p, spec, shape + what);
    };
    const auto causal = [](AttentionMask&) {};
    const std::int64_t half = heads / 2, quarter = heads / 4;
    std::vector<double> t5_table(static_cast<std::size_t>(32 * quarter));
    for (auto& x : t5_table) x = uniform(-2, 2);
    std::vector<double> r1(static_cast<std::size_t>(quarter)), r2(r1.size());
    for (std::size_t i = 0; i < r1.size(); ++i) {
      r1[i] = uniform(0.5, 2.0);
      r2[i] = uniform(0.5, 2.0);
    }
    with({{heads, {}, AlibiParams(heads)}}, "alibi", causal);
    // Four schemes, a quarter of the heads each: KV head g's rows carry scheme g.
    with({{quarter, RotaryQK{RopeParams(dim, dim)}, {}},
          {quarter, {}, AlibiParams(quarter)},
          {quarter, {}, T5BiasParams(quarter, 32, 128, true, t5_table)},
          {quarter, {}, KerpleParams(KerpleForm::kLog, r1, r2)}},
         "rope | alibi | t5 | kerple", causal);
    with({{half, {}, FireParams::init(half, 16, 3)}, {half, RotaryQK{RopeParams(dim, dim)}, AlibiParams(half)}},
         "fire | rope + alibi", causal);
    with({{heads, {}, AlibiParams(heads)}}, "alibi, window 37, soft-cap 5", [](AttentionMask& m) {
      m.window_left = 37;
      m.softcap = 5.0;
    });
    with({{heads, RotaryQK{RopeParams(dim, dim)}, {}}}, "rope, key lengths", [&](AttentionMask& m) {
      m.causal = false;
      m.key_lengths = {k_len / 3, k_len - 1};
      m.key_lengths.resize(static_cast<std::size_t>(p.batch));
    });
  }
}

// Prefill units of a group of 4 or 2 query blocks (forward_blocks) load each key tile once for the
// group. A group of n is formed when the blocks number at least 8·n per thread, so one thread runs
// the square problem (32 blocks of 128 queries) in groups of 4, two threads in pairs, and 64
// threads one block at a time; the results must agree bit for bit, and be accurate where grouped.
TEST_P(AttentionForward, GroupedBlocksKeepTheBitsOfSingleBlocks) {
  if (GetParam() == "ref") GTEST_SKIP() << "the fused kernels only (the reference has no blocks)";
  const auto expect_same_bits = [](const Problem& p, const AttentionSpec& spec, const std::string& what) {
    SCOPED_TRACE(what);
    const Attention att(spec);
    set_num_threads(64);
    const Outputs single = run_forward(p, att, 0);
    const AttentionStats single_tiles = single.stats;
    for (const int threads : {1, 2}) {
      set_num_threads(threads);
      const Outputs grouped = run_forward(p, att, 0);
      EXPECT_EQ(grouped.out, single.out) << threads << " threads";
      EXPECT_EQ(grouped.lse, single.lse) << threads << " threads";
      // The far-tile skip decides per block, grouped or not.
      EXPECT_EQ(grouped.stats.tiles, single_tiles.tiles) << threads << " threads";
      EXPECT_EQ(grouped.stats.skipped, single_tiles.skipped) << threads << " threads";
    }
    set_num_threads(2);
    return single_tiles.skipped;
  };
  const std::int64_t dim = 32;
  // 8 KV heads × 4 blocks of 128 queries; then queries ending a longer run of keys (the blocks'
  // last tiles partial, the second block's reaching further), GQA (G = 2, blocks of 64 queries,
  // an odd last block), and packed sequences.
  Problem square = make_problem(1, 512, 512, 8, 8, dim);
  Problem longer_keys = make_problem(1, 300, 517, 8, 8, dim);
  Problem grouped = make_problem(2, 230, 230, 8, 4, dim);
  Problem packed = make_packed({{300, 300}, {70, 90}, {260, 333}, {1, 5}}, 8, 8, dim);
  for (const Problem* p : {&square, &longer_keys, &grouped, &packed}) {
    AttentionSpec spec = spec_of(*p);
    spec.mask.causal = true;
    expect_same_bits(*p, spec, "causal");
    spec.mask.causal = false;
    expect_same_bits(*p, spec, "bidirectional");
    // Windows start each block's keys apart: such pairs run their blocks one at a time.
    spec.mask.causal = true;
    spec.mask.window_left = 100;
    expect_same_bits(*p, spec, "sliding window");
  }
  set_num_threads(1);
  AttentionSpec spec = spec_of(longer_keys);
  spec.mask.causal = true;
  expect_accurate(longer_keys, spec, "grouped, longer keys");
  spec = spec_of(grouped);
  spec.mask.causal = true;
  expect_accurate(grouped, spec, "grouped blocks, GQA");
  set_num_threads(2);
  // Every kind of scheme; ALiBi's steep slopes run the tiles from the diagonal down and skip far
  // ones (the last head has none, so its KV head's blocks skip nothing).
  const RopeParams rope(dim, dim);
  const std::vector<double> steep = {4.0, 2.0, 1.0, 0.5, 4.0, 2.0, 1.0, 0.0};
  spec = spec_of(square);
  spec.mask.causal = true;
  spec.groups = {{8, {}, AlibiParams(steep)}};
  EXPECT_GT(expect_same_bits(square, spec, "alibi, steep"), 0);
  spec.groups = {{8, RotaryQK{rope}, AlibiParams(steep)}};
  EXPECT_GT(expect_same_bits(square, spec, "rope + alibi, steep"), 0);
  spec.mask.causal = false;
  spec.groups = {{8, {}, AlibiParams(steep, AlibiForm::kSymmetric)}};
  EXPECT_GT(expect_same_bits(square, spec, "alibi symmetric, steep"), 0);
  std::vector<double> t5_table(static_cast<std::size_t>(32 * 8));
  for (auto& x : t5_table) x = uniform(-2, 2);
  const std::vector<std::pair<std::vector<HeadGroup>, std::string>> schemes = {
      {{{8, RotaryQK{rope}, {}}}, "rope"},
      {{{8, {}, T5BiasParams(8, 32, 128, true, t5_table)}}, "t5"},
      {{{8, {}, FireParams::init(8, 16, 3)}}, "fire"},
      {{{8, {}, {}, ShawParams::init(6, dim, 0.5, 11)}}, "shaw"},
      {{{8, {}, {}, {}, XlParams::init(8, dim, 24, 0.5, 21)}}, "transformer-xl"},
      {{{8, {}, tupe_with_cls(8, dim, 16, 600, 4)}}, "tupe"},
      {{{4, AbsoluteQK{SinusoidalParams(dim)}, {}}, {4, RotaryQK{rope}, {}}}, "shortformer | rope"}};
  for (const auto& [groups, what] : schemes) {
    spec = spec_of(longer_keys);
    spec.mask.causal = true;
    spec.groups = groups;
    expect_same_bits(longer_keys, spec, what);
  }
}

// The plan of `spec` with the vanishing-tile skip on, then off.
std::pair<Attention, Attention> with_and_without_skip(AttentionSpec spec) {
  Attention skipping(spec);
  spec.skip_vanishing_tiles = false;
  return {std::move(skipping), Attention(spec)};
}

// Steep slopes make keys vanish within a few tiles (a bias of −100 at 25 to 100 keys); the last
// head has no ALiBi, so its KV head's blocks never skip.
const std::vector<double> kSteepSlopes = {4.0, 2.0, 1.0, 0.0};

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

// ALiBi with steep slopes: far key tiles vanish and are skipped. Skipping must change no bit
// (against the same plan with skipping off, which runs the tiles in the same order) and must
// happen; the result stays as accurate as ever.
TEST_P(AttentionForward, VanishingFarTilesAreSkippedWithoutChangingABit) {
  if (GetParam() == "ref") GTEST_SKIP() << "the fused kernels only (the reference runs every pair)";
  const std::vector<double> steep = kSteepSlopes;
  const std::vector<VanishingCase> cases = {
      {"causal", 330, 330, true, -1, {{4, {}, AlibiParams(steep)}}},
      {"causal, queries at the end of longer keys", 150, 470, true, -1, {{4, {}, AlibiParams(steep)}}},
      {"rope + alibi", 300, 300, true, -1, {{4, RotaryQK{RopeParams(64, 64)}, AlibiParams(steep)}}},
      {"bidirectional, symmetric", 300, 300, false, -1, {{4, {}, AlibiParams(steep, AlibiForm::kSymmetric)}}},
      {"sliding window", 330, 330, true, 200, {{4, {}, AlibiParams(steep)}}},
      {"large logits", 330, 330, true, -1, {{4, {}, AlibiParams(steep)}}, true, 4.0},
      {"paper slopes, short", 130, 130, true, -1, {{4, {}, AlibiParams(4)}}, false},
  };
  for (const VanishingCase& c : cases) {
    SCOPED_TRACE(c.what);
    const Problem p = c.problem();
    const AttentionSpec spec = c.spec(p);
    const auto [skipping, running] = with_and_without_skip(spec);
    const Outputs a = run_forward(p, skipping, 0), b = run_forward(p, running, 0);
    EXPECT_EQ(b.stats.skipped, 0);
    EXPECT_EQ(a.stats.tiles, b.stats.tiles);
    if (c.skips) {
      EXPECT_GT(a.stats.skipped, 0);
    }
    ASSERT_EQ(a.out.size(), b.out.size());
    for (std::size_t i = 0; i < a.out.size(); ++i) {
      ASSERT_EQ(std::bit_cast<std::uint64_t>(a.out[i]), std::bit_cast<std::uint64_t>(b.out[i])) << "out " << i;
    }
    for (std::size_t i = 0; i < a.lse.size(); ++i) {
      ASSERT_EQ(std::bit_cast<std::uint64_t>(a.lse[i]), std::bit_cast<std::uint64_t>(b.lse[i])) << "lse " << i;
    }
    expect_accurate(p, spec, c.what);
  }
}

// A tile may be skipped only if every probability in it is below FLT_MIN. Far keys here align
// with the queries (q·k·scale = 32, more than the near keys' 0) and carry values of 1e30, so any
// probability of 1e-37 or more that a skip dropped would show in the output: the last far tile
// has logits up to 32 − 103 = −71 against a max of 0, so it must run (bounding q·k by 0 instead
// of |q|·|k| would skip it); the tiles behind it vanish and must be skipped.
Problem aligned_far_keys() {
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
AttentionSpec aligned_far_keys_spec(const Problem& p) {
  AttentionSpec spec = spec_of(p);
  spec.mask.causal = true;
  spec.groups = {{1, {}, AlibiParams(std::vector<double>{1.0})}};
  return spec;
}

// On aligned_far_keys: skipping must change no bit and must happen.
TEST_P(AttentionForward, SkippedTilesHoldOnlyFlushedProbabilities) {
  if (GetParam() == "ref") GTEST_SKIP() << "the fused kernels only";
  const Problem p = aligned_far_keys();
  const auto [skipping, running] = with_and_without_skip(aligned_far_keys_spec(p));
  const Outputs a = run_forward(p, skipping, 0), b = run_forward(p, running, 0);
  EXPECT_GT(a.stats.skipped, 0);
  for (std::size_t i = 0; i < a.out.size(); ++i) {
    ASSERT_EQ(std::bit_cast<std::uint64_t>(a.out[i]), std::bit_cast<std::uint64_t>(b.out[i])) << "out " << i;
  }
  // A NaN in a key of an otherwise vanishing tile: its norm fails the bound, the tile runs, and
  // both plans give the same bits (NaN outputs where the target's max lets the NaN through, as
  // the SIMD targets do: there a skipped tile would show).
  Problem nan_key = aligned_far_keys();
  nan_key.k[5 * 64 + 3] = std::numeric_limits<double>::quiet_NaN();
  nan_key.kb = testing::to_dtype(nan_key.k, nan_key.dtype);
  const auto [skipping_nan, running_nan] = with_and_without_skip(aligned_far_keys_spec(nan_key));
  const Outputs c = run_forward(nan_key, skipping_nan, 0), e = run_forward(nan_key, running_nan, 0);
  for (std::size_t i = 0; i < c.out.size(); ++i) {
    ASSERT_EQ(std::bit_cast<std::uint64_t>(c.out[i]), std::bit_cast<std::uint64_t>(e.out[i])) << "out " << i;
  }
}

TEST_P(AttentionForward, DecodeAcrossRowsHeadsAndTails) {
  // The decode kernels block keys by the number of query rows per KV head (1 … 8) and sweep
  // every KV head per block: rows, KV heads, key counts that leave partial blocks and tiles, head
  // dims with a remainder of the lane count, head-major (strided) caches and 16-bit inputs.
  for (int trial = 0; trial < 8; ++trial) {
    const std::int64_t kv = std::vector<std::int64_t>{1, 2, 3, 8}[static_cast<std::size_t>(uniform_int(0, 3))];
    const std::int64_t group = uniform_int(1, 8), q_len = uniform_int(1, 8 / group);
    const std::int64_t dim = std::vector<std::int64_t>{24, 64, 80, 128}[static_cast<std::size_t>(trial % 4)];
    const std::int64_t k_len = q_len + uniform_int(0, trial == 7 ? 9000 : 300);
    const DType dt = trial % 3 == 2 ? DType::kBF16 : DType::kF32;
    Problem p = make_problem(uniform_int(1, 2), q_len, k_len, kv * group, kv, dim, dt, trial % 2 == 1);
    AttentionSpec spec = spec_of(p);
    spec.mask.causal = trial % 2 == 0;
    expect_accurate(p, spec,
                    "decode, " + std::to_string(group * q_len) + " rows per KV head, " + std::to_string(kv) +
                        " KV heads, D " + std::to_string(dim) + ", " + std::to_string(k_len) + " keys");
  }
}

TEST_P(AttentionForward, DecodeReadsSixteenBitCachesAsTheirF32Values) {
  // Decode reads bf16 and f16 caches where they lie, widening each vector exactly to f32 (on
  // targets with those widenings; elsewhere, and at dims whose rows leave a partial vector, the
  // engine widens each tile into f32 scratch). Either way the arithmetic must be that of an f32
  // cache holding the same values: lse equal to the bit, and the 16-bit output equal to the f32
  // output rounded once to the dtype. Rows per KV head 1 to 8 (5, 6 and 7 leave accumulators of
  // the packed scores idle; on SSE4's 4 lanes they take the widening path), dims that fill whole
  // vectors and one that does not (72), GQA, and a cache long enough to be split into chunks.
  struct Shape {
    std::int64_t q_len, heads, kv_heads, dim, k_len;
  };
  const Shape shapes[] = {{1, 8, 2, 64, 300},   {1, 16, 4, 128, 9000}, {1, 4, 4, 80, 517},
                          {2, 8, 2, 64, 131},   {1, 32, 4, 128, 700},  {1, 6, 2, 72, 250},
                          {1, 28, 4, 128, 600}, {1, 10, 2, 64, 333},   {2, 6, 2, 80, 190}};
  for (const DType dt : {DType::kBF16, DType::kF16}) {
    for (const Shape& sh : shapes) {
      const std::string what = std::string(dtype_name(dt)) + ", " + std::to_string(sh.q_len * sh.heads / sh.kv_heads) +
                               " rows per KV head, D " + std::to_string(sh.dim) + ", " + std::to_string(sh.k_len) +
                               " keys";
      SCOPED_TRACE(what);
      const Problem p16 = make_problem(1, sh.q_len, sh.k_len, sh.heads, sh.kv_heads, sh.dim, dt);
      Problem p32 = p16;
      p32.dtype = DType::kF32;
      p32.qb = testing::to_dtype(p16.q, DType::kF32);
      p32.kb = testing::to_dtype(p16.k, DType::kF32);
      p32.vb = testing::to_dtype(p16.v, DType::kF32);
      AttentionSpec spec16 = spec_of(p16), spec32 = spec_of(p32);
      spec16.mask.causal = spec32.mask.causal = true;
      spec16.groups = spec32.groups = {{sh.heads, {}, AlibiParams(sh.heads)}};
      const Outputs o16 = run_forward(p16, Attention(spec16), 0), o32 = run_forward(p32, Attention(spec32), 0);
      for (std::size_t i = 0; i < o32.lse.size(); ++i) ASSERT_EQ(o16.lse[i], o32.lse[i]) << "lse " << i;
      for (std::size_t i = 0; i < o32.out.size(); ++i)
        ASSERT_EQ(o16.out[i], testing::round_to(o32.out[i], dt)) << "out " << i;
      expect_accurate(p16, spec16, what);
    }
  }
}

TEST_P(AttentionForward, DecodeRotatesAnUnrotatedCacheTileByTile) {
  // One RoPE over every head with the cache stored un-rotated. Decode rotates the keys inside the
  // scores where the pairs fill whole vectors and the packed scores apply (D 128, full or partial
  // rotary), else while widening each tile into scratch (attn_pack_rotate_heads): in registers
  // when the pairs fill vectors (D 72 with 64 rotated: the rows do not fill them), row by row
  // otherwise (D 80: 40 pairs, on AVX-512). Interleaved pairs are rotated inside the scores
  // when the rotated dims fill whole vectors (D 128, rotary 128 or 64; D 80 with 80), else row by
  // row (D 72 with 64 rotated on AVX-512, whose rows do not fill 16-lane vectors; AVX2 and SSE4
  // rotate it in the scores). f32, bf16 and f16, caches long enough to be split.
  struct Shape {
    std::int64_t heads, kv_heads, dim, rotary_dim, k_len;
    DType dtype;
    RopeLayout layout = RopeLayout::kHalfSplit;
  };
  constexpr RopeLayout kInterleaved = RopeLayout::kInterleaved;
  const Shape shapes[] = {{8, 2, 128, 128, 700, DType::kF32},
                          {8, 2, 128, 64, 5000, DType::kF32},
                          {4, 4, 80, 80, 333, DType::kF32},
                          {8, 2, 128, 128, 9000, DType::kBF16},
                          {8, 2, 128, 64, 517, DType::kF16},
                          {6, 2, 80, 80, 250, DType::kBF16},
                          {8, 2, 72, 64, 400, DType::kF32},
                          {8, 2, 72, 64, 300, DType::kBF16},
                          {8, 2, 128, 128, 9000, DType::kF32, kInterleaved},
                          {8, 2, 128, 64, 517, DType::kBF16, kInterleaved},
                          {6, 2, 80, 80, 250, DType::kF16, kInterleaved},
                          {4, 4, 80, 80, 333, DType::kF32, kInterleaved},
                          {8, 2, 72, 64, 300, DType::kF32, kInterleaved}};
  for (const Shape& sh : shapes) {
    const std::string what = std::string(dtype_name(sh.dtype)) + ", D " + std::to_string(sh.dim) + ", rotary " +
                             std::to_string(sh.rotary_dim) + ", " + std::to_string(sh.k_len) + " keys" +
                             (sh.layout == kInterleaved ? ", interleaved" : "");
    const Problem p = make_problem(1, 1, sh.k_len, sh.heads, sh.kv_heads, sh.dim, sh.dtype);
    AttentionSpec spec = spec_of(p);
    spec.mask.causal = true;
    spec.groups = {{sh.heads, RotaryQK{RopeParams(sh.dim, sh.rotary_dim, 10000.0, sh.layout)}, {}}};
    expect_accurate(p, spec, what);
  }
}

TEST_P(AttentionForward, DecodeAddsEveryHeadsTableBiasAsOneRow) {
  // One query per sequence and every head tabulated (ALiBi and T5 groups here): decode adds each
  // key's biases for all heads as one row of a [δ][head] table. A packed spec (cu_seqlens) of the
  // same single sequence adds them lane by lane; both must agree to the bit, and with the fp64
  // reference. Caches long enough to be split, GQA with groups that straddle KV heads.
  for (const std::int64_t k_len : {std::int64_t{77}, std::int64_t{700}, std::int64_t{9000}}) {
    SCOPED_TRACE(std::to_string(k_len) + " keys");
    const Problem p = make_problem(1, 1, k_len, 12, 4, 64);
    AttentionSpec spec = spec_of(p);
    spec.mask.causal = true;
    std::vector<double> t5_table(32 * 6);
    for (std::size_t i = 0; i < t5_table.size(); ++i) t5_table[i] = 0.05 * static_cast<double>(i % 17) - 0.3;
    spec.groups = {{6, {}, AlibiParams(6)}, {6, {}, T5BiasParams(6, 32, 128, false, t5_table)}};
    expect_accurate(p, spec, "ALiBi and T5");
    Problem packed = p;
    packed.cu_q = {0, 1};
    packed.cu_k = {0, k_len};
    AttentionSpec packed_spec = spec_of(packed);
    packed_spec.mask = spec.mask;
    packed_spec.groups = spec.groups;
    const Outputs one_row = run_forward(p, Attention(spec), 0),
                  lane_by_lane = run_forward(packed, Attention(packed_spec), 0);
    for (std::size_t i = 0; i < one_row.out.size(); ++i) ASSERT_EQ(one_row.out[i], lane_by_lane.out[i]) << "out " << i;
    for (std::size_t i = 0; i < one_row.lse.size(); ++i) ASSERT_EQ(one_row.lse[i], lane_by_lane.lse[i]) << "lse " << i;
  }
}

TEST_P(AttentionForward, SixteenBitInputs) {
  for (const DType dt : {DType::kBF16, DType::kF16}) {
    Problem p = make_problem(1, 45, 61, 2, 1, 80, dt, true);
    AttentionSpec spec = spec_of(p);
    spec.mask.causal = true;
    spec.groups = {{2, RotaryQK{RopeParams(80, 80)}, {}}};
    expect_accurate(p, spec, std::string(dtype_name(dt)));
  }
}

INSTANTIATE_TEST_SUITE_P(Targets, AttentionForward, ::testing::ValuesIn(testing::all_targets()));

// ─── The matrix kernel ───────────────────────────────────────────────────────────────────────
// attn_gemm splits deep products into passes over blocks of the depth (so that B's column strip
// stays in L1), storing C between passes. Every element must still be one chain of multiply-adds
// in t order, from C (accumulate) or from 0: the engine's bit-for-bit claims (thread counts,
// grouped blocks, skipped tiles) rest on it. The chain is fused on targets with FMA (AVX2,
// AVX-512) and a multiply then an add elsewhere (SSE4, scalar); the whole result must equal one
// of the two folds exactly. Depths straddle the pass sizes (128 on AVX-512 and AVX2, 256 on SSE4,
// 1024 on scalar); depth 0 must still set C to 0 when not accumulating.
class AttentionMatrixKernel : public EveryTarget {};

// One random problem of the matrix kernel: A(m, t) at m·a_row + t·a_depth (rows or columns
// contiguous, with a gap), B and C with padding, C's entries in [−c_range, c_range]; and the two
// results the kernel may give in `mode`, element by element: its multiply-adds in t order fused,
// or each product rounded on its own then added. kSet starts each chain from 0, kChain from C,
// kAddSum sums from 0 and adds the sum to C once (attn_gemm_add).
enum class GemmMode { kSet, kChain, kAddSum };
struct GemmCase {
  std::int64_t rows, cols, depth, a_row, a_depth, ldb, ldc;
  std::vector<float> a, b, c, fused, unfused;
  GemmCase(std::int64_t depth_, bool transposed_a, GemmMode mode, double c_range)
      : rows(uniform_int(1, 23)),
        cols(kernels::kAttnAlign * uniform_int(1, 6)),
        depth(depth_),
        a_row(transposed_a ? 1 : depth_ + 3),
        a_depth(transposed_a ? rows + 5 : 1),
        ldb(cols + 16),
        ldc(cols + 32) {
    a.resize(static_cast<std::size_t>(rows * a_row + depth * a_depth));
    b.resize(static_cast<std::size_t>(depth * ldb));
    c.resize(static_cast<std::size_t>(rows * ldc));
    for (auto& x : a) x = static_cast<float>(uniform(-1, 1));
    for (auto& x : b) x = static_cast<float>(uniform(-1, 1));
    for (auto& x : c) x = static_cast<float>(uniform(-c_range, c_range));
    fused = unfused = c;
    for (std::int64_t m = 0; m < rows; ++m) {
      for (std::int64_t n = 0; n < cols; ++n) {
        const auto at = static_cast<std::size_t>(m * ldc + n);
        float f = mode == GemmMode::kChain ? c[at] : 0.0f, u = f;
        for (std::int64_t t = 0; t < depth; ++t) {
          const float x = a[static_cast<std::size_t>(m * a_row + t * a_depth)],
                      y = b[static_cast<std::size_t>(t * ldb + n)];
          f = std::fma(x, y, f);
          // The product rounded on its own (exact in double, then one rounding to float), so that no
          // compiler setting can contract it with the add.
          const auto product = static_cast<float>(static_cast<double>(x) * y);
          u = product + u;
        }
        fused[at] = mode == GemmMode::kAddSum ? c[at] + f : f;
        unfused[at] = mode == GemmMode::kAddSum ? c[at] + u : u;
      }
    }
  }
  std::string describe() const {
    return "rows " + std::to_string(rows) + " cols " + std::to_string(cols) + " depth " + std::to_string(depth) +
           (a_row == 1 ? " A transposed" : "");
  }
  // The kernel's C equals one of the two folds, to the bit.
  bool matches(const std::vector<float>& out) const {
    return std::memcmp(out.data(), fused.data(), out.size() * sizeof(float)) == 0 ||
           std::memcmp(out.data(), unfused.data(), out.size() * sizeof(float)) == 0;
  }
};

TEST_P(AttentionMatrixKernel, EachElementIsOneChainInDepthOrder) {
  for (int trial = 0; trial < 36; ++trial) {
    const std::int64_t depth = std::vector<std::int64_t>{
        0, 1, 7, 127, 128, 129, 255, 256, 257, 1000, 1025, 2100}[static_cast<std::size_t>(trial % 12)];
    const bool accumulate = trial % 3 != 0;
    const GemmCase g(depth, trial % 2 == 1, accumulate ? GemmMode::kChain : GemmMode::kSet, 1.0);
    SCOPED_TRACE(g.describe() + (accumulate ? " accumulate" : ""));
    std::vector<float> out = g.c;
    kernels::attn_gemm(g.a.data(), g.a_row, g.a_depth, g.b.data(), g.ldb, out.data(), g.ldc, g.rows, g.cols, depth,
                       accumulate);
    EXPECT_TRUE(g.matches(out));
  }
}

// attn_gemm_add: C + (one chain from 0 in t order), added once; depths up to kAttnGemmAddDepth
// (one pass on every target), beyond that an Error naming the depth.
TEST_P(AttentionMatrixKernel, AddSumsEachElementFromZeroThenAddsIt) {
  for (int trial = 0; trial < 24; ++trial) {
    const std::int64_t depth =
        std::vector<std::int64_t>{0, 1, 7, 63, 64, 100, 127, 128}[static_cast<std::size_t>(trial % 8)];
    // C large against the sums, so that adding once differs from chaining from C.
    const GemmCase g(depth, trial % 2 == 1, GemmMode::kAddSum, 100.0);
    SCOPED_TRACE(g.describe());
    std::vector<float> out = g.c;
    kernels::attn_gemm_add(g.a.data(), g.a_row, g.a_depth, g.b.data(), g.ldb, out.data(), g.ldc, g.rows, g.cols, depth);
    EXPECT_TRUE(g.matches(out));
  }
  std::vector<float> a(200, 1.0f), b(200 * kernels::kAttnAlign, 1.0f), c(kernels::kAttnAlign, 0.0f);
  expect_error(
      [&] {
        kernels::attn_gemm_add(a.data(), 200, 1, b.data(), kernels::kAttnAlign, c.data(), kernels::kAttnAlign, 1,
                               kernels::kAttnAlign, 129);
      },
      {"attention kernel", "depth", "129", "<= 128"});
}

INSTANTIATE_TEST_SUITE_P(Targets, AttentionMatrixKernel, ::testing::ValuesIn(testing::all_targets()));

// ─── Backward ────────────────────────────────────────────────────────────────────────────────

struct Grads {
  std::vector<double> dq, dk, dv;
  AttentionGradients params;
  AttentionStats stats;  // the fused backward's (zero for the reference)
};

std::vector<double> gather(const Problem& p, const std::vector<double>& raw, std::int64_t seq, std::int64_t h) {
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
Grads run_backward(const Problem& p, const Attention& att, const std::vector<double>& d_out, bool reference,
                   bool with_params = true) {
  const DType dt = reference ? DType::kF64 : p.dtype;
  const std::int64_t rows = p.heads * (p.packed() ? 1 : p.batch) * p.q_len;
  std::vector<unsigned char> out = testing::garbage_buffer(dt, p.q_count());
  std::vector<float> lse(static_cast<std::size_t>(rows));
  TensorView lse_view = p.packed() ? TensorView::of(lse.data(), {p.heads, p.q_len})
                                   : TensorView::of(lse.data(), {p.batch, p.heads, p.q_len});
  TensorView out_view = p.view<true>(out.data(), p.q_len, p.heads, dt);
  if (reference) {
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
  if (reference) {
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

double max_abs(const std::vector<double>& a) {
  double m = 0;
  for (double x : a) m = std::max(m, std::fabs(x));
  return m;
}

// f32 backward against fp64: each gradient element is a sum of up to Sk (or Sq·G) products of
// f32-rounded terms, so its error is ~n·2^-24 of the largest contribution; 2^-13 of the
// gradient's max magnitude covers n up to ~2^10 with the usual √n growth to spare.
void expect_close(const std::vector<double>& got, const std::vector<double>& want, const char* name) {
  const double tol = std::ldexp(1.0, -13) * std::max(max_abs(want), 1e-3);
  EXPECT_LE(max_abs_diff(got, want), tol) << name << " (max |want| " << max_abs(want) << ")";
}

// As expect_close, with the gradient's scale given (for sums that cancel to ~0).
void expect_close_to_scale(const std::vector<double>& got, const std::vector<double>& want, double scale,
                           const char* name) {
  EXPECT_LE(max_abs_diff(got, want), std::ldexp(1.0, -13) * std::max(scale, 1e-3))
      << name << " (scale " << scale << ")";
}

std::vector<double> random_values(std::size_t n) {
  std::vector<double> v(n);
  for (auto& x : v) x = uniform(-1, 1);
  return v;
}

// The fused backward (this target) against the fp64 reference: dq, dk, dv and every scheme's
// parameter gradients.
void expect_backward_matches_reference(const Problem& p, const Attention& att, const std::vector<double>& d_out) {
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
    expect_close(fused.params.groups[g].alibi_slopes, exact.params.groups[g].alibi_slopes, "alibi slopes");
    expect_close(fused.params.groups[g].t5_table, exact.params.groups[g].t5_table, "t5 table");
    expect_close(fused.params.groups[g].kerple_r1, exact.params.groups[g].kerple_r1, "kerple r1");
    expect_close(fused.params.groups[g].kerple_r2, exact.params.groups[g].kerple_r2, "kerple r2");
    if (exact.params.groups[g].fire) {
      const FireGradients &a = *fused.params.groups[g].fire, &b = *exact.params.groups[g].fire;
      expect_close(a.w1, b.w1, "fire w1");
      expect_close(a.b1, b.b1, "fire b1");
      expect_close(a.w2, b.w2, "fire w2");
      // ∂L/∂b2 is Σ dS over whole rows, which softmax makes 0 up to rounding: judge its f32 error
      // against the size of the dS sums that also feed w2 (same terms, O(1) weights).
      expect_close_to_scale(a.b2, b.b2, std::max(max_abs(b.w2), max_abs(b.b1)), "fire b2");
      expect_close({a.c, a.threshold}, {b.c, b.threshold}, "fire c, L");
    }
    expect_close(fused.params.groups[g].shaw_key_table, exact.params.groups[g].shaw_key_table, "shaw key table");
    expect_close(fused.params.groups[g].shaw_value_table, exact.params.groups[g].shaw_value_table, "shaw value table");
    if (exact.params.groups[g].tupe) {
      const TupeGradients &a = *fused.params.groups[g].tupe, &b = *exact.params.groups[g].tupe;
      expect_close(a.table, b.table, "tupe table");
      expect_close(a.u_q, b.u_q, "tupe u_q");
      expect_close(a.u_k, b.u_k, "tupe u_k");
      // θ1's gradient is the [CLS] query's Σ dS over the other keys, which under a causal mask is
      // 0 (that row sees only its own key, so P = 1 and dS = dP − δ = 0) up to f32 rounding: judge
      // both θ against the size of the dS sums that feed U^Q and U^K (same terms, O(1) weights).
      const double theta_scale = std::max({max_abs(b.theta1), max_abs(b.theta2), max_abs(b.u_q), max_abs(b.u_k)});
      expect_close_to_scale(a.theta1, b.theta1, theta_scale, "tupe theta1");
      expect_close_to_scale(a.theta2, b.theta2, theta_scale, "tupe theta2");
    }
    if (exact.params.groups[g].xl) {
      const XlGradients &a = *fused.params.groups[g].xl, &b = *exact.params.groups[g].xl;
      expect_close(a.u, b.u, "xl u");
      expect_close(a.v, b.v, "xl v");
      expect_close(a.w_r, b.w_r, "xl w_r");
    }
  }
}

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
      {{heads, RotaryQK{RopeParams(dim, dim)}, {}, ShawParams::init(5, dim, 0.5, 3)}},
      {{heads, {}, FireParams::init(heads, 8, 5, 0.7, 16.0)}},
      // A KV group whose heads mix Shaw and no Shaw (the per-row paths). The bias head is T5, not
      // ALiBi: one head's slope gradient −Σ dS·δ cancels (every row's dS sums to 0) far below the
      // size of its terms, so a tolerance relative to the gradient cannot judge its f32 error (an
      // ALiBi head here gave 0.0133 with an error of 1.5e-5); T5's table gradient is the same δ
      // histogram without the cancellation. Case 1 checks the slopes (four heads).
      {{1, {}, {}, ShawParams::init(4, dim, 0.5, 7)},
       {1, {}, T5BiasParams(1, 16, 32, false, std::vector<double>(t5_table.begin(), t5_table.begin() + 16))},
       {2, {}, {}, ShawParams::init(2, dim, 0.5, 8)}},
      {{heads, {}, {}, {}, XlParams::init(heads, dim, 24, 0.5, 9)}},
      {{heads, {}, tupe_with_cls(heads, dim, 24, 60, 4)}},
      // TUPE without the [CLS] reset beside ALiBi inside one KV group.
      {{1, {}, TupeParams::init(1, dim, 16, 60, false, 0.5, 5)}, {3, {}, AlibiParams(3)}},
      // XL beside ALiBi inside one KV group.
      {{1, {}, AlibiParams(1)}, {3, {}, {}, {}, XlParams::init(3, dim, 16, 0.5, 10)}},
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
      EXPECT_EQ(grads[c].params.groups[1].alibi_slopes, alone_grads.params.groups[1].alibi_slopes) << "call " << c;
      EXPECT_EQ(grads[c].stats.skipped, alone_grads.stats.skipped) << "call " << c;
    }
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
  EXPECT_NEAR(g.params.groups[0].alibi_slopes[0], (loss(p, slope + h, entry) - loss(p, slope - h, entry)) / (2 * h),
              tol);
  EXPECT_NEAR(g.params.groups[1].t5_table[3], (loss(p, slope, entry + h) - loss(p, slope, entry - h)) / (2 * h), tol);
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
    spec.groups = {{2, {}, {}, ShawParams(k_max, dim, kt, vt)}};
    spec.mask.causal = true;
    const Attention att(spec);
    std::vector<double> out(static_cast<std::size_t>(p.q_count()));
    ref::attention_forward(att, p.view<true>(out.data(), p.q_len, p.heads, DType::kF64), {});
    double l = 0;
    for (std::size_t i = 0; i < out.size(); ++i) l += out[i] * w[i];
    return l;
  };
  AttentionSpec spec = spec_of(p);
  spec.groups = {{2, {}, {}, ShawParams(k_max, dim, key_table, value_table)}};
  spec.mask.causal = true;
  const Attention att(spec);
  const Grads g = run_backward(p, att, w, true);
  // Central differences, h = 1e-5: truncation ~1e-10, cancellation ~1e-11 (as above).
  const double h = 1e-5, tol = 1e-7;
  for (std::size_t e = 0; e < key_table.size(); ++e) {
    std::vector<double> up = key_table, down = key_table;
    up[e] += h;
    down[e] -= h;
    EXPECT_NEAR(g.params.groups[0].shaw_key_table[e], (loss(up, value_table) - loss(down, value_table)) / (2 * h), tol)
        << e;
    up = value_table;
    down = value_table;
    up[e] += h;
    down[e] -= h;
    EXPECT_NEAR(g.params.groups[0].shaw_value_table[e], (loss(key_table, up) - loss(key_table, down)) / (2 * h), tol)
        << e;
  }
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
    spec.groups = {{heads, {}, {}, {}, xl}};
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
  const XlGradients& xg = *g.params.groups[0].xl;
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
  // the other way, its far terms, which do not vanish, had cost 20× the naive f32 error); then T5
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
    EXPECT_EQ(runs[r].params.groups[0].alibi_slopes, runs[0].params.groups[0].alibi_slopes);
    EXPECT_EQ(decodes[r].out, decodes[0].out);
  }
  // Transformer-XL's and TUPE's gradients (tables summed per unit, units in order).
  AttentionSpec xs = spec_of(p);
  xs.mask.causal = true;
  xs.groups = {{2, {}, {}, {}, XlParams::init(2, 64, 32, 0.5, 2)},
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
    EXPECT_EQ(xruns[r].params.groups[0].xl->w_r, xruns[0].params.groups[0].xl->w_r);
    EXPECT_EQ(xruns[r].params.groups[0].xl->u, xruns[0].params.groups[0].xl->u);
    EXPECT_EQ(xruns[r].params.groups[1].tupe->table, xruns[0].params.groups[1].tupe->table);
    EXPECT_EQ(xruns[r].params.groups[1].tupe->u_k, xruns[0].params.groups[1].tupe->u_k);
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
      EXPECT_EQ(a.params.groups[0].alibi_slopes, b.params.groups[0].alibi_slopes);
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
      {{1, {}, {}, ShawParams::init(6, 32, 0.5, 3)},
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
        EXPECT_EQ(runs[r].params.groups[0].shaw_key_table, runs[0].params.groups[0].shaw_key_table);
        EXPECT_EQ(runs[r].params.groups[1].t5_table, runs[0].params.groups[1].t5_table);
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
  s.groups = {{4, {}, {}, ShawParams::init(3, 8)}};
  expect_error([&] { Attention a(s); }, {"groups[0].shaw.head_dim", "8", "16"});
  s.groups = {{4, {}, AlibiParams(4), {}, XlParams::init(4, 16, 8)}};
  expect_error([&] { Attention a(s); }, {"groups[0].xl", "alone"});
  s.groups = {{4, {}, {}, {}, XlParams::init(2, 16, 8)}};
  expect_error([&] { Attention a(s); }, {"groups[0].xl.heads", "2", "4 (the group's heads)"});
  s.groups = {{4,
               {},
               {},
               {},
               XlParams(4, 16, 8, std::vector<double>(64), std::vector<double>(64), std::vector<double>(512), 0.5)}};
  expect_error([&] { Attention a(s); }, {"groups[0].xl.scale", "0.5", "the attention's scale"});
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
  grads.groups[0].tupe->u_q.pop_back();
  std::vector<float> zeros(static_cast<std::size_t>(p.q_count()));
  std::vector<float> l2(32);
  tupe.forward(TensorView::of(out.data(), {1, 8, 4, 16}), TensorView::of(l2.data(), {1, 4, 8}));
  expect_error(
      [&] {
        tupe.backward(TensorView::of(out.data(), {1, 8, 4, 16}), TensorView::of(l2.data(), {1, 4, 8}),
                      TensorView::of(zeros.data(), {1, 8, 4, 16}), {}, {}, {}, &grads);
      },
      {"grads.groups[0].tupe.u_q"});
}

}  // namespace
}  // namespace posenc
