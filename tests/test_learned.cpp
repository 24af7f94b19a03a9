// Learned absolute table: forward/backward against the fp64 reference on every target, finite
// differences in fp64, determinism with repeated positions for any thread count, initialisers,
// and the errors (above all: positions beyond max_len).
#include <cmath>
#include <cstring>

#include "testing.hpp"

namespace posenc {
namespace {

using testing::EveryTarget;
using testing::expect_error;
using testing::uniform;
using testing::uniform_int;

std::vector<float> random_floats(std::int64_t n) {
  std::vector<float> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = static_cast<float>(uniform(-1, 1));
  return v;
}

TEST_P(EveryTarget, LearnedForwardMatchesReference) {
  for (int trial = 0; trial < 30; ++trial) {
    const std::int64_t max_len = uniform_int(1, 300), dim = uniform_int(1, 70);
    const std::int64_t batch = uniform_int(1, 3), seq = uniform_int(1, 50);
    const std::int64_t row_stride = dim + uniform_int(0, 2);  // padded rows in x and y
    SCOPED_TRACE("trial " + std::to_string(trial) + ": max_len " + std::to_string(max_len) + ", [" +
                 std::to_string(batch) + ", " + std::to_string(seq) + ", " + std::to_string(dim) + "]");
    std::vector<float> table = random_floats(max_len * dim);
    std::vector<float> x = random_floats(batch * seq * row_stride), y(x.size(), NAN);
    std::vector<std::int64_t> ids(static_cast<std::size_t>(batch * seq));
    for (auto& id : ids) id = uniform_int(0, max_len - 1);
    const Positions positions = Positions::ids(ids, batch, seq);
    const std::vector<std::int64_t> shape = {batch, seq, dim}, strides = {seq * row_stride, row_stride, 1};
    learned_forward(ConstTensorView::of(table.data(), {max_len, dim}),
                    ConstTensorView(x.data(), DType::kF32, shape, strides), positions,
                    TensorView(y.data(), DType::kF32, shape, strides));
    for (std::int64_t b = 0; b < batch; ++b) {
      for (std::int64_t s = 0; s < seq; ++s) {
        for (std::int64_t j = 0; j < dim; ++j) {
          const auto at = static_cast<std::size_t>(b * seq * row_stride + s * row_stride + j);
          const float want = x[at] + table[static_cast<std::size_t>(positions.at(b, s) * dim + j)];
          // One f32 addition on both paths: identical results.
          ASSERT_EQ(y[at], want) << b << ", " << s << ", " << j;
        }
      }
    }
  }
}

// Outputs over 8 MiB are written with streaming stores: checked exactly, with y starting one
// float past the allocation (so aligned and unaligned vectors both occur).
TEST_P(EveryTarget, LearnedForwardLargeIsExact) {
  const std::int64_t max_len = 2200, seq = 2100, dim = 1030;
  const std::vector<float> table = random_floats(max_len * dim), x = random_floats(seq * dim);
  std::vector<float> y(static_cast<std::size_t>(seq * dim + 1));
  std::vector<std::int64_t> ids(static_cast<std::size_t>(seq));
  for (auto& id : ids) id = uniform_int(0, max_len - 1);
  learned_forward(ConstTensorView::of(table.data(), {max_len, dim}), ConstTensorView::of(x.data(), {seq, dim}),
                  Positions::ids(ids), TensorView::of(y.data() + 1, {seq, dim}));
  for (std::int64_t s = 0; s < seq; ++s) {
    for (std::int64_t j = 0; j < dim; ++j) {
      const auto at = static_cast<std::size_t>(s * dim + j);
      ASSERT_EQ(y[at + 1], x[at] + table[static_cast<std::size_t>(ids[static_cast<std::size_t>(s)] * dim + j)])
          << s << ", " << j;
    }
  }
}

// bf16 tables and embeddings with strided columns take the converting path.
TEST_P(EveryTarget, LearnedForwardBf16Strided) {
  const std::int64_t max_len = 9, dim = 6, seq = 11;
  std::vector<double> table_values(static_cast<std::size_t>(max_len * dim)),
      x_values(static_cast<std::size_t>(seq * dim * 2));
  for (auto& v : table_values) v = uniform(-1, 1);
  for (auto& v : x_values) v = uniform(-1, 1);
  const auto table = testing::to_dtype(table_values, DType::kBF16);
  const auto x = testing::to_dtype(x_values, DType::kBF16);
  std::vector<bf16> y(static_cast<std::size_t>(seq * dim));
  std::vector<std::int64_t> ids(static_cast<std::size_t>(seq));
  for (auto& id : ids) id = uniform_int(0, max_len - 1);
  learned_forward(ConstTensorView::contiguous(table.data(), DType::kBF16, std::vector<std::int64_t>{max_len, dim}),
                  ConstTensorView(x.data(), DType::kBF16, std::vector<std::int64_t>{seq, dim},
                                  std::vector<std::int64_t>{2 * dim, 2}),
                  Positions::ids(ids), TensorView::of(y.data(), {seq, dim}));
  for (std::int64_t s = 0; s < seq; ++s) {
    for (std::int64_t j = 0; j < dim; ++j) {
      // One f32 addition of two bf16 values, rounded once to bf16: replayed exactly.
      const float sum =
          static_cast<float>(testing::element(x.data(), DType::kBF16, s * 2 * dim + 2 * j)) +
          static_cast<float>(testing::element(table.data(), DType::kBF16, ids[static_cast<std::size_t>(s)] * dim + j));
      ASSERT_EQ(y[static_cast<std::size_t>(s * dim + j)].bits, to_bf16(sum).bits) << s << ", " << j;
    }
  }
}

TEST_P(EveryTarget, LearnedBackwardMatchesReference) {
  const DType dtypes[] = {DType::kF32, DType::kF64, DType::kBF16, DType::kF16};
  for (int trial = 0; trial < 30; ++trial) {
    const DType dtype = dtypes[uniform_int(0, 3)];
    const std::int64_t max_len = uniform_int(1, 40), dim = uniform_int(1, 40);
    const std::int64_t batch = uniform_int(1, 3), seq = uniform_int(1, 60);
    SCOPED_TRACE("trial " + std::to_string(trial) + " " + std::string(dtype_name(dtype)));
    // Few distinct positions: many repeats per table row.
    std::vector<std::int64_t> ids(static_cast<std::size_t>(batch * seq));
    for (auto& id : ids) id = uniform_int(0, std::min<std::int64_t>(max_len - 1, 5));
    const Positions positions = Positions::ids(ids, batch, seq);
    const std::int64_t tokens = batch * seq * dim, table_size = max_len * dim;
    // Values in the dtype: dy, a d_table that already holds gradients (accumulation), dx likewise.
    auto make = [&](std::int64_t n) {
      std::vector<double> values(static_cast<std::size_t>(n));
      for (auto& v : values) v = uniform(-1, 1);
      return testing::to_dtype(values, dtype);
    };
    auto dy = make(tokens), d_table = make(table_size), dx = make(tokens);
    const auto d_table_initial = d_table;
    auto d_table_ref = d_table, dx_ref = dx;
    const std::vector<std::int64_t> tok_shape = {batch, seq, dim}, tab_shape = {max_len, dim};
    auto view = [&](std::vector<unsigned char>& b, const std::vector<std::int64_t>& shape) {
      return TensorView::contiguous(b.data(), dtype, shape);
    };
    learned_backward(view(dy, tok_shape), positions, view(d_table, tab_shape), view(dx, tok_shape));
    ref::learned_backward(view(dy, tok_shape), positions, view(d_table_ref, tab_shape), view(dx_ref, tok_shape));
    // d_table, replayed exactly so that the comparison is bitwise: the SIMD path adds each
    // token's row in f32 and rounds to the dtype after every token, in token order; the fp64
    // reference (target "ref", or any f64 tensor) sums in fp64 in token order and rounds once.
    const bool reference_path = GetParam() == "ref" || dtype == DType::kF64;
    for (std::int64_t row = 0; row < max_len; ++row) {
      for (std::int64_t j = 0; j < dim; ++j) {
        const std::int64_t at = row * dim + j;
        double acc = testing::element(d_table_initial.data(), dtype, at);
        for (std::int64_t t = 0; t < batch * seq; ++t) {
          if (ids[static_cast<std::size_t>(t)] != row) continue;
          const double term = testing::element(dy.data(), dtype, t * dim + j);
          acc = reference_path ? acc + term
                               : testing::round_to(static_cast<float>(acc) + static_cast<float>(term), dtype);
        }
        ASSERT_EQ(testing::element(d_table.data(), dtype, at), testing::round_to(acc, dtype))
            << "d_table[" << row << ", " << j << "]";
      }
    }
    for (std::int64_t i = 0; i < tokens; ++i) {
      // dx += dy is one addition on both paths; the reference adds in fp64 and rounds once, the
      // fast path adds in f32 and rounds to the dtype: at most one ulp of a sum <= 2 in the dtype
      // apart (f32 2^-22, bf16 2^-6, f16 2^-9).
      const double ulp2 = dtype == DType::kF64    ? 0.0
                          : dtype == DType::kF32  ? std::ldexp(1.0, -22)
                          : dtype == DType::kBF16 ? std::ldexp(1.0, -6)
                                                  : std::ldexp(1.0, -9);
      ASSERT_NEAR(testing::element(dx.data(), dtype, i), testing::element(dx_ref.data(), dtype, i), ulp2)
          << "dx element " << i;
    }
  }
}

// Gradient by central finite differences, L = Σ g·y with random g, y = x + W[pos];
// dL/dW[r, j] = Σ over tokens at r of g. In fp64 (the reference path) L is linear in W, so the
// quotient is exact up to the rounding of L (~1e-16·|L|/h): tolerance 1e-8 with h = 1e-3. In f32
// (the SIMD kernels) y rounds to f32: |L| <= 90 terms of size <= 2, each off by <= 2^-23, so L is
// off by <= 90·2^-22 ≈ 2.1e-5 and the quotient with h = 2^-4 by <= 2·2.1e-5·8 ≈ 3.4e-4: 5e-4.
template <class T>
void check_learned_gradient(double h, double tol) {
  const std::int64_t max_len = 7, dim = 5, batch = 2, seq = 9;
  std::vector<T> table(static_cast<std::size_t>(max_len * dim)), x(static_cast<std::size_t>(batch * seq * dim));
  std::vector<T> g(x.size()), y(x.size());
  for (auto& v : table) v = static_cast<T>(uniform(-1, 1));
  for (auto& v : x) v = static_cast<T>(uniform(-1, 1));
  for (auto& v : g) v = static_cast<T>(uniform(-1, 1));
  std::vector<std::int64_t> ids(static_cast<std::size_t>(batch * seq));
  for (auto& id : ids) id = uniform_int(0, max_len - 1);
  const Positions positions = Positions::ids(ids, batch, seq);
  auto loss = [&] {
    learned_forward(ConstTensorView::of(table.data(), {max_len, dim}), ConstTensorView::of(x.data(), {batch, seq, dim}),
                    positions, TensorView::of(y.data(), {batch, seq, dim}));
    double sum = 0;
    for (std::size_t i = 0; i < y.size(); ++i) sum += static_cast<double>(g[i]) * static_cast<double>(y[i]);
    return sum;
  };
  std::vector<T> d_table(table.size(), T(0)), dx(x.size(), T(0));
  learned_backward(ConstTensorView::of(g.data(), {batch, seq, dim}), positions,
                   TensorView::of(d_table.data(), {max_len, dim}), TensorView::of(dx.data(), {batch, seq, dim}));
  for (std::size_t k = 0; k < table.size(); ++k) {
    const T saved = table[k];
    table[k] = static_cast<T>(saved + h);
    const double up = loss();
    table[k] = static_cast<T>(saved - h);
    const double down = loss();
    table[k] = saved;
    EXPECT_NEAR(static_cast<double>(d_table[k]), (up - down) / (2 * h), tol) << "W element " << k;
  }
  for (std::size_t k = 0; k < x.size(); ++k) EXPECT_EQ(dx[k], g[k]);  // dx = 0 + dy
}

TEST_P(EveryTarget, LearnedGradientMatchesFiniteDifferences) {
  check_learned_gradient<double>(1e-3, 1e-8);
  check_learned_gradient<float>(0.0625, 5e-4);
}

TEST(Learned, BackwardIsBitwiseIdenticalForAnyThreadCount) {
  const std::int64_t max_len = 64, dim = 768, batch = 8, seq = 512;
  const std::vector<float> dy = random_floats(batch * seq * dim);
  std::vector<std::int64_t> ids(static_cast<std::size_t>(batch * seq));
  for (auto& id : ids) id = uniform_int(0, max_len - 1);  // ~64 tokens per row
  const Positions positions = Positions::ids(ids, batch, seq);
  std::vector<float> one(static_cast<std::size_t>(max_len * dim), 0.0f), two(one);
  set_num_threads(1);
  learned_backward(ConstTensorView::of(dy.data(), {batch, seq, dim}), positions,
                   TensorView::of(one.data(), {max_len, dim}));
  set_num_threads(2);
  learned_backward(ConstTensorView::of(dy.data(), {batch, seq, dim}), positions,
                   TensorView::of(two.data(), {max_len, dim}));
  EXPECT_EQ(std::memcmp(one.data(), two.data(), one.size() * sizeof(float)), 0);
  // And the sum is right: row 0 against a sequential f32 sum in token order.
  for (std::int64_t j = 0; j < dim; j += 97) {
    float acc = 0;
    for (std::int64_t t = 0; t < batch * seq; ++t) {
      if (ids[static_cast<std::size_t>(t)] == 0) acc += dy[static_cast<std::size_t>(t * dim + j)];
    }
    EXPECT_EQ(one[static_cast<std::size_t>(j)], acc) << j;
  }
}

TEST(Learned, InitNormalIsSeededAndThreadCountFree) {
  const std::int64_t max_len = 512, dim = 300;
  std::vector<float> a(static_cast<std::size_t>(max_len * dim)), b(a.size()), c(a.size());
  set_num_threads(1);
  learned_init_normal(TensorView::of(a.data(), {max_len, dim}), 0.02, 42);
  set_num_threads(2);
  learned_init_normal(TensorView::of(b.data(), {max_len, dim}), 0.02, 42);
  learned_init_normal(TensorView::of(c.data(), {max_len, dim}), 0.02, 43);
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0);
  EXPECT_NE(std::memcmp(a.data(), c.data(), a.size() * sizeof(float)), 0);
  // Moments of 153600 N(0, 0.02²) draws: the sample mean has standard error 0.02/√n ≈ 5.1e-5 and
  // the sample std about 0.02/√(2n) ≈ 3.6e-5; 6 standard errors cannot fail by chance in practice.
  double sum = 0, sum_sq = 0;
  for (const float v : a) {
    sum += v;
    sum_sq += static_cast<double>(v) * v;
  }
  const double n = static_cast<double>(a.size());
  const double mean = sum / n, std_dev = std::sqrt(sum_sq / n - mean * mean);
  EXPECT_NEAR(mean, 0.0, 6 * 0.02 / std::sqrt(n));
  EXPECT_NEAR(std_dev, 0.02, 6 * 0.02 / std::sqrt(2 * n));
  learned_init_zeros(TensorView::of(a.data(), {max_len, dim}));
  for (const float v : a) ASSERT_EQ(v, 0.0f);
}

TEST(Learned, RejectsPositionsBeyondTheTable) {
  std::vector<float> table(16 * 4), x(8 * 4), y(8 * 4);
  const std::vector<std::int64_t> ids = {0, 3, 16, 2};
  expect_error(
      [&] {
        learned_forward(ConstTensorView::of(table.data(), {16, 4}), ConstTensorView::of(x.data(), {4, 4}),
                        Positions::ids(ids), TensorView::of(y.data(), {4, 4}));
      },
      {"learned_forward", "position = 16", "max_len = 16", "does not extrapolate"});
  expect_error(
      [&] {
        learned_backward(ConstTensorView::of(x.data(), {8, 4}), Positions::range(8, 10),
                         TensorView::of(table.data(), {16, 4}));
      },
      {"learned_backward", "position = 17", "max_len = 16"});
}

TEST(Learned, RejectsBadArguments) {
  std::vector<float> table(16 * 4), x(8 * 4), y(8 * 4);
  std::vector<double> wide(8 * 4);
  expect_error(
      [&] {
        learned_forward(ConstTensorView::of(table.data(), {16, 4}), ConstTensorView::of(x.data(), {4, 8}),
                        Positions::range(4), TensorView::of(y.data(), {4, 8}));
      },
      {"x.size(-1) = 8", "the width of table, 4"});
  expect_error(
      [&] {
        learned_backward(ConstTensorView::of(x.data(), {4, 8}), Positions::range(4),
                         TensorView::of(table.data(), {8, 4}));
      },
      {"learned_backward: dy.size(-1) = 8", "the width of d_table, 4"});
  expect_error(
      [&] {
        learned_forward(ConstTensorView::of(table.data(), {16, 4}), ConstTensorView::of(table.data(), {16, 4}),
                        Positions::range(16), TensorView::of(table.data(), {16, 4}));
      },
      {"y = [16, 4]", "disjoint from table"});
  expect_error(
      [&] {
        learned_backward(ConstTensorView::of(x.data(), {8, 4}), Positions::range(8),
                         TensorView::of(table.data(), {16, 4}), TensorView::of(x.data(), {8, 4}));
      },
      {"dx = [8, 4]", "disjoint from dy"});
  expect_error(
      [&] {
        learned_forward(ConstTensorView::of(table.data(), {16, 4}), ConstTensorView::of(wide.data(), {8, 4}),
                        Positions::range(8), TensorView::of(y.data(), {8, 4}));
      },
      {"x.dtype() = f64", "f32"});
  expect_error(
      [&] {
        learned_forward(ConstTensorView::of(table.data(), {16, 4}), ConstTensorView::of(x.data(), {8, 4}),
                        Positions::range(8), TensorView::of(table.data() + 8, {8, 4}));
      },
      {"y = [8, 4]", "disjoint from table"});
  expect_error(
      [&] {
        learned_backward(ConstTensorView::of(x.data(), {8, 4}), Positions::range(8),
                         TensorView::of(table.data(), {16, 4}, {0, 1}));
      },
      {"d_table.stride(0) = 0"});
  // 2^62 floats: more than std::vector can hold, so no allocation is even attempted (a merely
  // huge request would abort under AddressSanitizer instead of throwing bad_alloc).
  expect_error([] { LearnedTable(std::int64_t{1} << 40, std::int64_t{1} << 22); },
               {"LearnedTable", "max_len × dim = 1099511627776 × 4194304", "fits in memory"});
  expect_error([&] { learned_init_normal(TensorView::of(table.data(), {16, 4}), -1.0, 0); }, {"std = -1;"});
  expect_error([] { LearnedTable(0, 4); }, {"LearnedTable", "max_len = 0"});
  expect_error([] { LearnedTable(4, -1); }, {"dim = -1"});
}

TEST(Learned, OwnedTable) {
  LearnedTable table(10, 6);
  EXPECT_EQ(table.view().size(0), 10);
  EXPECT_EQ(table.view().size(1), 6);
  learned_init_normal(table.view(), 1.0, 7);
  std::vector<float> x(6, 0.0f), y(6);
  const std::vector<std::int64_t> ids = {9};
  learned_forward(table.view(), ConstTensorView::of(x.data(), {1, 6}), Positions::ids(ids),
                  TensorView::of(y.data(), {1, 6}));
  EXPECT_EQ(y[0], table.view().typed<float>()[9 * 6]);
}

INSTANTIATE_TEST_SUITE_P(Targets, EveryTarget, ::testing::ValuesIn(testing::all_targets()),
                         [](const ::testing::TestParamInfo<std::string>& target) { return target.param; });

}  // namespace
}  // namespace posenc
