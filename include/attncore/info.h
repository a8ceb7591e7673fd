// What attncore knows about the machine it runs on.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "attncore/export.h"
#include "attncore/version.h"

namespace attncore {

struct ATTNCORE_API CpuInfo {
  std::string vendor;                 // "AuthenticAMD", ...
  std::string brand;                  // "AMD EPYC ..."
  int family = 0;                     // x86: the display family and model of cpuid leaf 1
  int model = 0;                      // (AMD 0x19: Zen 3 and 4, 0x1A: Zen 5); 0 elsewhere
  int logical_cores = 1;              // std::thread::hardware_concurrency()
  std::vector<std::string> features;  // "avx2", "fma", "avx512f", "avx512bf16", ...
  bool has(const std::string& feature) const;
};

ATTNCORE_API CpuInfo cpu_info();

// The version of the library loaded, "MAJOR.MINOR.PATCH" (ATTNCORE_VERSION of
// attncore/version.h is the version of the headers compiled against).
ATTNCORE_API const char* version();

// Threads a call with num_threads = 0 uses when set_num_threads (attncore/options.h) has set
// none: ATTNCORE_NUM_THREADS if set, else the CPUs the calling thread may run on
// (sched_getaffinity; at most kMaxThreads). Throws InvalidArgument when ATTNCORE_NUM_THREADS
// is set to anything but an integer from 1 to kMaxThreads (set empty, it counts as unset).
ATTNCORE_API int default_num_threads();

// The memory this process may use: the smallest of the physical memory, the memory limit of
// its cgroup (v2 memory.max, v1 memory.limit_in_bytes, over the cgroup and its ancestors) and
// RLIMIT_AS, with the name of the one that is smallest ("physical memory", "the cgroup limit",
// "RLIMIT_AS"). The first two are read once per process; RLIMIT_AS at every call. A call whose
// outputs and workspace exceed it is refused with OutOfMemory before anything is allocated
// (RLIMIT_AS is consulted for calls of 1 MiB or more: the library's code alone maps more).
struct MemoryLimit {
  double bytes;
  const char* name;
};
ATTNCORE_API MemoryLimit memory_limit();

// Measured peak f32 FMA throughput of `threads` threads (<= 0: default_num_threads()) in
// GFLOP/s: independent FMA chains in registers on the widest vector unit the CPU has, best of
// a few short runs (~0.1 s each).
ATTNCORE_API double measure_fma_peak_gflops(int threads);

// Measured read bandwidth of `threads` threads (<= 0: default_num_threads()) in GB/s (10^9
// bytes/s): each thread sums its own part of a 512 MiB buffer (far beyond the caches; less
// where the process may use under 4 GiB) with 8 vector accumulators, as one stream and as two
// at once (the part's halves, as decode reads K and V), the faster pattern's median of 5 runs
// of 2 passes each (0.3-0.6 s with the first touch). What a memory-bound call (decode over
// a long KV cache) can at best stream; `attncore info` and `attncore bench --decode` report it.
// piece_bytes > 0 (a multiple of 512, at most a thread's part): each thread reads its part in
// pieces of that size in a fixed shuffled order (two streams: two pieces at once), as decode
// reads a paged cache whose pages lie anywhere in their pool (what such a decode can at best
// stream; pieces of 128 KiB read about a tenth less than the whole part on the measuring
// machine).
ATTNCORE_API double measure_read_bandwidth_gbs(int threads, std::int64_t piece_bytes = 0);

// SIMD targets of the fused kernels compiled into this build ("avx512bf16", "avx512", "avx2",
// "generic"), and those this CPU can run, best first for this CPU: avx512 before avx512bf16 on
// Intel's cores, where bf16 pair dot products run at half the FMA's rate (README, "SIMD
// targets").
ATTNCORE_API std::vector<std::string> simd_targets_compiled();
ATTNCORE_API std::vector<std::string> simd_targets_supported();

// The target the fused kernels use now: the first of simd_targets_supported() unless
// set_simd_target chose.
ATTNCORE_API std::string simd_target();

// Makes every later call use `name` ("" = automatic); returns the previous setting. Throws
// InvalidArgument when `name` is not compiled in or this CPU cannot run it. Process-wide.
ATTNCORE_API std::string set_simd_target(const std::string& name);

}  // namespace attncore
