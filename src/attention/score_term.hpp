// The engine's interface to a score term: a part of the logit that is not a table over q − k:
// one that depends on the query row (Shaw, Transformer-XL, TUPE, FIRE) or on per-token inputs
// (Forgetting Attention's gate), with its
// forward, decode and backward. The engine keeps a list of terms (AttentionPlan::terms), calls
// each at fixed points of its loops, and names none of them. Internal.
//
// Where the engine calls a term, in order (one block of (head, query) rows; tiles of keys):
//   forward   begin(rows), start_rows → per tile: add_scores → softmax → add_probabilities → …
//             → finish(o)
//   decode    the same, with TermTile::decode set (few rows: direct products, no windows)
//   backward  begin_backward(rows) → per (tile, row block): add_scores → add_dp → dS →
//             backward_tile → … → end_rows (rows_outer terms) → finish_backward(dQs rows)
//   after the units: reduce(unit slots) into AttentionGradients.
// A term adds to the transposed score tile S^T [key][row] (rows `width` apart) for the rows of
// its heads only. Every sum runs in an order fixed by the shapes, so results stay bitwise the
// same for any thread count.
#pragma once

#include <array>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "internal.hpp"
#include "posenc/attention.hpp"

namespace posenc::detail {

struct Sequence;
struct RowBlock;
struct AttentionPlan;

// The block of rows a term serves, as the engine has loaded them.
struct TermRows {
  const Sequence* seq = nullptr;
  const RowBlock* rows = nullptr;
  std::int64_t kvh = -1;  // the KV head of the rows; −1: decode's block of every KV head
  // Queries transformed and scaled (scale·(T_q(q) + the terms' adjust_query)), [width][Dp].
  const float* q = nullptr;
  // The same transposed, [Dp][ldt] (null for decode's compact blocks).
  const float* qt = nullptr;
  std::int64_t ldt = 0;
  // Backward: dO as rows and transposed (like q and qt), and the unit's dQs rows [width][Dp]
  // (the gradient of the scaled query, before the scale and the inverse transform).
  const float* dout = nullptr;
  const float* doutt = nullptr;
  float* dq = nullptr;
  // Backward: each row's lse and δ = dO·out.
  const float* lse = nullptr;
  const float* delta = nullptr;
};

// One key tile against some of the block's rows: `rows` is the block (forward, decode) or a
// slice of it starting at row r0 (backward's row blocks).
struct TermTile {
  const Sequence* seq = nullptr;
  const RowBlock* rows = nullptr;
  std::int64_t r0 = 0;
  std::int64_t k0 = 0, keys = 0;       // sequence key indices [k0, k0 + keys)
  const std::int64_t* kpos = nullptr;  // their positions
  bool decode = false;
};

// A term's per-thread scratch, kept between calls (AttentionUnitScratch::terms). Its buffers
// mean what the term makes them mean; `rows` is the block the state serves.
struct TermState {
  std::array<AlignedFloats, 6> buffers;
  std::vector<double> doubles, more_doubles;
  std::vector<std::int64_t> heads;
  std::int64_t lo = 0, span = 0;
  TermRows rows;
  double* unit_grads = nullptr;  // backward: the unit's slot (null: no parameter gradients)
  std::int64_t bytes() const {
    std::int64_t total = static_cast<std::int64_t>((doubles.capacity() + more_doubles.capacity()) * sizeof(double) +
                                                   heads.capacity() * sizeof(std::int64_t));
    for (const auto& b : buffers) total += static_cast<std::int64_t>(b.capacity() * sizeof(float));
    return total;
  }
};

// A backward unit as reduce() sees it: its sequence and KV head, its slot.
struct TermUnit {
  const Sequence* seq = nullptr;
  std::int64_t kvh = 0;
  const double* slot = nullptr;
};

class ScoreTerm {
 public:
  virtual ~ScoreTerm() = default;

  // Whether decode may run every KV head's rows as one block (else a block per KV head).
  virtual bool merges_decode_heads() const { return true; }
  // Whether add_scores or add_probabilities reads TermTile::kpos (decode leaves it unset when no
  // term or bias does).
  virtual bool reads_key_positions() const { return true; }
  // Whether a few queries with many rows per KV head may run as wide decode blocks (compact rows
  // through the prefill tiles, in key chunks merged by their log-sum-exps).
  virtual bool allows_wide_decode() const { return false; }
  // Whether backward may split a sequence's queries into ranges, and whether it must walk its
  // row blocks outer (each row block over every key tile in order; no split).
  virtual bool rows_outer() const { return false; }
  // Tables the term keeps, for AttentionStats::workspace_bytes.
  virtual std::int64_t bytes() const { return 0; }
  // Whether tile_max bounds the term's part of every row (+inf for rows it cannot bound, whose
  // tiles then all run), so that the far-tile skip stays exact (AttentionPlan::skip_far_tiles);
  // false: no tile of the call is skipped or run out of key order.
  virtual bool keeps_tile_bound() const { return false; }
  // An upper bound of the term's part of the logits of row (head h, query i of seq) over the
  // sequence's keys [k_first, k_last], for the far-tile skip (tile_vanishes); by default 0 for a
  // term that keeps the tile bound (it adds nothing above 0), else +inf (no skip). A NaN bound
  // fails the test (the tile runs).
  virtual double tile_max(const Sequence& /* seq */, std::int64_t /* h */, std::int64_t /* i */,
                          std::int64_t /* k_first */, std::int64_t /* k_last */) const {
    return keeps_tile_bound() ? 0.0 : std::numeric_limits<double>::infinity();
  }
  // Whether the term's values for head h fall below −100 in some sequence, so that far tiles of
  // the head can vanish without a steep bias (the plan then runs them from the diagonal down).
  virtual bool steep(std::int64_t /* h */) const { return false; }

  // Added to the query row of head h before the scale (Transformer-XL's u).
  virtual void adjust_query(std::int64_t /* h */, float* /* row */) const {}

  // Forward and decode.
  virtual void begin(const TermRows& rows, TermState& s) const { s.rows = rows; }
  // The rows' online-softmax state (running max m, sum l: −inf and 0) before the first key, for a
  // term that joins the denominator (a sink); called once per row, in the first key chunk only.
  virtual void start_rows(const TermRows& /* rows */, float* /* m */, float* /* l */) const {}
  virtual void add_scores(const TermTile& tile, float* st, TermState& s) const = 0;
  // After the tile's softmax step: P^T in pt, corr the rescaling of what came before.
  virtual void add_probabilities(const TermTile& /* tile */, const float* /* pt */, const float* /* corr */,
                                 TermState& /* s */) const {}
  // Before the rows are normalised: the unnormalised output rows o [width][Dp].
  virtual void finish(float* /* o */, TermState& /* s */) const {}

  // Backward. unit_grads: the unit's slot of unit_gradient_size() doubles (null: not wanted).
  virtual std::int64_t unit_gradient_size() const { return 0; }
  virtual void begin_backward(const TermRows& rows, double* unit_grads, TermState& s) const {
    s.rows = rows;
    s.unit_grads = unit_grads;
  }
  // dP^T += the term's part of dL/dP (before dS is formed).
  virtual void add_dp(const TermTile& /* tile */, float* /* dpt */, TermState& /* s */) const {}
  // With P^T and dS^T of the tile (rows tile.rows->width apart).
  virtual void backward_tile(const TermTile& /* tile */, const float* /* pt */, const float* /* dst */,
                             TermState& /* s */) const {}
  // After the last tile of a row block (rows_outer terms only).
  virtual void end_rows(const RowBlock& /* rows */, std::int64_t /* r0 */, TermState& /* s */) const {}
  // After every tile: the term's part of dQs into s.rows.dq, and its slot.
  virtual void finish_backward(TermState& /* s */) const {}
  // The units' slots, in unit order, into the gradients.
  virtual void reduce(std::span<const TermUnit> /* units */, AttentionGradients& /* grads */) const {}
};

// An attention term's fused form for one call (entry `index` of HeadGroup::terms of group
// `group`): the library's own form for the term's type (src/schemes/fused_terms.cpp), else the
// generic form (generic_term.cpp), which evaluates the term's fp64 definition pair by pair. Each
// checks what the term needs of the call and throws posenc::Error naming the parameter otherwise.
std::unique_ptr<ScoreTerm> fused_term(const AttentionTerm& term, const AttentionPlan& plan, std::int64_t group,
                                      std::int64_t index);
std::unique_ptr<ScoreTerm> generic_term(const AttentionTerm& term, const AttentionPlan& plan, std::int64_t group,
                                        std::int64_t index);
// A position bias's fused form (the group's bias): the library's own for its type, else the
// generic form (generic_term.cpp: value and accumulate_gradient pair by pair).
std::unique_ptr<ScoreTerm> fused_bias(const PositionBias& bias, const AttentionPlan& plan, std::int64_t group);
std::unique_ptr<ScoreTerm> generic_bias(const PositionBias& bias, const AttentionPlan& plan, std::int64_t group);

// Shared by the terms' tables (score_term.cpp): C = A·B for large operands, in parallel with
// the same bits for any thread count; [rows][heads][dp] → [heads][rows][dp].
void blocked_gemm(const float* a, std::int64_t a_row, std::int64_t a_depth, const float* b, std::int64_t ldb, float* c,
                  std::int64_t ldc, std::int64_t rows, std::int64_t cols, std::int64_t depth);
AlignedFloats heads_major(const std::vector<float>& by_row, std::int64_t rows, std::int64_t heads, std::int64_t dp);

}  // namespace posenc::detail
