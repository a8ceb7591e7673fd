// How attncore._core runs a call (calls.h): the GIL released, the Ctrl-C watch of main-thread
// calls, and threads parked when the interpreter finalizes under them.
#include "calls.h"

#include <pybind11/pybind11.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace py = pybind11;

namespace attncore_python {
namespace {

bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

// Never returns: the interpreter is shutting down and this thread may not run Python again.
// The process ends when the thread finalizing the interpreter exits it.
[[noreturn]] void park_thread() {
  for (;;) pause();
}

// Ctrl-C during a long call made on the main thread (Python runs signal handlers there only):
// the call runs on the runner thread while the main thread, GIL released, wakes every
// kSignalPoll to take the GIL and run PyErr_CheckSignals (Python's own handlers: none is
// installed here). When a handler raises (KeyboardInterrupt), the call's Options::cancel is set,
// the main thread waits for the call to stop (the backends check the flag between work items)
// and raises that exception. Calls on other threads run in place, GIL released.
constexpr std::chrono::milliseconds kSignalPoll{20};  // the reaction time to Ctrl-C, at most

// The thread main-thread calls run on: made at the first one (in a child made by fork(), at
// its first), never destroyed (like the library's pool, it may be idle at exit; nothing waits
// for it).
class Runner {
 public:
  // Runs job() there; poll() on this thread every kSignalPoll until it is done. Rethrows job's
  // exception.
  void run(const std::function<void()>& job, const std::function<void()>& poll) {
    std::unique_lock<std::mutex> lock(mutex_);
    job_ = &job;
    done_ = false;
    error_ = nullptr;
    wake_.notify_one();
    while (!finished_.wait_for(lock, kSignalPoll, [this] { return done_; })) {
      lock.unlock();
      poll();
      lock.lock();
    }
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      wake_.wait(lock, [this] { return job_ != nullptr; });
      const std::function<void()>* job = job_;
      lock.unlock();
      std::exception_ptr error;
      try {
        (*job)();
      } catch (...) {
        error = std::current_exception();
      }
      lock.lock();
      job_ = nullptr;
      error_ = error;
      done_ = true;
      finished_.notify_one();
    }
  }

  std::mutex mutex_;  // guards everything below
  std::condition_variable wake_, finished_;
  const std::function<void()>* job_ = nullptr;
  bool done_ = false;
  std::exception_ptr error_;
  std::thread thread_{[this] { loop(); }};  // last: starts once the members above exist
};

unsigned long main_thread_id = 0;  // Python's ident of the main thread (set_main_thread)
bool runner_busy = false;          // main thread only: a signal handler's own call runs in place

// Calls of at most this much work (weighed_work) run in place on the main thread too: handing a
// call to the runner and back costs 50 us and more (a q [1, 1, 1, 64], k/v [1, 1, 16, 64] call
// took 50 us through the runner against 3.6 us in place; on Zen 3, a decode step of Hq 32, Hkv
// 8, D 128, bf16, 1 thread, over 1024 keys took 478-490 us at best and 541-742 at the median
// through it, against 380-384 and 424-490 in place, two runs of 300 calls; over 4096 keys
// 1674-1763 / 1819-2509 against 1577 / 1783-1848). At the fused backends' slowest, decode read
// from memory at ~13 GB/s (4 bytes of K and V per unit of work), such a call ends within ~10
// ms; the reference backend's and f64 work, weighed 8x, within ~20 ms at its 1.7 GFLOP/s.
constexpr double kInPlaceWork = 1 << 25;

}  // namespace

GilReleased::~GilReleased() {
  if (interpreter_finalizing()) park_thread();
  try {
    PyEval_RestoreThread(state_);
  } catch (...) {  // abi::__forced_unwind from PyThread_exit_thread: finalization began
    park_thread();
  }
}

void set_main_thread(unsigned long ident) { main_thread_id = ident; }

double call_work(const attncore::TensorView& q, const attncore::TensorView& k,
                 const attncore::TensorView& v) {
  const int key_rows = k.rank == 4 ? 2 : 0;
  return call_work(q, static_cast<double>(k.rank > key_rows ? k.size(key_rows) : 0), v);
}

double call_work(const attncore::TensorView& q, double keys, const attncore::TensorView& v) {
  const double rows_q =
      q.rank > 0 && q.size(q.rank - 1) > 0
          ? static_cast<double>(q.numel()) / static_cast<double>(q.size(q.rank - 1))
          : 0.0;
  return rows_q * keys *
         static_cast<double>((q.rank ? q.size(q.rank - 1) : 0) + (v.rank ? v.size(v.rank - 1) : 0));
}

double varlen_work(const attncore::TensorView& q, const attncore::TensorView& k,
                   const attncore::TensorView& v, const attncore::VarlenSeqs& seqs) {
  const bool paged = seqs.block_table.has_value();
  const double keys_bound = paged
                                ? static_cast<double>(std::max<std::int64_t>(seqs.max_seqlen_k, 0))
                            : k.rank > 0 ? static_cast<double>(k.size(0))
                                         : 0.0;
  const attncore::TensorView &cu_q = seqs.cu_seqlens_q, &cu_k = seqs.cu_seqlens_k;
  auto index = [](const attncore::TensorView& x, std::int64_t n) {
    return x.data != nullptr && x.dtype == attncore::DType::i32 && x.rank == 1 && x.size(0) == n;
  };
  const std::int64_t batch = cu_q.rank == 1 ? cu_q.size(0) - 1 : -1;
  if (q.rank != 3 || v.rank < 1 || batch < 1 || batch > (1 << 16) || !index(cu_q, batch + 1) ||
      !index(cu_k, batch + 1) || (seqs.seqused_k && !index(*seqs.seqused_k, batch)))
    return call_work(q, keys_bound, v);
  auto at = [](const attncore::TensorView& x, std::int64_t i) {
    return static_cast<double>(static_cast<const std::int32_t*>(x.data)[i * x.stride_of(0)]);
  };
  const double total_q = static_cast<double>(q.size(0));
  double pairs = 0;  // query rows x keys, summed over the sequences
  for (std::int64_t b = 0; b < batch; ++b) {
    const double rows = std::clamp(at(cu_q, b + 1) - at(cu_q, b), 0.0, total_q);
    const double keys = seqs.seqused_k ? at(*seqs.seqused_k, b) : at(cu_k, b + 1) - at(cu_k, b);
    pairs += rows * std::clamp(keys, 0.0, keys_bound);
  }
  return pairs * static_cast<double>(q.size(1)) *
         static_cast<double>(q.size(2) + v.size(v.rank - 1));
}

double weighed_work(double work, attncore::Backend backend, attncore::DType dtype) {
  const bool slowest = backend == attncore::Backend::reference || dtype == attncore::DType::f64;
  return slowest ? 8.0 * work : work;
}

void run_call(attncore::Options options, double work,
              const std::function<void(const attncore::Options&)>& call) {
  if (PyThread_get_thread_ident() != main_thread_id || runner_busy || work <= kInPlaceWork) {
    const GilReleased released;
    call(options);
    return;
  }
  // The runner of this process: a child made by fork() has none of its parent's threads, so
  // it makes its own (the parent's object, whose thread is gone, is left alone: its mutex may
  // have been held at the fork).
  static Runner* runner = nullptr;
  static pid_t runner_pid = 0;
  if (runner == nullptr || runner_pid != getpid()) {
    runner = new Runner;
    runner_pid = getpid();
  }
  std::atomic<bool> cancel{false};
  options.cancel = &cancel;
  const std::vector<attncore::Backend> enabled = attncore::enabled_backends();  // per thread
  bool interrupted = false;
  runner_busy = true;
  PyThreadState* state = PyEval_SaveThread();
  try {
    runner->run(
        [&] {
          const attncore::BackendScope scope(enabled);
          call(options);
        },
        [&] {
          if (interrupted) return;
          PyEval_RestoreThread(state);
          interrupted = PyErr_CheckSignals() != 0;  // the handler's exception stays pending
          state = PyEval_SaveThread();
          if (interrupted) cancel.store(true);
        });
  } catch (...) {
    PyEval_RestoreThread(state);
    runner_busy = false;
    if (interrupted) throw py::error_already_set();  // KeyboardInterrupt, not Cancelled
    throw;
  }
  PyEval_RestoreThread(state);
  runner_busy = false;
  if (interrupted) throw py::error_already_set();  // it ended before seeing the flag
}
}  // namespace attncore_python
