// RoPE (posenc/rotary.hpp) as the fused attention's query/key transform (attention/transforms.hpp).
#include <cmath>
#include <string>
#include <vector>

#include "attention/transforms.hpp"
#include "posenc/error.hpp"
#include "rotary_checks.hpp"

namespace posenc::detail {

// RoPE's tables for the table rows (QKTables): [cos | sin] per row, ζ^(±e) folded in under xPos.
QKTables qk_tables(const RotaryQK& rope, const TransformRows& r) {
  QKTables t;
  const std::vector<std::int64_t>& table_ids = r.table_ids;
  const Positions& table_positions = r.table_positions;
  const std::int64_t p_max = r.p_max;
  const auto rows = static_cast<std::int64_t>(table_ids.size());
  const RopeParams& rp = rope.params;
  if (rp.head_dim() != r.head_dim) {
    throw Error(r.where, (r.name + ".params.head_dim").c_str(), std::to_string(rp.head_dim()),
                "the head_dim of q, " + std::to_string(r.head_dim));
  }
  if (rp.xpos()) {
    check_xpos_range(rp, r.q_positions, r.batch_rows, r.q_len);
    check_xpos_range(rp, r.k_positions, r.batch_rows, r.k_len);
  }
  t.kind = QKTables::kRope;
  t.transform_keys = !rope.keys_rotated;
  t.interleaved = rp.layout() == RopeLayout::kInterleaved;
  t.half = rp.rotary_dim() / 2;
  t.offset = rp.rotary_offset();
  const std::int64_t half = t.half;
  std::vector<double, TableAllocator<double>> c64, s64;
  TableFloats c32, s32;
  if (rp.xpos()) {
    c64.resize(static_cast<std::size_t>(rows * half));
    s64.resize(c64.size());
    rope_cos_sin(rp, table_positions, TensorView::of(c64.data(), {rows, half}),
                 TensorView::of(s64.data(), {rows, half}), rope.seq_len > 0 ? rope.seq_len : p_max + 1);
  } else {
    c32.resize(static_cast<std::size_t>(rows * half));
    s32.resize(c32.size());
    rope_cos_sin(rp, table_positions, TensorView::of(c32.data(), {rows, half}),
                 TensorView::of(s32.data(), {rows, half}), rope.seq_len > 0 ? rope.seq_len : p_max + 1);
  }
  t.q_cos_sin.resize(static_cast<std::size_t>(rows * 2 * half));
  if (rp.xpos()) t.k_cos_sin.resize(t.q_cos_sin.size());
#pragma omp parallel for schedule(static) num_threads(threads_for(rows* half*(rp.xpos() ? 64 : 2)))
  for (std::int64_t row = 0; row < rows; ++row) {
    const double e = rp.xpos_exponent(static_cast<double>(table_ids[static_cast<std::size_t>(row)]));
    for (std::int64_t i = 0; i < half; ++i) {
      const auto at = static_cast<std::size_t>(row * half + i);
      const auto out = static_cast<std::size_t>(row * 2 * half + i);
      if (!rp.xpos()) {
        t.q_cos_sin[out] = c32[at];
        t.q_cos_sin[out + static_cast<std::size_t>(half)] = s32[at];
        continue;
      }
      // xPos (rotary.hpp): ζ_i^(+e) on queries, ζ_i^(−e) on keys.
      const double zeta = rp.xpos_zeta(i);
      const double up = std::pow(zeta, e), down = std::pow(zeta, -e);
      t.q_cos_sin[out] = static_cast<float>(c64[at] * up);
      t.q_cos_sin[out + static_cast<std::size_t>(half)] = static_cast<float>(s64[at] * up);
      t.k_cos_sin[out] = static_cast<float>(c64[at] * down);
      t.k_cos_sin[out + static_cast<std::size_t>(half)] = static_cast<float>(s64[at] * down);
    }
  }
  return t;
}

}  // namespace posenc::detail
