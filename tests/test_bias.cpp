// Score biases: ALiBi slopes against independently written formulas (every H in 1..256), T5
// buckets against PyTorch's (every relative position in [-2^20, 2^20], four settings, both
// directions), materialisation on every target against the fp64 reference (schemes × positions ×
// dtypes × strides), gradients against the reference and finite differences, determinism across
// thread counts, the evaluator, and errors.
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "testing.hpp"

namespace posenc {
namespace {

using testing::element;
using testing::EveryTarget;
using testing::expect_error;
using testing::uniform;
using testing::uniform_int;

// ------------------------------------------------------------------------------ ALiBi slopes

// The paper's construction, written the other way round: a geometric sequence for a power of
// two (start 2^(-8/n), ratio = start), and for other H the sequence of the lower power of two
// followed by every other member of the sequence for twice that, cut to H.
std::vector<double> paper_slopes(std::int64_t heads) {
  auto geometric = [](std::int64_t n) {
    const double start = std::pow(2.0, -8.0 / static_cast<double>(n));
    std::vector<double> s;
    for (std::int64_t i = 0; i < n; ++i) s.push_back(std::pow(start, static_cast<double>(i + 1)));
    return s;
  };
  const auto lower = static_cast<std::int64_t>(std::pow(2.0, std::floor(std::log2(static_cast<double>(heads)))));
  std::vector<double> slopes = geometric(lower);
  const std::vector<double> twice = geometric(2 * lower);
  for (std::size_t i = 0; static_cast<std::int64_t>(slopes.size()) < heads; i += 2) slopes.push_back(twice[i]);
  return slopes;
}

TEST(Alibi, SlopesFollowThePaperForEveryHeadCount) {
  for (std::int64_t heads = 1; heads <= 256; ++heads) {
    const std::vector<double> got = alibi_slopes(heads), want = paper_slopes(heads);
    ASSERT_EQ(got.size(), want.size());
    // pow(start, h + 1) of a rounded start carries h + 1 times start's relative rounding error
    // (2^-53 ≈ 1.1e-16) plus pow's own: (h + 1)·2e-15 bounds it with room; exp2 is near exact.
    for (std::size_t h = 0; h < got.size(); ++h)
      ASSERT_NEAR(got[h], want[h], 2e-15 * want[h] * static_cast<double>(h + 1)) << heads << " heads, head " << h;
  }
  const std::vector<double> eight = alibi_slopes(8);
  for (std::size_t h = 0; h < 8; ++h) EXPECT_EQ(eight[h], std::ldexp(1.0, -static_cast<int>(h + 1)));  // 1/2 … 1/256
}

// llama.cpp's generalisation: m0 = 2^(-max_bias/n), m1 = 2^(-max_bias/2/n), head h < n gets
// m0^(h+1), the others m1^(2(h-n)+1).
TEST(Alibi, MaxBiasGeneralisation) {
  for (const double max_bias : {8.0, 16.0, 4.5, 0.25}) {
    for (std::int64_t heads = 1; heads <= 256; ++heads) {
      const double n = std::pow(2.0, std::floor(std::log2(static_cast<double>(heads))));
      const double m0 = std::pow(2.0, -max_bias / n), m1 = std::pow(2.0, -max_bias / 2.0 / n);
      const std::vector<double> got = alibi_slopes(heads, max_bias);
      for (std::int64_t h = 0; h < heads; ++h) {
        const double want =
            h < n ? std::pow(m0, static_cast<double>(h + 1)) : std::pow(m1, 2.0 * (static_cast<double>(h) - n) + 1);
        // pow of a rounded base to an integer power: up to ~(exponent)·2^-53 relative.
        ASSERT_NEAR(got[static_cast<std::size_t>(h)], want, 1e-13 * want) << max_bias << ", " << heads << ", " << h;
      }
    }
  }
}

TEST(Alibi, SubsetOfHeadsAndCustomSlopes) {
  const std::vector<std::int64_t> heads = {5, 1, 2, 6};
  const AlibiParams p = AlibiParams::on_heads(8, heads);
  const std::vector<double> four = alibi_slopes(4);
  EXPECT_EQ(p.slopes(), (std::vector<double>{0, four[1], four[2], 0, 0, four[0], four[3], 0}));
  EXPECT_EQ(bias_value(p, 0, -100), 0.0);
  EXPECT_EQ(bias_value(p, 5, -100), -100 * four[0]);  // causal: −m·(i − j) with j − i = −100
  const AlibiParams sym(std::vector<double>{0.5}, AlibiForm::kSymmetric);
  EXPECT_EQ(bias_value(sym, 0, 7), -3.5);
  EXPECT_EQ(bias_value(sym, 0, -7), -3.5);
  expect_error([] { AlibiParams(std::vector<double>{0.5, -1.0}); }, {"AlibiParams: slopes[1] = -1", ">= 0"});
  expect_error([] { AlibiParams(std::vector<double>{}); }, {"slopes.size() = 0"});
  expect_error([] { AlibiParams(0); }, {"alibi_slopes: heads = 0", ">= 1"});
  expect_error([] { alibi_slopes(4, 0.0); }, {"max_bias = 0", "> 0"});
  expect_error(
      [&] {
        const std::vector<std::int64_t> twice = {1, 1};
        AlibiParams::on_heads(4, twice);
      },
      {"alibi_heads[1] = 1", "listed once"});
  expect_error(
      [&] {
        const std::vector<std::int64_t> out = {4};
        AlibiParams::on_heads(4, out);
      },
      {"alibi_heads[0] = 4", "[0, 4)"});
}

// ALiBi's and T5's rows (RelativeBias::tabulate, which the fused attention's tables read) are
// value()'s bits, both forms, across r = 0 and far out.
TEST(RelativeBias, AlibiAndT5RowsAreTheirValuesBits) {
  std::vector<double> table(32 * 5);
  for (std::size_t i = 0; i < table.size(); ++i) table[i] = uniform(-3.0, 3.0);
  const std::vector<std::shared_ptr<const RelativeBias>> schemes = {
      std::make_shared<AlibiParams>(5),
      std::make_shared<AlibiParams>(std::vector<double>{0.5, 0.0, 1.0 / 3.0}, AlibiForm::kSymmetric),
      std::make_shared<T5BiasParams>(5, 32, 128, true, table),
      std::make_shared<T5BiasParams>(5, 32, 128, false, table)};
  for (const auto& s : schemes) {
    for (const std::int64_t first : {std::int64_t{-300}, std::int64_t{-70000}, std::int64_t{1} << 40}) {
      const std::int64_t count = 700;
      std::vector<double> rows(static_cast<std::size_t>(s->heads() * count));
      s->tabulate(first, count, rows.data());
      for (std::int64_t h = 0; h < s->heads(); ++h) {
        for (std::int64_t t = 0; t < count; ++t) {
          ASSERT_EQ(rows[static_cast<std::size_t>(h * count + t)], s->value(h, first + t))
              << s->scheme_name() << " head " << h << " r " << first + t;
        }
      }
    }
  }
}

// ------------------------------------------------------------------------------ T5 buckets

// tests/data/t5_buckets_torch.txt: PyTorch's buckets as runs (scripts/gen_t5_bucket_goldens.py).
TEST(T5, BucketsEqualTransformersEverywhereInTwoToTheTwenty) {
  std::ifstream file(std::string(POSENC_TEST_DATA_DIR) + "/t5_buckets_torch.txt");
  ASSERT_TRUE(file) << "missing tests/data/t5_buckets_torch.txt";
  struct Run {
    std::int64_t first, bucket;
  };
  struct Setting {
    std::int64_t num_buckets, max_distance;
    bool bidirectional;
    std::vector<Run> runs;
  };
  std::vector<Setting> settings;
  std::string line;
  while (std::getline(file, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream in(line);
    if (line.rfind("setting", 0) == 0) {
      std::string word;
      int bidirectional = 0;
      Setting s{};
      in >> word >> s.num_buckets >> s.max_distance >> bidirectional;
      s.bidirectional = bidirectional != 0;
      settings.push_back(s);
    } else {
      Run r{};
      in >> r.first >> r.bucket;
      settings.back().runs.push_back(r);
    }
  }
  ASSERT_EQ(settings.size(), 8u);  // (32,128) (32,256) (64,256) (128,512), both directions
  constexpr std::int64_t kLimit = std::int64_t{1} << 20;
  for (const Setting& s : settings) {
    std::int64_t mismatches = 0;
    for (std::size_t k = 0; k < s.runs.size(); ++k) {
      const std::int64_t last = k + 1 < s.runs.size() ? s.runs[k + 1].first - 1 : kLimit;
      for (std::int64_t r = s.runs[k].first; r <= last; ++r) {
        const std::int64_t got = t5_bucket(r, s.num_buckets, s.max_distance, s.bidirectional);
        if (got != s.runs[k].bucket && mismatches++ < 5) {
          ADD_FAILURE() << "num_buckets " << s.num_buckets << ", max_distance " << s.max_distance << ", bidirectional "
                        << s.bidirectional << ": bucket(" << r << ") = " << got << ", transformers "
                        << s.runs[k].bucket;
        }
      }
    }
    EXPECT_EQ(mismatches, 0);
  }
}

TEST(T5, RejectsInvalidSettings) {
  expect_error([] { t5_bucket(3, 1, 128, false); }, {"t5_bucket: num_buckets = 1", ">= 2"});
  expect_error([] { t5_bucket(3, 3, 128, true); }, {"num_buckets = 3", ">= 4 for bidirectional"});
  expect_error([] { t5_bucket(3, 32, 8, true); }, {"max_distance = 8", "> max_exact = 8"});
  expect_error([] { T5BiasParams(0); }, {"T5BiasParams: heads = 0"});
  expect_error([] { T5BiasParams(2, 32, 128, true, std::vector<double>(10)); },
               {"table.size() = 10", "num_buckets · heads = 64"});
  EXPECT_EQ(t5_bucket(-5, 2, 2, false), 1);  // smallest causal setting: max_exact 1, one log bucket
}

// ------------------------------------------------------------------------------ schemes

BiasScheme random_scheme(int kind, std::int64_t heads) {
  switch (kind) {
    case 0:
      return NoPE(heads);
    case 1:
      return AlibiParams(heads, uniform_int(0, 1) ? AlibiForm::kCausal : AlibiForm::kSymmetric, uniform(2, 10));
    case 2: {
      std::vector<std::int64_t> subset;
      for (std::int64_t h = 0; h < heads; h += 2) subset.push_back(h);
      return AlibiParams::on_heads(heads, subset, AlibiForm::kCausal);
    }
    case 3: {
      const std::int64_t nb = uniform_int(0, 1) ? 32 : 64;
      std::vector<double> table(static_cast<std::size_t>(nb * heads));
      for (auto& v : table) v = uniform(-3, 3);
      return T5BiasParams(heads, nb, nb == 32 ? 128 : 256, uniform_int(0, 1) == 1, table);
    }
    case 7:
      return TupeParams::init(heads, uniform_int(1, 5), uniform_int(1, 6), 3100, uniform_int(0, 1) == 1, 0.5,
                              static_cast<std::uint64_t>(uniform_int(0, 1000)));
    case 6:
      return FireParams::init(heads, uniform_int(1, 40), static_cast<std::uint64_t>(uniform_int(0, 1000)),
                              uniform(0.01, 3), uniform(1, 100));
    default: {
      std::vector<double> r1(static_cast<std::size_t>(heads)), r2(r1.size());
      const bool power = kind == 5;
      for (auto& v : r1) v = uniform(0.1, 3);
      for (auto& v : r2) v = power ? uniform(0.05, 2) : uniform(0.01, 4);
      return KerpleParams(power ? KerpleForm::kPower : KerpleForm::kLog, r1, r2);
    }
  }
}

struct GridCase {
  std::int64_t batch, heads, q_len, k_len;
  int position_kind;  // 0: ranges with a cache offset, 1: shared range, 2: ids, 3: scattered ids, 4: packed
  std::vector<std::int64_t> q_ids, k_ids, starts, cu;
};

GridCase random_grid() {
  GridCase c{};
  c.position_kind = static_cast<int>(uniform_int(0, 4));
  c.batch = c.position_kind == 4 ? 1 : uniform_int(1, 2);
  c.heads = uniform_int(1, 5);
  c.q_len = uniform_int(1, 23);
  c.k_len = c.position_kind == 4 ? c.q_len : uniform_int(1, 41);
  for (std::int64_t b = 0; b < c.batch; ++b) c.starts.push_back(uniform_int(0, 3000));
  const std::int64_t spread = c.position_kind == 3 ? std::int64_t{1} << 34 : 200;
  for (std::int64_t t = 0; t < c.batch * c.q_len; ++t) c.q_ids.push_back(uniform_int(0, spread));
  for (std::int64_t t = 0; t < c.batch * c.k_len; ++t) c.k_ids.push_back(uniform_int(0, spread));
  c.cu = {0};
  while (c.cu.back() < c.q_len) c.cu.push_back(std::min(c.q_len, c.cu.back() + uniform_int(1, 7)));
  return c;
}

// Finite differences and position-indexed tables need moderate distances: scattered ids (kind 3)
// become ids below 200 (kind 2).
void with_moderate_ids(GridCase& c) {
  if (c.position_kind != 3) return;
  c.position_kind = 2;
  for (auto& id : c.q_ids) id %= 200;
  for (auto& id : c.k_ids) id %= 200;
}

std::pair<Positions, Positions> positions_of(const GridCase& c) {
  switch (c.position_kind) {
    case 0:
      return {Positions::ranges(c.starts, c.q_len), Positions::ranges(c.starts, c.k_len)};  // per-row offsets
    case 1:
      return {Positions::range(c.q_len, c.k_len), Positions::range(c.k_len)};  // queries after the cache
    case 4:
      return {Positions::packed(c.cu), Positions::packed(c.cu)};
    default:
      return {Positions::ids(c.q_ids, c.batch, c.q_len), Positions::ids(c.k_ids, c.batch, c.k_len)};
  }
}

TEST_P(EveryTarget, BiasMaterializeMatchesReference) {
  const DType dtypes[] = {DType::kF32, DType::kF32, DType::kBF16, DType::kF16, DType::kF64};
  for (int trial = 0; trial < 60; ++trial) {
    const GridCase c = random_grid();
    const auto [qp, kp] = positions_of(c);
    // TUPE indexes a table by position: not with the scattered ids of kind 3.
    const BiasScheme scheme = random_scheme(static_cast<int>(uniform_int(0, c.position_kind == 3 ? 6 : 7)), c.heads);
    const bool fire = scheme.get_if<FireParams>() != nullptr;
    const DType dtype = dtypes[uniform_int(0, 4)];
    const bool rank3 = c.batch == 1 && uniform_int(0, 1) == 1;
    const bool keys_strided = uniform_int(0, 2) == 0;  // storage [B, H, Sk, Sq]: keys not innermost
    const std::int64_t count = c.batch * c.heads * c.q_len * c.k_len;
    std::vector<std::int64_t> shape = {c.batch, c.heads, c.q_len, c.k_len};
    std::vector<std::int64_t> strides =
        keys_strided ? std::vector<std::int64_t>{c.heads * c.q_len * c.k_len, c.q_len * c.k_len, 1, c.q_len}
                     : std::vector<std::int64_t>{c.heads * c.q_len * c.k_len, c.q_len * c.k_len, c.k_len, 1};
    if (rank3) {
      shape.erase(shape.begin());
      strides.erase(strides.begin());
    }
    std::vector<unsigned char> got = testing::garbage_buffer(dtype, count);
    std::vector<double> want(static_cast<std::size_t>(count));
    bias_materialize(scheme, qp, kp, TensorView(got.data(), dtype, shape, strides));
    ref::bias_materialize(scheme, qp, kp, TensorView(want.data(), DType::kF64, shape, strides));
    // f32: the tabulated fp64 value rounded once (the evaluator's tables) — exactly (float)want.
    // bf16/f16: rounded to nearest through f32: half a unit in the last place of the 16-bit type
    // (2^-8 relative for bf16's 8 significant bits, 2^-11 for f16's 11), plus the f32 step's
    // 2^-24 (double rounding). f64: the reference path itself.
    const double rel = dtype == DType::kBF16  ? std::ldexp(1.0, -8) + std::ldexp(1.0, -24)
                       : dtype == DType::kF16 ? std::ldexp(1.0, -11) + std::ldexp(1.0, -24)
                                              : 0.0;
    int reported = 0;
    for (std::int64_t e = 0; e < count; ++e) {
      const double w = want[static_cast<std::size_t>(e)], g = element(got.data(), dtype, e);
      // Biases beyond a 16-bit type's range (Kerple at scattered ids) round to ±infinity.
      const double max16 = dtype == DType::kF16 ? 65504.0 + 16.0 : dtype == DType::kBF16 ? 3.3961e38 : HUGE_VAL;
      const double expected = dtype == DType::kF32    ? static_cast<double>(static_cast<float>(w))
                              : std::fabs(w) >= max16 ? std::copysign(HUGE_VAL, w)
                                                      : w;
      double tol =
          dtype == DType::kF16 && std::fabs(w) < 6.2e-5 ? 6e-8 : rel * std::fabs(w);  // f16 subnormals: absolute
      // FIRE's fast path sums the pieces' slope·x + intercept, the reference the MLP's units: both
      // fp64, apart by ~1e-15 of the units' magnitudes (W's ~ N(0, 1), |x| <= ~10), which can move
      // the f32 rounding by one unit: 2^-23 relative plus 1e-12 absolute.
      if (fire) tol += std::ldexp(std::fabs(w), -23) + 1e-12;
      if (!(g == expected || std::fabs(g - expected) <= tol) && reported++ < 5) {
        ADD_FAILURE() << "trial " << trial << " kind " << c.position_kind << " " << dtype_name(dtype) << " element "
                      << e << ": got " << g << ", reference " << w;
      }
    }
  }
}

// Finite differences of L = Σ w·b over the materialised fp64 bias, per learned parameter.
template <class Make>
double finite_difference(const Make& make, const GridCase& c, const Positions& qp, const Positions& kp,
                         const std::vector<double>& w, double step) {
  const std::vector<std::int64_t> shape = {c.batch, c.heads, c.q_len, c.k_len};
  auto loss = [&](double delta) {
    std::vector<double> b(w.size());
    ref::bias_materialize(make(delta), qp, kp, TensorView::contiguous(b.data(), DType::kF64, shape));
    double sum = 0;
    for (std::size_t e = 0; e < w.size(); ++e) sum += w[e] * b[e];
    return sum;
  };
  return (loss(step) - loss(-step)) / (2 * step);
}

TEST_P(EveryTarget, BiasBackwardMatchesReferenceAndFiniteDifferences) {
  for (int trial = 0; trial < 30; ++trial) {
    GridCase c = random_grid();
    with_moderate_ids(c);
    const auto [qp, kp] = positions_of(c);
    const std::int64_t count = c.batch * c.heads * c.q_len * c.k_len;
    const std::vector<std::int64_t> shape = {c.batch, c.heads, c.q_len, c.k_len};
    std::vector<double> w(static_cast<std::size_t>(count));
    for (auto& v : w) v = uniform(-1, 1);
    const bool f32 = uniform_int(0, 1) == 1;
    std::vector<float> w32(w.begin(), w.end());
    if (f32) std::copy(w32.begin(), w32.end(), w.begin());  // the same values in both dtypes
    const ConstTensorView ds = f32 ? ConstTensorView::contiguous(w32.data(), DType::kF32, shape)
                                   : ConstTensorView::contiguous(w.data(), DType::kF64, shape);
    const auto h = static_cast<std::size_t>(uniform_int(0, c.heads - 1));
    // Agreement with the reference: both sum the same products in fp64, in different orders:
    // within 1e-12 of Σ|terms| (n·2^-53 for n <= 1e4 terms per sum, with room).
    double abs_sum = 0;
    auto close = [&](double got, double want, const char* what) {
      EXPECT_NEAR(got, want, 1e-12 * (abs_sum + 1)) << what << ", trial " << trial;
    };
    const int kind = static_cast<int>(uniform_int(0, 2));
    if (kind == 0) {
      const AlibiParams p(c.heads, uniform_int(0, 1) ? AlibiForm::kCausal : AlibiForm::kSymmetric);
      std::vector<double> got(static_cast<std::size_t>(c.heads), 0.5), want(got.size(), 0.5);  // += onto 0.5
      alibi_backward(p, qp, kp, ds, got);
      ref::alibi_backward(p, qp, kp, ds, want);
      abs_sum = static_cast<double>(count) * 6000;
      close(got[h], want[h], "alibi");
      auto make = [&](double delta) {
        std::vector<double> s = p.slopes();
        s[h] += delta;
        return BiasScheme(AlibiParams(s, p.form()));
      };
      // Linear in the slope: central differences are exact up to rounding of L (|L| <= 1e7·2^-52).
      EXPECT_NEAR(want[h] - 0.5, finite_difference(make, c, qp, kp, w, 1e-3), 1e-6 * (std::fabs(want[h]) + 1)) << trial;
    } else if (kind == 1) {
      std::vector<double> table(static_cast<std::size_t>(32 * c.heads));
      for (auto& v : table) v = uniform(-1, 1);
      const T5BiasParams p(c.heads, 32, 128, uniform_int(0, 1) == 1, table);
      std::vector<double> got(table.size(), 0.0), want(table.size(), 0.0);
      t5_bias_backward(p, qp, kp, ds, got);
      ref::t5_bias_backward(p, qp, kp, ds, want);
      abs_sum = static_cast<double>(count);
      for (std::size_t e = 0; e < got.size(); ++e) close(got[e], want[e], "t5");
      const auto entry = static_cast<std::size_t>(uniform_int(0, 31) * c.heads) + h;
      auto make = [&](double delta) {
        std::vector<double> t = table;
        t[entry] += delta;
        return BiasScheme(T5BiasParams(c.heads, 32, 128, p.bidirectional(), t));
      };
      // L is linear in the table: the central difference is exact but for the rounding of L
      // (|L| <= count <= ~1e4, 2^-52 each) divided by the step 0.5: well under 1e-9.
      EXPECT_NEAR(want[entry], finite_difference(make, c, qp, kp, w, 0.25), 1e-9) << trial;
    } else {
      std::vector<double> r1(static_cast<std::size_t>(c.heads)), r2(r1.size());
      const bool power = uniform_int(0, 1) == 1;
      for (auto& v : r1) v = uniform(0.2, 2);
      for (auto& v : r2) v = power ? uniform(0.2, 1.8) : uniform(0.05, 2);
      const KerpleParams p(power ? KerpleForm::kPower : KerpleForm::kLog, r1, r2);
      std::vector<double> g1(r1.size(), 0.0), g2(r1.size(), 0.0), w1(r1.size(), 0.0), w2(r1.size(), 0.0);
      kerple_backward(p, qp, kp, ds, g1, g2);
      ref::kerple_backward(p, qp, kp, ds, w1, w2);
      abs_sum = static_cast<double>(count) * 1e5;
      close(g1[h], w1[h], "kerple r1");
      close(g2[h], w2[h], "kerple r2");
      auto make1 = [&](double delta) {
        std::vector<double> a = r1;
        a[h] += delta;
        return BiasScheme(KerpleParams(p.form(), a, r2));
      };
      auto make2 = [&](double delta) {
        std::vector<double> a = r2;
        a[h] += delta;
        return BiasScheme(KerpleParams(p.form(), r1, a));
      };
      // Central differences with step 1e-5: truncation error ~ step²·|∂³L| plus rounding
      // |L|·2^-52/step; relative 1e-6 covers both for these parameter ranges.
      EXPECT_NEAR(w1[h], finite_difference(make1, c, qp, kp, w, 1e-5), 1e-6 * (std::fabs(w1[h]) + 1)) << trial;
      EXPECT_NEAR(w2[h], finite_difference(make2, c, qp, kp, w, 1e-5), 1e-6 * (std::fabs(w2[h]) + 1)) << trial;
    }
  }
}

// Ids scattered over 2^34 positions: too wide to histogram, so the backward evaluates each element.
TEST_P(EveryTarget, BiasBackwardOfScatteredIdsMatchesReference) {
  const std::int64_t heads = 3, q_len = 17, k_len = 29;
  std::vector<std::int64_t> q_ids, k_ids;
  for (std::int64_t s = 0; s < q_len; ++s) q_ids.push_back(uniform_int(0, std::int64_t{1} << 34));
  for (std::int64_t s = 0; s < k_len; ++s) k_ids.push_back(uniform_int(0, std::int64_t{1} << 34));
  const Positions qp = Positions::ids(q_ids), kp = Positions::ids(k_ids);
  std::vector<float> ds(static_cast<std::size_t>(heads * q_len * k_len));
  for (auto& v : ds) v = static_cast<float>(uniform(-1, 1));
  const ConstTensorView view = ConstTensorView::of(ds.data(), {heads, q_len, k_len});
  // Same fp64 products summed in different orders: 1e-12 relative to Σ|terms| (<= 2^34 each).
  const double bound = 1e-12 * static_cast<double>(q_len * k_len) * std::ldexp(1.0, 34);
  std::vector<double> got(heads, 0.0), want(heads, 0.0);
  const AlibiParams alibi(heads, AlibiForm::kSymmetric);
  alibi_backward(alibi, qp, kp, view, got);
  ref::alibi_backward(alibi, qp, kp, view, want);
  for (std::size_t h = 0; h < got.size(); ++h) EXPECT_NEAR(got[h], want[h], bound) << h;
  const KerpleParams kerple(KerpleForm::kLog, {1.0, 0.5, 2.0}, {0.1, 1.0, 3.0});
  std::vector<double> g1(heads, 0.0), g2(heads, 0.0), w1(heads, 0.0), w2(heads, 0.0);
  kerple_backward(kerple, qp, kp, view, g1, g2);
  ref::kerple_backward(kerple, qp, kp, view, w1, w2);
  for (std::size_t h = 0; h < g1.size(); ++h) {
    EXPECT_NEAR(g1[h], w1[h], 1e-12 * 40 * q_len * k_len) << h;  // |log1p(r2·2^34)| < 40
    EXPECT_NEAR(g2[h], w2[h], 1e-12 * 20 * q_len * k_len) << h;  // |r1·d/(1 + r2·d)| <= r1/r2 <= 20
  }
}

TEST(Fire, PiecesEqualTheMlp) {
  for (int trial = 0; trial < 20; ++trial) {
    const FireParams p = FireParams::init(uniform_int(1, 6), uniform_int(1, 50), static_cast<std::uint64_t>(trial));
    for (int n = 0; n < 200; ++n) {
      const double x = uniform(-20, 20);
      const std::int64_t h = uniform_int(0, p.heads() - 1), s = p.piece_of(x);
      // Same terms, summed per unit vs pre-summed per piece, fp64: 1e-12 of |x|·Σ|W2·W1| + Σ|W2·B1|.
      EXPECT_NEAR(p.slope(s, h) * x + p.intercept(s, h), p.mlp(h, x), 1e-12 * (1 + std::fabs(x)) * 50) << trial;
    }
  }
  const FireParams p = FireParams::init(2, 4, 7, 0.5, 10);
  EXPECT_DOUBLE_EQ(p.normalized_distance(4, 1), std::log1p(0.5 * 3) / std::log1p(0.5 * 10));    // query before L
  EXPECT_DOUBLE_EQ(p.normalized_distance(40, 1), std::log1p(0.5 * 39) / std::log1p(0.5 * 40));  // past L
  EXPECT_DOUBLE_EQ(bias_value(p, 1, 40, 1), p.mlp(1, p.normalized_distance(40, 1)));
  expect_error([&] { bias_value(p, 0, 5); },
               {"bias_value: scheme = FIRE", "bias_value(scheme, head, q_position, k_position)"});
  expect_error(
      [] {
        FireParams(1, {1.0}, {0.0}, {1.0, 2.0}, {0.0});
      },
      {"FireParams: w2.size() = 2", "heads · hidden = 1"});
  expect_error([] { FireParams(1, {1.0}, {0.0}, {1.0}, {0.0}, 0.0); }, {"FireParams: c = 0", "> 0"});
  expect_error([] { FireParams(1, {1.0}, {0.0}, {1.0}, {0.0}, 1.0, -5); }, {"threshold = -5", "> 0"});
  expect_error([] { FireParams(1, {std::nan("")}, {0.0}, {1.0}, {0.0}); }, {"w1[0] = nan", "finite"});
}

TEST_P(EveryTarget, FireBackwardMatchesReferenceAndFiniteDifferences) {
  for (int trial = 0; trial < 12; ++trial) {
    GridCase c = random_grid();
    with_moderate_ids(c);
    const auto [qp, kp] = positions_of(c);
    const FireParams p = FireParams::init(c.heads, uniform_int(1, 12), static_cast<std::uint64_t>(trial),
                                          uniform(0.1, 2), uniform(2, 60));
    const std::int64_t count = c.batch * c.heads * c.q_len * c.k_len;
    const std::vector<std::int64_t> shape = {c.batch, c.heads, c.q_len, c.k_len};
    std::vector<double> w(static_cast<std::size_t>(count));
    for (auto& v : w) v = uniform(-1, 1);
    const ConstTensorView ds = ConstTensorView::contiguous(w.data(), DType::kF64, shape);
    FireGradients got(p), want(p);
    fire_backward(p, qp, kp, ds, got);
    ref::fire_backward(p, qp, kp, ds, want);
    // Both fp64 over the same pairs (the fast path grouped by piece), each gradient a sum of at
    // most count terms of size <= ~10 (|ds| <= 1, W ~ N(0, 1), 0 <= x <= ~5) in another order:
    // count·10·2^-52 ≈ 2e-15·count; 1e-12·count leaves room for the per-piece regrouping.
    const double tol = 1e-12 * static_cast<double>(count);
    for (std::size_t e = 0; e < got.w1.size(); ++e) {
      EXPECT_NEAR(got.w1[e], want.w1[e], tol) << trial;
      EXPECT_NEAR(got.b1[e], want.b1[e], tol) << trial;
    }
    for (std::size_t e = 0; e < got.w2.size(); ++e) EXPECT_NEAR(got.w2[e], want.w2[e], tol) << trial;
    for (std::size_t e = 0; e < got.b2.size(); ++e) EXPECT_NEAR(got.b2[e], want.b2[e], tol) << trial;
    EXPECT_NEAR(got.c, want.c, tol) << trial;
    EXPECT_NEAR(got.threshold, want.threshold, tol) << trial;
    // Finite differences of the reference loss against the reference gradients: W1[0], B2[0], c, L.
    auto rebuild = [&](int which, double delta) {
      std::vector<double> w1 = p.w1(), b1 = p.b1(), w2 = p.w2(), b2 = p.b2();
      double cc = p.c(), l = p.threshold();
      if (which == 0) w1[0] += delta;
      if (which == 1) b2[0] += delta;
      if (which == 2) cc += delta;
      if (which == 3) l += delta;
      return BiasScheme(FireParams(p.heads(), w1, b1, w2, b2, cc, l));
    };
    const double grads[] = {want.w1[0], want.b2[0], want.c, want.threshold};
    for (int which = 0; which < 4; ++which) {
      const double fd = finite_difference([&](double delta) { return rebuild(which, delta); }, c, qp, kp, w, 1e-6);
      // Step 1e-6: truncation ~1e-12·|∂³L| and rounding |L|·2^-52/1e-6 ≈ 1e-9·|L|; a pair can
      // cross a ReLU kink inside the step, where L has a corner: 1e-5·(1 + |g|) + that.
      EXPECT_NEAR(grads[which], fd, 1e-5 * (1 + std::fabs(grads[which])) + 1e-9 * static_cast<double>(count))
          << "trial " << trial << " parameter " << which;
    }
  }
}

TEST_P(EveryTarget, TupeBackwardMatchesReferenceAndFiniteDifferences) {
  for (int trial = 0; trial < 12; ++trial) {
    GridCase c = random_grid();
    with_moderate_ids(c);
    const auto [qp, kp] = positions_of(c);
    const TupeParams p0 = TupeParams::init(c.heads, uniform_int(1, 4), uniform_int(1, 5), 3100, trial % 2 == 0, 0.7,
                                           static_cast<std::uint64_t>(trial));
    std::vector<double> theta1(static_cast<std::size_t>(c.heads)), theta2(theta1.size());
    for (auto& v : theta1) v = uniform(-1, 1);
    for (auto& v : theta2) v = uniform(-1, 1);
    const TupeParams p(p0.heads(), p0.head_dim(), p0.d_model(), p0.table(), p0.u_q(), p0.u_k(), p0.cls_reset(), theta1,
                       theta2);
    const std::int64_t count = c.batch * c.heads * c.q_len * c.k_len;
    std::vector<double> w(static_cast<std::size_t>(count));
    for (auto& v : w) v = uniform(-1, 1);
    const std::vector<std::int64_t> shape = {c.batch, c.heads, c.q_len, c.k_len};
    const ConstTensorView ds = ConstTensorView::contiguous(w.data(), DType::kF64, shape);
    TupeGradients got(p), want(p);
    tupe_backward(p, qp, kp, ds, got);
    ref::tupe_backward(p, qp, kp, ds, want);
    // Same fp64 products, summed per projection first on the fast path: at most count terms of
    // size <= ~10 (|ds| <= 1, table ~ N(0, 0.49), U ~ N(0, 1/d_model)), 1e-12 of each.
    const double tol = 1e-12 * static_cast<double>(count) * 10;
    for (std::size_t e = 0; e < got.table.size(); ++e) ASSERT_NEAR(got.table[e], want.table[e], tol) << "table " << e;
    for (std::size_t e = 0; e < got.u_q.size(); ++e) {
      ASSERT_NEAR(got.u_q[e], want.u_q[e], tol) << "u_q " << e;
      ASSERT_NEAR(got.u_k[e], want.u_k[e], tol) << "u_k " << e;
    }
    for (std::size_t e = 0; e < got.theta1.size(); ++e) {
      EXPECT_NEAR(got.theta1[e], want.theta1[e], tol);
      EXPECT_NEAR(got.theta2[e], want.theta2[e], tol);
    }
    // Finite differences: a table row a query uses, one U^Q entry, θ2 of head 0.
    const std::size_t row = static_cast<std::size_t>(qp.at(0, 0) * p.d_model());
    const std::size_t uq = static_cast<std::size_t>(uniform_int(0, static_cast<std::int64_t>(p.u_q().size()) - 1));
    auto rebuild = [&](int which, double delta) {
      std::vector<double> table = p.table(), u_q = p.u_q(), t2 = p.theta2();
      if (which == 0) table[row] += delta;
      if (which == 1) u_q[uq] += delta;
      if (which == 2) t2[0] += delta;
      return BiasScheme(
          TupeParams(p.heads(), p.head_dim(), p.d_model(), table, u_q, p.u_k(), p.cls_reset(), p.theta1(), t2));
    };
    const double analytic[] = {want.table[row], want.u_q[uq], want.theta2[0]};
    for (int which = 0; which < 3; ++which) {
      const double fd = finite_difference([&](double delta) { return rebuild(which, delta); }, c, qp, kp, w, 1e-4);
      // Quadratic in a table row used by both q and k: central differences are exact up to
      // rounding of L over the step (|L| <= ~1e3·2^-52/1e-4 ≈ 2e-9).
      EXPECT_NEAR(analytic[which], fd, 1e-7 * (1 + std::fabs(analytic[which])))
          << "trial " << trial << " parameter " << which;
    }
  }
  expect_error(
      [] {
        TupeParams(1, 1, 2, {0.0, 0.0, 0.0}, {0.0, 0.0}, {0.0, 0.0});
      },
      {"TupeParams: table.size() = 3", "multiple of d_model = 2"});
  const TupeParams small = TupeParams::init(1, 1, 2, 4);
  std::vector<double> out(5 * 5);
  expect_error(
      [&] {
        bias_materialize(small, Positions::range(5), Positions::range(5), TensorView::of(out.data(), {1, 5, 5}));
      },
      {"bias_materialize: position = 4", "< max_len = 4"});
}

TEST_P(EveryTarget, BiasBackwardIsThreadCountFree) {
  const std::int64_t heads = 4, len = 300;
  std::vector<float> ds(static_cast<std::size_t>(heads * len * len));
  for (auto& v : ds) v = static_cast<float>(uniform(-1, 1));
  const std::vector<std::int64_t> shape = {heads, len, len};
  const T5BiasParams p(heads);
  std::vector<double> one(static_cast<std::size_t>(32 * heads), 0.0), two(one.size(), 0.0);
  set_num_threads(1);
  t5_bias_backward(p, Positions::range(len), Positions::range(len),
                   ConstTensorView::contiguous(ds.data(), DType::kF32, shape), one);
  set_num_threads(2);
  t5_bias_backward(p, Positions::range(len), Positions::range(len),
                   ConstTensorView::contiguous(ds.data(), DType::kF32, shape), two);
  EXPECT_EQ(std::memcmp(one.data(), two.data(), one.size() * sizeof(double)), 0);
}

// A RelativeBias whose one parameter every head shares, b_h(r) = −θ·(h + 1)·|r|: its gradient
// is summed from every head, so relative_bias_backward must call it from one thread at a time. The
// same bits for 1 and 2 threads, equal to the fp64 sum of the definition.
class SharedSlope final : public RelativeBias {
 public:
  std::string_view scheme_name() const override { return "shared-slope"; }
  std::int64_t heads() const override { return 8; }
  double value(std::int64_t head, std::int64_t r) const override {
    return -0.5 * static_cast<double>(head + 1) * static_cast<double>(std::abs(r));
  }
  std::int64_t parameter_count() const override { return 1; }
  std::vector<double> parameters() const override { return {0.5}; }
  void accumulate_gradient(std::int64_t head, std::int64_t r, double weight, std::span<double> grads) const override {
    grads[0] -= weight * static_cast<double>(head + 1) * static_cast<double>(std::abs(r));
  }
};

TEST(Bias, ParametersSharedByHeadsGetEveryHeadsGradient) {
  const std::int64_t heads = 8, len = 400;
  std::vector<float> ds(static_cast<std::size_t>(heads * len * len));
  for (auto& v : ds) v = static_cast<float>(uniform(-1, 1));
  const std::vector<std::int64_t> shape = {heads, len, len};
  const ConstTensorView view = ConstTensorView::contiguous(ds.data(), DType::kF32, shape);
  const SharedSlope scheme;
  double want = 0.0;
  for (std::int64_t h = 0; h < heads; ++h) {
    for (std::int64_t i = 0; i < len; ++i) {
      for (std::int64_t j = 0; j < len; ++j)
        want -= ds[static_cast<std::size_t>((h * len + i) * len + j)] * static_cast<double>(h + 1) *
                static_cast<double>(std::abs(j - i));
    }
  }
  std::vector<std::vector<double>> runs;
  for (const int threads : {1, 2}) {
    set_num_threads(threads);
    runs.push_back({0.0});
    relative_bias_backward(scheme, Positions::range(len), Positions::range(len), view, runs.back());
  }
  set_num_threads(2);
  EXPECT_EQ(std::memcmp(runs[0].data(), runs[1].data(), sizeof(double)), 0);
  EXPECT_NEAR(runs[0][0], want, 1e-9 * std::fabs(want) + 1e-6);
}

TEST(BiasEvaluator, RowsAndElementsAgreeWithTheScheme) {
  const KerpleParams p(KerpleForm::kLog, {1.0, 2.0}, {0.5, 0.25});
  const BiasEvaluator eval(p, -50, 10);
  std::vector<float> row(30), scores(30, 1.0f);
  for (const std::int64_t k_first : {-20, 100, -200}) {  // inside the table, past it, before it
    eval.fill_row(1, 5, k_first, 30, row.data());
    eval.add_row(1, 5, k_first, 30, scores.data());
    for (std::int64_t t = 0; t < 30; ++t) {
      const auto want = static_cast<float>(bias_value(p, 1, k_first + t - 5));
      EXPECT_EQ(row[static_cast<std::size_t>(t)], want);
      EXPECT_EQ(eval(1, 5, k_first + t), want);
      EXPECT_EQ(scores[static_cast<std::size_t>(t)], 1.0f + want);
      scores[static_cast<std::size_t>(t)] = 1.0f;
    }
  }
  EXPECT_NE(eval.table_row(0, 0, -50, 61), nullptr);
  EXPECT_EQ(eval.table_row(0, 0, -50, 62), nullptr);
  EXPECT_EQ(BiasEvaluator(NoPE(3), 0, 10)(2, 4, 9), 0.0f);
}

TEST(Bias, RejectsBadArguments) {
  std::vector<float> s(2 * 3 * 4);
  const AlibiParams alibi(2);
  expect_error(
      [&] {
        bias_materialize(alibi, Positions::range(3), Positions::range(4), TensorView::of(s.data(), {3, 3, 4}));
      },
      {"bias_materialize: out.size(0) = 3", "heads = 2"});
  expect_error(
      [&] { bias_materialize(alibi, Positions::range(3), Positions::range(4), TensorView::of(s.data(), {24})); },
      {"out rank = 1", "[B, H, Sq, Sk]"});
  expect_error(
      [&] {
        bias_materialize(alibi, Positions::range(2), Positions::range(4), TensorView::of(s.data(), {2, 3, 4}));
      },
      {"bias_materialize"});
  std::vector<double> grad(3);
  expect_error(
      [&] {
        alibi_backward(alibi, Positions::range(3), Positions::range(4), ConstTensorView::of(s.data(), {2, 3, 4}), grad);
      },
      {"alibi_backward: d_slopes.size() = 3", "2"});
  expect_error([] { KerpleParams(KerpleForm::kPower, {1.0}, {2.5}); }, {"r2[0] = 2.5", "(0, 2]"});
  expect_error([] { KerpleParams(KerpleForm::kLog, {1.0, 0.0}, {1.0, 1.0}); }, {"r1[1] = 0", "> 0"});
  expect_error([] { KerpleParams(KerpleForm::kLog, {1.0}, {1.0, 1.0}); }, {"r2.size() = 2", "r1.size() = 1"});
  expect_error([] { NoPE(0); }, {"NoPE: heads = 0"});
  expect_error([&] { bias_value(alibi, 2, 0); }, {"bias_value: head = 2", "[0, 2)"});
  expect_error([] { BiasEvaluator(NoPE(1), 5, 4); }, {"max_relative = 4", ">= min_relative = 5"});
}

INSTANTIATE_TEST_SUITE_P(Targets, EveryTarget, ::testing::ValuesIn(testing::all_targets()),
                         [](const ::testing::TestParamInfo<std::string>& target) { return target.param; });

}  // namespace
}  // namespace posenc
