#!/usr/bin/env bash
# The whole test suite: the release build's tests (C++, program, Python, install), the C++ and
# program tests built with clang (the kernels build with both compilers), then the same tests
# built with AddressSanitizer and UndefinedBehaviorSanitizer.
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
