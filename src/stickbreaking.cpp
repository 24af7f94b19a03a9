// Stick-breaking attention (stickbreaking.hpp): validation, and the fused forward and backward
// over blocks of query rows whose key tiles run from the diagonal leftwards.
#include "posenc/stickbreaking.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "absolute_checks.hpp"
#include "internal.hpp"
#include "kernels/attention/attention_kernels.hpp"
#include "kernels/attention/stickbreaking_kernels.hpp"
#include "kernels/common/flush_denormals.hpp"
#include "posenc/error.hpp"
#include "posenc/reference.hpp"
#include "stickbreaking_checks.hpp"

namespace posenc {

namespace detail {
namespace {

void require(bool ok, const char* param, const std::string& value, const std::string& expected) {
  if (!ok) throw Error(kStickBreaking, param, value, expected);
}

}  // namespace

SbShape check_stickbreaking(const StickBreakingSpec& spec) {
  return check_qkv(kStickBreaking, spec.q, spec.k, spec.v, spec.scale, spec.cu_seqlens_q, spec.cu_seqlens_k);
}

RemGrid check_rem(const SbShape& shape, const char* name, ConstTensorView rem, bool writable) {
  return check_row_stat(kStickBreaking, shape, name, rem, writable);
}

HeadsGrid check_sb_forward_outputs(const StickBreakingSpec& spec, const SbShape& shape, ConstTensorView out,
                                   ConstTensorView rem) {
  const HeadsGrid og = check_output_tokens(kStickBreaking, "out", out, shape.out_grid());
  check_out_dtype(kStickBreaking, shape, out);
  check_writable(kStickBreaking, "out", out);
  if (given(rem)) check_rem(shape, "rem", rem, true);
  check_disjoint(kStickBreaking, {{"out", out}, {"rem", rem}}, {{"q", spec.q}, {"k", spec.k}, {"v", spec.v}});
  return og;
}

SbBackwardGrids check_sb_backward(const StickBreakingSpec& spec, const SbShape& shape, ConstTensorView out,
                                  ConstTensorView rem, ConstTensorView d_out, ConstTensorView d_rem, ConstTensorView dq,
                                  ConstTensorView dk, ConstTensorView dv) {
  SbBackwardGrids g;
  static_cast<QkvBackwardGrids&>(g) = check_qkv_backward(kStickBreaking, shape, out, d_out, dq, dk, dv);
  if (given(d_rem)) {
    require(given(rem), "rem", "empty", "the forward's rem when d_rem is given");
    g.d_rem = check_rem(shape, "d_rem", d_rem, false);
  }
  if (given(rem)) g.rem = check_rem(shape, "rem", rem, false);
  check_disjoint(
      kStickBreaking, {{"dq", dq}, {"dk", dk}, {"dv", dv}},
      {{"q", spec.q}, {"k", spec.k}, {"v", spec.v}, {"out", out}, {"rem", rem}, {"d_out", d_out}, {"d_rem", d_rem}});
  return g;
}

}  // namespace detail

// ─── The fused passes ────────────────────────────────────────────────────────────────────────

namespace {

using detail::HeadsGrid;
using detail::SbShape;
using detail::rows::Block;
using detail::rows::finite_floats;
using detail::rows::Floats;
using detail::rows::grow;
using detail::rows::kKeyTile;
using detail::rows::padded;
using detail::rows::Sequence;
using detail::rows::Tile;
using detail::rows::Unit;
using kernels::kSbDead;
static_assert(kKeyTile <= kernels::kAttnGemmAddDepth);

struct Scratch {
  Floats qt, qrows, o, st, dpt, k, v, dot, dorows, dq, row, sig, own;
  std::vector<float> carry, suffix, total, d_rem;
  std::vector<double> sums;  // backward's exact path: per tile and row, Σ g
  std::int64_t bytes() const {
    std::int64_t n = 0;
    for (const Floats* f : {&qt, &qrows, &o, &st, &dpt, &k, &v, &dot, &dorows, &dq, &row, &sig, &own})
      n += static_cast<std::int64_t>(f->capacity());
    for (const std::vector<float>* f : {&carry, &suffix, &total, &d_rem}) n += static_cast<std::int64_t>(f->capacity());
    return n * static_cast<std::int64_t>(sizeof(float)) + static_cast<std::int64_t>(sums.capacity() * sizeof(double));
  }
};

Scratch& thread_scratch() {
  thread_local Scratch s;
  return s;
}

// Each row's carry before its first key: 0, and −inf for padding rows (no weight, ever dead).
void start_carries(const Block& blk, std::vector<float>& carry) {
  grow(carry, blk.width);
  for (std::int64_t r = 0; r < blk.width; ++r)
    carry[static_cast<std::size_t>(r)] =
        blk.head[static_cast<std::size_t>(r)] < 0 ? -std::numeric_limits<float>::infinity() : 0.0f;
}

// Whether the block may stop before the tile ending at `tile_end`: every row's carry is below
// kSbDead (or it sees no key) and nothing non-finite lies in keys [0, tile_end).
bool vanished(const Block& blk, const float* carry, std::int64_t tile_end, std::int64_t bad_from) {
  if (bad_from < tile_end) return false;
  for (std::int64_t r = 0; r < blk.width; ++r) {
    const auto at = static_cast<std::size_t>(r);
    if (blk.head[at] >= 0 && blk.hi[at] > 0 && !(carry[r] < kSbDead)) return false;
  }
  return true;
}

}  // namespace

struct StickBreakingAttention::Plan {
  StickBreakingSpec spec;
  detail::rows::Geometry geo;

  std::int64_t bad_from(std::int64_t kvh, const std::vector<std::int64_t>& bad, std::int64_t si) const {
    return spec.skip_vanishing_tiles ? bad[static_cast<std::size_t>(si * geo.shape.kv_heads + kvh)] : -1;
  }

  // Per (sequence, KV head): the first non-finite key (backward always asks; forward only to
  // skip), or −1 everywhere.
  std::vector<std::int64_t> scan_non_finite(int threads, bool always = false) const {
    if (!spec.skip_vanishing_tiles && !always)
      return std::vector<std::int64_t>(geo.sequences.size() * static_cast<std::size_t>(geo.shape.kv_heads), -1);
    return geo.scan_non_finite(threads);
  }

  AttentionStats forward(TensorView out, TensorView rem) const;
  AttentionStats backward(ConstTensorView out, ConstTensorView rem, ConstTensorView d_out, ConstTensorView d_rem,
                          TensorView dq, TensorView dk, TensorView dv) const;
};

namespace {

// The exact path of backward (a block whose inputs hold an inf or NaN): the tile's leftward walk
// in scalar code, leaving A in st, g = A·(dP − d_rem) in dpt and z in sig, and adding each
// row's Σ g over the tile to tile_sum (fp64; null: not wanted). Masked pairs get 0 everywhere.
void exact_walk(const Block& blk, std::int64_t k0, std::int64_t keys, float* st, float* dpt, float* sig,
                const float* d_rem, float* carry, double* tile_sum) {
  const std::int64_t w = blk.width;
  for (std::int64_t r = 0; r < w; ++r) {
    const std::int64_t hi = blk.head[static_cast<std::size_t>(r)] < 0 ? 0 : blk.hi[static_cast<std::size_t>(r)];
    float c = carry[r];
    for (std::int64_t j = keys - 1; j >= 0; --j) {
      const std::int64_t at = j * w + r;
      if (k0 + j >= hi) {
        st[at] = dpt[at] = sig[at] = 0.0f;
        continue;
      }
      const float z = st[at];
      const float e = std::exp(-std::fabs(z));
      const float t = std::isnan(z) ? z : std::log1p(e);
      const float sp = std::max(z, 0.0f) + t, sp_neg = std::max(-z, 0.0f) + t;
      const float log_a = c - sp_neg;
      const float a = std::isnan(log_a) ? log_a : (log_a < kSbDead ? 0.0f : std::exp(log_a));
      const float g = a * (dpt[at] - d_rem[r]);
      c -= sp;
      st[at] = a;
      dpt[at] = g;
      sig[at] = z;
      if (tile_sum != nullptr) tile_sum[r] += static_cast<double>(g);
    }
    carry[r] = c;
  }
}

// Then dz = g·σ(−z) − σ(z)·R (σ as the reference flushes it) with R = Σ_{m<j} g summed from the
// left: `left` holds each row's sum over the keys left of the tile; an inf there stays an inf
// (G − suffix would make it NaN).
void exact_finish(const Block& blk, std::int64_t k0, std::int64_t keys, float* dpt, const float* sig,
                  const double* left) {
  const std::int64_t w = blk.width;
  for (std::int64_t r = 0; r < w; ++r) {
    const std::int64_t hi = blk.head[static_cast<std::size_t>(r)] < 0 ? 0 : blk.hi[static_cast<std::size_t>(r)];
    double run = left[r];
    for (std::int64_t j = 0; j < keys && k0 + j < hi; ++j) {
      const std::int64_t at = j * w + r;
      const double g = dpt[at], z = sig[at];
      dpt[at] = static_cast<float>(g * detail::sb_sigmoid(-z) - detail::sb_sigmoid(z) * run);
      run += g;
    }
  }
}

}  // namespace

AttentionStats StickBreakingAttention::Plan::forward(TensorView out, TensorView rem) const {
  const SbShape& shape = geo.shape;
  const std::int64_t dvp = geo.dvp;
  const HeadsGrid og = detail::check_sb_forward_outputs(spec, shape, ConstTensorView(out), ConstTensorView(rem));
  const bool want_rem = rem.rank() > 0 && rem.data() != nullptr;
  const detail::RemGrid rg = want_rem ? detail::check_rem(shape, "rem", ConstTensorView(rem), true) : detail::RemGrid{};
  const std::vector<Unit> units = geo.forward_units();
  const int threads = geo.threads_for(units.size(), 1);
  const std::vector<std::int64_t> bad = scan_non_finite(threads);
  std::int64_t tiles = 0, skipped = 0, scratch_bytes = 0;
#pragma omp parallel num_threads(threads) reduction(+ : tiles, skipped, scratch_bytes)
  {
    const detail::FlushDenormals flush;
    Scratch& s = thread_scratch();
    Block blk;
#pragma omp for schedule(dynamic, 1)
    for (std::size_t u = 0; u < units.size(); ++u) {
      const Unit& un = units[u];
      const Sequence& seq = geo.sequences[static_cast<std::size_t>(un.seq)];
      geo.layout(seq, un.kvh, un.i0, un.i1, blk);
      const std::int64_t w = blk.width;
      const auto scale = static_cast<float>(shape.scale);
      const bool q_finite = geo.load_q(seq, blk, scale, scale, s.qrows, s.qt);
      grow(s.o, w * dvp);
      grow(s.st, kKeyTile * w);
      std::fill(s.o.begin(), s.o.begin() + w * dvp, 0.0f);
      start_carries(blk, s.carry);
      const std::int64_t bad_from = q_finite ? this->bad_from(un.kvh, bad, un.seq) : -1;
      const std::int64_t n_tiles = (blk.key_end + kKeyTile - 1) / kKeyTile;
      for (std::int64_t t = n_tiles - 1; t >= 0; --t) {
        const std::int64_t k0 = t * kKeyTile, keys = std::min(kKeyTile, blk.key_end - k0);
        if (vanished(blk, s.carry.data(), k0 + keys, bad_from)) {
          skipped += t + 1;
          tiles += t + 1;
          break;
        }
        ++tiles;
        if (t > 0) geo.prefetch(seq, un.kvh, k0 - kKeyTile, kKeyTile);
        const Tile kt = geo.load_tile(seq, un.kvh, k0, keys, s.k, s.v);
        kernels::attn_gemm(kt.k, kt.ldk, 1, s.qt.data(), padded(w), s.st.data(), w, keys, w, shape.dim, false);
        const bool masked = blk.any_masked(k0 + keys);
        kernels::sb_forward_tile(s.st.data(), keys, w, k0, blk.hi.data(), masked, s.carry.data());
        if (masked && detail::rows_non_finite(s.v.data(), padded(dvp), keys, shape.dim_v)) {
          detail::rows::add_visible(blk, k0, keys, s.st.data(), s.v.data(), padded(dvp), dvp, s.o.data(), dvp, true);
        } else {
          kernels::attn_gemm_add(s.st.data(), 1, w, s.v.data(), padded(dvp), s.o.data(), dvp, w, dvp, keys);
        }
      }
      for (std::int64_t r = 0; r < w; ++r) {
        const std::int64_t h = blk.head[static_cast<std::size_t>(r)];
        if (h < 0) continue;
        const std::int64_t i = blk.query[static_cast<std::size_t>(r)];
        detail::store_heads_row(s.o.data() + r * dvp, out.data(), out.dtype(), og, seq.b, seq.q0 + i, h, false);
        if (want_rem) {
          const float c = s.carry[static_cast<std::size_t>(r)];
          static_cast<float*>(rem.data())[rg.offset(seq.b, seq.q0 + i, h)] =
              std::isnan(c) ? c : (c < kSbDead ? 0.0f : std::exp(c));
        }
      }
    }
    scratch_bytes += s.bytes();
  }
  AttentionStats stats;
  stats.tiles = tiles;
  stats.skipped = skipped;
  stats.workspace_bytes = scratch_bytes;
  return stats;
}

AttentionStats StickBreakingAttention::Plan::backward(ConstTensorView out, ConstTensorView rem, ConstTensorView d_out,
                                                      ConstTensorView d_rem, TensorView dq, TensorView dk,
                                                      TensorView dv) const {
  const SbShape& shape = geo.shape;
  const detail::SbBackwardGrids g = detail::check_sb_backward(spec, shape, out, rem, d_out, d_rem, dq, dk, dv);
  const bool has_d_rem = d_rem.rank() > 0 && d_rem.data() != nullptr;
  const bool want_dq = dq.rank() > 0;
  const std::int64_t dp = geo.dp, dvp = geo.dvp, slab_row = geo.slab_row();
  const std::int64_t qc = geo.rows_per_block_queries();
  const detail::rows::Split split = geo.backward_split();
  const std::vector<Unit>& units = split.units;
  const std::int64_t slab_floats = split.slab_floats;
  thread_local Floats slab_store;  // the calling thread's, kept between calls
  grow(slab_store, slab_floats);
  float* const slabs = slab_store.data();  // (the workers' thread_local would be their own)
  const int threads = geo.threads_for(units.size(), 2);
  const std::vector<std::int64_t> bad = scan_non_finite(threads, true);
  const std::int64_t d = shape.dim, dv_cols = shape.dim_v;
  std::int64_t tiles = 0, skipped = 0, scratch_bytes = 0;
#pragma omp parallel num_threads(threads) reduction(+ : tiles, skipped, scratch_bytes)
  {
    const detail::FlushDenormals flush;
    Scratch& s = thread_scratch();
    Block blk;
#pragma omp for schedule(dynamic, 1)
    for (std::size_t u = 0; u < units.size(); ++u) {
      const Unit& un = units[u];
      const Sequence& seq = geo.sequences[static_cast<std::size_t>(un.seq)];
      if (un.slab < 0) grow(s.own, un.key_end * slab_row);
      float* slab = un.slab < 0 ? s.own.data() : slabs + un.slab;
      std::fill(slab, slab + un.key_end * slab_row, 0.0f);
      float* dk_acc = slab;                    // [key_end][dp]
      float* dv_acc = slab + un.key_end * dp;  // [key_end][dvp]
      for (std::int64_t b0 = un.i0; b0 < un.i1; b0 += qc) {
        geo.layout(seq, un.kvh, b0, std::min(un.i1, b0 + qc), blk);
        const std::int64_t w = blk.width, ldt = padded(w);
        const auto scale = static_cast<float>(shape.scale);
        const bool q_finite = geo.load_q(seq, blk, scale, scale, s.qrows, s.qt);
        grow(s.dorows, w * dvp);
        grow(s.dot, dvp * ldt);
        grow(s.dq, w * dp);
        grow(s.st, kKeyTile * w);
        grow(s.dpt, kKeyTile * w);
        grow(s.row, std::max(dp, dvp));
        for (auto* v : {&s.suffix, &s.total, &s.d_rem}) grow(*v, w);
        start_carries(blk, s.carry);
        std::fill(s.dq.begin(), s.dq.begin() + w * dp, 0.0f);
        bool do_finite = true, totals_finite = true;
        for (std::int64_t r = 0; r < w; ++r) {
          const auto at = static_cast<std::size_t>(r);
          float* dor = s.dorows.data() + r * dvp;
          const std::int64_t h = blk.head[at];
          s.suffix[at] = 0.0f;
          if (h < 0) {
            std::fill(dor, dor + dvp, 0.0f);
            s.total[at] = s.d_rem[at] = 0.0f;
          } else {
            const std::int64_t i = blk.query[at];
            detail::load_heads_row(d_out.data(), shape.dtype, g.dog, seq.b, seq.q0 + i, h, dor, dvp);
            detail::load_heads_row(out.data(), out.dtype(), g.og, seq.b, seq.q0 + i, h, s.row.data(), dvp);
            double total = 0;
            for (std::int64_t c = 0; c < dv_cols; ++c)
              total += static_cast<double>(dor[c]) * s.row[static_cast<std::size_t>(c)];
            float dr = 0.0f;
            if (has_d_rem) {
              dr = static_cast<const float*>(d_rem.data())[g.d_rem.offset(seq.b, seq.q0 + i, h)];
              const float rm = static_cast<const float*>(rem.data())[g.rem.offset(seq.b, seq.q0 + i, h)];
              total -= static_cast<double>(dr) * (1.0 - static_cast<double>(rm));
            }
            s.total[at] = static_cast<float>(total);
            s.d_rem[at] = dr;
            do_finite = do_finite && finite_floats(dor, dv_cols) && std::isfinite(dr);
            totals_finite = totals_finite && std::isfinite(s.total[at]);
          }
          for (std::int64_t c = 0; c < dv_cols; ++c) s.dot[static_cast<std::size_t>(c * ldt + r)] = dor[c];
        }
        const std::int64_t first_bad = bad[static_cast<std::size_t>(un.seq * shape.kv_heads + un.kvh)];
        // A block that meets an inf or NaN (its queries, d_out, d_rem, G, or a key or value row it
        // sees) takes R = Σ_{m<j} g from the left, in two passes (exact_walk): G − suffix would turn
        // an infinite G into NaN where the composition has ±inf.
        const bool exact = !(q_finite && do_finite && totals_finite && first_bad >= blk.key_end);
        const std::int64_t bad_from = exact ? -1 : (spec.skip_vanishing_tiles ? first_bad : -1);
        const std::int64_t n_tiles = (blk.key_end + kKeyTile - 1) / kKeyTile;
        // Recomputes the tile's z (in st) and d_out·v (in dpt); returns its keys.
        const auto scores = [&](std::int64_t k0, std::int64_t keys) {
          const Tile tile = geo.load_tile(seq, un.kvh, k0, keys, s.k, s.v);
          kernels::attn_gemm(tile.k, tile.ldk, 1, s.qt.data(), ldt, s.st.data(), w, keys, w, d, false);
          kernels::attn_gemm(s.v.data(), padded(dvp), 1, s.dot.data(), ldt, s.dpt.data(), w, keys, w, dv_cols, false);
          return tile;
        };
        if (exact) {
          // Pass 1: each tile's Σ g per row; then the sums of the tiles left of each tile.
          grow(s.sig, kKeyTile * w);
          s.sums.assign(static_cast<std::size_t>((n_tiles + 1) * w), 0.0);
          for (std::int64_t t = n_tiles - 1; t >= 0; --t) {
            const std::int64_t k0 = t * kKeyTile, keys = std::min(kKeyTile, blk.key_end - k0);
            scores(k0, keys);
            exact_walk(blk, k0, keys, s.st.data(), s.dpt.data(), s.sig.data(), s.d_rem.data(), s.carry.data(),
                       s.sums.data() + (t + 1) * w);
          }
          for (std::int64_t t = 1; t <= n_tiles; ++t) {
            for (std::int64_t r = 0; r < w; ++r)
              s.sums[static_cast<std::size_t>(t * w + r)] += s.sums[static_cast<std::size_t>((t - 1) * w + r)];
          }
          start_carries(blk, s.carry);
        }
        for (std::int64_t t = n_tiles - 1; t >= 0; --t) {
          const std::int64_t k0 = t * kKeyTile, keys = std::min(kKeyTile, blk.key_end - k0);
          if (vanished(blk, s.carry.data(), k0 + keys, bad_from)) {
            skipped += t + 1;
            tiles += t + 1;
            break;
          }
          ++tiles;
          if (t > 0) geo.prefetch(seq, un.kvh, k0 - kKeyTile, kKeyTile);
          const Tile tile = scores(k0, keys);
          const bool masked = blk.any_masked(k0 + keys);
          if (exact) {
            exact_walk(blk, k0, keys, s.st.data(), s.dpt.data(), s.sig.data(), s.d_rem.data(), s.carry.data(), nullptr);
            exact_finish(blk, k0, keys, s.dpt.data(), s.sig.data(), s.sums.data() + t * w);
          } else {
            kernels::sb_backward_tile(s.st.data(), s.dpt.data(), keys, w, k0, blk.hi.data(), masked, s.total.data(),
                                      s.d_rem.data(), s.carry.data(), s.suffix.data());
          }
          detail::rows::add_tile_gradients(geo, blk, k0, keys, masked, tile,
                                           {s.st.data(), s.dpt.data(), s.dorows.data(), s.qrows.data(), do_finite,
                                            q_finite, dv_acc + k0 * dvp, dk_acc + k0 * dp, s.dq.data()});
        }
        if (!want_dq) continue;
        for (std::int64_t r = 0; r < w; ++r) {
          const std::int64_t h = blk.head[static_cast<std::size_t>(r)];
          if (h < 0) continue;
          float* row = s.dq.data() + r * dp;
          for (std::int64_t c = 0; c < d; ++c) row[c] *= scale;
          detail::store_heads_row(row, dq.data(), shape.dtype, g.dqg, seq.b,
                                  seq.q0 + blk.query[static_cast<std::size_t>(r)], h, true);
        }
      }
      if (un.slab < 0) geo.store_unit(un, dk_acc, dv_acc, dk, g.dkg, dv, g.dvg);
    }
    scratch_bytes += s.bytes();
  }
  geo.add_slabs(split, slabs, threads, dk, g.dkg, dv, g.dvg);
  AttentionStats stats;
  stats.tiles = tiles;
  stats.skipped = skipped;
  stats.workspace_bytes = scratch_bytes + slab_floats * static_cast<std::int64_t>(sizeof(float));
  return stats;
}

// ─── The public object ───────────────────────────────────────────────────────────────────────

StickBreakingAttention::StickBreakingAttention(StickBreakingSpec spec) : plan_(std::make_unique<Plan>()) {
  detail::init_dispatch();
  const SbShape shape = detail::check_stickbreaking(spec);
  plan_->spec = std::move(spec);
  const StickBreakingSpec& sp = plan_->spec;
  plan_->geo =
      detail::rows::Geometry(sp.q, sp.k, sp.v, shape, sp.cu_seqlens_q, sp.cu_seqlens_k, sp.attend_current ? 1 : 0);
}

StickBreakingAttention::~StickBreakingAttention() = default;
StickBreakingAttention::StickBreakingAttention(StickBreakingAttention&&) noexcept = default;
StickBreakingAttention& StickBreakingAttention::operator=(StickBreakingAttention&&) noexcept = default;

const StickBreakingSpec& StickBreakingAttention::spec() const { return plan_->spec; }
std::int64_t StickBreakingAttention::batch() const { return plan_->geo.shape.batch; }
std::int64_t StickBreakingAttention::heads() const { return plan_->geo.shape.heads; }
std::int64_t StickBreakingAttention::kv_heads() const { return plan_->geo.shape.kv_heads; }
std::int64_t StickBreakingAttention::head_dim() const { return plan_->geo.shape.dim; }
std::int64_t StickBreakingAttention::value_dim() const { return plan_->geo.shape.dim_v; }
std::int64_t StickBreakingAttention::q_len() const { return plan_->geo.shape.q_len; }
std::int64_t StickBreakingAttention::k_len() const { return plan_->geo.shape.k_len; }
double StickBreakingAttention::scale() const { return plan_->geo.shape.scale; }

AttentionStats StickBreakingAttention::forward(TensorView out, TensorView rem) const {
  if (plan_->geo.shape.dtype == DType::kF64 || detail::use_reference()) {
    ref::stickbreaking_forward(*this, out, rem);
    return {};
  }
  return plan_->forward(out, rem);
}

AttentionStats StickBreakingAttention::backward(ConstTensorView out, ConstTensorView rem, ConstTensorView d_out,
                                                ConstTensorView d_rem, TensorView dq, TensorView dk,
                                                TensorView dv) const {
  if (plan_->geo.shape.dtype == DType::kF64 || detail::use_reference()) {
    ref::stickbreaking_backward(*this, out, rem, d_out, d_rem, dq, dk, dv);
    return {};
  }
  return plan_->backward(out, rem, d_out, d_rem, dq, dk, dv);
}

}  // namespace posenc
