#include "core/exit_guard.h"

#include <chrono>
#include <cstdlib>
#include <thread>

namespace attncore::detail {

namespace {

std::atomic<int> g_in_flight{0};  // backend runs in flight (plain atomics: never destroyed)

[[noreturn]] void park() {
  for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
}

// The atexit handler: runs before the static destructors of objects made before the first
// backend run and before every shared library's destructors. Waits for the runs in flight to
// reach their next work item or key tile (milliseconds).
void wait_for_runs() {
  g_process_exiting.store(true);
  while (g_in_flight.load() > 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
}

}  // namespace

void enter_run() {
  static const bool registered = std::atexit(wait_for_runs) == 0;
  static_cast<void>(registered);
  g_in_flight.fetch_add(1);
  // seq_cst on both sides: either the handler sees this run counted, or this run sees the flag.
  if (g_process_exiting.load()) {
    g_in_flight.fetch_sub(1);
    park();
  }
}

void leave_run() {
  g_in_flight.fetch_sub(1);
  if (g_process_exiting.load()) park();
}

}  // namespace attncore::detail
