// The flash forward's driver: SIMD target choice, K/V packing, work items, threads.
#include "cpu/flash.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>

#include "attncore/error.h"
#include "attncore/info.h"
#include "core/convert.h"
#include "core/threadpool.h"
#include "policy/mask.h"

namespace attncore::detail {

#if defined(__x86_64__)
FlashTarget flash_target_avx512();
FlashTarget flash_target_avx2();
#endif
FlashTarget flash_target_generic();

namespace {

// 64-byte aligned float storage, allocated once per call (never per tile).
struct AlignedFloats {
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  std::unique_ptr<float, Free> data;
  explicit AlignedFloats(std::int64_t count) {
    const std::size_t bytes = (static_cast<std::size_t>(std::max<std::int64_t>(count, 1)) * sizeof(float) + 63) &
                              ~std::size_t{63};
    data.reset(static_cast<float*>(std::aligned_alloc(64, bytes)));
    if (!data) throw std::bad_alloc();
  }
  float* get() const { return data.get(); }
};

std::int64_t round_up(std::int64_t x, std::int64_t m) { return (x + m - 1) / m * m; }

}  // namespace

// The target chosen by set_simd_target ("" = the best supported one).
std::mutex g_choice_mutex;
std::string g_choice;

std::vector<FlashTarget> flash_targets_compiled() {
#if defined(__x86_64__)
  return {flash_target_avx512(), flash_target_avx2(), flash_target_generic()};
#else
  return {flash_target_generic()};
#endif
}

bool flash_target_supported(const FlashTarget& t) {
  const std::string name = t.name;
  if (name == "generic") return true;
  static const CpuInfo cpu = cpu_info();
  if (name == "avx2") return cpu.has("avx2") && cpu.has("fma") && cpu.has("f16c");
  if (name == "avx512") {
    return cpu.has("avx512f") && cpu.has("avx512bw") && cpu.has("avx512vl") && cpu.has("avx512dq") &&
           cpu.has("avx2") && cpu.has("fma") && cpu.has("f16c");
  }
  return false;
}

const FlashTarget& flash_target_chosen() {
  static const std::vector<FlashTarget> targets = flash_targets_compiled();
  std::lock_guard<std::mutex> lock(g_choice_mutex);
  for (const FlashTarget& t : targets) {
    if ((g_choice.empty() || g_choice == t.name) && flash_target_supported(t)) return t;
  }
  return targets.back();  // generic: always compiled, always supported
}

void flash_forward(const Problem& p, const ForwardArgs& a) {
  const FlashTarget& target = flash_target_chosen();
  const FlashLayout& layout = target.layout;
  const std::int64_t lk = p.seqlen_k, d = p.head_dim, dv = p.head_dim_v;
  const std::int64_t tiles = (lk + layout.key_tile - 1) / layout.key_tile;
  const std::int64_t dv_pad = round_up(dv, layout.dv_align);
  const std::int64_t blocks = (p.seqlen_q + layout.block_rows - 1) / layout.block_rows;
  if (p.empty_output()) return;

  // K panels [tiles][D][key_tile] and V rows [tiles * key_tile][dv_pad] of one kv head.
  AlignedFloats k_tiles(tiles * d * layout.key_tile);
  AlignedFloats v_rows(tiles * layout.key_tile * dv_pad);
  const int threads = std::max(1, p.threads);
  const std::int64_t scratch_floats = layout.block_rows * (d + layout.key_tile + dv_pad + 3);
  AlignedFloats scratch(threads * round_up(scratch_floats, 16));
  const FlashPanel panel{k_tiles.get(), v_rows.get(), dv_pad};

  for (std::int64_t b = 0; b < p.batch; ++b) {
    for (std::int64_t kv_head = 0; kv_head < p.heads_kv; ++kv_head) {
      // Pack K (transposed per tile) and V (padded), one tile per task.
      parallel_for(tiles, threads, [&](std::int64_t t_begin, std::int64_t t_end) {
        for (std::int64_t t = t_begin; t < t_end; ++t) {
          float* kt = k_tiles.get() + t * d * layout.key_tile;
          float* vr = v_rows.get() + t * layout.key_tile * dv_pad;
          for (std::int64_t c = 0; c < layout.key_tile; ++c) {
            const std::int64_t j = t * layout.key_tile + c;
            float* v_row = vr + c * dv_pad;
            if (j < lk) {
              const std::int64_t k_row = offset4(a.k, b, kv_head, j, 0);
              for (std::int64_t e = 0; e < d; ++e) {
                kt[e * layout.key_tile + c] = load_element<float>(a.k.data, a.k.dtype, k_row + e);
              }
              load_row(a.v.data, a.v.dtype, offset4(a.v, b, kv_head, j, 0), dv, v_row);
            } else {
              for (std::int64_t e = 0; e < d; ++e) kt[e * layout.key_tile + c] = 0.0f;
              for (std::int64_t e = 0; e < dv; ++e) v_row[e] = 0.0f;
            }
            for (std::int64_t e = dv; e < dv_pad; ++e) v_row[e] = 0.0f;
          }
        }
      });
      // Work items: (query head of the group, block of rows), handed out in order from one
      // counter; each item's result does not depend on which thread runs it.
      const std::int64_t items = p.group * blocks;
      std::atomic<std::int64_t> next{0};
      run_tasks(static_cast<int>(std::min<std::int64_t>(threads, items)), threads, [&](int slot) {
        float* base = scratch.get() + slot * round_up(scratch_floats, 16);
        const FlashScratch w{base, base + layout.block_rows * d,
                             base + layout.block_rows * (d + layout.key_tile),
                             base + layout.block_rows * (d + layout.key_tile + dv_pad),
                             base + layout.block_rows * (d + layout.key_tile + dv_pad + 1),
                             base + layout.block_rows * (d + layout.key_tile + dv_pad + 2)};
        for (std::int64_t n = next.fetch_add(1); n < items; n = next.fetch_add(1)) {
          const std::int64_t h = kv_head * p.group + n / blocks;
          const std::int64_t row0 = (n % blocks) * layout.block_rows;
          const FlashItem item{b, h, row0, std::min<std::int64_t>(layout.block_rows, p.seqlen_q - row0)};
          target.run_block(p, a, panel, item, w);
        }
      });
    }
  }
}

}  // namespace attncore::detail

namespace attncore {

std::vector<std::string> simd_targets_compiled() {
  std::vector<std::string> names;
  for (const detail::FlashTarget& t : detail::flash_targets_compiled()) names.emplace_back(t.name);
  return names;
}

std::vector<std::string> simd_targets_supported() {
  std::vector<std::string> names;
  for (const detail::FlashTarget& t : detail::flash_targets_compiled()) {
    if (detail::flash_target_supported(t)) names.emplace_back(t.name);
  }
  return names;
}

std::string simd_target() { return detail::flash_target_chosen().name; }

std::string set_simd_target(const std::string& name) {
  if (!name.empty()) {
    const std::vector<std::string> supported = simd_targets_supported();
    if (std::find(supported.begin(), supported.end(), name) == supported.end()) {
      std::string list;
      for (const std::string& s : supported) list += (list.empty() ? "" : ", ") + s;
      throw InvalidArgument("set_simd_target: target is not available (name=" + name +
                            ", expected one of: " + list + ", or \"\" for automatic)");
    }
  }
  std::lock_guard<std::mutex> lock(detail::g_choice_mutex);
  std::string previous = detail::g_choice;
  detail::g_choice = name;
  return previous;
}

}  // namespace attncore
