// The schemes a HeadGroup holds in fields or BiasScheme alternatives of their own (FIRE, TUPE,
// Shaw, Transformer-XL), in the engine's order: the one place that names them for the engine
// (score_term.hpp, BuiltinTerm). A new scheme is an AttentionTerm (term.hpp) or a RelativeBias
// (scheme.hpp) instead, and needs no line here.
#include <array>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "attention/score_term.hpp"

namespace posenc::detail {

std::unique_ptr<ScoreTerm> make_fire_term(const AttentionPlan& p, const std::vector<HeadGroup>& groups);
std::unique_ptr<ScoreTerm> make_tupe_term(const AttentionPlan& p, const std::vector<HeadGroup>& groups);
std::unique_ptr<ScoreTerm> make_shaw_term(const AttentionPlan& p, const std::vector<HeadGroup>& groups);
std::unique_ptr<ScoreTerm> make_xl_term(const AttentionPlan& p, const std::vector<HeadGroup>& groups);
void shaw_zero_gradients(const HeadGroup& group, GroupGradients& grads);
void shaw_check_gradients(const GroupGradients& given, const GroupGradients& like, const std::string& name);
void xl_zero_gradients(const HeadGroup& group, GroupGradients& grads);
void xl_check_gradients(const GroupGradients& given, const GroupGradients& like, const std::string& name);

std::span<const BuiltinTerm> builtin_terms() {
  // FIRE's and TUPE's gradients are GroupGradients::bias (bias_parameter_count sizes them).
  static constexpr std::array<BuiltinTerm, 4> kTerms = {{
      {make_fire_term, nullptr, nullptr},
      {make_tupe_term, nullptr, nullptr},
      {make_shaw_term, shaw_zero_gradients, shaw_check_gradients},
      {make_xl_term, xl_zero_gradients, xl_check_gradients},
  }};
  return kTerms;
}

}  // namespace posenc::detail
