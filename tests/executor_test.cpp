// Options::executor: a call's parallel regions run on the caller's executor instead of the
// library's pool, with the same bits on every backend, forward and backward, through a plain
// std::thread executor and an OpenMP one (executor_openmp.cpp, when OpenMP is available);
// concurrency never above the call's thread count; cancellation works across it; an executor
// that throws gives attncore::Error.
#include "executor_test.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "attncore/attncore.h"
#include "testing/random.h"
#include "testing/tensors.h"

namespace attncore {
namespace {

// Threads started for each parallel region: the caller is worker 0, concurrency - 1 more
// std::threads take tasks from a counter. The simplest executor that satisfies the contract.
class ThreadExecutor : public test::CountingExecutor {
 public:
  void run(int num_tasks, int concurrency, const Task& task) const override {
    std::atomic<int> next{0};
    auto work = [&](int worker) {
      for (int t = next.fetch_add(1); t < num_tasks; t = next.fetch_add(1)) task(t, worker);
    };
    std::vector<std::thread> threads;
    for (int w = 1; w < concurrency; ++w) threads.emplace_back(work, w);
    work(0);
    for (std::thread& t : threads) t.join();
  }
};

struct Inputs {
  Tensor q, k, v, dout;
  explicit Inputs(DType dtype)
      : q(dtype, {2, 4, 200, 32}),
        k(dtype, {2, 2, 200, 32}),
        v(dtype, {2, 2, 200, 32}),
        dout(dtype, {2, 4, 200, 32}) {
    test::Random rng(7);
    for (const Tensor* t : {&q, &k, &v, &dout}) {
      for (std::int64_t i = 0; i < t->numel(); ++i) {
        const double x = rng.uniform() * 2 - 1;
        if (dtype == DType::f64) {
          t->data_as<double>()[i] = x;
        } else {
          t->data_as<float>()[i] = static_cast<float>(x);
        }
      }
    }
  }
};

::testing::AssertionResult same_bits(const Tensor& got, const Tensor& want, const char* what) {
  return test::same_bits(test::read_view(got), test::read_view(want), what);
}

// Forward and backward with the executor against the library's pool, same thread count.
void expect_same_bits(const test::CountingExecutor& executor) {
  for (Backend backend : {Backend::reference, Backend::math, Backend::flash}) {
    for (DType dtype : {DType::f32, DType::f64}) {
      if (backend == Backend::flash && dtype == DType::f64) continue;
      SCOPED_TRACE(std::string(name_of(backend)) + " " + std::string(name_of(dtype)));
      const Inputs x(dtype);
      Options pool;
      pool.num_threads = 3;
      pool.causal = Causal::lower_right;
      Options own = pool;
      own.executor = &executor;
      const int calls = executor.calls.load();
      const ForwardResult a = forward(x.q, x.k, x.v, pool, backend);
      const ForwardResult b = forward(x.q, x.k, x.v, own, backend);
      EXPECT_TRUE(same_bits(b.out, a.out, "out"));
      EXPECT_TRUE(same_bits(b.lse, a.lse, "lse"));
      const BackwardResult ga = backward(x.dout, x.q, x.k, x.v, a.out, a.lse, pool, backend);
      const BackwardResult gb = backward(x.dout, x.q, x.k, x.v, a.out, a.lse, own, backend);
      EXPECT_TRUE(same_bits(gb.dq, ga.dq, "dq"));
      EXPECT_TRUE(same_bits(gb.dk, ga.dk, "dk"));
      EXPECT_TRUE(same_bits(gb.dv, ga.dv, "dv"));
      EXPECT_GT(executor.calls.load(), calls) << "the executor was not used";
    }
  }
  EXPECT_LE(executor.max_concurrency.load(), 3);
  EXPECT_GE(executor.max_concurrency.load(), 2);
  EXPECT_FALSE(executor.bad_worker.load());
}

TEST(Executor, ThreadExecutorGivesThePoolsBits) {
  const ThreadExecutor executor;
  expect_same_bits(executor);
}

#if defined(ATTNCORE_TEST_OPENMP)
TEST(Executor, OpenMpExecutorGivesThePoolsBits) { expect_same_bits(test::openmp_executor()); }
#endif

// The concurrency bound follows the call's thread count, set_num_threads included.
TEST(Executor, ConcurrencyIsTheCallsThreadCount) {
  const ThreadExecutor executor;
  const Inputs x(DType::f32);
  Options options;
  options.executor = &executor;
  const int previous = set_num_threads(2);
  (void)forward(x.q, x.k, x.v, options, Backend::math);
  set_num_threads(previous);
  EXPECT_EQ(executor.max_concurrency.load(), 2);
  options.num_threads = 1;  // one thread: nothing to hand out
  const int calls = executor.calls.load();
  (void)forward(x.q, x.k, x.v, options, Backend::math);
  EXPECT_EQ(executor.calls.load(), calls);
}

// An executor whose first task sets the call's cancel flag: every backend stops and throws
// Cancelled (outputs incomplete), and the executor returns normally.
class CancellingExecutor : public ThreadExecutor {
 public:
  explicit CancellingExecutor(std::atomic<bool>& flag) : flag_(flag) {}
  void run(int num_tasks, int concurrency, const Task& task) const override {
    ThreadExecutor::run(num_tasks, concurrency, [&](int t, int worker) {
      flag_.store(true);
      task(t, worker);
    });
  }

 private:
  std::atomic<bool>& flag_;
};

TEST(Executor, CancellationWorksAcrossIt) {
  const Inputs x(DType::f32);
  for (Backend backend : {Backend::reference, Backend::math, Backend::flash}) {
    SCOPED_TRACE(std::string(name_of(backend)));
    std::atomic<bool> cancel{false};
    const CancellingExecutor executor(cancel);
    Options options;
    options.num_threads = 2;
    options.cancel = &cancel;
    options.executor = &executor;
    try {
      (void)forward(x.q, x.k, x.v, options, backend);
      ADD_FAILURE() << "not cancelled";
    } catch (const Cancelled& e) {
      EXPECT_NE(std::string(e.what()).find("incomplete"), std::string::npos) << e.what();
    }
    EXPECT_GT(executor.calls.load(), 0);
  }
}

// An executor that runs one task, then throws (out of its contract): every backend's forward
// and backward throw attncore::Error with the executor's message and say the outputs are
// incomplete, whatever the executor threw.
class ThrowingExecutor : public test::CountingExecutor {
 public:
  explicit ThrowingExecutor(bool standard) : standard_(standard) {}
  void run(int, int, const Task& task) const override {
    task(0, 0);
    if (standard_) throw std::runtime_error("engine pool shut down");
    throw 42;
  }

 private:
  bool standard_;
};

TEST(Executor, ItsExceptionIsAnErrorSayingTheOutputsAreIncomplete) {
  const Inputs x(DType::f32);
  for (bool standard : {true, false}) {
    for (Backend backend : {Backend::reference, Backend::math, Backend::flash}) {
      for (bool backward_pass : {false, true}) {
        SCOPED_TRACE(std::string(name_of(backend)) + (backward_pass ? " backward" : " forward") +
                     (standard ? "" : ", not a std::exception"));
        const ThrowingExecutor executor(standard);
        Options options;
        options.num_threads = 2;
        const ForwardResult f = forward(x.q, x.k, x.v, options, backend);
        options.executor = &executor;
        try {
          if (backward_pass) {
            (void)backward(x.dout, x.q, x.k, x.v, f.out, f.lse, options, backend);
          } else {
            (void)forward(x.q, x.k, x.v, options, backend);
          }
          ADD_FAILURE() << "no error";
        } catch (const InvalidArgument& e) {
          ADD_FAILURE() << "not a plain Error: " << e.what();
        } catch (const Error& e) {
          const std::string what = e.what();
          const std::string op = backward_pass ? "backward: " : "forward: ";
          EXPECT_EQ(what.rfind(op + "the executor's parallel_for threw (what=", 0), 0) << what;
          EXPECT_NE(
              what.find(standard ? "engine pool shut down" : "not derived from std::exception"),
              std::string::npos)
              << what;
          EXPECT_NE(what.find("; the outputs are incomplete"), std::string::npos) << what;
        }
        EXPECT_GT(executor.calls.load(), 0);
      }
    }
  }
}

}  // namespace
}  // namespace attncore
