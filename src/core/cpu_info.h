// Measurements of the machine shared inside the library (the public ones are in attncore/info.h).
#pragma once

namespace attncore::detail {

// Peak f32 FMA throughput of `threads` threads in GFLOP/s: the best of `runs` runs of about
// `run_seconds` each (measure_fma_peak_gflops of attncore/info.h is this with 0.06 s x 3).
double measure_fma_peak_gflops(int threads, double run_seconds, int runs);

// This machine's physical memory in bytes (sysconf); 2^62 where the OS does not say.
double physical_memory_bytes();

}  // namespace attncore::detail
