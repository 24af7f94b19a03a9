// TUPE's parameter gradients pair by pair, by the definition (fp64): the oracle of tupe_backward
// (tupe.cpp).
#include <cmath>

#include "bias_checks.hpp"
#include "posenc/reference.hpp"

namespace posenc::ref {

void tupe_backward(const TupeParams& params, const Positions& q_positions, const Positions& k_positions,
                   ConstTensorView d_scores, TupeGradients& grads) {
  const char* where = "tupe_backward";
  const detail::ScoreGrid g =
      detail::check_scores(where, "d_scores", d_scores, params.heads(), q_positions, k_positions);
  if (g.batch * g.q_len * g.k_len == 0) return;
  detail::check_tupe_positions(where, params, q_positions, k_positions);
  const std::int64_t dim = params.head_dim(), hd = params.heads() * dim, dm = params.d_model();
  const double scale = 1.0 / std::sqrt(2.0 * static_cast<double>(dim));
  for (std::int64_t b = 0; b < g.batch; ++b) {
    for (std::int64_t h = 0; h < g.heads; ++h) {
      for (std::int64_t i = 0; i < g.q_len; ++i) {
        for (std::int64_t j = 0; j < g.k_len; ++j) {
          const std::int64_t q = q_positions.at(b, i), k = k_positions.at(b, j);
          const double ds = detail::load(d_scores.data(), d_scores.dtype(), g.offset(b, h, i) + j * g.k_stride);
          if (params.cls_reset() && q == 0) {
            grads.theta1[static_cast<std::size_t>(h)] += ds;
            continue;
          }
          if (params.cls_reset() && k == 0) {
            grads.theta2[static_cast<std::size_t>(h)] += ds;
            continue;
          }
          const std::vector<double> a = params.project(params.u_q(), q, h), c = params.project(params.u_k(), k, h);
          for (std::int64_t m = 0; m < dm; ++m) {
            const double pq = params.table()[static_cast<std::size_t>(q * dm + m)];
            const double pk = params.table()[static_cast<std::size_t>(k * dm + m)];
            double to_q = 0, to_k = 0;
            for (std::int64_t e = 0; e < dim; ++e) {
              const auto col = static_cast<std::size_t>(m * hd + h * dim + e);
              grads.u_q[col] += ds * scale * pq * c[static_cast<std::size_t>(e)];
              grads.u_k[col] += ds * scale * pk * a[static_cast<std::size_t>(e)];
              to_q += params.u_q()[col] * c[static_cast<std::size_t>(e)];
              to_k += params.u_k()[col] * a[static_cast<std::size_t>(e)];
            }
            grads.table[static_cast<std::size_t>(q * dm + m)] += ds * scale * to_q;
            grads.table[static_cast<std::size_t>(k * dm + m)] += ds * scale * to_k;
          }
        }
      }
    }
  }
}

}  // namespace posenc::ref

namespace posenc {

void TupeParams::reference_backward(const Positions& q_positions, const Positions& k_positions,
                                    ConstTensorView d_scores, std::span<double> grads) const {
  detail::add_gradients<TupeGradients>("TupeParams::reference_backward", *this, grads, [&](TupeGradients& parts) {
    ref::tupe_backward(*this, q_positions, k_positions, d_scores, parts);
  });
}

}  // namespace posenc
