// An OpenMP executor for tests/executor_test.cpp: a parallel loop with dynamic scheduling on
// `concurrency` threads, the worker index being the OpenMP thread number.
#include <omp.h>

#include "executor_test.h"

namespace attncore::test {
namespace {

class OpenMpExecutor : public CountingExecutor {
 public:
  void run(int num_tasks, int concurrency, const Task& task) const override {
#pragma omp parallel for num_threads(concurrency) schedule(dynamic, 1)
    for (int t = 0; t < num_tasks; ++t) task(t, omp_get_thread_num());
  }
};

}  // namespace

const CountingExecutor& openmp_executor() {
  static const OpenMpExecutor executor;
  return executor;
}

}  // namespace attncore::test
