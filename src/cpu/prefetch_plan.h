// Where and how far ahead the in-place decode kernels (DirectKv, flash_direct_kv*-inl.h)
// prefetch the K and V rows they stream: a property of the core's design, chosen once from the
// CPU. A prefetch changes no value, so every plan gives the same bits.
#pragma once

#include <string>

namespace attncore::detail {

struct PrefetchPlan {
  const char* name;
  // K rows of one head lying together ([B, Hkv, L, D]), prefetched 6 KiB ahead into L1 (else
  // L2); f32 rows also this many bytes ahead, into the same level (0: not), those prefetches
  // either each just before the one of the row 6 KiB ahead (interleaved) or all of a block of
  // keys before them.
  bool near_k_into_l1;
  int near_k_f32_also_bytes;
  bool near_k_f32_also_interleaved;
  // V rows of one f32 query row over one head (MHA [B, Hkv, L, D]) prefetched this many keys
  // ahead of P . V, into L1 or L2 as v_into_l1 says (0: not; other one-head items: kVLead,
  // flash_direct_kv-inl.h).
  int f32_row_v_lead;
  // V rows of any one-head item ([B, Hkv, L, D]) also prefetched this many keys ahead into L2
  // (0: not; on AVX2 not for a GQA group's rows: flash_direct_kv-inl.h).
  int v_far;
  // V rows prefetched f32_row_v_lead or kVLead keys ahead (GQA on AVX-512: also each column
  // slice's 16 keys ahead) into L1, else into L2.
  bool v_into_l1;
};

// The plan for a CPU: `vendor` as cpuid gives it ("AuthenticAMD", ...) and its x86 family
// (CpuInfo::family).
const PrefetchPlan& prefetch_plan_for(const std::string& vendor, int family);

// This machine's plan (prefetch_plan_for of attncore::cpu_info(), looked up once), or the one
// a ScopedPrefetchPlan holds.
const PrefetchPlan& prefetch_plan();

// The plans there are (for tests: every plan must give the same bits).
const PrefetchPlan* prefetch_plans(int* count);

// Makes `plan` (a plan of prefetch_plans() or any other) the one prefetch_plan() returns while
// in scope: tests. (A call running meanwhile may mix plans, which changes no value.)
class ScopedPrefetchPlan {
 public:
  explicit ScopedPrefetchPlan(const PrefetchPlan& plan);
  ~ScopedPrefetchPlan();
  ScopedPrefetchPlan(const ScopedPrefetchPlan&) = delete;
  ScopedPrefetchPlan& operator=(const ScopedPrefetchPlan&) = delete;

 private:
  const PrefetchPlan* previous_;
};

}  // namespace attncore::detail
