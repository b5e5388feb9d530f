"""The documentation site builds with ``mkdocs build --strict`` (any warning,
e.g. a broken link or a docstring griffe cannot read, fails it), and holds
the pages it promises."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import mkdocs  # noqa: F401  (these three are test extras: CI builds the site)
import mkdocs_jupyter  # noqa: F401
import mkdocstrings_handlers.python  # noqa: F401
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _griffe_extension():
    spec = importlib.util.spec_from_file_location("griffe_doctest",
                                                  ROOT / "docs" / "griffe_doctest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_doctests_are_fenced_without_directives():
    ext = _griffe_extension()
    text = ("Summary.\n\nExample:\n    >>> x = [0, 0]  # doctest: +ELLIPSIS\n    >>> x\n"
            "    [0, 0]\n\nMore text.")
    assert ext.fence_doctests(text).splitlines() == [
        "Summary.", "", "Example:", "", "    ```pycon", "    >>> x = [0, 0]", "    >>> x",
        "    [0, 0]", "    ```", "", "", "More text."]


def test_grouped_parameters_are_split_only_in_args():
    ext = _griffe_extension()
    text = "Args:\n    a, b: inputs.\n    c: other.\n\nReturns:\n    x, y: a pair."
    assert ext.split_grouped_parameters(text).splitlines() == [
        "Args:", "    a: inputs.", "    b: inputs.", "    c: other.", "", "Returns:",
        "    x, y: a pair."]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
         str(ROOT / "mkdocs.yml"), "--site-dir", str(out)],
        cwd=out, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "WARNING" not in proc.stderr, proc.stderr
    # every page in docs/ is reachable from the navigation
    assert "not included in the \"nav\"" not in proc.stderr, proc.stderr
    return out


def test_site_has_every_section(site):
    for page in ["index.html", "concepts/policies/index.html",
                 "concepts/loss_scaling/index.html", "concepts/fused_kernels/index.html",
                 "concepts/tuning/index.html", "concepts/datasets/index.html",
                 "adaptive/index.html", "distributed/index.html", "benchmarks/index.html",
                 "fused_kernels/index.html", "recovering/index.html",
                 "api/tuning/index.html", "api/loss_scaling/index.html"]:
        assert (site / page).is_file(), page
    assert (site / "assets" / "bench" / "avx512-bf16" / "all-five.png").stat().st_size > 1000


def test_tutorials_are_rendered(site):
    notebooks = sorted(p.stem for p in (ROOT / "tutorials").glob("*.ipynb"))
    assert len(notebooks) == 5
    for stem in notebooks:
        html = (site / "tutorials" / stem / "index.html").read_text()
        # the notebook's code is on the page, and its stored outputs
        assert "datasets.load" in html or "deploy_demo.train" in html, stem
        assert "jp-OutputArea" in html, stem
    for stem in ("01_quickstart", "02_loss_scale_schedules"):  # their plots
        html = (site / "tutorials" / stem / "index.html").read_text()
        assert "data:image/png;base64" in html, stem


def test_api_reference_comes_from_docstrings(site):
    html = (site / "api" / "tuning" / "index.html").read_text()
    assert 'id="keras_mp.tuning.loss_scale_schedule"' in html
    assert 'id="keras_mp.tuning.PrecisionHyperModel"' in html
    # doctests render as code blocks, not as Markdown block quotes
    assert "&gt;&gt;&gt;" in html and "<blockquote>" not in html
    loss = (site / "api" / "loss_scaling" / "index.html").read_text()
    assert 'id="keras_mp.scaling.optimizer.LossScaleOptimizer"' in loss
    assert 'id="keras_mp.scaling.loss_scale.DynamicLossScale"' in loss
