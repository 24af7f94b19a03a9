#include "posenc/memory.hpp"

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <string>
#include <utility>

#include "posenc/error.hpp"

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace posenc {
namespace {

constexpr const char* kWhere = "HugePageBuffer";

std::size_t round_up_to_pages(std::size_t bytes) {
  constexpr std::size_t page = HugePageBuffer::kPageBytes;
  // One page of slack is mapped on top to align the start (see the constructor).
  if (bytes > std::numeric_limits<std::size_t>::max() - 2 * page) {
    throw Error(kWhere, "bytes", std::to_string(bytes),
                "at most " + std::to_string(std::numeric_limits<std::size_t>::max() - 2 * page));
  }
  return (bytes + page - 1) / page * page;
}

}  // namespace

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

}  // namespace posenc
