"""The notebooks run: every code cell of each notebook executes in order in one namespace, as Jupyter would run
them top to bottom (the notebooks check their own numbers: PyTorch vs fastgpt losses, logits)."""
import json
import pathlib

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, shakespeare_txt, encoder_json, monkeypatch):
    nb = json.loads(path.read_text())
    assert nb["nbformat"] == 4
    cells = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    assert cells, "a notebook without code"
    monkeypatch.setenv("FASTGPT_DATA", str(shakespeare_txt))
    monkeypatch.setenv("FASTGPT_GPT2_ENCODER", str(encoder_json))
    monkeypatch.chdir(path.parent.parent)
    namespace = {"__name__": "__main__"}
    for i, source in enumerate(cells):
        code = compile(source, f"{path.name}[code cell {i}]", "exec")
        exec(code, namespace)
