#include "fuzz_check.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "testing/problem.h"

namespace attncore::fuzz {

void fail(const std::string& what) {
  std::fprintf(stderr, "attncore fuzz: %s\n", what.c_str());
  std::abort();
}

namespace {

const char* name_of(Outcome o) {
  switch (o) {
    case Outcome::ok:
      return "ok";
    case Outcome::invalid:
      return "InvalidArgument";
    case Outcome::unsupported:
      return "Unsupported";
    case Outcome::out_of_memory:
      return "OutOfMemory";
    case Outcome::cancelled:
      return "Cancelled";
  }
  return "?";
}

Run run_one(const CallSpec& spec, Backend backend,
            const std::vector<std::vector<std::uint8_t>>& outputs_before,
            const std::vector<std::vector<std::uint8_t>>& inputs_before) {
  auto restore = [](Array* a, const std::vector<std::uint8_t>& bytes) {
    std::memcpy(a->storage.data(), bytes.data(), bytes.size());
  };
  for (std::size_t i = 0; i < spec.outputs.size(); ++i) restore(spec.outputs[i], outputs_before[i]);
  for (std::size_t i = 0; i < spec.inputs.size(); ++i) restore(spec.inputs[i], inputs_before[i]);
  Run run{backend, Outcome::ok, "", {}, {}};
  try {
    spec.call(backend);
  } catch (const InvalidArgument& e) {
    run.outcome = Outcome::invalid, run.message = e.what();
  } catch (const Unsupported& e) {
    run.outcome = Outcome::unsupported, run.message = e.what();
  } catch (const OutOfMemory& e) {
    run.outcome = Outcome::out_of_memory, run.message = e.what();
  } catch (const Cancelled& e) {
    run.outcome = Outcome::cancelled, run.message = e.what();
  } catch (const std::exception& e) {
    fail(std::string(attncore::name_of(backend)) + ": unexpected exception: " + e.what());
  }
  const std::string who = std::string(attncore::name_of(backend)) + " (" + name_of(run.outcome) +
                          (run.message.empty() ? "" : ": " + run.message) + ")";
  if (run.outcome == Outcome::cancelled && !spec.cancel_set) fail(who + ": cancelled unasked");
  if (run.outcome == Outcome::ok && spec.cancel_set) fail(who + ": ran with the cancel flag set");
  for (std::size_t i = 0; i < spec.inputs.size(); ++i) {
    bool may_write = false;
    for (const Array* w : spec.written) may_write |= w == spec.inputs[i];
    if (may_write && run.outcome == Outcome::ok) continue;
    if (!spec.inputs[i]->same_as(inputs_before[i]))
      fail(who + ": wrote input " + std::to_string(i));
  }
  if (run.outcome != Outcome::ok) {
    for (std::size_t i = 0; i < spec.outputs.size(); ++i) {
      if (!spec.outputs[i]->same_as(outputs_before[i]))
        fail(who + ": a refused call wrote output " + std::to_string(i));
    }
    return run;
  }
  for (const TensorView& v : spec.result) run.results.push_back(test::read_view(v));
  for (const Array* a : spec.written) run.written.push_back(a->snapshot());
  return run;
}

}  // namespace

std::vector<Run> run_all_backends(const CallSpec& spec) {
  std::vector<std::vector<std::uint8_t>> outputs_before, inputs_before;
  for (const Array* a : spec.outputs) outputs_before.push_back(a->snapshot());
  for (const Array* a : spec.inputs) inputs_before.push_back(a->snapshot());
  std::vector<Run> runs;
  for (Backend b : {Backend::reference, Backend::math, Backend::flash}) {
    runs.push_back(run_one(spec, b, outputs_before, inputs_before));
    const bool ref_invalid = runs.front().outcome == Outcome::invalid;
    if ((runs.back().outcome == Outcome::invalid) != ref_invalid)
      fail(std::string("validation differs: reference ") + name_of(runs.front().outcome) + " (" +
           runs.front().message + "), " + std::string(attncore::name_of(b)) + " " +
           name_of(runs.back().outcome) + " (" + runs.back().message + ")");
  }
  return runs;
}

double max_finite(const std::vector<double>& x) {
  double m = 0;
  for (double v : x)
    if (std::isfinite(v)) m = std::max(m, std::fabs(v));
  return m;
}

void check_close(const Run& ref, const Run& run, std::size_t i, double tolerance,
                 const std::string& what) {
  const std::vector<double>& want = ref.results.at(i);
  const std::vector<double>& got = run.results.at(i);
  for (std::size_t j = 0; j < want.size(); ++j) {
    const double a = got[j], b = want[j];
    const bool same_special = (std::isnan(a) && std::isnan(b)) || (std::isinf(b) && a == b);
    if (same_special) continue;
    if (!(std::fabs(a - b) <= tolerance)) {
      char text[256];
      std::snprintf(
          text, sizeof text, "%s: %s element %zu is %.9g, reference %.9g (tolerance %.3g)",
          std::string(attncore::name_of(run.backend)).c_str(), what.c_str(), j, a, b, tolerance);
      fail(text);
    }
  }
}

void check_masked_rows(const std::vector<double>& ref_lse, const std::vector<double>& out,
                       const std::vector<double>& lse, std::int64_t dim_v,
                       const std::string& what) {
  const double minus_inf = -std::numeric_limits<double>::infinity();
  for (std::size_t r = 0; r < ref_lse.size(); ++r) {
    if (ref_lse[r] != minus_inf) continue;
    if (lse[r] != minus_inf) fail(what + ": a fully masked row's LSE is not -inf");
    for (std::int64_t j = 0; j < dim_v; ++j) {
      if (out[r * static_cast<std::size_t>(dim_v) + static_cast<std::size_t>(j)] != 0.0)
        fail(what + ": a fully masked row's output is not 0");
    }
  }
}

double output_tolerance(DType dtype, double vmax) {
  const std::vector<double> v{vmax};
  const double rule = test::out_tolerance(dtype, v, {}, {}, 0.0);
  if (dtype == DType::f32 || dtype == DType::f64) return rule;
  const double u = dtype == DType::bf16 ? 0x1p-8 : 0x1p-11;
  return rule + 2.0 * (2.0 * u * vmax) + u * vmax;
}

}  // namespace attncore::fuzz
