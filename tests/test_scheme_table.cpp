// The "table" scheme's own tests, and through it the generic fused form of an attention term
// (term.hpp): its golden entries; the fused forward, decode and backward against the fp64
// reference where the generic matrix does not go (windows, soft-caps, GQA, packed sequences,
// chunked decode, cache offsets, positions far apart); a term defined here, outside the
// library, run fused and trained; the terms the generic form refuses. Then the generic form of
// a bias of both positions (scheme.hpp: PositionBias), with one defined here.
#include <cmath>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "attention_testing.hpp"
#include "posenc/bias.hpp"
#include "posenc/registry.hpp"
#include "posenc/scheme.hpp"
#include "posenc/term.hpp"
#include "testing.hpp"

namespace posenc {
namespace {

using namespace attention_testing;

HeadGroup table_group(std::int64_t heads, std::int64_t max_distance, double lo = -2.0, double hi = 2.0) {
  std::vector<double> w(static_cast<std::size_t>(heads * (2 * max_distance + 1)));
  for (double& x : w) x = uniform(lo, hi);
  return make_head_group(
      "table", {.heads = heads, .head_dim = 16, .options = {{"max_distance", max_distance}}, .parameters = w});
}

// w[h, clip(key − query, −K, K) + K], read from the picture at positions 0 … 5.
TEST(Table, EntriesAreTheClippedKeyMinusQuery) {
  std::vector<double> w(10);
  for (std::size_t t = 0; t < w.size(); ++t) w[t] = static_cast<double>(t);
  const HeadGroup g =
      make_head_group("table", {.heads = 2, .head_dim = 8, .options = {{"max_distance", 2}}, .parameters = w});
  const SchemePicture pic = scheme_picture(find_scheme("table"), g, Positions::range(6));
  ASSERT_EQ(pic.heads.size(), 2u);
  const auto at = [&](std::size_t h, std::int64_t i, std::int64_t j) { return pic.heads[h][i * 6 + j]; };
  EXPECT_EQ(at(0, 3, 3), 2.0);  // r = 0: the middle entry
  EXPECT_EQ(at(0, 3, 2), 1.0);  // r = −1
  EXPECT_EQ(at(0, 5, 0), 0.0);  // r = −5, clipped to −2
  EXPECT_EQ(at(0, 0, 5), 4.0);  // r = +5, clipped to +2
  EXPECT_EQ(at(1, 4, 0), 5.0);  // head 1's row starts at 2K + 1 = 5
  EXPECT_EQ(at(1, 1, 2), 8.0);
  // Zeros at first: an untrained table adds nothing.
  const HeadGroup fresh = make_head_group("table", {.heads = 2, .head_dim = 8});
  EXPECT_EQ(scheme_parameters(find_scheme("table"), fresh), std::vector<double>(2 * 257, 0.0));
}

class TableTargets : public testing::EveryTarget {};

TEST_P(TableTargets, MatchTheReference) {
  struct Case {
    const char* what;
    std::int64_t batch, q_len, k_len, heads, kv_heads, dim;
    DType dtype;
    bool causal;
    std::int64_t window_left;
    double softcap;
  };
  const Case cases[] = {
      {"causal GQA", 2, 70, 70, 4, 2, 32, DType::kF32, true, -1, 0.0},
      {"bidirectional", 1, 90, 90, 6, 3, 16, DType::kF32, false, -1, 0.0},
      {"window and soft-cap", 2, 80, 80, 2, 1, 16, DType::kF32, true, 10, 4.0},
      {"queries after a cache", 1, 7, 150, 4, 2, 32, DType::kF32, true, -1, 0.0},
      {"decode over chunks", 2, 1, 9000, 8, 2, 64, DType::kF32, true, -1, 0.0},
      {"bf16", 1, 64, 64, 4, 2, 32, DType::kBF16, true, -1, 0.0},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    Problem p = make_problem(c.batch, c.q_len, c.k_len, c.heads, c.kv_heads, c.dim, c.dtype);
    AttentionSpec spec = spec_of(p);
    spec.mask.causal = c.causal;
    spec.mask.window_left = c.window_left;
    spec.mask.softcap = c.softcap;
    spec.groups = {table_group(c.heads, 12)};
    expect_forward_and_backward_accurate(p, spec, c.what);
  }
}

// Packed sequences, the table on half of the heads beside ALiBi on the others, and positions
// nearly 2^40 apart (the largest the plan takes).
TEST_P(TableTargets, PackedSequencesPartOfTheHeadsAndFarPositions) {
  Problem p = make_packed({{30, 30}, {1, 1}, {50, 50}, {0, 0}}, 4, 2, 32);
  AttentionSpec spec = spec_of(p);
  spec.mask.causal = true;
  spec.groups = {HeadGroup{2, {}, AlibiParams(2)}, table_group(2, 5)};
  expect_accurate(p, spec, "packed");
  expect_backward_matches_reference(p, Attention(spec), random_values(static_cast<std::size_t>(p.q_count())));

  Problem far = make_problem(1, 20, 20, 2, 1, 16);
  AttentionSpec s = spec_of(far);
  std::vector<std::int64_t> ids(20);
  for (std::size_t t = 0; t < ids.size(); ++t)
    ids[t] = (t % 2 == 0 ? (std::int64_t{1} << 40) - 20 : 0) + static_cast<std::int64_t>(t);
  s.q_positions = Positions::ids(ids);
  s.k_positions = Positions::ids(ids);
  s.groups = {table_group(2, 3)};
  expect_accurate(far, s, "positions 2^40 apart");
  expect_backward_matches_reference(far, Attention(s), random_values(static_cast<std::size_t>(far.q_count())));
}

TEST_P(TableTargets, SameBitsForAnyThreadCount) {
  const Problem p = make_problem(2, 150, 150, 4, 2, 32);
  AttentionSpec spec = spec_of(p);
  spec.mask.causal = true;
  spec.groups = {table_group(4, 20)};
  const Problem d = make_problem(1, 1, 9000, 4, 2, 32);
  AttentionSpec ds = spec_of(d);
  ds.groups = spec.groups;
  const Attention dec(ds);
  expect_same_bits_for_any_thread_count(p, Attention(spec), d, &dec);
}

INSTANTIATE_TEST_SUITE_P(Targets, TableTargets, ::testing::ValuesIn(testing::all_targets()));

// A term written outside the library, as a user would prototype one: a learned slope per head on
// log(1 + |key − query|), given only by its fp64 definition. It runs fused, and its gradient
// matches the reference's and central differences of the reference's forward.
class LogDistance final : public AttentionTerm {
 public:
  explicit LogDistance(std::vector<double> slopes) : slopes_(std::move(slopes)) {}
  std::string_view name() const override { return "log-distance"; }
  std::int64_t heads() const override { return static_cast<std::int64_t>(slopes_.size()); }
  double value(std::int64_t head, const TokenPair& pair) const override {
    return -slopes_[static_cast<std::size_t>(head)] * feature(pair);
  }
  std::int64_t gradient_size() const override { return heads(); }
  void accumulate_gradient(std::int64_t head, const TokenPair& pair, double weight,
                           std::span<double> grads) const override {
    grads[static_cast<std::size_t>(head)] -= weight * feature(pair);
  }

 private:
  static double feature(const TokenPair& pair) {
    return std::log1p(std::fabs(static_cast<double>(pair.key_position - pair.query_position)));
  }
  std::vector<double> slopes_;
};

TEST(GenericTerm, ATermDefinedOutsideTheLibraryRunsFusedAndTrains) {
  Problem p = make_problem(1, 40, 40, 3, 1, 16);
  const std::vector<double> d_out = random_values(static_cast<std::size_t>(p.q_count()));
  const auto spec_with = [&](const std::vector<double>& slopes) {
    AttentionSpec spec = spec_of(p);
    spec.mask.causal = true;
    HeadGroup group{3, {}, {}};
    group.terms = {std::make_shared<LogDistance>(slopes)};
    spec.groups = {group};
    return spec;
  };
  const std::vector<double> slopes = {0.5, 1.0, 2.0};
  expect_accurate(p, spec_with(slopes), "log-distance");
  expect_backward_matches_reference(p, Attention(spec_with(slopes)), d_out);
  // Decode: one query over the same keys.
  Problem d = make_problem(1, 1, 3000, 3, 1, 16);
  AttentionSpec ds = spec_of(d);
  HeadGroup group{3, {}, {}};
  group.terms = {std::make_shared<LogDistance>(slopes)};
  ds.groups = {group};
  expect_accurate(d, ds, "log-distance decode");
  expect_term_gradient_matches_differences(p, spec_with, slopes, d_out, 1e-8);
}

// What the generic form cannot run is refused when the Attention is built, by name.
class ReadsRows final : public AttentionTerm {
 public:
  std::string_view name() const override { return "reads-rows"; }
  std::int64_t heads() const override { return 2; }
  bool reads_rows() const override { return true; }
  double row_value(std::int64_t /* head */, const TokenPair& /* pair */, const PairRows& rows) const override {
    return rows.q[0] * rows.k[0];
  }
};
class AddsToOutput final : public AttentionTerm {
 public:
  std::string_view name() const override { return "adds-to-output"; }
  std::int64_t heads() const override { return 2; }
  bool adds_to_output() const override { return true; }
};
class ASink final : public AttentionTerm {
 public:
  std::string_view name() const override { return "a-sink"; }
  std::int64_t heads() const override { return 2; }
  std::optional<double> sink(std::int64_t /* head */) const override { return 0.0; }
};

TEST(GenericTerm, TermsItCannotRunAreRefusedByName) {
  const Problem p = make_problem(1, 8, 8, 2, 1, 16);
  const auto build = [&](AttentionTermRef term) {
    AttentionSpec spec = spec_of(p);
    HeadGroup group{2, {}, {}};
    group.terms = {std::move(term)};
    spec.groups = {group};
    const Attention att(spec);
  };
  testing::expect_error([&] { build(std::make_shared<ReadsRows>()); },
                        {"groups[0].terms[0]", "reads-rows", "reads the query or key rows", "Shaw's"});
  testing::expect_error([&] { build(std::make_shared<AddsToOutput>()); },
                        {"groups[0].terms[0]", "adds-to-output", "adds to the output"});
  testing::expect_error([&] { build(std::make_shared<ASink>()); }, {"groups[0].terms[0]", "a-sink", "is a sink"});
}

// A bias of both positions written outside the library, as a user would prototype one: a learned
// weight per head on log(1 + |key − query|) / log(2 + |query|), which no table over the relative
// position holds, given only by value and its gradient per pair. It runs fused by the generic
// form, in decode and trainable; the bias API materialises it and takes its gradient through the
// interface's defaults.
class QueryScaledLog final : public PositionBias {
 public:
  explicit QueryScaledLog(std::vector<double> weights) : weights_(std::move(weights)) {}
  std::string_view scheme_name() const override { return "query-scaled-log"; }
  std::int64_t heads() const override { return static_cast<std::int64_t>(weights_.size()); }
  std::int64_t parameter_count() const override { return heads(); }
  std::vector<double> parameters() const override { return weights_; }
  double value(std::int64_t head, std::int64_t q, std::int64_t k) const override {
    return -weights_[static_cast<std::size_t>(head)] * feature(q, k);
  }
  void accumulate_gradient(std::int64_t head, std::int64_t q, std::int64_t k, double weight,
                           std::span<double> grads) const override {
    grads[static_cast<std::size_t>(head)] -= weight * feature(q, k);
  }

 private:
  static double feature(std::int64_t q, std::int64_t k) {
    return std::log1p(std::fabs(static_cast<double>(k - q))) / std::log(2.0 + std::fabs(static_cast<double>(q)));
  }
  std::vector<double> weights_;
};

PositionBiasRef query_scaled_log(const std::vector<double>& weights) {
  return std::make_shared<QueryScaledLog>(weights);
}

TEST(GenericBias, ABiasOfBothPositionsDefinedOutsideTheLibraryRunsFusedAndTrains) {
  const Problem p = make_problem(2, 40, 40, 4, 2, 16);
  const std::vector<double> d_out = random_values(static_cast<std::size_t>(p.q_count()));
  const auto spec_with = [&](const std::vector<double>& w) {
    AttentionSpec spec = spec_of(p);
    spec.mask.causal = true;
    spec.groups = {HeadGroup{4, {}, query_scaled_log(w)}};
    return spec;
  };
  const std::vector<double> w = {0.5, 1.0, 2.0, 4.0};
  expect_accurate(p, spec_with(w), "fused");
  expect_backward_matches_reference(p, Attention(spec_with(w)), d_out);
  expect_term_gradient_matches_differences(p, spec_with, w, d_out, 1e-8, /* of_bias */ true);
  // Beside ALiBi on other heads, packed, and in decode over chunks of 9000 keys.
  Problem packed = make_packed({{30, 30}, {1, 1}, {50, 50}}, 4, 2, 32);
  AttentionSpec ps = spec_of(packed);
  ps.mask.causal = true;
  ps.groups = {HeadGroup{2, {}, AlibiParams(2)}, HeadGroup{2, {}, query_scaled_log({1.0, 3.0})}};
  expect_accurate(packed, ps, "packed, beside ALiBi");
  expect_backward_matches_reference(packed, Attention(ps), random_values(static_cast<std::size_t>(packed.q_count())));
  const Problem d = make_problem(2, 1, 9000, 4, 2, 16);
  AttentionSpec ds = spec_of(d);
  ds.groups = spec_with(w).groups;
  expect_accurate(d, ds, "decode");
  const Attention dec(ds);
  expect_same_bits_for_any_thread_count(p, Attention(spec_with(w)), d, &dec);

  // The bias API: materialised by value() and its gradient through the per-pair form.
  const BiasScheme scheme = query_scaled_log(w);
  const Positions qp = Positions::range(5, 7), kp = Positions::range(9);
  std::vector<float> out(4 * 5 * 9);
  bias_materialize(scheme, qp, kp, TensorView::of(out.data(), {4, 5, 9}));
  std::vector<float> ds_values(out.size());
  for (float& x : ds_values) x = static_cast<float>(uniform(-1, 1));
  std::vector<double> grads(4, 0.0), want(4, 0.0);
  bias_backward(scheme, qp, kp, TensorView::of(ds_values.data(), {4, 5, 9}), grads);
  for (std::int64_t h = 0; h < 4; ++h) {
    for (std::int64_t i = 0; i < 5; ++i) {
      for (std::int64_t j = 0; j < 9; ++j) {
        const std::size_t at = static_cast<std::size_t>((h * 5 + i) * 9 + j);
        EXPECT_EQ(out[at], static_cast<float>(bias_value(scheme, h, 7 + i, j)));
        position_bias(scheme)->accumulate_gradient(h, 7 + i, j, ds_values[at], want);
      }
    }
  }
  for (std::size_t h = 0; h < 4; ++h) EXPECT_NEAR(grads[h], want[h], 1e-12 * (1 + std::fabs(want[h])));
}

// A PositionBias that gives neither gradient form is refused by name when the Attention is built
// (not inside the backward's threads) and by the bias API.
class NoGradient final : public PositionBias {
 public:
  std::string_view scheme_name() const override { return "no-gradient"; }
  std::int64_t heads() const override { return 2; }
  std::int64_t parameter_count() const override { return 1; }
  double value(std::int64_t /* head */, std::int64_t q, std::int64_t k) const override {
    return -0.1 * static_cast<double>(q - k);
  }
};

TEST(GenericBias, ASchemeWithoutAGradientIsRefusedByName) {
  const Problem p = make_problem(1, 8, 8, 2, 1, 16);
  AttentionSpec spec = spec_of(p);
  const auto scheme = std::make_shared<NoGradient>();
  spec.groups = {HeadGroup{2, {}, PositionBiasRef(scheme)}};
  testing::expect_error([&] { Attention{spec}; },
                        {"no-gradient", "overrides neither", "accumulate_gradient or reference_backward"});
  std::vector<float> ds(2 * 3 * 3, 1.0f);
  std::vector<double> grads(1, 0.0);
  const Positions pos = Positions::range(3);
  testing::expect_error(
      [&] {
        scheme->reference_backward(pos, pos, TensorView::of(ds.data(), {2, 3, 3}), grads);
      },
      {"no-gradient", "overrides neither", "accumulate_gradient or reference_backward"});
  // Its value alone still materialises.
  std::vector<float> out(2 * 3 * 3);
  bias_materialize(BiasScheme(PositionBiasRef(scheme)), pos, pos, TensorView::of(out.data(), {2, 3, 3}));
  EXPECT_EQ(out[1], 0.1f);
}

// BiasScheme is open: a scheme of one's own converts to it by value as the library's do, is found
// again by its type, and is shared (not copied) by copies of the BiasScheme.
TEST(GenericBias, ASchemeOfOnesOwnIsABiasSchemeByValue) {
  const BiasScheme own = QueryScaledLog({0.5, 2.0});
  ASSERT_NE(own.get_if<QueryScaledLog>(), nullptr);
  EXPECT_EQ(own.get_if<FireParams>(), nullptr);
  EXPECT_EQ(own.relative(), nullptr);
  EXPECT_EQ(own.heads(), 2);
  EXPECT_EQ(bias_parameter_count(own), 2);
  const BiasScheme copy = own;  // NOLINT(performance-unnecessary-copy-initialization)
  EXPECT_EQ(copy.position(), own.position());
  EXPECT_EQ(bias_value(own, 1, 3, 0), own.get_if<QueryScaledLog>()->value(1, 3, 0));

  const BiasScheme alibi = AlibiParams(4), none = NoPE(3);
  ASSERT_NE(alibi.get_if<AlibiParams>(), nullptr);
  EXPECT_EQ(alibi.get_if<KerpleParams>(), nullptr);
  EXPECT_EQ(alibi.position(), nullptr);
  EXPECT_TRUE(none.is_none());
  EXPECT_EQ(none.heads(), 3);
  EXPECT_EQ(bias_parameter_count(none), 0);
  testing::expect_error([] { const BiasScheme null{RelativeBiasRef()}; },
                        {"RelativeBiasRef = null", "a scheme object"});

  // The per-pair gradient's default checks the head it is given.
  std::vector<double> grads(1, 0.0);
  const NoGradient no_gradient;
  testing::expect_error([&] { no_gradient.PositionBias::accumulate_gradient(2, 0, 0, 1.0, grads); },
                        {"PositionBias::accumulate_gradient", "head = 2", "in [0, 2)"});
}

// A definition that throws (a position it cannot take, found only pair by pair) inside the
// engine's threads: the call throws that posenc::Error, on one thread or several, in forward,
// decode and backward, and the next call runs.
class FailsPast final : public PositionBias {
 public:
  FailsPast(std::int64_t value_from, std::int64_t gradient_from)
      : value_from_(value_from), gradient_from_(gradient_from) {}
  std::string_view scheme_name() const override { return "fails-past"; }
  std::int64_t heads() const override { return 2; }
  std::int64_t parameter_count() const override { return 1; }
  double value(std::int64_t /* head */, std::int64_t q, std::int64_t k) const override {
    if (q >= value_from_) throw Error("fails-past", "q_position", std::to_string(q), "a value's position");
    return -0.1 * static_cast<double>(q - k);
  }
  void accumulate_gradient(std::int64_t /* head */, std::int64_t q, std::int64_t k, double weight,
                           std::span<double> grads) const override {
    if (q >= gradient_from_ && weight != 0.0) {
      throw Error("fails-past", "q_position", std::to_string(q), "a gradient's position");
    }
    grads[0] -= weight * 0.1 * static_cast<double>(q - k);
  }

 private:
  std::int64_t value_from_, gradient_from_;
};

TEST(GenericBias, AnErrorOfTheDefinitionReachesTheCallerFromTheEnginesThreads) {
  const auto spec_with = [](const Problem& p, std::int64_t value_from, std::int64_t gradient_from) {
    AttentionSpec spec = spec_of(p);
    spec.mask.causal = true;
    spec.groups = {HeadGroup{2, {}, PositionBiasRef(std::make_shared<FailsPast>(value_from, gradient_from))}};
    return spec;
  };
  const Problem p = make_problem(2, 300, 300, 2, 1, 16), d = make_problem(4, 1, 5000, 2, 1, 16);
  const std::vector<double> d_out = random_values(static_cast<std::size_t>(p.q_count()));
  for (const int threads : {1, 2}) {
    SCOPED_TRACE("threads " + std::to_string(threads));
    set_num_threads(threads);
    const Attention forward(spec_with(p, 250, 1 << 30)), backward(spec_with(p, 1 << 30, 100));
    testing::expect_error([&] { (void)run_forward(p, forward, 0); }, {"fails-past", "a value's position"});
    testing::expect_error([&] { (void)run_backward(p, backward, d_out, 0); }, {"fails-past", "a gradient's position"});
    testing::expect_error([&] { (void)run_forward(d, Attention(spec_with(d, 4000, 1 << 30)), 0); },
                          {"fails-past", "q_position = 4999"});
    // The engine's per-thread scratch serves the next call after the error.
    const Problem small = make_problem(1, 50, 50, 2, 1, 16);
    const Attention fine(spec_with(small, 250, 100));
    expect_backward_matches_reference(small, fine, random_values(static_cast<std::size_t>(small.q_count())));
  }
  set_num_threads(2);
}

// A transform of q and k written outside the library, given by its fp64 definition only. A
// rotation whose angle grows with log(1 + p) rather than p, on the entries [4, 4 + 2·pairs) of
// each head, optionally scaled as xPos (s^p on queries, s^−p on keys):
class LogRotation final : public QKTransformScheme {
 public:
  LogRotation(std::int64_t dim, std::int64_t pairs, bool interleaved, bool scaled)
      : dim_(dim), pairs_(pairs), interleaved_(interleaved), scaled_(scaled) {}
  std::string_view scheme_name() const override { return "log-rotation"; }
  Form form() const override { return Form::kRotation; }
  std::int64_t head_dim() const override { return dim_; }
  std::int64_t rotary_pairs() const override { return pairs_; }
  std::int64_t rotary_offset() const override { return 4; }
  bool interleaved() const override { return interleaved_; }
  double angle(std::int64_t p, std::int64_t i) const override {
    return 6.0 * std::log1p(std::fabs(static_cast<double>(p))) * std::pow(100.0, -static_cast<double>(i) / pairs_);
  }
  bool scaled() const override { return scaled_; }
  double scale(std::int64_t p, std::int64_t i) const override {
    return std::pow(0.9 + 0.2 * static_cast<double>(i) / pairs_, static_cast<double>(p) / 512.0);
  }

 private:
  std::int64_t dim_, pairs_;
  bool interleaved_, scaled_;
};

// A row added to q and k (Shortformer's form): sin(0.07·p·(j + 1)) / 2.
class SineRows final : public QKTransformScheme {
 public:
  explicit SineRows(std::int64_t dim) : dim_(dim) {}
  std::string_view scheme_name() const override { return "sine-rows"; }
  Form form() const override { return Form::kAddition; }
  std::int64_t head_dim() const override { return dim_; }
  void addition(std::int64_t p, std::span<double> row) const override {
    for (std::size_t j = 0; j < row.size(); ++j) row[j] = 0.5 * std::sin(0.07 * static_cast<double>(p) * (j + 1.0));
  }

 private:
  std::int64_t dim_;
};

TEST(GenericTransform, ATransformDefinedOutsideTheLibraryRunsFusedInEveryPass) {
  for (const bool interleaved : {false, true}) {
    for (const bool scaled : {false, true}) {
      SCOPED_TRACE(std::string(interleaved ? "interleaved" : "half-split") + (scaled ? ", scaled" : ""));
      const QKTransformRef rotation = std::make_shared<LogRotation>(32, 10, interleaved, scaled);
      const Problem p = make_problem(2, 40, 40, 4, 2, 32);
      AttentionSpec spec = spec_of(p);
      spec.mask.causal = true;
      spec.groups = {HeadGroup{4, rotation, {}}};
      expect_accurate(p, spec, "forward");
      expect_backward_matches_reference(p, Attention(spec), random_values(static_cast<std::size_t>(p.q_count())));
      // Decode over chunks of 9000 keys (rotated as the cache is read), packed beside ALiBi.
      const Problem d = make_problem(2, 1, 9000, 4, 2, 32);
      AttentionSpec ds = spec_of(d);
      ds.groups = spec.groups;
      expect_accurate(d, ds, "decode");
      Problem packed = make_packed({{30, 30}, {1, 1}, {50, 50}}, 4, 2, 32);
      AttentionSpec ps = spec_of(packed);
      ps.mask.causal = true;
      ps.groups = {HeadGroup{2, {}, AlibiParams(2)}, HeadGroup{2, rotation, {}}};
      expect_accurate(packed, ps, "packed, beside ALiBi");
      expect_backward_matches_reference(packed, Attention(ps),
                                        random_values(static_cast<std::size_t>(packed.q_count())));
      const Attention dec(ds);
      expect_same_bits_for_any_thread_count(p, Attention(spec), d, &dec);
    }
  }
  const QKTransformRef rows = std::make_shared<SineRows>(16);
  const Problem p = make_problem(2, 33, 33, 4, 2, 16), d = make_problem(2, 1, 9000, 4, 2, 16);
  AttentionSpec spec = spec_of(p), ds = spec_of(d);
  spec.mask.causal = true;
  spec.groups = ds.groups = {HeadGroup{4, rows, {}}};
  expect_accurate(p, spec, "addition");
  expect_backward_matches_reference(p, Attention(spec), random_values(static_cast<std::size_t>(p.q_count())));
  expect_accurate(d, ds, "addition, decode");
}

// RoPE written as a definition, θ(p, i) = p·10000^(−2i/d), held by reference beside ALiBi, runs as
// the built-in RoPE does: the same outputs and gradients to within their f32 tables' rounding.
class RopeByDefinition final : public QKTransformScheme {
 public:
  RopeByDefinition(std::int64_t dim, bool interleaved) : dim_(dim), interleaved_(interleaved) {}
  std::string_view scheme_name() const override { return "rope-by-definition"; }
  Form form() const override { return Form::kRotation; }
  std::int64_t head_dim() const override { return dim_; }
  bool interleaved() const override { return interleaved_; }
  double angle(std::int64_t p, std::int64_t i) const override {
    return static_cast<double>(p) * std::pow(10000.0, -2.0 * static_cast<double>(i) / static_cast<double>(dim_));
  }

 private:
  std::int64_t dim_;
  bool interleaved_;
};

TEST(GenericTransform, RopeByItsDefinitionMatchesTheBuiltInRope) {
  const Problem p = make_problem(2, 29, 41, 4, 2, 32);
  const std::vector<double> d_out = random_values(static_cast<std::size_t>(p.q_count()));
  for (const bool interleaved : {false, true}) {
    SCOPED_TRACE(interleaved ? "interleaved" : "half-split");
    AttentionSpec mine = spec_of(p), builtin = spec_of(p);
    mine.mask.causal = builtin.mask.causal = true;
    mine.groups = {{2, QKTransformRef(std::make_shared<RopeByDefinition>(32, interleaved)), AlibiParams(2)},
                   {2, {}, {}}};
    builtin.groups = {
        {2, RotaryQK{RopeParams(32, 32, 10000.0, interleaved ? RopeLayout::kInterleaved : RopeLayout::kHalfSplit)},
         AlibiParams(2)},
        {2, {}, {}}};
    const Attention a(mine), b(builtin);
    const Outputs x = run_forward(p, a, 0), y = run_forward(p, b, 0);
    ASSERT_EQ(x.out.size(), y.out.size());
    for (std::size_t i = 0; i < x.out.size(); ++i) EXPECT_NEAR(x.out[i], y.out[i], 1e-5) << i;
    const Grads gx = run_backward(p, a, d_out, false), gy = run_backward(p, b, d_out, false);
    for (std::size_t i = 0; i < gx.dq.size(); ++i) EXPECT_NEAR(gx.dq[i], gy.dq[i], 1e-4) << i;
    for (std::size_t i = 0; i < gx.dk.size(); ++i) EXPECT_NEAR(gx.dk[i], gy.dk[i], 1e-4) << i;
  }
  AttentionSpec null = spec_of(p);
  null.groups = {{4, QKTransformRef(), {}}};
  testing::expect_error([&] { Attention{null}; }, {"groups[0].transform = null", "a QKTransformScheme"});
}

// What a definition cannot be is refused by name, from the engine's threads too.
class BadRotation final : public QKTransformScheme {
 public:
  BadRotation(std::int64_t pairs, std::int64_t bad_position, double scale)
      : pairs_(pairs), bad_(bad_position), scale_(scale) {}
  std::string_view scheme_name() const override { return "bad-rotation"; }
  Form form() const override { return Form::kRotation; }
  std::int64_t head_dim() const override { return 16; }
  std::int64_t rotary_pairs() const override { return pairs_; }
  double angle(std::int64_t p, std::int64_t /* i */) const override {
    return p == bad_ ? std::numeric_limits<double>::quiet_NaN() : 0.01 * static_cast<double>(p);
  }
  bool scaled() const override { return scale_ != 1.0; }
  double scale(std::int64_t /* p */, std::int64_t /* i */) const override { return scale_; }

 private:
  std::int64_t pairs_, bad_;
  double scale_;
};

class Undefined final : public QKTransformScheme {
 public:
  std::string_view scheme_name() const override { return "undefined"; }
  Form form() const override { return Form::kRotation; }
  std::int64_t head_dim() const override { return 16; }
};

TEST(GenericTransform, WhatADefinitionCannotBeIsRefusedByName) {
  const auto run = [](std::int64_t dim, const QKTransformRef& t, bool reference) {
    const Problem p = make_problem(1, 3000, 3000, 2, 1, dim);
    AttentionSpec spec = spec_of(p);
    spec.mask.causal = true;
    spec.groups = {HeadGroup{2, t, {}}};
    (void)run_forward(p, Attention(spec), reference ? 1 : 0);
  };
  const auto bad = [](std::int64_t pairs, std::int64_t position, double scale) -> QKTransformRef {
    return std::make_shared<BadRotation>(pairs, position, scale);
  };
  for (const bool reference : {false, true}) {
    SCOPED_TRACE(reference ? "reference" : "fused");
    testing::expect_error([&] { run(32, bad(8, -1, 1.0), reference); },
                          {"bad-rotation", "head_dim()", "= 16", "the head_dim of q, 32"});
    testing::expect_error([&] { run(16, bad(2777, -1, 1.0), reference); }, {"bad-rotation", "2777"});
    testing::expect_error([&] { run(16, bad(8, 2500, 1.0), reference); },
                          {"bad-rotation", "angle(2500, 0)", "nan", "finite"});
    testing::expect_error([&] { run(16, bad(8, -1, -2.0), reference); },
                          {"bad-rotation", "scale(0, 0)", "-2", "finite and > 0"});
    testing::expect_error([&] { run(16, std::make_shared<Undefined>(), reference); },
                          {"QKTransformScheme::angle", "undefined", "a rotation (form() kRotation) that defines it"});
  }
  // The engine serves the next call.
  run(16, bad(8, -1, 1.0), false);
}

}  // namespace
}  // namespace posenc
