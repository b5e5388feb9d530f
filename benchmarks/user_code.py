"""Code users bring, timed against the Keras policy they would have used:
each variant in a fresh process per round, start-up included.

The scenarios (issue 39, item 4; issue 49, item 4):

* ``small_fit``: the keras-io "customizing what happens in fit" guide's model
  (``Dense(1)`` on 32 features, Adam, MSE + MAE, 1000 rows, batch 32, 3
  epochs: 96 steps). The figure is the wall (and process CPU) time of
  building, compiling and fitting the model in a fresh Python process after
  TensorFlow and Keras are imported, keras_mp's import and start-up (device
  profile, measurements, execution trial, probes) included. keras_mp's
  ``"adaptive"`` is compared with Keras ``float32`` (what ``"adaptive"`` is on a
  CPU without 16-bit units), ``"adaptive_float16"`` with Keras
  ``mixed_float16``. ``--cache`` names the directory of
  :mod:`keras_mp.device.cache` the keras_mp processes use (``off``: none,
  so every process measures as on a first run; the default: a fresh
  temporary directory, so the first round fills it and the later ones read it).
* ``sepconv``: keras-io's ``image_classification_from_scratch`` network,
  shrunk (RandomFlip, RandomRotation, Rescaling, an entry Conv2D + BN + relu,
  blocks of SeparableConv2D + BN + relu, MaxPooling2D, a residual 1x1 Conv2D
  of stride 2 and ``layers.add``, GlobalAveragePooling2D, Dropout, Dense) on
  synthetic 64x64 images: seconds per training step after a warm-up epoch,
  ``"adaptive_float16"`` against Keras ``mixed_float16``, in a fresh process
  per variant and round. The keras-io run (4 epochs of 23k images) is large
  enough for adaptation to pay off; this shrunk one (30 warm-up steps) is not
  (:mod:`keras_mp.adaptive.decisions.gain` would train it in float32), so keras_mp
  adapts every fit here (``autofit.set_min_saving(0)``), as it would adapt
  the user's.

* one scenario per keras.io example of :mod:`benchmarks.keras_io_examples`
  (``distillation``, ``collaborative``, ``multi_io``, ``structured``,
  ``seq2seq``, ``ts_transformer``, ``ts_fcn``, ``unet``; issue 49, item 4):
  the wall and CPU time from setting the policy to the end of the example's
  ``fit`` (building, ``adapt`` calls, compiling, every start-up cost),
  ``fit`` alone beside it (``fit_wall_s``), each keras_mp process with an
  empty measurement cache of its own unless ``--cache`` names one.
  ``"adaptive"`` is compared with the Keras policy of the dtype it picks on
  this CPU (``mixed_bfloat16`` where bfloat16 is fast, float32 where it is
  float32 alone, and there also Keras float32 with ``jit_compile=True``,
  the other one-line set-up),
  ``"adaptive_float16"`` with ``mixed_float16``. ``--scale`` shrinks or
  grows the examples' data (1: the sizes in that module).

Rounds are interleaved (A, B, A, B, ...), so that load from other processes
on a shared machine falls on every variant alike; medians and spreads
(max - min) of each clock are reported, with the machine's CPU.

Run: ``python -m benchmarks.user_code [--scenario small_fit|sepconv|EXAMPLE|examples]
[--rounds 5] [--scale 1] [--policy adaptive]`` (``examples``: every example in turn;
``--policy``: that keras_mp policy's pair alone).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from .common import cpu_name
from .keras_io_examples import BUILDERS, xception_downsampling

__all__ = ["SCENARIOS", "EXAMPLES", "PAIRS", "pairs", "run", "main"]

#: The keras.io examples (:mod:`benchmarks.keras_io_examples`), one scenario each.
EXAMPLES = tuple(BUILDERS)
#: Stands for the Keras policy of the dtype ``"adaptive"`` picks on this CPU (:func:`pairs`).
MATCHING = "keras_matching"
#: Keras float32 with ``jit_compile=True``: compared too where ``"adaptive"`` is float32 alone.
XLA = "keras_float32_xla"
#: scenario -> the (keras_mp variant, Keras variant) pairs it compares.
PAIRS: dict[str, tuple[tuple[str, str], ...]] = {
    "small_fit": (("adaptive", "keras_float32"), ("adaptive_float16", "keras_mixed_float16")),
    "sepconv": (("adaptive_float16", "keras_mixed_float16"),),
    **{name: (("adaptive", MATCHING), ("adaptive_float16", "keras_mixed_float16"))
       for name in EXAMPLES},
}
SCENARIOS = tuple(PAIRS)
#: ``cache`` value: every keras_mp process starts with an empty cache of its own.
EMPTY = "empty"
_MARK = "USER_CODE "


def pairs(scenario: str) -> tuple[tuple[str, str], ...]:
    """``scenario``'s pairs with :data:`MATCHING` resolved on this CPU:
    ``keras_mixed_bfloat16`` (or ``keras_mixed_float16``) where ``"adaptive"``
    picks that dtype first, ``keras_float32`` where it is float32 alone."""
    if scenario not in PAIRS:
        raise ValueError(f"`scenario` must be one of {SCENARIOS}, got {scenario!r}.")
    from keras_mp.device import default_candidates

    first = default_candidates()[0]
    keras_policy = "keras_float32" if first == "float32" else f"keras_mixed_{first}"
    resolved = tuple((mp, keras_policy if k == MATCHING else k) for mp, k in PAIRS[scenario])
    if first == "float32" and any(k == MATCHING for _, k in PAIRS[scenario]):
        # On a float32-only CPU the best one-line Keras set-up may be XLA.
        resolved += (("adaptive", XLA),)
    return resolved


def _set_policy(variant: str) -> None:
    import keras

    if variant == XLA:  # Keras float32 with every model compiled jit_compile=True
        keras.mixed_precision.set_global_policy("float32")
        compile_ = keras.Model.compile
        keras.Model.compile = lambda self, *a, **k: compile_(
            self, *a, **{**k, "jit_compile": True})
    elif variant.startswith("keras_"):
        keras.mixed_precision.set_global_policy(variant.removeprefix("keras_"))
    else:
        import keras_mp

        keras_mp.set_global_policy(variant)


def _small_fit(variant: str) -> dict[str, float]:
    import keras
    import numpy as np

    c0, w0 = time.process_time(), time.perf_counter()
    _set_policy(variant)
    inputs = keras.Input(shape=(32,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    rng = np.random.default_rng(0)
    x, y = rng.random((1000, 32)).astype("float32"), rng.random((1000, 1)).astype("float32")
    model.fit(x, y, epochs=3, verbose=0)
    return {"cpu_s": time.process_time() - c0, "wall_s": time.perf_counter() - w0}


def sepconv_model(size: int = 64, widths: Sequence[int] = (32, 64, 128)):
    """keras-io's image_classification_from_scratch network, shrunk."""
    import keras
    from keras import layers

    inputs = keras.Input(shape=(size, size, 3))
    x = layers.RandomFlip("horizontal")(inputs)
    x = layers.RandomRotation(0.1)(x)
    x = layers.Rescaling(1.0 / 255)(x)
    x = xception_downsampling(x, widths[0], widths)
    x = layers.SeparableConv2D(2 * widths[-1], 3, padding="same")(x)
    x = layers.BatchNormalization()(x)
    x = layers.Activation("relu")(x)
    x = layers.GlobalAveragePooling2D()(x)
    x = layers.Dropout(0.25)(x)
    return keras.Model(inputs, layers.Dense(1)(x))


def _sepconv(variant: str, steps: int = 10) -> dict[str, float]:
    import keras
    import numpy as np
    import tensorflow as tf

    _set_policy(variant)
    if not variant.startswith("keras_"):
        from keras_mp.adaptive.fit import autofit

        autofit.set_min_saving(0)  # as the full-size fit, which can gain (module docstring)
    model = sepconv_model()
    model.compile(optimizer=keras.optimizers.Adam(3e-4),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True),
                  metrics=[keras.metrics.BinaryAccuracy(name="acc")])
    rng = np.random.default_rng(0)
    x = rng.integers(0, 255, (16 * steps, 64, 64, 3)).astype("float32")
    y = rng.integers(0, 2, (16 * steps, 1)).astype("float32")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(16).cache()
    model.fit(ds, epochs=3, verbose=0)  # tracing, keras_mp's first statistics steps
    c0, w0 = time.process_time(), time.perf_counter()
    model.fit(ds, epochs=2, verbose=0)
    return {"cpu_s": (time.process_time() - c0) / (2 * steps),
            "wall_s": (time.perf_counter() - w0) / (2 * steps)}


def _example(name: str, variant: str, scale: float) -> dict[str, float]:
    from .keras_io_examples import build

    c0, w0 = time.process_time(), time.perf_counter()
    _set_policy(variant)
    _, fit = build(name, scale)
    w1 = time.perf_counter()
    fit()
    return {"cpu_s": time.process_time() - c0, "wall_s": time.perf_counter() - w0,
            "fit_wall_s": time.perf_counter() - w1}


def _child(scenario: str, variant: str, scale: float = 1.0) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras  # noqa: F401 - imported before the clock starts, as for every variant
    import tensorflow  # noqa: F401

    if scenario in EXAMPLES:
        result = _example(scenario, variant, scale)
    else:
        result = (_small_fit if scenario == "small_fit" else _sepconv)(variant)
    print(_MARK + json.dumps(result), flush=True)


def _one(scenario: str, variant: str, cache: str, scale: float = 1.0) -> dict[str, float]:
    if cache == EMPTY:  # a new, empty cache for this process alone
        cache = tempfile.mkdtemp(prefix="keras_mp_cache_")
    env = dict(os.environ, KERAS_MP_CACHE_DIR=cache, TF_CPP_MIN_LOG_LEVEL="3")
    # Modules compiled once, as pip installs keras-mp (and Keras, TensorFlow): a
    # source checkout under PYTHONDONTWRITEBYTECODE=1 compiles keras_mp's 50
    # modules in every process (0.09-0.13 s against 0.03 s, AMX Xeon).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-m", "benchmarks.user_code", "--child", scenario,
                           variant, "--scale", repr(scale)],
                          capture_output=True, text=True, env=env, cwd=root)
    line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith(_MARK)), None)
    if line is None:
        raise RuntimeError(f"{scenario}/{variant} failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[len(_MARK):])


def _stats(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "spread": max(values) - min(values),
            "samples": values}


def run(scenario: str = "small_fit", rounds: int = 5, cache: str | None = None,
        log=print, scale: float = 1.0, policy: str | None = None) -> dict[str, Any]:
    """Times ``scenario``'s pairs in ``rounds`` interleaved rounds, each
    variant in a fresh process; returns per variant the median and spread of
    CPU and wall seconds and per pair the ratios (keras_mp / Keras).
    ``cache``: the keras_mp processes' ``KERAS_MP_CACHE_DIR`` (None: for the
    keras.io examples :data:`EMPTY`, an empty one per process, as on a first
    run; for the others a fresh directory the first round fills; ``"off"``:
    none);
    ``scale``: the examples' data (:mod:`benchmarks.keras_io_examples`);
    ``policy``: only the pair of this keras_mp policy (None: every pair)."""
    if scenario not in PAIRS:
        raise ValueError(f"`scenario` must be one of {SCENARIOS}, got {scenario!r}.")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"`rounds` must be an int >= 1, got {rounds!r}.")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale <= 100:
        raise ValueError(f"`scale` must be a number in (0, 100], got {scale!r}.")
    if cache is None:
        cache = EMPTY if scenario in EXAMPLES else tempfile.mkdtemp(prefix="keras_mp_cache_")
    compared = pairs(scenario)
    if policy is not None:
        if policy not in {mp for mp, _ in compared}:
            raise ValueError(f"`policy` must be one of {sorted({mp for mp, _ in compared})} "
                             f"for {scenario!r}, got {policy!r}.")
        compared = tuple(p for p in compared if p[0] == policy)
    variants = list(dict.fromkeys(v for pair in compared for v in pair))  # each once
    clocks = ("cpu_s", "wall_s", "fit_wall_s") if scenario in EXAMPLES else ("cpu_s", "wall_s")
    samples: dict[str, dict[str, list[float]]] = {v: {c: [] for c in clocks} for v in variants}
    for r in range(rounds):
        for v in variants:
            got = _one(scenario, v, cache, scale)
            for clock in clocks:
                samples[v][clock].append(got[clock])
            log(f"round {r + 1} {v}: " + ", ".join(f"{c} {got[c]:.3f} s" for c in clocks))
    result: dict[str, Any] = {
        "scenario": scenario, "rounds": rounds, "cache": cache, "cpu": cpu_name(),
        "cores": os.cpu_count(), "scale": scale,
        "variants": {v: {c: _stats(s) for c, s in samples[v].items()} for v in variants}}
    result["ratios"] = {
        f"{mp}/{k}": {c: result["variants"][mp][c]["median"] / result["variants"][k][c]["median"]
                      for c in clocks}
        for mp, k in compared}
    return result


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=(*SCENARIOS, "examples"), default="small_fit")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cache", default=None,
                        help="KERAS_MP_CACHE_DIR for the keras_mp processes ('off': none; "
                             "'empty': a new one per process, the examples' default)")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="the keras.io examples' data, times their shrunk sizes")
    parser.add_argument("--policy", default=None,
                        help="only the pair of this keras_mp policy (adaptive, adaptive_float16)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(*args.child, scale=args.scale)
        return
    results = []
    for scenario in (EXAMPLES if args.scenario == "examples" else (args.scenario,)):
        # A fresh cache per scenario unless one is named: each starts empty.
        result = run(scenario, args.rounds, args.cache, scale=args.scale, policy=args.policy)
        results.append(result)
        print(f"{result['scenario']}, {result['rounds']} interleaved rounds, fresh processes, "
              f"{result['cpu']} ({result['cores']} cores), cache {result['cache']}")
        for v, e in result["variants"].items():
            print(f"  {v:22s} cpu {e['cpu_s']['median']:.3f} s (spread "
                  f"{e['cpu_s']['spread']:.3f})  wall {e['wall_s']['median']:.3f} s (spread "
                  f"{e['wall_s']['spread']:.3f})")
        for pair, r in result["ratios"].items():
            print(f"  {pair}: " + ", ".join(f"{c.removesuffix('_s').replace('_', ' ')} "
                                            f"{v:.2f}x" for c, v in r.items()), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
