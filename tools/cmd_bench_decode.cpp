// attncore bench --decode: decode (one query row per sequence) over a KV cache, as K/V bytes
// read per second against the read bandwidth probe (attncore::measure_read_bandwidth_gbs)
// measured in the same run, and as GFLOP/s against the FMA peak (attncore::measure_fma_peak_gflops)
// with the ceiling that binds first: reading K/V at the probe's bandwidth or computing at the
// peak (GQA reads each K/V byte for several query heads). Each pass measures the probe (1 and 2
// threads) and the 1-thread peak, and then every point
// once (flash on 1 and 2 threads, math on 1), best of --repeat calls each, every call after a
// read, on as many threads, that evicts K and V from the caches (decode reads each layer's cache
// once per token, with the other layers' between); a point's figures are the medians over the
// passes, so that the machine's drift (other load, clock changes) hits the probe and the kernels
// alike. A pass times the layouts of a shape (dtype, Hkv, B, Lk) one after another on each
// backend and thread count, and each paged point is also given against its dense
// [B, L, Hkv, D] twin as the median of the passes' ratios of the two.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "attncore/attncore.h"
#include "attncore/kvcache.h"
#include "cache_fill.h"
#include "commands.h"
#include "flags.h"
#include "inputs.h"
#include "json.h"
#include "progress.h"
#include "run_config.h"

namespace attncore_tools {

using attncore::Backend;
using attncore::DType;
using attncore::TensorView;

namespace {

// Where a cache's rows lie: [B, Hkv, L, D] (one head's keys contiguous) or the engines' and
// flash-attn's [B, L, Hkv, D] (one position's heads contiguous; a key row every Hkv * D).
enum class Layout { bhld, blhd };
const char* name_of(Layout l) { return l == Layout::bhld ? "BHLD" : "BLHD"; }

struct DecodePoint {
  std::int64_t batch, heads_kv, seqlen_k;
  DType dtype;
  Layout layout;
  std::int64_t page_size = 0;  // > 0: a paged cache, pages [pages, page_size, Hkv, D] (BLHD)
  std::int64_t seqlen_q = 1;   // > 1: chunked prefill (lower-right causal: the chunk's last
                               // Lq slots of the cache are its own keys)
  double kv_bytes() const {
    return 2.0 * static_cast<double>(batch * heads_kv * seqlen_k) * kHeadDim *
           static_cast<double>(attncore::size_of(dtype));
  }
  // Floating-point operations (DESIGN.md section 5: 4 * B * Hq * Lq * Lk * D; every key visible
  // to a decode row).
  double flops() const {
    return 4.0 * static_cast<double>(batch * kHeadsQ * seqlen_q * seqlen_k) * kHeadDim;
  }
  // A page of K (or of V): page_size key rows of Hkv heads.
  std::int64_t page_bytes() const {
    return page_size * heads_kv * kHeadDim * static_cast<std::int64_t>(attncore::size_of(dtype));
  }
  // The layout column: BHLD, BLHD, or pN for pages of N. (Appended, not "p" + string: GCC
  // 12 warned, wrongly, of an overlapping memcpy in that operator+ [-Wrestrict].)
  std::string layout_name() const {
    if (page_size == 0) return name_of(layout);
    std::string name = "p";
    name += std::to_string(page_size);
    return name;
  }
  static constexpr std::int64_t kHeadsQ = 32, kHeadDim = 128;
};

// What each pass times of a point: flash on 1 and 2 threads, math on 1.
struct Timed {
  Backend backend;
  int threads;
};
constexpr Timed kTimed[] = {{Backend::flash, 1}, {Backend::flash, 2}, {Backend::math, 1}};
// With --threads N (1 or 2): only flash on N threads.
bool timed(const BenchConfig& bc, const Timed& how) {
  return bc.run.threads == 0 || (how.backend == Backend::flash && how.threads == bc.run.threads);
}

// Bytes read between timed calls to evict K and V from the caches: twice the L3 that sysconf
// reports (on AMD EPYC the whole socket's, 256 MiB on the Zen 3 of the README, where a core's own
// is its CCD's 32 MiB; 480 MiB on an Intel Xeon with AVX512-FP16 and AMX), 64 MiB to 1 GiB. (A
// point's K/V smaller than the cache, such as GQA Hkv = 8 16-bit at Lk = 4096, 16.8 MB, could
// otherwise be served from it to every call after the first: on that Xeon, 1 thread, 7 rounds of
// calls in turn, bf16 [B, Hkv, L, D] read 14.3 GB/s with nothing read between calls, 9.1 after
// 256 MiB and 7.6 after 1 GiB.)
std::int64_t eviction_bytes() {
  std::int64_t cache = 0;
#ifdef _SC_LEVEL3_CACHE_SIZE
  cache = std::max<std::int64_t>(0, sysconf(_SC_LEVEL3_CACHE_SIZE));
#endif
  return std::clamp<std::int64_t>(2 * cache, std::int64_t{64} << 20, std::int64_t{1} << 30);
}

// Memory for the largest point's K and V, 2 MiB aligned with the huge-page hint the probe's
// buffer gets too (the kernels and the probe see the same kind of pages), filled once
// (fill_cache_halves: every dtype's view of the bytes finite). And the buffer whose read evicts
// them (evict_caches).
struct CacheMemory {
  struct Free {
    void operator()(void* p) const { std::free(p); }
  };
  std::unique_ptr<void, Free> data;
  std::vector<std::uint64_t> eviction;
  explicit CacheMemory(double bytes) {
    constexpr std::size_t kAlign = 2u << 20;
    const std::size_t size = (static_cast<std::size_t>(bytes) + kAlign - 1) / kAlign * kAlign;
    const std::int64_t evicting = eviction_bytes();
    require_memory("bench --decode",
                   "the caches of the largest point (--max-kv-gib) and the buffer that evicts them",
                   bytes + static_cast<double>(evicting));
    eviction.assign(static_cast<std::size_t>(evicting) / sizeof(std::uint64_t), 1);
    data.reset(std::aligned_alloc(kAlign, std::max(size, kAlign)));
    if (!data) throw attncore::OutOfMemory("bench --decode: cannot allocate the caches");
    madvise(data.get(), size, MADV_HUGEPAGE);
    fill_cache_halves(data.get(), size);
  }
  // Reads the eviction buffer on `threads` threads, each all of it (the calls that follow run on
  // as many, whose cores' own caches it must reach; each thread's sum kept in a volatile of its
  // own, so that no read is optimized away).
  void evict_caches(int threads) const {
    auto read = [this] {
      std::uint64_t sum = 0;
      for (const std::uint64_t word : eviction) sum += word;
      const volatile std::uint64_t kept = sum;
      static_cast<void>(kept);
    };
    std::vector<std::thread> others;
    for (int t = 1; t < threads; ++t) others.emplace_back(read);
    read();
    for (std::thread& other : others) other.join();
  }
};

// The point's views over the memory and the call, timed: best of `repeat` calls, each after
// evict_caches on the call's thread count, in seconds.
double time_point(const DecodePoint& pt, const CacheMemory& memory, const Timed& how,
                  int repeat) {
  void* const kv = memory.data.get();
  const std::int64_t b = pt.batch, hkv = pt.heads_kv, l = pt.seqlen_k;
  const std::int64_t hq = DecodePoint::kHeadsQ, d = DecodePoint::kHeadDim;
  const std::int64_t elements = b * hkv * l * d;
  char* k_data = static_cast<char*>(kv);
  char* v_data = k_data + elements * static_cast<std::int64_t>(attncore::size_of(pt.dtype));
  // Paged: B * Lk / page_size pages (Lk a multiple of the page size), handed to the sequences in
  // a fixed shuffled order (pages of one sequence are not adjacent in memory, as in a serving
  // engine's pool after some traffic).
  const std::int64_t ps = pt.page_size, per_seq = ps > 0 ? l / ps : 0, pages = b * per_seq;
  auto cache = [&](char* data) {
    if (ps > 0) return TensorView::contiguous(data, pt.dtype, {pages, ps, hkv, d}).transposed(1, 2);
    return pt.layout == Layout::bhld
               ? TensorView::contiguous(data, pt.dtype, {b, hkv, l, d})
               : TensorView::contiguous(data, pt.dtype, {b, l, hkv, d}).transposed(1, 2);
  };
  attncore::Tensor table(DType::i32, {b, std::max<std::int64_t>(per_seq, 1)});
  if (ps > 0) {
    auto* t = static_cast<std::int32_t*>(table.view().data);
    for (std::int64_t n = 0; n < pages; ++n) t[n] = static_cast<std::int32_t>(n);
    std::uint32_t state = 777;
    for (std::int64_t n = pages - 1; n > 0; --n) {  // Fisher-Yates, fixed seed
      state = state * 1664525u + 1013904223u;
      std::swap(t[n], t[static_cast<std::int64_t>(state % static_cast<std::uint32_t>(n + 1))]);
    }
  }
  const std::int64_t lq = pt.seqlen_q;
  attncore::Tensor q(pt.dtype, {b, hq, lq, d});
  attncore::Tensor out(pt.dtype, {b, hq, lq, d});
  attncore::Tensor seqlens(DType::i32, {b});
  auto* lens = static_cast<std::int32_t*>(seqlens.view().data);
  std::fill_n(lens, b, static_cast<std::int32_t>(l));
  std::memcpy(q.view().data, k_data,
              static_cast<std::size_t>(b * hq * lq * d) * attncore::size_of(pt.dtype));
  attncore::KvCacheSeqs seqs;
  seqs.cache_seqlens = seqlens.view();
  if (ps > 0) seqs.block_table = table.view();
  attncore::Options options;
  options.num_threads = how.threads;
  if (lq > 1) options.causal = attncore::Causal::lower_right;
  double best = 1e30;
  for (int n = 0; n < repeat; ++n) {
    memory.evict_caches(how.threads);
    const auto t0 = std::chrono::steady_clock::now();
    attncore::forward_kvcache_into(q.view(), cache(k_data), cache(v_data), seqs, out.view(),
                                   std::nullopt, options, how.backend);
    const auto t1 = std::chrono::steady_clock::now();
    best = std::min(best, std::chrono::duration<double>(t1 - t0).count());
  }
  return best;
}

// The points of the sweep, in the order of its table: Hkv 32 and 8; f32, bf16, f16; dense in
// both layouts, then paged (BLHD rows) at page sizes 16 and 256; B; Lk. quick: B = 1 and Lk
// 4096 and 16384 only.
std::vector<DecodePoint> sweep_points(bool quick) {
  const std::vector<std::int64_t> batches =
      quick ? std::vector<std::int64_t>{1} : std::vector<std::int64_t>{1, 4, 16, 64};
  const std::vector<std::int64_t> lengths =
      quick ? std::vector<std::int64_t>{4096, 16384}
            : std::vector<std::int64_t>{1024, 4096, 16384, 32768};
  const std::pair<Layout, std::int64_t> kinds[] = {
      {Layout::bhld, 0}, {Layout::blhd, 0}, {Layout::blhd, 16}, {Layout::blhd, 256}};
  std::vector<DecodePoint> points;
  for (std::int64_t hkv : {std::int64_t{32}, std::int64_t{8}}) {
    for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
      for (const auto& [layout, page_size] : kinds) {
        for (std::int64_t b : batches) {
          for (std::int64_t l : lengths) points.push_back({b, hkv, l, dtype, layout, page_size});
        }
      }
    }
  }
  return points;
}

// A point's fields as --points names them: dtype, layout (BHLD, BLHD or pN) and Hkv; an item of
// --points holds one value or * (any) for each.
using PointFields = std::array<std::string, 3>;
constexpr const char* kPointFieldNames[] = {"dtype", "layout", "Hkv"};
PointFields fields_of(const DecodePoint& pt) {
  return {std::string(attncore::name_of(pt.dtype)), pt.layout_name(), std::to_string(pt.heads_kv)};
}

// --points: comma-separated dtype:layout:Hkv items, each field a value some point of the sweep
// has, or *. Bad usage names the first bad item.
std::vector<PointFields> parse_points(const std::string& points) {
  std::vector<std::string> values[3];  // each field's values over the sweep, in its order
  for (const DecodePoint& pt : sweep_points(false)) {
    const PointFields f = fields_of(pt);
    for (std::size_t n = 0; n < 3; ++n) {
      if (std::find(values[n].begin(), values[n].end(), f[n]) == values[n].end()) {
        values[n].push_back(f[n]);
      }
    }
  }
  std::vector<PointFields> items;
  for (const std::string_view item : split(points, ',')) {
    const std::vector<std::string_view> fields = split(item, ':');
    const std::string quoted = "'" + std::string(item) + "'";
    if (fields.size() != 3) {
      throw UsageError{"--points: item " + quoted + " is not dtype:layout:Hkv (fields=" +
                       std::to_string(fields.size()) + ", expected 3)"};
    }
    PointFields f;
    for (std::size_t n = 0; n < 3; ++n) {
      f[n] = fields[n];
      if (f[n] == "*" || std::find(values[n].begin(), values[n].end(), f[n]) != values[n].end()) {
        continue;
      }
      std::string choices;
      for (const std::string& v : values[n]) choices += v + ", ";
      throw UsageError{"--points: item " + quoted + " has an unknown " + kPointFieldNames[n] +
                       " (" + kPointFieldNames[n] + "='" + f[n] + "', expected one of " + choices +
                       "or *)"};
    }
    items.push_back(f);
  }
  return items;
}

// Whether the items of --points keep a point (no items: all are kept).
bool kept(const std::vector<PointFields>& items, const DecodePoint& pt) {
  const PointFields f = fields_of(pt);
  auto matches = [&](const PointFields& item) {
    for (std::size_t n = 0; n < 3; ++n) {
      if (item[n] != "*" && item[n] != f[n]) return false;
    }
    return true;
  };
  return items.empty() || std::any_of(items.begin(), items.end(), matches);
}

// Whether two points have one shape: dtype, Hkv, B and Lk (their layouts may differ).
bool same_shape(const DecodePoint& a, const DecodePoint& b) {
  return a.dtype == b.dtype && a.heads_kv == b.heads_kv && a.batch == b.batch &&
         a.seqlen_k == b.seqlen_k;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

}  // namespace

void check_decode_points(const std::string& points) { parse_points(points); }

int bench_decode(const BenchConfig& bc) {
  const std::vector<PointFields> wanted =
      bc.sweep.points.empty() ? std::vector<PointFields>{} : parse_points(bc.sweep.points);
  const double max_bytes = bc.sweep.max_kv_gib * 1024.0 * 1024.0 * 1024.0;
  std::vector<DecodePoint> points, skipped;
  for (const DecodePoint& pt : sweep_points(bc.sweep.quick)) {
    if (kept(wanted, pt)) (pt.kv_bytes() > max_bytes ? skipped : points).push_back(pt);
  }
  // (At least the chunked prefill's cache, f32 B=1 Hkv=8 Lk=4096, and its queries.)
  double largest = 2.0 * 8 * 4096 * 128 * 4;
  for (const DecodePoint& pt : points) largest = std::max(largest, pt.kv_bytes());
  const bool json_to_stdout = bc.sweep.json == "-";
  std::FILE* const table = json_to_stdout ? stderr : stdout;
  Progress progress;
  progress.show("filling the caches ...");
  const CacheMemory memory(largest);
  const int passes = std::max(1, bc.sweep.passes);
  std::vector<double> probe1, probe2, peak1;
  // The probe over pieces of each paged point's page bytes (of K, or of V), shuffled: what the
  // memory gives a read of such pages at best, 1 thread.
  std::vector<std::int64_t> page_bytes;
  for (const DecodePoint& pt : points) {
    if (pt.page_size > 0 && pt.page_bytes() % 512 == 0 &&
        std::find(page_bytes.begin(), page_bytes.end(), pt.page_bytes()) == page_bytes.end()) {
      page_bytes.push_back(pt.page_bytes());
    }
  }
  std::sort(page_bytes.begin(), page_bytes.end());
  std::vector<std::vector<double>> pieces(page_bytes.size());
  std::vector<std::vector<double>> seconds(points.size() * std::size(kTimed));
  // Each pass times the layouts of a shape one after another on each backend and thread count
  // (the table lists them layout by layout), so that a paged point and its dense twin see the
  // machine alike: the points in the order of their shapes' first points in the sweep.
  std::vector<std::size_t> first_of(points.size()), order(points.size());
  for (std::size_t n = 0; n < points.size(); ++n) {
    first_of[n] = n;
    while (!same_shape(points[first_of[n]], points[n])) ++first_of[n];
    order[n] = n;
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t x, std::size_t y) { return first_of[x] < first_of[y]; });
  for (int pass = 0; pass < passes; ++pass) {
    progress.showf("pass %d/%d: read bandwidth probe ...", pass + 1, passes);
    probe1.push_back(attncore::measure_read_bandwidth_gbs(1));
    probe2.push_back(attncore::measure_read_bandwidth_gbs(2));
    peak1.push_back(attncore::measure_fma_peak_gflops(1));
    for (std::size_t n = 0; n < page_bytes.size(); ++n) {
      pieces[n].push_back(attncore::measure_read_bandwidth_gbs(1, page_bytes[n]));
    }
    for (std::size_t first = 0, end = 0; first < order.size(); first = end) {
      end = first + 1;
      while (end < order.size() && first_of[order[end]] == first_of[order[first]]) ++end;
      progress.showf("pass %d/%d: points %zu-%zu/%zu ...", pass + 1, passes, first + 1, end,
                     points.size());
      for (std::size_t t = 0; t < std::size(kTimed); ++t) {
        if (!timed(bc, kTimed[t])) continue;
        for (std::size_t i = first; i < end; ++i) {
          const std::size_t n = order[i];
          seconds[n * std::size(kTimed) + t].push_back(
              time_point(points[n], memory, kTimed[t], bc.run.repeat));
        }
      }
    }
  }
  progress.clear();
  const double bw1 = median(probe1), bw2 = median(probe2), fma1 = median(peak1);
  std::fprintf(table,
               "attncore %s bench --decode: Hq=%lld, D=Dv=%lld, Lq=1, no mask, simd %s; median of "
               "%d interleaved passes, best of %d calls each\n"
               "read bandwidth probe (same passes): %.1f GB/s on 1 thread, %.1f on 2; f32 FMA peak "
               "%.1f GFLOP/s on 1 thread\n"
               "K/V GB/s = bytes of K and V read once / time; %%probe: of the probe on the same "
               "thread count; GFLOP/s = 4 B Hq Lk D / time, %%fma: of the 1-thread peak; binds: "
               "the ceiling reached first at the probe's bandwidth (bw) or the peak (fma)\n"
               "lay: BHLD = [B, Hkv, L, D]; BLHD = [B, L, Hkv, D]; pN = paged, page size N, pages "
               "[pages, N, Hkv, D] in a shuffled order\n\n",
               attncore::version(), static_cast<long long>(DecodePoint::kHeadsQ),
               static_cast<long long>(DecodePoint::kHeadDim), attncore::simd_target().c_str(),
               passes, bc.run.repeat, bw1, bw2, fma1);
  std::fprintf(table, "%-5s %-4s %3s %3s %6s %9s | %8s %6s %7s %5s %5s | %8s %6s | %8s %6s\n",
               "dtype", "lay", "Hkv", "B", "Lk", "K/V MB", "flash 1T", "%probe", "GFLOP/s", "%fma",
               "binds", "flash 2T", "%probe", "math 1T", "%probe");
  std::vector<std::string> items;
  for (std::size_t n = 0; n < points.size(); ++n) {
    const DecodePoint& pt = points[n];
    double gbs[std::size(kTimed)];
    for (std::size_t t = 0; t < std::size(kTimed); ++t) {
      const std::vector<double>& s = seconds[n * std::size(kTimed) + t];
      gbs[t] = s.empty() ? 0.0 : pt.kv_bytes() / median(s) * 1e-9;  // (not timed: 0)
    }
    const double of[] = {gbs[0] / bw1, gbs[1] / bw2, gbs[2] / bw1};
    const double intensity = pt.flops() / pt.kv_bytes();  // FLOPs per byte of K/V
    const double gflops = gbs[0] * intensity;
    const char* binds = bw1 * intensity < fma1 ? "bw" : "fma";
    const std::string kind = pt.layout_name();
    std::fprintf(
        table,
        "%-5s %-4s %3lld %3lld %6lld %9.1f | %8.1f %5.0f%% %7.1f %4.0f%% %5s | %8.1f %5.0f%% | "
        "%8.1f %5.0f%%\n",
        std::string(attncore::name_of(pt.dtype)).c_str(), kind.c_str(),
        static_cast<long long>(pt.heads_kv), static_cast<long long>(pt.batch),
        static_cast<long long>(pt.seqlen_k), pt.kv_bytes() / 1e6, gbs[0], 100 * of[0], gflops,
        100 * gflops / fma1, binds, gbs[1], 100 * of[1], gbs[2], 100 * of[2]);
    JsonObject j;
    j.add("dtype", attncore::name_of(pt.dtype));
    j.add("layout", name_of(pt.layout));
    j.add("page_size", pt.page_size);
    j.add("heads_kv", pt.heads_kv);
    j.add("batch", pt.batch);
    j.add("seqlen_k", pt.seqlen_k);
    j.add("kv_bytes", pt.kv_bytes());
    j.add("flash_1t_gbs", gbs[0]);
    j.add("flash_1t_of_probe", of[0]);
    j.add("flash_1t_gflops", gflops);
    j.add("flash_1t_of_fma_peak", gflops / fma1);
    j.add("binds", binds);
    j.add("flash_2t_gbs", gbs[1]);
    j.add("flash_2t_of_probe", of[1]);
    j.add("math_1t_gbs", gbs[2]);
    j.add("math_1t_of_probe", of[2]);
    items.push_back(j.str());
  }
  if (!page_bytes.empty()) {
    std::fprintf(table,
                 "\nread probe over pages: the probe's loop over pieces of a page's bytes (of K or "
                 "V) in a shuffled order, 1 thread, same passes\n%10s %8s %14s\n",
                 "page KiB", "GB/s", "of the probe");
    for (std::size_t n = 0; n < page_bytes.size(); ++n) {
      const double gbs = median(pieces[n]);
      std::fprintf(table, "%10lld %8.1f %13.0f%%\n", static_cast<long long>(page_bytes[n] / 1024),
                   gbs, 100 * gbs / bw1);
      JsonObject j;
      j.add("probe_piece_bytes", page_bytes[n]);
      j.add("probe_1t_gbs", gbs);
      j.add("of_probe", gbs / bw1);
      items.push_back(j.str());
    }
  }
  // Paged decode against its dense twin ([B, L, Hkv, D] of the same shape, timed with it in each
  // pass): the median over the passes of dense time / paged time, flash on each thread count
  // timed.
  bool titled = false;
  for (std::size_t n = 0; n < points.size(); ++n) {
    const DecodePoint& pt = points[n];
    if (pt.page_size == 0) continue;
    std::size_t twin = points.size();
    for (std::size_t m = 0; m < points.size(); ++m) {
      const DecodePoint& o = points[m];
      if (o.page_size == 0 && o.layout == Layout::blhd && same_shape(o, pt)) twin = m;
    }
    if (twin == points.size()) continue;  // (--points left the dense twin out)
    double ratio[2] = {0.0, 0.0};         // flash 1T, 2T (0: not timed)
    for (std::size_t t = 0; t < 2; ++t) {
      const std::vector<double>& paged = seconds[n * std::size(kTimed) + t];
      const std::vector<double>& dense = seconds[twin * std::size(kTimed) + t];
      std::vector<double> per_pass;
      for (std::size_t i = 0; i < paged.size() && i < dense.size(); ++i) {
        per_pass.push_back(dense[i] / paged[i]);
      }
      ratio[t] = median(per_pass);
    }
    if (!titled) {
      std::fprintf(table,
                   "\npaged decode against dense [B, L, Hkv, D] (same dtype, Hkv, B, Lk; timed "
                   "in the same group of each pass): median of the passes' dense time / paged "
                   "time\n%-5s %-5s %3s %3s %6s %12s %12s\n",
                   "dtype", "pages", "Hkv", "B", "Lk", "flash 1T", "flash 2T");
      titled = true;
    }
    auto cell = [](double r) {
      return r > 0.0 ? format("%11.2fx", r) : std::string(11, ' ') + "-";
    };
    std::fprintf(table, "%-5s %-5lld %3lld %3lld %6lld %s %s\n",
                 std::string(attncore::name_of(pt.dtype)).c_str(),
                 static_cast<long long>(pt.page_size), static_cast<long long>(pt.heads_kv),
                 static_cast<long long>(pt.batch), static_cast<long long>(pt.seqlen_k),
                 cell(ratio[0]).c_str(), cell(ratio[1]).c_str());
    JsonObject j;
    j.add("dtype", attncore::name_of(pt.dtype));
    j.add("decode_page_size", pt.page_size);
    j.add("heads_kv", pt.heads_kv);
    j.add("batch", pt.batch);
    j.add("seqlen_k", pt.seqlen_k);
    j.add("paged_over_dense_1t", ratio[0]);
    j.add("paged_over_dense_2t", ratio[1]);
    items.push_back(j.str());
  }
  // Chunked prefill over pages against the dense cache, flash on 1 thread, interleaved (not
  // with --points).
  if (bc.sweep.points.empty()) {
    constexpr std::int64_t kChunk = 256, kContext = 4096;
    std::fprintf(table,
                 "\nchunked prefill: B=1 Hq=32 Hkv=8 D=128, Lq=%lld new rows at the end of Lk=%lld "
                 "(lower-right causal), flash 1 thread; paged / dense = dense time / paged time "
                 "(equal work)\n%-5s %-5s %10s %10s %13s\n",
                 static_cast<long long>(kChunk), static_cast<long long>(kContext), "dtype", "pages",
                 "dense ms", "paged ms", "paged/dense");
    for (DType dtype : {DType::f32, DType::bf16}) {
      for (std::int64_t page_size : {std::int64_t{16}, std::int64_t{256}}) {
        const DecodePoint dense{1, 8, kContext, dtype, Layout::blhd, 0, kChunk};
        DecodePoint paged = dense;
        paged.page_size = page_size;
        std::vector<double> dense_s, paged_s;
        for (int pass = 0; pass < passes; ++pass) {
          dense_s.push_back(time_point(dense, memory, kTimed[0], bc.run.repeat));
          paged_s.push_back(time_point(paged, memory, kTimed[0], bc.run.repeat));
        }
        std::fprintf(table, "%-5s %-5lld %10.3f %10.3f %12.2fx\n",
                     std::string(attncore::name_of(dtype)).c_str(),
                     static_cast<long long>(page_size), median(dense_s) * 1e3,
                     median(paged_s) * 1e3, median(dense_s) / median(paged_s));
        JsonObject j;
        j.add("dtype", attncore::name_of(dtype));
        j.add("prefill_page_size", page_size);
        j.add("dense_seconds", median(dense_s));
        j.add("paged_seconds", median(paged_s));
        j.add("paged_over_dense", median(dense_s) / median(paged_s));
        items.push_back(j.str());
      }
    }
  }
  std::string list;
  for (const DecodePoint& pt : skipped) {
    list += "\n  " + std::string(attncore::name_of(pt.dtype)) + " " + pt.layout_name() +
            " Hkv=" + std::to_string(pt.heads_kv) + " B=" + std::to_string(pt.batch) +
            " Lk=" + std::to_string(pt.seqlen_k) +
            format(" (%.1f GiB)", pt.kv_bytes() / (1024.0 * 1024.0 * 1024.0));
  }
  if (!skipped.empty()) {
    std::fprintf(table, "\nskipped (K/V over %d GiB, --max-kv-gib):%s\n", bc.sweep.max_kv_gib,
                 list.c_str());
  }
  if (!bc.sweep.json.empty()) {
    JsonObject top;
    top.add("version", attncore::version());
    top.add("bench", "decode");
    top.add("heads_q", DecodePoint::kHeadsQ);
    top.add("head_dim", DecodePoint::kHeadDim);
    top.add("simd", attncore::simd_target());
    top.add("passes", passes);
    top.add("repeat", bc.run.repeat);
    top.add("probe_1t_gbs", bw1);
    top.add("probe_2t_gbs", bw2);
    top.add("fma_peak_1t_gflops", fma1);
    top.add("skipped", static_cast<std::int64_t>(skipped.size()));
    top.add_json("rows", json_array(items));
    write_json_object(bc.sweep.json, top);
  }
  return kExitOk;
}

}  // namespace attncore_tools
