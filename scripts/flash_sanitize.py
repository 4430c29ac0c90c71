"""Runs every flash attention kernel variant once on small shapes, for compute-sanitizer (memcheck, racecheck):
bf16 and fp16 at d 64 and 128, fp32 at d 64 and 128 (TF32 tensor cores, three products per product and one) and
at odd d (CUDA cores), causal and not, T that is and is not a multiple of the tiles, both layouts, atomic and
deterministic backward (the default, "auto", and the mma.sync 16x64 kernels); and every tile option of the
tensor-core kernels (bf16, d 64, T 130; the sm90 kernels also fp16, d 128, T 200; the persistent ones also at T 1024
with more tiles than SMs), the warp-specialised backwards also through the engine's attention op with the qkv bias
gradient (their column-sum epilogue).
It checks nothing numerically (the tests do); it exits non-zero only if a call raises.
Usage: compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/flash_sanitize.py"""
import itertools

import torch

from fastgpt import ops


def run(dtype, d, T, causal, layout, deterministic, fp32_math="tf32x3", B=2, H=3):
    shape = (B, H, T, d) if layout == "bhtd" else (B, T, H, d)
    q, k, v, dout = (torch.randn(shape, device="cuda", dtype=dtype) for _ in range(4))
    out, lse = ops.flash_attention_forward(q, k, v, causal=causal, layout=layout, fp32_math=fp32_math)
    ops.flash_attention_backward(dout, q, k, v, out, lse, causal=causal, layout=layout, deterministic=deterministic,
                                 fp32_math=fp32_math)


def run_qkv(dtype, T, B=2, H=3):
    """The engine's attention op on a fused qkv (B, T, 3C), d 64, with the qkv bias gradient: on an H100/H200 the
    warp-specialised backward then sums dK and dV's columns itself (its kv_sums epilogue)."""
    C = 64 * H
    qkv, dout = torch.randn(B, T, 3 * C, device="cuda", dtype=dtype), torch.randn(B, T, C, device="cuda", dtype=dtype)
    out, lse = ops.attention_forward(qkv, H)
    ops.attention_backward(dout, qkv, out, lse, H, bias_grad=True)


def main():
    n = 0
    for dtype, d in [(torch.bfloat16, 64), (torch.bfloat16, 128), (torch.float16, 64), (torch.float16, 128),
                     (torch.float32, 12), (torch.float32, 64), (torch.float32, 128), (torch.float32, 160)]:
        for T, causal, layout, det in itertools.product((17, 130), (True, False), ("bhtd", "bthd"), (False, True)):
            # The default, "auto" (the Hopper kernels on an H100/H200), in layout bhtd; the mma.sync 16x64 kernels
            # (option 1 of each) in bthd, so that both serve every dtype, d, T and backward here.
            ops.flash_attention_tiles(*((0, 0, 0) if layout == "bhtd" else (1, 1, 1)))
            # fp32 has one (deterministic) backward: det picks its TF32 choice instead (CUDA cores at d 12, 160).
            run(dtype, d, T, causal, layout, det and dtype != torch.float32, "tf32" if det else "tf32x3")
            n += 1
    ops.flash_attention_tiles(0, 0, 0)
    # Then each kernel option of the tensor-core kernels (d 64; ops.flash_attention_tiles; option 0 is "auto", 1 the
    # mma.sync 16x64 of each), deterministic backward: each forward shape, then each (dkdv, dq) pair, the other
    # kernels at option 1. The Hopper ("sm90") kernels also at d 128 in fp16, and only where they run (an sm_90 GPU,
    # a build with sm_90a code). dkdv "sm90 fused" and "sm90 ws fused" make dq themselves: once each, with dq's
    # option 1.
    options = ops.flash_attention_tile_options()
    combos = [(f, 1, 1) for f in range(1, len(options["fwd"]))] + [
        (1, k, q) for k, q in itertools.product(range(2, len(options["dkdv"])), range(1, len(options["dq"])))
        if not ("fused" in options["dkdv"][k] and q > 1)] + [(1, 1, q) for q in range(2, len(options["dq"]))]
    # The Hopper ones last, the warp-specialised after the rest: a trap (their 60 s wait limit) or a fault would end
    # the process before the choices after it.
    combos.sort(key=lambda c: sum(2 if " ws" in n else 1 for n in (options["fwd"][c[0]], options["dkdv"][c[1]],
                                                                     options["dq"][c[2]]) if n.startswith("sm90")))
    try:
        for fwd, dkdv, dq in combos:
            names = (options["fwd"][fwd], options["dkdv"][dkdv], options["dq"][dq])
            try:
                ops.flash_attention_tiles(fwd, dkdv, dq)
            except ValueError as e:
                print(f"flash_sanitize: skipped tiles {'/'.join(names)}: {e}")
                continue
            for causal in (True, False):
                run(torch.bfloat16, 64, 130, causal, "bthd" if causal else "bhtd", True)
                n += 1
                if any(name.startswith("sm90") for name in names):
                    run(torch.float16, 128, 200, causal, "bhtd" if causal else "bthd", True)
                    n += 1
            if "ws fused" in names[1]:  # and with the qkv bias gradient's column sums in its epilogue
                run_qkv(torch.bfloat16, 130)
                n += 1
            if any(name.endswith(" persistent") for name in names):
                # More tiles of 128 rows or keys than SMs (at T 130 each CTA holds one or two): some CTAs take
                # several in turn, reusing their buffers and barriers across tiles, as at GPT-2's shape.
                sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
                run(torch.bfloat16, 64, 1024, True, "bthd", True, B=1, H=sms // 8 + 1)
                n += 1
                if "ws fused" in names[1]:
                    run_qkv(torch.float16, 1024, B=1, H=sms // 8 + 1)
                    n += 1
    finally:
        ops.flash_attention_tiles(0, 0, 0)  # "auto"
    torch.cuda.synchronize()
    print(f"flash_sanitize: {n} forward+backward calls ran")


if __name__ == "__main__":
    main()
