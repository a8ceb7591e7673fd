// What attncore knows about the machine: CPU identification and features (cpuid + xgetbv on
// x86-64), the default thread count and a measured f32 FMA peak.
#include "core/cpu_info.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <latch>
#include <optional>
#include <sstream>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#if defined(__unix__)
#include <sys/resource.h>
#include <unistd.h>
#endif
#if defined(__linux__)
#include <sched.h>
#endif

#include "attncore/error.h"
#include "attncore/info.h"
#include "attncore/options.h"
#include "attncore/version.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace attncore {
namespace {

// `s` without leading and trailing spaces (cpuid pads the brand string).
std::string trim(const std::string& s) {
  const auto first = s.find_first_not_of(' ');
  if (first == std::string::npos) return {};
  const auto last = s.find_last_not_of(' ');
  return s.substr(first, last - first + 1);
}

#if defined(__x86_64__)

struct CpuidRegs {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
};

// cpuid(leaf, subleaf); all zero when the leaf is above the CPU's maximum.
CpuidRegs cpuid(unsigned leaf, unsigned subleaf = 0) {
  CpuidRegs r;
  const unsigned max_leaf = __get_cpuid_max(leaf & 0x80000000u, nullptr);
  if (max_leaf == 0 || leaf > max_leaf) return r;
  __cpuid_count(leaf, subleaf, r.eax, r.ebx, r.ecx, r.edx);
  return r;
}

// XCR0: which register states the OS saves on context switch. Only valid when OSXSAVE is set.
std::uint64_t xgetbv0() {
  std::uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<std::uint64_t>(hi) << 32) | lo;
}

bool bit(unsigned reg, int b) { return ((reg >> b) & 1u) != 0; }

// Feature names follow GCC's target attribute / __builtin_cpu_supports spelling.
void detect_x86(CpuInfo& info) {
  const CpuidRegs leaf0 = cpuid(0);
  char vendor[13] = {};
  std::memcpy(vendor + 0, &leaf0.ebx, 4);
  std::memcpy(vendor + 4, &leaf0.edx, 4);
  std::memcpy(vendor + 8, &leaf0.ecx, 4);
  info.vendor = vendor;

  if (cpuid(0x80000000u).eax >= 0x80000004u) {
    char brand[49] = {};
    for (unsigned i = 0; i < 3; ++i) {
      const CpuidRegs r = cpuid(0x80000002u + i);
      std::memcpy(brand + 16 * i + 0, &r.eax, 4);
      std::memcpy(brand + 16 * i + 4, &r.ebx, 4);
      std::memcpy(brand + 16 * i + 8, &r.ecx, 4);
      std::memcpy(brand + 16 * i + 12, &r.edx, 4);
    }
    info.brand = trim(brand);
  }

  const CpuidRegs l1 = cpuid(1);
  // The display family and model (Intel SDM, CPUID leaf 1: the extended fields count from
  // family 0xF; the extended model also for family 6).
  const int base_family = static_cast<int>((l1.eax >> 8) & 0xF);
  const int base_model = static_cast<int>((l1.eax >> 4) & 0xF);
  info.family =
      base_family == 0xF ? base_family + static_cast<int>((l1.eax >> 20) & 0xFF) : base_family;
  info.model = base_family == 0xF || base_family == 6
                   ? base_model + (static_cast<int>((l1.eax >> 16) & 0xF) << 4)
                   : base_model;
  const CpuidRegs l7 = cpuid(7, 0);
  const CpuidRegs l7s1 = cpuid(7, 1);

  // The OS must save a register file before its instructions are usable (Intel SDM 13.3):
  // XCR0 bits 1-2 = SSE and AVX (ymm) state, 5-7 = AVX-512 opmask and zmm state,
  // 17-18 = AMX tile config and tile data.
  const bool osxsave = bit(l1.ecx, 27);
  const std::uint64_t xcr0 = osxsave ? xgetbv0() : 0;
  const bool os_avx = (xcr0 & 0x6u) == 0x6u;
  const bool os_avx512 = os_avx && (xcr0 & 0xE0u) == 0xE0u;
  const bool os_amx = (xcr0 & 0x60000u) == 0x60000u;

  auto add = [&](const char* name, bool present) {
    if (present) info.features.emplace_back(name);
  };
  add("sse4.2", bit(l1.ecx, 20));
  add("avx", os_avx && bit(l1.ecx, 28));
  add("avx2", os_avx && bit(l7.ebx, 5));
  add("fma", os_avx && bit(l1.ecx, 12));
  add("f16c", os_avx && bit(l1.ecx, 29));
  add("avxvnni", os_avx && bit(l7s1.eax, 4));
  add("avx512f", os_avx512 && bit(l7.ebx, 16));
  add("avx512dq", os_avx512 && bit(l7.ebx, 17));
  add("avx512cd", os_avx512 && bit(l7.ebx, 28));
  add("avx512bw", os_avx512 && bit(l7.ebx, 30));
  add("avx512vl", os_avx512 && bit(l7.ebx, 31));
  add("avx512vnni", os_avx512 && bit(l7.ecx, 11));
  add("avx512bf16", os_avx512 && bit(l7s1.eax, 5));
  add("avx512fp16", os_avx512 && bit(l7.edx, 23));
  add("amx-tile", os_amx && bit(l7.edx, 24));
  add("amx-bf16", os_amx && bit(l7.edx, 22));
  add("amx-int8", os_amx && bit(l7.edx, 25));
}

#endif  // __x86_64__

// ---------------------------------------------------------------------------------------------
// FMA probe. Each kernel runs `iters` iterations of independent multiply-add chains held in
// registers (acc = acc * mul + add) and returns their sum, so nothing can be optimised away.
// mul < 1 keeps every chain bounded (it converges to add / (1 - mul)) and away from denormals.
//
// Chain counts: an FMA has 4 cycles latency and 2 pipes on Zen 4/5 and recent Intel cores, so
// at least 8 chains are needed to fill them; 16 zmm chains use 16 of the 32 zmm registers, 14
// ymm chains plus the two constants fill all 16 ymm registers without spilling. Measured on
// the measuring machines: 114 GFLOP/s per Zen 4 core with either width (its 512-bit FMA is
// double-pumped), 224-235 per Zen 5 core with zmm (full-width FMA).

// The chains stay in registers only when the probe is optimised: keep it so in -O0 (Debug)
// builds too, where it would otherwise measure stack round trips (~20 GFLOP/s instead of 224).
#if defined(__GNUC__) && !defined(__clang__)
#define ATTNCORE_PROBE_OPTIMIZE __attribute__((optimize("O2")))
#else
#define ATTNCORE_PROBE_OPTIMIZE
#endif
// A probe compiled for an instruction set the build does not target; called only after cpuid.
#define ATTNCORE_PROBE_TARGET(isa) __attribute__((target(isa))) ATTNCORE_PROBE_OPTIMIZE

constexpr float kMul = 0.999999f;  // chain multiplier, < 1 so chains stay bounded
constexpr float kAdd = 1e-6f;      // chain addend

#if defined(__x86_64__)

constexpr int kZmmChains = 16;
constexpr double kZmmFlopsPerIter = kZmmChains * 16 * 2;  // chains x 16 lanes x (mul + add)

ATTNCORE_PROBE_TARGET("avx512f") float fma_probe_zmm(std::int64_t iters, float seed) {
  const __m512 mul = _mm512_set1_ps(kMul), add = _mm512_set1_ps(kAdd);
  __m512 c[kZmmChains];
  for (int i = 0; i < kZmmChains; ++i) c[i] = _mm512_set1_ps(seed + static_cast<float>(i));
  for (std::int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 16
    for (int i = 0; i < kZmmChains; ++i) c[i] = _mm512_fmadd_ps(c[i], mul, add);
  }
  alignas(64) float lanes[16];
  float sum = 0;
  for (int i = 0; i < kZmmChains; ++i) {
    _mm512_store_ps(lanes, c[i]);
    for (float x : lanes) sum += x;
  }
  return sum;
}

constexpr int kYmmChains = 14;
constexpr double kYmmFlopsPerIter = kYmmChains * 8 * 2;  // chains x 8 lanes x (mul + add)

ATTNCORE_PROBE_TARGET("avx2,fma") float fma_probe_ymm(std::int64_t iters, float seed) {
  const __m256 mul = _mm256_set1_ps(kMul), add = _mm256_set1_ps(kAdd);
  __m256 c[kYmmChains];
  for (int i = 0; i < kYmmChains; ++i) c[i] = _mm256_set1_ps(seed + static_cast<float>(i));
  for (std::int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 14
    for (int i = 0; i < kYmmChains; ++i) c[i] = _mm256_fmadd_ps(c[i], mul, add);
  }
  alignas(32) float lanes[8];
  float sum = 0;
  for (int i = 0; i < kYmmChains; ++i) {
    _mm256_store_ps(lanes, c[i]);
    for (float x : lanes) sum += x;
  }
  return sum;
}

#endif  // __x86_64__

// Portable fallback: 16 scalar chains (the compiler may vectorise them; either way it is a
// lower bound for what the vector unit can do).
constexpr int kScalarChains = 16;
constexpr double kScalarFlopsPerIter = kScalarChains * 2.0;

ATTNCORE_PROBE_OPTIMIZE float fma_probe_scalar(std::int64_t iters, float seed) {
  float c[kScalarChains];
  for (int i = 0; i < kScalarChains; ++i) c[i] = seed + static_cast<float>(i);
  for (std::int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 16
    for (float& x : c) x = x * kMul + kAdd;
  }
  float sum = 0;
  for (float x : c) sum += x;
  return sum;
}

struct FmaProbe {
  float (*kernel)(std::int64_t iters, float seed);
  double flops_per_iter;
};

// The widest FMA unit the CPU and OS support.
FmaProbe pick_fma_probe() {
#if defined(__x86_64__)
  const CpuInfo info = cpu_info();
  if (info.has("avx512f")) return {fma_probe_zmm, kZmmFlopsPerIter};
  if (info.has("avx2") && info.has("fma")) return {fma_probe_ymm, kYmmFlopsPerIter};
#endif
  return {fma_probe_scalar, kScalarFlopsPerIter};
}

// Keeps every probe result alive: a store the compiler must perform.
std::atomic<float> g_probe_sink{0.0f};

// Seconds for `threads` threads each running `iters` iterations, released together; measured
// from the earliest thread's start to the latest thread's end. Throws std::system_error when a
// thread cannot be started (the ones already started are released and joined first).
double time_fma_run(const FmaProbe& probe, int threads, std::int64_t iters) {
  using Clock = std::chrono::steady_clock;
  std::vector<Clock::time_point> start(static_cast<std::size_t>(threads));
  std::vector<Clock::time_point> stop(static_cast<std::size_t>(threads));
  std::latch go(1);
  std::atomic<bool> abort{false};
  auto body = [&](int t) {
    go.wait();
    if (abort.load()) return;
    start[static_cast<std::size_t>(t)] = Clock::now();
    const float r = probe.kernel(iters, static_cast<float>(t));
    stop[static_cast<std::size_t>(t)] = Clock::now();
    g_probe_sink.store(r, std::memory_order_relaxed);
  };
  std::vector<std::thread> pool;
  try {
    pool.reserve(static_cast<std::size_t>(threads - 1));
    for (int t = 1; t < threads; ++t) pool.emplace_back(body, t);
  } catch (...) {
    abort.store(true);
    go.count_down();
    for (auto& th : pool) th.join();
    throw;
  }
  go.count_down();
  body(0);  // the calling thread is thread 0
  for (auto& th : pool) th.join();
  const auto first = *std::min_element(start.begin(), start.end());
  const auto last = *std::max_element(stop.begin(), stop.end());
  return std::chrono::duration<double>(last - first).count();
}

}  // namespace

bool CpuInfo::has(const std::string& feature) const {
  return std::find(features.begin(), features.end(), feature) != features.end();
}

CpuInfo cpu_info() {
  CpuInfo info;
  info.logical_cores = std::max(1u, std::thread::hardware_concurrency());
#if defined(__x86_64__)
  detect_x86(info);
#elif defined(__aarch64__)
  info.features.emplace_back("neon");  // Advanced SIMD is mandatory on AArch64
#endif
  return info;
}

const char* version() { return ATTNCORE_VERSION; }

int default_num_threads() { return detail::default_threads("default_num_threads"); }

// threads <= 0 means default_num_threads(). Each run lasts about kRunSeconds; the best of
// kRuns is reported (the best run is the least disturbed one).
double measure_fma_peak_gflops(int threads) {
  constexpr double kRunSeconds = 0.06;  // long enough for clock ramp-up and timers
  constexpr int kRuns = 3;              // best of 3 (one thread's peak varies ~5% run to run)
  return detail::measure_fma_peak_gflops(threads, kRunSeconds, kRuns);
}

namespace detail {

int default_threads(const char* op) {
  if (const char* env = std::getenv("ATTNCORE_NUM_THREADS"); env != nullptr && *env != '\0') {
    char* end = nullptr;
    errno = 0;
    const long n = std::strtol(env, &end, 10);  // (leading blanks skipped; trailing ones too)
    const bool read = end != env;
    while (std::isspace(static_cast<unsigned char>(*end))) ++end;
    if (errno == 0 && read && *end == '\0' && n >= 1 && n <= kMaxThreads) {
      return static_cast<int>(n);
    }
    std::string value(env);
    if (value.size() > 40) value = value.substr(0, 40) + "...";
    throw InvalidArgument(std::string(op) +
                          ": ATTNCORE_NUM_THREADS is invalid (ATTNCORE_NUM_THREADS=" + value +
                          ", expected an integer from 1 to " + std::to_string(kMaxThreads) +
                          "); set it to a thread count or unset it");
  }
  return affinity_threads();
}

int affinity_threads() {
#if defined(__linux__)
  // The calling thread's mask, read at each call (a syscall of well under a microsecond): it
  // may change while the process runs. Masks of more than 1024 CPUs need a larger set.
  for (int cpus = CPU_SETSIZE; cpus <= (1 << 16); cpus *= 2) {
    cpu_set_t* set = CPU_ALLOC(cpus);
    if (set == nullptr) break;
    const std::size_t bytes = CPU_ALLOC_SIZE(cpus);
    CPU_ZERO_S(bytes, set);
    const int rc = sched_getaffinity(0, bytes, set);
    const int count = rc == 0 ? CPU_COUNT_S(bytes, set) : 0;
    CPU_FREE(set);
    if (rc == 0 && count > 0) return std::min(count, kMaxThreads);
    if (rc != 0 && errno != EINVAL) break;  // EINVAL: the kernel's mask is larger
  }
#endif
  return machine_threads();
}

int machine_threads() {
  // Read once: glibc reads /sys for it (several microseconds).
  static const int cores =
      std::min(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())), kMaxThreads);
  return cores;
}

double measure_fma_peak_gflops(int threads, double run_seconds, int runs) {
  constexpr std::int64_t kCalibrationIters = 1 << 16;  // ~0.3 ms with zmm at 3.5 GHz
  if (threads <= 0) threads = default_num_threads();
  if (threads > kMaxThreads) {
    throw InvalidArgument(
        "measure_fma_peak_gflops: threads is too large (threads=" + std::to_string(threads) +
        ", expected <= " + std::to_string(kMaxThreads) + ")");
  }
  try {
    const FmaProbe probe = pick_fma_probe();
    // Calibrate on one thread, doubling until a run is long enough to time reliably (1 ms).
    std::int64_t iters = kCalibrationIters;
    double seconds = time_fma_run(probe, 1, iters);
    while (seconds < 1e-3) {
      iters *= 2;
      seconds = time_fma_run(probe, 1, iters);
    }
    iters = std::max<std::int64_t>(1, static_cast<std::int64_t>(iters * run_seconds / seconds));
    double best = 0;
    for (int run = 0; run < runs; ++run) {
      const double s = time_fma_run(probe, threads, iters);
      const double gflops = probe.flops_per_iter * static_cast<double>(iters) * threads / s * 1e-9;
      best = std::max(best, gflops);
    }
    return best;
  } catch (const std::system_error& e) {
    throw Error("measure_fma_peak_gflops: threads cannot be started (threads=" +
                std::to_string(threads) + ", expected what the system allows; " + e.what() + ")");
  }
}

double physical_memory_bytes() {
#if defined(__unix__)
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0) return static_cast<double>(pages) * static_cast<double>(page);
#endif
  return 0x1p62;
}

namespace {

// The first line of a file, or "" when it cannot be read.
std::string first_line(const std::string& path) {
  std::ifstream file(path);
  std::string line;
  std::getline(file, line);
  return line;
}

// A limit file's value in bytes; infinity for "max", for no file, and for cgroup v1's
// "unlimited" (the largest page multiple below 2^63).
double limit_value(const std::string& text) {
  if (text.empty() || text == "max") return HUGE_VAL;
  char* end = nullptr;
  errno = 0;
  const unsigned long long v = std::strtoull(text.c_str(), &end, 10);
  if (errno != 0 || end == text.c_str() || v >= (1ull << 62)) return HUGE_VAL;
  return static_cast<double>(v);
}

// The smallest limit in `file` of directory `dir` and of its ancestors up to `root`.
double smallest_up_the_tree(const std::string& root, std::string path, const char* file) {
  double smallest = HUGE_VAL;
  for (;;) {
    smallest = std::min(smallest, limit_value(first_line(root + path + "/" + file)));
    if (path.empty() || path == "/") return smallest;
    const std::size_t slash = path.find_last_of('/');
    path = slash == std::string::npos ? "" : path.substr(0, slash);
  }
}

}  // namespace

double cgroup_memory_limit_bytes(const std::string& proc_self_cgroup, const std::string& root) {
  double smallest = HUGE_VAL;
  std::istringstream lines(proc_self_cgroup);
  std::string line;
  // Lines "hierarchy:controllers:path": v2 is "0::path"; v1's memory controller names "memory"
  // among its comma-separated controllers.
  while (std::getline(lines, line)) {
    const std::size_t first = line.find(':');
    const std::size_t second = first == std::string::npos ? first : line.find(':', first + 1);
    if (second == std::string::npos) continue;
    const std::string controllers = line.substr(first + 1, second - first - 1);
    std::string path = line.substr(second + 1);
    if (!path.empty() && path.back() == '/') path.pop_back();
    if (controllers.empty()) {
      for (const char* mount : {"", "/unified"}) {
        smallest = std::min(smallest, smallest_up_the_tree(root + mount, path, "memory.max"));
      }
    } else if (("," + controllers + ",").find(",memory,") != std::string::npos) {
      smallest =
          std::min(smallest, smallest_up_the_tree(root + "/memory", path, "memory.limit_in_bytes"));
    }
  }
  return smallest;
}

}  // namespace detail

namespace {

// The physical memory and the cgroup limit, the smaller with its name: read once per process.
MemoryLimit fixed_memory_limit() {
  static const MemoryLimit limit = [] {
    const double physical = detail::physical_memory_bytes();
    std::ifstream file("/proc/self/cgroup");
    std::stringstream text;
    text << file.rdbuf();
    const double cgroup = detail::cgroup_memory_limit_bytes(text.str(), "/sys/fs/cgroup");
    return cgroup < physical ? MemoryLimit{cgroup, "the cgroup limit"}
                             : MemoryLimit{physical, "physical memory"};
  }();
  return limit;
}

}  // namespace

std::optional<MemoryLimit> detail::exceeded_memory_limit(double bytes) {
  if (bytes < kUncheckedAddressSpace && bytes <= fixed_memory_limit().bytes) return std::nullopt;
  const MemoryLimit limit = memory_limit();
  if (bytes <= limit.bytes) return std::nullopt;
  return limit;
}

void detail::refuse_past_memory_limit(double bytes, const std::string& what, const char* remedy) {
  const std::optional<MemoryLimit> limit = exceeded_memory_limit(bytes);
  if (!limit) return;
  char text[160];
  std::snprintf(text, sizeof text, "(bytes=%.4g, expected <= %.4g bytes, %s)", bytes, limit->bytes,
                limit->name);
  throw OutOfMemory(what + " exceeds the memory this process may use " + text + "; " + remedy);
}

MemoryLimit memory_limit() {
  MemoryLimit limit = fixed_memory_limit();
#if defined(__unix__)
  rlimit as{};
  if (getrlimit(RLIMIT_AS, &as) == 0 && as.rlim_cur != RLIM_INFINITY &&
      static_cast<double>(as.rlim_cur) < limit.bytes) {
    limit = {static_cast<double>(as.rlim_cur), "RLIMIT_AS"};
  }
#endif
  return limit;
}

}  // namespace attncore
