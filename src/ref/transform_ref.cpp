// A QKTransformScheme (posenc/scheme.hpp) as the fp64 attention reference applies it: its
// definition, row by row, independent of the tables the fused attention makes of it; and the
// interface's defaults.
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "internal.hpp"
#include "posenc/error.hpp"
#include "posenc/scheme.hpp"
#include "transforms_ref.hpp"

namespace posenc {

double QKTransformScheme::angle(std::int64_t /* position */, std::int64_t /* pair */) const {
  throw Error("QKTransformScheme::angle", "scheme", scheme_name(), "a rotation (form() kRotation) that defines it");
}

void QKTransformScheme::addition(std::int64_t /* position */, std::span<double> /* row */) const {
  throw Error("QKTransformScheme::addition", "scheme", scheme_name(), "an addition (form() kAddition) that defines it");
}

namespace ref {
namespace {

constexpr const char* kWhere = "attention_reference";

std::string at(const QKTransformScheme& t, const char* method, std::int64_t position, std::int64_t index) {
  return "transform (" + std::string(t.scheme_name()) + ")." + method + "(" + std::to_string(position) + ", " +
         std::to_string(index) + ")";
}

}  // namespace

// Queries: s·R(θ); keys: R(θ)/s; the transpose (the gradient's way back) turns by −θ with the same
// factor. An addition adds its row (its transpose is the identity).
void apply_transform(const QKTransformRef& transform, const TransformedRows& rows) {
  if (!transform) throw Error(kWhere, "transform", "null", "a QKTransformScheme");
  const QKTransformScheme& t = *transform;
  const std::int64_t d = rows.d;
  if (t.head_dim() != d) {
    throw Error(kWhere, "transform (" + std::string(t.scheme_name()) + ").head_dim()", std::to_string(t.head_dim()),
                "the head_dim of q, " + std::to_string(d));
  }
  const auto n = rows.n;
  if (t.form() == QKTransformScheme::Form::kAddition) {
    if (rows.transpose) return;
    std::vector<double> added(static_cast<std::size_t>(d));
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int64_t p = rows.positions.at(0, i);
      added.assign(added.size(), 0.0);
      t.addition(p, added);
      for (std::int64_t j = 0; j < d; ++j) {
        const double v = added[static_cast<std::size_t>(j)];
        if (!std::isfinite(v)) throw Error(kWhere, at(t, "addition", p, j), detail::to_text(v), "finite");
        rows.v[static_cast<std::size_t>(i * d + j)] += v;
      }
    }
    return;
  }
  const std::int64_t pairs = t.rotary_pairs(), o = t.rotary_offset();
  if (t.form() != QKTransformScheme::Form::kRotation || o < 0 || pairs < 1 || o + 2 * pairs > d) {
    throw Error(kWhere, "transform (" + std::string(t.scheme_name()) + ")",
                "rotary_offset " + std::to_string(o) + ", rotary_pairs " + std::to_string(pairs),
                "a rotation of pairs within head_dim = " + std::to_string(d) + ", or an addition");
  }
  const bool interleaved = t.interleaved();
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t p = rows.positions.at(0, i);
    double* row = rows.v.data() + i * d;
    for (std::int64_t k = 0; k < pairs; ++k) {
      const double theta = t.angle(p, k);
      if (!std::isfinite(theta)) throw Error(kWhere, at(t, "angle", p, k), detail::to_text(theta), "finite");
      double s = 1.0;
      if (t.scaled()) {
        s = t.scale(p, k);
        if (!(std::isfinite(s) && s > 0))
          throw Error(kWhere, at(t, "scale", p, k), detail::to_text(s), "finite and > 0");
      }
      const double factor = rows.is_q ? s : 1.0 / s;
      const double c = std::cos(theta), sn = rows.transpose ? -std::sin(theta) : std::sin(theta);
      const std::int64_t first = interleaved ? o + 2 * k : o + k, second = interleaved ? first + 1 : first + pairs;
      const double a = row[first], b = row[second];
      row[first] = factor * (a * c - b * sn);
      row[second] = factor * (a * sn + b * c);
    }
  }
}

}  // namespace ref
}  // namespace posenc
