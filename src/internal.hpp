// Internal helpers shared by the public entry points and the fp64 reference: argument checks that
// produce posenc::Error messages, element access for any dtype, and the thread count.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <initializer_list>
#include <mutex>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "posenc/dtype.hpp"
#include "posenc/error.hpp"
#include "posenc/positions.hpp"
#include "posenc/tensor.hpp"

namespace posenc::detail {

// An allocator whose blocks start on a 64-byte boundary (one cache line, one AVX-512 vector).
// The attention kernels' scratch rows are multiples of 16 floats, so with an aligned base every
// full-width vector load and store stays inside one cache line. glibc's malloc returns 16-byte
// alignment (large blocks: a page plus 16 bytes), and then every 64-byte load splits over two
// lines. Measured with attn_gemm at the forward pass's shapes (64 × 128 × 128, 60 × 64 × 64), 1
// thread, ratio to the FMA peak timed around each run: 0.77–0.82 aligned, 0.65–0.72 at +16 bytes.
template <class T, std::size_t kAlign = 64>
struct AlignedAllocator {
  using value_type = T;
  template <class U>
  struct rebind {
    using other = AlignedAllocator<U, kAlign>;
  };
  AlignedAllocator() = default;
  template <class U>
  explicit AlignedAllocator(const AlignedAllocator<U, kAlign>& /* other */) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new (n * sizeof(T), std::align_val_t{kAlign})); }
  void deallocate(T* p, std::size_t /* n */) { ::operator delete (p, std::align_val_t{kAlign}); }
  template <class U>
  bool operator==(const AlignedAllocator<U, kAlign>& /* other */) const {
    return true;
  }
};
// Floats whose first element sits on a cache line.
using AlignedFloats = std::vector<float, AlignedAllocator<float>>;
// Pairs of bf16 (the native bf16 products' operands, kernels::attn_gemm_bf16).
using AlignedPairs = std::vector<std::uint32_t, AlignedAllocator<std::uint32_t>>;

// Blocks for the tables of an attention call's plan, 64-byte aligned. Each decode step is a new
// call over the same sizes (the cache one key longer): its tables are megabytes (ALiBi over 32768
// keys and 32 heads: 4 MiB per table), and fresh pages cost more than filling them (a third of a
// step's planning in page faults). So blocks of at least kTableBlockMin bytes go back to a
// process-wide cache when a plan is destroyed, by size class (steps of 1/8 of a power of two, so
// that a table one key longer finds the block of the step before), and the next plan takes them.
// The cache keeps at most kTableCacheBytes, dropping the oldest; posenc::empty_cache() empties it.
inline constexpr std::size_t kTableBlockMin = std::size_t{256} << 10;
inline constexpr std::size_t kTableCacheBytes = std::size_t{256} << 20;
void* take_table_block(std::size_t bytes);
void give_table_block(void* block, std::size_t bytes) noexcept;

template <class T>
struct TableAllocator {
  using value_type = T;
  TableAllocator() = default;
  template <class U>
  explicit TableAllocator(const TableAllocator<U>& /* other */) {}
  T* allocate(std::size_t n) { return static_cast<T*>(take_table_block(n * sizeof(T))); }
  void deallocate(T* p, std::size_t n) noexcept { give_table_block(p, n * sizeof(T)); }
  // resize(n) leaves the new elements uninitialised: every table is written whole after it is
  // sized, and zeroing megabytes first costs as much as filling them.
  template <class U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <class U, class... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
  template <class U>
  bool operator==(const TableAllocator<U>& /* other */) const {
    return true;
  }
};
// Drops RoPE's rows kept across calls (schemes/rope_transform.cpp), for posenc::empty_cache().
void empty_rope_row_cache();

// A plan's table (attention/attention_plan.hpp): floats on a cache line, their block reused, not
// zeroed when sized.
using TableFloats = std::vector<float, TableAllocator<float>>;

// A [B, S, D] token grid, from a rank-3 view or a rank-2 [S, D] view (B = 1).
struct Grid {
  std::int64_t batch = 1, seq = 0, dim = 0;
  std::int64_t batch_stride = 0, seq_stride = 0, dim_stride = 1;

  std::int64_t offset(std::int64_t b, std::int64_t s) const { return b * batch_stride + s * seq_stride; }
};

Grid token_grid(const char* where, const char* name, ConstTensorView view);

// A [B, S, H, D] view, or a packed [T, H, D] one (B = 1, S = T).
struct HeadsGrid {
  std::int64_t batch = 1, seq = 0, heads = 0, dim = 0;
  std::int64_t batch_stride = 0, seq_stride = 0, head_stride = 0, dim_stride = 1;

  std::int64_t offset(std::int64_t b, std::int64_t s) const { return b * batch_stride + s * seq_stride; }
};
// Row (b, s, h) of a [B, S, H, D] grid in f32, zero-padded to `padded` floats (f32, bf16, f16 or
// f64 memory; attention/rows.cpp), and its inverse: row rounded once into dtype (+= with accumulate).
void load_heads_row(const void* base, DType dtype, const HeadsGrid& g, std::int64_t b, std::int64_t s, std::int64_t h,
                    float* out, std::int64_t padded);
void store_heads_row(const float* row, void* base, DType dtype, const HeadsGrid& g, std::int64_t b, std::int64_t s,
                     std::int64_t h, bool accumulate);
// Row (b, s, h)'s cache lines prefetched into L1 (unit dim stride only); with `write`, as
// prefetchw where the build's baseline has PRFCHW, else as a read. A block's rows lie a token's heads apart: prefetched
// together, their misses overlap instead of following each other.
inline void prefetch_heads_row(const void* base, DType dtype, const HeadsGrid& g, std::int64_t b, std::int64_t s,
                               std::int64_t h, bool write = false) {
  if (g.dim_stride != 1) return;
  const auto size = static_cast<std::int64_t>(dtype_size(dtype));
  const char* row = static_cast<const char*>(base) + (g.offset(b, s) + h * g.head_stride) * size;
  for (std::int64_t at = 0; at < g.dim * size; at += 64) {
    if (write) {
      __builtin_prefetch(row + at, 1, 3);
    } else {
      __builtin_prefetch(row + at, 0, 3);
    }
  }
}
// Whether the first `cols` floats of `count` rows, ld apart, hold an inf or NaN (attention/rows.cpp).
bool rows_non_finite(const float* rows, std::int64_t ld, std::int64_t count, std::int64_t cols);
// Throws posenc::Error unless the view has rank 4 or 3.
HeadsGrid heads_grid(const char* where, const char* name, ConstTensorView view);
// An output (or gradient) of the shape of the tokens `like` describes, and writable.
HeadsGrid check_output_tokens(const char* where, const char* name, ConstTensorView view, const HeadsGrid& like);
// [rows, cols] of a rank-2 view, as a Grid with batch = 1.
Grid matrix_grid(const char* where, const char* name, ConstTensorView view);

void check_same_dims(const char* where, const char* name, const Grid& got, const char* ref_name, const Grid& ref);
void check_dtype(const char* where, const char* name, DType got, DType expected);
// An output must not name one element by two indices (stride 0 over an extent > 1, or strides
// that make rows overlap): throws posenc::Error naming the offending stride.
void check_writable(const char* where, const char* name, ConstTensorView view);

// A learned parameter's values: throws posenc::Error unless values.size() == size ("where:
// name.size() = n; expected <expected_size>") and every value is finite ("name[e] = nan").
void check_parameter(const char* where, const char* name, const std::vector<double>& values, std::size_t size,
                     const std::string& expected_size);
// The element count of a parameter table whose extents are `factors` (each >= 1, checked by the
// caller), checked for int64 overflow and against allocation_limit() for doubles: "where: what =
// a · b · c; expected a table that fits in memory (… needed …)".
std::size_t table_count(const char* where, const char* what, std::initializer_list<std::int64_t> factors);
// Throws unless a gradient buffer's size `got` equals `expected`.
void check_gradient_size(const char* where, const char* name, std::size_t got, std::int64_t expected);
// Packed sequences' offsets: at least 2 entries, from 0, non-decreasing, ending at `tokens`.
void check_cu_seqlens(const char* where, const char* name, const std::vector<std::int64_t>& cu, std::int64_t tokens);
// Shortest text that reads back as the same double ("1e-09", "0.5", "nan"), for error messages.
std::string to_text(double value);

inline double load(const void* base, DType dtype, std::int64_t offset) {
  switch (dtype) {
    case DType::kF32:
      return static_cast<const float*>(base)[offset];
    case DType::kF64:
      return static_cast<const double*>(base)[offset];
    case DType::kBF16:
      return from_bf16(static_cast<const bf16*>(base)[offset]);
    case DType::kF16:
      return from_f16(static_cast<const f16*>(base)[offset]);
  }
  return 0.0;
}

// Rounds once to the destination type (bf16/f16 through f32: the double rounding can move a
// result by at most one unit in the last place of the 16-bit type, as documented).
inline void store(void* base, DType dtype, std::int64_t offset, double value) {
  switch (dtype) {
    case DType::kF32:
      static_cast<float*>(base)[offset] = static_cast<float>(value);
      return;
    case DType::kF64:
      static_cast<double*>(base)[offset] = value;
      return;
    case DType::kBF16:
      static_cast<bf16*>(base)[offset] = to_bf16(static_cast<float>(value));
      return;
    case DType::kF16:
      static_cast<f16*>(base)[offset] = to_f16(static_cast<float>(value));
      return;
  }
}

// Dispatch state (dispatch.cpp). Every public entry point calls init_dispatch() first, so that
// POSENC_TARGET takes effect before the first kernel runs.
void init_dispatch();
bool use_reference();

// Threads for a parallel region of `work` elementary operations (1 when too small to share).
int threads_for(std::int64_t work);

// The first exception thrown inside a parallel region, carried out of it: an exception may not
// leave an OpenMP region (std::terminate), and code run there may throw (a scheme's own
// definition, which the generic fused forms call pair by pair). run(fn) calls fn unless an
// earlier call failed, keeping the first exception; rethrow() after the region throws it.
class ParallelErrors {
 public:
  template <class Fn>
  void run(Fn&& fn) noexcept {
    if (failed_.load(std::memory_order_relaxed)) return;
    try {
      fn();
    } catch (...) {
      keep(std::current_exception());
    }
  }
  void rethrow() const {
    if (first_) std::rethrow_exception(first_);
  }

 private:
  void keep(std::exception_ptr e) noexcept {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (!first_) first_ = std::move(e);
    failed_.store(true, std::memory_order_relaxed);
  }
  std::atomic<bool> failed_{false};
  std::mutex mutex_;
  std::exception_ptr first_;
};

// The index-th draw of a standard normal stream: depends only on (seed, index), never on the
// thread count (SplitMix64 as a counter-based generator, Box–Muller on two draws).
double seeded_normal(std::uint64_t seed, std::uint64_t index);

// ω_i = base^(-2i/d) in extended precision, rounded to fp64.
double sinusoid_inv_frequency(double base, std::int64_t dim, std::int64_t i);

}  // namespace posenc::detail
