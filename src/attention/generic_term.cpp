// The generic fused forms of an attention term and of a position bias (score_term.hpp:
// generic_term, generic_bias): the scheme's fp64 definition evaluated pair by pair inside the
// engine's tiles, so that a term given only by value and accumulate_gradient, or a bias of both
// positions given only by its PositionBias definition, runs fused, in decode and trainable. A
// hand-written ScoreTerm (fused_terms.cpp: the forget gate's, the sinks', FIRE's, TUPE's) is the
// faster form of the same definition.
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "attention/attention_plan.hpp"
#include "attention/engine.hpp"
#include "attention/score_term.hpp"
#include "posenc/error.hpp"
#include "posenc/scheme.hpp"
#include "posenc/term.hpp"

namespace posenc {
namespace detail {
namespace {

// What the two generic forms share: the pairs of a tile that the group's heads see, each pair's
// value rounded to f32 and added to its score, and in backward each pair's dS handed to the
// definition's gradient, summed per backward unit in fp64 and reduced in unit order (the same
// bits for any thread count). Form gives value(local head, pair), gradient(local head, pair,
// weight, grads) and the vector its gradients go to (target).
template <class Form>
class PairwiseTerm : public ScoreTerm {
 public:
  // The pairs' positions come from the tile (TermTile::kpos), which the default keeps read.
  void add_scores(const TermTile& tile, float* st, TermState& /* s */) const override {
    const std::int64_t w = tile.rows->width;
    for_pairs(tile, [&](std::int64_t r, std::int64_t j, std::int64_t local, const TokenPair& pair) {
      st[j * w + r] += static_cast<float>(form().value(local, pair));
    });
  }

  // A definition may rise anywhere along a row, so it brings no bound: the group's tiles all run,
  // and the other groups keep their far-tile skip.
  bool keeps_tile_bound() const override { return true; }
  double tile_max(const Sequence& /* seq */, std::int64_t h, std::int64_t /* i */, std::int64_t /* k_first */,
                  std::int64_t /* k_last */) const override {
    return h >= first_head_ && h < first_head_ + heads_ ? std::numeric_limits<double>::infinity() : 0.0;
  }

  std::int64_t unit_gradient_size() const override { return gradient_size_; }
  void backward_tile(const TermTile& tile, const float* /* pt */, const float* dst, TermState& s) const override {
    if (s.unit_grads == nullptr || gradient_size_ == 0) return;
    const std::int64_t w = tile.rows->width;
    const std::span<double> grads(s.unit_grads, static_cast<std::size_t>(gradient_size_));
    for_pairs(tile, [&](std::int64_t r, std::int64_t j, std::int64_t local, const TokenPair& pair) {
      form().gradient(local, pair, static_cast<double>(dst[j * w + r]), grads);
    });
  }
  void reduce(std::span<const TermUnit> units, AttentionGradients& grads) const override {
    std::vector<double>& out = form().target(grads.groups[static_cast<std::size_t>(group_)]);
    for (const TermUnit& unit : units) {
      if (unit.slot == nullptr) continue;
      for (std::int64_t t = 0; t < gradient_size_; ++t) out[static_cast<std::size_t>(t)] += unit.slot[t];
    }
  }

 protected:
  PairwiseTerm(const AttentionPlan& p, std::int64_t group, std::int64_t gradient_size)
      : group_(group),
        first_head_(p.group_first_head[static_cast<std::size_t>(group)]),
        heads_(p.spec.groups[static_cast<std::size_t>(group)].heads),
        gradient_size_(gradient_size) {}

  std::int64_t group_ = 0, first_head_ = 0, heads_ = 0, gradient_size_ = 0;

 private:
  const Form& form() const { return static_cast<const Form&>(*this); }

  // fn(row, key of the tile, the group's head, pair) for every pair of the tile that the mask
  // lets through, rows of the group's heads only (padding rows have head −1), in row then key order.
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
};

// A term by its TermDefinition: value and accumulate_gradient, into GroupGradients::terms.
class GenericTerm final : public PairwiseTerm<GenericTerm> {
 public:
  GenericTerm(const AttentionTerm& term, const AttentionPlan& p, std::int64_t group, std::int64_t index)
      : PairwiseTerm(p, group, term.gradient_size()), term_(term), index_(index) {
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
  }

  double value(std::int64_t head, const TokenPair& pair) const { return term_.value(head, pair); }
  void gradient(std::int64_t head, const TokenPair& pair, double weight, std::span<double> grads) const {
    term_.accumulate_gradient(head, pair, weight, grads);
  }
  std::vector<double>& target(GroupGradients& g) const { return g.terms[static_cast<std::size_t>(index_)]; }

 private:
  const AttentionTerm& term_;
  std::int64_t index_ = 0;
};

// A bias of both positions by its PositionBias definition: value(head, p_i, p'_j) and
// accumulate_gradient, into GroupGradients::bias.
class GenericBias final : public PairwiseTerm<GenericBias> {
 public:
  GenericBias(const PositionBias& bias, const AttentionPlan& p, std::int64_t group)
      : PairwiseTerm(p, group, bias.parameter_count()), bias_(bias) {
    // The plan has checked the heads; the positions are the scheme's to refuse (TUPE's table).
    bias.check_positions(AttentionPlan::kWhere, *p.q_positions, *p.k_positions);
    // One gradient of weight 0 here, where an Error can reach the caller: a scheme that gives
    // neither gradient form (scheme.hpp) is refused now, not inside the backward's threads.
    for (const Sequence& seq : p.sequences) {
      if (gradient_size_ == 0 || seq.lq == 0 || seq.lk == 0) continue;
      std::vector<double> scratch(static_cast<std::size_t>(gradient_size_), 0.0);
      bias.accumulate_gradient(0, p.q_position(seq, 0), p.k_position(seq, 0), 0.0, scratch);
      break;
    }
  }

  double value(std::int64_t head, const TokenPair& pair) const {
    return bias_.value(head, pair.query_position, pair.key_position);
  }
  void gradient(std::int64_t head, const TokenPair& pair, double weight, std::span<double> grads) const {
    bias_.accumulate_gradient(head, pair.query_position, pair.key_position, weight, grads);
  }
  static std::vector<double>& target(GroupGradients& g) { return g.bias; }

 private:
  const PositionBias& bias_;
};

}  // namespace

std::unique_ptr<ScoreTerm> generic_term(const AttentionTerm& term, const AttentionPlan& plan, std::int64_t group,
                                        std::int64_t index) {
  return std::make_unique<GenericTerm>(term, plan, group, index);
}

std::unique_ptr<ScoreTerm> generic_bias(const PositionBias& bias, const AttentionPlan& plan, std::int64_t group) {
  return std::make_unique<GenericBias>(bias, plan, group);
}

}  // namespace detail
}  // namespace posenc
