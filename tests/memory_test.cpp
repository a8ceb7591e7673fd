// The flash backend's memory: no Lq x Lk buffer. The forward's workspace is O(threads x tile)
// plus one packed kv head: peak resident memory during a call stays within 1.25x the bytes of
// q, k, v and out. The backward's workspace stays within 1.25x one f32 copy of dQ (2 threads).
// A call whose workspace the machine cannot hold is refused before any work.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>

#include "attncore/attncore.h"

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
#if defined(__SANITIZE_ADDRESS__)
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
#if defined(__SANITIZE_ADDRESS__)
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
                                  " backend's workspace exceeds this machine's memory (workspace=",
                              0),
                0u)
          << message;
    } catch (const Unsupported& e) {
      // math: Lq * Lk past BLAS's 32-bit sizes is refused first, also before any work.
      EXPECT_EQ(backend, Backend::math) << e.what();
    }
  }
}

}  // namespace
}  // namespace attncore
