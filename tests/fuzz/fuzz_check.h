// What the fuzzer requires of every call: it runs the call on every backend, each time from the
// same starting memory, and aborts (so that libFuzzer reports the input) unless
//  - each backend either succeeds or throws InvalidArgument, Unsupported or OutOfMemory
//    (Cancelled only when the call's cancel flag is set), and InvalidArgument from one backend
//    means InvalidArgument from all (validation does not depend on the backend);
//  - a call that throws wrote nothing: every byte of every output and input array is as before;
//  - a call that succeeds changed no input (but the KV cache an append writes);
//  - results agree with the reference backend's within the tolerance of docs/design.md
//    section 6 (tests/testing/problem.h), and rows the reference finds fully masked (LSE -inf)
//    hold exactly 0 and LSE -inf.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "attncore/attncore.h"
#include "fuzz_input.h"

namespace attncore::fuzz {

[[noreturn]] void fail(const std::string& what);

enum class Outcome : std::uint8_t { ok, invalid, unsupported, out_of_memory, cancelled };

// One backend's run of a call: its outcome and, when ok, the result views' elements.
struct Run {
  Backend backend;
  Outcome outcome;
  std::string message;
  std::vector<std::vector<double>> results;
  std::vector<std::vector<std::uint8_t>> written;  // CallSpec::written's bytes after it, when ok
};

struct CallSpec {
  std::vector<Array*> outputs;     // reset to their starting bytes before each backend
  std::vector<Array*> inputs;      // must not change (restored before each backend anyway)
  std::vector<Array*> written;     // inputs a successful call may write (KV cache appends)
  std::vector<TensorView> result;  // views read after a successful call
  bool cancel_set = false;         // the call's cancel flag is set
  std::function<void(Backend)> call;
};

// Runs `spec.call` on reference, math and flash and checks the rules above but the numeric
// agreement; returns the runs (reference first).
std::vector<Run> run_all_backends(const CallSpec& spec);

// The largest |x| over finite elements.
double max_finite(const std::vector<double>& x);

// Checks run's results[i] against the reference's within `tolerance` (NaN must match NaN and an
// infinity the same infinity).
void check_close(const Run& ref, const Run& run, std::size_t i, double tolerance,
                 const std::string& what);

// Forward outputs out [rows, Dv] and lse [rows], both flattened in one order: rows whose
// reference LSE is -inf hold exactly 0 and -inf on `run`.
void check_masked_rows(const std::vector<double>& ref_lse, const std::vector<double>& out,
                       const std::vector<double>& lse, std::int64_t dim_v, const std::string& what);

// The tolerance on an attention output of `dtype` whose values are a weighted mean of values of
// magnitude at most `vmax` (already divided by 1 - dropout_p): docs/design.md section 6 through
// the tests' own out_tolerance. For the 16-bit dtypes the naive same-dtype computation's error
// is bounded rather than run (the varlen and KV-cache calls have no oracle): rounding P and the
// output once each errs at most 2u * vmax (u = 2^-8 for bf16, 2^-11 for f16), which the rule
// doubles, plus the reference's own rounding of its output, u * vmax.
double output_tolerance(DType dtype, double vmax);

}  // namespace attncore::fuzz
