// The flash backend's memory: no Lq x Lk buffer. The forward's workspace is O(threads x tile)
// plus one packed kv head: peak resident memory during a call stays within 1.25x the bytes of
// q, k, v and out. The backward's workspace stays within 1.25x one f32 copy of dQ (2 threads).
// A call whose workspace, plus the outputs it allocates, exceeds the memory the process may use
// (the smallest of physical memory, the cgroup limit and RLIMIT_AS) is refused before anything
// is allocated or written, naming the bytes.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "attncore/attncore.h"
#include "attncore/kvcache.h"
#include "core/cpu_info.h"
#include "core/large_memory.h"  // ATTNCORE_UNDER_ASAN (GCC and clang)
#include "testing/tensors.h"

namespace attncore {
namespace {

// A field of /proc/self/status in KiB ("VmRSS", "VmHWM"), or -1 where there is none.
std::int64_t status_kib(const std::string& field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::stoll(line.substr(field.size() + 1));
  }
  return -1;
}

// Resets the peak (VmHWM) to the current RSS (Linux: write 5 to /proc/self/clear_refs).
bool reset_peak() {
  std::ofstream clear("/proc/self/clear_refs");
  clear << "5";
  return static_cast<bool>(clear);
}

TEST(Memory, FlashPeakWithinAQuarterOfItsOperands) {
#if defined(ATTNCORE_UNDER_ASAN)
  GTEST_SKIP() << "AddressSanitizer's shadow memory and quarantine are part of the peak";
#endif
  if (status_kib("VmHWM") < 0 || !reset_peak()) GTEST_SKIP() << "no /proc/self/status peak here";
  const std::int64_t b = 1, h = 16, l = 2048, d = 128;  // f32: 16 MiB per operand
  const std::int64_t rss_before = status_kib("VmRSS");
  Tensor q(DType::f32, {b, h, l, d}), k(DType::f32, {b, h, l, d}), v(DType::f32, {b, h, l, d});
  Tensor out(DType::f32, {b, h, l, d});  // Tensor zero-fills: every page is resident
  for (Tensor* t : {&q, &k, &v}) {
    for (std::int64_t e = 0; e < t->numel(); ++e)
      t->data_as<float>()[e] = static_cast<float>(e % 7) * 0.1f;
  }
  const double operand_kib = 4.0 * static_cast<double>(b * h * l * d) * 4.0 / 1024.0;
  ASSERT_TRUE(reset_peak());
  forward_into(q, k, v, out, std::nullopt, {}, Backend::flash);
  const std::int64_t peak = status_kib("VmHWM");
  EXPECT_LE(static_cast<double>(peak - rss_before), 1.25 * operand_kib)
      << "peak " << peak << " KiB, before the operands " << rss_before << " KiB, operands "
      << operand_kib << " KiB";
  // The measurement sees allocations: one materialised Lq x Lk score matrix (16 MiB, zeroed)
  // raises the peak by its size.
  ASSERT_TRUE(reset_peak());
  const std::int64_t rss_now = status_kib("VmRSS");
  const Tensor scores(DType::f32, {l, l});  // [Lq, Lk]
  EXPECT_GE(status_kib("VmHWM") - rss_now, 15 * 1024);
}

// MQA (8 query heads on one kv head), where per-group workspace would be largest: per thread
// one head's packed q, dO and f32 dQ (3 MiB), plus the f32 dK, dV sums of the kv head (2 MiB).
TEST(Memory, FlashBackwardWorkspaceWithinOneCopyOfDq) {
#if defined(ATTNCORE_UNDER_ASAN)
  GTEST_SKIP() << "AddressSanitizer's shadow memory and quarantine are part of the peak";
#endif
  if (status_kib("VmHWM") < 0 || !reset_peak()) GTEST_SKIP() << "no /proc/self/status peak here";
  const std::int64_t b = 1, hq = 8, hkv = 1, l = 2048, d = 128;  // f32: 8 MiB per q-sized tensor
  auto filled = [](std::initializer_list<std::int64_t> shape, int seed) {
    Tensor t(DType::f32, shape);
    for (std::int64_t e = 0; e < t.numel(); ++e)
      t.data_as<float>()[e] = static_cast<float>((e * 7 + seed) % 11) * 0.05f - 0.25f;
    return t;
  };
  const Tensor q = filled({b, hq, l, d}, 1), k = filled({b, hkv, l, d}, 2),
               v = filled({b, hkv, l, d}, 3), dout = filled({b, hq, l, d}, 4);
  Options options;
  options.num_threads = 2;
  const ForwardResult f = forward(q, k, v, options, Backend::flash);
  Tensor dq(DType::f32, {b, hq, l, d}), dk(DType::f32, {b, hkv, l, d}),
      dv(DType::f32, {b, hkv, l, d});  // zero-filled: resident before the call
  const double dq_kib = static_cast<double>(b * hq * l * d) * 4.0 / 1024.0;
  const std::int64_t rss_before = status_kib("VmRSS");
  ASSERT_TRUE(reset_peak());
  backward_into(dout, q, k, v, f.out, f.lse, dq, dk, dv, std::nullopt, options, Backend::flash);
  const std::int64_t peak = status_kib("VmHWM");
  EXPECT_LE(static_cast<double>(peak - rss_before), 1.25 * dq_kib)
      << "peak " << peak << " KiB, before the call " << rss_before << " KiB, dQ " << dq_kib
      << " KiB";
}

// GQA decode over a cache with more query heads per kv head than two items read in place (20 >
// 2 x 8), not split: its one work item packs each key tile just before its use, so no panel of
// the group's K and V (128 MiB for these 2^18 keys, a stride-0 view holding one row) is made.
TEST(Memory, CacheDecodeOfWideGroupsPacksNoPanel) {
#if defined(ATTNCORE_UNDER_ASAN)
  GTEST_SKIP() << "AddressSanitizer's shadow memory and quarantine are part of the peak";
#endif
  if (status_kib("VmHWM") < 0 || !reset_peak()) GTEST_SKIP() << "no /proc/self/status peak here";
  const std::int64_t keys = std::int64_t{1} << 18, d = 64, hq = 20;
  std::vector<float> row(static_cast<std::size_t>(d), 0.25f);
  // [B, Hkv, capacity, D] over one row of memory: every key the same.
  const TensorView kv = TensorView::strided(row.data(), DType::f32, {1, 1, keys, d}, {0, 0, 0, 1});
  Tensor q(DType::f32, {1, hq, 1, d}), out(DType::f32, {1, hq, 1, d});
  Tensor lengths(DType::i32, {1});
  lengths.data_as<std::int32_t>()[0] = static_cast<std::int32_t>(keys);
  KvCacheSeqs seqs;
  seqs.cache_seqlens = lengths.view();
  Options options;
  options.num_threads = 2;
  options.num_splits = 1;
  forward_kvcache_into(q, kv, kv, seqs, out, std::nullopt, options, Backend::flash);  // warm
  const std::int64_t rss_before = status_kib("VmRSS");
  ASSERT_TRUE(reset_peak());
  forward_kvcache_into(q, kv, kv, seqs, out, std::nullopt, options, Backend::flash);
  const double panel_kib = static_cast<double>(keys * 2 * d) * 4.0 / 1024.0;
  EXPECT_LE(static_cast<double>(status_kib("VmHWM") - rss_before), panel_kib / 16)
      << "a panel of K and V is " << panel_kib << " KiB";
  EXPECT_EQ(out.data_as<float>()[0], 0.25f);  // the mean of equal rows
}

// Stride-0 views make absurd sizes cheap to build: K and V of 2^36 keys, one element each. Each
// backend's workspace grows with Lk (flash: a packed panel; math: the scores; reference: a
// row of scores), and each is refused up front with OutOfMemory naming the bytes.
TEST(Memory, WorkspacesPastTheMachineAreRefusedUpFront) {
  float one = 0.5f;
  const std::int64_t lk = std::int64_t{1} << 36;
  const TensorView q = TensorView::strided(&one, DType::f32, {1, 1, 64, 64}, {0, 0, 0, 1});
  const TensorView kv = TensorView::strided(&one, DType::f32, {1, 1, lk, 64}, {0, 0, 0, 1});
  Tensor out(DType::f32, {1, 1, 64, 64});
  for (Backend backend : {Backend::flash, Backend::math, Backend::reference}) {
    try {
      forward_into(q, kv, kv, out, std::nullopt, {}, backend);
      ADD_FAILURE() << name_of(backend) << ": no error";
    } catch (const OutOfMemory& e) {
      const std::string message = e.what();
      EXPECT_EQ(message.rfind("forward: the " + std::string(name_of(backend)) +
                                  " backend's workspace exceeds the memory this process may use "
                                  "(workspace=",
                              0),
                0u)
          << message;
    } catch (const Unsupported& e) {
      // math: Lq * Lk past BLAS's 32-bit sizes is refused first, also before any work.
      EXPECT_EQ(backend, Backend::math) << e.what();
    }
  }
}

// The allocating forms add the outputs they allocate to the workspace and refuse the call before
// allocating anything when the sum exceeds the memory: stride-0 queries of 2^36 rows give an
// out of 16 TiB (backward: dq), a packed batch of 2^30 query rows one of 256 GiB.
TEST(Memory, AllocatedOutputsPastTheMachineAreRefusedUpFront) {
  float one = 0.5f;
  const std::int64_t lq = std::int64_t{1} << 36;
  const TensorView q = TensorView::strided(&one, DType::f32, {1, 1, lq, 64}, {0, 0, 0, 1});
  const TensorView lse = TensorView::strided(&one, DType::f32, {1, 1, lq}, {0, 0, 0});
  const Tensor kv(DType::f32, {1, 1, 4, 64});
  const std::string forward_prefix = "forward: the outputs and the ";
  const std::string exceed =
      " backend's workspace exceed the memory this process may use (outputs=";
  for (Backend backend : {Backend::automatic, Backend::reference, Backend::flash}) {
    SCOPED_TRACE(std::string(name_of(backend)));
    try {
      (void)forward(q, kv, kv, {}, backend);
      ADD_FAILURE() << "no error";
    } catch (const OutOfMemory& e) {
      const std::string message = e.what();
      EXPECT_EQ(message.rfind(forward_prefix, 0), 0u) << message;
      EXPECT_NE(message.find(exceed + "1.787e+13 bytes"), std::string::npos) << message;
    }
    try {
      (void)backward(q, q, kv, kv, q, lse, {}, backend);
      ADD_FAILURE() << "no error";
    } catch (const OutOfMemory& e) {
      const std::string message = e.what();
      EXPECT_EQ(message.rfind("backward: the outputs and the ", 0), 0u) << message;
      EXPECT_NE(message.find(exceed + "1.759e+13 bytes"), std::string::npos) << message;
    }
  }
  // Packed: q [2^30, 1, 64] against one key.
  const std::int64_t rows = std::int64_t{1} << 30;
  const TensorView packed_q = TensorView::strided(&one, DType::f32, {rows, 1, 64}, {0, 0, 1});
  const Tensor packed_kv(DType::f32, {1, 1, 64});
  const std::int32_t cu_q[] = {0, static_cast<std::int32_t>(rows)}, cu_k[] = {0, 1};
  VarlenSeqs seqs;
  seqs.cu_seqlens_q = TensorView::contiguous(const_cast<std::int32_t*>(cu_q), DType::i32, {2});
  seqs.cu_seqlens_k = TensorView::contiguous(const_cast<std::int32_t*>(cu_k), DType::i32, {2});
  seqs.max_seqlen_q = rows;
  seqs.max_seqlen_k = 1;
  for (Backend backend : {Backend::reference, Backend::math, Backend::flash}) {
    SCOPED_TRACE(std::string(name_of(backend)));
    try {
      (void)forward_varlen(packed_q, packed_kv, packed_kv, seqs, {}, backend);
      ADD_FAILURE() << "no error";
    } catch (const OutOfMemory& e) {
      const std::string message = e.what();
      EXPECT_EQ(message.rfind(forward_prefix + std::string(name_of(backend)) + exceed, 0), 0u)
          << message;
    }
  }
}

#if !defined(ATTNCORE_UNDER_ASAN)
// A field of /proc/self/status in KiB.
std::int64_t vm_size_bytes() { return status_kib("VmSize") * 1024; }

// The address-space limit the RLIMIT_AS tests set: what the process holds plus `headroom`
// bytes; 0 where it cannot be lowered to that here (no /proc/self/status, or a lower limit
// already).
std::int64_t address_limit(std::int64_t headroom) {
  rlimit saved{};
  if (status_kib("VmSize") < 0 || getrlimit(RLIMIT_AS, &saved) != 0) return 0;
  const std::int64_t limit = vm_size_bytes() + headroom;
  if (saved.rlim_cur != RLIM_INFINITY && static_cast<std::int64_t>(saved.rlim_cur) < limit) {
    return 0;
  }
  return limit;
}

// What `call` throws (its what(); "" when it returns) under RLIMIT_AS `limit`, restored after.
std::string error_under(std::int64_t limit, const std::function<void()>& call) {
  rlimit saved{};
  EXPECT_EQ(getrlimit(RLIMIT_AS, &saved), 0);
  rlimit lowered = saved;
  lowered.rlim_cur = static_cast<rlim_t>(limit);
  EXPECT_EQ(setrlimit(RLIMIT_AS, &lowered), 0);
  std::string message;
  try {
    call();
  } catch (const std::exception& e) {
    message = e.what();
  }
  EXPECT_EQ(setrlimit(RLIMIT_AS, &saved), 0);
  return message;
}

// RLIMIT_AS below the machine's memory is the limit a call is held to: a reference workspace
// 1 GiB past it is refused, naming it.
TEST(Memory, AddressSpaceLimitIsTheLimit) {
  const std::int64_t limit = address_limit(std::int64_t{512} << 20);
  if (limit == 0) GTEST_SKIP() << "RLIMIT_AS cannot be lowered here";
  float one = 0.5f;
  // The reference backend's forward workspace on one thread: 8 * (Lk + Dv) bytes.
  const std::int64_t lk = (limit + (std::int64_t{1} << 30)) / 8;
  const TensorView kv = TensorView::strided(&one, DType::f32, {1, 1, lk, 64}, {0, 0, 0, 1});
  const Tensor q(DType::f32, {1, 1, 1, 64});
  Tensor out(DType::f32, {1, 1, 1, 64});
  Options options;
  options.num_threads = 1;
  const std::string message = error_under(
      limit, [&] { forward_into(q, kv, kv, out, std::nullopt, options, Backend::reference); });
  EXPECT_EQ(message.rfind("forward: the reference backend's workspace exceeds the memory this "
                          "process may use (workspace=",
                          0),
            0u)
      << message;
  EXPECT_NE(message.find(" bytes, RLIMIT_AS); reduce the sizes or the thread count"),
            std::string::npos)
      << message;
}

// Requests under kUncheckedAddressSpace are held to physical memory and the cgroup limit only
// (no getrlimit), larger ones to RLIMIT_AS as well: under an RLIMIT_AS of 512 KiB (below what
// the process holds), 1 MiB - 1 byte is not refused, 1 MiB is, naming RLIMIT_AS.
TEST(Memory, SmallRequestsSkipTheAddressSpaceLimit) {
  if (address_limit(std::int64_t{1} << 20) == 0) GTEST_SKIP() << "RLIMIT_AS cannot be lowered here";
  // The physical memory and the cgroup limit are read once per process: before the limit drops.
  (void)detail::exceeded_memory_limit(detail::kUncheckedAddressSpace);
  bool below = true, at = false;
  const char* name = "";
  error_under(std::int64_t{512} << 10, [&] {  // (nothing allocated while the limit is low)
    below = detail::exceeded_memory_limit(detail::kUncheckedAddressSpace - 1).has_value();
    const std::optional<MemoryLimit> exceeded =
        detail::exceeded_memory_limit(detail::kUncheckedAddressSpace);
    at = exceeded.has_value();
    if (exceeded) name = exceeded->name;
  });
  EXPECT_FALSE(below);
  EXPECT_TRUE(at);
  EXPECT_STREQ(name, "RLIMIT_AS");
}

// A backward with a bias gradient counts the f64 sums every backend keeps for it (8 bytes per
// element of the mask's shape) with the backend's workspace: under RLIMIT_AS 1 GiB above what
// the process holds, a mask whose sums pass that limit (its dbias, given, half as large, mapped
// but never touched), which flash allocated midway through the call (out of memory while
// running, outputs incomplete); now refused before anything is written.
TEST(Memory, BiasGradientSumsAreCountedUpFront) {
  const std::int64_t limit = address_limit(std::int64_t{1} << 30);
  if (limit == 0) GTEST_SKIP() << "RLIMIT_AS cannot be lowered here";
  // lq * lk elements of the mask: their f64 sums 8 MiB past the limit, dbias half of them.
  const std::int64_t lk = 16384, d = 8, lq = (limit / 8 + (std::int64_t{1} << 20)) / lk + 1;
  float zero = 0, row[8] = {};
  const TensorView q = TensorView::strided(row, DType::f32, {1, 1, lq, d}, {0, 0, 0, 1});
  const TensorView kv = TensorView::strided(row, DType::f32, {1, 1, lk, d}, {0, 0, 0, 1});
  const TensorView lse = TensorView::strided(&zero, DType::f32, {1, 1, lq}, {0, 0, 0});
  Tensor dq(DType::f32, {1, 1, lq, d}), dk(DType::f32, {1, 1, lk, d}),
      dv(DType::f32, {1, 1, lk, d});
  Tensor dbias(DType::f32, {1, 1, lq, lk});  // (untouched: mapped, not resident)
  Options o;
  o.mask = TensorView::strided(&zero, DType::f32, {1, 1, lq, lk}, {0, 0, 0, 0});
  o.compute_dbias = true;
  o.num_threads = 1;
  const std::string message = error_under(limit, [&] {
    backward_into(q, q, kv, kv, q, lse, dq, dk, dv, dbias.view(), o, Backend::flash);
  });
  EXPECT_EQ(message.rfind("backward: the flash backend's workspace exceeds the memory this "
                          "process may use (workspace=",
                          0),
            0u)
      << message;
}

// A process that may start no more threads (RLIMIT_AS 4 MiB above what it holds: no room for a
// thread's stack) still runs a call asked for 4 threads, on the threads the pool has (its
// std::system_error escaped the call before). Its own process (ctest runs each test alone) has
// started no worker yet; in a run of every test the pool may already hold them.
TEST(Memory, CallsRunWhereNoThreadCanStart) {
  const Tensor q(DType::f32, {1, 4, 64, 32});
  Tensor out(DType::f32, {1, 4, 64, 32});
  Options o;
  o.num_threads = 4;
  const std::int64_t limit = address_limit(std::int64_t{4} << 20);
  if (limit == 0) GTEST_SKIP() << "RLIMIT_AS cannot be lowered here";
  EXPECT_EQ(
      error_under(limit, [&] { forward_into(q, q, q, out, std::nullopt, o, Backend::reference); }),
      "");
}
#endif

// The cgroup limit: v2's memory.max and v1's memory.limit_in_bytes over the process's cgroup and
// its ancestors, the smallest one; "max", v1's "unlimited" and missing files are no limit.
TEST(Memory, CgroupLimitOverTheTree) {
  const std::filesystem::path root =
      std::filesystem::temp_directory_path() / ("attncore_cgroup_" + std::to_string(getpid()));
  std::filesystem::remove_all(root);
  auto write = [&](const std::filesystem::path& file, const std::string& text) {
    std::filesystem::create_directories(file.parent_path());
    std::ofstream(file) << text << "\n";
  };
  write(root / "a/b/memory.max", "max");
  write(root / "a/memory.max", "1073741824");
  write(root / "unified/c/memory.max", "2147483648");
  write(root / "memory/x/y/memory.limit_in_bytes", "9223372036854771712");  // v1: unlimited
  write(root / "memory/x/memory.limit_in_bytes", "4294967296");
  const std::string r = root.string();
  EXPECT_EQ(detail::cgroup_memory_limit_bytes("0::/a/b\n", r), 1073741824.0);
  EXPECT_EQ(detail::cgroup_memory_limit_bytes("0::/c\n", r), 2147483648.0);  // hybrid mount
  EXPECT_EQ(detail::cgroup_memory_limit_bytes("5:cpu,memory:/x/y\n0::/\n", r), 4294967296.0);
  EXPECT_EQ(detail::cgroup_memory_limit_bytes("4:memory:/x/y\n0::/a/b\n", r), 1073741824.0);
  EXPECT_TRUE(std::isinf(detail::cgroup_memory_limit_bytes("0::/\n", r)));
  EXPECT_TRUE(std::isinf(detail::cgroup_memory_limit_bytes("3:cpu:/a\n", r)));
  EXPECT_TRUE(std::isinf(detail::cgroup_memory_limit_bytes("", r)));
  std::filesystem::remove_all(root);
  // This process's limit is at most its physical memory, and positive.
  const MemoryLimit limit = memory_limit();
  EXPECT_GT(limit.bytes, 0);
  EXPECT_LE(limit.bytes, detail::physical_memory_bytes());
}

// The read probe over pieces (as decode reads a paged cache's pages): a piece size that is not a
// positive multiple of 512, or more than a thread's part of the buffer, is refused before any
// work, naming it; a valid one reads (0 = the whole part in order).
TEST(Memory, ReadProbeOverPiecesChecksThePieceSize) {
  EXPECT_EQ(test::invalid_argument_message([] { (void)measure_read_bandwidth_gbs(1, -512); }),
            "measure_read_bandwidth_gbs: piece_bytes is negative (piece_bytes=-512, expected 0 or "
            "a positive multiple of 512)");
  for (std::int64_t bad : {std::int64_t{100}, std::int64_t{513}, std::int64_t{1000}}) {
    EXPECT_EQ(test::invalid_argument_message([&] { (void)measure_read_bandwidth_gbs(1, bad); }),
              "measure_read_bandwidth_gbs: piece_bytes is not a multiple of 512 (piece_bytes=" +
                  std::to_string(bad) + ", expected 0 or a positive multiple of 512)");
  }
  EXPECT_EQ(test::invalid_argument_message(
                [] { (void)measure_read_bandwidth_gbs(1, std::int64_t{1} << 40); })
                .rfind("measure_read_bandwidth_gbs: piece_bytes is larger than a thread's part of "
                       "the buffer (piece_bytes=1099511627776, expected <= ",
                       0),
            0u);
  EXPECT_GT(measure_read_bandwidth_gbs(1, 128 * 1024), 0.0);
}

}  // namespace
}  // namespace attncore
