// Transformer-XL's position terms and their backward, r(δ) and W_R r(δ) evaluated per pair in
// fp64: the oracle of xl.cpp.
#include <cmath>
#include <map>
#include <type_traits>
#include <utility>

#include "posenc/reference.hpp"
#include "posenc/relative.hpp"
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

// XlTerm's fp64 definition (relative.hpp): per visible pair with δ = q_pos − k_pos,
// scale·(u_h·k_j + (q_i + v_h)·P_h(δ)), P_h(δ) = W_R[h] r(δ). With the reference's scratch of a
// (sequence, head), P is built once per δ (tables 0 and 1: fp64, and f32 summed over d_model in
// order, as a plain f32 implementation computes it) and ∂/∂P is summed per δ (table 2), to meet
// r(δ) once per δ in finish_row_gradients, as XL's own backward does.
namespace posenc {
namespace {

enum Table { kProjection, kProjectionF32, kProjectionGrad };

// P_h(δ) summed over d_model in order in T, stored as doubles.
template <class T>
std::vector<double> projection(const XlParams& params, std::int64_t head, std::int64_t delta) {
  const std::int64_t dim = params.head_dim(), dm = params.d_model();
  const std::vector<double> r = params.sinusoid(delta);
  std::vector<double> pr(static_cast<std::size_t>(dim));
  for (std::int64_t d = 0; d < dim; ++d) {
    T acc = 0;
    const double* w = params.w_r().data() + (head * dim + d) * dm;
    for (std::int64_t m = 0; m < dm; ++m) acc += static_cast<T>(w[m]) * static_cast<T>(r[static_cast<std::size_t>(m)]);
    pr[static_cast<std::size_t>(d)] = static_cast<double>(acc);
  }
  return pr;
}

// The pair's P (memoised in the scratch when there is one; `local` holds it otherwise).
template <class T>
const std::vector<double>& projection_of(const XlParams& params, std::int64_t head, std::int64_t delta,
                                         TermScratch* scratch, std::vector<double>& local) {
  if (scratch == nullptr) return local = projection<T>(params, head, delta);
  auto& table = scratch->tables[std::is_same_v<T, float> ? kProjectionF32 : kProjection];
  auto it = table.find(delta);
  if (it == table.end()) it = table.emplace(delta, projection<T>(params, head, delta)).first;
  return it->second;
}

template <class T>
T xl_logit(const XlParams& params, const std::vector<double>& pr, std::int64_t head, const PairRows& rows) {
  T acc = 0;
  for (std::int64_t t = 0; t < params.head_dim(); ++t) {
    const auto at = static_cast<std::size_t>(head * params.head_dim() + t), e = static_cast<std::size_t>(t);
    acc += static_cast<T>(params.u()[at]) * static_cast<T>(rows.k[e]) +
           (static_cast<T>(rows.q[e]) + static_cast<T>(params.v()[at])) * static_cast<T>(pr[e]);
  }
  return static_cast<T>(rows.scale) * acc;
}

// dW_R[h·D + t][m] += dP[t]·r(δ)[m]
void add_w_r_gradient(const XlParams& params, std::int64_t head, std::int64_t delta, const std::vector<double>& dp,
                      std::span<double> grads) {
  const std::int64_t dim = params.head_dim(), dm = params.d_model(), hd = params.heads() * dim;
  const std::vector<double> r = params.sinusoid(delta);
  for (std::int64_t t = 0; t < dim; ++t) {
    const double dpt = dp[static_cast<std::size_t>(t)];
    if (dpt == 0) continue;
    double* dw = grads.data() + 2 * hd + (head * dim + t) * dm;
    for (std::int64_t m = 0; m < dm; ++m) dw[m] += dpt * r[static_cast<std::size_t>(m)];
  }
}

}  // namespace

XlTerm::XlTerm(XlParams params) : params_(std::move(params)) {}

std::int64_t XlTerm::gradient_size() const {
  const std::int64_t hd = params_.heads() * params_.head_dim();
  return 2 * hd + hd * params_.d_model();
}

double XlTerm::row_value(std::int64_t head, const TokenPair& pair, const PairRows& rows) const {
  const std::int64_t delta = pair.query_position - pair.key_position;
  std::vector<double> local;
  if (rows.naive_f32) {
    return static_cast<double>(
        xl_logit<float>(params_, projection_of<float>(params_, head, delta, rows.scratch, local), head, rows));
  }
  return xl_logit<double>(params_, projection_of<double>(params_, head, delta, rows.scratch, local), head, rows);
}

void XlTerm::accumulate_row_gradient(std::int64_t head, const TokenPair& pair, const PairRows& rows, double weight,
                                     std::span<double> grads, std::span<double> dq, std::span<double> dk) const {
  const std::int64_t dim = params_.head_dim(), hd = params_.heads() * dim;
  const std::int64_t delta = pair.query_position - pair.key_position;
  std::vector<double> local;
  const std::vector<double>& pr = projection_of<double>(params_, head, delta, rows.scratch, local);
  const double w = rows.scale * weight;
  std::vector<double> dp_local;
  std::vector<double>* dp = nullptr;  // ∂/∂P_h(δ)
  if (!grads.empty()) {
    dp = rows.scratch != nullptr ? &rows.scratch->tables[kProjectionGrad][delta] : &dp_local;
    dp->resize(static_cast<std::size_t>(dim), 0.0);
  }
  for (std::int64_t t = 0; t < dim; ++t) {
    const auto at = static_cast<std::size_t>(head * dim + t), e = static_cast<std::size_t>(t);
    dq[e] += w * pr[e];
    dk[e] += w * params_.u()[at];
    if (dp == nullptr) continue;
    grads[at] += w * rows.k[e];
    grads[static_cast<std::size_t>(hd) + at] += w * pr[e];
    (*dp)[e] += w * (rows.q[e] + params_.v()[at]);
  }
  if (dp == &dp_local) add_w_r_gradient(params_, head, delta, dp_local, grads);
}

void XlTerm::finish_row_gradients(std::int64_t head, TermScratch& scratch, std::span<double> grads) const {
  if (!grads.empty()) {
    for (const auto& [delta, dp] : scratch.tables[kProjectionGrad]) add_w_r_gradient(params_, head, delta, dp, grads);
  }
  scratch.tables[kProjectionGrad].clear();
}

}  // namespace posenc
