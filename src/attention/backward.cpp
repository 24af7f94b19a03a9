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
#include "posenc/runtime.hpp"

namespace posenc::detail {

namespace {

// Whether row r of rb takes part in the pair with key `key`: it sees the key, and its lse is not
// −inf (a row whose visible logits are all −inf outputs 0 and passes no gradient, like a row
// without keys).
bool pair_counts(const RowBlock& rb, const float* lse, std::int64_t r, std::int64_t key) {
  return rb.sees(r, key) && lse[r] != kNegInf;
}

// P^T and dS^T [keys][rb.width] of a tile: exactly 0 for the pairs that do not count (a NaN lse,
// delta or dP would otherwise leave NaN there).
void zero_masked_pairs(const RowBlock& rb, const float* lse, std::int64_t k_first, std::int64_t keys, float* pt,
                       float* dst) {
  const std::int64_t rows = rb.width;
  for (std::int64_t j = 0; j < keys; ++j) {
    for (std::int64_t r = 0; r < rows; ++r) {
      if (pair_counts(rb, lse, r, k_first + j)) continue;
      pt[j * rows + r] = 0.0f;
      dst[j * rows + r] = 0.0f;
    }
  }
}

// dV += P^T·dO, dK += dS^T·Q, dQ += dS·K over the visible pairs only (rows `cols` floats wide).
void visible_products(const RowBlock& rb, const float* lse, std::int64_t k_first, std::int64_t keys, const float* pt,
                      const float* dst, const float* dout, const float* q, const float* k, std::int64_t ldk,
                      std::int64_t cols, float* dv, float* dk, float* dq) {
  const std::int64_t rows = rb.width;
  for (std::int64_t j = 0; j < keys; ++j) {
    for (std::int64_t r = 0; r < rows; ++r) {
      if (!pair_counts(rb, lse, r, k_first + j)) continue;
      const float p = pt[j * rows + r], ds = dst[j * rows + r];
      for (std::int64_t t = 0; t < cols; ++t) {
        dv[j * cols + t] += p * dout[r * cols + t];
        dk[j * cols + t] += ds * q[r * cols + t];
        dq[r * cols + t] += ds * k[j * ldk + t];
      }
    }
  }
}

// Adds Σ_j P_ij·dP_ij over the visible keys of a tile to exact_delta for the block's rows listed
// in exact_rows (in the unit's row numbering; the tile holds rows [r0, r0 + rb.width)). st holds
// the masked logits S^T, dpt dP^T, both [keys][rb.width]; P_ij = exp(s_ij − lse_i) in fp64, and a
// visible P of 0 still multiplies (0·inf is NaN, as in the reference).
void sum_exact_delta(const RowBlock& rb, std::int64_t r0, std::int64_t k_first, std::int64_t keys, const float* st,
                     const float* dpt, const float* lse, std::span<const std::int64_t> exact_rows,
                     std::vector<double>& exact_delta) {
  const std::int64_t rows = rb.width;
  for (const std::int64_t row : exact_rows) {
    const std::int64_t r = row - r0;
    if (r < 0 || r >= rows) continue;
    double sum = 0;
    for (std::int64_t j = 0; j < keys; ++j) {
      if (!rb.sees(r, k_first + j)) continue;
      const double p = std::exp(static_cast<double>(st[j * rows + r]) - static_cast<double>(lse[row]));
      sum += p * static_cast<double>(dpt[j * rows + r]);
    }
    exact_delta[static_cast<std::size_t>(row)] += sum;
  }
}

// A backward call's units: (sequence, KV head, query range). A sequence's queries are split into
// ranges only when there are fewer than kSplitBelow (sequence, KV head) pairs, so that batch 1
// with few KV heads still spreads over the cores; ranges hold at least kMinRangeQueries queries.
// The rule depends on the shapes only, never on the thread count, so results stay bitwise the
// same for any number of threads. A split unit owns its dQ rows and its parameter-gradient slots
// as before, and leaves dK, dV for the keys its queries see in `kv_parts` (f32, [dK rows | dV
// rows]); those are summed per key in range order afterwards (sum_split_units). (Splitting the
// keys instead would make every unit load and transpose all the queries it needs: measured 30%
// slower per thread.) Terms that walk row blocks outer (Transformer-XL) run over all keys unsplit.
struct BackwardWork {
  struct Unit {
    std::int64_t seq, kvh, i0, count, key_lo, key_hi;
    std::int64_t part;  // offset of its dK, dV rows in kv_parts, or −1: stored directly
  };
  std::vector<Unit> units;
  std::vector<float> kv_parts;
  std::int64_t flops = 0;
};

BackwardWork plan_backward(const AttentionPlan& p, bool rows_outer, bool want_kv) {
  constexpr std::int64_t kSplitBelow = 8, kMinRangeQueries = 256;
  BackwardWork w;
  std::int64_t pairs = 0;
  for (const Sequence& seq : p.sequences) pairs += seq.lq > 0 && seq.lk > 0 ? p.kv_heads : 0;
  const std::int64_t want_ranges =
      rows_outer || pairs >= kSplitBelow || pairs == 0 ? 1 : (kSplitBelow + pairs - 1) / pairs;
  std::int64_t part_floats = 0;
  RowBlock probe;
  for (std::int64_t si = 0; si < static_cast<std::int64_t>(p.sequences.size()); ++si) {
    const Sequence& seq = p.sequences[static_cast<std::size_t>(si)];
    if (seq.lq == 0 || seq.lk == 0) continue;
    const std::int64_t ranges = std::max<std::int64_t>(1, std::min(want_ranges, seq.lq / kMinRangeQueries));
    for (std::int64_t kvh = 0; kvh < p.kv_heads; ++kvh) {
      // Latest queries first: under a causal mask they see the most keys, and the dynamic
      // schedule balances better with the large units at the front.
      for (std::int64_t r = ranges - 1; r >= 0; --r) {
        const std::int64_t i0 = r * seq.lq / ranges, i1 = (r + 1) * seq.lq / ranges;
        if (ranges == 1) {
          w.units.push_back({si, kvh, 0, seq.lq, 0, seq.lk, -1});
          continue;
        }
        p.layout_rows(seq, kvh, i0, i1 - i0, false, probe);
        const std::int64_t lo = probe.key_lo, hi = std::max(probe.key_lo, probe.key_hi);
        w.units.push_back({si, kvh, i0, i1 - i0, lo, hi, want_kv && hi > lo ? part_floats : -1});
        if (want_kv && hi > lo) part_floats += 2 * (hi - lo) * p.dim;
      }
    }
  }
  w.kv_parts.resize(static_cast<std::size_t>(part_floats));
  w.flops = static_cast<std::int64_t>(p.batch) * p.q_len * p.k_len * p.heads * p.dim;
  return w;
}

// dK, dV of the split units: each key's rows summed over the ranges whose queries see it, in unit
// order (fp64), then added into dk, dv. Keys are independent, so this loop's thread count does
// not change a bit.
void sum_split_units(const AttentionPlan& p, const AttentionPlan::BackwardCall& call, const BackwardWork& w,
                     int threads) {
  const std::int64_t dim = p.dim;
  std::size_t u0 = 0;
  while (u0 < w.units.size()) {
    std::size_t u1 = u0 + 1;
    while (u1 < w.units.size() && w.units[u1].seq == w.units[u0].seq && w.units[u1].kvh == w.units[u0].kvh) ++u1;
    const Sequence& seq = p.sequences[static_cast<std::size_t>(w.units[u0].seq)];
    const std::int64_t kvh = w.units[u0].kvh;
    if (w.units[u0].i0 != 0 || w.units[u0].count != seq.lq) {
#pragma omp parallel num_threads(threads)
      {
        std::vector<double> sum(static_cast<std::size_t>(2 * dim));
        std::vector<float> row(static_cast<std::size_t>(2 * dim));
#pragma omp for schedule(static)
        for (std::int64_t key = 0; key < seq.lk; ++key) {
          std::fill(sum.begin(), sum.end(), 0.0);
          bool seen = false;
          for (std::size_t u = u0; u < u1; ++u) {
            const BackwardWork::Unit& un = w.units[u];
            if (un.part < 0 || key < un.key_lo || key >= un.key_hi) continue;
            seen = true;
            const float* dk_row = w.kv_parts.data() + un.part + (key - un.key_lo) * dim;
            const float* dv_row = dk_row + (un.key_hi - un.key_lo) * dim;
            for (std::int64_t t = 0; t < dim; ++t) {
              sum[static_cast<std::size_t>(t)] += dk_row[t];
              sum[static_cast<std::size_t>(dim + t)] += dv_row[t];
            }
          }
          if (!seen) continue;
          for (std::int64_t t = 0; t < 2 * dim; ++t)
            row[static_cast<std::size_t>(t)] = static_cast<float>(sum[static_cast<std::size_t>(t)]);
          if (call.dk != nullptr) p.store_row_to(row.data(), *call.dk, call.dkg, seq.b, seq.k0 + key, kvh);
          if (call.dv != nullptr) p.store_row_to(row.data() + dim, *call.dv, call.dvg, seq.b, seq.k0 + key, kvh);
        }
      }
    }
    u0 = u1;
  }
}

// Each unit's slots for the parameters' gradients: the bias parameters' (summed in unit order by
// reduce_gradients) and every term's (ScoreTerm::reduce sums them).
struct GradientSlots {
  std::int64_t bias_size = 0;
  std::vector<double>* bias = nullptr;
  std::vector<std::int64_t> term_size;
  std::vector<std::vector<double>*> terms;
  std::int64_t bytes = 0;

  GradientSlots(const AttentionPlan& p, bool want_bias_grads, bool want_term_grads, std::size_t units)
      : bias_size(want_bias_grads ? p.bias_gradient_size() : 0),
        bias(&zeroed_doubles(CallBuffer::kUnitBias, static_cast<std::size_t>(bias_size) * units)),
        term_size(p.terms.size(), 0),
        terms(p.terms.size()),
        bytes(static_cast<std::int64_t>(bias->size() * sizeof(double))) {
    for (std::size_t t = 0; t < p.terms.size(); ++t) {
      term_size[t] = want_term_grads ? p.terms[t]->unit_gradient_size() : 0;
      terms[t] = &zeroed_term_slots(t, static_cast<std::size_t>(term_size[t]) * units);
      bytes += static_cast<std::int64_t>(terms[t]->size() * sizeof(double));
    }
  }
  // Unit u's slots in `unit`.
  void assign(std::size_t u, AttentionPlan::BackwardUnit& unit) const {
    unit.bias_grads = bias_size > 0 ? bias->data() + u * static_cast<std::size_t>(bias_size) : nullptr;
    for (std::size_t t = 0; t < terms.size(); ++t)
      unit.term_grads[t] = term_size[t] > 0 ? terms[t]->data() + u * static_cast<std::size_t>(term_size[t]) : nullptr;
  }
};

// The units' slots summed into the caller's gradients, in unit order.
void reduce_gradients(const AttentionPlan& p, const BackwardWork& w, const GradientSlots& slots,
                      AttentionGradients* grads) {
  if (slots.bias_size > 0) {
    std::vector<double> total(static_cast<std::size_t>(slots.bias_size), 0.0);
    for (std::size_t u = 0; u < w.units.size(); ++u) {
      for (std::int64_t t = 0; t < slots.bias_size; ++t)
        total[static_cast<std::size_t>(t)] +=
            (*slots.bias)[u * static_cast<std::size_t>(slots.bias_size) + static_cast<std::size_t>(t)];
    }
    p.scatter_bias_gradients(total, *grads);
  }
  for (std::size_t t = 0; t < p.terms.size(); ++t) {
    if (slots.term_size[t] == 0) continue;
    std::vector<TermUnit> units(w.units.size());
    for (std::size_t u = 0; u < w.units.size(); ++u) {
      units[u].seq = &p.sequences[static_cast<std::size_t>(w.units[u].seq)];
      units[u].kvh = w.units[u].kvh;
      units[u].slot = slots.terms[t]->data() + u * static_cast<std::size_t>(slots.term_size[t]);
    }
    p.terms[t]->reduce(units, *grads);
  }
}

}  // namespace

// ─── Backward ────────────────────────────────────────────────────────────────────────────────

AttentionPlan::BackwardCall AttentionPlan::check_backward(ConstTensorView out, ConstTensorView lse,
                                                          ConstTensorView d_out, TensorView& dq, TensorView& dk,
                                                          TensorView& dv, AttentionGradients* grads) const {
  BackwardCall call;
  call.og = check_output_tokens(kWhere, "out", out, out_grid());
  check_dtype(kWhere, "out", out.dtype(), dtype);
  call.dog = check_output_tokens(kWhere, "d_out", d_out, out_grid());
  check_dtype(kWhere, "d_out", d_out.dtype(), dtype);
  check_lse(lse, false);
  const auto check_gradient = [&](const char* name, TensorView& view, const HeadsGrid& grid, HeadsGrid& checked,
                                  TensorView*& wanted) {
    if (view.rank() == 0) return;
    checked = check_output_tokens(kWhere, name, ConstTensorView(view), grid);
    check_dtype(kWhere, name, view.dtype(), dtype);
    check_writable(kWhere, name, ConstTensorView(view));
    wanted = &view;
  };
  check_gradient("dq", dq, qg, call.dqg, call.dq);
  check_gradient("dk", dk, kg, call.dkg, call.dk);
  check_gradient("dv", dv, vg, call.dvg, call.dv);
  if (grads != nullptr) check_gradients(*grads);
  check_disjoint({{"dq", dq}, {"dk", dk}, {"dv", dv}},
                 {{"q", spec.q}, {"k", spec.k}, {"v", spec.v}, {"out", out}, {"lse", lse}, {"d_out", d_out}});
  call.out = out;
  call.lse = lse;
  call.d_out = d_out;
  call.rows_outer = std::any_of(terms.begin(), terms.end(), [](const auto& t) { return t->rows_outer(); });
  // Row blocks outer (Transformer-XL) would pair each tile once per row block: f32 there.
  call.native_bf16 = dtype == DType::kBF16 && spec.bf16_products && !call.rows_outer && bf16_dot_products();
  return call;
}

AttentionStats AttentionPlan::backward(ConstTensorView out, ConstTensorView lse, ConstTensorView d_out, TensorView dq,
                                       TensorView dk, TensorView dv, AttentionGradients* grads) const {
  const BackwardCall call = check_backward(out, lse, d_out, dq, dk, dv, grads);
  BackwardWork work = plan_backward(*this, call.rows_outer, call.dk != nullptr || call.dv != nullptr);
  build_tile_maxima();
  const GradientSlots slots(*this, grads != nullptr && any_trainable_bias, grads != nullptr, work.units.size());
  const int threads =
      std::min<int>(threads_for(work.flops / 16), static_cast<int>(std::max<std::size_t>(work.units.size(), 1)));
  std::int64_t scratch_bytes = 0, steps = 0, skipped_steps = 0;
  ParallelErrors errors;  // a term's own definition may throw
#pragma omp parallel num_threads(threads) reduction(+ : scratch_bytes, steps, skipped_steps)
  {
    const FlushDenormals flush;
    AttentionUnitScratch& s = unit_scratch();
    s.steps = s.skipped_steps = 0;
    RowBlock rb;
    BackwardUnit unit;  // one per thread: its term slots are sized once, not per unit
    unit.term_grads.resize(terms.size());
#pragma omp for schedule(dynamic, 1)
    for (std::size_t u = 0; u < work.units.size(); ++u) {
      const BackwardWork::Unit& un = work.units[u];
      unit.seq = &sequences[static_cast<std::size_t>(un.seq)];
      unit.kvh = un.kvh;
      unit.i0 = un.i0;
      unit.count = un.count;
      slots.assign(u, unit);
      unit.kv_part = un.part >= 0 ? work.kv_parts.data() + un.part : nullptr;
      unit.part_key_lo = un.key_lo;
      unit.part_key_hi = un.key_hi;
      errors.run([&] { backward_unit(call, unit, s, rb); });
    }
    scratch_bytes += s.bytes();
    steps += s.steps;
    skipped_steps += s.skipped_steps;
  }
  errors.rethrow();
  if (!work.kv_parts.empty()) sum_split_units(*this, call, work, threads);
  reduce_gradients(*this, work, slots, grads);
  AttentionStats stats;
  stats.tiles = steps;
  stats.skipped = skipped_steps;
  stats.bf16_products = call.native_bf16 && !work.units.empty();
  stats.workspace_bytes =
      scratch_bytes + table_bytes() + slots.bytes + static_cast<std::int64_t>(work.kv_parts.size() * sizeof(float));
  return stats;
}

namespace {

// One backward unit (AttentionPlan::backward_unit): its rows' queries, dO, lse and δ loaded once,
// then (key tile, row block) steps — key tiles outer, or row blocks outer for terms that ask
// (ScoreTerm::rows_outer) — and dK, dV, dQ stored.
class UnitBackward {
 public:
  // Rows ahead that load_rows and store_dq prefetch (prefetch_row).
  static constexpr std::int64_t kRowsAhead = 8;

  UnitBackward(const AttentionPlan& p, const AttentionPlan::BackwardCall& call, const AttentionPlan::BackwardUnit& unit,
               AttentionUnitScratch& s, RowBlock& rb)
      : p_(p),
        call_(call),
        unit_(unit),
        seq_(*unit.seq),
        kvh_(unit.kvh),
        s_(s),
        rb_(rb),
        dp_(p.dim_padded),
        d_(p.dim),
        tq_(p.tables_of_head(unit.kvh * p.group_size)) {}

  void run() {
    load_rows();
    keys_transformed_ = tq_.kind != QKTables::kNone && tq_.transform_keys;
    prepare();
    if (call_.native_bf16) pair_rows();
    if (!call_.rows_outer) {
      keys_outer();
    } else {
      rows_outer();
    }
    for (const std::int64_t r : s_.exact_rows) {
      s_.delta[static_cast<std::size_t>(r)] = static_cast<float>(s_.exact_delta[static_cast<std::size_t>(r)]);
    }
    for (std::size_t t = 0; t < p_.terms.size(); ++t) p_.terms[t]->finish_backward(s_.terms[t]);
    if (call_.dq != nullptr) store_dq();
    if (unit_.bias_grads != nullptr) p_.finish_bias_gradients(s_, kvh_, unit_.bias_grads);
  }

 private:
  // The unit's rows (queries [i0, i0 + count) of the KV head's G heads), head-major, each head's
  // queries padded to the lane count: q (transformed, tempered, scaled), dO, lse and δ, and their
  // transposes.
  void load_rows() {
    p_.layout_rows(seq_, kvh_, unit_.i0, unit_.count, false, rb_);
    w_ = rb_.width;
    grow(s_.q, w_ * dp_);
    ldt_ = padded_stride(w_);
    ldkv_ = padded_stride(dp_);
    grow(s_.qt, dp_ * ldt_);
    grow(s_.dout, w_ * dp_);
    grow(s_.doutt, dp_ * ldt_);
    grow(s_.dq, w_ * dp_);
    grow(s_.lse, w_);
    grow(s_.delta, w_);
    grow(s_.o, dp_);
    std::fill(s_.dq.begin(), s_.dq.begin() + w_ * dp_, 0.0f);
    s_.exact_rows.clear();
    for (std::int64_t r = 0; r < kRowsAhead; ++r) prefetch_row(r, false);
    for (std::int64_t r = 0; r < w_; ++r) {
      prefetch_row(r + kRowsAhead, false);
      float* qrow = s_.q.data() + r * dp_;
      float* drow = s_.dout.data() + r * dp_;
      if (rb_.head[static_cast<std::size_t>(r)] < 0) {
        std::fill(qrow, qrow + dp_, 0.0f);
        std::fill(drow, drow + dp_, 0.0f);
        s_.lse[static_cast<std::size_t>(r)] = 0.0f;
        s_.delta[static_cast<std::size_t>(r)] = 0.0f;
      } else {
        load_row(r, qrow, drow);
      }
      for (std::int64_t t = 0; t < d_; ++t) {
        s_.qt[static_cast<std::size_t>(t * ldt_ + r)] = qrow[t];
        s_.doutt[static_cast<std::size_t>(t * ldt_ + r)] = drow[t];
      }
    }
  }

  // The rows of q, d_out and out (or, for `dq`, of dq, to be written) lie a token's heads apart,
  // where the hardware prefetchers do not follow: load_rows and store_dq fetch each row's lines
  // kRowsAhead rows before they reach it. Rows past the unit's and padding rows fetch nothing.
  void prefetch_row(std::int64_t r, bool dq) const {
    const std::int64_t h = r < w_ ? rb_.head[static_cast<std::size_t>(r)] : -1;
    if (h < 0) return;
    const std::int64_t s = seq_.q0 + rb_.query[static_cast<std::size_t>(r)];
    if (dq) {
      prefetch_heads_row(call_.dq->data(), call_.dq->dtype(), call_.dqg, seq_.b, s, h, true);
      return;
    }
    prefetch_heads_row(p_.q_data, p_.dtype, p_.qg, seq_.b, s, h);
    prefetch_heads_row(call_.d_out.data(), call_.d_out.dtype(), call_.dog, seq_.b, s, h);
    prefetch_heads_row(call_.out.data(), call_.out.dtype(), call_.og, seq_.b, s, h);
  }

  void load_row(std::int64_t r, float* qrow, float* drow) {
    const std::int64_t h = rb_.head[static_cast<std::size_t>(r)];
    const std::int64_t i = rb_.query[static_cast<std::size_t>(r)];
    p_.load_row(p_.q_data, p_.qg, seq_.b, seq_.q0 + i, h, qrow);
    p_.transform_row(tq_, true, p_.q_table_row(seq_, i), qrow, 1.0f);
    p_.temper_row(qrow, rb_.position[static_cast<std::size_t>(r)]);
    for (const auto& term : p_.terms) term->adjust_query(h, qrow);
    for (std::int64_t t = 0; t < d_; ++t) qrow[t] *= p_.scale;
    p_.load_row_as(call_.d_out, call_.dog, seq_.b, seq_.q0 + i, h, drow);
    p_.load_row_as(call_.out, call_.og, seq_.b, seq_.q0 + i, h, s_.o.data());
    double delta = 0;
    bool finite = true;
    for (std::int64_t t = 0; t < d_; ++t) {
      delta += static_cast<double>(drow[t]) * s_.o[static_cast<std::size_t>(t)];
      finite = finite && std::isfinite(drow[t]);
    }
    // δ = dO·O equals Σ_j P_ij·dP_ij, the softmax backward's form, for finite dO. With an inf
    // in dO every dP_ij is ±inf or NaN, so every dS of the row is NaN whatever δ is: the tiles
    // get NaN, and the sum itself (±inf when every dP_ij is one infinity: a sink's gradient)
    // accumulates over the visible pairs (exact_delta) for the terms' finish_backward.
    s_.delta[static_cast<std::size_t>(r)] =
        finite ? static_cast<float>(delta) : std::numeric_limits<float>::quiet_NaN();
    if (!finite) s_.exact_rows.push_back(r);
    s_.lse[static_cast<std::size_t>(r)] = p_.read_lse(call_.lse, seq_, h, i);
    dead_rows_ = dead_rows_ || s_.lse[static_cast<std::size_t>(r)] == kNegInf;
  }

  // The tiles' scratch, the far-tile skip's row norms, the bias histograms and the terms' rows.
  void prepare() {
    if (p_.skip_far_tiles) {
      grow(s_.row_norm, w_);
      row_norms(s_.q.data(), dp_, w_, d_, s_.row_norm.data());
      // bf16 queries and keys move a logit by up to 2^-8 of |q|·|k| (forward.cpp's forward_blocks).
      if (call_.native_bf16) {
        for (std::int64_t r = 0; r < w_; ++r) s_.row_norm[static_cast<std::size_t>(r)] *= 1.01;
      }
    }
    const std::int64_t tile = p_.backward_key_tile;
    grow(s_.k, tile * ldkv_);
    grow(s_.v, tile * ldkv_);
    grow(s_.dk, tile * dp_);
    grow(s_.dv, tile * dp_);
    // Row blocks of at most query_block·G rows share one key tile pass.
    rows_per_block_ = round_up(p_.query_block * p_.group_size, kAttnAlign);
    grow(s_.st, tile * rows_per_block_);
    grow(s_.dpt, tile * rows_per_block_);
    grow(s_.kpos, tile);
    // Bias-gradient histograms over δ per head of the unit (distance tables) and the direct path.
    if (unit_.bias_grads != nullptr) {
      grow(s_.hist, p_.group_size * p_.hist_width);
      std::fill(s_.hist.begin(), s_.hist.begin() + p_.group_size * p_.hist_width, 0.0);
    }
    if (!s_.exact_rows.empty()) s_.exact_delta.assign(static_cast<std::size_t>(w_), 0.0);
    if (s_.terms.size() < p_.terms.size()) s_.terms.resize(p_.terms.size());
    TermRows term_rows;
    term_rows.seq = &seq_;
    term_rows.rows = &rb_;
    term_rows.kvh = kvh_;
    term_rows.q = s_.q.data();
    term_rows.qt = s_.qt.data();
    term_rows.ldt = ldt_;
    term_rows.dout = s_.dout.data();
    term_rows.doutt = s_.doutt.data();
    term_rows.dq = s_.dq.data();
    term_rows.lse = s_.lse.data();
    term_rows.delta = s_.delta.data();
    for (std::size_t t = 0; t < p_.terms.size(); ++t)
      p_.terms[t]->begin_backward(term_rows, unit_.term_grads[t], s_.terms[t]);
  }

  // Loads the keys [k0, k0 + keys) (transformed) and values into s.k, s.v and their positions into
  // s.kpos; for the native bf16 products also as pairs (keys along the head dim and along the
  // keys, values along the head dim).
  void load_keys(std::int64_t k0, std::int64_t keys) {
    for (std::int64_t j = 0; j < keys; ++j) {
      float* krow = s_.k.data() + j * ldkv_;
      p_.load_row(p_.k_data, p_.kg, seq_.b, seq_.k0 + k0 + j, kvh_, krow);
      if (keys_transformed_) p_.transform_row(tq_, false, p_.k_table_row(seq_, k0 + j), krow, 1.0f);
      p_.load_row(p_.v_data, p_.vg, seq_.b, seq_.k0 + k0 + j, kvh_, s_.v.data() + j * ldkv_);
      s_.kpos[static_cast<std::size_t>(j)] = p_.k_position(seq_, k0 + j);
    }
    if (!call_.native_bf16) return;
    pair_both_ways(s_.k.data(), ldkv_, keys, dp_, s_.k_pairs, s_.k_key_pairs, ldkv_);
    grow(s_.v_dim_pairs, keys * dp_ / 2);
    kernels::attn_convert_bf16_rows(s_.v.data(), ldkv_, keys, dp_, s_.v_dim_pairs.data(), dp_ / 2);
  }

  // `count` rows of `cols` floats (ld apart) as bf16 pairs along each row (rows, cols / 2 apart)
  // and along the rows (down, ldd apart).
  static void pair_both_ways(const float* rows, std::int64_t ld, std::int64_t count, std::int64_t cols,
                             AlignedPairs& rows_out, AlignedPairs& down, std::int64_t ldd) {
    grow(rows_out, count * cols / 2);
    grow(down, (count + 1) / 2 * ldd);
    kernels::attn_convert_bf16_rows(rows, ld, count, cols, rows_out.data(), cols / 2);
    kernels::attn_pack_bf16_pairs(rows, ld, count, cols, down.data(), ldd);
  }

  // The unit's rows as the native bf16 products read them: Qᵀ and dOᵀ along the head dim, Q and
  // dO paired along the rows.
  void pair_rows() {
    const std::int64_t pairs = (d_ + 1) / 2;
    grow(s_.qt_pairs, pairs * ldt_);
    grow(s_.doutt_pairs, pairs * ldt_);
    grow(s_.q_row_pairs, (w_ + 1) / 2 * dp_);
    grow(s_.dout_row_pairs, (w_ + 1) / 2 * dp_);
    kernels::attn_transpose_bf16_pairs(s_.q.data(), dp_, w_, pairs, s_.qt_pairs.data(), ldt_);
    kernels::attn_transpose_bf16_pairs(s_.dout.data(), dp_, w_, pairs, s_.doutt_pairs.data(), ldt_);
    kernels::attn_pack_bf16_pairs(s_.q.data(), dp_, w_, dp_, s_.q_row_pairs.data(), dp_);
    kernels::attn_pack_bf16_pairs(s_.dout.data(), dp_, w_, dp_, s_.dout_row_pairs.data(), dp_);
  }

  // Whether any row of [r0, r0 + bw) sees the keys [k0, k0 + keys), and whether all valid rows
  // see all of them.
  bool coverage(std::int64_t r0, std::int64_t bw, std::int64_t k0, std::int64_t keys, bool* full) const {
    bool any = false;
    *full = true;
    for (std::int64_t r = r0; r < r0 + bw; ++r) {
      // A padding row sees no key, so its block is not full: the mask gives it −inf logits, which
      // terms and biases would otherwise fill from other rows' positions (a forget gate's
      // c_{k0} − c_j reaches +100: exp() infinite, and 0·inf into dK through its zero query).
      if (rb_.head[static_cast<std::size_t>(r)] < 0) {
        *full = false;
        continue;
      }
      const bool sees = rb_.lo[static_cast<std::size_t>(r)] < k0 + keys && rb_.hi[static_cast<std::size_t>(r)] > k0;
      any = any || sees;
      *full = *full && rb_.lo[static_cast<std::size_t>(r)] <= k0 && rb_.hi[static_cast<std::size_t>(r)] >= k0 + keys;
    }
    return any;
  }

  // Every probability of the step 0 (the far-tile skip against each row's lse): dS = 0 and the
  // products would add only zeros.
  bool vanishes(const RowBlock& sub, std::int64_t r0, std::int64_t k0, std::int64_t keys, const float* k_rows,
                const std::int64_t* kpos) {
    const auto [k_lo, k_hi] = std::minmax_element(kpos, kpos + keys);
    return tile_vanishes(p_, seq_, sub, s_.row_norm.data() + r0, s_.lse.data() + r0, *k_lo, *k_hi, k0, k0 + keys - 1,
                         [&] {
                           if (tile_key_norm_ < 0) tile_key_norm_ = row_norms(k_rows, ldkv_, keys, d_, nullptr);
                           return tile_key_norm_;
                         });
  }

  // One (key tile, row block) step: S, P, dP, dS and the products into dk, dv (rows for the tile's
  // keys), dq; the schemes' terms. k_rows, v_rows: the tile's key and value rows, ldkv apart;
  // kpos: their positions.
  void step(const RowBlock& sub, std::int64_t r0, std::int64_t k0, std::int64_t keys, bool full, const float* k_rows,
            const float* v_rows, const std::int64_t* kpos, float* dk_rows, float* dv_rows) {
    const std::int64_t bw = sub.width;
    ++s_.steps;
    if (p_.skip_far_tiles && vanishes(sub, r0, k0, keys, k_rows, kpos)) {
      ++s_.skipped_steps;
      return;
    }
    // Native: the tile's pairs (load_keys) stand for k_rows and v_rows, one tile at a time, which
    // is why rows-outer walks (several tiles loaded) keep f32 (check_backward).
    const bool native = call_.native_bf16;
    const std::int64_t pairs = (d_ + 1) / 2;
    // S^T = K·Q^T, biases, soft-cap, mask; dP^T = V·dO^T.
    if (native) {
      kernels::attn_gemm_bf16(s_.k_pairs.data(), dp_ / 2, 1, s_.qt_pairs.data() + r0, ldt_, s_.st.data(), bw, keys, bw,
                              pairs, false);
    } else {
      kernels::attn_gemm(k_rows, ldkv_, 1, s_.qt.data() + r0, ldt_, s_.st.data(), bw, keys, bw, d_, false);
    }
    p_.add_bias(sub, keys, kpos, s_.st.data());
    const TermTile tile = term_tile(seq_, sub, r0, k0, keys, kpos, false);
    for (std::size_t t = 0; t < p_.terms.size(); ++t) p_.terms[t]->add_scores(tile, s_.st.data(), s_.terms[t]);
    if (p_.mask.softcap > 0) kernels::attn_softcap_tile(s_.st.data(), keys, bw, static_cast<float>(p_.mask.softcap));
    if (!full) kernels::attn_mask_tile(s_.st.data(), keys, bw, k0, sub.lo.data(), sub.hi.data());
    if (native) {
      kernels::attn_gemm_bf16(s_.v_dim_pairs.data(), dp_ / 2, 1, s_.doutt_pairs.data() + r0, ldt_, s_.dpt.data(), bw,
                              keys, bw, pairs, false);
    } else {
      kernels::attn_gemm(v_rows, ldkv_, 1, s_.doutt.data() + r0, ldt_, s_.dpt.data(), bw, keys, bw, d_, false);
    }
    for (std::size_t t = 0; t < p_.terms.size(); ++t) p_.terms[t]->add_dp(tile, s_.dpt.data(), s_.terms[t]);
    if (!s_.exact_rows.empty()) {
      sum_exact_delta(sub, r0, k0, keys, s_.st.data(), s_.dpt.data(), s_.lse.data(), s_.exact_rows, s_.exact_delta);
    }
    // P^T, dS^T (with the soft-cap's derivative).
    kernels::attn_backward_tile(s_.st.data(), s_.dpt.data(), keys, bw, s_.lse.data() + r0, s_.delta.data() + r0,
                                static_cast<float>(p_.mask.softcap));
    // A partly masked tile (padding rows included, whose zero q meets an infinite key as NaN; or
    // one with a row whose logits were all −inf) whose operands hold inf or NaN (engine.hpp:
    // rows_non_finite): the pairs that do not count get P = dS = 0 exactly, and the products sum
    // over the others only.
    const bool exact =
        (!full || dead_rows_) &&
        (rows_non_finite(s_.q.data() + r0 * dp_, dp_, bw, d_) ||
         rows_non_finite(s_.dout.data() + r0 * dp_, dp_, bw, p_.dim_v) || rows_non_finite(k_rows, ldkv_, keys, d_) ||
         rows_non_finite(v_rows, ldkv_, keys, p_.dim_v) || rows_non_finite(s_.lse.data() + r0, 0, 1, bw) ||
         rows_non_finite(s_.delta.data() + r0, 0, 1, bw));
    if (exact) zero_masked_pairs(sub, s_.lse.data() + r0, k0, keys, s_.st.data(), s_.dpt.data());
    for (std::size_t t = 0; t < p_.terms.size(); ++t)
      p_.terms[t]->backward_tile(tile, s_.st.data(), s_.dpt.data(), s_.terms[t]);
    if (exact) {
      visible_products(sub, s_.lse.data() + r0, k0, keys, s_.st.data(), s_.dpt.data(), s_.dout.data() + r0 * dp_,
                       s_.q.data() + r0 * dp_, k_rows, ldkv_, dp_, dv_rows, dk_rows, s_.dq.data() + r0 * dp_);
    } else if (native) {
      // As below, with Pᵀ and dSᵀ paired along the rows, dS along the keys, each rounded to bf16.
      grow(s_.pt_pairs, keys * bw / 2);
      kernels::attn_convert_bf16_rows(s_.st.data(), bw, keys, bw, s_.pt_pairs.data(), bw / 2);
      pair_both_ways(s_.dpt.data(), bw, keys, bw, s_.dst_pairs, s_.ds_pairs, bw);
      kernels::attn_gemm_bf16(s_.pt_pairs.data(), bw / 2, 1, s_.dout_row_pairs.data() + r0 / 2 * dp_, dp_, dv_rows, dp_,
                              keys, dp_, bw / 2, true);
      kernels::attn_gemm_bf16(s_.dst_pairs.data(), bw / 2, 1, s_.q_row_pairs.data() + r0 / 2 * dp_, dp_, dk_rows, dp_,
                              keys, dp_, bw / 2, true);
      kernels::attn_gemm_bf16(s_.ds_pairs.data(), 1, bw, s_.k_key_pairs.data(), ldkv_, s_.dq.data() + r0 * dp_, dp_, bw,
                              dp_, (keys + 1) / 2, true);
    } else {
      // dV += P^T·dO, dK += dS^T·Q (Q carries the scale), dQ += dS·K.
      kernels::attn_gemm(s_.st.data(), bw, 1, s_.dout.data() + r0 * dp_, dp_, dv_rows, dp_, keys, dp_, bw, true);
      kernels::attn_gemm(s_.dpt.data(), bw, 1, s_.q.data() + r0 * dp_, dp_, dk_rows, dp_, keys, dp_, bw, true);
      kernels::attn_gemm(s_.dpt.data(), 1, bw, k_rows, ldkv_, s_.dq.data() + r0 * dp_, dp_, bw, dp_, keys, true);
    }
    if (unit_.bias_grads != nullptr)
      p_.accumulate_bias_gradients(sub, keys, kpos, s_.dpt.data(), s_, kvh_, unit_.bias_grads);
  }

  // dK (rotated back; the query scale is already in it) and dV rows of keys [k0, k0 + keys).
  // A split unit writes them into its part instead (keys [part_key_lo, part_key_hi), dK rows then
  // dV rows), for backward() to sum over the ranges.
  void store_keys(std::int64_t k0, std::int64_t keys, float* dk_rows, const float* dv_rows) {
    const std::int64_t lo = unit_.part_key_lo, hi = unit_.part_key_hi;
    for (std::int64_t j = 0; j < keys; ++j) {
      float* dkrow = dk_rows + j * dp_;
      if (unit_.kv_part != nullptr) {
        // A tile can reach past the keys the unit's rows see; those rows of dK, dV are 0 here.
        if (k0 + j < lo || k0 + j >= hi) continue;
        if (keys_transformed_) p_.transform_row(tq_, false, p_.k_table_row(seq_, k0 + j), dkrow, -1.0f);
        float* part_row = unit_.kv_part + (k0 + j - lo) * d_;
        std::copy(dkrow, dkrow + d_, part_row);
        std::copy(dv_rows + j * dp_, dv_rows + j * dp_ + d_, part_row + (hi - lo) * d_);
        continue;
      }
      if (call_.dk != nullptr) {
        if (keys_transformed_) p_.transform_row(tq_, false, p_.k_table_row(seq_, k0 + j), dkrow, -1.0f);
        p_.store_row_to(dkrow, *call_.dk, call_.dkg, seq_.b, seq_.k0 + k0 + j, kvh_);
      }
      if (call_.dv != nullptr) p_.store_row_to(dv_rows + j * dp_, *call_.dv, call_.dvg, seq_.b, seq_.k0 + k0 + j, kvh_);
    }
  }

  // Key tiles outer: dk and dv finish per tile.
  void keys_outer() {
    for (std::int64_t k0 = 0; k0 < seq_.lk; k0 += p_.backward_key_tile) {
      const std::int64_t keys = std::min(p_.backward_key_tile, seq_.lk - k0);
      bool full = true;
      if (!coverage(0, w_, k0, keys, &full)) continue;
      load_keys(k0, keys);
      tile_key_norm_ = -1;
      std::fill(s_.dk.begin(), s_.dk.begin() + keys * dp_, 0.0f);
      std::fill(s_.dv.begin(), s_.dv.begin() + keys * dp_, 0.0f);
      for (std::int64_t r0 = 0; r0 < w_; r0 += rows_per_block_) {
        const std::int64_t bw = std::min(rows_per_block_, w_ - r0);
        if (!coverage(r0, bw, k0, keys, &full)) continue;
        RowBlock sub;
        rb_.slice(r0, bw, sub);
        step(sub, r0, k0, keys, full, s_.k.data(), s_.v.data(), s_.kpos.data(), s_.dk.data(), s_.dv.data());
      }
      store_keys(k0, keys, s_.dk.data(), s_.dv.data());
    }
  }

  // Row blocks outer (ScoreTerm::rows_outer: Transformer-XL, whose window of Qs·P(δ) dots and of
  // dS sums slides down the δ range with the tiles instead of being rebuilt per tile); dk and dv
  // accumulate for the whole sequence (rows in the same order as keys_outer). The sequence's keys
  // and values are loaded once for all the row blocks (reloading them per block cost a quarter of
  // XL's time).
  void rows_outer() {
    const std::int64_t lk = seq_.lk, tile = p_.backward_key_tile;
    grow(s_.k, lk * ldkv_);
    grow(s_.v, lk * ldkv_);
    grow(s_.kpos, lk);
    load_keys(0, lk);
    grow(s_.dk, lk * dp_);
    grow(s_.dv, lk * dp_);
    std::fill(s_.dk.begin(), s_.dk.begin() + lk * dp_, 0.0f);
    std::fill(s_.dv.begin(), s_.dv.begin() + lk * dp_, 0.0f);
    for (std::int64_t r0 = 0; r0 < w_; r0 += rows_per_block_) {
      const std::int64_t bw = std::min(rows_per_block_, w_ - r0);
      RowBlock sub;
      rb_.slice(r0, bw, sub);
      for (std::int64_t k0 = 0; k0 < lk; k0 += tile) {
        const std::int64_t keys = std::min(tile, lk - k0);
        bool full = true;
        if (!coverage(r0, bw, k0, keys, &full)) continue;
        step(sub, r0, k0, keys, full, s_.k.data() + k0 * ldkv_, s_.v.data() + k0 * ldkv_, s_.kpos.data() + k0,
             s_.dk.data() + k0 * dp_, s_.dv.data() + k0 * dp_);
      }
      for (std::size_t t = 0; t < p_.terms.size(); ++t) p_.terms[t]->end_rows(sub, r0, s_.terms[t]);
    }
    for (std::int64_t k0 = 0; k0 < lk; k0 += tile) {
      store_keys(k0, std::min(tile, lk - k0), s_.dk.data() + k0 * dp_, s_.dv.data() + k0 * dp_);
    }
  }

  // dQ: times the scale (and the temperature), rotated back.
  void store_dq() {
    for (std::int64_t r = 0; r < kRowsAhead; ++r) prefetch_row(r, true);
    for (std::int64_t r = 0; r < w_; ++r) {
      prefetch_row(r + kRowsAhead, true);
      const std::int64_t h = rb_.head[static_cast<std::size_t>(r)];
      if (h < 0) continue;
      const std::int64_t i = rb_.query[static_cast<std::size_t>(r)];
      float* row = s_.dq.data() + r * dp_;
      for (std::int64_t t = 0; t < d_; ++t) row[t] *= p_.scale;
      p_.temper_row(row, rb_.position[static_cast<std::size_t>(r)]);
      p_.transform_row(tq_, true, p_.q_table_row(seq_, i), row, -1.0f);
      p_.store_row_to(row, *call_.dq, call_.dqg, seq_.b, seq_.q0 + i, h);
    }
  }

  const AttentionPlan& p_;
  const AttentionPlan::BackwardCall& call_;
  const AttentionPlan::BackwardUnit& unit_;
  const Sequence& seq_;
  const std::int64_t kvh_;
  AttentionUnitScratch& s_;
  RowBlock& rb_;
  const std::int64_t dp_, d_;
  const QKTables& tq_;
  std::int64_t w_ = 0, ldt_ = 0, ldkv_ = 0, rows_per_block_ = 0;
  bool keys_transformed_ = false;
  bool dead_rows_ = false;  // a row whose logits are all −inf (lse −inf): full tiles check too
  // The current tile's largest |k| once a row block's far-tile check asks for it (−1: not yet).
  double tile_key_norm_ = -1;
};

}  // namespace

void AttentionPlan::backward_unit(const BackwardCall& call, const BackwardUnit& unit, AttentionUnitScratch& s,
                                  RowBlock& rb) const {
  UnitBackward(*this, call, unit, s, rb).run();
}

}  // namespace posenc::detail
