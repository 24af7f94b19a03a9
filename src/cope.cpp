// CoPE (cope.hpp): validation, and the fused forward and backward over blocks of query rows whose
// key tiles run from the diagonal leftwards (row_blocks.hpp), with an online softmax.
#include "posenc/cope.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "absolute_checks.hpp"
#include "cope_checks.hpp"
#include "internal.hpp"
#include "kernels/attention/attention_kernels.hpp"
#include "kernels/attention/cope_kernels.hpp"
#include "kernels/common/flush_denormals.hpp"
#include "posenc/error.hpp"
#include "posenc/reference.hpp"

namespace posenc {

namespace detail {
namespace {

void require(bool ok, const char* param, const std::string& value, const std::string& expected) {
  if (!ok) throw Error(kCope, param, value, expected);
}

TableGrid table_grid(const CopeShape& shape, const char* name, ConstTensorView table) {
  require(table.rank() == 2 && table.size(0) >= 1 && table.size(0) <= kCopeMaxPositions && table.size(1) == shape.dim,
          name, table.describe(),
          "[npos, D] with 1 <= npos <= " + std::to_string(kCopeMaxPositions) + " and D = " + std::to_string(shape.dim));
  if (table.dtype() != shape.dtype && table.dtype() != DType::kF32) {
    throw Error(
        kCope, std::string(name) + ".dtype", std::string(dtype_name(table.dtype())),
        shape.dtype == DType::kF32 ? std::string("f32") : std::string(dtype_name(shape.dtype)) + " (as q) or f32");
  }
  return {table.stride(0), table.stride(1), table.dtype()};
}

}  // namespace

CopeShape check_cope(const CopeSpec& spec) {
  CopeShape s;
  static_cast<QkvShape&>(s) =
      check_qkv(kCope, spec.q, spec.k, spec.v, spec.scale, spec.cu_seqlens_q, spec.cu_seqlens_k);
  s.table = table_grid(s, "table", spec.table);
  s.npos = spec.table.size(0);
  return s;
}

HeadsGrid check_cope_forward_outputs(const CopeSpec& spec, const CopeShape& shape, ConstTensorView out,
                                     ConstTensorView lse) {
  const HeadsGrid og = check_output_tokens(kCope, "out", out, shape.out_grid());
  check_out_dtype(kCope, shape, out);
  check_writable(kCope, "out", out);
  if (given(lse)) check_row_stat(kCope, shape, "lse", lse, true);
  check_disjoint(kCope, {{"out", out}, {"lse", lse}},
                 {{"q", spec.q}, {"k", spec.k}, {"v", spec.v}, {"table", spec.table}});
  return og;
}

CopeBackwardGrids check_cope_backward(const CopeSpec& spec, const CopeShape& shape, ConstTensorView out,
                                      ConstTensorView lse, ConstTensorView d_out, ConstTensorView dq,
                                      ConstTensorView dk, ConstTensorView dv, ConstTensorView d_table) {
  CopeBackwardGrids g;
  static_cast<QkvBackwardGrids&>(g) = check_qkv_backward(kCope, shape, out, d_out, dq, dk, dv);
  require(lse.rank() > 0, "lse", "empty", "the forward's lse");
  g.lse = check_row_stat(kCope, shape, "lse", lse, false);
  if (given(d_table)) {
    g.d_table = table_grid(shape, "d_table", d_table);
    require(d_table.size(0) == shape.npos && d_table.dtype() == shape.table.dtype, "d_table", d_table.describe(),
            "the shape and dtype of table, " + spec.table.describe());
    check_writable(kCope, "d_table", d_table);
  }
  check_disjoint(kCope, {{"dq", dq}, {"dk", dk}, {"dv", dv}, {"d_table", d_table}},
                 {{"q", spec.q},
                  {"k", spec.k},
                  {"v", spec.v},
                  {"table", spec.table},
                  {"out", out},
                  {"lse", lse},
                  {"d_out", d_out}});
  return g;
}

}  // namespace detail

// ─── The fused passes ────────────────────────────────────────────────────────────────────────

namespace {

using detail::CopeShape;
using detail::HeadsGrid;
using detail::rows::Block;
using detail::rows::Floats;
using detail::rows::grow;
using detail::rows::kKeyTile;
using detail::rows::padded;
using detail::rows::Sequence;
using detail::rows::Tile;
using detail::rows::Unit;
static_assert(kKeyTile <= kernels::kAttnGemmAddDepth);

constexpr float kInf = std::numeric_limits<float>::infinity();

struct Scratch {
  Floats qt, qrows, qs, qe, dqe, o, st, dpt, dpp, gg, k, v, dot, dorows, dq, own;
  std::vector<float> carry, m, l, corr, lse, delta, left, sums;
  std::int64_t bytes() const {
    std::int64_t n = 0;
    for (const Floats* f : {&qt, &qrows, &qs, &qe, &dqe, &o, &st, &dpt, &dpp, &gg, &k, &v, &dot, &dorows, &dq, &own})
      n += static_cast<std::int64_t>(f->capacity());
    for (const std::vector<float>* f : {&carry, &m, &l, &corr, &lse, &delta, &left, &sums})
      n += static_cast<std::int64_t>(f->capacity());
    return n * static_cast<std::int64_t>(sizeof(float));
  }
};

Scratch& thread_scratch() {
  thread_local Scratch s;
  return s;
}

// Each row's gate sum before its first key: 0, and +inf for padding rows (clamped: they never
// hold a block back from the gate-free path, and they see no key).
// The compensations (carry[width + r]) start at 0.
void start_carries(const Block& blk, std::vector<float>& carry) {
  grow(carry, 2 * blk.width);
  for (std::int64_t r = 0; r < blk.width; ++r) {
    carry[static_cast<std::size_t>(r)] = blk.head[static_cast<std::size_t>(r)] < 0 ? kInf : 0.0f;
    carry[static_cast<std::size_t>(blk.width + r)] = 0.0f;
  }
}

// Whether every row has counted cap (a NaN sum has not).
bool all_clamped(const Block& blk, const std::vector<float>& carry, float cap) {
  for (std::int64_t r = 0; r < blk.width; ++r) {
    if (!(carry[static_cast<std::size_t>(r)] >= cap)) return false;
  }
  return true;
}

}  // namespace

struct CopeAttention::Plan {
  CopeSpec spec;
  detail::rows::Geometry geo;
  std::int64_t npos = 0, npp = 0;  // positions, padded to lane chunks
  detail::CopeShape shape;         // validated once, by the constructor

  // The table as f32: transposed [D][npp] (for ⟨q, e[n]⟩) and as rows [npos][dp] (for dq).
  void load_table(Floats& et, Floats& rows) const {
    const std::int64_t d = geo.shape.dim, dp = geo.dp;
    et.assign(static_cast<std::size_t>(d * npp), 0.0f);
    rows.assign(static_cast<std::size_t>(npos * dp), 0.0f);
    for (std::int64_t n = 0; n < npos; ++n) {
      for (std::int64_t t = 0; t < d; ++t) {
        const auto x = static_cast<float>(detail::load(spec.table.data(), shape.table.dtype, shape.table.offset(n, t)));
        et[static_cast<std::size_t>(t * npp + n)] = x;
        rows[static_cast<std::size_t>(n * dp + t)] = x;
      }
    }
  }

  // The block's queries (raw rows in s.qrows, scaled and transposed in s.qt) and qe = ⟨q, e[n]⟩.
  bool load_block(const Sequence& seq, const Block& blk, const Floats& et, Scratch& s) const {
    const auto scale = static_cast<float>(geo.shape.scale);
    const bool finite = geo.load_q(seq, blk, 1.0f, scale, s.qrows, s.qt);
    grow(s.qe, blk.width * npp);
    kernels::attn_gemm(s.qrows.data(), geo.dp, 1, et.data(), npp, s.qe.data(), npp, blk.width, npp, geo.shape.dim,
                       false);
    return finite;
  }

  AttentionStats forward(TensorView out, TensorView lse) const;
  AttentionStats backward(ConstTensorView out, ConstTensorView lse, ConstTensorView d_out, TensorView dq, TensorView dk,
                          TensorView dv, TensorView d_table) const;
};

AttentionStats CopeAttention::Plan::forward(TensorView out, TensorView lse) const {
  const CopeShape& qs = shape;
  const std::int64_t dvp = geo.dvp;
  const HeadsGrid og = detail::check_cope_forward_outputs(spec, qs, ConstTensorView(out), ConstTensorView(lse));
  const bool want_lse = detail::given(ConstTensorView(lse));
  const detail::RowStatGrid lg =
      want_lse ? detail::check_row_stat(detail::kCope, qs, "lse", ConstTensorView(lse), true) : detail::RowStatGrid{};
  Floats et, erows;
  load_table(et, erows);
  const auto cap = static_cast<float>(npos - 1);
  const std::vector<Unit> units = geo.forward_units();
  const int threads = geo.threads_for(units.size(), 1);
  std::int64_t tiles = 0, scratch_bytes = 0;
#pragma omp parallel num_threads(threads) reduction(+ : tiles, scratch_bytes)
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
      load_block(seq, blk, et, s);
      grow(s.o, w * dvp);
      grow(s.st, kKeyTile * w);
      std::fill(s.o.begin(), s.o.begin() + w * dvp, 0.0f);
      start_carries(blk, s.carry);
      s.m.assign(static_cast<std::size_t>(w), -kInf);
      s.l.assign(static_cast<std::size_t>(w), 0.0f);
      grow(s.corr, w);
      const std::int64_t n_tiles = (blk.key_end + kKeyTile - 1) / kKeyTile;
      for (std::int64_t t = n_tiles - 1; t >= 0; --t) {
        const std::int64_t k0 = t * kKeyTile, keys = std::min(kKeyTile, blk.key_end - k0);
        ++tiles;
        if (t > 0) geo.prefetch(seq, un.kvh, k0 - kKeyTile, kKeyTile);
        const Tile kt = geo.load_tile(seq, un.kvh, k0, keys, s.k, s.v);
        kernels::attn_gemm(kt.k, kt.ldk, 1, s.qt.data(), padded(w), s.st.data(), w, keys, w, qs.dim, false);
        const bool masked = blk.any_masked(k0 + keys);
        kernels::cope_forward_tile(s.st.data(), keys, w, k0, blk.hi.data(), masked, s.qe.data(), npp, cap,
                                   s.carry.data());
        kernels::attn_softmax_tile(s.st.data(), keys, w, s.m.data(), s.l.data(), s.corr.data());
        kernels::attn_scale_rows(s.o.data(), dvp, w, dvp, s.corr.data());
        if (masked && detail::rows_non_finite(s.v.data(), padded(dvp), keys, qs.dim_v)) {
          detail::rows::add_visible(blk, k0, keys, s.st.data(), s.v.data(), padded(dvp), dvp, s.o.data(), dvp, true);
        } else {
          kernels::attn_gemm_add(s.st.data(), 1, w, s.v.data(), padded(dvp), s.o.data(), dvp, w, dvp, keys);
        }
      }
      for (std::int64_t r = 0; r < w; ++r) {
        const auto at = static_cast<std::size_t>(r);
        const std::int64_t h = blk.head[at];
        if (h < 0) continue;
        const std::int64_t i = blk.query[at];
        // l == 0 (every logit −inf): a row of 0 and lse −inf, as the softmax engine's.
        const float l = s.l[at], inv = l == 0 ? 0.0f : 1.0f / l;
        float* row = s.o.data() + r * dvp;
        for (std::int64_t c = 0; c < qs.dim_v; ++c) row[c] *= inv;
        detail::store_heads_row(row, out.data(), out.dtype(), og, seq.b, seq.q0 + i, h, false);
        if (want_lse)
          static_cast<float*>(lse.data())[lg.offset(seq.b, seq.q0 + i, h)] = l == 0 ? -kInf : s.m[at] + std::log(l);
      }
    }
    scratch_bytes += s.bytes();
  }
  AttentionStats stats;
  stats.tiles = tiles;
  stats.workspace_bytes = scratch_bytes + static_cast<std::int64_t>((et.size() + erows.size()) * sizeof(float));
  return stats;
}

AttentionStats CopeAttention::Plan::backward(ConstTensorView out, ConstTensorView lse, ConstTensorView d_out,
                                             TensorView dq, TensorView dk, TensorView dv, TensorView d_table) const {
  const detail::CopeBackwardGrids g = detail::check_cope_backward(spec, shape, out, lse, d_out, dq, dk, dv, d_table);
  const std::int64_t dp = geo.dp, dvp = geo.dvp, slab_row = geo.slab_row(), d = shape.dim, dv_cols = shape.dim_v;
  const std::int64_t qc = geo.rows_per_block_queries();
  const detail::rows::Split split = geo.backward_split();
  const std::vector<Unit>& units = split.units;
  thread_local Floats slab_store, bin_store;  // the calling thread's, kept between calls
  grow(slab_store, split.slab_floats);
  float* const slabs = slab_store.data();  // (the workers' thread_local would be their own)
  // d_table sums per bin, a fixed run of units taken in order by one thread: the bins depend on
  // the shapes only, and are added in bin order.
  const bool want_dq = dq.rank() > 0, want_de = d_table.rank() > 0;
  const auto n_units = static_cast<std::int64_t>(units.size());
  const std::int64_t bins = std::min<std::int64_t>(n_units, 16), bin_floats = npos * dp;
  grow(bin_store, want_de ? bins * bin_floats : 0);
  float* const bin_sums = bin_store.data();
  Floats et, erows;
  load_table(et, erows);
  const auto cap = static_cast<float>(npos - 1);
  const auto scale = static_cast<float>(shape.scale);
  const int threads = geo.threads_for(static_cast<std::size_t>(bins), 2);
  std::int64_t tiles = 0, scratch_bytes = 0;
#pragma omp parallel num_threads(threads) reduction(+ : tiles, scratch_bytes)
  {
    const detail::FlushDenormals flush;
    Scratch& s = thread_scratch();
    Block blk;
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t bin = 0; bin < bins; ++bin) {
      float* de = want_de ? bin_sums + bin * bin_floats : nullptr;
      if (de != nullptr) std::fill(de, de + bin_floats, 0.0f);
      for (std::int64_t u = bin * n_units / bins; u < (bin + 1) * n_units / bins; ++u) {
        const Unit& un = units[static_cast<std::size_t>(u)];
        const Sequence& seq = geo.sequences[static_cast<std::size_t>(un.seq)];
        if (un.slab < 0) grow(s.own, un.key_end * slab_row);
        float* slab = un.slab < 0 ? s.own.data() : slabs + un.slab;
        std::fill(slab, slab + un.key_end * slab_row, 0.0f);
        float* dk_acc = slab;                    // [key_end][dp]
        float* dv_acc = slab + un.key_end * dp;  // [key_end][dvp]
        for (std::int64_t b0 = un.i0; b0 < un.i1; b0 += qc) {
          geo.layout(seq, un.kvh, b0, std::min(un.i1, b0 + qc), blk);
          const std::int64_t w = blk.width, ldt = padded(w);
          const bool q_finite = load_block(seq, blk, et, s);
          grow(s.qs, w * dp);
          for (std::size_t x = 0; x < static_cast<std::size_t>(w * dp); ++x) s.qs[x] = s.qrows[x] * scale;
          grow(s.dorows, w * dvp);
          grow(s.dot, dvp * ldt);
          grow(s.dq, w * dp);
          grow(s.dqe, w * npp);
          grow(s.o, dvp);  // one row of out at a time
          for (Floats* f : {&s.st, &s.dpt, &s.dpp, &s.gg}) grow(*f, kKeyTile * w);
          for (auto* v : {&s.lse, &s.delta, &s.left}) grow(*v, w);
          std::fill(s.dq.begin(), s.dq.begin() + w * dp, 0.0f);
          std::fill(s.dqe.begin(), s.dqe.begin() + w * npp, 0.0f);
          bool do_finite = true;
          for (std::int64_t r = 0; r < w; ++r) {
            const auto at = static_cast<std::size_t>(r);
            float* dor = s.dorows.data() + r * dvp;
            const std::int64_t h = blk.head[at];
            if (h < 0) {
              std::fill(dor, dor + dvp, 0.0f);
              s.lse[at] = -kInf;
              s.delta[at] = 0.0f;
            } else {
              const std::int64_t i = blk.query[at];
              detail::load_heads_row(d_out.data(), shape.dtype, g.dog, seq.b, seq.q0 + i, h, dor, dvp);
              detail::load_heads_row(out.data(), out.dtype(), g.og, seq.b, seq.q0 + i, h, s.o.data(), dvp);
              double delta = 0;
              for (std::int64_t c = 0; c < dv_cols; ++c)
                delta += static_cast<double>(dor[c]) * s.o[static_cast<std::size_t>(c)];
              s.delta[at] = static_cast<float>(delta);
              s.lse[at] = static_cast<const float*>(lse.data())[g.lse.offset(seq.b, seq.q0 + i, h)];
              do_finite = do_finite && detail::rows::finite_floats(dor, dv_cols);
            }
            for (std::int64_t c = 0; c < dv_cols; ++c) s.dot[static_cast<std::size_t>(c * ldt + r)] = dor[c];
          }
          const std::int64_t n_tiles = (blk.key_end + kKeyTile - 1) / kKeyTile;
          // Recomputes the tile's z (in st) and d_out·v (in dpt); returns its keys.
          const auto scores = [&](std::int64_t k0, std::int64_t keys) {
            const Tile tile = geo.load_tile(seq, un.kvh, k0, keys, s.k, s.v);
            kernels::attn_gemm(tile.k, tile.ldk, 1, s.qt.data(), ldt, s.st.data(), w, keys, w, d, false);
            kernels::attn_gemm(s.v.data(), padded(dvp), 1, s.dot.data(), ldt, s.dpt.data(), w, keys, w, dv_cols, false);
            return tile;
          };
          // Pass 1: each tile's Σ dp per row, over the tiles before every row has counted cap
          // (dp is 0 from there on); then sums[t] = Σ over the tiles left of tile t.
          s.sums.assign(static_cast<std::size_t>((n_tiles + 1) * w), 0.0f);
          start_carries(blk, s.carry);
          for (std::int64_t t = n_tiles - 1; t >= 0 && !all_clamped(blk, s.carry, cap); --t) {
            const std::int64_t k0 = t * kKeyTile, keys = std::min(kKeyTile, blk.key_end - k0);
            ++tiles;
            scores(k0, keys);
            kernels::cope_backward_tile(s.st.data(), s.dpt.data(), s.dpp.data(), s.gg.data(), keys, w, k0,
                                        blk.hi.data(), blk.any_masked(k0 + keys), s.qe.data(), npp, cap, s.lse.data(),
                                        s.delta.data(), s.carry.data(), nullptr, s.sums.data() + (t + 1) * w);
          }
          for (std::int64_t t = 1; t <= n_tiles; ++t) {
            for (std::int64_t r = 0; r < w; ++r)
              s.sums[static_cast<std::size_t>(t * w + r)] += s.sums[static_cast<std::size_t>((t - 1) * w + r)];
          }
          // Pass 2: the gradients.
          start_carries(blk, s.carry);
          for (std::int64_t t = n_tiles - 1; t >= 0; --t) {
            const std::int64_t k0 = t * kKeyTile, keys = std::min(kKeyTile, blk.key_end - k0);
            ++tiles;
            if (t > 0) geo.prefetch(seq, un.kvh, k0 - kKeyTile, kKeyTile);
            const Tile tile = scores(k0, keys);
            const bool masked = blk.any_masked(k0 + keys);
            kernels::cope_backward_tile(s.st.data(), s.dpt.data(), s.dpp.data(), s.gg.data(), keys, w, k0,
                                        blk.hi.data(), masked, s.qe.data(), npp, cap, s.lse.data(), s.delta.data(),
                                        s.carry.data(), s.dqe.data(), nullptr);
            std::copy(s.sums.begin() + t * w, s.sums.begin() + (t + 1) * w, s.left.begin());
            kernels::cope_backward_finish(s.dpt.data(), s.dpp.data(), s.gg.data(), keys, w, k0, blk.hi.data(), masked,
                                          s.left.data());
            detail::rows::add_tile_gradients(geo, blk, k0, keys, masked, tile,
                                             {s.st.data(), s.dpt.data(), s.dorows.data(), s.qs.data(), do_finite,
                                              q_finite, dv_acc + k0 * dvp, dk_acc + k0 * dp, s.dq.data()});
          }
          // de[n] += Σ_r dqe[r][n]·q_r;  dq_r = scale·dQ_r + Σ_n dqe[r][n]·e[n].
          if (de != nullptr) kernels::attn_gemm(s.dqe.data(), 1, npp, s.qrows.data(), dp, de, dp, npos, dp, w, true);
          if (!want_dq) continue;
          for (std::int64_t x = 0; x < w * dp; ++x) s.dq[static_cast<std::size_t>(x)] *= scale;
          kernels::attn_gemm(s.dqe.data(), npp, 1, erows.data(), dp, s.dq.data(), dp, w, dp, npos, true);
          for (std::int64_t r = 0; r < w; ++r) {
            const std::int64_t h = blk.head[static_cast<std::size_t>(r)];
            if (h < 0) continue;
            detail::store_heads_row(s.dq.data() + r * dp, dq.data(), shape.dtype, g.dqg, seq.b,
                                    seq.q0 + blk.query[static_cast<std::size_t>(r)], h, true);
          }
        }
        if (un.slab < 0) geo.store_unit(un, dk_acc, dv_acc, dk, g.dkg, dv, g.dvg);
      }
    }
    scratch_bytes += s.bytes();
  }
  geo.add_slabs(split, slabs, threads, dk, g.dkg, dv, g.dvg);
  if (want_de) {
    Floats row(static_cast<std::size_t>(dp));
    for (std::int64_t n = 0; n < npos; ++n) {
      std::fill(row.begin(), row.end(), 0.0f);
      for (std::int64_t b = 0; b < bins; ++b) {
        const float* src = bin_sums + b * bin_floats + n * dp;
        for (std::int64_t t = 0; t < d; ++t) row[static_cast<std::size_t>(t)] += src[t];
      }
      for (std::int64_t t = 0; t < d; ++t) {
        const std::int64_t o = g.d_table.offset(n, t);
        detail::store(d_table.data(), g.d_table.dtype, o,
                      detail::load(d_table.data(), g.d_table.dtype, o) + row[static_cast<std::size_t>(t)]);
      }
    }
  }
  AttentionStats stats;
  stats.tiles = tiles;
  stats.workspace_bytes = scratch_bytes + (split.slab_floats + (want_de ? bins * bin_floats : 0)) *
                                              static_cast<std::int64_t>(sizeof(float));
  return stats;
}

// ─── The public object ───────────────────────────────────────────────────────────────────────

CopeAttention::CopeAttention(CopeSpec spec) : plan_(std::make_unique<Plan>()) {
  detail::init_dispatch();
  const CopeShape shape = detail::check_cope(spec);
  plan_->spec = std::move(spec);
  const CopeSpec& sp = plan_->spec;
  plan_->geo = detail::rows::Geometry(sp.q, sp.k, sp.v, shape, sp.cu_seqlens_q, sp.cu_seqlens_k, 1);
  plan_->npos = shape.npos;
  plan_->npp = detail::rows::round_up(shape.npos, kernels::kAttnAlign);
  plan_->shape = shape;
}

CopeAttention::~CopeAttention() = default;
CopeAttention::CopeAttention(CopeAttention&&) noexcept = default;
CopeAttention& CopeAttention::operator=(CopeAttention&&) noexcept = default;

const CopeSpec& CopeAttention::spec() const { return plan_->spec; }
std::int64_t CopeAttention::batch() const { return plan_->geo.shape.batch; }
std::int64_t CopeAttention::heads() const { return plan_->geo.shape.heads; }
std::int64_t CopeAttention::kv_heads() const { return plan_->geo.shape.kv_heads; }
std::int64_t CopeAttention::head_dim() const { return plan_->geo.shape.dim; }
std::int64_t CopeAttention::value_dim() const { return plan_->geo.shape.dim_v; }
std::int64_t CopeAttention::q_len() const { return plan_->geo.shape.q_len; }
std::int64_t CopeAttention::k_len() const { return plan_->geo.shape.k_len; }
std::int64_t CopeAttention::positions() const { return plan_->npos; }
double CopeAttention::scale() const { return plan_->geo.shape.scale; }

AttentionStats CopeAttention::forward(TensorView out, TensorView lse) const {
  if (plan_->geo.shape.dtype == DType::kF64 || detail::use_reference()) {
    ref::cope_forward(*this, out, lse);
    return {};
  }
  return plan_->forward(out, lse);
}

AttentionStats CopeAttention::backward(ConstTensorView out, ConstTensorView lse, ConstTensorView d_out, TensorView dq,
                                       TensorView dk, TensorView dv, TensorView d_table) const {
  if (plan_->geo.shape.dtype == DType::kF64 || detail::use_reference()) {
    ref::cope_backward(*this, out, lse, d_out, dq, dk, dv, d_table);
    return {};
  }
  return plan_->backward(out, lse, d_out, dq, dk, dv, d_table);
}

}  // namespace posenc
