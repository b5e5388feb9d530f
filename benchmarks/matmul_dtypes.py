"""Matmul throughput per dtype at the Transformer's shapes: the ceiling of a
16-bit speed-up.

Run from the repository root::

    python -m benchmarks.matmul_dtypes [--quick]

Times, as TensorFlow graphs (oneDNN on CPU, what Keras runs without XLA),
the matmuls of one training step of the ``keras-mp bench`` Transformer
(``--quick``: batch 32, length 128, width 256; else width 512): the
attention projections and the feed-forward layers as ``[batch * length,
d] x [d, n]`` products, and the attention scores as a batched product, each
forward and the two backward products, in float32, bfloat16 and float16,
in interleaved rounds by process CPU time and wall time. Prints GFLOP/s and
each dtype's speed-up over float32: a step whose matmuls take time ``M`` in
float32 and whose other work takes ``E`` cannot run faster in 16 bits than
``(M + E) / (M / r + E')`` with ``r`` the matmul speed-up and ``E'`` the
16-bit other work.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from .common import quiet_tensorflow

quiet_tensorflow()

import tensorflow as tf  # noqa: E402

DTYPES = ("float32", "bfloat16", "float16")


def _shapes(batch: int, length: int, dim: int) -> list[tuple[str, tuple[int, ...], int]]:
    """(name, operand shapes, flops per call) of one step's matmuls (fwd + 2 bwd)."""
    rows = batch * length
    heads, key = 8, dim // 8
    out = []
    for name, n in (("qkv+out projections (x4)", dim), ("ffn up", 4 * dim)):
        out.append((name, (rows, dim, n), 3 * 2 * rows * dim * n))
    out.append(("ffn down", (rows, 4 * dim, dim), 3 * 2 * rows * 4 * dim * dim))
    out.append(("attention scores+context (batched)", (batch * heads, length, key),
                3 * 2 * 2 * batch * heads * length * length * key))
    return out


def _fn(shape: tuple[int, ...], dtype: str, batched: bool):
    init = tf.random.stateless_normal
    if batched:
        b, t, k = shape
        q = tf.cast(init([b, t, k], seed=[1, 1]), dtype)

        @tf.function(autograph=False)
        def step():
            s = tf.matmul(q, q, transpose_b=True)  # scores [b, t, t]
            c = tf.matmul(s, q)  # context [b, t, k]
            # the backward products of both, same sizes
            return tf.matmul(c, q, transpose_b=True)[:1, :1, :1] + tf.matmul(s, c)[:1, :1, :1] \
                + tf.matmul(s, q, transpose_a=True)[:1, :1, :1] \
                + tf.matmul(s, q)[:1, :1, :1]
    else:
        m, k, n = shape
        x = tf.cast(init([m, k], seed=[1, 2]), dtype)
        w = tf.cast(init([k, n], seed=[1, 3]), dtype)
        dy = tf.cast(init([m, n], seed=[1, 4]), dtype)

        @tf.function(autograph=False)
        def step():
            y = tf.matmul(x, w)
            dx = tf.matmul(dy, w, transpose_b=True)
            dw = tf.matmul(x, dy, transpose_a=True)
            return y[:1, :1] + dx[:1, :1] + dw[:1, :1]
    return lambda: step().numpy()


def run(quick: bool = True, rounds: int = 5, calls: int = 5) -> dict:
    """Measures every shape in every dtype; returns GFLOP/s by CPU and wall time.

    Args:
        quick: the ``--quick`` Transformer's width (256) instead of 512.
        rounds: interleaved rounds (>= 1); medians are kept.
        calls: calls per round (>= 1).
    """
    if rounds < 1 or calls < 1:
        raise ValueError(f"`rounds` and `calls` must be >= 1, got {rounds}, {calls}.")
    dim = 256 if quick else 512
    results: dict = {"batch": 32, "length": 128, "dim": dim, "shapes": {}}
    for name, shape, flops in _shapes(32, 128, dim):
        fns = {d: _fn(shape, d, "batched" in name) for d in DTYPES}
        for fn in fns.values():
            fn()
            fn()
        cpu = {d: [] for d in DTYPES}
        wall = {d: [] for d in DTYPES}
        for _ in range(rounds):
            for d, fn in fns.items():
                c0, w0 = time.process_time(), time.perf_counter()
                for _ in range(calls):
                    fn()
                cpu[d].append((time.process_time() - c0) / calls)
                wall[d].append((time.perf_counter() - w0) / calls)
        results["shapes"][name] = {
            d: {"gflops_wall": flops / statistics.median(wall[d]) / 1e9,
                "gflops_cpu": flops / statistics.median(cpu[d]) / 1e9,
                "ms_cpu": statistics.median(cpu[d]) * 1e3} for d in DTYPES}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    res = run(quick=args.quick)
    if args.json:
        print(json.dumps(res, indent=2))
        return
    print(f"Transformer matmuls, batch 32, length 128, width {res['dim']}; TF graph, "
          "forward + backward; GFLOP/s by wall time (speed-up over float32 by CPU time)")
    total = {d: 0.0 for d in DTYPES}
    for name, per in res["shapes"].items():
        base = per["float32"]["ms_cpu"]
        cells = [f"{d} {per[d]['gflops_wall']:7.1f} ({base / per[d]['ms_cpu']:4.2f}x)"
                 for d in DTYPES]
        print(f"  {name:<36} " + "   ".join(cells))
        for d in DTYPES:
            total[d] += per[d]["ms_cpu"] * (4 if name.startswith("qkv") else 1)
    print("  all matmuls of the step, CPU ms: " + ", ".join(
        f"{d} {total[d]:.1f} ({total['float32'] / total[d]:.2f}x)" for d in DTYPES))


if __name__ == "__main__":
    main()
