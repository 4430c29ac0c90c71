#!/usr/bin/env bash
# Prints one line naming what a build of fastgpt is made from: the CUDA architectures and a hash of every file the
# wheel is built from (csrc/, python/, CMakeLists.txt, pyproject.toml; not caches, not compiled leftovers).
# scripts/device_prep.sh writes it beside the wheel it builds for the GPU machine; scripts/gpu_check.sh installs
# that wheel only when the line it makes of its own copy of the tree is the same, and builds from source otherwise.
# The line depends on the files' contents alone (never their times: the device tool's copy gives every file a new
# one), so both machines make the same line of the same tree.
# Usage: bash scripts/source_stamp.sh [DIR] (default: the checkout); CUDAARCHS as gpu_check.sh uses it (default 90).
set -euo pipefail
cd "${1:-$(dirname "$0")/..}"
for p in csrc python CMakeLists.txt pyproject.toml; do
  [ -e "$p" ] || { echo "source_stamp.sh: no $p in $PWD" >&2; exit 2; }
done
hash=$(find csrc python CMakeLists.txt pyproject.toml -type f ! -path "*/__pycache__/*" ! -name "*.pyc" \
         ! -name "*.so" ! -path "*.egg-info/*" -print0 | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum)
echo "archs=${CUDAARCHS:-90} src=${hash:0:20}"
