// The library's threads: one persistent pool, static partitions (results never depend on the
// thread count because each index range is computed the same way whoever runs it).
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "attncore/options.h"

namespace attncore::detail {

// Runs task(t) for every t in [0, num_tasks) on up to `threads` threads, the caller being one
// of them, and returns when all are done. The first exception a task throws is rethrown here.
// A call made while the pool is busy (another caller, or from inside a task) runs inline.
// Inside an ExecutorScope with an executor, the caller's executor runs them instead of the pool
// (the same tasks, taken from the same counter: results do not change); an exception from the
// executor's parallel_for itself comes out as ExecutorFailed.
void run_tasks(int num_tasks, int threads, const std::function<void(int)>& task);

// Splits [0, n) into `threads` contiguous near-equal chunks and runs body(begin, end) on each.
void parallel_for(std::int64_t n, int threads,
                  const std::function<void(std::int64_t, std::int64_t)>& body);

// Makes run_tasks on this thread use `executor` (null: attncore's pool) for the scope: the
// entry points set it around a backend's run from Options::executor.
class ExecutorScope {
 public:
  explicit ExecutorScope(const Executor* executor);
  ~ExecutorScope();
  ExecutorScope(const ExecutorScope&) = delete;
  ExecutorScope& operator=(const ExecutorScope&) = delete;

 private:
  const Executor* previous_;
};

// Thrown by run_tasks when the caller's executor (not a task) throws; the entry points turn it
// into attncore::Error with the op's name and the executor's message (executor_failed_message).
struct ExecutorFailed {
  std::string what;
};
std::string executor_failed_message(const char* op, const ExecutorFailed& failed);

// The thread count a call uses: `requested` if > 0 (validated: at most kMaxThreads), else
// set_num_threads's setting (attncore/options.h), else default_num_threads(), whose
// InvalidArgument for a bad ATTNCORE_NUM_THREADS names `op`.
int resolve_threads(int requested, const char* op);

}  // namespace attncore::detail
