// FLOATER (Liu et al. 2020): the ODE's RK4 trajectory and its exact discrete backward (math in
// posenc/floater.hpp). RK4: Runge 1895, Kutta 1901; the classical 1/6, 1/3, 1/3, 1/6 weights.
#include "posenc/floater.hpp"

#include "posenc/memory.hpp"

#include <cmath>
#include <string>

#include "internal.hpp"

namespace posenc {
namespace {

// The MLP's hidden pre-activations z = W1·[t; p] + B1.
void hidden_input(const FloaterParams& f, double t, const double* p, double* z) {
  const std::int64_t dim = f.dim(), width = dim + 1;
  for (std::int64_t k = 0; k < f.hidden(); ++k) {
    const double* row = f.w1().data() + k * width;
    double sum = f.b1()[static_cast<std::size_t>(k)] + row[0] * t;
    for (std::int64_t d = 0; d < dim; ++d) sum += row[d + 1] * p[d];
    z[k] = sum;
  }
}

// Reverse mode through h_θ at (t, u): given f̄ = dL/dh, accumulates θ's gradients and adds
// W1[:, 1:]ᵀ·z̄ to u_bar.
void mlp_backward(const FloaterParams& f, double t, const double* u, const double* f_bar, FloaterGradients& g,
                  double* u_bar, std::vector<double>& z) {
  const std::int64_t dim = f.dim(), width = dim + 1, hidden = f.hidden();
  hidden_input(f, t, u, z.data());
  for (std::int64_t d = 0; d < dim; ++d) g.b2[static_cast<std::size_t>(d)] += f_bar[d];
  for (std::int64_t k = 0; k < hidden; ++k) {
    const double a = std::tanh(z[static_cast<std::size_t>(k)]);
    double back = 0;  // (W2ᵀ f̄)_k
    for (std::int64_t d = 0; d < dim; ++d) {
      g.w2[static_cast<std::size_t>(d * hidden + k)] += f_bar[d] * a;
      back += f.w2()[static_cast<std::size_t>(d * hidden + k)] * f_bar[d];
    }
    const double z_bar = back * (1 - a * a);
    g.b1[static_cast<std::size_t>(k)] += z_bar;
    double* w1_bar = g.w1.data() + k * width;
    const double* w1 = f.w1().data() + k * width;
    w1_bar[0] += z_bar * t;
    for (std::int64_t d = 0; d < dim; ++d) {
      w1_bar[d + 1] += z_bar * u[d];
      u_bar[d] += z_bar * w1[d + 1];
    }
  }
}

// One RK4 step from (t, y) over h: y_next, and the stage inputs u1 … u4 if wanted.
void rk4_step(const FloaterParams& f, double t, double h, const double* y, double* y_next, std::vector<double>& work) {
  const auto dim = static_cast<std::size_t>(f.dim());
  double* k1 = work.data();
  double* k2 = k1 + dim;
  double* k3 = k2 + dim;
  double* k4 = k3 + dim;
  double* u = k4 + dim;
  f.dynamics(t, y, k1);
  for (std::size_t d = 0; d < dim; ++d) u[d] = y[d] + 0.5 * h * k1[d];
  f.dynamics(t + 0.5 * h, u, k2);
  for (std::size_t d = 0; d < dim; ++d) u[d] = y[d] + 0.5 * h * k2[d];
  f.dynamics(t + 0.5 * h, u, k3);
  for (std::size_t d = 0; d < dim; ++d) u[d] = y[d] + h * k3[d];
  f.dynamics(t + h, u, k4);
  for (std::size_t d = 0; d < dim; ++d) y_next[d] = y[d] + h / 6 * (k1[d] + 2 * k2[d] + 2 * k3[d] + k4[d]);
}

// RK4 steps of (length − 1)·substeps, checked against int64.
std::int64_t step_count(const char* where, const FloaterParams& f, std::int64_t length) {
  std::int64_t steps = 0;
  if (__builtin_mul_overflow(length - 1, f.substeps(), &steps)) {
    throw Error(
        where, "params.substeps()", std::to_string(f.substeps()),
        "a value whose (length − 1) · substeps steps fit in int64 (table length " + std::to_string(length) + ")");
  }
  return steps;
}

// Integrates from `y` (the state at step `first`) over `count` steps, calling at(s, y_s) for every
// step s in (first, first + count]. Two state buffers: O(dim) memory whatever the length.
template <class At>
void integrate(const FloaterParams& f, std::int64_t first, std::int64_t count, std::vector<double>& y, At&& at) {
  const auto dim = static_cast<std::size_t>(f.dim());
  std::vector<double> next(dim), work(5 * dim);
  const double h = f.time_per_position() / static_cast<double>(f.substeps());
  for (std::int64_t s = first; s < first + count; ++s) {
    // t from the step index (not by summing h), so that longer tables repeat shorter ones exactly.
    rk4_step(f, static_cast<double>(s) * h, h, y.data(), next.data(), work);
    y.swap(next);
    at(s + 1, y.data());
  }
}

// The spectral norm of a [rows, cols] row-major block (column offset `first`, row stride `stride`)
// by power iteration on AᵀA from a fixed pseudo-random start: deterministic, and accurate to far
// better than the stability margin below needs for the small MLPs FLOATER uses.
double spectral_norm(const std::vector<double>& a, std::int64_t rows, std::int64_t cols, std::int64_t stride,
                     std::int64_t first) {
  const auto r = static_cast<std::size_t>(rows), c = static_cast<std::size_t>(cols);
  // Iterate on A / max|a| (finite entries, checked by the constructor), so that no square
  // overflows whatever the weights' size; the norm is scaled back at the end.
  double largest = 0;
  for (std::size_t i = 0; i < r; ++i) {
    for (std::size_t j = 0; j < c; ++j)
      largest = std::max(largest, std::fabs(a[i * static_cast<std::size_t>(stride) + first + j]));
  }
  if (largest == 0) return 0;
  const auto at = [&](std::size_t i, std::size_t j) {
    return a[i * static_cast<std::size_t>(stride) + first + j] / largest;
  };
  std::vector<double> x(c), ax(r);
  for (std::size_t j = 0; j < c; ++j) x[j] = detail::seeded_normal(0x5eed, j);
  double sigma = 0;
  for (int iteration = 0; iteration < 200; ++iteration) {
    double norm = 0;
    for (const double v : x) norm += v * v;
    norm = std::sqrt(norm);
    if (!(norm > 0)) return sigma * largest;
    for (auto& v : x) v /= norm;
    for (std::size_t i = 0; i < r; ++i) {
      double sum = 0;
      for (std::size_t j = 0; j < c; ++j) sum += at(i, j) * x[j];
      ax[i] = sum;
    }
    double ax_norm = 0;
    for (const double v : ax) ax_norm += v * v;
    const double previous = sigma;
    sigma = std::sqrt(ax_norm);  // ‖A·x‖ for a unit x: a lower bound that rises to ‖A‖₂
    for (std::size_t j = 0; j < c; ++j) {
      double sum = 0;
      for (std::size_t i = 0; i < r; ++i) sum += at(i, j) * ax[i];
      x[j] = sum;
    }
    if (iteration > 8 && sigma - previous <= 1e-9 * sigma) break;
  }
  return sigma * largest;
}

struct TableGrid {
  std::int64_t length = 0, row_stride = 0, col_stride = 0;
};

TableGrid check_table(const char* where, const char* name, ConstTensorView view, std::int64_t dim) {
  if (view.rank() != 2)
    throw Error(where, std::string(name) + ".rank()", std::to_string(view.rank()), "2 ([length, dim])");
  if (view.size(1) != dim) {
    throw Error(where, std::string(name) + ".size(1)", std::to_string(view.size(1)),
                "params.dim() = " + std::to_string(dim));
  }
  return {view.size(0), view.stride(0), view.stride(1)};
}

}  // namespace

FloaterParams::FloaterParams(std::int64_t dim, std::vector<double> w1, std::vector<double> b1, std::vector<double> w2,
                             std::vector<double> b2, std::vector<double> p0, double time_per_position,
                             std::int64_t substeps)
    : dim_(dim),
      w1_(std::move(w1)),
      b1_(std::move(b1)),
      w2_(std::move(w2)),
      b2_(std::move(b2)),
      p0_(std::move(p0)),
      time_per_position_(time_per_position),
      substeps_(substeps) {
  if (dim < 1) throw Error("FloaterParams", "dim", std::to_string(dim), ">= 1");
  if (b1_.empty()) throw Error("FloaterParams", "b1.size()", "0", ">= 1 (the hidden width)");
  const std::size_t hidden = b1_.size(), d = static_cast<std::size_t>(dim);
  detail::check_parameter("FloaterParams", "b1", b1_, hidden, "");
  detail::check_parameter("FloaterParams", "w1", w1_, hidden * (d + 1),
                          "hidden·(dim + 1) = " + std::to_string(hidden * (d + 1)) + " ([hidden, 1 + dim])");
  detail::check_parameter("FloaterParams", "w2", w2_, d * hidden,
                          "dim·hidden = " + std::to_string(d * hidden) + " ([dim, hidden])");
  detail::check_parameter("FloaterParams", "b2", b2_, d, "dim = " + std::to_string(d));
  detail::check_parameter("FloaterParams", "p0", p0_, d, "dim = " + std::to_string(d));
  if (!std::isfinite(time_per_position) || time_per_position <= 0) {
    throw Error("FloaterParams", "time_per_position", detail::to_text(time_per_position), "a finite number > 0");
  }
  if (substeps < 1 || substeps > kMaxSubsteps) {
    // More substeps cannot make the table more accurate: at a stable step (below) RK4's local error
    // (h·L)^5 is below fp64's rounding long before 2^16 substeps, while rounding grows with each step.
    throw Error("FloaterParams", "substeps", std::to_string(substeps),
                "in [1, " + std::to_string(kMaxSubsteps) + "] (past that, steps add rounding, not accuracy)");
  }
  // RK4 is stable for h·λ on the negative real axis down to −2.785 (the root of its stability
  // polynomial 1 + z + z²/2 + z³/6 + z⁴/24 = 1; Butcher, Numerical Methods for ODEs, §238). The
  // field's Lipschitz constant in p is at most L = ‖W2‖₂·‖W1[:, 1:]‖₂ (tanh' <= 1): a step h with
  // h·L beyond that limit may amplify rounding step after step, so its table would be the solver's
  // artefact, not the ODE's trajectory.
  const double lipschitz = lipschitz_bound();
  const double h = time_per_position / static_cast<double>(substeps);
  if (!(h * lipschitz <= kStableStep)) {  // an overflowing product (inf) is refused too
    const double needed = std::ceil(time_per_position * lipschitz / kStableStep);
    throw Error("FloaterParams", "time_per_position / substeps",
                detail::to_text(time_per_position) + " / " + std::to_string(substeps),
                "a step h with h · L <= " + detail::to_text(kStableStep) +
                    " (RK4's stability limit; L = ‖W2‖·‖W1[:, 1:]‖ = " + detail::to_text(lipschitz) +
                    ", a bound on the field's Lipschitz constant): " +
                    (needed <= static_cast<double>(kMaxSubsteps)
                         ? "substeps >= " + detail::to_text(needed)
                         : "time_per_position <= " + detail::to_text(kStableStep * kMaxSubsteps / lipschitz)));
  }
}

double FloaterParams::lipschitz_bound() const {
  const std::int64_t hidden = this->hidden();
  return spectral_norm(w2_, dim_, hidden, hidden, 0) * spectral_norm(w1_, hidden, dim_, dim_ + 1, 1);
}

FloaterParams FloaterParams::init(std::int64_t dim, std::int64_t hidden, std::uint64_t seed, double scale,
                                  double time_per_position, std::int64_t substeps) {
  if (dim < 1 || hidden < 1) {
    throw Error("FloaterParams::init", "dim, hidden", std::to_string(dim) + ", " + std::to_string(hidden), ">= 1 each");
  }
  const auto d = static_cast<std::size_t>(dim), m = static_cast<std::size_t>(hidden);
  std::vector<double> w1(m * (d + 1)), b1(m, 0.0), w2(d * m), b2(d, 0.0), p0(d);
  std::uint64_t index = 0;
  for (auto& x : w1) x = scale / std::sqrt(static_cast<double>(d + 1)) * detail::seeded_normal(seed, index++);
  for (auto& x : w2) x = scale / std::sqrt(static_cast<double>(m)) * detail::seeded_normal(seed, index++);
  for (auto& x : p0) x = detail::seeded_normal(seed, index++);
  return FloaterParams(dim, std::move(w1), std::move(b1), std::move(w2), std::move(b2), std::move(p0),
                       time_per_position, substeps);
}

void FloaterParams::dynamics(double t, const double* p, double* dp) const {
  std::vector<double> a(b1_.size());
  hidden_input(*this, t, p, a.data());
  const std::int64_t hidden = this->hidden();
  for (auto& x : a) x = std::tanh(x);
  for (std::int64_t d = 0; d < dim_; ++d) {
    double sum = b2_[static_cast<std::size_t>(d)];
    for (std::int64_t k = 0; k < hidden; ++k)
      sum += w2_[static_cast<std::size_t>(d * hidden + k)] * a[static_cast<std::size_t>(k)];
    dp[d] = sum;
  }
}

FloaterGradients::FloaterGradients(const FloaterParams& p)
    : w1(p.w1().size(), 0.0),
      b1(p.b1().size(), 0.0),
      w2(p.w2().size(), 0.0),
      b2(p.b2().size(), 0.0),
      p0(p.p0().size(), 0.0) {}

void floater_table(const FloaterParams& params, TensorView out) {
  detail::init_dispatch();
  const TableGrid g = check_table("floater_table", "out", ConstTensorView(out), params.dim());
  detail::check_writable("floater_table", "out", ConstTensorView(out));
  if (g.length == 0) return;
  const std::int64_t dim = params.dim(), substeps = params.substeps();
  const auto write_row = [&](std::int64_t n, const double* y) {
    for (std::int64_t d = 0; d < dim; ++d)
      detail::store(out.data(), out.dtype(), n * g.row_stride + d * g.col_stride, y[d]);
  };
  std::vector<double> y = params.p0();
  write_row(0, y.data());
  integrate(params, 0, step_count("floater_table", params, g.length), y, [&](std::int64_t s, const double* state) {
    if (s % substeps == 0) write_row(s / substeps, state);
  });
}

void floater_table_backward(const FloaterParams& params, ConstTensorView d_table, FloaterGradients& grads) {
  detail::init_dispatch();
  const char* where = "floater_table_backward";
  const TableGrid g = check_table(where, "d_table", d_table, params.dim());
  detail::check_gradient_size(where, "grads.w1", grads.w1.size(), static_cast<std::int64_t>(params.w1().size()));
  detail::check_gradient_size(where, "grads.b1", grads.b1.size(), params.hidden());
  detail::check_gradient_size(where, "grads.w2", grads.w2.size(), static_cast<std::int64_t>(params.w2().size()));
  detail::check_gradient_size(where, "grads.b2", grads.b2.size(), params.dim());
  detail::check_gradient_size(where, "grads.p0", grads.p0.size(), params.dim());
  if (g.length == 0) return;
  const auto dim = static_cast<std::size_t>(params.dim());
  const std::int64_t substeps = params.substeps(), steps = step_count(where, params, g.length);
  // Checkpoints: the state at each position (a table row), and the states of one position's
  // substeps recomputed from its checkpoint as the reverse pass reaches it — the same operations
  // as the forward, so the same bits; memory (length + substeps)·dim, not length·substeps·dim.
  const std::int64_t rows = checked_mul(g.length, params.dim(), "floater_table_backward length · dim");
  checked_allocation(rows, sizeof(double), where, "checkpoint values (length · dim)");
  checked_allocation(checked_mul(substeps, params.dim(), "floater_table_backward substeps · dim"), sizeof(double),
                     where, "one position's substep values (substeps · dim)");
  std::vector<double> checkpoints(static_cast<std::size_t>(rows)), segment(static_cast<std::size_t>(substeps) * dim);
  {
    std::vector<double> y = params.p0();
    std::copy(y.begin(), y.end(), checkpoints.begin());
    integrate(params, 0, steps, y, [&](std::int64_t s, const double* state) {
      if (s % substeps == 0) std::copy(state, state + dim, checkpoints.begin() + (s / substeps) * params.dim());
    });
  }
  std::int64_t segment_first = -1;  // the step whose state is segment's first row
  const auto state_at = [&](std::int64_t s) -> const double* {
    const std::int64_t first = s / substeps * substeps;
    if (first != segment_first) {
      std::vector<double> y(checkpoints.begin() + first / substeps * params.dim(),
                            checkpoints.begin() + (first / substeps + 1) * params.dim());
      std::copy(y.begin(), y.end(), segment.begin());
      integrate(params, first, substeps - 1, y, [&](std::int64_t step, const double* state) {
        std::copy(state, state + dim, segment.begin() + static_cast<std::ptrdiff_t>((step - first) * params.dim()));
      });
      segment_first = first;
    }
    return segment.data() + (s - first) * params.dim();
  };
  const double h = params.time_per_position() / static_cast<double>(substeps);
  std::vector<double> y_bar(dim, 0.0), work(5 * dim), z(static_cast<std::size_t>(params.hidden()));
  std::vector<double> k_bar(4 * dim), u(dim), u_bar(dim);
  auto add_output_gradient = [&](std::int64_t n) {
    for (std::size_t d = 0; d < dim; ++d) {
      y_bar[d] +=
          detail::load(d_table.data(), d_table.dtype(), n * g.row_stride + static_cast<std::int64_t>(d) * g.col_stride);
    }
  };
  add_output_gradient(g.length - 1);
  for (std::int64_t s = steps - 1; s >= 0; --s) {
    // Reverse RK4 step s: y_{s+1} = y_s + h/6·(k1 + 2k2 + 2k3 + k4).
    const double t = static_cast<double>(s) * h;
    const double* y = state_at(s);
    rk4_step(params, t, h, y, u.data(), work);  // refreshes k1 … k4 in work (u is scratch here)
    const double* k1 = work.data();
    const double* k2 = k1 + dim;
    const double* k3 = k2 + dim;
    double* k1_bar = k_bar.data();
    double* k2_bar = k1_bar + dim;
    double* k3_bar = k2_bar + dim;
    double* k4_bar = k3_bar + dim;
    for (std::size_t d = 0; d < dim; ++d) {
      k1_bar[d] = h / 6 * y_bar[d];
      k2_bar[d] = h / 3 * y_bar[d];
      k3_bar[d] = h / 3 * y_bar[d];
      k4_bar[d] = h / 6 * y_bar[d];
    }
    // k4 = f(t + h, y + h·k3)
    for (std::size_t d = 0; d < dim; ++d) u[d] = y[d] + h * k3[d];
    std::fill(u_bar.begin(), u_bar.end(), 0.0);
    mlp_backward(params, t + h, u.data(), k4_bar, grads, u_bar.data(), z);
    for (std::size_t d = 0; d < dim; ++d) {
      y_bar[d] += u_bar[d];
      k3_bar[d] += h * u_bar[d];
    }
    // k3 = f(t + h/2, y + h/2·k2)
    for (std::size_t d = 0; d < dim; ++d) u[d] = y[d] + 0.5 * h * k2[d];
    std::fill(u_bar.begin(), u_bar.end(), 0.0);
    mlp_backward(params, t + 0.5 * h, u.data(), k3_bar, grads, u_bar.data(), z);
    for (std::size_t d = 0; d < dim; ++d) {
      y_bar[d] += u_bar[d];
      k2_bar[d] += 0.5 * h * u_bar[d];
    }
    // k2 = f(t + h/2, y + h/2·k1)
    for (std::size_t d = 0; d < dim; ++d) u[d] = y[d] + 0.5 * h * k1[d];
    std::fill(u_bar.begin(), u_bar.end(), 0.0);
    mlp_backward(params, t + 0.5 * h, u.data(), k2_bar, grads, u_bar.data(), z);
    for (std::size_t d = 0; d < dim; ++d) {
      y_bar[d] += u_bar[d];
      k1_bar[d] += 0.5 * h * u_bar[d];
    }
    // k1 = f(t, y)
    std::fill(u_bar.begin(), u_bar.end(), 0.0);
    mlp_backward(params, t, y, k1_bar, grads, u_bar.data(), z);
    for (std::size_t d = 0; d < dim; ++d) y_bar[d] += u_bar[d];
    if (s % substeps == 0) add_output_gradient(s / substeps);  // y_s is table row s / substeps
  }
  for (std::size_t d = 0; d < dim; ++d) grads.p0[d] += y_bar[d];
}

}  // namespace posenc
