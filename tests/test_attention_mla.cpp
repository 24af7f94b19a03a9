// Multi-head latent attention's shapes (DeepSeek-V2/V3, Kimi K2): values narrower than queries
// and keys. Training: q, k [·, 192] and v [·, 128]; absorbed decode: q, k [·, 576] with one KV head
// shared by every query head, and v the first 512 columns of k's rows (a view of the same cache).
// The fused forward, decode and backward against the fp64 reference on every target, the view
// against a copy, and bad input.
#include <cstdint>
#include <vector>

#include "attention_testing.hpp"
#include "testing.hpp"

namespace posenc {
namespace {

using namespace attention_testing;

// A problem whose values are `dim_v` wide (the shared helpers make v as wide as k).
Problem with_value_dim(Problem p, std::int64_t dim_v) {
  const std::int64_t rows = p.k_count() / p.dim;
  std::vector<double> v(static_cast<std::size_t>(rows * dim_v));
  for (auto& x : v) x = testing::round_to(testing::uniform(-1, 1), p.dtype);
  p.v = v;
  p.vb = testing::to_dtype(v, p.dtype);
  return p;
}

AttentionSpec spec_with_values(const Problem& p, std::int64_t dim_v) {
  AttentionSpec s = spec_of(p);
  std::vector<std::int64_t> shape = p.shape(p.k_len, p.kv_heads), strides = shape;
  shape.back() = dim_v;
  // Contiguous [.., G, Dv] (head-major layouts are not used here).
  std::int64_t stride = 1;
  for (std::size_t i = shape.size(); i-- > 0;) {
    strides[i] = stride;
    stride *= shape[i];
  }
  s.v = ConstTensorView(p.vb.data(), p.dtype, shape, strides);
  return s;
}

// Runs forward into an out of Dv columns; returns out and lse as doubles.
Outputs forward_values(const Problem& p, const Attention& att, std::int64_t dim_v, int mode) {
  const DType dt = mode == 1 ? DType::kF64 : p.dtype;
  const std::int64_t rows = (p.packed() ? 1 : p.batch) * p.q_len * p.heads;
  std::vector<unsigned char> out = testing::garbage_buffer(dt, rows * dim_v);
  std::vector<float> lse(static_cast<std::size_t>(rows));
  const std::vector<std::int64_t> shape = {p.batch, p.q_len, p.heads, dim_v};
  const TensorView out_view = TensorView::contiguous(out.data(), dt, shape);
  const TensorView lse_view = TensorView::of(lse.data(), {p.batch, p.heads, p.q_len});
  if (mode == 0) {
    att.forward(out_view, lse_view);
  } else {
    ref::attention_forward(att, out_view, lse_view, mode == 2);
  }
  Outputs o;
  for (std::int64_t i = 0; i < rows * dim_v; ++i) o.out.push_back(testing::element(out.data(), dt, i));
  o.lse.assign(lse.begin(), lse.end());
  return o;
}

class AttentionMlaTargets : public testing::EveryTarget {};

TEST_P(AttentionMlaTargets, NarrowValuesMatchTheReference) {
  struct Case {
    const char* what;
    std::int64_t batch, q_len, k_len, heads, kv_heads, dim, dim_v;
    DType dtype;
  };
  const Case cases[] = {
      {"DeepSeek training heads, 192 / 128", 1, 70, 70, 4, 4, 192, 128, DType::kF32},
      {"GQA, a value width off the lanes", 2, 40, 40, 4, 2, 48, 20, DType::kF32},
      {"decode, 8 heads on one KV head", 1, 1, 3000, 8, 1, 96, 64, DType::kF32},
      {"bf16 decode", 1, 1, 700, 8, 1, 96, 64, DType::kBF16},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const Problem p =
        with_value_dim(make_problem(c.batch, c.q_len, c.k_len, c.heads, c.kv_heads, c.dim, c.dtype), c.dim_v);
    AttentionSpec spec = spec_with_values(p, c.dim_v);
    spec.mask.causal = true;
    const Attention att(spec);
    EXPECT_EQ(att.value_dim(), c.dim_v);
    const Outputs fused = forward_values(p, att, c.dim_v, 0), exact = forward_values(p, att, c.dim_v, 1);
    if (c.dtype == DType::kF32) {
      // flash-attention's criterion (attention_testing.hpp: expect_accurate).
      const Outputs naive = forward_values(p, att, c.dim_v, 2);
      EXPECT_LE(max_abs_diff(fused.out, exact.out), 2 * max_abs_diff(naive.out, exact.out) + std::ldexp(1.0, -22));
    } else {
      EXPECT_LE(max_abs_diff(fused.out, exact.out), std::ldexp(1.0, -9) + std::ldexp(1.0, -22));  // half a bf16 ulp
    }
    EXPECT_LE(max_abs_diff(fused.lse, exact.lse), 1e-5);
  }
}

// Absorbed decode reads the values from the keys' own rows: v is a view of k's first Dv columns,
// and the result equals the same call with those columns copied into a v of their own — to the
// bit, since the engine reads the same numbers either way.
TEST_P(AttentionMlaTargets, AbsorbedDecodeReadsValuesFromTheKeyRows) {
  for (const DType dtype : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(std::string(dtype_name(dtype)));
    const std::int64_t dim = 72, dim_v = 64, keys = 2500, heads = 8;  // 576 / 512 scaled down
    Problem p = make_problem(1, 1, keys, heads, 1, dim, dtype);
    AttentionSpec view_spec = spec_of(p);
    const std::vector<std::int64_t> v_shape = {1, keys, 1, dim_v}, k_strides = {keys * dim, dim, dim, 1};
    view_spec.v = ConstTensorView(p.kb.data(), dtype, v_shape, k_strides);
    std::vector<double> copied;
    for (std::int64_t j = 0; j < keys; ++j) {
      for (std::int64_t t = 0; t < dim_v; ++t) copied.push_back(p.k[static_cast<std::size_t>(j * dim + t)]);
    }
    const std::vector<unsigned char> copied_bytes = testing::to_dtype(copied, dtype);
    AttentionSpec copy_spec = spec_of(p);
    copy_spec.v = ConstTensorView::contiguous(copied_bytes.data(), dtype, v_shape);
    const Attention viewed(view_spec), copied_att(copy_spec);
    Problem as_copy = p;
    as_copy.vb = copied_bytes;
    const Outputs a = forward_values(p, viewed, dim_v, 0), b = forward_values(as_copy, copied_att, dim_v, 0);
    EXPECT_EQ(a.out, b.out);
    EXPECT_EQ(a.lse, b.lse);
    const Outputs exact = forward_values(p, viewed, dim_v, 1);
    EXPECT_LE(max_abs_diff(a.out, exact.out), dtype == DType::kF32 ? 1e-6 : std::ldexp(1.0, -8));
  }
}

TEST_P(AttentionMlaTargets, NarrowValuesBackwardMatchesTheReference) {
  const std::int64_t dim = 48, dim_v = 32;
  const Problem p = with_value_dim(make_problem(1, 50, 50, 4, 2, dim), dim_v);
  AttentionSpec spec = spec_with_values(p, dim_v);
  spec.mask.causal = true;
  spec.groups = {HeadGroup{4, RotaryQK{RopeParams(dim, dim)}, {}}};
  const Attention att(spec);
  const std::int64_t rows = p.q_len * p.heads;
  const auto f32 = [](auto& v, const std::vector<std::int64_t>& shape) {
    return TensorView::contiguous(v.data(), DType::kF32, shape);
  };
  const auto f64 = [](auto& v, const std::vector<std::int64_t>& shape) {
    return TensorView::contiguous(v.data(), DType::kF64, shape);
  };
  std::vector<float> out(static_cast<std::size_t>(rows * dim_v)), lse(static_cast<std::size_t>(rows)),
      lse64(lse.size());
  std::vector<double> out64(out.size());
  const std::vector<double> d_out = random_values(out.size());
  std::vector<float> d_out32(d_out.begin(), d_out.end());
  std::vector<double> d_out64 = d_out;
  const std::vector<std::int64_t> o_shape = {1, p.q_len, p.heads, dim_v}, l_shape = {1, p.heads, p.q_len};
  const std::vector<std::int64_t> q_shape = {1, p.q_len, p.heads, dim}, k_shape = {1, p.k_len, p.kv_heads, dim},
                                  v_shape = {1, p.k_len, p.kv_heads, dim_v};
  att.forward(f32(out, o_shape), f32(lse, l_shape));
  ref::attention_forward(att, f64(out64, o_shape), f32(lse64, l_shape));
  std::vector<float> dq(static_cast<std::size_t>(p.q_count())), dk(static_cast<std::size_t>(p.k_count()));
  std::vector<float> dv(static_cast<std::size_t>(p.k_len * p.kv_heads * dim_v));
  std::vector<double> dq64(dq.size()), dk64(dk.size()), dv64(dv.size());
  att.backward(f32(out, o_shape), f32(lse, l_shape), f32(d_out32, o_shape), f32(dq, q_shape), f32(dk, k_shape),
               f32(dv, v_shape));
  ref::attention_backward(att, f64(out64, o_shape), f32(lse64, l_shape), f64(d_out64, o_shape), f64(dq64, q_shape),
                          f64(dk64, k_shape), f64(dv64, v_shape), nullptr);
  expect_close(std::vector<double>(dq.begin(), dq.end()), dq64, "dq");
  expect_close(std::vector<double>(dk.begin(), dk.end()), dk64, "dk");
  expect_close(std::vector<double>(dv.begin(), dv.end()), dv64, "dv");
}

// Wide decode blocks: a few queries with more than 8 rows per KV head (MLA's heads on one latent
// head, GQA groups of 16) run compact rows through the matrix kernel, in key chunks merged by
// their log-sum-exps.
TEST_P(AttentionMlaTargets, WideDecodeBlocksMatchTheReference) {
  struct Case {
    const char* what;
    std::int64_t batch, q_len, k_len, heads, kv_heads, dim;
    int scheme;  // 0 none, 1 RoPE, 2 ALiBi, 3 FIRE (a score term that runs wide)
  };
  const Case cases[] = {
      {"16 heads on one KV head, chunks", 1, 1, 3000, 16, 1, 96, 0},
      {"3 queries, GQA groups of 16, RoPE", 2, 3, 1500, 32, 2, 64, 1},
      {"ALiBi, 12 heads per KV head", 1, 2, 900, 24, 2, 32, 2},
      {"FIRE, 12 heads per KV head", 1, 3, 900, 24, 2, 32, 3},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    Problem p = make_problem(c.batch, c.q_len, c.k_len, c.heads, c.kv_heads, c.dim);
    AttentionSpec spec = spec_of(p);
    spec.mask.causal = true;
    if (c.scheme == 1) spec.groups = {HeadGroup{c.heads, RotaryQK{RopeParams(c.dim, c.dim)}, {}}};
    if (c.scheme == 2) spec.groups = {HeadGroup{c.heads, {}, AlibiParams(c.heads)}};
    if (c.scheme == 3) spec.groups = {HeadGroup{c.heads, {}, FireParams::init(c.heads, 8, 3, 1.0, 64.0)}};
    expect_accurate(p, spec, c.what);
  }
}

// DeepSeek's RoPE on the trailing dims of each head (rotary_offset): prefill with its backward,
// and decode over an un-rotated cache (keys rotated row by row).
TEST_P(AttentionMlaTargets, RopeOnTheTrailingDimsMatchesTheReference) {
  for (const RopeLayout layout : {RopeLayout::kInterleaved, RopeLayout::kHalfSplit}) {
    const RopeParams rope = RopeParams(48, 16, 10000.0, layout).with_rotary_offset(32);
    for (const std::int64_t q_len : {std::int64_t{60}, std::int64_t{1}}) {
      SCOPED_TRACE(std::to_string(q_len) + (layout == RopeLayout::kInterleaved ? " interleaved" : " half-split"));
      Problem p = make_problem(1, q_len, q_len == 1 ? 700 : 60, 4, 2, 48);
      AttentionSpec spec = spec_of(p);
      spec.mask.causal = true;
      spec.groups = {HeadGroup{4, RotaryQK{rope}, {}}};
      expect_accurate(p, spec, "offset RoPE");
      if (q_len > 1) {
        expect_backward_matches_reference(p, Attention(spec), random_values(static_cast<std::size_t>(p.q_count())));
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Targets, AttentionMlaTargets, ::testing::ValuesIn(testing::all_targets()));

TEST(AttentionMla, WideDecodeIsBitwiseIdenticalForAnyThreadCount) {
  Problem p = make_problem(1, 2, 20000, 32, 2, 64);
  AttentionSpec spec = spec_of(p);
  spec.mask.causal = true;
  const Attention att(spec);
  expect_same_bits_for_any_thread_count(p, att, p, &att);
}

}  // namespace
}  // namespace posenc
