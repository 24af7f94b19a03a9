// FLOATER: the RK4 trajectory (prefix property, fourth-order convergence, dtypes and strides),
// gradients of every parameter against finite differences of the forward, and errors.
#include <cmath>
#include <cstring>

#include "testing.hpp"

namespace posenc {
namespace {

using testing::expect_error;
using testing::uniform;
using testing::uniform_int;

std::vector<double> table_of(const FloaterParams& p, std::int64_t length) {
  std::vector<double> t(static_cast<std::size_t>(length * p.dim()));
  floater_table(p, TensorView::of(t.data(), {length, p.dim()}));
  return t;
}

TEST(Floater, LongerTablesExtendShorterOnesExactly) {
  const FloaterParams p = FloaterParams::init(6, 8, 1, 1.0, 0.1, 3);
  const std::vector<double> short_table = table_of(p, 50), long_table = table_of(p, 200);
  EXPECT_EQ(std::memcmp(short_table.data(), long_table.data(), short_table.size() * sizeof(double)), 0);
  for (std::int64_t d = 0; d < 6; ++d)
    EXPECT_EQ(long_table[static_cast<std::size_t>(d)], p.p0()[static_cast<std::size_t>(d)]);
  // f32 and a transposed view hold the same values, rounded once.
  std::vector<float> t32(6 * 50);
  floater_table(p, TensorView::of(t32.data(), {50, 6}, {1, 50}));
  for (std::int64_t n = 0; n < 50; ++n) {
    for (std::int64_t d = 0; d < 6; ++d) {
      EXPECT_EQ(t32[static_cast<std::size_t>(d * 50 + n)],
                static_cast<float>(short_table[static_cast<std::size_t>(n * 6 + d)]));
    }
  }
}

// RK4 is fourth order: halving the step divides the error at a fixed time by about 16. The
// "truth" is the same system with 64 substeps. Scale 1 and Δ = 0.25 keep h·‖∂h_θ/∂p‖ well below
// 1, the asymptotic regime (with scale 3 and Δ = 0.5 the ratios fall to 5–9).
TEST(Floater, Rk4ConvergesAtFourthOrder) {
  const FloaterParams base = FloaterParams::init(4, 16, 5, 1.0, 0.25, 1);
  auto with_substeps = [&](std::int64_t substeps) {
    return FloaterParams(4, base.w1(), base.b1(), base.w2(), base.b2(), base.p0(), 0.25, substeps);
  };
  const std::vector<double> truth = table_of(with_substeps(64), 21);
  auto error = [&](std::int64_t substeps) {
    const std::vector<double> t = table_of(with_substeps(substeps), 21);
    double worst = 0;
    for (std::size_t e = 0; e < t.size(); ++e) worst = std::max(worst, std::fabs(t[e] - truth[e]));
    return worst;
  };
  const double e1 = error(1), e2 = error(2), e4 = error(4);
  // Ratios of 16 in the asymptotic regime; 10–22 allows the higher-order terms at these steps.
  EXPECT_GT(e1 / e2, 10.0) << e1 << " " << e2;
  EXPECT_LT(e1 / e2, 22.0) << e1 << " " << e2;
  EXPECT_GT(e2 / e4, 10.0) << e2 << " " << e4;
  EXPECT_LT(e2 / e4, 22.0) << e2 << " " << e4;
}

TEST(Floater, GradientsMatchFiniteDifferences) {
  for (int trial = 0; trial < 6; ++trial) {
    const std::int64_t dim = uniform_int(1, 5), hidden = uniform_int(1, 7), length = uniform_int(1, 30);
    const FloaterParams p =
        FloaterParams::init(dim, hidden, static_cast<std::uint64_t>(trial), 1.5, uniform(0.05, 0.3), uniform_int(1, 3));
    std::vector<double> w(static_cast<std::size_t>(length * dim));
    for (auto& v : w) v = uniform(-1, 1);
    auto loss = [&](const FloaterParams& q) {
      const std::vector<double> t = table_of(q, length);
      double sum = 0;
      for (std::size_t e = 0; e < t.size(); ++e) sum += w[e] * t[e];
      return sum;
    };
    FloaterGradients g(p);
    floater_table_backward(p, ConstTensorView::of(w.data(), {length, dim}), g);
    // Every parameter group, one random entry each.
    for (int group = 0; group < 5; ++group) {
      const std::vector<double>* values[] = {&p.w1(), &p.b1(), &p.w2(), &p.b2(), &p.p0()};
      const std::vector<double>* grads[] = {&g.w1, &g.b1, &g.w2, &g.b2, &g.p0};
      const auto e = static_cast<std::size_t>(uniform_int(0, static_cast<std::int64_t>(values[group]->size()) - 1));
      auto shifted = [&](double delta) {
        std::vector<double> v[] = {p.w1(), p.b1(), p.w2(), p.b2(), p.p0()};
        v[group][e] += delta;
        return FloaterParams(dim, v[0], v[1], v[2], v[3], v[4], p.time_per_position(), p.substeps());
      };
      const double step = 1e-5;
      const double fd = (loss(shifted(step)) - loss(shifted(-step))) / (2 * step);
      const double analytic = (*grads[group])[e];
      // Smooth (tanh) dynamics: central differences err by ~step²·|L'''| ≈ 1e-10 plus rounding
      // |L|·2^-52/step ≈ 1e-9 for |L| <= 1e2: 1e-6 relative is ample.
      EXPECT_NEAR(analytic, fd, 1e-6 * (1 + std::fabs(analytic)))
          << "trial " << trial << " group " << group << " entry " << e;
    }
  }
}

// The forward keeps two states, not the trajectory: a table of 3 rows at the most substeps runs
// under an allocation limit that the 2^17 states of the whole trajectory would exceed. The
// backward (checkpoints per position, one position's substeps recomputed) matches finite
// differences at 40 substeps, where every position's segment is recomputed.
TEST(Floater, ManySubstepsNeedNoTrajectory) {
  const std::size_t limit = allocation_limit();
  const FloaterParams p = FloaterParams::init(3, 4, 7, 1.0, 0.5, FloaterParams::kMaxSubsteps);
  set_allocation_limit(std::size_t{1} << 20);  // below 2 · 2^16 states · 3 · 8 bytes = 3 MiB
  std::vector<double> table;
  EXPECT_NO_THROW(table = table_of(p, 3));
  set_allocation_limit(limit);
  // At this many substeps the table is the ODE's trajectory to rounding: 4 substeps agree with it
  // to RK4's error at h = 0.125 (fourth order), far below the rows' spread.
  const FloaterParams few(3, p.w1(), p.b1(), p.w2(), p.b2(), p.p0(), 0.5, 4);
  const std::vector<double> coarse = table_of(few, 3);
  for (std::size_t e = 0; e < table.size(); ++e) EXPECT_NEAR(table[e], coarse[e], 1e-4) << e;

  const FloaterParams q(3, p.w1(), p.b1(), p.w2(), p.b2(), p.p0(), 0.5, 40);
  std::vector<double> w(3 * 5);
  for (auto& v : w) v = uniform(-1, 1);
  FloaterGradients g(q);
  floater_table_backward(q, ConstTensorView::of(w.data(), {5, 3}), g);
  const double step = 1e-5;
  for (std::size_t e = 0; e < q.w1().size(); e += 3) {
    auto loss = [&](double delta) {
      std::vector<double> w1 = q.w1();
      w1[e] += delta;
      const std::vector<double> t = table_of(FloaterParams(3, w1, q.b1(), q.w2(), q.b2(), q.p0(), 0.5, 40), 5);
      double sum = 0;
      for (std::size_t i = 0; i < t.size(); ++i) sum += w[i] * t[i];
      return sum;
    };
    const double fd = (loss(step) - loss(-step)) / (2 * step);
    EXPECT_NEAR(g.w1[e], fd, 1e-6 * (1 + std::fabs(fd))) << e;
  }
}

// A step past RK4's stability limit for the field is refused, saying what would do: a table of
// rows near 1e30 from Δ = 1e30 is the solver's artefact, not an encoding.
TEST(Floater, RefusesUnstableSteps) {
  const FloaterParams p = FloaterParams::init(4, 8, 3);
  const double lipschitz = p.lipschitz_bound();
  EXPECT_GT(lipschitz, 0.5);
  EXPECT_LT(lipschitz, 20.0);
  expect_error([] { FloaterParams::init(4, 8, 3, 1.0, 1e30); },
               {"FloaterParams: time_per_position / substeps = 1e+30 / 1", "h · L <= 2.785", "time_per_position <= "});
  // Δ = 1.9·2.785/L needs 2 substeps, and 2 are accepted.
  const double delta = 1.9 * FloaterParams::kStableStep / lipschitz;
  expect_error([&] { FloaterParams::init(4, 8, 3, 1.0, delta, 1); }, {"substeps >= 2"});
  EXPECT_NO_THROW(FloaterParams::init(4, 8, 3, 1.0, delta, 2));
  // The bound is the product of the two spectral norms, W1's time column left out: W1[:, 1:] =
  // [[3, 0], [0, 0.5], [0, 0]] (norm 3) beside a time column 5, 7, 9, and W2 = [[2, 0, 0],
  // [0, 1, 0]] (norm 2).
  const FloaterParams diagonal(2, {5.0, 3.0, 0.0, 7.0, 0.0, 0.5, 9.0, 0.0, 0.0}, {0.0, 0.0, 0.0},
                               {2.0, 0.0, 0.0, 0.0, 1.0, 0.0}, {0.0, 0.0}, {1.0, 1.0}, 0.1, 1);
  EXPECT_NEAR(diagonal.lipschitz_bound(), 6.0, 1e-9);
  // Weights whose squares overflow fp64: W2 of 1e200 beside W1 of 1e-100 has the finite bound
  // 1e100 (the norms are computed on the scaled matrices), and a step of 1e-101 is stable; with W1
  // of 1e200 too the bound is inf, and every step is refused.
  const std::vector<double> b1(3, 0.0), b2(2, 0.0), p0(2, 1.0);
  const auto w1_of = [](double x) { return std::vector<double>{0.0, x, 0.0, 0.0, 0.0, x, 0.0, 0.0, 0.0}; };
  const std::vector<double> w2 = {1e200, 0.0, 0.0, 0.0, 1e200, 0.0};
  const FloaterParams large(2, w1_of(1e-100), b1, w2, b2, p0, 1e-101, 1);
  EXPECT_NEAR(large.lipschitz_bound() / 1e100, 1.0, 1e-12);
  expect_error([&] { FloaterParams(2, w1_of(1e200), b1, w2, b2, p0, 1e-300, 1); },
               {"time_per_position / substeps = 1e-300 / 1", "= inf, a bound"});
  expect_error([] { FloaterParams::init(2, 3, 0, 1.0, 0.1, 10000000); }, {"substeps = 10000000", "[1, 65536]"});
}

TEST(Floater, RejectsBadArguments) {
  expect_error(
      [] {
        FloaterParams(2, {0.0}, {0.0}, {0.0, 0.0}, {0.0, 0.0}, {0.0, 0.0});
      },
      {"FloaterParams: w1.size() = 1", "hidden·(dim + 1) = 3"});
  expect_error([] { FloaterParams::init(2, 3, 0, 1.0, 0.0); }, {"time_per_position = 0", "> 0"});
  expect_error([] { FloaterParams::init(2, 3, 0, 1.0, 0.1, 0); }, {"substeps = 0", "in [1, 65536]"});
  const FloaterParams p = FloaterParams::init(3, 2);
  std::vector<double> t(10);
  expect_error(
      [&] {
        floater_table(p, TensorView::of(t.data(), {5, 2}));
      },
      {"floater_table: out.size(1) = 2", "params.dim() = 3"});
  FloaterGradients g(p);
  g.p0.resize(1);
  expect_error(
      [&] {
        floater_table_backward(p, ConstTensorView::of(t.data(), {3, 3}), g);
      },
      {"grads.p0.size() = 1", "3"});
}

}  // namespace
}  // namespace posenc
