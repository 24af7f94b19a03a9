// Measured limits of this machine, for the ratios every benchmark prints beside its throughput.
// Internal to posenc's CLI and benchmarks (not installed).
//
//   copy      STREAM-like copy b[i] = a[i] with ordinary stores (a loop of loads and stores, never
//             memcpy: see perf/limits.cpp).
//   copy_nt   the same copy with non-temporal (streaming) stores, which skip the read-for-ownership
//   rmw       in-place read-modify-write a[i] = a[i] + 1: the bound of kernels that update a
//             buffer in place (no read-for-ownership either: the line was just read)
//   read      a sum over the buffer read as two streams side by side, with software prefetch
//             4 KiB ahead (into L2): the bound of kernels that only read (reductions, decode).
//             Two streams, because one reads slower and four or more read no faster.
//   write_nt  non-temporal stores of zeros: the bound of kernels that only write (bias matrices)
//   fma       f32 fused multiply-adds on independent register accumulators, in GFLOP/s (2 flops
//             per lane): the compute bound of attention
//
// All count bytes read + bytes written (STREAM's convention) and use the given thread count on
// buffers of 4× the last-level cache each (STREAM's rule, so that they measure memory, not
// cache; 128 MiB at least, 2 GiB at most), touched before timing. Always measured with the best
// SIMD target, whatever target the kernel under test is forced to.
#pragma once

#include <hwy/aligned_allocator.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "posenc/error.hpp"
#include "posenc/memory.hpp"

namespace posenc::perf {

struct Limits {
  double copy_gbs = 0;  // GB/s, 1e9 bytes per second
  double copy_nt_gbs = 0;
  double rmw_gbs = 0;
  double read_gbs = 0;
  double write_nt_gbs = 0;
  double fma_gflops = 0;  // GFLOP/s
  double get(const std::string& name) const {
    return name == "copy_nt"    ? copy_nt_gbs
           : name == "rmw"      ? rmw_gbs
           : name == "read"     ? read_gbs
           : name == "write_nt" ? write_nt_gbs
           : name == "fma"      ? fma_gflops
                                : copy_gbs;
  }
};

// Bench memory, 64-byte aligned as PyTorch and NumPy allocate tensors; with `huge` (the bench's
// --huge-pages) on 2 MiB pages where the system grants them (posenc::HugePageBuffer). The limits
// and the kernels' buffers use it alike, so that both sides of a ratio run on the same kind of
// memory. `allocate` leaves the first touch to the caller; `assign` writes every element.
template <class T>
struct BenchArray {
  HugePageBuffer huge_memory;
  hwy::AlignedFreeUniquePtr<T[]> plain_memory;
  T* pointer = nullptr;
  std::size_t count = 0;
  void allocate(std::size_t n, bool huge) {
    clear();
    // Within posenc's allocation limit, and refused by name when the system says no: a shape
    // that asks for more never reaches a null pointer.
    const std::size_t bytes = checked_allocation(
        static_cast<std::int64_t>(std::min<std::size_t>(n, std::numeric_limits<std::int64_t>::max())), sizeof(T),
        "bench", "buffer elements");
    if (huge) {
      huge_memory = HugePageBuffer(bytes);
      pointer = huge_memory.as<T>();
    } else {
      plain_memory = hwy::AllocateAligned<T>(n);
      pointer = plain_memory.get();
      if (pointer == nullptr && n > 0) {
        throw Error("bench", "buffer bytes", std::to_string(bytes), "an allocation the system grants");
      }
    }
    count = n;
  }
  void assign(std::size_t n, T value, bool huge) {
    allocate(n, huge);
    std::fill(pointer, pointer + n, value);
  }
  void clear() {
    huge_memory = HugePageBuffer();
    plain_memory.reset();
    pointer = nullptr;
    count = 0;
  }
  std::size_t size() const { return count; }
  T* data() const { return pointer; }
  T* get() const { return pointer; }
  T* begin() const { return pointer; }
  T* end() const { return pointer + count; }
};

// Size of the last-level cache in bytes: the kernel's sysfs description of CPU 0's caches, else
// sysconf, else 32 MiB.
std::size_t last_level_cache_bytes();

// Best of `reps` runs of each kind; with `huge_pages`, on buffers on 2 MiB pages
// (posenc::HugePageBuffer), for kernels whose buffers are on them too.
Limits measure_limits(int threads, int reps = 5, bool huge_pages = false);
// The f32 FMA peak alone (also part of measure_limits).
double measure_fma_gflops(int threads, int reps = 5);

// Seconds per call of `fn`: the fastest of at least `min_reps` calls and of as many as fit into
// `min_seconds` (the machine is shared and noisy; the minimum is the least disturbed run).
template <class Fn>
double time_best(Fn&& fn, int min_reps = 5, double min_seconds = 0.5) {
  using Clock = std::chrono::steady_clock;
  fn();  // warm-up: first touch, caches, thread pool
  double best = 1e300;
  const auto start = Clock::now();
  for (int rep = 0;; ++rep) {
    const auto t0 = Clock::now();
    fn();
    const auto t1 = Clock::now();
    best = std::min(best, std::chrono::duration<double>(t1 - t0).count());
    if (rep + 1 >= min_reps && std::chrono::duration<double>(t1 - start).count() >= min_seconds) {
      break;
    }
  }
  return best;
}

}  // namespace posenc::perf
