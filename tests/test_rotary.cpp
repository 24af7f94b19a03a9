// Rotary embedding: parameters and frequencies (Hugging Face semantics), rotation on every target
// against the fp64 reference (layouts × partial × dtypes × positions × strides × GQA), the inverse,
// gradients by finite differences, norms, the relative-position property at long positions, the
// exactness of cos/sin, and errors.
#include <cmath>
#include <cstring>
#include <numbers>
#include <tuple>

#include "testing.hpp"

namespace posenc {
namespace {

using testing::element;
using testing::EveryTarget;
using testing::expect_error;
using testing::uniform;
using testing::uniform_int;

TEST(RopeParams, RejectsInvalidValues) {
  expect_error([] { RopeParams(128, 127); }, {"rope: rotary_dim = 127", "even number"});
  expect_error([] { RopeParams(64, 128); }, {"rotary_dim = 128", "<= head_dim = 64"});
  expect_error([] { RopeParams(64, 64, 1.0); }, {"base = 1;", "> 1"});
  RopeScaling linear;
  linear.type = RopeType::kLinear;
  linear.factor = 0.5;
  expect_error([&] { RopeParams(64, 64, 1e4, RopeLayout::kHalfSplit, linear); },
               {"factor = 0.5", ">= 1 for rope_type linear"});
  RopeScaling yarn;
  yarn.type = RopeType::kYarn;
  yarn.factor = 4;
  yarn.beta_fast = 1;
  yarn.beta_slow = 32;
  expect_error([&] { RopeParams(64, 64, 1e4, RopeLayout::kHalfSplit, yarn); }, {"beta_fast = 1", ">= beta_slow = 32"});
  RopeScaling longrope;
  longrope.type = RopeType::kLongRope;
  longrope.short_factor.assign(31, 1.0);
  longrope.long_factor.assign(32, 1.0);
  expect_error([&] { RopeParams(64, 64, 1e4, RopeLayout::kHalfSplit, longrope); },
               {"short_factor.size() = 31", "rotary_dim / 2 = 32"});
  expect_error([] { RopeParams(64, 64, 1e4, RopeLayout::kHalfSplit, {}, 2048, std::vector<double>(3, 1.0)); },
               {"freq_factors.size() = 3", "0 or rotary_dim / 2 = 32"});
  expect_error([] { RopeParams(64, 64, 1e4, RopeLayout::kHalfSplit, {}, 2048, std::vector<double>(32, 1e-4)); },
               {"frequency = 10000", "< 2^11"});
  RopeScaling bad_m0;
  bad_m0.type = RopeType::kLongRope;
  bad_m0.factor = 4;
  bad_m0.original_max_position_embeddings = 1;  // ln(1) = 0 in the derived attention factor
  bad_m0.short_factor.assign(32, 1.0);
  bad_m0.long_factor.assign(32, 1.0);
  expect_error([&] { RopeParams(64, 64, 1e4, RopeLayout::kHalfSplit, bad_m0); }, {"attention_factor() = inf"});
  // A factor whose f32 value or inverse is not normal: cos·α overflows or flushes in the kernels
  // (fuzz_rope: α = 1e306 turns finite inputs into NaN).
  for (const double alpha : {1e306, 1e-300, std::ldexp(1.0, 127), std::ldexp(1.0, -127)}) {
    RopeScaling huge;
    huge.attention_factor = alpha;
    expect_error([&] { RopeParams(64, 64, 1e4, RopeLayout::kHalfSplit, huge); },
                 {"attention_factor()", "[2^-126, 2^126]"});
  }
  RopeScaling edge;
  edge.attention_factor = std::ldexp(1.0, 126);
  EXPECT_EQ(RopeParams(64, 64, 1e4, RopeLayout::kHalfSplit, edge).attention_factor(), std::ldexp(1.0, 126));
  expect_error([] { rope_type_from_name("su"); }, {"rope_type = su", "one of default, linear"});
  EXPECT_EQ(rope_type_from_name("llama3"), RopeType::kLlama3);
}

TEST(RopeParams, DefaultLinearAndNtkFrequencies) {
  const RopeParams plain(128, 96, 10000.0);
  const std::vector<double> w = plain.inv_frequencies();
  ASSERT_EQ(w.size(), 48u);
  for (int i = 0; i < 48; ++i) {
    // base^(−2i/r) with r = rotary_dim (partial rotary), correctly rounded from long double.
    EXPECT_EQ(w[i], static_cast<double>(std::pow(10000.0L, -2.0L * i / 96.0L))) << i;
  }
  RopeScaling linear;
  linear.type = RopeType::kLinear;
  linear.factor = 4;
  const std::vector<double> wl = RopeParams(128, 96, 1e4, RopeLayout::kHalfSplit, linear).inv_frequencies();
  for (int i = 0; i < 48; ++i) EXPECT_EQ(wl[i], w[i] / 4) << i;
  RopeScaling ntk;
  ntk.type = RopeType::kNtk;
  ntk.factor = 4;
  const std::vector<double> wn = RopeParams(128, 128, 1e4, RopeLayout::kHalfSplit, ntk).inv_frequencies();
  // base' = 1e4 · 4^(128/126): the lowest frequency becomes base'^(−126/128) = ω_63 / 4.
  EXPECT_EQ(wn[0], 1.0);
  EXPECT_NEAR(wn[63] / RopeParams(128, 128).inv_frequencies()[63], 0.25, 1e-15);
}

// Hugging Face's dynamic NTK: unchanged up to max_position_embeddings M, then base·(f·L/M − f + 1)^(r/(r−2)).
TEST(RopeParams, DynamicFrequenciesFollowTheSequenceLength) {
  RopeScaling dynamic;
  dynamic.type = RopeType::kDynamic;
  dynamic.factor = 2;
  const RopeParams params(64, 64, 1e4, RopeLayout::kHalfSplit, dynamic, 4096);
  EXPECT_EQ(params.inv_frequencies(0), RopeParams(64, 64).inv_frequencies());
  EXPECT_EQ(params.inv_frequencies(4096), RopeParams(64, 64).inv_frequencies());
  const std::vector<double> w = params.inv_frequencies(8192);
  const long double base = 1e4L * std::pow(2.0L * 8192 / 4096 - 1.0L, 64.0L / 62.0L);  // 3^(64/62)·1e4
  for (int i = 0; i < 32; ++i) EXPECT_EQ(w[i], static_cast<double>(std::pow(base, -2.0L * i / 64))) << i;
}

// Values from docs/hf-rope-semantics.md (Hugging Face modeling_rope_utils, checked there with
// Python doubles): the correction range of d = 128, θ = 1e6, M0 = 32768 is [23, 40] (Qwen2-style
// yarn), and attention factors 0.1·ln 4 + 1 = 1.1386294361 (yarn, factor 4), 1.0 for DeepSeek's
// mscale = mscale_all_dim = 1, sqrt(1 + ln 32 / ln 4096) = 1.1902380714 (Phi-3 128k longrope).
TEST(RopeParams, YarnRampAndAttentionFactors) {
  RopeScaling yarn;
  yarn.type = RopeType::kYarn;
  yarn.factor = 4;
  yarn.original_max_position_embeddings = 32768;
  const RopeParams params(128, 128, 1e6, RopeLayout::kHalfSplit, yarn, 131072);
  const std::vector<double> w = params.inv_frequencies();
  const std::vector<double> w0 = RopeParams(128, 128, 1e6).inv_frequencies();
  for (int i = 0; i <= 23; ++i) EXPECT_EQ(w[i], w0[i]) << "extrapolated pair " << i;
  for (int i = 40; i < 64; ++i) EXPECT_NEAR(w[i], w0[i] / 4, 1e-18) << "interpolated pair " << i;
  for (int i = 24; i < 40; ++i) {
    const double ramp = (i - 23.0) / 17.0;
    EXPECT_NEAR(w[i], w0[i] / 4 * ramp + w0[i] * (1 - ramp), 1e-17) << "blended pair " << i;
  }
  EXPECT_NEAR(params.attention_factor(), 1.1386294361, 1e-10);
  RopeScaling deepseek = yarn;
  deepseek.factor = 40;
  deepseek.mscale = 1;
  deepseek.mscale_all_dim = 1;
  EXPECT_EQ(RopeParams(64, 64, 1e4, RopeLayout::kInterleaved, deepseek, 163840).attention_factor(), 1.0);
  RopeScaling phi3;
  phi3.type = RopeType::kLongRope;
  phi3.factor = 32;
  phi3.original_max_position_embeddings = 4096;
  phi3.short_factor.assign(48, 1.0);
  phi3.long_factor.assign(48, 2.0);
  const RopeParams longrope(96, 96, 1e4, RopeLayout::kHalfSplit, phi3, 131072);
  EXPECT_NEAR(longrope.attention_factor(), 1.1902380714, 1e-10);
  // Short factors up to M0, long ones beyond.
  EXPECT_EQ(longrope.inv_frequencies(4096)[5], RopeParams(96, 96).inv_frequencies()[5]);
  EXPECT_EQ(longrope.inv_frequencies(4097)[5], RopeParams(96, 96).inv_frequencies()[5] / 2);
}

// Llama 3.1 8B (config.json: rope_theta 500000, factor 8, low_freq_factor 1, high_freq_factor 4,
// original_max_position_embeddings 8192): wavelengths under 2048 keep their frequency, over 8192
// are divided by 8, in between blend by s = (8192/λ − 1)/3.
TEST(RopeParams, Llama3Bands) {
  RopeScaling llama3;
  llama3.type = RopeType::kLlama3;
  llama3.factor = 8;
  llama3.low_freq_factor = 1;
  llama3.high_freq_factor = 4;
  llama3.original_max_position_embeddings = 8192;
  const std::vector<double> w = RopeParams(128, 128, 5e5, RopeLayout::kHalfSplit, llama3, 131072).inv_frequencies();
  const std::vector<double> w0 = RopeParams(128, 128, 5e5).inv_frequencies();
  int kept = 0, scaled = 0, blended = 0;
  for (int i = 0; i < 64; ++i) {
    const double wavelength = 2 * std::numbers::pi / w0[i];
    if (wavelength < 2048) {
      EXPECT_EQ(w[i], w0[i]) << i;
      ++kept;
    } else if (wavelength > 8192) {
      EXPECT_EQ(w[i], w0[i] / 8) << i;
      ++scaled;
    } else {
      const double s = (8192 / wavelength - 1) / 3;
      EXPECT_NEAR(w[i], (1 - s) * w0[i] / 8 + s * w0[i], 1e-17) << i;
      ++blended;
    }
  }
  // All three bands are exercised: for θ = 500000, d = 128 the wavelengths 2π·θ^(2i/128) split
  // 29 / 6 / 29.
  EXPECT_EQ(kept, 29);
  EXPECT_EQ(blended, 6);
  EXPECT_EQ(scaled, 29);
}

// Hugging Face config fields → RopeParams, for the configurations the issue names.
TEST(RopeParams, FromHuggingFaceConfigs) {
  HfRopeConfig llama;  // Llama 3.1 8B config.json
  llama.hidden_size = 4096;
  llama.num_attention_heads = 32;
  llama.max_position_embeddings = 131072;
  llama.rope_theta = 500000.0;
  llama.rope_type = "llama3";
  llama.factor = 8;
  llama.low_freq_factor = 1;
  llama.high_freq_factor = 4;
  llama.original_max_position_embeddings = 8192;
  const RopeParams p = rope_params_from_hf(llama);
  EXPECT_EQ(p.head_dim(), 128);
  EXPECT_EQ(p.rotary_dim(), 128);
  EXPECT_EQ(p.layout(), RopeLayout::kHalfSplit);  // Hugging Face's rotate_half
  EXPECT_EQ(p.original_max_position_embeddings(), 8192);
  EXPECT_EQ(p.inv_frequencies().back(), std::pow(500000.0, -126.0 / 128.0) / 8);

  HfRopeConfig phi3;  // Phi-3-mini-128k: longrope, M0 at the top level, no explicit factor
  phi3.hidden_size = 3072;
  phi3.num_attention_heads = 32;
  phi3.max_position_embeddings = 131072;
  phi3.top_level_original_max_position_embeddings = 4096;
  phi3.rope_type = "su";  // the legacy name Phi-3 configs used
  phi3.short_factor.assign(48, 1.05);
  phi3.long_factor.assign(48, 3.0);
  const RopeParams q = rope_params_from_hf(phi3);
  EXPECT_EQ(q.scaling().type, RopeType::kLongRope);
  EXPECT_EQ(q.head_dim(), 96);
  EXPECT_EQ(q.scaling().factor, 32.0);  // max_position_embeddings / M0
  EXPECT_NEAR(q.attention_factor(), 1.1902380714, 1e-10);

  HfRopeConfig neox;  // GPT-NeoX / Pythia-2.8B: partial rotary
  neox.hidden_size = 2560;
  neox.num_attention_heads = 32;
  neox.partial_rotary_factor = 0.25;
  EXPECT_EQ(rope_params_from_hf(neox).rotary_dim(), 20);

  HfRopeConfig deepseek;  // DeepSeek-V2-Lite: yarn with the mscale ratio, rope head dim 64
  deepseek.head_dim = 64;
  deepseek.rope_type = "yarn";
  deepseek.factor = 40;
  deepseek.original_max_position_embeddings = 4096;
  deepseek.mscale = 0.707;
  deepseek.mscale_all_dim = 0.707;
  deepseek.max_position_embeddings = 163840;
  EXPECT_EQ(rope_params_from_hf(deepseek).attention_factor(), 1.0);  // equal mscales: ratio 1
  deepseek.mscale = 1.0;
  EXPECT_NEAR(rope_params_from_hf(deepseek).attention_factor(),
              (0.1 * std::log(40.0) + 1) / (0.1 * 0.707 * std::log(40.0) + 1), 1e-15);

  HfRopeConfig broken = llama;
  broken.low_freq_factor = std::nan("");
  expect_error([&] { rope_params_from_hf(broken); }, {"rope_params_from_hf", "llama3 without low_freq_factor"});
  HfRopeConfig no_dims;
  expect_error([&] { rope_params_from_hf(no_dims); }, {"head_dim = missing", "hidden_size and num_attention_heads"});
  HfRopeConfig no_factor = llama;
  no_factor.factor = std::nan("");
  expect_error([&] { rope_params_from_hf(no_factor); }, {"rope_scaling.factor = missing"});
}

// ─── Rotation ──────────────────────────────────────────────────────────────────────────────────

struct Case {
  std::int64_t batch, seq, q_heads, k_heads, head_dim, rotary_dim;
  RopeLayout layout;
  DType dtype;
  bool bhsd;  // memory [B, H, S, D], viewed as [B, S, H, D]
  bool in_place;
  RopeDirection direction;
  int position_kind;  // 0 range+offset, 1 per-row ranges, 2 ids, 3 packed (B = 1)
  bool xpos;          // positions then stay below 4096, centred at 2048 (ζ^e within [0.006, 150])
};

std::string describe(const Case& c) {
  return "[" + std::to_string(c.batch) + ", " + std::to_string(c.seq) + ", q " + std::to_string(c.q_heads) + " / k " +
         std::to_string(c.k_heads) + " heads, D " + std::to_string(c.head_dim) + ", r " + std::to_string(c.rotary_dim) +
         "] " + (c.layout == RopeLayout::kInterleaved ? "interleaved " : "half-split ") +
         std::string(dtype_name(c.dtype)) + (c.bhsd ? " BHSD" : " BSHD") + (c.in_place ? " in place" : "") +
         (c.direction == RopeDirection::kInverse    ? " inverse"
          : c.direction == RopeDirection::kBackward ? " backward"
                                                    : "") +
         " positions " + std::to_string(c.position_kind) + (c.xpos ? " xpos" : "");
}

// Strides of a [B, S, H, D] view over memory laid out [B, S, H, D] or [B, H, S, D].
std::vector<std::int64_t> strides_of(const Case& c, std::int64_t heads) {
  if (c.bhsd) return {heads * c.seq * c.head_dim, c.head_dim, c.seq * c.head_dim, 1};
  return {c.seq * heads * c.head_dim, heads * c.head_dim, c.head_dim, 1};
}

void run_case(const Case& c) {
  SCOPED_TRACE(describe(c));
  RopeScaling scaling;
  if (uniform_int(0, 1)) {
    scaling.type = RopeType::kYarn;  // α != 1 too
    scaling.factor = 4;
    scaling.original_max_position_embeddings = 1024;
  }
  const RopeParams plain(c.head_dim, c.rotary_dim, 1e4, c.layout, scaling, 4096);
  const RopeParams params = c.xpos ? plain.with_xpos(512.0, 2048.0) : plain;
  const std::int64_t far = c.xpos ? 4000 - c.seq : 1 << 20, far_ids = c.xpos ? 4000 : 1 << 24;
  const std::vector<std::int64_t> q_shape = {c.batch, c.seq, c.q_heads, c.head_dim};
  const std::vector<std::int64_t> k_shape = {c.batch, c.seq, c.k_heads, c.head_dim};
  const std::int64_t q_count = c.batch * c.seq * c.q_heads * c.head_dim,
                     k_count = c.batch * c.seq * c.k_heads * c.head_dim;
  std::vector<double> q_values(static_cast<std::size_t>(q_count)), k_values(static_cast<std::size_t>(k_count));
  for (auto& v : q_values) v = uniform(-1, 1);
  for (auto& v : k_values) v = uniform(-1, 1);
  auto q = testing::to_dtype(q_values, c.dtype), k = testing::to_dtype(k_values, c.dtype);
  std::vector<std::int64_t> starts, ids, cu = {0};
  for (std::int64_t b = 0; b < c.batch; ++b) starts.push_back(uniform_int(0, far));
  for (std::int64_t t = 0; t < c.batch * c.seq; ++t) ids.push_back(uniform_int(0, far_ids));
  while (cu.back() < c.seq) cu.push_back(std::min<std::int64_t>(c.seq, cu.back() + uniform_int(1, 9)));
  const Positions positions = c.position_kind == 0   ? Positions::range(c.seq, starts[0])
                              : c.position_kind == 1 ? Positions::ranges(starts, c.seq)
                              : c.position_kind == 2 ? Positions::ids(ids, c.batch, c.seq)
                                                     : Positions::packed(cu);
  // The reference, in f64 on the inputs as rounded to the dtype.
  std::vector<double> q64(q.size() / dtype_size(c.dtype)), k64(k.size() / dtype_size(c.dtype));
  for (std::size_t i = 0; i < q64.size(); ++i) q64[i] = element(q.data(), c.dtype, static_cast<std::int64_t>(i));
  for (std::size_t i = 0; i < k64.size(); ++i) k64[i] = element(k.data(), c.dtype, static_cast<std::int64_t>(i));
  std::vector<double> q_ref(q64.size()), k_ref(k64.size());
  const std::vector<std::int64_t> qs = strides_of(c, c.q_heads), ks = strides_of(c, c.k_heads);
  ref::rope_apply(params, positions, ConstTensorView(q64.data(), DType::kF64, q_shape, qs),
                  ConstTensorView(k64.data(), DType::kF64, k_shape, ks),
                  TensorView(q_ref.data(), DType::kF64, q_shape, qs),
                  TensorView(k_ref.data(), DType::kF64, k_shape, ks), c.direction);
  // The call under test.
  std::vector<unsigned char> q_out = c.in_place ? q : testing::garbage_buffer(c.dtype, q_count);
  std::vector<unsigned char> k_out = c.in_place ? k : testing::garbage_buffer(c.dtype, k_count);
  if (c.in_place) {
    rope_apply(params, positions, TensorView(q_out.data(), c.dtype, q_shape, qs),
               TensorView(k_out.data(), c.dtype, k_shape, ks), c.direction);
  } else {
    rope_apply(params, positions, ConstTensorView(q.data(), c.dtype, q_shape, qs),
               ConstTensorView(k.data(), c.dtype, k_shape, ks), TensorView(q_out.data(), c.dtype, q_shape, qs),
               TensorView(k_out.data(), c.dtype, k_shape, ks), c.direction);
  }
  // Tolerance per element, relative to the size σ of its coefficients: α·S, with α <= 1.14 (1/α
  // for the inverse) and S the xPos scale of its pair at its token, ζ^(±e) <= ζ^-|e| (ζ < 1),
  // e = (p − centre)/scale_base; S = 1 without xPos. With |inputs| <= 1:
  //   f32: each coefficient is σ·cos or σ·sin rounded to f32 (relative 2^-24, plus the
  //        reference's libm angle error p·2^-52 <= 2^-28), times |a| + |b| <= 2; the product, the
  //        fused multiply-add and the store add <= 3 ulps of the output: within
  //        1e-6·(1 + |want| + σ) with room.
  //   bf16, f16: one ulp of the output (relative 2^-7 for bf16, 2^-10 for f16) on top.
  //   f64: the reference itself: exact.
  const double rel = c.dtype == DType::kF32    ? 0.0
                     : c.dtype == DType::kBF16 ? std::ldexp(1.0, -7)
                     : c.dtype == DType::kF16  ? std::ldexp(1.0, -10)
                                               : 0.0;
  const double alpha =
      c.direction == RopeDirection::kInverse ? 1.0 / params.attention_factor() : params.attention_factor();
  auto sigma_of = [&](std::int64_t index, std::int64_t heads) {
    const std::int64_t j = index % c.head_dim, rest = index / c.head_dim;
    std::int64_t b, s;
    if (c.bhsd) {
      s = rest % c.seq;
      b = rest / c.seq / heads;
    } else {
      s = (rest / heads) % c.seq;
      b = rest / heads / c.seq;
    }
    if (!c.xpos || j >= c.rotary_dim) return alpha;
    const std::int64_t r = c.rotary_dim;
    const std::int64_t pair = c.layout == RopeLayout::kInterleaved ? j / 2 : j % (r / 2);
    const double zeta =
        (2.0 * static_cast<double>(pair) + 0.4 * static_cast<double>(r)) / (1.4 * static_cast<double>(r));
    const double e = (static_cast<double>(positions.at(b, s)) - params.xpos_center()) / params.xpos_scale_base();
    return alpha * std::pow(zeta, -std::fabs(e));
  };
  int reported = 0;
  auto compare = [&](const std::vector<unsigned char>& got, const std::vector<double>& want, std::int64_t heads,
                     const char* name) {
    for (std::size_t i = 0; i < want.size(); ++i) {
      const double g = element(got.data(), c.dtype, static_cast<std::int64_t>(i));
      const double sigma = sigma_of(static_cast<std::int64_t>(i), heads);
      const double tol =
          c.dtype == DType::kF64 ? 0.0 : 1e-6 * (1 + std::fabs(want[i]) + sigma) + rel * std::fabs(want[i]) + rel;
      if (!(std::fabs(g - want[i]) <= tol) && reported++ < 5) {
        ADD_FAILURE() << name << " element " << i << ": got " << g << ", reference " << want[i] << ", σ " << sigma;
      }
    }
  };
  compare(q_out, q_ref, c.q_heads, "q");
  compare(k_out, k_ref, c.k_heads, "k");
}

TEST_P(EveryTarget, RopeMatchesReference) {
  const std::int64_t head_dims[] = {2, 34, 64, 80, 96, 128, 256};
  const DType dtypes[] = {DType::kF32, DType::kF32, DType::kBF16, DType::kF16, DType::kF64};
  for (int trial = 0; trial < 40; ++trial) {
    Case c;
    c.head_dim = head_dims[uniform_int(0, 6)];
    c.rotary_dim = uniform_int(0, 2) ? c.head_dim : 2 * uniform_int(1, c.head_dim / 2);  // partial rotary
    c.position_kind = static_cast<int>(uniform_int(0, 3));
    c.batch = c.position_kind == 3 ? 1 : uniform_int(1, 2);
    c.seq = uniform_int(1, 20);
    c.k_heads = uniform_int(1, 3);
    c.q_heads = c.k_heads * uniform_int(1, 3);  // GQA
    c.layout = uniform_int(0, 1) ? RopeLayout::kInterleaved : RopeLayout::kHalfSplit;
    c.dtype = dtypes[uniform_int(0, 4)];
    c.bhsd = uniform_int(0, 1) == 1;
    c.in_place = uniform_int(0, 1) == 1;
    const RopeDirection directions[] = {RopeDirection::kForward, RopeDirection::kBackward, RopeDirection::kInverse};
    c.direction = directions[uniform_int(0, 2)];
    c.xpos = uniform_int(0, 3) == 0;
    run_case(c);
  }
}

// Inverse undoes forward, also with an attention factor and xPos; the plain rotation keeps norms.
TEST_P(EveryTarget, RopeInverseUndoesForward) {
  RopeScaling yarn;
  yarn.type = RopeType::kYarn;
  yarn.factor = 8;
  const RopeParams params = RopeParams(64, 64, 1e4, RopeLayout::kInterleaved, yarn, 4096).with_xpos(512, 1000);
  const std::int64_t seq = 70, heads = 3, d = 64;
  std::vector<float> x(static_cast<std::size_t>(seq * heads * d)), y(x.size()), z(x.size());
  for (auto& v : x) v = static_cast<float>(uniform(-1, 1));
  for (const Positions& positions : {Positions::range(seq, 960)}) {
    rope_apply(params, positions, ConstTensorView::of(x.data(), {seq, heads, d}), TensorView(),
               TensorView::of(y.data(), {seq, heads, d}), TensorView());
    rope_apply(params, positions, ConstTensorView::of(y.data(), {seq, heads, d}), TensorView(),
               TensorView::of(z.data(), {seq, heads, d}), TensorView(), RopeDirection::kInverse);
    // Scales within ζ^±0.1 and α = 1.21: two f32 roundings of each coefficient and output, well
    // within 2e-6 of |x| <= 1.
    for (std::size_t i = 0; i < x.size(); ++i) ASSERT_NEAR(z[i], x[i], 2e-6) << i;
  }
}

TEST_P(EveryTarget, RopeInverseAndNorms) {
  for (const RopeLayout layout : {RopeLayout::kInterleaved, RopeLayout::kHalfSplit}) {
    const RopeParams params(128, 96, 5e5, layout);
    const std::int64_t seq = 33, heads = 4, d = 128;
    std::vector<float> x(static_cast<std::size_t>(seq * heads * d)), y(x.size()), z(x.size());
    for (auto& v : x) v = static_cast<float>(uniform(-1, 1));
    const Positions positions = Positions::range(seq, (1 << 24) - 40);
    rope_apply(params, positions, ConstTensorView::of(x.data(), {seq, heads, d}), TensorView(),
               TensorView::of(y.data(), {seq, heads, d}), TensorView());
    rope_apply(params, positions, ConstTensorView::of(y.data(), {seq, heads, d}), TensorView(),
               TensorView::of(z.data(), {seq, heads, d}), TensorView(), RopeDirection::kInverse);
    for (std::int64_t t = 0; t < seq * heads; ++t) {
      double nx = 0, ny = 0;
      for (std::int64_t j = 0; j < d; ++j) {
        const auto i = static_cast<std::size_t>(t * d + j);
        // Two rotations in f32 with rounded cos/sin: |z − x| <= 2·(2·2^-24 + 2^-23)·2 < 1e-6.
        ASSERT_NEAR(z[i], x[i], 1e-6) << "token-head " << t << ", entry " << j;
        nx += static_cast<double>(x[i]) * x[i];
        ny += static_cast<double>(y[i]) * y[i];
      }
      // |y|² = |x|²·(cos² + sin²) with f32 rounding of each pair: relative 1e-6 covers it.
      EXPECT_NEAR(ny, nx, 1e-6 * nx) << t;
      // Partial rotary: entries past r untouched.
      for (std::int64_t j = 96; j < d; ++j)
        ASSERT_EQ(y[static_cast<std::size_t>(t * d + j)], x[static_cast<std::size_t>(t * d + j)]);
    }
  }
}

// <R(m)q, R(n)k> depends only on m − n, also 2^24 positions later. Against an fp64 dot product
// of the exact rotations: the f32 rotated vectors are within ~2^-23 per entry, so the dot
// product of 128 entries of size <= 1 is within 128·2·2^-23·1.5 ≈ 5e-5 of the exact one.
TEST_P(EveryTarget, RopeRelativePositionHoldsAtLongContext) {
  const RopeParams params(128, 128, 1e4, RopeLayout::kHalfSplit);
  std::vector<float> q(128), k(128);
  for (auto& v : q) v = static_cast<float>(uniform(-1, 1));
  for (auto& v : k) v = static_cast<float>(uniform(-1, 1));
  auto score = [&](std::int64_t m, std::int64_t n) {
    std::vector<float> qr(128), kr(128);
    const std::vector<std::int64_t> pm = {m}, pn = {n};
    rope_apply(params, Positions::ids(pm), ConstTensorView::of(q.data(), {1, 1, 128}), TensorView(),
               TensorView::of(qr.data(), {1, 1, 128}), TensorView());
    rope_apply(params, Positions::ids(pn), ConstTensorView::of(k.data(), {1, 1, 128}), TensorView(),
               TensorView::of(kr.data(), {1, 1, 128}), TensorView());
    double dot = 0;
    for (int i = 0; i < 128; ++i) dot += static_cast<double>(qr[i]) * kr[i];
    return dot;
  };
  const double near_start = score(10, 3);
  for (const std::int64_t t : {std::int64_t{1} << 16, std::int64_t{1} << 20, (std::int64_t{1} << 24) - 11}) {
    EXPECT_NEAR(score(10 + t, 3 + t), near_start, 5e-5) << "shift " << t;
  }
}

// cos and sin tables within 2^-24 of long double at positions near 2^24 (the issue asks 2^-23).
TEST_P(EveryTarget, RopeCosSinExact) {
  const RopeParams params(128, 128, 5e5, RopeLayout::kHalfSplit);
  const std::int64_t rows = 20;
  std::vector<float> cos(static_cast<std::size_t>(rows * 64)), sin(cos.size());
  rope_cos_sin(params, Positions::range(rows, (1 << 24) - rows + 1), TensorView::of(cos.data(), {rows, 64}),
               TensorView::of(sin.data(), {rows, 64}));
  for (std::int64_t r = 0; r < rows; ++r) {
    for (int i = 0; i < 64; ++i) {
      const long double angle = static_cast<long double>((1 << 24) - rows + 1 + r) * std::pow(5e5L, -2.0L * i / 128);
      ASSERT_LE(std::fabs(cos[static_cast<std::size_t>(r * 64 + i)] - std::cos(angle)), std::ldexp(1.0, -24))
          << r << ", " << i;
      ASSERT_LE(std::fabs(sin[static_cast<std::size_t>(r * 64 + i)] - std::sin(angle)), std::ldexp(1.0, -24))
          << r << ", " << i;
    }
  }
}

// L = Σ g·(α·S·R(θ)x): dL/dx = α·S·R(−θ) g, the backward direction. Central differences: L is linear in x, so
// in fp64 the quotient is exact up to rounding (1e-8 with h = 1e-3); in f32, y rounds to f32
// (L off by <= 2·64·2^-23·... ≈ 2e-5, quotient with h = 2^-4 off by <= 3e-4): 5e-4.
template <class T>
void check_rope_gradient(double h, double tol, RopeLayout layout) {
  const std::int64_t seq = 3, heads = 2, d = 16;
  // α != 1 and xPos: the gradient (backward) differs from the inverse here.
  RopeScaling yarn;
  yarn.type = RopeType::kYarn;
  yarn.factor = 4;
  const RopeParams params = RopeParams(d, 12, 1e4, layout, yarn, 512).with_xpos(512, 900);
  std::vector<T> x(static_cast<std::size_t>(seq * heads * d)), g(x.size()), y(x.size()), dx(x.size());
  for (auto& v : x) v = static_cast<T>(uniform(-1, 1));
  for (auto& v : g) v = static_cast<T>(uniform(-1, 1));
  const Positions positions = Positions::range(seq, 1000);
  auto loss = [&] {
    rope_apply(params, positions, ConstTensorView::of(x.data(), {seq, heads, d}), TensorView(),
               TensorView::of(y.data(), {seq, heads, d}), TensorView());
    double sum = 0;
    for (std::size_t i = 0; i < y.size(); ++i) sum += static_cast<double>(g[i]) * static_cast<double>(y[i]);
    return sum;
  };
  rope_apply(params, positions, ConstTensorView::of(g.data(), {seq, heads, d}), TensorView(),
             TensorView::of(dx.data(), {seq, heads, d}), TensorView(), RopeDirection::kBackward);
  for (std::size_t i = 0; i < x.size(); ++i) {
    const T saved = x[i];
    x[i] = static_cast<T>(saved + h);
    const double up = loss();
    x[i] = static_cast<T>(saved - h);
    const double down = loss();
    x[i] = saved;
    EXPECT_NEAR(static_cast<double>(dx[i]), (up - down) / (2 * h), tol) << "x element " << i;
  }
}

TEST_P(EveryTarget, RopeGradientIsTheBackwardDirection) {
  for (const RopeLayout layout : {RopeLayout::kInterleaved, RopeLayout::kHalfSplit}) {
    check_rope_gradient<double>(1e-3, 1e-8, layout);
    check_rope_gradient<float>(0.0625, 5e-4, layout);
  }
}

// Multi-axis RoPE against the fp64 reference: random sections (M-RoPE style, or 2-D axial with
// restarting frequencies), layouts, dtypes and directions. Tolerance as for plain RoPE (α = 1):
// 1e-6 of |x| <= 1 in f32, plus one output ulp for bf16/f16.
TEST_P(EveryTarget, RopeMultiAxisMatchesReference) {
  for (int trial = 0; trial < 20; ++trial) {
    const std::int64_t d = 2 * uniform_int(4, 40), r = 2 * uniform_int(3, d / 2);
    const std::int64_t pairs = r / 2, axes = uniform_int(2, 3);
    std::vector<std::int64_t> sections;
    std::int64_t left = pairs;
    for (std::int64_t a = 0; a < axes - 1; ++a) {
      sections.push_back(uniform_int(1, left - (axes - 1 - a)));
      left -= sections.back();
    }
    sections.push_back(left);
    const bool restart = uniform_int(0, 1) == 1;
    const RopeLayout layout = uniform_int(0, 1) ? RopeLayout::kInterleaved : RopeLayout::kHalfSplit;
    const DType dtypes[] = {DType::kF32, DType::kBF16, DType::kF16, DType::kF64};
    const DType dtype = dtypes[uniform_int(0, 3)];
    const RopeDirection directions[] = {RopeDirection::kForward, RopeDirection::kBackward, RopeDirection::kInverse};
    const RopeDirection direction = directions[uniform_int(0, 2)];
    const std::int64_t seq = uniform_int(1, 30), heads = uniform_int(1, 3);
    SCOPED_TRACE("trial " + std::to_string(trial) + ": d " + std::to_string(d) + ", r " + std::to_string(r) + ", " +
                 std::to_string(axes) + " axes" + (restart ? " restart" : "") + " " + std::string(dtype_name(dtype)));
    const RopeParams params(d, r, 1e4, layout);
    std::vector<std::vector<std::int64_t>> ids(static_cast<std::size_t>(axes));
    std::vector<Positions> axis_positions;
    for (auto& axis : ids) {
      for (std::int64_t t = 0; t < seq; ++t) axis.push_back(uniform_int(0, 1 << 16));
      axis_positions.push_back(Positions::ids(axis));
    }
    std::vector<double> values(static_cast<std::size_t>(seq * heads * d));
    for (auto& v : values) v = uniform(-1, 1);
    const auto x = testing::to_dtype(values, dtype);
    std::vector<double> x64(values.size()), want(values.size());
    for (std::size_t i = 0; i < values.size(); ++i) x64[i] = element(x.data(), dtype, static_cast<std::int64_t>(i));
    const std::vector<std::int64_t> shape = {seq, heads, d};
    ref::rope_apply_multi(params, sections, axis_positions, ConstTensorView::of(x64.data(), {seq, heads, d}), {},
                          TensorView::of(want.data(), {seq, heads, d}), {}, direction, restart);
    auto out = testing::garbage_buffer(dtype, seq * heads * d);
    rope_apply_multi(params, sections, axis_positions, ConstTensorView::contiguous(x.data(), dtype, shape), {},
                     TensorView::contiguous(out.data(), dtype, shape), {}, direction, restart);
    const double rel = dtype == DType::kBF16 ? std::ldexp(1.0, -7) : dtype == DType::kF16 ? std::ldexp(1.0, -10) : 0.0;
    for (std::size_t i = 0; i < want.size(); ++i) {
      const double tol = dtype == DType::kF64 ? 0.0 : 1e-6 * (2 + std::fabs(want[i])) + rel * (1 + std::fabs(want[i]));
      ASSERT_NEAR(element(out.data(), dtype, static_cast<std::int64_t>(i)), want[i], tol) << "element " << i;
    }
  }
}

// M-RoPE with the same ids on every axis (Qwen2-VL's text tokens) is plain RoPE.
TEST_P(EveryTarget, RopeMultiAxisWithEqualIdsIsPlainRope) {
  const RopeParams params(128, 128, 1e6, RopeLayout::kHalfSplit);
  const std::int64_t seq = 40, heads = 2, d = 128;
  std::vector<float> x(static_cast<std::size_t>(seq * heads * d)), plain(x.size()), multi(x.size());
  for (auto& v : x) v = static_cast<float>(uniform(-1, 1));
  const std::vector<std::int64_t> sections = {16, 24, 24};
  const Positions ids = Positions::range(seq, 300);
  const std::vector<Positions> axes = {ids, ids, ids};
  rope_apply(params, ids, ConstTensorView::of(x.data(), {seq, heads, d}), {},
             TensorView::of(plain.data(), {seq, heads, d}), {});
  rope_apply_multi(params, sections, axes, ConstTensorView::of(x.data(), {seq, heads, d}), {},
                   TensorView::of(multi.data(), {seq, heads, d}), {});
  // Exact coefficients against run-rotated ones (< 1e-13 apart), then one f32 rounding each.
  for (std::size_t i = 0; i < x.size(); ++i) ASSERT_NEAR(multi[i], plain[i], 1e-6) << i;
  expect_error(
      [&] {
        const std::vector<std::int64_t> bad = {16, 24, 20};
        rope_apply_multi(params, bad, axes, ConstTensorView::of(x.data(), {seq, heads, d}), {},
                         TensorView::of(multi.data(), {seq, heads, d}), {});
      },
      {"rope_apply_multi", "sum of sections = 60", "rotary_dim / 2 = 64"});
  expect_error(
      [&] {
        const std::vector<Positions> two = {ids, ids};
        rope_apply_multi(params, sections, two, ConstTensorView::of(x.data(), {seq, heads, d}), {},
                         TensorView::of(multi.data(), {seq, heads, d}), {});
      },
      {"axis_positions.size() = 2", "one Positions per section (3)"});
  expect_error(
      [&] {
        rope_apply_multi(params.with_xpos(), sections, axes, ConstTensorView::of(x.data(), {seq, heads, d}), {},
                         TensorView::of(multi.data(), {seq, heads, d}), {});
      },
      {"params.xpos() = true"});
}

// RoPE on a slice of each head (with_rotary_offset, MLA's trailing dims): every target against the
// fp64 reference, both layouts, f32 and bf16, in place and out of place, a head-major view; the
// entries outside the slice are copied exactly.
TEST_P(EveryTarget, RopeWithAnOffsetMatchesTheReference) {
  for (int trial = 0; trial < 12; ++trial) {
    const std::int64_t d = 2 * uniform_int(4, 40), r = 2 * uniform_int(1, d / 2 - 1), off = uniform_int(0, d - r);
    const RopeLayout layout = trial % 2 ? RopeLayout::kInterleaved : RopeLayout::kHalfSplit;
    const DType dtype = trial % 3 == 2 ? DType::kBF16 : DType::kF32;
    const bool in_place = trial % 4 == 1, head_major = trial % 5 == 3;
    const std::int64_t seq = uniform_int(1, 20), heads = uniform_int(1, 3);
    SCOPED_TRACE("d " + std::to_string(d) + ", r " + std::to_string(r) + ", offset " + std::to_string(off));
    const RopeParams params = RopeParams(d, r, 1e4, layout).with_rotary_offset(off);
    std::vector<double> values(static_cast<std::size_t>(seq * heads * d));
    for (auto& v : values) v = uniform(-1, 1);
    auto x = testing::to_dtype(values, dtype);
    std::vector<double> x64(values.size()), want(values.size());
    for (std::size_t i = 0; i < values.size(); ++i) x64[i] = element(x.data(), dtype, static_cast<std::int64_t>(i));
    // [S, H, D], or a [S, H, D] view of [H, S, D] memory.
    const std::vector<std::int64_t> shape = {seq, heads, d};
    const std::vector<std::int64_t> strides =
        head_major ? std::vector<std::int64_t>{d, seq * d, 1} : std::vector<std::int64_t>{heads * d, d, 1};
    const Positions positions = Positions::range(seq, 5000);
    ref::rope_apply(params, positions, ConstTensorView(x64.data(), DType::kF64, shape, strides), {},
                    TensorView(want.data(), DType::kF64, shape, strides), {});
    auto out = in_place ? x : testing::garbage_buffer(dtype, seq * heads * d);
    rope_apply(params, positions, ConstTensorView(x.data(), dtype, shape, strides), {},
               TensorView(out.data(), dtype, shape, strides), {});
    const double rel = dtype == DType::kBF16 ? std::ldexp(1.0, -7) : 0.0;
    for (std::int64_t s = 0; s < seq; ++s) {
      for (std::int64_t h = 0; h < heads; ++h) {
        for (std::int64_t j = 0; j < d; ++j) {
          const std::int64_t at = s * strides[0] + h * strides[1] + j;
          const double got = element(out.data(), dtype, at), w = want[static_cast<std::size_t>(at)];
          if (j < off || j >= off + r) {
            ASSERT_EQ(got, x64[static_cast<std::size_t>(at)]) << "passes unchanged: " << j;
          } else {
            ASSERT_NEAR(got, w, 1e-6 * (2 + std::fabs(w)) + rel * (1 + std::fabs(w))) << s << " " << h << " " << j;
          }
        }
      }
    }
  }
  expect_error([] { (void)RopeParams(64, 16).with_rotary_offset(49); }, {"rotary_offset = 49", "0 to head_dim"});
}

// Qwen3-VL's interleaved M-RoPE (head_dim 128, sections [24, 20, 20], θ 5e6; its config.json's
// rope_scaling has mrope_interleaved and mrope_section): transformers' apply_interleaved_mrope
// starts from the time axis' angles and overwrites the pairs at slice(1, 3·20, 3) with height's and
// at slice(2, 3·20, 3) with width's. Each output pair is checked against its angle, on every target.
TEST_P(EveryTarget, RopeInterleavedMropeFollowsQwen3Vl) {
  const std::int64_t seq = 9, heads = 2, d = 128, pairs = 64;
  const std::vector<std::int64_t> sections = {24, 20, 20};
  std::vector<std::int64_t> want_axis(pairs, 0);
  for (std::int64_t i = 1; i < 3 * sections[1]; i += 3) want_axis[static_cast<std::size_t>(i)] = 1;
  for (std::int64_t i = 2; i < 3 * sections[2]; i += 3) want_axis[static_cast<std::size_t>(i)] = 2;
  const std::vector<std::int64_t> axis = mrope_axis_of_pair(sections, MropeLayout::kInterleaved);
  EXPECT_EQ(axis, want_axis);
  const RopeParams params(d, d, 5e6, RopeLayout::kHalfSplit);
  std::vector<std::vector<std::int64_t>> ids(3);
  std::vector<Positions> axes;
  for (auto& a : ids) {
    for (std::int64_t t = 0; t < seq; ++t) a.push_back(uniform_int(0, 5000));
    axes.push_back(Positions::ids(a));
  }
  std::vector<float> x(static_cast<std::size_t>(seq * heads * d)), out(x.size());
  for (auto& v : x) v = static_cast<float>(uniform(-1, 1));
  rope_apply_axes(params, axis, axes, ConstTensorView::of(x.data(), {seq, heads, d}), {},
                  TensorView::of(out.data(), {seq, heads, d}), {});
  const std::vector<double> w = params.inv_frequencies();
  for (std::int64_t t = 0; t < seq; ++t) {
    for (std::int64_t h = 0; h < heads; ++h) {
      for (std::int64_t i = 0; i < pairs; ++i) {
        const auto a = static_cast<std::size_t>((t * heads + h) * d + i), b = a + pairs;
        const double angle =
            static_cast<double>(
                ids[static_cast<std::size_t>(want_axis[static_cast<std::size_t>(i)])][static_cast<std::size_t>(t)]) *
            w[static_cast<std::size_t>(i)];
        // One f32 rotation of O(1) values: a few 2^-24 of rounding (1e-6).
        ASSERT_NEAR(out[a], x[a] * std::cos(angle) - x[b] * std::sin(angle), 1e-6) << t << " " << i;
        ASSERT_NEAR(out[b], x[b] * std::cos(angle) + x[a] * std::sin(angle), 1e-6) << t << " " << i;
      }
    }
  }
  // The same map through the consecutive sections' reordering is not the same rotation.
  std::vector<float> blocks(x.size());
  rope_apply_multi(params, sections, axes, ConstTensorView::of(x.data(), {seq, heads, d}), {},
                   TensorView::of(blocks.data(), {seq, heads, d}), {});
  EXPECT_NE(blocks, out);
  expect_error(
      [] {
        mrope_axis_of_pair(std::vector<std::int64_t>{32, 32}, MropeLayout::kInterleaved);
      },
      {"sections.size() = 2", "3 (time, height, width)"});
  expect_error(
      [] {
        mrope_axis_of_pair(std::vector<std::int64_t>{4, 30, 30}, MropeLayout::kInterleaved);
      },
      {"sections[0] = 4", "interleaving gives axis 0"});
  expect_error(
      [&] {
        std::vector<std::int64_t> bad = axis;
        bad[7] = 3;
        rope_apply_axes(params, bad, axes, ConstTensorView::of(x.data(), {seq, heads, d}), {},
                        TensorView::of(out.data(), {seq, heads, d}), {});
      },
      {"axis_of_pair[7] = 3", "[0, 3)"});
}

// Multi-axis mapping written out by hand: r = 4 (pairs 0 and 1), sections {1, 1}, axis 0 ids
// and axis 1 ids differ; with restarting frequencies both pairs have ω = 1 (base^0).
TEST(Rope, MultiAxisMappingByHand) {
  for (const RopeLayout layout : {RopeLayout::kInterleaved, RopeLayout::kHalfSplit}) {
    const RopeParams params(4, 4, 100.0, layout);
    const std::vector<std::int64_t> sections = {1, 1}, t_ids = {3}, h_ids = {7};
    const std::vector<Positions> axes = {Positions::ids(t_ids), Positions::ids(h_ids)};
    std::vector<double> x = {1, 0, 0, 0}, y(4);
    // Pair 0 = entries (0, 1) interleaved or (0, 2) half-split; x = (1, 0) in pair 0 gives
    // (cos θ0, sin θ0) with θ0 = 3·ω0 = 3 (axis 0, ω0 = 1).
    for (const bool restart : {false, true}) {
      rope_apply_multi(params, sections, axes, ConstTensorView::of(x.data(), {1, 1, 4}), {},
                       TensorView::of(y.data(), {1, 1, 4}), {}, RopeDirection::kForward, restart);
      const std::size_t second = layout == RopeLayout::kInterleaved ? 1 : 2;
      EXPECT_NEAR(y[0], std::cos(3.0), 1e-15);
      EXPECT_NEAR(y[second], std::sin(3.0), 1e-15);
    }
    // Pair 1 follows axis 1: θ1 = 7·ω1, ω1 = 100^(-2/4) = 0.1, or 1 when frequencies restart
    // (its section has one pair: base^0).
    std::vector<double> x1 =
        layout == RopeLayout::kInterleaved ? std::vector<double>{0, 0, 1, 0} : std::vector<double>{0, 1, 0, 0};
    const std::size_t a = layout == RopeLayout::kInterleaved ? 2 : 1, b = layout == RopeLayout::kInterleaved ? 3 : 3;
    for (const bool restart : {false, true}) {
      rope_apply_multi(params, sections, axes, ConstTensorView::of(x1.data(), {1, 1, 4}), {},
                       TensorView::of(y.data(), {1, 1, 4}), {}, RopeDirection::kForward, restart);
      const double theta = 7.0 * (restart ? 1.0 : 0.1);
      EXPECT_NEAR(y[a], std::cos(theta), 1e-15) << restart;
      EXPECT_NEAR(y[b], std::sin(theta), 1e-15) << restart;
    }
  }
}

// The contiguous path (runs of 64 positions rotated from an exact start) keeps the coefficients
// within 2^-23 of the truth near 2^24: unit vectors rotated by rope_apply read back cos and sin.
TEST_P(EveryTarget, RopeRunsStayExactNearTwoToThe24) {
  const std::int64_t seq = 130, d = 128, start = (std::int64_t{1} << 24) - seq + 1;
  const RopeParams params(d, d, 5e5, RopeLayout::kHalfSplit);
  // Head 0 carries e_i in pair i's first member: its rotation is (cos θ_i, sin θ_i) — one head per
  // pair would be needed for all; half the pairs at once use the first and second halves.
  std::vector<float> x(static_cast<std::size_t>(seq * d), 0.0f), y(x.size());
  for (std::int64_t s = 0; s < seq; ++s) {
    for (std::int64_t i = 0; i < d / 2; ++i) x[static_cast<std::size_t>(s * d + i)] = 1.0f;
  }
  rope_apply(params, Positions::range(seq, start), ConstTensorView::of(x.data(), {seq, 1, d}), {},
             TensorView::of(y.data(), {seq, 1, d}), {});
  for (std::int64_t s = 0; s < seq; ++s) {
    for (std::int64_t i = 0; i < d / 2; ++i) {
      const long double angle =
          static_cast<long double>(start + s) * std::pow(5e5L, -2.0L * static_cast<long double>(i) / d);
      // x = e_i alone in pair i: y_i = cos θ, y_{i+64} = sin θ, each one f32 product of 1.
      ASSERT_LE(std::fabs(y[static_cast<std::size_t>(s * d + i)] - std::cos(angle)), std::ldexp(1.0, -23))
          << s << ", " << i;
      ASSERT_LE(std::fabs(y[static_cast<std::size_t>(s * d + d / 2 + i)] - std::sin(angle)), std::ldexp(1.0, -23))
          << s << ", " << i;
    }
  }
}

// Outputs over 8 MiB are streamed; results must match the reference and not depend on threads.
TEST_P(EveryTarget, RopeLargeStreamedAndThreadCountFree) {
  const std::int64_t seq = 300, q_heads = 32, k_heads = 8, d = 128;  // 12.3 MB of outputs
  const RopeParams params(d, d, 1e4, RopeLayout::kInterleaved);
  std::vector<float> q(static_cast<std::size_t>(seq * q_heads * d)), k(static_cast<std::size_t>(seq * k_heads * d));
  for (auto& v : q) v = static_cast<float>(uniform(-1, 1));
  for (auto& v : k) v = static_cast<float>(uniform(-1, 1));
  std::vector<float> q1(q.size()), k1(k.size()), q2(q.size()), k2(k.size());
  const Positions positions = Positions::range(seq, 1000);
  set_num_threads(1);
  rope_apply(params, positions, ConstTensorView::of(q.data(), {seq, q_heads, d}),
             ConstTensorView::of(k.data(), {seq, k_heads, d}), TensorView::of(q1.data(), {seq, q_heads, d}),
             TensorView::of(k1.data(), {seq, k_heads, d}));
  set_num_threads(2);
  rope_apply(params, positions, ConstTensorView::of(q.data(), {seq, q_heads, d}),
             ConstTensorView::of(k.data(), {seq, k_heads, d}), TensorView::of(q2.data(), {seq, q_heads, d}),
             TensorView::of(k2.data(), {seq, k_heads, d}));
  EXPECT_EQ(std::memcmp(q1.data(), q2.data(), q1.size() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(k1.data(), k2.data(), k1.size() * sizeof(float)), 0);
  std::vector<double> q64(q.begin(), q.end()), want(q.size());
  ref::rope_apply(params, positions, ConstTensorView::of(q64.data(), {seq, q_heads, d}), {},
                  TensorView::of(want.data(), {seq, q_heads, d}), {});
  // As RopeMatchesReference (α = 1): 1e-6·(2 + |want|).
  for (std::size_t i = 0; i < want.size(); ++i) ASSERT_NEAR(q1[i], want[i], 1e-6 * (2 + std::fabs(want[i]))) << i;
}

// The 16-bit storage paths round exactly like the scalar conversions (nearest even, NaN kept a
// NaN) on every target, streamed or not. At position 0 the rotation is a scaling by the attention
// factor: out = round16(fl32(x·α_f32) + partner·0), so the expected bits are known exactly. (A fixed
// α and 16-bit x give few distinct low-bit patterns: a rounding bias of 2^-4 ulp is caught, one of
// 2^-12 ulp may not be.)
TEST_P(EveryTarget, Rope16BitOutputsRoundToNearestEven) {
  // The reference computes x·α in fp64 and rounds once; its agreement is RopeMatchesReference's.
  if (GetParam() == "ref") GTEST_SKIP() << "f32 kernels only";
  RopeScaling yarn;
  yarn.type = RopeType::kYarn;
  yarn.factor = 4;  // α = 0.1·ln 4 + 1, a scale with a full mantissa
  for (const DType dtype : {DType::kBF16, DType::kF16}) {
    // d = 128 takes the two-vector steps; d = 48, rotary 46 the one-vector steps and scalar tails.
    // seq 1000 × 40 heads × 128 × 2 bytes = 10 MB of outputs: over the streaming threshold.
    for (const auto& [seq, d, r] :
         {std::tuple<std::int64_t, std::int64_t, std::int64_t>{1000, 128, 128}, {37, 48, 46}}) {
      for (const RopeLayout layout : {RopeLayout::kHalfSplit, RopeLayout::kInterleaved}) {
        const RopeParams params(d, r, 1e4, layout, yarn, 1024);
        const auto alpha = static_cast<float>(params.attention_factor());
        const std::int64_t q_heads = 32, k_heads = 8;
        const auto count = static_cast<std::size_t>(seq * (q_heads + k_heads) * d);
        std::vector<std::uint16_t> in(count), out(count);
        for (std::size_t i = 0; i < count; ++i) {
          const float v = static_cast<float>(uniform(-4, 4));
          in[i] = dtype == DType::kBF16 ? to_bf16(v).bits : to_f16(v).bits;
        }
        const std::size_t nan_at = 5, inf_at = 1000 * 7 + 3;  // a NaN, and an infinity (its partner turns NaN)
        in[nan_at] = dtype == DType::kBF16 ? std::uint16_t{0x7f81} : std::uint16_t{0x7c01};
        if (inf_at < count) in[inf_at] = dtype == DType::kBF16 ? std::uint16_t{0x7f80} : std::uint16_t{0x7c00};
        const std::vector<std::int64_t> zeros(static_cast<std::size_t>(seq), 0);
        const std::int64_t k_offset = seq * q_heads * d;
        const std::vector<std::int64_t> q_shape = {seq, q_heads, d}, k_shape = {seq, k_heads, d};
        rope_apply(params, Positions::ids(zeros), ConstTensorView::contiguous(in.data(), dtype, q_shape),
                   ConstTensorView::contiguous(in.data() + k_offset, dtype, k_shape),
                   TensorView::contiguous(out.data(), dtype, q_shape),
                   TensorView::contiguous(out.data() + k_offset, dtype, k_shape));
        auto widen = [&](std::uint16_t b) { return dtype == DType::kBF16 ? from_bf16(bf16{b}) : from_f16(f16{b}); };
        auto narrow = [&](float f) { return dtype == DType::kBF16 ? to_bf16(f).bits : to_f16(f).bits; };
        for (std::size_t i = 0; i < count; ++i) {
          const auto j = static_cast<std::int64_t>(i) % d;
          const std::size_t head = i - static_cast<std::size_t>(j);
          const std::int64_t partner = j >= r ? j : layout == RopeLayout::kInterleaved ? (j ^ 1) : (j + r / 2) % r;
          const float x = widen(in[i]), p = widen(in[head + static_cast<std::size_t>(partner)]);
          if (j >= r) {
            ASSERT_EQ(out[i], in[i]) << i;  // passed through untouched
          } else if (std::isnan(x) || std::isinf(p) || std::isnan(p)) {
            ASSERT_TRUE(std::isnan(widen(out[i]))) << dtype_name(dtype) << " " << i;
          } else {
            ASSERT_EQ(out[i], narrow(x * alpha)) << dtype_name(dtype) << " d " << d << " entry " << i << " x " << x;
          }
        }
      }
    }
  }
}

// xPos makes q·k decay as ζ^((m − n)/scale_base): one pair (r = 2, ζ_0 = 0.4/1.4), q = k = e_0.
TEST(Rope, XposScoreDecaysWithDistance) {
  const RopeParams params = RopeParams(2, 2, 1e4).with_xpos(512, 0);
  const std::vector<double> e0 = {1, 0};
  auto score = [&](std::int64_t m, std::int64_t n) {
    std::vector<double> qr(2), kr(2), dummy(2);
    const std::vector<std::int64_t> pm = {m}, pn = {n};
    rope_apply(params, Positions::ids(pm), ConstTensorView::of(e0.data(), {1, 1, 2}), {},
               TensorView::of(qr.data(), {1, 1, 2}), {});
    rope_apply(params, Positions::ids(pn), ConstTensorView::of(dummy.data(), {1, 1, 2}),
               ConstTensorView::of(e0.data(), {1, 1, 2}), TensorView::of(dummy.data(), {1, 1, 2}),
               TensorView::of(kr.data(), {1, 1, 2}));
    return qr[0] * kr[0] + qr[1] * kr[1];
  };
  for (const auto& [m, n] : {std::pair<std::int64_t, std::int64_t>{700, 200}, {1500, 100}, {300, 300}}) {
    const double expected =
        std::pow(0.4 / 1.4, static_cast<double>(m - n) / 512.0) * std::cos(static_cast<double>(m - n));
    EXPECT_NEAR(score(m, n), expected, 1e-12) << m << ", " << n;
  }
  expect_error(
      [&] {
        std::vector<float> x(2), y(2);
        rope_apply(params, Positions::range(1, 100000), ConstTensorView::of(x.data(), {1, 1, 2}), {},
                   TensorView::of(y.data(), {1, 1, 2}), {});
      },
      {"rope (xPos)", "position = 100000", "|position − center| <="});
}

// Re-rotating cached keys equals rotating the raw keys from scratch under the new parameters:
// a context shift, a dynamic-NTK base change, LongRoPE's short-to-long switch, and xPos with a
// new centre. Keys |x| <= 1, coefficients <= 1.3: the re-rotated keys went through two f32
// rotations (each ~2 ulps plus the coefficients' rounding) against one, so 4e-6 covers them.
TEST_P(EveryTarget, RopeRerotationMatchesRotatingFromScratch) {
  const std::int64_t seq = 70, heads = 2, d = 64;
  std::vector<float> raw(static_cast<std::size_t>(seq * heads * d));
  for (auto& v : raw) v = static_cast<float>(uniform(-1, 1));
  RopeScaling dynamic;
  dynamic.type = RopeType::kDynamic;
  dynamic.factor = 2;
  RopeScaling longrope;
  longrope.type = RopeType::kLongRope;
  longrope.factor = 8;
  longrope.original_max_position_embeddings = 1024;
  for (int i = 0; i < 32; ++i) {
    longrope.short_factor.push_back(1.0 + 0.01 * i);
    longrope.long_factor.push_back(1.0 + 0.2 * i);
  }
  struct Scenario {
    const char* name;
    RopeParams from, to;
    Positions from_positions, to_positions;
    std::int64_t from_seq_len, to_seq_len;
  };
  const RopeParams plain(d, d, 1e4, RopeLayout::kInterleaved);
  const RopeParams dyn(d, d, 1e4, RopeLayout::kHalfSplit, dynamic, 1024);
  const RopeParams lr(d, d, 1e4, RopeLayout::kHalfSplit, longrope, 8192);
  const RopeParams xp = RopeParams(d, 48, 1e4, RopeLayout::kHalfSplit).with_xpos(512, 1000);
  const RopeParams xpi = RopeParams(d, d, 1e4, RopeLayout::kInterleaved).with_xpos(256, 990);
  RopeScaling yarn4, yarn16;
  yarn4.type = yarn16.type = RopeType::kYarn;
  yarn4.factor = 4;
  yarn16.factor = 16;
  const RopeParams ya(d, d, 1e4, RopeLayout::kHalfSplit, yarn4, 2048),
      yb(d, d, 1e4, RopeLayout::kHalfSplit, yarn16, 8192);
  const Scenario scenarios[] = {
      {"context shift", plain, plain, Positions::range(seq, 5000), Positions::range(seq, 4), 0, 0},
      {"dynamic NTK growth", dyn, dyn, Positions::range(seq, 900), Positions::range(seq, 900), 1024, 4096},
      {"longrope short to long", lr, lr, Positions::range(seq, 950), Positions::range(seq, 950), 1000, 2000},
      {"xpos new centre", xp, xp.with_xpos(512, 1100), Positions::range(seq, 1000), Positions::range(seq, 1000), 0, 0},
      {"xpos interleaved shift", xpi, xpi, Positions::range(seq, 1000), Positions::range(seq, 940), 0, 0},
      {"yarn factor 4 to 16 (α changes)", ya, yb, Positions::range(seq, 100), Positions::range(seq, 100), 0, 0},
  };
  for (const Scenario& sc : scenarios) {
    SCOPED_TRACE(sc.name);
    std::vector<float> cached(raw.size()), moved(raw.size()), direct(raw.size()), q_dummy(raw.size());
    const auto view = [&](std::vector<float>& v) { return TensorView::of(v.data(), {seq, heads, d}); };
    // Keys go in the k slot: xPos treats keys with ζ^(−e).
    rope_apply(sc.from, sc.from_positions, ConstTensorView::of(q_dummy.data(), {seq, heads, d}),
               ConstTensorView::of(raw.data(), {seq, heads, d}), view(q_dummy), view(cached), RopeDirection::kForward,
               sc.from_seq_len);
    rope_rerotate(sc.from, sc.from_positions, sc.from_seq_len, sc.to, sc.to_positions, sc.to_seq_len,
                  ConstTensorView::of(cached.data(), {seq, heads, d}), view(moved));
    rope_apply(sc.to, sc.to_positions, ConstTensorView::of(q_dummy.data(), {seq, heads, d}),
               ConstTensorView::of(raw.data(), {seq, heads, d}), view(q_dummy), view(direct), RopeDirection::kForward,
               sc.to_seq_len);
    for (std::size_t i = 0; i < raw.size(); ++i) ASSERT_NEAR(moved[i], direct[i], 4e-6) << "element " << i;
    // In place too.
    rope_rerotate(sc.from, sc.from_positions, sc.from_seq_len, sc.to, sc.to_positions, sc.to_seq_len, view(cached),
                  view(cached));
    EXPECT_EQ(std::memcmp(cached.data(), moved.data(), cached.size() * sizeof(float)), 0);
  }
  expect_error(
      [&] {
        std::vector<float> k(64 * 4);
        rope_rerotate(plain, Positions::range(4), 0, RopeParams(d, 32), Positions::range(4), 0,
                      ConstTensorView::of(k.data(), {4, 1, 64}), TensorView::of(k.data(), {4, 1, 64}));
      },
      {"rope_rerotate: to = head_dim 64, rotary_dim 32, layout half-split",
       "expected from's head_dim 64, rotary_dim 64, layout interleaved"});
}

TEST(Rope, RejectsBadArguments) {
  const RopeParams params(8, 8);
  std::vector<float> q(2 * 3 * 8), k(2 * 3 * 8), out(2 * 3 * 8);
  expect_error(
      [&] {
        rope_apply(params, Positions::range(3), TensorView::of(q.data(), {1, 3, 2, 4}), TensorView());
      },
      {"rope_apply: q.size(-1) = 4", "params.head_dim() = 8"});
  expect_error(
      [&] {
        rope_apply(params, Positions::range(3), TensorView::of(q.data(), {6, 8}), TensorView());
      },
      {"q.rank() = 2", "4 ([B, S, H, D]) or 3"});
  expect_error(
      [&] {
        rope_apply(params, Positions::range(3), TensorView::of(q.data(), {3, 2, 8}),
                   TensorView::of(k.data(), {2, 2, 8}));
      },
      {"k shape = [1, 2, 2, 8]", "the tokens and head_dim of q [1, 3, 2, 8]"});
  expect_error(
      [&] {
        rope_apply(params, Positions::range(4), TensorView::of(q.data(), {3, 2, 8}), TensorView());
      },
      {"positions.seq_len() = 4"});
  expect_error(
      [&] {
        rope_apply(params, Positions::range(3), ConstTensorView::of(q.data(), {3, 2, 8}), TensorView(),
                   TensorView::of(q.data() + 8, {3, 2, 8}), TensorView());
      },
      {"q_out = [3, 2, 8]", "disjoint from q"});
  expect_error(
      [&] {
        rope_apply(params, Positions::range(3), ConstTensorView::of(q.data(), {3, 2, 8}),
                   ConstTensorView::of(k.data(), {3, 2, 8}), TensorView::of(out.data(), {3, 2, 8}), TensorView());
      },
      {"k_out = empty", "a view exactly when k is one"});
}

INSTANTIATE_TEST_SUITE_P(Targets, EveryTarget, ::testing::ValuesIn(testing::all_targets()),
                         [](const ::testing::TestParamInfo<std::string>& target) { return target.param; });

}  // namespace
}  // namespace posenc
