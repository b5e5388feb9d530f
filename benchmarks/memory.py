"""Peak training memory of one bench variant, each in a fresh process.

How it is measured, and why so: TensorFlow's CPU allocator keeps every
region it grew (it never returns memory to the system) and an XLA:CPU
executable is never freed, so variants trained one after another in one
process would each start from what the earlier ones left, and a process's
peak only ever rises. Each variant therefore runs alone in a new Python
process (:func:`measure`), the same way the timing runs it: the same model,
data, the same two single steps (:func:`benchmarks.variants.first_steps`),
then ``epochs`` epochs: the warm-up epoch of ``warmup`` steps (``steps``
when not given), which for keras_mp holds its measured choice of execution
mode and its first statistics step, and in the full bench one timed round's
of ``steps``. The figures, read
at the end:

* ``peak_rss_mib``: the process's peak resident memory (Linux ``VmHWM``),
  everything included: the TensorFlow runtime the process loads, the model,
  the optimizer, the step's tensors, compiled code. On a GPU it is the host
  side only;
* ``allocator_peak_mib``: the peak of TensorFlow's allocator on the step's
  device (``tf.config.experimental.get_memory_info``; on a GPU, the device
  memory the step used), None where it keeps no statistics;
* ``baseline_rss_mib``: the process's resident memory after importing
  TensorFlow, Keras and keras-mp and building the data, before the model:
  the same for every variant.

Up to ``parallel`` variants are measured at once. How busy the cores are
changes the peak a little (a process alone runs more ops at once: a
Transformer step's process peaked up to 200 MiB higher alone than beside
another), so variants compared with each other run side by side.

Run one variant: ``python -m benchmarks.memory --child '{"kind": "mlp", ...}'``.

Example:
    >>> from benchmarks import memory
    >>> sorted(memory.FIELDS)
    ['allocator_peak_mib', 'baseline_rss_mib', 'peak_rss_mib']
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

__all__ = ["FIELDS", "fresh_process", "measure", "main"]

FIELDS: tuple[str, ...] = ("peak_rss_mib", "allocator_peak_mib", "baseline_rss_mib")
_MARK = "KERAS_MP_BENCH_MEMORY "


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    from .common import quiet_tensorflow

    quiet_tensorflow()
    import tensorflow as tf

    from keras_mp.device import memory

    from . import models, variants

    build, data = models.get(spec["kind"], spec["size"], spec["steps"])
    small = models.get(spec["kind"], spec["size"], 1, rows=8)[1]
    baseline = memory.process_rss()
    train, _ = variants.make(spec["variant"], build, data, spec["steps"])
    first = variants.first_steps(spec["variant"], data, small)
    if first is not None:
        train(1, first)
        train(1, first)
    for epoch in range(spec["epochs"]):
        train(spec.get("warmup", spec["steps"]) if epoch == 0 else spec["steps"])
    del tf
    allocator = memory.allocator()
    return {"peak_rss_mib": memory.process_peak_rss() / 2**20,
            "allocator_peak_mib": None if allocator is None else allocator[1] / 2**20,
            "baseline_rss_mib": baseline / 2**20}


def fresh_process(module: str, spec: dict[str, Any], mark: str = _MARK,
                  timeout: float = 900.0) -> dict[str, Any]:
    """Runs ``python -m MODULE --child SPEC`` in a new process and returns the
    JSON its last ``mark`` line printed, or ``{"error": message}`` where the
    process failed or gave no result within ``timeout`` seconds. ``module`` is
    a ``benchmarks.*`` name; installed as ``keras_mp.benchmarks`` it is run
    under that name."""
    if module.startswith("benchmarks.") and __package__ and __package__ != "benchmarks":
        module = f"{__package__}.{module.partition('.')[2]}"
    # ``-P``: the working folder is not put first on the child's path. Run
    # from a source checkout, its ``keras_mp/`` (which has no ``benchmarks``)
    # would hide the installed ``keras_mp.benchmarks``.
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if module.startswith("benchmarks."):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    try:
        proc = subprocess.run(
            [sys.executable, "-P", "-m", module, "--child", json.dumps(spec)],
            capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"no result within {timeout:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(mark)]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1][:300]
        return {"error": f"exit status {proc.returncode}: {tail}"}
    return json.loads(lines[-1][len(mark):])


def measure(specs: Sequence[dict[str, Any]], parallel: int = 2,
            timeout: float = 900.0, progress: Any = None) -> list[dict[str, Any]]:
    """Runs each spec (``kind``, ``size``, ``variant``, ``steps``, ``epochs``,
    optionally ``warmup``) in a process of its own, ``parallel`` at a time; returns, per spec, the
    :data:`FIELDS` in MiB, or ``{"error": message}`` where its process failed.
    ``progress``: a :class:`benchmarks.progress.Progress` started for
    ``len(specs)`` calls, or None."""
    if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
        raise ValueError(f"`parallel` must be an int >= 1, got {parallel!r}.")

    def one(spec):
        return fresh_process("benchmarks.memory", spec, _MARK, timeout)

    out = []
    with ThreadPoolExecutor(parallel) as pool:
        if progress is not None:
            progress.update("peak memory, a fresh process per variant")
        for spec, result in zip(specs, pool.map(one, specs)):
            out.append(result)
            if progress is not None:
                progress.done()
                progress.update(f"peak memory, a fresh process per variant: "
                                f"{spec['variant']} done")
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", required=True, help="the variant to run, as JSON")
    args = parser.parse_args(argv)
    print(_MARK + json.dumps(_child(json.loads(args.child))), flush=True)


if __name__ == "__main__":
    main()
