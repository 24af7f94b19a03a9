// FIRE's rows in the fused attention (FireRows, attention_plan.hpp): biases and backward moments
// of a row or a lane chunk from ψ tables, as the per-element definition computes them.
#include "attention/attention_plan.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <string>
#include <variant>

#include "bias_checks.hpp"
#include "kernels/attention/attention_kernels.hpp"
#include "posenc/error.hpp"
#include "rotary_checks.hpp"

namespace posenc::detail {

namespace {

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

}  // namespace

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

}  // namespace posenc::detail
