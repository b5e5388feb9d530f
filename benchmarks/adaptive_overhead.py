"""Adaptive precision vs plain Keras ``mixed_bfloat16``: the cost of the
statistics, the loss-scale wrapper and the callback on a well-behaved model.

The same MLP is trained under ``keras_mp.set_global_policy("adaptive_bfloat16")``
with :class:`keras_mp.callbacks.AdaptivePrecision` (which wraps the optimizer
in :class:`keras_mp.LossScaleOptimizer`, runs the statistics kernel every
step and decides every ``interval`` steps) and under Keras's
``mixed_bfloat16``, side by side in one process (repeats interleaved). Every
layer must stay in bfloat16; the step-time ratio is printed.
Target: adaptive step <= 1.05x Keras's.

Run: ``python -m benchmarks.adaptive_overhead [--quick]``
"""

from __future__ import annotations

import argparse

from benchmarks.common import format_ratio_table, quiet_tensorflow, side_by_side

TARGET = 1.05


def run(quick: bool = False, layers: int = 4, width: int = 512, batch: int = 512,
        interval: int = 100) -> dict:
    """Times one training step (train function plus callback) per variant.

    Returns:
        ``{"keras": timing, "adaptive": timing, "ratio": adaptive / keras,
        "target": 1.05, "dtypes": [...], "switches": n, "table": str}``.
    """
    quiet_tensorflow()
    import keras
    import numpy as np

    import keras_mp
    from keras_mp import callbacks, policies

    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, width)).astype("float32")
    y = rng.normal(size=(batch, 1)).astype("float32")

    def make(policy):
        keras.utils.set_random_seed(0)
        policies.set_global_policy(policy)
        model = keras.Sequential([keras.Input((width,))] + [
            keras.layers.Dense(width, activation="relu") for _ in range(layers)
        ] + [keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
        return model

    plain = make("mixed_bfloat16")
    adaptive = make("adaptive_bfloat16")
    policies.set_global_policy("float32")
    cb = callbacks.AdaptivePrecision(interval=interval)
    # One fit builds everything (wrap, statistics, trace) outside the timing.
    adaptive.fit(x, y, batch_size=batch, epochs=1, verbose=0, callbacks=[cb])
    plain.fit(x, y, batch_size=batch, epochs=1, verbose=0)
    assert isinstance(adaptive.optimizer, keras_mp.LossScaleOptimizer)

    def adaptive_step():
        out = adaptive.train_on_batch(x, y)
        cb.on_train_batch_end(0)  # what fit does after every step
        return out

    timings = side_by_side({"keras": lambda: plain.train_on_batch(x, y),
                            "adaptive": adaptive_step},
                           steps=10 if quick else 50, warmup=3, repeats=3 if quick else 7)
    ratio = timings["adaptive"]["median"] / timings["keras"]["median"]
    table = format_ratio_table([{"name": k, **v} for k, v in timings.items()],
                               baseline="keras")
    dtypes = [layer.compute_dtype for layer in adaptive.layers]
    return {**timings, "ratio": ratio, "target": TARGET, "dtypes": dtypes,
            "switches": len(cb.events), "table": table,
            "model": f"MLP {layers}x{width}, batch {batch}, Adam, interval {interval}"}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats")
    args = parser.parse_args(argv)
    r = run(quick=args.quick)
    print(f"Training step, {r['model']}:")
    print(r["table"])
    print(f"adaptive layer dtypes: {sorted(set(r['dtypes']))}, switches: {r['switches']}")
    verdict = "meets" if r["ratio"] <= TARGET else "misses"
    print(f"adaptive / keras mixed_bfloat16 step time: {r['ratio']:.3f} "
          f"({verdict} target <= {TARGET})")


if __name__ == "__main__":
    main()
