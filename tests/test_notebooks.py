"""The notebooks run top to bottom in a Jupyter kernel (nbclient), as a user would run them, and show what they
promise: the speed-up ladder's table has a row per rung and side with finite, falling losses and a chart; the
training notebook draws its loss curve, its losses fall, and its checkpoint and Hugging Face round trips are exact.
The notebooks also assert their own numbers (PyTorch vs fastgpt losses, logits). They are stored without outputs.
Their shared Colab cell is run against a stand-in Colab (no network, no install): it works inside the clone and
sets the data paths on the first run, after a runtime restart, and after a first run cut short."""
import importlib.metadata
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import types
import urllib.request

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
sys.path.insert(0, str(ROOT / "bench"))


def run_notebook(path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}}).execute()
    return [c for c in nb.cells if c.cell_type == "code"]


def text(cell):
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


def has_image(cell):
    return any("image/png" in o.get("data", {}) for o in cell.outputs)


@pytest.fixture
def notebook_env(shakespeare_txt, encoder_json, monkeypatch):
    monkeypatch.setenv("FASTGPT_DATA", str(shakespeare_txt))  # the kernel inherits the environment
    monkeypatch.setenv("FASTGPT_GPT2_ENCODER", str(encoder_json))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebooks_are_stored_without_outputs(path):
    nb = json.loads(path.read_text())
    assert nb["nbformat"] == 4
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code, "a notebook without code"
    for c in code:
        assert c["outputs"] == [] and c["execution_count"] is None, f"{path.name}: a cell was saved with its outputs"


def test_01_cpu_quickstart_runs(notebook_env):
    cells = run_notebook(ROOT / "notebooks" / "01_cpu_quickstart.ipynb")
    out = "".join(text(c) for c in cells)
    diff = float(re.search(r"max \|loss difference\| over \d+ steps: (\S+)", out).group(1))
    assert diff < 1e-4, out[-2000:]
    m = re.search(r"loss after (\d+) steps: fp32 (\S+), fastgpt bf16 (\S+), torch autocast bf16 (\S+)", out)
    steps, fp32, bf16, autocast = int(m.group(1)), *map(float, m.groups()[1:])
    assert steps == 20 and max(fp32, bf16, autocast) < math.log(50304) - 0.5, m.group(0)  # each trained
    m = re.search(r"bf16 vs fp32 over 20 steps: max \|loss difference\| fastgpt (\S+), torch autocast (\S+)", out)
    assert float(m.group(1)) < 1e-2 and float(m.group(2)) < 1e-2, m.group(0)  # bf16 rounding, not a different run
    assert "tf32 on the CPU: precision='tf32' needs device='cuda'" in out
    flash = float(re.search(r"flash attention vs SDPA on the CPU: max \|difference\| over out, dq, dk, dv: (\S+)",
                            out).group(1))
    assert flash < 1e-4, out[-2000:]


@pytest.mark.uses_gpu  # the notebook picks the GPU where there is one
def test_02_speedup_progression_table_and_chart(notebook_env):
    import bench_ladder
    cells = run_notebook(ROOT / "notebooks" / "02_speedup_progression.ipynb")
    summary = next(c for c in cells if "ladder.table(state[\"rows\"])" in c.source and "fastgpt / PyTorch" in c.source)
    table = text(summary).split("fastgpt / PyTorch")[0]  # the table, before the ratio lines
    rows = {}
    for line in table.splitlines():
        for rung in bench_ladder.RUNGS:
            m = re.match(rf"{re.escape(rung.name)}\s+(torch|fastgpt)\s+(.*)", line)
            if m:
                rows[(rung.name, m.group(1))] = m.group(2)
    assert set(rows) == {(r.name, s) for r in bench_ladder.RUNGS for s in ("torch", "fastgpt")}, table
    ran = 0
    for (rung, side), rest in rows.items():
        if rest.startswith("skipped"):
            assert len(rest.split(None, 1)) == 2, f"{rung} {side}: skipped without a reason"
            continue
        ms, tok_s, _mfu, _mem, loss = rest.split()[:5]
        assert float(ms) > 0 and float(tok_s) > 0 and math.isfinite(float(loss)), (rung, side, rest)
        assert float(loss) < math.log(50304), (rung, side, "the loss did not fall from the uniform one")
        ran += 1
    assert ran >= 8, table  # on a CPU: fp32, bf16, flash attention, vocab 50304, fused AdamW on both sides
    assert any(has_image(c) for c in cells), "the bar chart was not drawn"
    assert "losses finite and falling; fp32 sides agree" in text(cells[-1])


@pytest.mark.uses_gpu  # the notebook picks the GPU where there is one
def test_03_train_sample_share(notebook_env):
    cells = run_notebook(ROOT / "notebooks" / "03_train_sample_share.ipynb")
    train = next(c for c in cells if "handle.update(fig)" in c.source)
    assert has_image(train), "the live loss curve was not drawn"
    m = re.search(r"train loss (\S+) -> (\S+), val loss (\S+) -> (\S+)", text(train))
    t0, t1, v0, v1 = map(float, m.groups())
    assert t1 < t0 - 1 and v1 < v0 - 1, m.group(0)  # from ~10.8, clearly down
    out = "".join(text(c) for c in cells)
    assert out.count("> ROMEO:") == 3
    assert "reloaded logits identical: True; samples identical: True" in out
    assert re.search(r"transformers vs fastgpt logits: relative error \S+; weights identical after the round trip: "
                     r"True", out), out[-2000:]


def colab_cell(path):
    return "".join(json.loads(path.read_text())["cells"][1]["source"])


def test_the_colab_cell_is_the_same_in_every_notebook():
    cells = {p.name: colab_cell(p) for p in NOTEBOOKS}
    assert len(set(cells.values())) == 1 and "google.colab" in cells[NOTEBOOKS[0].name], cells


def test_the_colab_cell_works_inside_the_clone_after_a_restart_too(tmp_path, monkeypatch):
    """Colab stood in for: google.colab imported, git and pip (subprocess.run), the downloads and the installed
    distribution faked. Each 'session' is a fresh kernel: back in the starting folder, without the two paths."""
    source = colab_cell(NOTEBOOKS[0])
    content = tmp_path.resolve()  # Colab's /content
    clone = content / "fastgpt"
    calls, installed = [], []

    def run(cmd, check):
        calls.append(cmd[0] if cmd[0] == "git" else "pip")
        if cmd[:2] == ["git", "clone"]:  # a clone: the folder the notebooks find the repository by
            (pathlib.Path(cmd[-1]) / "tests").mkdir(parents=True)
            (pathlib.Path(cmd[-1]) / "tests" / "reference_gpt.py").write_text("")
        else:
            assert cmd[1:4] == ["-m", "pip", "install"] and pathlib.Path(cmd[-1]) == clone, cmd
            installed.append(True)
        return subprocess.CompletedProcess(cmd, 0)

    def urlretrieve(url, path):
        calls.append("download")
        pathlib.Path(path).write_text(url)

    def distribution(name):
        assert name == "fastgpt"
        if not installed:
            raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.setattr(urllib.request, "urlretrieve", urlretrieve)
    monkeypatch.setattr(importlib.metadata, "distribution", distribution)
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    monkeypatch.setenv("FASTGPT_REPO", "https://example.invalid/fastgpt.git")
    for var in ("FASTGPT_DATA", "FASTGPT_GPT2_ENCODER"):
        monkeypatch.setenv(var, "")  # recorded, so that the test's own settings are undone after it
        monkeypatch.delenv(var)

    def session(start=content):
        calls.clear()
        os.chdir(start)
        for var in ("FASTGPT_DATA", "FASTGPT_GPT2_ENCODER"):
            os.environ.pop(var, None)
        exec(source, {})
        assert pathlib.Path.cwd() == clone
        data, encoder = clone / "data" / "tinyshakespeare.txt", clone / "data" / "gpt2" / "encoder.json"
        assert os.environ["FASTGPT_DATA"] == str(data) and data.read_text().endswith("input.txt")
        assert os.environ["FASTGPT_GPT2_ENCODER"] == str(encoder) and encoder.read_text().endswith("encoder.json")
        return list(calls)

    monkeypatch.chdir(content)  # restored after the test
    assert session() == ["git", "pip", "download", "download"]  # the first run
    assert session() == []  # after a restart: installed and downloaded, only back into the clone
    assert session(start=clone) == []  # the cell run again in the same session, already inside the clone
    assert not list(clone.rglob("*.part")) and not (clone / "fastgpt").exists()

    installed.clear()  # a first run cut short after the clone: the folder is there, the package is not
    for f in (clone / "data").rglob("*.*"):
        f.unlink()
    assert session() == ["pip", "download", "download"]

    monkeypatch.delitem(sys.modules, "google.colab")  # anywhere but Colab: nothing
    os.chdir(content)
    calls.clear()
    for var in ("FASTGPT_DATA", "FASTGPT_GPT2_ENCODER"):
        os.environ.pop(var)
    exec(source, {})
    assert calls == [] and pathlib.Path.cwd() == content and "FASTGPT_DATA" not in os.environ
