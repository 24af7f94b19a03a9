// Score biases: parameter validation, the T5 bucket function, the tabulating evaluator, and the
// SIMD materialisation and backward (math and layouts in posenc/bias.hpp).
//
// Every scheme here is a per-head function of r = k − q, so a call tabulates b(h, r) once over the
// relative positions its grids can produce (fp64, rounded once to f32) and then
//   materialise  copies table rows into the output (contiguous keys) or gathers them;
//   backward     sums dL/dscores into an fp64 histogram over r per head (one pass over the
//                scores, each head owned by one thread and summed in a fixed order), then
//                contracts the histogram with ∂b/∂θ(r).
// Ranges too wide to tabulate (scattered ids) fall back to evaluating each element.
#include "posenc/bias.hpp"

#include <omp.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <string>

#include "bias_checks.hpp"
#include "kernels/bias/bias_kernels.hpp"
#include "kernels/common/row_kernels.hpp"
#include "posenc/memory.hpp"
#include "posenc/reference.hpp"

namespace posenc {
namespace {

// Largest table the evaluator and the backward build: entries over all heads (64 MiB of f32).
constexpr std::int64_t kMaxTableEntries = std::int64_t{1} << 24;
// fp64 entries per slice of a table's tabulation (64 KiB: below malloc's mmap threshold).
constexpr std::int64_t kTabulateSliceEntries = 8192;
// Non-temporal stores pay off once the output is much larger than the caches.
constexpr std::int64_t kStreamBytes = std::int64_t{8} << 20;

void check_heads(const char* where, std::int64_t heads) {
  if (heads < 1) throw Error(where, "heads", std::to_string(heads), ">= 1");
  checked_allocation(heads, sizeof(double), where, "heads");
}

void check_finite_nonnegative(const char* where, const char* name, std::size_t index, double value, bool positive) {
  if (!std::isfinite(value) || value < 0 || (positive && value == 0)) {
    throw Error(where, std::string(name) + "[" + std::to_string(index) + "]", detail::to_text(value),
                positive ? "a finite number > 0" : "a finite number >= 0");
  }
}

// The smallest and largest position of a [batch, len] grid.
std::pair<std::int64_t, std::int64_t> position_bounds(const Positions& positions, std::int64_t batch,
                                                      std::int64_t len) {
  std::int64_t lo = std::numeric_limits<std::int64_t>::max(), hi = std::numeric_limits<std::int64_t>::min();
  for (std::int64_t b = 0; b < batch; ++b) {
    if (positions.kind() == Positions::Kind::kRange || positions.kind() == Positions::Kind::kRanges) {
      lo = std::min(lo, positions.at(b, 0));  // consecutive: first and last are the bounds
      hi = std::max(hi, positions.at(b, len - 1));
      continue;
    }
    for (std::int64_t s = 0; s < len; ++s) {
      const std::int64_t p = positions.at(b, s);
      lo = std::min(lo, p);
      hi = std::max(hi, p);
    }
  }
  return {lo, hi};
}

bool consecutive(const std::vector<std::int64_t>& ids) {
  for (std::size_t s = 1; s < ids.size(); ++s) {
    if (ids[s] != ids[s - 1] + 1) return false;
  }
  return true;
}

}  // namespace

// ------------------------------------------------------------------------------ parameters

NoPE::NoPE(std::int64_t heads_) : heads(heads_) { check_heads("NoPE", heads_); }

std::vector<double> alibi_slopes(std::int64_t heads, double max_bias) {
  check_heads("alibi_slopes", heads);
  if (!std::isfinite(max_bias) || max_bias <= 0) {
    throw Error("alibi_slopes", "max_bias", detail::to_text(max_bias), "a finite number > 0");
  }
  // Press et al. 2022, section 3 and their reference code's rule for head counts that are not a
  // power of two; max_bias generalises the 8 of the paper (llama.cpp's ggml_alibi).
  std::int64_t n = 1;
  while (n <= heads / 2) n *= 2;
  std::vector<double> slopes(static_cast<std::size_t>(heads));
  for (std::int64_t h = 0; h < heads; ++h) {
    const double exponent = h < n ? static_cast<double>(h + 1) / static_cast<double>(n)
                                  : static_cast<double>(2 * (h - n) + 1) / static_cast<double>(2 * n);
    slopes[static_cast<std::size_t>(h)] = std::exp2(-max_bias * exponent);
  }
  return slopes;
}

AlibiParams::AlibiParams(std::int64_t heads, AlibiForm form, double max_bias)
    : slopes_(alibi_slopes(heads, max_bias)), form_(form) {}

AlibiParams::AlibiParams(std::vector<double> slopes, AlibiForm form) : slopes_(std::move(slopes)), form_(form) {
  if (slopes_.empty()) throw Error("AlibiParams", "slopes.size()", "0", ">= 1 (one slope per head)");
  for (std::size_t h = 0; h < slopes_.size(); ++h)
    check_finite_nonnegative("AlibiParams", "slopes", h, slopes_[h], false);
}

AlibiParams AlibiParams::on_heads(std::int64_t heads, std::span<const std::int64_t> alibi_heads, AlibiForm form,
                                  double max_bias) {
  check_heads("AlibiParams::on_heads", heads);
  if (alibi_heads.empty()) throw Error("AlibiParams::on_heads", "alibi_heads.size()", "0", ">= 1");
  const std::vector<double> paper = alibi_slopes(static_cast<std::int64_t>(alibi_heads.size()), max_bias);
  std::vector<double> slopes(static_cast<std::size_t>(heads), 0.0);
  std::vector<bool> seen(static_cast<std::size_t>(heads), false);
  for (std::size_t k = 0; k < alibi_heads.size(); ++k) {
    const std::int64_t h = alibi_heads[k];
    if (h < 0 || h >= heads || seen[static_cast<std::size_t>(h)]) {
      throw Error("AlibiParams::on_heads", "alibi_heads[" + std::to_string(k) + "]", std::to_string(h),
                  "a head in [0, " + std::to_string(heads) + ") listed once");
    }
    seen[static_cast<std::size_t>(h)] = true;
    slopes[static_cast<std::size_t>(h)] = paper[k];
  }
  return AlibiParams(std::move(slopes), form);
}

namespace {
void check_t5(const char* where, std::int64_t num_buckets, std::int64_t max_distance, bool bidirectional) {
  const std::int64_t n = bidirectional ? num_buckets / 2 : num_buckets;
  if (num_buckets < 2 || n / 2 < 1) {
    throw Error(where, "num_buckets", std::to_string(num_buckets),
                bidirectional ? ">= 4 for bidirectional buckets (max_exact = num_buckets / 4 >= 1)"
                              : ">= 2 (max_exact = num_buckets / 2 >= 1)");
  }
  if (max_distance <= n / 2) {
    throw Error(
        where, "max_distance", std::to_string(max_distance),
        "> max_exact = " + std::to_string(n / 2) + " (the log formula divides by log(max_distance / max_exact))");
  }
}
}  // namespace

namespace {
// −r, except that −(−2^63), which int64 cannot hold, becomes 2^63 − 1: the same (last) bucket.
std::int64_t negate(std::int64_t r) {
  return r == std::numeric_limits<std::int64_t>::min() ? std::numeric_limits<std::int64_t>::max() : -r;
}
}  // namespace

std::int64_t t5_bucket(std::int64_t relative_position, std::int64_t num_buckets, std::int64_t max_distance,
                       bool bidirectional) {
  check_t5("t5_bucket", num_buckets, max_distance, bidirectional);
  std::int64_t n = num_buckets, offset = 0, distance;
  if (bidirectional) {
    n /= 2;
    offset = relative_position > 0 ? n : 0;
    distance = relative_position < 0 ? negate(relative_position) : relative_position;
  } else {
    distance = relative_position < 0 ? negate(relative_position) : 0;
  }
  const std::int64_t max_exact = n / 2;
  if (distance < max_exact) return offset + distance;
  // The float32 steps of transformers' formula in PyTorch, one rounding each (tests/data has
  // PyTorch's buckets for every |r| <= 2^20 of the common settings, and they agree bit for bit):
  // distance.float() / max_exact, log, / f32(math.log(max_distance / max_exact)), · (n − max_exact),
  // then truncation to int64.
  const float ratio = static_cast<float>(distance) / static_cast<float>(max_exact);
  const auto log_range =
      static_cast<float>(std::log(static_cast<double>(max_distance) / static_cast<double>(max_exact)));
  const float scaled = std::log(ratio) / log_range * static_cast<float>(n - max_exact);
  // Past the last bucket (and before a float too large for int64 is truncated).
  if (!(scaled < static_cast<float>(n - max_exact))) return offset + n - 1;
  const std::int64_t large = max_exact + static_cast<std::int64_t>(scaled);
  return offset + std::min(large, n - 1);
}

T5BiasParams::T5BiasParams(std::int64_t heads, std::int64_t num_buckets, std::int64_t max_distance, bool bidirectional,
                           std::vector<double> table)
    : heads_(heads),
      num_buckets_(num_buckets),
      max_distance_(max_distance),
      bidirectional_(bidirectional),
      table_(std::move(table)) {
  check_heads("T5BiasParams", heads);
  check_t5("T5BiasParams", num_buckets, max_distance, bidirectional);
  const std::size_t size = detail::table_count("T5BiasParams", "num_buckets · heads", {num_buckets, heads});
  if (table_.empty()) table_.assign(size, 0.0);
  detail::check_parameter("T5BiasParams", "table", table_, size,
                          "num_buckets · heads = " + std::to_string(size) + " ([num_buckets, heads] row-major)");
}

KerpleParams::KerpleParams(KerpleForm form, std::vector<double> r1, std::vector<double> r2)
    : form_(form), r1_(std::move(r1)), r2_(std::move(r2)) {
  if (r1_.empty()) throw Error("KerpleParams", "r1.size()", "0", ">= 1 (one per head)");
  if (r2_.size() != r1_.size()) {
    throw Error("KerpleParams", "r2.size()", std::to_string(r2_.size()), "r1.size() = " + std::to_string(r1_.size()));
  }
  for (std::size_t h = 0; h < r1_.size(); ++h) {
    check_finite_nonnegative("KerpleParams", "r1", h, r1_[h], true);
    check_finite_nonnegative("KerpleParams", "r2", h, r2_[h], true);
    if (form_ == KerpleForm::kPower && r2_[h] > 2) {
      throw Error("KerpleParams", "r2[" + std::to_string(h) + "]", detail::to_text(r2_[h]),
                  "in (0, 2] for the power form");
    }
  }
}

// ------------------------------------------------------------------------------ RelativeBias

double AlibiParams::value(std::int64_t head, std::int64_t r) const {
  return slopes_[static_cast<std::size_t>(head)] * detail::alibi_derivative(form_, r);
}
void AlibiParams::accumulate_gradient(std::int64_t head, std::int64_t r, double weight, std::span<double> grads) const {
  grads[static_cast<std::size_t>(head)] += weight * detail::alibi_derivative(form_, r);
}

void AlibiParams::tabulate(std::int64_t r_first, std::int64_t count, double* out) const {
  for (std::int64_t h = 0; h < heads(); ++h) {
    const double slope = slopes_[static_cast<std::size_t>(h)];
    double* row = out + h * count;
    for (std::int64_t t = 0; t < count; ++t) row[t] = slope * detail::alibi_derivative(form_, r_first + t);
  }
}

void T5BiasParams::tabulate(std::int64_t r_first, std::int64_t count, double* out) const {
  for (std::int64_t t = 0; t < count; ++t) {
    const double* row = table_.data() + bucket(r_first + t) * heads_;
    for (std::int64_t h = 0; h < heads_; ++h) out[h * count + t] = row[h];
  }
}

double T5BiasParams::value(std::int64_t head, std::int64_t r) const {
  return table_[static_cast<std::size_t>(bucket(r) * heads_ + head)];
}
void T5BiasParams::accumulate_gradient(std::int64_t head, std::int64_t r, double weight,
                                       std::span<double> grads) const {
  grads[static_cast<std::size_t>(bucket(r) * heads_ + head)] += weight;
}

double KerpleParams::value(std::int64_t head, std::int64_t r) const {
  const double distance = std::fabs(static_cast<double>(r));
  const double r1 = r1_[static_cast<std::size_t>(head)], r2 = r2_[static_cast<std::size_t>(head)];
  return form_ == KerpleForm::kLog ? -r1 * std::log1p(r2 * distance) : -r1 * std::pow(distance, r2);
}
std::vector<double> KerpleParams::parameters() const {
  std::vector<double> all = r1_;
  all.insert(all.end(), r2_.begin(), r2_.end());
  return all;
}
void KerpleParams::accumulate_gradient(std::int64_t head, std::int64_t r, double weight,
                                       std::span<double> grads) const {
  double d1 = 0, d2 = 0;
  detail::kerple_derivatives(*this, head, r, &d1, &d2);
  grads[static_cast<std::size_t>(head)] += weight * d1;
  grads[static_cast<std::size_t>(heads() + head)] += weight * d2;
}

BiasScheme::BiasScheme(RelativeBiasRef scheme) : relative_(std::move(scheme)) {
  if (!relative_) throw Error("BiasScheme", "RelativeBiasRef", "null", "a scheme object");
}

BiasScheme::BiasScheme(PositionBiasRef scheme) : position_(std::move(scheme)) {
  if (!position_) throw Error("BiasScheme", "PositionBiasRef", "null", "a scheme object");
}

std::int64_t BiasScheme::heads() const {
  if (relative_) return relative_->heads();
  return position_ ? position_->heads() : heads_;
}

const RelativeBias* relative_bias(const BiasScheme& scheme) { return scheme.relative(); }

const PositionBias* position_bias(const BiasScheme& scheme) { return scheme.position(); }

std::int64_t bias_heads(const BiasScheme& scheme) { return scheme.heads(); }

std::int64_t bias_parameter_count(const BiasScheme& scheme) {
  if (const PositionBias* pb = scheme.position()) return pb->parameter_count();
  return scheme.relative() ? scheme.relative()->parameter_count() : 0;
}

namespace {
double signed_bias_value(const BiasScheme& scheme, std::size_t h, std::int64_t r);
}  // namespace

namespace {
void check_head(const BiasScheme& scheme, std::int64_t head) {
  const std::int64_t heads = bias_heads(scheme);
  if (head < 0 || head >= heads) {
    throw Error("bias_value", "head", std::to_string(head), "in [0, " + std::to_string(heads) + ")");
  }
}
}  // namespace

double bias_value(const BiasScheme& scheme, std::int64_t head, std::int64_t r) {
  check_head(scheme, head);
  if (const PositionBias* pb = position_bias(scheme)) {
    std::string name(pb->scheme_name());  // shown as the papers write it: FIRE, TUPE
    std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::toupper(c); });
    throw Error("bias_value", "scheme", name,
                "a scheme of the relative position only (this one needs the positions: "
                "bias_value(scheme, head, q_position, k_position))");
  }
  return signed_bias_value(scheme, static_cast<std::size_t>(head), r) + 0.0;  // + 0.0: no −0 at r = 0
}

double bias_value(const BiasScheme& scheme, std::int64_t head, std::int64_t q_position, std::int64_t k_position) {
  check_head(scheme, head);
  if (const PositionBias* pb = position_bias(scheme)) return pb->value(head, q_position, k_position) + 0.0;
  return signed_bias_value(scheme, static_cast<std::size_t>(head), k_position - q_position) + 0.0;
}

namespace {
double signed_bias_value(const BiasScheme& scheme, std::size_t h, std::int64_t r) {
  const RelativeBias* rb = relative_bias(scheme);
  return rb == nullptr ? 0.0 : rb->value(static_cast<std::int64_t>(h), r);  // NoPE: 0
}
}  // namespace

// ------------------------------------------------------------------------------ evaluator

BiasEvaluator::BiasEvaluator(const BiasScheme& scheme, std::int64_t min_relative, std::int64_t max_relative)
    : scheme_(scheme), heads_(bias_heads(scheme)), zero_(scheme.is_none()) {
  if (max_relative < min_relative) {
    throw Error("BiasEvaluator", "max_relative", std::to_string(max_relative),
                ">= min_relative = " + std::to_string(min_relative));
  }
  const std::int64_t width = max_relative - min_relative + 1;
  // Nothing to tabulate (NoPE), not a function of k − q alone, or too wide.
  if (zero_ || position_bias(scheme) != nullptr || width > kMaxTableEntries / heads_) {
    return;
  }
  min_relative_ = min_relative;
  width_ = width;
  table_.resize(static_cast<std::size_t>(heads_ * width_));
  detail::tabulate_f32(*relative_bias(scheme_), min_relative_, width_, table_.data(), false);
}

BiasEvaluator BiasEvaluator::for_positions(const BiasScheme& scheme, const Positions& q_positions,
                                           const Positions& k_positions, std::int64_t batch, std::int64_t q_len,
                                           std::int64_t k_len) {
  if (q_len < 1 || k_len < 1 || batch < 1) return BiasEvaluator(scheme, 0, 0);
  q_positions.check_grid("BiasEvaluator", batch, q_len);
  k_positions.check_grid("BiasEvaluator", batch, k_len);
  const auto [q_lo, q_hi] = position_bounds(q_positions, batch, q_len);
  const auto [k_lo, k_hi] = position_bounds(k_positions, batch, k_len);
  return BiasEvaluator(scheme, k_lo - q_hi, k_hi - q_lo);
}

float BiasEvaluator::direct(std::int64_t head, std::int64_t q_position, std::int64_t k_position) const {
  return static_cast<float>(bias_value(scheme_, head, q_position, k_position));
}

float BiasEvaluator::operator()(std::int64_t head, std::int64_t q_position, std::int64_t k_position) const {
  if (zero_) return 0.0f;
  const std::int64_t t = k_position - q_position - min_relative_;
  if (t >= 0 && t < width_) return table_[static_cast<std::size_t>(head * width_ + t)];
  return direct(head, q_position, k_position);
}

const float* BiasEvaluator::table_row(std::int64_t head, std::int64_t q_position, std::int64_t k_first,
                                      std::int64_t count) const {
  const std::int64_t t0 = k_first - q_position - min_relative_;
  if (zero_ || t0 < 0 || t0 + count > width_) return nullptr;
  return table_.data() + head * width_ + t0;
}

void BiasEvaluator::fill_row(std::int64_t head, std::int64_t q_position, std::int64_t k_first, std::int64_t count,
                             float* out) const {
  if (zero_) {
    std::fill(out, out + count, 0.0f);
    return;
  }
  if (const float* row = table_row(head, q_position, k_first, count)) {
    kernels::copy_row_f32(row, out, count, false);
    return;
  }
  for (std::int64_t t = 0; t < count; ++t) out[t] = (*this)(head, q_position, k_first + t);
}

void BiasEvaluator::add_row(std::int64_t head, std::int64_t q_position, std::int64_t k_first, std::int64_t count,
                            float* scores) const {
  if (zero_) return;
  if (const float* row = table_row(head, q_position, k_first, count)) {
    kernels::add_rows_f32(scores, row, scores, count);
    return;
  }
  for (std::int64_t t = 0; t < count; ++t) scores[t] += (*this)(head, q_position, k_first + t);
}

// ------------------------------------------------------------------------------ checks

namespace detail {

void tabulate_f32(const RelativeBias& bias, std::int64_t r_first, std::int64_t count, float* out, bool reversed) {
  const std::int64_t heads = bias.heads();
  if (heads < 1 || count < 1) return;  // nothing to tabulate
  // Slices start at r_first + 64·m, as RelativeBias::tabulate promises (scheme.hpp), so a scheme
  // that restarts every 64 r (Sandwich) gives the bits of one call, on any number of threads.
  const std::int64_t slice = std::min(count, std::max<std::int64_t>(1, kTabulateSliceEntries / heads / 64) * 64);
  const std::int64_t slices = (count + slice - 1) / slice;
  const auto tabulate = [&](std::int64_t m, std::vector<double>& rows) {
    const std::int64_t t0 = m * slice, n = std::min(slice, count - t0);
    rows.resize(static_cast<std::size_t>(heads * slice));
    bias.tabulate(r_first + t0, n, rows.data());
    for (std::int64_t h = 0; h < heads; ++h) {
      float* row = out + h * count;
      for (std::int64_t t = 0; t < n; ++t) {
        // + 0.0: no −0 at r = 0, as bias_value
        const float v = static_cast<float>(rows[static_cast<std::size_t>(h * n + t)] + 0.0);
        row[reversed ? count - 1 - (t0 + t) : t0 + t] = v;
      }
    }
  };
  // A scheme's own tabulate may throw: after a failure on the threads, the slices run again in
  // order, so that the error is the first slice's whatever the thread count.
  ParallelErrors errors;
#pragma omp parallel num_threads(static_cast <int>(std::min <std::int64_t>(threads_for(count * heads * 4), slices)))
  {
    std::vector<double> rows;
#pragma omp for schedule(static)
    for (std::int64_t m = 0; m < slices; ++m) errors.run([&] { tabulate(m, rows); });
  }
  try {
    errors.rethrow();
  } catch (...) {
    std::vector<double> rows;
    for (std::int64_t m = 0; m < slices; ++m) tabulate(m, rows);
    throw;
  }
}

ScoreGrid check_scores(const char* where, const char* name, ConstTensorView scores, std::int64_t heads,
                       const Positions& q_positions, const Positions& k_positions) {
  ScoreGrid g;
  const int rank = scores.rank();
  if (rank != 3 && rank != 4) {
    throw Error(where, std::string(name) + " rank", std::to_string(rank), "4 ([B, H, Sq, Sk]) or 3 ([H, Sq, Sk])");
  }
  const int o = rank - 3;
  g.batch = rank == 4 ? scores.size(0) : 1;
  g.batch_stride = rank == 4 ? scores.stride(0) : 0;
  g.heads = scores.size(o);
  g.head_stride = scores.stride(o);
  g.q_len = scores.size(o + 1);
  g.q_stride = scores.stride(o + 1);
  g.k_len = scores.size(o + 2);
  g.k_stride = scores.stride(o + 2);
  if (g.heads != heads) {
    throw Error(where, std::string(name) + ".size(" + std::to_string(o) + ")", std::to_string(g.heads),
                "the scheme's heads = " + std::to_string(heads));
  }
  if (g.batch > 0 && g.q_len > 0) q_positions.check_grid(where, g.batch, g.q_len);
  if (g.batch > 0 && g.k_len > 0) k_positions.check_grid(where, g.batch, g.k_len);
  return g;
}

std::vector<std::int64_t> row_positions(const Positions& positions, std::int64_t b, std::int64_t len) {
  std::vector<std::int64_t> ids(static_cast<std::size_t>(len));
  for (std::int64_t s = 0; s < len; ++s) ids[static_cast<std::size_t>(s)] = positions.at(b, s);
  return ids;
}

void kerple_derivatives(const KerpleParams& params, std::int64_t head, std::int64_t r, double* d_r1, double* d_r2) {
  const auto h = static_cast<std::size_t>(head);
  const double r1 = params.r1()[h], r2 = params.r2()[h];
  const double d = std::fabs(static_cast<double>(r));
  if (params.form() == KerpleForm::kLog) {
    *d_r1 = -std::log1p(r2 * d);
    *d_r2 = -r1 * d / (1 + r2 * d);
  } else {
    const double power = std::pow(d, r2);
    *d_r1 = -power;
    *d_r2 = d > 0 ? -r1 * power * std::log(d) : 0.0;
  }
}

}  // namespace detail

// ------------------------------------------------------------------------------ materialise

void bias_materialize(const BiasScheme& scheme, const Positions& q_positions, const Positions& k_positions,
                      TensorView out) {
  detail::init_dispatch();
  const detail::ScoreGrid g = detail::check_scores("bias_materialize", "out", ConstTensorView(out), bias_heads(scheme),
                                                   q_positions, k_positions);
  detail::check_writable("bias_materialize", "out", ConstTensorView(out));
  const PositionBias* pb = position_bias(scheme);
  if (pb != nullptr && g.q_len * g.k_len > 0) pb->check_positions("bias_materialize", q_positions, k_positions);
  if (detail::use_reference() || out.dtype() == DType::kF64) {
    ref::bias_materialize(scheme, q_positions, k_positions, out);
    return;
  }
  if (g.batch * g.heads * g.q_len * g.k_len == 0) return;
  if (pb != nullptr) {
    pb->materialize(q_positions, k_positions, out);
    return;
  }
  const BiasEvaluator eval = BiasEvaluator::for_positions(scheme, q_positions, k_positions, g.batch, g.q_len, g.k_len);
  const bool f32_rows = out.dtype() == DType::kF32 && g.k_stride == 1;
  const bool stream = f32_rows && g.batch * g.heads * g.q_len * g.k_len * 4 >= kStreamBytes;
  const std::int64_t rows = g.batch * g.heads * g.q_len;
  const int threads = detail::threads_for(rows * g.k_len);
  detail::ParallelErrors errors;  // a scheme's own value() may throw
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> row(static_cast<std::size_t>(f32_rows ? 0 : g.k_len));
    std::vector<float> zeros(static_cast<std::size_t>(scheme.is_none() ? g.k_len : 0), 0.0f);
    std::int64_t cached_b = -1;
    std::vector<std::int64_t> keys;
    bool keys_consecutive = false;
#pragma omp for schedule(static)
    for (std::int64_t r = 0; r < rows; ++r)
      errors.run([&] {
        const std::int64_t b = r / (g.heads * g.q_len), h = (r / g.q_len) % g.heads, i = r % g.q_len;
        if (b != cached_b) {
          keys = detail::row_positions(k_positions, b, g.k_len);
          keys_consecutive = consecutive(keys);
          cached_b = b;
        }
        const std::int64_t q = q_positions.at(b, i);
        const std::int64_t offset = g.offset(b, h, i);
        float* dst = f32_rows ? static_cast<float*>(out.data()) + offset : row.data();
        if (!zeros.empty()) {
          kernels::copy_row_f32(zeros.data(), dst, g.k_len, stream);  // NoPE
        } else if (const float* src = keys_consecutive ? eval.table_row(h, q, keys[0], g.k_len) : nullptr) {
          kernels::copy_row_f32(src, dst, g.k_len, stream);  // straight from the table
        } else if (keys_consecutive) {
          eval.fill_row(h, q, keys[0], g.k_len, dst);
        } else {
          for (std::int64_t j = 0; j < g.k_len; ++j) dst[j] = eval(h, q, keys[static_cast<std::size_t>(j)]);
        }
        if (!f32_rows) {
          for (std::int64_t j = 0; j < g.k_len; ++j) {
            detail::store(out.data(), out.dtype(), offset + j * g.k_stride, row[static_cast<std::size_t>(j)]);
          }
        }
      });
    if (stream) kernels::flush_streams();
  }
  errors.rethrow();
}

// ------------------------------------------------------------------------------ backward

namespace {

// Per head h, calls grad(h, r, sum) with sum = Σ d_scores[b, h, i, j] over the pairs with
// k_pos − q_pos = r, for every r met (in increasing r), or per element (r, d_scores) when the
// range is too wide to histogram. Heads are split over threads, each head's sums over b, i, j in
// order. grad_per_head: grad touches only head h's gradients (RelativeBias::gradients_per_head) and
// runs on the head's thread; otherwise (a scheme whose parameters its heads may share) it runs in one
// thread, heads and then r ascending, after the sums of each block of heads. Either way the
// results do not depend on the thread count.
template <class Grad>
void reduce_by_relative_position(const char* where, std::int64_t heads, const Positions& q_positions,
                                 const Positions& k_positions, ConstTensorView d_scores, bool grad_per_head,
                                 Grad grad) {
  const detail::ScoreGrid g = detail::check_scores(where, "d_scores", d_scores, heads, q_positions, k_positions);
  if (g.batch * g.heads * g.q_len * g.k_len == 0) return;
  const auto [q_lo, q_hi] = position_bounds(q_positions, g.batch, g.q_len);
  const auto [k_lo, k_hi] = position_bounds(k_positions, g.batch, g.k_len);
  const std::int64_t min_r = k_lo - q_hi, width = k_hi - q_lo - min_r + 1;
  const int threads =
      static_cast<int>(std::min<std::int64_t>(detail::threads_for(g.batch * g.heads * g.q_len * g.k_len), g.heads));
  const bool histogram = width <= kMaxTableEntries / std::max(threads, 1);
  std::vector<std::vector<std::int64_t>> keys(static_cast<std::size_t>(g.batch));
  std::vector<bool> keys_consecutive(static_cast<std::size_t>(g.batch));
  for (std::int64_t b = 0; b < g.batch; ++b) {
    keys[static_cast<std::size_t>(b)] = detail::row_positions(k_positions, b, g.k_len);
    keys_consecutive[static_cast<std::size_t>(b)] = consecutive(keys[static_cast<std::size_t>(b)]);
  }
  const bool f32_rows = d_scores.dtype() == DType::kF32 && g.k_stride == 1;
  // Head h's sums by r − min_r (histogram), or grad per element.
  const auto head_sums = [&](std::int64_t h, std::vector<double>& sums) {
    std::fill(sums.begin(), sums.end(), 0.0);
    for (std::int64_t b = 0; b < g.batch; ++b) {
      const auto& ks = keys[static_cast<std::size_t>(b)];
      const bool fast = histogram && f32_rows && keys_consecutive[static_cast<std::size_t>(b)];
      for (std::int64_t i = 0; i < g.q_len; ++i) {
        const std::int64_t q = q_positions.at(b, i), offset = g.offset(b, h, i);
        if (fast) {
          // A block of queries at consecutive positions: summed along its diagonals.
          std::int64_t rows = 1;
          while (rows < kernels::kDiagonalRows && i + rows < g.q_len && q_positions.at(b, i + rows) == q + rows) ++rows;
          kernels::accumulate_diagonals_f64(static_cast<const float*>(d_scores.data()) + offset, g.q_stride, rows,
                                            g.k_len, sums.data() + (ks[0] - q - min_r));
          i += rows - 1;
          continue;
        }
        for (std::int64_t j = 0; j < g.k_len; ++j) {
          const double value = detail::load(d_scores.data(), d_scores.dtype(), offset + j * g.k_stride);
          const std::int64_t r = ks[static_cast<std::size_t>(j)] - q;
          if (histogram) {
            sums[static_cast<std::size_t>(r - min_r)] += value;
          } else {
            grad(h, r, value);
          }
        }
      }
    }
  };
  std::vector<std::vector<double>> block(static_cast<std::size_t>(threads),
                                         std::vector<double>(static_cast<std::size_t>(histogram ? width : 0)));
  const auto emit = [&](std::int64_t h, const std::vector<double>& sums) {
    for (std::int64_t r = 0; r < static_cast<std::int64_t>(sums.size()); ++r) {
      if (sums[static_cast<std::size_t>(r)] != 0.0) grad(h, min_r + r, sums[static_cast<std::size_t>(r)]);
    }
  };
  if (grad_per_head) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (std::int64_t h = 0; h < g.heads; ++h) {
      std::vector<double>& sums = block[static_cast<std::size_t>(omp_get_thread_num())];
      head_sums(h, sums);
      emit(h, sums);
    }
    return;
  }
  if (!histogram) {  // scattered positions too far apart: per element, in one thread
    for (std::int64_t h = 0; h < g.heads; ++h) head_sums(h, block[0]);
    return;
  }
  for (std::int64_t h0 = 0; h0 < g.heads; h0 += threads) {
    const std::int64_t n = std::min<std::int64_t>(threads, g.heads - h0);
#pragma omp parallel for schedule(static) num_threads(static_cast <int>(n))
    for (std::int64_t t = 0; t < n; ++t) head_sums(h0 + t, block[static_cast<std::size_t>(t)]);
    for (std::int64_t t = 0; t < n; ++t) emit(h0 + t, block[static_cast<std::size_t>(t)]);
  }
}

// grads += Σ d_scores·∂b/∂θ of a RelativeBias, through its own derivative (`where` names the caller).
void reduce_relative_bias(const char* where, const RelativeBias& scheme, const Positions& q_positions,
                          const Positions& k_positions, ConstTensorView d_scores, std::span<double> grads,
                          bool grad_per_head) {
  reduce_by_relative_position(
      where, scheme.heads(), q_positions, k_positions, d_scores, grad_per_head,
      [&](std::int64_t h, std::int64_t r, double sum) { scheme.accumulate_gradient(h, r, sum, grads); });
}

}  // namespace

void alibi_backward(const AlibiParams& params, const Positions& q_positions, const Positions& k_positions,
                    ConstTensorView d_scores, std::span<double> d_slopes) {
  detail::init_dispatch();
  detail::check_gradient_size("alibi_backward", "d_slopes", d_slopes.size(), params.heads());
  if (detail::use_reference()) {
    ref::alibi_backward(params, q_positions, k_positions, d_scores, d_slopes);
    return;
  }
  reduce_relative_bias("alibi_backward", params, q_positions, k_positions, d_scores, d_slopes, true);
}

void t5_bias_backward(const T5BiasParams& params, const Positions& q_positions, const Positions& k_positions,
                      ConstTensorView d_scores, std::span<double> d_table) {
  detail::init_dispatch();
  detail::check_gradient_size("t5_bias_backward", "d_table", d_table.size(), params.num_buckets() * params.heads());
  if (detail::use_reference()) {
    ref::t5_bias_backward(params, q_positions, k_positions, d_scores, d_table);
    return;
  }
  reduce_relative_bias("t5_bias_backward", params, q_positions, k_positions, d_scores, d_table, true);
}

void relative_bias_backward(const RelativeBias& scheme, const Positions& q_positions, const Positions& k_positions,
                            ConstTensorView d_scores, std::span<double> d_params) {
  detail::init_dispatch();
  detail::check_gradient_size("relative_bias_backward", "d_params", d_params.size(), scheme.parameter_count());
  if (detail::use_reference()) {
    ref::relative_bias_backward(scheme, q_positions, k_positions, d_scores, d_params);
    return;
  }
  reduce_relative_bias("relative_bias_backward", scheme, q_positions, k_positions, d_scores, d_params,
                       scheme.gradients_per_head());
}

void bias_backward(const BiasScheme& scheme, const Positions& q_positions, const Positions& k_positions,
                   ConstTensorView d_scores, std::span<double> d_params) {
  detail::check_gradient_size("bias_backward", "d_params", d_params.size(), bias_parameter_count(scheme));
  if (const PositionBias* pb = position_bias(scheme)) {
    pb->backward(q_positions, k_positions, d_scores, d_params);
  } else if (const RelativeBias* relative = relative_bias(scheme)) {
    relative_bias_backward(*relative, q_positions, k_positions, d_scores, d_params);
  }
}

void kerple_backward(const KerpleParams& params, const Positions& q_positions, const Positions& k_positions,
                     ConstTensorView d_scores, std::span<double> d_r1, std::span<double> d_r2) {
  detail::init_dispatch();
  detail::check_gradient_size("kerple_backward", "d_r1", d_r1.size(), params.heads());
  detail::check_gradient_size("kerple_backward", "d_r2", d_r2.size(), params.heads());
  if (detail::use_reference()) {
    ref::kerple_backward(params, q_positions, k_positions, d_scores, d_r1, d_r2);
    return;
  }
  reduce_by_relative_position("kerple_backward", params.heads(), q_positions, k_positions, d_scores, true,
                              [&](std::int64_t h, std::int64_t r, double sum) {
                                double g1 = 0, g2 = 0;
                                detail::kerple_derivatives(params, h, r, &g1, &g2);
                                d_r1[static_cast<std::size_t>(h)] += sum * g1;
                                d_r2[static_cast<std::size_t>(h)] += sum * g2;
                              });
}

}  // namespace posenc
