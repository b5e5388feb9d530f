"""The ``keras-mp bench`` suite: plain Keras against keras-mp, side by side.

For each model (``mlp``, ``cnn``, ``transformer``, shapes of
``../shared/anchors/keras_step_time.py``; ``--quick`` shrinks them) four
variants train on the same synthetic data in one process:

* ``keras_float32``: plain Keras, float32;
* ``keras_mixed_bfloat16``: plain Keras ``mixed_bfloat16``;
* ``keras_mixed_float16``: plain Keras ``mixed_float16`` (fewer steps: on a
  CPU without float16 units it is very slow);
* ``keras_mp``: ``keras_mp.set_global_policy("adaptive")`` (the device's fast
  dtypes), :func:`keras_mp.fuse`, and the :class:`AdaptivePrecision` callback.

Timed repeats are interleaved across variants, warm-up (tracing) excluded;
each figure is the median of the repeats with its spread, and every speed is
a ratio against ``keras_float32`` measured in the same run. Peak memory is
the growth of the process's peak RSS over one training call of each variant
(Linux resets the peak through ``/proc/self/clear_refs``), or the device's
peak where TensorFlow reports one (GPU).

Run: ``python -m benchmarks.suite [--quick] [--models mlp,cnn] [--out DIR]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from typing import Any

from .common import format_ratio_table, quiet_tensorflow, side_by_side

__all__ = ["MODELS", "VARIANTS", "run", "main"]

MODELS: tuple[str, ...] = ("mlp", "cnn", "transformer")
VARIANTS: tuple[str, ...] = ("keras_float32", "keras_mixed_bfloat16", "keras_mixed_float16",
                             "keras_mp")
_SLOW = {"keras_mixed_float16"}

# name -> (full, quick) sizes
_SIZES: dict[str, dict[str, dict[str, int]]] = {
    "mlp": {"full": dict(batch=256, features=1024, width=2048, depth=4),
            "quick": dict(batch=64, features=256, width=512, depth=2)},
    "cnn": {"full": dict(batch=32, side=64, filters=64),
            "quick": dict(batch=16, side=32, filters=16)},
    "transformer": {"full": dict(batch=32, length=128, dim=512, blocks=2),
                    "quick": dict(batch=8, length=32, dim=128, blocks=1)},
}


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


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _rss_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _peak_memory_mb(fn: Callable[[], Any]) -> float | None:
    """Peak memory one call of ``fn`` adds, in MiB (None if unmeasurable)."""
    import tensorflow as tf

    gpus = tf.config.list_logical_devices("GPU")
    if gpus:
        tf.config.experimental.reset_memory_stats(gpus[0].name)
        fn()
        return tf.config.experimental.get_memory_info(gpus[0].name)["peak"] / 2**20
    if not _reset_peak():
        return None
    before = _rss_mb("VmRSS")
    fn()
    return max(_rss_mb("VmHWM") - before, 0.0)


def _make_variant(variant: str, build: Callable[[], Any], x, y, batch: int, steps: int):
    import keras

    import keras_mp
    from keras_mp import callbacks, policies

    keras.utils.clear_session()
    keras.utils.set_random_seed(0)
    cbs: list[Any] = []
    if variant == "keras_mp":
        with policies.policy_scope("adaptive"):
            model = keras_mp.fuse(build())
        cbs = [callbacks.AdaptivePrecision(interval=max(steps, 1))]
    else:
        policy = variant.removeprefix("keras_")
        with policies.policy_scope(policy):
            model = build()
    model.compile(optimizer=keras.optimizers.Adam(1e-4),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    n = batch * steps
    state: dict[str, Any] = {}

    def train():
        hist = model.fit(x[:n], y[:n], batch_size=batch, epochs=1, verbose=0,
                         shuffle=False, callbacks=cbs)
        state["loss"] = float(hist.history["loss"][-1])
        return None

    return train, state, steps


def run(models: Sequence[str] = MODELS, quick: bool = False,
        variants: Sequence[str] = VARIANTS, out: str | None = None,
        log: Callable[[str], None] = print) -> dict[str, Any]:
    """Runs the suite and returns its figures (and writes them under ``out``).

    Args:
        models: among :data:`MODELS`.
        quick: small shapes and few steps (a minute or two on 2 cores).
        variants: among :data:`VARIANTS`; ``keras_float32`` is always run (it
            is every ratio's baseline).
        out: a folder for ``bench.json`` and ``bench.png``, or None.
        log: where progress lines go.

    Returns:
        ``{"machine": {...}, "results": {model: {variant: {...}}}, "tables":
        {model: markdown}}``; each variant has ``median_s``, ``spread_s``,
        ``speedup_vs_float32``, ``peak_mb``, ``final_loss``, ``steps``.
    """
    models = list(models)
    for m in models:
        if m not in MODELS:
            raise ValueError(f"`models` must be among {MODELS}, got {m!r}.")
    if not models:
        raise ValueError(f"`models` must name at least one of {MODELS}.")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"`variants` must be among {VARIANTS}, got {unknown}.")
    variants = ["keras_float32"] + [v for v in variants if v != "keras_float32"]
    if out is not None:
        os.makedirs(out, exist_ok=True)
        if not os.access(out, os.W_OK):
            raise PermissionError(f"`out` folder {out!r} is not writable.")
    quiet_tensorflow()
    import numpy as np
    import tensorflow as tf

    import keras_mp
    from keras_mp import device

    prof = device.profile()
    machine = {"processor": platform.processor() or platform.machine(),
               "cpu_flags": sorted(prof.flags), "device_type": prof.device_type,
               "fast_dtypes": list(prof.fast), "tensorflow": tf.__version__,
               "keras": __import__("keras").__version__, "keras_mp": keras_mp.__version__,
               "cores": os.cpu_count()}
    results: dict[str, dict[str, Any]] = {}
    tables: dict[str, str] = {}
    for kind in models:
        size = _SIZES[kind]["quick" if quick else "full"]
        build, shape = _builder(kind, size)
        rng = np.random.default_rng(0)
        batch = size["batch"]
        steps = 2 if quick else 4
        x = rng.standard_normal((batch * steps,) + shape).astype("float32")
        y = rng.integers(0, 10, len(x))
        log(f"[{kind}] building {len(variants)} variants ({size})")
        made = {}
        for v in variants:
            s = 1 if v in _SLOW else steps
            made[v] = _make_variant(v, build, x, y, batch, s)
        t0 = time.perf_counter()
        fast = {v: m[0] for v, m in made.items() if v not in _SLOW}
        timings = side_by_side(fast, steps=1, warmup=1, repeats=3 if quick else 5)
        for v in set(made) - set(fast):
            timings[v] = side_by_side({v: made[v][0]}, steps=1, warmup=1, repeats=1)[v]
        log(f"[{kind}] timed in {time.perf_counter() - t0:.0f} s; measuring memory")
        base = timings["keras_float32"]["median"] / made["keras_float32"][2]
        results[kind] = {}
        rows = []
        for v in variants:
            train, state, s = made[v]
            per_step = timings[v]["median"] / s
            entry = {"median_s": per_step, "spread_s": timings[v]["spread"] / s,
                     "speedup_vs_float32": base / per_step,
                     "peak_mb": _peak_memory_mb(train), "final_loss": state.get("loss"),
                     "steps": s}
            results[kind][v] = entry
            rows.append({"name": v, "median": per_step, "spread": entry["spread_s"],
                         "peak_mb": entry["peak_mb"], "final_loss": entry["final_loss"]})
        tables[kind] = format_ratio_table(rows, baseline="keras_float32")
        log(f"\n{kind} (per training step, batch {batch}):\n{tables[kind]}\n")
    report = {"machine": machine, "quick": quick, "results": results, "tables": tables}
    if out is not None:
        with open(os.path.join(out, "bench.json"), "w") as f:
            json.dump(report, f, indent=2)
        report["plot"] = _plot(os.path.join(out, "bench.png"), results)
        log(f"Wrote {os.path.join(out, 'bench.json')} and {report['plot']}")
    return report


def _plot(path: str, results: dict[str, dict[str, Any]]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(results)
    variants = list(next(iter(results.values())))
    fig, ax = plt.subplots(figsize=(2.5 + 2 * len(models), 3.8))
    width = 0.8 / len(variants)
    for i, v in enumerate(variants):
        vals = [results[m][v]["speedup_vs_float32"] for m in models]
        ax.bar([j + i * width for j in range(len(models))], vals, width, label=v)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + width * (len(variants) - 1) / 2 for j in range(len(models))], models)
    ax.set_yscale("log", base=2)
    ax.set_ylabel("speed-up vs Keras float32")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    run(models=[m for m in args.models.split(",") if m], quick=args.quick, out=args.out)


if __name__ == "__main__":
    main()
