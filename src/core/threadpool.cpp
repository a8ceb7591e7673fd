// A minimal persistent thread pool: workers sleep on a condition variable between jobs.
#include "core/threadpool.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "attncore/error.h"
#include "attncore/options.h"
#include "core/cpu_info.h"

namespace attncore::detail {

namespace {

class Pool {
 public:
  // Returns false (and does nothing) when the pool is busy.
  bool try_run(int num_tasks, int threads, const std::function<void(int)>& task) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock()) return false;
    int helpers = std::min(threads, num_tasks) - 1;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      while (static_cast<int>(workers_.size()) < helpers) {
        try {
          workers_.emplace_back(
              [this, id = static_cast<int>(workers_.size())] { worker_loop(id); });
        } catch (const std::system_error&) {
          // The process may start no more threads (a limit on processes or address space):
          // the job runs on the helpers there are, the caller taking what they leave (its
          // std::system_error escaped every call before).
          helpers = static_cast<int>(workers_.size());
        }
      }
      task_ = &task;
      num_tasks_ = num_tasks;
      active_helpers_ = helpers;
      next_.store(0);
      open_ = true;
      helpers_joined_ = 0;
      helpers_done_ = 0;
      error_ = nullptr;
      ++generation_;
    }
    wake_.notify_all();
    drain();
    std::unique_lock<std::mutex> lock(mutex_);
    // Every task is taken. Helpers that have joined must check in, so none can still touch
    // this job when the next starts; helpers not yet awake stay out (a late wake-up, 4-40 us
    // measured, no longer delays a call whose caller did the work alone).
    open_ = false;
    done_.wait(lock, [this] { return helpers_done_ == helpers_joined_; });
    task_ = nullptr;
    if (error_) std::rethrow_exception(error_);
    return true;
  }

 private:
  void worker_loop(int id) {
    std::uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      wake_.wait(lock, [&] { return generation_ != seen; });
      seen = generation_;
      if (id >= active_helpers_ || !open_) continue;
      ++helpers_joined_;
      lock.unlock();
      drain();
      lock.lock();
      ++helpers_done_;
      done_.notify_all();
    }
  }

  // Takes tasks until none are left.
  void drain() {
    for (;;) {
      const int t = next_.fetch_add(1);
      if (t >= num_tasks_) return;
      try {
        (*task_)(t);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!error_) error_ = std::current_exception();
      }
    }
  }

  std::mutex busy_;   // held by the caller of the job in flight
  std::mutex mutex_;  // guards everything below
  std::condition_variable wake_, done_;
  std::vector<std::thread> workers_;
  const std::function<void(int)>* task_ = nullptr;
  int num_tasks_ = 0;
  int active_helpers_ = 0;  // workers [0, active_helpers_) may take part in the current job
  bool open_ = false;       // helpers may still join the current job
  int helpers_joined_ = 0;  // helpers that joined it
  int helpers_done_ = 0;
  std::atomic<int> next_{0};
  std::uint64_t generation_ = 0;
  std::exception_ptr error_;
};

// Never destroyed: a thread the program did not join (a detached std::thread, a Python daemon
// thread) may be inside a call when the process exits, and a pool destroyed by the static
// destructors would then be used after its end (tests/exit_test.cpp). Left alive, its workers
// sleep on their condition variable, or finish the job in flight, until the process ends.
Pool& pool() {
  static Pool* const p = new Pool;
  return *p;
}

// Set while this thread runs tasks of a pool job: a call from inside a task runs inline
// (re-locking the pool's mutex from the thread that holds it would be undefined).
thread_local bool t_in_task = false;

struct InTask {
  bool previous = t_in_task;
  InTask() { t_in_task = true; }
  ~InTask() { t_in_task = previous; }
};

// The executor of the call this thread is running (ExecutorScope); null: the pool.
thread_local const Executor* t_executor = nullptr;

// The pool's job on the caller's executor: min(threads, num_tasks) executor tasks, each taking
// tasks from one counter until none are left (as the pool's threads do), so a task only ever
// waits for tasks already taken by a running executor task. Tasks the executor left unrun (it
// ran fewer) are run here; the first exception is rethrown. An executor that throws breaks its
// contract (it returns only once its tasks have): the call then stops there, its outputs
// incomplete.
void run_on_executor(const Executor& executor, int num_tasks, int threads,
                     const std::function<void(int)>& task) {
  const int workers = std::min(threads, num_tasks);
  std::atomic<int> next{0};
  std::mutex error_mutex;
  std::exception_ptr error;
  auto drain = [&] {
    for (int t = next.fetch_add(1); t < num_tasks; t = next.fetch_add(1)) {
      try {
        task(t);
      } catch (...) {
        const std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
      }
    }
  };
  try {
    executor.parallel_for(workers, workers, [&](int, int) { drain(); });
  } catch (const std::exception& e) {
    throw ExecutorFailed{e.what()};
  } catch (...) {
    throw ExecutorFailed{"an exception not derived from std::exception"};
  }
  drain();
  if (error) std::rethrow_exception(error);
}

}  // namespace

std::string executor_failed_message(const char* op, const ExecutorFailed& failed) {
  return std::string(op) + ": the executor's parallel_for threw (what=\"" + failed.what +
         "\", expected it to return once its tasks have); the outputs are incomplete";
}

ExecutorScope::ExecutorScope(const Executor* executor) : previous_(t_executor) {
  t_executor = executor;
}
ExecutorScope::~ExecutorScope() { t_executor = previous_; }

void run_tasks(int num_tasks, int threads, const std::function<void(int)>& task) {
  if (num_tasks <= 0) return;
  if (t_in_task || threads <= 1 || num_tasks == 1) {
    for (int t = 0; t < num_tasks; ++t) task(t);
    return;
  }
  const InTask in_task;
  const std::function<void(int)> marked = [&](int t) {
    const InTask inner;
    task(t);
  };
  if (t_executor != nullptr) {
    run_on_executor(*t_executor, num_tasks, threads, marked);
  } else if (!pool().try_run(num_tasks, threads, marked)) {
    for (int t = 0; t < num_tasks; ++t) task(t);
  }
}

void parallel_for(std::int64_t n, int threads,
                  const std::function<void(std::int64_t, std::int64_t)>& body) {
  if (n <= 0) return;
  const int chunks = static_cast<int>(std::min<std::int64_t>(std::max(threads, 1), n));
  run_tasks(chunks, chunks, [&](int c) {
    const std::int64_t begin = n * c / chunks, end = n * (c + 1) / chunks;
    body(begin, end);
  });
}

namespace {
// set_num_threads's setting: 0 = none.
std::atomic<int> g_num_threads{0};
}  // namespace

int resolve_threads(int requested, const char* op) {
  if (requested > 0) return requested;
  const int process_wide = g_num_threads.load(std::memory_order_relaxed);
  return process_wide > 0 ? process_wide : default_threads(op);
}

}  // namespace attncore::detail

namespace attncore {

int set_num_threads(int num_threads) {
  if (num_threads < 0 || num_threads > kMaxThreads) {
    throw InvalidArgument("set_num_threads: num_threads is out of range (num_threads=" +
                          std::to_string(num_threads) + ", expected 0 to " +
                          std::to_string(kMaxThreads) + ", attncore::kMaxThreads; 0 = default)");
  }
  return detail::g_num_threads.exchange(num_threads);
}

int get_num_threads() { return detail::resolve_threads(0, "get_num_threads"); }

}  // namespace attncore
