// The engine's query-dependent score terms: Shaw's relative key and value terms, Transformer-XL's
// position terms and TUPE's projections, forward and backward, over a block's rows.
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

}  // namespace posenc
