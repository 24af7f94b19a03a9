// The engine's forward pass over prefill blocks and decode chunks (attention.cpp states the
// units; decode.cpp the decode tiles).
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

namespace posenc {

using detail::AttentionUnitScratch;
using detail::CallBuffer;
using detail::zeroed_doubles;
using kernels::kAttnAlign;

// ─── Forward ─────────────────────────────────────────────────────────────────────────────────

namespace {

using detail::AttentionPlan;
using detail::FlushDenormals;
using detail::grow;
using detail::kNegInf;
using detail::padded_stride;
using detail::round_up;
using detail::RowBlock;
using detail::Sequence;

void prefetch_rows(const AttentionPlan& p, const Sequence& seq, std::int64_t kvh, std::int64_t first,
                   std::int64_t count) {
  const std::int64_t width = p.kv_unit;
  const std::int64_t row_bytes = p.kv_row_bytes(p.kg);
  const std::int64_t v_row_bytes = p.kv_row_bytes(p.vg);
  for (std::int64_t j = 0; j < count; ++j) {
    const char* k =
        static_cast<const char*>(p.k_data) + (p.kg.offset(seq.b, seq.k0 + first + j) + kvh * p.kg.head_stride) * width;
    const char* v =
        static_cast<const char*>(p.v_data) + (p.vg.offset(seq.b, seq.k0 + first + j) + kvh * p.vg.head_stride) * width;
    // Into L2 (prefetcht1): a tile's keys and values are 64 KiB at D = 128, more than L1, where
    // they would evict the block's working rows. perf, 1 thread, S 2048, three alternating pairs:
    // prefetch_rows' samples 234–293 against 331–397 into L1; the totals within the noise.
    for (std::int64_t at = 0; at < row_bytes; at += 64) __builtin_prefetch(k + at, 0, 2);
    for (std::int64_t at = 0; at < v_row_bytes; at += 64) __builtin_prefetch(v + at, 0, 2);
  }
}

// One forward block in steps: forward_begin loads the rows of `rb`; block_tile runs one key
// tile [k0, k0 + keys) of the sequence through them (forward_blocks drives both). Leaves the unnormalised output rows
// in s.o ([width][Dp]) and m, l per row. Compact blocks keep their queries as rows for decode's
// dot products, unless `transposed` asks for Q^T (a wide decode block through block_tile).
void forward_begin(const AttentionPlan& p, const Sequence& seq, const RowBlock& rb, AttentionUnitScratch& s,
                   bool first_chunk, bool transposed = false, bool native_bf16 = false) {
  const std::int64_t w = rb.width, dp = p.dim_padded, d = p.dim;
  const bool dot = rb.compact && !transposed;
  grow(s.q, w * dp);
  const std::int64_t ldt = padded_stride(w);
  grow(s.qt, dp * ldt);
  grow(s.o, w * dp);
  grow(s.m, w);
  grow(s.l, w);
  grow(s.corr, w);
  grow(s.st, p.key_tile * w);
  grow(s.k, p.key_tile * padded_stride(dp));
  grow(s.v, p.key_tile * padded_stride(dp));
  grow(s.kpos, p.key_tile);
  std::fill(s.o.begin(), s.o.begin() + w * dp, 0.0f);
  std::fill(s.m.begin(), s.m.begin() + w, kNegInf);
  std::fill(s.l.begin(), s.l.begin() + w, 0.0f);
  // The block's query rows, all prefetched first (5% of a bf16 prefill's time, Zen 5).
  for (std::int64_t r = 0; r < w; ++r) {
    const std::int64_t h = rb.head[static_cast<std::size_t>(r)];
    if (h >= 0)
      detail::prefetch_heads_row(p.q_data, p.dtype, p.qg, seq.b, seq.q0 + rb.query[static_cast<std::size_t>(r)], h);
  }
  // Queries: transformed, scaled, as rows (decode) or transposed (Q^T [d][w]).
  for (std::int64_t r = 0; r < w; ++r) {
    float* row = s.q.data() + r * dp;
    const std::int64_t h = rb.head[static_cast<std::size_t>(r)];
    if (h < 0) {
      std::fill(row, row + dp, 0.0f);
    } else {
      const std::int64_t i = rb.query[static_cast<std::size_t>(r)];
      p.load_row(p.q_data, p.qg, seq.b, seq.q0 + i, h, row);
      p.transform_row(p.tables_of_head(h), true, p.q_table_row(seq, i), row, 1.0f);
      p.temper_row(row, rb.position[static_cast<std::size_t>(r)]);
      for (const auto& term : p.terms) term->adjust_query(h, row);
      for (std::int64_t t = 0; t < d; ++t) row[t] *= p.scale;
    }
    // The native bf16 products read Qᵀ as pairs (below); only the terms read it in f32 then.
    if (!dot && !(native_bf16 && p.terms.empty())) {
      for (std::int64_t t = 0; t < d; ++t) s.qt[static_cast<std::size_t>(t * ldt + r)] = row[t];
    }
  }
  if (native_bf16) {
    grow(s.qt_pairs, (d + 1) / 2 * ldt);
    kernels::attn_transpose_bf16_pairs(s.q.data(), dp, w, (d + 1) / 2, s.qt_pairs.data(), ldt);
  }
  if (p.terms.empty()) return;
  if (s.terms.size() < p.terms.size()) s.terms.resize(p.terms.size());
  detail::TermRows rows;
  rows.seq = &seq;
  rows.rows = &rb;
  rows.kvh = dot ? -1 : rb.head[0] / p.group_size;
  rows.q = s.q.data();
  rows.qt = dot ? nullptr : s.qt.data();
  rows.ldt = ldt;
  for (std::size_t t = 0; t < p.terms.size(); ++t) {
    p.terms[t]->begin(rows, s.terms[t]);
    if (first_chunk) p.terms[t]->start_rows(rows, s.m.data(), s.l.data());
  }
}

// A key tile's keys and values as the matrix kernel reads them: rows ld floats apart; for the
// native bf16 products also as pairs (keys' rows, values paired along the keys), ld pairs apart.
struct TileRows {
  const float *k = nullptr, *v = nullptr;
  std::int64_t ldk = 0, ldv = 0;
  const void* k_pairs = nullptr;  // pairs (bf16 memory in place, or s.k_pairs)
  const std::uint32_t* v_pairs = nullptr;
  std::int64_t ldk_pairs = 0, ldv_pairs = 0;
  bool values_finite = true;       // where v is null (values paired from memory): whether all are finite
  std::int64_t kvh = 0, keys = 0;  // the KV head; the keys loaded (a group's longest block's)
};

// A tile's keys [k0, k0 + keys) of KV head kvh as f32 rows, ld apart, transformed; its values
// (load_value_rows) as they are.
void load_key_rows(const AttentionPlan& p, const Sequence& seq, std::int64_t kvh, std::int64_t k0, std::int64_t keys,
                   float* out, std::int64_t ld) {
  const detail::QKTables& kt = p.tables_of_head(kvh * p.group_size);
  for (std::int64_t j = 0; j < keys; ++j) {
    float* row = out + j * ld;
    p.load_key_row(seq.b, seq.k0 + k0 + j, kvh, row);
    if (kt.transform_keys) p.transform_row(kt, false, p.k_table_row(seq, k0 + j), row, 1.0f);
  }
}
void load_value_rows(const AttentionPlan& p, const Sequence& seq, std::int64_t kvh, std::int64_t k0, std::int64_t keys,
                     float* out, std::int64_t ld) {
  for (std::int64_t j = 0; j < keys; ++j) p.load_value_row(seq.b, seq.k0 + k0 + j, kvh, out + j * ld);
}

// The native bf16 products' tile: keys as pairs in place (bf16 rows with an even head dim and no
// key transform), else converted from their f32 rows; values paired straight from memory (no f32
// rows: block_tile widens them only for a partly masked tile with a non-finite value).
TileRows load_bf16_tile(const AttentionPlan& p, const Sequence& seq, std::int64_t kvh, std::int64_t k0,
                        std::int64_t keys, AttentionUnitScratch& s) {
  const std::int64_t dp = p.dim_padded, d = p.dim;
  const detail::QKTables& kt = p.tables_of_head(kvh * p.group_size);
  TileRows rows;
  rows.kvh = kvh;
  rows.keys = keys;
  const auto* k_base =
      static_cast<const std::uint16_t*>(p.k_data) + p.kg.offset(seq.b, seq.k0 + k0) + kvh * p.kg.head_stride;
  // Whole pairs per row and rows a whole number of pairs apart (an odd head stride leaves pairs
  // unaligned, which the kernel's loads allow).
  if (p.kg.dim_stride == 1 && d % 2 == 0 && p.kg.seq_stride % 2 == 0 &&
      (kt.kind == detail::QKTables::kNone || !kt.transform_keys)) {
    rows.k_pairs = k_base;
    rows.ldk_pairs = p.kg.seq_stride / 2;
  } else {
    rows.ldk = padded_stride(dp);
    load_key_rows(p, seq, kvh, k0, keys, s.k.data(), rows.ldk);
    rows.ldk_pairs = dp / 2;
    grow(s.k_pairs, keys * rows.ldk_pairs);
    kernels::attn_convert_bf16_rows(s.k.data(), rows.ldk, keys, dp, s.k_pairs.data(), rows.ldk_pairs);
    rows.k_pairs = s.k_pairs.data();
  }
  rows.ldv = padded_stride(dp);
  rows.ldv_pairs = padded_stride(dp);
  grow(s.v_pairs, (keys + 1) / 2 * rows.ldv_pairs);
  if (p.vg.dim_stride == 1) {
    const auto* v_base =
        static_cast<const std::uint16_t*>(p.v_data) + p.vg.offset(seq.b, seq.k0 + k0) + kvh * p.vg.head_stride;
    rows.values_finite =
        kernels::attn_pack_bf16_raw_pairs(v_base, p.vg.seq_stride, keys, p.dim_v, dp, s.v_pairs.data(), rows.ldv_pairs);
  } else {
    load_value_rows(p, seq, kvh, k0, keys, s.v.data(), rows.ldv);
    kernels::attn_pack_bf16_pairs(s.v.data(), rows.ldv, keys, dp, s.v_pairs.data(), rows.ldv_pairs);
    rows.v = s.v.data();
  }
  rows.v_pairs = s.v_pairs.data();
  return rows;
}

// Keys: straight from memory (f32, unit stride, D a multiple of the padding, no key transform)
// or packed into f32 rows (s.k). Values: always packed (s.v; see padded_stride — keys, the
// broadcast operand, do not gain from it).
TileRows load_tile(const AttentionPlan& p, const Sequence& seq, std::int64_t kvh, std::int64_t k0, std::int64_t keys,
                   AttentionUnitScratch& s, bool native_bf16 = false) {
  if (native_bf16) return load_bf16_tile(p, seq, kvh, k0, keys, s);
  const std::int64_t dp = p.dim_padded;
  const detail::QKTables& kt = p.tables_of_head(kvh * p.group_size);
  TileRows rows;
  if (p.zero_copy && (kt.kind == detail::QKTables::kNone || !kt.transform_keys)) {
    rows.k = static_cast<const float*>(p.k_data) + p.kg.offset(seq.b, seq.k0 + k0) + kvh * p.kg.head_stride;
    rows.ldk = p.kg.seq_stride;
  } else {
    rows.ldk = padded_stride(dp);
    load_key_rows(p, seq, kvh, k0, keys, s.k.data(), rows.ldk);
    rows.k = s.k.data();
  }
  rows.ldv = padded_stride(dp);
  load_value_rows(p, seq, kvh, k0, keys, s.v.data(), rows.ldv);
  rows.v = s.v.data();
  return rows;
}

// The key tile [k0, k0 + keys) through the rows of the prefill block `rb` (decode blocks run in
// decode_tiles), its keys and values in `kv` (which may hold more keys: the tile of a later block of its group).
void block_tile(const AttentionPlan& p, const Sequence& seq, const RowBlock& rb, std::int64_t k0, std::int64_t keys,
                const TileRows& kv, AttentionUnitScratch& s) {
  const std::int64_t w = rb.width, dp = p.dim_padded, d = p.dim;
  const float* kp = kv.k;
  const float* vp = kv.v;
  const std::int64_t ldk = kv.ldk, ldv = kv.ldv;
  const auto values_non_finite = [&] {
    if (vp != nullptr) return detail::rows_non_finite(vp, ldv, keys, p.dim_v);
    if (kv.values_finite) return false;
    // Values paired from memory, one of them not finite: this block's own f32 rows of them.
    grow(s.v, keys * ldv);
    load_value_rows(p, seq, kv.kvh, k0, keys, s.v.data(), ldv);
    vp = s.v.data();
    return detail::rows_non_finite(vp, ldv, keys, p.dim_v);
  };
  // S^T = K·Q^T (scale and query transform already in Q).
  if (kv.k_pairs != nullptr) {
    kernels::attn_gemm_bf16(kv.k_pairs, kv.ldk_pairs, 1, s.qt_pairs.data(), padded_stride(w), s.st.data(), w, keys, w,
                            (d + 1) / 2, false);
  } else {
    kernels::attn_gemm(kp, ldk, 1, s.qt.data(), padded_stride(w), s.st.data(), w, keys, w, d, false);
  }
  if (p.any_bias || !p.terms.empty()) {
    for (std::int64_t j = 0; j < keys; ++j) s.kpos[static_cast<std::size_t>(j)] = p.k_position(seq, k0 + j);
  }
  if (p.any_bias) p.add_bias(rb, keys, s.kpos.data(), s.st.data());
  const detail::TermTile tile = detail::term_tile(seq, rb, 0, k0, keys, s.kpos.data(), false);
  for (std::size_t t = 0; t < p.terms.size(); ++t) p.terms[t]->add_scores(tile, s.st.data(), s.terms[t]);
  if (p.mask.softcap > 0) kernels::attn_softcap_tile(s.st.data(), keys, w, static_cast<float>(p.mask.softcap));
  const bool unmasked = p.tile_unmasked(rb, k0, keys);
  if (!unmasked) kernels::attn_mask_tile(s.st.data(), keys, w, k0, rb.lo.data(), rb.hi.data());
  kernels::attn_softmax_tile(s.st.data(), keys, w, s.m.data(), s.l.data(), s.corr.data());
  kernels::attn_scale_rows(s.o.data(), dp, w, dp, s.corr.data());
  if (!unmasked && values_non_finite()) {
    detail::add_visible_values(rb, 0, w, k0, keys, s.st.data(), w, vp, ldv, p.dim_v, s.o.data(), dp);
  } else if (kv.v_pairs != nullptr) {
    // P rounded to bf16, paired along the keys (the terms below read the f32 P).
    grow(s.p_pairs, (keys + 1) / 2 * w);
    kernels::attn_pack_bf16_pairs(s.st.data(), w, keys, w, s.p_pairs.data(), w);
    const std::uint32_t* v_pairs = kv.v_pairs;
    if (keys % 2 == 1 && keys < kv.keys) {
      // The last pair's high half is a key of a longer block of the group: 0 there, or its
      // value (inf, NaN) would reach these rows through 0·v.
      grow(s.v_own_pairs, (keys + 1) / 2 * kv.ldv_pairs);
      std::copy(kv.v_pairs, kv.v_pairs + (keys + 1) / 2 * kv.ldv_pairs, s.v_own_pairs.begin());
      for (std::int64_t c = 0; c < dp; ++c)
        s.v_own_pairs[static_cast<std::size_t>(keys / 2 * kv.ldv_pairs + c)] &= 0xffffu;
      v_pairs = s.v_own_pairs.data();
    }
    kernels::attn_gemm_bf16(s.p_pairs.data(), 1, w, v_pairs, kv.ldv_pairs, s.o.data(), dp, w, dp, (keys + 1) / 2, true);
  } else {
    // O += P·V with P(r, j) = P^T[j][r], the tile's sum added to O once (attn_gemm_add).
    kernels::attn_gemm_add(s.st.data(), 1, w, vp, ldv, s.o.data(), dp, w, dp, keys);
  }
  for (std::size_t t = 0; t < p.terms.size(); ++t)
    p.terms[t]->add_probabilities(tile, s.st.data(), s.corr.data(), s.terms[t]);
}

// The largest key norm of one tile (keys [k0, k0 + keys)), kept for the other blocks of a group.
struct TileNorm {
  std::int64_t k0 = -1, keys = 0;
  double norm = 0;
};

// The far-tile skip in forward: tile_vanishes against the rows' running maxima; the keys' norms
// read from the inputs once per tile and group (`memo`): they do not depend on the block.
bool far_tile_vanishes(const AttentionPlan& p, const Sequence& seq, std::int64_t kvh, const RowBlock& rb,
                       std::int64_t k0, std::int64_t keys, AttentionUnitScratch& s, TileNorm& memo) {
  std::int64_t k_lo = std::numeric_limits<std::int64_t>::max(), k_hi = std::numeric_limits<std::int64_t>::min();
  for (std::int64_t j = 0; j < keys; ++j) {
    const std::int64_t kp = p.k_position(seq, k0 + j);
    k_lo = std::min(k_lo, kp);
    k_hi = std::max(k_hi, kp);
  }
  return detail::tile_vanishes(p, seq, rb, s.row_norm.data(), s.m.data(), k_lo, k_hi, k0, k0 + keys - 1, [&] {
    if (memo.k0 == k0 && memo.keys == keys) return memo.norm;
    grow(s.tmp, p.dim_padded);
    double largest = 0;
    for (std::int64_t j = 0; j < keys; ++j) {
      p.load_key_row(seq.b, seq.k0 + k0 + j, kvh, s.tmp.data());
      largest = detail::max_or_nan(largest, detail::row_norms(s.tmp.data(), 0, 1, p.dim, nullptr));
    }
    memo = TileNorm{k0, keys, largest};
    return largest;
  });
}

// At most this many consecutive query blocks of one KV head share their key tiles (a group).
constexpr std::size_t kMaxGroupBlocks = 4;
// Blocks of at most this many queries whose rows per KV head exceed kDecodeRows run as wide decode
// blocks (AttentionPlan::forward); more queries fill their heads' lane chunks well enough.
constexpr std::int64_t kWideDecodeQueries = 4;

// Runs query blocks of one KV head whose key ranges start at the same key — one block, or a group
// of up to kMaxGroupBlocks consecutive ones — through their key tiles, each tile's keys and values
// loaded (values packed, keys packed or transformed, the next tile prefetched) once for all of
// them. Every block meets its own tiles in the same order, grouped or not, so grouping never
// changes a bit. With the far-tile skip the tiles run from the last (the diagonal, for causal
// blocks) down, and a tile is loaded when at least one block does not skip it. Returns the tiles
// skipped, counted per block.
// Grouping, measured by perf (1 thread, S 2048, H 8, D 128, causal, no scheme): the packing and
// the prefetches were ~17% of the forward's samples when each block did its own; with pairs the
// forward took 4427–4587 samples against 5399–6019, in alternating runs. Groups of four against
// pairs: 3423–3517 samples against 3392–3610, within the noise, but the value loads' samples fell
// from 330–383 to 313–336 and the prefetches' from 104–123 to 63–82.
std::int64_t forward_blocks(const AttentionPlan& p, const Sequence& seq, std::int64_t kvh,
                            std::span<const RowBlock* const> blocks, std::span<AttentionUnitScratch* const> scratch,
                            bool native_bf16) {
  constexpr std::size_t kMaxBlocks = kMaxGroupBlocks;
  const std::size_t n = blocks.size();
  const std::int64_t kt = p.key_tile, kb = blocks[0]->key_lo;
  std::array<std::int64_t, kMaxBlocks> ends{}, tiles{};
  std::int64_t ke = kb;
  for (std::size_t b = 0; b < n; ++b) {
    forward_begin(p, seq, *blocks[b], *scratch[b], true, false, native_bf16);
    ends[b] = std::max(blocks[b]->key_hi, kb);
    tiles[b] = (ends[b] - kb + kt - 1) / kt;
    ke = std::max(ke, ends[b]);
  }
  const bool descending = p.far_tiles_first && p.far_first_kv[static_cast<std::size_t>(kvh)] != 0;
  const bool skip_far = p.skip_far_tiles && descending;
  for (std::size_t b = 0; b < n; ++b) {
    if (skip_far) {
      grow(scratch[b]->row_norm, blocks[b]->width);
      detail::row_norms(scratch[b]->q.data(), p.dim_padded, blocks[b]->width, p.dim, scratch[b]->row_norm.data());
      // bf16 queries and keys move a logit by up to 2^-8 of |q|·|k| (two roundings), beyond the
      // 1e-3 that tile_vanishes allows for f32's.
      if (native_bf16) {
        for (std::int64_t r = 0; r < blocks[b]->width; ++r) scratch[b]->row_norm[static_cast<std::size_t>(r)] *= 1.01;
      }
    }
  }
  const std::int64_t all_tiles = (ke - kb + kt - 1) / kt;
  std::int64_t skipped = 0;
  for (std::int64_t i = 0; i < all_tiles; ++i) {
    const std::int64_t t = descending ? all_tiles - 1 - i : i, k0 = kb + t * kt;
    std::array<bool, kMaxBlocks> run{};
    bool any = false;
    TileNorm norm;
    for (std::size_t b = 0; b < n; ++b) {
      if (t >= tiles[b]) continue;
      run[b] = !(skip_far && t < tiles[b] - 1 &&
                 far_tile_vanishes(p, seq, kvh, *blocks[b], k0, std::min(kt, ends[b] - k0), *scratch[b], norm));
      skipped += run[b] ? 0 : 1;
      any = any || run[b];
    }
    if (!any) continue;
    // The next tile's key and value rows: in [B, S, G, D] memory consecutive keys of one head
    // lie G·D elements apart, often a page, which the hardware prefetchers do not cross.
    const std::int64_t next = descending ? k0 - kt : k0 + kt;
    if (next >= kb && next < ke) prefetch_rows(p, seq, kvh, next, std::min(kt, ke - next));
    const TileRows kv = load_tile(p, seq, kvh, k0, std::min(kt, ke - k0), *scratch[0], native_bf16);
    for (std::size_t b = 0; b < n; ++b) {
      if (run[b]) block_tile(p, seq, *blocks[b], k0, std::min(kt, ends[b] - k0), kv, *scratch[b]);
    }
  }
  return skipped;
}

// The scratch of a group's blocks after the first (which uses unit_scratch()).
std::array<AttentionUnitScratch, kMaxGroupBlocks - 1>& group_scratch() {
  thread_local std::array<AttentionUnitScratch, kMaxGroupBlocks - 1> s;
  return s;
}

// A forward call's work. Units: (sequence, KV head, query block group) for prefill; decode
// blocks (few rows) run every KV head per key tile — reading the cache in its memory order — in
// chunks of keys: (sequence, query block, key chunk), kvh = −1. Wide decode blocks (few queries
// but more than kDecodeRows rows per KV head: MLA's heads on one latent KV head, GQA groups of
// 16) run per KV head through the matrix kernel, their rows compact (no padding of each head's
// queries to a lane chunk), in key chunks like decode.
struct ForwardUnit {
  std::int64_t seq, kvh, i0, count, k_begin, k_end, partial;
  bool compact;
  bool first;  // the first of a decode block's key chunks (it starts the rows: sinks)
  bool wide = false;
};
// A decode block's chunks, merged after the units in chunk order (their partial indices).
struct DecodeMerge {
  std::int64_t seq, i0, count;
  std::vector<std::int64_t> partials;
};
struct ForwardWork {
  std::vector<ForwardUnit> units;
  std::vector<DecodeMerge> merges;
  std::int64_t partials = 0;
  std::int64_t part_rows = AttentionPlan::kDecodeRows;  // rows of a chunk's partial result per KV head
  std::int64_t flops = 0;
};

bool wide_decode(const AttentionPlan& p, const Sequence& seq) {
  return std::all_of(p.terms.begin(), p.terms.end(), [](const auto& t) { return t->allows_wide_decode(); }) &&
         seq.lq * p.group_size > AttentionPlan::kDecodeRows && seq.lq <= kWideDecodeQueries;
}

// A decode block's units: its visible keys in chunks (only the keys some query sees are split: a
// sliding window or a chunk of a long cache), every KV head per unit, or one unit per KV head
// when wide.
void add_decode_units(const AttentionPlan& p, std::int64_t si, std::int64_t bytes_chunk_keys, ForwardWork& w) {
  const Sequence& seq = p.sequences[static_cast<std::size_t>(si)];
  const bool wide = wide_decode(p, seq);
  std::int64_t seen_lo = seq.lk, seen_hi = 0;
  for (std::int64_t i = 0; i < seq.lq; ++i) {
    const auto [lo, hi] = p.visible_keys(seq, i);
    if (lo < hi) seen_lo = std::min(seen_lo, lo), seen_hi = std::max(seen_hi, hi);
  }
  const std::int64_t seen = std::max<std::int64_t>(0, seen_hi - seen_lo);
  const std::int64_t chunk_keys =
      std::max(bytes_chunk_keys, (seen + AttentionPlan::kDecodeMaxChunks - 1) / AttentionPlan::kDecodeMaxChunks);
  const std::int64_t chunks = seen > chunk_keys ? (seen + chunk_keys - 1) / chunk_keys : 1;
  if (chunks > 1) w.merges.push_back({si, 0, seq.lq, {}});
  for (std::int64_t c = 0; c < chunks; ++c) {
    const std::int64_t kb = chunks == 1 ? 0 : seen_lo + c * chunk_keys;
    const std::int64_t ke = chunks == 1 ? seq.lk : std::min(seen_hi, kb + chunk_keys);
    const std::int64_t partial = chunks == 1 ? -1 : w.partials;
    for (std::int64_t kvh = wide ? 0 : -1; kvh < (wide ? p.kv_heads : 0); ++kvh)
      w.units.push_back({si, kvh, 0, seq.lq, kb, ke, partial, true, c == 0, wide});
    if (chunks > 1) w.merges.back().partials.push_back(w.partials++);
  }
}

ForwardWork plan_forward(const AttentionPlan& p) {
  ForwardWork w;
  // Prefill units of a group of query blocks (forward_blocks): the largest group of 4, 2 or 1 that
  // leaves at least 8 units per thread (the dynamic schedule balances causal units, whose cost
  // grows with their queries, only with several units per thread).
  std::int64_t prefill_blocks = 0;
  for (const Sequence& seq : p.sequences) {
    if (seq.lq * p.group_size > AttentionPlan::kDecodeRows && !wide_decode(p, seq))
      prefill_blocks += p.kv_heads * ((seq.lq + p.query_block - 1) / p.query_block);
    if (wide_decode(p, seq)) w.part_rows = std::max(w.part_rows, seq.lq * p.group_size);
  }
  w.flops = static_cast<std::int64_t>(p.batch) * p.q_len * p.k_len * p.heads * p.dim;
  // Grouping never changes a bit (see forward_blocks), so the rule may look at the thread count.
  std::int64_t group_blocks = static_cast<std::int64_t>(kMaxGroupBlocks);
  while (group_blocks > 1 &&
         prefill_blocks < 8 * group_blocks * static_cast<std::int64_t>(detail::threads_for(w.flops / 16)))
    group_blocks /= 2;
  const std::int64_t unit_queries = group_blocks * p.query_block;
  // Decode chunks: keys per chunk from the bytes of one key's keys and values.
  const std::int64_t bytes_chunk_keys =
      std::max(AttentionPlan::kDecodeMinChunkKeys, AttentionPlan::kDecodeChunkBytes / (2 * p.decode_key_row_bytes()));
  for (std::int64_t si = 0; si < static_cast<std::int64_t>(p.sequences.size()); ++si) {
    const Sequence& seq = p.sequences[static_cast<std::size_t>(si)];
    if (seq.lq == 0) continue;
    if (seq.lq * p.group_size <= AttentionPlan::kDecodeRows || wide_decode(p, seq)) {
      add_decode_units(p, si, bytes_chunk_keys, w);
      continue;
    }
    for (std::int64_t kvh = 0; kvh < p.kv_heads; ++kvh) {
      for (std::int64_t i0 = 0; i0 < seq.lq; i0 += unit_queries) {
        w.units.push_back({si, kvh, i0, std::min(unit_queries, seq.lq - i0), 0, seq.lk, -1, false, true});
      }
    }
  }
  return w;
}

// Where a forward call's rows go: the outputs, and the chunked decode units' (m, l, O) rows per KV
// head, merged in chunk order after the units.
struct ForwardOutput {
  TensorView out, lse;
  detail::HeadsGrid og;
  bool want_lse;
  std::int64_t part_rows, part_width;
  std::vector<float> parts;
  bool native_bf16 = false;  // prefill's products on bf16 dot products (AttentionSpec::bf16_products)

  float* part_row(const AttentionPlan& p, std::int64_t partial, std::int64_t kvh, std::int64_t r) {
    return parts.data() + ((partial * p.kv_heads + kvh) * part_rows + r) * part_width;
  }
};

// Normalises and stores the rows of a finished block.
void finish_rows(const AttentionPlan& p, ForwardOutput& o, const Sequence& seq, const RowBlock& rb,
                 AttentionUnitScratch& s) {
  const std::int64_t dp = p.dim_padded;
  for (std::size_t t = 0; t < p.terms.size(); ++t) p.terms[t]->finish(s.o.data(), s.terms[t]);
  grow(s.tmp, dp);
  for (std::int64_t r = 0; r < rb.width; ++r) {
    const std::int64_t h = rb.head[static_cast<std::size_t>(r)];
    if (h < 0) continue;
    const std::int64_t i = rb.query[static_cast<std::size_t>(r)];
    const float l = s.l[static_cast<std::size_t>(r)];
    // l == 0: no key seen, a row of 0 and lse −inf; a NaN l stays NaN in both.
    const float inv = l == 0 ? 0.0f : 1.0f / l;
    for (std::int64_t t = 0; t < p.dim; ++t)
      s.tmp[static_cast<std::size_t>(t)] = s.o[static_cast<std::size_t>(r * dp + t)] * inv;
    p.store_row(s.tmp.data(), o.out.data(), o.og, seq.b, seq.q0 + i, h, false);
    if (o.want_lse) p.write_lse(o.lse, seq, h, i, l == 0 ? kNegInf : s.m[static_cast<std::size_t>(r)] + std::log(l));
  }
}

// A chunk's unnormalised row r as (m, l, O) for the merge.
void store_partial_row(const AttentionPlan& p, ForwardOutput& o, std::int64_t partial, std::int64_t kvh,
                       std::int64_t part_r, const AttentionUnitScratch& s, std::int64_t r) {
  float* row = o.part_row(p, partial, kvh, part_r);
  row[0] = s.m[static_cast<std::size_t>(r)];
  row[1] = s.l[static_cast<std::size_t>(r)];
  std::memcpy(row + 2, s.o.data() + r * p.dim_padded, static_cast<std::size_t>(p.dim_padded) * sizeof(float));
}

// One thread's rows and scratch for the units it runs.
struct ForwardThread {
  AttentionUnitScratch& s = detail::unit_scratch();
  std::array<RowBlock, kMaxGroupBlocks> group_rows;
  std::array<const RowBlock*, kMaxGroupBlocks> group{};
  std::array<AttentionUnitScratch*, kMaxGroupBlocks> group_scratches{&s};
  std::vector<AttentionUnitScratch>& per_head = per_head_scratch();  // decode: one per KV head
  std::vector<RowBlock>& per_head_rows = per_head_row_blocks();
  std::int64_t skipped_tiles = 0, prefill_tiles = 0;

  ForwardThread() {
    for (std::size_t b = 1; b < kMaxGroupBlocks; ++b) group_scratches[b] = &group_scratch()[b - 1];
  }
  static std::vector<AttentionUnitScratch>& per_head_scratch() {
    thread_local std::vector<AttentionUnitScratch> v;
    return v;
  }
  static std::vector<RowBlock>& per_head_row_blocks() {
    thread_local std::vector<RowBlock> v;
    return v;
  }
  std::int64_t scratch_bytes() const {
    std::int64_t bytes = s.bytes();
    for (const AttentionUnitScratch& gs : group_scratch()) bytes += gs.bytes();
    for (const auto& hs : per_head) bytes += hs.bytes();
    return bytes;
  }
};

// A prefill unit: its query blocks through the key tiles together (forward_blocks), or one at a
// time when their key ranges start apart (sliding windows).
void run_prefill_unit(const AttentionPlan& p, ForwardOutput& o, const ForwardUnit& un, ForwardThread& t) {
  const Sequence& seq = p.sequences[static_cast<std::size_t>(un.seq)];
  const auto n = static_cast<std::size_t>((un.count + p.query_block - 1) / p.query_block);
  bool same_start = true;
  for (std::size_t b = 0; b < n; ++b) {
    const std::int64_t i0 = un.i0 + static_cast<std::int64_t>(b) * p.query_block;
    p.layout_rows(seq, un.kvh, i0, std::min(p.query_block, un.i0 + un.count - i0), false, t.group_rows[b]);
    t.group[b] = &t.group_rows[b];
    same_start = same_start && t.group_rows[b].key_lo == t.group_rows[0].key_lo;
  }
  const auto count_tiles = [&](const RowBlock& block) {
    t.prefill_tiles += (std::max(block.key_hi, block.key_lo) - block.key_lo + p.key_tile - 1) / p.key_tile;
  };
  if (same_start) {
    t.skipped_tiles += forward_blocks(p, seq, un.kvh, std::span(t.group.data(), n),
                                      std::span(t.group_scratches.data(), n), o.native_bf16);
    for (std::size_t b = 0; b < n; ++b) {
      count_tiles(*t.group[b]);
      finish_rows(p, o, seq, *t.group[b], *t.group_scratches[b]);
    }
    return;
  }
  for (std::size_t b = 0; b < n; ++b) {
    t.skipped_tiles += forward_blocks(p, seq, un.kvh, std::span(t.group.data() + b, 1),
                                      std::span(t.group_scratches.data(), 1), o.native_bf16);
    count_tiles(*t.group[b]);
    finish_rows(p, o, seq, *t.group[b], t.s);
  }
}

// A wide decode unit: one KV head's compact rows through the matrix kernel over its key chunk.
void run_wide_unit(const AttentionPlan& p, ForwardOutput& o, const ForwardUnit& un, ForwardThread& t) {
  const Sequence& seq = p.sequences[static_cast<std::size_t>(un.seq)];
  RowBlock& rb = t.group_rows[0];
  AttentionUnitScratch& s = t.s;
  p.layout_rows(seq, un.kvh, un.i0, un.count, true, rb);
  forward_begin(p, seq, rb, s, un.first, true);
  const std::int64_t kb = un.partial >= 0 ? un.k_begin : rb.key_lo;
  const std::int64_t ke = un.partial >= 0 ? un.k_end : std::max(rb.key_hi, kb);
  for (std::int64_t k0 = kb; k0 < ke; k0 += p.key_tile) {
    const std::int64_t keys = std::min(p.key_tile, ke - k0);
    if (k0 + keys < ke) prefetch_rows(p, seq, un.kvh, k0 + keys, std::min(p.key_tile, ke - k0 - keys));
    block_tile(p, seq, rb, k0, keys, load_tile(p, seq, un.kvh, k0, keys, s), s);
  }
  if (un.partial < 0) {
    finish_rows(p, o, seq, rb, s);
    return;
  }
  for (std::int64_t r = 0; r < rb.valid_rows; ++r) store_partial_row(p, o, un.partial, un.kvh, r, s, r);
}

// A decode unit: one block of every KV head's rows (or a block per KV head for terms that keep
// per-head state: ScoreTerm::merges_decode_heads) over its key chunk (decode_tiles).
void run_decode_unit(const AttentionPlan& p, ForwardOutput& o, const ForwardUnit& un, ForwardThread& t) {
  const Sequence& seq = p.sequences[static_cast<std::size_t>(un.seq)];
  const bool merged = p.decode_merges_heads();
  const std::int64_t blocks = merged ? 1 : p.kv_heads;
  if (static_cast<std::int64_t>(t.per_head.size()) < blocks) t.per_head.resize(static_cast<std::size_t>(blocks));
  if (static_cast<std::int64_t>(t.per_head_rows.size()) < blocks + 1) {
    t.per_head_rows.resize(static_cast<std::size_t>(blocks + 1));  // + layout_decode_rows' scratch
  }
  if (merged) {
    p.layout_decode_rows(seq, un.i0, un.count, t.per_head_rows[1], t.per_head_rows[0]);
    forward_begin(p, seq, t.per_head_rows[0], t.per_head[0], un.first);
  } else {
    for (std::int64_t kvh = 0; kvh < p.kv_heads; ++kvh) {
      const auto k = static_cast<std::size_t>(kvh);
      p.layout_rows(seq, kvh, un.i0, un.count, true, t.per_head_rows[k]);
      forward_begin(p, seq, t.per_head_rows[k], t.per_head[k], un.first);
    }
  }
  const RowBlock& rows0 = t.per_head_rows[0];
  const std::int64_t kb = std::max(un.k_begin, un.partial >= 0 ? un.k_begin : rows0.key_lo);
  const std::int64_t ke = un.partial >= 0 ? un.k_end : std::min(un.k_end, std::max(rows0.key_hi, kb));
  const auto n_blocks = static_cast<std::size_t>(blocks);
  p.decode_tiles(seq, kb, ke, std::span<const RowBlock>(t.per_head_rows.data(), n_blocks),
                 std::span<AttentionUnitScratch>(t.per_head.data(), n_blocks), t.s);
  for (std::size_t b = 0; b < n_blocks; ++b) {
    const RowBlock& hr = t.per_head_rows[b];
    AttentionUnitScratch& hs = t.per_head[b];
    if (un.partial < 0) {
      finish_rows(p, o, seq, hr, hs);
      continue;
    }
    for (std::size_t k = 0; k < p.terms.size(); ++k) p.terms[k]->finish(hs.o.data(), hs.terms[k]);
    // Rows of KV head kvh at parts[(partial · G + kvh) · part_rows + r].
    const std::int64_t per_kvh = merged ? hr.valid_rows / p.kv_heads : hr.valid_rows;
    for (std::int64_t r = 0; r < hr.valid_rows; ++r) {
      const std::int64_t kvh = merged ? r / per_kvh : static_cast<std::int64_t>(b);
      store_partial_row(p, o, un.partial, kvh, r % per_kvh, hs, r);
    }
  }
}

// Merges the chunks of each decode block, in chunk order (fp64 sums; deterministic).
void merge_decode_chunks(const AttentionPlan& p, ForwardOutput& o, const std::vector<DecodeMerge>& merges) {
  RowBlock rb;
  std::vector<double> acc(static_cast<std::size_t>(p.dim));
  std::vector<float> row(static_cast<std::size_t>(p.dim));
  for (const DecodeMerge& merge : merges) {
    const Sequence& seq = p.sequences[static_cast<std::size_t>(merge.seq)];
    for (std::int64_t kvh = 0; kvh < p.kv_heads; ++kvh) {
      p.layout_rows(seq, kvh, merge.i0, merge.count, true, rb);
      for (std::int64_t r = 0; r < rb.valid_rows; ++r) {
        const auto part_row = [&](std::int64_t partial) { return o.part_row(p, partial, kvh, r); };
        float m = kNegInf;
        bool nan = false;  // std::max drops a NaN maximum; the row must not
        for (const std::int64_t c : merge.partials) {
          m = std::max(m, part_row(c)[0]);
          nan = nan || std::isnan(part_row(c)[0]);
        }
        if (nan) m = std::numeric_limits<float>::quiet_NaN();
        double l = 0;
        std::fill(acc.begin(), acc.end(), 0.0);
        if (m != kNegInf) {
          for (const std::int64_t c : merge.partials) {
            const float* pr = part_row(c);
            if (pr[0] == kNegInf) continue;
            const double f = std::exp(static_cast<double>(pr[0]) - m);
            l += f * pr[1];
            for (std::int64_t t = 0; t < p.dim; ++t) acc[static_cast<std::size_t>(t)] += f * pr[2 + t];
          }
        }
        for (std::int64_t t = 0; t < p.dim; ++t) {
          row[static_cast<std::size_t>(t)] = l == 0 ? 0.0f : static_cast<float>(acc[static_cast<std::size_t>(t)] / l);
        }
        const std::int64_t h = rb.head[static_cast<std::size_t>(r)];
        const std::int64_t i = rb.query[static_cast<std::size_t>(r)];
        p.store_row(row.data(), o.out.data(), o.og, seq.b, seq.q0 + i, h, false);
        if (o.want_lse) p.write_lse(o.lse, seq, h, i, l == 0 ? kNegInf : static_cast<float>(m + std::log(l)));
      }
    }
  }
}

}  // namespace

namespace detail {

AttentionStats AttentionPlan::forward(TensorView out, TensorView lse) const {
  const HeadsGrid og = check_output_tokens(kWhere, "out", ConstTensorView(out), out_grid());
  check_dtype(kWhere, "out", out.dtype(), dtype);
  check_writable(kWhere, "out", ConstTensorView(out));
  const bool want_lse = lse.rank() > 0;
  if (want_lse) check_lse(lse, true);
  check_disjoint({{"out", out}, {"lse", lse}}, {{"q", spec.q}, {"k", spec.k}, {"v", spec.v}});
  const ForwardWork work = plan_forward(*this);
  // Prefill units may skip far tiles by the tables' maxima; decode's never do.
  if (std::any_of(work.units.begin(), work.units.end(), [](const ForwardUnit& u) { return !u.compact; }))
    build_tile_maxima();
  ForwardOutput o{out, lse, og, want_lse, work.part_rows, dim_padded + 2, {}};
  o.native_bf16 = dtype == DType::kBF16 && !cache_format && spec.bf16_products && bf16_dot_products();
  o.parts.resize(static_cast<std::size_t>(work.partials * kv_heads * o.part_rows * o.part_width));
  const int threads =
      std::min<int>(threads_for(work.flops / 16), static_cast<int>(std::max<std::size_t>(work.units.size(), 1)));
  std::int64_t scratch_bytes = 0, skipped_tiles = 0, prefill_tiles = 0;
  ParallelErrors errors;  // a term's own definition may throw
#pragma omp parallel num_threads(threads) reduction(+ : scratch_bytes, skipped_tiles, prefill_tiles)
  {
    const FlushDenormals flush;
    ForwardThread t;
#pragma omp for schedule(dynamic, 1)
    for (std::size_t u = 0; u < work.units.size(); ++u) {
      errors.run([&] {
        const ForwardUnit& un = work.units[u];
        if (!un.compact) {
          run_prefill_unit(*this, o, un, t);
        } else if (un.wide) {
          run_wide_unit(*this, o, un, t);
        } else {
          run_decode_unit(*this, o, un, t);
        }
      });
    }
    scratch_bytes += t.scratch_bytes();
    skipped_tiles += t.skipped_tiles;
    prefill_tiles += t.prefill_tiles;
  }
  errors.rethrow();
  merge_decode_chunks(*this, o, work.merges);
  AttentionStats stats;
  stats.workspace_bytes = scratch_bytes + static_cast<std::int64_t>(o.parts.size() * sizeof(float)) + table_bytes();
  stats.tiles = prefill_tiles;
  stats.skipped = skipped_tiles;
  stats.bf16_products = o.native_bf16 && std::any_of(work.units.begin(), work.units.end(),
                                                     [](const ForwardUnit& u) { return !u.compact; });
  return stats;
}

}  // namespace detail

}  // namespace posenc
