// Memory for large buffers that kernels stream: a PagedKvCache's page pools, Tensors of 32 MiB
// or more, the bandwidth probes' buffers.
#pragma once

#include <cstddef>

namespace attncore::detail {

// Whether StreamedMemory maps buffers of its own on huge pages (Linux, and not under
// AddressSanitizer, which checks heap memory only), else takes them from the heap.
#if defined(__SANITIZE_ADDRESS__)
#define ATTNCORE_UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define ATTNCORE_UNDER_ASAN 1
#endif
#endif
#if defined(__linux__) && !defined(ATTNCORE_UNDER_ASAN)
inline constexpr bool kStreamedOnHugePages = true;
#else
inline constexpr bool kStreamedOnHugePages = false;
#endif
inline constexpr std::size_t kHugePageBytes = std::size_t{2} << 20;

// `bytes` bytes of zeros. With kStreamedOnHugePages and at least kHugePageBytes of them: a
// mapping of their own, kHugePageBytes aligned, for which the OS is asked, before anything
// touches it, for huge pages (Linux's transparent huge pages in madvise or always mode; a hint,
// ignored where not offered); its own, so that the advice never reaches memory the process's
// allocator hands out later. Streamed with fewer TLB misses: decode from memory (Lk = 16384,
// 1 thread, Zen 3, K/V on 4 KiB pages against huge ones in one process, median of 9 rounds)
// read 2-11% more K/V GB/s on huge pages (MHA f32 16.6 -> 17.0, bf16 11.3 -> 12.5, f16 11.7 ->
// 12.1; GQA f32 10.3 -> 11.4, bf16 6.9 -> 7.6; pages of 16 keys alike); and touching 48 MiB
// took 4 ms instead of 21. Otherwise from the heap, 64-byte aligned.
class StreamedMemory {
 public:
  StreamedMemory() = default;
  explicit StreamedMemory(std::size_t bytes);  // throws std::bad_alloc
  ~StreamedMemory();
  StreamedMemory(StreamedMemory&& other) noexcept;
  StreamedMemory& operator=(StreamedMemory&& other) noexcept;
  StreamedMemory(const StreamedMemory&) = delete;
  StreamedMemory& operator=(const StreamedMemory&) = delete;

  void* data() const { return data_; }

 private:
  void release();
  void* data_ = nullptr;
  std::size_t mapped_ = 0;  // bytes of its own mapping at data_ (0: heap memory)
};

}  // namespace attncore::detail
