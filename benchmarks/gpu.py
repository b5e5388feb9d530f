"""The whole comparison and the kernel tests on a CUDA GPU, in one command.

Run from the repository root::

    python -m benchmarks.gpu [--out DIR] [--quick] [--no-tests]

On a machine without a GPU visible to TensorFlow it says so and exits 0. On a
GPU it prints the device, runs ``keras-mp bench`` (every Keras one-liner
against keras-mp's recommended set-up, full sizes, 5 interleaved rounds of 5
steps; :mod:`benchmarks.suite`), then the tests of the fused kernels, layers
and execution choice on that GPU (``pytest tests/scaling/test_kernels.py
tests/fused/test_ops.py tests/fused/test_layers.py tests/fused/test_fuse.py
tests/execution/test_choice.py``, where a repository checkout is present), and ends
with one table: keras-mp against Keras float32, Keras ``mixed_bfloat16`` and
the best Keras variant, per model, by process CPU time and wall time, beside
the targets of issue 14 (Transformer >= 3x float32 and >= 1.5x
``mixed_bfloat16``; every model >= 1.0x the best Keras one-liner).

Sized to finish within 5 minutes on one recent GPU (most of it XLA
compilation); not yet run on one, since no GPU was available to this work.
``--quick`` uses the smaller shapes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from .common import quiet_tensorflow

__all__ = ["summary_table", "main"]

_TESTS = ("tests/scaling/test_kernels.py", "tests/fused/test_ops.py", "tests/fused/test_layers.py",
          "tests/fused/test_fuse.py", "tests/execution/test_choice.py")


def summary_table(report: dict[str, Any]) -> str:
    """keras-mp's ratios per model from a :func:`benchmarks.suite.run` report.

    Example:
        >>> e = {"cpu": {"median": 1.0}, "wall": {"median": 2.0}}
        >>> f = {"cpu": {"median": 3.0}, "wall": {"median": 4.0}}
        >>> r = {"results": {"mlp": {"keras_float32": f, "keras_mixed_bfloat16": f,
        ...                          "keras_mp": e}}}
        >>> print(summary_table(r).splitlines()[2])
        | mlp | 3.00x / 2.00x | 3.00x / 2.00x | 3.00x / 2.00x (keras_float32) | >= 1.0x best |
    """
    from .suite import KERAS_VARIANTS

    lines = ["| model | vs Keras float32 (CPU / wall) | vs Keras mixed_bfloat16 | "
             "vs best Keras one-liner | target |", "| --- | ---: | ---: | ---: | --- |"]
    for model, entries in report["results"].items():
        mp = entries.get("keras_mp")
        if mp is None:
            continue

        def ratio(name: str) -> str:
            if name not in entries:
                return "n/a"
            return " / ".join(f"{entries[name][c]['median'] / mp[c]['median']:.2f}x"
                              for c in ("cpu", "wall"))

        keras = [v for v in KERAS_VARIANTS if v in entries]
        best = min(keras, key=lambda v: entries[v]["wall"]["median"])
        target = ">= 3x float32, >= 1.5x mixed_bfloat16, >= 1.0x best" \
            if model == "transformer" else ">= 1.0x best"
        lines.append(f"| {model} | {ratio('keras_float32')} | {ratio('keras_mixed_bfloat16')} "
                     f"| {ratio(best)} ({best}) | {target} |")
    return "\n".join(lines)


def _run_tests(root: str) -> int | None:
    tests = [t for t in _TESTS if os.path.exists(os.path.join(root, t))]
    if not tests:
        print("No tests/ folder here (not a repository checkout): kernel tests not run.")
        return None
    # One process on the one GPU (pyproject.toml's addopts ask pytest-xdist for two).
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
           "-o", "addopts=-ra", *tests]
    print("$", " ".join(cmd[2:]), flush=True)
    return subprocess.run(cmd, cwd=root, check=False).returncode


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_results", help="folder for bench.json/png")
    parser.add_argument("--quick", action="store_true", help="small shapes")
    parser.add_argument("--no-tests", action="store_true", help="skip the kernel tests")
    args = parser.parse_args(argv)
    quiet_tensorflow()
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        print("No CUDA GPU visible to TensorFlow on this machine: nothing to run "
              "(python -m benchmarks.suite compares on the CPU).")
        return 0
    for g in gpus:
        details = tf.config.experimental.get_device_details(g)
        print(f"GPU: {details.get('device_name', g.name)}, compute capability "
              f"{details.get('compute_capability')}")
    start = time.perf_counter()
    from . import suite

    report = suite.run(quick=args.quick, out=args.out, rounds=5, steps=5)
    print(f"benchmark: {time.perf_counter() - start:.0f} s")
    status = 0
    if not args.no_tests:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        code = _run_tests(root)
        status = 0 if code in (0, None) else code
    print("\nkeras-mp (adaptive + fuse + AdaptivePrecision) speed-up, median of interleaved "
          "rounds:\n" + summary_table(report))
    print(f"total: {time.perf_counter() - start:.0f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
