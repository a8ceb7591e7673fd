// Uses the installed attncore from C++17: one forward call checked against its closed form, one
// call with bad shapes that must throw attncore::InvalidArgument, the measurements of info.h
// linked, and the version macros of the headers against the version of the library loaded.
//
// With q = 0 every score is 0, so the softmax is uniform over the keys:
// out[b, h, i, :] = mean_j v[b, h / (Hq / Hkv), j, :] and lse[b, h, i] = log(Lk).
#include <attncore/attncore.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

// Built as C++17 by both install tests: a package that forced a newer standard fails here.
static_assert(__cplusplus == 201703L, "the consumer must compile as C++17");

int main() {
  constexpr std::int64_t kB = 2, kHq = 4, kHkv = 2, kLq = 5, kLk = 7, kD = 8;
  attncore::Tensor q(attncore::DType::f32, {kB, kHq, kLq, kD});  // zero-initialised
  attncore::Tensor k(attncore::DType::f32, {kB, kHkv, kLk, kD});
  attncore::Tensor v(attncore::DType::f32, {kB, kHkv, kLk, kD});
  for (std::int64_t i = 0; i < k.numel(); ++i) {
    k.data_as<float>()[i] = static_cast<float>((i * 37) % 11) / 11.0f - 0.5f;
    v.data_as<float>()[i] = static_cast<float>((i * 13) % 17) / 17.0f - 0.5f;
  }
  const attncore::ForwardResult r = attncore::forward(q, k, v);

  double err = 0;
  for (std::int64_t b = 0; b < kB; ++b) {
    for (std::int64_t h = 0; h < kHq; ++h) {
      const std::int64_t hk = h / (kHq / kHkv);
      for (std::int64_t i = 0; i < kLq; ++i) {
        for (std::int64_t d = 0; d < kD; ++d) {
          double mean = 0;
          for (std::int64_t j = 0; j < kLk; ++j) {
            mean += v.data_as<float>()[((b * kHkv + hk) * kLk + j) * kD + d];
          }
          mean /= kLk;
          const float got = r.out.data_as<float>()[((b * kHq + h) * kLq + i) * kD + d];
          err = std::fmax(err, std::fabs(got - mean));
        }
        const float lse = r.lse.data_as<float>()[(b * kHq + h) * kLq + i];
        err = std::fmax(err, std::fabs(lse - std::log(static_cast<double>(kLk))));
      }
    }
  }
  if (!(err < 1e-5)) {
    std::fprintf(stderr, "wrong result: max error %g\n", err);
    return 1;
  }

  attncore::Tensor bad_q(attncore::DType::f32, {kB, 3, kLq, kD});  // 3 % Hkv != 0
  try {
    attncore::forward(bad_q, k, v);
    std::fprintf(stderr, "no error for Hq=3, Hkv=2\n");
    return 1;
  } catch (const attncore::InvalidArgument& e) {
    std::printf("expected error: %s\n", e.what());
  }
  // The measurements of attncore/info.h resolve from the installed library (one was declared
  // without ATTNCORE_API, so a program linking the shared library could not call it).
  // (Stored through volatile, so that the references stay in the program to be linked.)
  double (*volatile fma_peak)(int) = &attncore::measure_fma_peak_gflops;
  double (*volatile read_bandwidth)(int, std::int64_t) = &attncore::measure_read_bandwidth_gbs;
  if (fma_peak == nullptr || read_bandwidth == nullptr) return 1;
  const std::string from_macros = std::to_string(ATTNCORE_VERSION_MAJOR) + "." +
                                  std::to_string(ATTNCORE_VERSION_MINOR) + "." +
                                  std::to_string(ATTNCORE_VERSION_PATCH);
  if (from_macros != ATTNCORE_VERSION || std::strcmp(ATTNCORE_VERSION, attncore::version()) != 0) {
    std::fprintf(stderr, "versions differ: macros %s, ATTNCORE_VERSION %s, library %s\n",
                 from_macros.c_str(), ATTNCORE_VERSION, attncore::version());
    return 1;
  }
  std::printf("attncore %s: ok (max error %g)\n", attncore::version(), err);
  return 0;
}
