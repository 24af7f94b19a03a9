// FIRE (Li et al. 2024, "Functional Interpolation for Relative Positions Improves Long Context
// Transformers") inside the fused attention (a group's bias, FireParams), as a ScoreTerm:
// b(h, i, j) = f_h(ψ(|i − j|)/ψ(max(L, i))) with ψ(d) = log(1 + c·d) and f_h its piecewise-linear
// MLP (bias.hpp). A row's biases come from ψ tables over the call's distances, the MLP's pieces
// walked along the row; backward sums dS into moments per piece (Σ dS, Σ dS·x) and the c and L
// terms, in fp64 in each unit's slot, and reduce() contracts them through the MLP once per call.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include "attention/engine.hpp"
#include "attention/score_term.hpp"
#include "schemes/fused_terms.hpp"
#include "bias_checks.hpp"
#include "kernels/attention/attention_kernels.hpp"
#include "posenc/error.hpp"

namespace posenc::detail {

namespace {

// FIRE's biases of a row (one query against keys at consecutive positions), exactly as the
// per-element definition computes them (fp64, rounded once): x = ψ(d)·(1/ψ(max(L, q))) with
// ψ(d) = log1p(c·d) tabulated for the distances a call meets; the pieces of the MLP walked along
// the row (x is monotone on each side of the query); one multiply-add per element.
struct FireRows {
  const FireParams* params = nullptr;
  std::vector<double> psi;      // ψ(d), d < psi.size()
  std::vector<double> dpsi_dc;  // ∂ψ(d)/∂c = d/(1 + c·d)
  // out[j] += b(head, q, k_first + j) for j < count; false if a distance is past the table.
  bool add_row(std::int64_t head, std::int64_t q_position, std::int64_t k_first, std::int64_t count, float* out,
               std::int64_t out_stride) const;
  std::vector<double> inv_norm;  // 1/ψ(max(L, q)) for q = inv_norm_first + t
  std::int64_t inv_norm_first = 0;
  // How many of keys k_first … k_first + count − 1 lie at or before every query of the lane
  // chunk q_first … q_first + 15 (a contiguous ψ slice per key); −1 if a distance or query
  // position is past the tables.
  std::int64_t keys_below(std::int64_t q_first, std::int64_t k_first, std::int64_t count) const;
  // The same for one lane chunk: lane t (valid when lane_head[t] >= 0) at query position
  // q_first + t, against keys at positions k_first … k_first + count − 1 (sequence indices from
  // k_index). Keys at or before every lane's query go through the vector kernel (attn_fire_keys);
  // the rest through add_row, limited to the keys lane t sees, [lane_lo[t], lane_hi[t]) — the
  // others are left for the mask. out: S^T of the chunk, rows `out_stride` apart. False (nothing
  // added) if a distance or query position is past the tables.
  bool add_chunk(std::int64_t head, const std::int64_t* lane_head, const std::int32_t* lane_lo,
                 const std::int32_t* lane_hi, std::int64_t q_first, std::int64_t k_index, std::int64_t k_first,
                 std::int64_t count, float* out, std::int64_t out_stride) const;
  // Backward moments of one row against keys kpos[0..count) with dL/db = ds[j·ds_stride]:
  // s0[piece·heads + head] += ds, s1[…] += ds·x, and the c and L gradients (fp64; any key order).
  void accumulate_row(std::int64_t head, std::int64_t heads, std::int64_t q_position, const std::int64_t* kpos,
                      std::int64_t count, const float* ds, std::int64_t ds_stride, double* s0, double* s1, double* d_c,
                      double* d_threshold) const;
  // The same for one lane chunk, as add_chunk splits it: keys at or before every lane's query
  // through the vector kernel (attn_fire_moments), the others by accumulate_row over the keys
  // lane t sees. Key positions kpos[0..count) are consecutive; ds: dS^T of the chunk, rows
  // `ds_stride` apart. False (nothing added) if a distance or query position is past the tables.
  bool accumulate_chunk(std::int64_t head, std::int64_t heads, const std::int64_t* lane_head,
                        const std::int32_t* lane_lo, const std::int32_t* lane_hi, std::int64_t q_first,
                        std::int64_t k_index, const std::int64_t* kpos, std::int64_t count, const float* ds,
                        std::int64_t ds_stride, double* s0, double* s1, double* d_c, double* d_threshold) const;
};

// A FIRE lane chunk against keys at or before every lane's query (FireRows::add_chunk,
// accumulate_chunk): lane t's normaliser 1/ψ(max(L, q)), its piece of the MLP and that piece's
// bounds and line. Padding lanes (lane_head < 0) take x = ψ·1, slope 0 and never leave a piece
// spanning every x.
struct FireLanes {
  static constexpr std::int64_t kLanes = kernels::kAttnAlign;
  alignas(64) double inv[kLanes], lo[kLanes], hi[kLanes], slope[kLanes], intercept[kLanes];
  std::int64_t piece[kLanes];
  const FireRows& rows;
  std::int64_t head, q_first, k_first;

  FireLanes(const FireRows& fire, std::int64_t head_, const std::int64_t* lane_head, std::int64_t q_first_,
            std::int64_t k_first_)
      : rows(fire), head(head_), q_first(q_first_), k_first(k_first_) {
    constexpr double kInf = std::numeric_limits<double>::infinity();
    for (std::int64_t t = 0; t < kLanes; ++t) {
      if (lane_head[t] < 0) {
        inv[t] = 1.0, lo[t] = -kInf, hi[t] = kInf, slope[t] = 0.0, intercept[t] = 0.0, piece[t] = -1;
        continue;
      }
      inv[t] = rows.inv_norm[static_cast<std::size_t>(q_first + t - rows.inv_norm_first)];
      enter(t, rows.params->piece_of(x_at(t, 0)));
    }
  }
  // Lane t's x at key j, as the kernels compute it: ψ(d)·(1/ψ(max(L, q))). (The per-element
  // definition divides; the two differ by an fp64 rounding, far below the f32 result's.)
  double x_at(std::int64_t t, std::int64_t j) const {
    return rows.psi[static_cast<std::size_t>(q_first + t - k_first - j)] * inv[t];
  }
  void enter(std::int64_t t, std::int64_t pc) {
    constexpr double kInf = std::numeric_limits<double>::infinity();
    const std::vector<double>& kinks = rows.params->kinks();
    piece[t] = pc;
    lo[t] = pc > 0 ? kinks[static_cast<std::size_t>(pc - 1)] : -kInf;
    hi[t] = pc < static_cast<std::int64_t>(kinks.size()) ? kinks[static_cast<std::size_t>(pc)] : kInf;
    slope[t] = rows.params->slope(pc, head);
    intercept[t] = rows.params->intercept(pc, head);
  }
  // The piece lane t moves to at key j (piece_of's rule: a kink belongs to the piece on its
  // right), or −1 if it stays (or is padding).
  std::int64_t next_piece(std::int64_t t, std::int64_t j) const {
    if (piece[t] < 0) return -1;
    const double x = x_at(t, j);
    if (x >= lo[t] && x < hi[t]) return -1;
    const std::vector<double>& kinks = rows.params->kinks();
    const auto n_kinks = static_cast<std::int64_t>(kinks.size());
    std::int64_t pc = piece[t];
    while (pc > 0 && x < kinks[static_cast<std::size_t>(pc - 1)]) --pc;
    while (pc < n_kinks && x >= kinks[static_cast<std::size_t>(pc)]) ++pc;
    return pc;
  }
};

// Keys [0, below) of a lane chunk at q_first … q_first + 15 against keys k_first … k_first +
// count − 1 lie at or before every lane's query: distances q_first + t − k fall by one per key and
// rise by one per lane, a contiguous slice of ψ. −1 if a distance or query position is past the
// tables.
std::int64_t FireRows::keys_below(std::int64_t q_first, std::int64_t k_first, std::int64_t count) const {
  const auto table = static_cast<std::int64_t>(psi.size());
  const std::int64_t k_last = k_first + count - 1, q_last = q_first + kernels::kAttnAlign - 1;
  if (std::max(std::abs(q_last - k_first), std::abs(k_last - q_first)) >= table) return -1;
  if (q_first < inv_norm_first || q_last - inv_norm_first >= static_cast<std::int64_t>(inv_norm.size())) return -1;
  return std::clamp<std::int64_t>(q_first - k_first + 1, 0, count);
}

bool FireRows::add_row(std::int64_t head, std::int64_t q_position, std::int64_t k_first, std::int64_t count, float* out,
                       std::int64_t out_stride) const {
  const FireParams& p = *params;
  const auto table = static_cast<std::int64_t>(psi.size());
  if (std::abs(q_position - k_first) >= table || std::abs(q_position - (k_first + count - 1)) >= table) return false;
  // As FireParams::normalized_distance: ψ(d) / ψ(max(L, q)).
  const double norm = std::log1p(p.c() * std::max(p.threshold(), static_cast<double>(q_position)));
  const std::vector<double>& kinks = p.kinks();
  const auto n_kinks = static_cast<std::int64_t>(kinks.size());
  // The current piece as an x interval [lo, hi) with its line: most elements stay on the piece of
  // their neighbour, and then cost a division, two compares and a multiply-add.
  std::int64_t piece = -1;
  double lo = 0, hi = -1, slope = 0, intercept = 0;  // empty: the first element looks its piece up
  for (std::int64_t j = 0; j < count; ++j) {
    const std::int64_t d = std::abs(k_first + j - q_position);
    const double x = psi[static_cast<std::size_t>(d)] / norm;
    if (!(x >= lo && x < hi)) {
      if (piece < 0) {
        piece = p.piece_of(x);
      } else {
        // piece_of's rule (upper bound: a kink belongs to the piece on its right), walked.
        while (piece > 0 && x < kinks[static_cast<std::size_t>(piece - 1)]) --piece;
        while (piece < n_kinks && x >= kinks[static_cast<std::size_t>(piece)]) ++piece;
      }
      lo = piece > 0 ? kinks[static_cast<std::size_t>(piece - 1)] : -std::numeric_limits<double>::infinity();
      hi = piece < n_kinks ? kinks[static_cast<std::size_t>(piece)] : std::numeric_limits<double>::infinity();
      slope = p.slope(piece, head);
      intercept = p.intercept(piece, head);
    }
    out[j * out_stride] += static_cast<float>(slope * x + intercept);
  }
  return true;
}

bool FireRows::add_chunk(std::int64_t head, const std::int64_t* lane_head, const std::int32_t* lane_lo,
                         const std::int32_t* lane_hi, std::int64_t q_first, std::int64_t k_index, std::int64_t k_first,
                         std::int64_t count, float* out, std::int64_t out_stride) const {
  constexpr std::int64_t kLanes = kernels::kAttnAlign;
  if (count <= 0) return true;
  const std::int64_t below = keys_below(q_first, k_first, count);
  if (below < 0) return false;
  if (below > 0) {
    FireLanes lanes(*this, head, lane_head, q_first, k_first);
    const std::int64_t base = q_first - k_first;
    for (std::int64_t j = 0; j < below;) {
      j += kernels::attn_fire_keys(out + j * out_stride, below - j, out_stride, psi.data(), base - j, lanes.inv,
                                   lanes.lo, lanes.hi, lanes.slope, lanes.intercept);
      if (j == below) break;
      // Some lane left its piece at key j: move it and go on.
      for (std::int64_t t = 0; t < kLanes; ++t) {
        if (const std::int64_t pc = lanes.next_piece(t, j); pc >= 0) lanes.enter(t, pc);
      }
    }
  }
  if (below < count) {
    // Keys after some lane's query: element by element, and only those the lane sees (the mask
    // sets the others to −inf after the biases; in causal attention that is all of them).
    for (std::int64_t t = 0; t < kLanes; ++t) {
      if (lane_head[t] < 0) continue;
      const std::int64_t j0 = std::max<std::int64_t>(below, lane_lo[t] - k_index);
      const std::int64_t j1 = std::min<std::int64_t>(count, lane_hi[t] - k_index);
      // add_row cannot decline here: every distance of the chunk was checked against ψ above.
      if (j1 > j0) add_row(head, q_first + t, k_first + j0, j1 - j0, out + j0 * out_stride + t, out_stride);
    }
  }
  return true;
}

bool FireRows::accumulate_chunk(std::int64_t head, std::int64_t heads, const std::int64_t* lane_head,
                                const std::int32_t* lane_lo, const std::int32_t* lane_hi, std::int64_t q_first,
                                std::int64_t k_index, const std::int64_t* kpos, std::int64_t count, const float* ds,
                                std::int64_t ds_stride, double* s0, double* s1, double* d_c,
                                double* d_threshold) const {
  constexpr std::int64_t kLanes = kernels::kAttnAlign;
  const FireParams& p = *params;
  if (count <= 0) return true;
  const std::int64_t below = keys_below(q_first, kpos[0], count);
  if (below < 0) return false;
  if (below > 0) {
    FireLanes lanes(*this, head, lane_head, q_first, kpos[0]);
    alignas(64) double moments[4 * kLanes] = {};  // per lane: Σ g, Σ g·x (this piece); Σ g·f'·dψ/dc, Σ g·f'·x
    // Moves lane t's sums of its current piece into the piece's slots.
    const auto flush = [&](std::int64_t t) {
      if (lanes.piece[t] < 0) return;
      const auto slot = static_cast<std::size_t>(lanes.piece[t] * heads + head);
      s0[slot] += moments[t];
      s1[slot] += moments[kLanes + t];
      moments[t] = moments[kLanes + t] = 0.0;
    };
    const std::int64_t base = q_first - kpos[0];
    for (std::int64_t j = 0; j < below;) {
      j += kernels::attn_fire_moments(ds + j * ds_stride, below - j, ds_stride, psi.data(), dpsi_dc.data(), base - j,
                                      lanes.inv, lanes.lo, lanes.hi, lanes.slope, moments);
      if (j == below) break;
      for (std::int64_t t = 0; t < kLanes; ++t) {
        if (const std::int64_t pc = lanes.next_piece(t, j); pc >= 0) {
          flush(t);
          lanes.enter(t, pc);
        }
      }
    }
    // Per lane, the c and L terms as accumulate_row forms them.
    const double c = p.c();
    for (std::int64_t t = 0; t < kLanes; ++t) {
      if (lanes.piece[t] < 0) continue;
      flush(t);
      const double q = static_cast<double>(q_first + t);
      const bool threshold_active = p.threshold() > q;
      const double n = threshold_active ? p.threshold() : q;
      const double psi_n = std::log1p(c * n);
      const double dc_from_x = n / (1 + c * n) / psi_n, dl_from_x = threshold_active ? -(c / (1 + c * n)) / psi_n : 0.0;
      *d_c += moments[2 * kLanes + t] / psi_n - dc_from_x * moments[3 * kLanes + t];
      *d_threshold += dl_from_x * moments[3 * kLanes + t];
    }
  }
  if (below < count) {
    // Keys after some lane's query: row by row, only those the lane sees (the others have dS = 0).
    for (std::int64_t t = 0; t < kLanes; ++t) {
      if (lane_head[t] < 0) continue;
      const std::int64_t j0 = std::max<std::int64_t>(below, lane_lo[t] - k_index);
      const std::int64_t j1 = std::min<std::int64_t>(count, lane_hi[t] - k_index);
      if (j1 > j0) {
        accumulate_row(head, heads, q_first + t, kpos + j0, j1 - j0, ds + j0 * ds_stride + t, ds_stride, s0, s1, d_c,
                       d_threshold);
      }
    }
  }
  return true;
}

void FireRows::accumulate_row(std::int64_t head, std::int64_t heads, std::int64_t q_position, const std::int64_t* kpos,
                              std::int64_t count, const float* ds, std::int64_t ds_stride, double* s0, double* s1,
                              double* d_c, double* d_threshold) const {
  const FireParams& p = *params;
  const double c = p.c();
  const bool threshold_active = p.threshold() > static_cast<double>(q_position);
  const double n = threshold_active ? p.threshold() : static_cast<double>(q_position);
  const double psi_n = std::log1p(c * n);
  // ∂x/∂c = (dψ(d)/dc − x·n/(1 + c·n))/ψ(n);  ∂x/∂L = −x·c/((1 + c·n)·ψ(n)) below L (as fire_backward).
  const double dc_from_x = n / (1 + c * n) / psi_n, dl_from_x = threshold_active ? -(c / (1 + c * n)) / psi_n : 0.0;
  const std::vector<double>& kinks = p.kinks();
  const auto n_kinks = static_cast<std::int64_t>(kinks.size());
  const auto table = static_cast<std::int64_t>(psi.size());
  std::int64_t piece = -1;
  double t1 = 0, t2 = 0;  // Σ g·dψ/dc, Σ g·x with g = ds·f'(x)
  for (std::int64_t j = 0; j < count; ++j) {
    const double g_ds = ds[j * ds_stride];
    const std::int64_t d = std::abs(kpos[j] - q_position);
    const double psi_d = d < table ? psi[static_cast<std::size_t>(d)] : std::log1p(c * static_cast<double>(d));
    const double dpsi =
        d < table ? dpsi_dc[static_cast<std::size_t>(d)] : static_cast<double>(d) / (1 + c * static_cast<double>(d));
    const double x = psi_d / psi_n;
    if (piece < 0) {
      piece = p.piece_of(x);
    } else {
      while (piece > 0 && x < kinks[static_cast<std::size_t>(piece - 1)]) --piece;
      while (piece < n_kinks && x >= kinks[static_cast<std::size_t>(piece)]) ++piece;
    }
    if (g_ds == 0.0f) continue;
    const std::size_t slot = static_cast<std::size_t>(piece * heads + head);
    s0[slot] += g_ds;
    s1[slot] += g_ds * x;
    const double g = g_ds * p.slope(piece, head);
    t1 += g * dpsi;
    t2 += g * x;
  }
  *d_c += t1 / psi_n - dc_from_x * t2;
  *d_threshold += dl_from_x * t2;
}

// FIRE's ψ and 1/ψ(max(L, q)) tables over the distances and query positions a call meets, when
// those are of a sensible size (else they stay empty and rows are evaluated per element). `fire`
// is the plan's own spec's (FireRows keeps a pointer to it).
FireRows fire_rows_for(const FireParams& fire, const AttentionPlan::PositionRange& range) {
  const std::int64_t q_min = range.q_min, q_max = range.q_max, k_min = range.k_min, k_max = range.k_max;
  FireRows rows;
  rows.params = &fire;
  const std::int64_t max_distance = std::max(std::abs(k_max - q_min), std::abs(q_max - k_min));
  if (max_distance >= AttentionPlan::kMaxBiasTable) return rows;
  // kAttnAlign past it: a lane chunk's padding lanes read on past the last real row.
  const std::int64_t entries = max_distance + 1 + kernels::kAttnAlign;
  rows.psi.resize(static_cast<std::size_t>(entries));
  rows.dpsi_dc.resize(static_cast<std::size_t>(entries));
  for (std::int64_t t = 0; t < entries; ++t) {
    const auto d = static_cast<double>(t);
    rows.psi[static_cast<std::size_t>(t)] = std::log1p(fire.c() * d);
    rows.dpsi_dc[static_cast<std::size_t>(t)] = d / (1 + fire.c() * d);
  }
  // 1/ψ(max(L, q)) per query position (and the padding lanes past the last one), when that range
  // is of a sensible size too (else add_chunk declines and rows take add_row).
  rows.inv_norm_first = q_min;
  if (q_max - q_min < AttentionPlan::kMaxBiasTable)
    rows.inv_norm.resize(static_cast<std::size_t>(q_max - q_min + 1 + kernels::kAttnAlign));
  for (std::size_t t = 0; t < rows.inv_norm.size(); ++t) {
    const auto q = static_cast<double>(q_min + static_cast<std::int64_t>(t));
    rows.inv_norm[t] = 1.0 / std::log1p(fire.c() * std::max(fire.threshold(), q));
  }
  return rows;
}

// A group's FIRE: its rows and the layout of a unit's slot, [s0 | s1] per piece and head, then
// ∂L/∂c and ∂L/∂L (FireRows::accumulate_row).
struct FireGroup {
  FireRows rows;
  std::int64_t heads = 0, pieces = 0;
  std::int64_t slot_size() const { return 2 * pieces * heads + 2; }
};

class FireTerm final : public GroupTerm<FireGroup> {
 public:
  // The bias of group `group`: `fire` is the plan's own (FireRows keeps a pointer).
  FireTerm(const AttentionPlan& p, std::int64_t group, const FireParams& fire) : GroupTerm(p, group) {
    table_.rows = fire_rows_for(fire, p.position_range);
    table_.heads = fire.heads();
    table_.pieces = static_cast<std::int64_t>(fire.kinks().size()) + 1;
  }

  std::int64_t bytes() const override {
    const FireRows& r = table_.rows;
    return static_cast<std::int64_t>((r.psi.size() + r.dpsi_dc.size() + r.inv_norm.size()) * sizeof(double));
  }
  // A bias of the rows' positions alone, added to any layout of rows (as the tabulated biases).
  bool allows_wide_decode() const override { return true; }
  // FIRE's MLP may rise anywhere along a row, so it brings no bound: its heads' tiles all run (as
  // those of any bias that is not tabulated), and the other heads keep their skip.
  bool keeps_tile_bound() const override { return true; }
  double tile_max(const Sequence& /* seq */, std::int64_t h, std::int64_t /* i */, std::int64_t /* k_first */,
                  std::int64_t /* k_last */) const override {
    return of_head(h) != nullptr ? std::numeric_limits<double>::infinity() : 0.0;
  }
  void add_scores(const TermTile& tile, float* st, TermState& s) const override;
  std::int64_t unit_gradient_size() const override { return table_.slot_size(); }
  void backward_tile(const TermTile& tile, const float* pt, const float* dst, TermState& s) const override;
  void reduce(std::span<const TermUnit> units, AttentionGradients& grads) const override;
};

// Lane chunks of one head at consecutive positions take the vector kernel (add_chunk), other
// rows add_row over consecutive keys, and any other tile is evaluated per element (as bias_value).
void FireTerm::add_scores(const TermTile& tile, float* st, TermState& /* s */) const {
  const RowBlock& rb = *tile.rows;
  const std::int64_t keys = tile.keys, w = rb.width;
  const std::int64_t* kpos = tile.kpos;
  const bool keys_consecutive = positions_consecutive(kpos, keys);
  for (std::int64_t c = 0; c < w / kAttnAlign; ++c) {
    const std::int64_t r0 = c * kAttnAlign;
    const std::int64_t h0 = rb.head[static_cast<std::size_t>(r0)];
    if (h0 < 0 && !rb.compact) continue;
    if (h0 >= 0 && rb.chunk_uniform[static_cast<std::size_t>(c)] && keys_consecutive) {
      const FireGroup* g = of_head(h0);
      if (g == nullptr) continue;
      if (g->rows.add_chunk(local_head(h0), rb.head.data() + r0, rb.lo.data() + r0, rb.hi.data() + r0,
                            rb.position[static_cast<std::size_t>(r0)], tile.k0, kpos[0], keys, st + r0, w)) {
        continue;
      }
    }
    for (std::int64_t r = r0; r < r0 + kAttnAlign; ++r) {
      const std::int64_t h = rb.head[static_cast<std::size_t>(r)];
      const FireGroup* g = h >= 0 ? of_head(h) : nullptr;
      if (g == nullptr) continue;
      const std::int64_t qp = rb.position[static_cast<std::size_t>(r)], lh = local_head(h);
      if (keys_consecutive && g->rows.add_row(lh, qp, kpos[0], keys, st + r, w)) continue;
      const FireParams& fire = *g->rows.params;
      for (std::int64_t j = 0; j < keys; ++j)
        st[j * w + r] += static_cast<float>(fire.mlp(lh, fire.normalized_distance(qp, kpos[j])) + 0.0);
    }
  }
}

void FireTerm::backward_tile(const TermTile& tile, const float* /* pt */, const float* dst, TermState& s) const {
  if (s.unit_grads == nullptr) return;
  const RowBlock& rb = *tile.rows;
  const std::int64_t keys = tile.keys, w = rb.width;
  const std::int64_t* kpos = tile.kpos;
  const auto moments = [&](const FireGroup& g) {
    double* at = s.unit_grads;
    const std::int64_t n = g.pieces * g.heads;
    return std::array<double*, 4>{at, at + n, at + 2 * n, at + 2 * n + 1};
  };
  // Lane chunks first (the vector path); `done` marks them for the rows below.
  std::uint64_t done = 0;  // bit c: chunk c done (row blocks hold at most 64 chunks here)
  const bool keys_consecutive = positions_consecutive(kpos, keys);
  for (std::int64_t c = 0; c < w / kAttnAlign && c < 64 && keys_consecutive; ++c) {
    const std::int64_t r0 = c * kAttnAlign;
    const std::int64_t h0 = rb.head[static_cast<std::size_t>(r0)];
    if (h0 < 0 || !rb.chunk_uniform[static_cast<std::size_t>(c)]) continue;
    const FireGroup* g = of_head(h0);
    if (g == nullptr) continue;
    const auto m = moments(*g);
    if (g->rows.accumulate_chunk(local_head(h0), g->heads, rb.head.data() + r0, rb.lo.data() + r0, rb.hi.data() + r0,
                                 rb.position[static_cast<std::size_t>(r0)], tile.k0, kpos, keys, dst + r0, w, m[0],
                                 m[1], m[2], m[3])) {
      done |= std::uint64_t{1} << c;
    }
  }
  for (std::int64_t r = 0; r < w; ++r) {
    const std::int64_t h = rb.head[static_cast<std::size_t>(r)];
    if (h < 0 || (r / kAttnAlign < 64 && (done >> (r / kAttnAlign) & 1) != 0)) continue;
    const FireGroup* g = of_head(h);
    if (g == nullptr) continue;
    const auto m = moments(*g);
    g->rows.accumulate_row(local_head(h), g->heads, rb.position[static_cast<std::size_t>(r)], kpos, keys, dst + r, w,
                           m[0], m[1], m[2], m[3]);
  }
}

// The units' slots summed in unit order, then the moments contracted through the MLP.
void FireTerm::reduce(std::span<const TermUnit> units, AttentionGradients& grads) const {
  const std::int64_t size = table_.slot_size();
  std::vector<double>& total = zeroed_doubles(CallBuffer::kTermTotals, static_cast<std::size_t>(size));
  for (const TermUnit& u : units) {
    for (std::int64_t t = 0; t < size; ++t) total[static_cast<std::size_t>(t)] += u.slot[t];
  }
  const FireParams& fire = *table_.rows.params;
  const double* at = total.data();
  const std::int64_t n = table_.pieces * table_.heads;
  FireGradients contracted(fire);
  fire_contract_moments(fire, at, at + n, contracted);
  contracted.c = at[2 * n];
  contracted.threshold = at[2 * n + 1];
  add_flat(contracted.flat(), grads.groups[static_cast<std::size_t>(group_)].bias);
}

}  // namespace

}  // namespace posenc::detail

namespace posenc {

std::unique_ptr<detail::ScoreTerm> detail::fused_form(const FireParams& fire, const AttentionPlan& plan,
                                                      std::int64_t group) {
  return std::make_unique<FireTerm>(plan, group, fire);
}

}  // namespace posenc
