// The positional parameters' gradients of the fused attention: their zeroed shapes, the checks of
// a caller's, and the units' flat sums turned into them (the relative biases through RelativeBias).
#include "attention/attention_plan.hpp"
#include "attention/score_term.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <string>
#include <variant>

#include "bias_checks.hpp"
#include "kernels/attention/attention_kernels.hpp"
#include "posenc/error.hpp"
#include "rotary_checks.hpp"

namespace posenc::detail {
namespace {

constexpr const char* kWhere = AttentionPlan::kWhere;

void require(bool ok, const char* param, const std::string& value, const std::string& expected) {
  if (!ok) throw Error(kWhere, param, value, expected);
}

}  // namespace

// ─── Positional gradients ────────────────────────────────────────────────────────────────────

AttentionGradients AttentionPlan::zero_gradients() const {
  AttentionGradients grads;
  const std::vector<HeadGroup> groups =
      spec.groups.empty() ? std::vector<HeadGroup>{HeadGroup{heads, {}, {}}} : spec.groups;
  for (const HeadGroup& grp : groups) {
    GroupGradients g;
    if (grp.bias) g.bias.assign(static_cast<std::size_t>(bias_parameter_count(*grp.bias)), 0.0);
    for (const AttentionTermRef& term : grp.terms)
      g.terms.emplace_back(static_cast<std::size_t>(term->gradient_size()), 0.0);
    if (grp.normaliser) g.normaliser.assign(static_cast<std::size_t>(grp.normaliser->gradient_size()), 0.0);
    grads.groups.push_back(std::move(g));
  }
  return grads;
}

void AttentionPlan::check_gradients(const AttentionGradients& grads) const {
  const AttentionGradients like = zero_gradients();
  require(grads.groups.size() == like.groups.size(), "grads.groups", "size " + std::to_string(grads.groups.size()),
          std::to_string(like.groups.size()) + " (one per head group; Attention::zero_gradients() makes them)");
  for (std::size_t g = 0; g < like.groups.size(); ++g) {
    const auto& a = grads.groups[g];
    const auto& b = like.groups[g];
    const std::string name = "grads.groups[" + std::to_string(g) + "]";
    check_gradient_size(kWhere, (name + ".bias").c_str(), a.bias.size(), static_cast<std::int64_t>(b.bias.size()));
    check_gradient_size(kWhere, (name + ".normaliser").c_str(), a.normaliser.size(),
                        static_cast<std::int64_t>(b.normaliser.size()));
    require(a.terms.size() == b.terms.size(), (name + ".terms").c_str(), "size " + std::to_string(a.terms.size()),
            std::to_string(b.terms.size()) + " (one per HeadGroup::terms entry)");
    for (std::size_t t = 0; t < b.terms.size(); ++t) {
      check_gradient_size(kWhere, (name + ".terms[" + std::to_string(t) + "]").c_str(), a.terms[t].size(),
                          static_cast<std::int64_t>(b.terms[t].size()));
    }
  }
}

std::int64_t AttentionPlan::bias_gradient_size() const { return grad_offset.back(); }

void AttentionPlan::add_bias_derivative(std::int64_t h, std::int64_t r, double sum, double* flat) const {
  const auto g = static_cast<std::size_t>(head_group[static_cast<std::size_t>(h)]);
  const std::int64_t local = h - group_first_head[g];
  const RelativeBias* relative = relative_bias(*spec.groups[g].bias);
  if (relative == nullptr) return;
  const std::span<double> at(flat + grad_offset[g], static_cast<std::size_t>(relative->parameter_count()));
  relative->accumulate_gradient(local, r, sum, at);
}

void AttentionPlan::accumulate_bias_gradients(const RowBlock& rb, std::int64_t keys, const std::int64_t* kpos,
                                              const float* dst, AttentionUnitScratch& s, std::int64_t kvh,
                                              double* unit_grads) const {
  for (std::int64_t r = 0; r < rb.width; ++r) {
    const std::int64_t h = rb.head[static_cast<std::size_t>(r)];
    if (h < 0) continue;
    const HeadBias& hb = head_bias[static_cast<std::size_t>(h)];
    if (hb.kind != HeadBias::kTable && hb.kind != HeadBias::kDirect) continue;
    const HeadGroup& grp = spec.groups[static_cast<std::size_t>(hb.group)];
    const std::int64_t qp = rb.position[static_cast<std::size_t>(r)];
    const RelativeBias* relative = relative_bias(*grp.bias);
    if (relative == nullptr || relative->parameter_count() == 0) continue;
    if (hist_width > 0) {
      double* hist = s.hist.data() + (h - kvh * group_size) * hist_width - delta_min;
      for (std::int64_t j = 0; j < keys; ++j) hist[qp - kpos[j]] += static_cast<double>(dst[j * rb.width + r]);
    } else {
      for (std::int64_t j = 0; j < keys; ++j) {
        add_bias_derivative(h, kpos[j] - qp, static_cast<double>(dst[j * rb.width + r]), unit_grads);
      }
    }
  }
}

void AttentionPlan::finish_bias_gradients(AttentionUnitScratch& s, std::int64_t kvh, double* unit_grads) const {
  if (hist_width == 0) return;
  for (std::int64_t g = 0; g < group_size; ++g) {
    const std::int64_t h = kvh * group_size + g;
    const HeadBias& hb = head_bias[static_cast<std::size_t>(h)];
    if (hb.kind != HeadBias::kTable && hb.kind != HeadBias::kDirect) continue;
    const double* hist = s.hist.data() + g * hist_width;
    for (std::int64_t t = 0; t < hist_width; ++t) {
      if (hist[t] != 0.0) add_bias_derivative(h, -(delta_min + t), hist[t], unit_grads);
    }
  }
}

void AttentionPlan::scatter_bias_gradients(const std::vector<double>& total, AttentionGradients& grads) const {
  for (std::size_t g = 0; g < spec.groups.size(); ++g) {
    const std::optional<BiasScheme>& bias = spec.groups[g].bias;
    if (!bias) continue;
    const double* at = total.data() + grad_offset[g];
    std::vector<double>& out = grads.groups[g].bias;
    if (relative_bias(*bias) != nullptr) {
      // A RelativeBias's θ: the flat sums are its gradient in its own (the registered) order.
      for (std::size_t t = 0; t < out.size(); ++t) out[t] += at[t];
    }
  }
}

}  // namespace posenc::detail
