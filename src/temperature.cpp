// Position-dependent attention temperature (posenc/temperature.hpp).
#include "posenc/temperature.hpp"

#include <cmath>
#include <string>

#include "internal.hpp"
#include "posenc/error.hpp"

namespace posenc {

namespace {
constexpr const char* kWhere = "PositionTemperature";
}

PositionTemperature PositionTemperature::llama4(double floor_scale, double attn_scale) {
  using detail::to_text;
  if (!(std::isfinite(floor_scale) && floor_scale > 0)) {
    throw Error(kWhere, "floor_scale", to_text(floor_scale), "a finite number > 0");
  }
  // A negative scale would shrink the queries with the position, to 0 and past it (flipping the
  // attention) at long enough positions: no model does that.
  if (!(std::isfinite(attn_scale) && attn_scale >= 0)) {
    throw Error(kWhere, "attn_scale", to_text(attn_scale), "a finite number >= 0");
  }
  return PositionTemperature(Kind::kLlama4, floor_scale, attn_scale);
}

PositionTemperature PositionTemperature::mistral(double beta, std::int64_t original_max_position_embeddings) {
  if (!(std::isfinite(beta) && beta >= 0)) throw Error(kWhere, "beta", detail::to_text(beta), "a finite number >= 0");
  if (original_max_position_embeddings < 1) {
    throw Error(kWhere, "original_max_position_embeddings", std::to_string(original_max_position_embeddings), ">= 1");
  }
  return PositionTemperature(Kind::kMistral, static_cast<double>(original_max_position_embeddings), beta);
}

std::string_view PositionTemperature::name() const { return kind_ == Kind::kLlama4 ? "llama4" : "mistral"; }

double PositionTemperature::factor(std::int64_t position) const {
  if (position < 0) throw Error(kWhere, "position", std::to_string(position), ">= 0");
  if (kind_ == Kind::kLlama4) {
    return 1.0 + strength_ * std::log(std::floor((static_cast<double>(position) + 1.0) / length_) + 1.0);
  }
  const std::int64_t blocks = position / static_cast<std::int64_t>(length_);  // length_ is an integer >= 1
  return 1.0 + strength_ * std::log1p(static_cast<double>(blocks));
}

}  // namespace posenc
