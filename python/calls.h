// How attncore._core runs a call into the library: with the GIL released, and, for a call of
// some size made on the main thread, watched for Ctrl-C (docs/design.md section 8). The part of
// the extension module that deals with threads, signals and the interpreter's exit.
#pragma once

#include <Python.h>

#include <functional>

#include "attncore/attncore.h"
#include "attncore/varlen.h"

namespace attncore_python {

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
  ~GilReleased();

 private:
  PyThreadState* state_;
};

// Python's ident of the main thread: set once, when the module is imported.
void set_main_thread(unsigned long ident);

// A bound on a call's work, in multiply-adds: every query row (q [..., Lq, D], or packed rows
// [total_q, Hq, D]) against every row of k [..., Lk, D] (or [total_k, Hkv, D]), times D + Dv;
// or against `keys` keys (a KV-cache call: the keys its sequences attend, on average).
double call_work(const attncore::TensorView& q, const attncore::TensorView& k,
                 const attncore::TensorView& v);
double call_work(const attncore::TensorView& q, double keys, const attncore::TensorView& v);
// What run_call weighs a call's work as: `work` (call_work, varlen_work) itself for the fused
// backends (flash, math, or automatic over f32 and 16-bit values), 8x for the reference backend
// or f64 values (fp64 loops, the slowest), so that a call run in place ends soon (calls.cpp:
// kInPlaceWork).
double weighed_work(double work, attncore::Backend backend, attncore::DType dtype);
// A variable-length call's work: each sequence's query rows against its keys (seqused_k[b],
// else its cu_seqlens_k gap), times Hq and D + Dv. Index arrays the library will refuse (not
// int32 [B + 1] and [B]), or more than 2^16 sequences (not read through), count every query
// row against k's rows (over page pools: max_seqlen_k).
double varlen_work(const attncore::TensorView& q, const attncore::TensorView& k,
                   const attncore::TensorView& v, const attncore::VarlenSeqs& seqs);

// Runs call(options) with the GIL released (the GIL is held on entry and on return). On the
// main thread, a call whose work exceeds a threshold (calls.cpp: kInPlaceWork) runs on a runner
// thread while this one watches for Ctrl-C: a KeyboardInterrupt sets the call's
// Options::cancel, waits for the call to stop and is raised (py::error_already_set).
void run_call(attncore::Options options, double work,
              const std::function<void(const attncore::Options&)>& call);

}  // namespace attncore_python
