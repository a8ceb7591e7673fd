// Thread counts (attncore/options.h, attncore/info.h): one maximum, kMaxThreads, for
// Options::num_threads and ATTNCORE_NUM_THREADS, past which a call is an InvalidArgument error
// (the variable's name in the message) and no thread is started; and a default that follows
// the calling thread's CPU affinity mask.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
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

namespace attncore {
namespace {

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

std::string invalid_argument_message(const std::function<void()>& call) {
  try {
    call();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

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
  for (const char* bad : {"1025", "100000", "0", "-2", "abc", "4x", "99999999999999999999"}) {
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
