// STREAM-like copy kernels (plain and non-temporal stores), Highway with dynamic dispatch.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "limits.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>
#include <hwy/cache_control.h>

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <string>

#include <unistd.h>

#include "limits.hpp"

HWY_BEFORE_NAMESPACE();
namespace posenc::perf {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// dst[i] = src[i] for i < n; both 64-byte aligned, n a multiple of 64 floats. The plain loop must
// stay a loop: CMakeLists.txt forbids the compiler to turn it into a call of memcpy, whose
// `rep movsb` skips the read-for-ownership and is no ordinary-store copy.
void CopyF32(const float* HWY_RESTRICT src, float* HWY_RESTRICT dst, std::size_t n, bool stream) {
  const hn::ScalableTag<float> d;
  const std::size_t lanes = hn::Lanes(d);
  if (stream) {
    for (std::size_t i = 0; i < n; i += lanes) hn::Stream(hn::Load(d, src + i), d, dst + i);
    hwy::FlushStream();
  } else {
    for (std::size_t i = 0; i < n; i += lanes) hn::Store(hn::Load(d, src + i), d, dst + i);
  }
}

// Σ a[i] for i < n (four accumulators) read as two streams, the first and the second half side by
// side, every line prefetched into L2 4 KiB ahead; 64-byte aligned, n a multiple of 128 floats.
// Two streams because the kernels it bounds read at least two (decode reads keys and values). A
// test program on this host (2 threads, 256 MiB and 1.2 GiB buffers, prefetch as here) read one
// stream at 22-26 GB/s, two at 24-29, and four to sixteen no faster than two.
float SumF32(const float* HWY_RESTRICT a, std::size_t n) {
  const hn::ScalableTag<float> d;
  const std::size_t lanes = hn::Lanes(d);
  constexpr std::size_t kAhead = 1024, kLine = 16;  // floats: 4 KiB, one 64-byte line
  const std::size_t half = n / 2;
  const float* HWY_RESTRICT b = a + half;
  auto s0 = hn::Zero(d), s1 = hn::Zero(d), s2 = hn::Zero(d), s3 = hn::Zero(d);
  std::size_t i = 0;
  for (; i + 2 * lanes <= half; i += 2 * lanes) {
    for (std::size_t at = i; at < i + 2 * lanes; at += kLine) {
      __builtin_prefetch(a + at + kAhead, 0, 2);
      __builtin_prefetch(b + at + kAhead, 0, 2);
    }
    s0 = hn::Add(s0, hn::Load(d, a + i));
    s1 = hn::Add(s1, hn::Load(d, a + i + lanes));
    s2 = hn::Add(s2, hn::Load(d, b + i));
    s3 = hn::Add(s3, hn::Load(d, b + i + lanes));
  }
  for (; i < half; i += lanes) s0 = hn::Add(hn::Add(s0, hn::Load(d, a + i)), hn::Load(d, b + i));
  return hn::GetLane(hn::SumOfLanes(d, hn::Add(hn::Add(s0, s1), hn::Add(s2, s3))));
}
// dst[i] = 0 for i < n with non-temporal stores; 64-byte aligned, n a multiple of 64 floats.
void ZeroStreamF32(float* HWY_RESTRICT dst, std::size_t n) {
  const hn::ScalableTag<float> d;
  const auto zero = hn::Zero(d);
  for (std::size_t i = 0; i < n; i += hn::Lanes(d)) hn::Stream(zero, d, dst + i);
  hwy::FlushStream();
}
// a[i] += 1 for i < n; 64-byte aligned, n a multiple of 64 floats.
void AddOneF32(float* HWY_RESTRICT a, std::size_t n) {
  const hn::ScalableTag<float> d;
  const auto one = hn::Set(d, 1.0f);
  for (std::size_t i = 0; i < n; i += hn::Lanes(d)) hn::Store(hn::Add(hn::Load(d, a + i), one), d, a + i);
}

// Fused multiply-adds on kFmaChains independent accumulators, `iterations` times; returns a value
// that depends on all of them. 2·lanes·kFmaChains flops per iteration.
//
// The chains must cover the FMA latency on two ports (4 cycles × 2 = 8 in flight on Skylake and
// Zen 3/4) *and* stay in registers together with the two constants. AVX-512 has 32 vector
// registers, so 16 chains fit. AVX2 and SSE4 have 16: 16 chains would spill to the stack and
// halve the measured peak. On a Zen 3 (2 threads, AVX2): 16 chains 113-115 GFLOP/s, 12 chains
// 195-201, 10 chains 196-202, 8 chains 163-180.
#if HWY_TARGET != HWY_SCALAR && HWY_MAX_BYTES >= 64
constexpr int kFmaChains = 16;
#else
constexpr int kFmaChains = 12;
#endif
float FmaPeak(std::size_t iterations, float seed) {
  const hn::ScalableTag<float> d;
  using V = hn::Vec<decltype(d)>;
  V acc[kFmaChains];
  for (int i = 0; i < kFmaChains; ++i) acc[i] = hn::Set(d, seed + static_cast<float>(i));
  const V a = hn::Set(d, 0.999999f), b = hn::Set(d, 1e-7f);
  for (std::size_t it = 0; it < iterations; ++it) {
    for (int i = 0; i < kFmaChains; ++i) acc[i] = hn::MulAdd(acc[i], a, b);
  }
  V total = acc[0];
  for (int i = 1; i < kFmaChains; ++i) total = hn::Add(total, acc[i]);
  return hn::GetLane(total);
}
// Flops of one FmaPeak iteration on the best target.
std::size_t FmaFlopsPerIteration() { return 2 * kFmaChains * hn::Lanes(hn::ScalableTag<float>()); }

}  // namespace HWY_NAMESPACE
}  // namespace posenc::perf
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace posenc::perf {

HWY_EXPORT(CopyF32);
HWY_EXPORT(AddOneF32);
HWY_EXPORT(SumF32);
HWY_EXPORT(ZeroStreamF32);
HWY_EXPORT(FmaPeak);
HWY_EXPORT(FmaFlopsPerIteration);

double measure_fma_gflops(int threads, int reps) {
  constexpr std::size_t kIterations = std::size_t{1} << 22;
  volatile float sink = 0;
  const double seconds = time_best(
      [&] {
#pragma omp parallel num_threads(threads)
        {
          const float r = HWY_DYNAMIC_DISPATCH(FmaPeak)(kIterations, static_cast<float>(omp_get_thread_num()));
#pragma omp critical
          sink = sink + r;
        }
      },
      reps, 0.0);
  const double flops =
      static_cast<double>(HWY_DYNAMIC_DISPATCH(FmaFlopsPerIteration)()) * static_cast<double>(kIterations) * threads;
  return flops / seconds / 1e9;
}

namespace {

// "32768K", "1M", "512" (bytes) as sysfs writes cache sizes; 0 when it is none of them.
std::size_t parse_cache_size(const std::string& text) {
  std::size_t digits = 0;
  while (digits < text.size() && text[digits] >= '0' && text[digits] <= '9') ++digits;
  if (digits == 0) return 0;
  const std::size_t value = std::stoull(text.substr(0, digits));
  const char unit = digits < text.size() ? text[digits] : '\n';
  return unit == 'K' ? value << 10 : unit == 'M' ? value << 20 : unit == 'G' ? value << 30 : value;
}

// The largest data or unified cache of CPU 0 as the kernel describes it in sysfs; 0 if absent.
std::size_t sysfs_last_level_cache_bytes() {
  std::size_t best_level = 0, best_size = 0;
  for (int index = 0; index < 16; ++index) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/";
    std::ifstream level_file(dir + "level"), type_file(dir + "type"), size_file(dir + "size");
    std::size_t level = 0;
    std::string type, size;
    if (!(level_file >> level) || !(type_file >> type) || !(size_file >> size)) continue;
    if (type == "Instruction") continue;
    if (level > best_level) {
      best_level = level;
      best_size = parse_cache_size(size);
    }
  }
  return best_size;
}

}  // namespace

// sysfs first: glibc's sysconf can misreport the L3 (glibc 2.36 on an AMD EPYC VM: 320 MiB where
// sysfs and lscpu say 32 MiB), which would make every limit buffer 1.25 GiB.
std::size_t last_level_cache_bytes() {
  if (const std::size_t from_sysfs = sysfs_last_level_cache_bytes(); from_sysfs > 0) return from_sysfs;
  for (const int name : {_SC_LEVEL4_CACHE_SIZE, _SC_LEVEL3_CACHE_SIZE, _SC_LEVEL2_CACHE_SIZE}) {
    const long size = sysconf(name);
    if (size > 0) return static_cast<std::size_t>(size);
  }
  return std::size_t{32} << 20;
}

Limits measure_limits(int threads, int reps, bool huge_pages) {
  const std::size_t bytes =
      std::clamp<std::size_t>(4 * last_level_cache_bytes(), std::size_t{128} << 20, std::size_t{2} << 30);
  const std::size_t n = bytes / sizeof(float) / 1024 * 1024;
  // On 2 MiB pages when the kernel's buffers are (the bench's --huge-pages): the same kind of
  // memory on both sides of a ratio.
  BenchArray<float> src_memory, dst_memory;
  src_memory.allocate(n, huge_pages);
  dst_memory.allocate(n, huge_pages);
  float* src = src_memory.data();
  float* dst = dst_memory.data();
  const std::size_t chunk = n / static_cast<std::size_t>(threads) / 128 * 128;
  // kind 0: copy, 1: copy with streaming stores, 2: in-place add, 3: read (sum), 4: write
  // (streaming stores of zeros).
  volatile float sink = 0;
  auto run = [&](int kind) {
#pragma omp parallel num_threads(threads)
    {
      const auto t = static_cast<std::size_t>(omp_get_thread_num());
      const std::size_t begin = t * chunk;
      const std::size_t end = t + 1 == static_cast<std::size_t>(threads) ? n : begin + chunk;
      if (kind == 4) {
        HWY_DYNAMIC_DISPATCH(ZeroStreamF32)(dst + begin, end - begin);
      } else if (kind == 3) {
        sink = sink + HWY_DYNAMIC_DISPATCH(SumF32)(src + begin, end - begin);
      } else if (kind == 2) {
        HWY_DYNAMIC_DISPATCH(AddOneF32)(dst + begin, end - begin);
      } else {
        HWY_DYNAMIC_DISPATCH(CopyF32)(src + begin, dst + begin, end - begin, kind == 1);
      }
    }
  };
  // First touch by the threads that will use the pages.
#pragma omp parallel for schedule(static) num_threads(threads)
  for (std::size_t i = 0; i < n; ++i) {
    src[i] = static_cast<float>(i & 1023);
    dst[i] = 0.0f;
  }
  Limits limits;
  const double moved = 2.0 * static_cast<double>(n * sizeof(float));
  limits.copy_gbs = moved / time_best([&] { run(0); }, reps, 0.0) / 1e9;
  limits.copy_nt_gbs = moved / time_best([&] { run(1); }, reps, 0.0) / 1e9;
  limits.rmw_gbs = moved / time_best([&] { run(2); }, reps, 0.0) / 1e9;
  limits.read_gbs = moved / 2 / time_best([&] { run(3); }, reps, 0.0) / 1e9;
  limits.write_nt_gbs = moved / 2 / time_best([&] { run(4); }, reps, 0.0) / 1e9;
  limits.fma_gflops = measure_fma_gflops(threads, reps);
  return limits;
}

}  // namespace posenc::perf
#endif  // HWY_ONCE
