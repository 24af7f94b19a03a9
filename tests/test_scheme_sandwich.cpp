// Sandwich's own tests (posenc/sandwich.hpp); the generic matrix (test_schemes.cpp) covers the
// reference parity, dtypes, strides, gradients, threads and bad options of every registered scheme.
#include <cmath>
#include <memory>
#include <vector>

#include "posenc/bias.hpp"
#include "posenc/sandwich.hpp"
#include "testing.hpp"

namespace posenc {
namespace {

// Golden values worked by hand from the paper's formula. d' = 2: one frequency, ω = 1, so
// b_h(r) = (cos r − 1)·H/(8(h + 1)); d' = 4, base 10^4: ω = 1, 0.01.
TEST(Sandwich, GoldenValues) {
  const SandwichBias one(8, 2);
  EXPECT_DOUBLE_EQ(one.value(0, 1), -0.45969769413186023);  // cos 1 − 1
  EXPECT_DOUBLE_EQ(one.value(3, 2), -0.3540367091367856);   // (cos 2 − 1)/4
  const SandwichBias two(8, 4);
  EXPECT_DOUBLE_EQ(two.value(0, 100), -0.5973788218441762);    // cos 100 + cos 1 − 2
  EXPECT_DOUBLE_EQ(two.value(2, -100), -0.19912627394805874);  // the same over 3, symmetric in r
  EXPECT_DOUBLE_EQ(two.frequencies()[1], 0.01);
  EXPECT_DOUBLE_EQ(two.head_factor(7), 1.0 / 8);
}

// 0 on the diagonal, never above 0, symmetric, each head a multiple of head 0: the paper's
// shape, for the paper's d' = 128 and at positions past 2^40.
TEST(Sandwich, ZeroAtTheDiagonalNegativeElsewhereAndSymmetric) {
  const SandwichBias s(12);
  for (std::int64_t h = 0; h < 12; ++h) EXPECT_EQ(s.value(h, 0), 0.0);
  for (const std::int64_t r : {std::int64_t{1}, std::int64_t{7}, std::int64_t{1000}, (std::int64_t{1} << 40) + 3}) {
    for (std::int64_t h = 0; h < 12; ++h) {
      EXPECT_LT(s.value(h, r), 0.0) << r;
      EXPECT_EQ(s.value(h, r), s.value(h, -r)) << r;
      EXPECT_NEAR(s.value(h, r), s.value(0, r) / static_cast<double>(h + 1), 1e-12 * std::fabs(s.value(0, r)));
    }
  }
}

// tabulate's recurrence (restarted every 64 keys) against the per-value definition, over rows
// that start anywhere and cross several restarts: within the header's (d'/2)·(|r|·2^-51 + 1e-14)
// per unit of head factor.
TEST(Sandwich, TabulateStaysWithinItsBoundOfTheDefinition) {
  const SandwichBias s(3, 128);
  for (const std::int64_t first : {std::int64_t{-300}, std::int64_t{5}, (std::int64_t{1} << 40) - 200}) {
    const std::int64_t count = 257;
    std::vector<double> rows(static_cast<std::size_t>(3 * count));
    s.tabulate(first, count, rows.data());
    for (std::int64_t h = 0; h < 3; ++h) {
      for (std::int64_t t = 0; t < count; ++t) {
        const double r = std::fabs(static_cast<double>(first + t));
        const double bound = 64 * (r * std::ldexp(1.0, -51) + 1e-14) * s.head_factor(h);
        ASSERT_NEAR(rows[static_cast<std::size_t>(h * count + t)], s.value(h, first + t), bound)
            << "r = " << first + t << ", head " << h;
      }
    }
  }
}

// A materialised bias is tabulate's rows of one call rounded to f32, bit for bit, although the
// library tabulates a wide table in pieces (8 heads: 1024 r per piece; here 1399 r).
TEST(Sandwich, MaterialisedTableHasTheBitsOfOneTabulateCall) {
  constexpr std::int64_t kHeads = 8, kN = 700, kWidth = 2 * kN - 1;
  const auto s = std::make_shared<const SandwichBias>(kHeads, 128);
  std::vector<double> rows(static_cast<std::size_t>(kHeads * kWidth));
  s->tabulate(-(kN - 1), kWidth, rows.data());
  std::vector<float> out(static_cast<std::size_t>(kHeads * kN * kN));
  const Positions positions = Positions::range(kN);
  const std::vector<std::int64_t> shape = {kHeads, kN, kN};
  bias_materialize(BiasScheme(RelativeBiasRef(s)), positions, positions,
                   TensorView::contiguous(out.data(), DType::kF32, shape));
  for (std::int64_t h = 0; h < kHeads; ++h) {
    for (std::int64_t i = 0; i < kN; ++i) {
      for (std::int64_t j = 0; j < kN; ++j) {
        const auto want = static_cast<float>(rows[static_cast<std::size_t>(h * kWidth + j - i + kN - 1)] + 0.0);
        ASSERT_EQ(out[static_cast<std::size_t>((h * kN + i) * kN + j)], want)
            << "head " << h << ", q " << i << ", k " << j;
      }
    }
  }
}

TEST(Sandwich, RefusesBadParametersByName) {
  testing::expect_error([] { SandwichBias(0); }, {"SandwichBias", "heads", "0"});
  testing::expect_error([] { SandwichBias(4, 7); }, {"dim", "7", "even"});
  testing::expect_error([] { SandwichBias(4, 0); }, {"dim", "0"});
  // From fuzz_schemes: dim = 2^31 would ask for 8 GiB of frequencies.
  testing::expect_error([] { SandwichBias(4, std::int64_t{1} << 31); }, {"dim = 2147483648", "[2, 65536]"});
  testing::expect_error([] { SandwichBias(4, 8, 1.0); }, {"base", "1", "> 1"});
  testing::expect_error([] { SandwichBias(4, 8, std::nan("")); }, {"base", "nan"});
  testing::expect_error(
      [] {
        make_head_group("sandwich", {.heads = 4, .head_dim = 8, .options = {{"dim", 9}}});
      },
      {"dim", "9"});
}

}  // namespace
}  // namespace posenc
