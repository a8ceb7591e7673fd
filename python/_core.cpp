// attncore._core: the extension module behind the `attncore` Python package. It runs
// attncore::forward_into / backward_into and their variable-length forms
// (forward_varlen_into / backward_varlen_into) on Python arrays, read and written in place: numpy
// arrays (and any other buffer-protocol object) through the buffer protocol, everything else
// (torch tensors, bf16 included) through `__dlpack__`. Nothing is copied; the package allocates
// the outputs and reshapes its arguments into the views this module takes (rank 4 for dense
// calls, the packed rank-3 views for variable-length ones). int32 arrays become DType::i32 views,
// which the library takes as index arrays (cu_seqlens, seqused_k) and refuses elsewhere.
#include <dlpack/dlpack.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "attncore/attncore.h"
#include "attncore/kvcache.h"
#include "attncore/merge.h"
#include "attncore/paged.h"
#include "attncore/varlen.h"

namespace py = pybind11;

namespace {

using attncore::DType;
using attncore::InvalidArgument;
using attncore::TensorView;
using attncore::Unsupported;

// DLPack 0.8 added a bool type code; DLPack 0.6 (Debian 12's header) does not name it.
constexpr std::uint8_t kDLBoolCode = 6;

// The data addresses of the arrays of this thread's last call, by argument name: lets the
// tests prove that a strided view reached the kernels without a copy.
thread_local std::map<std::string, std::uintptr_t> last_call_addresses;

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

// Releases the GIL for the duration of a call into the library and takes it back after.
// When the interpreter has begun to finalize (a daemon thread still inside a call at exit),
// taking the GIL back ends the thread through pthread_exit, a forced unwind; unwinding this
// frame's callers would run destructors that need the GIL, and unwinding a noexcept
// destructor terminates the process. The thread is parked instead, as CPython 3.14 parks
// daemon threads: it holds no lock and the process exits normally.
class GilReleased {
 public:
  GilReleased() : state_(PyEval_SaveThread()) {}
  GilReleased(const GilReleased&) = delete;
  GilReleased& operator=(const GilReleased&) = delete;
  ~GilReleased() {
    if (interpreter_finalizing()) park_thread();
    try {
      PyEval_RestoreThread(state_);
    } catch (...) {  // abi::__forced_unwind from PyThread_exit_thread: finalization began
      park_thread();
    }
  }

 private:
  PyThreadState* state_;
};

// Ctrl-C during a long call made on the main thread (Python runs signal handlers there only):
// the call runs on the runner thread while the main thread, GIL released, wakes every
// kSignalPoll to take the GIL and run PyErr_CheckSignals (Python's own handlers: none is
// installed here). When a handler raises (KeyboardInterrupt), the call's Options::cancel is set,
// the main thread waits for the call to stop (the backends check the flag between work items)
// and raises that exception. Calls on other threads run in place, GIL released.
constexpr std::chrono::milliseconds kSignalPoll{20};  // the reaction time to Ctrl-C, at most

// The thread main-thread calls run on: made at the first one, never destroyed (like the
// library's pool, it may be idle at exit; nothing waits for it).
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

unsigned long main_thread_id = 0;  // Python's ident of the main thread, set at import
bool runner_busy = false;          // main thread only: a signal handler's own call runs in place

// Runs call(options) with the GIL released: interruptible by Ctrl-C on the main thread (above).
template <class Call>
void run_call(attncore::Options options, const Call& call) {
  if (PyThread_get_thread_ident() != main_thread_id || runner_busy) {
    const GilReleased released;
    call(options);
    return;
  }
  static Runner* const runner = new Runner;
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

DType dtype_from_format(std::string format, py::ssize_t itemsize, const std::string& name) {
  // Native or explicitly little-endian byte order only (this library runs on little-endian CPUs).
  if (!format.empty() && (format[0] == '@' || format[0] == '=' || format[0] == '<'))
    format.erase(0, 1);
  if (format == "f" && itemsize == 4) return DType::f32;
  if (format == "d" && itemsize == 8) return DType::f64;
  if (format == "e" && itemsize == 2) return DType::f16;
  if (format == "?" && itemsize == 1) return DType::b8;
  // numpy's int32 is 'i' ('l' where a C long has 4 bytes).
  if ((format == "i" || format == "l") && itemsize == 4) return DType::i32;
  throw InvalidArgument(name + " has an unsupported element type (format='" + format +
                        "', itemsize=" + std::to_string(itemsize) +
                        ", expected float32, float64, float16, bool or int32)");
}

DType dtype_from_dlpack(const DLDataType& t, bool is_mask, const std::string& name) {
  if (t.lanes == 1) {
    if (t.code == kDLFloat && t.bits == 32) return DType::f32;
    if (t.code == kDLFloat && t.bits == 64) return DType::f64;
    if (t.code == kDLFloat && t.bits == 16) return DType::f16;
    if (t.code == kDLBfloat && t.bits == 16) return DType::bf16;
    if (t.code == kDLBoolCode && t.bits == 8) return DType::b8;
    if (t.code == kDLInt && t.bits == 32) return DType::i32;
    // Producers that cannot export bool (torch 1.13) pass a bool mask's bytes as uint8.
    if (is_mask && t.code == kDLUInt && t.bits == 8) return DType::b8;
  }
  throw InvalidArgument(name + " has an unsupported element type (dlpack code=" +
                        std::to_string(t.code) +
                        ", bits=" + std::to_string(t.bits) + ", lanes=" + std::to_string(t.lanes) +
                        ", expected float32, float64, float16, bfloat16, bool or int32)");
}

std::string type_name(py::handle obj) {
  return std::string(py::str(py::type::of(obj).attr("__name__")));
}

// One Python array seen as a TensorView onto its own memory, valid while this object lives.
// Errors name the array as "<op>: <name>", the library's message form.
class Borrowed {
 public:
  Borrowed(py::handle obj, const char* op, const char* name, bool writable, bool is_mask = false) {
    const std::string what = std::string(op) + ": " + name;
    if (PyObject_CheckBuffer(obj.ptr())) {
      from_buffer(obj, what, writable);
    } else if (py::hasattr(obj, "__dlpack__")) {
      from_dlpack(obj, what, is_mask);
    } else {
      throw py::type_error(what + " is not an array (type=" + type_name(obj) +
                           ", expected a numpy array or an object with __dlpack__)");
    }
    last_call_addresses[name] = reinterpret_cast<std::uintptr_t>(view_.data);
  }
  Borrowed(Borrowed&&) = default;
  Borrowed& operator=(Borrowed&&) = delete;

  const TensorView& view() const { return view_; }

 private:
  void check_rank(std::int64_t rank, const std::string& what) {
    if (rank > attncore::kMaxRank) {
      throw InvalidArgument(what + " has too many dimensions (rank=" + std::to_string(rank) +
                            ", expected <= 4)");
    }
    view_.rank = static_cast<int>(rank);
  }

  void from_buffer(py::handle obj, const std::string& what, bool writable) {
    buffer_ = py::reinterpret_borrow<py::buffer>(obj).request(writable);
    const py::buffer_info& b = *buffer_;
    check_rank(b.ndim, what);
    view_.dtype = dtype_from_format(b.format, b.itemsize, what);
    view_.data = b.ptr;
    for (int d = 0; d < view_.rank; ++d) {
      const auto stride = b.strides[static_cast<std::size_t>(d)];
      if (stride < 0 || stride % b.itemsize != 0) {
        throw InvalidArgument(what + " has a stride that is not a non-negative multiple of its " +
                              "item size (stride[" + std::to_string(d) + "]=" +
                              std::to_string(stride) + " bytes, itemsize=" +
                              std::to_string(b.itemsize) + "); pass a contiguous copy");
      }
      view_.shape[static_cast<std::size_t>(d)] = b.shape[static_cast<std::size_t>(d)];
      view_.stride[static_cast<std::size_t>(d)] = stride / b.itemsize;
    }
  }

  void from_dlpack(py::handle obj, const std::string& what, bool is_mask) {
    // A producer that names its device is asked first, so that memory of another device is
    // refused before an export (which some producers refuse with errors of their own).
    if (py::hasattr(obj, "__dlpack_device__")) {
      int device_type = -1;
      try {
        device_type = obj.attr("__dlpack_device__")()[py::int_(0)].cast<int>();
      } catch (const std::exception& e) {  // the producer's error, or no int where expected
        throw InvalidArgument(what + " cannot be read through DLPack (type=" + type_name(obj) +
                              ", error='" + e.what() + "', expected an array in CPU memory)");
      }
      if (device_type != kDLCPU && device_type != kDLCUDAHost) {
        throw Unsupported(what + " is not in CPU memory (dlpack device_type=" +
                          std::to_string(device_type) +
                          ", expected CPU); attncore has CPU backends only");
      }
    }
    py::object exported;
    try {
      exported = obj.attr("__dlpack__")();
    } catch (const py::error_already_set& e) {
      throw InvalidArgument(what + " cannot be read through DLPack (type=" + type_name(obj) +
                            ", error='" + e.what() + "', expected a strided CPU array)");
    }
    auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(exported.ptr(), "dltensor"));
    if (managed == nullptr) {
      PyErr_Clear();
      throw InvalidArgument(what + " gave no DLPack capsule (type=" + type_name(obj) +
                            ", expected __dlpack__() to return an unused 'dltensor' capsule)");
    }
    // The capsule is consumed: from here on, this object calls the deleter.
    PyCapsule_SetName(exported.ptr(), "used_dltensor");
    managed_.reset(managed);
    const DLTensor& t = managed->dl_tensor;
    if (t.device.device_type != kDLCPU && t.device.device_type != kDLCUDAHost) {
      throw Unsupported(what + " is not in CPU memory (dlpack device_type=" +
                        std::to_string(static_cast<int>(t.device.device_type)) +
                        ", expected CPU); attncore has CPU backends only");
    }
    check_rank(t.ndim, what);
    view_.dtype = dtype_from_dlpack(t.dtype, is_mask, what);
    view_.data = static_cast<char*>(t.data) + t.byte_offset;
    std::int64_t running = 1;
    for (int d = view_.rank; d-- > 0;) {
      view_.shape[static_cast<std::size_t>(d)] = t.shape[d];
      view_.stride[static_cast<std::size_t>(d)] = t.strides != nullptr ? t.strides[d] : running;
      running *= t.shape[d];
    }
  }

  struct CallDeleter {
    void operator()(DLManagedTensor* t) const {
      if (t->deleter != nullptr) t->deleter(t);
    }
  };

  TensorView view_;
  std::optional<py::buffer_info> buffer_;  // released (with the GIL held) on destruction
  std::unique_ptr<DLManagedTensor, CallDeleter> managed_;  // DLPack: deleter runs on destruction
};

std::optional<Borrowed> borrow_optional(py::handle obj, const char* op, const char* name,
                                        bool writable, bool is_mask = false) {
  std::optional<Borrowed> b;
  if (!obj.is_none()) b.emplace(obj, op, name, writable, is_mask);
  return b;
}

std::optional<TensorView> view_of(const std::optional<Borrowed>& b) {
  if (!b) return std::nullopt;
  return b->view();
}

attncore::Causal causal_from_name(const char* op, const std::string& name) {
  for (auto c :
       {attncore::Causal::none, attncore::Causal::upper_left, attncore::Causal::lower_right}) {
    if (attncore::name_of(c) == name) return c;
  }
  throw InvalidArgument(std::string(op) + ": causal is invalid (causal='" + name +
                        "', expected 'none', 'upper-left' or 'lower-right')");
}

// The library's backend_from_name, with the package's message.
attncore::Backend backend_from_name(const char* op, const std::string& name) {
  try {
    return attncore::backend_from_name(name);
  } catch (const InvalidArgument&) {
    throw InvalidArgument(std::string(op) + ": backend is invalid (backend='" + name +
                          "', expected 'auto', 'reference', 'math' or 'flash')");
  }
}

// The options of one call, as the package passes them (keyword arguments of both functions).
struct CallOptions {
  std::optional<double> scale;
  std::string causal;
  std::int64_t window_left, window_right;
  double softcap, dropout_p;
  std::uint64_t seed, offset;
  bool enable_gqa;
  int num_threads;
  std::string backend;

  attncore::Options options(const char* op, const std::optional<Borrowed>& mask,
                            const std::optional<Borrowed>& alibi, bool compute_dbias) const {
    attncore::Options o;
    o.scale = scale;
    o.causal = causal_from_name(op, causal);
    o.window_left = window_left;
    o.window_right = window_right;
    o.softcap = softcap;
    o.alibi_slopes = view_of(alibi);
    o.mask = view_of(mask);
    o.compute_dbias = compute_dbias;
    o.dropout_p = dropout_p;
    o.seed = seed;
    o.offset = offset;
    o.enable_gqa = enable_gqa;
    o.num_threads = num_threads;
    return o;
  }
};

// q [B, Hq, Lq, D], k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv]; writes out [B, Hq, Lq, Dv] and, when
// given, lse [B, Hq, Lq]. mask: rank 2 or 4; alibi_slopes: [Hq] or [B, Hq].
void forward(py::handle q, py::handle k, py::handle v, py::handle out, py::handle lse,
             py::handle mask, py::handle alibi_slopes, const CallOptions& call) {
  constexpr const char* op = "forward";  // the library's name of the call, in messages
  last_call_addresses.clear();
  const Borrowed bq(q, op, "query", false), bk(k, op, "key", false), bv(v, op, "value", false);
  const Borrowed bout(out, op, "out", true);
  const auto blse = borrow_optional(lse, op, "lse", true);
  const auto bmask = borrow_optional(mask, op, "mask", false, /*is_mask=*/true);
  const auto balibi = borrow_optional(alibi_slopes, op, "alibi_slopes", false);
  const attncore::Options options = call.options(op, bmask, balibi, false);
  const attncore::Backend backend = backend_from_name(op, call.backend);
  run_call(options, [&](const attncore::Options& o) {
    attncore::forward_into(bq.view(), bk.view(), bv.view(), bout.view(), view_of(blse), o,
                           backend);
  });
}

// The gradients of forward's call with the same q, k, v and options: writes dq, dk, dv (shaped
// like q, k, v) and, when given, dbias (shaped like mask, which must then be additive).
void backward(py::handle dout, py::handle q, py::handle k, py::handle v, py::handle out,
              py::handle lse, py::handle dq, py::handle dk, py::handle dv, py::handle dbias,
              py::handle mask, py::handle alibi_slopes, const CallOptions& call) {
  constexpr const char* op = "backward";  // the library's name of the call, in messages
  last_call_addresses.clear();
  const Borrowed bdout(dout, op, "dout", false), bq(q, op, "query", false), bk(k, op, "key", false),
      bv(v, op, "value", false), bout(out, op, "out", false), blse(lse, op, "lse", false);
  const Borrowed bdq(dq, op, "dq", true), bdk(dk, op, "dk", true), bdv(dv, op, "dv", true);
  const auto bdbias = borrow_optional(dbias, op, "dbias", true);
  const auto bmask = borrow_optional(mask, op, "mask", false, /*is_mask=*/true);
  const auto balibi = borrow_optional(alibi_slopes, op, "alibi_slopes", false);
  const attncore::Options options = call.options(op, bmask, balibi, bdbias.has_value());
  const attncore::Backend backend = backend_from_name(op, call.backend);
  run_call(options, [&](const attncore::Options& o) {
    attncore::backward_into(bdout.view(), bq.view(), bk.view(), bv.view(), bout.view(),
                            blse.view(), bdq.view(), bdk.view(), bdv.view(), view_of(bdbias), o,
                            backend);
  });
}

// The index arrays of a variable-length call, borrowed for the duration of the call.
struct BorrowedSeqs {
  Borrowed cu_seqlens_q, cu_seqlens_k;
  std::optional<Borrowed> seqused_k;
  std::int64_t max_seqlen_q, max_seqlen_k;

  BorrowedSeqs(const char* op, py::handle cu_q, py::handle cu_k, py::handle used,
               std::int64_t max_q, std::int64_t max_k)
      : cu_seqlens_q(cu_q, op, "cu_seqlens_q", false),
        cu_seqlens_k(cu_k, op, "cu_seqlens_k", false),
        seqused_k(borrow_optional(used, op, "seqused_k", false)),
        max_seqlen_q(max_q),
        max_seqlen_k(max_k) {}

  attncore::VarlenSeqs seqs() const {
    return {cu_seqlens_q.view(), cu_seqlens_k.view(), view_of(seqused_k), max_seqlen_q,
            max_seqlen_k};
  }
};

// Packed q [total_q, Hq, D], k [total_k, Hkv, D], v [total_k, Hkv, Dv] with int32 cu_seqlens_q,
// cu_seqlens_k [B + 1] and seqused_k [B] (or None); writes out [total_q, Hq, Dv] and, when
// given, lse [Hq, total_q]. mask is passed on so that the library refuses it (Unsupported).
void forward_varlen(py::handle q, py::handle k, py::handle v, py::handle cu_seqlens_q,
                    py::handle cu_seqlens_k, py::handle seqused_k, std::int64_t max_seqlen_q,
                    std::int64_t max_seqlen_k, py::handle out, py::handle lse, py::handle mask,
                    py::handle alibi_slopes, const CallOptions& call) {
  constexpr const char* op = "forward";  // the library's name of the call, in messages
  last_call_addresses.clear();
  const Borrowed bq(q, op, "query", false), bk(k, op, "key", false), bv(v, op, "value", false);
  const BorrowedSeqs seqs(op, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k);
  const Borrowed bout(out, op, "out", true);
  const auto blse = borrow_optional(lse, op, "lse", true);
  const auto bmask = borrow_optional(mask, op, "mask", false, /*is_mask=*/true);
  const auto balibi = borrow_optional(alibi_slopes, op, "alibi_slopes", false);
  const attncore::Options options = call.options(op, bmask, balibi, false);
  const attncore::Backend backend = backend_from_name(op, call.backend);
  run_call(options, [&](const attncore::Options& o) {
    attncore::forward_varlen_into(bq.view(), bk.view(), bv.view(), seqs.seqs(), bout.view(),
                                  view_of(blse), o, backend);
  });
}

// The gradients of forward_varlen's call with the same inputs: writes dq, dk, dv (shaped like
// q, k, v; rows that belong to no sequence get 0).
void backward_varlen(py::handle dout, py::handle q, py::handle k, py::handle v, py::handle out,
                     py::handle lse, py::handle cu_seqlens_q, py::handle cu_seqlens_k,
                     py::handle seqused_k, std::int64_t max_seqlen_q, std::int64_t max_seqlen_k,
                     py::handle dq, py::handle dk, py::handle dv, py::handle mask,
                     py::handle alibi_slopes, const CallOptions& call) {
  constexpr const char* op = "backward";  // the library's name of the call, in messages
  last_call_addresses.clear();
  const Borrowed bdout(dout, op, "dout", false), bq(q, op, "query", false), bk(k, op, "key", false),
      bv(v, op, "value", false), bout(out, op, "out", false), blse(lse, op, "lse", false);
  const BorrowedSeqs seqs(op, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k);
  const Borrowed bdq(dq, op, "dq", true), bdk(dk, op, "dk", true), bdv(dv, op, "dv", true);
  const auto bmask = borrow_optional(mask, op, "mask", false, /*is_mask=*/true);
  const auto balibi = borrow_optional(alibi_slopes, op, "alibi_slopes", false);
  const attncore::Options options = call.options(op, bmask, balibi, false);
  const attncore::Backend backend = backend_from_name(op, call.backend);
  run_call(options, [&](const attncore::Options& o) {
    attncore::backward_varlen_into(bdout.view(), bq.view(), bk.view(), bv.view(), bout.view(),
                                   blse.view(), seqs.seqs(), bdq.view(), bdk.view(), bdv.view(),
                                   o, backend);
  });
}

// Names of backends, in order.
std::vector<std::string> names_of(const std::vector<attncore::Backend>& backends) {
  std::vector<std::string> names;
  for (attncore::Backend b : backends) names.emplace_back(attncore::name_of(b));
  return names;
}

// An Explanation as ([(name, enabled, reasons, estimated_seconds)], chosen name or None,
// summary).
py::tuple explanation_tuple(const attncore::Explanation& e) {
  py::list verdicts;
  for (const attncore::BackendVerdict& v : e.verdicts) {
    verdicts.append(py::make_tuple(std::string(attncore::name_of(v.backend)), v.enabled, v.reasons,
                                   v.estimated_seconds));
  }
  py::object chosen = py::none();
  if (e.chosen != attncore::Backend::automatic)
    chosen = py::str(std::string(attncore::name_of(e.chosen)));
  return py::make_tuple(verdicts, chosen, e.summary());
}

// What automatic selection does with forward's call (the same arguments, nothing written).
py::tuple explain_forward(py::handle q, py::handle k, py::handle v, py::handle mask,
                          py::handle alibi_slopes, const CallOptions& call) {
  constexpr const char* op = "forward";  // the library's name of the call, in messages
  const Borrowed bq(q, op, "query", false), bk(k, op, "key", false), bv(v, op, "value", false);
  const auto bmask = borrow_optional(mask, op, "mask", false, /*is_mask=*/true);
  const auto balibi = borrow_optional(alibi_slopes, op, "alibi_slopes", false);
  return explanation_tuple(attncore::explain_forward(bq.view(), bk.view(), bv.view(),
                                                     call.options(op, bmask, balibi, false)));
}

// The same for backward's call; dbias is asked for when `want_dbias` (an additive mask).
py::tuple explain_backward(py::handle dout, py::handle q, py::handle k, py::handle v,
                           py::handle out, py::handle lse, py::handle mask, py::handle alibi_slopes,
                           bool want_dbias, const CallOptions& call) {
  constexpr const char* op = "backward";  // the library's name of the call, in messages
  const Borrowed bdout(dout, op, "dout", false), bq(q, op, "query", false), bk(k, op, "key", false),
      bv(v, op, "value", false), bout(out, op, "out", false), blse(lse, op, "lse", false);
  const auto bmask = borrow_optional(mask, op, "mask", false, /*is_mask=*/true);
  const auto balibi = borrow_optional(alibi_slopes, op, "alibi_slopes", false);
  return explanation_tuple(attncore::explain_backward(bdout.view(), bq.view(), bk.view(), bv.view(),
                                                      bout.view(), blse.view(),
                                                      call.options(op, bmask, balibi, want_dbias)));
}

// Copies src into dst element by element (same shape and dtype, any strides; rank <= 4).
void copy_view(const TensorView& src, const TensorView& dst) {
  const std::size_t item = attncore::size_of(src.dtype);
  std::array<std::int64_t, attncore::kMaxRank> n{1, 1, 1, 1}, ss{}, ds{};
  const int shift = attncore::kMaxRank - src.rank;
  for (int d = 0; d < src.rank; ++d) {
    n[static_cast<std::size_t>(d + shift)] = src.size(d);
    ss[static_cast<std::size_t>(d + shift)] = src.stride_of(d);
    ds[static_cast<std::size_t>(d + shift)] = dst.stride_of(d);
  }
  const auto* s = static_cast<const char*>(src.data);
  auto* t = static_cast<char*>(dst.data);
  for (std::int64_t a = 0; a < n[0]; ++a)
    for (std::int64_t b = 0; b < n[1]; ++b)
      for (std::int64_t c = 0; c < n[2]; ++c)
        for (std::int64_t e = 0; e < n[3]; ++e) {
          const std::int64_t so = a * ss[0] + b * ss[1] + c * ss[2] + e * ss[3];
          const std::int64_t to = a * ds[0] + b * ds[1] + c * ds[2] + e * ds[3];
          std::memcpy(t + to * static_cast<std::int64_t>(item),
                      s + so * static_cast<std::int64_t>(item), item);
        }
}

// Attention over a KV cache: q [B, Hq, Lq, D], k_cache [B_cache, Hkv, capacity, D], v_cache
// [B_cache, Hkv, capacity, Dv] (the flash layout's transposed(1, 2) views), int32 cache_seqlens
// [B] and optional cache_batch_idx, cache_leftpad [B]; with an int32 block_table
// [B, max_pages_per_seq] the caches are page pools [num_pages, Hkv, page_size, D]. With k_new / v_new [B, Hkv, L_new, D]
// the new rows are written into the caches in place first (rotated with f32 rotary_cos,
// rotary_sin [positions, rotary_dim / 2] when given). Writes out [B, Hq, Lq, Dv] and, when
// given, lse [B, Hq, Lq].
void forward_kvcache(py::handle q, py::handle k_cache, py::handle v_cache,
                     py::handle cache_seqlens, py::handle cache_batch_idx,
                     py::handle cache_leftpad, py::handle block_table, py::handle k_new,
                     py::handle v_new,
                     py::handle rotary_cos, py::handle rotary_sin, bool rotary_interleaved,
                     py::handle out, py::handle lse, py::handle alibi_slopes,
                     const CallOptions& call) {
  constexpr const char* op = "forward_kvcache";  // the library's name of the call, in messages
  last_call_addresses.clear();
  const Borrowed bq(q, op, "query", false);
  const bool appending = !k_new.is_none();  // the caches are written only by an append
  const Borrowed bk(k_cache, op, "k_cache", appending), bv(v_cache, op, "v_cache", appending);
  const Borrowed blens(cache_seqlens, op, "cache_seqlens", false);
  const auto bidx = borrow_optional(cache_batch_idx, op, "cache_batch_idx", false);
  const auto bpad = borrow_optional(cache_leftpad, op, "cache_leftpad", false);
  const auto btable = borrow_optional(block_table, op, "block_table", false);
  const auto bknew = borrow_optional(k_new, op, "k", false);
  const auto bvnew = borrow_optional(v_new, op, "v", false);
  const auto bcos = borrow_optional(rotary_cos, op, "rotary_cos", false);
  const auto bsin = borrow_optional(rotary_sin, op, "rotary_sin", false);
  const Borrowed bout(out, op, "out", true);
  const auto blse = borrow_optional(lse, op, "lse", true);
  const auto balibi = borrow_optional(alibi_slopes, op, "alibi_slopes", false);
  const attncore::Options options = call.options(op, std::nullopt, balibi, false);
  const attncore::Backend backend = backend_from_name(op, call.backend);
  const attncore::KvCacheSeqs seqs{blens.view(), view_of(bidx), view_of(bpad), view_of(btable)};
  if (bknew.has_value() != bvnew.has_value())
    throw InvalidArgument(std::string(op) + ": k and v must be given together (k is " +
                          (bknew ? "set" : "None") + ", v is " + (bvnew ? "set" : "None") + ")");
  if (!bknew) {
    run_call(options, [&](const attncore::Options& o) {
      attncore::forward_kvcache_into(bq.view(), bk.view(), bv.view(), seqs, bout.view(),
                                     view_of(blse), o, backend);
    });
    return;
  }
  attncore::KvAppend append;
  append.k_new = bknew->view();
  append.v_new = bvnew->view();
  append.rotary_cos = view_of(bcos);
  append.rotary_sin = view_of(bsin);
  append.rotary_interleaved = rotary_interleaved;
  run_call(options, [&](const attncore::Options& o) {
    const attncore::ForwardResult r =
        attncore::forward_kvcache(bq.view(), bk.view(), bv.view(), seqs, append, o, backend);
    copy_view(r.out.view(), bout.view());
    if (blse) copy_view(r.lse.view(), blse->view());
  });
}

// Merges two attention results over disjoint key sets into out and lse (which may be the very
// arrays out_a / lse_a or out_b / lse_b).
void merge_states(py::handle out_a, py::handle lse_a, py::handle out_b, py::handle lse_b,
                  py::handle out, py::handle lse, int num_threads) {
  constexpr const char* op = "merge_attention_states";
  last_call_addresses.clear();
  const Borrowed boa(out_a, op, "out_a", false), bla(lse_a, op, "lse_a", false);
  const Borrowed bob(out_b, op, "out_b", false), blb(lse_b, op, "lse_b", false);
  const Borrowed bout(out, op, "out", true), blse(lse, op, "lse", true);
  const GilReleased released;
  attncore::merge_attention_states_into(boa.view(), bla.view(), bob.view(), blb.view(),
                                        bout.view(), blse.view(), num_threads);
}

// A PagedKvCache's array as a numpy array over the cache's own memory, which the array keeps
// alive (through `owner`, the Python object of the cache); bf16 as int16 (numpy has no
// bfloat16: attncore.PagedKVCache views it as torch.bfloat16).
py::array paged_array(py::object owner, const TensorView& t) {
  static const std::map<DType, const char*> names = {{DType::f32, "float32"},
                                                     {DType::f64, "float64"},
                                                     {DType::f16, "float16"},
                                                     {DType::bf16, "int16"},
                                                     {DType::i32, "int32"}};
  std::vector<py::ssize_t> shape, strides;
  for (int d = 0; d < t.rank; ++d) {
    shape.push_back(t.size(d));
    strides.push_back(t.stride_of(d) * static_cast<py::ssize_t>(attncore::size_of(t.dtype)));
  }
  return py::array(py::dtype(names.at(t.dtype)), shape, strides, t.data, owner);
}

DType cache_dtype(const std::string& name) {
  for (DType d : {DType::f32, DType::f64, DType::f16, DType::bf16}) {
    if (name == attncore::name_of(d)) return d;
  }
  throw InvalidArgument("PagedKVCache: dtype is not a cache dtype (dtype=" + name +
                        ", expected f32, bf16, f16 or f64)");
}

void bind_paged_cache(py::module_& m) {
  using attncore::PagedKvCache;
  py::class_<PagedKvCache>(m, "PagedKvCache")
      .def(py::init([](std::int64_t num_pages, std::int64_t page_size, std::int64_t heads_kv,
                       std::int64_t head_dim, std::int64_t head_dim_v, const std::string& dtype,
                       std::int64_t max_batch, std::int64_t max_pages_per_seq) {
             return PagedKvCache(num_pages, page_size, heads_kv, head_dim, head_dim_v,
                                 cache_dtype(dtype), max_batch, max_pages_per_seq);
           }),
           py::arg("num_pages"), py::arg("page_size"), py::arg("heads_kv"), py::arg("head_dim"),
           py::arg("head_dim_v"), py::arg("dtype"), py::arg("max_batch"),
           py::arg("max_pages_per_seq"))
      .def("reserve", &PagedKvCache::reserve, py::arg("batch_idx"), py::arg("seq_len"))
      .def("erase", &PagedKvCache::erase, py::arg("batch_idx"))
      .def("fork", &PagedKvCache::fork, py::arg("src"), py::arg("dst"), py::arg("prefix_len"))
      .def("free_pages", &PagedKvCache::free_pages)
      .def("capacity", &PagedKvCache::capacity, py::arg("batch_idx"))
      .def("references", &PagedKvCache::references, py::arg("page"))
      .def(
          "assign",
          [](PagedKvCache& c, std::int64_t b, py::handle positions, py::handle k, py::handle v) {
            constexpr const char* op = "PagedKVCache.assign";
            const Borrowed bp(positions, op, "input_pos", false), bk(k, op, "k_val", false),
                bv(v, op, "v_val", false);
            c.assign(b, bp.view(), bk.view(), bv.view());
          },
          py::arg("batch_idx"), py::arg("positions"), py::arg("k"), py::arg("v"))
      .def("array", [](py::object self, const std::string& which) {
        const PagedKvCache& c = self.cast<const PagedKvCache&>();
        if (which == "k") return paged_array(self, c.k_pages());
        if (which == "v") return paged_array(self, c.v_pages());
        if (which == "page_table") return paged_array(self, c.page_table());
        return paged_array(self, c.seqlens());
      });
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "attncore's C++ library on Python arrays (used by the attncore package)";

  main_thread_id = py::module_::import("threading")
                       .attr("main_thread")()
                       .attr("ident")
                       .cast<unsigned long>();
  // attncore::Cancelled: a call whose Options::cancel was set stopped (outputs incomplete).
  static py::exception<attncore::Cancelled> cancelled(m, "Cancelled", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const attncore::InvalidArgument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const attncore::Unsupported& e) {
      PyErr_SetString(PyExc_NotImplementedError, e.what());
    } catch (const attncore::OutOfMemory& e) {
      PyErr_SetString(PyExc_MemoryError, e.what());
    } catch (const attncore::Cancelled& e) {
      PyErr_SetString(cancelled.ptr(), e.what());
    } catch (const attncore::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });

  py::class_<CallOptions>(m, "CallOptions")
      .def(
          py::init([](std::optional<double> scale, std::string causal, std::int64_t window_left,
                      std::int64_t window_right, double softcap, double dropout_p,
                      std::uint64_t seed, std::uint64_t offset, bool enable_gqa, int num_threads,
                      std::string backend) {
            return CallOptions{
                scale,  std::move(causal), window_left, window_right,      softcap, dropout_p, seed,
                offset, enable_gqa,        num_threads, std::move(backend)};
          }),
          py::kw_only(), py::arg("scale"), py::arg("causal"), py::arg("window_left"),
          py::arg("window_right"), py::arg("softcap"), py::arg("dropout_p"), py::arg("seed"),
          py::arg("offset"), py::arg("enable_gqa"), py::arg("num_threads"), py::arg("backend"));

  m.def("forward", &forward, py::arg("query"), py::arg("key"), py::arg("value"), py::arg("out"),
        py::arg("lse").none(true), py::arg("mask").none(true), py::arg("alibi_slopes").none(true),
        py::arg("options"));
  m.def("backward", &backward, py::arg("dout"), py::arg("query"), py::arg("key"), py::arg("value"),
        py::arg("out"), py::arg("lse"), py::arg("dq"), py::arg("dk"), py::arg("dv"),
        py::arg("dbias").none(true), py::arg("mask").none(true), py::arg("alibi_slopes").none(true),
        py::arg("options"));
  m.def("forward_varlen", &forward_varlen, py::arg("query"), py::arg("key"), py::arg("value"),
        py::arg("cu_seqlens_q"), py::arg("cu_seqlens_k"), py::arg("seqused_k").none(true),
        py::arg("max_seqlen_q"), py::arg("max_seqlen_k"), py::arg("out"),
        py::arg("lse").none(true), py::arg("mask").none(true), py::arg("alibi_slopes").none(true),
        py::arg("options"));
  m.def("backward_varlen", &backward_varlen, py::arg("dout"), py::arg("query"), py::arg("key"),
        py::arg("value"), py::arg("out"), py::arg("lse"), py::arg("cu_seqlens_q"),
        py::arg("cu_seqlens_k"), py::arg("seqused_k").none(true), py::arg("max_seqlen_q"),
        py::arg("max_seqlen_k"), py::arg("dq"), py::arg("dk"), py::arg("dv"),
        py::arg("mask").none(true), py::arg("alibi_slopes").none(true), py::arg("options"));
  m.def("explain_forward", &explain_forward, py::arg("query"), py::arg("key"), py::arg("value"),
        py::arg("mask").none(true), py::arg("alibi_slopes").none(true), py::arg("options"));
  m.def("explain_backward", &explain_backward, py::arg("dout"), py::arg("query"), py::arg("key"),
        py::arg("value"), py::arg("out"), py::arg("lse"), py::arg("mask").none(true),
        py::arg("alibi_slopes").none(true), py::arg("want_dbias"), py::arg("options"));
  m.def(
      "enabled_backends", [] { return names_of(attncore::enabled_backends()); },
      "The backends automatic selection may choose on this thread, in priority order");
  m.def(
      "set_enabled_backends",
      [](const std::vector<std::string>& names) {
        std::vector<attncore::Backend> backends;
        for (const std::string& name : names)
          backends.push_back(backend_from_name("set_enabled_backends", name));
        return names_of(attncore::set_enabled_backends(backends));
      },
      py::arg("backends"), "Replaces this thread's enabled backends; returns the previous list");
  m.def("version", &attncore::version);
  bind_paged_cache(m);
  m.def("simd_target", &attncore::simd_target);
  m.def(
      "_last_call_addresses", [] { return last_call_addresses; },
      "The data address of each array of this thread's last call, by name");
  m.def("forward_kvcache", &forward_kvcache, py::arg("query"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("cache_seqlens"), py::arg("cache_batch_idx").none(true),
        py::arg("cache_leftpad").none(true), py::arg("block_table").none(true),
        py::arg("k").none(true), py::arg("v").none(true),
        py::arg("rotary_cos").none(true), py::arg("rotary_sin").none(true),
        py::arg("rotary_interleaved"), py::arg("out"), py::arg("lse").none(true),
        py::arg("alibi_slopes").none(true), py::arg("options"));
  m.def("merge_attention_states", &merge_states, py::arg("out_a"), py::arg("lse_a"),
        py::arg("out_b"), py::arg("lse_b"), py::arg("out"), py::arg("lse"),
        py::arg("num_threads") = 0);
}
