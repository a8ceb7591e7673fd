// Executors for tests/executor_test.cpp: each counts its parallel regions and checks the
// worker indices it hands out.
#pragma once

#include <atomic>

#include "attncore/options.h"

namespace attncore::test {

// parallel_for checks its arguments and counts, then run() executes the tasks.
class CountingExecutor : public Executor {
 public:
  mutable std::atomic<int> calls{0};
  mutable std::atomic<int> max_concurrency{0};
  mutable std::atomic<bool> bad_worker{false};  // a worker index outside [0, concurrency)

  void parallel_for(int num_tasks, int concurrency, const Task& task) const final {
    calls.fetch_add(1);
    int seen = max_concurrency.load();
    while (concurrency > seen && !max_concurrency.compare_exchange_weak(seen, concurrency)) {
    }
    run(num_tasks, concurrency, [&](int t, int worker) {
      if (worker < 0 || worker >= concurrency) bad_worker.store(true);
      task(t, worker);
    });
  }
  virtual void run(int num_tasks, int concurrency, const Task& task) const = 0;
};

// An OpenMP executor (tests/executor_openmp.cpp, built when CMake finds OpenMP).
const CountingExecutor& openmp_executor();

}  // namespace attncore::test
