// `--check`: a call's results against the reference backend in f64.
#pragma once

#include <optional>
#include <string>

#include "attncore/attncore.h"
#include "inputs.h"

namespace attncore_tools {

struct CheckResult {
  std::string scope;  // what was checked ("all", or the batch and heads of a large call)
  bool full = true;   // all of it
  double out_err = 0;
  std::optional<double> grad_err;  // max over dq, dk, dv
};

// max |result - reference| of `out` and, when `dq` is given, of dq, dk and dv. Large calls are
// checked on a slice (check.cpp says which).
CheckResult check_against_reference(const PreparedCall& p, const attncore::TensorView& out,
                                    const attncore::Tensor* dq, const attncore::Tensor* dk,
                                    const attncore::Tensor* dv);

}  // namespace attncore_tools
