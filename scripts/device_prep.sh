#!/usr/bin/env bash
# Prepares .device (ignored by git), the folder a call to the lent GPU machine carries, for scripts/gpu_check.sh:
# the data the tests read (../shared does not travel), the commit (the machine's copy of the tree may carry a stale
# .git), and the wheels that the notebook tests' kernel needs there. The device machine has no network and lacks
# nbformat, nbclient, ipykernel and matplotlib, so the GPU cases of tests/test_notebooks.py skipped on every run
# until 2026-11-26; gpu_check.sh installs them by name from .device/wheels, offline, before its tests. The wheels
# are for the device's CPython 3.12 on x86_64 Linux; what it already has (numpy, packaging, typing_extensions) is
# left out, and so is what fits no carry (at most 64 MiB with the tree: about 40 MB here).
# Usage: bash scripts/device_prep.sh [--no-wheels]; then carry [".device"]. DEVICE_DIR=path: prepare that folder
# instead (the tests').
set -euo pipefail
cd "$(dirname "$0")/.."
shared=${FASTGPT_SHARED:-../shared}
[ -f "$shared/data/tinyshakespeare.txt" ] || { echo "device_prep.sh: no $shared/data/tinyshakespeare.txt" >&2; exit 2; }
case "${1:-}" in ""|--no-wheels) ;; *) echo "usage: device_prep.sh [--no-wheels]" >&2; exit 2 ;; esac
dev=${DEVICE_DIR:-.device}
mkdir -p "$dev"
case "$(realpath "$PWD")/" in  # the folder is emptied first: never the checkout or a folder holding it
  "$(realpath "$dev")"/*) echo "device_prep.sh: DEVICE_DIR=$dev holds the checkout" >&2; exit 2 ;;
esac
chmod -R u+w "$dev"  # an earlier copy of the read-only shared data
rm -rf "$dev"
mkdir -p "$dev/shared"
cp -r --no-preserve=mode "$shared/data" "$dev/shared/"
git rev-parse --short HEAD > "$dev/COMMIT"
if [ "${1:-}" != --no-wheels ]; then
  mkdir -p "$dev/wheels"
  if python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
       --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
       -d "$dev/wheels" "nbclient>=0.7" "nbformat>=5" "ipykernel>=6" "matplotlib>=3.5" matplotlib-inline; then
    rm -f "$dev"/wheels/numpy-* "$dev"/wheels/packaging-* "$dev"/wheels/typing_extensions-*
  else
    echo "device_prep.sh: no wheels (pip could not download them): the notebooks' GPU cases will skip" >&2
    rm -rf "$dev/wheels"
  fi
fi
echo "device_prep.sh: $dev at $(cat "$dev/COMMIT"), $(du -sh "$dev" | cut -f1)"
