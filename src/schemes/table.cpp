// "table": a learned bias per head and clipped relative position, b_h(clip(r, −K, K)) with
// r = key − query (posenc's sign of r, as the relative-bias family and Shaw's table use it) —
// T5's table without buckets, or Shaw et al.'s clipped distances as a scalar bias. A scheme given
// only by its fp64 definition: the engine runs it through the generic fused form of an attention
// term (term.hpp), forward, decode and backward, with no code of its own in the engine.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "posenc/error.hpp"
#include "posenc/registry.hpp"
#include "posenc/term.hpp"

namespace posenc {
namespace {

class DistanceTable final : public AttentionTerm {
 public:
  DistanceTable(std::int64_t heads, std::int64_t max_distance, std::vector<double> table)
      : heads_(heads), max_distance_(max_distance), table_(std::move(table)) {}

  std::string_view name() const override { return "table"; }
  std::int64_t heads() const override { return heads_; }
  const std::vector<double>& table() const { return table_; }

  double value(std::int64_t head, const TokenPair& pair) const override {
    return table_[static_cast<std::size_t>(index(head, pair))];
  }
  std::int64_t gradient_size() const override { return static_cast<std::int64_t>(table_.size()); }
  void accumulate_gradient(std::int64_t head, const TokenPair& pair, double weight,
                           std::span<double> grads) const override {
    grads[static_cast<std::size_t>(index(head, pair))] += weight;
  }

 private:
  // Row `head`, column clip(r, −K, K) + K (positions lie in [0, 2^40]: r cannot overflow).
  std::int64_t index(std::int64_t head, const TokenPair& pair) const {
    const std::int64_t r = pair.key_position - pair.query_position;
    return head * (2 * max_distance_ + 1) + std::clamp(r, -max_distance_, max_distance_) + max_distance_;
  }

  std::int64_t heads_, max_distance_;
  std::vector<double> table_;  // [heads][2K + 1]
};

}  // namespace

namespace scheme_entries {

SchemeEntry table_entry() {
  return SchemeEntry{
      .name = "table",
      .family = "term",
      .summary = "b = w[h, clip(r, −K, K) + K], r = key − query: a learned bias per head and clipped distance",
      .source = "Shaw et al. 2018's clipped distances; Raffel et al. 2020 (T5) without buckets",
      .options = {size_option("max_distance", 128, "K: distances beyond ±K share the end entries")},
      .parameters = "w [heads, 2·max_distance + 1] (zeros at first)",
      .parameter_shape =
          [](const SchemeArgs& a) {
            return std::vector<std::int64_t>{a.heads, 2 * a.integer("max_distance") + 1};
          },
      .make =
          [](const SchemeArgs& a) {
            const std::int64_t k = a.integer("max_distance");
            std::vector<double> w = a.parameters;
            if (w.empty()) w.assign(static_cast<std::size_t>(a.heads * (2 * k + 1)), 0.0);
            HeadGroup g{a.heads, {}, {}};
            g.terms = {std::make_shared<const DistanceTable>(a.heads, k, std::move(w))};
            return g;
          },
      .parameters_of =
          [](const HeadGroup& g) {
            const auto* t = g.terms.empty() ? nullptr : dynamic_cast<const DistanceTable*>(g.terms[0].get());
            if (t == nullptr) throw Error("scheme table", "terms[0]", "not a table", "the group table_entry makes");
            return t->table();
          },
      // The entry's term is the group's first (the attention's sinks and gates arguments append theirs).
      .gradients_of = [](const GroupGradients& g) { return g.terms.empty() ? std::vector<double>{} : g.terms[0]; }};
}

}  // namespace scheme_entries
}  // namespace posenc
