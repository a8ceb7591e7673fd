// Calls in flight when the process exits. exit() runs the static destructors and then the
// shared libraries' own (OpenBLAS frees its GEMM buffers there) while a thread the program did
// not join (a detached std::thread, a Python daemon thread) may still be inside a backend: a
// crash at exit (tests/exit_test.cpp crashed in 8 of 120 runs inside OpenBLAS). So the
// first backend run registers an atexit handler that marks the process as exiting, and waits
// until no backend run is in flight: runs stop at their next work item or, within a flash
// item, key tile (Launch::check_cancel), and every thread that leaves a run, or starts
// one, from then on sleeps forever instead (as CPython parks its daemon threads); the process
// then ends normally.
#pragma once

#include <atomic>

namespace attncore::detail {

// True once exit() began (read between work items).
inline std::atomic<bool> g_process_exiting{false};

// Counts a backend run in flight; parks the thread if the process is exiting.
void enter_run();
// Ends it; parks the thread if the process is exiting.
void leave_run();

// run() counted in flight. A run the exit stopped parks here rather than throw Cancelled to a
// caller that may not catch it (an uncaught exception ends the process with std::terminate).
template <class Fn>
void run_in_flight(Fn&& run) {
  enter_run();
  try {
    run();
  } catch (...) {
    leave_run();
    throw;
  }
  leave_run();
}

}  // namespace attncore::detail
