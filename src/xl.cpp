// Transformer-XL relative position terms (Dai et al. 2019; math and layouts in
// posenc/relative.hpp).
//
// Fast path: the sinusoids r(δ) and the projected P(δ) = W_R r(δ) are tabulated once per call for
// the δ = q_pos − k_pos the call can meet (a range for consecutive positions, else the distinct
// values), then every pair costs two D-long dot products. The backward runs one head per thread
// (its sums in b, i, j order), so results are bitwise identical for any thread count. The
// reference evaluates r and W_R r per pair, in fp64.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "relative_checks.hpp"
#include "posenc/reference.hpp"
#include "posenc/relative.hpp"

namespace posenc {
namespace {

// The δ = q_pos − k_pos a call meets, each with its row in the tables: a dense range when it is
// not much wider than the pairs, else the sorted distinct values.
struct Deltas {
  std::int64_t lo = 0;
  bool dense = true;
  std::vector<std::int64_t> values;  // sorted distinct (dense: lo, lo + 1, …)
  std::size_t index(std::int64_t delta) const {
    if (dense) return static_cast<std::size_t>(delta - lo);
    return static_cast<std::size_t>(std::lower_bound(values.begin(), values.end(), delta) - values.begin());
  }
};

Deltas deltas_of(const Positions& q_positions, const Positions& k_positions, std::int64_t batch, std::int64_t q_len,
                 std::int64_t k_len) {
  Deltas d;
  std::int64_t lo = INT64_MAX, hi = INT64_MIN;
  std::vector<std::vector<std::int64_t>> qs, ks;
  for (std::int64_t b = 0; b < batch; ++b) {
    qs.push_back(detail::row_positions(q_positions, b, q_len));
    ks.push_back(detail::row_positions(k_positions, b, k_len));
    const auto [q_lo, q_hi] = std::minmax_element(qs.back().begin(), qs.back().end());
    const auto [k_lo, k_hi] = std::minmax_element(ks.back().begin(), ks.back().end());
    lo = std::min(lo, *q_lo - *k_hi);
    hi = std::max(hi, *q_hi - *k_lo);
  }
  const std::int64_t pairs = batch * q_len * k_len;
  if (hi - lo + 1 <= std::max<std::int64_t>(4 * pairs, 1024)) {
    d.lo = lo;
    for (std::int64_t delta = lo; delta <= hi; ++delta) d.values.push_back(delta);
    return d;
  }
  d.dense = false;
  for (std::int64_t b = 0; b < batch; ++b) {
    for (const std::int64_t q : qs[static_cast<std::size_t>(b)]) {
      for (const std::int64_t k : ks[static_cast<std::size_t>(b)]) d.values.push_back(q - k);
    }
  }
  std::sort(d.values.begin(), d.values.end());
  d.values.erase(std::unique(d.values.begin(), d.values.end()), d.values.end());
  return d;
}

// P(δ) = W_R r(δ) for every δ: [deltas, H·D]; and the sinusoids r(δ): [deltas, d_model].
void project(const XlParams& p, const Deltas& deltas, std::vector<double>& sinusoids, std::vector<double>& projected) {
  const auto count = static_cast<std::int64_t>(deltas.values.size());
  const std::int64_t out = p.heads() * p.head_dim(), in = p.d_model();
  sinusoids.assign(static_cast<std::size_t>(count * in), 0.0);
  projected.assign(static_cast<std::size_t>(count * out), 0.0);
  const int threads = detail::threads_for(count * out * in);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (std::int64_t t = 0; t < count; ++t) {
    const std::vector<double> r = p.sinusoid(deltas.values[static_cast<std::size_t>(t)]);
    std::copy(r.begin(), r.end(), sinusoids.begin() + t * in);
    for (std::int64_t o = 0; o < out; ++o) {
      double sum = 0;
      for (std::int64_t m = 0; m < in; ++m)
        sum += p.w_r()[static_cast<std::size_t>(o * in + m)] * r[static_cast<std::size_t>(m)];
      projected[static_cast<std::size_t>(t * out + o)] = sum;
    }
  }
}

}  // namespace

namespace detail {

XlGrids check_xl(const char* where, const XlParams& p, ConstTensorView q, ConstTensorView k, const char* scores_name,
                 ConstTensorView scores, const Positions& q_positions, const Positions& k_positions) {
  XlGrids g;
  g.q = detail::heads_grid(where, "q", q);
  g.k = detail::heads_grid(where, "k", k);
  for (const auto& [name, grid] : {std::pair<const char*, const detail::HeadsGrid&>{"q", g.q}, {"k", g.k}}) {
    if (grid.heads != p.heads() || grid.dim != p.head_dim()) {
      throw Error(where, std::string(name) + " [heads, head_dim]",
                  std::to_string(grid.heads) + ", " + std::to_string(grid.dim),
                  "params' " + std::to_string(p.heads()) + ", " + std::to_string(p.head_dim()));
    }
  }
  if (g.k.batch != g.q.batch) {
    throw Error(where, "k batch", std::to_string(g.k.batch), "q's batch = " + std::to_string(g.q.batch));
  }
  g.scores = detail::check_scores(where, scores_name, scores, p.heads(), q_positions, k_positions);
  if (g.scores.batch != g.q.batch || g.scores.q_len != g.q.seq || g.scores.k_len != g.k.seq) {
    throw Error(where, std::string(scores_name) + " shape", scores.describe(),
                "[B, H, Sq, Sk] = [" + std::to_string(g.q.batch) + ", " + std::to_string(p.heads()) + ", " +
                    std::to_string(g.q.seq) + ", " + std::to_string(g.k.seq) + "]");
  }
  return g;
}

double load_token(ConstTensorView v, const detail::HeadsGrid& g, std::int64_t b, std::int64_t s, std::int64_t h,
                  std::int64_t d) {
  return detail::load(v.data(), v.dtype(), g.offset(b, s) + h * g.head_stride + d * g.dim_stride);
}

void add_token(TensorView v, const detail::HeadsGrid& g, std::int64_t b, std::int64_t s, std::int64_t h, std::int64_t d,
               double value) {
  const std::int64_t at = g.offset(b, s) + h * g.head_stride + d * g.dim_stride;
  detail::store(v.data(), v.dtype(), at, detail::load(v.data(), v.dtype(), at) + value);
}

// P_h(δ) = W_R r(δ) restricted to head h, by the definition (fp64).
std::vector<double> projected_head(const XlParams& p, std::int64_t h, std::int64_t delta) {
  const std::vector<double> r = p.sinusoid(delta);
  std::vector<double> out(static_cast<std::size_t>(p.head_dim()), 0.0);
  for (std::int64_t e = 0; e < p.head_dim(); ++e) {
    for (std::int64_t m = 0; m < p.d_model(); ++m) {
      out[static_cast<std::size_t>(e)] +=
          p.w_r()[static_cast<std::size_t>((h * p.head_dim() + e) * p.d_model() + m)] * r[static_cast<std::size_t>(m)];
    }
  }
  return out;
}
}  // namespace detail

XlParams::XlParams(std::int64_t heads, std::int64_t head_dim, std::int64_t d_model, std::vector<double> u,
                   std::vector<double> v, std::vector<double> w_r, double scale, double base)
    : heads_(heads),
      head_dim_(head_dim),
      d_model_(d_model),
      u_(std::move(u)),
      v_(std::move(v)),
      w_r_(std::move(w_r)),
      scale_(scale == 0.0 ? 1.0 / std::sqrt(static_cast<double>(head_dim)) : scale),
      base_(base) {
  if (heads < 1) throw Error("XlParams", "heads", std::to_string(heads), ">= 1");
  if (head_dim < 1) throw Error("XlParams", "head_dim", std::to_string(head_dim), ">= 1");
  if (d_model < 2 || d_model % 2 != 0)
    throw Error("XlParams", "d_model", std::to_string(d_model), "an even number >= 2");
  const std::size_t hd = detail::table_count("XlParams", "heads · head_dim", {heads, head_dim});
  detail::table_count("XlParams", "heads · head_dim · d_model", {heads, head_dim, d_model});
  detail::check_parameter("XlParams", "u", u_, hd, "heads·head_dim = " + std::to_string(hd));
  detail::check_parameter("XlParams", "v", v_, hd, "heads·head_dim = " + std::to_string(hd));
  detail::check_parameter("XlParams", "w_r", w_r_, hd * static_cast<std::size_t>(d_model),
                          "heads·head_dim·d_model = " + std::to_string(hd * static_cast<std::size_t>(d_model)));
  if (!std::isfinite(scale_) || scale_ <= 0)
    throw Error("XlParams", "scale", detail::to_text(scale), "> 0, or 0 for 1/sqrt(head_dim)");
  if (!std::isfinite(base) || base <= 1) throw Error("XlParams", "base", detail::to_text(base), "a finite number > 1");
}

XlParams XlParams::init(std::int64_t heads, std::int64_t head_dim, std::int64_t d_model, double std,
                        std::uint64_t seed) {
  if (heads < 1 || head_dim < 1 || d_model < 2) {
    throw Error("XlParams::init", "heads, head_dim, d_model",
                std::to_string(heads) + ", " + std::to_string(head_dim) + ", " + std::to_string(d_model),
                ">= 1, >= 1, >= 2");
  }
  const std::size_t hd = detail::table_count("XlParams::init", "heads · head_dim", {heads, head_dim});
  std::vector<double> u(hd), v(hd),
      w(detail::table_count("XlParams::init", "heads · head_dim · d_model", {heads, head_dim, d_model}));
  std::uint64_t index = 0;
  for (auto& x : u) x = std * detail::seeded_normal(seed, index++);
  for (auto& x : v) x = std * detail::seeded_normal(seed, index++);
  const double w_std = 1.0 / std::sqrt(static_cast<double>(d_model));
  for (auto& x : w) x = w_std * detail::seeded_normal(seed, index++);
  return XlParams(heads, head_dim, d_model, std::move(u), std::move(v), std::move(w));
}

std::vector<double> XlParams::sinusoid(std::int64_t delta) const {
  const std::int64_t half = d_model_ / 2;
  std::vector<double> r(static_cast<std::size_t>(d_model_));
  for (std::int64_t i = 0; i < half; ++i) {
    const double angle = static_cast<double>(delta) * detail::sinusoid_inv_frequency(base_, d_model_, i);
    r[static_cast<std::size_t>(i)] = std::sin(angle);
    r[static_cast<std::size_t>(half + i)] = std::cos(angle);
  }
  return r;
}

XlGradients::XlGradients(const XlParams& params)
    : u(params.u().size(), 0.0), v(params.v().size(), 0.0), w_r(params.w_r().size(), 0.0) {}

void xl_add_position_terms(const XlParams& params, ConstTensorView q, ConstTensorView k, const Positions& q_positions,
                           const Positions& k_positions, TensorView scores) {
  detail::init_dispatch();
  const char* where = "xl_add_position_terms";
  const detail::XlGrids g =
      detail::check_xl(where, params, q, k, "scores", ConstTensorView(scores), q_positions, k_positions);
  detail::check_writable(where, "scores", ConstTensorView(scores));
  if (detail::use_reference()) {
    ref::xl_add_position_terms(params, q, k, q_positions, k_positions, scores);
    return;
  }
  const detail::ScoreGrid& sg = g.scores;
  if (sg.batch * sg.q_len * sg.k_len == 0) return;
  const Deltas deltas = deltas_of(q_positions, k_positions, sg.batch, sg.q_len, sg.k_len);
  std::vector<double> sinusoids, projected;
  project(params, deltas, sinusoids, projected);
  const std::int64_t dim = params.head_dim(), hd = params.heads() * dim;
  const std::int64_t rows = sg.batch * sg.heads * sg.q_len;
  const int threads = detail::threads_for(rows * sg.k_len * dim * 2);
#pragma omp parallel num_threads(threads)
  {
    std::vector<double> w(static_cast<std::size_t>(dim)), content(static_cast<std::size_t>(sg.k_len));
    std::int64_t cached = -1;
#pragma omp for schedule(static)
    for (std::int64_t row = 0; row < rows; ++row) {
      const std::int64_t b = row / (sg.heads * sg.q_len), h = (row / sg.q_len) % sg.heads, i = row % sg.q_len;
      if (cached != row / sg.q_len) {  // u·k_j for this (b, h)
        for (std::int64_t j = 0; j < sg.k_len; ++j) {
          double dot = 0;
          for (std::int64_t d = 0; d < dim; ++d)
            dot += params.u()[static_cast<std::size_t>(h * dim + d)] * detail::load_token(k, g.k, b, j, h, d);
          content[static_cast<std::size_t>(j)] = dot;
        }
        cached = row / sg.q_len;
      }
      for (std::int64_t d = 0; d < dim; ++d) {
        w[static_cast<std::size_t>(d)] =
            detail::load_token(q, g.q, b, i, h, d) + params.v()[static_cast<std::size_t>(h * dim + d)];
      }
      const std::int64_t q_pos = q_positions.at(b, i);
      for (std::int64_t j = 0; j < sg.k_len; ++j) {
        const double* pd = projected.data() +
                           deltas.index(q_pos - k_positions.at(b, j)) * static_cast<std::size_t>(hd) +
                           static_cast<std::size_t>(h * dim);
        double dot = 0;
        for (std::int64_t d = 0; d < dim; ++d) dot += w[static_cast<std::size_t>(d)] * pd[d];
        const std::int64_t at = sg.offset(b, h, i) + j * sg.k_stride;
        const double term = params.scale() * (content[static_cast<std::size_t>(j)] + dot);
        detail::store(scores.data(), scores.dtype(), at, detail::load(scores.data(), scores.dtype(), at) + term);
      }
    }
  }
}

void xl_position_terms_backward(const XlParams& params, ConstTensorView q, ConstTensorView k, ConstTensorView d_scores,
                                const Positions& q_positions, const Positions& k_positions, TensorView dq,
                                TensorView dk, XlGradients& grads) {
  detail::init_dispatch();
  const char* where = "xl_position_terms_backward";
  const detail::XlGrids g = detail::check_xl(where, params, q, k, "d_scores", d_scores, q_positions, k_positions);
  const bool has_dq = !detail::empty_view(ConstTensorView(dq)), has_dk = !detail::empty_view(ConstTensorView(dk));
  if (has_dq) detail::check_output_tokens(where, "dq", ConstTensorView(dq), g.q);
  if (has_dk) detail::check_output_tokens(where, "dk", ConstTensorView(dk), g.k);
  detail::check_gradient_size(where, "grads.u", grads.u.size(), params.heads() * params.head_dim());
  detail::check_gradient_size(where, "grads.v", grads.v.size(), params.heads() * params.head_dim());
  detail::check_gradient_size(where, "grads.w_r", grads.w_r.size(),
                              params.heads() * params.head_dim() * params.d_model());
  if (detail::use_reference()) {
    ref::xl_position_terms_backward(params, q, k, d_scores, q_positions, k_positions, dq, dk, grads);
    return;
  }
  const detail::ScoreGrid& sg = g.scores;
  if (sg.batch * sg.q_len * sg.k_len == 0) return;
  const detail::HeadsGrid dqg = has_dq ? detail::heads_grid(where, "dq", ConstTensorView(dq)) : detail::HeadsGrid{};
  const detail::HeadsGrid dkg = has_dk ? detail::heads_grid(where, "dk", ConstTensorView(dk)) : detail::HeadsGrid{};
  const Deltas deltas = deltas_of(q_positions, k_positions, sg.batch, sg.q_len, sg.k_len);
  std::vector<double> sinusoids, projected;
  project(params, deltas, sinusoids, projected);
  const std::int64_t dim = params.head_dim(), hd = params.heads() * dim, dm = params.d_model();
  const auto count = static_cast<std::int64_t>(deltas.values.size());
  const double scale = params.scale();
  const int threads = static_cast<int>(
      std::min<std::int64_t>(detail::threads_for(sg.batch * sg.heads * sg.q_len * sg.k_len * dim * 3), sg.heads));
#pragma omp parallel num_threads(threads)
  {
    std::vector<double> d_projected(static_cast<std::size_t>(count * dim)), w(static_cast<std::size_t>(dim));
    std::vector<double> column(static_cast<std::size_t>(sg.k_len)), dq_row(static_cast<std::size_t>(dim));
#pragma omp for schedule(static)
    for (std::int64_t h = 0; h < sg.heads; ++h) {
      std::fill(d_projected.begin(), d_projected.end(), 0.0);
      for (std::int64_t b = 0; b < sg.batch; ++b) {
        std::fill(column.begin(), column.end(), 0.0);
        for (std::int64_t i = 0; i < sg.q_len; ++i) {
          const std::int64_t q_pos = q_positions.at(b, i);
          for (std::int64_t d = 0; d < dim; ++d) {
            w[static_cast<std::size_t>(d)] =
                detail::load_token(q, g.q, b, i, h, d) + params.v()[static_cast<std::size_t>(h * dim + d)];
          }
          std::fill(dq_row.begin(), dq_row.end(), 0.0);
          for (std::int64_t j = 0; j < sg.k_len; ++j) {
            const double ds =
                scale * detail::load(d_scores.data(), d_scores.dtype(), sg.offset(b, h, i) + j * sg.k_stride);
            column[static_cast<std::size_t>(j)] += ds;
            const std::size_t t = deltas.index(q_pos - k_positions.at(b, j));
            const double* pd = projected.data() + t * static_cast<std::size_t>(hd) + static_cast<std::size_t>(h * dim);
            double* dpd = d_projected.data() + t * static_cast<std::size_t>(dim);
            for (std::int64_t d = 0; d < dim; ++d) {
              dq_row[static_cast<std::size_t>(d)] += ds * pd[d];
              dpd[d] += ds * w[static_cast<std::size_t>(d)];
            }
          }
          for (std::int64_t d = 0; d < dim; ++d) {
            grads.v[static_cast<std::size_t>(h * dim + d)] += dq_row[static_cast<std::size_t>(d)];
            if (has_dq) detail::add_token(dq, dqg, b, i, h, d, dq_row[static_cast<std::size_t>(d)]);
          }
        }
        // u·k_j: dk_j += (Σ_i ds)·u, du += Σ_j (Σ_i ds)·k_j.
        for (std::int64_t j = 0; j < sg.k_len; ++j) {
          const double col = column[static_cast<std::size_t>(j)];
          for (std::int64_t d = 0; d < dim; ++d) {
            grads.u[static_cast<std::size_t>(h * dim + d)] += col * detail::load_token(k, g.k, b, j, h, d);
            if (has_dk) detail::add_token(dk, dkg, b, j, h, d, col * params.u()[static_cast<std::size_t>(h * dim + d)]);
          }
        }
      }
      // dW_R[h·D + e, m] += Σ_δ dP_h(δ)[e]·r(δ)[m].
      for (std::int64_t e = 0; e < dim; ++e) {
        double* out = grads.w_r.data() + (h * dim + e) * dm;
        for (std::int64_t t = 0; t < count; ++t) {
          const double dp = d_projected[static_cast<std::size_t>(t * dim + e)];
          if (dp == 0.0) continue;
          const double* r = sinusoids.data() + t * dm;
          for (std::int64_t m = 0; m < dm; ++m) out[m] += dp * r[m];
        }
      }
    }
  }
}

// ------------------------------------------------------------------------------ evaluator

XlEvaluator::XlEvaluator(const XlParams& params, std::int64_t min_delta, std::int64_t max_delta)
    : params_(params),
      min_delta_(min_delta),
      width_(0),
      hd_(params.heads() * params.head_dim()),
      dim_(params.head_dim()),
      u_(params.u().begin(), params.u().end()),
      v_(params.v().begin(), params.v().end()) {
  if (max_delta < min_delta) {
    throw Error("XlEvaluator", "max_delta", std::to_string(max_delta), ">= min_delta = " + std::to_string(min_delta));
  }
  // Tables up to 2^26 floats (256 MiB); wider ranges are projected per pair.
  if ((max_delta - min_delta + 1) > (std::int64_t{1} << 26) / hd_) return;
  width_ = max_delta - min_delta + 1;
  Deltas deltas;
  deltas.lo = min_delta;
  for (std::int64_t delta = min_delta; delta <= max_delta; ++delta) deltas.values.push_back(delta);
  std::vector<double> sinusoids, projected;
  project(params, deltas, sinusoids, projected);
  projected_.assign(projected.begin(), projected.end());
}

void XlEvaluator::add_row(std::int64_t head, const float* q, std::int64_t q_position, const float* k,
                          std::int64_t k_stride, std::int64_t k_first, std::int64_t count, float* scores) const {
  const float* u = u_.data() + head * dim_;
  const float* v = v_.data() + head * dim_;
  const auto scale = static_cast<float>(params_.scale());
  std::vector<float> spot;
  for (std::int64_t j = 0; j < count; ++j) {
    const std::int64_t t = q_position - (k_first + j) - min_delta_;
    const float* pd;
    if (t >= 0 && t < width_) {
      pd = projected_.data() + t * hd_ + head * dim_;
    } else {  // outside the table: projected on the spot
      const std::vector<double> exact = detail::projected_head(params_, head, q_position - (k_first + j));
      spot.assign(exact.begin(), exact.end());
      pd = spot.data();
    }
    const float* kj = k + j * k_stride;
    float sum = 0;
    for (std::int64_t d = 0; d < dim_; ++d) sum += u[d] * kj[d] + (q[d] + v[d]) * pd[d];
    scores[j] += scale * sum;
  }
}

// ------------------------------------------------------------------------------ reference

}  // namespace posenc
