#!/usr/bin/env bash
# The whole test suite: the release build's tests (GCC: C++, program, Python, install), then the
# same C++ and program tests built with clang under AddressSanitizer and UndefinedBehaviorSanitizer
# (less the three longest runs of the program, which the release stage runs: the default sweep,
# `bench --select` and the check that `--explain-choice` reproduces: 6 of the 17.5 minutes its
# tests took, 9 on 2 cores, and the kernels they run are covered there by the C++ tests), then
# the libFuzzer target (tests/fuzz, clang, ASan + UBSan, every SIMD target compiled: so clang
# builds every kernel) for a minute from its seed corpus, copied to a temporary directory so that
# the run leaves the repository as it was (a failing input lands in build/fuzz/). The sanitized
# builds keep line tables only (-g1: file and line in every report; full debug information took
# a quarter longer to compile: 74 s against 59 for the AVX2 kernels). One sanitized build with
# clang stands for a GCC one and an unsanitized clang one: on a Zen 3 (2 cores) those two builds
# and their tests took 1132 s of the suite's 30 minutes, the clang ASan build of the machine's
# SIMD targets and its tests 602 s.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
for preset in release asan; do
  echo "== ${preset}: build"
  cmake --preset "${preset}" >/dev/null
  cmake --build --preset "${preset}"
  echo "== ${preset}: test"
  ctest --preset "${preset}" -j2
done
echo "== fuzz: build"
cmake --preset fuzz >/dev/null
cmake --build --preset fuzz
echo "== fuzz: 60 s from tests/fuzz/corpus"
corpus=$(mktemp -d)
trap 'rm -rf "${corpus}"' EXIT
cp tests/fuzz/corpus/* "${corpus}"
build/fuzz/tests/fuzz/fuzz_attention "${corpus}" -max_total_time=60 -max_len=512 \
  -artifact_prefix=build/fuzz/ -print_final_stats=1
