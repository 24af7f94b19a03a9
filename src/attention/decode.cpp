// The engine's decode tiles: every KV head of a key tile in the cache's memory order.
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

namespace posenc {

namespace detail {

// Decode: key tiles of every KV head in memory order (attn_decode_*), the softmax step in between.
// `rows` is either one block holding every KV head's rows (layout_decode_rows; head g's rows are
// lanes g·R … g·R + R − 1 of its tiles) or a block per KV head, each with its own scratch in
// `blocks_scratch`. Keys and values come straight from the cache (f32, unit stride, keys not
// transformed) or are converted per tile into [key][head][Dp] rows, keys transformed where the
// scheme says so.
void AttentionPlan::decode_tiles(const Sequence& seq, std::int64_t k_begin, std::int64_t k_end,
                                 std::span<const RowBlock> rows, std::span<AttentionUnitScratch> blocks_scratch,
                                 AttentionUnitScratch& s) const {
  const std::int64_t dp = dim_padded, g_count = kv_heads;
  // Keys per tile, by bytes: a tile's keys of every KV head are prefetched into L2 while the
  // previous tile's values are summed, and its values while its scores are computed, so about
  // three tiles' rows share L2. At 8 KV heads × D 128 in f32 (4 KiB per key) 64 keys take 256 KiB;
  // a multi-head cache (32 KV heads: 16 KiB per key) took 1 MiB per tile at 64 keys, as much as
  // this host's whole L2. There (8192 keys, 2 threads, alternating runs) 16-key tiles took
  // 11.7–12.4 ms, 32-key tiles 12.6–12.7 and 64-key tiles 13.2–13.7.
  const std::int64_t decode_tile =
      std::clamp<std::int64_t>(kDecodeTileBytes / decode_key_row_bytes() / 16 * 16, 16, key_tile);
  bool transform_keys = false;
  for (std::int64_t g = 0; g < g_count; ++g) {
    const QKTables& t = tables_of_head(g * group_size);
    transform_keys = transform_keys || (t.kind != QKTables::kNone && t.transform_keys);
  }
  const bool merged = rows.size() == 1;
  const std::int64_t w = rows[0].width;
  const std::int64_t valid = merged ? rows[0].valid_rows / g_count : rows[0].valid_rows;  // rows per KV head
  // The kernels read the cache where it lies (f32, and bf16 / f16 on targets that widen them in
  // vectors); otherwise each tile is first widened into f32 scratch rows of dim_padded. Keys that
  // RoPE or an absolute encoding transforms go through scratch too, unless the scores rotate them
  // (below); the values never need to.
  const bool reads_dtype = kernels::attn_decode_reads_directly(dtype, valid, dim);
  // Keys that every KV head rotates with one RoPE table: rotated inside the scores where the
  // kernel can (attn_decode_rotates_keys, either layout), else, half-split, widened and rotated in
  // one pass per tile (attn_pack_rotate_heads); otherwise row by row.
  const QKTables* shared_rope = &tables_of_head(0);
  for (std::int64_t g = 0; g < g_count; ++g) {
    if (&tables_of_head(g * group_size) != shared_rope) shared_rope = nullptr;
  }
  if (shared_rope != nullptr && (shared_rope->kind != QKTables::kRope || !shared_rope->transform_keys ||
                                 kg.dim_stride != 1 || shared_rope->offset != 0)) {
    shared_rope = nullptr;
  }
  const bool rotate_in_scores =
      shared_rope != nullptr &&
      kernels::attn_decode_rotates_keys(dtype, valid, dim, shared_rope->half, shared_rope->interleaved);
  if (shared_rope != nullptr && shared_rope->interleaved && !rotate_in_scores) shared_rope = nullptr;
  const bool interleaved_rope = shared_rope != nullptr && shared_rope->interleaved;
  // The keys' [cos | sin] rows (transform_row's choice: their own table, else the queries').
  const float* rope_cos_sin = shared_rope == nullptr           ? nullptr
                              : shared_rope->k_cos_sin.empty() ? shared_rope->q_cos_sin.data()
                                                               : shared_rope->k_cos_sin.data();
  const bool direct_k = kg.dim_stride == 1 && reads_dtype && (!transform_keys || rotate_in_scores);
  const bool direct_v = vg.dim_stride == 1 && kernels::attn_decode_reads_directly(dtype, valid, dim_v);
  std::vector<const float*> q_heads(static_cast<std::size_t>(g_count)), p_heads(q_heads.size());
  std::vector<float*> st_heads(q_heads.size()), o_heads(q_heads.size());
  for (std::int64_t g = 0; g < g_count; ++g) {
    AttentionUnitScratch& hs = blocks_scratch[static_cast<std::size_t>(merged ? 0 : g)];
    const std::int64_t r0 = merged ? g * valid : 0;
    q_heads[static_cast<std::size_t>(g)] = hs.q.data() + r0 * dp;
    st_heads[static_cast<std::size_t>(g)] = hs.st.data() + r0;
    p_heads[static_cast<std::size_t>(g)] = hs.st.data() + r0;
    o_heads[static_cast<std::size_t>(g)] = hs.o.data() + r0 * dp;
  }
  if (!direct_k) grow(s.k, decode_tile * g_count * dp);
  if (!direct_v) grow(s.v, decode_tile * g_count * dp);
  const std::int64_t width = static_cast<std::int64_t>(dtype_size(dtype));
  // Keys [k0, k0 + keys) of every KV head of `data` as f32 rows [key][head][Dp].
  const auto pack_tile = [&](const void* data, const HeadsGrid& grid, std::int64_t k0, std::int64_t keys, float* dst) {
    if (grid.dim_stride == 1) {
      kernels::attn_pack_heads(static_cast<const char*>(data) + grid.offset(seq.b, seq.k0 + k0) * width, dtype,
                               grid.seq_stride, grid.head_stride, keys, g_count, grid.dim, dst, dp);
      return;
    }
    for (std::int64_t j = 0; j < keys; ++j) {
      for (std::int64_t g = 0; g < g_count; ++g)
        load_row(data, grid, seq.b, seq.k0 + k0 + j, g, dst + (j * g_count + g) * dp);
    }
  };
  const DType k_dtype = direct_k ? dtype : DType::kF32, v_dtype = direct_v ? dtype : DType::kF32;
  std::vector<std::int64_t> table_rows(shared_rope != nullptr ? static_cast<std::size_t>(decode_tile) : 0);
  kernels::KeyRotation rotation;
  // Interleaved pairs: each tile's rows expanded to one cos and one signed sin per rotated dim
  // (attn_expand_interleaved_rope), read by the scores as rows 0 … keys − 1.
  std::vector<std::int64_t> tile_rows(interleaved_rope ? static_cast<std::size_t>(decode_tile) : 0);
  for (std::size_t j = 0; j < tile_rows.size(); ++j) tile_rows[j] = static_cast<std::int64_t>(j);
  if (interleaved_rope) grow(s.rope_rows, decode_tile * 4 * shared_rope->half);
  if (rotate_in_scores) {
    rotation.cos_sin = interleaved_rope ? s.rope_rows.data() : rope_cos_sin;
    rotation.table_rows = interleaved_rope ? tile_rows.data() : table_rows.data();
    rotation.half = shared_rope->half;
    rotation.interleaved = interleaved_rope;
  }
  for (std::int64_t k0 = k_begin; k0 < k_end; k0 += decode_tile) {
    const std::int64_t keys = std::min(decode_tile, k_end - k0);
    const void *kp, *vp;
    std::int64_t ldk, khs, ldv, vhs;
    if (shared_rope != nullptr) {
      for (std::int64_t j = 0; j < keys; ++j) table_rows[static_cast<std::size_t>(j)] = k_table_row(seq, k0 + j);
      if (interleaved_rope) {
        kernels::attn_expand_interleaved_rope(rope_cos_sin, table_rows.data(), keys, shared_rope->half,
                                              s.rope_rows.data());
      }
    }
    if (direct_k) {
      kp = static_cast<const char*>(k_data) + kg.offset(seq.b, seq.k0 + k0) * width;
      ldk = kg.seq_stride;
      khs = kg.head_stride;
    } else if (shared_rope != nullptr) {
      kernels::attn_pack_rotate_heads(static_cast<const char*>(k_data) + kg.offset(seq.b, seq.k0 + k0) * width, dtype,
                                      kg.seq_stride, kg.head_stride, keys, g_count, dim, rope_cos_sin,
                                      table_rows.data(), shared_rope->half, s.k.data(), dp);
      kp = s.k.data();
      ldk = g_count * dp;
      khs = dp;
    } else {
      pack_tile(k_data, kg, k0, keys, s.k.data());
      for (std::int64_t j = 0; j < keys; ++j) {
        for (std::int64_t g = 0; g < g_count; ++g) {
          const QKTables& t = tables_of_head(g * group_size);
          if (t.kind != QKTables::kNone && t.transform_keys) {
            transform_row(t, false, k_table_row(seq, k0 + j), s.k.data() + (j * g_count + g) * dp, 1.0f);
          }
        }
      }
      kp = s.k.data();
      ldk = g_count * dp;
      khs = dp;
    }
    if (direct_v) {
      vp = static_cast<const char*>(v_data) + vg.offset(seq.b, seq.k0 + k0) * width;
      ldv = vg.seq_stride;
      vhs = vg.head_stride;
    } else {
      vp = s.v.data();
      ldv = g_count * dp;
      vhs = dp;
    }
    // While the scores are computed, this tile's values come in; while the values are summed,
    // the next tile's keys do.
    const std::int64_t next_keys = std::min(decode_tile, k_end - (k0 + keys));
    kernels::attn_decode_scores(kp, k_dtype, ldk, khs, keys, g_count, q_heads.data(), dp, valid, dim, st_heads.data(),
                                w, rows_ahead(v_data, vg, seq, k0, keys), k0 == k_begin, rotation);
    // The keys' positions, once per tile for every head.
    const std::int64_t* kpos = blocks_scratch[0].kpos.data();
    if (any_bias || !terms.empty()) {
      for (std::int64_t j = 0; j < keys; ++j)
        blocks_scratch[0].kpos[static_cast<std::size_t>(j)] = k_position(seq, k0 + j);
    }
    bool partly_masked = false;
    for (std::size_t b = 0; b < rows.size(); ++b) {
      AttentionUnitScratch& hs = blocks_scratch[b];
      const RowBlock& rb = rows[b];
      partly_masked = partly_masked || !tile_unmasked(rb, k0, keys);
      if (any_bias) add_bias(seq, rb, k0, keys, kpos, hs.st.data());
      const TermTile tile = term_tile(seq, rb, 0, k0, keys, kpos, true);
      for (std::size_t t = 0; t < terms.size(); ++t) terms[t]->add_scores(tile, hs.st.data(), hs.terms[t]);
      if (mask.softcap > 0) kernels::attn_softcap_tile(hs.st.data(), keys, w, static_cast<float>(mask.softcap));
      if (!tile_unmasked(rb, k0, keys)) kernels::attn_mask_tile(hs.st.data(), keys, w, k0, rb.lo.data(), rb.hi.data());
      kernels::attn_softmax_tile(hs.st.data(), keys, w, hs.m.data(), hs.l.data(), hs.corr.data());
      kernels::attn_scale_rows(hs.o.data(), dp, rb.valid_rows, dp, hs.corr.data());
      for (std::size_t t = 0; t < terms.size(); ++t)
        terms[t]->add_probabilities(tile, hs.st.data(), hs.corr.data(), hs.terms[t]);
    }
    bool v_packed = false;
    if (partly_masked) {
      // Several query positions in one block (a multi-token decode): values that are not finite
      // must not reach the rows that do not see their keys (rows_non_finite).
      grow(s.v, decode_tile * g_count * dp);
      pack_tile(v_data, vg, k0, keys, s.v.data());
      v_packed = true;
      if (rows_non_finite(s.v.data(), dp, keys * g_count, dim_v)) {
        for (std::int64_t g = 0; g < g_count; ++g) {
          add_visible_values(rows[static_cast<std::size_t>(merged ? 0 : g)], merged ? g * valid : 0, valid, k0, keys,
                             p_heads[static_cast<std::size_t>(g)], w, s.v.data() + g * dp, g_count * dp, dim_v,
                             o_heads[static_cast<std::size_t>(g)], dp);
        }
        continue;
      }
    }
    if (!direct_v && !v_packed) pack_tile(v_data, vg, k0, keys, s.v.data());
    kernels::attn_decode_values(vp, v_dtype, ldv, vhs, keys, g_count, p_heads.data(), w, valid, direct_v ? dim_v : dp,
                                o_heads.data(), dp, rows_ahead(k_data, kg, seq, k0 + keys, next_keys));
  }
}

}  // namespace detail

}  // namespace posenc
