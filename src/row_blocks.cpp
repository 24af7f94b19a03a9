// Query-row blocks over key tiles walked from the diagonal leftwards (row_blocks.hpp).
#include "row_blocks.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "absolute_checks.hpp"
#include "kernels/attention/attention_kernels.hpp"
#include "kernels/common/flush_denormals.hpp"
#include "posenc/error.hpp"

namespace posenc::detail {

namespace {

void require(bool ok, const char* where, const char* param, const std::string& value, const std::string& expected) {
  if (!ok) throw Error(where, param, value, expected);
}

}  // namespace

QkvShape check_qkv(const char* where, ConstTensorView q, ConstTensorView k, ConstTensorView v, double scale,
                   const std::vector<std::int64_t>& cu_seqlens_q, const std::vector<std::int64_t>& cu_seqlens_k) {
  QkvShape s;
  s.packed = !cu_seqlens_q.empty() || !cu_seqlens_k.empty();
  require(q.rank() == 3 || q.rank() == 4, where, "q", q.describe(), "[B, Sq, H, D] or packed [Tq, H, D]");
  s.qg = heads_grid(where, "q", q);
  s.kg = heads_grid(where, "k", k);
  s.vg = heads_grid(where, "v", v);
  require(k.rank() == q.rank(), where, "k", k.describe(), "the rank of q, " + std::to_string(q.rank()));
  require(v.rank() == q.rank(), where, "v", v.describe(), "the rank of q, " + std::to_string(q.rank()));
  if (s.packed) require(q.rank() == 3, where, "q", q.describe(), "packed [Tq, H, D] with cu_seqlens");
  s.dtype = q.dtype();
  require(s.dtype == DType::kF32 || s.dtype == DType::kBF16 || s.dtype == DType::kF16 || s.dtype == DType::kF64, where,
          "q.dtype", std::string(dtype_name(s.dtype)), "f32, bf16, f16 or f64");
  check_dtype(where, "k", k.dtype(), s.dtype);
  check_dtype(where, "v", v.dtype(), s.dtype);
  s.batch = s.qg.batch;
  s.q_len = s.qg.seq;
  s.k_len = s.kg.seq;
  s.heads = s.qg.heads;
  s.kv_heads = s.kg.heads;
  s.dim = s.qg.dim;
  s.dim_v = s.vg.dim;
  require(s.dim >= 1, where, "q", q.describe(), "head_dim >= 1");
  require(s.heads >= 1, where, "q", q.describe(), "at least one head");
  require(s.kg.batch == s.batch && s.kg.dim == s.dim, where, "k", k.describe(),
          "the batch and head_dim of q, " + q.describe());
  require(s.kv_heads >= 1 && s.heads % s.kv_heads == 0, where, "k", k.describe(),
          "a KV head count dividing the query heads (" + std::to_string(s.heads) + ")");
  require(s.vg.batch == s.batch && s.vg.seq == s.k_len && s.vg.heads == s.kv_heads && s.dim_v >= 1, where, "v",
          v.describe(), "the batch, tokens and heads of k, " + k.describe() + ", and head_dim >= 1");
  require(s.k_len < (std::int64_t{1} << 31), where, "k", k.describe(), "fewer than 2^31 keys");
  s.group = s.heads / s.kv_heads;
  // The logits are f32 (scale·q rounded once): a scale past FLT_MAX would be inf there, one below
  // FLT_MIN 0 or a denormal.
  const double magnitude = std::abs(scale);
  require(scale == 0.0 ||
              (magnitude >= std::numeric_limits<float>::min() && magnitude <= std::numeric_limits<float>::max()),
          where, "scale", to_text(scale), "0 (1/sqrt(head_dim)) or a magnitude within f32's normal range");
  s.scale = scale == 0.0 ? 1.0 / std::sqrt(static_cast<double>(s.dim)) : scale;
  if (s.packed) {
    require(!cu_seqlens_q.empty() && !cu_seqlens_k.empty(), where, "cu_seqlens_k",
            cu_seqlens_k.empty() ? "empty" : "given", "both cu_seqlens_q and cu_seqlens_k, or neither");
    check_cu_seqlens(where, "cu_seqlens_q", cu_seqlens_q, s.q_len);
    check_cu_seqlens(where, "cu_seqlens_k", cu_seqlens_k, s.k_len);
    require(cu_seqlens_q.size() == cu_seqlens_k.size(), where, "cu_seqlens_k",
            "size " + std::to_string(cu_seqlens_k.size()),
            "size of cu_seqlens_q, " + std::to_string(cu_seqlens_q.size()));
    for (std::size_t t = 0; t + 1 < cu_seqlens_q.size(); ++t) {
      const std::int64_t lq = cu_seqlens_q[t + 1] - cu_seqlens_q[t];
      const std::int64_t lk = cu_seqlens_k[t + 1] - cu_seqlens_k[t];
      if (lq > lk) {
        throw Error(where, "cu_seqlens_q", "sequence " + std::to_string(t) + " with " + std::to_string(lq) + " queries",
                    "at most its " + std::to_string(lk) + " keys (queries are the last tokens)");
      }
    }
  } else {
    require(s.q_len <= s.k_len, where, "q", q.describe(),
            "at most as many queries as keys, " + std::to_string(s.k_len) + " (queries are the last tokens)");
  }
  return s;
}

RowStatGrid check_row_stat(const char* where, const QkvShape& shape, const char* name, ConstTensorView view,
                           bool writable) {
  check_dtype(where, name, view.dtype(), DType::kF32);
  RowStatGrid g;
  if (shape.packed) {
    require(view.rank() == 2 && view.size(0) == shape.q_len && view.size(1) == shape.heads, where, name,
            view.describe(), "[Tq, H] = [" + std::to_string(shape.q_len) + ", " + std::to_string(shape.heads) + "]");
    g.seq = view.stride(0);
    g.head = view.stride(1);
  } else {
    require(
        view.rank() == 3 && view.size(0) == shape.batch && view.size(1) == shape.q_len && view.size(2) == shape.heads,
        where, name, view.describe(),
        "[B, Sq, H] = [" + std::to_string(shape.batch) + ", " + std::to_string(shape.q_len) + ", " +
            std::to_string(shape.heads) + "]");
    g.batch = view.stride(0);
    g.seq = view.stride(1);
    g.head = view.stride(2);
  }
  if (writable) check_writable(where, name, view);
  return g;
}

void check_out_dtype(const char* where, const QkvShape& shape, ConstTensorView out) {
  if (out.dtype() != shape.dtype && out.dtype() != DType::kF32) {
    throw Error(where, "out", std::string(dtype_name(out.dtype())),
                std::string(dtype_name(shape.dtype)) + " (as q) or f32");
  }
}

QkvBackwardGrids check_qkv_backward(const char* where, const QkvShape& shape, ConstTensorView out,
                                    ConstTensorView d_out, ConstTensorView dq, ConstTensorView dk, ConstTensorView dv) {
  QkvBackwardGrids g;
  g.og = check_output_tokens(where, "out", out, shape.out_grid());
  check_out_dtype(where, shape, out);
  g.dog = check_output_tokens(where, "d_out", d_out, shape.out_grid());
  check_dtype(where, "d_out", d_out.dtype(), shape.dtype);
  const auto gradient = [&](const char* name, ConstTensorView view, const HeadsGrid& like) {
    if (!given(view)) return HeadsGrid{};
    const HeadsGrid grid = check_output_tokens(where, name, view, like);
    check_dtype(where, name, view.dtype(), shape.dtype);
    check_writable(where, name, view);
    return grid;
  };
  g.dqg = gradient("dq", dq, shape.qg);
  g.dkg = gradient("dk", dk, shape.kg);
  g.dvg = gradient("dv", dv, shape.vg);
  return g;
}

namespace rows {

std::int64_t padded(std::int64_t w) { return w + kernels::kAttnAlign; }

bool Block::any_masked(std::int64_t key_end_of_tile) const {
  for (std::int64_t r = 0; r < width; ++r) {
    if (hi[static_cast<std::size_t>(r)] < key_end_of_tile) return true;
  }
  return false;
}

Geometry::Geometry(ConstTensorView q_, ConstTensorView k_, ConstTensorView v_, QkvShape shape_,
                   const std::vector<std::int64_t>& cu_seqlens_q, const std::vector<std::int64_t>& cu_seqlens_k,
                   std::int64_t extra_)
    : q(q_), k(k_), v(v_), shape(shape_), extra(extra_) {
  dp = round_up(shape.dim, kernels::kAttnAlign);
  dvp = round_up(shape.dim_v, kernels::kAttnAlign);
  if (shape.packed) {
    for (std::size_t t = 0; t + 1 < cu_seqlens_q.size(); ++t) {
      sequences.push_back({0, cu_seqlens_q[t], cu_seqlens_q[t + 1] - cu_seqlens_q[t], cu_seqlens_k[t],
                           cu_seqlens_k[t + 1] - cu_seqlens_k[t]});
    }
  } else {
    for (std::int64_t b = 0; b < shape.batch; ++b) sequences.push_back({b, 0, shape.q_len, 0, shape.k_len});
  }
}

void Geometry::layout(const Sequence& seq, std::int64_t kvh, std::int64_t i0, std::int64_t i1, Block& blk) const {
  blk.valid = (i1 - i0) * shape.group;
  blk.width = round_up(blk.valid, kernels::kAttnAlign);
  blk.head.assign(static_cast<std::size_t>(blk.width), -1);
  blk.query.assign(static_cast<std::size_t>(blk.width), 0);
  blk.hi.assign(static_cast<std::size_t>(blk.width), 0);
  blk.key_end = 0;
  std::int64_t r = 0;
  for (std::int64_t h = kvh * shape.group; h < (kvh + 1) * shape.group; ++h) {
    for (std::int64_t i = i0; i < i1; ++i, ++r) {
      const auto at = static_cast<std::size_t>(r);
      blk.head[at] = h;
      blk.query[at] = i;
      const std::int64_t hi = seq.lk - seq.lq + i + extra;
      blk.hi[at] = static_cast<std::int32_t>(hi);
      blk.key_end = std::max(blk.key_end, hi);
    }
  }
}

bool Geometry::load_q(const Sequence& seq, const Block& blk, float row_scale, float t_scale, Floats& qrows,
                      Floats& qt) const {
  const std::int64_t w = blk.width, ldt = padded(w), d = shape.dim;
  grow(qt, d * ldt);
  grow(qrows, w * dp);
  bool finite = true;
  for (std::int64_t r = 0; r < w; ++r) {
    float* row = qrows.data() + r * dp;
    const std::int64_t h = blk.head[static_cast<std::size_t>(r)];
    if (h < 0) {
      std::fill(row, row + dp, 0.0f);
    } else {
      load_heads_row(q.data(), shape.dtype, shape.qg, seq.b, seq.q0 + blk.query[static_cast<std::size_t>(r)], h, row,
                     dp);
      finite = finite && finite_floats(row, d);
    }
    for (std::int64_t t = 0; t < d; ++t) qt[static_cast<std::size_t>(t * ldt + r)] = row[t] * t_scale;
    if (row_scale != 1.0f) {
      for (std::int64_t t = 0; t < d; ++t) row[t] *= row_scale;
    }
  }
  return finite;
}

Tile Geometry::load_tile(const Sequence& seq, std::int64_t kvh, std::int64_t k0, std::int64_t keys, Floats& kbuf,
                         Floats& vbuf) const {
  grow(vbuf, keys * padded(dvp));
  for (std::int64_t j = 0; j < keys; ++j) {
    load_heads_row(v.data(), shape.dtype, shape.vg, seq.b, seq.k0 + k0 + j, kvh, vbuf.data() + j * padded(dvp), dvp);
  }
  // (D a multiple of the lanes: backward's dQ product reads the keys' rows dp wide.)
  if (shape.dtype == DType::kF32 && shape.kg.dim_stride == 1 && shape.dim == dp) {
    return {static_cast<const float*>(k.data()) + shape.kg.offset(seq.b, seq.k0 + k0) + kvh * shape.kg.head_stride,
            shape.kg.seq_stride};
  }
  grow(kbuf, keys * padded(dp));
  for (std::int64_t j = 0; j < keys; ++j) {
    load_heads_row(k.data(), shape.dtype, shape.kg, seq.b, seq.k0 + k0 + j, kvh, kbuf.data() + j * padded(dp), dp);
  }
  return {kbuf.data(), padded(dp)};
}

void Geometry::prefetch(const Sequence& seq, std::int64_t kvh, std::int64_t k0, std::int64_t keys) const {
  const auto width = static_cast<std::int64_t>(dtype_size(shape.dtype));
  const std::int64_t k_bytes = ((shape.dim - 1) * shape.kg.dim_stride + 1) * width;
  const std::int64_t v_bytes = ((shape.dim_v - 1) * shape.vg.dim_stride + 1) * width;
  for (std::int64_t j = std::max<std::int64_t>(k0, 0); j < k0 + keys; ++j) {
    const char* kr =
        static_cast<const char*>(k.data()) + (shape.kg.offset(seq.b, seq.k0 + j) + kvh * shape.kg.head_stride) * width;
    const char* vr =
        static_cast<const char*>(v.data()) + (shape.vg.offset(seq.b, seq.k0 + j) + kvh * shape.vg.head_stride) * width;
    for (std::int64_t at = 0; at < k_bytes; at += 64) __builtin_prefetch(kr + at, 0, 2);
    for (std::int64_t at = 0; at < v_bytes; at += 64) __builtin_prefetch(vr + at, 0, 2);
  }
}

std::vector<std::int64_t> Geometry::scan_non_finite(int threads) const {
  const auto pairs = static_cast<std::int64_t>(sequences.size()) * shape.kv_heads;
  std::vector<std::int64_t> bad(static_cast<std::size_t>(pairs), -1);
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (std::int64_t u = 0; u < pairs; ++u) {
    thread_local Floats row;
    grow(row, std::max(dp, dvp));
    const Sequence& seq = sequences[static_cast<std::size_t>(u / shape.kv_heads)];
    const std::int64_t kvh = u % shape.kv_heads;
    std::int64_t first = seq.lk;
    for (std::int64_t j = 0; j < seq.lk && first == seq.lk; ++j) {
      load_heads_row(k.data(), shape.dtype, shape.kg, seq.b, seq.k0 + j, kvh, row.data(), dp);
      if (!finite_floats(row.data(), shape.dim)) first = j;
      load_heads_row(v.data(), shape.dtype, shape.vg, seq.b, seq.k0 + j, kvh, row.data(), dvp);
      if (!finite_floats(row.data(), shape.dim_v)) first = j;
    }
    bad[static_cast<std::size_t>(u)] = first;
  }
  return bad;
}

int Geometry::threads_for(std::size_t units, std::int64_t passes) const {
  std::int64_t work = 0;
  for (const Sequence& seq : sequences) work += seq.lq * seq.lk;
  return std::min<int>(detail::threads_for(work * shape.heads * (shape.dim + shape.dim_v) * passes),
                       static_cast<int>(std::max<std::size_t>(units, 1)));
}

std::vector<Unit> Geometry::forward_units() const {
  std::vector<Unit> units;
  const std::int64_t qc = rows_per_block_queries();
  for (std::size_t si = 0; si < sequences.size(); ++si) {
    for (std::int64_t kvh = 0; kvh < shape.kv_heads; ++kvh) {
      for (std::int64_t i0 = 0; i0 < sequences[si].lq; i0 += qc)
        units.push_back({static_cast<std::int64_t>(si), kvh, i0, std::min(sequences[si].lq, i0 + qc), 0, -1});
    }
  }
  return units;
}

Split Geometry::backward_split() const {
  Split split;
  std::int64_t pairs = 0;
  for (const Sequence& seq : sequences) pairs += seq.lq > 0 ? shape.kv_heads : 0;
  const std::int64_t qc = rows_per_block_queries();
  for (std::size_t si = 0; si < sequences.size(); ++si) {
    const Sequence& seq = sequences[si];
    if (seq.lq == 0) continue;
    const std::int64_t ranges =
        pairs >= 8 ? 1 : std::max<std::int64_t>(1, std::min((8 + pairs - 1) / pairs, seq.lq / 256));
    const std::int64_t span = round_up((seq.lq + ranges - 1) / ranges, qc);
    const bool split_pair = span < seq.lq;
    for (std::int64_t kvh = 0; kvh < shape.kv_heads; ++kvh) {
      for (std::int64_t i0 = 0; i0 < seq.lq; i0 += span) {
        const std::int64_t i1 = std::min(seq.lq, i0 + span);
        const std::int64_t key_end = std::max<std::int64_t>(0, std::min(seq.lk, seq.lk - seq.lq + i1 - 1 + extra));
        split.units.push_back(
            {static_cast<std::int64_t>(si), kvh, i0, i1, key_end, split_pair ? split.slab_floats : -1});
        if (split_pair) split.slab_floats += key_end * slab_row();
      }
    }
  }
  return split;
}

void Geometry::store_unit(const Unit& un, const float* dk_acc, const float* dv_acc, TensorView dk, const HeadsGrid& dkg,
                          TensorView dv, const HeadsGrid& dvg) const {
  const Sequence& seq = sequences[static_cast<std::size_t>(un.seq)];
  for (std::int64_t j = 0; j < un.key_end; ++j) {
    if (dk.rank() > 0) store_heads_row(dk_acc + j * dp, dk.data(), shape.dtype, dkg, seq.b, seq.k0 + j, un.kvh, true);
    if (dv.rank() > 0) store_heads_row(dv_acc + j * dvp, dv.data(), shape.dtype, dvg, seq.b, seq.k0 + j, un.kvh, true);
  }
}

void Geometry::add_slabs(const Split& split, const float* slabs, int threads, TensorView dk, const HeadsGrid& dkg,
                         TensorView dv, const HeadsGrid& dvg) const {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (std::int64_t pair = 0; pair < static_cast<std::int64_t>(sequences.size()) * shape.kv_heads; ++pair) {
    const std::int64_t si = pair / shape.kv_heads, kvh = pair % shape.kv_heads;
    const Sequence& seq = sequences[static_cast<std::size_t>(si)];
    std::vector<const Unit*> mine;
    std::int64_t keys = 0;
    for (const Unit& un : split.units) {
      if (un.seq == si && un.kvh == kvh) {
        mine.push_back(&un);
        keys = std::max(keys, un.key_end);
      }
    }
    if (mine.empty() || mine[0]->slab < 0) continue;  // added by its unit
    Floats sum(static_cast<std::size_t>(slab_row()));
    for (std::int64_t j = 0; j < keys; ++j) {
      std::fill(sum.begin(), sum.end(), 0.0f);
      for (const Unit* un : mine) {
        if (j >= un->key_end) continue;
        const float* dk_row = slabs + un->slab + j * dp;
        const float* dv_row = slabs + un->slab + un->key_end * dp + j * dvp;
        for (std::int64_t c = 0; c < dp; ++c) sum[static_cast<std::size_t>(c)] += dk_row[c];
        for (std::int64_t c = 0; c < dvp; ++c) sum[static_cast<std::size_t>(dp + c)] += dv_row[c];
      }
      if (dk.rank() > 0) store_heads_row(sum.data(), dk.data(), shape.dtype, dkg, seq.b, seq.k0 + j, kvh, true);
      if (dv.rank() > 0) store_heads_row(sum.data() + dp, dv.data(), shape.dtype, dvg, seq.b, seq.k0 + j, kvh, true);
    }
  }
}

void add_visible(const Block& blk, std::int64_t k0, std::int64_t keys, const float* t, const float* b, std::int64_t ldb,
                 std::int64_t cols, float* out, std::int64_t ldo, bool by_rows) {
  for (std::int64_t r = 0; r < blk.width; ++r) {
    const std::int64_t hi = blk.hi[static_cast<std::size_t>(r)];
    if (blk.head[static_cast<std::size_t>(r)] < 0) continue;
    for (std::int64_t j = 0; j < keys && k0 + j < hi; ++j) {
      const float w = t[j * blk.width + r];
      const float* src = b + (by_rows ? j : r) * ldb;
      float* dst = out + (by_rows ? r : j) * ldo;
      for (std::int64_t c = 0; c < cols; ++c) dst[c] += w * src[c];
    }
  }
}

void add_tile_gradients(const Geometry& geo, const Block& blk, std::int64_t k0, std::int64_t keys, bool masked,
                        const Tile& tile, const TileGradients& t) {
  const std::int64_t w = blk.width, dp = geo.dp, dvp = geo.dvp;
  if (masked && !t.do_finite) {
    add_visible(blk, k0, keys, t.p, t.dorows, dvp, dvp, t.dv_acc, dvp, false);
  } else {
    kernels::attn_gemm(t.p, w, 1, t.dorows, dvp, t.dv_acc, dvp, keys, dvp, w, true);
  }
  if (masked && !t.q_finite) {
    add_visible(blk, k0, keys, t.dz, t.qs, dp, dp, t.dk_acc, dp, false);
  } else {
    kernels::attn_gemm(t.dz, w, 1, t.qs, dp, t.dk_acc, dp, keys, dp, w, true);
  }
  if (masked && rows_non_finite(tile.k, tile.ldk, keys, geo.shape.dim)) {
    add_visible(blk, k0, keys, t.dz, tile.k, tile.ldk, geo.shape.dim, t.dq, dp, true);
  } else {
    kernels::attn_gemm(t.dz, 1, w, tile.k, tile.ldk, t.dq, dp, w, dp, keys, true);
  }
}

std::int64_t WalkScratch::bytes() const {
  std::int64_t n = 0;
  for (const Floats* f : {&qt, &qrows, &o, &st, &dpt, &k, &v, &dot, &dorows, &dq, &row, &own})
    n += static_cast<std::int64_t>(f->capacity());
  return n * static_cast<std::int64_t>(sizeof(float));
}

namespace {

WalkScratch& walk_scratch() {
  thread_local WalkScratch s;
  return s;
}

}  // namespace

Tile BlockWalk::scores(std::int64_t k0, std::int64_t keys) const {
  const std::int64_t w = blk.width, ldt = padded(w);
  const Tile tile = geo.load_tile(seq, un.kvh, k0, keys, s.k, s.v);
  kernels::attn_gemm(tile.k, tile.ldk, 1, s.qt.data(), ldt, s.st.data(), w, keys, w, geo.shape.dim, false);
  kernels::attn_gemm(s.v.data(), padded(geo.dvp), 1, s.dot.data(), ldt, s.dpt.data(), w, keys, w, geo.shape.dim_v,
                     false);
  return tile;
}

AttentionStats walk_forward(const Geometry& geo, const std::function<std::unique_ptr<ForwardRows>()>& make,
                            TensorView out, const HeadsGrid& og, TensorView stat, const RowStatGrid& sg) {
  const std::int64_t dvp = geo.dvp;
  const bool want_stat = given(ConstTensorView(stat));
  const std::vector<Unit> units = geo.forward_units();
  const int threads = geo.threads_for(units.size(), 1);
  std::int64_t tiles = 0, skipped = 0, scratch_bytes = 0;
#pragma omp parallel num_threads(threads) reduction(+ : tiles, skipped, scratch_bytes)
  {
    const FlushDenormals flush;
    WalkScratch& s = walk_scratch();
    const std::unique_ptr<ForwardRows> rows = make();
    Block blk;
#pragma omp for schedule(dynamic, 1)
    for (std::size_t u = 0; u < units.size(); ++u) {
      const Unit& un = units[u];
      const Sequence& seq = geo.sequences[static_cast<std::size_t>(un.seq)];
      geo.layout(seq, un.kvh, un.i0, un.i1, blk);
      const std::int64_t w = blk.width;
      rows->start(un, blk, s);
      grow(s.o, w * dvp);
      grow(s.st, kKeyTile * w);
      std::fill(s.o.begin(), s.o.begin() + w * dvp, 0.0f);
      const std::int64_t n_tiles = (blk.key_end + kKeyTile - 1) / kKeyTile;
      for (std::int64_t t = n_tiles - 1; t >= 0; --t) {
        const std::int64_t k0 = t * kKeyTile, keys = std::min(kKeyTile, blk.key_end - k0);
        if (rows->vanished(blk, k0 + keys)) {
          skipped += t + 1;
          tiles += t + 1;
          break;
        }
        ++tiles;
        if (t > 0) geo.prefetch(seq, un.kvh, k0 - kKeyTile, kKeyTile);
        const Tile kt = geo.load_tile(seq, un.kvh, k0, keys, s.k, s.v);
        kernels::attn_gemm(kt.k, kt.ldk, 1, s.qt.data(), padded(w), s.st.data(), w, keys, w, geo.shape.dim, false);
        const bool masked = blk.any_masked(k0 + keys);
        rows->weigh(blk, k0, keys, masked, s);
        if (masked && rows_non_finite(s.v.data(), padded(dvp), keys, geo.shape.dim_v)) {
          add_visible(blk, k0, keys, s.st.data(), s.v.data(), padded(dvp), dvp, s.o.data(), dvp, true);
        } else {
          kernels::attn_gemm_add(s.st.data(), 1, w, s.v.data(), padded(dvp), s.o.data(), dvp, w, dvp, keys);
        }
      }
      for (std::int64_t r = 0; r < w; ++r) {
        const std::int64_t h = blk.head[static_cast<std::size_t>(r)];
        if (h < 0) continue;
        const std::int64_t token = seq.q0 + blk.query[static_cast<std::size_t>(r)];
        float* row = s.o.data() + r * dvp;
        const float value = rows->finish(r, row);
        store_heads_row(row, out.data(), out.dtype(), og, seq.b, token, h, false);
        if (want_stat) static_cast<float*>(stat.data())[sg.offset(seq.b, token, h)] = value;
      }
    }
    scratch_bytes += s.bytes() + rows->bytes();
  }
  AttentionStats stats;
  stats.tiles = tiles;
  stats.skipped = skipped;
  stats.workspace_bytes = scratch_bytes;
  return stats;
}

AttentionStats walk_backward(const Geometry& geo, const Split& split, std::int64_t runs,
                             const std::function<std::unique_ptr<BackwardRows>()>& make, const QkvBackwardGrids& g,
                             ConstTensorView out, ConstTensorView d_out, TensorView dq, TensorView dk, TensorView dv) {
  const std::int64_t dp = geo.dp, dvp = geo.dvp, slab_row = geo.slab_row(), dv_cols = geo.shape.dim_v;
  const std::int64_t qc = geo.rows_per_block_queries();
  const std::vector<Unit>& units = split.units;
  thread_local Floats slab_store;  // the calling thread's, kept between calls
  grow(slab_store, split.slab_floats);
  float* const slabs = slab_store.data();  // (the workers' thread_local would be their own)
  const bool want_dq = dq.rank() > 0;
  const auto n_units = static_cast<std::int64_t>(units.size());
  const int threads = geo.threads_for(static_cast<std::size_t>(runs), 2);
  std::int64_t tiles = 0, skipped = 0, scratch_bytes = 0;
#pragma omp parallel num_threads(threads) reduction(+ : tiles, skipped, scratch_bytes)
  {
    const FlushDenormals flush;
    WalkScratch& s = walk_scratch();
    const std::unique_ptr<BackwardRows> rows = make();
    Block blk;
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t run = 0; run < runs; ++run) {
      rows->start_run(run);
      for (std::int64_t u = run * n_units / runs; u < (run + 1) * n_units / runs; ++u) {
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
          const bool q_finite = rows->start(un, blk, s);
          grow(s.dorows, w * dvp);
          grow(s.dot, dvp * ldt);
          grow(s.dq, w * dp);
          grow(s.st, kKeyTile * w);
          grow(s.dpt, kKeyTile * w);
          grow(s.row, dvp);
          std::fill(s.dq.begin(), s.dq.begin() + w * dp, 0.0f);
          bool do_finite = true;
          for (std::int64_t r = 0; r < w; ++r) {
            float* dor = s.dorows.data() + r * dvp;
            const std::int64_t h = blk.head[static_cast<std::size_t>(r)];
            if (h < 0) {
              std::fill(dor, dor + dvp, 0.0f);
              rows->pad_row(r);
            } else {
              const std::int64_t token = seq.q0 + blk.query[static_cast<std::size_t>(r)];
              load_heads_row(d_out.data(), geo.shape.dtype, g.dog, seq.b, token, h, dor, dvp);
              load_heads_row(out.data(), out.dtype(), g.og, seq.b, token, h, s.row.data(), dvp);
              double dot = 0;
              for (std::int64_t c = 0; c < dv_cols; ++c)
                dot += static_cast<double>(dor[c]) * s.row[static_cast<std::size_t>(c)];
              const bool own_finite = rows->row(r, seq.b, token, h, dot);
              do_finite = do_finite && finite_floats(dor, dv_cols) && own_finite;
            }
            for (std::int64_t c = 0; c < dv_cols; ++c) s.dot[static_cast<std::size_t>(c * ldt + r)] = dor[c];
          }
          BlockWalk walk{geo, un, seq, blk, s, q_finite, do_finite, tiles};
          rows->prepare(walk);
          const float* qs = rows->scaled_q(s);
          for (std::int64_t t = walk.n_tiles() - 1; t >= 0; --t) {
            const std::int64_t k0 = walk.k0(t), keys = walk.keys(t);
            if (rows->vanished(blk, k0 + keys)) {
              skipped += t + 1;
              tiles += t + 1;
              break;
            }
            ++tiles;
            if (t > 0) geo.prefetch(seq, un.kvh, k0 - kKeyTile, kKeyTile);
            const Tile tile = walk.scores(k0, keys);
            const bool masked = blk.any_masked(k0 + keys);
            rows->tile(walk, t, masked);
            add_tile_gradients(geo, blk, k0, keys, masked, tile,
                               {s.st.data(), s.dpt.data(), s.dorows.data(), qs, do_finite, q_finite, dv_acc + k0 * dvp,
                                dk_acc + k0 * dp, s.dq.data()});
          }
          rows->finish(blk, s, want_dq);
          if (!want_dq) continue;
          for (std::int64_t r = 0; r < w; ++r) {
            const std::int64_t h = blk.head[static_cast<std::size_t>(r)];
            if (h < 0) continue;
            store_heads_row(s.dq.data() + r * dp, dq.data(), geo.shape.dtype, g.dqg, seq.b,
                            seq.q0 + blk.query[static_cast<std::size_t>(r)], h, true);
          }
        }
        if (un.slab < 0) geo.store_unit(un, dk_acc, dv_acc, dk, g.dkg, dv, g.dvg);
      }
    }
    scratch_bytes += s.bytes() + rows->bytes();
  }
  geo.add_slabs(split, slabs, threads, dk, g.dkg, dv, g.dvg);
  AttentionStats stats;
  stats.tiles = tiles;
  stats.skipped = skipped;
  stats.workspace_bytes = scratch_bytes + split.slab_floats * static_cast<std::int64_t>(sizeof(float));
  return stats;
}

}  // namespace rows
}  // namespace posenc::detail
