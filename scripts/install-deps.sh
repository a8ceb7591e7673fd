#!/usr/bin/env bash
# Installs the Debian 12 packages attncore needs to build, test and benchmark (README:
# Dependencies). Does nothing when they are all present; needs root otherwise.
set -euo pipefail
packages=(cmake g++ make pkg-config libgtest-dev libbenchmark-dev python3
  python3-dev pybind11-dev libdlpack-dev python3-numpy python3-pytest python3-torch clang
  libclang-rt-14-dev  # clang 14's libFuzzer and sanitizer runtimes
  python3-venv python3-build mypy  # pip into a venv, wheels, the type stubs' check
  libomp-14-dev)  # clang 14's OpenMP (the OpenMP executor test)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "installing: ${missing[*]}"
  sudo_cmd=()
  [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
  export DEBIAN_FRONTEND=noninteractive
  "${sudo_cmd[@]}" apt-get update -qq
  "${sudo_cmd[@]}" apt-get install -y -qq "${missing[@]}"
fi
