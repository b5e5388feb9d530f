"""Adaptive float8 against Keras ``mixed_bfloat16`` and Keras all-float8, on
a Transformer, on a GPU with float8 units (H100/H200, L40, RTX 40xx).

Run from the repository root::

    python -m benchmarks.float8_gpu [--steps 10] [--rounds 5] [--out DIR]

On a machine without a GPU with float8 units (compute capability >= 8.9)
visible to TensorFlow it says so and exits 0: float8 is emulated elsewhere
(on CPU ~1.8x slower than ``mixed_bfloat16``), so there is nothing to
measure. ``--allow-cpu`` runs the same comparison at toy sizes anyway, to
check the script (its times mean nothing).

The model: 2 post-norm Transformer blocks (d=1024, 16-head
``MultiHeadAttention`` whose projections are ``EinsumDense``, GELU MLP of
width 4096, T=256, batch 32), a 10-way head; Adam; ``jit_compile=True`` for
every variant (XLA rewrites Keras's quantize-dequantize pattern into float8
GEMMs; without XLA float8 runs as bfloat16 plus the quantization work).
Variants:

* ``keras_mixed_bfloat16``: Keras ``mixed_bfloat16``;
* ``keras_float8``: the same after ``model.quantize("float8")`` (Keras's
  all-float8 training);
* ``keras_mp_adaptive_float8``: ``keras_mp.AdaptivePolicy(("float8",
  "bfloat16", "float32"))`` and ``keras_mp.callbacks.AdaptivePrecision()``
  (statistics and probe steps included in the time: they are part of the
  cost).

Each variant trains ``--steps`` steps per round with ``model.fit``, after two
warm-up rounds (tracing, XLA compilation, every trace of the adaptive
callback), in ``--rounds`` interleaved rounds; the table gives the median
and spread of wall and process CPU time per step, and ratios against
``mixed_bfloat16``. Written to ``DIR/float8_gpu.json`` with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from .common import cpu_name, quiet_tensorflow, sync, without_autotune

__all__ = ["float8_gpu", "main", "SIZES"]

#: (d, heads, mlp width, sequence, batch) per size.
SIZES = {"full": (1024, 16, 4096, 256, 32), "toy": (32, 2, 64, 8, 4)}
VARIANTS = ("keras_mixed_bfloat16", "keras_float8", "keras_mp_adaptive_float8")


def float8_gpu() -> tuple[bool, str]:
    """``(usable, description)``: whether TensorFlow sees a GPU with float8
    units (compute capability >= 8.9), and what it sees."""
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return False, "no GPU visible to TensorFlow"
    details = tf.config.experimental.get_device_details(gpus[0])
    cc = tuple(details.get("compute_capability", (0, 0)) or (0, 0))
    name = details.get("device_name", "GPU")
    if cc < (8, 9):
        return False, f"{name} (compute capability {cc[0]}.{cc[1]}) has no float8 units"
    return True, f"{name} (compute capability {cc[0]}.{cc[1]})"


def _model(size: str):
    import keras

    d, heads, width, seq, _ = SIZES[size]
    L = keras.layers
    inputs = keras.Input((seq, d))
    x = inputs
    for _ in range(2):
        a = L.MultiHeadAttention(heads, d // heads)(x, x)
        x = L.LayerNormalization()(L.Add()([x, a]))
        h = L.Dense(width, activation="gelu")(x)
        x = L.LayerNormalization()(L.Add()([x, L.Dense(d)(h)]))
    outputs = L.Dense(10, dtype="float32")(L.GlobalAveragePooling1D()(x))
    return keras.Model(inputs, outputs)


def _build(variant: str, size: str):
    import keras

    import keras_mp

    callbacks = []
    if variant == "keras_mp_adaptive_float8":
        keras_mp.set_global_policy(keras_mp.AdaptivePolicy(("float8", "bfloat16", "float32")))
        model = _model(size)
        callbacks = [keras_mp.callbacks.AdaptivePrecision()]
    else:
        keras_mp.set_global_policy("mixed_bfloat16")
        model = _model(size)
        if variant == "keras_float8":
            model.quantize("float8")
    keras_mp.set_global_policy("float32")
    model.compile(optimizer="adam", jit_compile=True,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model, callbacks


def run(size: str = "full", steps: int = 10, rounds: int = 5) -> dict[str, Any]:
    """Times the variants (see the module docstring); returns the report."""
    import numpy as np
    import tensorflow as tf

    import keras_mp

    if size not in SIZES:
        raise ValueError(f"`size` must be one of {tuple(SIZES)}, got {size!r}.")
    for name, value in (("steps", steps), ("rounds", rounds)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}` must be an int >= 1, got {value!r}.")
    d, _, _, seq, batch = SIZES[size]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch * steps, seq, d)).astype("float32")
    y = rng.integers(0, 10, batch * steps)
    # Each round is a fit call: see common.without_autotune.
    data = without_autotune(tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).cache())
    built = {v: _build(v, size) for v in VARIANTS}

    def epoch(variant):
        model, callbacks = built[variant]
        history = model.fit(data, epochs=1, verbose=0, callbacks=callbacks)
        sync(model.optimizer.iterations)
        return history.history["loss"][-1]

    for _ in range(2):  # warm-up: traces, XLA, the callback's statistics/probe traces
        for v in VARIANTS:
            epoch(v)
    wall = {v: [] for v in VARIANTS}
    cpu = {v: [] for v in VARIANTS}
    loss = {}
    for _ in range(rounds):
        for v in VARIANTS:
            w0, c0 = time.perf_counter(), time.process_time()
            loss[v] = epoch(v)
            wall[v].append((time.perf_counter() - w0) / steps)
            cpu[v].append((time.process_time() - c0) / steps)
    model, _ = built["keras_mp_adaptive_float8"]
    policy = keras_mp.policies.policy_of(model)
    f8 = policy.float8_layers()
    results = {v: {"wall": _summary(wall[v]), "cpu": _summary(cpu[v]), "final_loss": loss[v]}
               for v in VARIANTS}
    return {"size": size, "steps": steps, "rounds": rounds, "results": results,
            "adaptive_float8_layers": sum(d == "float8" for d in f8.values()),
            "float8_capable_layers": len(f8)}


def _summary(samples: Sequence[float]) -> dict[str, Any]:
    return {"median": statistics.median(samples), "spread": max(samples) - min(samples),
            "samples": list(samples)}


def table(report: dict[str, Any]) -> str:
    """The report as a text table (ms per step; ratios are speed-ups over
    ``keras_mixed_bfloat16``, > 1 is faster)."""
    res = report["results"]
    base = res["keras_mixed_bfloat16"]
    lines = ["| variant | wall ms/step (spread) | CPU ms/step (spread) | x bf16 wall | "
             "x bf16 CPU | final loss |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for v in VARIANTS:
        r = res[v]
        lines.append(
            f"| {v} | {1e3 * r['wall']['median']:.2f} ({1e3 * r['wall']['spread']:.2f}) | "
            f"{1e3 * r['cpu']['median']:.2f} ({1e3 * r['cpu']['spread']:.2f}) | "
            f"{base['wall']['median'] / r['wall']['median']:.2f} | "
            f"{base['cpu']['median'] / r['cpu']['median']:.2f} | {r['final_loss']:.4f} |")
    lines.append(f"adaptive: {report['adaptive_float8_layers']} of "
                 f"{report['float8_capable_layers']} float8-capable layers in float8")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.float8_gpu",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None)
    parser.add_argument("--allow-cpu", action="store_true",
                        help="run at toy sizes without float8 hardware (checks the script)")
    args = parser.parse_args(argv)
    quiet_tensorflow()
    usable, what = float8_gpu()
    if not usable and not args.allow_cpu:
        print(f"float8 benchmark skipped: {what}; float8 is emulated without float8 units, "
              "so there is nothing to measure here.")
        return 0
    import keras

    import keras_mp

    size = "full" if usable else "toy"
    print(f"device: {what if usable else 'CPU (' + cpu_name() + '), toy sizes, times mean nothing'}"
          f"; TensorFlow {__import__('tensorflow').__version__}, Keras {keras.__version__}, "
          f"keras-mp {keras_mp.__version__}")
    report = run(size, args.steps, args.rounds)
    report["device"] = what if usable else f"CPU: {cpu_name()}"
    print(table(report))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "float8_gpu.json"), "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
