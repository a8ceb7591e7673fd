// The library's threads: one persistent pool, static partitions (results never depend on the
// thread count because each index range is computed the same way whoever runs it).
#pragma once

#include <cstdint>
#include <functional>

namespace attncore::detail {

// Runs task(t) for every t in [0, num_tasks) on up to `threads` threads, the caller being one
// of them, and returns when all are done. The first exception a task throws is rethrown here.
// A call made while the pool is busy (another caller, or from inside a task) runs inline.
void run_tasks(int num_tasks, int threads, const std::function<void(int)>& task);

// Splits [0, n) into `threads` contiguous near-equal chunks and runs body(begin, end) on each.
void parallel_for(std::int64_t n, int threads,
                  const std::function<void(std::int64_t, std::int64_t)>& body);

// The thread count a call uses: `requested` if > 0 (validated: at most kMaxThreads), else
// set_num_threads's setting (attncore/options.h), else default_num_threads(), whose
// InvalidArgument for a bad ATTNCORE_NUM_THREADS names `op`.
int resolve_threads(int requested, const char* op);

}  // namespace attncore::detail
