// FIRE (Li et al. 2023): parameters, the piecewise-linear form of its MLP, materialisation rows
// and the backward (math in posenc/bias.hpp).
//
// f_θ(x)_h = Σ_k W2[h, k]·relu(W1[k]·x + B1[k]) + B2[h] is linear between the kinks
// x = −B1[k]/W1[k]; on each piece posenc keeps the active units and, per head, the slope and
// intercept, so a bias is x (one log1p of a tabulated distance and a division) then one
// multiply-add. The backward needs, per piece and head, only Σ dL/db and Σ dL/db·x (the
// gradients of W1, B1, W2, B2 are linear in those), and per pair Σ_h dL/db_h·slope_h for c and L.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "bias_checks.hpp"
#include "posenc/bias.hpp"
#include "posenc/reference.hpp"

namespace posenc {
namespace {

void check_positive(const char* name, double value) {
  if (!std::isfinite(value) || value <= 0)
    throw Error("FireParams", name, detail::to_text(value), "a finite number > 0");
}

}  // namespace

namespace {

// The piecewise-linear form tabulates, for each of the hidden + 1 pieces, every unit's activity
// and every head's slope: (hidden + 1)·hidden bytes and (hidden + 1)·hidden·heads multiply-adds,
// kept to 2^28 (the paper's MLP has 32 units: heads up to 2·10^5).
void check_fire_size(const char* where, std::int64_t heads, std::int64_t hidden) {
  std::int64_t work = 0;
  if (__builtin_mul_overflow(hidden + 1, hidden, &work) || __builtin_mul_overflow(work, heads, &work) ||
      work > (std::int64_t{1} << 28)) {
    throw Error(where, "heads · hidden · (hidden + 1)",
                std::to_string(heads) + " · " + std::to_string(hidden) + " · " + std::to_string(hidden + 1),
                "at most 2^28 (the piecewise-linear form tabulates each piece's slope per head)");
  }
}

}  // namespace

FireParams::FireParams(std::int64_t heads, std::vector<double> w1, std::vector<double> b1, std::vector<double> w2,
                       std::vector<double> b2, double c, double threshold)
    : heads_(heads),
      w1_(std::move(w1)),
      b1_(std::move(b1)),
      w2_(std::move(w2)),
      b2_(std::move(b2)),
      c_(c),
      threshold_(threshold) {
  if (heads < 1) throw Error("FireParams", "heads", std::to_string(heads), ">= 1");
  if (w1_.empty()) throw Error("FireParams", "w1.size()", "0", ">= 1 (the hidden width)");
  const std::size_t hidden = w1_.size();
  check_fire_size("FireParams", heads, static_cast<std::int64_t>(hidden));
  detail::check_parameter("FireParams", "w1", w1_, hidden, "");
  detail::check_parameter("FireParams", "b1", b1_, hidden, "hidden = " + std::to_string(hidden));
  detail::check_parameter(
      "FireParams", "w2", w2_, static_cast<std::size_t>(heads) * hidden,
      "heads · hidden = " + std::to_string(static_cast<std::size_t>(heads) * hidden) + " ([heads, hidden])");
  detail::check_parameter("FireParams", "b2", b2_, static_cast<std::size_t>(heads), "heads = " + std::to_string(heads));
  check_positive("c", c);
  check_positive("threshold", threshold);
  // The pieces of f_θ: kinks sorted, and per piece the active units, slopes and intercepts.
  for (std::size_t k = 0; k < hidden; ++k) {
    if (w1_[k] != 0) kinks_.push_back(-b1_[k] / w1_[k]);
  }
  std::sort(kinks_.begin(), kinks_.end());
  kinks_.erase(std::unique(kinks_.begin(), kinks_.end()), kinks_.end());
  const std::size_t pieces = kinks_.size() + 1;
  active_.assign(pieces * hidden, 0);
  slopes_.assign(pieces * static_cast<std::size_t>(heads), 0.0);
  intercepts_.assign(slopes_.size(), 0.0);
  for (std::size_t s = 0; s < pieces; ++s) {
    const double x = kinks_.empty()    ? 0.0
                     : s == 0          ? kinks_.front() - 1.0
                     : s == pieces - 1 ? kinks_.back() + 1.0
                                       : 0.5 * (kinks_[s - 1] + kinks_[s]);
    for (std::size_t k = 0; k < hidden; ++k) active_[s * hidden + k] = w1_[k] * x + b1_[k] > 0 ? 1 : 0;
    for (std::size_t h = 0; h < static_cast<std::size_t>(heads); ++h) {
      double slope = 0, intercept = b2_[h];
      for (std::size_t k = 0; k < hidden; ++k) {
        if (!active_[s * hidden + k]) continue;
        slope += w2_[h * hidden + k] * w1_[k];
        intercept += w2_[h * hidden + k] * b1_[k];
      }
      slopes_[s * static_cast<std::size_t>(heads) + h] = slope;
      intercepts_[s * static_cast<std::size_t>(heads) + h] = intercept;
    }
  }
}

FireParams FireParams::init(std::int64_t heads, std::int64_t hidden, std::uint64_t seed, double c, double threshold) {
  if (heads < 1) throw Error("FireParams::init", "heads", std::to_string(heads), ">= 1");
  if (hidden < 1) throw Error("FireParams::init", "hidden", std::to_string(hidden), ">= 1");
  check_fire_size("FireParams::init", heads, hidden);
  const auto n = static_cast<std::size_t>(hidden);
  std::vector<double> w1(n), b1(n), w2(static_cast<std::size_t>(heads) * n), b2(static_cast<std::size_t>(heads), 0.0);
  std::uint64_t index = 0;
  for (auto& v : w1) v = detail::seeded_normal(seed, index++);
  for (auto& v : b1) v = detail::seeded_normal(seed, index++);
  const double scale = 1.0 / std::sqrt(static_cast<double>(hidden));
  for (auto& v : w2) v = scale * detail::seeded_normal(seed, index++);
  return FireParams(heads, std::move(w1), std::move(b1), std::move(w2), std::move(b2), c, threshold);
}

double FireParams::normalized_distance(std::int64_t q_position, std::int64_t k_position) const {
  const double d = std::fabs(static_cast<double>(k_position) - static_cast<double>(q_position));
  const double n = std::max(threshold_, static_cast<double>(q_position));
  return std::log1p(c_ * d) / std::log1p(c_ * n);
}

double FireParams::mlp(std::int64_t head, double x) const {
  const std::size_t hidden = w1_.size(), h = static_cast<std::size_t>(head);
  double sum = b2_[h];
  for (std::size_t k = 0; k < hidden; ++k) sum += w2_[h * hidden + k] * std::max(0.0, w1_[k] * x + b1_[k]);
  return sum;
}

std::int64_t FireParams::piece_of(double x) const {
  return std::upper_bound(kinks_.begin(), kinks_.end(), x) - kinks_.begin();
}

FireGradients::FireGradients(const FireParams& params)
    : w1(params.w1().size(), 0.0),
      b1(params.b1().size(), 0.0),
      w2(params.w2().size(), 0.0),
      b2(params.b2().size(), 0.0) {}

std::vector<double> FireGradients::flat() const {
  std::vector<double> all;
  all.reserve(w1.size() + b1.size() + w2.size() + b2.size() + 2);
  for (const std::vector<double>* part : {&w1, &b1, &w2, &b2}) all.insert(all.end(), part->begin(), part->end());
  all.push_back(c);
  all.push_back(threshold);
  return all;
}

namespace detail {

void fire_rows(const FireParams& params, std::int64_t q_position, const std::int64_t* keys, std::int64_t count,
               double* x, std::int64_t* piece) {
  const double n = std::max(params.threshold(), static_cast<double>(q_position));
  const double psi_n = std::log1p(params.c() * n);
  for (std::int64_t j = 0; j < count; ++j) {
    const double d = std::fabs(static_cast<double>(keys[j]) - static_cast<double>(q_position));
    x[j] = std::log1p(params.c() * d) / psi_n;
    piece[j] = params.piece_of(x[j]);
  }
}

}  // namespace detail

namespace detail {

// ∂x/∂c and ∂x/∂L of x = ψ(d)/ψ(n), ψ(t) = log1p(c·t), n = max(L, q).
void fire_x_derivatives(const FireParams& p, std::int64_t q, std::int64_t k, double x, double* dx_dc, double* dx_dl) {
  const double c = p.c(), d = std::fabs(static_cast<double>(k) - static_cast<double>(q));
  const bool threshold_active = p.threshold() > static_cast<double>(q);
  const double n = threshold_active ? p.threshold() : static_cast<double>(q);
  const double psi_n = std::log1p(c * n);
  *dx_dc = (d / (1 + c * d) - x * n / (1 + c * n)) / psi_n;
  *dx_dl = threshold_active ? -x * (c / (1 + c * n)) / psi_n : 0.0;
}

void fire_contract_moments(const FireParams& params, const double* s0, const double* s1, FireGradients& grads) {
  const auto heads = static_cast<std::size_t>(params.heads());
  const std::size_t pieces = params.kinks().size() + 1;
  const auto hidden = static_cast<std::size_t>(params.hidden());
  for (std::size_t s = 0; s < pieces; ++s) {
    for (std::size_t h = 0; h < heads; ++h) {
      const double m0 = s0[s * heads + h], m1 = s1[s * heads + h];
      grads.b2[h] += m0;
      for (std::size_t k = 0; k < hidden; ++k) {
        if (!params.active(static_cast<std::int64_t>(s), static_cast<std::int64_t>(k))) {
          // relu is exactly 0 here: ∂b/∂W2 = 0, and 0·NaN or 0·inf is NaN, as autograd gives it
          // (relu's own backward passes nothing to W1 and B1, as autograd's does).
          if (!std::isfinite(m0) || !std::isfinite(m1)) grads.w2[h * hidden + k] += 0.0 * (m0 + m1);
          continue;
        }
        const double w2 = params.w2()[h * hidden + k];
        grads.w2[h * hidden + k] += params.w1()[k] * m1 + params.b1()[k] * m0;
        grads.w1[k] += w2 * m1;
        grads.b1[k] += w2 * m0;
      }
    }
  }
}

}  // namespace detail

namespace {

// Partial sums of one block of rows: per piece and head Σ ds and Σ ds·x; Σ g·∂x/∂c, Σ g·∂x/∂L.
struct FireMoments {
  std::vector<double> s0, s1;
  double c = 0, threshold = 0;
};

constexpr std::int64_t kFireBlockRows = 16;

}  // namespace

void fire_backward(const FireParams& params, const Positions& q_positions, const Positions& k_positions,
                   ConstTensorView d_scores, FireGradients& grads) {
  detail::init_dispatch();
  const char* where = "fire_backward";
  detail::check_gradient_size(where, "grads.w1", grads.w1.size(), params.hidden());
  detail::check_gradient_size(where, "grads.b1", grads.b1.size(), params.hidden());
  detail::check_gradient_size(where, "grads.w2", grads.w2.size(), params.heads() * params.hidden());
  detail::check_gradient_size(where, "grads.b2", grads.b2.size(), params.heads());
  if (detail::use_reference()) {
    ref::fire_backward(params, q_positions, k_positions, d_scores, grads);
    return;
  }
  const detail::ScoreGrid g =
      detail::check_scores(where, "d_scores", d_scores, params.heads(), q_positions, k_positions);
  const std::int64_t rows = g.batch * g.q_len;
  if (rows * g.heads * g.k_len == 0) return;
  const auto heads = static_cast<std::size_t>(g.heads);
  const std::size_t pieces = params.kinks().size() + 1;
  const std::int64_t blocks = (rows + kFireBlockRows - 1) / kFireBlockRows;
  std::vector<FireMoments> partial(static_cast<std::size_t>(blocks));
  const int threads = detail::threads_for(rows * g.k_len * g.heads * 4);
#pragma omp parallel num_threads(threads)
  {
    std::vector<double> x(static_cast<std::size_t>(g.k_len)), gsum(x.size());
    std::vector<std::int64_t> piece(x.size());
#pragma omp for schedule(static)
    for (std::int64_t block = 0; block < blocks; ++block) {
      FireMoments& m = partial[static_cast<std::size_t>(block)];
      m.s0.assign(pieces * heads, 0.0);
      m.s1.assign(pieces * heads, 0.0);
      for (std::int64_t r = block * kFireBlockRows; r < std::min(rows, (block + 1) * kFireBlockRows); ++r) {
        const std::int64_t b = r / g.q_len, i = r % g.q_len;
        const std::int64_t q = q_positions.at(b, i);
        const std::vector<std::int64_t> keys = detail::row_positions(k_positions, b, g.k_len);
        detail::fire_rows(params, q, keys.data(), g.k_len, x.data(), piece.data());
        std::fill(gsum.begin(), gsum.end(), 0.0);
        for (std::int64_t h = 0; h < g.heads; ++h) {
          const std::int64_t offset = g.offset(b, h, i);
          for (std::int64_t j = 0; j < g.k_len; ++j) {
            const auto at = static_cast<std::size_t>(j);
            const double ds = detail::load(d_scores.data(), d_scores.dtype(), offset + j * g.k_stride);
            const std::size_t slot = static_cast<std::size_t>(piece[at]) * heads + static_cast<std::size_t>(h);
            m.s0[slot] += ds;
            m.s1[slot] += ds * x[at];
            gsum[at] += ds * params.slope(piece[at], h);
          }
        }
        for (std::int64_t j = 0; j < g.k_len; ++j) {
          const auto at = static_cast<std::size_t>(j);
          double dc = 0, dl = 0;
          detail::fire_x_derivatives(params, q, keys[at], x[at], &dc, &dl);
          m.c += gsum[at] * dc;
          m.threshold += gsum[at] * dl;
        }
      }
    }
  }
  // Blocks in order, then the moments contracted with the pieces' active units.
  std::vector<double> s0(pieces * heads, 0.0), s1(pieces * heads, 0.0);
  for (const FireMoments& m : partial) {
    for (std::size_t e = 0; e < s0.size(); ++e) {
      s0[e] += m.s0[e];
      s1[e] += m.s1[e];
    }
    grads.c += m.c;
    grads.threshold += m.threshold;
  }
  detail::fire_contract_moments(params, s0.data(), s1.data(), grads);
}

// ------------------------------------------------------------------------------ PositionBias

std::int64_t FireParams::parameter_count() const {
  return static_cast<std::int64_t>(w1_.size() + b1_.size() + w2_.size() + b2_.size()) + 2;
}

std::vector<double> FireParams::parameters() const {
  std::vector<double> all;
  all.reserve(static_cast<std::size_t>(parameter_count()));
  for (const std::vector<double>* part : {&w1_, &b1_, &w2_, &b2_}) all.insert(all.end(), part->begin(), part->end());
  all.push_back(c_);
  all.push_back(threshold_);
  return all;
}

double FireParams::value(std::int64_t head, std::int64_t q_position, std::int64_t k_position) const {
  return mlp(head, normalized_distance(q_position, k_position));
}

void FireParams::backward(const Positions& q_positions, const Positions& k_positions, ConstTensorView d_scores,
                          std::span<double> grads) const {
  detail::add_gradients<FireGradients>("FireParams::backward", *this, grads, [&](FireGradients& parts) {
    fire_backward(*this, q_positions, k_positions, d_scores, parts);
  });
}

// Per query, x and the piece of every key once, then each head's row by one multiply-add per
// element (fp64, rounded once).
void FireParams::materialize(const Positions& q_positions, const Positions& k_positions, TensorView out) const {
  detail::init_dispatch();
  const detail::ScoreGrid g =
      detail::check_scores("FireParams::materialize", "out", ConstTensorView(out), heads_, q_positions, k_positions);
  detail::check_writable("FireParams::materialize", "out", ConstTensorView(out));
  const FireParams& fire = *this;
  const std::int64_t rows = g.batch * g.q_len;
  const int threads = detail::threads_for(rows * g.k_len * g.heads * 4);
#pragma omp parallel num_threads(threads)
  {
    std::vector<double> x(static_cast<std::size_t>(g.k_len));
    std::vector<std::int64_t> piece(x.size());
#pragma omp for schedule(static)
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t b = r / g.q_len, i = r % g.q_len, q = q_positions.at(b, i);
      const std::vector<std::int64_t> keys = detail::row_positions(k_positions, b, g.k_len);
      detail::fire_rows(fire, q, keys.data(), g.k_len, x.data(), piece.data());
      for (std::int64_t h = 0; h < g.heads; ++h) {
        const std::int64_t offset = g.offset(b, h, i);
        auto value = [&](std::size_t at) {
          return fire.slope(piece[at], h) * x[at] + fire.intercept(piece[at], h) + 0.0;
        };
        if (out.dtype() == DType::kF32 && g.k_stride == 1) {
          float* dst = static_cast<float*>(out.data()) + offset;
          for (std::int64_t j = 0; j < g.k_len; ++j) dst[j] = static_cast<float>(value(static_cast<std::size_t>(j)));
          continue;
        }
        for (std::int64_t j = 0; j < g.k_len; ++j) {
          detail::store(out.data(), out.dtype(), offset + j * g.k_stride, value(static_cast<std::size_t>(j)));
        }
      }
    }
  }
}

}  // namespace posenc
