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

namespace {

// Decode: key tiles of every KV head in memory order (attn_decode_*), the softmax step in between.
// `rows` is either one block holding every KV head's rows (layout_decode_rows; head g's rows are
// lanes g·R … g·R + R − 1 of its tiles) or a block per KV head, each with its own scratch in
// `blocks_scratch`. Keys and values come straight from the cache (f32, unit stride, keys not
// transformed) or are converted per tile into [key][head][Dp] rows, keys transformed where the
// scheme says so.
class DecodeTiles {
 public:
  DecodeTiles(const AttentionPlan& p, const Sequence& seq, std::span<const RowBlock> rows,
              std::span<AttentionUnitScratch> blocks_scratch, AttentionUnitScratch& s)
      : p_(p),
        seq_(seq),
        rows_(rows),
        blocks_(blocks_scratch),
        s_(s),
        dp_(p.dim_padded),
        g_count_(p.kv_heads),
        merged_(rows.size() == 1),
        w_(rows[0].width),
        valid_(merged_ ? rows[0].valid_rows / g_count_ : rows[0].valid_rows),  // rows per KV head
        width_(p.kv_unit) {
    // Keys per tile, by bytes: a tile's keys of every KV head are prefetched into L2 while the
    // previous tile's values are summed, and (unless they are read key by key) its values while
    // its scores are computed, so about three tiles' rows share L2. At 8 KV heads × D 128 in f32 (4 KiB per key) 256
    // KiB is 64 keys; at 32 KV heads 64 keys would fill a 1 MiB L2, and (8192 keys, 2 threads, alternating runs) 16-key
    // tiles take 11.7–12.4 ms, 32-key tiles 12.6–12.7 and 64-key tiles 13.2–13.7.
    tile_ =
        std::clamp<std::int64_t>(AttentionPlan::kDecodeTileBytes / p.decode_key_row_bytes() / 16 * 16, 16, p.key_tile);
    choose_key_path();
    reads_kpos_ = p.any_bias ||
                  std::any_of(p.terms.begin(), p.terms.end(), [](const auto& t) { return t->reads_key_positions(); });
    direct_v_ = p.cache_format ? kernels::attn_decode_reads_quantized(*p.cache_format, valid_, p.dim_v)
                               : p.vg.dim_stride == 1 && kernels::attn_decode_reads_directly(p.dtype, valid_, p.dim_v);
    point_heads();
    if (!direct_k_) grow(s_.k, tile_ * g_count_ * dp_);
    if (!direct_v_) grow(s_.v, tile_ * g_count_ * dp_);
  }

  void run(std::int64_t k_begin, std::int64_t k_end) {
    for (std::int64_t k0 = k_begin; k0 < k_end; k0 += tile_) {
      const std::int64_t keys = std::min(tile_, k_end - k0);
      const TileKeys k = tile_keys(k0, keys);
      // While the values are summed, the next tile's keys are prefetched; the values themselves
      // are prefetched during the scores only where they are not read in memory order
      // (attn_decode_scores).
      const std::int64_t next_keys = std::min(tile_, k_end - (k0 + keys));
      const kernels::RowPrefetch values_ahead = p_.rows_ahead(p_.v_data, p_.vg, seq_, k0, keys);
      if (p_.cache_format && direct_k_) {
        kernels::attn_decode_scores_quantized(k.data, *p_.cache_format, k.ld, k.head_stride, keys, g_count_,
                                              q_heads_.data(), dp_, valid_, p_.dim, st_heads_.data(), w_, values_ahead,
                                              k0 == k_begin);
      } else {
        kernels::attn_decode_scores(k.data, k_dtype_, k.ld, k.head_stride, keys, g_count_, q_heads_.data(), dp_, valid_,
                                    p_.dim, st_heads_.data(), w_, values_ahead, k0 == k_begin, rotation_);
      }
      const bool partly_masked = softmax_step(k0, keys);
      add_values(k0, keys, next_keys, partly_masked);
    }
  }

 private:
  // How the keys reach the scores. Those that RoPE or an absolute encoding transforms go through
  // scratch, unless every KV head rotates them with one RoPE table: then they are rotated inside
  // the scores where the kernel can (attn_decode_rotates_keys, either layout), else, half-split,
  // widened (or dequantised) and rotated in one pass per tile (attn_pack_rotate_heads,
  // attn_dequantize_rotate_heads); otherwise row by row. The
  // kernels read the cache where it lies (f32, and bf16 / f16 on targets that widen them in
  // vectors; a quantized cache whose keys are not transformed); otherwise each tile is first
  // widened (dequantised) into f32 scratch rows of dim_padded.
  void choose_key_path() {
    bool transform_keys = false;
    for (std::int64_t g = 0; g < g_count_; ++g) {
      const QKTables& t = p_.tables_of_head(g * p_.group_size);
      transform_keys = transform_keys || (t.kind != QKTables::kNone && t.transform_keys);
    }
    const bool reads_dtype = !p_.cache_format && kernels::attn_decode_reads_directly(p_.dtype, valid_, p_.dim);
    rope_ = &p_.tables_of_head(0);
    for (std::int64_t g = 0; g < g_count_; ++g) {
      if (&p_.tables_of_head(g * p_.group_size) != rope_) rope_ = nullptr;
    }
    if (rope_ != nullptr &&
        (rope_->kind != QKTables::kRope || !rope_->transform_keys || p_.kg.dim_stride != 1 || rope_->offset != 0)) {
      rope_ = nullptr;
    }
    // A quantized cache's keys: dequantised and rotated in one pass per tile, half-split.
    if (rope_ != nullptr && p_.cache_format && (rope_->interleaved || !kernels::attn_dequantize_rotates(rope_->half))) {
      rope_ = nullptr;
    }
    const bool rotate_in_scores =
        rope_ != nullptr && !p_.cache_format &&
        kernels::attn_decode_rotates_keys(p_.dtype, valid_, p_.dim, rope_->half, rope_->interleaved);
    if (rope_ != nullptr && rope_->interleaved && !rotate_in_scores) rope_ = nullptr;
    interleaved_ = rope_ != nullptr && rope_->interleaved;
    // The keys' [cos | sin] rows (transform_row's choice: their own table, else the queries').
    rope_cos_sin_ = rope_ == nullptr ? nullptr : rope_->cos_sin(true);
    direct_k_ = p_.kg.dim_stride == 1 && reads_dtype && (!transform_keys || rotate_in_scores);
    // A quantized cache is read in place unless its keys are transformed (then dequantised into
    // scratch and transformed there).
    if (p_.cache_format)
      direct_k_ = !transform_keys && kernels::attn_decode_reads_quantized(*p_.cache_format, valid_, p_.dim);
    k_dtype_ = direct_k_ ? p_.dtype : DType::kF32;
    table_rows_.assign(rope_ != nullptr ? static_cast<std::size_t>(tile_) : 0, 0);
    // Interleaved pairs: each tile's rows expanded to one cos and one signed sin per rotated dim
    // (attn_expand_interleaved_rope), read by the scores as rows 0 … keys − 1.
    tile_rows_.resize(interleaved_ ? static_cast<std::size_t>(tile_) : 0);
    for (std::size_t j = 0; j < tile_rows_.size(); ++j) tile_rows_[j] = static_cast<std::int64_t>(j);
    if (interleaved_) grow(s_.rope_rows, tile_ * 4 * rope_->half);
    if (rotate_in_scores) {
      rotation_.cos_sin = interleaved_ ? s_.rope_rows.data() : rope_cos_sin_;
      rotation_.table_rows = interleaved_ ? tile_rows_.data() : table_rows_.data();
      rotation_.half = rope_->half;
      rotation_.interleaved = interleaved_;
    }
  }

  // Each KV head's query rows, scores, probabilities and output rows.
  void point_heads() {
    const auto n = static_cast<std::size_t>(g_count_);
    q_heads_.resize(n);
    p_heads_.resize(n);
    st_heads_.resize(n);
    o_heads_.resize(n);
    for (std::int64_t g = 0; g < g_count_; ++g) {
      AttentionUnitScratch& hs = blocks_[static_cast<std::size_t>(merged_ ? 0 : g)];
      const std::int64_t r0 = merged_ ? g * valid_ : 0;
      q_heads_[static_cast<std::size_t>(g)] = hs.q.data() + r0 * dp_;
      st_heads_[static_cast<std::size_t>(g)] = hs.st.data() + r0;
      p_heads_[static_cast<std::size_t>(g)] = hs.st.data() + r0;
      o_heads_[static_cast<std::size_t>(g)] = hs.o.data() + r0 * dp_;
    }
  }

  // Keys [k0, k0 + keys) of every KV head of `data` as f32 rows [key][head][Dp].
  void pack_tile(const void* data, const HeadsGrid& grid, std::int64_t k0, std::int64_t keys, float* dst) const {
    if (p_.cache_format) {
      kernels::attn_dequantize_heads(static_cast<const char*>(data) + grid.offset(seq_.b, seq_.k0 + k0),
                                     *p_.cache_format, grid.seq_stride, grid.head_stride, keys, g_count_, grid.dim, dst,
                                     dp_);
      return;
    }
    if (grid.dim_stride == 1) {
      kernels::attn_pack_heads(static_cast<const char*>(data) + grid.offset(seq_.b, seq_.k0 + k0) * width_, p_.dtype,
                               grid.seq_stride, grid.head_stride, keys, g_count_, grid.dim, dst, dp_);
      return;
    }
    for (std::int64_t j = 0; j < keys; ++j) {
      for (std::int64_t g = 0; g < g_count_; ++g)
        p_.load_row(data, grid, seq_.b, seq_.k0 + k0 + j, g, dst + (j * g_count_ + g) * dp_);
    }
  }

  struct TileKeys {
    const void* data;
    std::int64_t ld, head_stride;
  };

  // A tile's keys for the scores: the cache itself, or scratch rows (rotated or transformed).
  TileKeys tile_keys(std::int64_t k0, std::int64_t keys) {
    if (rope_ != nullptr) {
      for (std::int64_t j = 0; j < keys; ++j) table_rows_[static_cast<std::size_t>(j)] = p_.k_table_row(seq_, k0 + j);
      if (interleaved_) {
        kernels::attn_expand_interleaved_rope(rope_cos_sin_, table_rows_.data(), keys, rope_->half,
                                              s_.rope_rows.data());
      }
    }
    const char* cache = static_cast<const char*>(p_.k_data) + p_.kg.offset(seq_.b, seq_.k0 + k0) * width_;
    if (direct_k_) return {cache, p_.kg.seq_stride, p_.kg.head_stride};
    if (rope_ != nullptr && p_.cache_format) {
      kernels::attn_dequantize_rotate_heads(cache, *p_.cache_format, p_.kg.seq_stride, p_.kg.head_stride, keys,
                                            g_count_, p_.dim, rope_cos_sin_, table_rows_.data(), rope_->half,
                                            s_.k.data(), dp_);
      return {s_.k.data(), g_count_ * dp_, dp_};
    }
    if (rope_ != nullptr) {
      kernels::attn_pack_rotate_heads(cache, p_.dtype, p_.kg.seq_stride, p_.kg.head_stride, keys, g_count_, p_.dim,
                                      rope_cos_sin_, table_rows_.data(), rope_->half, s_.k.data(), dp_);
      return {s_.k.data(), g_count_ * dp_, dp_};
    }
    pack_tile(p_.k_data, p_.kg, k0, keys, s_.k.data());
    for (std::int64_t j = 0; j < keys; ++j) {
      for (std::int64_t g = 0; g < g_count_; ++g) {
        const QKTables& t = p_.tables_of_head(g * p_.group_size);
        if (t.kind != QKTables::kNone && t.transform_keys) {
          p_.transform_row(t, false, p_.k_table_row(seq_, k0 + j), s_.k.data() + (j * g_count_ + g) * dp_, 1.0f);
        }
      }
    }
    return {s_.k.data(), g_count_ * dp_, dp_};
  }

  // The scores' biases, terms, soft-cap and mask, then the online softmax, per block of rows.
  // Returns whether some row does not see every key of the tile.
  bool softmax_step(std::int64_t k0, std::int64_t keys) {
    // The keys' positions, once per tile for every head, where a bias or a term reads them.
    const std::int64_t* kpos = blocks_[0].kpos.data();
    if (reads_kpos_) {
      for (std::int64_t j = 0; j < keys; ++j)
        blocks_[0].kpos[static_cast<std::size_t>(j)] = p_.k_position(seq_, k0 + j);
    }
    bool partly_masked = false;
    for (std::size_t b = 0; b < rows_.size(); ++b) {
      AttentionUnitScratch& hs = blocks_[b];
      const RowBlock& rb = rows_[b];
      const bool unmasked = p_.tile_unmasked(rb, k0, keys);
      partly_masked = partly_masked || !unmasked;
      if (p_.any_bias) p_.add_bias(rb, keys, kpos, hs.st.data());
      const TermTile tile = term_tile(seq_, rb, 0, k0, keys, kpos, true);
      for (std::size_t t = 0; t < p_.terms.size(); ++t) p_.terms[t]->add_scores(tile, hs.st.data(), hs.terms[t]);
      if (p_.mask.softcap > 0) kernels::attn_softcap_tile(hs.st.data(), keys, w_, static_cast<float>(p_.mask.softcap));
      if (!unmasked) kernels::attn_mask_tile(hs.st.data(), keys, w_, k0, rb.lo.data(), rb.hi.data());
      kernels::attn_softmax_tile(hs.st.data(), keys, w_, hs.m.data(), hs.l.data(), hs.corr.data());
      kernels::attn_scale_rows(hs.o.data(), dp_, rb.valid_rows, dp_, hs.corr.data());
      for (std::size_t t = 0; t < p_.terms.size(); ++t)
        p_.terms[t]->add_probabilities(tile, hs.st.data(), hs.corr.data(), hs.terms[t]);
    }
    return partly_masked;
  }

  // O += P·V for the tile, the next tile's keys prefetched meanwhile.
  void add_values(std::int64_t k0, std::int64_t keys, std::int64_t next_keys, bool partly_masked) {
    bool v_packed = false;
    if (partly_masked) {
      // Several query positions in one block (a multi-token decode): values that are not finite
      // must not reach the rows that do not see their keys (rows_non_finite).
      grow(s_.v, tile_ * g_count_ * dp_);
      pack_tile(p_.v_data, p_.vg, k0, keys, s_.v.data());
      v_packed = true;
      if (rows_non_finite(s_.v.data(), dp_, keys * g_count_, p_.dim_v)) {
        for (std::int64_t g = 0; g < g_count_; ++g) {
          add_visible_values(rows_[static_cast<std::size_t>(merged_ ? 0 : g)], merged_ ? g * valid_ : 0, valid_, k0,
                             keys, p_heads_[static_cast<std::size_t>(g)], w_, s_.v.data() + g * dp_, g_count_ * dp_,
                             p_.dim_v, o_heads_[static_cast<std::size_t>(g)], dp_);
        }
        return;
      }
    }
    if (!direct_v_ && !v_packed) pack_tile(p_.v_data, p_.vg, k0, keys, s_.v.data());
    const void* vp = direct_v_ ? static_cast<const void*>(static_cast<const char*>(p_.v_data) +
                                                          p_.vg.offset(seq_.b, seq_.k0 + k0) * width_)
                               : s_.v.data();
    const std::int64_t ldv = direct_v_ ? p_.vg.seq_stride : g_count_ * dp_;
    const std::int64_t vhs = direct_v_ ? p_.vg.head_stride : dp_;
    if (p_.cache_format && direct_v_) {
      kernels::attn_decode_values_quantized(vp, *p_.cache_format, ldv, vhs, keys, g_count_, p_heads_.data(), w_, valid_,
                                            p_.dim_v, o_heads_.data(), dp_,
                                            p_.rows_ahead(p_.k_data, p_.kg, seq_, k0 + keys, next_keys));
      return;
    }
    kernels::attn_decode_values(vp, direct_v_ ? p_.dtype : DType::kF32, ldv, vhs, keys, g_count_, p_heads_.data(), w_,
                                valid_, direct_v_ ? p_.dim_v : dp_, o_heads_.data(), dp_,
                                p_.rows_ahead(p_.k_data, p_.kg, seq_, k0 + keys, next_keys));
  }

  const AttentionPlan& p_;
  const Sequence& seq_;
  std::span<const RowBlock> rows_;
  std::span<AttentionUnitScratch> blocks_;
  AttentionUnitScratch& s_;
  const std::int64_t dp_, g_count_;
  const bool merged_;
  const std::int64_t w_, valid_, width_;
  std::int64_t tile_ = 16;
  const QKTables* rope_ = nullptr;  // the one RoPE table every KV head's keys share, if any
  bool interleaved_ = false, direct_k_ = false, direct_v_ = false, reads_kpos_ = true;
  const float* rope_cos_sin_ = nullptr;
  DType k_dtype_ = DType::kF32;
  std::vector<std::int64_t> table_rows_, tile_rows_;
  kernels::KeyRotation rotation_;
  std::vector<const float*> q_heads_, p_heads_;
  std::vector<float*> st_heads_, o_heads_;
};

}  // namespace

void AttentionPlan::decode_tiles(const Sequence& seq, std::int64_t k_begin, std::int64_t k_end,
                                 std::span<const RowBlock> rows, std::span<AttentionUnitScratch> blocks_scratch,
                                 AttentionUnitScratch& s) const {
  DecodeTiles(*this, seq, rows, blocks_scratch, s).run(k_begin, k_end);
}

}  // namespace detail

}  // namespace posenc
