// Memory for large buffers that kernels stream (K/V caches, the bandwidth probes' buffers).
#pragma once

#include <cstddef>

namespace attncore::detail {

// Memory for `bytes` bytes (> 0), freed with std::free; nullptr when the allocation fails. From
// kLargeBytes on: aligned to kLargeBytes, and the OS asked, before anything touches it, to back
// it with huge pages (Linux's transparent huge pages in their madvise mode; a hint, ignored
// where not offered), so that streaming it takes fewer TLB misses and its first touch fewer
// faults: decode from memory (Lk = 16384, 1 thread, Zen 3, K/V of a Tensor on 4 KiB pages
// against huge ones, in one process, median of 9 rounds) read 2-11% more GB/s on huge pages
// (MHA f32 16.6 -> 17.0, bf16 11.3 -> 12.5, f16 11.7 -> 12.1; GQA f32 10.3 -> 11.4, bf16 6.9
// -> 7.6; pages of 16 keys alike), and touching 48 MiB took 4 ms instead of 21. Below
// kLargeBytes: 64-byte aligned.
constexpr std::size_t kLargeBytes = std::size_t{2} << 20;
void* allocate_streamed(std::size_t bytes);

}  // namespace attncore::detail
