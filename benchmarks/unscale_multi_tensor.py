"""Loss-scale unscale + finite check over a 200-tensor gradient list:
one multi-tensor XLA kernel vs a per-tensor loop.

Run from the repository root::

    python -m benchmarks.unscale_multi_tensor [--quick]

Both variants run inside a ``tf.function`` (as in a training step) on the
same list of float32 gradients shaped like a Transformer's (matrices,
vectors and biases), at two widths: ``d=32`` (~150k values, where the cost
is launching ~600 small ops) and ``d=256`` (~9.7M values, where the cost is
memory traffic):

* ``per_tensor_loop``: ``g / scale`` and ``reduce_all(is_finite(g))`` per
  tensor, then a reduction of the 200 flags (what a per-tensor loss scaler
  does);
* ``multi_tensor``: :func:`keras_mp.scaling.kernels.unscale_and_check`, placed by
  :mod:`keras_mp.device.xla` (on CPU a TensorFlow graph);
* ``multi_tensor_xla``: the same kernel forced under XLA.

Target: multi-tensor at least 2x faster. Bound: on a memory-bound CPU the
loop reads each gradient twice and writes it once, a fused kernel at best
reads once and writes once, so for large tensors no kernel can beat the
loop by more than ~1.5x; the 2x is reachable only where launches dominate.
"""

from __future__ import annotations

import argparse
import json

from .common import format_ratio_table, quiet_tensorflow, side_by_side

quiet_tensorflow()

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_mp.scaling import kernels
from keras_mp.device import xla

N_TENSORS = 200


WIDTHS: tuple[int, ...] = (32, 256)


def gradient_shapes(d: int, n: int = N_TENSORS) -> list[tuple[int, ...]]:
    """Shapes of a Transformer-like gradient list of width ``d``: per block,
    4 attention matrices, 2 MLP matrices, their biases, 2 layer-norm pairs."""
    block = [(d, d), (d,), (d, d), (d,), (d, d), (d,), (d, d), (d,),
             (d, 4 * d), (4 * d,), (4 * d, d), (d,), (d,), (d,), (d,), (d,)]
    shapes = []
    while len(shapes) < n:
        shapes.extend(block)
    return shapes[:n]


def _measure(d: int, quick: bool) -> dict:
    rng = np.random.default_rng(0)
    # Gradients live in variables and results go to variables, as in a
    # training step: passing 200 tensors across the tf.function boundary
    # costs ~12 ms of Python per call here, which would swamp both variants.
    grads = [tf.Variable(rng.normal(size=s).astype("float32") * 1024)
             for s in gradient_shapes(d)]
    outs = [tf.Variable(tf.zeros_like(g)) for g in grads]
    scale = tf.constant(1024.0)

    def per_tensor(gs, scale):
        out, flags = [], []
        for g in gs:
            out.append(g / scale)
            flags.append(tf.reduce_all(tf.math.is_finite(g)))
        return out, tf.reduce_all(tf.stack(flags))

    def step_with(unscale):
        @tf.function
        def step(scale):
            unscaled, ok = unscale([g.read_value() for g in grads], scale)
            for o, u in zip(outs, unscaled):
                o.assign(u)
            return ok

        return step

    per_tensor_loop = step_with(per_tensor)
    multi_tensor = step_with(kernels.unscale_and_check)
    # The kernel as placed by keras_mp.device.xla (on CPU: a TensorFlow graph), and
    # forced under XLA; the placement is read when the step is traced.
    multi_tensor_xla = step_with(kernels.unscale_and_check)
    xla.set_xla("multi_tensor", True)
    try:
        multi_tensor_xla(scale)
    finally:
        xla.set_xla("multi_tensor", None)

    # Same answer first: a faster wrong kernel would be no result.
    ok_a = per_tensor_loop(scale)
    a = [o.numpy() for o in outs]
    ok_b = multi_tensor(scale)
    assert bool(ok_a) == bool(ok_b)
    assert all(np.array_equal(x, o.numpy()) for x, o in zip(a, outs))

    timings = side_by_side(
        {"per_tensor_loop": lambda: per_tensor_loop(scale),
         "multi_tensor": lambda: multi_tensor(scale),
         "multi_tensor_xla": lambda: multi_tensor_xla(scale)},
        steps=5 if quick else 20, warmup=3, repeats=5 if quick else 7)
    rows = [{"name": n, **t} for n, t in timings.items()]
    return {
        "n_tensors": len(grads),
        "n_values": int(sum(int(np.prod(g.shape)) for g in grads)),
        "variants": timings,
        "speedup_multi_vs_loop": timings["per_tensor_loop"]["median"]
        / timings["multi_tensor"]["median"],
        "best_speedup_multi_vs_loop": timings["per_tensor_loop"]["min"]
        / timings["multi_tensor"]["min"],
        "speedup_multi_xla_vs_loop": timings["per_tensor_loop"]["median"]
        / timings["multi_tensor_xla"]["median"],
        "table": format_ratio_table(rows, baseline="per_tensor_loop"),
    }


def run(quick: bool = False) -> dict:
    """Times the variants side by side at each width in :data:`WIDTHS`.

    Returns:
        ``{"d=<width>": {"n_tensors", "n_values", "variants": {name:
        {"median", "spread", "samples"}}, "speedup_multi_vs_loop", "table"}}``
        (seconds).
    """
    return {f"d={d}": _measure(d, quick) for d in WIDTHS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller tensors, fewer repeats")
    args = parser.parse_args()
    result = run(quick=args.quick)
    for width, r in result.items():
        print(f"unscale + finite check, {width}: {r['n_tensors']} float32 tensors, "
              f"{r['n_values']} values")
        print(r["table"])
        print(f"multi-tensor vs per-tensor loop: {r['speedup_multi_vs_loop']:.2f}x median, "
              f"{r['best_speedup_multi_vs_loop']:.2f}x best-of; forced under XLA: "
              f"{r['speedup_multi_xla_vs_loop']:.2f}x (target >= 2x)\n")
    print(json.dumps({w: {k: v for k, v in r.items() if k != "table"}
                      for w, r in result.items()}, default=float))

if __name__ == "__main__":
    main()
