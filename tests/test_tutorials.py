"""Every tutorial notebook runs top to bottom in smoke mode, and is committed
with the outputs of a normal-size run of its current code
(``python -m tutorials.execute`` stores them).

Each notebook runs in a fresh kernel of this interpreter (a kernelspec
written to a scratch folder and found first through JUPYTER_PATH, so a
different "python3" kernel installed on the machine is never used), with
KERAS_MP_SMOKE=1 and the offline TFDS data prepared under tmp_path.
"""

import re

import ipykernel  # noqa: F401  (the kernel the notebooks run in; a test extra)
import nbclient
import nbformat
import pytest

from tutorials.execute import KERNEL, NOTEBOOKS, kernel, stale_cells

# What each notebook must print when it worked, beyond running without error.
EXPECTED = {
    "01_quickstart.ipynb": [r"keras_mp_digits \(8, 8, 1\) 10 classes", r"policy: adaptive,",
                            r"candidates: float16, float32",
                            r"loss-scale changes made by the rule: \['1 -> \d+ @\d+",
                            r"float16->float32@\d+ \(fp16_subnormal\)", r"image/png"],
    "02_loss_scale_schedules.ipynb": [r"too high, halve \(2\^24\)\s+skipped\s+[1-9]",
                                      r"best schedule: DynamicLossScale\(", r"image/png"],
    "03_fused_kernels_and_xla.ipynb": [r"keras_mp\.fused\.layers\.Dense",
                                       r"max \|plain - fused\| = \d\.\d+e-0[5-9]",
                                       r"fused mixed_bfloat16\s+\d"],
    "04_custom_loops_and_distribute.ipynb": [r"replicas: 2", r"skipped steps: 0 -> 1",
                                             r"replicas agree: True"],
    "05_deployment.ipynb": [r"features\s+float16 -> float32", r"features': 'promoted'",
                            r"guided is within 0\.[0-4]\d points",
                            r"SavedModel output dtype: float32",
                            r"SavedModel \(guided int8\)\s+accuracy 0\.[6-9]",
                            r"LiteRT \(float32\)\s+accuracy 0\.[6-9]"],
}

# The stored outputs come from the normal size, where counts differ from the smoke run's.
NORMAL_SIZE = {**EXPECTED, "04_custom_loops_and_distribute.ipynb": [
    r"replicas: 2", r"skipped steps: \d+ -> \d+", r"replicas agree: True"]}


def test_every_tutorial_is_checked():
    assert [p.name for p in NOTEBOOKS] == sorted(EXPECTED)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_stored_outputs_come_from_the_current_code(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code), \
        f"{path.name}: not executed; run python -m tutorials.execute {path.stem}"
    stale = stale_cells(nb)
    assert not stale, (f"{path.name}: cells {stale} changed since their outputs were stored; "
                       f"run python -m tutorials.execute {path.stem}")
    # What the smoke run must print, the stored normal-size run printed too.
    text = _text(nb)
    for pattern in NORMAL_SIZE[path.name]:
        assert re.search(pattern, text), f"{path.name}: no {pattern!r} in its stored outputs"


def test_a_changed_cell_is_stale():
    nb = nbformat.read(NOTEBOOKS[0], as_version=4)
    first = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code")
    nb.cells[first].source += "\n# edited"
    assert stale_cells(nb) == [first]


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory):
    with kernel() as env:
        yield {"JUPYTER_PATH": env["JUPYTER_PATH"], "KERAS_MP_SMOKE": "1",
               "KERAS_MP_DATA_DIR": str(tmp_path_factory.mktemp("tfds")),
               "KERAS_MP_DATASET": "keras_mp_digits", "TF_CPP_MIN_LOG_LEVEL": "2"}


def _text(nb) -> str:
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.output_type == "stream":
                parts.append(out.text)
            elif out.output_type in ("execute_result", "display_data"):
                parts.append(out.data.get("text/plain", ""))
                parts.extend(k for k in out.data if k.startswith("image/"))
    return "\n".join(parts)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_in_smoke_mode(path, kernel_env, tmp_path, monkeypatch):
    for key, value in kernel_env.items():
        monkeypatch.setenv(key, value)
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name=KERNEL, timeout=300,
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    text = _text(nb)
    for pattern in EXPECTED[path.name]:
        # On a failure, the output lines that start like the pattern (the
        # whole output is too long for pytest to show).
        near = [ln for ln in text.splitlines() if ln.startswith(pattern.split(":")[0][:12])]
        assert re.search(pattern, text), \
            f"{path.name}: no {pattern!r} in its output; lines like it: {near}"
