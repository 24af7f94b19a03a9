// The generic fused form of an attention term (score_term.hpp: generic_term): the term's fp64
// definition evaluated pair by pair inside the engine's tiles, so that a term given only by value
// and accumulate_gradient runs fused, in decode and trainable. A hand-written ScoreTerm
// (fused_terms.cpp: the forget gate's, the sinks') is the faster form of the same definition.
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "attention/attention_plan.hpp"
#include "attention/engine.hpp"
#include "attention/score_term.hpp"
#include "posenc/error.hpp"
#include "posenc/term.hpp"

namespace posenc {
namespace detail {
namespace {

class GenericTerm final : public ScoreTerm {
 public:
  GenericTerm(const AttentionTerm& term, const AttentionPlan& p, std::int64_t group, std::int64_t index)
      : term_(term), group_(group), index_(index) {
    first_head_ = p.group_first_head[static_cast<std::size_t>(group)];
    heads_ = p.spec.groups[static_cast<std::size_t>(group)].heads;
    const std::string name = "groups[" + std::to_string(group) + "].terms[" + std::to_string(index) + "]";
    const auto refuse = [&](const char* what) {
      throw Error(AttentionPlan::kWhere, name.c_str(), std::string(term.name()) + ", a term that " + what,
                  "a term of the pair alone (value, accumulate_gradient) for the generic fused form; a term "
                  "that reads q or k, adds to the output or is a sink runs fused only as one of the library's "
                  "own terms (Shaw's, Transformer-XL's, the sinks)");
    };
    if (term.reads_rows()) refuse("reads the query or key rows");
    if (term.adds_to_output()) refuse("adds to the output");
    for (std::int64_t h = 0; h < heads_; ++h) {
      if (term.sink(h)) refuse("is a sink");
    }
    gradient_size_ = term.gradient_size();
  }

  // The pairs' positions come from the tile (TermTile::kpos), which the default keeps read.
  void add_scores(const TermTile& tile, float* st, TermState& /* s */) const override {
    const RowBlock& rb = *tile.rows;
    const std::int64_t w = rb.width;
    for_pairs(tile, [&](std::int64_t r, std::int64_t j, std::int64_t local, const TokenPair& pair) {
      st[j * w + r] += static_cast<float>(term_.value(local, pair));
    });
  }

  // Per backward unit: the term's whole gradient (fp64), reduced in unit order.
  std::int64_t unit_gradient_size() const override { return gradient_size_; }
  void backward_tile(const TermTile& tile, const float* /* pt */, const float* dst, TermState& s) const override {
    if (s.unit_grads == nullptr || gradient_size_ == 0) return;
    const std::int64_t w = tile.rows->width;
    const std::span<double> grads(s.unit_grads, static_cast<std::size_t>(gradient_size_));
    for_pairs(tile, [&](std::int64_t r, std::int64_t j, std::int64_t local, const TokenPair& pair) {
      term_.accumulate_gradient(local, pair, static_cast<double>(dst[j * w + r]), grads);
    });
  }
  void reduce(std::span<const TermUnit> units, AttentionGradients& grads) const override {
    std::vector<double>& out = grads.groups[static_cast<std::size_t>(group_)].terms[static_cast<std::size_t>(index_)];
    for (const TermUnit& unit : units) {
      if (unit.slot == nullptr) continue;
      for (std::int64_t t = 0; t < gradient_size_; ++t) out[static_cast<std::size_t>(t)] += unit.slot[t];
    }
  }

 private:
  // fn(row, key of the tile, the group's head, pair) for every pair of the tile that the mask
  // lets through, rows of the term's heads only (padding rows have head −1), in row then key order.
  template <class Fn>
  void for_pairs(const TermTile& tile, Fn&& fn) const {
    const RowBlock& rb = *tile.rows;
    const Sequence& seq = *tile.seq;
    for (std::int64_t r = 0; r < rb.width; ++r) {
      const auto at = static_cast<std::size_t>(r);
      const std::int64_t h = rb.head[at], i = rb.query[at];
      if (h < first_head_ || h >= first_head_ + heads_ || i < 0) continue;
      TokenPair pair;
      pair.batch = seq.b;
      pair.sequence_start = seq.k0;
      pair.query_token = seq.k0 + seq.lk - seq.lq + i;  // the key token the query stands for (term.hpp)
      pair.query_position = rb.position[at];
      for (std::int64_t j = 0; j < tile.keys; ++j) {
        if (!rb.sees(r, tile.k0 + j)) continue;
        pair.key_token = seq.k0 + tile.k0 + j;
        pair.key_position = tile.kpos[j];
        fn(r, j, h - first_head_, pair);
      }
    }
  }

  const AttentionTerm& term_;
  std::int64_t group_ = 0, index_ = 0, first_head_ = 0, heads_ = 0, gradient_size_ = 0;
};

}  // namespace

std::unique_ptr<ScoreTerm> generic_term(const AttentionTerm& term, const AttentionPlan& plan, std::int64_t group,
                                        std::int64_t index) {
  return std::make_unique<GenericTerm>(term, plan, group, index);
}

}  // namespace detail
}  // namespace posenc
