// SIMD kernels of rotary position embedding (Highway, dynamic dispatch). See rotary_kernels.hpp
// for the coefficient layout and posenc/rotary.hpp for the math.
//
// rope_state_*: θ = p·ω in fp64, SinPair (kernels/common/sincos-inl.h) for exact sin/cos at the
//   start of a run of consecutive positions, an fp64 rotation by ω per further position; times α,
//   rounded once to f32 — the angle keeps every bit an fp32 `p·ω` would lose.
// rope_rotate: out = x·cos_e + partner(x)·sin_e over the rotated entries, in f32, for f32, bf16
//   and f16 storage (one loop, a codec per storage type):
//   half-split      partner vectors are the other half, loaded contiguously;
//   interleaved     partner vector = x with adjacent lanes swapped (Shuffle2301); the one-lane
//                   HWY_SCALAR target pairs entries in a plain loop instead.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/rotary/rotary_kernels.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>
#include <hwy/cache_control.h>

#include <cstdint>
#include <cstring>

#include "kernels/common/sincos-inl.h"
#include "kernels/common/store-inl.h"
#include "kernels/rotary/rotary_kernels.hpp"
#include "posenc/dtype.hpp"
#include "posenc/error.hpp"

HWY_BEFORE_NAMESPACE();
namespace posenc::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using common::HWY_NAMESPACE::SinPair;
using common::HWY_NAMESPACE::StoreOrStream;
using common::HWY_NAMESPACE::StreamableTag;

// Full vectors of doubles are read and written up to kRopePadding entries past the rotary dims.
static_assert(hn::MaxLanes(hn::ScalableTag<double>()) <= kRopePadding, "rope tables need more padding");

void RopeStateStart(const RopeColumns& cols, double position, double* HWY_RESTRICT state) {
  const hn::ScalableTag<double> dd;
  const auto n = static_cast<std::int64_t>(hn::Lanes(dd));
  const std::int64_t r = cols.rotary_dim, half = r / 2;
  const std::int64_t stride = r + kRopePadding;
  const auto p = hn::Set(dd, position);
  // One SinPair per pair (not per entry): both members of a pair share (cos θ, sin θ).
  HWY_ALIGN double c_buf[hn::MaxLanes(dd)];
  HWY_ALIGN double s_buf[hn::MaxLanes(dd)];
  for (std::int64_t i = 0; i < half; i += n) {
    hn::Vec<decltype(dd)> s, c;
    SinPair(dd, hn::Mul(p, hn::LoadU(dd, cols.pair_freq + i)), hn::Zero(dd), s, c);
    if (!cols.interleaved && i + n <= half) {  // entries i and i + r/2
      hn::StoreU(c, dd, state + i);
      hn::StoreU(s, dd, state + stride + i);
      hn::StoreU(c, dd, state + half + i);
      hn::StoreU(s, dd, state + stride + half + i);
      continue;
    }
    // Interleaved (entries 2i and 2i + 1), or the last, partial vector of pairs.
    hn::Store(c, dd, c_buf);
    hn::Store(s, dd, s_buf);
    const std::int64_t count = half - i < n ? half - i : n;
    for (std::int64_t l = 0; l < count; ++l) {
      const std::int64_t first = cols.interleaved ? 2 * (i + l) : i + l;
      const std::int64_t second = cols.interleaved ? first + 1 : first + half;
      state[first] = state[second] = c_buf[l];
      state[stride + first] = state[stride + second] = s_buf[l];
    }
  }
}

void RopeStateStep(const RopeColumns& cols, double* HWY_RESTRICT state) {
  const hn::ScalableTag<double> dd;
  const auto n = static_cast<std::int64_t>(hn::Lanes(dd));
  const std::int64_t stride = cols.rotary_dim + kRopePadding;
  for (std::int64_t j = 0; j < cols.rotary_dim; j += n) {
    // (cos, sin)(θ + ω) = (cos θ·cos ω − sin θ·sin ω, sin θ·cos ω + cos θ·sin ω)
    const auto c = hn::LoadU(dd, state + j), s = hn::LoadU(dd, state + stride + j);
    const auto sc = hn::LoadU(dd, cols.step_cos + j), ss = hn::LoadU(dd, cols.step_sin + j);
    hn::StoreU(hn::NegMulAdd(s, ss, hn::Mul(c, sc)), dd, state + j);
    hn::StoreU(hn::MulAdd(c, ss, hn::Mul(s, sc)), dd, state + stride + j);
  }
}

void RopeStateEmit(const RopeColumns& cols, const double* HWY_RESTRICT state, double alpha, float* HWY_RESTRICT cos_e,
                   float* HWY_RESTRICT sin_e) {
  const hn::ScalableTag<double> dd;
  const hn::Rebind<float, decltype(dd)> df;
  const auto n = static_cast<std::int64_t>(hn::Lanes(dd));
  const std::int64_t stride = cols.rotary_dim + kRopePadding;
  const auto a = hn::Set(dd, alpha);
  // cos_e and sin_e hold r + kRopePadding floats: full vectors may be stored past r.
  for (std::int64_t j = 0; j < cols.rotary_dim; j += n) {
    hn::StoreU(hn::DemoteTo(df, hn::Mul(hn::LoadU(dd, state + j), a)), df, cos_e + j);
    const auto signed_alpha = hn::Mul(hn::LoadU(dd, cols.sign + j), a);
    hn::StoreU(hn::DemoteTo(df, hn::Mul(hn::LoadU(dd, state + stride + j), signed_alpha)), df, sin_e + j);
  }
}

// Element codecs: how the rotation loads vectors of DF (f32) lanes from its storage type and
// stores them back. Store2 stores two vectors to 2·Lanes(df) consecutive elements — for the
// 16-bit types one full vector, packed without Highway's saturating DemoteTo. `kSimd` is false
// where a codec has no exact SIMD form on this target; the rotation then runs its scalar loop
// over the whole row (correct, slower).
//   f32   plain loads; stores stream when asked.
//   bf16  widening is exact (bf16 is the top half of an f32); narrowing rounds to nearest even
//         (Highway 1.0.3's DemoteTo truncates) and keeps a NaN a NaN.
//   f16   the F16C conversions of AVX2 and AVX-512 (IEEE, nearest even); Highway's emulation on
//         older targets truncates, so those take the scalar loop.
template <class DF>
struct F32Codec {
  using T = float;
  static constexpr bool kSimd = HWY_TARGET != HWY_SCALAR;
  static HWY_INLINE hn::Vec<DF> Load(DF df, const T* p) { return hn::LoadU(df, p); }
  static HWY_INLINE void Store(hn::Vec<DF> v, DF df, T* p, bool stream) { StoreOrStream(v, df, p, stream); }
  static HWY_INLINE void Store2(hn::Vec<DF> lo, hn::Vec<DF> hi, DF df, T* p, bool stream) {
    StoreOrStream(lo, df, p, stream);
    StoreOrStream(hi, df, p + hn::Lanes(df), stream);
  }
  static bool Streamable(DF df) { return StreamableTag(df); }
  static float Widen(T x) { return x; }
  static T Narrow(float f) { return f; }
};

template <class DF>
struct BF16Codec {
  using T = std::uint16_t;
  using DU16 = hn::Rebind<std::uint16_t, DF>;  // Lanes(df) of them: half a vector
  static constexpr bool kSimd = HWY_TARGET != HWY_SCALAR;
  static HWY_INLINE hn::Vec<DF> Load(DF df, const T* p) {
    const hn::RebindToUnsigned<DF> du32;
    return hn::BitCast(df, hn::ShiftLeft<16>(hn::PromoteTo(du32, hn::LoadU(DU16(), p))));
  }
  // The f32 bits with the bf16 rounded to nearest even in their upper half: + 0x7fff, + 1 more
  // when the kept part is odd; a NaN keeps its upper half with the quiet bit set.
  static HWY_INLINE hn::Vec<hn::RebindToUnsigned<DF>> RoundedBits(hn::Vec<DF> v) {
    const hn::RebindToUnsigned<DF> du32;
    const auto bits = hn::BitCast(du32, v);
    const auto odd = hn::And(hn::ShiftRight<16>(bits), hn::Set(du32, 1));
    const auto rounded = hn::Add(bits, hn::Add(odd, hn::Set(du32, 0x7fff)));
    return hn::IfThenElse(hn::RebindMask(du32, hn::IsNaN(v)), hn::Or(bits, hn::Set(du32, 0x00400000)), rounded);
  }
  static HWY_INLINE void Store(hn::Vec<DF> v, DF /* tag */, T* p, bool stream) {
    const hn::RebindToSigned<DF> di32;
    const auto upper = hn::BitCast(di32, hn::ShiftRight<16>(RoundedBits(v)));
    StoreOrStream(hn::DemoteTo(DU16(), upper), DU16(), p, stream);
  }
  static HWY_INLINE void Store2(hn::Vec<DF> lo, hn::Vec<DF> hi, [[maybe_unused]] DF df, T* p, bool stream) {
#if HWY_TARGET != HWY_SCALAR
    // The upper halves of both vectors' lanes, in order: one permute instead of two packs.
    const hn::Repartition<std::uint16_t, DF> du16;
    StoreOrStream(hn::ConcatOdd(du16, hn::BitCast(du16, RoundedBits(hi)), hn::BitCast(du16, RoundedBits(lo))), du16, p,
                  stream);
#else
    Store(lo, df, p, stream);
    Store(hi, df, p + 1, stream);
#endif
  }
  static bool Streamable(DF /* tag */) { return StreamableTag(DU16()); }
  static float Widen(T x) { return from_bf16(bf16{x}); }
  static T Narrow(float f) { return to_bf16(f).bits; }
};

template <class DF>
struct F16Codec {
  using T = std::uint16_t;
  using DU16 = hn::Rebind<std::uint16_t, DF>;
  using DH = hn::Rebind<hwy::float16_t, DF>;
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2
  static constexpr bool kSimd = true;
#else
  static constexpr bool kSimd = false;
#endif
  static HWY_INLINE hn::Vec<DF> Load(DF df, const T* p) {
    return hn::PromoteTo(df, hn::LoadU(DH(), reinterpret_cast<const hwy::float16_t*>(p)));
  }
  static HWY_INLINE void Store(hn::Vec<DF> v, DF /* tag */, T* p, bool stream) {
    StoreOrStream(hn::BitCast(DU16(), hn::DemoteTo(DH(), v)), DU16(), p, stream);
  }
  static HWY_INLINE void Store2(hn::Vec<DF> lo, hn::Vec<DF> hi, DF df, T* p, bool stream) {
    Store(lo, df, p, stream);
    Store(hi, df, p + hn::Lanes(df), stream);
  }
  static bool Streamable(DF /* tag */) { return StreamableTag(DU16()); }
  static float Widen(T x) { return from_f16(f16{x}); }
  static T Narrow(float f) { return to_f16(f).bits; }
};

// out = x·cos_e + partner(x)·sin_e for each head of one token, in f32, through codec C: two
// vectors per step (Store2), then one, then a scalar tail.
template <template <class> class Codec>
void RotateHeads(const float* cos_e, const float* sin_e, std::int64_t rotary_dim, bool interleaved,
                 std::int64_t head_dim, std::int64_t heads, const void* x_raw, std::int64_t x_head_stride,
                 void* out_raw, std::int64_t out_head_stride, bool stream) {
  const hn::ScalableTag<float> df;
  using C = Codec<decltype(df)>;
  using T = typename C::T;
  const auto* x = static_cast<const T*>(x_raw);
  auto* out = static_cast<T*>(out_raw);
  [[maybe_unused]] const auto n = static_cast<std::int64_t>(hn::Lanes(df));
  // Software prefetch kRopePrefetchBytes ahead of the loads: the loop does too much per loaded
  // line for the hardware prefetcher alone to keep enough misses in flight.
  [[maybe_unused]] constexpr std::int64_t ahead = kRopePrefetchBytes / static_cast<std::int64_t>(sizeof(T));
  // One prefetch per 64-byte line of the 2·n elements a step loads from each place.
  [[maybe_unused]] const auto prefetch_step = [&](const T* p) {
    for (std::int64_t line = 0; line < 2 * n * static_cast<std::int64_t>(sizeof(T)); line += 64) {
      hwy::Prefetch(reinterpret_cast<const char*>(p + ahead) + line);
    }
  };
  const std::int64_t half = rotary_dim / 2;
  stream = stream && C::Streamable(df);
  for (std::int64_t h = 0; h < heads; ++h) {
    const T* src = x + h * x_head_stride;
    T* dst = out + h * out_head_stride;
    std::int64_t j = 0;
    if (interleaved) {
#if HWY_TARGET != HWY_SCALAR  // no Shuffle2301 on one lane (kSimd is false there anyway)
      if constexpr (C::kSimd) {
        // Entry j's partner is its neighbour in the pair: the same vector with lanes swapped.
        const auto rotate = [&](std::int64_t at) {
          const auto v = C::Load(df, src + at);
          return hn::MulAdd(hn::Shuffle2301(v), hn::LoadU(df, sin_e + at), hn::Mul(v, hn::LoadU(df, cos_e + at)));
        };
        for (; j + 2 * n <= rotary_dim; j += 2 * n) {
          prefetch_step(src + j);
          C::Store2(rotate(j), rotate(j + n), df, dst + j, stream);
        }
        for (; j + n <= rotary_dim; j += n) C::Store(rotate(j), df, dst + j, stream);
      }
#endif
      for (; j < rotary_dim; j += 2) {  // tail (and the whole row without SIMD)
        const float a = C::Widen(src[j]), b = C::Widen(src[j + 1]);
        dst[j] = C::Narrow(a * cos_e[j] + b * sin_e[j]);
        dst[j + 1] = C::Narrow(b * cos_e[j + 1] + a * sin_e[j + 1]);
      }
    } else {
      if constexpr (C::kSimd) {
        // Entry j's partner is entry j + r/2: first = a·cos + b·sin', second = b·cos + a·sin''.
        const auto first = [&](std::int64_t at, hn::Vec<decltype(df)> a, hn::Vec<decltype(df)> b) {
          return hn::MulAdd(b, hn::LoadU(df, sin_e + at), hn::Mul(a, hn::LoadU(df, cos_e + at)));
        };
        for (; j + 2 * n <= half; j += 2 * n) {
          prefetch_step(src + j);
          prefetch_step(src + half + j);
          const auto a0 = C::Load(df, src + j), a1 = C::Load(df, src + j + n);
          const auto b0 = C::Load(df, src + half + j), b1 = C::Load(df, src + half + j + n);
          C::Store2(first(j, a0, b0), first(j + n, a1, b1), df, dst + j, stream);
          C::Store2(first(half + j, b0, a0), first(half + j + n, b1, a1), df, dst + half + j, stream);
        }
        for (; j + n <= half; j += n) {
          const auto a = C::Load(df, src + j), b = C::Load(df, src + half + j);
          C::Store(first(j, a, b), df, dst + j, stream);
          C::Store(first(half + j, b, a), df, dst + half + j, stream);
        }
      }
      for (; j < half; ++j) {
        const float a = C::Widen(src[j]), b = C::Widen(src[half + j]);
        dst[j] = C::Narrow(a * cos_e[j] + b * sin_e[j]);
        dst[half + j] = C::Narrow(b * cos_e[half + j] + a * sin_e[half + j]);
      }
    }
    if (dst != src && head_dim > rotary_dim) {
      std::memcpy(dst + rotary_dim, src + rotary_dim, static_cast<size_t>(head_dim - rotary_dim) * sizeof(T));
    }
  }
}

void RopeRotate(const float* cos_e, const float* sin_e, std::int64_t rotary_dim, bool interleaved,
                std::int64_t head_dim, std::int64_t heads, DType dtype, const void* x, std::int64_t x_head_stride,
                void* out, std::int64_t out_head_stride, bool stream) {
  const auto rotate = dtype == DType::kF32    ? &RotateHeads<F32Codec>
                      : dtype == DType::kBF16 ? &RotateHeads<BF16Codec>
                                              : &RotateHeads<F16Codec>;
  rotate(cos_e, sin_e, rotary_dim, interleaved, head_dim, heads, x, x_head_stride, out, out_head_stride, stream);
}

}  // namespace HWY_NAMESPACE
}  // namespace posenc::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace posenc::kernels {

HWY_EXPORT(RopeStateStart);
HWY_EXPORT(RopeStateStep);
HWY_EXPORT(RopeStateEmit);
HWY_EXPORT(RopeRotate);

void rope_state_start(const RopeColumns& cols, double position, double* state) {
  HWY_DYNAMIC_DISPATCH(RopeStateStart)(cols, position, state);
}
void rope_state_step(const RopeColumns& cols, double* state) { HWY_DYNAMIC_DISPATCH(RopeStateStep)(cols, state); }
void rope_state_emit(const RopeColumns& cols, const double* state, double alpha, float* cos_e, float* sin_e) {
  HWY_DYNAMIC_DISPATCH(RopeStateEmit)(cols, state, alpha, cos_e, sin_e);
}
void rope_rotate(const float* cos_e, const float* sin_e, std::int64_t rotary_dim, bool interleaved,
                 std::int64_t head_dim, std::int64_t heads, DType dtype, const void* x, std::int64_t x_head_stride,
                 void* out, std::int64_t out_head_stride, bool stream) {
  if (dtype != DType::kF32 && dtype != DType::kBF16 && dtype != DType::kF16) {
    throw Error("rope kernel", "dtype", std::string(dtype_name(dtype)), "f32, bf16 or f16 (f64 uses the reference)");
  }
  HWY_DYNAMIC_DISPATCH(RopeRotate)
  (cos_e, sin_e, rotary_dim, interleaved, head_dim, heads, dtype, x, x_head_stride, out, out_head_stride, stream);
}

}  // namespace posenc::kernels
#endif  // HWY_ONCE
