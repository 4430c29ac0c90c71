#!/usr/bin/env bash
# Prepares .device (ignored by git), the folder a call to the lent GPU machine carries, for scripts/gpu_check.sh:
# the data the tests read (../shared does not travel), the commit (the machine's copy of the tree may carry a stale
# .git), the wheels that the notebook tests' kernel needs there, and fastgpt itself built here as a wheel for that
# machine. The device machine has no network and lacks nbformat, nbclient, ipykernel and matplotlib, so the GPU
# cases of tests/test_notebooks.py skipped on every run until 2026-11-26; gpu_check.sh installs them by name from
# .device/wheels, offline, before its tests. The wheels are for the device's CPython 3.12 on x86_64 Linux; what it
# already has (numpy, packaging, typing_extensions) is left out, and so is what fits no carry (at most 64 MiB with
# the tree: about 40 MB here).
# The prebuilt wheel (.device/prebuilt): gpu_check.sh's build took 34-55 s of every call there (the 2026-11-27 runs,
# a warm machine's too: the tool's copy gives each file a new time), and a session has 900 device-seconds. Here it
# takes about 65 s the first time and then only what changed (build/device-cp312 is kept).
# Built as there (CUDA on, CUDAARCHS, default 90) for CPython 3.12, with the CPU kernels for x86-64-v3 (AVX2 and
# FMA, which any GPU host has) instead of -march=native, and an rpath to pip's NCCL beside the installed package
# (nvidia/nccl/lib, where torch's nvidia-nccl-cu13 puts libnccl.so.2). scripts/source_stamp.sh's line goes beside
# it: gpu_check.sh installs the wheel only for the same sources and architectures, checks that it imports and runs
# a kernel, and builds from source otherwise. Needs a Python 3.12 here (DEVICE_PYTHON, else python3.12 or pyenv's)
# and PyPI once (scikit-build-core and pybind11 into build/device-py312); without them it says so and goes on.
# Usage: bash scripts/device_prep.sh [--no-wheels] [--no-prebuild]; then carry [".device"]. DEVICE_DIR=path:
# prepare that folder instead (the tests').
set -euo pipefail
cd "$(dirname "$0")/.."
shared=${FASTGPT_SHARED:-../shared}
wheels=1 prebuild=1
for a in "$@"; do
  case $a in
    --no-wheels) wheels= ;;
    --no-prebuild) prebuild= ;;
    *) echo "usage: device_prep.sh [--no-wheels] [--no-prebuild]" >&2; exit 2 ;;
  esac
done
[ -f "$shared/data/tinyshakespeare.txt" ] || { echo "device_prep.sh: no $shared/data/tinyshakespeare.txt" >&2; exit 2; }
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
if [ -n "$wheels" ]; then
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

prebuilt() {  # fastgpt's wheel for the device into $dev/prebuilt, with its stamp; returns nonzero on any failure
  local py=${DEVICE_PYTHON:-} venv=build/device-py312 c
  if [ -z "$py" ]; then
    for c in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3; do
      if "$c" -c "import sys; assert sys.version_info[:2] == (3, 12)" 2> /dev/null; then py=$c; break; fi
    done
  fi
  [ -n "$py" ] || { echo "device_prep.sh: no Python 3.12 here (set DEVICE_PYTHON)" >&2; return 1; }
  if [ ! -x "$venv/bin/python" ]; then
    "$py" -m venv "$venv" && "$venv/bin/python" -m pip install -q "scikit-build-core>=0.10" "pybind11>=2.12" ||
      { rm -rf "$venv"; echo "device_prep.sh: could not make $venv" >&2; return 1; }
  fi
  local stamp t0=$SECONDS
  local -x CUDAARCHS=${CUDAARCHS:-90}  # gpu_check.sh's default; source_stamp.sh's line names it
  stamp=$(bash scripts/source_stamp.sh)
  mkdir -p "$dev/prebuilt"
  # The device's pip installs into the site-packages that holds torch's nvidia-nccl-cu13: $ORIGIN/.. is that folder.
  FASTGPT_CUDA=ON FASTGPT_NATIVE=OFF "$venv/bin/python" -m pip wheel -q \
    --no-build-isolation --no-deps -w "$dev/prebuilt" --config-settings=build-dir=build/device-cp312 \
    --config-settings=cmake.define.CMAKE_CXX_FLAGS=-march=x86-64-v3 \
    '--config-settings=cmake.define.CMAKE_INSTALL_RPATH=$ORIGIN/../nvidia/nccl/lib' . \
    > build/device-prebuild.log 2>&1 ||
    { tail -20 build/device-prebuild.log >&2; echo "device_prep.sh: the wheel did not build" >&2; return 1; }
  # a file changed while it built: the wheel may hold either version
  [ "$stamp" = "$(bash scripts/source_stamp.sh)" ] ||
    { echo "device_prep.sh: the sources changed during the build" >&2; return 1; }
  echo "$stamp" > "$dev/prebuilt/STAMP"
  echo "device_prep.sh: prebuilt $(basename "$dev"/prebuilt/fastgpt-*.whl) ($stamp) in $((SECONDS - t0)) s"
}
if [ -n "$prebuild" ] && ! prebuilt; then
  rm -rf "$dev/prebuilt"
  echo "device_prep.sh: no prebuilt wheel: gpu_check.sh will build fastgpt on the device" >&2
fi
echo "device_prep.sh: $dev at $(cat "$dev/COMMIT"), $(du -sh "$dev" | cut -f1)"
# What a call sends: the tracked and untracked-not-ignored files, and this folder (the tool's limit is 64 MiB).
sent=$(git ls-files -coz --exclude-standard | xargs -0 -r stat -c %s 2> /dev/null | awk '{s += $1} END {print s + 0}')
sent=$((sent + $(du -sb "$dev" | cut -f1)))
echo "device_prep.sh: a call carrying $dev sends about $((sent / 1048576)) MiB (the limit is 64)"
[ $sent -le $((64 * 1048576)) ] || echo "device_prep.sh: over the limit: --no-wheels leaves the notebooks' out" >&2
