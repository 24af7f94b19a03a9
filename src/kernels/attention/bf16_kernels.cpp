// Native bf16 products of the fused attention (attention_kernels.hpp: attn_gemm_bf16 and its
// packing). Highway 1.0 has no target with AVX512-BF16, so these few functions are compiled for
// it through the compiler's target attribute and chosen at run time (attn_bf16_supported).
#include <cstdint>
#include <cstring>
#include <string>

#include "kernels/attention/attention_kernels.hpp"
#include "posenc/error.hpp"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#define POSENC_BF16_KERNELS 1
#define POSENC_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))
#else
#define POSENC_BF16_KERNELS 0
#endif

namespace posenc::kernels {

#if POSENC_BF16_KERNELS
namespace {

// CPUID leaf 7 sub-leaf 1, EAX bit 5: AVX512_BF16; the OS must save the ZMM state (XCR0 bits 1,
// 2, 5, 6, 7), which __builtin_cpu_supports("avx512f") checks.
bool host_has_bf16() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
      !__builtin_cpu_supports("avx512vl") || !__builtin_cpu_supports("avx512dq"))
    return false;
  if (__get_cpuid_max(0, nullptr) < 7) return false;
  __cpuid_count(7, 1, eax, ebx, ecx, edx);
  return (eax & (1u << 5)) != 0;
}

// Register blocking as the f32 kernel's on AVX-512: kRows broadcast pairs × kVecs vectors of
// accumulators (24 of the 32 registers, 4 for B, one broadcast).
constexpr int kRows = 6;
constexpr int kVecs = 4;
constexpr std::int64_t kLanes = 16;

template <int R, int V>
POSENC_BF16_TARGET inline void Bf16Block(const char* __restrict a, std::int64_t a_row, std::int64_t a_depth,
                                         const std::uint32_t* __restrict b, std::int64_t ldb, float* __restrict c,
                                         std::int64_t ldc, std::int64_t pairs, bool add_sum) {
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  }
  for (std::int64_t t = 0; t < pairs; ++t) {
    __m512bh bv[V];
    for (int v = 0; v < V; ++v) bv[v] = (__m512bh)_mm512_loadu_si512(b + t * ldb + v * kLanes);
    for (int r = 0; r < R; ++r) {
      std::uint32_t pair;  // memcpy: A may be bf16 memory read as pairs
      std::memcpy(&pair, a + 4 * (r * a_row + t * a_depth), sizeof(pair));
      const auto av = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], av, bv[v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) {
      float* cv = c + r * ldc + v * kLanes;
      _mm512_storeu_ps(cv, add_sum ? _mm512_add_ps(_mm512_loadu_ps(cv), acc[r][v]) : acc[r][v]);
    }
  }
}

// The rows of one column strip of V vectors: blocks of kRows, then one block of the R < kRows
// left (R found by recursion down from kRows − 1: one instantiation per size).
template <int V, int R = kRows>
POSENC_BF16_TARGET void Bf16Rows(std::int64_t rows, const char* a, std::int64_t a_row, std::int64_t a_depth,
                                 const std::uint32_t* b, std::int64_t ldb, float* c, std::int64_t ldc,
                                 std::int64_t pairs, bool add_sum) {
  if constexpr (R == kRows) {
    std::int64_t m = 0;
    for (; m + kRows <= rows; m += kRows)
      Bf16Block<kRows, V>(a + 4 * m * a_row, a_row, a_depth, b, ldb, c + m * ldc, ldc, pairs, add_sum);
    Bf16Rows<V, kRows - 1>(rows - m, a + 4 * m * a_row, a_row, a_depth, b, ldb, c + m * ldc, ldc, pairs, add_sum);
  } else if constexpr (R > 0) {
    if (rows == R) {
      Bf16Block<R, V>(a, a_row, a_depth, b, ldb, c, ldc, pairs, add_sum);
    } else {
      Bf16Rows<V, R - 1>(rows, a, a_row, a_depth, b, ldb, c, ldc, pairs, add_sum);
    }
  }
}

// Column strips of kVecs vectors, then one of the V < kVecs left, likewise.
template <int V = kVecs>
POSENC_BF16_TARGET void Bf16Gemm(const char* a, std::int64_t a_row, std::int64_t a_depth, const std::uint32_t* b,
                                 std::int64_t ldb, float* c, std::int64_t ldc, std::int64_t rows, std::int64_t vecs,
                                 std::int64_t pairs, bool add_sum) {
  if constexpr (V == kVecs) {
    std::int64_t v = 0;
    for (; v + kVecs <= vecs; v += kVecs)
      Bf16Rows<kVecs>(rows, a, a_row, a_depth, b + v * kLanes, ldb, c + v * kLanes, ldc, pairs, add_sum);
    Bf16Gemm<kVecs - 1>(a, a_row, a_depth, b + v * kLanes, ldb, c + v * kLanes, ldc, rows, vecs - v, pairs, add_sum);
  } else if constexpr (V > 0) {
    if (vecs == V) {
      Bf16Rows<V>(rows, a, a_row, a_depth, b, ldb, c, ldc, pairs, add_sum);
    } else {
      Bf16Gemm<V - 1>(a, a_row, a_depth, b, ldb, c, ldc, rows, vecs, pairs, add_sum);
    }
  }
}

// 16 floats → 16 bf16 (round to nearest even; the instruction flushes denormals to 0), each in
// the low half of a 32-bit lane.
POSENC_BF16_TARGET inline __m512i Bf16Low(__m512 x) { return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)); }

POSENC_BF16_TARGET void Bf16PackPairs(const float* src, std::int64_t ld, std::int64_t count, std::int64_t cols,
                                      std::uint32_t* dst, std::int64_t ldd) {
  for (std::int64_t p = 0; 2 * p < count; ++p) {
    const float* lo = src + 2 * p * ld;
    const float* hi = lo + ld;
    const bool has_hi = 2 * p + 1 < count;
    for (std::int64_t i = 0; i < cols; i += kLanes) {
      const __m512i l = Bf16Low(_mm512_loadu_ps(lo + i));
      const __m512i h = has_hi ? _mm512_slli_epi32(Bf16Low(_mm512_loadu_ps(hi + i)), 16) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + p * ldd + i, _mm512_or_si512(l, h));
    }
  }
}

// Two rows of 32 bf16 interleaved into 32 pairs: unpacklo/hi pair elements 0–3 and 4–7 of each
// 128-bit lane, and the 64-bit permutes put the lanes back in order.
POSENC_BF16_TARGET bool Bf16PackRawPairs(const std::uint16_t* src, std::int64_t ld, std::int64_t count,
                                         std::int64_t dim, std::int64_t cols, std::uint32_t* dst, std::int64_t ldd) {
  const __m512i exponent = _mm512_set1_epi16(0x7f80);
  const __m512i first = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0),
                second = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
  __mmask32 non_finite = 0;
  for (std::int64_t p = 0; 2 * p < count; ++p) {
    const std::uint16_t* lo = src + 2 * p * ld;
    const std::uint16_t* hi = lo + ld;
    const bool has_hi = 2 * p + 1 < count;
    for (std::int64_t i = 0; i < cols; i += 2 * kLanes) {
      const std::int64_t n = dim - i < 0 ? 0 : (dim - i < 2 * kLanes ? dim - i : 2 * kLanes);
      const auto mask = static_cast<__mmask32>(n == 32 ? ~0u : (1u << n) - 1u);
      const __m512i l = _mm512_maskz_loadu_epi16(mask, lo + i);
      const __m512i h = has_hi ? _mm512_maskz_loadu_epi16(mask, hi + i) : _mm512_setzero_si512();
      non_finite |= _mm512_cmpeq_epi16_mask(_mm512_and_si512(l, exponent), exponent) |
                    _mm512_cmpeq_epi16_mask(_mm512_and_si512(h, exponent), exponent);
      const __m512i a = _mm512_unpacklo_epi16(l, h), b = _mm512_unpackhi_epi16(l, h);
      _mm512_storeu_si512(dst + p * ldd + i, _mm512_permutex2var_epi64(a, first, b));
      // cols is a multiple of 16: the second half only where it lies within them.
      if (i + kLanes < cols) _mm512_storeu_si512(dst + p * ldd + i + kLanes, _mm512_permutex2var_epi64(a, second, b));
    }
  }
  return non_finite == 0;
}

// dst rows (pairs) × 16 lanes from 16 rows of 16 pairs: a 16 × 16 transpose of 32-bit elements
// (after the two unpacks, lane k of u[4i + c] holds rows 4i … 4i + 3 of column 4k + c; the two
// 128-bit shuffles gather each column's four quarters).
POSENC_BF16_TARGET void Bf16TransposeRows(const float* src, std::int64_t ld, std::int64_t rows, std::int64_t pairs,
                                          std::uint32_t* dst, std::int64_t ldd) {
  for (std::int64_t r0 = 0; r0 < rows; r0 += kLanes) {
    for (std::int64_t p0 = 0; p0 < pairs; p0 += kLanes) {
      const std::int64_t n = pairs - p0 < kLanes ? pairs - p0 : kLanes;  // pairs of this block
      const auto lo_mask = static_cast<__mmask16>(2 * n >= kLanes ? 0xffff : (1u << (2 * n)) - 1u);
      const auto hi_mask = static_cast<__mmask16>(2 * n <= kLanes ? 0 : (1u << (2 * n - kLanes)) - 1u);
      __m512i r[16], t[16], u[16], v[16];
      for (int i = 0; i < 16; ++i) {
        const float* row = src + (r0 + i) * ld + 2 * p0;
        const __m512 a = _mm512_maskz_loadu_ps(lo_mask, row), b = _mm512_maskz_loadu_ps(hi_mask, row + kLanes);
        r[i] = (__m512i)_mm512_cvtne2ps_pbh(b, a);  // bf16 of row[0 … 31] in order: pairs 0 … 15
      }
      for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
      }
      for (int i = 0; i < 4; ++i) {
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
      }
      for (int c = 0; c < 4; ++c) {
        v[c] = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88);
        v[4 + c] = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xdd);
        v[8 + c] = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
        v[12 + c] = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xdd);
      }
      for (int c = 0; c < 4; ++c) {
        const __m512i col[4] = {
            _mm512_shuffle_i32x4(v[c], v[8 + c], 0x88), _mm512_shuffle_i32x4(v[4 + c], v[12 + c], 0x88),
            _mm512_shuffle_i32x4(v[c], v[8 + c], 0xdd), _mm512_shuffle_i32x4(v[4 + c], v[12 + c], 0xdd)};
        for (int q = 0; q < 4; ++q) {
          const int column = 4 * q + c;  // columns c, 4 + c, 8 + c, 12 + c
          if (column < n) _mm512_storeu_si512(dst + (p0 + column) * ldd + r0, col[q]);
        }
      }
    }
  }
}

POSENC_BF16_TARGET void Bf16ConvertRows(const float* src, std::int64_t ld, std::int64_t rows, std::int64_t cols,
                                        std::uint32_t* dst, std::int64_t ldd) {
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t i = 0; i < cols; i += kLanes) {
      const __m256i x = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + r * ld + i));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + r * ldd + i / 2), x);
    }
  }
}

}  // namespace

bool attn_bf16_supported() {
  static const bool supported = host_has_bf16();
  return supported;
}
#else
bool attn_bf16_supported() { return false; }
#endif

namespace {
void require_bf16(const char* kernel, std::int64_t cols) {
  if (!attn_bf16_supported())
    throw Error(kernel, "host", "without AVX512-BF16", "a host with AVX512-BF16 (attn_bf16_supported)");
  if (cols % kAttnAlign != 0)
    throw Error(kernel, "cols", std::to_string(cols), "a multiple of " + std::to_string(kAttnAlign));
}
}  // namespace

void attn_gemm_bf16(const void* a, std::int64_t a_row, std::int64_t a_depth, const std::uint32_t* b, std::int64_t ldb,
                    float* c, std::int64_t ldc, std::int64_t rows, std::int64_t cols, std::int64_t pairs,
                    bool add_sum) {
  require_bf16("attn_gemm_bf16", cols);
#if POSENC_BF16_KERNELS
  Bf16Gemm(static_cast<const char*>(a), a_row, a_depth, b, ldb, c, ldc, rows, cols / kLanes, pairs, add_sum);
#endif
}

void attn_pack_bf16_pairs(const float* src, std::int64_t ld, std::int64_t count, std::int64_t cols, std::uint32_t* dst,
                          std::int64_t ldd) {
  require_bf16("attn_pack_bf16_pairs", cols);
#if POSENC_BF16_KERNELS
  Bf16PackPairs(src, ld, count, cols, dst, ldd);
#endif
}

bool attn_pack_bf16_raw_pairs(const std::uint16_t* src, std::int64_t ld, std::int64_t count, std::int64_t dim,
                              std::int64_t cols, std::uint32_t* dst, std::int64_t ldd) {
  require_bf16("attn_pack_bf16_raw_pairs", cols);
  if (dim > cols) throw Error("attn_pack_bf16_raw_pairs", "dim", std::to_string(dim), "at most cols");
#if POSENC_BF16_KERNELS
  return Bf16PackRawPairs(src, ld, count, dim, cols, dst, ldd);
#else
  return false;
#endif
}

void attn_transpose_bf16_pairs(const float* src, std::int64_t ld, std::int64_t rows, std::int64_t pairs,
                               std::uint32_t* dst, std::int64_t ldd) {
  require_bf16("attn_transpose_bf16_pairs", rows);
  if (2 * pairs > ld) throw Error("attn_transpose_bf16_pairs", "pairs", std::to_string(pairs), "at most ld / 2");
#if POSENC_BF16_KERNELS
  Bf16TransposeRows(src, ld, rows, pairs, dst, ldd);
#endif
}

void attn_convert_bf16_rows(const float* src, std::int64_t ld, std::int64_t rows, std::int64_t cols, std::uint32_t* dst,
                            std::int64_t ldd) {
  require_bf16("attn_convert_bf16_rows", cols);
#if POSENC_BF16_KERNELS
  Bf16ConvertRows(src, ld, rows, cols, dst, ldd);
#endif
}

}  // namespace posenc::kernels
