// The generic test matrix: every registered scheme (posenc/registry.hpp), on every target, goes
// through the same checks, so that a new scheme is tested by its registry line alone:
//   - its entry is complete and its parameters have the declared shape;
//   - every invalid option, parameter count, head count and per-token input is refused by name;
//   - the fused attention matches the fp64 reference (flash-attention's criterion against the
//     naive f32 composition), causal and bidirectional, prefill and decode, with q, k and v in a
//     strided layout, and in bf16 and f16;
//   - its parameter and per-token input gradients match finite differences of the fp64
//     reference, and the fused backward's (and dq, dk, dv) match the fp64 reference's;
//   - forward, decode and backward give the same bits for 1, 2 and 3 threads;
//   - a relative-bias scheme's materialisation and backward match their references.
// A scheme's own file of tests (test_scheme_<name>.cpp) holds its golden values.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "testing.hpp"

namespace posenc {
namespace {

using testing::EveryTarget;
using testing::expect_error;
using testing::uniform;

constexpr std::int64_t kBatch = 2, kQLen = 29, kKLen = 41, kHeads = 4, kKvHeads = 2, kDim = 16;

// An entry's per-token inputs [B, Sk, heads], drawn once from their typical ranges (views of these
// must outlive the matrix's Attentions).
const std::vector<double>& input_values(const SchemeEntry& entry, const SchemeInput& input) {
  static std::map<std::string, std::vector<double>> values;
  std::vector<double>& v = values[entry.name + "." + input.name];
  if (v.empty()) {
    v.resize(static_cast<std::size_t>(kBatch * kKLen * kHeads));
    for (double& x : v) x = input.typical ? input.typical(uniform(0, 1)) : 0.0;
  }
  return v;
}
ConstTensorView input_view(const std::vector<double>& values) {
  return ConstTensorView::of(values.data(), {kBatch, kKLen, kHeads});
}

// Options that keep every scheme's tables small at the matrix's shapes, and the per-token inputs.
SchemeArgs matrix_args(const SchemeEntry& entry) {
  SchemeArgs a;
  for (const SchemeInput& input : entry.inputs) a.inputs[input.name] = input_view(input_values(entry, input));
  a.heads = kHeads;
  a.head_dim = kDim;
  const auto set = [&](const char* name, double value) {
    for (const SchemeOption& o : entry.options) {
      if (o.name == name) a.options[name] = value;
    }
  };
  set("hidden", 6);        // FIRE
  set("threshold", 16);    // FIRE's L: below the positions, so that ∂/∂L is exercised
  set("d_model", 12);      // TUPE, XL
  set("max_len", 64);      // TUPE
  set("max_distance", 9);  // Shaw, T5
  set("num_buckets", 8);   // T5
  // A relative bias's width (d' of a sinusoid's dot product); Shortformer's must equal head_dim.
  if (entry.family == "relative-bias") set("dim", 24);
  return a;
}

// The scheme with its initial parameters moved off their special values (zero tables, equal
// slopes): each scaled by [0.5, 1.5], zeros set in [−0.5, 0.5]. Positive parameters stay positive.
SchemeArgs with_random_parameters(const SchemeEntry& entry, SchemeArgs a) {
  const HeadGroup initial = make_head_group(entry.name, a);
  std::vector<double> theta = scheme_parameters(entry, initial);
  for (double& t : theta) t = t == 0 ? uniform(-0.5, 0.5) : t * uniform(0.5, 1.5);
  a.parameters = theta;
  return a;
}

struct Inputs {
  std::vector<double> q, k, v;  // [B, S, H, D] values
};

Inputs random_inputs() {
  Inputs in;
  in.q.resize(static_cast<std::size_t>(kBatch * kQLen * kHeads * kDim));
  in.k.resize(static_cast<std::size_t>(kBatch * kKLen * kKvHeads * kDim));
  in.v.resize(in.k.size());
  for (auto* values : {&in.q, &in.k, &in.v}) {
    for (double& x : *values) x = uniform(-1, 1);
  }
  return in;
}

// [B, S, H, D] values (the first `len` of `rows` tokens per batch row) stored [B, S, H, D], or
// [B, H, S, D] (`head_major`), with the strides that see them as [B, len, H, D].
struct Stored {
  std::vector<unsigned char> data;
  std::vector<std::int64_t> strides;
};
Stored store(const std::vector<double>& values, std::int64_t rows, std::int64_t len, std::int64_t heads, DType dt,
             bool head_major) {
  std::vector<double> out(static_cast<std::size_t>(kBatch * len * heads * kDim));
  for (std::int64_t b = 0; b < kBatch; ++b) {
    for (std::int64_t s = 0; s < len; ++s) {
      for (std::int64_t h = 0; h < heads; ++h) {
        for (std::int64_t d = 0; d < kDim; ++d) {
          const std::int64_t at =
              head_major ? ((b * heads + h) * len + s) * kDim + d : ((b * len + s) * heads + h) * kDim + d;
          out[static_cast<std::size_t>(at)] = values[static_cast<std::size_t>(((b * rows + s) * heads + h) * kDim + d)];
        }
      }
    }
  }
  Stored st{testing::to_dtype(out, dt), {}};
  st.strides = head_major ? std::vector<std::int64_t>{heads * len * kDim, kDim, len * kDim, 1}
                          : std::vector<std::int64_t>{len * heads * kDim, heads * kDim, kDim, 1};
  return st;
}

// Buffers of one dtype holding the inputs (the first q_len queries: fewer make a decode call),
// and views of them: [B, S, H, D], or (`strided`) [B, H, S, D] buffers seen through permuted
// strides.
struct Call {
  DType dtype;
  bool strided;
  std::int64_t q_len;
  Stored q, k, v;
  AttentionSpec spec;

  Call(const Inputs& in, DType dt, bool strided_qkv, HeadGroup group, bool causal, std::int64_t queries = kQLen)
      : dtype(dt),
        strided(strided_qkv),
        q_len(queries),
        q(store(in.q, kQLen, queries, kHeads, dt, strided_qkv)),
        k(store(in.k, kKLen, kKLen, kKvHeads, dt, strided_qkv)),
        v(store(in.v, kKLen, kKLen, kKvHeads, dt, strided_qkv)) {
    const std::vector<std::int64_t> k_shape = {kBatch, kKLen, kKvHeads, kDim};
    const std::vector<std::int64_t> q_shape = {kBatch, q_len, kHeads, kDim};
    spec.q = ConstTensorView(q.data.data(), dt, q_shape, q.strides);
    spec.k = ConstTensorView(k.data.data(), dt, k_shape, k.strides);
    spec.v = ConstTensorView(v.data.data(), dt, k_shape, v.strides);
    spec.groups = {std::move(group)};
    spec.mask.causal = causal;
  }
};

struct Result {
  std::vector<double> out, lse;
  bool bf16_products = false;  // the fused call's AttentionStats::bf16_products
};

// out (as values in [B, S, H, D] order) and lse of the fused call or a reference (mode 1: fp64,
// mode 2: naive f32, mode 3: naive with bf16 products), out in the call's dtype (f64 for the fp64
// reference).
Result run(const Attention& att, DType dtype, int mode, std::int64_t q_len = kQLen) {
  const DType out_dtype = mode == 1 ? DType::kF64 : dtype;
  const std::int64_t count = kBatch * q_len * kHeads * kDim;
  std::vector<unsigned char> out = testing::garbage_buffer(out_dtype, count);
  std::vector<float> lse(static_cast<std::size_t>(kBatch * kHeads * q_len));
  const std::vector<std::int64_t> shape = {kBatch, q_len, kHeads, kDim};
  const TensorView out_view = TensorView::contiguous(out.data(), out_dtype, shape);
  const TensorView lse_view = TensorView::of(lse.data(), {kBatch, kHeads, q_len});
  Result r;
  if (mode == 0) {
    r.bf16_products = att.forward(out_view, lse_view).bf16_products;
  } else if (mode == 3) {
    ref::attention_forward_bf16_products(att, out_view, lse_view);
  } else {
    ref::attention_forward(att, out_view, lse_view, mode == 2);
  }
  for (std::int64_t i = 0; i < count; ++i) r.out.push_back(testing::element(out.data(), out_dtype, i));
  r.lse.assign(lse.begin(), lse.end());
  return r;
}

double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

double max_abs(const std::vector<double>& a) {
  double m = 0;
  for (const double x : a) m = std::max(m, std::fabs(x));
  return m;
}

class Schemes : public EveryTarget {};

TEST_P(Schemes, EveryEntryIsDescribedAndItsParametersHaveTheDeclaredShape) {
  std::vector<std::string> names;
  for (const SchemeEntry& e : schemes()) {
    SCOPED_TRACE(e.name);
    EXPECT_EQ(std::count(names.begin(), names.end(), e.name), 0) << "duplicate name";
    names.push_back(e.name);
    // An alias is a name of its own, and finds its entry.
    for (const std::string& alias : e.aliases) {
      EXPECT_EQ(std::count(names.begin(), names.end(), alias), 0) << "duplicate name " << alias;
      names.push_back(alias);
      EXPECT_EQ(&find_scheme(alias), &e) << alias;
    }
    EXPECT_TRUE(e.family == "none" || e.family == "transform" || e.family == "relative-bias" || e.family == "bias" ||
                e.family == "relative-terms" || e.family == "sink" || e.family == "token-term" || e.family == "term" ||
                e.family == "normaliser")
        << e.family;
    EXPECT_FALSE(e.summary.empty());
    EXPECT_FALSE(e.source.empty());
    EXPECT_EQ(&find_scheme(e.name), &e);
    const SchemeArgs args = complete_scheme_args(e, matrix_args(e));
    const HeadGroup g = e.make(args);
    EXPECT_EQ(g.heads, kHeads);
    std::int64_t count = e.parameter_shape(args).empty() ? 0 : 1;
    for (const std::int64_t extent : e.parameter_shape(args)) count *= extent;
    EXPECT_EQ(static_cast<std::int64_t>(scheme_parameters(e, g).size()), count);
    EXPECT_EQ(e.parameters.empty(), count == 0) << "the parameters' description";
    // The group's gradients flatten to the same size.
    const Inputs in = random_inputs();
    const Call call(in, DType::kF32, false, g, true);
    const Attention att(call.spec);
    EXPECT_EQ(static_cast<std::int64_t>(scheme_gradients(e, att.zero_gradients().groups[0]).size()), count);
    const std::vector<std::vector<double>> input_grads = scheme_input_gradients(e, att.zero_gradients().groups[0]);
    ASSERT_EQ(input_grads.size(), e.inputs.size());
    for (std::size_t i = 0; i < e.inputs.size(); ++i) {
      EXPECT_FALSE(e.inputs[i].description.empty());
      ASSERT_TRUE(e.inputs[i].typical) << e.inputs[i].name;
      EXPECT_TRUE(std::isfinite(e.inputs[i].typical(0)) && std::isfinite(e.inputs[i].typical(1))) << e.inputs[i].name;
      EXPECT_EQ(input_grads[i].size(), input_values(e, e.inputs[i]).size()) << e.inputs[i].name;
    }
    // The bench preset sets only declared options, and the group it gives builds at a model's
    // shape (8 heads of 128 over 2048 keys), its parameters of the declared shape.
    if (e.bench_preset) {
      SchemeArgs bench{.heads = 8, .head_dim = 128};
      e.bench_preset(bench, 2048);
      for (const auto& [name, value] : bench.options) {
        EXPECT_TRUE(std::any_of(e.options.begin(), e.options.end(), [&](const SchemeOption& o) {
          return o.name == name;
        })) << name;
      }
      const SchemeArgs completed = complete_scheme_args(e, bench);
      std::int64_t size = e.parameter_shape(completed).empty() ? 0 : 1;
      for (const std::int64_t extent : e.parameter_shape(completed)) size *= extent;
      EXPECT_TRUE(bench.parameters.empty() || static_cast<std::int64_t>(bench.parameters.size()) == size);
      EXPECT_EQ(make_head_group(e.name, bench).heads, 8);
    }
    // A decoder's options are declared ones (complete_scheme_args refuses others by name); the
    // trained slices (when any) cover the parameters' flat size exactly.
    SchemeArgs decoder{.heads = kHeads, .head_dim = kDim};
    if (e.decoder_preset) e.decoder_preset(decoder, 64);
    decoder = complete_scheme_args(e, decoder);
    if (e.training) {
      const std::vector<TrainedSlice> slices = e.training(decoder, 64);
      std::int64_t trained = 0;
      for (const TrainedSlice& t : slices) {
        std::int64_t n = 1;
        for (const std::int64_t extent : t.shape) n *= extent;
        trained += n;
        EXPECT_FALSE(t.name.empty());
        EXPECT_TRUE(t.init != TrainedSlice::Init::kNormal || t.value > 0) << t.name;
      }
      std::int64_t size = e.parameter_shape(decoder).empty() ? 0 : 1;
      for (const std::int64_t extent : e.parameter_shape(decoder)) size *= extent;
      EXPECT_TRUE(slices.empty() || trained == size) << trained << " of " << size;
    }
    // What a picture ignores is an argument or a declared option (a misspelt name would let
    // `posenc table` accept the flag and ignore it).
    for (const std::string& ignored : picture_ignores(e)) {
      EXPECT_TRUE(
          ignored == "heads" || ignored == "head_dim" ||
          std::any_of(e.options.begin(), e.options.end(), [&](const SchemeOption& o) { return o.name == ignored; }))
          << ignored;
    }
  }
  expect_error([] { find_scheme("bogus"); }, {"schemes", "name", "bogus", "one of none, nope, rope, xpos"});
  // A length variant scales the options' RoPE, and refuses full RoPE parameters rather than leave them unscaled.
  for (const LengthVariant& v : find_scheme("rope").length_variants) {
    SchemeArgs scaled = complete_scheme_args(find_scheme("rope"), {.heads = 1, .head_dim = 8});
    v.at_length(scaled, 16, 64);
    ASSERT_TRUE(scaled.rope.has_value()) << v.name;
    EXPECT_NE(scaled.rope->inv_frequencies(64), RopeParams(8, 8).inv_frequencies(64)) << v.name;
    EXPECT_FALSE(scaled.options.contains("base")) << v.name;
    expect_error(
        [&v] {
          SchemeArgs given{.heads = 1, .head_dim = 8, .rope = RopeParams(8, 8)};
          v.at_length(given, 16, 64);
        },
        {"scheme rope", "rope", "given"});
  }
  // Shapes that would overflow an int64 are refused before anything is allocated.
  expect_error(
      [] {
        make_head_group("xl", {.heads = 1 << 30, .head_dim = 1 << 30, .options = {{"d_model", 1 << 30}}});
      },
      {"scheme xl", "parameters", "more than 2^63"});
  // Full RoPE parameters set base, rotary_dim and the layout: options beside them are refused.
  SchemeArgs rope{.heads = 2, .head_dim = 8, .options = {{"base", 500000.0}}};
  rope.rope = RopeParams(8, 8);
  expect_error([&] { make_head_group("rope", rope); }, {"base", "absent when RoPE parameters are given"});
  // rope_dim absent means head_dim; an explicit 0 is refused, not read as "unset".
  expect_error(
      [] {
        make_head_group("rope", {.heads = 2, .head_dim = 8, .options = {{"rotary_dim", 0}}});
      },
      {"rotary_dim", "0"});
}

TEST_P(Schemes, EveryInvalidArgumentIsRefusedByName) {
  for (const SchemeEntry& e : schemes()) {
    SCOPED_TRACE(e.name);
    SchemeArgs a = matrix_args(e);
    a.options["bogus_option"] = 1;
    expect_error([&] { make_head_group(e.name, a); }, {"scheme " + e.name, "option", "bogus_option"});
    for (const SchemeOption& o : e.options) {
      SCOPED_TRACE(o.name);
      SchemeArgs b = matrix_args(e);
      b.options[o.name] = std::nan("");
      expect_error([&] { make_head_group(e.name, b); }, {o.name, "nan"});
      if (o.integer) {
        b.options[o.name] = 2.5;
        expect_error([&] { make_head_group(e.name, b); }, {o.name, "2.5", "an integer"});
      }
      // Out of the declared range on either side (flags: 0 or 1; sizes: 1 … 2^31; seeds >= 0).
      if (o.minimum > -SchemeOption::kUnbounded) {
        b.options[o.name] = o.minimum - 1;
        expect_error([&] { make_head_group(e.name, b); }, {o.name});
      }
      if (o.maximum < SchemeOption::kUnbounded) {
        // + 1 where a double still counts by ones, else the next double up (2^53 + 2 for seeds).
        b.options[o.name] = o.maximum < 0x1p52 ? o.maximum + 1 : std::nextafter(o.maximum, SchemeOption::kUnbounded);
        expect_error([&] { make_head_group(e.name, b); }, {o.name});
      }
    }
    if (e.parameters.empty()) {  // a parameter-free scheme takes none, not one to ignore
      SchemeArgs p = matrix_args(e);
      p.parameters = {0.5};
      expect_error([&] { make_head_group(e.name, p); }, {"parameters", "1 values", "no learned parameters"});
    }
    if (!e.takes_rope_parameters) {  // full RoPE parameters only where the entry says it takes them
      SchemeArgs r = matrix_args(e);
      r.rope = RopeParams(kDim, kDim);
      expect_error([&] { make_head_group(e.name, r); }, {"rope", "only for a scheme that takes them"});
    }
    SchemeArgs c = matrix_args(e);
    c.parameters = {1.0, 2.0, 3.0};  // no scheme at these shapes has three parameters
    expect_error([&] { make_head_group(e.name, c); }, {"parameters", "3 values"});
    SchemeArgs i = matrix_args(e);
    i.inputs["bogus_input"] = input_view(input_values(e, {"bogus_input", "no scheme declares it"}));
    expect_error([&] { make_head_group(e.name, i); }, {"scheme " + e.name, "input", "bogus_input"});
    for (const SchemeInput& input : e.inputs) {
      SCOPED_TRACE(input.name);
      SchemeArgs absent = matrix_args(e);
      absent.inputs.erase(input.name);
      expect_error([&] { make_head_group(e.name, absent); }, {"scheme " + e.name, input.name, "absent"});
      // [B, Sk, heads] with one head fewer than the group's.
      SchemeArgs narrow = matrix_args(e);
      narrow.inputs[input.name] = ConstTensorView::of(input_values(e, input).data(), {kBatch, kKLen, kHeads - 1});
      expect_error([&] { make_head_group(e.name, narrow); }, {input.name, std::to_string(kHeads - 1)});
    }
    SchemeArgs d = matrix_args(e);
    d.heads = 0;
    expect_error([&] { make_head_group(e.name, d); }, {"heads", "0", "in [1, 2^31]"});
  }
}

TEST_P(Schemes, FusedAttentionMatchesTheReference) {
  const Inputs in = random_inputs();
  for (const SchemeEntry& e : schemes()) {
    const SchemeArgs args = with_random_parameters(e, matrix_args(e));
    const HeadGroup g = make_head_group(e.name, args);
    for (const bool causal : {true, false}) {
      for (const bool strided : {false, true}) {
        // Every query (the prefill path), and 1 or 3 queries: 2 or 6 rows per KV head, the decode
        // path (at most AttentionPlan::kDecodeRows).
        for (const std::int64_t q_len : {kQLen, std::int64_t{1}, std::int64_t{3}}) {
          SCOPED_TRACE(e.name + (causal ? ", causal" : ", bidirectional") + (strided ? ", q, k, v [B, H, S, D]" : "") +
                       ", " + std::to_string(q_len) + " queries");
          const Call call(in, DType::kF32, strided, g, causal, q_len);
          if (e.causal_only && !causal && q_len > 1) {  // refused, but for one query per sequence
            expect_error([&] { const Attention refused(call.spec); }, {"mask", "causal"});
            continue;
          }
          const Attention att(call.spec);
          // A row normaliser's reference is fp64 only: its place is taken by an error of 2^-20 (16
          // f32 ulps of |out| <= 1) on out and none on the statistic.
          const bool has_naive = e.family != "normaliser";
          const Result fused = run(att, DType::kF32, 0, q_len), exact = run(att, DType::kF32, 1, q_len),
                       naive = has_naive ? run(att, DType::kF32, 2, q_len) : exact;
          // flash-attention's criterion, with a floor of 2^-22 (4 f32 ulps of |out| <= max|v| = 1)
          // for cases where the naive error happens to be tiny.
          const double naive_err = has_naive ? max_abs_diff(naive.out, exact.out) : std::ldexp(1.0, -20);
          EXPECT_LE(max_abs_diff(fused.out, exact.out), 2 * naive_err + std::ldexp(1.0, -22))
              << "naive f32 error " << naive_err;
          // lse: f32 carries 2^-24 relative on |lse| ~ log Sk + |logits| (a few units here).
          EXPECT_LE(max_abs_diff(fused.lse, exact.lse), 2 * max_abs_diff(naive.lse, exact.lse) + std::ldexp(1.0, -18));
        }
      }
    }
    // 16-bit inputs: the fp64 reference of the same rounded inputs, rounded once to the dtype, is
    // off by half an ulp, at |out| < 1 at most 2^-9 (bf16) or 2^-12 (f16); the f32 computation
    // adds at most the floor. bf16 on the host's bf16 dot products: flash-attention's criterion
    // against the naive composition with the same roundings (docs/attention.md).
    for (const auto& [dt, half_ulp] : {std::pair{DType::kBF16, -9}, std::pair{DType::kF16, -12}}) {
      SCOPED_TRACE(e.name + ", " + std::string(dtype_name(dt)));
      const Call call(in, dt, false, g, true);
      const Attention att(call.spec);
      const Result fused = run(att, dt, 0), exact = run(att, dt, 1);
      const double allowed =
          fused.bf16_products ? 2 * max_abs_diff(run(att, dt, 3).out, exact.out) : std::ldexp(1.0, half_ulp);
      EXPECT_LE(max_abs_diff(fused.out, exact.out), allowed + std::ldexp(1.0, -20));
    }
    // Per-token inputs stored in f32, bf16 and f16 (the matrix's are f64): both paths read the
    // same stored values, so the f32 criterion above holds.
    for (const DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
      if (e.inputs.empty()) break;
      SCOPED_TRACE(e.name + ", inputs in " + std::string(dtype_name(dt)));
      SchemeArgs stored_args = args;
      std::vector<std::vector<unsigned char>> stored;
      for (const SchemeInput& input : e.inputs) {
        stored.push_back(testing::to_dtype(input_values(e, input), dt));
        const std::vector<std::int64_t> shape = {kBatch, kKLen, kHeads};
        stored_args.inputs[input.name] = ConstTensorView::contiguous(stored.back().data(), dt, shape);
      }
      const Call call(in, DType::kF32, false, make_head_group(e.name, stored_args), true);
      const Attention att(call.spec);
      const Result fused = run(att, DType::kF32, 0), exact = run(att, DType::kF32, 1), naive = run(att, DType::kF32, 2);
      EXPECT_LE(max_abs_diff(fused.out, exact.out), 2 * max_abs_diff(naive.out, exact.out) + std::ldexp(1.0, -22));
    }
  }
}

struct Gradients {
  std::vector<double> dq, dk, dv, params, inputs;  // inputs: every per-token input's, concatenated
};

// d(Σ w·out) by the call's backward (fused or the fp64 reference), with w = out_weights.
Gradients backward(const SchemeEntry& e, const Attention& att, DType dtype, bool reference,
                   const std::vector<double>& out_weights) {
  const DType dt = reference ? DType::kF64 : dtype;
  const std::int64_t q_count = kBatch * kQLen * kHeads * kDim, k_count = kBatch * kKLen * kKvHeads * kDim;
  std::vector<unsigned char> out = testing::garbage_buffer(dt, q_count);
  std::vector<float> lse(static_cast<std::size_t>(kBatch * kHeads * kQLen));
  const std::vector<std::int64_t> q_shape = {kBatch, kQLen, kHeads, kDim}, k_shape = {kBatch, kKLen, kKvHeads, kDim};
  const TensorView out_view = TensorView::contiguous(out.data(), dt, q_shape);
  const TensorView lse_view = TensorView::of(lse.data(), {kBatch, kHeads, kQLen});
  const std::vector<unsigned char> d_out = testing::to_dtype(out_weights, dt);
  std::vector<unsigned char> dq = testing::to_dtype(std::vector<double>(static_cast<std::size_t>(q_count), 0.0), dt);
  std::vector<unsigned char> dk = testing::to_dtype(std::vector<double>(static_cast<std::size_t>(k_count), 0.0), dt);
  std::vector<unsigned char> dv = dk;
  AttentionGradients grads = att.zero_gradients();
  const ConstTensorView dov = ConstTensorView::contiguous(d_out.data(), dt, q_shape);
  const TensorView dqv = TensorView::contiguous(dq.data(), dt, q_shape);
  const TensorView dkv = TensorView::contiguous(dk.data(), dt, k_shape),
                   dvv = TensorView::contiguous(dv.data(), dt, k_shape);
  if (reference) {
    ref::attention_forward(att, out_view, lse_view);
    ref::attention_backward(att, out_view, lse_view, dov, dqv, dkv, dvv, &grads);
  } else {
    att.forward(out_view, lse_view);
    att.backward(out_view, lse_view, dov, dqv, dkv, dvv, &grads);
  }
  Gradients g;
  for (std::int64_t i = 0; i < q_count; ++i) g.dq.push_back(testing::element(dq.data(), dt, i));
  for (std::int64_t i = 0; i < k_count; ++i) {
    g.dk.push_back(testing::element(dk.data(), dt, i));
    g.dv.push_back(testing::element(dv.data(), dt, i));
  }
  g.params = scheme_gradients(e, grads.groups[0]);
  for (const std::vector<double>& d : scheme_input_gradients(e, grads.groups[0]))
    g.inputs.insert(g.inputs.end(), d.begin(), d.end());
  return g;
}

// Σ w·out of the fp64 reference of the scheme with these arguments.
double loss(const SchemeEntry& e, const SchemeArgs& a, const Inputs& in, const std::vector<double>& w) {
  const Call call(in, DType::kF64, false, make_head_group(e.name, a), true);
  const Attention att(call.spec);
  const Result r = run(att, DType::kF64, 1);
  double sum = 0;
  for (std::size_t i = 0; i < w.size(); ++i) sum += w[i] * r.out[i];
  return sum;
}

TEST_P(Schemes, GradientsMatchFiniteDifferencesAndTheReference) {
  const Inputs in = random_inputs();
  std::vector<double> w(in.q.size());
  for (double& x : w) x = uniform(-1, 1);
  for (const SchemeEntry& e : schemes()) {
    SCOPED_TRACE(e.name);
    const SchemeArgs args = with_random_parameters(e, matrix_args(e));
    const HeadGroup g = make_head_group(e.name, args);
    const Call call32(in, DType::kF32, false, g, true), call64(in, DType::kF64, false, g, true);
    const Attention att32(call32.spec), att64(call64.spec);
    const Gradients exact = backward(e, att64, DType::kF64, true, w);
    // The fp64 reference against central differences of its own forward, at up to 12 parameters
    // spread over the vector. h = 1e-5·max(1, |θ|): the rounding error 2^-53·|L|/h is about
    // 1e-11·|L| (|L| = |Σ w·out| reaches a few tens here) and the truncation error O(h²) is
    // smaller; 1e-7 covers both with margin (the largest error seen is 1.5e-8).
    const std::vector<double> theta = args.parameters;
    const std::size_t n = theta.size();
    for (std::size_t s = 0; s < std::min<std::size_t>(n, 12); ++s) {
      const std::size_t t = s * n / std::min<std::size_t>(n, 12);
      const double h = 1e-5 * std::max(1.0, std::fabs(theta[t]));
      SchemeArgs plus = args, minus = args;
      plus.parameters[t] += h;
      minus.parameters[t] -= h;
      const double fd = (loss(e, plus, in, w) - loss(e, minus, in, w)) / (2 * h);
      EXPECT_NEAR(exact.params[t], fd, 1e-7 * (1 + std::fabs(fd))) << "parameter " << t;
    }
    // The per-token inputs likewise, at 12 elements of each spread over batch rows, tokens after
    // the first (a forget gate's first token enters no logit) and heads (the same h and bound).
    std::size_t offset = 0;
    for (const SchemeInput& input : e.inputs) {
      const std::vector<double>& values = input_values(e, input);
      const std::size_t m = values.size();
      ASSERT_GE(exact.inputs.size(), offset + m) << "the inputs' gradients have the inputs' sizes";
      for (std::int64_t s = 0; s < 12; ++s) {
        const std::int64_t token = 1 + (s * 7) % (kKLen - 1);
        const auto t = static_cast<std::size_t>(((s % kBatch) * kKLen + token) * kHeads + s % kHeads);
        const double h = 1e-5 * std::max(1.0, std::fabs(values[t]));
        std::vector<double> up = values, down = values;
        up[t] += h;
        down[t] -= h;
        SchemeArgs plus = args, minus = args;
        plus.inputs[input.name] = input_view(up);
        minus.inputs[input.name] = input_view(down);
        const double fd = (loss(e, plus, in, w) - loss(e, minus, in, w)) / (2 * h);
        EXPECT_NEAR(exact.inputs[offset + t], fd, 1e-7 * (1 + std::fabs(fd))) << input.name << " " << t;
      }
      offset += m;
    }
    EXPECT_EQ(exact.inputs.size(), offset) << "the inputs' gradients have the inputs' sizes";
    // The fused f32 backward against the fp64 reference: sums of up to B·Sq·Sk f32 terms per
    // parameter, each with a relative error of a few 2^-24: 1e-3 of the largest gradient.
    const Gradients fused = backward(e, att32, DType::kF32, false, w);
    ASSERT_EQ(fused.params.size(), exact.params.size());
    EXPECT_LE(max_abs_diff(fused.params, exact.params), 1e-3 * (max_abs(exact.params) + 1e-3));
    ASSERT_EQ(fused.inputs.size(), exact.inputs.size());
    EXPECT_LE(max_abs_diff(fused.inputs, exact.inputs), 1e-3 * (max_abs(exact.inputs) + 1e-3));
    EXPECT_LE(max_abs_diff(fused.dq, exact.dq), 1e-3 * (max_abs(exact.dq) + 1e-3));
    EXPECT_LE(max_abs_diff(fused.dk, exact.dk), 1e-3 * (max_abs(exact.dk) + 1e-3));
    EXPECT_LE(max_abs_diff(fused.dv, exact.dv), 1e-3 * (max_abs(exact.dv) + 1e-3));
  }
}

TEST_P(Schemes, SameBitsForAnyThreadCount) {
  const Inputs in = random_inputs();
  std::vector<double> w(in.q.size());
  for (double& x : w) x = uniform(-1, 1);
  for (const SchemeEntry& e : schemes()) {
    SCOPED_TRACE(e.name);
    const HeadGroup g = make_head_group(e.name, with_random_parameters(e, matrix_args(e)));
    const Call call(in, DType::kF32, false, g, true), decode_call(in, DType::kF32, false, g, true, 3);
    const Attention att(call.spec), decode(decode_call.spec);
    set_num_threads(1);
    const Result one = run(att, DType::kF32, 0), one_decode = run(decode, DType::kF32, 0, 3);
    const Gradients one_grads = backward(e, att, DType::kF32, false, w);
    for (const int threads : {2, 3}) {
      set_num_threads(threads);
      const Result many = run(att, DType::kF32, 0);
      // (One key chunk at these sizes: the chunks' merge is tested across thread counts in
      // test_attention.cpp and test_attention_mla.cpp.)
      const Result many_decode = run(decode, DType::kF32, 0, 3);
      EXPECT_EQ(many_decode.out, one_decode.out) << threads << " threads, decode";
      EXPECT_EQ(many_decode.lse, one_decode.lse) << threads << " threads, decode";
      const Gradients many_grads = backward(e, att, DType::kF32, false, w);
      EXPECT_EQ(many.out, one.out) << threads << " threads";
      EXPECT_EQ(many.lse, one.lse) << threads << " threads";
      EXPECT_EQ(many_grads.dq, one_grads.dq) << threads << " threads";
      EXPECT_EQ(many_grads.dk, one_grads.dk) << threads << " threads";
      EXPECT_EQ(many_grads.dv, one_grads.dv) << threads << " threads";
      EXPECT_EQ(many_grads.params, one_grads.params) << threads << " threads";
      EXPECT_EQ(many_grads.inputs, one_grads.inputs) << threads << " threads";
    }
  }
}

TEST_P(Schemes, RelativeBiasesMaterialiseAndDifferentiateAsTheirReference) {
  std::vector<std::int64_t> q_ids(static_cast<std::size_t>(kQLen)), k_ids(static_cast<std::size_t>(kKLen));
  for (auto& x : q_ids) x = testing::uniform_int(0, 5000);
  for (std::size_t j = 0; j < k_ids.size(); ++j) k_ids[j] = 3000 + static_cast<std::int64_t>(j);  // consecutive
  const Positions qp = Positions::ids(q_ids), kp = Positions::ids(k_ids);
  for (const SchemeEntry& e : schemes()) {
    if (e.family != "relative-bias") continue;
    SCOPED_TRACE(e.name);
    const HeadGroup g = make_head_group(e.name, with_random_parameters(e, matrix_args(e)));
    const BiasScheme& scheme = *g.bias;
    std::vector<float> fast(static_cast<std::size_t>(kHeads * kQLen * kKLen));
    std::vector<double> exact(fast.size());
    bias_materialize(scheme, qp, kp, TensorView::of(fast.data(), {kHeads, kQLen, kKLen}));
    ref::bias_materialize(scheme, qp, kp, TensorView::of(exact.data(), {kHeads, kQLen, kKLen}));
    for (std::size_t i = 0; i < fast.size(); ++i) {
      // One rounding of the fp64 value to f32, plus tabulate's own error: a sum of up to 64
      // cosines whose angles carry |r|·2^-52 each is within 64·8000·2^-51 < 1e-9 at these positions.
      ASSERT_NEAR(fast[i], exact[i], std::ldexp(std::fabs(exact[i]), -24) + 1e-9) << "element " << i;
    }
    const RelativeBias& rb = *relative_bias(scheme);
    std::vector<double> ds(fast.size());
    for (double& x : ds) x = uniform(-1, 1);
    std::vector<double> d_fast(static_cast<std::size_t>(rb.parameter_count()), 0.0), d_exact = d_fast;
    const ConstTensorView dsv = ConstTensorView::of(ds.data(), {kHeads, kQLen, kKLen});
    relative_bias_backward(rb, qp, kp, dsv, d_fast);
    ref::relative_bias_backward(rb, qp, kp, dsv, d_exact);
    // fp64 sums in another order: 1e-12 of the largest.
    EXPECT_LE(max_abs_diff(d_fast, d_exact), 1e-12 * (max_abs(d_exact) + 1));
  }
}

// bias_backward, any score bias's gradient through its family's fast path, against the fp64
// reference's (ref::bias_backward), and refusing a span of another size by name.
TEST_P(Schemes, EveryScoreBiasDifferentiatesThroughOneCall) {
  std::vector<std::int64_t> q_ids(static_cast<std::size_t>(kQLen)), k_ids(static_cast<std::size_t>(kKLen));
  for (auto& x : q_ids) x = testing::uniform_int(0, 60);  // inside TUPE's table of 64 rows
  for (std::size_t j = 0; j < k_ids.size(); ++j) k_ids[j] = 10 + static_cast<std::int64_t>(j);
  const Positions qp = Positions::ids(q_ids), kp = Positions::ids(k_ids);
  std::vector<double> ds(static_cast<std::size_t>(kHeads * kQLen * kKLen));
  for (double& x : ds) x = uniform(-1, 1);
  const ConstTensorView dsv = ConstTensorView::of(ds.data(), {kHeads, kQLen, kKLen});
  int checked = 0;
  for (const SchemeEntry& e : schemes()) {
    if (e.family != "relative-bias" && e.family != "bias") continue;
    SCOPED_TRACE(e.name);
    const HeadGroup g = make_head_group(e.name, with_random_parameters(e, matrix_args(e)));
    const BiasScheme& scheme = *g.bias;
    std::vector<double> d_fast(static_cast<std::size_t>(bias_parameter_count(scheme)), 0.0), d_exact = d_fast;
    bias_backward(scheme, qp, kp, dsv, d_fast);
    ref::bias_backward(scheme, qp, kp, dsv, d_exact);
    EXPECT_LE(max_abs_diff(d_fast, d_exact), 1e-11 * (max_abs(d_exact) + 1));
    if (!d_fast.empty()) {
      std::vector<double> short_span(d_fast.size() - 1);
      expect_error([&] { bias_backward(scheme, qp, kp, dsv, short_span); },
                   {"bias_backward", "d_params", std::to_string(d_fast.size())});
    }
    ++checked;
  }
  EXPECT_GE(checked, 6);  // ALiBi, T5, Kerple, FIRE, TUPE, Sandwich
}

// A picture (posenc table) is the scheme's logit term: an fp64 attention with q = k = 0 and
// one-hot values v_j = e_j outputs P itself, whose logs differ along a row as the picture does
// (T5's bucket ids through its table). Schemes without one refuse by name.
TEST_P(Schemes, PicturesAreTheLogitsOfZeroQueriesAndKeys) {
  constexpr std::int64_t n = 7;  // <= kDim: one value dimension per key
  const Positions positions = Positions::range(n, 3);
  for (const SchemeEntry& e : schemes()) {
    SCOPED_TRACE(e.name);
    const HeadGroup g = make_head_group(e.name, with_random_parameters(e, matrix_args(e)));
    if (!has_picture(e)) {
      expect_error([&] { scheme_picture(e, g, positions); }, {"scheme " + e.name, "picture", e.family});
      continue;
    }
    const SchemePicture picture = scheme_picture(e, g, positions);
    ASSERT_EQ(picture.heads.size(), picture.shared.empty() ? static_cast<std::size_t>(kHeads) : 1);
    for (const auto& m : picture.heads) ASSERT_EQ(m.size(), static_cast<std::size_t>(n * n));
    if (e.name == "shaw") {  // table rows clip(r, ±k) + k (q = 0 sees none of them)
      const std::int64_t k = dynamic_cast<const ShawTerm&>(*g.terms.front()).params().max_distance();
      for (std::int64_t i = 0; i < n; ++i) {
        for (std::int64_t j = 0; j < n; ++j)
          EXPECT_EQ(picture.heads[0][static_cast<std::size_t>(i * n + j)], std::clamp(j - i, -k, k) + k);
      }
      continue;
    }
    std::vector<double> zeros(static_cast<std::size_t>(n * kHeads * kDim), 0.0), v = zeros, out = zeros;
    for (std::int64_t j = 0; j < n; ++j) {
      for (std::int64_t h = 0; h < kHeads; ++h) v[static_cast<std::size_t>((j * kHeads + h) * kDim + j)] = 1.0;
    }
    std::vector<float> lse(static_cast<std::size_t>(kHeads * n));
    const auto view = [&](std::vector<double>& x) { return TensorView::of(x.data(), {1, n, kHeads, kDim}); };
    AttentionSpec spec;
    spec.q = view(zeros);
    spec.k = view(zeros);
    spec.v = view(v);
    spec.groups = {g};
    spec.q_positions = positions;
    spec.k_positions = positions;
    ref::attention_forward(Attention(spec), view(out), TensorView::of(lse.data(), {1, kHeads, n}));
    for (std::int64_t h = 0; h < kHeads; ++h) {
      const auto logit = [&](std::int64_t i, std::int64_t j) {
        const double x =
            picture
                .heads[picture.shared.empty() ? static_cast<std::size_t>(h) : 0][static_cast<std::size_t>(i * n + j)];
        if (picture.shared.empty()) return x;
        EXPECT_EQ(picture.shared, "buckets");  // T5: the table's entry [bucket, head]
        return g.bias->get_if<T5BiasParams>()->table()[static_cast<std::size_t>(x) * kHeads + h];
      };
      for (std::int64_t i = 0; i < n; ++i) {
        const auto p = [&](std::int64_t j) { return out[static_cast<std::size_t>((i * kHeads + h) * kDim + j)]; };
        double sum = 0;
        for (std::int64_t j = 0; j < n; ++j) {
          // fp64 softmax of logits of a few units: log(p_j / p_0) within 1e-12 of the difference.
          EXPECT_NEAR(std::log(p(j) / p(0)), logit(i, j) - logit(i, 0), 1e-12)
              << "head " << h << ", (" << i << ", " << j << ")";
          sum += std::exp(logit(i, j));
        }
        // lse is f32: 2^-22 of its size.
        EXPECT_NEAR(lse[static_cast<std::size_t>(h * n + i)], std::log(sum),
                    std::ldexp(1.0 + std::fabs(std::log(sum)), -22));
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Targets, Schemes, ::testing::ValuesIn(testing::all_targets()));

}  // namespace
}  // namespace posenc
