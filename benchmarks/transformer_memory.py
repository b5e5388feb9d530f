"""Peak training memory of a 2-block Transformer: Keras's one-liners against
keras-mp's recommended set-up, and the largest batch that fits a budget.

The model (issue 21): the bench's Transformer (:mod:`benchmarks.models`) at
T=256, d=512, 8 heads, 2 post-norm blocks, a float32 10-way head; Adam;
``model.fit`` for 12 steps of batch 64 on synthetic data. Each variant runs
alone in a fresh process (TensorFlow's CPU allocator never gives memory
back, so variants sharing a process would inherit each other's regions; see
:mod:`benchmarks.memory`), ``parallel`` at a time (in the order of
``variants``, so neighbours share the cores alike), ``repeats`` times each;
the figure is the process's peak resident memory (Linux ``VmHWM``, MiB), median and spread over the
repeats, and the peak of TensorFlow's allocator.

Variants:

* ``keras_float32``, ``keras_mixed_bfloat16``: Keras alone (keras_mp not
  imported);
* ``keras_mp``: ``"adaptive"``, ``keras_mp.fuse(model, inplace=True)``,
  ``AdaptivePrecision()`` defaults, ``compile()`` defaults (the measured
  execution mode, its trial inside the 12 steps);
* ``keras_mp_sampling``: the same with ``AdaptivePrecision(interval=10,
  probe_every=20)`` for 24 steps, so that statistics steps (one in 2) and
  a float32 probe step (call 20) fall inside the run;
* ``keras_mp_graph``: ``keras_mp`` with ``KERAS_MP_EXECUTION=graph`` (no trial);
* ``keras_mixed_bfloat16_remat``: Keras alone, the model built inside
  ``keras.RematScope("activations")``, the one mode Keras's own TensorFlow
  ``remat`` runs on this model in graph mode (``"full"`` and
  ``"larger_than"`` fail on its attention's keyword arguments);
* ``keras_mp_remat``: ``keras_mp`` with the model built inside
  ``keras.RematScope("larger_than")`` (every layer whose output holds more
  than 1024 values per row recomputed on the backward pass:
  :mod:`keras_mp.execution.remat`).

Each run also records the median process CPU and wall time of its last
``STEPS // 2`` steps (the rematerialized variants pay a second forward pass).

``--budget MIB`` also gives, for Keras ``mixed_bfloat16`` and ``keras_mp``,
the largest batch whose peak fits: peaks measured at ``--batches`` (memory
grows linearly with the batch), the line through them solved for the
budget, rounded down to a multiple of 8, and that batch run once to check.

Run: ``python -m benchmarks.transformer_memory [--quick] [--budget 4096]``
(``--quick``: 1 repeat, no sampling variant).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

__all__ = ["VARIANTS", "SIZE", "run", "largest_batch", "main"]

VARIANTS: tuple[str, ...] = ("keras_float32", "keras_mixed_bfloat16", "keras_mp",
                             "keras_mp_sampling", "keras_mp_graph", "keras_mixed_bfloat16_remat",
                             "keras_mp_remat")
#: The keras.RematScope mode each rematerialized variant builds its model in.
REMAT = {"keras_mixed_bfloat16_remat": "activations", "keras_mp_remat": "larger_than"}
SIZE = dict(batch=64, length=256, dim=512, blocks=2)
STEPS = 12
_MARK = "KERAS_MP_TRANSFORMER_MEMORY "


def _step_clock():
    import keras

    class StepClock(keras.callbacks.Callback):
        """Each step's process CPU and wall time (``laps``)."""

        def on_train_batch_begin(self, batch, logs=None):
            self._start = (time.process_time(), time.perf_counter())

        def on_train_batch_end(self, batch, logs=None):
            c, w = self._start
            self.laps.append((time.process_time() - c, time.perf_counter() - w))

        def on_train_begin(self, logs=None):
            self.laps = []

    return StepClock()


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    variant = spec["variant"]
    if variant == "keras_mp_graph":
        os.environ["KERAS_MP_EXECUTION"] = "graph"
    import keras
    import tensorflow as tf

    from .models import get

    def rss(field):
        with open("/proc/self/status", encoding="ascii") as f:
            return next(int(ln.split()[1]) / 1024 for ln in f if ln.startswith(field))

    size = dict(SIZE, batch=spec["batch"])
    steps = 2 * STEPS if variant == "keras_mp_sampling" else STEPS
    build, data = get("transformer", size, 4)
    baseline = rss("VmRSS:")
    keras.utils.set_random_seed(0)
    cbs = [_step_clock()]
    scope = keras.RematScope(REMAT[variant]) if variant in REMAT else contextlib.nullcontext()
    if variant.startswith("keras_mp"):
        import keras_mp
        from keras_mp import callbacks, policies

        with policies.policy_scope("adaptive"), scope:
            model = keras_mp.fuse(build(), inplace=True)
        cbs.append(callbacks.AdaptivePrecision(interval=10, probe_every=20)
                   if variant == "keras_mp_sampling" else callbacks.AdaptivePrecision())
    else:
        previous = keras.config.dtype_policy()
        keras.config.set_dtype_policy(variant.removeprefix("keras_").removesuffix("_remat"))
        with scope:
            model = build()
        keras.config.set_dtype_policy(previous)
    model.compile(optimizer=keras.optimizers.Adam(1e-4),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=cbs)
    try:
        allocator = tf.config.experimental.get_memory_info("CPU:0")["peak"] / 2**20
    except (ValueError, RuntimeError):
        allocator = None
    mode = None
    if variant.startswith("keras_mp"):
        from keras_mp import execution

        mode = execution.chosen(model)
    half = cbs[0].laps[-(steps // 2):]
    return {"peak_rss_mib": rss("VmHWM:"), "allocator_peak_mib": allocator,
            "baseline_rss_mib": baseline, "mode": mode,
            "step_cpu_s": statistics.median(c for c, _ in half),
            "step_wall_s": statistics.median(w for _, w in half)}


def _measure(specs: list[dict[str, Any]], parallel: int) -> list[dict[str, Any]]:
    module = f"{__package__}.transformer_memory" if __package__ else \
        "benchmarks.transformer_memory"
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)

    def one(spec):
        proc = subprocess.run([sys.executable, "-P", "-m", module, "--child", json.dumps(spec)],
                              capture_output=True, text=True, env=env)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(_MARK)]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"{spec}: exit status {proc.returncode}: "
                               f"{proc.stderr.strip()[-500:]}")
        return json.loads(lines[-1][len(_MARK):])

    with ThreadPoolExecutor(parallel) as pool:
        return list(pool.map(one, specs))


def run(variants: Sequence[str] = VARIANTS, repeats: int = 2, parallel: int = 2,
        batch: int = SIZE["batch"]) -> dict[str, dict[str, Any]]:
    """Peak memory per variant: ``{variant: {"peak_rss_mib": {"median", "min",
    "max", "samples"}, "allocator_peak_mib": ..., "baseline_rss_mib": ...,
    "mode": ...}}`` (MiB; the repeats interleaved across variants)."""
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        raise ValueError(f"`variants` must be among {VARIANTS}, got {bad}.")
    specs = [dict(variant=v, batch=batch) for _ in range(repeats) for v in variants]
    out: dict[str, dict[str, Any]] = {}
    for spec, r in zip(specs, _measure(specs, parallel)):
        e = out.setdefault(spec["variant"], {"samples": [], "allocator": [], "base": []})
        e["samples"].append(r["peak_rss_mib"])
        e["allocator"].append(r["allocator_peak_mib"])
        e["base"].append(r["baseline_rss_mib"])
        e.setdefault("cpu", []).append(r["step_cpu_s"])
        e.setdefault("wall", []).append(r["step_wall_s"])
        e["mode"] = r["mode"]
    for e in out.values():
        s = e.pop("samples")
        e["peak_rss_mib"] = {"median": statistics.median(s), "min": min(s), "max": max(s),
                             "samples": s}
        alloc = [a for a in e.pop("allocator") if a is not None]
        e["allocator_peak_mib"] = statistics.median(alloc) if alloc else None
        e["baseline_rss_mib"] = statistics.median(e.pop("base"))
        for clock in ("cpu", "wall"):
            t = e.pop(clock)
            e[f"step_{clock}_s"] = {"median": statistics.median(t), "min": min(t),
                                    "max": max(t), "samples": t}
    return out


def largest_batch(variant: str, budget_mib: float, batches: Sequence[int] = (32, 64, 96),
                  parallel: int = 2) -> dict[str, Any]:
    """The largest batch (a multiple of 8) whose peak RSS fits ``budget_mib``:
    a line through the peaks at ``batches``, then a check at its answer."""
    if len(batches) < 2:
        raise ValueError(f"`batches` must hold at least two sizes, got {batches!r}.")
    peaks = [r["peak_rss_mib"] for r in
             _measure([dict(variant=variant, batch=b) for b in batches], parallel)]
    n = len(batches)
    mx, my = sum(batches) / n, sum(peaks) / n
    slope = sum((b - mx) * (p - my) for b, p in zip(batches, peaks)) / \
        sum((b - mx) ** 2 for b in batches)
    intercept = my - slope * mx
    best = max(8, int((budget_mib - intercept) / slope) // 8 * 8)
    check = _measure([dict(variant=variant, batch=best)], 1)[0]["peak_rss_mib"]
    while check > budget_mib and best > 8:
        best -= 8
        check = _measure([dict(variant=variant, batch=best)], 1)[0]["peak_rss_mib"]
    return {"batch": best, "peak_rss_mib": check, "mib_per_row": slope,
            "fixed_mib": intercept, "measured": dict(zip(batches, peaks))}


def _table(results: dict[str, dict[str, Any]]) -> str:
    ref = results.get("keras_mixed_bfloat16")
    lines = ["| variant | peak RSS MiB (median) | spread | vs Keras mixed_bfloat16 | "
             "allocator peak MiB | CPU s / step (spread) | wall s / step (spread) | mode |",
             "| --- |" + " ---: |" * 6 + " --- |"]
    for v, e in results.items():
        p = e["peak_rss_mib"]
        ratio = f"{p['median'] / ref['peak_rss_mib']['median']:.2f}x" if ref else ""
        alloc = "" if e["allocator_peak_mib"] is None else f"{e['allocator_peak_mib']:.0f}"
        cpu, wall = e["step_cpu_s"], e["step_wall_s"]
        lines.append(f"| {v} | {p['median']:.0f} | {p['max'] - p['min']:.0f} | {ratio} | "
                     f"{alloc} | {cpu['median']:.3f} ({cpu['max'] - cpu['min']:.3f}) | "
                     f"{wall['median']:.3f} ({wall['max'] - wall['min']:.3f}) | "
                     f"{e['mode'] or ''} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--budget", type=float, default=None,
                        help="MiB: also find the largest batch that fits")
    parser.add_argument("--batches", default="32,64,96")
    parser.add_argument("--variants", default=None,
                        help=f"comma-separated, among {', '.join(VARIANTS)} (default: all)")
    args = parser.parse_args(argv)
    if args.child is not None:
        print(_MARK + json.dumps(_child(json.loads(args.child))), flush=True)
        return
    variants = args.variants.split(",") if args.variants else \
        [v for v in VARIANTS if not (args.quick and v == "keras_mp_sampling")]
    repeats = args.repeats or (1 if args.quick else 2)
    results = run(variants, repeats=repeats)
    print(f"2-block Transformer, T={SIZE['length']}, d={SIZE['dim']}, batch {SIZE['batch']}, "
          f"Adam, {STEPS} steps ({2 * STEPS} for keras_mp_sampling); {repeats} repeats\n")
    print(_table(results))
    if args.budget:
        batches = [int(b) for b in args.batches.split(",")]
        for v in ("keras_mixed_bfloat16", "keras_mp"):
            r = largest_batch(v, args.budget, batches)
            print(f"\nlargest batch within {args.budget:.0f} MiB, {v}: {r['batch']} "
                  f"(peak {r['peak_rss_mib']:.0f} MiB; {r['mib_per_row']:.1f} MiB per row "
                  f"over {r['fixed_mib']:.0f} MiB; measured {r['measured']})")


if __name__ == "__main__":
    main()
