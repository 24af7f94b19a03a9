// Quantized KV caches (quantized.hpp): the formats' bytes against hand-worked blocks of ggml's and
// OCP's definitions, the SIMD dequantiser against the scalar one on every target, and attention
// against a quantized cache — the same bits as against the f32 cache of the dequantised values,
// accurate against the fp64 reference, for decode and prefill, every kind of scheme, and bad input.
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "attention_testing.hpp"
#include "kernels/attention/attention_kernels.hpp"
#include "posenc/quantized.hpp"
#include "posenc/runtime.hpp"
#include "testing.hpp"

namespace posenc {
namespace {

using namespace attention_testing;
using testing::expect_error;

constexpr CacheFormat kFormats[] = {CacheFormat::kQ8_0, CacheFormat::kQ4_0, CacheFormat::kFp8E4M3};

std::vector<unsigned char> quantized(CacheFormat f, const std::vector<float>& x, std::int64_t dim) {
  const std::int64_t rows = static_cast<std::int64_t>(x.size()) / dim, rb = cache_row_bytes(f, dim);
  std::vector<unsigned char> out(static_cast<std::size_t>(rows * rb), 0xcd);
  quantize_rows(f, x.data(), rows, dim, out.data(), rb);
  return out;
}

std::vector<float> dequantized(CacheFormat f, const std::vector<unsigned char>& bytes, std::int64_t dim) {
  const std::int64_t rb = cache_row_bytes(f, dim), rows = static_cast<std::int64_t>(bytes.size()) / rb;
  std::vector<float> x(static_cast<std::size_t>(rows * dim));
  dequantize_rows(f, bytes.data(), rb, rows, dim, x.data());
  return x;
}

TEST(QuantizedFormats, RowBytesAndNames) {
  EXPECT_EQ(cache_row_bytes(CacheFormat::kQ8_0, 128), 136);
  EXPECT_EQ(cache_row_bytes(CacheFormat::kQ4_0, 128), 72);
  EXPECT_EQ(cache_row_bytes(CacheFormat::kFp8E4M3, 128), 132);
  for (CacheFormat f : kFormats) {
    EXPECT_EQ(parse_cache_format(cache_format_name(f)), f);
    EXPECT_EQ(cache_row_dim(f, cache_row_bytes(f, 96)), 96);
  }
  EXPECT_FALSE(parse_cache_format("q8").has_value());
  expect_error([] { cache_row_bytes(CacheFormat::kQ8_0, 48); }, {"dim", "48", "multiple of 32", "q8_0"});
  expect_error([] { cache_row_bytes(CacheFormat::kQ4_0, 0); }, {"dim", "0", "multiple of 32"});
  expect_error([] { cache_row_bytes(CacheFormat::kFp8E4M3, 0); }, {"dim", "0", "1 to 2^40"});
  expect_error([] { cache_row_dim(CacheFormat::kQ8_0, 35); }, {"row bytes", "35", "multiple of 34"});
}

// ggml's q8_0 on a worked block: max|x| = 127 gives d = 1 (f16 0x3c00) and q = round(x), halves
// away from zero.
TEST(QuantizedFormats, Q8BlockAsGgmlDefinesIt) {
  std::vector<float> x(32, 0.0f);
  x[0] = 127.0f;
  x[1] = -127.0f;
  x[2] = 63.5f;
  x[3] = -2.5f;
  x[4] = 0.49f;
  const auto b = quantized(CacheFormat::kQ8_0, x, 32);
  ASSERT_EQ(b.size(), 34u);
  EXPECT_EQ(b[0], 0x00);
  EXPECT_EQ(b[1], 0x3c);
  EXPECT_EQ(b[2], 0x7f);
  EXPECT_EQ(b[3], 0x81);  // −127
  EXPECT_EQ(b[4], 64);
  EXPECT_EQ(b[5], 0xfd);  // −3
  EXPECT_EQ(b[6], 0);
  const auto back = dequantized(CacheFormat::kQ8_0, b, 32);
  EXPECT_EQ(back[2], 64.0f);
  EXPECT_EQ(back[3], -3.0f);
  // A block of zeros: scale 0, every value 0.
  const auto zeros = quantized(CacheFormat::kQ8_0, std::vector<float>(32, 0.0f), 32);
  for (unsigned char c : zeros) EXPECT_EQ(c, 0);
}

// ggml's q4_0: d = (the x of largest magnitude) / −8, n = min(15, ⌊x/d + 8.5⌋); byte i holds
// value i (low nibble) and i + 16 (high nibble).
TEST(QuantizedFormats, Q4BlockAsGgmlDefinesIt) {
  std::vector<float> x(32, 0.0f);
  x[0] = -8.0f;  // the largest magnitude: d = 1
  x[1] = 4.0f;
  x[2] = 3.5f;  // 12.0: exactly 12
  x[3] = 7.9f;  // 16.4: clamped to 15
  x[16] = 1.0f;
  x[17] = 8.0f;  // a tie in magnitude with x[0]: the first one sets d
  const auto b = quantized(CacheFormat::kQ4_0, x, 32);
  ASSERT_EQ(b.size(), 18u);
  EXPECT_EQ(b[0], 0x00);
  EXPECT_EQ(b[1], 0x3c);
  EXPECT_EQ(b[2], 0x90);  // 0 | 9 << 4
  EXPECT_EQ(b[3], 0xfc);  // 12 | 15 << 4
  EXPECT_EQ(b[4], 0x8c);
  EXPECT_EQ(b[5], 0x8f);
  for (std::size_t i = 6; i < 18; ++i) EXPECT_EQ(b[i], 0x88) << i;
  const auto back = dequantized(CacheFormat::kQ4_0, b, 32);
  EXPECT_EQ(back[0], -8.0f);
  EXPECT_EQ(back[2], 4.0f);
  EXPECT_EQ(back[3], 7.0f);
  EXPECT_EQ(back[16], 1.0f);
  EXPECT_EQ(back[17], 7.0f);
  // A positive extreme: d = −1, so values flip around 8.
  std::vector<float> y(32, 0.0f);
  y[5] = 8.0f;
  y[6] = -3.0f;
  const auto c = quantized(CacheFormat::kQ4_0, y, 32);
  EXPECT_EQ(c[1], 0xbc);  // f16 −1
  EXPECT_EQ(c[2 + 5] & 0x0f, 0);
  EXPECT_EQ(c[2 + 6] & 0x0f, 11);
  EXPECT_EQ(dequantized(CacheFormat::kQ4_0, c, 32)[5], 8.0f);
}

// OCP E4M3FN: every byte round-trips, the values of the specification's table, ties to even, and
// what lies past 448.
TEST(QuantizedFormats, E4M3AsOcpDefinesIt) {
  EXPECT_EQ(from_e4m3(0x00), 0.0f);
  EXPECT_EQ(from_e4m3(0x01), std::ldexp(1.0f, -9));  // the smallest subnormal
  EXPECT_EQ(from_e4m3(0x07), 7 * std::ldexp(1.0f, -9));
  EXPECT_EQ(from_e4m3(0x08), std::ldexp(1.0f, -6));  // the smallest normal
  EXPECT_EQ(from_e4m3(0x38), 1.0f);
  EXPECT_EQ(from_e4m3(0xb8), -1.0f);
  EXPECT_EQ(from_e4m3(0x7e), 448.0f);
  EXPECT_TRUE(std::isnan(from_e4m3(0x7f)));
  EXPECT_TRUE(std::isnan(from_e4m3(0xff)));
  for (int b = 0; b < 256; ++b) {
    if ((b & 0x7f) == 0x7f) continue;
    EXPECT_EQ(to_e4m3(from_e4m3(static_cast<std::uint8_t>(b))), b) << b;
  }
  EXPECT_EQ(to_e4m3(1.0625f), 0x38);  // between 1 and 1.125: to the even mantissa
  EXPECT_EQ(to_e4m3(1.1875f), 0x3a);
  EXPECT_EQ(to_e4m3(464.0f), 0x7e);  // the tie between 448 and 480 goes to 448
  EXPECT_EQ(to_e4m3(465.0f), 0x7f);  // past it: no value, NaN (as torch.float8_e4m3fn)
  EXPECT_EQ(to_e4m3(-std::numeric_limits<float>::infinity()), 0xff);
  EXPECT_EQ(to_e4m3(std::ldexp(1.0f, -10)), 0x00);  // half the smallest subnormal: ties to even 0
  EXPECT_EQ(to_e4m3(std::ldexp(3.0f, -10)), 0x02);  // 1.5 subnormal units: to 2
  EXPECT_EQ(to_e4m3(std::ldexp(3.0f, -11)), 0x01);  // 0.75 units: to 1
  // A row: scale = max|x| / 448, so the largest value maps to 448 and comes back exactly scaled.
  std::vector<float> x = {1.0f, -0.5f, 0.25f, 3.0f, 0.0f};
  const auto b = quantized(CacheFormat::kFp8E4M3, x, 5);
  ASSERT_EQ(b.size(), 9u);
  float scale;
  std::memcpy(&scale, b.data(), 4);
  EXPECT_EQ(scale, 3.0f / 448.0f);
  EXPECT_EQ(b[4 + 3], 0x7e);
}

// Each format's round trip stays within its step: q8_0 half a scale (plus the f16 rounding of the
// scale, times up to 127), q4_0 one scale (the
// clamp at 15 on the side opposite the extreme), fp8 its 2^-4 relative half-ulp (plus the
// subnormal step); non-finite values make their block (row) NaN; every target's dequantiser
// gives the scalar one's bits.
TEST(QuantizedFormats, RoundTripBoundsAndNonFinite) {
  const std::int64_t dim = 128;
  std::vector<float> x(4 * dim);
  for (auto& v : x) v = static_cast<float>(testing::uniform(-3, 3));
  for (CacheFormat f : kFormats) {
    SCOPED_TRACE(std::string(cache_format_name(f)));
    const auto back = dequantized(f, quantized(f, x, dim), dim);
    for (std::int64_t r = 0; r < 4; ++r) {
      const std::int64_t group = f == CacheFormat::kFp8E4M3 ? dim : 32;
      for (std::int64_t b0 = 0; b0 < dim; b0 += group) {
        double amax = 0;
        for (std::int64_t i = 0; i < group; ++i) amax = std::max(amax, std::fabs(double(x[r * dim + b0 + i])));
        for (std::int64_t i = 0; i < group; ++i) {
          const double v = x[r * dim + b0 + i], w = back[r * dim + b0 + i];
          // The f16 scale is off by up to 2^-11 relative from the one the integers were chosen by.
          const double bound = f == CacheFormat::kQ8_0   ? amax / 127 * (0.5 + 127 * std::ldexp(1.0, -11))
                               : f == CacheFormat::kQ4_0 ? amax / 8 * 1.01
                                                         : std::fabs(v) / 16 + amax / 448 * std::ldexp(1.0, -10);
          EXPECT_LE(std::fabs(v - w), bound) << "value " << v;
        }
      }
    }
    std::vector<float> bad = x;
    bad[40] = std::numeric_limits<float>::quiet_NaN();
    bad[dim + 3] = std::numeric_limits<float>::infinity();
    const auto b = dequantized(f, quantized(f, bad, dim), dim);
    const std::int64_t group = f == CacheFormat::kFp8E4M3 ? dim : 32;
    for (std::int64_t i = 0; i < 4 * dim; ++i) {
      const bool in_bad = i / group == 40 / group || i / group == (dim + 3) / group;
      EXPECT_EQ(std::isnan(b[static_cast<std::size_t>(i)]), in_bad) << i;
    }
  }
}

class QuantizedTargets : public testing::EveryTarget {};

TEST_P(QuantizedTargets, KernelGivesTheScalarBits) {
  for (CacheFormat f : kFormats) {
    for (std::int64_t dim : {32, 64, 96, 128}) {
      if (f == CacheFormat::kFp8E4M3 && dim == 96) dim = 37;  // fp8: any dim, a tail too
      SCOPED_TRACE(std::string(cache_format_name(f)) + " dim " + std::to_string(dim));
      const std::int64_t keys = 5, heads = 3, rb = cache_row_bytes(f, dim);
      std::vector<float> x(static_cast<std::size_t>(keys * heads * dim));
      for (auto& v : x) v = static_cast<float>(testing::uniform(-2, 2));
      x[7] = std::ldexp(1.0f, -20);  // fp8 subnormals after the scale
      x[9] = std::numeric_limits<float>::quiet_NaN();
      // Rows padded apart (key stride heads·rb + 5, head stride rb + 1) as a cache may lie.
      const std::int64_t hs = rb + 1, ss = heads * hs + 5;
      std::vector<unsigned char> bytes(static_cast<std::size_t>(keys * ss));
      for (std::int64_t j = 0; j < keys; ++j) {
        for (std::int64_t g = 0; g < heads; ++g)
          quantize_rows(f, x.data() + (j * heads + g) * dim, 1, dim, bytes.data() + j * ss + g * hs, rb);
      }
      const std::int64_t dp = (dim + 15) / 16 * 16;
      std::vector<float> got(static_cast<std::size_t>(keys * heads * dp), 7.0f), want(static_cast<std::size_t>(dim));
      kernels::attn_dequantize_heads(bytes.data(), f, ss, hs, keys, heads, dim, got.data(), dp);
      for (std::int64_t j = 0; j < keys; ++j) {
        for (std::int64_t g = 0; g < heads; ++g) {
          dequantize_rows(f, bytes.data() + j * ss + g * hs, 0, 1, dim, want.data());
          const float* row = got.data() + (j * heads + g) * dp;
          for (std::int64_t t = 0; t < dim; ++t) {
            if (std::isnan(want[static_cast<std::size_t>(t)])) {
              EXPECT_TRUE(std::isnan(row[t]));
            } else {
              EXPECT_EQ(std::bit_cast<std::uint32_t>(row[t]),
                        std::bit_cast<std::uint32_t>(want[static_cast<std::size_t>(t)]))
                  << j << " " << g << " " << t;
            }
          }
          for (std::int64_t t = dim; t < dp; ++t) EXPECT_EQ(row[t], 0.0f);
        }
      }
    }
  }
}

// A problem's keys and values quantized: the cache, and the problem holding the dequantised
// values (f32) as its k and v.
struct Quantized {
  std::vector<unsigned char> k, v;
  QuantizedCache cache;
  Problem plain;
};

Quantized quantize_problem(const Problem& p, CacheFormat f) {
  Quantized q;
  const std::int64_t rb = cache_row_bytes(f, p.dim);
  const auto one = [&](const std::vector<double>& values, std::vector<unsigned char>& bytes, std::vector<double>& deq) {
    const std::vector<float> x(values.begin(), values.end());
    bytes = quantized(f, x, p.dim);
    const auto back = dequantized(f, bytes, p.dim);
    deq.assign(back.begin(), back.end());
  };
  q.plain = p;
  one(p.k, q.k, q.plain.k);
  one(p.v, q.v, q.plain.v);
  q.plain.kb = testing::to_dtype(q.plain.k, DType::kF32);
  q.plain.vb = testing::to_dtype(q.plain.v, DType::kF32);
  const auto rows_of = [&](const std::vector<unsigned char>& bytes) {
    return QuantizedRows{bytes.data(),    p.batch, p.k_len, p.kv_heads, p.dim, p.k_len * p.kv_heads * rb,
                         p.kv_heads * rb, rb};
  };
  q.cache = {f, rows_of(q.k), rows_of(q.v)};
  return q;
}

AttentionSpec cache_spec(const Problem& p, const Quantized& q) {
  AttentionSpec s = spec_of(p);
  s.k = {};
  s.v = {};
  s.cache = q.cache;
  return s;
}

class QuantizedAttention : public testing::EveryTarget {};

// Decode (1 and 3 queries) and prefill against each format, with no scheme, ALiBi, T5, sinks, a
// window and soft-cap, RoPE on rotated keys and RoPE rotating the dequantised keys: the fused
// result is accurate against the fp64 reference of the dequantised cache and, where the keys are
// not transformed, has the bits of the same call on the f32 cache of the dequantised values.
TEST_P(QuantizedAttention, SameBitsAsTheDequantisedCache) {
  const std::int64_t heads = 8, kv = 2, dim = 64;
  for (CacheFormat f : kFormats) {
    for (const auto& [q_len, k_len] : {std::pair<std::int64_t, std::int64_t>{1, 300}, {3, 211}, {37, 70}}) {
      Problem p = make_problem(2, q_len, k_len, heads, kv, dim);
      // Every seventh key and value tiny: fp8's subnormals (below 2^-6 of a row's largest / 448).
      for (std::size_t i = 0; i < p.k.size(); i += 7) {
        p.k[i] *= 1e-5;
        p.v[i] *= 1e-5;
      }
      const Quantized q = quantize_problem(p, f);
      const RopeParams rope(dim, dim);
      std::vector<double> t5(32 * heads);
      for (auto& x : t5) x = uniform(-2, 2);
      const std::vector<std::pair<std::vector<HeadGroup>, std::string>> cases = {
          {{}, "none"},
          {{{heads, {}, AlibiParams(heads)}}, "alibi"},
          {{{heads, {}, T5BiasParams(heads, 32, 128, true, t5)}}, "t5"},
          {{{heads, {}, {}, {std::make_shared<AttentionSinks>(std::vector<double>(heads, 0.5))}}}, "sinks"},
          {{{heads, RotaryQK{rope, true}, {}}}, "rope, keys rotated in the cache"},
          {{{heads, RotaryQK{rope}, {}}}, "rope after dequantisation"},
          {{{heads, RotaryQK{RopeParams(dim, dim, 10000.0, RopeLayout::kInterleaved)}, {}}}, "rope interleaved after"},
      };
      for (const auto& [groups, name] : cases) {
        for (int masks = 0; masks < 2; ++masks) {
          const std::string what = std::string(cache_format_name(f)) + " " + name + " q_len " + std::to_string(q_len) +
                                   (masks ? " window, soft-cap" : " causal");
          SCOPED_TRACE(what);
          AttentionSpec s = cache_spec(p, q);
          s.groups = groups;
          s.mask.causal = true;
          if (masks) {
            s.mask.window_left = 50;
            s.mask.softcap = 20.0;
          }
          expect_accurate(p, s, what);
          AttentionSpec plain = spec_of(q.plain);
          plain.groups = groups;
          plain.mask = s.mask;
          // Keys rotated after dequantisation take another path than a rotating f32 cache (rotated
          // in scratch rows, not in the scores' registers): accurate, not the same bits. Half-split,
          // where every KV head shares the table, each tile is dequantised and rotated in one pass:
          // the bits of two groups of the same RoPE, whose rows are rotated one by one.
          if (name.find("after") != std::string::npos) {
            if (name == "rope after dequantisation") {
              AttentionSpec split = s;
              split.groups = {{heads / 2, RotaryQK{rope}, {}}, {heads / 2, RotaryQK{rope}, {}}};
              const Outputs a = run_forward(p, Attention(s), 0), b = run_forward(p, Attention(split), 0);
              ASSERT_EQ(a.out, b.out);
              ASSERT_EQ(a.lse, b.lse);
            }
            continue;
          }
          const Outputs a = run_forward(p, Attention(s), 0), b = run_forward(q.plain, Attention(plain), 0);
          for (std::size_t i = 0; i < a.out.size(); ++i) ASSERT_EQ(a.out[i], b.out[i]) << i;
          for (std::size_t i = 0; i < a.lse.size(); ++i) ASSERT_EQ(a.lse[i], b.lse[i]) << i;
        }
      }
    }
  }
}

// 16-bit queries and outputs against a quantized cache; values narrower than keys (MLA).
TEST_P(QuantizedAttention, SixteenBitQueriesAndNarrowValues) {
  for (DType dt : {DType::kBF16, DType::kF16}) {
    Problem p = make_problem(1, 2, 150, 4, 1, 64, dt);
    const Quantized q = quantize_problem(p, CacheFormat::kQ8_0);
    AttentionSpec s = cache_spec(p, q);
    s.mask.causal = true;
    expect_accurate(p, s, std::string(dtype_name(dt)));
  }
  Problem p = make_problem(1, 1, 90, 2, 1, 64);
  const Quantized q = quantize_problem(p, CacheFormat::kQ4_0);
  AttentionSpec s = cache_spec(p, q);
  s.cache->v.dim = 32;  // the first 32 values of each 64-value row: a view of a narrower V
  s.cache->v.seq_stride = q.cache.v.seq_stride;
  const Attention att(s);
  EXPECT_EQ(att.value_dim(), 32);
  std::vector<float> out(2 * 32), ref_out(2 * 32), lse(2), ref_lse(2);
  att.forward(TensorView::of(out.data(), {1, 1, 2, 32}), TensorView::of(lse.data(), {1, 2, 1}));
  ref::attention_forward(att, TensorView::of(ref_out.data(), {1, 1, 2, 32}), TensorView::of(ref_lse.data(), {1, 2, 1}));
  for (std::size_t i = 0; i < out.size(); ++i) EXPECT_NEAR(out[i], ref_out[i], 1e-5);
}

TEST_P(QuantizedAttention, SameBitsForAnyThreadCount) {
  Problem p = make_problem(1, 1, 5000, 8, 2, 128);
  const Quantized q = quantize_problem(p, CacheFormat::kQ8_0);
  const Attention att(cache_spec(p, q));
  set_num_threads(1);
  const Outputs one = run_forward(p, att, 0);
  set_num_threads(2);
  const Outputs two = run_forward(p, att, 0);
  EXPECT_EQ(one.out, two.out);
  EXPECT_EQ(one.lse, two.lse);
}

INSTANTIATE_TEST_SUITE_P(Targets, QuantizedTargets, ::testing::ValuesIn(testing::all_targets()));
INSTANTIATE_TEST_SUITE_P(Targets, QuantizedAttention, ::testing::ValuesIn(testing::all_targets()));

TEST(QuantizedAttentionErrors, BadInputIsNamed) {
  Problem p = make_problem(1, 1, 40, 2, 1, 64);
  const Quantized q = quantize_problem(p, CacheFormat::kQ8_0);
  AttentionSpec both = cache_spec(p, q);
  both.k = p.kv();
  expect_error([&] { Attention a(both); }, {"k", "empty views with spec.cache"});
  AttentionSpec odd = cache_spec(p, q);
  odd.cache->k.dim = 48;
  expect_error([&] { Attention a(odd); }, {"cache.k", "multiple of 32"});
  AttentionSpec wrong_dim = cache_spec(p, q);
  wrong_dim.cache->k.dim = 32;
  wrong_dim.cache->v.dim = 32;
  expect_error([&] { Attention a(wrong_dim); }, {"cache.k", "head_dim 64 as q"});
  AttentionSpec null_data = cache_spec(p, q);
  null_data.cache->v.data = nullptr;
  expect_error([&] { Attention a(null_data); }, {"cache.v", "non-null"});
  AttentionSpec huge = cache_spec(p, q);
  huge.cache->k.seq_stride = std::numeric_limits<std::int64_t>::max() / 2;
  expect_error([&] { Attention a(huge); }, {"cache offset"});
  AttentionSpec packed = cache_spec(p, q);
  packed.cu_seqlens_q = {0, 1};
  packed.cu_seqlens_k = {0, 40};
  expect_error([&] { Attention a(packed); }, {"cu_seqlens_k", "none with spec.cache"});
  const Attention att(cache_spec(p, q));
  std::vector<float> out(2 * 64), lse(2), d_out(2 * 64, 1.0f), dq(2 * 64);
  att.forward(TensorView::of(out.data(), {1, 1, 2, 64}), TensorView::of(lse.data(), {1, 2, 1}));
  expect_error(
      [&] {
        att.backward(ConstTensorView::of(out.data(), {1, 1, 2, 64}), ConstTensorView::of(lse.data(), {1, 2, 1}),
                     ConstTensorView::of(d_out.data(), {1, 1, 2, 64}), TensorView::of(dq.data(), {1, 1, 2, 64}), {},
                     {});
      },
      {"cache", "q8_0", "no gradient"});
  // An output on the cache's bytes.
  std::vector<unsigned char> shared = q.k;
  AttentionSpec aliased = cache_spec(p, q);
  aliased.cache->k.data = shared.data();
  const Attention on_cache(aliased);
  expect_error(
      [&] {
        on_cache.forward(TensorView::of(reinterpret_cast<float*>(shared.data()), {1, 1, 2, 64}), {});
      },
      {"out", "apart from cache.k"});
}

}  // namespace
}  // namespace posenc
