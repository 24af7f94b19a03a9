// The library's hand-written fused forms of attention terms (term.hpp) and position biases
// (scheme.hpp), one overload per type, each defined beside its scheme; fused_terms.cpp finds them
// by the object's dynamic type. Internal.
#pragma once

#include <cstdint>
#include <memory>

#include "attention/score_term.hpp"

namespace posenc {
class AttentionSinks;
class ForgetGate;
class ShawTerm;
class XlTerm;
class FireParams;
class TupeParams;
}  // namespace posenc

namespace posenc::detail {

std::unique_ptr<ScoreTerm> fused_form(const AttentionSinks& sinks, const AttentionPlan& plan, std::int64_t group,
                                      std::int64_t index);
std::unique_ptr<ScoreTerm> fused_form(const ForgetGate& gate, const AttentionPlan& plan, std::int64_t group,
                                      std::int64_t index);
std::unique_ptr<ScoreTerm> fused_form(const ShawTerm& term, const AttentionPlan& plan, std::int64_t group,
                                      std::int64_t index);
std::unique_ptr<ScoreTerm> fused_form(const XlTerm& term, const AttentionPlan& plan, std::int64_t group,
                                      std::int64_t index);
// Position biases (scheme.hpp): the group's bias, its gradients into GroupGradients::bias.
std::unique_ptr<ScoreTerm> fused_form(const FireParams& fire, const AttentionPlan& plan, std::int64_t group);
std::unique_ptr<ScoreTerm> fused_form(const TupeParams& tupe, const AttentionPlan& plan, std::int64_t group);

}  // namespace posenc::detail
