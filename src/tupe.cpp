// TUPE (Ke et al. 2021): parameters, materialisation and backward (math in posenc/bias.hpp).
//
// Fast path: each token's projections p[pos]·U^Q_h and p[pos]·U^K_h once per call, then one
// D-long dot product per score; the backward sums dL/db into the projections' gradients (one
// head per thread, b, i, j in order), contracts them into U^Q, U^K per head, and into the table
// per column (one column set per thread, tokens in order): bitwise identical for any thread
// count. The reference differentiates each pair by the definition.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "bias_checks.hpp"
#include "posenc/bias.hpp"
#include "posenc/reference.hpp"

namespace posenc {
namespace {

std::vector<double> checked(const char* name, std::vector<double> values, std::size_t size, const std::string& expected,
                            bool zeros_when_empty = false) {
  if (zeros_when_empty && values.empty()) values.assign(size, 0.0);
  detail::check_parameter("TupeParams", name, values, size, expected);
  return values;
}

}  // namespace

// Every position of both grids indexes the table.
void detail::check_tupe_positions(const char* where, const TupeParams& p, const Positions& q_positions,
                                  const Positions& k_positions) {
  for (const Positions* positions : {&q_positions, &k_positions}) {
    if (positions->max_position() >= p.max_len()) {
      throw Error(where, "position", std::to_string(positions->max_position()),
                  "< max_len = " + std::to_string(p.max_len()) + " (the rows of TUPE's table)");
    }
  }
}

namespace {

// Projections of every token of a [batch, len] grid: [batch·len, H·D].
std::vector<double> project_tokens(const TupeParams& p, const std::vector<double>& u, const Positions& positions,
                                   std::int64_t batch, std::int64_t len) {
  const std::int64_t hd = p.heads() * p.head_dim(), dm = p.d_model(), tokens = batch * len;
  std::vector<double> out(static_cast<std::size_t>(tokens * hd), 0.0);
  const int threads = detail::threads_for(tokens * hd * dm);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (std::int64_t t = 0; t < tokens; ++t) {
    const double* row = p.table().data() + positions.at(t / len, t % len) * dm;
    double* dst = out.data() + t * hd;
    for (std::int64_t m = 0; m < dm; ++m) {
      const double x = row[m];
      const double* um = u.data() + m * hd;
      for (std::int64_t c = 0; c < hd; ++c) dst[c] += x * um[c];
    }
  }
  return out;
}

}  // namespace

TupeParams::TupeParams(std::int64_t heads, std::int64_t head_dim, std::int64_t d_model, std::vector<double> table,
                       std::vector<double> u_q, std::vector<double> u_k, bool cls_reset, std::vector<double> theta1,
                       std::vector<double> theta2)
    : heads_(heads), head_dim_(head_dim), d_model_(d_model), cls_reset_(cls_reset) {
  if (heads < 1) throw Error("TupeParams", "heads", std::to_string(heads), ">= 1");
  if (head_dim < 1) throw Error("TupeParams", "head_dim", std::to_string(head_dim), ">= 1");
  if (d_model < 1) throw Error("TupeParams", "d_model", std::to_string(d_model), ">= 1");
  if (table.empty() || table.size() % static_cast<std::size_t>(d_model) != 0) {
    throw Error("TupeParams", "table.size()", std::to_string(table.size()),
                "a positive multiple of d_model = " + std::to_string(d_model) + " ([max_len, d_model])");
  }
  const std::size_t table_size = table.size();
  table_ = checked("table", std::move(table), table_size, "");
  const std::size_t u_size =
      detail::table_count("TupeParams", "d_model · heads · head_dim", {d_model, heads, head_dim});
  u_q_ = checked("u_q", std::move(u_q), u_size, "d_model·heads·head_dim = " + std::to_string(u_size));
  u_k_ = checked("u_k", std::move(u_k), u_size, "d_model·heads·head_dim = " + std::to_string(u_size));
  theta1_ =
      checked("theta1", std::move(theta1), static_cast<std::size_t>(heads), "heads = " + std::to_string(heads), true);
  theta2_ =
      checked("theta2", std::move(theta2), static_cast<std::size_t>(heads), "heads = " + std::to_string(heads), true);
}

TupeParams TupeParams::init(std::int64_t heads, std::int64_t head_dim, std::int64_t d_model, std::int64_t max_len,
                            bool cls_reset, double std, std::uint64_t seed) {
  if (heads < 1 || head_dim < 1 || d_model < 1 || max_len < 1) {
    throw Error("TupeParams::init", "heads, head_dim, d_model, max_len",
                std::to_string(heads) + ", " + std::to_string(head_dim) + ", " + std::to_string(d_model) + ", " +
                    std::to_string(max_len),
                "all >= 1");
  }
  std::vector<double> table(detail::table_count("TupeParams::init", "max_len · d_model", {max_len, d_model})),
      u_q(detail::table_count("TupeParams::init", "d_model · heads · head_dim", {d_model, heads, head_dim}));
  std::vector<double> u_k(u_q.size());
  std::uint64_t index = 0;
  for (auto& x : table) x = std * detail::seeded_normal(seed, index++);
  const double u_std = 1.0 / std::sqrt(static_cast<double>(d_model));
  for (auto& x : u_q) x = u_std * detail::seeded_normal(seed, index++);
  for (auto& x : u_k) x = u_std * detail::seeded_normal(seed, index++);
  return TupeParams(heads, head_dim, d_model, std::move(table), std::move(u_q), std::move(u_k), cls_reset);
}

std::vector<double> TupeParams::project(const std::vector<double>& u, std::int64_t position, std::int64_t head) const {
  std::vector<double> out(static_cast<std::size_t>(head_dim_), 0.0);
  const std::int64_t hd = heads_ * head_dim_;
  for (std::int64_t m = 0; m < d_model_; ++m) {
    for (std::int64_t e = 0; e < head_dim_; ++e) {
      out[static_cast<std::size_t>(e)] += table_[static_cast<std::size_t>(position * d_model_ + m)] *
                                          u[static_cast<std::size_t>(m * hd + head * head_dim_ + e)];
    }
  }
  return out;
}

TupeGradients::TupeGradients(const TupeParams& params)
    : table(params.table().size(), 0.0),
      u_q(params.u_q().size(), 0.0),
      u_k(params.u_k().size(), 0.0),
      theta1(params.theta1().size(), 0.0),
      theta2(params.theta2().size(), 0.0) {}

std::vector<double> TupeGradients::flat() const {
  std::vector<double> all;
  all.reserve(table.size() + u_q.size() + u_k.size() + theta1.size() + theta2.size());
  for (const std::vector<double>* part : {&table, &u_q, &u_k, &theta1, &theta2})
    all.insert(all.end(), part->begin(), part->end());
  return all;
}

namespace detail {

double tupe_value(const TupeParams& p, std::int64_t head, std::int64_t q_position, std::int64_t k_position) {
  // Both positions index the table, a [CLS] pair too (as check_tupe_positions asks of every call).
  if (q_position >= p.max_len() || k_position >= p.max_len()) {
    throw Error("bias_value", "position", std::to_string(std::max(q_position, k_position)),
                "< max_len = " + std::to_string(p.max_len()) + " (the rows of TUPE's table)");
  }
  if (p.cls_reset() && q_position == 0) return p.theta1()[static_cast<std::size_t>(head)];
  if (p.cls_reset() && k_position == 0) return p.theta2()[static_cast<std::size_t>(head)];
  const std::vector<double> a = p.project(p.u_q(), q_position, head), c = p.project(p.u_k(), k_position, head);
  double dot = 0;
  for (std::size_t e = 0; e < a.size(); ++e) dot += a[e] * c[e];
  return dot / std::sqrt(2.0 * static_cast<double>(p.head_dim()));
}

void materialize_tupe(const TupeParams& p, const Positions& q_positions, const Positions& k_positions,
                      const ScoreGrid& g, TensorView out) {
  const std::vector<double> pq = project_tokens(p, p.u_q(), q_positions, g.batch, g.q_len);
  const std::vector<double> pk = project_tokens(p, p.u_k(), k_positions, g.batch, g.k_len);
  const std::int64_t dim = p.head_dim(), hd = p.heads() * dim, rows = g.batch * g.heads * g.q_len;
  const double scale = 1.0 / std::sqrt(2.0 * static_cast<double>(dim));
  const int threads = threads_for(rows * g.k_len * dim);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (std::int64_t row = 0; row < rows; ++row) {
    const std::int64_t b = row / (g.heads * g.q_len), h = (row / g.q_len) % g.heads, i = row % g.q_len;
    const std::int64_t q_pos = q_positions.at(b, i);
    const double* a = pq.data() + (b * g.q_len + i) * hd + h * dim;
    for (std::int64_t j = 0; j < g.k_len; ++j) {
      const std::int64_t k_pos = k_positions.at(b, j);
      double value;
      if (p.cls_reset() && q_pos == 0) {
        value = p.theta1()[static_cast<std::size_t>(h)];
      } else if (p.cls_reset() && k_pos == 0) {
        value = p.theta2()[static_cast<std::size_t>(h)];
      } else {
        const double* c = pk.data() + (b * g.k_len + j) * hd + h * dim;
        double dot = 0;
        for (std::int64_t e = 0; e < dim; ++e) dot += a[e] * c[e];
        value = dot * scale;
      }
      store(out.data(), out.dtype(), g.offset(b, h, i) + j * g.k_stride, value + 0.0);
    }
  }
}

}  // namespace detail

void tupe_backward(const TupeParams& params, const Positions& q_positions, const Positions& k_positions,
                   ConstTensorView d_scores, TupeGradients& grads) {
  detail::init_dispatch();
  const char* where = "tupe_backward";
  detail::check_gradient_size(where, "grads.table", grads.table.size(),
                              static_cast<std::int64_t>(params.table().size()));
  detail::check_gradient_size(where, "grads.u_q", grads.u_q.size(), static_cast<std::int64_t>(params.u_q().size()));
  detail::check_gradient_size(where, "grads.u_k", grads.u_k.size(), static_cast<std::int64_t>(params.u_k().size()));
  detail::check_gradient_size(where, "grads.theta1", grads.theta1.size(), params.heads());
  detail::check_gradient_size(where, "grads.theta2", grads.theta2.size(), params.heads());
  const detail::ScoreGrid g =
      detail::check_scores(where, "d_scores", d_scores, params.heads(), q_positions, k_positions);
  if (g.batch * g.q_len * g.k_len == 0) return;
  detail::check_tupe_positions(where, params, q_positions, k_positions);
  if (detail::use_reference()) {
    ref::tupe_backward(params, q_positions, k_positions, d_scores, grads);
    return;
  }
  const std::vector<double> pq = project_tokens(params, params.u_q(), q_positions, g.batch, g.q_len);
  const std::vector<double> pk = project_tokens(params, params.u_k(), k_positions, g.batch, g.k_len);
  const std::int64_t dim = params.head_dim(), hd = params.heads() * dim, dm = params.d_model();
  const std::int64_t q_tokens = g.batch * g.q_len, k_tokens = g.batch * g.k_len;
  const double scale = 1.0 / std::sqrt(2.0 * static_cast<double>(dim));
  std::vector<double> d_pq(pq.size(), 0.0), d_pk(pk.size(), 0.0);
  const int threads =
      static_cast<int>(std::min<std::int64_t>(detail::threads_for(q_tokens * g.k_len * hd * 2), g.heads));
#pragma omp parallel for schedule(static) num_threads(threads)
  for (std::int64_t h = 0; h < g.heads; ++h) {
    const auto hh = static_cast<std::size_t>(h);
    for (std::int64_t b = 0; b < g.batch; ++b) {
      for (std::int64_t i = 0; i < g.q_len; ++i) {
        const std::int64_t q_pos = q_positions.at(b, i), qt = b * g.q_len + i;
        for (std::int64_t j = 0; j < g.k_len; ++j) {
          const double ds = detail::load(d_scores.data(), d_scores.dtype(), g.offset(b, h, i) + j * g.k_stride);
          const std::int64_t k_pos = k_positions.at(b, j), kt = b * g.k_len + j;
          if (params.cls_reset() && q_pos == 0) {
            grads.theta1[hh] += ds;
            continue;
          }
          if (params.cls_reset() && k_pos == 0) {
            grads.theta2[hh] += ds;
            continue;
          }
          const double* a = pq.data() + qt * hd + h * dim;
          const double* c = pk.data() + kt * hd + h * dim;
          double* da = d_pq.data() + qt * hd + h * dim;
          double* dc = d_pk.data() + kt * hd + h * dim;
          for (std::int64_t e = 0; e < dim; ++e) {
            da[e] += ds * scale * c[e];
            dc[e] += ds * scale * a[e];
          }
        }
      }
    }
    // U^Q, U^K columns of head h: Σ_tokens p[pos]ᵀ · d(projection).
    for (const bool is_q : {true, false}) {
      std::vector<double>& du = is_q ? grads.u_q : grads.u_k;
      const std::vector<double>& dproj = is_q ? d_pq : d_pk;
      const Positions& positions = is_q ? q_positions : k_positions;
      const std::int64_t tokens = is_q ? q_tokens : k_tokens, len = is_q ? g.q_len : g.k_len;
      for (std::int64_t t = 0; t < tokens; ++t) {
        const double* row = params.table().data() + positions.at(t / len, t % len) * dm;
        const double* dp = dproj.data() + t * hd + h * dim;
        for (std::int64_t m = 0; m < dm; ++m) {
          for (std::int64_t e = 0; e < dim; ++e) du[static_cast<std::size_t>(m * hd + h * dim + e)] += row[m] * dp[e];
        }
      }
    }
  }
  // The table rows: d p[pos][m] += Σ_c U[m, c]·d(projection)[c], columns m split over threads.
  const int column_threads = detail::threads_for((q_tokens + k_tokens) * hd * dm);
#pragma omp parallel for schedule(static) num_threads(column_threads)
  for (std::int64_t m = 0; m < dm; ++m) {
    for (const bool is_q : {true, false}) {
      const std::vector<double>& u = is_q ? params.u_q() : params.u_k();
      const std::vector<double>& dproj = is_q ? d_pq : d_pk;
      const Positions& positions = is_q ? q_positions : k_positions;
      const std::int64_t tokens = is_q ? q_tokens : k_tokens, len = is_q ? g.q_len : g.k_len;
      for (std::int64_t t = 0; t < tokens; ++t) {
        double sum = 0;
        for (std::int64_t c = 0; c < hd; ++c)
          sum += u[static_cast<std::size_t>(m * hd + c)] * dproj[static_cast<std::size_t>(t * hd + c)];
        grads.table[static_cast<std::size_t>(positions.at(t / len, t % len) * dm + m)] += sum;
      }
    }
  }
}

TupeEvaluator::TupeEvaluator(const TupeParams& params, std::int64_t first_position, std::int64_t last_position)
    : params_(params),
      first_(first_position),
      hd_(params.heads() * params.head_dim()),
      dim_(params.head_dim()),
      scale_(static_cast<float>(1.0 / std::sqrt(2.0 * static_cast<double>(params.head_dim())))) {
  if (first_position < 0 || last_position < first_position || last_position >= params.max_len()) {
    throw Error("TupeEvaluator", "[first_position, last_position]",
                "[" + std::to_string(first_position) + ", " + std::to_string(last_position) + "]",
                "0 <= first <= last < max_len = " + std::to_string(params.max_len()));
  }
  const std::int64_t count = last_position - first_position + 1;
  pq_.resize(static_cast<std::size_t>(count * hd_));
  pk_.resize(pq_.size());
  for (std::int64_t n = 0; n < count; ++n) {
    for (std::int64_t h = 0; h < params.heads(); ++h) {
      const std::vector<double> a = params.project(params.u_q(), first_position + n, h);
      const std::vector<double> c = params.project(params.u_k(), first_position + n, h);
      for (std::int64_t e = 0; e < dim_; ++e) {
        pq_[static_cast<std::size_t>(n * hd_ + h * dim_ + e)] = static_cast<float>(a[static_cast<std::size_t>(e)]);
        pk_[static_cast<std::size_t>(n * hd_ + h * dim_ + e)] = static_cast<float>(c[static_cast<std::size_t>(e)]);
      }
    }
  }
}

void TupeEvaluator::add_row(std::int64_t head, std::int64_t q_position, std::int64_t k_first, std::int64_t count,
                            float* scores) const {
  const auto in_range = [&](std::int64_t p) {
    return p >= first_ && (p - first_) * hd_ < static_cast<std::int64_t>(pq_.size());
  };
  for (std::int64_t j = 0; j < count; ++j) {
    const std::int64_t k_position = k_first + j;
    if ((params_.cls_reset() && (q_position == 0 || k_position == 0)) || !in_range(q_position) ||
        !in_range(k_position)) {
      scores[j] += static_cast<float>(detail::tupe_value(params_, head, q_position, k_position));
      continue;
    }
    const float* a = pq_.data() + (q_position - first_) * hd_ + head * dim_;
    const float* c = pk_.data() + (k_position - first_) * hd_ + head * dim_;
    float dot = 0;
    for (std::int64_t e = 0; e < dim_; ++e) dot += a[e] * c[e];
    scores[j] += dot * scale_;
  }
}

// ------------------------------------------------------------------------------ PositionBias

std::int64_t TupeParams::parameter_count() const {
  return static_cast<std::int64_t>(table_.size() + u_q_.size() + u_k_.size() + theta1_.size() + theta2_.size());
}

std::vector<double> TupeParams::parameters() const {
  std::vector<double> all;
  all.reserve(static_cast<std::size_t>(parameter_count()));
  for (const std::vector<double>* part : {&table_, &u_q_, &u_k_, &theta1_, &theta2_})
    all.insert(all.end(), part->begin(), part->end());
  return all;
}

double TupeParams::value(std::int64_t head, std::int64_t q_position, std::int64_t k_position) const {
  return detail::tupe_value(*this, head, q_position, k_position);
}

void TupeParams::check_positions(const char* where, const Positions& q_positions, const Positions& k_positions) const {
  detail::check_tupe_positions(where, *this, q_positions, k_positions);
}

void TupeParams::backward(const Positions& q_positions, const Positions& k_positions, ConstTensorView d_scores,
                          std::span<double> grads) const {
  detail::add_gradients<TupeGradients>("TupeParams::backward", *this, grads, [&](TupeGradients& parts) {
    tupe_backward(*this, q_positions, k_positions, d_scores, parts);
  });
}

void TupeParams::materialize(const Positions& q_positions, const Positions& k_positions, TensorView out) const {
  detail::init_dispatch();
  const detail::ScoreGrid g =
      detail::check_scores("TupeParams::materialize", "out", ConstTensorView(out), heads_, q_positions, k_positions);
  detail::check_writable("TupeParams::materialize", "out", ConstTensorView(out));
  if (g.batch * g.heads * g.q_len * g.k_len == 0) return;
  check_positions("TupeParams::materialize", q_positions, k_positions);
  detail::materialize_tupe(*this, q_positions, k_positions, g, out);
}

}  // namespace posenc
