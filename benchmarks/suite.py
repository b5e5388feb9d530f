"""The ``keras-mp bench`` suite: keras-mp against every Keras one-liner, side by side.

For each model (``mlp``, ``cnn``, ``transformer``; ``--quick`` shrinks them)
these variants train on the same synthetic data in one process:

* ``keras_float32``: plain Keras, ``compile()`` defaults;
* ``keras_float32_xla``: plain Keras, ``compile(jit_compile=True)``;
* ``keras_mixed_bfloat16`` and ``keras_mixed_bfloat16_xla``: Keras's
  ``mixed_bfloat16`` policy, without and with XLA;
* ``keras_mixed_float16`` and ``keras_mixed_float16_xla``: Keras's
  ``mixed_float16`` (loss scaling by Keras's own optimizer wrapper), without
  and with XLA (dropped, with the reason, where XLA does not compile it);
* ``keras_mp``: keras-mp's recommended set-up,
  ``keras_mp.set_global_policy("adaptive")``, :func:`keras_mp.fuse`, the
  :class:`~keras_mp.callbacks.AdaptivePrecision` callback (which picks the
  device's fast dtypes and the measured execution mode,
  :mod:`keras_mp.execution`), ``compile()`` defaults.

Every variant runs the same number of training steps per round (one
``model.fit`` epoch over a ``tf.data`` dataset, 20 steps by default: the
``AdaptivePrecision`` default gathers statistics on one call in 20, so every
round of keras_mp holds exactly one statistics step, at its steady-state
rate); after a warm-up (two 8-row steps, then one epoch: tracing, XLA
compilation, keras_mp's measured choice of graph or XLA and the first
statistics step, all before timing), the rounds are interleaved across
variants and timed by process CPU time and by wall time. Each figure is the
median over the rounds with its spread (max - min), per training step.
keras_mp's decisions (one per 100 calls) fall inside the rounds as they
would in training. Its float32 probe (one call in 200 by default) is timed
on its own after the rounds (:meth:`AdaptivePrecision.probe
<keras_mp.callbacks.AdaptivePrecision.probe>`, the same computation on one
batch) and its cost per step (the probe's time divided by ``probe_every``)
is **added** to keras_mp's figures (``probe`` in the results says how much).
Ratios are taken against ``keras_float32`` and against the best Keras
variant (the fastest of the six one-liners, by the same clock) measured in
the same run.

On a GPU the peak device memory TensorFlow's allocator reached during one
epoch is reported (``gpu_peak_mib``, MiB); on CPU memory is not reported
(the process's resident size mostly reflects allocator caches).

Run: ``python -m benchmarks.suite [--quick] [--models mlp,cnn] [--out DIR]``
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from .common import cpu_name, interleaved_clocks, quiet_tensorflow

__all__ = ["MODELS", "VARIANTS", "KERAS_VARIANTS", "run", "main"]

MODELS: tuple[str, ...] = ("mlp", "cnn", "transformer")
KERAS_VARIANTS: tuple[str, ...] = (
    "keras_float32", "keras_float32_xla", "keras_mixed_bfloat16", "keras_mixed_bfloat16_xla",
    "keras_mixed_float16", "keras_mixed_float16_xla")
VARIANTS: tuple[str, ...] = (*KERAS_VARIANTS, "keras_mp")

# name -> (full, quick) sizes
_SIZES: dict[str, dict[str, dict[str, int]]] = {
    "mlp": {"full": dict(batch=256, features=1024, width=2048, depth=4),
            "quick": dict(batch=256, features=1024, width=1024, depth=3)},
    "cnn": {"full": dict(batch=32, side=64, filters=32),
            "quick": dict(batch=32, side=32, filters=32)},
    "transformer": {"full": dict(batch=32, length=128, dim=512, blocks=2),
                    "quick": dict(batch=32, length=128, dim=256, blocks=2)},
}
# (steps per round, rounds)
_SCHEDULE = {"full": (20, 7), "quick": (20, 5)}
#: A variant whose one step on 8 rows (after tracing) is this many times
#: slower than keras_float32's is reported from that step and not timed
#: (Keras's mixed_float16 on an AMX Xeon: 61-439x slower than float32).
TOO_SLOW = 8.0


def _builder(kind: str, size: dict[str, int]) -> tuple[Callable[[], Any], tuple[int, ...]]:
    import keras

    def head(h):
        out = keras.layers.Dense(10)(h)
        return keras.layers.Activation("linear", dtype="float32")(out)

    if kind == "mlp":
        shape = (size["features"],)

        def build():
            inp = keras.Input(shape)
            h = inp
            for _ in range(size["depth"]):
                h = keras.layers.Dense(size["width"], activation="relu")(h)
            return keras.Model(inp, head(h))
    elif kind == "cnn":
        shape = (size["side"], size["side"], 3)

        def build():
            inp = keras.Input(shape)
            h = inp
            for k in (1, 2, 4):
                for _ in range(2):
                    h = keras.layers.Conv2D(size["filters"] * k, 3, padding="same",
                                            activation="relu")(h)
                h = keras.layers.MaxPooling2D()(h)
            return keras.Model(inp, head(keras.layers.GlobalAveragePooling2D()(h)))
    elif kind == "transformer":
        shape = (size["length"], size["dim"])
        d = size["dim"]

        def build():
            inp = keras.Input(shape)
            h = inp
            for _ in range(size["blocks"]):
                a = keras.layers.MultiHeadAttention(8, d // 8)(h, h)
                h = keras.layers.LayerNormalization()(h + a)
                f = keras.layers.Dense(d)(keras.layers.Dense(4 * d, activation="gelu")(h))
                h = keras.layers.LayerNormalization()(h + f)
            return keras.Model(inp, head(keras.layers.GlobalAveragePooling1D()(h)))
    else:
        raise ValueError(f"`models` must be among {MODELS}, got {kind!r}.")
    return build, shape


def _gpu_peak_mib(fn: Callable[[], Any]) -> float | None:
    """Peak GPU memory (MiB) TensorFlow's allocator reached during ``fn()``."""
    import tensorflow as tf

    gpus = tf.config.list_logical_devices("GPU")
    if not gpus:
        return None
    tf.config.experimental.reset_memory_stats(gpus[0].name)
    fn()
    return tf.config.experimental.get_memory_info(gpus[0].name)["peak"] / 2**20


def _make_variant(variant: str, build: Callable[[], Any], data, steps: int):
    """A callable that trains one epoch of ``steps`` steps, and its state."""
    import keras

    import keras_mp
    from keras_mp import callbacks, policies

    keras.utils.set_random_seed(0)
    cbs: list[Any] = []
    jit: bool | str = "auto"
    if variant == "keras_mp":
        with policies.policy_scope("adaptive"):
            model = keras_mp.fuse(build())
        cbs = [callbacks.AdaptivePrecision()]  # the defaults, as the README recommends
    else:
        policy = variant.removeprefix("keras_").removesuffix("_xla")
        jit = variant.endswith("_xla")
        with policies.policy_scope(policy):
            model = build()
    model.compile(optimizer=keras.optimizers.Adam(1e-4),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=jit)
    state: dict[str, Any] = {"model": model, "callback": cbs[0] if cbs else None}

    def train(n: int = steps, on=data):
        hist = model.fit(on, epochs=1, steps_per_epoch=n, verbose=0, callbacks=cbs,
                         shuffle=False)
        state["loss"] = float(hist.history["loss"][-1])

    return train, state


def _dtype_counts(model) -> dict[str, int]:
    """Layers with weights per compute dtype (what the variant really ran)."""
    counts: dict[str, int] = {}
    for layer in model._flatten_layers(include_self=False):
        if layer.weights:
            counts[layer.compute_dtype] = counts.get(layer.compute_dtype, 0) + 1
    return counts


def _add_probe_cost(entry: dict[str, Any], callback, data) -> dict[str, Any] | None:
    """Times ``callback``'s float32 probe on one batch (median of 3 calls
    after one to trace) and adds its cost per step (divided by
    ``probe_every``) to every sample of ``entry``. Returns what was added."""
    import statistics

    if callback.probe_every is None or getattr(callback, "_inert", False):
        return None
    batch = next(iter(data))
    callback.probe(batch)  # traces
    cpu, wall = [], []
    for _ in range(3):
        c0, w0 = time.process_time(), time.perf_counter()
        callback.probe(batch)
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    added = {"cpu_s": statistics.median(cpu), "wall_s": statistics.median(wall),
             "every": callback.probe_every}
    for clock in ("cpu", "wall"):
        per_step = added[f"{clock}_s"] / callback.probe_every
        added[f"per_step_{clock}_s"] = per_step
        e = entry[clock]
        e["samples"] = [x + per_step for x in e["samples"]]
        for k in ("median", "min", "max"):
            e[k] += per_step
    return added


def _machine(prof, exec_prof) -> dict[str, Any]:
    import keras
    import tensorflow as tf

    import keras_mp

    cpu = cpu_name()
    gpus = tf.config.list_physical_devices("GPU")
    gpu_names = [tf.config.experimental.get_device_details(g).get("device_name", g.name)
                 for g in gpus]
    return {"cpu": cpu, "cores": os.cpu_count(), "cpu_flags": sorted(prof.flags),
            "gpus": gpu_names, "device_type": prof.device_type,
            "fast_dtypes": list(prof.fast),
            "xla_step_speedup": {d: round(exec_prof.xla_speedup(d), 3)
                                 for d in exec_prof.step},
            "tensorflow": tf.__version__, "keras": keras.__version__,
            "keras_mp": keras_mp.__version__,
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


def _best(entries: dict[str, dict[str, Any]], clock: str) -> str:
    keras_ok = [v for v in KERAS_VARIANTS if v in entries]
    return min(keras_ok, key=lambda v: entries[v][clock]["median"])


def _table(entries: dict[str, dict[str, Any]]) -> str:
    best_cpu, best_wall = _best(entries, "cpu"), _best(entries, "wall")
    base = entries["keras_float32"]
    lines = ["| variant | CPU ms/step | spread | wall ms/step | spread | vs float32 CPU | "
             "vs float32 wall | vs best Keras CPU | vs best Keras wall | final loss |",
             "| --- |" + " ---: |" * 9]
    for v, e in entries.items():
        c, w = e["cpu"], e["wall"]
        cells = [v + (" (mode: " + e["mode"] + ")" if e.get("mode") else ""),
                 f"{c['median'] * 1e3:.1f}", f"{c['spread'] * 1e3:.1f}",
                 f"{w['median'] * 1e3:.1f}", f"{w['spread'] * 1e3:.1f}",
                 f"{base['cpu']['median'] / c['median']:.2f}x",
                 f"{base['wall']['median'] / w['median']:.2f}x",
                 f"{entries[best_cpu]['cpu']['median'] / c['median']:.2f}x",
                 f"{entries[best_wall]['wall']['median'] / w['median']:.2f}x",
                 "" if e.get("final_loss") is None else f"{e['final_loss']:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    note = ""
    probe = (entries.get("keras_mp") or {}).get("probe")
    if probe:
        note = (f" keras_mp's figures include its float32 probe: {probe['cpu_s'] * 1e3:.0f} ms "
                f"CPU ({probe['wall_s'] * 1e3:.0f} ms wall) per call, one call in "
                f"{probe['every']}, i.e. +{probe['per_step_cpu_s'] * 1e3:.2f} ms CPU per step.")
    return "\n".join(lines) + (f"\n\nBest Keras one-liner: `{best_cpu}` by CPU time, "
                               f"`{best_wall}` by wall time." + note)


def run(models: Sequence[str] = MODELS, quick: bool = False,
        variants: Sequence[str] = VARIANTS, out: str | None = None,
        log: Callable[[str], None] = print, rounds: int | None = None,
        steps: int | None = None) -> dict[str, Any]:
    """Runs the suite and returns its figures (and writes them under ``out``).

    Args:
        models: among :data:`MODELS`.
        quick: smaller shapes (a few minutes on 2 cores).
        variants: among :data:`VARIANTS`; ``keras_float32`` is always run (it
            is the baseline of every ratio).
        out: a folder for ``bench.json`` and ``bench.png``, or None.
        log: where progress lines go.
        rounds: interleaved timed rounds (>= 5); 5 in quick mode, 7 otherwise.
        steps: training steps per round and variant (>= 5); 20 (a multiple
            of ``AdaptivePrecision``'s default ``statistics_every``, so
            keras_mp's statistics steps are timed at their steady-state rate).

    Returns:
        ``{"machine": {...}, "quick": bool, "rounds": int, "steps": int,
        "results": {model: {variant: {...}}}, "skipped": {model: {variant:
        reason}}, "tables": {model: markdown}}``; each variant has ``cpu`` and
        ``wall`` (``median``, ``spread``, ``min``, ``max``, ``samples``, s per
        step), ``vs_float32`` and ``vs_best_keras`` (``{"cpu": x, "wall": x}``),
        ``final_loss``, ``gpu_peak_mib`` (None off GPU), ``compute_dtypes``
        (layers with weights per compute dtype at the end) and, for keras_mp,
        ``mode`` (``"xla"`` or ``"graph"``, as :mod:`keras_mp.execution`
        measured on the model) and ``probe`` (the float32 probe's seconds
        per call, ``cpu_s`` and ``wall_s``, ``every`` calls, and the
        ``per_step_cpu_s`` / ``per_step_wall_s`` added to its figures).
    """
    models = list(models)
    if not models:
        raise ValueError(f"`models` must name at least one of {MODELS}.")
    for m in models:
        if m not in MODELS:
            raise ValueError(f"`models` must be among {MODELS}, got {m!r}.")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"`variants` must be among {VARIANTS}, got {unknown}.")
    default_steps, default_rounds = _SCHEDULE["quick" if quick else "full"]
    steps = default_steps if steps is None else steps
    rounds = default_rounds if rounds is None else rounds
    for name, value in (("rounds", rounds), ("steps", steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 5:
            raise ValueError(f"`{name}` must be an int >= 5, got {value!r}.")
    variants = ["keras_float32"] + [v for v in VARIANTS if v in variants and v != "keras_float32"]
    if out is not None:
        os.makedirs(out, exist_ok=True)
        if not os.access(out, os.W_OK):
            raise PermissionError(f"`out` folder {out!r} is not writable.")
    quiet_tensorflow()
    import keras
    import numpy as np
    import tensorflow as tf

    from keras_mp import device, execution

    prof = device.profile()
    machine = _machine(prof, execution.profile())
    results: dict[str, dict[str, Any]] = {}
    skipped: dict[str, dict[str, str]] = {}
    tables: dict[str, str] = {}
    keras.utils.clear_session()
    for kind in models:
        size = _SIZES[kind]["quick" if quick else "full"]
        build, shape = _builder(kind, size)
        rng = np.random.default_rng(0)
        batch = size["batch"]
        x = rng.standard_normal((batch * steps,) + shape).astype("float32")
        y = rng.integers(0, 10, len(x))
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).cache().repeat()
        small = tf.data.Dataset.from_tensor_slices((x[:8], y[:8])).batch(8).repeat()
        log(f"[{kind}] building {len(variants)} variants ({size}), "
            f"{steps} steps x {rounds} rounds each")
        made: dict[str, tuple[Callable[[], Any], dict[str, Any]]] = {}
        skipped[kind] = {}
        t0 = time.perf_counter()
        pre: dict[str, float] = {}
        for v in variants:
            train, state = _make_variant(v, build, data, steps)
            try:
                # Tracing and XLA compilation on a few rows (the batch
                # dimension is unknown to the trace, so it is reused), then
                # one timed step there, to leave out what is far too slow to
                # time (seconds per full step).
                train(1, small)
                w0 = time.perf_counter()
                train(1, small)
                pre[v] = time.perf_counter() - w0
                if v in ("keras_float32", "keras_mp") or \
                        pre[v] <= TOO_SLOW * pre["keras_float32"]:
                    # Warm-up, one epoch: for keras_mp, its measured choice
                    # of execution mode (the first 18 calls) and the first
                    # statistics step (call 20) are traced here.
                    train()
            except Exception as e:  # noqa: BLE001 - e.g. XLA cannot compile this variant
                if v == "keras_float32":
                    raise
                reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
                skipped[kind][v] = f"{type(e).__name__}: {reason}"
                log(f"[{kind}] {v} skipped: {skipped[kind][v]}")
                continue
            # (keras_mp's second 8-row step is its XLA trial's compilation.)
            if v not in ("keras_float32", "keras_mp") and \
                    pre[v] > TOO_SLOW * pre["keras_float32"]:
                skipped[kind][v] = (
                    f"too slow to time: {pre[v] * 1e3:.0f} ms for one step of 8 rows, "
                    f"{pre[v] / pre['keras_float32']:.0f}x keras_float32 "
                    f"({pre['keras_float32'] * 1e3:.1f} ms)")
                log(f"[{kind}] {v} skipped: {skipped[kind][v]}")
                continue
            made[v] = (train, state)
        timings = interleaved_clocks({v: m[0] for v, m in made.items()}, rounds=rounds,
                                     warmup=0, per_call=steps)
        log(f"[{kind}] timed in {time.perf_counter() - t0:.0f} s")
        entries: dict[str, dict[str, Any]] = {}
        for v, (train, state) in made.items():
            model = state["model"]
            entries[v] = {**timings[v], "final_loss": state.get("loss"),
                          "gpu_peak_mib": _gpu_peak_mib(train),
                          "mode": execution.chosen(model) if v == "keras_mp" else None,
                          "compute_dtypes": _dtype_counts(model)}
            if v == "keras_mp" and state["callback"] is not None:
                entries[v]["probe"] = _add_probe_cost(entries[v], state["callback"], data)
                log(f"[{kind}] keras_mp probe: {entries[v]['probe']}")
        for clock in ("cpu", "wall"):
            best = _best(entries, clock)
            for e in entries.values():
                e.setdefault("vs_float32", {})[clock] = (
                    entries["keras_float32"][clock]["median"] / e[clock]["median"])
                e.setdefault("vs_best_keras", {})[clock] = (
                    entries[best][clock]["median"] / e[clock]["median"])
                e.setdefault("best_keras", {})[clock] = best
        results[kind] = entries
        tables[kind] = _table(entries)
        log(f"\n{kind} (per training step, batch {batch}):\n{tables[kind]}\n")
    report = {"machine": machine, "quick": quick, "rounds": rounds, "steps": steps,
              "results": results, "skipped": skipped, "tables": tables}
    if out is not None:
        with open(os.path.join(out, "bench.json"), "w") as f:
            json.dump(report, f, indent=2)
        report["plot"] = _plot(os.path.join(out, "bench.png"), results, machine)
        log(f"Wrote {os.path.join(out, 'bench.json')} and {report['plot']}")
    return report


def _plot(path: str, results: dict[str, dict[str, Any]], machine: dict[str, Any]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(results)
    variants = [v for v in VARIANTS if any(v in results[m] for m in models)]
    fig, axes = plt.subplots(1, 2, figsize=(4 + 3 * len(models), 4.6), sharey=True)
    width = 0.8 / len(variants)
    colors = plt.get_cmap("tab10").colors
    for ax, clock, label in zip(axes, ("cpu", "wall"), ("process CPU time", "wall time")):
        for i, v in enumerate(variants):
            xs, vals, lo, hi = [], [], [], []
            for j, m in enumerate(models):
                if v not in results[m]:
                    continue
                base = results[m]["keras_float32"][clock]["median"]
                e = results[m][v][clock]
                r = base / e["median"]
                xs.append(j + (i - (len(variants) - 1) / 2) * width)
                vals.append(r)
                # The spread of the variant's own rounds, as a ratio.
                lo.append(r - base / e["max"])
                hi.append(base / e["min"] - r)
            ax.bar(xs, vals, width, yerr=[lo, hi], capsize=2, label=v,
                   color=colors[i % len(colors)], edgecolor="black" if v == "keras_mp" else None,
                   linewidth=1.2 if v == "keras_mp" else 0)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(models)), models)
        ax.set_title(f"by {label}", fontsize=10)
        ax.set_ylim(bottom=0)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("speed-up vs Keras float32 (higher is faster)")
    gpu = ", ".join(machine.get("gpus") or [])
    fig.suptitle(f"keras-mp {machine['keras_mp']} vs Keras {machine['keras']} (TF "
                 f"{machine['tensorflow']}) on {gpu or machine['cpu']}, "
                 f"{machine['cores']} cores\nmedian of interleaved rounds, bars: spread",
                 fontsize=9)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(0.83, 0.5), fontsize=8,
               frameon=False)
    fig.tight_layout(rect=(0, 0, 0.83, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--out", default=None)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args(argv)
    run(models=[m for m in args.models.split(",") if m], quick=args.quick, out=args.out,
        rounds=args.rounds, steps=args.steps,
        variants=[v for v in args.variants.split(",") if v])


if __name__ == "__main__":
    main()
