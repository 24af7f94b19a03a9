// posenc::matmul: against the fp64 reference over random shapes, strides and tails on every
// target; bit for bit against its stated order (one fused multiply-add chain per element) on the
// targets that have fused multiply-add, for any thread count; non-finite inputs; bad input.
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "posenc/matmul.hpp"
#include "testing.hpp"

namespace posenc {
namespace {

using testing::EveryTarget;
using testing::expect_error;
using testing::uniform;
using testing::uniform_int;

// A [rows, cols] matrix inside a larger buffer: row-major with padded rows, or column-major
// (a transposed view), or broadcast along one axis (stride 0).
struct Strided {
  std::int64_t rows = 0, cols = 0, s0 = 0, s1 = 0;
  std::vector<float> data;
  std::vector<double> wide;  // the same values in f64, densely [rows, cols]

  float at(std::int64_t i, std::int64_t j) const { return data[static_cast<std::size_t>(i * s0 + j * s1)]; }
  ConstTensorView view() const {
    return ConstTensorView(data.data(), DType::kF32, std::vector<std::int64_t>{rows, cols},
                           std::vector<std::int64_t>{s0, s1});
  }
  ConstTensorView wide_view() const { return ConstTensorView::of(wide.data(), {rows, cols}); }
};

Strided random_matrix(std::int64_t rows, std::int64_t cols, int layout, std::int64_t pad = -1) {
  Strided m;
  m.rows = rows, m.cols = cols;
  if (pad < 0) pad = uniform_int(0, 3);
  switch (layout) {
    case 0:
      m.s0 = cols + pad, m.s1 = 1;
      break;  // row-major, padded rows
    case 1:
      m.s0 = 1, m.s1 = rows + pad;
      break;  // column-major
    case 2:
      m.s0 = 0, m.s1 = 1;
      break;  // one row broadcast
    default:
      m.s0 = (cols + pad) * 2, m.s1 = 2;
      break;  // every other element
  }
  const std::int64_t extent = std::max<std::int64_t>(1, (rows - 1) * m.s0 + (cols - 1) * m.s1 + 1);
  m.data.assign(static_cast<std::size_t>(rows > 0 && cols > 0 ? extent : 1), 0.0f);
  for (float& x : m.data) x = static_cast<float>(uniform(-2.0, 2.0));
  m.wide.resize(static_cast<std::size_t>(rows * cols));
  for (std::int64_t i = 0; i < rows; ++i) {
    for (std::int64_t j = 0; j < cols; ++j) m.wide[static_cast<std::size_t>(i * cols + j)] = m.at(i, j);
  }
  return m;
}

struct Case {
  Strided a, b;
  std::vector<float> bias;
  std::vector<double> bias_wide;
  bool has_bias = false;
  std::int64_t out_s0 = 0, out_s1 = 1;
};

Case random_case(std::int64_t m, std::int64_t k, std::int64_t n) {
  Case c;
  c.a = random_matrix(m, k, static_cast<int>(uniform_int(0, 3)));
  c.b = random_matrix(k, n, static_cast<int>(uniform_int(0, 3)));
  c.has_bias = uniform_int(0, 1) == 1;
  for (std::int64_t j = 0; j < n; ++j) c.bias.push_back(static_cast<float>(uniform(-1.0, 1.0)));
  c.bias_wide.assign(c.bias.begin(), c.bias.end());
  const bool transposed = uniform_int(0, 3) == 0;
  c.out_s0 = transposed ? 1 : n + uniform_int(0, 2);
  c.out_s1 = transposed ? m + 1 : 1;
  return c;
}

std::vector<float> run(const Case& c, std::int64_t m, std::int64_t n) {
  std::vector<float> out(static_cast<std::size_t>(std::max<std::int64_t>(1, (m + 1) * (n + 3))),
                         std::numeric_limits<float>::quiet_NaN());
  const TensorView o(out.data(), DType::kF32, std::vector<std::int64_t>{m, n},
                     std::vector<std::int64_t>{c.out_s0, c.out_s1});
  const ConstTensorView bias = c.has_bias ? ConstTensorView::of(c.bias.data(), {n}) : ConstTensorView{};
  matmul(c.a.view(), c.b.view(), o, bias);
  // Nothing outside the view is written.
  std::vector<bool> inside(out.size(), false);
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t j = 0; j < n; ++j) inside[static_cast<std::size_t>(i * c.out_s0 + j * c.out_s1)] = true;
  }
  for (std::size_t e = 0; e < out.size(); ++e) {
    if (!inside[e] && !std::isnan(out[e])) ADD_FAILURE() << "element " << e << " outside out was written";
  }
  std::vector<float> dense(static_cast<std::size_t>(m * n));
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t j = 0; j < n; ++j)
      dense[static_cast<std::size_t>(i * n + j)] = out[static_cast<std::size_t>(i * c.out_s0 + j * c.out_s1)];
  }
  return dense;
}

// The stated order: fma chain in k order from 0, then the bias with one rounding.
float chain(const Case& c, std::int64_t i, std::int64_t j) {
  float acc = 0.0f;
  for (std::int64_t t = 0; t < c.a.cols; ++t) acc = std::fma(c.a.at(i, t), c.b.at(t, j), acc);
  return c.has_bias ? acc + c.bias[static_cast<std::size_t>(j)] : acc;
}

bool has_fma(const std::string& target) { return target == "avx512" || target == "avx2"; }

// got (dense [m, n]) against the fp64 reference on f64 copies of the inputs, within the bound
// γ_T·Σ|terms| for T = K products plus the bias (Higham §3.1: fused or not, and the bias's add), and
// bit for bit against the stated chain on the targets with fused multiply-add.
void expect_matches(const Case& c, const std::vector<float>& got, const std::string& target) {
  const std::int64_t m = c.a.rows, k = c.a.cols, n = c.b.cols;
  std::vector<double> want(static_cast<std::size_t>(m * n));
  ref::matmul(c.a.wide_view(), c.b.wide_view(), TensorView::of(want.data(), {m, n}),
              c.has_bias ? ConstTensorView::of(c.bias_wide.data(), {n}) : ConstTensorView{});
  const double u = std::ldexp(1.0, -24), terms = static_cast<double>(k + (c.has_bias ? 1 : 0));
  const double gamma = terms * u / (1 - terms * u);
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t j = 0; j < n; ++j) {
      double magnitude = c.has_bias ? std::abs(c.bias_wide[static_cast<std::size_t>(j)]) : 0.0;
      for (std::int64_t t = 0; t < k; ++t)
        magnitude +=
            std::abs(c.a.wide[static_cast<std::size_t>(i * k + t)] * c.b.wide[static_cast<std::size_t>(t * n + j)]);
      const float v = got[static_cast<std::size_t>(i * n + j)];
      ASSERT_LE(std::abs(v - want[static_cast<std::size_t>(i * n + j)]), gamma * magnitude + 1e-37)
          << "at " << i << ", " << j;
      if (has_fma(target)) {
        ASSERT_EQ(v, chain(c, i, j)) << "at " << i << ", " << j;
      }
    }
  }
}

TEST_P(EveryTarget, MatmulMatchesReference) {
  for (int trial = 0; trial < 40; ++trial) {
    const std::int64_t m = uniform_int(0, 70), k = uniform_int(0, 300), n = uniform_int(0, 70);
    SCOPED_TRACE(::testing::Message() << "trial " << trial << ": " << m << " x " << k << " x " << n);
    const Case c = random_case(m, k, n);
    expect_matches(c, run(c, m, n), GetParam());
  }
}

// The layout the study's layers mostly take: dense B and out, N a multiple of the kernel's 16
// columns, so that out is written in place (bias added there), depth over several chunks of 32.
TEST_P(EveryTarget, MatmulInPlaceLayouts) {
  for (const std::int64_t n : {16, 64}) {
    for (const std::int64_t k : {33, 100}) {
      for (const bool with_bias : {false, true}) {
        SCOPED_TRACE(::testing::Message() << "n " << n << ", k " << k << ", bias " << with_bias);
        const std::int64_t m = 67;
        Case c;
        c.a = random_matrix(m, k, 0, 0);
        c.b = random_matrix(k, n, 0, 0);
        c.has_bias = with_bias;
        for (std::int64_t j = 0; j < n; ++j) c.bias.push_back(static_cast<float>(uniform(-1.0, 1.0)));
        c.bias_wide.assign(c.bias.begin(), c.bias.end());
        c.out_s0 = n, c.out_s1 = 1;
        expect_matches(c, run(c, m, n), GetParam());
      }
    }
  }
}

TEST_P(EveryTarget, MatmulBitsDoNotDependOnThreads) {
  // Large enough for two threads (threads_for: 2^16 operations each).
  const Case c = random_case(157, 131, 45);
  set_num_threads(1);
  const std::vector<float> one = run(c, 157, 45);
  set_num_threads(2);
  const std::vector<float> two = run(c, 157, 45);
  for (std::size_t e = 0; e < one.size(); ++e) ASSERT_EQ(one[e], two[e]) << "element " << e;
}

TEST_P(EveryTarget, MatmulPropagatesNonFinite) {
  std::vector<float> a = {1, 2, std::numeric_limits<float>::quiet_NaN(), 1, 0, 1};  // [3, 2]
  std::vector<float> b = {std::numeric_limits<float>::infinity(), 1, 0, 1};         // [2, 2]
  std::vector<float> out(6);
  matmul(ConstTensorView::of(a.data(), {3, 2}), ConstTensorView::of(b.data(), {2, 2}),
         TensorView::of(out.data(), {3, 2}));
  EXPECT_EQ(out[0], std::numeric_limits<float>::infinity());  // 1·inf + 2·0
  EXPECT_EQ(out[1], 3.0f);
  EXPECT_TRUE(std::isnan(out[2]));  // NaN in its row
  EXPECT_TRUE(std::isnan(out[3]));
  EXPECT_TRUE(std::isnan(out[4]));  // 0·inf
  EXPECT_EQ(out[5], 1.0f);
}

INSTANTIATE_TEST_SUITE_P(Targets, EveryTarget, ::testing::ValuesIn(testing::all_targets()));

TEST(Matmul, SameBitsOnEveryFusedTarget) {
  const Case c = random_case(67, 200, 33);
  std::vector<std::vector<float>> results;
  for (const std::string& t : available_targets()) {
    if (!has_fma(t)) continue;
    set_target(t);
    results.push_back(run(c, 67, 33));
  }
  set_target("auto");
  if (results.size() < 2) GTEST_SKIP() << "one target with fused multiply-add on this host: nothing to compare";
  for (std::size_t r = 1; r < results.size(); ++r) EXPECT_EQ(results[r], results[0]);
}

TEST(Matmul, EmptyDepthGivesTheBias) {
  std::vector<float> bias = {1.5f, -2.0f}, out(4, 7.0f);
  matmul(ConstTensorView(nullptr, DType::kF32, std::vector<std::int64_t>{2, 0}, std::vector<std::int64_t>{0, 1}),
         ConstTensorView(nullptr, DType::kF32, std::vector<std::int64_t>{0, 2}, std::vector<std::int64_t>{2, 1}),
         TensorView::of(out.data(), {2, 2}), ConstTensorView::of(bias.data(), {2}));
  EXPECT_EQ(out, (std::vector<float>{1.5f, -2.0f, 1.5f, -2.0f}));
}

TEST(Matmul, BadInputIsNamed) {
  std::vector<float> a(12), b(12), out(16), bias(4);
  std::vector<double> wide(16);
  std::vector<std::uint16_t> half(12);
  const auto A = ConstTensorView::of(a.data(), {3, 4});
  const auto B = ConstTensorView::of(b.data(), {4, 3});
  const auto O = TensorView::of(out.data(), {3, 3});
  expect_error([&] { matmul(ConstTensorView::of(a.data(), {12}), B, O); }, {"matmul: a.rank() = 1", "expected 2"});
  expect_error([&] { matmul(A, ConstTensorView::of(b.data(), {3, 4}), O); }, {"b.size(0) = 3", "4 (a.size(1)"});
  expect_error([&] { matmul(A, B, TensorView::of(out.data(), {2, 3})); }, {"out.size(0) = 2", "3 (a.size(0))"});
  expect_error([&] { matmul(A, B, TensorView::of(out.data(), {3, 4})); }, {"out.size(1) = 4", "3 (b.size(1))"});
  expect_error([&] { matmul(A, B, O, ConstTensorView::of(bias.data(), {4})); }, {"bias.size(0) = 4", "3 (b.size(1))"});
  expect_error([&] { matmul(A, B, O, ConstTensorView::of(bias.data(), {1, 3})); }, {"bias.rank() = 2"});
  expect_error([&] { matmul(A, B, TensorView::of(wide.data(), {3, 3})); }, {"matmul: a", "f32", "f64"});
  expect_error(
      [&] {
        matmul(ConstTensorView(half.data(), DType::kBF16, std::vector<std::int64_t>{3, 4},
                               std::vector<std::int64_t>{4, 1}),
               ConstTensorView(half.data(), DType::kBF16, std::vector<std::int64_t>{4, 3},
                               std::vector<std::int64_t>{3, 1}),
               TensorView(out.data(), DType::kBF16, std::vector<std::int64_t>{3, 3}, std::vector<std::int64_t>{3, 1}));
      },
      {"out.dtype() = bf16", "f32 or f64"});
  expect_error(
      [&] {
        matmul(A, B,
               TensorView(out.data(), DType::kF32, std::vector<std::int64_t>{3, 3}, std::vector<std::int64_t>{0, 1}));
      },
      {"out.stride(0) = 0"});
  expect_error([&] { matmul(A, B, TensorView::of(a.data(), {3, 3})); }, {"out", "a"});
}

}  // namespace
}  // namespace posenc
