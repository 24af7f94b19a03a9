#include "posenc/memory.hpp"

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <limits>
#include <mutex>
#include <new>
#include <string>
#include <utility>

#include "internal.hpp"
#include "posenc/error.hpp"

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif
#include <atomic>

namespace posenc {
namespace {

constexpr const char* kWhere = "HugePageBuffer";

std::size_t physical_memory() noexcept {
#if defined(__linux__)
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0 &&
      static_cast<unsigned long>(pages) <= std::numeric_limits<std::size_t>::max() / static_cast<unsigned long>(page)) {
    return static_cast<std::size_t>(pages) * static_cast<std::size_t>(page);
  }
#endif
  return std::size_t{1} << 40;  // 1 TiB where the system does not say
}

std::atomic<std::size_t>& limit_slot() noexcept {
  static std::atomic<std::size_t> limit{physical_memory()};
  return limit;
}

std::string bytes_text(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 6) {
    bytes /= 1024.0;
    ++u;
  }
  char text[48];
  std::snprintf(text, sizeof(text), u == 0 ? "%.0f %s" : "%.1f %s", bytes, units[u]);
  return text;
}

std::size_t round_up_to_pages(std::size_t bytes) {
  constexpr std::size_t page = HugePageBuffer::kPageBytes;
  if (bytes > allocation_limit()) {
    throw Error(
        kWhere, "bytes", std::to_string(bytes),
        "at most the allocation limit, " + std::to_string(allocation_limit()) + " (posenc::set_allocation_limit)");
  }
  // One page of slack is mapped on top to align the start (see the constructor); the limit is
  // far below where this could wrap.
  return (bytes + page - 1) / page * page;
}

}  // namespace

std::size_t allocation_limit() noexcept { return limit_slot().load(std::memory_order_relaxed); }

void set_allocation_limit(std::size_t bytes) {
  // Above 2^62 the checked products below could not be told from an overflow.
  constexpr std::size_t kMax = std::size_t{1} << 62;
  if (bytes < 1 || bytes > kMax) {
    throw Error("set_allocation_limit", "bytes", std::to_string(bytes), "1 to 2^62");
  }
  limit_slot().store(bytes, std::memory_order_relaxed);
}

std::size_t checked_allocation(std::int64_t count, std::size_t elem_bytes, const char* where, const char* what) {
  const std::size_t limit = allocation_limit();
  const std::size_t most = elem_bytes == 0 ? limit : limit / elem_bytes;
  if (count < 0 || static_cast<std::uint64_t>(count) > most) {
    const double need = static_cast<double>(count) * static_cast<double>(elem_bytes);
    throw Error(where, what, std::to_string(count),
                count < 0 ? std::string(">= 0")
                          : "at most " + std::to_string(most) + " (" + bytes_text(need) +
                                " needed; the allocation limit is " + bytes_text(static_cast<double>(limit)) +
                                ", posenc::set_allocation_limit)");
  }
  return static_cast<std::size_t>(count) * elem_bytes;
}

HugePageBuffer::HugePageBuffer(std::size_t bytes) {
  if (bytes == 0) return;
  const std::size_t mapped = round_up_to_pages(bytes);
  constexpr std::size_t page = kPageBytes;
#if defined(__linux__)
  // mmap aligns only to 4 KiB: map one page more, then give back the ends so that what stays
  // starts on a 2 MiB boundary. The kernel can only use a huge page for an aligned 2 MiB range.
  void* raw = mmap(nullptr, mapped + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) {
    throw Error(kWhere, "bytes", std::to_string(bytes),
                std::string("a size the system can map (mmap failed: ") + std::strerror(errno) + ")");
  }
  const auto start = reinterpret_cast<std::uintptr_t>(raw);
  const std::uintptr_t aligned = (start + page - 1) / page * page;
  if (aligned > start) munmap(raw, aligned - start);
  const std::uintptr_t end = start + mapped + page, aligned_end = aligned + mapped;
  if (end > aligned_end) munmap(reinterpret_cast<void*>(aligned_end), end - aligned_end);
  data_ = reinterpret_cast<void*>(aligned);
  advised_ = madvise(data_, mapped, MADV_HUGEPAGE) == 0;
#else
  data_ = ::operator new (mapped, std::align_val_t{page}, std::nothrow);
  if (data_ == nullptr) {
    throw Error(kWhere, "bytes", std::to_string(bytes), "a size the system can allocate");
  }
  std::memset(data_, 0, mapped);
#endif
  size_ = bytes;
  mapped_ = mapped;
}

void HugePageBuffer::release() noexcept {
  if (data_ == nullptr) return;
#if defined(__linux__)
  munmap(data_, mapped_);
#else
  ::operator delete (data_, std::align_val_t{kPageBytes});
#endif
  data_ = nullptr;
  size_ = mapped_ = 0;
  advised_ = false;
}

HugePageBuffer::~HugePageBuffer() { release(); }

HugePageBuffer::HugePageBuffer(HugePageBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      mapped_(std::exchange(other.mapped_, 0)),
      advised_(std::exchange(other.advised_, false)) {}

HugePageBuffer& HugePageBuffer::operator=(HugePageBuffer&& other) noexcept {
  if (this != &other) {
    release();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    mapped_ = std::exchange(other.mapped_, 0);
    advised_ = std::exchange(other.advised_, false);
  }
  return *this;
}

namespace {

// The size class of a table block: bytes rounded up to a multiple of 1/8 of its power of two.
std::size_t table_block_class(std::size_t bytes) noexcept {
  if (bytes < detail::kTableBlockMin) return bytes;
  std::size_t power = detail::kTableBlockMin;
  while (power <= bytes / 2) power *= 2;
  const std::size_t step = power / 8;
  return (bytes + step - 1) / step * step;
}

class TableCache {
 public:
  static TableCache& instance() {
    static TableCache* cache = new TableCache();  // never destroyed: plans may outlive static destruction
    return *cache;
  }
  void* take(std::size_t bytes) {
    const std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = free_.rbegin(); it != free_.rend(); ++it) {
      if (it->bytes == bytes) {
        void* block = it->block;
        cached_ -= bytes;
        free_.erase(std::next(it).base());
        return block;
      }
    }
    return nullptr;
  }
  // Keeps the block, dropping the oldest while over the limit; false: too large to keep.
  bool give(void* block, std::size_t bytes) {
    if (bytes > detail::kTableCacheBytes) return false;
    const std::lock_guard<std::mutex> lock(mutex_);
    free_.push_back({block, bytes});  // first: if it throws, nothing has changed
    cached_ += bytes;
    while (cached_ > detail::kTableCacheBytes) {
      cached_ -= free_.front().bytes;
      ::operator delete (free_.front().block, std::align_val_t{64});
      free_.pop_front();
    }
    return true;
  }
  void empty() {
    const std::lock_guard<std::mutex> lock(mutex_);
    for (const Block& b : free_) ::operator delete (b.block, std::align_val_t{64});
    free_.clear();
    cached_ = 0;
  }

 private:
  struct Block {
    void* block;
    std::size_t bytes;
  };
  std::mutex mutex_;
  std::deque<Block> free_;  // oldest first
  std::size_t cached_ = 0;
};

}  // namespace

namespace detail {

void* take_table_block(std::size_t bytes) {
  const std::size_t size = table_block_class(bytes);
  if (size >= kTableBlockMin) {
    if (void* block = TableCache::instance().take(size)) return block;
  }
  return ::operator new (size, std::align_val_t{64});
}

void give_table_block(void* block, std::size_t bytes) noexcept {
  if (block == nullptr) return;
  const std::size_t size = table_block_class(bytes);
  bool kept = false;
  if (size >= kTableBlockMin) {
    try {
      kept = TableCache::instance().give(block, size);
    } catch (...) {  // the cache's bookkeeping could not grow: the block goes back to the system
      kept = false;
    }
  }
  if (!kept) ::operator delete (block, std::align_val_t{64});
}

}  // namespace detail

void empty_cache() {
  detail::empty_rope_row_cache();  // first: its tables' blocks then return to the table cache
  TableCache::instance().empty();
}

}  // namespace posenc
