// posenc/memory.hpp — memory for large, long-lived tensors (KV caches above all), on 2 MiB pages.
//
// Why it matters. Decode reads a KV cache laid out [B, S, G, D]: for one KV head it reads one
// row of D values per key, and consecutive keys of that head lie G·D elements apart. At the
// common shape G = 8, D = 128, f32 that stride is exactly 4 KiB, so on ordinary 4 KiB pages
// every row of a head sits on a page of its own:
//
//     4 KiB pages:  | key 0: h0 h1 … h7 | key 1: h0 h1 … h7 | key 2: …     one page per key
//     one head's rows:    ^                   ^                   ^          a new page each row
//     2 MiB pages:  | key 0 … key 511 (all heads) | key 512 … |          512 keys per page
//
// A decode tile of 64 keys then walks 64 pages of keys and 64 of values per head pass. Measured
// on a Zen 4 (2 threads, 32768 keys, 32 query heads over 8 KV heads, D 128, f32; docs/attention.md):
// 26.9-28.9 GB/s on 4 KiB pages, 32.1-33.9 GB/s on 2 MiB pages, same binary, same minute. What
// a sequential copy gains varies: 0-7% in a test program copying 512 MiB, up to 1.5x for the
// bench's own limits on that virtual machine.
//
// HugePageBuffer maps `bytes` (rounded up to whole 2 MiB pages) of anonymous memory aligned to
// 2 MiB and, on Linux, advises the kernel to back it with transparent huge pages
// (madvise(MADV_HUGEPAGE)). Whether the kernel grants them depends on the system setting
// (/sys/kernel/mm/transparent_hugepage/enabled must be `always` or `madvise`) and on free
// contiguous memory; without them the buffer still works, on ordinary pages. Elsewhere it is
// plain 2 MiB-aligned memory.
//
// The memory starts zero-filled. Pages are allocated when first written: have the threads that
// will read a region write it first, so that it lands near them on multi-socket machines.
//
// Errors: a size above allocation_limit(), or a mapping the system refuses, throws posenc::Error
// naming `bytes`, its value and why. Zero bytes give an empty buffer (data() == nullptr).
#pragma once

#include <cstddef>
#include <cstdint>

namespace posenc {

// The allocation limit. Every buffer posenc sizes from an argument (a table of 2k + 1 Shaw rows,
// a FLOATER trajectory of length · substeps states, H ALiBi slopes, a benchmark's tensors, a
// HugePageBuffer) is checked against it before it is allocated, so that a huge or overflowing
// size is refused by name instead of wrapping to a small block, crashing in the allocator or
// being killed by the kernel when its pages are touched. The default is the machine's physical
// memory (sysconf(_SC_PHYS_PAGES) · page size), read once; set_allocation_limit(bytes) replaces
// it for the whole process (bytes >= 1).
std::size_t allocation_limit() noexcept;
void set_allocation_limit(std::size_t bytes);
// count elements of elem_bytes each, in bytes, after checking that the product neither
// overflows nor exceeds allocation_limit(). Throws posenc::Error "where: what = count; expected at
// most N (… bytes needed; the allocation limit is …)". count < 0 is refused as well.
std::size_t checked_allocation(std::int64_t count, std::size_t elem_bytes, const char* where, const char* what);

// Returns to the system the memory kept for reuse by later calls: the blocks of attention plans'
// tables (a decode step plans tables over every cache position; the next step, one key longer,
// reuses their blocks instead of faulting in fresh ones), at most 256 MiB, and RoPE's rows over
// positions from 0, kept by their frequencies, at most 128 MiB. posenc.empty_cache() calls it.
void empty_cache();

class HugePageBuffer {
 public:
  static constexpr std::size_t kPageBytes = std::size_t{2} << 20;  // x86-64's 2 MiB page

  HugePageBuffer() noexcept = default;
  explicit HugePageBuffer(std::size_t bytes);
  ~HugePageBuffer();
  HugePageBuffer(HugePageBuffer&& other) noexcept;
  HugePageBuffer& operator=(HugePageBuffer&& other) noexcept;
  HugePageBuffer(const HugePageBuffer&) = delete;
  HugePageBuffer& operator=(const HugePageBuffer&) = delete;

  void* data() const noexcept { return data_; }
  // The bytes asked for; the mapping covers mapped_bytes() >= size().
  std::size_t size() const noexcept { return size_; }
  std::size_t mapped_bytes() const noexcept { return mapped_; }
  // True when the system accepted the advice to use huge pages (not a promise that it will).
  bool huge_pages_advised() const noexcept { return advised_; }

  // The memory viewed as `count()` elements of T (trivially constructible T; the zero bytes
  // are valid values of every arithmetic type).
  template <class T>
  T* as() const noexcept {
    return static_cast<T*>(data_);
  }
  template <class T>
  std::size_t count() const noexcept {
    return size_ / sizeof(T);
  }

 private:
  void release() noexcept;
  void* data_ = nullptr;
  std::size_t size_ = 0, mapped_ = 0;
  bool advised_ = false;
};

}  // namespace posenc
