// `--check`: a call's results against the reference backend in f64, judged by the rule of
// docs/design.md section 6.
#pragma once

#include <optional>
#include <string>

#include "attncore/attncore.h"
#include "inputs.h"

namespace attncore_tools {

struct CheckResult {
  std::string scope;  // what was checked ("all", or the part of a large call)
  bool full = true;   // all of it
  double out_err = 0;
  double out_tolerance = 0;
  std::optional<double> grad_err;  // max over dq, dk, dv
  // Error over tolerance of out, and the largest over dq, dk and dv (when checked).
  double out_ratio = 0;
  std::optional<double> grad_ratio;
  // The largest error / tolerance over out, dq, dk and dv: at most 1 passes (NaN fails).
  double worst_ratio = 0;
  bool passed() const { return worst_ratio <= 1.0; }
};

// The rule a check applies, in words (for the text output).
extern const char* const kCheckRule;

// max |result - reference| of `out` and, when `dq` is given, of dq, dk and dv, and each against
// its tolerance. Dense and packed calls alike; large calls are checked on a part (check.cpp says
// which).
CheckResult check_against_reference(const PreparedCall& p, const attncore::TensorView& out,
                                    const attncore::Tensor* dq, const attncore::Tensor* dk,
                                    const attncore::Tensor* dv);

}  // namespace attncore_tools
