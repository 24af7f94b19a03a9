// The fused attention engine (math, layouts and contracts in posenc/attention.hpp).
//
// Work is cut into units that never share outputs, so any thread count gives the same bits:
//   forward   (sequence, KV head, block of queries): rows = the block's queries × the KV head's
//             G query heads, head-major, each head's queries padded to kAttnAlign lanes (about
//             128 rows); key tiles of key_tile keys stream past them;
//   decode    (sequence, key chunk) when a sequence has at most kDecodeRows rows per KV head:
//             every KV head of each key tile in the cache's memory order (decode_tiles), the
//             heads' rows side by side in one score tile (layout_decode_rows; a block per KV
//             head with Shaw, XL and TUPE), caches split into chunks of about kDecodeChunkBytes,
//             merged in chunk order;
//   backward  (sequence, KV head): all of its rows, key tiles outer (dk, dv finished per tile),
//             row blocks inner, dq accumulated per unit in f32.
// Score tiles are transposed (S^T[key][row]) so that the softmax, the biases and the masks run
// with rows in the vector lanes; see kernels/attention/attention_kernels.hpp.
#include "posenc/attention.hpp"

#include <omp.h>
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <type_traits>
#include <utility>

#include "attention/attention_plan.hpp"
#include "internal.hpp"
#include "kernels/attention/attention_kernels.hpp"
#include "posenc/error.hpp"
#include "posenc/reference.hpp"

namespace posenc {

using detail::AttentionUnitScratch;
using detail::CallBuffer;
using detail::zeroed_doubles;
using kernels::kAttnAlign;

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

std::int64_t round_up(std::int64_t x, std::int64_t to) { return (x + to - 1) / to * to; }

// Row strides of the packed operands the matrix kernel streams (Qᵀ, dOᵀ: w rows wide; K, V
// tiles: Dp wide) get one extra cache line. At 128 rows or D = 128 a plain stride is 512 bytes,
// and [B, S, H, D] inputs have S-strides of H·D·4 bytes (4 KiB at H·D = 1024): the rows of an
// operand panel then fall into a few L1 sets, evict each other, and every block of the kernel
// reloads its panel from L2. Measured, S = 2048, H = 4, D = 128, causal forward, 1 thread: 48–66
// ms with V read in place and stride w, 43–45 ms with V packed at Dp + 16 and Qᵀ at w + 16.
std::int64_t padded_stride(std::int64_t w) { return w + kAttnAlign; }

// Denormals flushed to zero (FTZ) and read as zero (DAZ) while a thread runs attention: ALiBi's
// far keys give probabilities near FLT_MIN whose products with values are denormal, and each
// denormal result costs a microcode assist (~100 cycles) on x86 — the forward pass ran at half
// speed. Flushing changes results only below FLT_MIN (absolute), and identically on every
// thread, so results stay bitwise reproducible. The caller's mode is restored afterwards.
class FlushDenormals {
 public:
  FlushDenormals() {
#if defined(__x86_64__) || defined(__i386__)
    saved_ = _mm_getcsr();
    _mm_setcsr(saved_ | 0x8040u);  // FTZ (bit 15) | DAZ (bit 6)
#endif
  }
  ~FlushDenormals() {
#if defined(__x86_64__) || defined(__i386__)
    _mm_setcsr(saved_);
#endif
  }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;

 private:
  unsigned saved_ = 0;
};

template <class T, class Allocator>
void grow(std::vector<T, Allocator>& v, std::int64_t n) {
  if (static_cast<std::int64_t>(v.size()) < n) v.resize(static_cast<std::size_t>(n));
}

}  // namespace

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
  const std::vector<float>& cs = (is_q || t.k_cos_sin.empty()) ? t.q_cos_sin : t.k_cos_sin;
  const std::int64_t half = t.half;
  const float* c = cs.data() + table_row * 2 * half;
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
void AttentionPlan::load_row(const void* base, const HeadsGrid& g, std::int64_t b, std::int64_t s, std::int64_t h,
                             float* out) const {
  const std::int64_t offset = g.offset(b, s) + h * g.head_stride;
  if (g.dim_stride == 1) {
    kernels::attn_load_f32(static_cast<const char*>(base) + offset * static_cast<std::int64_t>(dtype_size(dtype)),
                           dtype, dim, out);
  } else {
    for (std::int64_t d = 0; d < dim; ++d) out[d] = static_cast<float>(load(base, dtype, offset + d * g.dim_stride));
  }
  for (std::int64_t d = dim; d < dim_padded; ++d) out[d] = 0.0f;
}

kernels::RowPrefetch AttentionPlan::rows_ahead(const void* base, const HeadsGrid& g, const Sequence& seq,
                                               std::int64_t k_first, std::int64_t keys) const {
  kernels::RowPrefetch plan;
  if (g.dim_stride != 1 || keys <= 0) return plan;
  const auto width = static_cast<std::int64_t>(dtype_size(dtype));
  plan.base = static_cast<const char*>(base) + g.offset(seq.b, seq.k0 + k_first) * width;
  plan.ld = g.seq_stride * width;
  plan.head_stride = g.head_stride * width;
  plan.keys = keys;
  plan.heads = kv_heads;
  plan.row_bytes = dim * width;
  return plan;
}

void AttentionPlan::store_row(const float* row, void* base, const HeadsGrid& g, std::int64_t b, std::int64_t s,
                              std::int64_t h, bool accumulate) const {
  const std::int64_t offset = g.offset(b, s) + h * g.head_stride;
  if (g.dim_stride == 1) {
    kernels::attn_store(row, dim, dtype,
                        static_cast<char*>(base) + offset * static_cast<std::int64_t>(dtype_size(dtype)), accumulate);
    return;
  }
  for (std::int64_t d = 0; d < dim; ++d) {
    const std::int64_t at = offset + d * g.dim_stride;
    const double prior = accumulate ? load(base, dtype, at) : 0.0;
    store(base, dtype, at, static_cast<double>(static_cast<float>(prior) + row[d]));
  }
}

// ─── Row blocks ──────────────────────────────────────────────────────────────────────────────

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
  const std::int64_t offset = seq.lk - seq.lq;
  for (std::int64_t r = 0; r < rb.width; ++r) {
    const std::int64_t g = compact ? r / std::max<std::int64_t>(count, 1) : r / per_head;
    const std::int64_t qi = compact ? r % std::max<std::int64_t>(count, 1) : r % per_head;
    const bool valid = r < group_size * per_head && g < group_size && qi < count;
    auto& head = rb.head[static_cast<std::size_t>(r)];
    head = valid ? kvh * group_size + g : -1;
    rb.query[static_cast<std::size_t>(r)] = valid ? i0 + qi : -1;
    const std::int64_t i = i0 + qi;
    rb.position[static_cast<std::size_t>(r)] = valid ? q_position(seq, i) : 0;
    std::int64_t lo = 0, hi = seq.lk;
    if (valid) {
      if (mask.window_left >= 0) lo = std::max<std::int64_t>(0, i + offset - mask.window_left);
      if (window_right >= 0) hi = std::min<std::int64_t>(seq.lk, i + offset + window_right + 1);
      if (hi < lo) hi = lo;
    } else {
      hi = 0;  // padding: sees nothing
    }
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

// Adds the positional biases of the rows to S^T [keys][width] for keys [k_first, k_first + keys)
// of the sequence, whose positions are kpos[0..keys).
void AttentionPlan::add_bias(const Sequence& seq, const RowBlock& rb, std::int64_t k_first, std::int64_t keys,
                             const std::int64_t* kpos, float* st) const {
  if (!any_bias) return;
  bool keys_consecutive = true;
  for (std::int64_t j = 1; j < keys && keys_consecutive; ++j) keys_consecutive = kpos[j] == kpos[0] + j;
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
      if (hb.fire != nullptr &&
          hb.fire->add_chunk(hb.local_head, rb.head.data() + r0, rb.lo.data() + r0, rb.hi.data() + r0,
                             rb.position[static_cast<std::size_t>(r0)], k_first, kpos[0], keys, st + r0, rb.width)) {
        continue;
      }
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
      if (hb.fire != nullptr && keys_consecutive &&
          hb.fire->add_row(hb.local_head, qp, kpos[0], keys, st + r, rb.width)) {
        continue;
      }
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
  (void)seq;
}

// ─── Vanishing tiles ───────────────────────────────────────────────────────────────────────────
// Whether no row of rb can get a probability of at least FLT_MIN from keys at positions
// [k_lo, k_hi] (AttentionPlan::skip_far_tiles). Row r's logits there are at most
// (1 + 1e-3)·row_norm[r]·key_norm() + max b over the tile's δ (row_norm: |scale·q_r|), the 1e-3
// covering the f32 dot product's rounding (D·2^−24 < 2.5e-4 for D <= 4096) and a rotation's; the
// bias bound gets 1e-3 of itself plus 1 for its table's and the sum's rounding. Forward passes the
// running max m_r as row_max, backward the row's lse (>= the max); both flush exp(x) to 0 below
// x = −87.3, so a bound under row_max − 89 leaves 1.7 to spare: every probability of the tile is
// exactly 0, and skipping it changes no bit (for finite values). The bias bound is checked first;
// key_norm() (the tile's largest |k|) is called only when it passes.
template <class KeyNorm>
bool tile_vanishes(const AttentionPlan& p, const RowBlock& rb, const double* row_norm, const float* row_max,
                   std::int64_t k_lo, std::int64_t k_hi, KeyNorm&& key_norm) {
  const auto rows_pass = [&](double norm) {
    for (std::int64_t r = 0; r < rb.width; ++r) {
      const std::int64_t h = rb.head[static_cast<std::size_t>(r)];
      if (h < 0) continue;
      const HeadBias& hb = p.head_bias[static_cast<std::size_t>(h)];
      if (hb.kind != HeadBias::kTable || hb.max_from == nullptr) return false;
      const std::int64_t qp = rb.position[static_cast<std::size_t>(r)];
      const std::int64_t a = qp - k_hi - hb.delta_min, b = qp - k_lo - hb.delta_min;
      if (a < 0 || b >= hb.width) return false;
      const double bias = std::min(hb.max_from[a], hb.max_to[b]);
      const double bound = (1 + 1e-3) * row_norm[r] * norm + bias + 1e-3 * std::abs(bias) + 1.0;
      // A row that has no max yet (−inf) or a NaN norm fails here: the tile runs.
      if (!(bound < static_cast<double>(row_max[r]) - 89.0)) return false;
    }
    return true;
  };
  return rows_pass(0.0) && rows_pass(key_norm());
}

// The larger of a and b, NaN if either is (std::max would drop a NaN b): a NaN norm must fail the
// bound of tile_vanishes, so that a tile holding a NaN key runs.
double max_or_nan(double a, double b) {
  return std::isnan(a) || std::isnan(b) ? std::numeric_limits<double>::quiet_NaN() : std::max(a, b);
}

// Row norms |row| of `count` rows ld apart (D values each), in fp64, into out (unless null);
// returns the largest (NaN if any is).
double row_norms(const float* rows, std::int64_t ld, std::int64_t count, std::int64_t d, double* out) {
  double largest = 0;
  for (std::int64_t r = 0; r < count; ++r) {
    double n2 = 0;
    for (std::int64_t t = 0; t < d; ++t) n2 += static_cast<double>(rows[r * ld + t]) * rows[r * ld + t];
    if (out != nullptr) out[r] = std::sqrt(n2);
    largest = max_or_nan(largest, std::sqrt(n2));
  }
  return largest;
}

// ─── Shaw's relative key and value terms ─────────────────────────────────────────────────────
// Per-row arrays over the table rows are kept transposed, [table row u][row r] with row stride
// ld, so that a tile whose keys all clip to one table row for every row (every tile outside the
// ±k band around the diagonal) is one vector add per key.

// Calls fn(r, tables, q_position) for every row of the block whose head has Shaw terms.
template <class Fn>
void for_each_shaw_row(const AttentionPlan& p, const RowBlock& rb, Fn&& fn) {
  for (std::int64_t r = 0; r < rb.width; ++r) {
    const std::int64_t h = rb.head[static_cast<std::size_t>(r)];
    const ShawTables* t = h < 0 ? nullptr : p.shaw_of_head(h);
    if (t != nullptr) fn(r, *t, rb.position[static_cast<std::size_t>(r)]);
  }
}

// The Shaw tables every valid row of the block uses, when they all use the same ones.
const ShawTables* AttentionPlan::shaw_of_block(const RowBlock& rb) const {
  const ShawTables* common = nullptr;
  for (std::int64_t r = 0; r < rb.width; ++r) {
    const std::int64_t h = rb.head[static_cast<std::size_t>(r)];
    if (h < 0) continue;
    const ShawTables* t = shaw_of_head(h);
    if (t == nullptr || (common != nullptr && t != common)) return nullptr;
    common = t;
  }
  return common;
}

// dots[u][r] = rows_r · table[u] (the key table, or the value table) for rows with Shaw; 0 for
// the other rows and table rows past their group's width. rows_t: the rows transposed, [d][r]
// with stride ld_t, when available: one matrix product then does it (a block of one group).
void AttentionPlan::shaw_row_dots(const RowBlock& rb, const float* rows, std::int64_t ld_rows, const float* rows_t,
                                  std::int64_t ld_t, bool value_table, float* dots, std::int64_t ld) const {
  for (std::int64_t u = 0; u < shaw_width; ++u) std::fill(dots + u * ld, dots + u * ld + rb.width, 0.0f);
  if (const ShawTables* t = shaw_of_block(rb); t != nullptr && rows_t != nullptr) {
    kernels::attn_gemm(value_table ? t->value.data() : t->key.data(), value_table ? dim_padded : dim, 1, rows_t, ld_t,
                       dots, ld, t->width, rb.width, dim, false);
    return;
  }
  for_each_shaw_row(*this, rb, [&](std::int64_t r, const ShawTables& t, std::int64_t /* q_position */) {
    const float* row = rows + r * ld_rows;
    for (std::int64_t u = 0; u < t.width; ++u) {
      const float* a = value_table ? t.value.data() + u * dim_padded : t.key.data() + u * dim;
      float sum = 0;
      for (std::int64_t e = 0; e < dim; ++e) sum += row[e] * a[e];
      dots[u * ld + r] = sum;
    }
  });
}

// The one table row every (row, key) pair of the tile clips to, or −1.
std::int64_t AttentionPlan::shaw_uniform_row(const RowBlock& rb, std::int64_t keys, const std::int64_t* kpos) const {
  std::int64_t k_min = kpos[0], k_max = kpos[0];
  for (std::int64_t j = 1; j < keys; ++j) {
    k_min = std::min(k_min, kpos[j]);
    k_max = std::max(k_max, kpos[j]);
  }
  std::int64_t uniform = -2;  // −2: no Shaw row seen yet
  for (std::int64_t r = 0; r < rb.width; ++r) {
    const std::int64_t h = rb.head[static_cast<std::size_t>(r)];
    const ShawTables* t = h < 0 ? nullptr : shaw_of_head(h);
    if (t == nullptr) continue;
    const std::int64_t qp = rb.position[static_cast<std::size_t>(r)];
    const std::int64_t lo = t->row_of(k_min - qp), hi = t->row_of(k_max - qp);
    if (lo != hi || (uniform != -2 && lo != uniform)) return -1;
    uniform = lo;
  }
  return uniform < 0 ? -1 : uniform;
}

// st[j][r] += dots[row(k_j − q_r)][r].
void AttentionPlan::shaw_add_rows(const RowBlock& rb, std::int64_t keys, const std::int64_t* kpos, const float* dots,
                                  std::int64_t ld, float* st) const {
  const std::int64_t w = rb.width, u0 = shaw_uniform_row(rb, keys, kpos);
  if (u0 >= 0) {
    const float* d = dots + u0 * ld;
    for (std::int64_t j = 0; j < keys; ++j) {
      float* row = st + j * w;
      for (std::int64_t r = 0; r < w; ++r) row[r] += d[r];
    }
    return;
  }
  for_each_shaw_row(*this, rb, [&](std::int64_t r, const ShawTables& t, std::int64_t qp) {
    for (std::int64_t j = 0; j < keys; ++j) st[j * w + r] += dots[t.row_of(kpos[j] - qp) * ld + r];
  });
}

// sums[row(k_j − q_r)][r] += pt[j][r] over the tile's keys, after scaling every sum of row r by
// corr[r] when given (the online softmax's rescaling of what came before).
void AttentionPlan::shaw_collect(const RowBlock& rb, std::int64_t keys, const std::int64_t* kpos, const float* pt,
                                 const float* corr, float* sums, std::int64_t ld) const {
  const std::int64_t w = rb.width;
  if (corr != nullptr) {
    bool rescale = false;
    for (std::int64_t r = 0; r < w && !rescale; ++r) rescale = corr[r] != 1.0f;
    if (rescale) {
      for (std::int64_t u = 0; u < shaw_width; ++u) {
        float* row = sums + u * ld;
        for (std::int64_t r = 0; r < w; ++r) row[r] *= corr[r];
      }
    }
  }
  const std::int64_t u0 = shaw_uniform_row(rb, keys, kpos);
  if (u0 >= 0) {
    float* row = sums + u0 * ld;
    for (std::int64_t j = 0; j < keys; ++j) {
      const float* p = pt + j * w;
      for (std::int64_t r = 0; r < w; ++r) row[r] += p[r];
    }
    return;
  }
  for_each_shaw_row(*this, rb, [&](std::int64_t r, const ShawTables& t, std::int64_t qp) {
    for (std::int64_t j = 0; j < keys; ++j) sums[t.row_of(kpos[j] - qp) * ld + r] += pt[j * w + r];
  });
}

// o_r += Σ_u probs[u][r]·a^V[u] (unnormalised, as o): a matrix product for a block of one group.
void AttentionPlan::shaw_add_values(const RowBlock& rb, const float* probs, std::int64_t ld, float* o) const {
  if (const ShawTables* t = shaw_of_block(rb); t != nullptr) {
    kernels::attn_gemm(probs, 1, ld, t->value.data(), dim_padded, o, dim_padded, rb.width, dim_padded, t->width, true);
    return;
  }
  for_each_shaw_row(*this, rb, [&](std::int64_t r, const ShawTables& t, std::int64_t /* q_position */) {
    float* row = o + r * dim_padded;
    for (std::int64_t u = 0; u < t.width; ++u) {
      const float p = probs[u * ld + r];
      if (p == 0.0f) continue;
      const float* a = t.value.data() + u * dim_padded;
      for (std::int64_t e = 0; e < dim; ++e) row[e] += p * a[e];
    }
  });
}

// ─── Transformer-XL's position terms ─────────────────────────────────────────────────────────
// Qs·P_h(δ) for a window of δ is one matrix product per head's run of rows (P's rows are
// consecutive δ); a tile then picks dots[δ(r, j) − lo][r] for every (row, key), and backward
// sums dS the same way before two more products (dQs += sumsᵀ·P, dP += sums·Qs).

// The δ range the XL rows of the block meet against keys kpos[0..keys), within the table.
bool AttentionPlan::xl_tile_range(const RowBlock& rb, std::int64_t keys, const std::int64_t* kpos, std::int64_t* lo,
                                  std::int64_t* hi) const {
  std::int64_t q_lo = std::numeric_limits<std::int64_t>::max(), q_hi = std::numeric_limits<std::int64_t>::min();
  for (std::int64_t r = 0; r < rb.width; ++r) {
    const std::int64_t h = rb.head[static_cast<std::size_t>(r)];
    if (h < 0 || xl_of_head(h) == nullptr) continue;
    q_lo = std::min(q_lo, rb.position[static_cast<std::size_t>(r)]);
    q_hi = std::max(q_hi, rb.position[static_cast<std::size_t>(r)]);
  }
  if (q_lo > q_hi || keys == 0) return false;
  const auto [k_lo, k_hi] = std::minmax_element(kpos, kpos + keys);
  *lo = std::max(q_lo - *k_hi, xl_delta_min);
  *hi = std::min(q_hi - *k_lo, xl_delta_min + xl_width - 1);
  return *lo <= *hi;
}

// Calls fn(first row, rows, head) for each run of lane chunks whose rows belong to one head that
// `has` the scheme (non-compact layouts pad every head's rows to whole lane chunks).
template <class Has, class Fn>
void for_each_head_run(const RowBlock& rb, Has&& has, Fn&& fn) {
  const auto chunk_head = [&](std::int64_t c) {
    for (std::int64_t t = 0; t < kAttnAlign; ++t) {
      const std::int64_t h = rb.head[static_cast<std::size_t>(c * kAttnAlign + t)];
      if (h >= 0) return has(h) ? h : std::int64_t{-1};
    }
    return std::int64_t{-1};
  };
  const std::int64_t chunks = rb.width / kAttnAlign;
  for (std::int64_t c = 0; c < chunks;) {
    const std::int64_t h = chunk_head(c);
    std::int64_t e = c + 1;
    while (h >= 0 && e < chunks && chunk_head(e) == h) ++e;
    if (h >= 0) fn(c * kAttnAlign, (e - c) * kAttnAlign, h);
    c = e;
  }
}
template <class Fn>
void for_each_xl_run(const AttentionPlan& p, const RowBlock& rb, Fn&& fn) {
  for_each_head_run(
      rb, [&](std::int64_t h) { return p.xl_of_head(h) != nullptr; }, fn);
}
template <class Fn>
void for_each_tupe_run(const AttentionPlan& p, const RowBlock& rb, Fn&& fn) {
  for_each_head_run(
      rb, [&](std::int64_t h) { return p.tupe_of_head(h) != nullptr; }, fn);
}

// dots[u][r] = Qs_r·P_h(lo + u) + c_h(lo + u) for u < span; rows_t: Qs transposed, [d][r].
void AttentionPlan::xl_window(const RowBlock& rb, const float* rows_t, std::int64_t ld_t, std::int64_t lo,
                              std::int64_t span, float* dots, std::int64_t ld) const {
  for_each_xl_run(*this, rb, [&](std::int64_t r0, std::int64_t n, std::int64_t h) {
    const XlTables& t = *xl_of_head(h);
    const std::int64_t lh = xl_local_head(h), t0 = lo - xl_delta_min;
    kernels::attn_gemm(t.p_row(t0, lh, dim_padded), dim_padded, 1, rows_t + r0, ld_t, dots + r0, ld, span, n, dim,
                       false);
    const float* c = t.constant.data() + lh * xl_width + t0;
    for (std::int64_t u = 0; u < span; ++u) {
      float* row = dots + u * ld + r0;
      for (std::int64_t r = 0; r < n; ++r) row[r] += c[u];
    }
  });
}

// Calls fn(tile index j·w + r, window index u·ld + r) for every pair of an XL row r and key j
// whose δ falls in the window [lo, lo + span) (pairs outside it are masked ones).
template <class Fn>
void for_each_xl_pair(const AttentionPlan& p, const RowBlock& rb, std::int64_t keys, const std::int64_t* kpos,
                      std::int64_t lo, std::int64_t span, std::int64_t ld, Fn&& fn) {
  const std::int64_t w = rb.width;
  for (std::int64_t r = 0; r < w; ++r) {
    const std::int64_t h = rb.head[static_cast<std::size_t>(r)];
    if (h < 0 || p.xl_of_head(h) == nullptr) continue;
    const std::int64_t base = rb.position[static_cast<std::size_t>(r)] - lo;
    for (std::int64_t j = 0; j < keys; ++j) {
      const std::int64_t u = base - kpos[j];
      if (u >= 0 && u < span) fn(j * w + r, u * ld + r);
    }
  }
}

// The XL pairs of a block by lane chunks, through the gather kernels: fn(chunk's first row, its
// lanes' bases, the keys' offsets), u = base[t] − offset[j], both relative to the tile's first key
// position, in int32. Returns false before running any chunk when a value would not fit; the caller
// then takes the scalar walk. Bases and offsets stay within the table's δ span (< 2^26 under its
// 2 GiB cap) plus a row block and a key tile, so in practice only a window·row-block product past
// 2^30 — small D, G = 1 and a table near the cap, which no test builds — takes the walk.
template <class Fn>
bool for_each_xl_chunk(const AttentionPlan& p, const RowBlock& rb, std::int64_t keys, const std::int64_t* kpos,
                       std::int64_t lo, std::int64_t span, std::int64_t ld, Fn&& fn) {
  constexpr std::int64_t kLimit = std::int64_t{1} << 30, kMaxKeys = 256;
  constexpr std::int32_t kNever = -(std::int32_t{1} << 30);  // u = kNever − offset < 0 for every key
  if (keys == 0) return true;
  if (keys > kMaxKeys || span * ld + kAttnAlign >= kLimit) return false;
  const std::int64_t k_ref = *std::min_element(kpos, kpos + keys);
  std::array<std::int32_t, kMaxKeys> offset{};
  for (std::int64_t j = 0; j < keys; ++j) {
    if (kpos[j] - k_ref >= kLimit) return false;
    offset[static_cast<std::size_t>(j)] = static_cast<std::int32_t>(kpos[j] - k_ref);
  }
  const auto base_of = [&](std::int64_t r) -> std::int64_t {
    const std::int64_t h = rb.head[static_cast<std::size_t>(r)];
    if (h < 0 || p.xl_of_head(h) == nullptr) return kNever;
    return rb.position[static_cast<std::size_t>(r)] - lo - k_ref;
  };
  for (std::int64_t r = 0; r < rb.width; ++r) {
    const std::int64_t b = base_of(r);
    if (b != kNever && (b <= kNever || b >= kLimit)) return false;
  }
  std::array<std::int32_t, kAttnAlign> base{};
  for (std::int64_t c = 0; c < rb.width; c += kAttnAlign) {
    bool any = false;
    for (std::int64_t t = 0; t < kAttnAlign; ++t) {
      const std::int64_t b = base_of(c + t);
      base[static_cast<std::size_t>(t)] = static_cast<std::int32_t>(b);
      any = any || b != kNever;
    }
    if (any) fn(c, base.data(), offset.data());
  }
  return true;
}

// st[j][r] += dots[δ(r, j) − lo][r] for the XL rows.
void AttentionPlan::xl_add_rows(const RowBlock& rb, std::int64_t keys, const std::int64_t* kpos, std::int64_t lo,
                                std::int64_t span, const float* dots, std::int64_t ld, float* st) const {
  const std::int64_t w = rb.width;
  if (for_each_xl_chunk(*this, rb, keys, kpos, lo, span, ld,
                        [&](std::int64_t c, const std::int32_t* base, const std::int32_t* offset) {
                          kernels::attn_xl_add(st + c, keys, w, dots + c, ld, span, base, offset);
                        })) {
    return;
  }
  for_each_xl_pair(*this, rb, keys, kpos, lo, span, ld,
                   [&](std::int64_t at, std::int64_t from) { st[at] += dots[from]; });
}

// sums[δ(r, j) − lo][r] += dst[j][r] (the transpose of xl_add_rows).
void AttentionPlan::xl_collect(const RowBlock& rb, std::int64_t keys, const std::int64_t* kpos, std::int64_t lo,
                               std::int64_t span, const float* dst, float* sums, std::int64_t ld) const {
  const std::int64_t w = rb.width;
  if (for_each_xl_chunk(*this, rb, keys, kpos, lo, span, ld,
                        [&](std::int64_t c, const std::int32_t* base, const std::int32_t* offset) {
                          kernels::attn_xl_collect(dst + c, keys, w, sums + c, ld, span, base, offset);
                        })) {
    return;
  }
  for_each_xl_pair(*this, rb, keys, kpos, lo, span, ld,
                   [&](std::int64_t from, std::int64_t at) { sums[at] += dst[from]; });
}

// Decode rows (few): st[j][r] += Qs_r·P_h(δ) + c_h(δ), a dot product per pair.
void AttentionPlan::xl_add_direct(const RowBlock& rb, std::int64_t keys, const std::int64_t* kpos, const float* q_rows,
                                  float* st) const {
  const std::int64_t w = rb.width;
  for (std::int64_t r = 0; r < w; ++r) {
    const std::int64_t h = rb.head[static_cast<std::size_t>(r)];
    const XlTables* t = h < 0 ? nullptr : xl_of_head(h);
    if (t == nullptr) continue;
    const std::int64_t lh = xl_local_head(h), qp = rb.position[static_cast<std::size_t>(r)];
    const float* q = q_rows + r * dim_padded;
    for (std::int64_t j = 0; j < keys; ++j) {
      const std::int64_t u = qp - kpos[j] - xl_delta_min;
      if (u < 0 || u >= xl_width) continue;  // outside every visible pair's δ: masked
      const float* pr = t->p_row(u, lh, dim_padded);
      float sum = t->constant[static_cast<std::size_t>(lh * xl_width + u)];
      for (std::int64_t e = 0; e < dim; ++e) sum += q[e] * pr[e];
      st[j * w + r] += sum;
    }
  }
}

// ─── TUPE ────────────────────────────────────────────────────────────────────────────────────
// Its bias is a product of per-position projections, PQ_i·PK_j: a second matrix product per tile
// and head run (keys' PK rows straight from the table when their positions are consecutive),
// and in backward two more (dPQ += dS·PK, dPK = dSᵀ·PQ), like the content products.

// PQ of the block's rows: transposed [Dp][padded_stride(w)] (tile products; the padding keeps
// the columns of a long unit off one L1 set, as for qt) and, as_rows, [w][Dp]. Blocks of 16 rows,
// so that each write of the transpose fills a cache line.
void AttentionPlan::tupe_load_rows(const RowBlock& rb, AttentionUnitScratch& s, bool as_rows) const {
  const std::int64_t w = rb.width, dp = dim_padded, ld = padded_stride(w);
  grow(s.tupe_pqt, dp * ld);
  if (as_rows) grow(s.tupe_pq, w * dp);
  constexpr std::int64_t kBlock = 16;
  std::array<const float*, kBlock> rows{};
  for (std::int64_t r0 = 0; r0 < w; r0 += kBlock) {
    const std::int64_t n = std::min(kBlock, w - r0);
    for (std::int64_t r = 0; r < n; ++r) {
      const std::int64_t h = rb.head[static_cast<std::size_t>(r0 + r)];
      const TupeTables* t = h < 0 ? nullptr : tupe_of_head(h);
      rows[static_cast<std::size_t>(r)] =
          t == nullptr ? nullptr : tupe_row(*t, true, rb.position[static_cast<std::size_t>(r0 + r)], h);
    }
    for (std::int64_t d = 0; d < dp; ++d) {
      float* to = s.tupe_pqt.data() + d * ld + r0;
      for (std::int64_t r = 0; r < n; ++r) {
        const float* row = rows[static_cast<std::size_t>(r)];
        to[r] = row == nullptr ? 0.0f : row[d];
      }
    }
    if (!as_rows) continue;
    for (std::int64_t r = 0; r < n; ++r) {
      const float* row = rows[static_cast<std::size_t>(r)];
      float* to = s.tupe_pq.data() + (r0 + r) * dp;
      if (row == nullptr) {
        std::fill(to, to + dp, 0.0f);
      } else {
        std::copy(row, row + dp, to);
      }
    }
  }
}

namespace {
// The keys' PK rows of head h: a view into the table when their positions are consecutive, else
// gathered into s.tupe_pk.
const float* tupe_keys(const AttentionPlan& p, const TupeTables& t, std::int64_t h, std::int64_t keys,
                       const std::int64_t* kpos, AttentionUnitScratch& s, std::int64_t* ld) {
  bool consecutive = true;
  for (std::int64_t j = 1; j < keys && consecutive; ++j) consecutive = kpos[j] == kpos[0] + j;
  if (consecutive) {
    *ld = p.dim_padded;
    return p.tupe_row(t, false, kpos[0], h);
  }
  grow(s.tupe_pk, keys * p.dim_padded);
  for (std::int64_t j = 0; j < keys; ++j) {
    std::memcpy(s.tupe_pk.data() + j * p.dim_padded, p.tupe_row(t, false, kpos[j], h),
                static_cast<std::size_t>(p.dim_padded) * sizeof(float));
  }
  *ld = p.dim_padded;
  return s.tupe_pk.data();
}
}  // namespace

// S^T[j][r] += PK_j·PQ_r (PQ^T columns r0 + r of s.tupe_pqt, ld_rows apart), and the [CLS] values.
void AttentionPlan::tupe_add_tile(const RowBlock& rb, std::int64_t r0, std::int64_t ld_rows, std::int64_t keys,
                                  const std::int64_t* kpos, AttentionUnitScratch& s, float* st) const {
  const std::int64_t w = rb.width;
  for_each_tupe_run(*this, rb, [&](std::int64_t ra, std::int64_t n, std::int64_t h) {
    const TupeTables& t = *tupe_of_head(h);
    std::int64_t ldpk = 0;
    const float* pk = tupe_keys(*this, t, h, keys, kpos, s, &ldpk);
    kernels::attn_gemm(pk, ldpk, 1, s.tupe_pqt.data() + r0 + ra, ld_rows, st + ra, w, keys, n, dim, true);
    if (!t.cls_reset) return;
    const std::int64_t lh = h - group_first_head[static_cast<std::size_t>(head_group[static_cast<std::size_t>(h)])];
    const float theta1 = t.theta1[static_cast<std::size_t>(lh)], theta2 = t.theta2[static_cast<std::size_t>(lh)];
    for (std::int64_t r = ra; r < ra + n; ++r) {
      if (rb.head[static_cast<std::size_t>(r)] != h) continue;
      const bool cls_query = rb.position[static_cast<std::size_t>(r)] == 0;
      for (std::int64_t j = 0; j < keys; ++j) {
        if (cls_query) {
          st[j * w + r] += theta1;
        } else if (kpos[j] == 0) {
          st[j * w + r] += theta2;
        }
      }
    }
  });
}

// Decode rows: st[j][r] += b(h, q, k_j) by dot products (pq_rows: [rows][Dp]).
void AttentionPlan::tupe_add_direct(const RowBlock& rb, std::int64_t keys, const std::int64_t* kpos,
                                    const float* pq_rows, float* st) const {
  const std::int64_t w = rb.width;
  for (std::int64_t r = 0; r < w; ++r) {
    const std::int64_t h = rb.head[static_cast<std::size_t>(r)];
    const TupeTables* t = h < 0 ? nullptr : tupe_of_head(h);
    if (t == nullptr) continue;
    const std::int64_t lh = h - group_first_head[static_cast<std::size_t>(head_group[static_cast<std::size_t>(h)])];
    const std::int64_t qp = rb.position[static_cast<std::size_t>(r)];
    const float* a = pq_rows + r * dim_padded;
    for (std::int64_t j = 0; j < keys; ++j) {
      float b;
      if (t->cls_reset && qp == 0) {
        b = t->theta1[static_cast<std::size_t>(lh)];
      } else if (t->cls_reset && kpos[j] == 0) {
        b = t->theta2[static_cast<std::size_t>(lh)];
      } else {
        const float* c = tupe_row(*t, false, kpos[j], h);
        b = 0;
        for (std::int64_t e = 0; e < dim; ++e) b += a[e] * c[e];
      }
      st[j * w + r] += b;
    }
  }
}

// Backward of one (tile, row block), dS^T in s.dpt: dPQ rows += dS·PK; the tile's dPK = dSᵀ·PQ
// into the unit's table by key position; the [CLS] values' sums (fp64).
void AttentionPlan::tupe_backward_tile(const RowBlock& sub, std::int64_t r0, std::int64_t keys,
                                       const std::int64_t* kpos, std::int64_t kvh, double* unit_tupe_grads,
                                       AttentionUnitScratch& s) const {
  // dS reaches only TUPE's parameters (its term does not depend on q or k): nothing to do without them.
  if (unit_tupe_grads == nullptr) return;
  const std::int64_t bw = sub.width, dp = dim_padded;
  for_each_tupe_run(*this, sub, [&](std::int64_t ra, std::int64_t n, std::int64_t h) {
    const TupeTables& t = *tupe_of_head(h);
    std::int64_t ldpk = 0;
    const float* pk = tupe_keys(*this, t, h, keys, kpos, s, &ldpk);
    kernels::attn_gemm(s.dpt.data() + ra, 1, bw, pk, ldpk, s.tupe_dpq.data() + (r0 + ra) * dp, dp, n, dp, keys, true);
    const std::int64_t g = h - kvh * group_size;
    grow(s.tupe_dpk, keys * dp);
    kernels::attn_gemm(s.dpt.data() + ra, bw, 1, s.tupe_pq.data() + (r0 + ra) * dp, dp, s.tupe_dpk.data(), dp, keys, dp,
                       n, false);
    for (std::int64_t j = 0; j < keys; ++j) {
      if (t.cls_reset && kpos[j] == 0) continue;  // the [CLS] key's projection is not used
      float* to = s.tupe_dpk_positions.data() + ((kpos[j] - tupe_first) * group_size + g) * dp;
      const float* from = s.tupe_dpk.data() + j * dp;
      for (std::int64_t d = 0; d < dp; ++d) to[d] += from[d];
    }
    if (!t.cls_reset) return;
    double* theta = unit_tupe_grads + 2 * tupe_count * group_size * dp;
    for (std::int64_t r = ra; r < ra + n; ++r) {
      if (sub.head[static_cast<std::size_t>(r)] != h) continue;
      const bool cls_query = sub.position[static_cast<std::size_t>(r)] == 0;
      for (std::int64_t j = 0; j < keys; ++j) {
        const double ds = s.dpt[static_cast<std::size_t>(j * bw + r)];
        if (cls_query) {
          theta[g] += ds;
        } else if (kpos[j] == 0) {
          theta[group_size + g] += ds;
        }
      }
    }
  });
}

}  // namespace detail

// ─── Forward ─────────────────────────────────────────────────────────────────────────────────

namespace {

using detail::AttentionPlan;
using detail::RowBlock;
using detail::Sequence;

void prefetch_rows(const AttentionPlan& p, const Sequence& seq, std::int64_t kvh, std::int64_t first,
                   std::int64_t count) {
  const std::int64_t width = static_cast<std::int64_t>(dtype_size(p.dtype));
  const std::int64_t row_bytes = (p.dim - 1) * width * p.kg.dim_stride + width;
  for (std::int64_t j = 0; j < count; ++j) {
    const char* k =
        static_cast<const char*>(p.k_data) + (p.kg.offset(seq.b, seq.k0 + first + j) + kvh * p.kg.head_stride) * width;
    const char* v =
        static_cast<const char*>(p.v_data) + (p.vg.offset(seq.b, seq.k0 + first + j) + kvh * p.vg.head_stride) * width;
    // Into L2 (prefetcht1): a tile's keys and values are 64 KiB at D = 128, more than L1, where
    // they would evict the block's working rows. perf, 1 thread, S 2048, three alternating pairs:
    // prefetch_rows' samples fell from 331–397 to 234–293; the totals moved within the noise.
    for (std::int64_t at = 0; at < row_bytes; at += 64) {
      __builtin_prefetch(k + at, 0, 2);
      __builtin_prefetch(v + at, 0, 2);
    }
  }
}

// One forward block in steps: forward_begin loads the rows of `rb`; block_tile runs one key
// tile [k0, k0 + keys) of the sequence through them (forward_blocks drives both). Leaves the unnormalised output rows
// in s.o ([width][Dp]) and m, l per row.
void forward_begin(const AttentionPlan& p, const Sequence& seq, const RowBlock& rb, AttentionUnitScratch& s) {
  const std::int64_t w = rb.width, dp = p.dim_padded, d = p.dim;
  const bool dot = rb.compact;
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
      p.add_xl_u(h, row);
      for (std::int64_t t = 0; t < d; ++t) row[t] *= p.scale;
    }
    if (!dot) {
      for (std::int64_t t = 0; t < d; ++t) s.qt[static_cast<std::size_t>(t * ldt + r)] = row[t];
    }
  }
  if (p.any_shaw) {
    grow(s.shaw_key_dots, w * p.shaw_width);
    grow(s.shaw_probs, w * p.shaw_width);
    std::fill(s.shaw_probs.begin(), s.shaw_probs.begin() + w * p.shaw_width, 0.0f);
    p.shaw_row_dots(rb, s.q.data(), dp, dot ? nullptr : s.qt.data(), ldt, false, s.shaw_key_dots.data(), w);
  }
  s.xl_span = 0;  // no XL window yet
  if (p.any_tupe) p.tupe_load_rows(rb, s, dot);
}

// Transformer-XL in a forward tile (prefill blocks; decode adds its rows' dots directly in
// decode_tiles): a block keeps a window of its rows' dots over kXlWindow δ values, moved down as
// the tiles advance (δ = q − k falls).
void forward_xl(const AttentionPlan& p, const RowBlock& rb, std::int64_t keys, AttentionUnitScratch& s) {
  // Window length: the matrix product over a window re-does the rows' dots for the δ where two
  // windows overlap (at most a tile plus a block of rows), so a window of 1024 δ wastes at most
  // ~20% over computing each dot once, for 1024 × rows floats (512 KiB at 128 rows) of scratch.
  constexpr std::int64_t kXlWindow = 1024;
  const std::int64_t w = rb.width;
  std::int64_t lo = 0, hi = 0;
  if (!p.xl_tile_range(rb, keys, s.kpos.data(), &lo, &hi)) return;
  if (s.xl_span == 0 || lo < s.xl_lo || hi >= s.xl_lo + s.xl_span) {
    s.xl_lo = std::max(p.xl_delta_min, std::min(lo, hi - kXlWindow + 1));
    s.xl_span = hi - s.xl_lo + 1;
    grow(s.xl_dots, s.xl_span * w);
    p.xl_window(rb, s.qt.data(), padded_stride(w), s.xl_lo, s.xl_span, s.xl_dots.data(), w);
  }
  p.xl_add_rows(rb, keys, s.kpos.data(), s.xl_lo, s.xl_span, s.xl_dots.data(), w, s.st.data());
}

// A key tile's keys and values as the matrix kernel reads them: rows ld floats apart.
struct TileRows {
  const float *k = nullptr, *v = nullptr;
  std::int64_t ldk = 0, ldv = 0;
};

// Keys: straight from memory (f32, unit stride, D a multiple of the padding, no key transform)
// or packed into f32 rows (s.k). Values: always packed (s.v; see padded_stride — keys, the
// broadcast operand, do not gain from it).
TileRows load_tile(const AttentionPlan& p, const Sequence& seq, std::int64_t kvh, std::int64_t k0, std::int64_t keys,
                   AttentionUnitScratch& s) {
  const std::int64_t dp = p.dim_padded;
  const detail::QKTables& kt = p.tables_of_head(kvh * p.group_size);
  TileRows rows;
  if (p.zero_copy && (kt.kind == detail::QKTables::kNone || !kt.transform_keys)) {
    rows.k = static_cast<const float*>(p.k_data) + p.kg.offset(seq.b, seq.k0 + k0) + kvh * p.kg.head_stride;
    rows.ldk = p.kg.seq_stride;
  } else {
    rows.ldk = padded_stride(dp);
    for (std::int64_t j = 0; j < keys; ++j) {
      float* row = s.k.data() + j * rows.ldk;
      p.load_row(p.k_data, p.kg, seq.b, seq.k0 + k0 + j, kvh, row);
      if (kt.transform_keys) p.transform_row(kt, false, p.k_table_row(seq, k0 + j), row, 1.0f);
    }
    rows.k = s.k.data();
  }
  rows.ldv = padded_stride(dp);
  for (std::int64_t j = 0; j < keys; ++j)
    p.load_row(p.v_data, p.vg, seq.b, seq.k0 + k0 + j, kvh, s.v.data() + j * rows.ldv);
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
  // S^T = K·Q^T (scale and query transform already in Q).
  kernels::attn_gemm(kp, ldk, 1, s.qt.data(), padded_stride(w), s.st.data(), w, keys, w, d, false);
  if (p.any_bias || p.any_shaw || p.any_xl || p.any_tupe) {
    for (std::int64_t j = 0; j < keys; ++j) s.kpos[static_cast<std::size_t>(j)] = p.k_position(seq, k0 + j);
  }
  if (p.any_tupe) p.tupe_add_tile(rb, 0, padded_stride(w), keys, s.kpos.data(), s, s.st.data());
  if (p.any_bias) p.add_bias(seq, rb, k0, keys, s.kpos.data(), s.st.data());
  if (p.any_shaw) p.shaw_add_rows(rb, keys, s.kpos.data(), s.shaw_key_dots.data(), w, s.st.data());
  if (p.any_xl) forward_xl(p, rb, keys, s);
  if (p.mask.softcap > 0) kernels::attn_softcap_tile(s.st.data(), keys, w, static_cast<float>(p.mask.softcap));
  if (!p.tile_unmasked(rb, k0, keys)) {
    kernels::attn_mask_tile(s.st.data(), keys, w, k0, rb.lo.data(), rb.hi.data());
  }
  kernels::attn_softmax_tile(s.st.data(), keys, w, s.m.data(), s.l.data(), s.corr.data());
  kernels::attn_scale_rows(s.o.data(), dp, w, dp, s.corr.data());
  // O += P·V with P(r, j) = P^T[j][r], the tile's sum added to O once (attn_gemm_add).
  kernels::attn_gemm_add(s.st.data(), 1, w, vp, ldv, s.o.data(), dp, w, dp, keys);
  if (p.any_shaw) p.shaw_collect(rb, keys, s.kpos.data(), s.st.data(), s.corr.data(), s.shaw_probs.data(), w);
}

// The far-tile skip in forward: tile_vanishes against the rows' running maxima; the keys' norms
// read from the inputs.
bool far_tile_vanishes(const AttentionPlan& p, const Sequence& seq, std::int64_t kvh, const RowBlock& rb,
                       std::int64_t k0, std::int64_t keys, AttentionUnitScratch& s) {
  std::int64_t k_lo = std::numeric_limits<std::int64_t>::max(), k_hi = std::numeric_limits<std::int64_t>::min();
  for (std::int64_t j = 0; j < keys; ++j) {
    const std::int64_t kp = p.k_position(seq, k0 + j);
    k_lo = std::min(k_lo, kp);
    k_hi = std::max(k_hi, kp);
  }
  return detail::tile_vanishes(p, rb, s.row_norm.data(), s.m.data(), k_lo, k_hi, [&] {
    grow(s.tmp, p.dim_padded);
    double largest = 0;
    for (std::int64_t j = 0; j < keys; ++j) {
      p.load_row(p.k_data, p.kg, seq.b, seq.k0 + k0 + j, kvh, s.tmp.data());
      largest = detail::max_or_nan(largest, detail::row_norms(s.tmp.data(), 0, 1, p.dim, nullptr));
    }
    return largest;
  });
}

// At most this many consecutive query blocks of one KV head share their key tiles (a group).
constexpr std::size_t kMaxGroupBlocks = 4;

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
                            std::span<const RowBlock* const> blocks, std::span<AttentionUnitScratch* const> scratch) {
  constexpr std::size_t kMaxBlocks = kMaxGroupBlocks;
  const std::size_t n = blocks.size();
  const std::int64_t kt = p.key_tile, kb = blocks[0]->key_lo;
  std::array<std::int64_t, kMaxBlocks> ends{}, tiles{};
  std::int64_t ke = kb;
  for (std::size_t b = 0; b < n; ++b) {
    forward_begin(p, seq, *blocks[b], *scratch[b]);
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
    }
  }
  const std::int64_t all_tiles = (ke - kb + kt - 1) / kt;
  std::int64_t skipped = 0;
  for (std::int64_t i = 0; i < all_tiles; ++i) {
    const std::int64_t t = descending ? all_tiles - 1 - i : i, k0 = kb + t * kt;
    std::array<bool, kMaxBlocks> run{};
    bool any = false;
    for (std::size_t b = 0; b < n; ++b) {
      if (t >= tiles[b]) continue;
      run[b] = !(skip_far && t < tiles[b] - 1 &&
                 far_tile_vanishes(p, seq, kvh, *blocks[b], k0, std::min(kt, ends[b] - k0), *scratch[b]));
      skipped += run[b] ? 0 : 1;
      any = any || run[b];
    }
    if (!any) continue;
    // The next tile's key and value rows: in [B, S, G, D] memory consecutive keys of one head
    // lie G·D elements apart, often a page, which the hardware prefetchers do not cross.
    const std::int64_t next = descending ? k0 - kt : k0 + kt;
    if (next >= kb && next < ke) prefetch_rows(p, seq, kvh, next, std::min(kt, ke - next));
    const TileRows kv = load_tile(p, seq, kvh, k0, std::min(kt, ke - k0), *scratch[0]);
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

}  // namespace

namespace detail {

void AttentionPlan::forward(TensorView out, TensorView lse) const {
  const HeadsGrid og = check_output_tokens(kWhere, "out", ConstTensorView(out), qg);
  check_dtype(kWhere, "out", out.dtype(), dtype);
  check_writable(kWhere, "out", ConstTensorView(out));
  const bool want_lse = lse.rank() > 0;
  if (want_lse) check_lse(lse, true);
  // Units: (sequence, KV head, query block) for prefill; decode blocks (few rows) run every KV
  // head per key tile — reading the cache in its memory order — in chunks of keys:
  // (sequence, query block, key chunk), kvh = −1.
  struct Unit {
    std::int64_t seq, kvh, i0, count, k_begin, k_end, partial;
    bool compact;
  };
  std::vector<Unit> units;
  std::int64_t partials = 0;
  // Prefill units of a group of query blocks (forward_blocks): the largest group of 4, 2 or 1 that
  // leaves at least 8 units per thread (the dynamic schedule balances causal units, whose cost
  // grows with their queries, only with several units per thread).
  std::int64_t prefill_blocks = 0;
  for (const Sequence& seq : sequences) {
    if (seq.lq * group_size > kDecodeRows) prefill_blocks += kv_heads * ((seq.lq + query_block - 1) / query_block);
  }
  const auto flops = static_cast<std::int64_t>(batch) * q_len * k_len * heads * dim;
  // Grouping never changes a bit (see forward_blocks), so the rule may look at the thread count.
  std::int64_t group_blocks = static_cast<std::int64_t>(kMaxGroupBlocks);
  while (group_blocks > 1 && prefill_blocks < 8 * group_blocks * static_cast<std::int64_t>(threads_for(flops / 16)))
    group_blocks /= 2;
  const std::int64_t unit_queries = group_blocks * query_block;
  // Decode chunks: keys per chunk from the bytes of one key's keys and values.
  const std::int64_t bytes_chunk_keys = std::max(kDecodeMinChunkKeys, kDecodeChunkBytes / (2 * decode_key_row_bytes()));
  for (std::int64_t si = 0; si < static_cast<std::int64_t>(sequences.size()); ++si) {
    const Sequence& seq = sequences[static_cast<std::size_t>(si)];
    if (seq.lq == 0) continue;
    if (seq.lq * group_size <= kDecodeRows) {
      const std::int64_t chunk_keys = std::max(bytes_chunk_keys, (seq.lk + kDecodeMaxChunks - 1) / kDecodeMaxChunks);
      const std::int64_t chunks = seq.lk > chunk_keys ? (seq.lk + chunk_keys - 1) / chunk_keys : 1;
      for (std::int64_t c = 0; c < chunks; ++c) {
        const std::int64_t kb = chunks == 1 ? 0 : c * chunk_keys;
        const std::int64_t ke = chunks == 1 ? seq.lk : std::min(seq.lk, kb + chunk_keys);
        units.push_back({si, -1, 0, seq.lq, kb, ke, chunks == 1 ? -1 : partials, true});
        if (chunks > 1) ++partials;
      }
      continue;
    }
    for (std::int64_t kvh = 0; kvh < kv_heads; ++kvh) {
      for (std::int64_t i0 = 0; i0 < seq.lq; i0 += unit_queries) {
        units.push_back({si, kvh, i0, std::min(unit_queries, seq.lq - i0), 0, seq.lk, -1, false});
      }
    }
  }
  // Chunked decode units leave (m, l, O) rows per KV head here, merged in chunk order afterwards.
  const std::int64_t part_rows = kDecodeRows;
  const std::int64_t part_width = dim_padded + 2;
  std::vector<float> parts(static_cast<std::size_t>(partials * kv_heads * part_rows * part_width));
  const int threads = std::min<int>(threads_for(flops / 16), static_cast<int>(std::max<std::size_t>(units.size(), 1)));
  std::int64_t scratch_bytes = 0;
  // Normalises and stores the rows of a finished block.
  const auto finish = [&](const Sequence& seq, const RowBlock& rb, AttentionUnitScratch& s) {
    const std::int64_t dp = dim_padded;
    if (any_shaw) shaw_add_values(rb, s.shaw_probs.data(), rb.width, s.o.data());
    grow(s.tmp, dp);
    for (std::int64_t r = 0; r < rb.width; ++r) {
      const std::int64_t h = rb.head[static_cast<std::size_t>(r)];
      if (h < 0) continue;
      const std::int64_t i = rb.query[static_cast<std::size_t>(r)];
      const float l = s.l[static_cast<std::size_t>(r)];
      const float inv = l > 0 ? 1.0f / l : 0.0f;
      for (std::int64_t t = 0; t < dim; ++t)
        s.tmp[static_cast<std::size_t>(t)] = s.o[static_cast<std::size_t>(r * dp + t)] * inv;
      store_row(s.tmp.data(), out.data(), og, seq.b, seq.q0 + i, h, false);
      if (want_lse) write_lse(lse, seq, h, i, l > 0 ? s.m[static_cast<std::size_t>(r)] + std::log(l) : kNegInf);
    }
  };
  std::int64_t skipped_tiles = 0, prefill_tiles = 0;
#pragma omp parallel num_threads(threads) reduction(+ : scratch_bytes, skipped_tiles, prefill_tiles)
  {
    const FlushDenormals flush;
    AttentionUnitScratch& s = unit_scratch();
    thread_local std::vector<AttentionUnitScratch> per_head;  // decode: one per KV head
    thread_local std::vector<RowBlock> per_head_rows;
    std::array<RowBlock, kMaxGroupBlocks> group_rows;
    std::array<const RowBlock*, kMaxGroupBlocks> group{};
    std::array<AttentionUnitScratch*, kMaxGroupBlocks> group_scratches{&s};
    for (std::size_t b = 1; b < kMaxGroupBlocks; ++b) group_scratches[b] = &group_scratch()[b - 1];
#pragma omp for schedule(dynamic, 1)
    for (std::size_t u = 0; u < units.size(); ++u) {
      const Unit& un = units[u];
      const Sequence& seq = sequences[static_cast<std::size_t>(un.seq)];
      if (!un.compact) {
        const auto n = static_cast<std::size_t>((un.count + query_block - 1) / query_block);
        bool same_start = true;
        for (std::size_t b = 0; b < n; ++b) {
          const std::int64_t i0 = un.i0 + static_cast<std::int64_t>(b) * query_block;
          layout_rows(seq, un.kvh, i0, std::min(query_block, un.i0 + un.count - i0), false, group_rows[b]);
          group[b] = &group_rows[b];
          same_start = same_start && group_rows[b].key_lo == group_rows[0].key_lo;
        }
        const auto count_tiles = [&](const RowBlock& block) {
          prefill_tiles += (std::max(block.key_hi, block.key_lo) - block.key_lo + key_tile - 1) / key_tile;
        };
        if (same_start) {
          skipped_tiles +=
              forward_blocks(*this, seq, un.kvh, std::span(group.data(), n), std::span(group_scratches.data(), n));
          for (std::size_t b = 0; b < n; ++b) {
            count_tiles(*group[b]);
            finish(seq, *group[b], *group_scratches[b]);
          }
          continue;
        }
        // Blocks whose key ranges start apart (sliding windows): one at a time.
        for (std::size_t b = 0; b < n; ++b) {
          skipped_tiles +=
              forward_blocks(*this, seq, un.kvh, std::span(group.data() + b, 1), std::span(group_scratches.data(), 1));
          count_tiles(*group[b]);
          finish(seq, *group[b], s);
        }
        continue;
      }
      // Decode: one block of every KV head's rows (or, for Shaw, XL and TUPE, a block per KV head).
      const bool merged = decode_merges_heads();
      const std::int64_t blocks = merged ? 1 : kv_heads;
      if (static_cast<std::int64_t>(per_head.size()) < blocks) per_head.resize(static_cast<std::size_t>(blocks));
      if (static_cast<std::int64_t>(per_head_rows.size()) < blocks + 1) {
        per_head_rows.resize(static_cast<std::size_t>(blocks + 1));  // + layout_decode_rows' scratch
      }
      if (merged) {
        layout_decode_rows(seq, un.i0, un.count, per_head_rows[1], per_head_rows[0]);
        forward_begin(*this, seq, per_head_rows[0], per_head[0]);
      } else {
        for (std::int64_t kvh = 0; kvh < kv_heads; ++kvh) {
          layout_rows(seq, kvh, un.i0, un.count, true, per_head_rows[static_cast<std::size_t>(kvh)]);
          forward_begin(*this, seq, per_head_rows[static_cast<std::size_t>(kvh)],
                        per_head[static_cast<std::size_t>(kvh)]);
        }
      }
      const RowBlock& rows0 = per_head_rows[0];
      const std::int64_t kb = std::max(un.k_begin, un.partial >= 0 ? un.k_begin : rows0.key_lo);
      const std::int64_t ke = un.partial >= 0 ? un.k_end : std::min(un.k_end, std::max(rows0.key_hi, kb));
      const auto n_blocks = static_cast<std::size_t>(blocks);
      decode_tiles(seq, kb, ke, std::span<const RowBlock>(per_head_rows.data(), n_blocks),
                   std::span<AttentionUnitScratch>(per_head.data(), n_blocks), s);
      for (std::size_t b = 0; b < n_blocks; ++b) {
        const RowBlock& hr = per_head_rows[b];
        AttentionUnitScratch& hs = per_head[b];
        if (un.partial < 0) {
          finish(seq, hr, hs);
          continue;
        }
        if (any_shaw) shaw_add_values(hr, hs.shaw_probs.data(), hr.width, hs.o.data());
        // Rows of KV head kvh at parts[(partial · G + kvh) · part_rows + r].
        const std::int64_t per_kvh = merged ? hr.valid_rows / kv_heads : hr.valid_rows;
        for (std::int64_t r = 0; r < hr.valid_rows; ++r) {
          const std::int64_t kvh = merged ? r / per_kvh : static_cast<std::int64_t>(b);
          float* row = parts.data() + ((un.partial * kv_heads + kvh) * part_rows + r % per_kvh) * part_width;
          row[0] = hs.m[static_cast<std::size_t>(r)];
          row[1] = hs.l[static_cast<std::size_t>(r)];
          std::memcpy(row + 2, hs.o.data() + r * dim_padded, static_cast<std::size_t>(dim_padded) * sizeof(float));
        }
      }
    }
    scratch_bytes += s.bytes();
    for (const AttentionUnitScratch& gs : group_scratch()) scratch_bytes += gs.bytes();
    for (const auto& hs : per_head) scratch_bytes += hs.bytes();
  }
  // Merge the chunks of each decode block, in chunk order (fp64 sums; deterministic).
  RowBlock rb;
  std::vector<double> acc(static_cast<std::size_t>(dim));
  std::vector<float> row(static_cast<std::size_t>(dim));
  for (std::size_t u = 0; u < units.size();) {
    if (units[u].partial < 0) {
      ++u;
      continue;
    }
    std::size_t end = u;
    while (end < units.size() && units[end].partial >= 0 && units[end].seq == units[u].seq) ++end;
    const Sequence& seq = sequences[static_cast<std::size_t>(units[u].seq)];
    for (std::int64_t kvh = 0; kvh < kv_heads; ++kvh) {
      layout_rows(seq, kvh, units[u].i0, units[u].count, true, rb);
      for (std::int64_t r = 0; r < rb.valid_rows; ++r) {
        const auto part_row = [&](std::size_t c) {
          return parts.data() + ((units[c].partial * kv_heads + kvh) * part_rows + r) * part_width;
        };
        float m = kNegInf;
        for (std::size_t c = u; c < end; ++c) m = std::max(m, part_row(c)[0]);
        double l = 0;
        std::fill(acc.begin(), acc.end(), 0.0);
        if (m != kNegInf) {
          for (std::size_t c = u; c < end; ++c) {
            const float* pr = part_row(c);
            if (pr[0] == kNegInf) continue;
            const double f = std::exp(static_cast<double>(pr[0]) - m);
            l += f * pr[1];
            for (std::int64_t t = 0; t < dim; ++t) acc[static_cast<std::size_t>(t)] += f * pr[2 + t];
          }
        }
        for (std::int64_t t = 0; t < dim; ++t) {
          row[static_cast<std::size_t>(t)] = l > 0 ? static_cast<float>(acc[static_cast<std::size_t>(t)] / l) : 0.0f;
        }
        const std::int64_t h = rb.head[static_cast<std::size_t>(r)];
        const std::int64_t i = rb.query[static_cast<std::size_t>(r)];
        store_row(row.data(), out.data(), og, seq.b, seq.q0 + i, h, false);
        if (want_lse) write_lse(lse, seq, h, i, l > 0 ? static_cast<float>(m + std::log(l)) : kNegInf);
      }
    }
    u = end;
  }
  last_workspace_bytes = scratch_bytes + static_cast<std::int64_t>(parts.size() * sizeof(float)) + table_bytes();
  last_skipped_tiles = skipped_tiles;
  last_tiles = prefill_tiles;
}

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
  if (shared_rope != nullptr &&
      (shared_rope->kind != QKTables::kRope || !shared_rope->transform_keys || kg.dim_stride != 1)) {
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
  const bool direct_v = vg.dim_stride == 1 && reads_dtype;
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
                               grid.seq_stride, grid.head_stride, keys, g_count, dim, dst, dp);
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
    if (any_bias || any_shaw || any_xl || any_tupe) {
      for (std::int64_t j = 0; j < keys; ++j)
        blocks_scratch[0].kpos[static_cast<std::size_t>(j)] = k_position(seq, k0 + j);
    }
    for (std::size_t b = 0; b < rows.size(); ++b) {
      AttentionUnitScratch& hs = blocks_scratch[b];
      const RowBlock& rb = rows[b];
      if (any_tupe) tupe_add_direct(rb, keys, kpos, hs.tupe_pq.data(), hs.st.data());
      if (any_bias) add_bias(seq, rb, k0, keys, kpos, hs.st.data());
      if (any_shaw) shaw_add_rows(rb, keys, kpos, hs.shaw_key_dots.data(), w, hs.st.data());
      if (any_xl) xl_add_direct(rb, keys, kpos, hs.q.data(), hs.st.data());
      if (mask.softcap > 0) kernels::attn_softcap_tile(hs.st.data(), keys, w, static_cast<float>(mask.softcap));
      if (!tile_unmasked(rb, k0, keys)) kernels::attn_mask_tile(hs.st.data(), keys, w, k0, rb.lo.data(), rb.hi.data());
      kernels::attn_softmax_tile(hs.st.data(), keys, w, hs.m.data(), hs.l.data(), hs.corr.data());
      kernels::attn_scale_rows(hs.o.data(), dp, rb.valid_rows, dp, hs.corr.data());
      if (any_shaw) shaw_collect(rb, keys, kpos, hs.st.data(), hs.corr.data(), hs.shaw_probs.data(), w);
    }
    if (!direct_v) pack_tile(v_data, vg, k0, keys, s.v.data());
    kernels::attn_decode_values(vp, v_dtype, ldv, vhs, keys, g_count, p_heads.data(), w, valid, direct_v ? dim : dp,
                                o_heads.data(), dp, rows_ahead(k_data, kg, seq, k0 + keys, next_keys));
  }
}

// ─── Backward ────────────────────────────────────────────────────────────────────────────────

void AttentionPlan::backward(ConstTensorView out, ConstTensorView lse, ConstTensorView d_out, TensorView dq,
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
#pragma omp parallel num_threads(threads) reduction(+ : scratch_bytes, steps, skipped_steps)
  {
    const FlushDenormals flush;
    AttentionUnitScratch& s = unit_scratch();
    s.steps = s.skipped_steps = 0;
    RowBlock rb;
#pragma omp for schedule(dynamic, 1)
    for (std::size_t u = 0; u < units.size(); ++u) {
      const Sequence& seq = sequences[static_cast<std::size_t>(units[u].seq)];
      const std::int64_t kvh = units[u].kvh;
      backward_unit(seq, kvh, out, og, lse, d_out, dog, want_dq ? &dq : nullptr, dqg, want_dk ? &dk : nullptr, dkg,
                    want_dv ? &dv : nullptr, dvg,
                    want_bias_grads ? unit_grads.data() + u * static_cast<std::size_t>(grad_size) : nullptr,
                    shaw_size > 0 ? unit_shaw_grads.data() + u * static_cast<std::size_t>(shaw_size) : nullptr,
                    xl_size > 0 ? unit_xl_grads.data() + u * static_cast<std::size_t>(xl_size) : nullptr,
                    tupe_size > 0 ? unit_tupe_grads.data() + u * static_cast<std::size_t>(tupe_size) : nullptr,
                    units[u].i0, units[u].count, units[u].part >= 0 ? kv_parts.data() + units[u].part : nullptr,
                    units[u].key_lo, units[u].key_hi, s, rb);
    }
    scratch_bytes += s.bytes();
    steps += s.steps;
    skipped_steps += s.skipped_steps;
  }
  last_steps = steps;
  last_skipped_steps = skipped_steps;
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
  last_workspace_bytes = scratch_bytes + table_bytes() +
                         static_cast<std::int64_t>((unit_grads.size() + unit_shaw_grads.size() + unit_xl_grads.size() +
                                                    unit_tupe_grads.size()) *
                                                   sizeof(double)) +
                         static_cast<std::int64_t>(kv_parts.size() * sizeof(float));
}

void AttentionPlan::backward_unit(const Sequence& seq, std::int64_t kvh, ConstTensorView out, const HeadsGrid& og,
                                  ConstTensorView lse, ConstTensorView d_out, const HeadsGrid& dog, TensorView* dq,
                                  const HeadsGrid& dqg, TensorView* dk, const HeadsGrid& dkg, TensorView* dv,
                                  const HeadsGrid& dvg, double* unit_grads, double* unit_shaw_grads,
                                  double* unit_xl_grads, double* unit_tupe_grads, std::int64_t i0, std::int64_t count,
                                  float* kv_part, std::int64_t part_key_lo, std::int64_t part_key_hi,
                                  AttentionUnitScratch& s, RowBlock& rb) const {
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

}  // namespace detail

// ─── Public class ────────────────────────────────────────────────────────────────────────────

Attention::Attention(AttentionSpec spec) : plan_(std::make_unique<Plan>(std::move(spec))) {}
Attention::~Attention() = default;
Attention::Attention(Attention&&) noexcept = default;
Attention& Attention::operator=(Attention&&) noexcept = default;

std::int64_t Attention::batch() const { return plan_->batch; }
std::int64_t Attention::q_len() const { return plan_->q_len; }
std::int64_t Attention::k_len() const { return plan_->k_len; }
std::int64_t Attention::heads() const { return plan_->heads; }
std::int64_t Attention::kv_heads() const { return plan_->kv_heads; }
std::int64_t Attention::head_dim() const { return plan_->dim; }
const AttentionSpec& Attention::spec() const { return plan_->spec; }
AttentionGradients Attention::zero_gradients() const { return plan_->zero_gradients(); }
std::int64_t Attention::workspace_bytes() const { return plan_->last_workspace_bytes; }
Attention::TileCounts Attention::forward_tiles() const { return {plan_->last_tiles, plan_->last_skipped_tiles}; }
Attention::TileCounts Attention::backward_steps() const { return {plan_->last_steps, plan_->last_skipped_steps}; }

void Attention::forward(TensorView out, TensorView lse) const {
  detail::init_dispatch();
  if (detail::use_reference() || plan_->dtype == DType::kF64) {
    ref::attention_forward(*this, out, lse);
    plan_->last_tiles = plan_->last_skipped_tiles = 0;  // the reference runs every pair, no tiles
    return;
  }
  plan_->forward(out, lse);
}

void Attention::backward(ConstTensorView out, ConstTensorView lse, ConstTensorView d_out, TensorView dq, TensorView dk,
                         TensorView dv, AttentionGradients* grads) const {
  detail::init_dispatch();
  if (detail::use_reference() || plan_->dtype == DType::kF64) {
    ref::attention_backward(*this, out, lse, d_out, dq, dk, dv, grads);
    plan_->last_steps = plan_->last_skipped_steps = 0;  // the reference runs every pair, no steps
    return;
  }
  plan_->backward(out, lse, d_out, dq, dk, dv, grads);
}

}  // namespace posenc
