// Measurements of the machine shared inside the library (the public ones are in attncore/info.h).
#pragma once

#include <optional>
#include <string>

#include "attncore/info.h"  // memory_limit

namespace attncore::detail {

// Peak f32 FMA throughput of `threads` threads in GFLOP/s: the best of `runs` runs of about
// `run_seconds` each (measure_fma_peak_gflops of attncore/info.h is this with 0.06 s x 3).
double measure_fma_peak_gflops(int threads, double run_seconds, int runs);

// Threads a call with num_threads = 0 uses (default_num_threads of attncore/info.h): a bad
// ATTNCORE_NUM_THREADS throws InvalidArgument with `op` as the message's operation.
int default_threads(const char* op);

// The CPUs the calling thread may run on (sched_getaffinity), at most kMaxThreads; where the OS
// does not say, machine_threads().
int affinity_threads();

// The machine's logical cores (std::thread::hardware_concurrency, which ignores affinity), at
// least 1 and at most kMaxThreads: a fixed property of the machine.
int machine_threads();

// This machine's physical memory in bytes (sysconf); 2^62 where the OS does not say.
double physical_memory_bytes();

// The smallest cgroup memory limit that applies to a process whose /proc/self/cgroup reads
// `proc_self_cgroup`, with the cgroup file systems mounted under `root` (/sys/fs/cgroup: v2 at
// root or root/unified, v1's memory controller at root/memory); infinity when none is set.
double cgroup_memory_limit_bytes(const std::string& proc_self_cgroup, const std::string& root);

// Below this many bytes a request is held to the physical memory and the cgroup limit only,
// not to RLIMIT_AS, whose system call memory_limit() makes at every call: four per decode call
// (its two outputs, its workspace, its append), 0.5 us each on the Zen 3 of docs/decode.md
// (a getrlimit loop), a quarter of a decode over 16 keys. A process running this library's code
// already holds more address space than this (the code alone maps 1.4 MB), so only a limit
// below what the process holds could refuse less; under one, the allocations come from memory
// already mapped or raise OutOfMemory.
inline constexpr double kUncheckedAddressSpace = 1 << 20;

// The limit `bytes` exceed (memory_limit, attncore/info.h), or nothing where they fit.
std::optional<MemoryLimit> exceeded_memory_limit(double bytes);

// Refuses, before the allocator sees it, memory of `bytes` past what this process may use
// (memory_limit, attncore/info.h): throws OutOfMemory "<what> exceeds the memory this process
// may use (bytes=..., expected <= ... bytes, <the limit>); <remedy>".
void refuse_past_memory_limit(double bytes, const std::string& what, const char* remedy);

}  // namespace attncore::detail
