"""Bias + GELU, forward and backward, in bfloat16: fused kernel vs TF graph.

Run from the repository root::

    python -m benchmarks.fused_bias_gelu [--quick]

Variants, all inside one ``tf.function`` computing ``y``, ``dx`` and ``db``
for an upstream gradient ``dy`` (what a training step needs):

* ``tf_graph_bf16``: ``tf.nn.gelu(x + b)`` on bfloat16 tensors, as Keras's
  ``Dense(activation="gelu")`` runs it under ``mixed_bfloat16``;
* ``tf_graph_f32``: the same in float32 (the float32 model's cost);
* ``fused_bf16``: :func:`keras_mp.fused.ops.bias_activation` (one XLA kernel each
  way, float32 math, bfloat16 in and out).

Target: fused at least 3x faster than the bfloat16 TF graph.
"""

from __future__ import annotations

import argparse
import json

from .common import format_ratio_table, quiet_tensorflow, side_by_side

quiet_tensorflow()

import tensorflow as tf  # noqa: E402

from keras_mp.fused import ops as kops

SHAPE = (32, 128, 2048)
QUICK_SHAPE = (8, 128, 2048)


def _step(apply):
    @tf.function(jit_compile=False)
    def step(x, b, dy):
        with tf.GradientTape() as tape:
            tape.watch([x, b])
            y = apply(x, b)
        dx, db = tape.gradient(y, [x, b], output_gradients=dy)
        # Returning y too: a training step keeps the forward output, and a
        # graph that does not may prune it.
        return y, dx, db

    return step


def run(quick: bool = False) -> dict:
    """Times the variants side by side; returns their timings and ratios.

    Returns:
        ``{"shape": [...], "variants": {name: {"median", "spread",
        "samples"}}, "speedup_fused_vs_tf_graph_bf16": float, "table": str}``
        (seconds).
    """
    shape = QUICK_SHAPE if quick else SHAPE
    rng = tf.random.Generator.from_seed(0)
    x32 = rng.normal(shape)
    b32 = rng.normal(shape[-1:])
    dy32 = rng.normal(shape)
    x, b, dy = (tf.cast(t, tf.bfloat16) for t in (x32, b32, dy32))
    steps = {
        "tf_graph_bf16": (_step(lambda x, b: tf.nn.gelu(x + b)), (x, b, dy)),
        "tf_graph_f32": (_step(lambda x, b: tf.nn.gelu(x + b)), (x32, b32, dy32)),
        "fused_bf16": (_step(lambda x, b: kops.bias_activation(x, b, "gelu")), (x, b, dy)),
    }
    variants = {name: (lambda f=f, a=a: f(*a)) for name, (f, a) in steps.items()}
    timings = side_by_side(variants, steps=3 if quick else 5, warmup=2,
                           repeats=5 if quick else 7)
    rows = [{"name": n, **t} for n, t in timings.items()]
    speedup = timings["tf_graph_bf16"]["median"] / timings["fused_bf16"]["median"]
    best = timings["tf_graph_bf16"]["min"] / timings["fused_bf16"]["min"]
    return {
        "shape": list(shape),
        "variants": timings,
        "speedup_fused_vs_tf_graph_bf16": speedup,
        "best_speedup_fused_vs_tf_graph_bf16": best,
        "table": format_ratio_table(rows, baseline="tf_graph_bf16"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller shape, fewer repeats")
    args = parser.parse_args()
    result = run(quick=args.quick)
    print(f"bias+GELU fwd+bwd, shape {result['shape']}, bf16 unless noted")
    print(result["table"])
    print(f"fused vs TF graph (bf16): {result['speedup_fused_vs_tf_graph_bf16']:.2f}x median, "
          f"{result['best_speedup_fused_vs_tf_graph_bf16']:.2f}x best-of (target >= 3x)")
    print(json.dumps({k: v for k, v in result.items() if k != "table"}, default=float))


if __name__ == "__main__":
    main()
