// The engine's rows: per-row transforms (RoPE, Shortformer), loading and storing rows of any
// dtype and layout, the layout of a block's (head, query) rows and their visible keys, and the
// score biases of a tile.
#include <bit>
#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "attention/engine.hpp"
#include "internal.hpp"
#include "kernels/attention/attention_kernels.hpp"
#include "posenc/error.hpp"

namespace posenc {

// ─── Per-row transforms ──────────────────────────────────────────────────────────────────────

namespace detail {

// x (f32, D entries, padded with zeros to Dp) ← T(x) for a token at `row` of the table; sign −1
// applies the transpose (backward: sine negated).
void AttentionPlan::transform_row(const QKTables& t, bool is_q, std::int64_t table_row, float* x,
                                  float sine_sign) const {
  if (t.kind == QKTables::kNone) return;
  if (t.kind == QKTables::kAbsolute) {
    if (sine_sign < 0) return;  // the gradient of an addition passes through
    const float* add = t.absolute.data() + table_row * dim;
    for (std::int64_t d = 0; d < dim; ++d) x[d] += add[d];
    return;
  }
  const std::int64_t half = t.half;
  x += t.offset;
  const float* c = t.cos_sin(!is_q) + table_row * 2 * half;
  const float* s = c + half;
  if (!t.interleaved) {
    kernels::attn_rotate_half_split(x, c, s, half, sine_sign);
  } else {
    for (std::int64_t i = 0; i < half; ++i) {
      const float ai = x[2 * i], bi = x[2 * i + 1], si = sine_sign * s[i];
      x[2 * i] = ai * c[i] - bi * si;
      x[2 * i + 1] = bi * c[i] + ai * si;
    }
  }
}

// One token's head vector (any dtype, any dim stride) into f32 with zero padding to Dp.
void load_heads_row(const void* base, DType dtype, const HeadsGrid& g, std::int64_t b, std::int64_t s, std::int64_t h,
                    float* out, std::int64_t padded) {
  const std::int64_t offset = g.offset(b, s) + h * g.head_stride;
  if (g.dim_stride == 1) {
    kernels::attn_load_f32(static_cast<const char*>(base) + offset * static_cast<std::int64_t>(dtype_size(dtype)),
                           dtype, g.dim, out);
  } else {
    for (std::int64_t d = 0; d < g.dim; ++d) out[d] = static_cast<float>(load(base, dtype, offset + d * g.dim_stride));
  }
  for (std::int64_t d = g.dim; d < padded; ++d) out[d] = 0.0f;
}

void store_heads_row(const float* row, void* base, DType dtype, const HeadsGrid& g, std::int64_t b, std::int64_t s,
                     std::int64_t h, bool accumulate) {
  const std::int64_t offset = g.offset(b, s) + h * g.head_stride;
  if (g.dim_stride == 1) {
    kernels::attn_store(row, g.dim, dtype,
                        static_cast<char*>(base) + offset * static_cast<std::int64_t>(dtype_size(dtype)), accumulate);
    return;
  }
  for (std::int64_t d = 0; d < g.dim; ++d) {
    const std::int64_t at = offset + d * g.dim_stride;
    const double prior = accumulate ? load(base, dtype, at) : 0.0;
    store(base, dtype, at, static_cast<double>(static_cast<float>(prior) + row[d]));
  }
}

void AttentionPlan::load_row(const void* base, const HeadsGrid& g, std::int64_t b, std::int64_t s, std::int64_t h,
                             float* out) const {
  load_heads_row(base, dtype, g, b, s, h, out, dim_padded);
}

void AttentionPlan::load_kv_row(const void* base, const HeadsGrid& g, std::int64_t b, std::int64_t s, std::int64_t h,
                                float* out) const {
  if (!cache_format) {
    load_row(base, g, b, s, h, out);
    return;
  }
  kernels::attn_dequantize_heads(static_cast<const char*>(base) + g.offset(b, s) + h * g.head_stride, *cache_format, 0,
                                 0, 1, 1, g.dim, out, dim_padded);
}

kernels::RowPrefetch AttentionPlan::rows_ahead(const void* base, const HeadsGrid& g, const Sequence& seq,
                                               std::int64_t k_first, std::int64_t keys) const {
  kernels::RowPrefetch plan;
  if (g.dim_stride != 1 || keys <= 0) return plan;
  const std::int64_t width = kv_unit;
  plan.base = static_cast<const char*>(base) + g.offset(seq.b, seq.k0 + k_first) * width;
  plan.ld = g.seq_stride * width;
  plan.head_stride = g.head_stride * width;
  plan.keys = keys;
  plan.heads = kv_heads;
  plan.row_bytes = kv_row_bytes(g);
  return plan;
}

void AttentionPlan::store_row(const float* row, void* base, const HeadsGrid& g, std::int64_t b, std::int64_t s,
                              std::int64_t h, bool accumulate) const {
  store_heads_row(row, base, dtype, g, b, s, h, accumulate);
}

// ─── Row blocks ──────────────────────────────────────────────────────────────────────────────

std::pair<std::int64_t, std::int64_t> AttentionPlan::visible_keys(const Sequence& seq, std::int64_t i) const {
  const std::int64_t offset = seq.lk - seq.lq;
  std::int64_t lo = 0, hi = seq.lk;
  if (mask.window_left >= 0) lo = std::max<std::int64_t>(0, i + offset - mask.window_left);
  if (window_right >= 0) hi = std::min<std::int64_t>(seq.lk, i + offset + window_right + 1);
  if (mask.chunk_size) {
    const auto [chunk_lo, chunk_hi] = chunk_keys(seq, q_position(seq, i));
    lo = std::max(lo, chunk_lo);
    hi = std::min(hi, chunk_hi);
  }
  return {lo, std::max(lo, hi)};
}

// Lays out the rows of queries [i0, i0 + count) of `seq` for KV head `kvh`: head-major, each
// head's queries padded to kAttnAlign lanes (compact: no padding, for decode).
void AttentionPlan::layout_rows(const Sequence& seq, std::int64_t kvh, std::int64_t i0, std::int64_t count,
                                bool compact, RowBlock& rb) const {
  rb.i0 = i0;
  rb.count = count;
  rb.compact = compact;
  const std::int64_t per_head = compact ? count : round_up(count, kAttnAlign);
  rb.valid_rows = group_size * count;
  rb.width = round_up(group_size * per_head, kAttnAlign);
  grow(rb.head, rb.width);
  grow(rb.query, rb.width);
  grow(rb.position, rb.width);
  grow(rb.lo, rb.width);
  grow(rb.hi, rb.width);
  for (std::int64_t r = 0; r < rb.width; ++r) {
    const std::int64_t g = compact ? r / std::max<std::int64_t>(count, 1) : r / per_head;
    const std::int64_t qi = compact ? r % std::max<std::int64_t>(count, 1) : r % per_head;
    const bool valid = r < group_size * per_head && g < group_size && qi < count;
    auto& head = rb.head[static_cast<std::size_t>(r)];
    head = valid ? kvh * group_size + g : -1;
    rb.query[static_cast<std::size_t>(r)] = valid ? i0 + qi : -1;
    const std::int64_t i = i0 + qi;
    rb.position[static_cast<std::size_t>(r)] = valid ? q_position(seq, i) : 0;
    std::int64_t lo = 0, hi = 0;  // padding sees nothing
    if (valid) std::tie(lo, hi) = visible_keys(seq, i);
    rb.lo[static_cast<std::size_t>(r)] = static_cast<std::int32_t>(lo);
    rb.hi[static_cast<std::size_t>(r)] = static_cast<std::int32_t>(hi);
  }
  summarize_rows(seq, rb);
}

// The rows of every KV head's decode block side by side (kvh·valid + r), padded to kAttnAlign
// lanes once: one S^T tile [keys][width] for all heads, so that the biases, the masks and the
// softmax fill their vector lanes (with a block per KV head, 4 rows of a GQA group used a
// quarter of each 16-lane vector).
void AttentionPlan::layout_decode_rows(const Sequence& seq, std::int64_t i0, std::int64_t count, RowBlock& scratch,
                                       RowBlock& rb) const {
  layout_rows(seq, 0, i0, count, true, scratch);
  const std::int64_t per_head = scratch.valid_rows;
  rb.i0 = i0;
  rb.count = count;
  rb.compact = true;
  rb.valid_rows = per_head * kv_heads;
  rb.width = round_up(rb.valid_rows, kAttnAlign);
  // Padding lanes as layout_rows leaves them: head and query −1, position 0, no visible keys.
  for (auto* v : {&rb.head, &rb.query}) v->assign(static_cast<std::size_t>(rb.width), -1);
  rb.position.assign(static_cast<std::size_t>(rb.width), 0);
  for (auto* v : {&rb.lo, &rb.hi}) v->assign(static_cast<std::size_t>(rb.width), 0);
  for (std::int64_t kvh = 0; kvh < kv_heads; ++kvh) {
    if (kvh > 0) layout_rows(seq, kvh, i0, count, true, scratch);
    for (std::int64_t r = 0; r < per_head; ++r) {
      const auto from = static_cast<std::size_t>(r), to = static_cast<std::size_t>(kvh * per_head + r);
      rb.head[to] = scratch.head[from];
      rb.query[to] = scratch.query[from];
      rb.position[to] = scratch.position[from];
      rb.lo[to] = scratch.lo[from];
      rb.hi[to] = scratch.hi[from];
    }
  }
  summarize_rows(seq, rb);
}

// The union of the rows' visible keys, and which lane chunks may take the vector bias path.
void AttentionPlan::summarize_rows(const Sequence& seq, RowBlock& rb) {
  rb.key_lo = seq.lk;
  rb.key_hi = 0;
  for (std::int64_t r = 0; r < rb.width; ++r) {
    if (rb.head[static_cast<std::size_t>(r)] < 0) continue;
    rb.key_lo = std::min<std::int64_t>(rb.key_lo, rb.lo[static_cast<std::size_t>(r)]);
    rb.key_hi = std::max<std::int64_t>(rb.key_hi, rb.hi[static_cast<std::size_t>(r)]);
  }
  // Lane chunks that can take the vector bias path: one head, consecutive positions.
  const std::int64_t chunks = rb.width / kAttnAlign;
  grow(rb.chunk_uniform, chunks);
  for (std::int64_t c = 0; c < chunks; ++c) {
    bool uniform = true;
    const std::int64_t r0 = c * kAttnAlign;
    for (std::int64_t t = 0; t < kAttnAlign && uniform; ++t) {
      const auto r = static_cast<std::size_t>(r0 + t);
      uniform = rb.head[static_cast<std::size_t>(r0)] >= 0 &&
                (rb.head[r] < 0 || (rb.head[r] == rb.head[static_cast<std::size_t>(r0)] &&
                                    rb.position[r] == rb.position[static_cast<std::size_t>(r0)] + t));
    }
    rb.chunk_uniform[static_cast<std::size_t>(c)] = uniform ? 1 : 0;
  }
}

// Whether keys [k_first, k_first + keys) of the sequence are all visible to every valid row.
bool AttentionPlan::tile_unmasked(const RowBlock& rb, std::int64_t k_first, std::int64_t keys) const {
  for (std::int64_t r = 0; r < rb.width; ++r) {
    if (rb.head[static_cast<std::size_t>(r)] < 0) continue;
    if (rb.lo[static_cast<std::size_t>(r)] > k_first || rb.hi[static_cast<std::size_t>(r)] < k_first + keys)
      return false;
  }
  return true;
}

bool rows_non_finite(const float* rows, std::int64_t ld, std::int64_t count, std::int64_t cols) {
  // On the bits: all exponent bits set is inf or NaN. An integer OR vectorises; a float test
  // under strict IEEE order would not.
  std::uint32_t bad = 0;
  for (std::int64_t r = 0; r < count; ++r) {
    const float* row = rows + r * ld;
    for (std::int64_t t = 0; t < cols; ++t) {
      const auto bits = std::bit_cast<std::uint32_t>(row[t]);
      bad |= static_cast<std::uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
    }
  }
  return bad != 0;
}

void add_visible_values(const RowBlock& rb, std::int64_t r_first, std::int64_t rows, std::int64_t k_first,
                        std::int64_t keys, const float* p, std::int64_t ldp, const float* v, std::int64_t ldv,
                        std::int64_t cols, float* out, std::int64_t ldo) {
  for (std::int64_t r = 0; r < rows; ++r) {
    float* o = out + r * ldo;
    for (std::int64_t j = 0; j < keys; ++j) {
      if (!rb.sees(r_first + r, k_first + j)) continue;
      const float pj = p[j * ldp + r];
      const float* vj = v + j * ldv;
      for (std::int64_t t = 0; t < cols; ++t) o[t] += pj * vj[t];
    }
  }
}

// Adds the tabulated (or evaluated) biases of the rows to S^T [keys][width] for a tile of keys
// at positions kpos[0..keys).
void AttentionPlan::add_bias(const RowBlock& rb, std::int64_t keys, const std::int64_t* kpos, float* st) const {
  if (!any_bias) return;
  const bool keys_consecutive = positions_consecutive(kpos, keys);
  // Decode's merged rows of one query (layout_decode_rows: lane r is head r, all at one position):
  // a key's biases for every head are one row of bias_by_delta.
  if (!bias_by_delta.empty() && keys_consecutive && rb.compact && rb.valid_rows == heads && keys > 0) {
    bool one_query = true;
    for (std::int64_t r = 0; r < heads && one_query; ++r) {
      one_query =
          rb.head[static_cast<std::size_t>(r)] == r && rb.position[static_cast<std::size_t>(r)] == rb.position[0];
    }
    const HeadBias& hb = head_bias[0];
    const std::int64_t base = rb.position[0] - kpos[0] - hb.delta_min;
    if (one_query && base - (keys - 1) >= 0 && base < hb.width) {
      kernels::attn_add_bias_rows(st, keys, rb.width, bias_by_delta.data(), base, heads);
      return;
    }
  }
  const std::int64_t chunks = rb.width / kAttnAlign;
  for (std::int64_t c = 0; c < chunks; ++c) {
    const std::int64_t r0 = c * kAttnAlign;
    const std::int64_t h0 = rb.head[static_cast<std::size_t>(r0)];
    if (h0 < 0 && !rb.compact) continue;
    if (h0 >= 0 && rb.chunk_uniform[static_cast<std::size_t>(c)] && keys_consecutive) {
      const HeadBias& hb = head_bias[static_cast<std::size_t>(h0)];
      if (hb.kind == HeadBias::kNone) continue;
      if (hb.kind == HeadBias::kTable) {
        // δ = q − k runs up with the lane and down with the key: a contiguous table slice per key.
        const std::int64_t base = rb.position[static_cast<std::size_t>(r0)] - kpos[0] - hb.delta_min;
        if (base - (keys - 1) >= 0 && base + kAttnAlign <= hb.width) {
          kernels::attn_add_bias_tile(st + r0, keys, rb.width, hb.table, base);
          continue;
        }
      }
    }
    // General path: lane by lane.
    for (std::int64_t t = 0; t < kAttnAlign; ++t) {
      const std::int64_t r = r0 + t;
      const std::int64_t h = rb.head[static_cast<std::size_t>(r)];
      if (h < 0) continue;
      const HeadBias& hb = head_bias[static_cast<std::size_t>(h)];
      if (hb.kind == HeadBias::kNone) continue;
      const std::int64_t qp = rb.position[static_cast<std::size_t>(r)];
      if (hb.kind == HeadBias::kTable && keys_consecutive) {
        // The lane's slice of its head's table, read backwards (decode rows mix heads, so the
        // chunk path above does not apply to them).
        const std::int64_t base = qp - kpos[0] - hb.delta_min;
        if (base - (keys - 1) >= 0 && base < hb.width) {
          const float* row = hb.table + base;
          for (std::int64_t j = 0; j < keys; ++j) st[j * rb.width + r] += row[-j];
          continue;
        }
      }
      for (std::int64_t j = 0; j < keys; ++j) {
        const std::int64_t delta = qp - kpos[j];
        float b;
        if (hb.kind == HeadBias::kTable && delta >= hb.delta_min && delta < hb.delta_min + hb.width) {
          b = hb.table[delta - hb.delta_min];
        } else {
          b = (*hb.evaluator)(hb.local_head, qp, kpos[j]);
        }
        st[j * rb.width + r] += b;
      }
    }
  }
}

}  // namespace detail

}  // namespace posenc
