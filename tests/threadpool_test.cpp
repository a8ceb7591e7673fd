// The thread pool (core/threadpool): every task runs exactly once whatever the thread count and
// however late the helpers wake, errors reach the caller, nested regions run inline.
#include "core/threadpool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>
#include <vector>

namespace attncore::detail {
namespace {

TEST(ThreadPool, EveryTaskRunsOnceInManyShortRegions) {
  // Thousands of regions back to back: helpers that wake late for one region must neither run
  // a task of it after it returned nor miss the next one.
  for (int threads : {1, 2, 3, 8}) {
    for (int tasks : {1, 2, 5, 64}) {
      for (int region = 0; region < 300; ++region) {
        std::vector<std::atomic<int>> runs(static_cast<std::size_t>(tasks));
        run_tasks(tasks, threads, [&](int t) { runs[static_cast<std::size_t>(t)].fetch_add(1); });
        for (int t = 0; t < tasks; ++t) {
          ASSERT_EQ(runs[static_cast<std::size_t>(t)].load(), 1)
              << "task " << t << " of " << tasks << ", threads " << threads << ", region "
              << region;
        }
      }
    }
  }
}

TEST(ThreadPool, HelpersJoinWhileTasksRemain) {
  // The caller's task waits for another thread to start the second task: a helper must join
  // an open region (the caller would otherwise take the task itself after the timeout).
  if (std::thread::hardware_concurrency() < 2) GTEST_SKIP() << "one core: no helper to wait for";
  int helped = 0;
  for (int region = 0; region < 20; ++region) {
    const std::thread::id caller = std::this_thread::get_id();
    std::atomic<bool> helper_ran{false};
    run_tasks(2, 2, [&](int) {
      if (std::this_thread::get_id() != caller) {
        helper_ran = true;
        return;
      }
      const auto t0 = std::chrono::steady_clock::now();
      while (!helper_ran && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(1)) {
      }
    });
    helped += helper_ran ? 1 : 0;
  }
  EXPECT_GT(helped, 0);
}

TEST(ThreadPool, ErrorsReachTheCallerAndThePoolGoesOn) {
  EXPECT_THROW(run_tasks(8, 2,
                         [](int t) {
                           if (t == 5) throw std::runtime_error("task 5");
                         }),
               std::runtime_error);
  std::atomic<int> sum{0};
  run_tasks(8, 2, [&](int t) { sum += t; });
  EXPECT_EQ(sum.load(), 28);
}

TEST(ThreadPool, NestedRegionsRunInline) {
  std::atomic<int> inner{0};
  run_tasks(4, 2, [&](int) { run_tasks(3, 2, [&](int) { inner.fetch_add(1); }); });
  EXPECT_EQ(inner.load(), 12);
}

TEST(ThreadPool, ParallelForCoversTheRangeOnce) {
  for (int threads : {1, 2, 7}) {
    for (std::int64_t n : {0, 1, 5, 1000}) {
      std::vector<std::atomic<int>> seen(static_cast<std::size_t>(n));
      parallel_for(n, threads, [&](std::int64_t begin, std::int64_t end) {
        for (std::int64_t i = begin; i < end; ++i) seen[static_cast<std::size_t>(i)].fetch_add(1);
      });
      for (std::int64_t i = 0; i < n; ++i) ASSERT_EQ(seen[static_cast<std::size_t>(i)].load(), 1);
    }
  }
}

}  // namespace
}  // namespace attncore::detail
