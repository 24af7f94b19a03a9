// SIMD kernels of the absolute encodings (Highway, dynamic dispatch).
//
// Sinusoids are computed for runs of consecutive positions p0, p0+1, … (at most kMaxRun rows),
// one (sin, cos) pair of columns at a time: a pair's two columns are each other's partner in the
// rotation, so one rotation yields both.
//
// 1. The first row exactly: sin x and cos x with x = p0·ω_i >= 0.
//    Angle reduction in fp64: k = round(x·2/π), r = x - k·(π/2)_hi - k·(π/2)_lo, |r| <= π/4.
//    The two-part π/2 (hi = fp64(π/2), lo = fp64(π/2 - hi)) with fused multiply-adds keeps r
//    exact to ~1e-16 for any k < 2^51, so the error is that of x = p0·ω itself (<= p0·2^-53) —
//    the bits an fp32 `p * div_term` loses at long positions are kept. The quadrant k mod 4 picks
//    ±sin r or ±cos r; sin and cos on [-π/4, π/4] are their Taylor polynomials to degree 11 and 12
//    (truncation <= (π/4)^13/13! ≈ 7e-12 and (π/4)^14/14! ≈ 4e-13).
// 2. Every further row by rotating each (sin, cos) pair in fp64 (absolute_kernels.hpp): row 1 by
//    ω_i from row 0, then even and odd rows as two independent chains stepping by 2ω_i — four
//    multiply-adds per pair instead of a reduction and two polynomials. The run walks a tile of
//    pairs down all its rows with the state in registers: no scratch memory.
// 3. Each value is rounded once to f32 (<= 2^-25 for |value| <= 1).
// Error against the exact sin/cos: 2^-25 + p·2^-52 + 1e-11 (see posenc/absolute.hpp). Every lane
// follows the same fp64 operations for either layout and any tile width, so every target with
// fused multiply-adds (AVX2, AVX-512) gives the same bits; SSE4 and scalar round each twice.
//
// Data flow for one tile of pairs [i, i + K·Lanes):
//   row 0:   p0·ω ──► reduce, polynomials ──► sin, cos (registers) ──► demote ──► out[0]
//   row r:   sin, cos ──► rotate by ω ─────► sin, cos              ──► demote ──► out[r]
// Interleaved rows receive sin and cos zipped (columns 2i, 2i+1), split rows the sines at column
// i and the cosines at d/2 + i. Either way a tile row fills whole 64-byte lines where the target
// streams, which non-temporal stores need: a streamed half line leaves its write-combining buffer
// partly filled (on a Zen 3 host, half-line tiles streamed at 5.2 GB/s where ordinary stores
// reached 16.4).
// The float vector has as many lanes as the double one (half width), which every target supports,
// including Highway's one-lane HWY_SCALAR (the baseline when GCC < 12.3 cannot build EMU128).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/absolute/absolute_kernels.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>
#include <hwy/cache_control.h>

#include <algorithm>
#include <cstring>

#include "kernels/absolute/absolute_kernels.hpp"
#include "kernels/common/sincos-inl.h"
#include "kernels/common/store-inl.h"

HWY_BEFORE_NAMESPACE();
namespace posenc::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DD = hn::ScalableTag<double>;
using DF = hn::Rebind<float, DD>;  // as many lanes as DD, half the width
using VD = hn::Vec<DD>;
using common::HWY_NAMESPACE::SinPair;
using common::HWY_NAMESPACE::StreamableTag;

using VF = hn::Vec<DF>;

// Lambdas passed down a tile must be inlined, or every row becomes a call. Not under
// AddressSanitizer: there the forced inlining multiplies the instrumented code (the sanitized and
// fuzz builds compiled this file five times longer) and changes no result.
#if defined(__clang__)
#if __has_feature(address_sanitizer)
#define POSENC_INLINE_LAMBDA
#else
#define POSENC_INLINE_LAMBDA __attribute__((always_inline))
#endif
#elif defined(__GNUC__) && !defined(__SANITIZE_ADDRESS__)
#define POSENC_INLINE_LAMBDA __attribute__((always_inline))
#else
#define POSENC_INLINE_LAMBDA
#endif

// Vectors of pairs per tile. Interleaved rows take 2·Lanes floats per vector of pairs, so two
// vectors fill a 64-byte line on AVX2 and two lines on AVX-512; split rows take Lanes floats per half,
// so AVX2 needs four vectors for a whole line in each half. Targets that do not stream (SSE4,
// scalar, EMU128) keep two, which stay in registers.
constexpr size_t kInterleavedVectors = 2;
constexpr size_t kSplitVectors = [] {
  constexpr size_t bytes = hn::MaxLanes(DF()) * sizeof(float);
  return bytes >= 16 && 64 / bytes > 2 ? 64 / bytes : size_t{2};
}();
constexpr size_t kMaxVectors = kSplitVectors > kInterleavedVectors ? kSplitVectors : kInterleavedVectors;

// A tile reads pairs [i, i + K·Lanes) of the pair tables, i < dim/2: the padding must cover it.
static_assert(kColumnPadding >= kMaxVectors * hn::MaxLanes(DD()), "pair tables need more padding");

// Rows [begin, end) of one tile of K vectors of pairs (begin = 0 or an even row >= 2):
// emit(r, sin, cos) receives row r's K f32 vectors of each. A tile walks its rows in groups of
// kGroupRows (see absolute_kernels.hpp); between groups the rotation state waits in `saved`
// (4·K·Lanes doubles), written when end < rows and read when begin > 0.
template <size_t K, class Emit>
HWY_INLINE void Tile(const SinusoidColumns& cols, double p0, std::int64_t rows, std::int64_t i, std::int64_t begin,
                     std::int64_t end, double* HWY_RESTRICT saved, const Emit& emit) {
  const DD dd;
  const DF df;
  const std::int64_t n = static_cast<std::int64_t>(hn::Lanes(dd));
  VD v[K], u[K], cc[K], ss[K], odd_v[K], odd_u[K];
  VF fs[K], fc[K];
  const auto demote = [&](const VD* sin, const VD* cos) POSENC_INLINE_LAMBDA {
    for (size_t k = 0; k < K; ++k) {
      fs[k] = hn::DemoteTo(df, sin[k]);
      fc[k] = hn::DemoteTo(df, cos[k]);
    }
  };
  // Rotation by ω: (sin, cos) ← (sin·c + cos·s, cos·c - sin·s).
  const auto rotate = [](VD& sin, VD& cos, VD c, VD s) POSENC_INLINE_LAMBDA {
    const VD next_sin = hn::MulAdd(cos, s, hn::Mul(sin, c));
    cos = hn::NegMulAdd(sin, s, hn::Mul(cos, c));
    sin = next_sin;
  };
  for (size_t k = 0; k < K; ++k) {
    const std::int64_t at = i + static_cast<std::int64_t>(k) * n;
    const VD c = hn::LoadU(dd, cols.step_cos + at), s = hn::LoadU(dd, cols.step_sin + at);
    // Double angle for the two chains: cos 2ω = c² - s², sin 2ω = 2·c·s.
    cc[k] = hn::NegMulAdd(s, s, hn::Mul(c, c));
    ss[k] = hn::Mul(hn::Add(c, c), s);
    if (begin == 0) {
      const VD p = hn::Set(dd, p0);
      SinPair(dd, hn::Mul(p, hn::LoadU(dd, cols.freq + at)), hn::Zero(dd), v[k], u[k]);
      odd_v[k] = v[k];
      odd_u[k] = u[k];
      rotate(odd_v[k], odd_u[k], c, s);
    } else {
      const double* from = saved + 4 * static_cast<std::int64_t>(k) * n;
      v[k] = hn::LoadU(dd, from);
      u[k] = hn::LoadU(dd, from + n);
      odd_v[k] = hn::LoadU(dd, from + 2 * n);
      odd_u[k] = hn::LoadU(dd, from + 3 * n);
    }
  }
  if (begin == 0) {
    demote(v, u);
    emit(0, fs, fc);
    if (rows == 1) return;
    demote(odd_v, odd_u);
    emit(1, fs, fc);
    begin = 2;
  }
  // Two independent chains, even rows and odd rows, each stepping by 2ω: a rotation's latency
  // (multiply, then multiply-add) would otherwise bound the loop.
  if constexpr (K <= 2) {
    // Both chains interleaved fit in the registers.
    std::int64_t r = begin;
    for (; r + 1 < end; r += 2) {
      for (size_t k = 0; k < K; ++k) {
        rotate(v[k], u[k], cc[k], ss[k]);
        rotate(odd_v[k], odd_u[k], cc[k], ss[k]);
      }
      demote(v, u);
      emit(r, fs, fc);
      demote(odd_v, odd_u);
      emit(r + 1, fs, fc);
    }
    if (r < end) {  // the last row of an odd count: only when end == rows
      for (size_t k = 0; k < K; ++k) rotate(v[k], u[k], cc[k], ss[k]);
      demote(v, u);
      emit(r, fs, fc);
    }
  } else {
    // Four vectors (AVX2's 16 registers): one chain after the other, each with enough
    // independent rotations to hide the latency.
    for (std::int64_t r = begin; r < end; r += 2) {
      for (size_t k = 0; k < K; ++k) rotate(v[k], u[k], cc[k], ss[k]);
      demote(v, u);
      emit(r, fs, fc);
    }
    for (std::int64_t r = begin + 1; r < end; r += 2) {
      for (size_t k = 0; k < K; ++k) rotate(odd_v[k], odd_u[k], cc[k], ss[k]);
      demote(odd_v, odd_u);
      emit(r, fs, fc);
    }
  }
  if (end < rows) {
    for (size_t k = 0; k < K; ++k) {
      double* to = saved + 4 * static_cast<std::int64_t>(k) * n;
      hn::StoreU(v[k], dd, to);
      hn::StoreU(u[k], dd, to + n);
      hn::StoreU(odd_v[k], dd, to + 2 * n);
      hn::StoreU(odd_u[k], dd, to + 3 * n);
    }
  }
}

// AVX2 and AVX-512 have native masked loads and stores, which touch exactly the valid lanes;
// other targets go through a small buffer and memcpy, which touches exactly the valid bytes too
// (never an element of a row that another thread writes).
#if HWY_TARGET <= HWY_AVX2
constexpr bool kNativeMasks = true;
#else
constexpr bool kNativeMasks = false;
#endif

enum class Store { kPlain, kStream };

// Whether full tiles of large outputs are streamed. On AVX2 they go through the caches: on a
// Zen 3 host (the AVX2 machine measured), whole-line non-temporal tiles wrote the table at
// 19.5-20.8 GB/s where ordinary stores reached 23.3-23.8 in the same runs (2 threads); the
// streamed stores stall the rotations behind them. AVX-512 hosts streamed faster.
constexpr bool kStreamLargeOutputs = HWY_TARGET != HWY_AVX2;

template <Store kHow, class D>
HWY_INLINE void StoreVector(D d, hn::Vec<D> v, float* HWY_RESTRICT dst) {
  if constexpr (kHow == Store::kStream) {
    hn::Stream(v, d, dst);
  } else {
    hn::StoreU(v, d, dst);
  }
}

// The first `valid` (<= count·Lanes) floats of f[0] ++ f[1] ++ … at out.
HWY_INLINE void StorePartial(const VF* f, size_t count, float* out, size_t valid) {
  const DF df;
  const size_t n = hn::Lanes(df);
  if constexpr (kNativeMasks) {
    for (size_t k = 0; k < count && k * n < valid; ++k) {
      const size_t left = valid - k * n;
      if (left >= n) {
        hn::StoreU(f[k], df, out + k * n);
      } else {
        hn::BlendedStore(f[k], hn::FirstN(df, left), df, out + k * n);
      }
    }
  } else {
    HWY_ALIGN float buffer[2 * kMaxVectors * hn::MaxLanes(df)];
    for (size_t k = 0; k < count; ++k) hn::Store(f[k], df, buffer + k * n);
    std::memcpy(out, buffer, valid * sizeof(float));
  }
}

// Loads the first `valid` (<= count·Lanes) floats at src into f[0] ++ f[1] ++ …, zeros elsewhere.
HWY_INLINE void LoadPartial(const float* src, size_t valid, size_t count, VF* f) {
  const DF df;
  const size_t n = hn::Lanes(df);
  if constexpr (kNativeMasks) {
    for (size_t k = 0; k < count; ++k) {
      const size_t left = valid > k * n ? valid - k * n : 0;
      f[k] = left >= n ? hn::LoadU(df, src + k * n) : hn::MaskedLoad(hn::FirstN(df, left), df, src + k * n);
    }
  } else {
    HWY_ALIGN float buffer[2 * kMaxVectors * hn::MaxLanes(df)] = {};
    std::memcpy(buffer, src, valid * sizeof(float));
    for (size_t k = 0; k < count; ++k) f[k] = hn::Load(df, buffer + k * n);
  }
}

// z[2k], z[2k+1] = the floats of sin[k] and cos[k] zipped: sin_0, cos_0, sin_1, cos_1, ….
template <size_t K>
HWY_INLINE void Zip(const VF* sin, const VF* cos, VF* z) {
  const DF df;
#if HWY_TARGET <= HWY_AVX2
  // InterleaveLower/Upper zip within 128-bit blocks; a 256-bit vector's blocks are then reordered.
  for (size_t k = 0; k < K; ++k) {
    const VF lo = hn::InterleaveLower(df, sin[k], cos[k]);
    const VF hi = hn::InterleaveUpper(df, sin[k], cos[k]);
    if constexpr (hn::MaxLanes(df) * sizeof(float) <= 16) {
      z[2 * k] = lo;
      z[2 * k + 1] = hi;
    } else {
      static_assert(K > 0 && hn::MaxLanes(DF()) * sizeof(float) == 32, "a float vector of 16 or 32 bytes");
      z[2 * k] = hn::ConcatLowerLower(df, hi, lo);
      z[2 * k + 1] = hn::ConcatUpperUpper(df, hi, lo);
    }
  }
#else
  const size_t n = hn::Lanes(df);
  HWY_ALIGN float a[hn::MaxLanes(df)];
  HWY_ALIGN float b[hn::MaxLanes(df)];
  HWY_ALIGN float zipped[2 * hn::MaxLanes(df)];
  for (size_t k = 0; k < K; ++k) {
    hn::Store(sin[k], df, a);
    hn::Store(cos[k], df, b);
    for (size_t l = 0; l < n; ++l) {
      zipped[2 * l] = a[l];
      zipped[2 * l + 1] = b[l];
    }
    z[2 * k] = hn::Load(df, zipped);
    z[2 * k + 1] = hn::Load(df, zipped + n);
  }
#endif
}

// Calls run(pair_begin, pairs, how, tile_index) over the pairs of a row so that, with streaming,
// every full tile's stores land on whole aligned lines: a partial tile first up to the first line
// boundary of row 0, full tiles, and a partial tile at the end. Rows stream only when every row
// keeps row 0's alignment; otherwise ordinary stores (a streamed partial line is slower than a
// cached one). A pair takes 2 floats of an interleaved row, 1 of each half of a split one.
template <size_t K, class Run>
HWY_INLINE void ForTiles(const SinusoidColumns& cols, const float* out, std::int64_t out_row_stride, bool stream,
                         const Run& run) {
  const DF df;
  const std::int64_t width = static_cast<std::int64_t>(K) * static_cast<std::int64_t>(hn::Lanes(df));
  const std::int64_t pairs = cols.dim / 2;
  const std::int64_t floats_per_pair = cols.interleaved ? 2 : 1;
  constexpr std::int64_t kLine = 64;
  const auto misalignment = static_cast<std::int64_t>(reinterpret_cast<std::uintptr_t>(out) % kLine);
  const std::int64_t pair_bytes = floats_per_pair * static_cast<std::int64_t>(sizeof(float));
  const bool streamed = stream && kStreamLargeOutputs && StreamableTag(df) &&
                        (out_row_stride * static_cast<std::int64_t>(sizeof(float))) % kLine == 0 &&
                        misalignment % pair_bytes == 0 &&
                        (cols.interleaved || (pairs * static_cast<std::int64_t>(sizeof(float))) % kLine == 0) &&
                        (width * pair_bytes) % kLine == 0;
  std::int64_t i = 0;
  std::int64_t tile = 0;
  if (streamed && misalignment != 0) {
    i = std::min(pairs, (kLine - misalignment) / pair_bytes);
    run(std::int64_t{0}, i, Store::kPlain, tile++);
  }
  for (; i + width <= pairs; i += width) run(i, width, streamed ? Store::kStream : Store::kPlain, tile++);
  if (i < pairs) run(i, pairs - i, Store::kPlain, tile++);
}

// One tile's rows written to out (x added first when x is not null): full tiles with whole-vector
// stores of kind kHow, partial ones (fewer than K·Lanes pairs) with masked stores.
template <size_t K, Store kHow>
HWY_INLINE void WriteTile(const SinusoidColumns& cols, double p0, std::int64_t rows, std::int64_t begin,
                          std::int64_t end, double* saved, std::int64_t i, std::int64_t count, const float* x,
                          std::int64_t x_row_stride, float* out, std::int64_t out_row_stride) {
  const DF df;
  const auto n = static_cast<std::int64_t>(hn::Lanes(df));
  const bool full = count == static_cast<std::int64_t>(K) * n;
  const std::int64_t half = cols.dim / 2;
  // Writes `floats` floats of f at dst, adding src's first when x is given.
  const auto put = [&](const VF* f, size_t vectors, const float* src, float* dst,
                       std::int64_t floats) POSENC_INLINE_LAMBDA {
    VF sum[2 * kMaxVectors];
    if (x != nullptr) {
      LoadPartial(src, static_cast<size_t>(floats), vectors, sum);
      for (size_t k = 0; k < vectors; ++k) sum[k] = hn::Add(sum[k], f[k]);
      f = sum;
    }
    if (full) {
      if constexpr (kHow == Store::kPlain) {
        // Rows are pages apart, where the hardware prefetchers stop: fetch
        // the lines two tiles on while this one is computed.
        __builtin_prefetch(dst + 2 * static_cast<std::int64_t>(vectors) * n, 1, 3);
        if (x != nullptr) __builtin_prefetch(src + 2 * static_cast<std::int64_t>(vectors) * n, 0, 3);
      }
#if HWY_TARGET <= HWY_AVX2
      // Pairs of half-width vectors as one native vector: half as many stores.
      const hn::Twice<DF> dw;
      for (size_t k = 0; k < vectors; k += 2)
        StoreVector<kHow>(dw, hn::Combine(dw, f[k + 1], f[k]), dst + static_cast<std::int64_t>(k) * n);
#else
      for (size_t k = 0; k < vectors; ++k) StoreVector<kHow>(df, f[k], dst + static_cast<std::int64_t>(k) * n);
#endif
    } else {
      StorePartial(f, vectors, dst, static_cast<size_t>(floats));
    }
  };
  if (cols.interleaved) {
    Tile<K>(cols, p0, rows, i, begin, end, saved,
            [&](std::int64_t r, const VF* sin, const VF* cos) POSENC_INLINE_LAMBDA {
              VF z[2 * K];
              Zip<K>(sin, cos, z);
              const float* src = x == nullptr ? nullptr : x + r * x_row_stride + 2 * i;
              put(z, 2 * K, src, out + r * out_row_stride + 2 * i, 2 * count);
            });
  } else {
    Tile<K>(cols, p0, rows, i, begin, end, saved,
            [&](std::int64_t r, const VF* sin, const VF* cos) POSENC_INLINE_LAMBDA {
              const float* src = x == nullptr ? nullptr : x + r * x_row_stride + i;
              float* dst = out + r * out_row_stride + i;
              put(sin, K, src, dst, count);
              put(cos, K, src == nullptr ? nullptr : src + half, dst + half, count);
            });
  }
}

// A run's rows in groups of kGroupRows, every tile of a group before the next group.
template <size_t K>
HWY_INLINE void Run(const SinusoidColumns& cols, double p0, std::int64_t rows, const float* x,
                    std::int64_t x_row_stride, float* out, std::int64_t out_row_stride, bool stream, double* state) {
  const auto tile_doubles = static_cast<std::int64_t>(4 * K * hn::Lanes(DD()));
  for (std::int64_t begin = 0; begin < rows; begin += kGroupRows) {
    const std::int64_t end = std::min(rows, begin + kGroupRows);
    ForTiles<K>(cols, out, out_row_stride, stream,
                [&](std::int64_t i, std::int64_t count, Store how, std::int64_t tile) POSENC_INLINE_LAMBDA {
                  double* saved = state + tile * tile_doubles;
                  if (how == Store::kStream) {
                    WriteTile<K, Store::kStream>(cols, p0, rows, begin, end, saved, i, count, x, x_row_stride, out,
                                                 out_row_stride);
                  } else {
                    WriteTile<K, Store::kPlain>(cols, p0, rows, begin, end, saved, i, count, x, x_row_stride, out,
                                                out_row_stride);
                  }
                });
  }
}

void SinusoidRunF32(const SinusoidColumns& cols, double first_position, std::int64_t rows, float* HWY_RESTRICT out,
                    std::int64_t out_row_stride, bool stream, double* state) {
  if (cols.interleaved) {
    Run<kInterleavedVectors>(cols, first_position, rows, nullptr, 0, out, out_row_stride, stream, state);
  } else {
    Run<kSplitVectors>(cols, first_position, rows, nullptr, 0, out, out_row_stride, stream, state);
  }
}

void SinusoidAddRunF32(const SinusoidColumns& cols, double first_position, std::int64_t rows, const float* x,
                       std::int64_t x_row_stride, float* out, std::int64_t out_row_stride, bool stream, double* state) {
  if (cols.interleaved) {
    Run<kInterleavedVectors>(cols, first_position, rows, x, x_row_stride, out, out_row_stride, stream, state);
  } else {
    Run<kSplitVectors>(cols, first_position, rows, x, x_row_stride, out, out_row_stride, stream, state);
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace posenc::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace posenc::kernels {

HWY_EXPORT(SinusoidRunF32);
HWY_EXPORT(SinusoidAddRunF32);

void sinusoid_run_f32(const SinusoidColumns& cols, double first_position, std::int64_t rows, float* out,
                      std::int64_t out_row_stride, bool stream, double* state) {
  HWY_DYNAMIC_DISPATCH(SinusoidRunF32)(cols, first_position, rows, out, out_row_stride, stream, state);
}
void sinusoid_add_run_f32(const SinusoidColumns& cols, double first_position, std::int64_t rows, const float* x,
                          std::int64_t x_row_stride, float* out, std::int64_t out_row_stride, bool stream,
                          double* state) {
  HWY_DYNAMIC_DISPATCH(SinusoidAddRunF32)
  (cols, first_position, rows, x, x_row_stride, out, out_row_stride, stream, state);
}

}  // namespace posenc::kernels
#endif  // HWY_ONCE
