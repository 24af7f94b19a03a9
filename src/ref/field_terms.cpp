// The HeadGroup fields that hold a scheme (Shaw, Transformer-XL), as the attention reference
// reads them: each field's definition and its gradients' place in GroupGradients.
#include "ref/field_terms.hpp"

#include <algorithm>
#include <array>
#include <initializer_list>

namespace posenc::ref {
namespace {

std::vector<double> joined(std::initializer_list<const std::vector<double>*> parts) {
  std::vector<double> out;
  for (const auto* part : parts) out.insert(out.end(), part->begin(), part->end());
  return out;
}

void split(std::span<const double> flat, std::initializer_list<std::vector<double>*> parts) {
  for (auto* part : parts) {
    std::copy(flat.begin(), flat.begin() + static_cast<std::ptrdiff_t>(part->size()), part->begin());
    flat = flat.subspan(part->size());
  }
}

constexpr FieldScheme kShaw{
    [](const HeadGroup& g) { return g.shaw ? shaw_definition(*g.shaw) : nullptr; },
    [](const GroupGradients& g) {
      return std::vector<std::size_t>{g.shaw_key_table.size(), g.shaw_value_table.size()};
    },
    [](const GroupGradients& g) {
      return joined({&g.shaw_key_table, &g.shaw_value_table});
    },
    [](std::span<const double> flat, GroupGradients& g) {
      split(flat, {&g.shaw_key_table, &g.shaw_value_table});
    },
};

constexpr FieldScheme kXl{
    [](const HeadGroup& g) { return g.xl ? xl_definition(*g.xl) : nullptr; },
    [](const GroupGradients& g) {
      return g.xl ? std::vector<std::size_t>{g.xl->u.size(), g.xl->v.size(), g.xl->w_r.size()}
                  : std::vector<std::size_t>{};
    },
    [](const GroupGradients& g) {
      return joined({&g.xl->u, &g.xl->v, &g.xl->w_r});
    },
    [](std::span<const double> flat, GroupGradients& g) {
      split(flat, {&g.xl->u, &g.xl->v, &g.xl->w_r});
    },
};

}  // namespace

std::span<const FieldScheme> field_schemes() {
  // The engine's order of these terms (src/schemes/builtin_terms.cpp).
  static constexpr std::array<FieldScheme, 2> kFields = {kShaw, kXl};
  return kFields;
}

}  // namespace posenc::ref
