// Helpers shared by the engine's parts (rows.cpp, forward.cpp, decode.cpp, backward.cpp) and the
// score terms (src/schemes/*_term.cpp): scratch growth, padded strides, the denormal flush, the
// far-tile bound, the runs of rows by head, a group's term tables and term tiles. Internal.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "attention/attention_plan.hpp"
#include "kernels/attention/attention_kernels.hpp"
#include "kernels/common/flush_denormals.hpp"

namespace posenc::detail {

using kernels::kAttnAlign;

inline constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline std::int64_t round_up(std::int64_t x, std::int64_t to) { return (x + to - 1) / to * to; }

// Row strides of the packed operands the matrix kernel streams (Qᵀ, dOᵀ: w rows wide; K, V
// tiles: Dp wide) get one extra cache line. At 128 rows or D = 128 a plain stride is 512 bytes,
// and [B, S, H, D] inputs have S-strides of H·D·4 bytes (4 KiB at H·D = 1024): the rows of an
// operand panel then fall into a few L1 sets, evict each other, and every block of the kernel
// reloads its panel from L2. S = 2048, H = 4, D = 128, causal forward, 1 thread: 43–45 ms with V
// packed at Dp + 16 and Qᵀ at w + 16, against 48–66 with V read in place and Qᵀ at w.
inline std::int64_t padded_stride(std::int64_t w) { return w + kAttnAlign; }

// Whether positions pos[0..n) run up by one (a tile's keys read a contiguous table slice).
inline bool positions_consecutive(const std::int64_t* pos, std::int64_t n) {
  for (std::int64_t j = 1; j < n; ++j) {
    if (pos[j] != pos[0] + j) return false;
  }
  return true;
}

template <class T, class Allocator>
inline void grow(std::vector<T, Allocator>& v, std::int64_t n) {
  if (static_cast<std::int64_t>(v.size()) < n) v.resize(static_cast<std::size_t>(n));
}

// ─── Non-finite values in partly masked tiles ────────────────────────────────────────────────
// A masked key's probability is exactly 0, but 0 · inf and 0 · NaN are NaN: a value that is not
// finite would reach, through the tile's matrix product, rows that the mask hides its key from.
// Partly masked tiles (the diagonal, a window's or chunk's edge) therefore check their value rows
// and, where one is not finite, sum over each row's visible keys only, as the reference does.
// The check reads the tile's values once; only partly masked tiles pay it.

// out[r][t] += Σ_j p[j·ldp + r]·v[j·ldv + t] over rows r of rb (block rows r_first + r) and the
// keys k_first + j they see (rb.lo <= key < rb.hi), t < cols: O += P·V without masked pairs.
void add_visible_values(const RowBlock& rb, std::int64_t r_first, std::int64_t rows, std::int64_t k_first,
                        std::int64_t keys, const float* p, std::int64_t ldp, const float* v, std::int64_t ldv,
                        std::int64_t cols, float* out, std::int64_t ldo);

// ─── Vanishing tiles ───────────────────────────────────────────────────────────────────────────
// Whether no row of rb can get a probability of at least FLT_MIN from keys at positions
// [k_lo, k_hi] (AttentionPlan::skip_far_tiles). Row r's logits there are at most
// (1 + 1e-3)·row_norm[r]·key_norm() + max b over the tile's δ (row_norm: |scale·q_r|), the 1e-3
// covering the f32 dot product's rounding (D·2^−24 < 2.5e-4 for D <= 4096) and a rotation's; the
// bias bound gets 1e-3 of itself plus 1 for its table's and the sum's rounding. Forward passes the
// running max m_r as row_max, backward the row's lse (>= the max); both flush exp(x) to 0 below
// x = −87.3, so a bound under row_max − 89 leaves 1.7 to spare: every probability of the tile is
// exactly 0, and skipping it changes no bit (for finite values). The bias bound is checked first;
// key_norm() (the tile's largest |k|) is called only when it passes.
// The keys [k_first, k_last] of `seq` are the tile's (by index, for the terms' tile_max): their
// bound joins the bias's (a head without a bias table: 0 plus the terms').
template <class KeyNorm>
bool tile_vanishes(const AttentionPlan& p, const Sequence& seq, const RowBlock& rb, const double* row_norm,
                   const float* row_max, std::int64_t k_lo, std::int64_t k_hi, std::int64_t k_first,
                   std::int64_t k_last, KeyNorm&& key_norm) {
  const auto rows_pass = [&](double norm) {
    for (std::int64_t r = 0; r < rb.width; ++r) {
      const std::int64_t h = rb.head[static_cast<std::size_t>(r)];
      if (h < 0) continue;
      const HeadBias& hb = p.head_bias[static_cast<std::size_t>(h)];
      double bias = 0;
      if (const float* max_from = p.tile_maxima(hb)) {
        const std::int64_t qp = rb.position[static_cast<std::size_t>(r)];
        const std::int64_t a = qp - k_hi - hb.delta_min, b = qp - k_lo - hb.delta_min;
        if (a < 0 || b >= hb.width) return false;
        bias = std::min(max_from[a], max_from[hb.width + b]);
      } else if (hb.kind != HeadBias::kNone) {
        return false;
      }
      for (const auto& term : p.terms)
        bias += term->tile_max(seq, h, rb.query[static_cast<std::size_t>(r)], k_first, k_last);
      const double bound = (1 + 1e-3) * row_norm[r] * norm + bias + 1e-3 * std::abs(bias) + 1.0;
      // A row that has no max yet (−inf) or a NaN norm fails here: the tile runs.
      if (!(bound < static_cast<double>(row_max[r]) - 89.0)) return false;
    }
    return true;
  };
  return rows_pass(0.0) && rows_pass(key_norm());
}

// The larger of a and b, NaN if either is (std::max would drop a NaN b): a NaN norm must fail the
// bound of tile_vanishes, so that a tile holding a NaN key runs.
inline double max_or_nan(double a, double b) {
  return std::isnan(a) || std::isnan(b) ? std::numeric_limits<double>::quiet_NaN() : std::max(a, b);
}

// Row norms |row| of `count` rows ld apart (D values each), in fp64, into out (unless null);
// returns the largest (NaN if any is). Four partial sums: one chain of adds waits out their
// latency at every element, which made the far-tile test of a 64-key tile cost more than the
// tile's products. The norms only bound logits (with a margin of 1e-3): any order of summation.
inline double row_norms(const float* rows, std::int64_t ld, std::int64_t count, std::int64_t d, double* out) {
  double largest = 0;
  for (std::int64_t r = 0; r < count; ++r) {
    const float* x = rows + r * ld;
    double part[4] = {0, 0, 0, 0};
    std::int64_t t = 0;
    for (; t + 4 <= d; t += 4) {
      for (int u = 0; u < 4; ++u) part[u] += static_cast<double>(x[t + u]) * x[t + u];
    }
    for (; t < d; ++t) part[0] += static_cast<double>(x[t]) * x[t];
    const double n2 = (part[0] + part[1]) + (part[2] + part[3]);
    if (out != nullptr) out[r] = std::sqrt(n2);
    largest = max_or_nan(largest, std::sqrt(n2));
  }
  return largest;
}

// Calls fn(first row, rows, head) for each run of lane chunks whose rows belong to one head that
// `has` the scheme (non-compact layouts pad every head's rows to whole lane chunks).
template <class Has, class Fn>
void for_each_head_run(const RowBlock& rb, Has&& has, Fn&& fn) {
  const auto chunk_head = [&](std::int64_t c) {
    for (std::int64_t t = 0; t < kAttnAlign; ++t) {
      const std::int64_t h = rb.head[static_cast<std::size_t>(c * kAttnAlign + t)];
      if (h >= 0) return has(h) ? h : std::int64_t{-1};
    }
    return std::int64_t{-1};
  };
  const std::int64_t chunks = rb.width / kAttnAlign;
  for (std::int64_t c = 0; c < chunks;) {
    const std::int64_t h = chunk_head(c);
    std::int64_t e = c + 1;
    while (h >= 0 && e < chunks && chunk_head(e) == h) ++e;
    if (h >= 0) fn(c * kAttnAlign, (e - c) * kAttnAlign, h);
    c = e;
  }
}
// A score term of one head group (HeadGroup::terms or the group's bias): its tables, and the
// heads it serves.
template <class Tables>
class GroupTerm : public ScoreTerm {
 protected:
  GroupTerm(const AttentionPlan& p, std::int64_t group) : p_(p), group_(group) {}
  std::int64_t group_of(std::int64_t h) const { return p_.head_group[static_cast<std::size_t>(h)]; }
  const Tables* of_head(std::int64_t h) const { return group_of(h) == group_ ? &table_ : nullptr; }
  std::int64_t local_head(std::int64_t h) const {
    return h - p_.group_first_head[static_cast<std::size_t>(group_of(h))];
  }
  // fn(first row, rows, head) for each run of lane chunks of one head that has the term.
  template <class Fn>
  void for_each_run(const RowBlock& rb, Fn&& fn) const {
    for_each_head_run(
        rb, [&](std::int64_t h) { return of_head(h) != nullptr; }, fn);
  }

  const AttentionPlan& p_;
  std::int64_t group_;
  Tables table_;
};

// The tile of `rows` (from row r0 of its block) against keys [k0, k0 + keys) at positions kpos.
inline TermTile term_tile(const Sequence& seq, const RowBlock& rows, std::int64_t r0, std::int64_t k0,
                          std::int64_t keys, const std::int64_t* kpos, bool decode) {
  TermTile tile;
  tile.seq = &seq;
  tile.rows = &rows;
  tile.r0 = r0;
  tile.k0 = k0;
  tile.keys = keys;
  tile.kpos = kpos;
  tile.decode = decode;
  return tile;
}

}  // namespace posenc::detail
