// Split-KV decode (flash-decoding) of the flash forward: the keys of each kv group that is a
// single work item (decode) are cut into parts run as separate work items, each writing a
// normalised partial output and its LSE, merged afterwards all at once (docs/design.md
// section 1.12).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "core/params.h"
#include "cpu/flash.h"

namespace attncore::detail {

// The number of parts each kv group's keys are cut into (1: no split), a pure function of the
// problem and `cpus`, a fixed property of the machine (machine_threads(), never the call's
// thread count), so that results are the same bits for any thread count. Only kv groups that
// are one work item each (group * Lq <= the layout's block rows) are split; Params::num_splits
// > 0 forces the count (capped to the longest sequence's tiles; a varlen sequence's own).
std::int64_t plan_kv_splits(const Params& p, const FlashLayout& layout, int cpus);
// Each sequence's parts: a dense or cache call's for every sequence; a varlen sequence's own,
// as the dense call of its lengths would plan them (so that a packed batch gives, bit for bit,
// what the loop over its sequences does). plan_kv_splits is their maximum.
std::vector<std::int64_t> sequence_splits(const Params& p, const FlashLayout& layout, int cpus);

// The workspace of a split call, in floats: every part's output (f32) and LSE (f64, two floats'
// worth) of every row.
std::int64_t split_workspace_floats(const Params& p, std::int64_t splits);

// Runs a call whose plan has splits > 1 parts: items (run of plan.heads_of kv heads, part)
// over the threads, groups taken in plan.order, each thread in the scratch scratch_of(slot)
// gives; then the parts of each row merged into the outputs.
void flash_forward_split(const Params& p, const Launch& launch, const ForwardArgs& args,
                         const FlashTarget& target, const FlashForwardPlan& plan,
                         const std::function<FlashScratch(int)>& scratch_of);

}  // namespace attncore::detail
