"""Training step of a 2-block Transformer: plain Keras float32, plain Keras
mixed_bfloat16, and mixed_bfloat16 after :func:`keras_mp.fuse`.

Run from the repository root::

    python -m benchmarks.transformer_step [--quick] [--no-memory]

The model (the transformer of ``keras-mp bench``, full size): d=512,
T=128, batch 32, 8-head ``MultiHeadAttention``, post-norm residual blocks,
GELU MLP of width 2048, a float32 10-way head; Adam and sparse categorical
cross-entropy; ``jit_compile=False`` (Keras's choice on CPU). The three
variants are timed interleaved in one process (``train_on_batch``, warm-up
excluded). Peak memory is measured per variant in a fresh subprocess
(``tf.config.experimental.get_memory_info`` where the device has it, else
the process's peak RSS), since a process's peak never goes down.

Targets: fused at least 3x faster than float32 and 1.5x faster than Keras
mixed_bfloat16.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from .common import format_ratio_table, peak_rss_mb, quiet_tensorflow, side_by_side

quiet_tensorflow()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_mp.fused.fuse import fuse  # noqa: E402

VARIANTS: dict[str, tuple[str, bool]] = {
    "keras_float32": ("float32", False),
    "keras_mixed_bfloat16": ("mixed_bfloat16", False),
    "fused_mixed_bfloat16": ("mixed_bfloat16", True),
}
T, D, HEADS, BLOCKS, CLASSES = 128, 512, 8, 2, 10


def build_model(policy: str, fused: bool, seed: int = 0) -> keras.Model:
    """The benchmark's Transformer under ``policy``, fused if asked, compiled."""
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(policy)
    try:
        keras.utils.set_random_seed(seed)
        inp = keras.Input((T, D))
        h = inp
        for _ in range(BLOCKS):
            a = keras.layers.MultiHeadAttention(HEADS, D // HEADS)(h, h)
            h = keras.layers.LayerNormalization()(h + a)
            f = keras.layers.Dense(D)(keras.layers.Dense(4 * D, activation="gelu")(h))
            h = keras.layers.LayerNormalization()(h + f)
        h = keras.layers.GlobalAveragePooling1D()(h)
        out = keras.layers.Activation("linear", dtype="float32")(keras.layers.Dense(CLASSES)(h))
        model = keras.Model(inp, out)
    finally:
        keras.mixed_precision.set_global_policy(previous)
    if fused:
        model = fuse(model)
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False)
    return model


def _data(batch: int):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((batch, T, D)).astype("float32"),
            rng.integers(0, CLASSES, batch))


def _device_peak_mb() -> float | None:
    try:
        return tf.config.experimental.get_memory_info("GPU:0")["peak"] / 2**20
    except (ValueError, RuntimeError):
        return None  # no GPU, or a device without memory statistics


def measure_memory(variant: str, batch: int, steps: int = 3) -> dict:
    """Peak memory of ``steps`` training steps of ``variant`` in this process.

    Meant for a fresh process (see :func:`run`): ``rss_before_mb`` is taken
    after the model is built and compiled, ``peak_rss_mb`` after the steps.
    """
    policy, fused = VARIANTS[variant]
    x, y = _data(batch)
    model = build_model(policy, fused)
    before = peak_rss_mb()
    for _ in range(steps):
        model.train_on_batch(x, y)
    peak = peak_rss_mb()
    return {"variant": variant, "rss_before_mb": before, "peak_rss_mb": peak,
            "step_peak_rss_mb": peak - before, "device_peak_mb": _device_peak_mb()}


def _memory_in_subprocess(variant: str, batch: int) -> dict:
    out = subprocess.run(
        # __spec__.name: "benchmarks.transformer_step" in the repository,
        # "keras_mp.benchmarks.transformer_step" when installed.
        [sys.executable, "-m", __spec__.name, "--memory-of", variant,
         "--batch", str(batch)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(quick: bool = False, memory: bool = True, rounds: int = 7) -> dict:
    """Times the three variants side by side (``rounds`` interleaved rounds
    of 2 steps each after 2 warm-up calls); optionally measures memory.

    Returns:
        ``{"batch", "variants": {name: {"median", "spread", "samples",
        "cpu_median", ...}}, "cpu_speedup_fused_vs_float32",
        "cpu_speedup_fused_vs_keras_bf16" (process CPU time),
        "speedup_fused_vs_float32", "speedup_fused_vs_keras_bf16" (wall),
        "speedup_keras_bf16_vs_float32", "memory": {name: {...}} | None,
        "table"}`` (seconds, MiB).
    """
    batch = 8 if quick else 32
    x, y = _data(batch)
    models = {name: build_model(*spec) for name, spec in VARIANTS.items()}
    timings = side_by_side(
        {name: (lambda m=m: m.train_on_batch(x, y)) for name, m in models.items()},
        steps=1 if quick else 2, warmup=2, repeats=rounds)
    med = {name: t["median"] for name, t in timings.items()}
    cpu = {name: t["cpu_median"] for name, t in timings.items()}
    best = {name: t["min"] for name, t in timings.items()}
    mem = ({name: _memory_in_subprocess(name, batch) for name in VARIANTS}
           if memory else None)
    rows = []
    for name, t in timings.items():
        row = {"name": name, **t}
        if mem:
            row["peak RSS MiB"] = mem[name]["peak_rss_mb"]
            row["step peak RSS MiB"] = mem[name]["step_peak_rss_mb"]
        rows.append(row)
    return {
        "batch": batch,
        "variants": timings,
        "cpu_speedup_fused_vs_float32": cpu["keras_float32"] / cpu["fused_mixed_bfloat16"],
        "cpu_speedup_fused_vs_keras_bf16":
            cpu["keras_mixed_bfloat16"] / cpu["fused_mixed_bfloat16"],
        "speedup_fused_vs_float32": med["keras_float32"] / med["fused_mixed_bfloat16"],
        "speedup_fused_vs_keras_bf16": med["keras_mixed_bfloat16"] / med["fused_mixed_bfloat16"],
        "speedup_keras_bf16_vs_float32": med["keras_float32"] / med["keras_mixed_bfloat16"],
        # Best-of-repeats ratios: least disturbed by other processes.
        "best_speedup_fused_vs_float32": best["keras_float32"] / best["fused_mixed_bfloat16"],
        "best_speedup_fused_vs_keras_bf16":
            best["keras_mixed_bfloat16"] / best["fused_mixed_bfloat16"],
        "memory": mem,
        "table": format_ratio_table(rows, baseline="keras_float32"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="batch 8, fewer repeats")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory subprocesses")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timed rounds")
    parser.add_argument("--memory-of", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=32, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_of:
        print(json.dumps(measure_memory(args.memory_of, args.batch)))
        return
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    result = run(quick=args.quick, memory=not args.no_memory, rounds=args.rounds)
    print(f"2-block Transformer training step, d={D}, T={T}, batch {result['batch']}")
    print(result["table"])
    print(f"fused bf16 vs Keras float32: {result['cpu_speedup_fused_vs_float32']:.2f}x CPU "
          f"time, {result['speedup_fused_vs_float32']:.2f}x wall (medians; target >= 3x)")
    print(f"fused bf16 vs Keras mixed_bfloat16: {result['cpu_speedup_fused_vs_keras_bf16']:.2f}x "
          f"CPU time, {result['speedup_fused_vs_keras_bf16']:.2f}x wall (medians; "
          "target >= 1.5x CPU, 1.4x wall)")
    print(f"Keras mixed_bfloat16 vs float32: {result['speedup_keras_bf16_vs_float32']:.2f}x")
    print(json.dumps({k: v for k, v in result.items() if k != "table"}, default=float))


if __name__ == "__main__":
    main()
