// Calls as backend selection sees them, for the selection tests (select_test.cpp,
// select_cost_test.cpp): what a call computes (Params) and on how many threads, the cost
// model's estimate of it and the choice among enabled backends.
#pragma once

#include <vector>

#include "attncore/attncore.h"
#include "core/select.h"

namespace attncore::test {

// The backends enabled by default, in priority order.
inline const std::vector<Backend> kDefault = {Backend::flash, Backend::math, Backend::reference};

// A call as selection sees it: what it computes (Params) and on how many threads.
struct Call : detail::Params {
  int threads = 1;
};

inline double estimate(Backend b, detail::Pass pass, const Call& c, const detail::CostModel& m) {
  return detail::estimate_seconds(b, pass, c, detail::Launch{c.threads}, m);
}

inline Explanation select_call(detail::Pass pass, const Call& c, Backend requested,
                               const std::vector<Backend>& enabled, const detail::CostModel& m) {
  return detail::select(pass, c, detail::Launch{c.threads}, requested, enabled, m);
}

}  // namespace attncore::test
