"""bench/bench_flash_attention.py's --tiles rows (tile_rows), run on NumPy inputs (fastgpt's CPU kernels, which the
tile choice does not change): every choice that applies at the head dim gets a row that runs its calls, a Hopper
("sm90") choice this machine cannot run gets a skipped row with the reason, and the default tiles come back. How
fast each choice is, only a GPU run says."""
import pathlib
import sys

import numpy as np
import pytest

from devices import sm90_device
from fastgpt import _C, ops

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "bench"))
import bench_flash_attention as bench  # noqa: E402


@pytest.mark.skipif(not _C.built_with_cuda, reason="the tile choice exists in builds with CUDA")
@pytest.mark.parametrize("d", [64, 128])
def test_tile_rows_time_each_choice_that_runs_and_skip_the_rest(rng, d):
    q, k, v, dout = (rng.standard_normal((1, 2, 40, d)).astype(np.float32) for _ in range(4))
    want_out, _ = ops.flash_attention_forward(q, k, v, causal=True)
    rows = []

    def record(impl, fwd=None, bwd=None, out=None, **extra):
        row = dict(impl=impl, ran=[], **extra)
        for part, call in (("fwd", fwd), ("bwd", bwd)):
            if call is not None:
                call()
                row["ran"].append(part)
        if out is not None:
            row["diff"] = float(np.abs(np.asarray(out) - want_out).max())
        rows.append(row)

    default = ops.flash_attention_tiles()
    bench.tile_rows(record, q, k, v, dout, True, d)
    assert ops.flash_attention_tiles() == default

    options = ops.flash_attention_tile_options()
    assert all(names[0] == "auto" for names in options.values())  # the default, the plain rows
    kernels = {kernel: names[1:] for kernel, names in options.items()}
    first = {kernel: names[0] for kernel, names in kernels.items()}

    def applies(tiles):
        return d == 64 or all(name == first[kern] or name.startswith("sm90") for kern, name in tiles.items())

    want = [("fastgpt tiles fwd " + f, dict(first, fwd=f)) for f in kernels["fwd"]]
    want += [(f"fastgpt tiles bwd {a}/{b}", dict(first, dkdv=a, dq=b)) for a in kernels["dkdv"] for b in kernels["dq"]
             if "fused" not in a or b == first["dq"]]
    want = [(name, tiles) for name, tiles in want if applies(tiles)]

    def hopper(item):  # the sm90 choices come after the others (forwards first): a fault there ends the run
        return (" bwd " in item[0], any(n.startswith("sm90") for n in item[1].values()))
    want.sort(key=hopper)
    assert [r["impl"] for r in rows] == [name for name, _ in want]
    for row, (name, tiles) in zip(rows, want):
        runs = sm90_device() or not any(n.startswith("sm90") for n in tiles.values())
        if runs:
            assert "status" not in row and row["ran"] == (["fwd"] if " fwd " in name else ["bwd"]), row
            if " fwd " in name:
                assert row["diff"] == 0.0  # the CPU kernel whatever the tiles
        else:
            assert row["status"] == "skipped" and row["ran"] == [], row
            assert "needs a GPU of compute capability 9.0" in row["error"], row
    # three sm90 forwards, four warp-specialised (two of them persistent)
    assert sum(" fwd sm90" in r["impl"] for r in rows) == 7
    assert sum(r["impl"].endswith(" persistent") for r in rows) == 2  # forwards; the backwards' end in their dq
    assert sum(" persistent/" in r["impl"] for r in rows) == 2
    assert any("sm90" in r["impl"] and " bwd " in r["impl"] for r in rows)
    assert [r["impl"] for r in rows if "fused" in r["impl"]] == [f"fastgpt tiles bwd sm90 {f}/{first['dq']}"
                                                                 for f in ("fused", "ws fused", "ws fused 128x128",
                                                                           "ws fused persistent",
                                                                           "ws fused 128x128 persistent")]
