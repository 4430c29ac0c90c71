"""Whether compute-sanitizer's initcheck takes the flash forward's TMA-stored O as written, for scripts/gpu_check.sh's
sanitize part. The tool does not count TMA tensor stores as writes: in the 2026-11-26 H200 runs it reported flash
backward's delta pass reading `out` that the warp-specialised Hopper forward had written only by TMA stores, and this
probe read 32,768 reports for that forward's out and none for the plain one's. So the forward now marks O written
through NVTX's memory API (tma.cuh mark_stored). This runs that forward ("tma") or the plain Hopper forward with the
same bits and ordinary stores ("plain") into a fresh `out`, then has torch read every element: under initcheck, no
reports for either means the marks work.
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
