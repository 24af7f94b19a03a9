// Sandwich (math, source and contract in posenc/sandwich.hpp) and its registry entry.
#include "posenc/sandwich.hpp"

#include <algorithm>
#include <cmath>
#include <string>

#include "internal.hpp"
#include "posenc/error.hpp"
#include "posenc/registry.hpp"

namespace posenc {

SandwichBias::SandwichBias(std::int64_t heads, std::int64_t dim, double base) : heads_(heads), dim_(dim), base_(base) {
  if (heads < 1) throw Error("SandwichBias", "heads", std::to_string(heads), ">= 1");
  // Each bias value sums dim/2 cosines: a model's width (128 to a few thousand), not millions.
  if (dim < 2 || dim % 2 != 0 || dim > 65536)
    throw Error("SandwichBias", "dim", std::to_string(dim), "even, in [2, 65536]");
  if (!std::isfinite(base) || base <= 1) throw Error("SandwichBias", "base", detail::to_text(base), "finite and > 1");
  frequencies_.resize(static_cast<std::size_t>(dim / 2));
  for (std::int64_t k = 0; k < dim / 2; ++k) {
    frequencies_[static_cast<std::size_t>(k)] =
        std::pow(base, -2.0 * static_cast<double>(k) / static_cast<double>(dim));
  }
}

double SandwichBias::head_factor(std::int64_t head) const {
  return static_cast<double>(heads_) / (8.0 * static_cast<double>(head + 1));
}

double SandwichBias::value(std::int64_t head, std::int64_t relative_position) const {
  const auto r = static_cast<double>(relative_position);
  double dot = 0;
  for (const double w : frequencies_) dot += std::cos(r * w);
  return (dot - static_cast<double>(dim_ / 2)) * head_factor(head);
}

void SandwichBias::tabulate(std::int64_t r_first, std::int64_t count, double* out) const {
  // p_i·p_j once per r (every head scales the same row), each frequency's cos and sin carried
  // from r to r + 1 by the rotation (cos ω, sin ω), restarted from libm every kRestart keys.
  constexpr std::int64_t kRestart = 64;
  const std::size_t n = frequencies_.size();
  std::vector<double> c(n), s(n), step_c(n), step_s(n), dots(static_cast<std::size_t>(count));
  for (std::size_t k = 0; k < n; ++k) {
    step_c[k] = std::cos(frequencies_[k]);
    step_s[k] = std::sin(frequencies_[k]);
  }
  for (std::int64_t t = 0; t < count; ++t) {
    if (t % kRestart == 0) {
      const auto r = static_cast<double>(r_first + t);
      for (std::size_t k = 0; k < n; ++k) {
        c[k] = std::cos(r * frequencies_[k]);
        s[k] = std::sin(r * frequencies_[k]);
      }
    } else {
      for (std::size_t k = 0; k < n; ++k) {
        const double next_c = c[k] * step_c[k] - s[k] * step_s[k];
        s[k] = s[k] * step_c[k] + c[k] * step_s[k];
        c[k] = next_c;
      }
    }
    double dot = 0;
    for (std::size_t k = 0; k < n; ++k) dot += c[k];
    dots[static_cast<std::size_t>(t)] = dot - static_cast<double>(dim_ / 2);
  }
  for (std::int64_t h = 0; h < heads_; ++h) {
    const double factor = head_factor(h);
    for (std::int64_t t = 0; t < count; ++t) out[h * count + t] = dots[static_cast<std::size_t>(t)] * factor;
  }
}

namespace scheme_entries {

SchemeEntry sandwich_entry() {
  return {
      .name = "sandwich",
      .family = "relative-bias",
      .summary = "b = (Σ_k cos(r·ω_k) − d'/2)·H/(8·(h + 1)), ω_k = base^(−2k/d'): parameter-free",
      .source = "Chi et al. 2023, Dissecting Transformer Length Extrapolation via the Lens of Receptive Field Analysis",
      .options = {size_option("dim", 128, "d', the width of the sinusoid whose dot product is the bias"),
                  {"base", 10000.0, "frequency base"}},
      .parameters = "",
      .parameter_shape = [](const SchemeArgs&) { return std::vector<std::int64_t>{}; },
      .make =
          [](const SchemeArgs& a) {
            HeadGroup g{a.heads, {}, {}};
            g.bias = RelativeBiasRef(std::make_shared<const SandwichBias>(a.heads, a.integer("dim"), a.number("base")));
            return g;
          }};
}

}  // namespace scheme_entries
}  // namespace posenc
