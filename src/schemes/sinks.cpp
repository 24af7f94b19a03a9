// Attention sinks (sinks.hpp): the logits' checks, the fused term, which starts every row's
// online softmax from the sink and returns its gradient from lse and dO·out, and the registry
// entry of sinks alone (registry.hpp).
#include "posenc/sinks.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "attention/engine.hpp"
#include "attention/score_term.hpp"
#include "schemes/fused_terms.hpp"
#include "internal.hpp"
#include "posenc/error.hpp"
#include "posenc/registry.hpp"

namespace posenc {

AttentionSinks::AttentionSinks(std::vector<double> logits) : logits_(std::move(logits)) {
  if (logits_.empty()) throw Error("AttentionSinks", "logits", "empty", "one logit per head");
  for (std::size_t h = 0; h < logits_.size(); ++h) {
    if (std::isnan(logits_[h]) || logits_[h] == std::numeric_limits<double>::infinity()) {
      throw Error("AttentionSinks", ("logits[" + std::to_string(h) + "]").c_str(), detail::to_text(logits_[h]),
                  "a finite number, or −inf for no sink");
    }
  }
}

namespace detail {
namespace {

class SinkTerm final : public ScoreTerm {
 public:
  SinkTerm(const AttentionSinks& sinks, const AttentionPlan& p, std::int64_t group, std::int64_t index)
      : p_(p), group_(group), index_(index), logits_(sinks.logits()) {
    first_head_ = p.group_first_head[static_cast<std::size_t>(group)];
    const std::int64_t heads = p.spec.groups[static_cast<std::size_t>(group)].heads;
    if (sinks.heads() != heads) {
      throw Error(AttentionPlan::kWhere,
                  ("groups[" + std::to_string(group) + "].terms[" + std::to_string(index) + "].heads").c_str(),
                  std::to_string(sinks.heads()), std::to_string(heads) + " (the group's heads)");
    }
  }

  // The sink adds to no score: the bounds of the far-tile skip stay bounds, and a row's running
  // max only starts higher.
  bool keeps_tile_bound() const override { return true; }
  bool reads_key_positions() const override { return false; }
  void add_scores(const TermTile& /* tile */, float* /* st */, TermState& /* s */) const override {}
  // The sink joins the row's running (m, l), which starts at (−inf, 0) or holds another sink of
  // the group: one sink gives (s, 1) exactly.
  void start_rows(const TermRows& rows, float* m, float* l) const override {
    const RowBlock& rb = *rows.rows;
    for (std::int64_t r = 0; r < rb.width; ++r) {
      const std::int64_t h = rb.head[static_cast<std::size_t>(r)];
      if (h < 0 || !ours(h)) continue;
      const auto s = static_cast<float>(logit(h));
      if (std::isinf(s) && s < 0) continue;  // −inf: no sink
      const float m_new = std::max(m[r], s);
      l[r] = (l[r] == 0.0f ? 0.0f : l[r] * std::exp(m[r] - m_new)) + std::exp(s - m_new);
      m[r] = m_new;
    }
  }

  // Per unit: ∂L/∂s per head of the KV group, [G] (fp64).
  std::int64_t unit_gradient_size() const override { return p_.group_size; }
  void finish_backward(TermState& s) const override {
    if (s.unit_grads == nullptr) return;
    const RowBlock& rb = *s.rows.rows;
    for (std::int64_t r = 0; r < rb.width; ++r) {
      const std::int64_t h = rb.head[static_cast<std::size_t>(r)];
      if (h < 0 || !ours(h)) continue;
      const double p_sink = std::exp(logit(h) - static_cast<double>(s.rows.lse[r]));
      if (p_sink == 0.0) continue;  // −inf sink, or a row whose keys outweigh it beyond fp64
      s.unit_grads[h - s.rows.kvh * p_.group_size] -= p_sink * static_cast<double>(s.rows.delta[r]);
    }
  }
  void reduce(std::span<const TermUnit> units, AttentionGradients& grads) const override {
    std::vector<double>& out = grads.groups[static_cast<std::size_t>(group_)].terms[static_cast<std::size_t>(index_)];
    for (const TermUnit& unit : units) {
      for (std::int64_t g = 0; g < p_.group_size; ++g) {
        const std::int64_t h = unit.kvh * p_.group_size + g;
        if (ours(h)) out[static_cast<std::size_t>(h - first_head_)] += unit.slot[g];
      }
    }
  }

 private:
  bool ours(std::int64_t h) const {
    return h >= first_head_ && h < first_head_ + static_cast<std::int64_t>(logits_.size());
  }
  double logit(std::int64_t h) const { return logits_[static_cast<std::size_t>(h - first_head_)]; }

  const AttentionPlan& p_;
  std::int64_t group_ = 0, index_ = 0, first_head_ = 0;
  std::vector<double> logits_;
};

}  // namespace
}  // namespace detail

std::unique_ptr<detail::ScoreTerm> detail::fused_form(const AttentionSinks& sinks, const AttentionPlan& plan,
                                                      std::int64_t group, std::int64_t index) {
  return std::make_unique<SinkTerm>(sinks, plan, group, index);
}

namespace scheme_entries {

// The sinks as a group's whole scheme: a head group of their own in posenc.attention, or
// posenc.Scheme("sinks", heads) as a module of learned logits. Sinks beside another scheme on the
// same heads (gpt-oss: RoPE) go through the attention's `sinks` argument (HeadGroup::terms).
SchemeEntry sinks_entry() {
  SchemeEntry e{
      .name = "sinks",
      .family = "sink",
      .summary = "P_ij = exp(x_ij)/(exp(s_h) + Σ_j exp(x_ij)): a learned logit per head in every row's denominator",
      .source = "OpenAI 2025, gpt-oss; Xiao et al. 2024, Efficient Streaming Language Models with Attention Sinks",
      .options = {},
      .parameters = "logits [heads] (zeros at first)",
      .parameter_shape = [](const SchemeArgs& a) { return std::vector<std::int64_t>{a.heads}; },
      .make =
          [](const SchemeArgs& a) {
            HeadGroup g{a.heads, {}, {}};
            std::vector<double> logits = a.parameters;
            if (logits.empty()) logits.assign(static_cast<std::size_t>(a.heads), 0.0);
            g.terms = {std::make_shared<const AttentionSinks>(std::move(logits))};
            return g;
          }};
  e.parameters_of = [](const HeadGroup& g) {
    const auto* sinks = g.terms.empty() ? nullptr : dynamic_cast<const AttentionSinks*>(g.terms[0].get());
    if (sinks == nullptr) throw Error("scheme sinks", "terms[0]", "not AttentionSinks", "the group sinks_entry makes");
    return sinks->logits();
  };
  // The entry's sink is the group's first term (the attention's sinks and gates arguments append theirs).
  e.gradients_of = [](const GroupGradients& g) { return g.terms.empty() ? std::vector<double>{} : g.terms[0]; };
  // Logits of about the size of gpt-oss's learned sinks (zeros by default).
  e.bench_preset = [](SchemeArgs& a, std::int64_t) { a.parameters.assign(static_cast<std::size_t>(a.heads), 1.0); };
  return e;
}

}  // namespace scheme_entries
}  // namespace posenc
