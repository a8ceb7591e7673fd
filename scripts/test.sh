#!/usr/bin/env bash
# The whole test suite: the release build's tests (C++, program, Python, install), the C++ and
# program tests built with clang (the kernels build with both compilers), then the same tests
# built with AddressSanitizer and UndefinedBehaviorSanitizer, then the libFuzzer target
# (tests/fuzz, ASan + UBSan) for a minute from its seed corpus, copied to a temporary directory
# so that the run leaves the repository as it was (a failing input lands in build/fuzz/).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
for preset in release clang asan; do
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
