// The BiasScheme alternatives that are score terms rather than tables (FIRE, TUPE), in the
// engine's order: the one place that names them for the engine (score_term.hpp, BuiltinTerm). A
// new scheme is an AttentionTerm (term.hpp) or a RelativeBias (scheme.hpp) instead, and needs no
// line here.
#include <array>
#include <memory>
#include <span>
#include <vector>

#include "attention/score_term.hpp"

namespace posenc::detail {

std::unique_ptr<ScoreTerm> make_fire_term(const AttentionPlan& p, const std::vector<HeadGroup>& groups);
std::unique_ptr<ScoreTerm> make_tupe_term(const AttentionPlan& p, const std::vector<HeadGroup>& groups);

std::span<const BuiltinTerm> builtin_terms() {
  // Their gradients are GroupGradients::bias (bias_parameter_count sizes them).
  static constexpr std::array<BuiltinTerm, 2> kTerms = {{{make_fire_term}, {make_tupe_term}}};
  return kTerms;
}

}  // namespace posenc::detail
