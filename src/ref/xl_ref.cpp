// Transformer-XL's position terms and their backward, r(δ) and W_R r(δ) evaluated per pair in
// fp64: the oracle of xl.cpp.
#include <cmath>

#include "posenc/reference.hpp"
#include "relative_checks.hpp"

namespace posenc::ref {

void xl_add_position_terms(const XlParams& params, ConstTensorView q, ConstTensorView k, const Positions& q_positions,
                           const Positions& k_positions, TensorView scores) {
  const char* where = "xl_add_position_terms";
  const detail::XlGrids g =
      detail::check_xl(where, params, q, k, "scores", ConstTensorView(scores), q_positions, k_positions);
  detail::check_writable(where, "scores", ConstTensorView(scores));
  const std::int64_t dim = params.head_dim();
  for (std::int64_t b = 0; b < g.scores.batch; ++b) {
    for (std::int64_t h = 0; h < g.scores.heads; ++h) {
      for (std::int64_t i = 0; i < g.scores.q_len; ++i) {
        for (std::int64_t j = 0; j < g.scores.k_len; ++j) {
          const std::vector<double> pd = detail::projected_head(params, h, q_positions.at(b, i) - k_positions.at(b, j));
          double sum = 0;
          for (std::int64_t d = 0; d < dim; ++d) {
            const auto hd = static_cast<std::size_t>(h * dim + d);
            sum += params.u()[hd] * detail::load_token(k, g.k, b, j, h, d) +
                   (detail::load_token(q, g.q, b, i, h, d) + params.v()[hd]) * pd[static_cast<std::size_t>(d)];
          }
          const std::int64_t at = g.scores.offset(b, h, i) + j * g.scores.k_stride;
          detail::store(scores.data(), scores.dtype(), at,
                        detail::load(scores.data(), scores.dtype(), at) + params.scale() * sum);
        }
      }
    }
  }
}

void xl_position_terms_backward(const XlParams& params, ConstTensorView q, ConstTensorView k, ConstTensorView d_scores,
                                const Positions& q_positions, const Positions& k_positions, TensorView dq,
                                TensorView dk, XlGradients& grads) {
  const char* where = "xl_position_terms_backward";
  const detail::XlGrids g = detail::check_xl(where, params, q, k, "d_scores", d_scores, q_positions, k_positions);
  const bool has_dq = !detail::empty_view(ConstTensorView(dq)), has_dk = !detail::empty_view(ConstTensorView(dk));
  const detail::HeadsGrid dqg = has_dq ? detail::heads_grid(where, "dq", ConstTensorView(dq)) : detail::HeadsGrid{};
  const detail::HeadsGrid dkg = has_dk ? detail::heads_grid(where, "dk", ConstTensorView(dk)) : detail::HeadsGrid{};
  const std::int64_t dim = params.head_dim(), dm = params.d_model();
  // Accumulated in fp64 per element of dq and dk, stored once each.
  std::vector<double> dq_acc(static_cast<std::size_t>(g.q.batch * g.q.seq * g.q.heads * dim), 0.0);
  std::vector<double> dk_acc(static_cast<std::size_t>(g.k.batch * g.k.seq * g.k.heads * dim), 0.0);
  for (std::int64_t b = 0; b < g.scores.batch; ++b) {
    for (std::int64_t h = 0; h < g.scores.heads; ++h) {
      for (std::int64_t i = 0; i < g.scores.q_len; ++i) {
        for (std::int64_t j = 0; j < g.scores.k_len; ++j) {
          const std::int64_t delta = q_positions.at(b, i) - k_positions.at(b, j);
          const std::vector<double> pd = detail::projected_head(params, h, delta), r = params.sinusoid(delta);
          const double ds = params.scale() * detail::load(d_scores.data(), d_scores.dtype(),
                                                          g.scores.offset(b, h, i) + j * g.scores.k_stride);
          for (std::int64_t d = 0; d < dim; ++d) {
            const auto hd = static_cast<std::size_t>(h * dim + d);
            const double w = detail::load_token(q, g.q, b, i, h, d) + params.v()[hd];
            grads.u[hd] += ds * detail::load_token(k, g.k, b, j, h, d);
            grads.v[hd] += ds * pd[static_cast<std::size_t>(d)];
            dq_acc[static_cast<std::size_t>(((b * g.q.seq + i) * g.q.heads + h) * dim + d)] +=
                ds * pd[static_cast<std::size_t>(d)];
            dk_acc[static_cast<std::size_t>(((b * g.k.seq + j) * g.k.heads + h) * dim + d)] += ds * params.u()[hd];
            for (std::int64_t m = 0; m < dm; ++m)
              grads.w_r[hd * static_cast<std::size_t>(dm) + static_cast<std::size_t>(m)] +=
                  ds * w * r[static_cast<std::size_t>(m)];
          }
        }
      }
    }
  }
  for (std::int64_t b = 0; b < g.q.batch; ++b) {
    for (std::int64_t s = 0; s < g.q.seq; ++s) {
      for (std::int64_t h = 0; h < g.q.heads; ++h) {
        for (std::int64_t d = 0; d < dim; ++d) {
          if (has_dq)
            detail::add_token(dq, dqg, b, s, h, d,
                              dq_acc[static_cast<std::size_t>(((b * g.q.seq + s) * g.q.heads + h) * dim + d)]);
        }
      }
    }
    for (std::int64_t s = 0; s < g.k.seq; ++s) {
      for (std::int64_t h = 0; h < g.k.heads; ++h) {
        for (std::int64_t d = 0; d < dim; ++d) {
          if (has_dk)
            detail::add_token(dk, dkg, b, s, h, d,
                              dk_acc[static_cast<std::size_t>(((b * g.k.seq + s) * g.k.heads + h) * dim + d)]);
        }
      }
    }
  }
}

}  // namespace posenc::ref
