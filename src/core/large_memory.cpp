#include "core/large_memory.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace attncore::detail {

StreamedMemory::StreamedMemory(std::size_t bytes) {
  if (bytes == 0) return;
#if defined(__linux__)
  if (kStreamedOnHugePages && bytes >= kHugePageBytes) {
    // A mapping one huge page longer than whole small pages of `bytes`, trimmed to the aligned
    // part; fresh anonymous memory reads as zeros.
    constexpr std::size_t kPage = 4096;
    const std::size_t length = (bytes + kPage - 1) / kPage * kPage;
    const std::size_t over = length + kHugePageBytes;
    void* map = mmap(nullptr, over, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (map == MAP_FAILED) throw std::bad_alloc();
    const auto start = reinterpret_cast<std::uintptr_t>(map);
    const std::uintptr_t aligned = (start + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
    if (aligned > start) munmap(map, aligned - start);
    const std::uintptr_t end = start + over;
    if (end > aligned + length) {
      munmap(reinterpret_cast<void*>(aligned + length), end - aligned - length);
    }
    data_ = reinterpret_cast<void*>(aligned);
    mapped_ = length;
#if defined(MADV_HUGEPAGE)
    madvise(data_, length, MADV_HUGEPAGE);  // a hint: its failure changes nothing
#endif
    return;
  }
#endif
  if (posix_memalign(&data_, 64, bytes) != 0) {
    data_ = nullptr;
    throw std::bad_alloc();
  }
  std::memset(data_, 0, bytes);
}

void StreamedMemory::release() {
#if defined(__linux__)
  if (mapped_ > 0) {
    munmap(data_, mapped_);
    data_ = nullptr;
    mapped_ = 0;
    return;
  }
#endif
  std::free(data_);
  data_ = nullptr;
}

StreamedMemory::~StreamedMemory() { release(); }

StreamedMemory::StreamedMemory(StreamedMemory&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), mapped_(std::exchange(other.mapped_, 0)) {}

StreamedMemory& StreamedMemory::operator=(StreamedMemory&& other) noexcept {
  if (this != &other) {
    release();
    data_ = std::exchange(other.data_, nullptr);
    mapped_ = std::exchange(other.mapped_, 0);
  }
  return *this;
}

}  // namespace attncore::detail
