// SIMD kernels of the fused attention (Highway, dynamic dispatch; attention_kernels.cpp).
//
// The engine keeps score tiles transposed: S^T[j][r] for key j and query row r, rows contiguous
// (kRowAlign-padded), so the softmax runs down the keys with the rows in the vector lanes — no
// horizontal reductions, and no transposition of keys: S^T = K·Q^T takes keys as they lie in
// memory and the query block's transpose, packed once per block.
#pragma once

#include <cstdint>

#include "posenc/dtype.hpp"
#include "posenc/quantized.hpp"

namespace posenc::kernels {

// Row blocks (the vector dimension of score tiles) and head_dim columns are padded to this many
// floats: a multiple of every target's f32 lane count.
inline constexpr std::int64_t kAttnAlign = 16;

// Rows of K or V to pull into L2 (on Zen 5 non-temporally: docs/attention.md) while a decode
// kernel computes on other data: row (j, g) for j < keys, g < heads spans
// [base + j·ld + g·head_stride, + row_bytes) (bytes). The kernels that take one spread its lines
// evenly over their work. An empty plan (base == nullptr) prefetches nothing. (The prefill matrix
// kernel takes none: between register blocks prefetches stall on the line fill buffers, inside
// the depth loop they spill the accumulators; forward_blocks' burst before each key tile
// measures faster than either.)
struct RowPrefetch {
  const char* base = nullptr;
  std::int64_t ld = 0, head_stride = 0, keys = 0, heads = 0, row_bytes = 0;
};

// C[m][n] (+)= Σ_t A(m, t)·B[t][n] for m < rows, n < cols, t < depth, in f32 with fused
// multiply-adds in t order. A(m, t) = a[m·a_row + t·a_depth] (any strides: broadcast operand);
// B rows at b + t·ldb, C rows at c + m·ldc; cols a multiple of kAttnAlign.
void attn_gemm(const float* a, std::int64_t a_row, std::int64_t a_depth, const float* b, std::int64_t ldb, float* c,
               std::int64_t ldc, std::int64_t rows, std::int64_t cols, std::int64_t depth, bool accumulate);
// C[m][n] += Σ_t A(m, t)·B[t][n], the sum taken as one chain of fused multiply-adds from 0 in t
// order and then added to C once (attn_gemm with `accumulate` chains from C instead). Online
// softmax adds a tile's P·V so: O then takes one rounding per tile, not one per key, and its
// error does not grow with the keys already summed (forward with far tiles first puts the largest
// terms into O first; rounded per key, a 4096-key causal row would lose up to 20× the naive f32
// accuracy).
// depth <= kAttnGemmAddDepth (one pass of the kernel on every target), else posenc::Error.
inline constexpr std::int64_t kAttnGemmAddDepth = 128;
void attn_gemm_add(const float* a, std::int64_t a_row, std::int64_t a_depth, const float* b, std::int64_t ldb, float* c,
                   std::int64_t ldc, std::int64_t rows, std::int64_t cols, std::int64_t depth);

// Native bf16 products (bf16_kernels.cpp), on hosts with AVX512-BF16 only (else posenc::Error):
// operands are pairs of bf16 in 32-bit words, the even element in the low half, and each
// instruction adds a pair's two exact products to an f32 lane (denormals flushed).
bool attn_bf16_supported();
// C[m][n] = (add_sum: C[m][n] +) Σ_t A(m, t)·B[t][n] for t < pairs, each term a pair's dot
// product, summed from 0 in t order: A(m, t) = the pair at a + 4·(m·a_row + t·a_depth) bytes (any
// alignment: A may be bf16 rows in place, consecutive elements the pairs), B rows at b + t·ldb (pairs),
// C rows at c + m·ldc; cols a multiple of kAttnAlign.
void attn_gemm_bf16(const void* a, std::int64_t a_row, std::int64_t a_depth, const std::uint32_t* b, std::int64_t ldb,
                    float* c, std::int64_t ldc, std::int64_t rows, std::int64_t cols, std::int64_t pairs, bool add_sum);
// dst[p·ldd + i] = (bf16(src[2p·ld + i]), bf16(src[(2p + 1)·ld + i])) for p < ⌈count/2⌉, i < cols
// (a multiple of kAttnAlign): rows paired along the sum's index; an odd count's last pair has 0 in
// its high half. Rounded to nearest even.
void attn_pack_bf16_pairs(const float* src, std::int64_t ld, std::int64_t count, std::int64_t cols, std::uint32_t* dst,
                          std::int64_t ldd);
// attn_pack_bf16_pairs from bf16 rows as they lie (raw bits; rows ld elements apart, dim of them
// read, zeros up to cols): exact. Returns whether every value read is finite.
bool attn_pack_bf16_raw_pairs(const std::uint16_t* src, std::int64_t ld, std::int64_t count, std::int64_t dim,
                              std::int64_t cols, std::uint32_t* dst, std::int64_t ldd);
// dst[p·ldd + r] = (bf16(src[r·ld + 2p]), bf16(src[r·ld + 2p + 1])) for r < rows (a multiple of
// kAttnAlign), p < pairs (2·pairs <= ld): rows transposed into pairs along their columns (Qᵀ).
void attn_transpose_bf16_pairs(const float* src, std::int64_t ld, std::int64_t rows, std::int64_t pairs,
                               std::uint32_t* dst, std::int64_t ldd);
// Row r of dst (ldd pairs apart) = bf16 of src[r·ld + i] for i < cols (a multiple of kAttnAlign):
// its pairs are consecutive elements (i, i + 1).
void attn_convert_bf16_rows(const float* src, std::int64_t ld, std::int64_t rows, std::int64_t cols, std::uint32_t* dst,
                            std::int64_t ldd);

// dst[j][g][0..dim_padded) = f32 of src row (key j, head g) at src + j·seq_stride + g·head_stride
// (elements; unit dim stride), zero-padded: a tile of the cache converted in its memory order.
void attn_pack_heads(const void* src, DType dtype, std::int64_t seq_stride, std::int64_t head_stride, std::int64_t keys,
                     std::int64_t heads, std::int64_t dim, float* dst, std::int64_t dim_padded);
// attn_pack_heads, then each key's rows rotated (half-split RoPE, pairs (i, i + half), i < half) by
// the [cos(half) | sin(half)] row cos_sin + table_rows[j]·2·half, in one pass.
void attn_pack_rotate_heads(const void* src, DType dtype, std::int64_t seq_stride, std::int64_t head_stride,
                            std::int64_t keys, std::int64_t heads, std::int64_t dim, const float* cos_sin,
                            const std::int64_t* table_rows, std::int64_t half, float* dst, std::int64_t dim_padded);

// attn_pack_heads for a quantized cache (quantized.hpp): dst[j][g][0..dim_padded) = row (key j,
// head g) at src + j·seq_stride + g·head_stride (bytes) dequantised, zero-padded; the values of
// posenc::dequantize_rows, bit for bit (quantized_kernels.cpp).
void attn_dequantize_heads(const void* src, CacheFormat format, std::int64_t seq_stride, std::int64_t head_stride,
                           std::int64_t keys, std::int64_t heads, std::int64_t dim, float* dst,
                           std::int64_t dim_padded);
// attn_dequantize_heads with key j's rows rotated by the half-split RoPE of its table row
// ([cos(half) | sin(half)] at cos_sin + table_rows[j]·2·half), in registers: the bits of
// dequantising and then attn_rotate_half_split. Where attn_dequantize_rotates(half): the pairs
// fill whole vectors (else posenc::Error).
bool attn_dequantize_rotates(std::int64_t half);
void attn_dequantize_rotate_heads(const void* src, CacheFormat format, std::int64_t seq_stride,
                                  std::int64_t head_stride, std::int64_t keys, std::int64_t heads, std::int64_t dim,
                                  const float* cos_sin, const std::int64_t* table_rows, std::int64_t half, float* dst,
                                  std::int64_t dim_padded);

// Decode over all KV heads of a key tile (any strides; [S, G, D] memory order is fastest): the
// scores take blocks of keys of one head (⌊lanes / q_rows⌋ keys when q_rows <= lanes and dim fills
// whole vectors, else up to 4), every head in turn; the values key by key over every head (up to
// lanes / 8 query rows per head: the cache in memory order), else one head at a time, the keys
// streaming past a block of columns held in registers. st_heads and p_heads may point into
// one tile (head g's rows at lanes g·q_rows …, the engine's merged decode rows):
//   scores  st_heads[g][j·ld_st + r] = Σ_d k[j·ldk + g·k_head_stride + d]·q_heads[g][r·ldq + d]
//   values  o_heads[g][r·ldo + c] += Σ_j p_heads[g][j·ld_p + r]·v[j·ldv + g·v_head_stride + c]
//           for c < cols, in j order (one fused multiply-add per key), straight from the rows
// At most 8 query rows per head (the engine's kDecodeRows). Each kernel spreads prefetches of
// `ahead` evenly over its work, into L2: the engine passes the tile's values to the scores (used
// only where the values are not read key by key: the hardware prefetchers follow those) and the
// next tile's keys to the values, so the memory streams while either computes; `prefetch_keys`
// (the first tile of a run, whose keys nobody prefetched) makes the scores prefetch their own keys
// one cache row (4 KiB) ahead as well.
// The cache is read in its own dtype (strides in its elements): f32 always; bf16 and f16 where
// attn_decode_reads_directly says so, widened exactly to f32 in registers, so the sums are those
// of an f32 cache holding the same values, bit for bit. Other cases throw posenc::Error (the
// engine widens such tiles into f32 scratch first).
// With `rotation` (cos_sin set), the scores first rotate key j (of the tile) by its RoPE row,
// in registers: an un-rotated cache read in place. Only where attn_decode_rotates_keys says so
// (else posenc::Error). The two layouts take differently shaped rows of cos_sin:
//   half-split   pairs (i, i + half); row cos_sin + table_rows[j]·2·half = [cos(half) | sin(half)],
//                the tables' own rows:  k'_i = k_i·c_i − k_{i+half}·s_i,  k'_{i+half} = k_{i+half}·c_i + k_i·s_i
//   interleaved  pairs (2i, 2i + 1); row cos_sin + table_rows[j]·4·half = [C(2·half) | S(2·half)],
//                one entry per rotated dim (attn_expand_interleaved_rope), so that
//                k' = k ⊙ C + swap_pairs(k) ⊙ S with C = (c_0, c_0, c_1, c_1, …), S = (−s_0, s_0, −s_1, s_1, …)
struct KeyRotation {
  const float* cos_sin = nullptr;            // rows as above
  const std::int64_t* table_rows = nullptr;  // per key of the tile
  std::int64_t half = 0;                     // rotated pairs; the rotated dims are [0, 2·half)
  bool interleaved = false;
};
bool attn_decode_reads_directly(DType dtype, std::int64_t q_rows, std::int64_t dim);
bool attn_decode_rotates_keys(DType dtype, std::int64_t q_rows, std::int64_t dim, std::int64_t half,
                              bool interleaved = false);
// The interleaved layout's rows for keys j < keys from the tables' [cos(half) | sin(half)] rows
// cos_sin + table_rows[j]·2·half: dst[j·4·half …] = [C | S] as KeyRotation describes.
void attn_expand_interleaved_rope(const float* cos_sin, const std::int64_t* table_rows, std::int64_t keys,
                                  std::int64_t half, float* dst);
void attn_decode_scores(const void* k, DType dtype, std::int64_t ldk, std::int64_t k_head_stride, std::int64_t keys,
                        std::int64_t heads, const float* const* q_heads, std::int64_t ldq, std::int64_t q_rows,
                        std::int64_t dim, float* const* st_heads, std::int64_t ld_st, const RowPrefetch& ahead,
                        bool prefetch_keys, const KeyRotation& rotation = {});
void attn_decode_values(const void* v, DType dtype, std::int64_t ldv, std::int64_t v_head_stride, std::int64_t keys,
                        std::int64_t heads, const float* const* p_heads, std::int64_t ld_p, std::int64_t rows,
                        std::int64_t cols, float* const* o_heads, std::int64_t ldo, const RowPrefetch& ahead);

// attn_decode_scores / attn_decode_values on a quantized cache (quantized.hpp), rows and strides
// in bytes, no rotation: each vector dequantised in registers and summed as the f32 kernels sum
// the f32 cache of the dequantised values (the same bits). Only where attn_decode_reads_quantized
// says so (else posenc::Error; the engine dequantises such tiles into f32 scratch).
bool attn_decode_reads_quantized(CacheFormat format, std::int64_t q_rows, std::int64_t dim);
void attn_decode_scores_quantized(const void* k, CacheFormat format, std::int64_t ldk, std::int64_t k_head_stride,
                                  std::int64_t keys, std::int64_t heads, const float* const* q_heads, std::int64_t ldq,
                                  std::int64_t q_rows, std::int64_t dim, float* const* st_heads, std::int64_t ld_st,
                                  const RowPrefetch& ahead, bool prefetch_keys);
void attn_decode_values_quantized(const void* v, CacheFormat format, std::int64_t ldv, std::int64_t v_head_stride,
                                  std::int64_t keys, std::int64_t heads, const float* const* p_heads, std::int64_t ld_p,
                                  std::int64_t rows, std::int64_t cols, float* const* o_heads, std::int64_t ldo,
                                  const RowPrefetch& ahead);

// Online-softmax step over a tile S^T [keys][width] (width a multiple of kAttnAlign): with the
// running max m[r] and sum l[r] of each row, m' = max(m, max_j S^T[j][r]); S^T becomes
// P^T = exp(S^T − m'); l = l·exp(m − m') + Σ_j P^T; correction[r] = exp(m − m') (1 where m was
// −inf, 0 lanes stay 0). Rows whose logits are all −inf keep m = −inf and P = 0.
void attn_softmax_tile(float* st, std::int64_t keys, std::int64_t width, float* m, float* l, float* correction);

// z = c·tanh(x / c) over a tile, in place; the derivative's factor 1 − (z/c)² is what backward
// needs, computed there from z.
void attn_softcap_tile(float* st, std::int64_t keys, std::int64_t width, float cap);

// rows[r][0..cols) *= factor[r] for r < count (skipped where factor is 1).
void attn_scale_rows(float* rows, std::int64_t ld, std::int64_t count, std::int64_t cols, const float* factor);

// Backward on a tile: P^T = exp(S^T − lse[r]) in place (−inf lse: 0), then
// dS^T = P^T·(dP^T − delta[r]) written over dP^T, times (1 − (z/c)²) with a soft-cap (z taken
// from S^T before the exponent).
void attn_backward_tile(float* st, float* dpt, std::int64_t keys, std::int64_t width, const float* lse,
                        const float* delta, float cap);

// S^T[j][t] += table[base − j + t] for j < keys, t < kAttnAlign (one lane chunk of rows at
// consecutive query positions against keys at consecutive positions: δ = q − k runs up with the
// lane and down with the key). st points at the chunk's first lane; rows of S^T are `width` apart.
void attn_add_bias_tile(float* st, std::int64_t keys, std::int64_t width, const float* table, std::int64_t base);
// S^T[j][r] += table[(base − j)·rows + r] for j < keys, r < rows: a bias table stored [δ][row]
// (decode's rows of one query, one per head, against keys at consecutive positions).
void attn_add_bias_rows(float* st, std::int64_t keys, std::int64_t width, const float* table, std::int64_t base,
                        std::int64_t rows);

// Transformer-XL's pairs on one lane chunk (kAttnAlign rows; st and window point at its first
// lane): for key j and lane t, u = base[t] − key_offset[j] picks the window row when 0 <= u < span,
// and then add: S^T[j][t] += window[u·ld + t]; collect (the transpose): window[u·ld + t] += S^T[j][t].
// Lanes with no pair (padding, other schemes) carry a base that is never inside. A gather per key,
// and a scatter when collecting: lanes' window columns differ (t < ld), so lanes never collide.
// The caller keeps u·ld + t, base and key_offset within int32.
void attn_xl_add(float* st, std::int64_t keys, std::int64_t width, const float* window, std::int64_t ld,
                 std::int64_t span, const std::int32_t* base, const std::int32_t* key_offset);
void attn_xl_collect(const float* st, std::int64_t keys, std::int64_t width, float* window, std::int64_t ld,
                     std::int64_t span, const std::int32_t* base, const std::int32_t* key_offset);

// FIRE on one lane chunk against consecutive keys at or before every lane's query: for lane t,
// x = psi[base − j + t]·inv_norm[t] (ψ of the distance, normalised) and, while every lane's x stays
// in its piece [lo[t], hi[t]), S^T[j][t] += slope[t]·x + intercept[t] (fp64, rounded once).
// Returns the first key at which some lane leaves its piece (keys if none); the caller moves that
// lane to its next piece and calls again from there. All lane arrays hold kAttnAlign values.
std::int64_t attn_fire_keys(float* st, std::int64_t keys, std::int64_t width, const double* psi, std::int64_t base,
                            const double* inv_norm, const double* lo, const double* hi, const double* slope,
                            const double* intercept);

// FIRE's backward moments on one lane chunk against the same keys as attn_fire_keys, with
// g = ds[j·width + t] (dL/db, f32) and x as there: while every lane stays in its piece,
// moments[0·16 + t] += g, moments[1·16 + t] += g·x, moments[2·16 + t] += g·slope[t]·dpsi[base − j + t],
// moments[3·16 + t] += g·slope[t]·x (fp64). Returns the first key at which some lane leaves its
// piece (keys if none): the caller moves that lane's piece sums to their slot and calls again.
std::int64_t attn_fire_moments(const float* ds, std::int64_t keys, std::int64_t width, const double* psi,
                               const double* dpsi, std::int64_t base, const double* inv_norm, const double* lo,
                               const double* hi, const double* slope, double* moments);

// S^T[j][r] += f32(row[r] − key[j]) for j < keys and r in [r0, r0 + n) (any n): a difference of
// fp64 values rounded once (Forgetting Attention's c_i − c_j).
void attn_add_differences(float* st, std::int64_t keys, std::int64_t width, std::int64_t r0, std::int64_t n,
                          const double* row, const double* key);

// S^T[j][r0 + t] += f32(row[r0 + t] − key[j·ld_key + t]) for j < keys and t < n (any n): rows of
// consecutive heads, each against its own column of a [key][head] table (decode's c_i − c_j).
void attn_add_head_differences(float* st, std::int64_t keys, std::int64_t width, std::int64_t r0, std::int64_t n,
                               const double* row, const double* key, std::int64_t ld_key);

// S^T[j][r] = −inf unless lo[r] <= k_first + j < hi[r].
void attn_mask_tile(float* st, std::int64_t keys, std::int64_t width, std::int64_t k_first, const std::int32_t* lo,
                    const std::int32_t* hi);

// In place, a half-split RoPE rotation of one row: (x[i], x[i + half]) turned by (c[i], ±s[i]),
// the sine times sine_sign (−1: the transpose, for gradients). Matches the scalar form exactly
// (one multiply and one fused multiply-add per output).
void attn_rotate_half_split(float* x, const float* c, const float* s, std::int64_t half, float sine_sign);

// dst[0..n) = src converted to f32 (f32, bf16 or f16 raw bits; unit stride).
void attn_load_f32(const void* src, DType dtype, std::int64_t n, float* dst);
// dst[0..n) (+)= src converted from f32 to dtype (round to nearest even for 16-bit).
void attn_store(const float* src, std::int64_t n, DType dtype, void* dst, bool accumulate);
// attn_store's bf16 case (raw bits), the bits of posenc::to_bf16.
void attn_store_bf16(const float* src, std::int64_t n, std::uint16_t* dst, bool accumulate);

}  // namespace posenc::kernels
