// Shaw et al.'s relative key and value terms and their backward, every (i, j) and dimension in
// fp64: the oracle of shaw.cpp.
#include <cmath>
#include <string>
#include <utility>

#include "posenc/error.hpp"
#include "posenc/reference.hpp"
#include "posenc/relative.hpp"
#include "relative_checks.hpp"

namespace posenc::ref {

void shaw_add_score_term(const ShawParams& params, ConstTensorView q, const Positions& q_positions,
                         const Positions& k_positions, TensorView scores) {
  const char* where = "shaw_add_score_term";
  const detail::ShawGrids g =
      detail::check_shaw(where, params, "q", q, "scores", ConstTensorView(scores), q_positions, k_positions);
  detail::check_writable(where, "scores", ConstTensorView(scores));
  const std::int64_t dim = params.head_dim();
  const double scale = 1.0 / std::sqrt(static_cast<double>(dim));
  for (std::int64_t b = 0; b < g.scores.batch; ++b) {
    for (std::int64_t h = 0; h < g.scores.heads; ++h) {
      for (std::int64_t i = 0; i < g.scores.q_len; ++i) {
        for (std::int64_t j = 0; j < g.scores.k_len; ++j) {
          const std::int64_t t = params.row_of(k_positions.at(b, j) - q_positions.at(b, i));
          double dot = 0;
          for (std::int64_t d = 0; d < dim; ++d) {
            dot += detail::load(q.data(), q.dtype(),
                                g.tokens.offset(b, i) + h * g.tokens.head_stride + d * g.tokens.dim_stride) *
                   params.key_table()[static_cast<std::size_t>(t * dim + d)];
          }
          const std::int64_t at = g.scores.offset(b, h, i) + j * g.scores.k_stride;
          detail::store(scores.data(), scores.dtype(), at,
                        detail::load(scores.data(), scores.dtype(), at) + dot * scale);
        }
      }
    }
  }
}

void shaw_add_value_term(const ShawParams& params, ConstTensorView probs, const Positions& q_positions,
                         const Positions& k_positions, TensorView out) {
  const char* where = "shaw_add_value_term";
  const detail::ShawGrids g =
      detail::check_shaw(where, params, "out", ConstTensorView(out), "probs", probs, q_positions, k_positions);
  detail::check_writable(where, "out", ConstTensorView(out));
  const std::int64_t dim = params.head_dim();
  for (std::int64_t b = 0; b < g.scores.batch; ++b) {
    for (std::int64_t h = 0; h < g.scores.heads; ++h) {
      for (std::int64_t i = 0; i < g.scores.q_len; ++i) {
        for (std::int64_t d = 0; d < dim; ++d) {
          double sum = 0;
          for (std::int64_t j = 0; j < g.scores.k_len; ++j) {
            const std::int64_t t = params.row_of(k_positions.at(b, j) - q_positions.at(b, i));
            sum += detail::load(probs.data(), probs.dtype(), g.scores.offset(b, h, i) + j * g.scores.k_stride) *
                   params.value_table()[static_cast<std::size_t>(t * dim + d)];
          }
          const std::int64_t at = g.tokens.offset(b, i) + h * g.tokens.head_stride + d * g.tokens.dim_stride;
          detail::store(out.data(), out.dtype(), at, detail::load(out.data(), out.dtype(), at) + sum);
        }
      }
    }
  }
}

void shaw_score_term_backward(const ShawParams& params, ConstTensorView q, ConstTensorView d_scores,
                              const Positions& q_positions, const Positions& k_positions, TensorView dq,
                              std::span<double> d_key_table) {
  const char* where = "shaw_score_term_backward";
  const detail::ShawGrids g = detail::check_shaw(where, params, "q", q, "d_scores", d_scores, q_positions, k_positions);
  detail::check_gradient_size(where, "d_key_table", d_key_table.size(), params.rows() * params.head_dim());
  const bool has_dq = !detail::empty_view(ConstTensorView(dq));
  detail::HeadsGrid dg;
  if (has_dq) dg = detail::check_output_tokens(where, "dq", ConstTensorView(dq), g.tokens);
  const std::int64_t dim = params.head_dim();
  const double scale = 1.0 / std::sqrt(static_cast<double>(dim));
  for (std::int64_t b = 0; b < g.scores.batch; ++b) {
    for (std::int64_t h = 0; h < g.scores.heads; ++h) {
      for (std::int64_t i = 0; i < g.scores.q_len; ++i) {
        for (std::int64_t d = 0; d < dim; ++d) {
          const double qd = detail::load(q.data(), q.dtype(),
                                         g.tokens.offset(b, i) + h * g.tokens.head_stride + d * g.tokens.dim_stride);
          double dq_sum = 0;  // one rounding per dq element
          for (std::int64_t j = 0; j < g.scores.k_len; ++j) {
            const std::int64_t t = params.row_of(k_positions.at(b, j) - q_positions.at(b, i));
            const double ds =
                detail::load(d_scores.data(), d_scores.dtype(), g.scores.offset(b, h, i) + j * g.scores.k_stride);
            d_key_table[static_cast<std::size_t>(t * dim + d)] += ds * qd * scale;
            dq_sum += ds * params.key_table()[static_cast<std::size_t>(t * dim + d)] * scale;
          }
          if (has_dq) {
            const std::int64_t at = dg.offset(b, i) + h * dg.head_stride + d * dg.dim_stride;
            detail::store(dq.data(), dq.dtype(), at, detail::load(dq.data(), dq.dtype(), at) + dq_sum);
          }
        }
      }
    }
  }
}

void shaw_value_term_backward(const ShawParams& params, ConstTensorView probs, ConstTensorView d_out,
                              const Positions& q_positions, const Positions& k_positions, TensorView d_probs,
                              std::span<double> d_value_table) {
  const char* where = "shaw_value_term_backward";
  const detail::ShawGrids g =
      detail::check_shaw(where, params, "d_out", d_out, "probs", probs, q_positions, k_positions);
  detail::check_gradient_size(where, "d_value_table", d_value_table.size(), params.rows() * params.head_dim());
  const bool has_dp = !detail::empty_view(ConstTensorView(d_probs));
  detail::ScoreGrid dpg;
  if (has_dp)
    dpg = detail::check_scores(where, "d_probs", ConstTensorView(d_probs), g.scores.heads, q_positions, k_positions);
  const std::int64_t dim = params.head_dim();
  for (std::int64_t b = 0; b < g.scores.batch; ++b) {
    for (std::int64_t h = 0; h < g.scores.heads; ++h) {
      for (std::int64_t i = 0; i < g.scores.q_len; ++i) {
        for (std::int64_t j = 0; j < g.scores.k_len; ++j) {
          const std::int64_t t = params.row_of(k_positions.at(b, j) - q_positions.at(b, i));
          const double p = detail::load(probs.data(), probs.dtype(), g.scores.offset(b, h, i) + j * g.scores.k_stride);
          double dp = 0;
          for (std::int64_t d = 0; d < dim; ++d) {
            const double go = detail::load(d_out.data(), d_out.dtype(),
                                           g.tokens.offset(b, i) + h * g.tokens.head_stride + d * g.tokens.dim_stride);
            d_value_table[static_cast<std::size_t>(t * dim + d)] += p * go;
            dp += go * params.value_table()[static_cast<std::size_t>(t * dim + d)];
          }
          if (has_dp) {
            const std::int64_t at = dpg.offset(b, h, i) + j * dpg.k_stride;
            detail::store(d_probs.data(), d_probs.dtype(), at, detail::load(d_probs.data(), d_probs.dtype(), at) + dp);
          }
        }
      }
    }
  }
}

}  // namespace posenc::ref

// ShawTerm's fp64 definition (relative.hpp): per visible pair with r = clip(k_pos − q_pos, ±k),
// scale·⟨q_i, a^K[r]⟩ added to the logit and a^V[r] to the value the row averages. An empty table
// means zeros.
namespace posenc {
namespace {

// scale·⟨q, a⟩ summed in T, as a plain implementation in T computes it.
template <class T>
T scaled_dot(std::span<const double> q, const double* a, double scale) {
  T acc = 0;
  for (std::size_t t = 0; t < q.size(); ++t) acc += static_cast<T>(q[t]) * static_cast<T>(a[t]);
  return static_cast<T>(scale) * acc;
}

// Where the pair's table row starts: clip(k_pos − q_pos, ±k) + k rows of head_dim.
std::int64_t row_start(const ShawParams& params, const TokenPair& pair) {
  return params.row_of(pair.key_position - pair.query_position) * params.head_dim();
}

}  // namespace

ShawTerm::ShawTerm(std::int64_t heads, ShawParams params) : heads_(heads), params_(std::move(params)) {
  if (heads < 1) throw Error("ShawTerm", "heads", std::to_string(heads), ">= 1");
}

double ShawTerm::row_value(std::int64_t /* head */, const TokenPair& pair, const PairRows& rows) const {
  if (params_.key_table().empty()) return 0.0;
  const double* a = params_.key_table().data() + row_start(params_, pair);
  const std::span<const double> q = rows.q.first(static_cast<std::size_t>(params_.head_dim()));
  return rows.naive_f32 ? static_cast<double>(scaled_dot<float>(q, a, rows.scale))
                        : scaled_dot<double>(q, a, rows.scale);
}

void ShawTerm::accumulate_row_gradient(std::int64_t /* head */, const TokenPair& pair, const PairRows& rows,
                                       double weight, std::span<double> grads, std::span<double> dq,
                                       std::span<double> /* dk */) const {
  const std::int64_t dim = params_.head_dim(), at = row_start(params_, pair);
  for (std::int64_t t = 0; t < dim; ++t) {
    if (!params_.key_table().empty())
      dq[static_cast<std::size_t>(t)] += rows.scale * weight * params_.key_table()[static_cast<std::size_t>(at + t)];
    if (!grads.empty())
      grads[static_cast<std::size_t>(at + t)] += rows.scale * weight * rows.q[static_cast<std::size_t>(t)];
  }
}

void ShawTerm::output_value(std::int64_t /* head */, const TokenPair& pair, std::span<double> w) const {
  const std::int64_t dim = params_.head_dim(), at = row_start(params_, pair);
  for (std::int64_t t = 0; t < dim; ++t) {
    w[static_cast<std::size_t>(t)] =
        params_.value_table().empty() ? 0.0 : params_.value_table()[static_cast<std::size_t>(at + t)];
  }
}

void ShawTerm::accumulate_output_gradient(std::int64_t /* head */, const TokenPair& pair, double weight,
                                          std::span<const double> d_out, std::span<double> grads) const {
  const std::int64_t dim = params_.head_dim();
  const std::int64_t at = params_.rows() * dim + row_start(params_, pair);  // the value table's
  for (std::int64_t t = 0; t < dim; ++t)
    grads[static_cast<std::size_t>(at + t)] += weight * d_out[static_cast<std::size_t>(t)];
}

}  // namespace posenc
