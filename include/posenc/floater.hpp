// posenc/floater.hpp — FLOATER: position encodings from a learned continuous dynamical system.
//
// FLOATER (Liu et al. 2020, "Learning to Encode Position for Transformer with Continuous
// Dynamical Model") makes the encoding of position n the state of an ODE at time t_n:
//
//   dp/dt = h_θ(t, p(t)),   p(0) = p0,   t_n = n·Δ  (Δ = time_per_position)
//   h_θ(t, p) = W2·tanh(W1·[t; p] + B1) + B2          (a one-hidden-layer MLP)
//
//   W1: [hidden, dim + 1] (column 0 multiplies t), B1: [hidden], W2: [dim, hidden], B2: [dim]
//
// integrated with the classical fixed-step Runge–Kutta method (RK4), `substeps` steps of
// Δ/substeps per position. The table rows are the states p(t_0), p(t_1), …: a longer table
// integrates further and its first rows are bitwise the shorter table's, so the encoding
// extends to any length. The paper adds p(t_n) to the input of every layer (each layer may have
// its own θ); here a table is computed per θ and added like a learned table.
//
// The backward differentiates the discrete solver exactly (reverse mode through every RK4 stage,
// each position's substeps recomputed from its state), so gradients match finite differences of
// floater_table to rounding; it accumulates (+=) into FloaterGradients. The forward holds two
// states (O(dim) memory), the backward (length + substeps)·dim values. Everything runs in fp64,
// sequentially along the trajectory (the recurrence has no parallelism across positions); the
// result is the same for any thread count and is its own fp64 reference.
//
// Errors: posenc::Error naming the parameter for sizes that do not match, non-finite values,
// time_per_position <= 0, substeps outside [1, 2^16], a step h = time_per_position / substeps
// with h·L > 2.785 (RK4's stability limit, L = ‖W2‖₂·‖W1[:, 1:]‖₂ bounding the field's Lipschitz
// constant; the message says how many substeps would do), and tables whose width is not dim.
#pragma once

#include <cstdint>
#include <vector>

#include "posenc/tensor.hpp"

namespace posenc {

class FloaterParams {
 public:
  FloaterParams(std::int64_t dim, std::vector<double> w1, std::vector<double> b1, std::vector<double> w2,
                std::vector<double> b2, std::vector<double> p0, double time_per_position = 0.1,
                std::int64_t substeps = 1);
  // W1, W2 ~ N(0, scale²/fan_in), B = 0, p0 ~ N(0, 1): a smooth, slowly varying field; seeded.
  static FloaterParams init(std::int64_t dim, std::int64_t hidden = 32, std::uint64_t seed = 0, double scale = 1.0,
                            double time_per_position = 0.1, std::int64_t substeps = 1);

  std::int64_t dim() const { return dim_; }
  std::int64_t hidden() const { return static_cast<std::int64_t>(b1_.size()); }
  const std::vector<double>& w1() const { return w1_; }
  const std::vector<double>& b1() const { return b1_; }
  const std::vector<double>& w2() const { return w2_; }
  const std::vector<double>& b2() const { return b2_; }
  const std::vector<double>& p0() const { return p0_; }
  double time_per_position() const { return time_per_position_; }
  std::int64_t substeps() const { return substeps_; }
  // ‖W2‖₂·‖W1[:, 1:]‖₂ (power iteration): a bound on the field's Lipschitz constant in p.
  double lipschitz_bound() const;

  static constexpr std::int64_t kMaxSubsteps = std::int64_t{1} << 16;
  static constexpr double kStableStep = 2.785;  // RK4's real stability interval is [−2.785, 0]

  // dp = h_θ(t, p), dim values each.
  void dynamics(double t, const double* p, double* dp) const;

 private:
  std::int64_t dim_;
  std::vector<double> w1_, b1_, w2_, b2_, p0_;
  double time_per_position_;
  std::int64_t substeps_;
};

struct FloaterGradients {
  explicit FloaterGradients(const FloaterParams& params);
  std::vector<double> w1, b1, w2, b2, p0;
};

// out[n, :] = p(n·Δ) for n < out.size(0). out: [length, dim], any dtype and strides (rounded
// once from fp64).
void floater_table(const FloaterParams& params, TensorView out);
// grads += dL/dθ and dL/dp0 for L with dL/d out = d_table ([length, dim], any dtype).
void floater_table_backward(const FloaterParams& params, ConstTensorView d_table, FloaterGradients& grads);

}  // namespace posenc
