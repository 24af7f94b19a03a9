// FIRE's parameter gradients by straight backpropagation, pair by pair (fp64): the oracle of
// fire_backward (fire.cpp).
#include <algorithm>
#include <cmath>

#include "bias_checks.hpp"
#include "posenc/reference.hpp"

namespace posenc::ref {

void fire_backward(const FireParams& params, const Positions& q_positions, const Positions& k_positions,
                   ConstTensorView d_scores, FireGradients& grads) {
  const char* where = "fire_backward";
  detail::check_gradient_size(where, "grads.w1", grads.w1.size(), params.hidden());
  detail::check_gradient_size(where, "grads.b1", grads.b1.size(), params.hidden());
  detail::check_gradient_size(where, "grads.w2", grads.w2.size(), params.heads() * params.hidden());
  detail::check_gradient_size(where, "grads.b2", grads.b2.size(), params.heads());
  const detail::ScoreGrid g =
      detail::check_scores(where, "d_scores", d_scores, params.heads(), q_positions, k_positions);
  const auto hidden = static_cast<std::size_t>(params.hidden());
  std::vector<double> z(hidden), dz(hidden);
  // Straight backpropagation through x → z = W1·x + B1 → relu → W2·a + B2, pair by pair.
  for (std::int64_t b = 0; b < g.batch; ++b) {
    for (std::int64_t i = 0; i < g.q_len; ++i) {
      const std::int64_t q = q_positions.at(b, i);
      for (std::int64_t j = 0; j < g.k_len; ++j) {
        const std::int64_t k = k_positions.at(b, j);
        const double x = params.normalized_distance(q, k);
        for (std::size_t u = 0; u < hidden; ++u) {
          z[u] = params.w1()[u] * x + params.b1()[u];
          dz[u] = 0;
        }
        for (std::int64_t h = 0; h < g.heads; ++h) {
          const double ds = detail::load(d_scores.data(), d_scores.dtype(), g.offset(b, h, i) + j * g.k_stride);
          const auto hh = static_cast<std::size_t>(h);
          grads.b2[hh] += ds;
          for (std::size_t u = 0; u < hidden; ++u) {
            grads.w2[hh * hidden + u] += ds * std::max(0.0, z[u]);
            if (z[u] > 0) dz[u] += ds * params.w2()[hh * hidden + u];
          }
        }
        double dx = 0;
        for (std::size_t u = 0; u < hidden; ++u) {
          grads.w1[u] += dz[u] * x;
          grads.b1[u] += dz[u];
          dx += dz[u] * params.w1()[u];
        }
        double dx_dc = 0, dx_dl = 0;
        detail::fire_x_derivatives(params, q, k, x, &dx_dc, &dx_dl);
        grads.c += dx * dx_dc;
        grads.threshold += dx * dx_dl;
      }
    }
  }
}

}  // namespace posenc::ref

namespace posenc {

void FireParams::reference_backward(const Positions& q_positions, const Positions& k_positions,
                                    ConstTensorView d_scores, std::span<double> grads) const {
  detail::add_gradients<FireGradients>("FireParams::reference_backward", *this, grads, [&](FireGradients& parts) {
    ref::fire_backward(*this, q_positions, k_positions, d_scores, parts);
  });
}

}  // namespace posenc
