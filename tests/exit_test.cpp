// A process may end while another thread is inside an attention call: `exit_test return` returns
// from main and `exit_test exit` calls std::exit while a detached thread runs calls that use the
// library's thread pool (2 threads, flash and math in turn). Static destruction then runs
// concurrently with the call; the process must exit 0 with no sanitizer report (ctest runs it
// in every build, the ASan/UBSan one included).
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "attncore/attncore.h"

namespace {

void calls_forever() {
  // q, k, v [1, 4, 512, 64]: one call takes tens of milliseconds, so the exit lands inside one.
  attncore::Tensor q(attncore::DType::f32, {1, 4, 512, 64});
  auto* x = q.data_as<float>();
  for (std::int64_t i = 0; i < q.numel(); ++i) x[i] = static_cast<float>(i % 13) * 0.01f;
  attncore::Options options;
  options.num_threads = 2;
  for (int i = 0;; ++i) {
    const auto backend = i % 2 ? attncore::Backend::math : attncore::Backend::flash;
    attncore::forward(q, q, q, options, backend);
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::thread(calls_forever).detach();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  if (argc > 1 && std::strcmp(argv[1], "exit") == 0) std::exit(0);
  return 0;
}
