#!/usr/bin/env bash
# Quick start: install what is needed, build the release preset, run `attncore` on its
# built-in default (a short checked and timed sweep of every backend).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
cmake --preset release >/dev/null
cmake --build --preset release
./build/release/attncore
