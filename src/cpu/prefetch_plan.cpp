#include "cpu/prefetch_plan.h"

#include <atomic>
#include <functional>
#include <iterator>

#include "attncore/info.h"

namespace attncore::detail {

namespace {

// Each plan as measured on its core: bench --decode, 1 thread, % of the read probe, Lk =
// 4096/16384, B = 1, interleaved passes of the two plans on the same machine.
const PrefetchPlan kPlans[] = {
    // Zen 4 (AMD family 0x19), and every CPU not named below. Near K rows once, into L2; an f32
    // row's V 8 keys ahead. Against the zen5 plan, 5 passes: MHA [B, Hkv, L, D] f32 43/43 ->
    // 77/74, bf16 60/61 -> 66/67, f16 56/56 -> 61/61; GQA (Hkv = 8) f32 40/38 -> 52/49, bf16
    // 37/36 -> 41/39, f16 35/31 -> 36/35. (Near K into L1 once: f32 MHA 49/47 with no V lead;
    // not prefetched at all: 35/35; an f32 row's V 0, 8, 16, 32 keys ahead: 55, 77, 74, 66-69.)
    {"zen4", false, false, 8},
    // Zen 5 (AMD family 0x1A). Near K rows into L1, f32 rows twice (MHA f32 82/81 -> 88/86,
    // GQA f32 76/65 -> 80/72 and 68/62 -> 78/73 in two runs of 9 passes against once; 16-bit
    // rows ran slower twice: bf16 97/92 -> 89/88); no V prefetch for an f32 row (80/79 against
    // 78/76 at 8 keys).
    {"zen5", true, true, 0},
};

std::atomic<const PrefetchPlan*> scoped{nullptr};

}  // namespace

const PrefetchPlan& prefetch_plan_for(const std::string& vendor, int family) {
  if (vendor == "AuthenticAMD" && family >= 0x1A) return kPlans[1];
  return kPlans[0];
}

const PrefetchPlan& prefetch_plan() {
  if (const PrefetchPlan* plan = scoped.load(std::memory_order_relaxed)) return *plan;
  static const PrefetchPlan& machine = [] {
    const CpuInfo cpu = cpu_info();
    return std::ref(prefetch_plan_for(cpu.vendor, cpu.family));
  }();
  return machine;
}

const PrefetchPlan* prefetch_plans(int* count) {
  *count = static_cast<int>(std::size(kPlans));
  return kPlans;
}

ScopedPrefetchPlan::ScopedPrefetchPlan(const PrefetchPlan& plan)
    : previous_(scoped.exchange(&plan)) {}
ScopedPrefetchPlan::~ScopedPrefetchPlan() { scoped.store(previous_); }

}  // namespace attncore::detail
