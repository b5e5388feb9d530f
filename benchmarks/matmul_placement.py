"""Where should matmuls run on this CPU? bfloat16 einsums, TF graph vs XLA.

Run from the repository root::

    python -m benchmarks.matmul_placement [--quick]

Times forward+backward of the two matmul shapes of a Transformer block at
batch 8 (an ``EinsumDense`` projection 8x128x512 -> 8x128x8x64, and the
attention core: scores, softmax, context), in float32 and bfloat16, as a
TensorFlow graph and under XLA. This is the measurement behind
:func:`keras_mp.device.xla.uses_xla` for ``"matmul"`` on CPU: on CPUs with AMX
TensorFlow's bfloat16 matmuls win, on CPUs without bfloat16 hardware XLA's.
"""

from __future__ import annotations

import argparse
import json

from .common import format_ratio_table, quiet_tensorflow, side_by_side

quiet_tensorflow()

import tensorflow as tf  # noqa: E402

from keras_mp.device import xla


def _projection(x, w):
    return tf.einsum("abc,cde->abde", x, w)


def _attention(q):
    probs = tf.nn.softmax(tf.einsum("aecd,abcd->acbe", q, q))
    return tf.einsum("acbe,aecd->abcd", probs, q)


def _fwd_bwd(fn, jit: bool):
    @tf.function(jit_compile=jit)
    def step(*args):
        with tf.GradientTape() as tape:
            tape.watch(args)
            y = fn(*args)
        return tape.gradient(y, args)

    return step


def run(quick: bool = False) -> dict:
    """Times each (op, dtype, placement); returns timings and XLA-vs-graph ratios.

    Returns:
        ``{"cpu_has_bf16_matmul", "uses_xla_matmul", "variants": {name:
        {...}}, "xla_speedup": {"<op>_<dtype>": graph / xla}, "table"}``.
    """
    batch = 4 if quick else 8
    x = tf.random.normal((batch, 128, 512))
    w = tf.random.normal((512, 8, 64))
    q = tf.random.normal((batch, 128, 8, 64))
    variants = {}
    for dtype in ("float32", "bfloat16"):
        xs, ws, qs = (tf.cast(t, dtype) for t in (x, w, q))
        for jit in (False, True):
            place = "xla" if jit else "graph"
            proj = _fwd_bwd(_projection, jit)
            att = _fwd_bwd(_attention, jit)
            variants[f"projection_{dtype}_{place}"] = lambda f=proj, a=xs, b=ws: f(a, b)
            variants[f"attention_{dtype}_{place}"] = lambda f=att, a=qs: f(a)
    timings = side_by_side(variants, steps=2 if quick else 3, warmup=2,
                           repeats=5 if quick else 5)
    ratios = {}
    for op in ("projection", "attention"):
        for dtype in ("float32", "bfloat16"):
            ratios[f"{op}_{dtype}"] = (timings[f"{op}_{dtype}_graph"]["median"]
                                       / timings[f"{op}_{dtype}_xla"]["median"])
    rows = [{"name": n, **t} for n, t in timings.items()]
    return {
        "cpu_has_bf16_matmul": xla.cpu_has_bf16_matmul(),
        "uses_xla_matmul": xla.uses_xla("matmul"),
        "variants": timings,
        "xla_speedup": ratios,
        "table": format_ratio_table(rows, baseline="projection_float32_graph"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="batch 4, fewer repeats")
    args = parser.parse_args()
    result = run(quick=args.quick)
    print(f"CPU has bf16 matmul hardware: {result['cpu_has_bf16_matmul']}; "
          f"keras_mp compiles matmuls here: {result['uses_xla_matmul']}")
    print(result["table"])
    for name, ratio in result["xla_speedup"].items():
        print(f"{name}: XLA {ratio:.2f}x faster than the TF graph")
    print(json.dumps({k: v for k, v in result.items() if k != "table"}, default=float))


if __name__ == "__main__":
    main()
