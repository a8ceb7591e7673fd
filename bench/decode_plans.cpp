// Decode plans against each other in one process (src/cpu/decode_plan.h), for tuning them on a
// core: one decode shape over a KV cache, the plans' calls in turn for --rounds rounds, each call
// (the best of --repeat) after a read that evicts K and V from the caches; per plan the median K/V
// GB/s and the median of the per-round speed ratios against the first plan, with their range.
// Calls in turn in one process see the machine alike, where separate runs minutes apart do not
// (docs/decode.md: how to measure). A plan is a spec, "zen5" or "zen5,one_row_paired=0,v_far=64"
// (decode_plan_from_spec); "read" stands for a plain read of the same K and V bytes, one stream
// with 8 vector accumulators: what the memory gives such a read in the same minutes.
//
//   build/release/bench/decode_plans --dtype f16 --layout BHLD zen5 zen5,one_row_paired=0 read
//
// K and V lie in one buffer on huge pages (2 MiB aligned, the hint given), V right after K, as
// `attncore bench --decode` places them; paged layouts (pN) hand the pages to the sequence in a
// fixed shuffled order.
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "attncore/attncore.h"
#include "attncore/kvcache.h"
#include "cache_fill.h"
#include "cpu/decode_plan.h"

namespace {

using attncore::DType;
using attncore::Tensor;
using attncore::TensorView;
using attncore::detail::DecodePlan;

struct Config {
  DType dtype = DType::f32;
  std::int64_t heads_q = 32, heads_kv = 32, seqlen = 16384, head_dim = 128;
  std::string layout = "BHLD";  // BHLD, BLHD or pN (pages of N keys)
  int rounds = 9, repeat = 3, threads = 1;
  std::int64_t evict_mib = 256;
  std::vector<std::string> specs;
};

constexpr const char* kUsage =
    "usage: decode_plans [flags] PLAN [PLAN...]   (PLAN: a decode plan spec, e.g. zen5 or\n"
    "  zen5,one_row_paired=0,v_far=64; or read: a plain read of the same K and V)\n"
    "  --dtype T        f32, bf16 or f16 (the query's and the cache's) [f32]\n"
    "  --heads-q N      query heads [32]\n"
    "  --heads-kv N     kv heads, heads-q % heads-kv == 0 [32]\n"
    "  --seqlen N       keys in the cache, B = 1, Lq = 1 [16384]\n"
    "  --head-dim N     D = Dv [128]\n"
    "  --layout L       BHLD ([B, Hkv, L, D]), BLHD ([B, L, Hkv, D]) or pN (pages of N keys,\n"
    "                   N dividing seqlen) [BHLD]\n"
    "  --rounds N       rounds of the plans' calls in turn [9]\n"
    "  --repeat N       calls per plan and round, the fastest kept [3]\n"
    "  --threads N      the calls' threads [1]\n"
    "  --evict-mib N    MiB read before each call to evict K and V, 0: none [256]\n";

// The usage, with the plans' fields a spec may set (src/cpu/decode_plan.h says what each does).
void print_usage(std::FILE* to) {
  std::fputs(kUsage, to);
  std::string line = "  plan fields:";
  for (const std::string& field : attncore::detail::decode_plan_field_names()) {
    if (line.size() + field.size() + 1 > 96) {
      std::fprintf(to, "%s\n", line.c_str());
      line = "   ";
    }
    line += " " + field;
  }
  std::fprintf(to, "%s\n", line.c_str());
}

[[noreturn]] void usage_error(const std::string& message) {
  std::fprintf(stderr, "decode_plans: %s\n", message.c_str());
  print_usage(stderr);
  std::exit(2);
}

std::int64_t positive(const std::string& flag, const char* text) {
  char* end = nullptr;
  const long long value = std::strtoll(text, &end, 10);
  if (*text == '\0' || *end != '\0' || value < 1 || value > (std::int64_t{1} << 40)) {
    usage_error(flag + " takes a positive integer (got '" + text + "')");
  }
  return value;
}

Config parse(int argc, char** argv) {
  Config c;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help") {
      print_usage(stdout);
      std::exit(0);
    }
    if (arg.rfind("--", 0) != 0) {
      c.specs.push_back(arg);
      continue;
    }
    if (i + 1 >= argc) usage_error(arg + " needs a value");
    const char* value = argv[++i];
    if (arg == "--dtype") {
      const std::string v = value;
      if (v != "f32" && v != "bf16" && v != "f16") usage_error("--dtype takes f32, bf16 or f16");
      c.dtype = v == "f32" ? DType::f32 : v == "bf16" ? DType::bf16 : DType::f16;
    } else if (arg == "--heads-q") {
      c.heads_q = positive(arg, value);
    } else if (arg == "--heads-kv") {
      c.heads_kv = positive(arg, value);
    } else if (arg == "--seqlen") {
      c.seqlen = positive(arg, value);
    } else if (arg == "--head-dim") {
      c.head_dim = positive(arg, value);
    } else if (arg == "--layout") {
      c.layout = value;
    } else if (arg == "--rounds") {
      c.rounds = static_cast<int>(std::min<std::int64_t>(positive(arg, value), 1000));
    } else if (arg == "--repeat") {
      c.repeat = static_cast<int>(std::min<std::int64_t>(positive(arg, value), 1000));
    } else if (arg == "--threads") {
      c.threads = static_cast<int>(std::min<std::int64_t>(positive(arg, value), 1024));
    } else if (arg == "--evict-mib") {
      c.evict_mib = std::string(value) == "0" ? 0 : positive(arg, value);
    } else {
      usage_error("unknown flag " + arg);
    }
  }
  if (c.specs.empty()) usage_error("no plan given");
  if (c.heads_q % c.heads_kv != 0) usage_error("--heads-q must be a multiple of --heads-kv");
  const bool paged = c.layout.size() > 1 && c.layout[0] == 'p';
  if (!paged && c.layout != "BHLD" && c.layout != "BLHD") {
    usage_error("--layout takes BHLD, BLHD or pN");
  }
  if (paged && c.seqlen % positive("--layout pN", c.layout.c_str() + 1) != 0) {
    usage_error("--layout pN: N must divide --seqlen");
  }
  return c;
}

// The bytes from p summed as floats, 8 vector accumulators, one stream (AVX-512 where the CPU has
// it; n a multiple of 64 floats).
#if defined(__x86_64__)
__attribute__((target("avx512f"))) float sum_avx512(const float* p, std::size_t n) {
  __m512 acc[8];
  for (__m512& a : acc) a = _mm512_setzero_ps();
  for (std::size_t i = 0; i < n; i += 128) {
    for (int k = 0; k < 8; ++k) acc[k] = _mm512_add_ps(acc[k], _mm512_loadu_ps(p + i + 16 * k));
  }
  for (int k = 1; k < 8; ++k) acc[0] = _mm512_add_ps(acc[0], acc[k]);
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, acc[0]);
  float sum = 0;
  for (const float x : lanes) sum += x;
  return sum;
}
#endif
float sum_plain(const float* p, std::size_t n) {
  float acc[32] = {};
  for (std::size_t i = 0; i < n; i += 32) {
    for (int k = 0; k < 32; ++k) acc[k] += p[i + static_cast<std::size_t>(k)];
  }
  float sum = 0;
  for (float x : acc) sum += x;
  return sum;
}

struct Free {
  void operator()(void* p) const { std::free(p); }
};

int run(const Config& c) {
  std::vector<DecodePlan> plans;  // (each spec checked before any work)
  for (const std::string& spec : c.specs) {
    plans.push_back(spec == "read" ? DecodePlan{} : attncore::detail::decode_plan_from_spec(spec));
  }
  const bool paged = c.layout[0] == 'p';
  const std::int64_t page = paged ? std::atoll(c.layout.c_str() + 1) : 0;
  const std::int64_t d = c.head_dim, l = c.seqlen, hkv = c.heads_kv;
  const std::size_t element = attncore::size_of(c.dtype);
  const std::size_t elements = static_cast<std::size_t>(hkv * l * d);  // of K, and of V
  const std::size_t bytes = 2 * elements * element;
  constexpr std::size_t kAlign = std::size_t{2} << 20;
  const std::size_t size = (bytes + kAlign - 1) / kAlign * kAlign;
  std::unique_ptr<void, Free> memory(std::aligned_alloc(kAlign, size));
  if (!memory) throw std::runtime_error("cannot allocate " + std::to_string(size) + " bytes");
  madvise(memory.get(), size, MADV_HUGEPAGE);
  attncore_tools::fill_cache_halves(memory.get(), size);  // (as bench --decode fills its caches)
  char* k_data = static_cast<char*>(memory.get());
  char* v_data = k_data + elements * element;
  const std::int64_t pages = paged ? l / page : 0;
  auto cache = [&](char* data) {  // [B, Hkv, L, D] views
    if (paged) return TensorView::contiguous(data, c.dtype, {pages, page, hkv, d}).transposed(1, 2);
    return c.layout == "BHLD"
               ? TensorView::contiguous(data, c.dtype, {1, hkv, l, d})
               : TensorView::contiguous(data, c.dtype, {1, l, hkv, d}).transposed(1, 2);
  };
  Tensor table(DType::i32, {1, std::max<std::int64_t>(pages, 1)});
  auto* order = static_cast<std::int32_t*>(table.view().data);
  for (std::int64_t n = 0; n < pages; ++n) order[n] = static_cast<std::int32_t>(n);
  std::uint32_t shuffle = 777;
  for (std::int64_t n = pages - 1; n > 0; --n) {  // Fisher-Yates, fixed seed
    shuffle = shuffle * 1664525u + 1013904223u;
    std::swap(order[n],
              order[static_cast<std::int64_t>(shuffle % static_cast<std::uint32_t>(n + 1))]);
  }
  Tensor q(c.dtype, {1, c.heads_q, 1, d}), out(c.dtype, {1, c.heads_q, 1, d});
  Tensor lens(DType::i32, {1});
  static_cast<std::int32_t*>(lens.view().data)[0] = static_cast<std::int32_t>(l);
  std::memcpy(q.view().data, k_data, static_cast<std::size_t>(c.heads_q * d) * element);
  attncore::KvCacheSeqs seqs;
  seqs.cache_seqlens = lens.view();
  if (paged) seqs.block_table = table.view();
  attncore::Options options;
  options.num_threads = c.threads;

  std::vector<std::uint64_t> eviction(static_cast<std::size_t>(c.evict_mib) << 17, 1);
  bool avx512 = false;
#if defined(__x86_64__)
  avx512 = attncore::cpu_info().has("avx512f");
#endif
  volatile float sink = 0;
  std::vector<std::vector<double>> gbs(plans.size());
  for (int round = 0; round < c.rounds; ++round) {
    for (std::size_t p = 0; p < plans.size(); ++p) {
      const attncore::detail::ScopedDecodePlan scoped(plans[p]);
      double best = 1e30;
      for (int n = 0; n < c.repeat; ++n) {
        std::uint64_t evicted = 0;
        for (const std::uint64_t word : eviction) evicted += word;
        sink = sink + static_cast<float>(evicted);
        const auto t0 = std::chrono::steady_clock::now();
        if (c.specs[p] == "read") {
          const auto* floats = reinterpret_cast<const float*>(k_data);
          const std::size_t n_floats = bytes / 4 / 128 * 128;
#if defined(__x86_64__)
          sink = sink + (avx512 ? sum_avx512(floats, n_floats) : sum_plain(floats, n_floats));
#else
          sink = sink + sum_plain(floats, n_floats);
#endif
        } else {
          attncore::forward_kvcache_into(q.view(), cache(k_data), cache(v_data), seqs, out.view(),
                                         std::nullopt, options, attncore::Backend::flash);
        }
        const auto t1 = std::chrono::steady_clock::now();
        best = std::min(best, std::chrono::duration<double>(t1 - t0).count());
      }
      gbs[p].push_back(static_cast<double>(bytes) / best / 1e9);
    }
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const char* dtype = c.dtype == DType::f32 ? "f32" : c.dtype == DType::bf16 ? "bf16" : "f16";
  std::printf(
      "decode_plans: %s %s, Hq=%lld Hkv=%lld Lk=%lld D=%lld, %d thread(s), K/V %.1f MB, "
      "%d rounds of the plans in turn, best of %d calls each, %lld MiB read before each\n",
      dtype, c.layout.c_str(), static_cast<long long>(c.heads_q), static_cast<long long>(hkv),
      static_cast<long long>(l), static_cast<long long>(d), c.threads, bytes / 1e6, c.rounds,
      c.repeat, static_cast<long long>(c.evict_mib));
  std::printf("%-48s %10s %12s %14s\n", "plan", "GB/s", "ratio", "ratio range");
  for (std::size_t p = 0; p < plans.size(); ++p) {
    std::vector<double> ratio;
    for (int r = 0; r < c.rounds; ++r) ratio.push_back(gbs[p][r] / gbs[0][r]);
    const auto [lo, hi] = std::minmax_element(ratio.begin(), ratio.end());
    std::printf("%-48s %10.2f %12.3f %7.2f-%.2f\n", c.specs[p].c_str(), median(gbs[p]),
                median(ratio), *lo, *hi);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Config config = parse(argc, argv);
  try {
    return run(config);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "decode_plans: %s\n", e.what());
    return 1;
  }
}
