// Thread counts (attncore/options.h, attncore/info.h): one maximum, kMaxThreads, for
// Options::num_threads and ATTNCORE_NUM_THREADS, past which a call is an InvalidArgument error
// (the variable's name in the message) and no thread is started; and a default that follows
// the calling thread's CPU affinity mask.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#endif

#include "attncore/attncore.h"
#include "attncore/merge.h"
#include "core/threadpool.h"
#include "testing/tensors.h"

namespace attncore {
namespace {

using test::invalid_argument_message;

// Sets ATTNCORE_NUM_THREADS (or unsets it, for nullopt) for the scope, then restores it.
class EnvThreads {
 public:
  explicit EnvThreads(const std::optional<std::string>& value) {
    if (const char* old = std::getenv("ATTNCORE_NUM_THREADS")) previous_ = old;
    if (value) {
      setenv("ATTNCORE_NUM_THREADS", value->c_str(), 1);
    } else {
      unsetenv("ATTNCORE_NUM_THREADS");
    }
  }
  ~EnvThreads() {
    if (previous_) {
      setenv("ATTNCORE_NUM_THREADS", previous_->c_str(), 1);
    } else {
      unsetenv("ATTNCORE_NUM_THREADS");
    }
  }
  EnvThreads(const EnvThreads&) = delete;
  EnvThreads& operator=(const EnvThreads&) = delete;

 private:
  std::optional<std::string> previous_;
};

// A small valid call: q, k, v [1, 2, 8, 16].
struct Small {
  Tensor q{DType::f32, {1, 2, 8, 16}}, k{DType::f32, {1, 2, 8, 16}}, v{DType::f32, {1, 2, 8, 16}};
};

TEST(Threads, MaximumIsDocumentedValue) { EXPECT_EQ(kMaxThreads, 1024); }

// The maximum itself is accepted (on a call with one task, so no helper starts); one more is
// refused before any work, through every entry point.
TEST(Threads, NumThreadsPastTheMaximumIsInvalid) {
  const Small s;
  Options at_max;
  at_max.num_threads = kMaxThreads;
  EXPECT_NO_THROW((void)forward(s.q, s.k, s.v, at_max, Backend::reference));
  Options past = at_max;
  past.num_threads = kMaxThreads + 1;
  const std::string message =
      invalid_argument_message([&] { (void)forward(s.q, s.k, s.v, past, Backend::flash); });
  EXPECT_EQ(message,
            "forward: num_threads is too large (num_threads=1025, expected <= 1024, "
            "attncore::kMaxThreads)");
  EXPECT_THROW((void)explain_forward(s.q, s.k, s.v, past), InvalidArgument);
  const ForwardResult f = forward(s.q, s.k, s.v, {}, Backend::math);
  EXPECT_THROW((void)backward(f.out, s.q, s.k, s.v, f.out, f.lse, past), InvalidArgument);
  EXPECT_THROW((void)measure_fma_peak_gflops(kMaxThreads + 1), InvalidArgument);
  EXPECT_EQ(invalid_argument_message([&] {
              (void)merge_attention_states(f.out, f.lse, f.out, f.lse, kMaxThreads + 1);
            }).rfind("merge_attention_states: num_threads is too large (num_threads=1025", 0),
            0u);
}

// ATTNCORE_NUM_THREADS: an integer from 1 to kMaxThreads; anything else fails the call that
// would read it, naming it (a call with its own num_threads does not read it).
TEST(Threads, EnvironmentVariable) {
  const Small s;
  {
    const EnvThreads env(std::string("3"));
    EXPECT_EQ(default_num_threads(), 3);
    EXPECT_NO_THROW((void)forward(s.q, s.k, s.v));
  }
  {
    const EnvThreads env(std::string(""));  // empty: as unset
    EXPECT_GE(default_num_threads(), 1);
  }
  for (const char* blanks : {" 2", "2 ", " 2\n"}) {  // blanks around the number, as shells leave
    const EnvThreads env(std::string{blanks});
    EXPECT_EQ(default_num_threads(), 2) << '"' << blanks << '"';
  }
  for (const char* bad :
       {"1025", "100000", "0", "-2", "abc", "4x", "99999999999999999999", " ", "2 x"}) {
    const EnvThreads env(std::string{bad});
    const std::string message =
        invalid_argument_message([&] { (void)forward(s.q, s.k, s.v, {}, Backend::reference); });
    EXPECT_EQ(message.rfind(std::string("forward: ATTNCORE_NUM_THREADS is invalid "
                                        "(ATTNCORE_NUM_THREADS=") +
                                bad + ", expected an integer from 1 to 1024)",
                            0),
              0u)
        << message;
    EXPECT_THROW((void)default_num_threads(), InvalidArgument) << bad;
    const ForwardResult f = forward(s.q, s.k, s.v, [] {
      Options o;
      o.num_threads = 2;  // given: the variable is not read
      return o;
    }());
    EXPECT_NE(invalid_argument_message([&] {
                (void)backward(f.out, s.q, s.k, s.v, f.out, f.lse);
              }).find("backward: ATTNCORE_NUM_THREADS is invalid"),
              std::string::npos);
  }
}

// Sets the process-wide thread count for the scope, then restores the previous setting.
class ProcessThreads {
 public:
  explicit ProcessThreads(int n) : previous_(set_num_threads(n)) {}
  ~ProcessThreads() { set_num_threads(previous_); }
  ProcessThreads(const ProcessThreads&) = delete;
  ProcessThreads& operator=(const ProcessThreads&) = delete;

 private:
  int previous_;
};

// docs/design.md section 8's order: Options::num_threads, else set_num_threads, else
// ATTNCORE_NUM_THREADS, else the affinity mask; 0 resets the process-wide setting.
TEST(Threads, ProcessWideSettingTakesItsPlaceInTheOrder) {
  const EnvThreads env("5");
  ASSERT_EQ(set_num_threads(0), 0);  // no setting at the start
  EXPECT_EQ(get_num_threads(), 5);
  {
    const ProcessThreads setting(3);
    EXPECT_EQ(get_num_threads(), 3);
    EXPECT_EQ(detail::resolve_threads(0, "forward"), 3);
    EXPECT_EQ(detail::resolve_threads(2, "forward"), 2);  // the call's own count wins
    EXPECT_EQ(default_num_threads(), 5);                  // the default ignores the setting
    EXPECT_EQ(set_num_threads(kMaxThreads), 3);           // returns the previous setting
    EXPECT_EQ(get_num_threads(), kMaxThreads);
  }
  EXPECT_EQ(get_num_threads(), 5);
  {
    // A set count means ATTNCORE_NUM_THREADS is not read: a bad one no longer fails calls.
    const EnvThreads bad("lots");
    const ProcessThreads setting(2);
    EXPECT_EQ(get_num_threads(), 2);
    const Small s;
    EXPECT_NO_THROW((void)forward(s.q, s.k, s.v));
    set_num_threads(0);
    EXPECT_THROW((void)get_num_threads(), InvalidArgument);
  }
}

TEST(Threads, ProcessWideSettingRefusesCountsOutsideItsRange) {
  const ProcessThreads setting(4);
  for (int bad : {-1, kMaxThreads + 1}) {
    try {
      set_num_threads(bad);
      ADD_FAILURE() << "set_num_threads(" << bad << ") did not throw";
    } catch (const InvalidArgument& e) {
      EXPECT_EQ(std::string(e.what()),
                "set_num_threads: num_threads is out of range (num_threads=" +
                    std::to_string(bad) +
                    ", expected 0 to 1024, attncore::kMaxThreads; 0 = default)");
    }
    EXPECT_EQ(get_num_threads(), 4);  // unchanged
  }
}

// Calls on the process-wide count give the same bits as on one thread (every backend).
TEST(Threads, ProcessWideSettingKeepsResults) {
  Tensor q(DType::f32, {1, 2, 300, 32}), k(DType::f32, {1, 2, 300, 32}),
      v(DType::f32, {1, 2, 300, 32});
  for (Tensor* t : {&q, &k, &v}) {
    float* x = t->data_as<float>();
    for (std::int64_t i = 0; i < t->numel(); ++i) x[i] = static_cast<float>(i * 37 % 101 - 50) / 50;
  }
  for (Backend b : {Backend::reference, Backend::math, Backend::flash}) {
    Options one;
    one.num_threads = 1;
    const ForwardResult expected = forward(q, k, v, one, b);
    const ProcessThreads setting(2);
    const ForwardResult got = forward(q, k, v, {}, b);
    EXPECT_EQ(std::memcmp(expected.out.data(), got.out.data(), expected.out.numel() * 4), 0)
        << name_of(b);
  }
}

#if defined(__linux__)
// The default follows the calling thread's affinity mask (as `taskset -c 0 program` sets it):
// a thread pinned to one CPU gets 1, to two CPUs 2.
TEST(Threads, DefaultFollowsTheAffinityMask) {
  const EnvThreads env(std::nullopt);
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  ASSERT_EQ(sched_getaffinity(0, sizeof allowed, &allowed), 0);
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &allowed)) cpus.push_back(c);
  }
  ASSERT_FALSE(cpus.empty());
  EXPECT_EQ(default_num_threads(), static_cast<int>(std::min<std::size_t>(cpus.size(), 1024)));
  for (std::size_t n : {std::size_t{1}, std::size_t{2}}) {
    if (n > cpus.size()) continue;
    int seen = -1;
    std::thread pinned([&] {
      cpu_set_t set;
      CPU_ZERO(&set);
      for (std::size_t i = 0; i < n; ++i) CPU_SET(cpus[i], &set);
      if (sched_setaffinity(0, sizeof set, &set) != 0) return;  // 0: the calling thread
      seen = default_num_threads();
      // A call on the default thread count runs there, with the same result as on one thread.
      const Small s;
      (void)forward(s.q, s.k, s.v);
    });
    pinned.join();
    EXPECT_EQ(seen, static_cast<int>(n));
  }
}
#endif

}  // namespace
}  // namespace attncore
