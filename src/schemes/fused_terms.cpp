// The fused forms of attention terms and position biases for one call (score_term.hpp:
// fused_term, fused_bias): the library's hand-written form for the object's type (fused_terms.hpp),
// else the generic form of the definition. A type matches exactly: a class derived from one of
// these is a scheme of its own (it runs through the generic form of its own definition).
#include "schemes/fused_terms.hpp"

#include <map>
#include <typeindex>
#include <typeinfo>

#include "posenc/bias.hpp"
#include "posenc/forgetting.hpp"
#include "posenc/relative.hpp"
#include "posenc/sinks.hpp"
#include "posenc/term.hpp"

namespace posenc::detail {
namespace {

using Factory = std::unique_ptr<ScoreTerm> (*)(const AttentionTerm&, const AttentionPlan&, std::int64_t, std::int64_t);

using BiasFactory = std::unique_ptr<ScoreTerm> (*)(const PositionBias&, const AttentionPlan&, std::int64_t);

template <class Term>
std::unique_ptr<ScoreTerm> form_of(const AttentionTerm& term, const AttentionPlan& plan, std::int64_t group,
                                   std::int64_t index) {
  return fused_form(static_cast<const Term&>(term), plan, group, index);
}
template <class Bias>
std::unique_ptr<ScoreTerm> bias_form_of(const PositionBias& bias, const AttentionPlan& plan, std::int64_t group) {
  return fused_form(static_cast<const Bias&>(bias), plan, group);
}

}  // namespace

std::unique_ptr<ScoreTerm> fused_term(const AttentionTerm& term, const AttentionPlan& plan, std::int64_t group,
                                      std::int64_t index) {
  static const std::map<std::type_index, Factory> forms = {
      {typeid(AttentionSinks), &form_of<AttentionSinks>},
      {typeid(ForgetGate), &form_of<ForgetGate>},
      {typeid(ShawTerm), &form_of<ShawTerm>},
      {typeid(XlTerm), &form_of<XlTerm>},
  };
  const auto it = forms.find(typeid(term));
  return it == forms.end() ? generic_term(term, plan, group, index) : it->second(term, plan, group, index);
}

std::unique_ptr<ScoreTerm> fused_bias(const PositionBias& bias, const AttentionPlan& plan, std::int64_t group) {
  static const std::map<std::type_index, BiasFactory> forms = {
      {typeid(FireParams), &bias_form_of<FireParams>},
      {typeid(TupeParams), &bias_form_of<TupeParams>},
  };
  const auto it = forms.find(typeid(bias));
  return it == forms.end() ? generic_bias(bias, plan, group) : it->second(bias, plan, group);
}

}  // namespace posenc::detail
