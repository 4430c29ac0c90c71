#!/usr/bin/env bash
# Runs the tensor-core and fp32 flash attention kernels (csrc/cuda/flash_attention*.cu, attention.cu, cast.cu), the
# KV-cache decode kernels (attention_decode.cu), the cross-entropy kernels (cross_entropy.cu), the LayerNorm ones
# (layernorm.cu, residual_layernorm.cu), the optimizer step's (adamw.cu) and the embedding's (encoder.cu; these
# three beside their CPU references), the linear layers' bias gradient (matmul_bias.cu) and the scratch workspace on the
# CPU, in a host emulation of the few CUDA features they use (emu.h: one fiber per CUDA thread, ldmatrix /
# mma.sync / shuffles / ballots as warp collectives written from the PTX ISA's fragment tables (their sums exact and
# rounded once, or, mode tchw, cut toward zero as tensor cores' adders do), cp.async copied at issue or as late as
# wait_group allows; Hopper's wgmma, mbarriers, TMA copies and named barriers, with a vector-clock race check of the
# shared memory wgmma reads; one-dimensional blocks only), and compares their outputs with a float64 reference or the
# CPU's bits (emu_test.cpp). It checks the kernels'
# index, fragment, masking and barrier logic without a GPU; it says nothing of speed or of the real compiler's code. The
# kernel sources are used as they are: only the asm helpers, the shared-memory declarations and the <<<>>> launches
# are swapped (by the sed/awk below, so those lines keep their current spelling).
# Usage: tests/warp_emu/run.sh BUILD_DIR [MODE [LAZY]]
#   MODE quick|mix|tc|tiles|f32|tf32|tchw|sm75|smem|sm90|ws|fused|wsbwd|racecheck|auto|decode|ce|ln|adamw|encoder|
#   bias|delta|big|peaky|grid|selftest (the emulator's own checks, also in quick),
#   LAZY 0|1; or MODE cute (cute_check.cpp, with CUTLASS_INCLUDE set): the kernels' Hopper tiles and descriptors and the
#   emulator's wgmma against CUTLASS. EMU_SEED=N in the environment runs each block's ready threads in an order
#   shuffled by N (default: first come, first run).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
src=$(cd "$here/../../csrc" && pwd)
out=$1 mode=${2:-quick} lazy=${3:-1}
cuda_inc=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}/include
mkdir -p "$out/cuda"
cp "$here/emu.h" "$here/emu_ops.h" "$here/emu_wgmma.h" "$here/emu_tma.h" "$out/"
cp "$here/emu_cp_async.h" "$out/cuda/cp_async.cuh"  # the cp.async helpers (flash tiles, the LayerNorm row ring)
# The header up to the asm helpers, then the emulated ones, then the rest (the tile loader).
{ echo '#include "../emu.h"'
  awk '/^\/\/ c \(16 x 8, fp32\) \+= a/{skip=1} /^\/\/ Rows \[row0/{if(skip){print "#include \"../emu_ops.h\""}; skip=0} !skip{print}' \
    "$src/cuda/flash_attention.cuh"; } > "$out/cuda/flash_attention.cuh"
# wgmma.cuh and tma.cuh: the PTX part (between the "// ---- PTX" and "// ---- end of PTX" lines) becomes
# emu_wgmma.h, emu_tma.h.
for h in wgmma tma; do
  awk -v h=$h '/^\/\/ ---- PTX/{skip=1; print "#include \"../emu_" h ".h\""} /^\/\/ ---- end of PTX/{skip=0}
               !skip{print}' "$src/cuda/$h.cuh" > "$out/cuda/$h.cuh"
done
units=(flash_attention_fwd flash_attention_bwd flash_attention flash_attention_sm90a flash_attention_ws_sm90a
       flash_attention_bwd_sm90a flash_attention_bwd_ws_sm90a flash_attention_tf32 attention cast attention_decode
       cross_entropy layernorm
       residual_layernorm adamw encoder matmul_bias)
for f in "${units[@]}"; do
  # cast.cu (the 16-bit fallback of attention.cu widens and narrows through it), attention_decode.cu,
  # cross_entropy.cu and the LayerNorm files do not include the swapped flash_attention.cuh: the CUDA headers and
  # then the emulator come first.
  { { [ $f = cast ] || [ $f = attention_decode ] || [ $f = cross_entropy ] || [ $f = layernorm ] ||
      [ $f = residual_layernorm ] || [ $f = adamw ] || [ $f = encoder ] || [ $f = matmul_bias ]; } &&
      printf '#include <cuda_runtime.h>\n#include <library_types.h>\n#include "emu.h"\n'
    sed -E -e 's/extern __shared__ __align__\(16\) unsigned char smem_raw\[\];/unsigned char* smem_raw = emu::smem();/' \
      -e 's/extern __shared__ float sm\[\];/float* sm = reinterpret_cast<float*>(emu::smem());/' \
      -e 's/__shared__ ([A-Za-z_0-9]+) ([A-Za-z_0-9]+)\[([^]]+)\];/\1* \2 = emu::static_smem<\1>(__LINE__, \3);/' \
      -e 's/([A-Za-z_0-9:]+(<[^<>]*>)?)<<<(.*)>>>\((.*)\);/emu::launch(\1, \3, \4);/' "$src/cuda/$f.cu"; } \
    > "$out/$f.cpp"
done
if grep -q "<<<\|__shared__\|asm volatile" "$out"/*.cpp "$out/cuda/flash_attention.cuh" "$out/cuda/wgmma.cuh" \
  "$out/cuda/tma.cuh"; then
  echo "warp_emu: a launch, shared declaration or asm block was not translated (see run.sh's patterns)" >&2
  exit 2
fi
cp "$here/emu_test.cpp" "$out/test.cpp"
cp "$src/cpu/adamw.cpp" "$out/cpu_adamw.cpp"  # the CPU references the adamw and encoder kernels are compared with
cp "$src/cpu/encoder.cpp" "$out/cpu_encoder.cpp"
cp "$src/cpu/layernorm.cpp" "$out/cpu_layernorm.cpp"  # and the LayerNorm gradients' (dweight/dbias: the CPU's bits)
cp "$src/cpu/matmul_bias.cpp" "$out/cpu_matmul_bias.cpp"  # (its dinp_sum: the column sums the CPU LayerNorm calls)
# The kernel units are built as nvcc builds them: a * b + c contracted into one FMA where the compiler likes (nvcc's
# default, --fmad=true; GCC's -O1 does it with -fexpensive-optimizations and -mfma), so that code whose bits depend
# on where the roundings fall (a merge that must give both lanes of a shuffle the same bits) fails here as on a GPU.
# Not adamw.cu: its check is the CPU reference's bits (cpu/adamw.h's one adamw_element), which hold only where
# neither side contracts; on a GPU it is the CPU's to rounding (tests/test_adamw.py checks both against torch).
kernel_flags=(-fexpensive-optimizations -mfma -ffp-contract=fast)
flags=(-std=c++20 -O1 -I"$out" -I"$src" -I"$cuda_inc" -pthread -Wno-attributes -Wno-psabi -DFASTGPT_SM90A=1)
if [ "$mode" = cute ]; then  # the sm90 tiles, descriptors and the emulator's wgmma against CuTe (cute_check.cpp)
  : "${CUTLASS_INCLUDE:?the cute mode needs CUTLASS_INCLUDE, the CUTLASS include directory}"
  cccl=()
  [ -d "$cuda_inc/cccl" ] && cccl=(-I"$cuda_inc/cccl")  # CUDA 13 keeps libcu++ (cuda/std) there
  g++ "${flags[@]}" "${cccl[@]}" -I"$CUTLASS_INCLUDE" -Wno-deprecated-declarations "$here/cute_check.cpp" \
    -o "$out/cute_check"
  exec "$out/cute_check"
fi
# Built again only when a source, header, flag or this script changed (a digest of them all beside the binary): the
# test cases that share a build directory compile once.
digest=$( { printf '%s\n' "${flags[@]}"; cat "$0"; cat "$out"/*.cpp "$out"/*.h "$out"/cuda/*;
            find "$src" \( -name '*.h' -o -name '*.cuh' \) -print0 | sort -z | xargs -0 cat; } | sha256sum)
if [ "$(cat "$out/emu_test.digest" 2>/dev/null)" != "$digest" ] || ! [ -x "$out/emu_test" ]; then
  rm -f "$out/emu_test.digest" "$out/emu_test"
  objs=() pids=()
  for f in "${units[@]}" cpu_adamw cpu_encoder cpu_layernorm cpu_matmul_bias test; do
    rm -f "$out/$f.o"  # a failed compile must not leave an old object to link
    case $f in cpu_*|test|adamw) kf=() ;; *) kf=("${kernel_flags[@]}") ;; esac
    g++ "${flags[@]}" "${kf[@]}" -c "$out/$f.cpp" -o "$out/$f.o" &
    pids+=($!)
    objs+=("$out/$f.o")
  done
  for p in "${pids[@]}"; do wait "$p"; done  # set -e: the first failed compile ends the run
  g++ "${flags[@]}" "${objs[@]}" -o "$out/emu_test"
  echo "$digest" > "$out/emu_test.digest"
fi
"$out/emu_test" "$mode" "$lazy"
