// attncore explain: the backend `auto` picks for the call the run flags describe, with every
// backend's verdict, the cost model's estimates and its constants (the fixed ones it uses, and
// the same measured in this process). Runs nothing: the library's public explain_forward /
// explain_backward, cost_constants and measured_cost_constants answer.
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "attncore/attncore.h"
#include "commands.h"
#include "constants.h"
#include "flags.h"
#include "inputs.h"
#include "json.h"
#include "run_config.h"

namespace attncore_tools {

using attncore::Backend;

int cmd_explain(const std::vector<std::string>& args) {
  if (asks_for_run_help(args)) {
    std::fputs(usage_text().c_str(), stdout);
    return kExitOk;
  }
  const RunConfig c = parse_run_flags(args);
  for (const std::string& arg : args) {  // (run's flags that only a run reads)
    for (const char* flag : {"--check", "--repeat"}) {
      if (arg == flag || arg.starts_with(std::string(flag) + "=")) {
        throw UsageError{std::string("explain does not take ") + flag + " (it runs nothing)"};
      }
    }
  }
  if (c.is_varlen()) {
    throw UsageError{"explain does not take --varlen (the library explains dense calls)"};
  }
  if (c.is_cache()) {
    throw UsageError{"explain does not take --cache-len (it explains dense calls; `run "
                     "--cache-len` reports the backend that ran)"};
  }
  attncore::set_simd_target(c.simd);
  // The views point at one element of the widest dtype (so aligned for every dtype): explain
  // validates shapes and strides and reads none of their data, but the ALiBi slopes it reads
  // (a view of that one element gave it Hq floats past it).
  static double no_data;
  const CallViews w = c.views(&no_data);
  const attncore::Tensor slopes = alibi_slopes(c);
  const attncore::Options options = c.options(slopes, w.mask);
  std::optional<attncore::BackendScope> only;  // --backend B: B alone is considered
  if (c.backend != Backend::automatic) only.emplace(std::vector<Backend>{c.backend});
  const attncore::Explanation e =
      c.backward ? attncore::explain_backward(w.out, w.q, w.k, w.v, w.out, w.lse, options)
                 : attncore::explain_forward(w.q, w.k, w.v, options);
  const attncore::CostConstants k = attncore::cost_constants();
  const attncore::CostConstants measured = attncore::measured_cost_constants();
  const int threads = c.resolved_threads();
  const char* pass = c.backward ? "backward" : "forward";

  if (c.json) {
    JsonObject j;
    j.add("version", attncore::version());
    j.add("pass", pass);
    c.add_shape(j);
    j.add("threads", threads);
    std::vector<std::string> enabled;
    for (Backend b : attncore::enabled_backends()) {
      enabled.push_back(JsonObject::quoted(name_of(b)));
    }
    j.add_json("enabled", json_array(enabled));
    if (e.chosen == Backend::automatic) {
      j.add_null("chosen");
    } else {
      j.add("chosen", name_of(e.chosen));
    }
    std::vector<std::string> verdicts;
    for (const attncore::BackendVerdict& v : e.verdicts) {
      JsonObject o;
      o.add("backend", name_of(v.backend));
      o.add("enabled", v.enabled);
      o.add("can_run", v.reasons.empty());
      std::vector<std::string> reasons;
      for (const std::string& r : v.reasons) reasons.push_back(JsonObject::quoted(r));
      o.add_json("reasons", json_array(reasons));
      o.add("estimated_seconds", v.estimated_seconds >= 0
                                     ? std::optional<double>(v.estimated_seconds)
                                     : std::optional<double>());
      verdicts.push_back(o.str());
    }
    j.add_json("verdicts", json_array(verdicts));
    j.add_json("constants", constants_json(k));
    j.add_json("measured_constants", constants_json(measured));
    print_json_object(j);
    return kExitOk;
  }

  std::printf("attncore explain: %s, dtype=%s %s causal=%s threads=%d\n", pass,
              std::string(name_of(c.dtype)).c_str(), c.shape_text().c_str(),
              std::string(name_of(c.causal)).c_str(), threads);
  std::printf("%s", e.summary().c_str());
  print_constants(k, measured);
  return kExitOk;
}

}  // namespace attncore_tools
