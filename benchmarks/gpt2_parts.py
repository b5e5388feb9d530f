"""Where a GPT-2 training step's time goes, part by part, against its matmul bound.

Run from the repository root::

    python -m benchmarks.gpt2_parts [--rounds 5]

The shapes are the ``gpt2`` bench model's (:mod:`benchmarks.models`: batch
16, T=128, d=256, 4 heads, 4 decoder blocks, feed-forward 1024, GPT-2's
50257-token vocabulary, logits through the tied embedding). Each part is
one step's worth of that work (all blocks), forward and backward, as a
TensorFlow graph, timed in interleaved rounds (process CPU time and wall
time, median and spread) in two forms: what Keras ``mixed_bfloat16`` runs
(``keras``) and what keras-mp's recommended set-up runs (``keras_mp``: the
fused kernels of :mod:`keras_mp.fused.ops`, the optimizer update compiled by
XLA); ``matmuls`` is the same for both (oneDNN), once in float32 for
reference:

* ``matmuls``: every matmul of the blocks, forward and both backward
  products (projections, attention scores and context, feed-forward) in
  bfloat16: the bound no elementwise work can beat;
* ``logits matmuls``: the tied logits ``[2048, 256] x [256, 50257]``, forward
  and both backward products. Keras ``mixed_bfloat16`` runs them in
  float32 (``ReversibleEmbedding`` keeps its table in float32 in ``call``,
  so the bfloat16 inputs meet a float32 table); keras-mp in bfloat16
  (:class:`keras_mp.fused.layers.ReversibleEmbedding`);
* ``attention softmax + mask``: the causal mask and softmax of the scores
  ``[16, 4, 128, 128]`` (Keras: the mask added in bfloat16, softmax in
  bfloat16; keras-mp: one float32 kernel each way), 4 blocks;
* ``layer norm``: 9 normalizations of ``[16, 128, 256]``;
* ``bias + GELU``: the feed-forward's bias and tanh GELU on ``[16, 128,
  1024]``, 4 blocks;
* ``loss``: softmax cross-entropy over the ``[2048, 50257]`` logits
  (Keras: float32 logits, as its logits matmul makes them; keras-mp:
  bfloat16);
* ``accuracy metric``: the sparse categorical accuracy over those logits,
  forward only (KerasHub's causal LMs compile with it by default; keras-mp:
  :mod:`keras_mp.fused.metrics`, measured alone here; in a keras-mp step it
  takes its matches from the loss's forward kernel instead,
  :mod:`keras_mp.fused.shared_matches`);
* ``embedding gradients``: the token embedding's gather and its gradient
  (sparse rows summed into the dense ``[50257, 256]`` gradient that the
  tied logits matmul also produces);
* ``casts``: every float32 weight cast to bfloat16 once, every bfloat16
  weight gradient cast back;
* ``optimizer update``: Adam on every weight matrix (16.1 M parameters; Keras:
  as graph ops per variable; keras-mp: compiled by XLA,
  :mod:`keras_mp.execution.fused_update`).

The sum of the parts against a whole step (``python -m benchmarks.suite
--models gpt2``) says what is left above the matmul bound.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from .common import cpu_name, quiet_tensorflow

__all__ = ["SHAPE", "parts", "run", "main"]

SHAPE = dict(batch=16, length=128, dim=256, heads=4, blocks=4, ffn=1024, vocabulary=50257)


def _grad_fn(fwd: Callable, *inputs):
    """A graph running ``fwd(*inputs)`` forward and backward (gradients of a
    sum with a random cotangent w.r.t. every input), returning a scalar."""
    import tensorflow as tf

    @tf.function(autograph=False)
    def step():
        with tf.GradientTape() as tape:
            tape.watch(inputs)
            y = fwd(*inputs)
            loss = tf.reduce_sum(tf.cast(y, tf.float32) * 1e-3)
        grads = tape.gradient(loss, inputs)
        return tf.add_n([tf.reduce_sum(tf.cast(g, tf.float32)) for g in grads if g is not None])

    return lambda: step().numpy()


def parts() -> dict[str, dict[str, Callable[[], object]]]:
    """part -> {form: a callable running one step's worth of it}."""
    import keras
    import tensorflow as tf

    from keras_mp.execution import fused_update
    from keras_mp.fused import metrics as fused_metrics
    from keras_mp.fused import ops as kops

    s = SHAPE
    b, t, d, h, n, f, v = (s["batch"], s["length"], s["dim"], s["heads"], s["blocks"],
                           s["ffn"], s["vocabulary"])
    rows, bf16 = b * t, tf.bfloat16
    init = tf.random.stateless_normal

    def rand(shape, dtype=bf16, seed=1):
        return tf.cast(init(shape, seed=[seed, 7]), dtype)

    out: dict[str, dict[str, Callable[[], object]]] = {}

    def matmuls(dtype):
        x, w = rand([rows, d], dtype), rand([d, d], dtype, 2)
        up, down = rand([d, f], dtype, 3), rand([f, d], dtype, 4)
        hidden = rand([rows, f], dtype, 5)
        q = rand([b * h, t, d // h], dtype, 6)

        def fwd(x, w, up, down, hidden, q):
            parts_ = []
            for _ in range(n):
                for _ in range(4):  # q, k, v, output projections
                    parts_.append(tf.reduce_sum(tf.matmul(x, w)))
                parts_.append(tf.reduce_sum(tf.matmul(x, up)))
                parts_.append(tf.reduce_sum(tf.matmul(hidden, down)))
                scores = tf.matmul(q, q, transpose_b=True)
                parts_.append(tf.reduce_sum(tf.matmul(scores, q)))
            return tf.add_n(parts_)
        return _grad_fn(fwd, x, w, up, down, hidden, q)

    out["matmuls"] = {"float32": matmuls(tf.float32), "bfloat16": matmuls(bf16)}

    def logits_matmuls(dtype):
        return _grad_fn(lambda x, table: tf.matmul(x, tf.transpose(table)),
                        rand([rows, d], dtype, 12), rand([v, d], dtype, 7))

    out["logits matmuls"] = {"keras": logits_matmuls(tf.float32),
                             "keras_mp": logits_matmuls(bf16)}

    scores = rand([b, h, t, t])
    causal = tf.linalg.band_part(tf.ones([t, t], tf.bool), -1, 0)[None, None]
    softmax = keras.layers.Softmax(axis=-1, dtype="mixed_bfloat16")
    out["attention softmax + mask"] = {
        "keras": _grad_fn(lambda x: tf.add_n([softmax(x, mask=causal) for _ in range(n)]),
                          scores),
        "keras_mp": _grad_fn(lambda x: tf.add_n([kops.softmax(x, causal) for _ in range(n)]),
                             scores)}

    x = rand([b, t, d])
    gamma, beta = tf.ones([d]), tf.zeros([d])
    norm = keras.layers.LayerNormalization(epsilon=1e-5, dtype="mixed_bfloat16")
    norm.build((b, t, d))
    out["layer norm"] = {
        "keras": _grad_fn(lambda x: tf.add_n([norm(x) for _ in range(2 * n + 1)]), x),
        "keras_mp": _grad_fn(lambda x, g, be: tf.add_n(
            [kops.layer_norm(x, g, be, epsilon=1e-5) for _ in range(2 * n + 1)]),
            x, gamma, beta)}

    z, bias = rand([b, t, f]), rand([f], seed=9)
    out["bias + GELU"] = {
        "keras": _grad_fn(lambda z, bias: tf.add_n(
            [keras.activations.gelu(z + bias, approximate=True) for _ in range(n)]), z, bias),
        "keras_mp": _grad_fn(lambda z, bias: tf.add_n(
            [kops.bias_activation(z, bias, "gelu", approximate=True) for _ in range(n)]),
            z, bias)}

    logits, logits32 = rand([rows, v]), rand([rows, v], tf.float32)
    labels = tf.random.stateless_uniform([rows], seed=[3, 3], maxval=v, dtype=tf.int32)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    out["loss"] = {
        "keras": _grad_fn(lambda lg: loss_fn(labels, lg), logits32),
        "keras_mp": _grad_fn(lambda lg: tf.reduce_mean(kops.sparse_softmax_cross_entropy(
            labels, lg)), logits)}

    # KerasHub's CausalLM compiles with this metric by default: forward only.
    metric = tf.function(lambda fn, lg: tf.reduce_sum(fn(labels, lg)), autograph=False)
    out["accuracy metric"] = {
        "keras": lambda: metric(keras.metrics.sparse_categorical_accuracy, logits32).numpy(),
        "keras_mp": lambda: metric(fused_metrics.sparse_categorical_accuracy, logits).numpy()}

    table = tf.Variable(init([v, d], seed=[4, 4]) * 0.01)
    tokens = tf.random.stateless_uniform([b, t], seed=[5, 5], maxval=v, dtype=tf.int32)
    dense_part = rand([v, d], tf.float32, 11)

    @tf.function(autograph=False)
    def embedding_grads():
        with tf.GradientTape() as tape:
            y = tf.gather(tf.cast(table, bf16), tokens)
            loss = tf.reduce_sum(tf.cast(y, tf.float32)) * 1e-3
        sparse = tape.gradient(loss, table)
        return tf.reduce_sum(tf.convert_to_tensor(sparse) + dense_part)

    out["embedding gradients"] = {"keras": lambda: embedding_grads().numpy()}

    shapes = ([[v, d], [t, d]] + [[d, d]] * (4 * n) + [[d, f], [f, d]] * n)
    weights = [tf.Variable(init(sh, seed=[6, i])) for i, sh in enumerate(shapes)]

    @tf.function(autograph=False)
    def casts():
        low = [tf.cast(w, bf16) for w in weights]
        return tf.add_n([tf.reduce_sum(tf.cast(x[:1], tf.float32)) for x in low])

    out["casts"] = {"keras": lambda: casts().numpy()}

    def adam(compiled: bool):
        opt = keras.optimizers.Adam(1e-4)
        opt.build(weights)
        grads = [tf.cast(init(w.shape, seed=[8, i]), tf.float32) * 1e-3
                 for i, w in enumerate(weights)]
        if compiled:
            fused_update.install(opt)

        @tf.function(autograph=False)
        def update():
            if compiled:
                with fused_update.compiling(True):
                    opt.apply(grads, weights)
            else:
                opt.apply(grads, weights)
            return opt.iterations
        return lambda: update().numpy()

    out["optimizer update"] = {"keras": adam(False), "keras_mp": adam(True)}
    return out


def run(rounds: int = 5, calls: int = 3) -> dict[str, dict[str, dict[str, float]]]:
    """Median and spread (ms) of every part and form, by CPU and wall time."""
    if rounds < 1 or calls < 1:
        raise ValueError(f"`rounds` and `calls` must be >= 1, got {rounds}, {calls}.")
    fns = {(p, form): fn for p, forms in parts().items() for form, fn in forms.items()}
    for fn in fns.values():
        fn()
        fn()
    cpu = {k: [] for k in fns}
    wall = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            c0, w0 = time.process_time(), time.perf_counter()
            for _ in range(calls):
                fn()
            cpu[k].append((time.process_time() - c0) / calls * 1e3)
            wall[k].append((time.perf_counter() - w0) / calls * 1e3)
    res: dict[str, dict[str, dict[str, float]]] = {}
    for (p, form) in fns:
        res.setdefault(p, {})[form] = {
            "cpu_ms": statistics.median(cpu[(p, form)]),
            "cpu_spread": max(cpu[(p, form)]) - min(cpu[(p, form)]),
            "wall_ms": statistics.median(wall[(p, form)]),
            "wall_spread": max(wall[(p, form)]) - min(wall[(p, form)])}
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    quiet_tensorflow()
    import os

    res = run(rounds=args.rounds)
    print(f"GPT-2 step parts ({SHAPE}), forward + backward, one step's worth each; "
          f"{cpu_name()}, {os.cpu_count()} cores; median of {args.rounds} interleaved rounds, "
          "ms (spread)\n")
    print("| part | form | CPU ms | spread | wall ms | spread |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for p, forms in res.items():
        for form, r in forms.items():
            print(f"| {p} | {form} | {r['cpu_ms']:.1f} | {r['cpu_spread']:.1f} | "
                  f"{r['wall_ms']:.1f} | {r['wall_spread']:.1f} |")
    for form in ("keras", "keras_mp"):
        total = sum(forms.get(form, forms.get("keras", {})).get("cpu_ms", 0.0)
                    for p, forms in res.items() if "matmuls" not in p)
        print(f"\n{form}: work around the matmuls {total:.1f} ms CPU; logits matmuls "
              f"{res['logits matmuls'][form]['cpu_ms']:.1f} ms; block matmuls (bfloat16) "
              f"{res['matmuls']['bfloat16']['cpu_ms']:.1f} ms")


if __name__ == "__main__":
    main()
