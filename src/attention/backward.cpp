// The engine's backward pass: units of (sequence, KV head[, query range]), key tiles outer, row
// blocks inner; parameter gradients summed in a fixed order.
#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <type_traits>
#include <utility>

#include "attention/engine.hpp"
#include "internal.hpp"
#include "kernels/attention/attention_kernels.hpp"
#include "posenc/error.hpp"

namespace posenc::detail {

// ─── Backward ────────────────────────────────────────────────────────────────────────────────

AttentionStats AttentionPlan::backward(ConstTensorView out, ConstTensorView lse, ConstTensorView d_out, TensorView dq,
                                       TensorView dk, TensorView dv, AttentionGradients* grads) const {
  const HeadsGrid og = check_output_tokens(kWhere, "out", out, qg);
  check_dtype(kWhere, "out", out.dtype(), dtype);
  const HeadsGrid dog = check_output_tokens(kWhere, "d_out", d_out, qg);
  check_dtype(kWhere, "d_out", d_out.dtype(), dtype);
  check_lse(lse, false);
  const bool want_dq = dq.rank() > 0, want_dk = dk.rank() > 0, want_dv = dv.rank() > 0;
  HeadsGrid dqg, dkg, dvg;
  if (want_dq) {
    dqg = check_output_tokens(kWhere, "dq", ConstTensorView(dq), qg);
    check_dtype(kWhere, "dq", dq.dtype(), dtype);
    check_writable(kWhere, "dq", ConstTensorView(dq));
  }
  if (want_dk) {
    dkg = check_output_tokens(kWhere, "dk", ConstTensorView(dk), kg);
    check_dtype(kWhere, "dk", dk.dtype(), dtype);
    check_writable(kWhere, "dk", ConstTensorView(dk));
  }
  if (want_dv) {
    dvg = check_output_tokens(kWhere, "dv", ConstTensorView(dv), vg);
    check_dtype(kWhere, "dv", dv.dtype(), dtype);
    check_writable(kWhere, "dv", ConstTensorView(dv));
  }
  if (grads != nullptr) check_gradients(*grads);
  check_disjoint({{"dq", dq}, {"dk", dk}, {"dv", dv}},
                 {{"q", spec.q}, {"k", spec.k}, {"v", spec.v}, {"out", out}, {"lse", lse}, {"d_out", d_out}});
  const bool want_bias_grads = grads != nullptr && any_trainable_bias;
  // Units: (sequence, KV head, query range). A sequence's queries are split into ranges only when
  // there are fewer than kSplitBelow (sequence, KV head) pairs, so that batch 1 with few KV heads
  // still spreads over the cores; ranges hold at least kMinRangeQueries queries. The rule depends
  // on the shapes only, never on the thread count, so results stay bitwise the same for any
  // number of threads. A split unit owns its dQ rows and its parameter-gradient slots as before,
  // and leaves dK, dV for the keys its queries see in `kv_parts` (f32, [dK rows | dV rows]);
  // those are summed per key in range order afterwards. (Splitting the keys instead would make
  // every unit load and transpose all the queries it needs: measured 30% slower per thread.)
  // Transformer-XL runs its row blocks outer over all keys and is not split.
  constexpr std::int64_t kSplitBelow = 8, kMinRangeQueries = 256;
  struct Unit {
    std::int64_t seq, kvh, i0, count, key_lo, key_hi;
    std::int64_t part;  // offset of its dK, dV rows in kv_parts, or −1: stored directly
  };
  std::vector<Unit> units;
  std::int64_t pairs = 0;
  for (const Sequence& seq : sequences) pairs += seq.lq > 0 && seq.lk > 0 ? kv_heads : 0;
  const std::int64_t want_ranges = any_xl || pairs >= kSplitBelow || pairs == 0 ? 1 : (kSplitBelow + pairs - 1) / pairs;
  std::int64_t part_floats = 0;
  {
    RowBlock probe;
    for (std::int64_t si = 0; si < static_cast<std::int64_t>(sequences.size()); ++si) {
      const Sequence& seq = sequences[static_cast<std::size_t>(si)];
      if (seq.lq == 0 || seq.lk == 0) continue;
      const std::int64_t ranges = std::max<std::int64_t>(1, std::min(want_ranges, seq.lq / kMinRangeQueries));
      for (std::int64_t kvh = 0; kvh < kv_heads; ++kvh) {
        // Latest queries first: under a causal mask they see the most keys, and the dynamic
        // schedule balances better with the large units at the front.
        for (std::int64_t r = ranges - 1; r >= 0; --r) {
          const std::int64_t i0 = r * seq.lq / ranges, i1 = (r + 1) * seq.lq / ranges;
          if (ranges == 1) {
            units.push_back({si, kvh, 0, seq.lq, 0, seq.lk, -1});
            continue;
          }
          layout_rows(seq, kvh, i0, i1 - i0, false, probe);
          const std::int64_t lo = probe.key_lo, hi = std::max(probe.key_lo, probe.key_hi);
          units.push_back({si, kvh, i0, i1 - i0, lo, hi, (want_dk || want_dv) && hi > lo ? part_floats : -1});
          if ((want_dk || want_dv) && hi > lo) part_floats += 2 * (hi - lo) * dim;
        }
      }
    }
  }
  std::vector<float> kv_parts(static_cast<std::size_t>(part_floats));
  // Per unit, its share of the bias parameters' gradients (summed in unit order afterwards).
  const std::int64_t grad_size = want_bias_grads ? bias_gradient_size() : 0;
  std::vector<double>& unit_grads =
      zeroed_doubles(CallBuffer::kUnitBias, static_cast<std::size_t>(grad_size) * units.size());
  const std::int64_t shaw_size = grads != nullptr && any_shaw ? shaw_grad_offset.back() : 0;
  std::vector<double>& unit_shaw_grads =
      zeroed_doubles(CallBuffer::kUnitShaw, static_cast<std::size_t>(shaw_size) * units.size());
  const std::int64_t xl_size = grads != nullptr ? xl_unit_gradient_size() : 0;
  std::vector<double>& unit_xl_grads =
      zeroed_doubles(CallBuffer::kUnitXl, static_cast<std::size_t>(xl_size) * units.size());
  const std::int64_t tupe_size = grads != nullptr ? tupe_unit_gradient_size() : 0;
  std::vector<double>& unit_tupe_grads =
      zeroed_doubles(CallBuffer::kUnitTupe, static_cast<std::size_t>(tupe_size) * units.size());
  const auto flops = static_cast<std::int64_t>(batch) * q_len * k_len * heads * dim;
  const int threads = std::min<int>(threads_for(flops / 16), static_cast<int>(std::max<std::size_t>(units.size(), 1)));
  std::int64_t scratch_bytes = 0;
  std::int64_t steps = 0, skipped_steps = 0;
  BackwardCall call;
  call.out = out;
  call.lse = lse;
  call.d_out = d_out;
  call.og = og;
  call.dog = dog;
  call.dq = want_dq ? &dq : nullptr;
  call.dk = want_dk ? &dk : nullptr;
  call.dv = want_dv ? &dv : nullptr;
  call.dqg = dqg;
  call.dkg = dkg;
  call.dvg = dvg;
#pragma omp parallel num_threads(threads) reduction(+ : scratch_bytes, steps, skipped_steps)
  {
    const FlushDenormals flush;
    AttentionUnitScratch& s = unit_scratch();
    s.steps = s.skipped_steps = 0;
    RowBlock rb;
#pragma omp for schedule(dynamic, 1)
    for (std::size_t u = 0; u < units.size(); ++u) {
      BackwardUnit unit;
      unit.seq = &sequences[static_cast<std::size_t>(units[u].seq)];
      unit.kvh = units[u].kvh;
      unit.i0 = units[u].i0;
      unit.count = units[u].count;
      unit.bias_grads = want_bias_grads ? unit_grads.data() + u * static_cast<std::size_t>(grad_size) : nullptr;
      unit.shaw_grads = shaw_size > 0 ? unit_shaw_grads.data() + u * static_cast<std::size_t>(shaw_size) : nullptr;
      unit.xl_grads = xl_size > 0 ? unit_xl_grads.data() + u * static_cast<std::size_t>(xl_size) : nullptr;
      unit.tupe_grads = tupe_size > 0 ? unit_tupe_grads.data() + u * static_cast<std::size_t>(tupe_size) : nullptr;
      unit.kv_part = units[u].part >= 0 ? kv_parts.data() + units[u].part : nullptr;
      unit.part_key_lo = units[u].key_lo;
      unit.part_key_hi = units[u].key_hi;
      backward_unit(call, unit, s, rb);
    }
    scratch_bytes += s.bytes();
    steps += s.steps;
    skipped_steps += s.skipped_steps;
  }
  AttentionStats stats;
  stats.tiles = steps;
  stats.skipped = skipped_steps;
  if (part_floats > 0) {
    // dK, dV of the split units: each key's rows summed over the ranges whose queries see it, in
    // unit order (fp64), then added into dk, dv. Keys are independent, so this loop's thread count
    // does not change a bit.
    std::size_t u0 = 0;
    while (u0 < units.size()) {
      std::size_t u1 = u0 + 1;
      while (u1 < units.size() && units[u1].seq == units[u0].seq && units[u1].kvh == units[u0].kvh) ++u1;
      const Sequence& seq = sequences[static_cast<std::size_t>(units[u0].seq)];
      const std::int64_t kvh = units[u0].kvh;
      if (units[u0].i0 != 0 || units[u0].count != seq.lq) {
#pragma omp parallel num_threads(threads)
        {
          std::vector<double> sum(static_cast<std::size_t>(2 * dim));
          std::vector<float> row(static_cast<std::size_t>(2 * dim));
#pragma omp for schedule(static)
          for (std::int64_t key = 0; key < seq.lk; ++key) {
            std::fill(sum.begin(), sum.end(), 0.0);
            bool seen = false;
            for (std::size_t u = u0; u < u1; ++u) {
              const Unit& un = units[u];
              if (un.part < 0 || key < un.key_lo || key >= un.key_hi) continue;
              seen = true;
              const float* dk_row = kv_parts.data() + un.part + (key - un.key_lo) * dim;
              const float* dv_row = dk_row + (un.key_hi - un.key_lo) * dim;
              for (std::int64_t t = 0; t < dim; ++t) {
                sum[static_cast<std::size_t>(t)] += dk_row[t];
                sum[static_cast<std::size_t>(dim + t)] += dv_row[t];
              }
            }
            if (!seen) continue;
            for (std::int64_t t = 0; t < 2 * dim; ++t)
              row[static_cast<std::size_t>(t)] = static_cast<float>(sum[static_cast<std::size_t>(t)]);
            if (want_dk) store_row_to(row.data(), dk, dkg, seq.b, seq.k0 + key, kvh);
            if (want_dv) store_row_to(row.data() + dim, dv, dvg, seq.b, seq.k0 + key, kvh);
          }
        }
      }
      u0 = u1;
    }
  }
  if (want_bias_grads) {
    std::vector<double> total(static_cast<std::size_t>(grad_size), 0.0);
    for (std::size_t u = 0; u < units.size(); ++u) {
      for (std::int64_t t = 0; t < grad_size; ++t)
        total[static_cast<std::size_t>(t)] +=
            unit_grads[u * static_cast<std::size_t>(grad_size) + static_cast<std::size_t>(t)];
    }
    scatter_bias_gradients(total, *grads);
  }
  if (shaw_size > 0) {
    // Units in order; then each group's [key | value] block into its tables' gradients.
    std::vector<double> total(static_cast<std::size_t>(shaw_size), 0.0);
    for (std::size_t u = 0; u < units.size(); ++u) {
      for (std::int64_t t = 0; t < shaw_size; ++t) {
        total[static_cast<std::size_t>(t)] +=
            unit_shaw_grads[u * static_cast<std::size_t>(shaw_size) + static_cast<std::size_t>(t)];
      }
    }
    for (std::size_t g = 0; g < grads->groups.size(); ++g) {
      GroupGradients& gg = grads->groups[g];
      const double* at = total.data() + shaw_grad_offset[g];
      for (std::size_t t = 0; t < gg.shaw_key_table.size(); ++t) gg.shaw_key_table[t] += at[t];
      for (std::size_t t = 0; t < gg.shaw_value_table.size(); ++t)
        gg.shaw_value_table[t] += at[gg.shaw_key_table.size() + t];
    }
  }
  // The units' XL and TUPE slots summed per KV head, units in order (sequence order).
  // Each element sums its units in order, so splitting the elements over the cores keeps the bits.
  const auto sum_per_kv_head = [&](const std::vector<double>& parts, std::int64_t size,
                                   CallBuffer buffer) -> const std::vector<double>& {
    std::vector<double>& totals = zeroed_doubles(buffer, static_cast<std::size_t>(size * kv_heads));
    constexpr std::int64_t kBlock = 4096;
    const std::int64_t blocks = (size + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) num_threads(threads_for(size* static_cast <std::int64_t>(units.size())))
    for (std::int64_t b = 0; b < blocks; ++b) {
      const std::int64_t t0 = b * kBlock, t1 = std::min(size, t0 + kBlock);
      for (std::size_t u = 0; u < units.size(); ++u) {
        double* total = totals.data() + units[u].kvh * size;
        const double* part = parts.data() + u * static_cast<std::size_t>(size);
        for (std::int64_t t = t0; t < t1; ++t) total[t] += part[t];
      }
    }
    return totals;
  };
  if (xl_size > 0) finish_xl_gradients(sum_per_kv_head(unit_xl_grads, xl_size, CallBuffer::kXlTotals), *grads);
  if (tupe_size > 0)
    finish_tupe_gradients(sum_per_kv_head(unit_tupe_grads, tupe_size, CallBuffer::kTupeTotals), *grads);
  stats.workspace_bytes = scratch_bytes + table_bytes() +
                          static_cast<std::int64_t>((unit_grads.size() + unit_shaw_grads.size() + unit_xl_grads.size() +
                                                     unit_tupe_grads.size()) *
                                                    sizeof(double)) +
                          static_cast<std::int64_t>(kv_parts.size() * sizeof(float));
  return stats;
}

void AttentionPlan::backward_unit(const BackwardCall& call, const BackwardUnit& unit, AttentionUnitScratch& s,
                                  RowBlock& rb) const {
  const Sequence& seq = *unit.seq;
  const std::int64_t kvh = unit.kvh, i0 = unit.i0, count = unit.count;
  const ConstTensorView &out = call.out, &lse = call.lse, &d_out = call.d_out;
  const HeadsGrid &og = call.og, &dog = call.dog, &dqg = call.dqg, &dkg = call.dkg, &dvg = call.dvg;
  TensorView *dq = call.dq, *dk = call.dk, *dv = call.dv;
  double *unit_grads = unit.bias_grads, *unit_shaw_grads = unit.shaw_grads, *unit_xl_grads = unit.xl_grads,
         *unit_tupe_grads = unit.tupe_grads;
  float* kv_part = unit.kv_part;
  const std::int64_t part_key_lo = unit.part_key_lo, part_key_hi = unit.part_key_hi;
  const std::int64_t dp = dim_padded, d = dim;
  // The unit's rows (queries [i0, i0 + count) of the KV head's G heads), head-major, each head's
  // queries padded to the lane count.
  layout_rows(seq, kvh, i0, count, false, rb);
  const std::int64_t w = rb.width;
  grow(s.q, w * dp);
  const std::int64_t ldt = padded_stride(w), ldkv = padded_stride(dp);
  grow(s.qt, dp * ldt);
  grow(s.dout, w * dp);
  grow(s.doutt, dp * ldt);
  grow(s.dq, w * dp);
  grow(s.lse, w);
  grow(s.delta, w);
  grow(s.o, dp);
  std::fill(s.dq.begin(), s.dq.begin() + w * dp, 0.0f);
  const QKTables& tq = tables_of_head(kvh * group_size);
  for (std::int64_t r = 0; r < w; ++r) {
    float* qrow = s.q.data() + r * dp;
    float* drow = s.dout.data() + r * dp;
    const std::int64_t h = rb.head[static_cast<std::size_t>(r)];
    if (h < 0) {
      std::fill(qrow, qrow + dp, 0.0f);
      std::fill(drow, drow + dp, 0.0f);
      s.lse[static_cast<std::size_t>(r)] = 0.0f;
      s.delta[static_cast<std::size_t>(r)] = 0.0f;
    } else {
      const std::int64_t i = rb.query[static_cast<std::size_t>(r)];
      load_row(q_data, qg, seq.b, seq.q0 + i, h, qrow);
      transform_row(tq, true, q_table_row(seq, i), qrow, 1.0f);
      add_xl_u(h, qrow);
      for (std::int64_t t = 0; t < d; ++t) qrow[t] *= scale;
      load_row_as(d_out, dog, seq.b, seq.q0 + i, h, drow);
      load_row_as(out, og, seq.b, seq.q0 + i, h, s.o.data());
      double delta = 0;
      for (std::int64_t t = 0; t < d; ++t) delta += static_cast<double>(drow[t]) * s.o[static_cast<std::size_t>(t)];
      s.delta[static_cast<std::size_t>(r)] = static_cast<float>(delta);
      s.lse[static_cast<std::size_t>(r)] = read_lse(lse, seq, h, i);
    }
    for (std::int64_t t = 0; t < d; ++t) {
      s.qt[static_cast<std::size_t>(t * ldt + r)] = qrow[t];
      s.doutt[static_cast<std::size_t>(t * ldt + r)] = drow[t];
    }
  }
  const bool keys_transformed = tq.kind != QKTables::kNone && tq.transform_keys;
  // The far-tile skip (tile_vanishes, against each row's lse): the rows' |scale·q|, and the
  // current tile's largest |k| once a row block asks for it (−1: not yet).
  double tile_key_norm = -1;
  if (skip_far_tiles) {
    grow(s.row_norm, w);
    row_norms(s.q.data(), dp, w, d, s.row_norm.data());
  }
  if (any_shaw) {
    // Shaw: q·a^K and dO·a^V per row and table row; the tiles then sum dS and P per table row.
    for (auto* buffer : {&s.shaw_key_dots, &s.shaw_value_dots, &s.shaw_grads, &s.shaw_probs})
      grow(*buffer, w * shaw_width);
    shaw_row_dots(rb, s.q.data(), dp, s.qt.data(), ldt, false, s.shaw_key_dots.data(), w);
    shaw_row_dots(rb, s.dout.data(), dp, s.doutt.data(), ldt, true, s.shaw_value_dots.data(), w);
    std::fill(s.shaw_grads.begin(), s.shaw_grads.begin() + w * shaw_width, 0.0f);
    std::fill(s.shaw_probs.begin(), s.shaw_probs.begin() + w * shaw_width, 0.0f);
  }
  grow(s.k, backward_key_tile * ldkv);
  grow(s.v, backward_key_tile * ldkv);
  grow(s.dk, backward_key_tile * dp);
  grow(s.dv, backward_key_tile * dp);
  // Row blocks of at most query_block·G rows share one key tile pass.
  const std::int64_t rows_per_block = round_up(query_block * group_size, kAttnAlign);
  grow(s.st, backward_key_tile * rows_per_block);
  grow(s.dpt, backward_key_tile * rows_per_block);
  grow(s.kpos, backward_key_tile);
  // Bias-gradient histograms over δ per head of the unit (distance tables) and the direct path.
  if (unit_grads != nullptr) {
    grow(s.hist, group_size * hist_width);
    std::fill(s.hist.begin(), s.hist.begin() + group_size * hist_width, 0.0);
  }
  if (any_tupe) {
    tupe_load_rows(rb, s, true);
    if (unit_tupe_grads != nullptr) {  // dPQ and dPK serve only the parameters' gradients
      grow(s.tupe_dpq, w * dp);
      std::fill(s.tupe_dpq.begin(), s.tupe_dpq.begin() + w * dp, 0.0f);
      grow(s.tupe_dpk_positions, tupe_count * group_size * dp);
      std::fill(s.tupe_dpk_positions.begin(), s.tupe_dpk_positions.begin() + tupe_count * group_size * dp, 0.0f);
    }
  }
  if (unit_xl_grads != nullptr) {
    grow(s.xl_dp, xl_width * group_size * dp);
    std::fill(s.xl_dp.begin(), s.xl_dp.begin() + xl_width * group_size * dp, 0.0f);
  }
  // Loads the keys [k0, k0 + keys) (transformed) and values into s.k, s.v and their positions into
  // s.kpos.
  const auto load_keys = [&](std::int64_t k0, std::int64_t keys) {
    for (std::int64_t j = 0; j < keys; ++j) {
      float* krow = s.k.data() + j * ldkv;
      load_row(k_data, kg, seq.b, seq.k0 + k0 + j, kvh, krow);
      if (keys_transformed) transform_row(tq, false, k_table_row(seq, k0 + j), krow, 1.0f);
      load_row(v_data, vg, seq.b, seq.k0 + k0 + j, kvh, s.v.data() + j * ldkv);
      s.kpos[static_cast<std::size_t>(j)] = k_position(seq, k0 + j);
    }
  };
  // Whether any row of [r0, r0 + bw) sees the keys [k0, k0 + keys), and whether all valid rows
  // see all of them.
  const auto coverage = [&](std::int64_t r0, std::int64_t bw, std::int64_t k0, std::int64_t keys, bool* full) {
    bool any = false;
    *full = true;
    for (std::int64_t r = r0; r < r0 + bw; ++r) {
      if (rb.head[static_cast<std::size_t>(r)] < 0) continue;
      const bool sees = rb.lo[static_cast<std::size_t>(r)] < k0 + keys && rb.hi[static_cast<std::size_t>(r)] > k0;
      any = any || sees;
      *full = *full && rb.lo[static_cast<std::size_t>(r)] <= k0 && rb.hi[static_cast<std::size_t>(r)] >= k0 + keys;
    }
    return any;
  };
  // One (key tile, row block) step: S, P, dP, dS and the products into dk, dv (rows for the tile's
  // keys), dq; the schemes' terms. XL's window (s.xl_lo, s.xl_span) must cover the pair.
  // k_rows, v_rows: the tile's key and value rows, ldkv apart; kpos: their positions.
  const auto step = [&](const RowBlock& sub, std::int64_t r0, std::int64_t k0, std::int64_t keys, bool full,
                        const float* k_rows, const float* v_rows, const std::int64_t* kpos, float* dk_rows,
                        float* dv_rows) {
    const std::int64_t bw = sub.width;
    ++s.steps;
    if (skip_far_tiles) {
      // Every probability 0: dS = 0 and the products would add only zeros.
      const auto [k_lo, k_hi] = std::minmax_element(kpos, kpos + keys);
      const bool vanishes = tile_vanishes(*this, sub, s.row_norm.data() + r0, s.lse.data() + r0, *k_lo, *k_hi, [&] {
        if (tile_key_norm < 0) tile_key_norm = row_norms(k_rows, ldkv, keys, d, nullptr);
        return tile_key_norm;
      });
      if (vanishes) {
        ++s.skipped_steps;
        return;
      }
    }
    // S^T = K·Q^T, biases, soft-cap, mask; dP^T = V·dO^T.
    kernels::attn_gemm(k_rows, ldkv, 1, s.qt.data() + r0, ldt, s.st.data(), bw, keys, bw, d, false);
    if (any_tupe) tupe_add_tile(sub, r0, ldt, keys, kpos, s, s.st.data());
    add_bias(seq, sub, k0, keys, kpos, s.st.data());
    if (any_shaw) shaw_add_rows(sub, keys, kpos, s.shaw_key_dots.data() + r0, w, s.st.data());
    if (any_xl) xl_add_rows(sub, keys, kpos, s.xl_lo, s.xl_span, s.xl_dots.data(), bw, s.st.data());
    if (mask.softcap > 0) kernels::attn_softcap_tile(s.st.data(), keys, bw, static_cast<float>(mask.softcap));
    if (!full) kernels::attn_mask_tile(s.st.data(), keys, bw, k0, sub.lo.data(), sub.hi.data());
    kernels::attn_gemm(v_rows, ldkv, 1, s.doutt.data() + r0, ldt, s.dpt.data(), bw, keys, bw, d, false);
    // Shaw's value term: dP_ij += dO_i·a^V[row].
    if (any_shaw) shaw_add_rows(sub, keys, kpos, s.shaw_value_dots.data() + r0, w, s.dpt.data());
    // P^T, dS^T (with the soft-cap's derivative).
    kernels::attn_backward_tile(s.st.data(), s.dpt.data(), keys, bw, s.lse.data() + r0, s.delta.data() + r0,
                                static_cast<float>(mask.softcap));
    if (any_shaw) {
      shaw_collect(sub, keys, kpos, s.dpt.data(), nullptr, s.shaw_grads.data() + r0, w);
      shaw_collect(sub, keys, kpos, s.st.data(), nullptr, s.shaw_probs.data() + r0, w);
    }
    if (any_xl) xl_collect(sub, keys, kpos, s.xl_lo, s.xl_span, s.dpt.data(), s.xl_sums.data(), bw);
    if (any_tupe) tupe_backward_tile(sub, r0, keys, kpos, kvh, unit_tupe_grads, s);
    // dV += P^T·dO, dK += dS^T·Q (Q carries the scale), dQ += dS·K.
    kernels::attn_gemm(s.st.data(), bw, 1, s.dout.data() + r0 * dp, dp, dv_rows, dp, keys, dp, bw, true);
    kernels::attn_gemm(s.dpt.data(), bw, 1, s.q.data() + r0 * dp, dp, dk_rows, dp, keys, dp, bw, true);
    kernels::attn_gemm(s.dpt.data(), 1, bw, k_rows, ldkv, s.dq.data() + r0 * dp, dp, bw, dp, keys, true);
    if (unit_grads != nullptr) accumulate_bias_gradients(seq, sub, k0, keys, kpos, s.dpt.data(), s, kvh, unit_grads);
  };
  // dK (rotated back; the query scale is already in it) and dV rows of keys [k0, k0 + keys).
  // A split unit writes them into its part instead (keys [part_key_lo, part_key_hi), dK rows then
  // dV rows), for backward() to sum over the ranges.
  const auto store_keys = [&](std::int64_t k0, std::int64_t keys, float* dk_rows, const float* dv_rows) {
    for (std::int64_t j = 0; j < keys; ++j) {
      float* dkrow = dk_rows + j * dp;
      if (kv_part != nullptr) {
        // A tile can reach past the keys the unit's rows see; those rows of dK, dV are 0 here.
        if (k0 + j < part_key_lo || k0 + j >= part_key_hi) continue;
        if (keys_transformed) transform_row(tq, false, k_table_row(seq, k0 + j), dkrow, -1.0f);
        float* part_row = kv_part + (k0 + j - part_key_lo) * d;
        std::copy(dkrow, dkrow + d, part_row);
        std::copy(dv_rows + j * dp, dv_rows + j * dp + d, part_row + (part_key_hi - part_key_lo) * d);
        continue;
      }
      if (dk != nullptr) {
        if (keys_transformed) transform_row(tq, false, k_table_row(seq, k0 + j), dkrow, -1.0f);
        store_row_to(dkrow, *dk, dkg, seq.b, seq.k0 + k0 + j, kvh);
      }
      if (dv != nullptr) store_row_to(dv_rows + j * dp, *dv, dvg, seq.b, seq.k0 + k0 + j, kvh);
    }
  };
  if (!any_xl) {
    // Key tiles outer: dk and dv finish per tile.
    for (std::int64_t k0 = 0; k0 < seq.lk; k0 += backward_key_tile) {
      const std::int64_t keys = std::min(backward_key_tile, seq.lk - k0);
      bool full = true;
      if (!coverage(0, w, k0, keys, &full)) continue;
      load_keys(k0, keys);
      tile_key_norm = -1;
      std::fill(s.dk.begin(), s.dk.begin() + keys * dp, 0.0f);
      std::fill(s.dv.begin(), s.dv.begin() + keys * dp, 0.0f);
      for (std::int64_t r0 = 0; r0 < w; r0 += rows_per_block) {
        const std::int64_t bw = std::min(rows_per_block, w - r0);
        if (!coverage(r0, bw, k0, keys, &full)) continue;
        RowBlock sub;
        rb.slice(r0, bw, sub);
        step(sub, r0, k0, keys, full, s.k.data(), s.v.data(), s.kpos.data(), s.dk.data(), s.dv.data());
      }
      store_keys(k0, keys, s.dk.data(), s.dv.data());
    }
  } else {
    // Transformer-XL: row blocks outer, so that each block's window of Qs·P(δ) dots and of dS sums
    // slides down the δ range with the tiles (as in forward) instead of being rebuilt per tile;
    // dk and dv accumulate for the whole sequence (rows in the same order as above). A window is
    // flushed — dQs += sumsᵀ·P, dP += sums·Qs — when it moves and after the last tile. The
    // sequence's keys and values are loaded once for all the row blocks (reloading them per block
    // cost a quarter of the time).
    constexpr std::int64_t kXlWindow = 1024;  // as forward_xl's window, for the same reason
    grow(s.k, seq.lk * ldkv);
    grow(s.v, seq.lk * ldkv);
    grow(s.kpos, seq.lk);
    load_keys(0, seq.lk);
    grow(s.dk, seq.lk * dp);
    grow(s.dv, seq.lk * dp);
    std::fill(s.dk.begin(), s.dk.begin() + seq.lk * dp, 0.0f);
    std::fill(s.dv.begin(), s.dv.begin() + seq.lk * dp, 0.0f);
    for (std::int64_t r0 = 0; r0 < w; r0 += rows_per_block) {
      const std::int64_t bw = std::min(rows_per_block, w - r0);
      RowBlock sub;
      rb.slice(r0, bw, sub);
      s.xl_span = 0;
      for (std::int64_t k0 = 0; k0 < seq.lk; k0 += backward_key_tile) {
        const std::int64_t keys = std::min(backward_key_tile, seq.lk - k0);
        bool full = true;
        if (!coverage(r0, bw, k0, keys, &full)) continue;
        const std::int64_t* kpos = s.kpos.data() + k0;
        std::int64_t lo = 0, hi = -1;
        if (!xl_tile_range(sub, keys, kpos, &lo, &hi)) {
          lo = hi = xl_delta_min;  // no XL row: an idle one-entry window
        }
        if (s.xl_span == 0 || lo < s.xl_lo || hi >= s.xl_lo + s.xl_span) {
          if (s.xl_span > 0) xl_backward_window(sub, r0, s.xl_lo, s.xl_span, kvh, unit_xl_grads, s);
          s.xl_lo = std::max(xl_delta_min, std::min(lo, hi - kXlWindow + 1));
          s.xl_span = hi - s.xl_lo + 1;
          grow(s.xl_dots, s.xl_span * bw);
          grow(s.xl_sums, s.xl_span * bw);
          std::fill(s.xl_sums.begin(), s.xl_sums.begin() + s.xl_span * bw, 0.0f);
          xl_window(sub, s.qt.data() + r0, ldt, s.xl_lo, s.xl_span, s.xl_dots.data(), bw);
        }
        step(sub, r0, k0, keys, full, s.k.data() + k0 * ldkv, s.v.data() + k0 * ldkv, kpos, s.dk.data() + k0 * dp,
             s.dv.data() + k0 * dp);
      }
      if (s.xl_span > 0) xl_backward_window(sub, r0, s.xl_lo, s.xl_span, kvh, unit_xl_grads, s);
    }
    for (std::int64_t k0 = 0; k0 < seq.lk; k0 += backward_key_tile) {
      store_keys(k0, std::min(backward_key_tile, seq.lk - k0), s.dk.data() + k0 * dp, s.dv.data() + k0 * dp);
    }
  }
  if (const ShawTables* block_tables = any_shaw ? shaw_of_block(rb) : nullptr; block_tables != nullptr) {
    const ShawTables* t = block_tables;
    // One group: matrix products. dL/dQs += dS-sumᵀ·a^K; the tables' gradients a^K += dS-sum·Qs,
    // a^V += P-sum·dO, summed in f32 over the unit's rows (in a fixed order) and added in fp64.
    kernels::attn_gemm(s.shaw_grads.data(), 1, w, t->key_padded.data(), dp, s.dq.data(), dp, w, dp, t->width, true);
    if (unit_shaw_grads != nullptr) {
      grow(s.dk, 2 * t->width * dp);
      float* key_part = s.dk.data();
      float* value_part = key_part + t->width * dp;
      kernels::attn_gemm(s.shaw_grads.data(), w, 1, s.q.data(), dp, key_part, dp, t->width, dp, w, false);
      kernels::attn_gemm(s.shaw_probs.data(), w, 1, s.dout.data(), dp, value_part, dp, t->width, dp, w, false);
      const std::int64_t h0 = rb.head[0] >= 0 ? rb.head[0] : kvh * group_size;
      double* key_grad =
          unit_shaw_grads + shaw_grad_offset[static_cast<std::size_t>(head_group[static_cast<std::size_t>(h0)])];
      double* value_grad = key_grad + t->width * d;
      for (std::int64_t u = 0; u < t->width; ++u) {
        for (std::int64_t e = 0; e < d; ++e) {
          key_grad[u * d + e] += key_part[u * dp + e];
          value_grad[u * d + e] += value_part[u * dp + e];
        }
      }
    }
  } else if (any_shaw) {
    // dL/dQs_r += Σ_u dS-sum[r][u]·a^K[u]; the tables' gradients: a^K[u] += Σ_r dS-sum·Qs_r,
    // a^V[u] += Σ_r P-sum·dO_r (fp64, rows in order).
    for (std::int64_t r = 0; r < w; ++r) {
      const std::int64_t h = rb.head[static_cast<std::size_t>(r)];
      const ShawTables* t = h < 0 ? nullptr : shaw_of_head(h);
      if (t == nullptr) continue;
      const float* ds = s.shaw_grads.data() + r;  // [u][r], stride w
      const float* ps = s.shaw_probs.data() + r;
      float* dq_row = s.dq.data() + r * dp;
      double* key_grad =
          unit_shaw_grads == nullptr
              ? nullptr
              : unit_shaw_grads + shaw_grad_offset[static_cast<std::size_t>(head_group[static_cast<std::size_t>(h)])];
      double* value_grad = key_grad == nullptr ? nullptr : key_grad + t->width * d;
      for (std::int64_t u = 0; u < t->width; ++u) {
        const float dsu = ds[u * w], psu = ps[u * w];
        const float* a = t->key.data() + u * d;
        for (std::int64_t e = 0; e < d; ++e) dq_row[e] += dsu * a[e];
        if (key_grad == nullptr) continue;
        for (std::int64_t e = 0; e < d; ++e) {
          key_grad[u * d + e] += static_cast<double>(dsu) * s.q[static_cast<std::size_t>(r * dp + e)];
          value_grad[u * d + e] += static_cast<double>(psu) * s.dout[static_cast<std::size_t>(r * dp + e)];
        }
      }
    }
  }
  // dQ: times the scale, rotated back. XL's du collects Σ d(q + u) per head.
  if (dq != nullptr || unit_xl_grads != nullptr) {
    double* dqs = unit_xl_grads == nullptr ? nullptr : unit_xl_grads + xl_width * group_size * (dp + 1);
    for (std::int64_t r = 0; r < w; ++r) {
      const std::int64_t h = rb.head[static_cast<std::size_t>(r)];
      if (h < 0) continue;
      const std::int64_t i = rb.query[static_cast<std::size_t>(r)];
      float* row = s.dq.data() + r * dp;
      for (std::int64_t t = 0; t < d; ++t) row[t] *= scale;
      transform_row(tq, true, q_table_row(seq, i), row, -1.0f);
      if (dqs != nullptr && xl_of_head(h) != nullptr) {
        for (std::int64_t t = 0; t < d; ++t) dqs[(h - kvh * group_size) * d + t] += static_cast<double>(row[t]);
      }
      if (dq != nullptr) store_row_to(row, *dq, dqg, seq.b, seq.q0 + i, h);
    }
  }
  if (unit_tupe_grads != nullptr) {
    // dPQ rows by position (the [CLS] query's is not used), and the tiles' dPK.
    for (std::int64_t r = 0; r < w; ++r) {
      const std::int64_t h = rb.head[static_cast<std::size_t>(r)];
      const TupeTables* t = h < 0 ? nullptr : tupe_of_head(h);
      const std::int64_t qp = rb.position[static_cast<std::size_t>(r)];
      if (t == nullptr || (t->cls_reset && qp == 0)) continue;
      double* to = unit_tupe_grads + ((qp - tupe_first) * group_size + (h - kvh * group_size)) * dp;
      for (std::int64_t e = 0; e < dp; ++e)
        to[e] += static_cast<double>(s.tupe_dpq[static_cast<std::size_t>(r * dp + e)]);
    }
    double* dpk = unit_tupe_grads + tupe_count * group_size * dp;
    for (std::int64_t e = 0; e < tupe_count * group_size * dp; ++e)
      dpk[e] += static_cast<double>(s.tupe_dpk_positions[static_cast<std::size_t>(e)]);
  }
  if (unit_xl_grads != nullptr) {
    const std::int64_t n = xl_width * group_size * dp;
    for (std::int64_t t = 0; t < n; ++t) unit_xl_grads[t] += static_cast<double>(s.xl_dp[static_cast<std::size_t>(t)]);
  }
  if (unit_grads != nullptr) finish_bias_gradients(s, kvh, unit_grads);
}

// XL's backward for a row block's window of dS sums over δ (collected by the steps):
//   dQs += sumsᵀ·P_h (into the unit's dq rows, which get the scale at the end),
//   dP_h += sums·Qs (the unit's table) and Σ dS per δ (for c_h) into the unit's gradients.
void AttentionPlan::xl_backward_window(const RowBlock& sub, std::int64_t r0, std::int64_t lo, std::int64_t span,
                                       std::int64_t kvh, double* unit_xl_grads, AttentionUnitScratch& s) const {
  const std::int64_t bw = sub.width, dp = dim_padded;
  for_each_xl_run(*this, sub, [&](std::int64_t ra, std::int64_t n, std::int64_t h) {
    const XlTables& t = *xl_of_head(h);
    const std::int64_t lh = xl_local_head(h), t0 = lo - xl_delta_min, g = h - kvh * group_size;
    const float* sums = s.xl_sums.data() + ra;
    kernels::attn_gemm(sums, 1, bw, t.p_row(t0, lh, dp), dp, s.dq.data() + (r0 + ra) * dp, dp, n, dp, span, true);
    if (unit_xl_grads == nullptr) return;
    kernels::attn_gemm(sums, bw, 1, s.q.data() + (r0 + ra) * dp, dp, s.xl_dp.data() + (t0 * group_size + g) * dp,
                       group_size * dp, span, dp, n, true);
    double* hist = unit_xl_grads + xl_width * group_size * dp + g * xl_width + t0;
    for (std::int64_t u = 0; u < span; ++u) {
      const float* row = sums + u * bw;
      double sum = 0;
      for (std::int64_t r = 0; r < n; ++r) sum += static_cast<double>(row[r]);
      hist[u] += sum;
    }
  });
}

}  // namespace posenc::detail
