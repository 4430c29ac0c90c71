"""Whether compute-sanitizer's initcheck counts TMA tensor stores as writes, for scripts/gpu_check.sh's sanitize part.
The H200 runs of 2026-11-26 had initcheck report flash backward's delta pass reading elements of `out` that were
never written, at the shape where flash_sanitize.py runs the warp-specialised Hopper forward, which writes O only by
TMA stores (the warp emulator shows it writing every element). This runs that forward ("tma") or the plain Hopper
forward with the same bits and ordinary stores ("plain") into a fresh `out`, then has torch read every element:
under initcheck, reports for "tma" and none for "plain" mean the tool does not see TMA stores.
Usage: compute-sanitizer --tool initcheck --error-exitcode 1 python3 scripts/initcheck_tma.py tma|plain
Exits 0 without running anything where there is no H100/H200 (it says so), 2 for a bad argument."""
import sys

FORWARDS = {"tma": "sm90 ws 128x128", "plain": "sm90 128x128"}


def main(argv):
    if len(argv) != 1 or argv[0] not in FORWARDS:
        print(f"usage: initcheck_tma.py {'|'.join(FORWARDS)}", file=sys.stderr)
        return 2
    import torch

    from fastgpt import ops
    if not torch.cuda.is_available():
        print("initcheck_tma: skipped (no CUDA GPU)")
        return 0
    try:
        before = ops.flash_attention_tiles(fwd=FORWARDS[argv[0]])
    except (ValueError, RuntimeError) as e:  # not an sm_90 GPU or no sm_90a code; a build without CUDA
        print(f"initcheck_tma: skipped ({e})")
        return 0
    try:
        q, k, v = (torch.randn(1, 2, 256, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        out, _ = ops.flash_attention_forward(q, k, v, causal=True)
        total = out.float().sum().item()  # torch's reduction reads every element of out
    finally:
        ops.flash_attention_tiles(**before)
    print(f"initcheck_tma {argv[0]}: forward {FORWARDS[argv[0]]!r}, sum of out {total:.6g}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
