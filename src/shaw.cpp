// Shaw et al. 2018 relative position representations (math and layouts in posenc/relative.hpp).
//
// Fast path: per (b, h, i) row, the 2k + 1 dot products q·a^K[r] once, then each score adds its
// row's; values and the backward group a row's probabilities (or score gradients) by table row
// first. Rows are independent (each writes its own outputs), and the table gradients are summed
// in a second pass that owns table rows and visits the (b, h, i) rows in order: bitwise identical
// for any thread count. The reference loops over every (i, j) and dimension in fp64.
#include <omp.h>

#include <cmath>
#include <limits>
#include <string>

#include "relative_checks.hpp"
#include "posenc/memory.hpp"
#include "posenc/reference.hpp"
#include "posenc/relative.hpp"

namespace posenc {
namespace {

std::vector<double> checked_table(std::vector<double> table, std::int64_t rows, std::int64_t dim, const char* name) {
  const auto size = static_cast<std::size_t>(rows * dim);
  if (table.empty()) table.assign(size, 0.0);
  detail::check_parameter("ShawParams", name, table, size, "(2k + 1)·head_dim = " + std::to_string(size));
  return table;
}

// Per (b, h, i) row: Σ over the keys of each table row of values[b, h, i, j] (fp64), into
// sums[row · (2k + 1) + t]. Rows ordered b, h, i.
void sum_by_table_row(const ShawParams& p, ConstTensorView values, const detail::ScoreGrid& g,
                      const Positions& q_positions, const Positions& k_positions, std::vector<double>& sums) {
  const std::int64_t width = p.rows(), rows = g.batch * g.heads * g.q_len;
  sums.assign(static_cast<std::size_t>(rows * width), 0.0);
  const int threads = detail::threads_for(rows * g.k_len * 4);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (std::int64_t row = 0; row < rows; ++row) {
    const std::int64_t b = row / (g.heads * g.q_len), h = (row / g.q_len) % g.heads, i = row % g.q_len;
    const std::int64_t q = q_positions.at(b, i), offset = g.offset(b, h, i);
    double* out = sums.data() + row * width;
    for (std::int64_t j = 0; j < g.k_len; ++j) {
      out[p.row_of(k_positions.at(b, j) - q)] += detail::load(values.data(), values.dtype(), offset + j * g.k_stride);
    }
  }
}

// table_grad[t, :] += Σ_rows sums[row, t]·tokens[b, i, h, :]·scale, in row order per t.
void contract_table_gradient(const ShawParams& p, const std::vector<double>& sums, ConstTensorView tokens,
                             const detail::HeadsGrid& tg, const detail::ScoreGrid& g, double scale,
                             std::span<double> table_grad) {
  const std::int64_t width = p.rows(), dim = p.head_dim(), rows = g.batch * g.heads * g.q_len;
  const int threads = detail::threads_for(rows * width * dim);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (std::int64_t t = 0; t < width; ++t) {
    std::vector<double> acc(static_cast<std::size_t>(dim), 0.0);
    for (std::int64_t row = 0; row < rows; ++row) {
      const double w = sums[static_cast<std::size_t>(row * width + t)];
      if (w == 0.0) continue;
      const std::int64_t b = row / (g.heads * g.q_len), h = (row / g.q_len) % g.heads, i = row % g.q_len;
      const std::int64_t base = tg.offset(b, i) + h * tg.head_stride;
      for (std::int64_t d = 0; d < dim; ++d) {
        acc[static_cast<std::size_t>(d)] += w * detail::load(tokens.data(), tokens.dtype(), base + d * tg.dim_stride);
      }
    }
    for (std::int64_t d = 0; d < dim; ++d)
      table_grad[static_cast<std::size_t>(t * dim + d)] += acc[static_cast<std::size_t>(d)] * scale;
  }
}

}  // namespace

namespace detail {

ShawGrids check_shaw(const char* where, const ShawParams& p, const char* tokens_name, ConstTensorView tokens,
                     const char* scores_name, ConstTensorView scores, const Positions& q_positions,
                     const Positions& k_positions) {
  ShawGrids g;
  g.tokens = detail::heads_grid(where, tokens_name, tokens);
  if (g.tokens.dim != p.head_dim()) {
    throw Error(where, std::string(tokens_name) + ".size(-1)", std::to_string(g.tokens.dim),
                "params.head_dim() = " + std::to_string(p.head_dim()));
  }
  g.scores = detail::check_scores(where, scores_name, scores, g.tokens.heads, q_positions, k_positions);
  if (g.scores.batch != g.tokens.batch || g.scores.q_len != g.tokens.seq) {
    throw Error(
        where, std::string(scores_name) + " [B, H, Sq, Sk]",
        std::to_string(g.scores.batch) + " × " + std::to_string(g.scores.heads) + " × " +
            std::to_string(g.scores.q_len) + " × " + std::to_string(g.scores.k_len),
        "B = " + std::to_string(g.tokens.batch) + " and Sq = " + std::to_string(g.tokens.seq) + " of " + tokens_name);
  }
  return g;
}

}  // namespace detail

ShawParams::ShawParams(std::int64_t max_distance, std::int64_t head_dim, std::vector<double> key_table,
                       std::vector<double> value_table)
    : max_distance_(max_distance), head_dim_(head_dim) {
  if (max_distance < 0)
    throw Error("ShawParams", "max_distance", std::to_string(max_distance), ">= 0 (k of the clip to [−k, k])");
  if (head_dim < 1) throw Error("ShawParams", "head_dim", std::to_string(head_dim), ">= 1");
  std::int64_t size = 0;
  if (max_distance > (std::numeric_limits<std::int64_t>::max() - 1) / 2 ||
      __builtin_mul_overflow(2 * max_distance + 1, head_dim, &size)) {
    throw Error(
        "ShawParams", "max_distance", std::to_string(max_distance),
        "a k whose two tables of (2k + 1) · head_dim values fit in memory (head_dim " + std::to_string(head_dim) + ")");
  }
  checked_allocation(size, 2 * sizeof(double), "ShawParams", "max_distance's table rows (2k + 1) · head_dim");
  key_table_ = checked_table(std::move(key_table), rows(), head_dim, "key_table");
  value_table_ = checked_table(std::move(value_table), rows(), head_dim, "value_table");
}

ShawParams ShawParams::init(std::int64_t max_distance, std::int64_t head_dim, double std, std::uint64_t seed) {
  if (!std::isfinite(std) || std < 0)
    throw Error("ShawParams::init", "std", detail::to_text(std), "a finite number >= 0");
  ShawParams p(max_distance, head_dim);
  std::uint64_t index = 0;
  for (auto& v : p.key_table_) v = std * detail::seeded_normal(seed, index++);
  for (auto& v : p.value_table_) v = std * detail::seeded_normal(seed, index++);
  return p;
}

void shaw_add_score_term(const ShawParams& params, ConstTensorView q, const Positions& q_positions,
                         const Positions& k_positions, TensorView scores) {
  detail::init_dispatch();
  const char* where = "shaw_add_score_term";
  const detail::ShawGrids g =
      detail::check_shaw(where, params, "q", q, "scores", ConstTensorView(scores), q_positions, k_positions);
  detail::check_writable(where, "scores", ConstTensorView(scores));
  if (detail::use_reference()) {
    ref::shaw_add_score_term(params, q, q_positions, k_positions, scores);
    return;
  }
  const std::int64_t width = params.rows(), dim = params.head_dim();
  const std::int64_t rows = g.scores.batch * g.scores.heads * g.scores.q_len;
  const double scale = 1.0 / std::sqrt(static_cast<double>(dim));
  const int threads = detail::threads_for(rows * (g.scores.k_len + width * dim));
#pragma omp parallel num_threads(threads)
  {
    std::vector<double> dots(static_cast<std::size_t>(width));
#pragma omp for schedule(static)
    for (std::int64_t row = 0; row < rows; ++row) {
      const std::int64_t b = row / (g.scores.heads * g.scores.q_len), h = (row / g.scores.q_len) % g.scores.heads;
      const std::int64_t i = row % g.scores.q_len, q_pos = q_positions.at(b, i);
      const std::int64_t base = g.tokens.offset(b, i) + h * g.tokens.head_stride;
      for (std::int64_t t = 0; t < width; ++t) {
        double dot = 0;
        for (std::int64_t d = 0; d < dim; ++d) {
          dot += detail::load(q.data(), q.dtype(), base + d * g.tokens.dim_stride) *
                 params.key_table()[static_cast<std::size_t>(t * dim + d)];
        }
        dots[static_cast<std::size_t>(t)] = dot * scale;
      }
      const std::int64_t offset = g.scores.offset(b, h, i);
      for (std::int64_t j = 0; j < g.scores.k_len; ++j) {
        const std::int64_t at = offset + j * g.scores.k_stride;
        const double term = dots[static_cast<std::size_t>(params.row_of(k_positions.at(b, j) - q_pos))];
        detail::store(scores.data(), scores.dtype(), at, detail::load(scores.data(), scores.dtype(), at) + term);
      }
    }
  }
}

void shaw_add_value_term(const ShawParams& params, ConstTensorView probs, const Positions& q_positions,
                         const Positions& k_positions, TensorView out) {
  detail::init_dispatch();
  const char* where = "shaw_add_value_term";
  const detail::ShawGrids g =
      detail::check_shaw(where, params, "out", ConstTensorView(out), "probs", probs, q_positions, k_positions);
  detail::check_writable(where, "out", ConstTensorView(out));
  if (detail::use_reference()) {
    ref::shaw_add_value_term(params, probs, q_positions, k_positions, out);
    return;
  }
  std::vector<double> sums;
  sum_by_table_row(params, probs, g.scores, q_positions, k_positions, sums);
  const std::int64_t width = params.rows(), dim = params.head_dim();
  const std::int64_t rows = g.scores.batch * g.scores.heads * g.scores.q_len;
  const int threads = detail::threads_for(rows * width * dim);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (std::int64_t row = 0; row < rows; ++row) {
    const std::int64_t b = row / (g.scores.heads * g.scores.q_len), h = (row / g.scores.q_len) % g.scores.heads;
    const std::int64_t i = row % g.scores.q_len;
    const std::int64_t base = g.tokens.offset(b, i) + h * g.tokens.head_stride;
    for (std::int64_t d = 0; d < dim; ++d) {
      double sum = 0;
      for (std::int64_t t = 0; t < width; ++t) {
        sum += sums[static_cast<std::size_t>(row * width + t)] *
               params.value_table()[static_cast<std::size_t>(t * dim + d)];
      }
      const std::int64_t at = base + d * g.tokens.dim_stride;
      detail::store(out.data(), out.dtype(), at, detail::load(out.data(), out.dtype(), at) + sum);
    }
  }
}

void shaw_score_term_backward(const ShawParams& params, ConstTensorView q, ConstTensorView d_scores,
                              const Positions& q_positions, const Positions& k_positions, TensorView dq,
                              std::span<double> d_key_table) {
  detail::init_dispatch();
  const char* where = "shaw_score_term_backward";
  const detail::ShawGrids g = detail::check_shaw(where, params, "q", q, "d_scores", d_scores, q_positions, k_positions);
  detail::check_gradient_size(where, "d_key_table", d_key_table.size(), params.rows() * params.head_dim());
  const bool has_dq = !detail::empty_view(ConstTensorView(dq));
  if (has_dq) detail::check_output_tokens(where, "dq", ConstTensorView(dq), g.tokens);
  if (detail::use_reference()) {
    ref::shaw_score_term_backward(params, q, d_scores, q_positions, k_positions, dq, d_key_table);
    return;
  }
  std::vector<double> sums;
  sum_by_table_row(params, d_scores, g.scores, q_positions, k_positions, sums);
  const std::int64_t width = params.rows(), dim = params.head_dim();
  const double scale = 1.0 / std::sqrt(static_cast<double>(dim));
  if (has_dq) {
    const detail::HeadsGrid dg = detail::heads_grid(where, "dq", ConstTensorView(dq));
    const std::int64_t rows = g.scores.batch * g.scores.heads * g.scores.q_len;
    const int threads = detail::threads_for(rows * width * dim);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (std::int64_t row = 0; row < rows; ++row) {
      const std::int64_t b = row / (g.scores.heads * g.scores.q_len), h = (row / g.scores.q_len) % g.scores.heads;
      const std::int64_t i = row % g.scores.q_len;
      const std::int64_t base = dg.offset(b, i) + h * dg.head_stride;
      for (std::int64_t d = 0; d < dim; ++d) {
        double sum = 0;
        for (std::int64_t t = 0; t < width; ++t) {
          sum += sums[static_cast<std::size_t>(row * width + t)] *
                 params.key_table()[static_cast<std::size_t>(t * dim + d)];
        }
        const std::int64_t at = base + d * dg.dim_stride;
        detail::store(dq.data(), dq.dtype(), at, detail::load(dq.data(), dq.dtype(), at) + sum * scale);
      }
    }
  }
  contract_table_gradient(params, sums, q, g.tokens, g.scores, scale, d_key_table);
}

void shaw_value_term_backward(const ShawParams& params, ConstTensorView probs, ConstTensorView d_out,
                              const Positions& q_positions, const Positions& k_positions, TensorView d_probs,
                              std::span<double> d_value_table) {
  detail::init_dispatch();
  const char* where = "shaw_value_term_backward";
  const detail::ShawGrids g =
      detail::check_shaw(where, params, "d_out", d_out, "probs", probs, q_positions, k_positions);
  detail::check_gradient_size(where, "d_value_table", d_value_table.size(), params.rows() * params.head_dim());
  const bool has_dp = !detail::empty_view(ConstTensorView(d_probs));
  detail::ScoreGrid dpg;
  if (has_dp) {
    dpg = detail::check_scores(where, "d_probs", ConstTensorView(d_probs), g.scores.heads, q_positions, k_positions);
    if (dpg.batch != g.scores.batch || dpg.q_len != g.scores.q_len || dpg.k_len != g.scores.k_len) {
      throw Error(where, "d_probs shape", ConstTensorView(d_probs).describe(), "the shape of probs");
    }
    detail::check_writable(where, "d_probs", ConstTensorView(d_probs));
  }
  if (detail::use_reference()) {
    ref::shaw_value_term_backward(params, probs, d_out, q_positions, k_positions, d_probs, d_value_table);
    return;
  }
  const std::int64_t width = params.rows(), dim = params.head_dim();
  if (has_dp) {
    const std::int64_t rows = g.scores.batch * g.scores.heads * g.scores.q_len;
    const int threads = detail::threads_for(rows * (width * dim + g.scores.k_len));
#pragma omp parallel num_threads(threads)
    {
      std::vector<double> dots(static_cast<std::size_t>(width));
#pragma omp for schedule(static)
      for (std::int64_t row = 0; row < rows; ++row) {
        const std::int64_t b = row / (g.scores.heads * g.scores.q_len), h = (row / g.scores.q_len) % g.scores.heads;
        const std::int64_t i = row % g.scores.q_len, q_pos = q_positions.at(b, i);
        const std::int64_t base = g.tokens.offset(b, i) + h * g.tokens.head_stride;
        for (std::int64_t t = 0; t < width; ++t) {
          double dot = 0;
          for (std::int64_t d = 0; d < dim; ++d) {
            dot += detail::load(d_out.data(), d_out.dtype(), base + d * g.tokens.dim_stride) *
                   params.value_table()[static_cast<std::size_t>(t * dim + d)];
          }
          dots[static_cast<std::size_t>(t)] = dot;
        }
        const std::int64_t offset = dpg.offset(b, h, i);
        for (std::int64_t j = 0; j < dpg.k_len; ++j) {
          const std::int64_t at = offset + j * dpg.k_stride;
          const double term = dots[static_cast<std::size_t>(params.row_of(k_positions.at(b, j) - q_pos))];
          detail::store(d_probs.data(), d_probs.dtype(), at, detail::load(d_probs.data(), d_probs.dtype(), at) + term);
        }
      }
    }
  }
  std::vector<double> sums;
  sum_by_table_row(params, probs, g.scores, q_positions, k_positions, sums);
  contract_table_gradient(params, sums, d_out, g.tokens, g.scores, 1.0, d_value_table);
}

// ------------------------------------------------------------------------------ evaluator

ShawEvaluator::ShawEvaluator(const ShawParams& params)
    : k_(params.max_distance()),
      width_(params.rows()),
      dim_(params.head_dim()),
      scale_(static_cast<float>(1.0 / std::sqrt(static_cast<double>(params.head_dim())))),
      key_table_(params.key_table().begin(), params.key_table().end()),
      value_table_(params.value_table().begin(), params.value_table().end()) {}

void ShawEvaluator::query_dots(const float* q, float* dots) const {
  for (std::int64_t t = 0; t < width_; ++t) {
    const float* row = key_table_.data() + t * dim_;
    float dot = 0;
    for (std::int64_t d = 0; d < dim_; ++d) dot += q[d] * row[d];
    dots[t] = dot * scale_;
  }
}

void ShawEvaluator::add_row(const float* dots, std::int64_t q_position, std::int64_t k_first, std::int64_t count,
                            float* scores) const {
  for (std::int64_t j = 0; j < count; ++j) scores[j] += dots[row_of(k_first + j - q_position)];
}

void ShawEvaluator::add_values(const float* probs, std::int64_t q_position, std::int64_t k_first, std::int64_t count,
                               float* out) const {
  std::vector<float> weights(static_cast<std::size_t>(width_), 0.0f);
  for (std::int64_t j = 0; j < count; ++j)
    weights[static_cast<std::size_t>(row_of(k_first + j - q_position))] += probs[j];
  for (std::int64_t t = 0; t < width_; ++t) {
    const float w = weights[static_cast<std::size_t>(t)];
    if (w == 0.0f) continue;
    const float* row = value_table_.data() + t * dim_;
    for (std::int64_t d = 0; d < dim_; ++d) out[d] += w * row[d];
  }
}

// ------------------------------------------------------------------------------ reference

}  // namespace posenc
