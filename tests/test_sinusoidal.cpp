// Sinusoidal encoding: parameters, the classic table, every target against the fp64 reference
// over random shapes/positions/dtypes/strides, exactness at long positions against long double,
// thread-count invariance, and every documented error.
#include <cmath>
#include <cstring>

#include "testing.hpp"

namespace posenc {
namespace {

using testing::element;
using testing::EveryTarget;
using testing::expect_error;
using testing::uniform_int;

// One unit in the last place of `value` in a 16-bit float format with `mantissa_bits` stored
// mantissa bits and smallest normal exponent `min_exponent` (below it the spacing is constant).
double ulp16(double value, int mantissa_bits, int min_exponent) {
  const int exponent = value == 0.0 ? min_exponent : std::max(std::ilogb(value), min_exponent);
  return std::ldexp(1.0, exponent - mantissa_bits);
}

// Tolerance of an output against the fp64 reference value `want` at position p, by dtype.
//   f32:  both sides are within p·2^-52 + 2^-53 (angle) of the truth, the SIMD path adds a
//         rotation error (< 1e-13) and rounds to f32 once (<= 2^-25): 2^-25 + p·2^-50 + 2^-40
//         covers the sum with room to spare, and stays below 2^-24 for every p <= 2^24.
//   bf16, f16: the kernel rounds to f32, then to the 16-bit type; the reference rounds its fp64
//         value to f32, then to the 16-bit type. The two f32 values differ by at most the f32
//         tolerance, which can move a value across a rounding midpoint: one ulp of the 16-bit type
//         at |want| (bf16 7 mantissa bits, f16 10) plus that f32 tolerance.
//   f64:  the f64 path is the reference itself: exact agreement.
double tolerance(DType dtype, std::int64_t p, double want) {
  const double f32 = std::ldexp(1.0, -25) + static_cast<double>(p) * std::ldexp(1.0, -50) + std::ldexp(1.0, -40);
  switch (dtype) {
    case DType::kF32:
      return f32;
    case DType::kBF16:
      return ulp16(want, 7, -126) + f32;
    case DType::kF16:
      return ulp16(want, 10, -14) + f32;
    case DType::kF64:
      return 0.0;
  }
  return 0;
}

TEST(SinusoidalParams, RejectsInvalidValues) {
  expect_error([] { SinusoidalParams(7); }, {"sinusoidal: dim = 7", "even number in [2, 2^20]"});
  expect_error([] { SinusoidalParams(0); }, {"dim = 0"});
  expect_error([] { SinusoidalParams(-4); }, {"dim = -4"});
  expect_error([] { SinusoidalParams((1 << 20) + 2); }, {"dim = 1048578"});
  expect_error([] { SinusoidalParams(8, 1.0); }, {"base = 1;", "finite number > 1"});
  expect_error([] { SinusoidalParams(8, 1.0 - 1e-9); }, {"base = 0.999999999;"});
  expect_error([] { SinusoidalParams(8, 0.5); }, {"base = 0.5"});
  expect_error([] { SinusoidalParams(8, std::nan("")); }, {"base = nan"});
  expect_error([] { SinusoidalParams(8, INFINITY); }, {"base = inf"});
  expect_error([] { SinusoidalParams(8, 10000.0, static_cast<SinusoidalLayout>(9)); }, {"layout = 9"});
}

TEST(SinusoidalParams, InverseFrequenciesAreExactPowers) {
  const SinusoidalParams params(6, 10000.0);
  const std::vector<double> w = params.inv_frequencies();
  ASSERT_EQ(w.size(), 3u);
  EXPECT_EQ(w[0], 1.0);
  // 10000^(-2/6) correctly rounded: computed here independently in long double.
  EXPECT_EQ(w[1], static_cast<double>(std::pow(10000.0L, -1.0L / 3.0L)));
  EXPECT_EQ(w[2], static_cast<double>(std::pow(10000.0L, -2.0L / 3.0L)));
}

// The table every tutorial prints (Vaswani et al. with d = 4): values are sin/cos of p and p/100.
TEST_P(EveryTarget, SinusoidalClassicTable) {
  std::vector<float> table(40);
  sinusoidal_table(SinusoidalParams(4), Positions::range(10), TensorView::of(table.data(), {10, 4}));
  for (int p = 0; p < 10; ++p) {
    EXPECT_NEAR(table[p * 4 + 0], std::sin(p), 1e-7);
    EXPECT_NEAR(table[p * 4 + 1], std::cos(p), 1e-7);
    EXPECT_NEAR(table[p * 4 + 2], std::sin(p / 100.0), 1e-7);
    EXPECT_NEAR(table[p * 4 + 3], std::cos(p / 100.0), 1e-7);
  }
  std::vector<float> split(40);
  sinusoidal_table(SinusoidalParams(4, 10000.0, SinusoidalLayout::kSplitHalves), Positions::range(10),
                   TensorView::of(split.data(), {10, 4}));
  for (int p = 0; p < 10; ++p) {
    EXPECT_EQ(split[p * 4 + 0], table[p * 4 + 0]);
    EXPECT_EQ(split[p * 4 + 1], table[p * 4 + 2]);
    EXPECT_EQ(split[p * 4 + 2], table[p * 4 + 1]);
    EXPECT_EQ(split[p * 4 + 3], table[p * 4 + 3]);
  }
}

// Random positions of one of the kinds the kernels treat differently: long runs (rotation),
// isolated ids (exact path only), runs broken by jumps, far positions.
std::vector<std::int64_t> random_ids(std::int64_t n) {
  std::vector<std::int64_t> ids(static_cast<std::size_t>(n));
  const std::int64_t far[] = {0, 1 << 16, 1 << 20, 1 << 24, std::int64_t{1} << 30};
  std::int64_t p = far[uniform_int(0, 4)] + uniform_int(0, 100);
  for (auto& id : ids) {
    id = p;
    const std::int64_t kind = uniform_int(0, 9);
    p = kind < 7 ? p + 1 : (kind < 9 ? uniform_int(0, 1 << 24) : p);  // mostly runs
  }
  return ids;
}

// Compares `out` (a strided [rows, dim] view of `dtype`) with the reference written into an f64
// table of the same positions.
void expect_matches_reference(const SinusoidalParams& params, const Positions& positions, const void* out, DType dtype,
                              std::int64_t rows, std::int64_t row_stride, std::int64_t col_stride) {
  std::vector<double> expected(static_cast<std::size_t>(rows * params.dim()));
  ref::sinusoidal_table(params, positions, TensorView::of(expected.data(), {rows, params.dim()}));
  int reported = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t j = 0; j < params.dim(); ++j) {
      const double got = element(out, dtype, r * row_stride + j * col_stride);
      const double want = expected[static_cast<std::size_t>(r * params.dim() + j)];
      const double tol = tolerance(dtype, positions.at(0, r), want);
      if (!(std::fabs(got - want) <= tol) && reported++ < 5) {
        ADD_FAILURE() << "row " << r << " (position " << positions.at(0, r) << ") column " << j << ": got " << got
                      << ", reference " << want << ", tolerance " << tol;
      }
    }
  }
}

TEST_P(EveryTarget, SinusoidalTableMatchesReference) {
  const std::int64_t dims[] = {2, 4, 6, 14, 16, 18, 30, 34, 62, 66, 130, 768, 1026};
  const DType dtypes[] = {DType::kF32, DType::kBF16, DType::kF16, DType::kF64};
  for (int trial = 0; trial < 40; ++trial) {
    const std::int64_t dim = dims[uniform_int(0, std::size(dims) - 1)];
    const std::int64_t rows = uniform_int(0, 1) ? uniform_int(1, 9) : uniform_int(60, 200);
    const auto layout = uniform_int(0, 1) ? SinusoidalLayout::kSplitHalves : SinusoidalLayout::kInterleaved;
    const double base = uniform_int(0, 3) ? 10000.0 : testing::uniform(2.0, 1e6);
    const DType dtype = dtypes[uniform_int(0, 3)];
    // Strided views: rows padded, and sometimes every other column.
    const std::int64_t col_stride = uniform_int(0, 3) == 0 ? 2 : 1;
    const std::int64_t row_stride = dim * col_stride + uniform_int(0, 5);
    const std::vector<std::int64_t> ids = random_ids(rows);
    const SinusoidalParams params(dim, base, layout);
    SCOPED_TRACE("trial " + std::to_string(trial) + ": dim " + std::to_string(dim) + ", rows " + std::to_string(rows) +
                 ", base " + std::to_string(base) + ", dtype " + std::string(dtype_name(dtype)) + ", strides [" +
                 std::to_string(row_stride) + ", " + std::to_string(col_stride) + "], layout " +
                 std::to_string(static_cast<int>(layout)));
    auto buffer = testing::garbage_buffer(dtype, rows * row_stride);
    const TensorView out(buffer.data(), dtype, std::vector<std::int64_t>{rows, dim},
                         std::vector<std::int64_t>{row_stride, col_stride});
    sinusoidal_table(params, Positions::ids(ids), out);
    expect_matches_reference(params, Positions::ids(ids), buffer.data(), dtype, rows, row_stride, col_stride);
    // Contiguous ranges take the rotation path across whole runs.
    const std::int64_t start = ids.front();
    sinusoidal_table(params, Positions::range(rows, start), out);
    expect_matches_reference(params, Positions::range(rows, start), buffer.data(), dtype, rows, row_stride, col_stride);
  }
}

// The exactness bar: every f32 value within 2^-23 of the true sin/cos of the exact angle
// p·base^(-2i/d), for positions up to 2^24 and d up to 8192, against long double. posenc's own
// documented bound is tighter (2^-25 + p·2^-52 + 1e-11 < 2^-24 for p <= 2^24), so that is what is
// asserted; the fp32 `p * div_term` formulation is off by ~0.05 at 2^20 and would fail by far.
TEST_P(EveryTarget, SinusoidalExactAtLongPositions) {
  const std::int64_t centres[] = {1 << 16, 1 << 20, 1 << 24};
  for (const std::int64_t dim : {2, 64, 768, 8192}) {
    const SinusoidalParams params(dim);
    for (const std::int64_t centre : centres) {
      // 70 rows cross a run boundary of the rotation path; the last row is exactly 2^24.
      const std::int64_t rows = 70, start = centre - rows + 1;
      std::vector<float> table(static_cast<std::size_t>(rows * dim));
      sinusoidal_table(params, Positions::range(rows, start), TensorView::of(table.data(), {rows, dim}));
      double worst = 0;
      for (std::int64_t r = 0; r < rows; ++r) {
        const long double p = static_cast<long double>(start + r);
        for (std::int64_t i = 0; i < dim / 2; ++i) {
          const long double angle =
              p * std::pow(10000.0L, -2.0L * static_cast<long double>(i) / static_cast<long double>(dim));
          const auto at = static_cast<std::size_t>(r * dim + 2 * i);
          worst = std::max({worst, static_cast<double>(std::fabs(table[at] - std::sin(angle))),
                            static_cast<double>(std::fabs(table[at + 1] - std::cos(angle)))});
        }
      }
      // 2^-24: the documented bound 2^-25 + p·2^-52 + 1e-11 at p = 2^24 is 2^-25 + 2^-28 + 1e-11.
      EXPECT_LE(worst, std::ldexp(1.0, -24)) << "dim " << dim << ", positions ending at " << centre;
    }
  }
}

TEST_P(EveryTarget, SinusoidalAddMatchesReference) {
  const DType dtypes[] = {DType::kF32, DType::kBF16, DType::kF16, DType::kF64};
  for (int trial = 0; trial < 30; ++trial) {
    const std::int64_t batch = uniform_int(1, 3), seq = uniform_int(1, 70);
    const std::int64_t dim = 2 * uniform_int(1, 70);
    const DType dtype = dtypes[uniform_int(0, 3)];
    const bool in_place = uniform_int(0, 1) == 1;
    // x lives inside a larger buffer: padded rows ([B, S, D] with row stride > D).
    const std::int64_t row_stride = dim + uniform_int(0, 3);
    const std::int64_t count = batch * seq * row_stride;
    SCOPED_TRACE("trial " + std::to_string(trial) + ": [" + std::to_string(batch) + ", " + std::to_string(seq) + ", " +
                 std::to_string(dim) + "] " + std::string(dtype_name(dtype)) + (in_place ? " in place" : ""));
    std::vector<double> x_values(static_cast<std::size_t>(count));
    for (auto& v : x_values) v = testing::uniform(-2, 2);
    std::vector<unsigned char> x = testing::to_dtype(x_values, dtype);
    const std::vector<std::int64_t> shape = {batch, seq, dim};
    const std::vector<std::int64_t> strides = {seq * row_stride, row_stride, 1};
    const ConstTensorView xv(x.data(), dtype, shape, strides);
    std::vector<unsigned char> out_buffer = in_place ? x : testing::garbage_buffer(dtype, count);
    const TensorView out(out_buffer.data(), dtype, shape, strides);
    const ConstTensorView x_used = in_place ? ConstTensorView(out) : xv;
    // Positions: shared range with an offset, per-row cache offsets, or per-row ids.
    std::vector<std::int64_t> starts, ids;
    for (std::int64_t b = 0; b < batch; ++b) starts.push_back(uniform_int(0, 1 << 20));
    for (std::int64_t b = 0; b < batch; ++b) {
      const std::vector<std::int64_t> row = random_ids(seq);
      ids.insert(ids.end(), row.begin(), row.end());
    }
    const int kind = static_cast<int>(uniform_int(0, 2));
    const Positions positions = kind == 0   ? Positions::range(seq, starts[0])
                                : kind == 1 ? Positions::ranges(starts, seq)
                                            : Positions::ids(ids, batch, seq);
    const SinusoidalParams params(dim);
    sinusoidal_add(params, x_used, positions, out);
    // The reference in f64 on x as rounded to the dtype.
    std::vector<double> x64(static_cast<std::size_t>(batch * seq * dim)), expected(x64.size());
    for (std::int64_t t = 0; t < batch * seq; ++t) {
      for (std::int64_t j = 0; j < dim; ++j) {
        x64[static_cast<std::size_t>(t * dim + j)] = element(x.data(), dtype, t * row_stride + j);
      }
    }
    ref::sinusoidal_add(params, ConstTensorView::of(x64.data(), {batch, seq, dim}), positions,
                        TensorView::of(expected.data(), {batch, seq, dim}));
    int reported = 0;
    for (std::int64_t b = 0; b < batch; ++b) {
      for (std::int64_t s = 0; s < seq; ++s) {
        for (std::int64_t j = 0; j < dim; ++j) {
          const double got = element(out_buffer.data(), dtype, b * seq * row_stride + s * row_stride + j);
          const double want = expected[static_cast<std::size_t>((b * seq + s) * dim + j)];
          // The sum x + PE (|x| <= 2) rounds once more in the output dtype: the encoding's
          // tolerance plus one ulp of the sum in that dtype (f32 2^-23 relative).
          const double ulp_sum = dtype == DType::kF32    ? std::ldexp(std::fabs(want), -23)
                                 : dtype == DType::kBF16 ? ulp16(want, 7, -126)
                                 : dtype == DType::kF16  ? ulp16(want, 10, -14)
                                                         : 0.0;
          const double tol = tolerance(dtype, positions.at(b, s), want) + ulp_sum;
          if (!(std::fabs(got - want) <= tol) && reported++ < 5) {
            ADD_FAILURE() << "[" << b << ", " << s << ", " << j << "] got " << got << ", reference " << want;
          }
        }
      }
    }
  }
}

// Column strides, x and out with different strides (both paths of the add), packed positions.
TEST_P(EveryTarget, SinusoidalAddStridedAndPacked) {
  const SinusoidalParams params(22, 500.0, SinusoidalLayout::kSplitHalves);
  const std::vector<std::int64_t> cu_seqlens = {0, 5, 20, 20, 37};  // an empty sequence too
  const Positions packed = Positions::packed(cu_seqlens);
  const std::int64_t tokens = 37, dim = 22;
  auto check = [&](const ConstTensorView& x, const TensorView& out, const std::vector<float>& out_buffer,
                   std::int64_t out_row, std::int64_t out_col, const Positions& positions, std::int64_t batch,
                   std::int64_t seq) {
    std::vector<double> x64(static_cast<std::size_t>(batch * seq * dim)), expected(x64.size());
    for (std::int64_t b = 0; b < batch; ++b) {
      for (std::int64_t s = 0; s < seq; ++s) {
        for (std::int64_t j = 0; j < dim; ++j) {
          const std::int64_t at =
              x.rank() == 3 ? b * x.stride(0) + s * x.stride(1) + j * x.stride(2) : s * x.stride(0) + j * x.stride(1);
          x64[static_cast<std::size_t>((b * seq + s) * dim + j)] = x.typed<float>()[at];
        }
      }
    }
    ref::sinusoidal_add(params, ConstTensorView::of(x64.data(), {batch, seq, dim}), positions,
                        TensorView::of(expected.data(), {batch, seq, dim}));
    sinusoidal_add(params, x, positions, out);
    for (std::int64_t t = 0; t < batch * seq; ++t) {
      for (std::int64_t j = 0; j < dim; ++j) {
        const double want = expected[static_cast<std::size_t>(t * dim + j)];
        // Encoding tolerance plus one f32 ulp of the sum (|x| <= 1).
        ASSERT_NEAR(out_buffer[static_cast<std::size_t>(t * out_row + j * out_col)], want,
                    tolerance(DType::kF32, 40, want) + std::ldexp(2.0, -23))
            << "token " << t << ", column " << j;
      }
    }
  };
  // x every other column of a padded buffer, out contiguous: packed positions.
  std::vector<float> x_buffer(static_cast<std::size_t>(tokens * 50));
  for (auto& v : x_buffer) v = static_cast<float>(testing::uniform(-1, 1));
  std::vector<float> out(static_cast<std::size_t>(tokens * dim), NAN);
  check(ConstTensorView::of(x_buffer.data(), {tokens, dim}, {50, 2}), TensorView::of(out.data(), {tokens, dim}), out,
        dim, 1, packed, 1, tokens);
  // x contiguous [2, 18, 22], out with padded rows; per-row cache offsets.
  const std::vector<std::int64_t> starts = {3, 1000};
  std::vector<float> out_padded(static_cast<std::size_t>(2 * 18 * 25), NAN);
  check(ConstTensorView::of(x_buffer.data(), {2, 18, dim}),
        TensorView::of(out_padded.data(), {2, 18, dim}, {18 * 25, 25, 1}), out_padded, 25, 1,
        Positions::ranges(starts, 18), 2, 18);
}

// Large enough to use every thread and non-temporal stores; the output starts 4 bytes past a
// line boundary, so the aligned and unaligned paths both run.
TEST_P(EveryTarget, SinusoidalBitwiseIdenticalForAnyThreadCount) {
  const std::int64_t rows = 2100, dim = 1030;
  const SinusoidalParams params(dim);
  std::vector<float> one(static_cast<std::size_t>(rows * dim + 16)), two(one.size());
  set_num_threads(1);
  sinusoidal_table(params, Positions::range(rows, 12345), TensorView::of(one.data() + 1, {rows, dim}));
  set_num_threads(2);
  sinusoidal_table(params, Positions::range(rows, 12345), TensorView::of(two.data() + 1, {rows, dim}));
  EXPECT_EQ(std::memcmp(one.data(), two.data(), one.size() * sizeof(float)), 0);
  expect_matches_reference(params, Positions::range(rows, 12345), one.data() + 1, DType::kF32, rows, dim, 1);

  std::vector<float> x(static_cast<std::size_t>(4 * 600 * dim), 0.5f), y1(x.size()), y2(x.size());
  set_num_threads(1);
  sinusoidal_add(params, ConstTensorView::of(x.data(), {4, 600, dim}), Positions::range(600, 7),
                 TensorView::of(y1.data(), {4, 600, dim}));
  set_num_threads(2);
  sinusoidal_add(params, ConstTensorView::of(x.data(), {4, 600, dim}), Positions::range(600, 7),
                 TensorView::of(y2.data(), {4, 600, dim}));
  EXPECT_EQ(std::memcmp(y1.data(), y2.data(), y1.size() * sizeof(float)), 0);
  // 9.9 MB out of place: the streaming path of the add, against the reference (encoding
  // tolerance plus one f32 ulp of the sum, |x + PE| < 2).
  std::vector<double> x64(x.begin(), x.end()), want(x.size());
  ref::sinusoidal_add(params, ConstTensorView::of(x64.data(), {4, 600, dim}), Positions::range(600, 7),
                      TensorView::of(want.data(), {4, 600, dim}));
  for (std::size_t i = 0; i < want.size(); ++i) {
    ASSERT_NEAR(y1[i], want[i], tolerance(DType::kF32, 700, want[i]) + std::ldexp(1.0, -23)) << i;
  }
}

// Tables larger than the streaming threshold (8 MiB) take the non-temporal path.
TEST_P(EveryTarget, SinusoidalStreamedTableMatchesReference) {
  const std::int64_t rows = 2050, dim = 1024 + 6;  // 8.4 MB of f32
  const SinusoidalParams params(dim, 10000.0, SinusoidalLayout::kSplitHalves);
  std::vector<float> table(static_cast<std::size_t>(rows * dim + 3));
  float* out = table.data() + 3;  // 12 bytes past the allocation's alignment
  sinusoidal_table(params, Positions::range(rows, (1 << 20) - 1000), TensorView::of(out, {rows, dim}));
  expect_matches_reference(params, Positions::range(rows, (1 << 20) - 1000), out, DType::kF32, rows, dim, 1);
}

// Every target with fused multiply-adds (avx2, avx512: every host of the fleet) walks the same
// fp64 operations per (sin, cos) pair, whatever its tile width, store kind or row grouping, so
// the tables agree to the bit (the study's golden results rely on it across hosts). sse4 and
// scalar round each multiply-add twice. Cached runs (16 rows) and large ones (64 rows in groups),
// both layouts, outputs on and off line boundaries, and the add.
TEST(Sinusoidal, SameBitsOnEveryFmaTarget) {
  struct Shape {
    std::int64_t rows, dim, offset;
  };
  const Shape shapes[] = {{37, 130, 0}, {100, 1026, 1}, {2100, 1030, 0}, {2100, 1030, 2}, {2050, 1056, 0}};
  std::vector<std::string> targets;
  for (const std::string& t : testing::all_targets()) {
    if (t == "avx2" || t == "avx512") targets.push_back(t);
  }
  if (targets.size() < 2) GTEST_SKIP() << "one target with fused multiply-adds on this host";
  for (const auto layout : {SinusoidalLayout::kInterleaved, SinusoidalLayout::kSplitHalves}) {
    for (const Shape& shape : shapes) {
      const SinusoidalParams params(shape.dim, 10000.0, layout);
      const auto size = static_cast<std::size_t>(shape.rows * shape.dim + shape.offset);
      std::vector<float> x(size);
      for (std::size_t i = 0; i < size; ++i) x[i] = static_cast<float>(i % 7) * 0.25f;
      std::vector<float> first_table, first_sum;
      for (const std::string& target : targets) {
        SCOPED_TRACE(target + ": rows " + std::to_string(shape.rows) + ", dim " + std::to_string(shape.dim) +
                     ", offset " + std::to_string(shape.offset) + ", layout " +
                     std::to_string(static_cast<int>(layout)));
        set_target(target);
        std::vector<float> table(size), sum(size);
        const auto positions = Positions::range(shape.rows, 4093);
        sinusoidal_table(params, positions, TensorView::of(table.data() + shape.offset, {shape.rows, shape.dim}));
        sinusoidal_add(params, ConstTensorView::of(x.data() + shape.offset, {1, shape.rows, shape.dim}), positions,
                       TensorView::of(sum.data() + shape.offset, {1, shape.rows, shape.dim}));
        if (first_table.empty()) {
          first_table = table;
          first_sum = sum;
          continue;
        }
        EXPECT_EQ(std::memcmp(table.data(), first_table.data(), size * sizeof(float)), 0) << "table vs " << targets[0];
        EXPECT_EQ(std::memcmp(sum.data(), first_sum.data(), size * sizeof(float)), 0) << "add vs " << targets[0];
      }
      set_target("auto");
    }
  }
}

TEST(Sinusoidal, EmptyInputsAreFine) {
  std::vector<float> none;
  EXPECT_NO_THROW(sinusoidal_table(SinusoidalParams(8), Positions::range(0), TensorView::of(none.data(), {0, 8})));
  EXPECT_NO_THROW(sinusoidal_add(SinusoidalParams(8), ConstTensorView::of(none.data(), {0, 5, 8}), Positions::range(5),
                                 TensorView::of(none.data(), {0, 5, 8})));
}

TEST(Sinusoidal, RejectsBadArguments) {
  std::vector<float> table(64), x(64), y(64);
  std::vector<double> wide(64);
  const SinusoidalParams params(8);
  expect_error(
      [&] {
        sinusoidal_table(params, Positions::range(8), TensorView::of(table.data(), {4, 16}));
      },
      {"sinusoidal_table", "out.size(1) = 16", "params.dim() = 8"});
  expect_error(
      [&] {
        sinusoidal_table(params, Positions::range(8), TensorView::of(table.data(), {2, 4, 8}));
      },
      {"out.rank() = 3", "2 ([rows, D])"});
  expect_error(
      [&] {
        sinusoidal_table(params, Positions::range(5), TensorView::of(table.data(), {8, 8}));
      },
      {"positions.seq_len() = 5", "8 (one position per token)"});
  const std::vector<std::int64_t> starts = {0, 4};
  expect_error(
      [&] {
        sinusoidal_table(params, Positions::ranges(starts, 8), TensorView::of(table.data(), {8, 8}));
      },
      {"positions.batch() = 2", "0 or 1"});
  expect_error(
      [&] {
        sinusoidal_table(params, Positions::range(8), TensorView::of(table.data(), {8, 8}, {0, 1}));
      },
      {"out.stride(0) = 0", "expected >= 1, so that no two elements of an output share memory"});
  // Rows that overlap (stride 4 < width 8) would have two threads write one element.
  expect_error(
      [&] {
        sinusoidal_table(params, Positions::range(8), TensorView::of(table.data(), {8, 8}, {4, 1}));
      },
      {"out.stride(0) = 4", ">= 8"});
  expect_error(
      [&] {
        sinusoidal_add(params, ConstTensorView::of(x.data(), {8, 8}), Positions::range(8),
                       TensorView::of(wide.data(), {8, 8}));
      },
      {"sinusoidal_add", "out.dtype() = f64", "f32"});
  expect_error(
      [&] {
        sinusoidal_add(params, ConstTensorView::of(x.data(), {4, 8}), Positions::range(4),
                       TensorView::of(y.data(), {2, 8}));
      },
      {"out shape = [1, 2, 8]", "the shape of x, [1, 4, 8]"});
  expect_error(
      [&] {
        sinusoidal_add(params, ConstTensorView::of(x.data(), {4, 8}), Positions::range(4),
                       TensorView::of(x.data() + 4, {4, 8}));
      },
      {"out = [4, 8]", "disjoint from x"});
  expect_error(
      [&] {
        sinusoidal_add(params, ConstTensorView::of(x.data(), {2, 2, 8}), Positions::ranges(starts, 3),
                       TensorView::of(y.data(), {2, 2, 8}));
      },
      {"positions.seq_len() = 3"});
  expect_error(
      [&] {
        sinusoidal_add(params, ConstTensorView::of(x.data(), {4, 2, 8}), Positions::ranges(starts, 2),
                       TensorView::of(y.data(), {4, 2, 8}));
      },
      {"positions.batch() = 2", "batch size 4"});
  expect_error(
      [&] {
        sinusoidal_add(params, ConstTensorView::of(x.data(), {2, 2, 2, 8}), Positions::range(2),
                       TensorView::of(y.data(), {2, 2, 2, 8}));
      },
      {"x.rank() = 4", "3 ([B, S, D]) or 2 ([S, D])"});
}

INSTANTIATE_TEST_SUITE_P(Targets, EveryTarget, ::testing::ValuesIn(testing::all_targets()),
                         [](const ::testing::TestParamInfo<std::string>& target) { return target.param; });

}  // namespace
}  // namespace posenc
