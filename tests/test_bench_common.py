"""bench/_common.py's write_json, which every benchmark's --json goes through (and bench_gpu_train.py after each of
its variants, so that a device call cut short keeps what was measured): the file is replaced whole or not at all."""
import json
import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "bench"))
import _common  # noqa: E402


def test_write_json_replaces_the_file_whole_or_not_at_all(tmp_path, rng, capsys):
    path = tmp_path / "sub" / "bench.json"
    first = {"rows": rng.standard_normal(5).tolist()}
    _common.write_json(str(path), first)
    assert json.loads(path.read_text()) == first
    assert "wrote" in capsys.readouterr().out
    # A payload that fails half-way through (json.dump writes as it goes): the previous file stays as it was and no
    # temporary file is left beside it.
    with pytest.raises(TypeError):
        _common.write_json(str(path), {"ok": 1.0, "bad": np.float32(rng.standard_normal())})
    assert json.loads(path.read_text()) == first
    assert [p.name for p in path.parent.iterdir()] == ["bench.json"]
    second = {"rows": rng.standard_normal(3).tolist(), "partial": True}
    _common.write_json(str(path), second, quiet=True)
    assert json.loads(path.read_text()) == second
    assert capsys.readouterr().out == ""
