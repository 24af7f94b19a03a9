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
  SbShape s;
  s.packed = !spec.cu_seqlens_q.empty() || !spec.cu_seqlens_k.empty();
  require(spec.q.rank() == 3 || spec.q.rank() == 4, "q", spec.q.describe(), "[B, Sq, H, D] or packed [Tq, H, D]");
  s.qg = heads_grid(kStickBreaking, "q", spec.q);
  s.kg = heads_grid(kStickBreaking, "k", spec.k);
  s.vg = heads_grid(kStickBreaking, "v", spec.v);
  require(spec.k.rank() == spec.q.rank(), "k", spec.k.describe(), "the rank of q, " + std::to_string(spec.q.rank()));
  require(spec.v.rank() == spec.q.rank(), "v", spec.v.describe(), "the rank of q, " + std::to_string(spec.q.rank()));
  if (s.packed) require(spec.q.rank() == 3, "q", spec.q.describe(), "packed [Tq, H, D] with cu_seqlens");
  s.dtype = spec.q.dtype();
  require(s.dtype == DType::kF32 || s.dtype == DType::kBF16 || s.dtype == DType::kF16 || s.dtype == DType::kF64,
          "q.dtype", std::string(dtype_name(s.dtype)), "f32, bf16, f16 or f64");
  check_dtype(kStickBreaking, "k", spec.k.dtype(), s.dtype);
  check_dtype(kStickBreaking, "v", spec.v.dtype(), s.dtype);
  s.batch = s.qg.batch;
  s.q_len = s.qg.seq;
  s.k_len = s.kg.seq;
  s.heads = s.qg.heads;
  s.kv_heads = s.kg.heads;
  s.dim = s.qg.dim;
  s.dim_v = s.vg.dim;
  require(s.dim >= 1, "q", spec.q.describe(), "head_dim >= 1");
  require(s.heads >= 1, "q", spec.q.describe(), "at least one head");
  require(s.kg.batch == s.batch && s.kg.dim == s.dim, "k", spec.k.describe(),
          "the batch and head_dim of q, " + spec.q.describe());
  require(s.kv_heads >= 1 && s.heads % s.kv_heads == 0, "k", spec.k.describe(),
          "a KV head count dividing the query heads (" + std::to_string(s.heads) + ")");
  require(s.vg.batch == s.batch && s.vg.seq == s.k_len && s.vg.heads == s.kv_heads && s.dim_v >= 1, "v",
          spec.v.describe(), "the batch, tokens and heads of k, " + spec.k.describe() + ", and head_dim >= 1");
  require(s.k_len < (std::int64_t{1} << 31), "k", spec.k.describe(), "fewer than 2^31 keys");
  s.group = s.heads / s.kv_heads;
  // The logits are f32 (scale·q rounded once): a scale past FLT_MAX would be inf there, one below
  // FLT_MIN 0 or a denormal.
  const double magnitude = std::abs(spec.scale);
  require(spec.scale == 0.0 ||
              (magnitude >= std::numeric_limits<float>::min() && magnitude <= std::numeric_limits<float>::max()),
          "scale", to_text(spec.scale), "0 (1/sqrt(head_dim)) or a magnitude within f32's normal range");
  s.scale = spec.scale == 0.0 ? 1.0 / std::sqrt(static_cast<double>(s.dim)) : spec.scale;
  if (s.packed) {
    require(!spec.cu_seqlens_q.empty() && !spec.cu_seqlens_k.empty(), "cu_seqlens_k",
            spec.cu_seqlens_k.empty() ? "empty" : "given", "both cu_seqlens_q and cu_seqlens_k, or neither");
    check_cu_seqlens(kStickBreaking, "cu_seqlens_q", spec.cu_seqlens_q, s.q_len);
    check_cu_seqlens(kStickBreaking, "cu_seqlens_k", spec.cu_seqlens_k, s.k_len);
    require(spec.cu_seqlens_q.size() == spec.cu_seqlens_k.size(), "cu_seqlens_k",
            "size " + std::to_string(spec.cu_seqlens_k.size()),
            "size of cu_seqlens_q, " + std::to_string(spec.cu_seqlens_q.size()));
    for (std::size_t t = 0; t + 1 < spec.cu_seqlens_q.size(); ++t) {
      const std::int64_t lq = spec.cu_seqlens_q[t + 1] - spec.cu_seqlens_q[t];
      const std::int64_t lk = spec.cu_seqlens_k[t + 1] - spec.cu_seqlens_k[t];
      if (lq > lk) {
        throw Error(kStickBreaking, "cu_seqlens_q",
                    "sequence " + std::to_string(t) + " with " + std::to_string(lq) + " queries",
                    "at most its " + std::to_string(lk) + " keys (queries are the last tokens)");
      }
    }
  } else {
    require(s.q_len <= s.k_len, "q", spec.q.describe(),
            "at most as many queries as keys, " + std::to_string(s.k_len) + " (queries are the last tokens)");
  }
  return s;
}

RemGrid check_rem(const SbShape& shape, const char* name, ConstTensorView rem, bool writable) {
  check_dtype(kStickBreaking, name, rem.dtype(), DType::kF32);
  RemGrid g;
  if (shape.packed) {
    require(rem.rank() == 2 && rem.size(0) == shape.q_len && rem.size(1) == shape.heads, name, rem.describe(),
            "[Tq, H] = [" + std::to_string(shape.q_len) + ", " + std::to_string(shape.heads) + "]");
    g.seq = rem.stride(0);
    g.head = rem.stride(1);
  } else {
    require(rem.rank() == 3 && rem.size(0) == shape.batch && rem.size(1) == shape.q_len && rem.size(2) == shape.heads,
            name, rem.describe(),
            "[B, Sq, H] = [" + std::to_string(shape.batch) + ", " + std::to_string(shape.q_len) + ", " +
                std::to_string(shape.heads) + "]");
    g.batch = rem.stride(0);
    g.seq = rem.stride(1);
    g.head = rem.stride(2);
  }
  if (writable) check_writable(kStickBreaking, name, rem);
  return g;
}

namespace {

bool given(ConstTensorView v) { return v.rank() > 0 && v.data() != nullptr; }

// out in the inputs' dtype, or f32 for any (backward then reads an out that was not rounded to
// 16 bits).
void check_out_dtype(const SbShape& shape, ConstTensorView out) {
  if (out.dtype() != shape.dtype && out.dtype() != DType::kF32) {
    throw Error(kStickBreaking, "out", std::string(dtype_name(out.dtype())),
                std::string(dtype_name(shape.dtype)) + " (as q) or f32");
  }
}

}  // namespace

HeadsGrid check_sb_forward_outputs(const StickBreakingSpec& spec, const SbShape& shape, ConstTensorView out,
                                   ConstTensorView rem) {
  const HeadsGrid og = check_output_tokens(kStickBreaking, "out", out, shape.out_grid());
  check_out_dtype(shape, out);
  check_writable(kStickBreaking, "out", out);
  if (given(rem)) check_rem(shape, "rem", rem, true);
  check_disjoint(kStickBreaking, {{"out", out}, {"rem", rem}}, {{"q", spec.q}, {"k", spec.k}, {"v", spec.v}});
  return og;
}

SbBackwardGrids check_sb_backward(const StickBreakingSpec& spec, const SbShape& shape, ConstTensorView out,
                                  ConstTensorView rem, ConstTensorView d_out, ConstTensorView d_rem, ConstTensorView dq,
                                  ConstTensorView dk, ConstTensorView dv) {
  SbBackwardGrids g;
  g.og = check_output_tokens(kStickBreaking, "out", out, shape.out_grid());
  check_out_dtype(shape, out);
  g.dog = check_output_tokens(kStickBreaking, "d_out", d_out, shape.out_grid());
  check_dtype(kStickBreaking, "d_out", d_out.dtype(), shape.dtype);
  if (given(d_rem)) {
    require(given(rem), "rem", "empty", "the forward's rem when d_rem is given");
    g.d_rem = check_rem(shape, "d_rem", d_rem, false);
  }
  if (given(rem)) g.rem = check_rem(shape, "rem", rem, false);
  const auto gradient = [&](const char* name, ConstTensorView view, const HeadsGrid& like) {
    if (!given(view)) return HeadsGrid{};
    const HeadsGrid grid = check_output_tokens(kStickBreaking, name, view, like);
    check_dtype(kStickBreaking, name, view.dtype(), shape.dtype);
    check_writable(kStickBreaking, name, view);
    return grid;
  };
  g.dqg = gradient("dq", dq, shape.qg);
  g.dkg = gradient("dk", dk, shape.kg);
  g.dvg = gradient("dv", dv, shape.vg);
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
using kernels::kAttnAlign;
using kernels::kSbDead;
using Floats = detail::AlignedFloats;

constexpr std::int64_t kBlockRows = 64;  // query rows per block (the lanes of a tile)
constexpr std::int64_t kKeyTile = 64;    // keys per tile (<= kAttnGemmAddDepth)
static_assert(kKeyTile <= kernels::kAttnGemmAddDepth);

std::int64_t round_up(std::int64_t x, std::int64_t to) { return (x + to - 1) / to * to; }
// One cache line more than the rows need: see engine.hpp's padded_stride.
std::int64_t padded(std::int64_t w) { return w + kAttnAlign; }

struct Sequence {
  std::int64_t b = 0, q0 = 0, lq = 0, k0 = 0, lk = 0;
};

// The rows of a block: (head, query) pairs of one KV head's group, padded to whole lane chunks.
struct Block {
  std::int64_t width = 0, valid = 0, key_end = 0;
  std::vector<std::int64_t> head, query;  // head −1: a padding row
  std::vector<std::int32_t> hi;           // the row sees keys [0, hi)
  bool any_masked(std::int64_t key_end_of_tile) const {
    for (std::int64_t r = 0; r < width; ++r) {
      if (hi[static_cast<std::size_t>(r)] < key_end_of_tile) return true;
    }
    return false;
  }
};

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

template <class V>
void grow(V& v, std::int64_t n) {
  if (static_cast<std::int64_t>(v.size()) < n) v.resize(static_cast<std::size_t>(n));
}

Scratch& thread_scratch() {
  thread_local Scratch s;
  return s;
}

bool finite_floats(const float* x, std::int64_t n) { return !detail::rows_non_finite(x, 0, 1, n); }

}  // namespace

struct StickBreakingAttention::Plan {
  StickBreakingSpec spec;
  SbShape shape;
  std::vector<Sequence> sequences;
  std::int64_t dp = 0, dvp = 0;  // D and Dv padded to lane chunks

  std::int64_t rows_per_block_queries() const { return std::max<std::int64_t>(1, kBlockRows / shape.group); }

  // The block of the group of KV head kvh over queries [i0, i1) of seq.
  void layout(const Sequence& seq, std::int64_t kvh, std::int64_t i0, std::int64_t i1, Block& blk) const {
    blk.valid = (i1 - i0) * shape.group;
    blk.width = round_up(blk.valid, kAttnAlign);
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
        const std::int64_t hi = seq.lk - seq.lq + i + (spec.attend_current ? 1 : 0);
        blk.hi[at] = static_cast<std::int32_t>(hi);
        blk.key_end = std::max(blk.key_end, hi);
      }
    }
  }

  // The block's queries, scaled, as rows (s.qrows) and transposed (s.qt); whether all are finite.
  bool load_q(const Sequence& seq, const Block& blk, Scratch& s) const {
    const std::int64_t w = blk.width, ldt = padded(w), d = shape.dim;
    grow(s.qt, d * ldt);
    grow(s.qrows, w * dp);
    const auto scale = static_cast<float>(shape.scale);
    bool finite = true;
    for (std::int64_t r = 0; r < w; ++r) {
      float* row = s.qrows.data() + r * dp;
      const std::int64_t h = blk.head[static_cast<std::size_t>(r)];
      if (h < 0) {
        std::fill(row, row + dp, 0.0f);
      } else {
        detail::load_heads_row(spec.q.data(), shape.dtype, shape.qg, seq.b,
                               seq.q0 + blk.query[static_cast<std::size_t>(r)], h, row, dp);
        for (std::int64_t t = 0; t < d; ++t) row[t] *= scale;
        finite = finite && finite_floats(row, d);
      }
      for (std::int64_t t = 0; t < d; ++t) s.qt[static_cast<std::size_t>(t * ldt + r)] = row[t];
    }
    return finite;
  }

  // Keys and values of the tile [k0, k0 + keys) of KV head kvh, as f32 rows: keys read in place
  // where they are f32 rows of unit stride (the broadcast operand; as the softmax engine does),
  // values always packed (engine.hpp's padded_stride: rows 4 KiB apart thrash L1 sets).
  struct Tile {
    const float* k;
    std::int64_t ldk;
  };
  Tile load_tile(const Sequence& seq, std::int64_t kvh, std::int64_t k0, std::int64_t keys, Scratch& s) const {
    grow(s.v, keys * padded(dvp));
    for (std::int64_t j = 0; j < keys; ++j) {
      detail::load_heads_row(spec.v.data(), shape.dtype, shape.vg, seq.b, seq.k0 + k0 + j, kvh,
                             s.v.data() + j * padded(dvp), dvp);
    }
    // (D a multiple of the lanes: backward's dQ product reads the keys' rows dp wide.)
    if (shape.dtype == DType::kF32 && shape.kg.dim_stride == 1 && shape.dim == dp) {
      return {
          static_cast<const float*>(spec.k.data()) + shape.kg.offset(seq.b, seq.k0 + k0) + kvh * shape.kg.head_stride,
          shape.kg.seq_stride};
    }
    grow(s.k, keys * padded(dp));
    for (std::int64_t j = 0; j < keys; ++j) {
      detail::load_heads_row(spec.k.data(), shape.dtype, shape.kg, seq.b, seq.k0 + k0 + j, kvh,
                             s.k.data() + j * padded(dp), dp);
    }
    return {s.k.data(), padded(dp)};
  }

  // The key and value rows of keys [k0, k0 + keys) into L2 (prefetcht1), ahead of their tile:
  // consecutive keys of one head lie G·D elements apart in [B, S, G, D] memory, often a page,
  // which the hardware prefetchers do not cross (forward.cpp's prefetch_rows measured the same).
  void prefetch(const Sequence& seq, std::int64_t kvh, std::int64_t k0, std::int64_t keys) const {
    const auto width = static_cast<std::int64_t>(dtype_size(shape.dtype));
    const std::int64_t k_bytes = ((shape.dim - 1) * shape.kg.dim_stride + 1) * width;
    const std::int64_t v_bytes = ((shape.dim_v - 1) * shape.vg.dim_stride + 1) * width;
    for (std::int64_t j = std::max<std::int64_t>(k0, 0); j < k0 + keys; ++j) {
      const char* k = static_cast<const char*>(spec.k.data()) +
                      (shape.kg.offset(seq.b, seq.k0 + j) + kvh * shape.kg.head_stride) * width;
      const char* v = static_cast<const char*>(spec.v.data()) +
                      (shape.vg.offset(seq.b, seq.k0 + j) + kvh * shape.vg.head_stride) * width;
      for (std::int64_t at = 0; at < k_bytes; at += 64) __builtin_prefetch(k + at, 0, 2);
      for (std::int64_t at = 0; at < v_bytes; at += 64) __builtin_prefetch(v + at, 0, 2);
    }
  }

  // The first key of the sequence whose key or value row of KV head kvh holds an inf or NaN (lk
  // if none): tiles right of it may be skipped, the others must run (they spread it).
  std::int64_t first_non_finite(const Sequence& seq, std::int64_t kvh, Scratch& s) const {
    grow(s.row, std::max(dp, dvp));
    for (std::int64_t j = 0; j < seq.lk; ++j) {
      detail::load_heads_row(spec.k.data(), shape.dtype, shape.kg, seq.b, seq.k0 + j, kvh, s.row.data(), dp);
      if (!finite_floats(s.row.data(), shape.dim)) return j;
      detail::load_heads_row(spec.v.data(), shape.dtype, shape.vg, seq.b, seq.k0 + j, kvh, s.row.data(), dvp);
      if (!finite_floats(s.row.data(), shape.dim_v)) return j;
    }
    return seq.lk;
  }

  // Each row's carry before its first key: 0, and −inf for padding rows (no weight, ever dead).
  static void start_carries(const Block& blk, std::vector<float>& carry) {
    grow(carry, blk.width);
    for (std::int64_t r = 0; r < blk.width; ++r)
      carry[static_cast<std::size_t>(r)] =
          blk.head[static_cast<std::size_t>(r)] < 0 ? -std::numeric_limits<float>::infinity() : 0.0f;
  }

  // Whether the block may stop before the tile ending at `tile_end`: every row's carry is below
  // kSbDead (or it sees no key) and nothing non-finite lies in keys [0, tile_end).
  static bool vanished(const Block& blk, const float* carry, std::int64_t tile_end, std::int64_t bad_from) {
    if (bad_from < tile_end) return false;
    for (std::int64_t r = 0; r < blk.width; ++r) {
      const auto at = static_cast<std::size_t>(r);
      if (blk.head[at] >= 0 && blk.hi[at] > 0 && !(carry[r] < kSbDead)) return false;
    }
    return true;
  }

  std::int64_t bad_from(std::int64_t kvh, const std::vector<std::int64_t>& bad, std::int64_t si) const {
    return spec.skip_vanishing_tiles ? bad[static_cast<std::size_t>(si * shape.kv_heads + kvh)] : -1;
  }

  // Per (sequence, KV head): first_non_finite (backward always asks; forward only to skip), or
  // −1 everywhere.
  std::vector<std::int64_t> scan_non_finite(int threads, bool always = false) const {
    const auto pairs = static_cast<std::int64_t>(sequences.size()) * shape.kv_heads;
    std::vector<std::int64_t> bad(static_cast<std::size_t>(pairs), -1);
    if (!spec.skip_vanishing_tiles && !always) return bad;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (std::int64_t u = 0; u < pairs; ++u) {
      const Sequence& seq = sequences[static_cast<std::size_t>(u / shape.kv_heads)];
      bad[static_cast<std::size_t>(u)] = first_non_finite(seq, u % shape.kv_heads, thread_scratch());
    }
    return bad;
  }

  // Threads for a pass over `units` units doing `passes` times the forward's products (the
  // results do not depend on it).
  int threads_for(std::size_t units, std::int64_t passes) const {
    std::int64_t work = 0;
    for (const Sequence& seq : sequences) work += seq.lq * seq.lk;
    return std::min<int>(detail::threads_for(work * shape.heads * (shape.dim + shape.dim_v) * passes),
                         static_cast<int>(std::max<std::size_t>(units, 1)));
  }

  AttentionStats forward(TensorView out, TensorView rem) const;
  AttentionStats backward(ConstTensorView out, ConstTensorView rem, ConstTensorView d_out, ConstTensorView d_rem,
                          TensorView dq, TensorView dk, TensorView dv) const;
};

namespace {

// out[r][c] (+)= Σ_j T[j][r]·B[j][c] (by_rows) or out[j][c] += Σ_r T[j][r]·B[r][c], over the
// pairs the block's rows see only: the matrix kernels' 0·inf would spread a non-finite operand of
// a masked pair to a row (or key) that must not meet it.
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

// The work split: per (sequence, KV head), query ranges — one when there are at least 8 pairs,
// else enough for 8 units, each of at least 256 queries. Shapes only: the same for any threads.
std::int64_t ranges_per_pair(std::int64_t pairs, std::int64_t lq) {
  if (pairs >= 8) return 1;
  return std::max<std::int64_t>(1, std::min((8 + pairs - 1) / pairs, lq / 256));
}

}  // namespace

AttentionStats StickBreakingAttention::Plan::forward(TensorView out, TensorView rem) const {
  const HeadsGrid og = detail::check_sb_forward_outputs(spec, shape, ConstTensorView(out), ConstTensorView(rem));
  const bool want_rem = rem.rank() > 0 && rem.data() != nullptr;
  const detail::RemGrid rg = want_rem ? detail::check_rem(shape, "rem", ConstTensorView(rem), true) : detail::RemGrid{};
  struct Unit {
    std::int64_t seq, kvh, i0, i1;
  };
  std::vector<Unit> units;
  const std::int64_t qc = rows_per_block_queries();
  for (std::size_t si = 0; si < sequences.size(); ++si) {
    for (std::int64_t kvh = 0; kvh < shape.kv_heads; ++kvh) {
      for (std::int64_t i0 = 0; i0 < sequences[si].lq; i0 += qc)
        units.push_back({static_cast<std::int64_t>(si), kvh, i0, std::min(sequences[si].lq, i0 + qc)});
    }
  }
  const int threads = threads_for(units.size(), 1);
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
      const Sequence& seq = sequences[static_cast<std::size_t>(un.seq)];
      layout(seq, un.kvh, un.i0, un.i1, blk);
      const std::int64_t w = blk.width;
      const bool q_finite = load_q(seq, blk, s);
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
        if (t > 0) prefetch(seq, un.kvh, k0 - kKeyTile, kKeyTile);
        const Tile kt = load_tile(seq, un.kvh, k0, keys, s);
        kernels::attn_gemm(kt.k, kt.ldk, 1, s.qt.data(), padded(w), s.st.data(), w, keys, w, shape.dim, false);
        const bool masked = blk.any_masked(k0 + keys);
        kernels::sb_forward_tile(s.st.data(), keys, w, k0, blk.hi.data(), masked, s.carry.data());
        if (masked && detail::rows_non_finite(s.v.data(), padded(dvp), keys, shape.dim_v)) {
          add_visible(blk, k0, keys, s.st.data(), s.v.data(), padded(dvp), dvp, s.o.data(), dvp, true);
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
  const detail::SbBackwardGrids g = detail::check_sb_backward(spec, shape, out, rem, d_out, d_rem, dq, dk, dv);
  const bool has_d_rem = d_rem.rank() > 0 && d_rem.data() != nullptr;
  const bool want_dq = dq.rank() > 0, want_dk = dk.rank() > 0, want_dv = dv.rank() > 0;
  // Units: (sequence, KV head, query range); each sums its dK, dV from zero. A pair's only unit
  // adds them to dk, dv itself, from a buffer of its thread (slab −1); the units of a split pair
  // leave them in slabs of the call, added in range order afterwards.
  struct Unit {
    std::int64_t seq, kvh, i0, i1, key_end, slab;
  };
  std::vector<Unit> units;
  std::int64_t pairs = 0;
  for (const Sequence& seq : sequences) pairs += seq.lq > 0 ? shape.kv_heads : 0;
  const std::int64_t qc = rows_per_block_queries();
  const std::int64_t slab_row = dp + dvp;
  std::int64_t slab_floats = 0;
  for (std::size_t si = 0; si < sequences.size(); ++si) {
    const Sequence& seq = sequences[si];
    if (seq.lq == 0) continue;
    const std::int64_t ranges = ranges_per_pair(pairs, seq.lq);
    const std::int64_t span = round_up((seq.lq + ranges - 1) / ranges, qc);
    const bool split = span < seq.lq;
    for (std::int64_t kvh = 0; kvh < shape.kv_heads; ++kvh) {
      for (std::int64_t i0 = 0; i0 < seq.lq; i0 += span) {
        const std::int64_t i1 = std::min(seq.lq, i0 + span);
        const std::int64_t key_end =
            std::max<std::int64_t>(0, std::min(seq.lk, seq.lk - seq.lq + i1 - 1 + (spec.attend_current ? 1 : 0)));
        units.push_back({static_cast<std::int64_t>(si), kvh, i0, i1, key_end, split ? slab_floats : -1});
        if (split) slab_floats += key_end * slab_row;
      }
    }
  }
  thread_local Floats slab_store;  // the calling thread's, kept between calls
  grow(slab_store, slab_floats);
  float* const slabs = slab_store.data();  // (the workers' thread_local would be their own)
  const int threads = threads_for(units.size(), 2);
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
      const Sequence& seq = sequences[static_cast<std::size_t>(un.seq)];
      if (un.slab < 0) grow(s.own, un.key_end * slab_row);
      float* slab = un.slab < 0 ? s.own.data() : slabs + un.slab;
      std::fill(slab, slab + un.key_end * slab_row, 0.0f);
      float* dk_acc = slab;                    // [key_end][dp]
      float* dv_acc = slab + un.key_end * dp;  // [key_end][dvp]
      for (std::int64_t b0 = un.i0; b0 < un.i1; b0 += qc) {
        layout(seq, un.kvh, b0, std::min(un.i1, b0 + qc), blk);
        const std::int64_t w = blk.width, ldt = padded(w);
        const bool q_finite = load_q(seq, blk, s);
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
          const Tile tile = load_tile(seq, un.kvh, k0, keys, s);
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
          if (t > 0) prefetch(seq, un.kvh, k0 - kKeyTile, kKeyTile);
          const Tile tile = scores(k0, keys);
          const float* kt = tile.k;
          const bool masked = blk.any_masked(k0 + keys);
          if (exact) {
            exact_walk(blk, k0, keys, s.st.data(), s.dpt.data(), s.sig.data(), s.d_rem.data(), s.carry.data(), nullptr);
            exact_finish(blk, k0, keys, s.dpt.data(), s.sig.data(), s.sums.data() + t * w);
          } else {
            kernels::sb_backward_tile(s.st.data(), s.dpt.data(), keys, w, k0, blk.hi.data(), masked, s.total.data(),
                                      s.d_rem.data(), s.carry.data(), s.suffix.data());
          }
          // dV_j += Σ_r A[j][r]·dO_r;  dK_j += Σ_r dz[j][r]·(scale·q_r);  dQ_r += Σ_j dz[j][r]·k_j.
          if (masked && !do_finite) {
            add_visible(blk, k0, keys, s.st.data(), s.dorows.data(), dvp, dvp, dv_acc + k0 * dvp, dvp, false);
          } else {
            kernels::attn_gemm(s.st.data(), w, 1, s.dorows.data(), dvp, dv_acc + k0 * dvp, dvp, keys, dvp, w, true);
          }
          if (masked && !q_finite) {
            add_visible(blk, k0, keys, s.dpt.data(), s.qrows.data(), dp, dp, dk_acc + k0 * dp, dp, false);
          } else {
            kernels::attn_gemm(s.dpt.data(), w, 1, s.qrows.data(), dp, dk_acc + k0 * dp, dp, keys, dp, w, true);
          }
          if (masked && detail::rows_non_finite(kt, tile.ldk, keys, d)) {
            add_visible(blk, k0, keys, s.dpt.data(), kt, tile.ldk, d, s.dq.data(), dp, true);
          } else {
            kernels::attn_gemm(s.dpt.data(), 1, w, kt, tile.ldk, s.dq.data(), dp, w, dp, keys, true);
          }
        }
        if (!want_dq) continue;
        const auto scale = static_cast<float>(shape.scale);
        for (std::int64_t r = 0; r < w; ++r) {
          const std::int64_t h = blk.head[static_cast<std::size_t>(r)];
          if (h < 0) continue;
          float* row = s.dq.data() + r * dp;
          for (std::int64_t c = 0; c < d; ++c) row[c] *= scale;
          detail::store_heads_row(row, dq.data(), shape.dtype, g.dqg, seq.b,
                                  seq.q0 + blk.query[static_cast<std::size_t>(r)], h, true);
        }
      }
      if (un.slab >= 0) continue;
      for (std::int64_t j = 0; j < un.key_end; ++j) {
        if (want_dk)
          detail::store_heads_row(dk_acc + j * dp, dk.data(), shape.dtype, g.dkg, seq.b, seq.k0 + j, un.kvh, true);
        if (want_dv)
          detail::store_heads_row(dv_acc + j * dvp, dv.data(), shape.dtype, g.dvg, seq.b, seq.k0 + j, un.kvh, true);
      }
    }
    scratch_bytes += s.bytes();
  }
  // The slabs of each (sequence, KV head), added in range order, then into dk and dv.
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (std::int64_t pair = 0; pair < static_cast<std::int64_t>(sequences.size()) * shape.kv_heads; ++pair) {
    const std::int64_t si = pair / shape.kv_heads, kvh = pair % shape.kv_heads;
    const Sequence& seq = sequences[static_cast<std::size_t>(si)];
    std::vector<const Unit*> mine;
    std::int64_t keys = 0;
    for (const Unit& un : units) {
      if (un.seq == si && un.kvh == kvh) {
        mine.push_back(&un);
        keys = std::max(keys, un.key_end);
      }
    }
    if (mine.empty() || mine[0]->slab < 0) continue;  // added by its unit
    Floats sum(static_cast<std::size_t>(slab_row));
    for (std::int64_t j = 0; j < keys; ++j) {
      std::fill(sum.begin(), sum.end(), 0.0f);
      for (const Unit* un : mine) {
        if (j >= un->key_end) continue;
        const float* dk_row = slabs + un->slab + j * dp;
        const float* dv_row = slabs + un->slab + un->key_end * dp + j * dvp;
        for (std::int64_t c = 0; c < dp; ++c) sum[static_cast<std::size_t>(c)] += dk_row[c];
        for (std::int64_t c = 0; c < dvp; ++c) sum[static_cast<std::size_t>(dp + c)] += dv_row[c];
      }
      if (want_dk) detail::store_heads_row(sum.data(), dk.data(), shape.dtype, g.dkg, seq.b, seq.k0 + j, kvh, true);
      if (want_dv)
        detail::store_heads_row(sum.data() + dp, dv.data(), shape.dtype, g.dvg, seq.b, seq.k0 + j, kvh, true);
    }
  }
  AttentionStats stats;
  stats.tiles = tiles;
  stats.skipped = skipped;
  stats.workspace_bytes = scratch_bytes + slab_floats * static_cast<std::int64_t>(sizeof(float));
  return stats;
}

// ─── The public object ───────────────────────────────────────────────────────────────────────

StickBreakingAttention::StickBreakingAttention(StickBreakingSpec spec) : plan_(std::make_unique<Plan>()) {
  detail::init_dispatch();
  plan_->shape = detail::check_stickbreaking(spec);
  plan_->spec = std::move(spec);
  const SbShape& s = plan_->shape;
  plan_->dp = round_up(s.dim, kAttnAlign);
  plan_->dvp = round_up(s.dim_v, kAttnAlign);
  const StickBreakingSpec& sp = plan_->spec;
  if (s.packed) {
    for (std::size_t t = 0; t + 1 < sp.cu_seqlens_q.size(); ++t) {
      plan_->sequences.push_back({0, sp.cu_seqlens_q[t], sp.cu_seqlens_q[t + 1] - sp.cu_seqlens_q[t],
                                  sp.cu_seqlens_k[t], sp.cu_seqlens_k[t + 1] - sp.cu_seqlens_k[t]});
    }
  } else {
    for (std::int64_t b = 0; b < s.batch; ++b) plan_->sequences.push_back({b, 0, s.q_len, 0, s.k_len});
  }
}

StickBreakingAttention::~StickBreakingAttention() = default;
StickBreakingAttention::StickBreakingAttention(StickBreakingAttention&&) noexcept = default;
StickBreakingAttention& StickBreakingAttention::operator=(StickBreakingAttention&&) noexcept = default;

const StickBreakingSpec& StickBreakingAttention::spec() const { return plan_->spec; }
std::int64_t StickBreakingAttention::batch() const { return plan_->shape.batch; }
std::int64_t StickBreakingAttention::heads() const { return plan_->shape.heads; }
std::int64_t StickBreakingAttention::kv_heads() const { return plan_->shape.kv_heads; }
std::int64_t StickBreakingAttention::head_dim() const { return plan_->shape.dim; }
std::int64_t StickBreakingAttention::value_dim() const { return plan_->shape.dim_v; }
std::int64_t StickBreakingAttention::q_len() const { return plan_->shape.q_len; }
std::int64_t StickBreakingAttention::k_len() const { return plan_->shape.k_len; }
double StickBreakingAttention::scale() const { return plan_->shape.scale; }

AttentionStats StickBreakingAttention::forward(TensorView out, TensorView rem) const {
  if (plan_->shape.dtype == DType::kF64 || detail::use_reference()) {
    ref::stickbreaking_forward(*this, out, rem);
    return {};
  }
  return plan_->forward(out, rem);
}

AttentionStats StickBreakingAttention::backward(ConstTensorView out, ConstTensorView rem, ConstTensorView d_out,
                                                ConstTensorView d_rem, TensorView dq, TensorView dk,
                                                TensorView dv) const {
  if (plan_->shape.dtype == DType::kF64 || detail::use_reference()) {
    ref::stickbreaking_backward(*this, out, rem, d_out, d_rem, dq, dk, dv);
    return {};
  }
  return plan_->backward(out, rem, d_out, d_rem, dq, dk, dv);
}

}  // namespace posenc
