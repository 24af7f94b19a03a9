// SIMD kernels of the fused attention that read the KV cache where it lies: decode's scores and
// values, packing and rotating rows of any dtype (Highway, dynamic dispatch). See
// attention_kernels.hpp.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/attention/attention_cache_kernels.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>
#include <hwy/cache_control.h>
#include <hwy/contrib/math/math-inl.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "kernels/attention/attention_kernels.hpp"
#include "kernels/attention/quant_row-inl.h"
#include "kernels/common/cpu_vendor.hpp"
#include "posenc/error.hpp"
#include "posenc/quantized.hpp"

HWY_BEFORE_NAMESPACE();
namespace posenc::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

#if HWY_TARGET != HWY_SCALAR
// Sums of `lanes` vectors, one per lane: out[j] = Σ_t acc[j][t]. A tree of interleaves (pairs of
// keys within 128-bit blocks, then 64-bit halves) and block moves: about one shuffle and one
// add per vector instead of a full horizontal reduction each.
HWY_INLINE VF SumEachVector(DF d, VF* acc) {
  const auto n = hn::Lanes(d);
  const hn::Repartition<double, DF> d64;
  VF b[8];
  for (std::size_t i = 0; i < n / 2; ++i) {
    b[i] =
        hn::Add(hn::InterleaveLower(d, acc[2 * i], acc[2 * i + 1]), hn::InterleaveUpper(d, acc[2 * i], acc[2 * i + 1]));
  }
  VF c[4];
  for (std::size_t k = 0; k < n / 4; ++k) {
    const auto x = hn::BitCast(d64, b[2 * k]), y = hn::BitCast(d64, b[2 * k + 1]);
    c[k] = hn::Add(hn::BitCast(d, hn::InterleaveLower(d64, x, y)), hn::BitCast(d, hn::InterleaveUpper(d64, x, y)));
  }
  // c[k]: per 128-bit block, the block's partial sums of keys 4k … 4k + 3.
#if HWY_MAX_BYTES >= 64
  if (n == 16) {
    const VF w0 = hn::Add(hn::ConcatLowerLower(d, c[2], c[0]), hn::ConcatUpperUpper(d, c[2], c[0]));
    const VF w1 = hn::Add(hn::ConcatLowerLower(d, c[3], c[1]), hn::ConcatUpperUpper(d, c[3], c[1]));
    const VF u0 = hn::Add(w0, hn::SwapAdjacentBlocks(w0)), u1 = hn::Add(w1, hn::SwapAdjacentBlocks(w1));
    return hn::OddEvenBlocks(u1, u0);
  }
#endif
#if HWY_MAX_BYTES >= 32
  if (n == 8) return hn::Add(hn::ConcatLowerLower(d, c[1], c[0]), hn::ConcatUpperUpper(d, c[1], c[0]));
#endif
  return c[0];
}
#endif

// Decode over every KV head of a key tile in memory order: rows f = j·heads + g (key j, head g),
// which in [S, G, D] memory are consecutive, so the cache streams through once and the hardware
// prefetchers follow it.
//   scores  per row f: its key vectors loaded once (8 at a time), multiplied into one
//           accumulator per query row; a block of `lanes` rows is then summed by SumEachVector.
//   values  per head, a block of columns of every query row stays in registers while the keys'
//           value rows stream past it: one broadcast of P and one fused multiply-add per vector.
//           (An earlier form copied the rows head-major and ran the matrix kernel on the copy: the
//           copy and the product kept the core busy without any memory traffic in flight.)
// Decode is bound by memory: each kernel also prefetches the engine's `ahead` rows into L2, spread
// evenly over its work, so that the memory is busy while the core computes.
constexpr std::int64_t kDecodeMaxRows = 8;
// Software prefetch distance of the keys' own stream, in floats (4 KiB ahead): it serves the
// first tile of a chunk, which no earlier kernel prefetched (`prefetch_keys`). 32768 keys × 8 KV heads ×
// D 128 f32, 2 threads, with no `ahead`: none 10.0–10.1 GB/s, 1 KiB 11.4–12.0, 4 KiB
// 12.6–12.9, 16 KiB 12.3–12.5.
constexpr std::int64_t kDecodeAhead = 1024;

// The keys' own stream: the bytes kDecodeAhead floats (4 KiB) past a row of `row_bytes`, a line at a time.
HWY_INLINE void PrefetchKeyRowAhead(const void* row, std::int64_t row_bytes) {
  const char* ahead = static_cast<const char*>(row) + kDecodeAhead * static_cast<std::int64_t>(sizeof(float));
  for (std::int64_t at = 0; at < row_bytes; at += 64) hwy::Prefetch(ahead + at);
}

// Decode reads the cache where it lies, in its own dtype: f32, or bf16 / f16 (their bits as
// uint16) widened exactly to f32 in registers, so that a 16-bit cache moves half the bytes and
// the multiply-adds are those of the f32 cache holding the same values, bit for bit.
template <DType kType>
using CacheElement = std::conditional_t<kType == DType::kF32, float, std::uint16_t>;

// Whether this target widens kType in vectors (16-bit: bf16 by a shift, f16 with F16C).
template <DType kType>
constexpr bool WidensInVectors() {
  if constexpr (kType == DType::kF32) return true;
  if constexpr (kType == DType::kBF16) return HWY_TARGET != HWY_SCALAR;
  return HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2;  // f16
}

template <DType kType>
HWY_INLINE VF LoadCache(DF d, const CacheElement<kType>* HWY_RESTRICT p) {
  if constexpr (kType == DType::kF32) {
    return hn::LoadU(d, p);
  } else if constexpr (kType == DType::kBF16) {
    const hn::RebindToUnsigned<DF> du32;
    const hn::Rebind<std::uint16_t, DF> du16;
    return hn::BitCast(d, hn::ShiftLeft<16>(hn::PromoteTo(du32, hn::LoadU(du16, p))));
  } else {
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2
    const hn::Rebind<hwy::float16_t, DF> dh;
    return hn::PromoteTo(d, hn::LoadU(dh, reinterpret_cast<const hwy::float16_t*>(p)));
#else
    (void)p;  // never called: WidensInVectors<kF16>() is false on this target
    return hn::Zero(d);
#endif
  }
}

// Whether this target widens `dtype` in vectors (WidensInVectors at run time; false for f64).
HWY_INLINE bool WidensInVectors(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return WidensInVectors<DType::kF32>();
    case DType::kBF16:
      return WidensInVectors<DType::kBF16>();
    case DType::kF16:
      return WidensInVectors<DType::kF16>();
    default:
      return false;
  }
}

// One half-split RoPE pair of vectors: (a, b) at dims (i, i + half) rotated by (c, s) =
// (cos, sin) of angle i: lo = a·c − b·s, hi = b·c + a·s.
HWY_INLINE void RotatePair(VF a, VF b, VF c, VF s, VF& lo, VF& hi) {
  lo = hn::NegMulAdd(b, s, hn::Mul(a, c));
  hi = hn::MulAdd(a, s, hn::Mul(b, c));
}

// One vector of interleaved RoPE pairs (2i, 2i + 1): k ⊙ C + Reverse2(k) ⊙ S, with C at `cs` and
// S at cs + sin_at (attn_expand_interleaved_rope's rows): lane 2i = k_2i·c_i − k_2i+1·s_i and lane
// 2i + 1 = k_2i+1·c_i + k_2i·s_i, the same two roundings as RotatePair.
HWY_INLINE VF RotateInterleaved(DF d, VF k, const float* HWY_RESTRICT cs, std::int64_t sin_at) {
  return hn::MulAdd(hn::Reverse2(d, k), hn::LoadU(d, cs + sin_at), hn::Mul(k, hn::LoadU(d, cs)));
}

// Walks the rows of a RowPrefetch a cache line at a time.
class PrefetchCursor {
 public:
  explicit PrefetchCursor(const RowPrefetch& plan) : plan_(plan), non_temporal_(amd_family() == 0x1Au) {
    if (plan_.base == nullptr || plan_.keys <= 0 || plan_.heads <= 0 || plan_.row_bytes <= 0) plan_.keys = 0;
    // Rows without gaps ([S, G, D] with unit strides): one range of lines, walked without the
    // row bookkeeping (which cost a fifth of the decode scores' time when cached).
    contiguous_ = plan_.keys > 0 && plan_.head_stride == plan_.row_bytes && plan_.ld == plan_.heads * plan_.row_bytes;
    if (contiguous_) {
      const auto address = reinterpret_cast<std::uintptr_t>(plan_.base);
      at_ = plan_.base - (address % kLine);
      last_ = plan_.base + plan_.keys * plan_.ld - 1;
      return;
    }
    start_row();
  }
  // Lines in the plan (a row spans at most row_bytes / 64 + 1 lines).
  std::int64_t lines() const {
    if (contiguous_) return (last_ - at_) / kLine + 1;
    return plan_.keys * plan_.heads * (plan_.row_bytes / kLine + 1);
  }
  // Issues prefetches for the next `count` lines (nothing once the plan is done). A call, as
  // measured on Zen 5 (docs/attention.md, "Prefetches").
  HWY_NOINLINE void step(std::int64_t count) {
    if (contiguous_) {
      if (non_temporal_) {
        for (; count > 0 && at_ <= last_; --count, at_ += kLine) __builtin_prefetch(at_, 0, 0);
      } else {
        for (; count > 0 && at_ <= last_; --count, at_ += kLine) __builtin_prefetch(at_, 0, 2);
      }
      return;
    }
    for (; count > 0 && j_ < plan_.keys; --count) {
      __builtin_prefetch(at_, 0, 2);  // read, into L2 (prefetcht1): L1 holds the working rows
      at_ += kLine;
      if (at_ > last_) {
        if (++g_ == plan_.heads) {
          g_ = 0;
          ++j_;
        }
        start_row();
      }
    }
  }

 private:
  static constexpr std::int64_t kLine = 64;
  void start_row() {
    if (j_ >= plan_.keys) return;
    const char* row = plan_.base + j_ * plan_.ld + g_ * plan_.head_stride;
    const auto address = reinterpret_cast<std::uintptr_t>(row);
    at_ = row - (address % kLine);
    last_ = row + plan_.row_bytes - 1;
  }
  RowPrefetch plan_;
  bool non_temporal_ = false;  // prefetchnta for contiguous rows: Zen 5's choice (docs/attention.md)
  bool contiguous_ = false;
  std::int64_t j_ = 0, g_ = 0;
  const char* at_ = nullptr;
  const char* last_ = nullptr;
};

// Lines per step to spread `lines` over `steps` (rounded up, so the plan ends within the work).
HWY_INLINE std::int64_t LinesPerStep(std::int64_t lines, std::int64_t steps) {
  return steps > 0 ? (lines + steps - 1) / steps : 0;
}

// Keys per block of the scores: KB keys of one head share each query vector load. R·KB
// accumulators stay within half the vector registers (32 on AVX-512, 16 elsewhere), at most 4.
template <int R>
constexpr int ScoreKeyBlock() {
  if (HWY_TARGET == HWY_SCALAR) return 1;
  constexpr int budget = HWY_MAX_BYTES >= 64 ? 16 : 8;
  return budget / R >= 4 ? 4 : budget / R >= 2 ? 2 : 1;
}

// KB cache rows of one head (keys kr, kr + ldk, …) against R query rows: acc_out[r·16·lanes +
// i·lanes] = the lanes' partial sums of key i over d < full. Each query vector is loaded once for
// the KB keys.
template <int R, int KB>
HWY_INLINE void ScoreKeys(DF d, const float* HWY_RESTRICT kr, std::int64_t ldk, const float* HWY_RESTRICT qg,
                          std::int64_t ldq, std::int64_t full, float* HWY_RESTRICT acc_out) {
  const auto n = static_cast<std::int64_t>(hn::Lanes(d));
  VF acc[KB][R];
  for (int i = 0; i < KB; ++i) {
    for (int r = 0; r < R; ++r) acc[i][r] = hn::Zero(d);
  }
  for (std::int64_t c = 0; c < full; c += n) {
    VF kv[KB];
    for (int i = 0; i < KB; ++i) kv[i] = hn::LoadU(d, kr + i * ldk + c);
    for (int r = 0; r < R; ++r) {
      const VF qv = hn::LoadU(d, qg + r * ldq + c);
      for (int i = 0; i < KB; ++i) acc[i][r] = hn::MulAdd(kv[i], qv, acc[i][r]);
    }
  }
  for (int i = 0; i < KB; ++i) {
    for (int r = 0; r < R; ++r) hn::Store(acc[i][r], d, acc_out + r * 16 * n + i * n);
  }
}

// The scores of one tile with R query rows per head. Keys go in blocks of KB, each block over every
// head in turn (a block of KB keys × heads rows lies together in [S, G, D] memory); the partial
// sums of `lanes` rows at a time are then summed across lanes by SumEachVector.
template <int R>
void DecodeScoresRows(DF d, const float* HWY_RESTRICT k, std::int64_t ldk, std::int64_t k_head_stride,
                      std::int64_t keys, std::int64_t heads, const float* const* q_heads, std::int64_t ldq,
                      std::int64_t dim, float* const* st_heads, std::int64_t ld_st, PrefetchCursor& cursor,
                      std::int64_t per_row, bool prefetch_keys) {
  constexpr int KB = ScoreKeyBlock<R>();
  const auto n = static_cast<std::int64_t>(hn::Lanes(d));
  const std::int64_t full = HWY_TARGET == HWY_SCALAR ? 0 : dim - dim % n;
  HWY_ALIGN float acc_buffer[kDecodeMaxRows * 16 * 16];  // [r][t][lanes]
  float tails[kDecodeMaxRows][16];
  float* outs[16] = {};
  std::int64_t t = 0;  // rows waiting in acc_buffer
  const auto flush = [&] {
    for (std::int64_t r = 0; r < R; ++r) {
#if HWY_TARGET != HWY_SCALAR
      if (t == n) {
        VF vecs[16];
        for (std::int64_t u = 0; u < n; ++u) vecs[u] = hn::Load(d, acc_buffer + (r * 16 + u) * n);
        HWY_ALIGN float sums[16];
        hn::Store(SumEachVector(d, vecs), d, sums);
        for (std::int64_t u = 0; u < n; ++u) outs[u][r] = sums[u] + tails[r][u];
        continue;
      }
#endif
      for (std::int64_t u = 0; u < t; ++u) {
        outs[u][r] = hn::GetLane(hn::SumOfLanes(d, hn::Load(d, acc_buffer + (r * 16 + u) * n))) + tails[r][u];
      }
    }
    t = 0;
  };
  for (std::int64_t j0 = 0; j0 < keys; j0 += KB) {
    const std::int64_t block = std::min<std::int64_t>(KB, keys - j0);
    for (std::int64_t g = 0; g < heads; ++g) {
      if (t + block > n) flush();
      const float* kr = k + j0 * ldk + g * k_head_stride;
      const float* qg = q_heads[g];
      for (std::int64_t i = 0; i < block; ++i) {
        if (prefetch_keys) PrefetchKeyRowAhead(kr + i * ldk, dim * static_cast<std::int64_t>(sizeof(float)));
        outs[t + i] = st_heads[g] + (j0 + i) * ld_st;
        for (std::int64_t r = 0; r < R; ++r) {
          float extra = 0;
          for (std::int64_t c = full; c < dim; ++c) extra += kr[i * ldk + c] * qg[r * ldq + c];
          tails[r][t + i] = extra;
        }
      }
      cursor.step(per_row * block);
      if (block == KB) {
        ScoreKeys<R, KB>(d, kr, ldk, qg, ldq, full, acc_buffer + t * n);
      } else {
        for (std::int64_t i = 0; i < block; ++i)
          ScoreKeys<R, 1>(d, kr + i * ldk, ldk, qg, ldq, full, acc_buffer + (t + i) * n);
      }
      t += block;
      if (t == n) flush();
    }
  }
  flush();
}

#if HWY_TARGET != HWY_SCALAR
// acc[i·R + r] += kv[i]·q_r[c …] for KB keys and R query rows: each query vector loaded once.
template <int R, int KB>
HWY_INLINE void MulKeysIntoRows(DF d, const VF* kv, const float* HWY_RESTRICT qg, std::int64_t ldq, std::int64_t c,
                                VF* acc) {
  for (int r = 0; r < R; ++r) {
    const VF qv = hn::LoadU(d, qg + r * ldq + c);
    for (int i = 0; i < KB; ++i) acc[i * R + r] = hn::MulAdd(kv[i], qv, acc[i * R + r]);
  }
}

// The lanes' sums of acc (SumEachVector) as scores: key i's R rows at out + i·ld_st.
template <int R, int KB>
HWY_INLINE void StoreKeyScores(DF d, VF* acc, float* out, std::int64_t ld_st) {
  HWY_ALIGN float sums[hn::MaxLanes(DF())];
  hn::Store(SumEachVector(d, acc), d, sums);
  for (int i = 0; i < KB; ++i) std::memcpy(out + i * ld_st, sums + i * R, R * sizeof(float));
}
#endif

#if HWY_TARGET != HWY_SCALAR
// The scores when R <= lanes and the dimension fills whole vectors: blocks of KB = ⌊lanes / R⌋
// keys of one head, the R·KB accumulators (u = i·R + r: key i, row r; the lanes − R·KB others stay
// zero) summed across lanes in registers by SumEachVector, whose lane u is then score (key i, row
// r) — R consecutive floats of each key's row in S^T, copied out per key. R = 5, 6, 7 (Qwen's
// 40/8 and 28/4 query/KV heads) leave 1–4 of 16 accumulators idle. (DecodeScoresRows instead stores the
// accumulators, gathers `lanes` rows of them and scatters each sum with its scalar tail: with the
// per-row bookkeeping, about twice the multiply-adds' time when the cache lines are at hand.)
//
// With kRotate, key j is first rotated by the RoPE of its table row (`rotation`), in registers, so
// that an un-rotated cache is read in place like any other. Half-split: each pair of vectors
// (c, c + half) of the key is rotated and multiplied into the query's pair (the sums then run
// over the pairs in the order c, c + half, c + lanes, …, not over d in order). Interleaved: each
// vector is rotated alone, k ⊙ C + Reverse2(k) ⊙ S (Reverse2 swaps the lanes of each pair), and
// the sums run over d in order.
template <int R, DType kType, bool kRotate>
void DecodeScoresPacked(DF d, const CacheElement<kType>* HWY_RESTRICT k, std::int64_t ldk, std::int64_t k_head_stride,
                        std::int64_t keys, std::int64_t heads, const float* const* q_heads, std::int64_t ldq,
                        std::int64_t dim, float* const* st_heads, std::int64_t ld_st, PrefetchCursor& cursor,
                        std::int64_t per_row, bool prefetch_keys, const KeyRotation& rotation) {
  constexpr auto kLanes = static_cast<std::int64_t>(hn::MaxLanes(DF()));
  constexpr int KB = static_cast<int>(kLanes) / R;
  static_assert(KB >= 1);
  const std::int64_t whole = keys - keys % KB;
  const std::int64_t half = kRotate ? rotation.half : 0;
  const bool interleaved = kRotate && rotation.interleaved;
  // Half-split rows are [cos(half) | sin(half)], interleaved ones [C(2·half) | S(2·half)].
  const std::int64_t row_floats = interleaved ? 4 * half : 2 * half, sin_at = interleaved ? 2 * half : half;
  for (std::int64_t j0 = 0; j0 < whole; j0 += KB) {
    const float* cos_sin[KB] = {};
    for (int i = 0; kRotate && i < KB; ++i) cos_sin[i] = rotation.cos_sin + rotation.table_rows[j0 + i] * row_floats;
    for (std::int64_t g = 0; g < heads; ++g) {
      const CacheElement<kType>* kr = k + j0 * ldk + g * k_head_stride;
      const float* HWY_RESTRICT qg = q_heads[g];
      for (int i = 0; prefetch_keys && i < KB; ++i) {
        PrefetchKeyRowAhead(kr + i * ldk, dim * static_cast<std::int64_t>(sizeof(CacheElement<kType>)));
      }
      cursor.step(per_row * KB);
      VF acc[kLanes];
      for (auto& a : acc) a = hn::Zero(d);
      for (std::int64_t c = 0; interleaved && c < 2 * half; c += kLanes) {
        VF kv[KB];
        for (int i = 0; i < KB; ++i)
          kv[i] = RotateInterleaved(d, LoadCache<kType>(d, kr + i * ldk + c), cos_sin[i] + c, sin_at);
        MulKeysIntoRows<R, KB>(d, kv, qg, ldq, c, acc);
      }
      for (std::int64_t c = 0; kRotate && !interleaved && c < half; c += kLanes) {
        VF lo[KB], hi[KB];
        for (int i = 0; i < KB; ++i) {
          RotatePair(LoadCache<kType>(d, kr + i * ldk + c), LoadCache<kType>(d, kr + i * ldk + half + c),
                     hn::LoadU(d, cos_sin[i] + c), hn::LoadU(d, cos_sin[i] + half + c), lo[i], hi[i]);
        }
        for (int r = 0; r < R; ++r) {
          const VF q_lo = hn::LoadU(d, qg + r * ldq + c), q_hi = hn::LoadU(d, qg + r * ldq + half + c);
          for (int i = 0; i < KB; ++i)
            acc[i * R + r] = hn::MulAdd(hi[i], q_hi, hn::MulAdd(lo[i], q_lo, acc[i * R + r]));
        }
      }
      for (std::int64_t c = 2 * half; c < dim; c += kLanes) {
        VF kv[KB];
        for (int i = 0; i < KB; ++i) kv[i] = LoadCache<kType>(d, kr + i * ldk + c);
        MulKeysIntoRows<R, KB>(d, kv, qg, ldq, c, acc);
      }
      StoreKeyScores<R, KB>(d, acc, st_heads[g] + j0 * ld_st, ld_st);
    }
  }
  // The last keys % KB keys: one at a time.
  for (std::int64_t j = whole; j < keys; ++j) {
    const float* cos_sin = kRotate ? rotation.cos_sin + rotation.table_rows[j] * row_floats : nullptr;
    for (std::int64_t g = 0; g < heads; ++g) {
      const CacheElement<kType>* kr = k + j * ldk + g * k_head_stride;
      cursor.step(per_row);
      for (int r = 0; r < R; ++r) {
        const float* qr = q_heads[g] + r * ldq;
        VF acc = hn::Zero(d);
        for (std::int64_t c = 0; interleaved && c < 2 * half; c += kLanes) {
          acc = hn::MulAdd(RotateInterleaved(d, LoadCache<kType>(d, kr + c), cos_sin + c, sin_at), hn::LoadU(d, qr + c),
                           acc);
        }
        for (std::int64_t c = 0; kRotate && !interleaved && c < half; c += kLanes) {
          VF lo, hi;
          RotatePair(LoadCache<kType>(d, kr + c), LoadCache<kType>(d, kr + half + c), hn::LoadU(d, cos_sin + c),
                     hn::LoadU(d, cos_sin + half + c), lo, hi);
          acc = hn::MulAdd(hi, hn::LoadU(d, qr + half + c), hn::MulAdd(lo, hn::LoadU(d, qr + c), acc));
        }
        for (std::int64_t c = 2 * half; c < dim; c += kLanes)
          acc = hn::MulAdd(LoadCache<kType>(d, kr + c), hn::LoadU(d, qr + c), acc);
        st_heads[g][j * ld_st + r] = hn::GetLane(hn::SumOfLanes(d, acc));
      }
    }
  }
}
#endif

// Whether a tile's values are summed key by key over every KV head (KeyMajorValues): the cache
// is then read in its memory order, which the hardware prefetchers follow (a head's column
// blocks walk the tile's keys a key row apart, a page apart at 8 KV heads × D 128). The output
// rows are then loaded and stored per key, R·D/lanes vectors, so only while R <= lanes / 8 (about
// 16 stores per KiB of values at D 128); with more rows register accumulators per head
// (ValueRows) do better. (Zen 5, D 128, 32768 keys, 2 threads, against ValueRows: 1.3–1.5× the
// bandwidth at 1–2 rows per head on AVX-512 and 1 row on AVX2; at 32 stores per KiB, AVX-512's
// 4 rows and AVX2's 2, key by key still measured 1.05–1.3×, but a core with half-rate 512-bit
// stores (Zen 4) would then spend as long on them as AVX2's 4 rows, 0.84×.)
// A cache of one KV head is read in memory order either way. At most 2 rows, the kernels there
// are (wider vectors than AVX-512's keep ValueRows beyond).
HWY_INLINE bool ValuesKeyMajor(std::int64_t rows, std::int64_t heads) {
  return HWY_TARGET != HWY_SCALAR && heads > 1 && rows <= 2 && rows * 8 <= static_cast<std::int64_t>(hn::Lanes(DF()));
}

// Whether the packed scores kernel takes q_rows rows per head at this dim on this target.
HWY_INLINE bool PackedScoresFit(std::int64_t q_rows, std::int64_t dim) {
#if HWY_TARGET != HWY_SCALAR
  constexpr auto kLanes = static_cast<std::int64_t>(hn::MaxLanes(DF()));
  // SumEachVector sums at most 16 vectors (one per lane); 1 <= q_rows <= min(8, lanes).
  return static_cast<std::int64_t>(hn::Lanes(DF())) == kLanes && kLanes <= 16 && dim % kLanes == 0 && q_rows >= 1 &&
         q_rows <= 8 && q_rows <= kLanes;
#else
  (void)q_rows;
  (void)dim;
  return false;
#endif
}

// Whether decode reads a cache of `dtype` directly on this target (else the engine widens each
// tile into f32 scratch first): f32 always; bf16 and f16 where the packed scores kernel fits and
// the target widens them in vectors.
bool AttnDecodeReadsDirectly(DType dtype, std::int64_t q_rows, std::int64_t dim) {
  return dtype == DType::kF32 || (WidensInVectors(dtype) && PackedScoresFit(q_rows, dim));
}

// Whether the packed scores can also rotate the keys: half-split halves, or the interleaved
// rotated dims, filling whole vectors.
bool AttnDecodeRotatesKeys(DType dtype, std::int64_t q_rows, std::int64_t dim, std::int64_t half, bool interleaved) {
  const auto lanes = static_cast<std::int64_t>(hn::Lanes(DF()));
  return half > 0 && (interleaved ? 2 * half : half) % lanes == 0 && 2 * half <= dim && PackedScoresFit(q_rows, dim) &&
         WidensInVectors(dtype);
}

template <DType kType>
void DecodeScoresPackedRows(DF d, const CacheElement<kType>* HWY_RESTRICT k, std::int64_t ldk,
                            std::int64_t k_head_stride, std::int64_t keys, std::int64_t heads,
                            const float* const* q_heads, std::int64_t ldq, std::int64_t q_rows, std::int64_t dim,
                            float* const* st_heads, std::int64_t ld_st, PrefetchCursor& cursor, std::int64_t per_row,
                            bool prefetch_keys, const KeyRotation& rotation) {
#if HWY_TARGET != HWY_SCALAR
  constexpr auto kLanes = static_cast<std::int64_t>(hn::MaxLanes(DF()));
  if constexpr (!WidensInVectors<kType>()) return;  // never asked (AttnDecodeReadsDirectly)
  switch (q_rows) {
#define POSENC_DECODE_PACKED(R)                                                                                        \
  case R:                                                                                                              \
    if constexpr (kLanes >= R) {                                                                                       \
      if (rotation.cos_sin != nullptr) {                                                                               \
        DecodeScoresPacked<R, kType, true>(d, k, ldk, k_head_stride, keys, heads, q_heads, ldq, dim, st_heads, ld_st,  \
                                           cursor, per_row, prefetch_keys, rotation);                                  \
      } else {                                                                                                         \
        DecodeScoresPacked<R, kType, false>(d, k, ldk, k_head_stride, keys, heads, q_heads, ldq, dim, st_heads, ld_st, \
                                            cursor, per_row, prefetch_keys, rotation);                                 \
      }                                                                                                                \
    }                                                                                                                  \
    break;
    POSENC_DECODE_PACKED(1)
    POSENC_DECODE_PACKED(2)
    POSENC_DECODE_PACKED(3)
    POSENC_DECODE_PACKED(4)
    POSENC_DECODE_PACKED(5)
    POSENC_DECODE_PACKED(6)
    POSENC_DECODE_PACKED(7)
    POSENC_DECODE_PACKED(8)
#undef POSENC_DECODE_PACKED
    default:
      break;  // more than 8 rows: PackedScoresFit is false
  }
#else
  (void)d, (void)k, (void)ldk, (void)k_head_stride, (void)keys, (void)heads, (void)q_heads, (void)ldq, (void)q_rows;
  (void)dim, (void)st_heads, (void)ld_st, (void)cursor, (void)per_row, (void)prefetch_keys, (void)rotation;
#endif
}

void AttnDecodeScores(const void* HWY_RESTRICT k, DType dtype, std::int64_t ldk, std::int64_t k_head_stride,
                      std::int64_t keys, std::int64_t heads, const float* const* q_heads, std::int64_t ldq,
                      std::int64_t q_rows, std::int64_t dim, float* const* st_heads, std::int64_t ld_st,
                      const RowPrefetch& ahead, bool prefetch_keys, const KeyRotation& rotation) {
  const DF d;
  // Values summed key-major are left to the hardware prefetchers: prefetching them here as well
  // cost a fifth of the decode's bandwidth.
  PrefetchCursor cursor(ValuesKeyMajor(q_rows, heads) ? RowPrefetch{} : ahead);
  const std::int64_t per_row = LinesPerStep(cursor.lines(), keys * heads);
  if (dtype != DType::kF32) {
    const auto* k16 = static_cast<const std::uint16_t*>(k);
    const auto scores =
        dtype == DType::kBF16 ? &DecodeScoresPackedRows<DType::kBF16> : &DecodeScoresPackedRows<DType::kF16>;
    scores(d, k16, ldk, k_head_stride, keys, heads, q_heads, ldq, q_rows, dim, st_heads, ld_st, cursor, per_row,
           prefetch_keys, rotation);
    cursor.step(cursor.lines());
    return;
  }
  const auto* kf = static_cast<const float*>(k);
  if (PackedScoresFit(q_rows, dim)) {
    DecodeScoresPackedRows<DType::kF32>(d, kf, ldk, k_head_stride, keys, heads, q_heads, ldq, q_rows, dim, st_heads,
                                        ld_st, cursor, per_row, prefetch_keys, rotation);
    cursor.step(cursor.lines());
    return;
  }
  switch (q_rows) {
#define POSENC_DECODE_SCORES(R)                                                                                      \
  case R:                                                                                                            \
    DecodeScoresRows<R>(d, kf, ldk, k_head_stride, keys, heads, q_heads, ldq, dim, st_heads, ld_st, cursor, per_row, \
                        prefetch_keys);                                                                              \
    break;
    POSENC_DECODE_SCORES(1)
    POSENC_DECODE_SCORES(2)
    POSENC_DECODE_SCORES(3)
    POSENC_DECODE_SCORES(4)
    POSENC_DECODE_SCORES(5)
    POSENC_DECODE_SCORES(6)
    POSENC_DECODE_SCORES(7)
#undef POSENC_DECODE_SCORES
    default:
      DecodeScoresRows<8>(d, kf, ldk, k_head_stride, keys, heads, q_heads, ldq, dim, st_heads, ld_st, cursor, per_row,
                          prefetch_keys);
      break;
  }
  cursor.step(cursor.lines());  // nothing is left unless the tile was empty
}

constexpr std::int64_t kValueKeysPerStep = 8;

// o[r][c0 + v·lanes …] += Σ_j p[j·ld_p + r]·v_j[c0 + v·lanes …] for r < R, v < V: R·V
// accumulators in registers across the keys, each value vector loaded once per key
// (load_key(j, vv) fills vv[0 … V) with key j's vectors).
template <int R, int V, class LoadKey>
HWY_INLINE void ValueColumnsOf(DF d, std::int64_t keys, const float* HWY_RESTRICT p, std::int64_t ld_p,
                               float* HWY_RESTRICT o, std::int64_t ldo, PrefetchCursor& cursor, std::int64_t per_key,
                               const LoadKey& load_key) {
  const auto n = static_cast<std::int64_t>(hn::Lanes(d));
  VF acc[R][V];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < V; ++c) acc[r][c] = hn::LoadU(d, o + r * ldo + c * n);
  }
  // The cursor steps once per kValueKeysPerStep keys: its call spills the R·V accumulators
  // (every vector register is caller-saved), which per key cost more than the prefetches gained.
  for (std::int64_t j0 = 0; j0 < keys; j0 += kValueKeysPerStep) {
    const std::int64_t j1 = std::min(keys, j0 + kValueKeysPerStep);
    for (std::int64_t j = j0; j < j1; ++j) {
      VF vv[V];
      load_key(j, vv);
      for (int r = 0; r < R; ++r) {
        const VF pr = hn::Set(d, p[j * ld_p + r]);
        for (int c = 0; c < V; ++c) acc[r][c] = hn::MulAdd(pr, vv[c], acc[r][c]);
      }
    }
    cursor.step(per_key * (j1 - j0));
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < V; ++c) hn::StoreU(acc[r][c], d, o + r * ldo + c * n);
  }
}

template <int R, int V, DType kType>
HWY_INLINE void ValueColumns(DF d, const CacheElement<kType>* HWY_RESTRICT v, std::int64_t ldv, std::int64_t keys,
                             const float* HWY_RESTRICT p, std::int64_t ld_p, float* HWY_RESTRICT o, std::int64_t ldo,
                             PrefetchCursor& cursor, std::int64_t per_key) {
  const auto n = static_cast<std::int64_t>(hn::Lanes(d));
  ValueColumnsOf<R, V>(d, keys, p, ld_p, o, ldo, cursor, per_key, [&](std::int64_t j, VF* vv) {
    for (int c = 0; c < V; ++c) vv[c] = LoadCache<kType>(d, v + j * ldv + c * n);
  });
}

// Vectors per column block of R rows: 4 while R·4 accumulators fit beside the loads in AVX-512's 32
// registers, else 2.
constexpr int ValueBlockVectors(std::int64_t rows) {
  return HWY_TARGET == HWY_SCALAR ? 1 : (rows <= 4 && HWY_MAX_BYTES >= 64) ? 4 : 2;
}
// Column blocks (of either width) of one head's rows, for spreading the prefetches.
HWY_INLINE std::int64_t ValueBlocks(std::int64_t rows, std::int64_t cols, std::int64_t lanes) {
  const std::int64_t wide = ValueBlockVectors(rows) * lanes;
  return cols / wide + (cols % wide) / lanes;
}

// Column blocks of one head's rows: ValueBlockVectors(R) vectors at a time, then single vectors,
// then scalar columns.
template <int R, DType kType>
HWY_INLINE void ValueRows(DF d, const CacheElement<kType>* HWY_RESTRICT v, std::int64_t ldv, std::int64_t keys,
                          const float* HWY_RESTRICT p, std::int64_t ld_p, std::int64_t cols, float* HWY_RESTRICT o,
                          std::int64_t ldo, PrefetchCursor& cursor, std::int64_t per_key) {
  const auto n = static_cast<std::int64_t>(hn::Lanes(d));
  constexpr int kWide = ValueBlockVectors(R);
  std::int64_t c = 0;
  for (; c + kWide * n <= cols; c += kWide * n) {
    ValueColumns<R, kWide, kType>(d, v + c, ldv, keys, p, ld_p, o + c, ldo, cursor, per_key);
  }
  for (; c + n <= cols; c += n) ValueColumns<R, 1, kType>(d, v + c, ldv, keys, p, ld_p, o + c, ldo, cursor, per_key);
  // Scalar columns: f32 only (a 16-bit cache is read directly only when the columns fill whole
  // vectors, AttnDecodeReadsDirectly).
  if constexpr (kType != DType::kF32) return;
  for (; c < cols; ++c) {
    for (int r = 0; r < R; ++r) {
      float sum = o[r * ldo + c];
      for (std::int64_t j = 0; j < keys; ++j) sum = std::fma(p[j * ld_p + r], v[j * ldv + c], sum);
      o[r * ldo + c] = sum;
    }
  }
}

// o_g[r] += Σ_j p_g[j·ld_p + r]·v_{j,g} key by key, every KV head g of a key before the next key
// (the cache's memory order); the output rows stay in L1. Each column still sums its keys in
// order, with the multiply-adds of ValueRows, so the results are the same bits.
template <int R, DType kType>
void KeyMajorValues(DF d, const CacheElement<kType>* HWY_RESTRICT v, std::int64_t ldv, std::int64_t v_head_stride,
                    std::int64_t keys, std::int64_t heads, const float* const* p_heads, std::int64_t ld_p,
                    std::int64_t cols, float* const* o_heads, std::int64_t ldo, PrefetchCursor& cursor,
                    std::int64_t per_key) {
  const auto n = static_cast<std::int64_t>(hn::Lanes(d));
  const std::int64_t full = HWY_TARGET == HWY_SCALAR ? 0 : cols - cols % n;
  for (std::int64_t j = 0; j < keys; ++j) {
    for (std::int64_t g = 0; g < heads; ++g) {
      const CacheElement<kType>* HWY_RESTRICT vr = v + j * ldv + g * v_head_stride;
      const float* p = p_heads[g] + j * ld_p;
      float* HWY_RESTRICT o = o_heads[g];
      VF pr[R];
      for (int r = 0; r < R; ++r) pr[r] = hn::Set(d, p[r]);
      for (std::int64_t c = 0; c < full; c += n) {
        const VF vv = LoadCache<kType>(d, vr + c);
        for (int r = 0; r < R; ++r)
          hn::StoreU(hn::MulAdd(pr[r], vv, hn::LoadU(d, o + r * ldo + c)), d, o + r * ldo + c);
      }
      // Scalar columns: f32 only (a 16-bit cache is read directly only when the columns fill
      // whole vectors, AttnDecodeReadsDirectly).
      if constexpr (kType == DType::kF32) {
        for (std::int64_t c = full; c < cols; ++c) {
          for (int r = 0; r < R; ++r) o[r * ldo + c] = std::fma(p[r], vr[c], o[r * ldo + c]);
        }
      }
      cursor.step(per_key);
    }
  }
}

template <DType kType>
void DecodeValuesRows(DF d, const CacheElement<kType>* HWY_RESTRICT v, std::int64_t ldv, std::int64_t v_head_stride,
                      std::int64_t keys, std::int64_t heads, const float* const* p_heads, std::int64_t ld_p,
                      std::int64_t rows, std::int64_t cols, float* const* o_heads, std::int64_t ldo,
                      PrefetchCursor& cursor, std::int64_t per_key) {
  if constexpr (!WidensInVectors<kType>()) return;  // never asked (AttnDecodeReadsDirectly)
  switch (ValuesKeyMajor(rows, heads) ? rows : 0) {
#define POSENC_KEY_MAJOR_VALUES(R)                                                                             \
  case R:                                                                                                      \
    KeyMajorValues<R, kType>(d, v, ldv, v_head_stride, keys, heads, p_heads, ld_p, cols, o_heads, ldo, cursor, \
                             per_key);                                                                         \
    return;
    POSENC_KEY_MAJOR_VALUES(1)
    POSENC_KEY_MAJOR_VALUES(2)
#undef POSENC_KEY_MAJOR_VALUES
    default:
      break;
  }
  for (std::int64_t g = 0; g < heads; ++g) {
    const CacheElement<kType>* vg = v + g * v_head_stride;
    const float* p = p_heads[g];
    float* o = o_heads[g];
    switch (rows) {
      case 1:
        ValueRows<1, kType>(d, vg, ldv, keys, p, ld_p, cols, o, ldo, cursor, per_key);
        break;
      case 2:
        ValueRows<2, kType>(d, vg, ldv, keys, p, ld_p, cols, o, ldo, cursor, per_key);
        break;
      case 3:
        ValueRows<3, kType>(d, vg, ldv, keys, p, ld_p, cols, o, ldo, cursor, per_key);
        break;
      case 4:
        ValueRows<4, kType>(d, vg, ldv, keys, p, ld_p, cols, o, ldo, cursor, per_key);
        break;
      case 5:
        ValueRows<5, kType>(d, vg, ldv, keys, p, ld_p, cols, o, ldo, cursor, per_key);
        break;
      case 6:
        ValueRows<6, kType>(d, vg, ldv, keys, p, ld_p, cols, o, ldo, cursor, per_key);
        break;
      case 7:
        ValueRows<7, kType>(d, vg, ldv, keys, p, ld_p, cols, o, ldo, cursor, per_key);
        break;
      default:
        ValueRows<8, kType>(d, vg, ldv, keys, p, ld_p, cols, o, ldo, cursor, per_key);
        break;
    }
  }
}

void AttnDecodeValues(const void* HWY_RESTRICT v, DType dtype, std::int64_t ldv, std::int64_t v_head_stride,
                      std::int64_t keys, std::int64_t heads, const float* const* p_heads, std::int64_t ld_p,
                      std::int64_t rows, std::int64_t cols, float* const* o_heads, std::int64_t ldo,
                      const RowPrefetch& ahead) {
  const DF d;
  const auto n = static_cast<std::int64_t>(hn::Lanes(d));
  PrefetchCursor cursor(ahead);
  // Steps: one per key of every head (key-major), else one per key per column block of every head.
  const std::int64_t steps = heads * keys * (ValuesKeyMajor(rows, heads) ? 1 : ValueBlocks(rows, cols, n));
  const std::int64_t per_key = LinesPerStep(cursor.lines(), steps);
  if (dtype != DType::kF32) {
    const auto values = dtype == DType::kBF16 ? &DecodeValuesRows<DType::kBF16> : &DecodeValuesRows<DType::kF16>;
    values(d, static_cast<const std::uint16_t*>(v), ldv, v_head_stride, keys, heads, p_heads, ld_p, rows, cols, o_heads,
           ldo, cursor, per_key);
  } else {
    DecodeValuesRows<DType::kF32>(d, static_cast<const float*>(v), ldv, v_head_stride, keys, heads, p_heads, ld_p, rows,
                                  cols, o_heads, ldo, cursor, per_key);
  }
  cursor.step(cursor.lines());
}

// ─── Quantized caches (quantized.hpp), read where they lie ─────────────────────────────────────
// Each vector of a row is dequantised in registers (QuantRow, quant_row-inl.h: the values of
// posenc::dequantize_rows) and then meets the same multiply-adds, in the same order, as the f32
// kernels above give the f32 cache of those values (DecodeScoresPacked without rotation,
// KeyMajorValues, ValueColumns): the same bits. Row pointers and strides count bytes.
#if HWY_TARGET != HWY_SCALAR
// DecodeScoresPacked<R, f32, no rotation> on a quantized cache.
template <int R, CacheFormat kFormat>
void QuantScoresPacked(DF d, const unsigned char* HWY_RESTRICT k, std::int64_t ldk, std::int64_t k_head_stride,
                       std::int64_t keys, std::int64_t heads, const float* const* q_heads, std::int64_t ldq,
                       std::int64_t dim, float* const* st_heads, std::int64_t ld_st, PrefetchCursor& cursor,
                       std::int64_t per_row, bool prefetch_keys, std::int64_t row_bytes) {
  using Q = QuantRow<kFormat>;
  constexpr auto kLanes = static_cast<std::int64_t>(hn::MaxLanes(DF()));
  constexpr int KB = static_cast<int>(kLanes) / R;
  static_assert(KB >= 1);
  const std::int64_t whole = keys - keys % KB;
  for (std::int64_t j0 = 0; j0 < whole; j0 += KB) {
    for (std::int64_t g = 0; g < heads; ++g) {
      const unsigned char* kr = k + j0 * ldk + g * k_head_stride;
      const float* HWY_RESTRICT qg = q_heads[g];
      for (int i = 0; prefetch_keys && i < KB; ++i) PrefetchKeyRowAhead(kr + i * ldk, row_bytes);
      cursor.step(per_row * KB);
      VF acc[kLanes];
      for (auto& a : acc) a = hn::Zero(d);
      VF scale[KB];
      for (std::int64_t c = 0; c < dim; c += kLanes) {
        if (c % Q::kGroup == 0) {
          for (int i = 0; i < KB; ++i) scale[i] = Q::Scale(d, kr + i * ldk, c);
        }
        VF kv[KB];
        for (int i = 0; i < KB; ++i) kv[i] = Q::Load(d, kr + i * ldk, c, scale[i]);
        MulKeysIntoRows<R, KB>(d, kv, qg, ldq, c, acc);
      }
      StoreKeyScores<R, KB>(d, acc, st_heads[g] + j0 * ld_st, ld_st);
    }
  }
  for (std::int64_t j = whole; j < keys; ++j) {
    for (std::int64_t g = 0; g < heads; ++g) {
      const unsigned char* kr = k + j * ldk + g * k_head_stride;
      cursor.step(per_row);
      for (int r = 0; r < R; ++r) {
        const float* qr = q_heads[g] + r * ldq;
        VF acc = hn::Zero(d), scale = hn::Zero(d);
        for (std::int64_t c = 0; c < dim; c += kLanes) {
          if (c % Q::kGroup == 0) scale = Q::Scale(d, kr, c);
          acc = hn::MulAdd(Q::Load(d, kr, c, scale), hn::LoadU(d, qr + c), acc);
        }
        st_heads[g][j * ld_st + r] = hn::GetLane(hn::SumOfLanes(d, acc));
      }
    }
  }
}

// ValueColumns on a quantized cache: columns [c0, c0 + V·lanes) of every key's row.
template <int R, int V, CacheFormat kFormat>
HWY_INLINE void QuantValueColumns(DF d, const unsigned char* HWY_RESTRICT v, std::int64_t ldv, std::int64_t c0,
                                  std::int64_t keys, const float* HWY_RESTRICT p, std::int64_t ld_p,
                                  float* HWY_RESTRICT o, std::int64_t ldo, PrefetchCursor& cursor,
                                  std::int64_t per_key) {
  using Q = QuantRow<kFormat>;
  const auto n = static_cast<std::int64_t>(hn::Lanes(d));
  ValueColumnsOf<R, V>(d, keys, p, ld_p, o, ldo, cursor, per_key, [&](std::int64_t j, VF* vv) {
    const unsigned char* row = v + j * ldv;
    VF scale = Q::Scale(d, row, c0);
    for (int c = 0; c < V; ++c) {
      const std::int64_t col = c0 + c * n;
      if (c > 0 && col % Q::kGroup == 0) scale = Q::Scale(d, row, col);
      vv[c] = Q::Load(d, row, col, scale);
    }
  });
}

template <int R, CacheFormat kFormat>
HWY_INLINE void QuantValueRows(DF d, const unsigned char* HWY_RESTRICT v, std::int64_t ldv, std::int64_t keys,
                               const float* HWY_RESTRICT p, std::int64_t ld_p, std::int64_t cols, float* HWY_RESTRICT o,
                               std::int64_t ldo, PrefetchCursor& cursor, std::int64_t per_key) {
  const auto n = static_cast<std::int64_t>(hn::Lanes(d));
  constexpr int kWide = ValueBlockVectors(R);
  std::int64_t c = 0;
  for (; c + kWide * n <= cols; c += kWide * n)
    QuantValueColumns<R, kWide, kFormat>(d, v, ldv, c, keys, p, ld_p, o + c, ldo, cursor, per_key);
  for (; c + n <= cols; c += n)
    QuantValueColumns<R, 1, kFormat>(d, v, ldv, c, keys, p, ld_p, o + c, ldo, cursor, per_key);
}

// KeyMajorValues on a quantized cache.
template <int R, CacheFormat kFormat>
void QuantKeyMajorValues(DF d, const unsigned char* HWY_RESTRICT v, std::int64_t ldv, std::int64_t v_head_stride,
                         std::int64_t keys, std::int64_t heads, const float* const* p_heads, std::int64_t ld_p,
                         std::int64_t cols, float* const* o_heads, std::int64_t ldo, PrefetchCursor& cursor,
                         std::int64_t per_key) {
  using Q = QuantRow<kFormat>;
  const auto n = static_cast<std::int64_t>(hn::Lanes(d));
  for (std::int64_t j = 0; j < keys; ++j) {
    for (std::int64_t g = 0; g < heads; ++g) {
      const unsigned char* HWY_RESTRICT vr = v + j * ldv + g * v_head_stride;
      const float* p = p_heads[g] + j * ld_p;
      float* HWY_RESTRICT o = o_heads[g];
      VF pr[R];
      for (int r = 0; r < R; ++r) pr[r] = hn::Set(d, p[r]);
      VF scale = hn::Zero(d);
      for (std::int64_t c = 0; c < cols; c += n) {
        if (c % Q::kGroup == 0) scale = Q::Scale(d, vr, c);
        const VF vv = Q::Load(d, vr, c, scale);
        for (int r = 0; r < R; ++r)
          hn::StoreU(hn::MulAdd(pr[r], vv, hn::LoadU(d, o + r * ldo + c)), d, o + r * ldo + c);
      }
      cursor.step(per_key);
    }
  }
}

template <CacheFormat kFormat>
void QuantDecodeScores(DF d, const unsigned char* k, std::int64_t ldk, std::int64_t k_head_stride, std::int64_t keys,
                       std::int64_t heads, const float* const* q_heads, std::int64_t ldq, std::int64_t q_rows,
                       std::int64_t dim, float* const* st_heads, std::int64_t ld_st, PrefetchCursor& cursor,
                       std::int64_t per_row, bool prefetch_keys, std::int64_t row_bytes) {
  constexpr auto kLanes = static_cast<std::int64_t>(hn::MaxLanes(DF()));
  switch (q_rows) {
#define POSENC_QUANT_SCORES(R)                                                                                         \
  case R:                                                                                                              \
    if constexpr (kLanes >= R) {                                                                                       \
      QuantScoresPacked<R, kFormat>(d, k, ldk, k_head_stride, keys, heads, q_heads, ldq, dim, st_heads, ld_st, cursor, \
                                    per_row, prefetch_keys, row_bytes);                                                \
    }                                                                                                                  \
    break;
    POSENC_QUANT_SCORES(1)
    POSENC_QUANT_SCORES(2)
    POSENC_QUANT_SCORES(3)
    POSENC_QUANT_SCORES(4)
    POSENC_QUANT_SCORES(5)
    POSENC_QUANT_SCORES(6)
    POSENC_QUANT_SCORES(7)
    POSENC_QUANT_SCORES(8)
#undef POSENC_QUANT_SCORES
    default:
      break;  // AttnDecodeReadsQuantized is false
  }
}

template <CacheFormat kFormat>
void QuantDecodeValues(DF d, const unsigned char* v, std::int64_t ldv, std::int64_t v_head_stride, std::int64_t keys,
                       std::int64_t heads, const float* const* p_heads, std::int64_t ld_p, std::int64_t rows,
                       std::int64_t cols, float* const* o_heads, std::int64_t ldo, PrefetchCursor& cursor,
                       std::int64_t per_key) {
  switch (ValuesKeyMajor(rows, heads) ? rows : 0) {
    case 1:
      QuantKeyMajorValues<1, kFormat>(d, v, ldv, v_head_stride, keys, heads, p_heads, ld_p, cols, o_heads, ldo, cursor,
                                      per_key);
      return;
    case 2:
      QuantKeyMajorValues<2, kFormat>(d, v, ldv, v_head_stride, keys, heads, p_heads, ld_p, cols, o_heads, ldo, cursor,
                                      per_key);
      return;
    default:
      break;
  }
  for (std::int64_t g = 0; g < heads; ++g) {
    const unsigned char* vg = v + g * v_head_stride;
    switch (rows) {
#define POSENC_QUANT_VALUES(R)                                                                              \
  case R:                                                                                                   \
    QuantValueRows<R, kFormat>(d, vg, ldv, keys, p_heads[g], ld_p, cols, o_heads[g], ldo, cursor, per_key); \
    break;
      POSENC_QUANT_VALUES(1)
      POSENC_QUANT_VALUES(2)
      POSENC_QUANT_VALUES(3)
      POSENC_QUANT_VALUES(4)
      POSENC_QUANT_VALUES(5)
      POSENC_QUANT_VALUES(6)
      POSENC_QUANT_VALUES(7)
#undef POSENC_QUANT_VALUES
      default:
        QuantValueRows<8, kFormat>(d, vg, ldv, keys, p_heads[g], ld_p, cols, o_heads[g], ldo, cursor, per_key);
        break;
    }
  }
}
#endif

// Whether decode reads a quantized cache in place here: where the packed scores fit and whole
// vectors fill the row's groups (q8_0, q4_0: lanes divide 32; fp8: dim a multiple of lanes).
bool AttnDecodeReadsQuantized(CacheFormat format, std::int64_t q_rows, std::int64_t dim) {
#if HWY_TARGET != HWY_SCALAR
  const auto lanes = static_cast<std::int64_t>(hn::Lanes(DF()));
  (void)format;
  return PackedScoresFit(q_rows, dim) && 32 % lanes == 0;
#else
  (void)format, (void)q_rows, (void)dim;
  return false;
#endif
}

void AttnDecodeScoresQuantized(const void* HWY_RESTRICT k, CacheFormat format, std::int64_t ldk,
                               std::int64_t k_head_stride, std::int64_t keys, std::int64_t heads,
                               const float* const* q_heads, std::int64_t ldq, std::int64_t q_rows, std::int64_t dim,
                               float* const* st_heads, std::int64_t ld_st, const RowPrefetch& ahead,
                               bool prefetch_keys) {
#if HWY_TARGET != HWY_SCALAR
  const DF d;
  PrefetchCursor cursor(ValuesKeyMajor(q_rows, heads) ? RowPrefetch{} : ahead);
  const std::int64_t per_row = LinesPerStep(cursor.lines(), keys * heads);
  const auto* kb = static_cast<const unsigned char*>(k);
  const std::int64_t row_bytes = cache_row_bytes(format, dim);
  const auto scores = format == CacheFormat::kQ8_0   ? &QuantDecodeScores<CacheFormat::kQ8_0>
                      : format == CacheFormat::kQ4_0 ? &QuantDecodeScores<CacheFormat::kQ4_0>
                                                     : &QuantDecodeScores<CacheFormat::kFp8E4M3>;
  scores(d, kb, ldk, k_head_stride, keys, heads, q_heads, ldq, q_rows, dim, st_heads, ld_st, cursor, per_row,
         prefetch_keys, row_bytes);
  cursor.step(cursor.lines());
#else
  (void)k, (void)format, (void)ldk, (void)k_head_stride, (void)keys, (void)heads, (void)q_heads, (void)ldq;
  (void)q_rows, (void)dim, (void)st_heads, (void)ld_st, (void)ahead, (void)prefetch_keys;
#endif
}

void AttnDecodeValuesQuantized(const void* HWY_RESTRICT v, CacheFormat format, std::int64_t ldv,
                               std::int64_t v_head_stride, std::int64_t keys, std::int64_t heads,
                               const float* const* p_heads, std::int64_t ld_p, std::int64_t rows, std::int64_t cols,
                               float* const* o_heads, std::int64_t ldo, const RowPrefetch& ahead) {
#if HWY_TARGET != HWY_SCALAR
  const DF d;
  const auto n = static_cast<std::int64_t>(hn::Lanes(d));
  PrefetchCursor cursor(ahead);
  const std::int64_t steps = heads * keys * (ValuesKeyMajor(rows, heads) ? 1 : ValueBlocks(rows, cols, n));
  const std::int64_t per_key = LinesPerStep(cursor.lines(), steps);
  const auto* vb = static_cast<const unsigned char*>(v);
  const auto values = format == CacheFormat::kQ8_0   ? &QuantDecodeValues<CacheFormat::kQ8_0>
                      : format == CacheFormat::kQ4_0 ? &QuantDecodeValues<CacheFormat::kQ4_0>
                                                     : &QuantDecodeValues<CacheFormat::kFp8E4M3>;
  values(d, vb, ldv, v_head_stride, keys, heads, p_heads, ld_p, rows, cols, o_heads, ldo, cursor, per_key);
  cursor.step(cursor.lines());
#else
  (void)v, (void)format, (void)ldv, (void)v_head_stride, (void)keys, (void)heads, (void)p_heads, (void)ld_p;
  (void)rows, (void)cols, (void)o_heads, (void)ldo, (void)ahead;
#endif
}

void AttnLoadF32(const void* src, DType dtype, std::int64_t n, float* HWY_RESTRICT dst);
void AttnPackHeads(const void* src, DType dtype, std::int64_t seq_stride, std::int64_t head_stride, std::int64_t keys,
                   std::int64_t heads, std::int64_t dim, float* HWY_RESTRICT dst, std::int64_t dim_padded);

void AttnRotateHalfSplit(float* HWY_RESTRICT x, const float* HWY_RESTRICT c, const float* HWY_RESTRICT s,
                         std::int64_t half, float sine_sign) {
  const DF d;
  const auto n = static_cast<std::int64_t>(hn::Lanes(d));
  const VF sign = hn::Set(d, sine_sign);
  float* b = x + half;
  std::int64_t i = 0;
  for (; i + n <= half; i += n) {
    VF lo, hi;
    RotatePair(hn::LoadU(d, x + i), hn::LoadU(d, b + i), hn::LoadU(d, c + i), hn::Mul(sign, hn::LoadU(d, s + i)), lo,
               hi);
    hn::StoreU(lo, d, x + i);
    hn::StoreU(hi, d, b + i);
  }
  for (; i < half; ++i) {
    const float ai = x[i], bi = b[i], si = sine_sign * s[i];
    x[i] = ai * c[i] - bi * si;
    b[i] = bi * c[i] + ai * si;
  }
}

// AttnPackRotateHeads for a cache of kType whose pairs fill whole vectors: each pair rotated
// straight from the cache into the scratch row (RotatePair), the dims past 2·half copied.
template <DType kType>
void PackRotateInRegisters(const CacheElement<kType>* HWY_RESTRICT src, std::int64_t seq_stride,
                           std::int64_t head_stride, std::int64_t keys, std::int64_t heads, std::int64_t dim,
                           const float* HWY_RESTRICT cos_sin, const std::int64_t* HWY_RESTRICT table_rows,
                           std::int64_t half, float* HWY_RESTRICT dst, std::int64_t dim_padded) {
  const DF d;
  const auto n = static_cast<std::int64_t>(hn::Lanes(d));
  for (std::int64_t j = 0; j < keys; ++j) {
    const float* c = cos_sin + table_rows[j] * 2 * half;
    for (std::int64_t g = 0; g < heads; ++g) {
      const CacheElement<kType>* x = src + j * seq_stride + g * head_stride;
      float* row = dst + (j * heads + g) * dim_padded;
      for (std::int64_t i = 0; i < half; i += n) {
        VF lo, hi;
        RotatePair(LoadCache<kType>(d, x + i), LoadCache<kType>(d, x + half + i), hn::LoadU(d, c + i),
                   hn::LoadU(d, c + half + i), lo, hi);
        hn::StoreU(lo, d, row + i);
        hn::StoreU(hi, d, row + half + i);
      }
      if (dim > 2 * half) AttnLoadF32(x + 2 * half, kType, dim - 2 * half, row + 2 * half);
      for (std::int64_t t = dim; t < dim_padded; ++t) row[t] = 0.0f;
    }
  }
}

// AttnPackHeads, with every key's rows rotated by the half-split RoPE of its table row
// ([cos(half) | sin(half)] at cos_sin + table_rows[j]·2·half): the decode of an un-rotated cache
// when the scores cannot rotate it themselves (one dispatch per tile instead of one per row).
// In registers where the pairs fill whole vectors: widening the rows first and rotating them in
// place reads each value back right after storing it, and measured 62 cycles per row of D 128
// (perf, one thread, cache in L2) for 16 multiply-adds.
void AttnPackRotateHeads(const void* src, DType dtype, std::int64_t seq_stride, std::int64_t head_stride,
                         std::int64_t keys, std::int64_t heads, std::int64_t dim, const float* HWY_RESTRICT cos_sin,
                         const std::int64_t* HWY_RESTRICT table_rows, std::int64_t half, float* HWY_RESTRICT dst,
                         std::int64_t dim_padded) {
  if (half % static_cast<std::int64_t>(hn::Lanes(DF())) != 0 || !WidensInVectors(dtype)) {
    AttnPackHeads(src, dtype, seq_stride, head_stride, keys, heads, dim, dst, dim_padded);
    for (std::int64_t j = 0; j < keys; ++j) {
      const float* c = cos_sin + table_rows[j] * 2 * half;
      for (std::int64_t g = 0; g < heads; ++g)
        AttnRotateHalfSplit(dst + (j * heads + g) * dim_padded, c, c + half, half, 1.0f);
    }
    return;
  }
  switch (dtype) {
    case DType::kBF16:
      PackRotateInRegisters<DType::kBF16>(static_cast<const std::uint16_t*>(src), seq_stride, head_stride, keys, heads,
                                          dim, cos_sin, table_rows, half, dst, dim_padded);
      break;
    case DType::kF16:
      PackRotateInRegisters<DType::kF16>(static_cast<const std::uint16_t*>(src), seq_stride, head_stride, keys, heads,
                                         dim, cos_sin, table_rows, half, dst, dim_padded);
      break;
    default:
      PackRotateInRegisters<DType::kF32>(static_cast<const float*>(src), seq_stride, head_stride, keys, heads, dim,
                                         cos_sin, table_rows, half, dst, dim_padded);
      break;
  }
}

void AttnPackHeads(const void* src, DType dtype, std::int64_t seq_stride, std::int64_t head_stride, std::int64_t keys,
                   std::int64_t heads, std::int64_t dim, float* HWY_RESTRICT dst, std::int64_t dim_padded) {
  const auto width = static_cast<std::int64_t>(dtype_size(dtype));
  for (std::int64_t j = 0; j < keys; ++j) {
    for (std::int64_t g = 0; g < heads; ++g) {
      float* row = dst + (j * heads + g) * dim_padded;
      AttnLoadF32(static_cast<const char*>(src) + (j * seq_stride + g * head_stride) * width, dtype, dim, row);
      for (std::int64_t t = dim; t < dim_padded; ++t) row[t] = 0.0f;
    }
  }
}

void AttnLoadF32(const void* src, DType dtype, std::int64_t n, float* HWY_RESTRICT dst) {
  const DF d;
  const auto lanes = static_cast<std::int64_t>(hn::Lanes(d));
  std::int64_t t = 0;
  if (dtype == DType::kF32) {
    const auto* s = static_cast<const float*>(src);
    for (; t + lanes <= n; t += lanes) hn::StoreU(hn::LoadU(d, s + t), d, dst + t);
    for (; t < n; ++t) dst[t] = s[t];
    return;
  }
  const auto* s = static_cast<const std::uint16_t*>(src);
  if (dtype == DType::kBF16) {
#if HWY_TARGET != HWY_SCALAR
    const hn::RebindToUnsigned<DF> du32;
    const hn::Rebind<std::uint16_t, DF> du16;
    for (; t + lanes <= n; t += lanes) {
      hn::StoreU(hn::BitCast(d, hn::ShiftLeft<16>(hn::PromoteTo(du32, hn::LoadU(du16, s + t)))), d, dst + t);
    }
#endif
    for (; t < n; ++t) dst[t] = from_bf16(bf16{s[t]});
    return;
  }
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2
  // F16C: exact widening.
  const hn::Rebind<hwy::float16_t, DF> dh;
  for (; t + lanes <= n; t += lanes) {
    hn::StoreU(hn::PromoteTo(d, hn::LoadU(dh, reinterpret_cast<const hwy::float16_t*>(s) + t)), d, dst + t);
  }
#endif
  for (; t < n; ++t) dst[t] = from_f16(f16{s[t]});
}

// dst (+)= src rounded to bf16 as posenc::to_bf16 rounds (nearest, ties to even; a NaN stays a
// quiet NaN with its upper bits), a vector at a time.
void AttnStoreBF16(const float* HWY_RESTRICT src, std::int64_t n, std::uint16_t* HWY_RESTRICT dst, bool accumulate) {
  std::int64_t t = 0;
#if HWY_TARGET != HWY_SCALAR
  const DF d;
  const hn::RebindToUnsigned<DF> du;
  const hn::RebindToSigned<DF> di;
  const hn::Rebind<std::uint16_t, DF> du16;
  const auto lanes = static_cast<std::int64_t>(hn::Lanes(d));
  const auto magnitude = hn::Set(du, 0x7fffffffu), half = hn::Set(du, 0x7fffu), one = hn::Set(du, 1u),
             quiet = hn::Set(du, 0x0040u);
  const auto inf = hn::Set(di, 0x7f800000);
  for (; t + lanes <= n; t += lanes) {
    auto x = hn::LoadU(d, src + t);
    if (accumulate) x = hn::Add(hn::BitCast(d, hn::ShiftLeft<16>(hn::PromoteTo(du, hn::LoadU(du16, dst + t)))), x);
    const auto u = hn::BitCast(du, x);
    const auto high = hn::ShiftRight<16>(u);
    // As the scalar's uint32 arithmetic: the adds wrap, the shifts are logical; |x| > inf (as
    // signed: both sides are below 2^31) is a NaN.
    const auto rounded = hn::ShiftRight<16>(hn::Add(u, hn::Add(half, hn::And(high, one))));
    const auto nan = hn::RebindMask(du, hn::Gt(hn::BitCast(di, hn::And(u, magnitude)), inf));
    hn::StoreU(hn::DemoteTo(du16, hn::BitCast(di, hn::IfThenElse(nan, hn::Or(high, quiet), rounded))), du16, dst + t);
  }
#endif
  for (; t < n; ++t) {
    const float x = accumulate ? from_bf16(bf16{dst[t]}) + src[t] : src[t];
    dst[t] = to_bf16(x).bits;
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace posenc::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace posenc::kernels {

HWY_EXPORT(AttnLoadF32);
HWY_EXPORT(AttnStoreBF16);
void attn_store_bf16(const float* src, std::int64_t n, std::uint16_t* dst, bool accumulate) {
  HWY_DYNAMIC_DISPATCH(AttnStoreBF16)(src, n, dst, accumulate);
}
HWY_EXPORT(AttnDecodeScores);
HWY_EXPORT(AttnPackHeads);
HWY_EXPORT(AttnRotateHalfSplit);
void attn_rotate_half_split(float* x, const float* c, const float* s, std::int64_t half, float sine_sign) {
  HWY_DYNAMIC_DISPATCH(AttnRotateHalfSplit)(x, c, s, half, sine_sign);
}
HWY_EXPORT(AttnPackRotateHeads);
void attn_pack_rotate_heads(const void* src, DType dtype, std::int64_t seq_stride, std::int64_t head_stride,
                            std::int64_t keys, std::int64_t heads, std::int64_t dim, const float* cos_sin,
                            const std::int64_t* table_rows, std::int64_t half, float* dst, std::int64_t dim_padded) {
  HWY_DYNAMIC_DISPATCH(AttnPackRotateHeads)
  (src, dtype, seq_stride, head_stride, keys, heads, dim, cos_sin, table_rows, half, dst, dim_padded);
}
void attn_pack_heads(const void* src, DType dtype, std::int64_t seq_stride, std::int64_t head_stride, std::int64_t keys,
                     std::int64_t heads, std::int64_t dim, float* dst, std::int64_t dim_padded) {
  HWY_DYNAMIC_DISPATCH(AttnPackHeads)(src, dtype, seq_stride, head_stride, keys, heads, dim, dst, dim_padded);
}
HWY_EXPORT(AttnDecodeValues);
HWY_EXPORT(AttnDecodeReadsDirectly);
HWY_EXPORT(AttnDecodeReadsQuantized);
HWY_EXPORT(AttnDecodeScoresQuantized);
HWY_EXPORT(AttnDecodeValuesQuantized);
bool attn_decode_reads_quantized(CacheFormat format, std::int64_t q_rows, std::int64_t dim) {
  return HWY_DYNAMIC_DISPATCH(AttnDecodeReadsQuantized)(format, q_rows, dim);
}
void attn_decode_scores_quantized(const void* k, CacheFormat format, std::int64_t ldk, std::int64_t k_head_stride,
                                  std::int64_t keys, std::int64_t heads, const float* const* q_heads, std::int64_t ldq,
                                  std::int64_t q_rows, std::int64_t dim, float* const* st_heads, std::int64_t ld_st,
                                  const RowPrefetch& ahead, bool prefetch_keys) {
  if (!attn_decode_reads_quantized(format, q_rows, dim)) {
    throw Error("attention kernel", "k format", std::string(cache_format_name(format)),
                "a cache this target's decode reads in place at dim " + std::to_string(dim) + " with " +
                    std::to_string(q_rows) + " rows (attn_decode_reads_quantized)");
  }
  HWY_DYNAMIC_DISPATCH(AttnDecodeScoresQuantized)
  (k, format, ldk, k_head_stride, keys, heads, q_heads, ldq, q_rows, dim, st_heads, ld_st, ahead, prefetch_keys);
}
void attn_decode_values_quantized(const void* v, CacheFormat format, std::int64_t ldv, std::int64_t v_head_stride,
                                  std::int64_t keys, std::int64_t heads, const float* const* p_heads, std::int64_t ld_p,
                                  std::int64_t rows, std::int64_t cols, float* const* o_heads, std::int64_t ldo,
                                  const RowPrefetch& ahead) {
  if (!attn_decode_reads_quantized(format, rows, cols)) {
    throw Error("attention kernel", "v format", std::string(cache_format_name(format)),
                "a cache this target's decode reads in place at " + std::to_string(cols) + " columns with " +
                    std::to_string(rows) + " rows (attn_decode_reads_quantized)");
  }
  HWY_DYNAMIC_DISPATCH(AttnDecodeValuesQuantized)
  (v, format, ldv, v_head_stride, keys, heads, p_heads, ld_p, rows, cols, o_heads, ldo, ahead);
}
HWY_EXPORT(AttnDecodeRotatesKeys);
bool attn_decode_reads_directly(DType dtype, std::int64_t q_rows, std::int64_t dim) {
  return HWY_DYNAMIC_DISPATCH(AttnDecodeReadsDirectly)(dtype, q_rows, dim);
}
bool attn_decode_rotates_keys(DType dtype, std::int64_t q_rows, std::int64_t dim, std::int64_t half, bool interleaved) {
  return HWY_DYNAMIC_DISPATCH(AttnDecodeRotatesKeys)(dtype, q_rows, dim, half, interleaved);
}
void attn_expand_interleaved_rope(const float* cos_sin, const std::int64_t* table_rows, std::int64_t keys,
                                  std::int64_t half, float* dst) {
  for (std::int64_t j = 0; j < keys; ++j) {
    const float* c = cos_sin + table_rows[j] * 2 * half;
    const float* s = c + half;
    float* cj = dst + j * 4 * half;
    float* sj = cj + 2 * half;
    for (std::int64_t i = 0; i < half; ++i) {
      cj[2 * i] = cj[2 * i + 1] = c[i];
      sj[2 * i] = -s[i];
      sj[2 * i + 1] = s[i];
    }
  }
}
void attn_decode_scores(const void* k, DType dtype, std::int64_t ldk, std::int64_t k_head_stride, std::int64_t keys,
                        std::int64_t heads, const float* const* q_heads, std::int64_t ldq, std::int64_t q_rows,
                        std::int64_t dim, float* const* st_heads, std::int64_t ld_st, const RowPrefetch& ahead,
                        bool prefetch_keys, const KeyRotation& rotation) {
  if (q_rows < 1 || q_rows > 8) throw Error("attention kernel", "q_rows", std::to_string(q_rows), "1 … 8 (decode)");
  if (rotation.cos_sin != nullptr &&
      !attn_decode_rotates_keys(dtype, q_rows, dim, rotation.half, rotation.interleaved)) {
    throw Error("attention kernel", "rotation.half", std::to_string(rotation.half),
                "pairs the scores rotate at dim " + std::to_string(dim) + " (attn_decode_rotates_keys)");
  }
  if (!attn_decode_reads_directly(dtype, q_rows, dim)) {
    throw Error("attention kernel", "k dtype", std::string(dtype_name(dtype)),
                "a dtype this target's decode reads directly at dim " + std::to_string(dim) + " with " +
                    std::to_string(q_rows) + " rows (attn_decode_reads_directly)");
  }
  HWY_DYNAMIC_DISPATCH(AttnDecodeScores)
  (k, dtype, ldk, k_head_stride, keys, heads, q_heads, ldq, q_rows, dim, st_heads, ld_st, ahead, prefetch_keys,
   rotation);
}
void attn_decode_values(const void* v, DType dtype, std::int64_t ldv, std::int64_t v_head_stride, std::int64_t keys,
                        std::int64_t heads, const float* const* p_heads, std::int64_t ld_p, std::int64_t rows,
                        std::int64_t cols, float* const* o_heads, std::int64_t ldo, const RowPrefetch& ahead) {
  if (rows < 1 || rows > 8) throw Error("attention kernel", "rows", std::to_string(rows), "1 … 8 (decode)");
  if (!attn_decode_reads_directly(dtype, rows, cols)) {
    throw Error("attention kernel", "v dtype", std::string(dtype_name(dtype)),
                "a dtype this target's decode reads directly at " + std::to_string(cols) + " columns with " +
                    std::to_string(rows) + " rows (attn_decode_reads_directly)");
  }
  HWY_DYNAMIC_DISPATCH(AttnDecodeValues)
  (v, dtype, ldv, v_head_stride, keys, heads, p_heads, ld_p, rows, cols, o_heads, ldo, ahead);
}
void attn_load_f32(const void* src, DType dtype, std::int64_t n, float* dst) {
  HWY_DYNAMIC_DISPATCH(AttnLoadF32)(src, dtype, n, dst);
}

}  // namespace posenc::kernels
#endif  // HWY_ONCE
