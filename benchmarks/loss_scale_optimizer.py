"""keras_mp.LossScaleOptimizer vs keras.optimizers.LossScaleOptimizer.

The same ~100-variable MLP is trained with each optimizer, side by side in
one process (repeats interleaved), and the step-time ratio is printed.
Target: keras-mp's step <= 1.05x Keras's on CPU.

Run: ``python -m benchmarks.loss_scale_optimizer [--quick]``
"""

from __future__ import annotations

import argparse

from .common import format_ratio_table, quiet_tensorflow, side_by_side

TARGET = 1.05


def _model(keras, layers: int, width: int):
    model = keras.Sequential([keras.Input((width,))])
    for _ in range(layers):
        model.add(keras.layers.Dense(width, activation="relu"))
    return model


def run(quick: bool = False, layers: int = 50, width: int = 64, batch: int = 64) -> dict:
    """Times one training step with each optimizer.

    Returns:
        ``{"variables": n, "keras": timing, "keras_mp": timing,
        "ratio": keras_mp / keras, "target": 1.05, "table": str}``.
    """
    quiet_tensorflow()
    import keras
    import numpy as np

    import keras_mp

    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, width)).astype("float32")
    y = rng.normal(size=(batch, width)).astype("float32")

    def make(opt_cls):
        keras.utils.set_random_seed(0)
        model = _model(keras, layers, width)
        model.compile(optimizer=opt_cls(keras.optimizers.Adam(1e-4)), loss="mse")
        model.train_on_batch(x, y)  # trace and build outside the timing
        return model

    models = {
        "keras": make(keras.optimizers.LossScaleOptimizer),
        "keras_mp": make(keras_mp.LossScaleOptimizer),
    }
    n_vars = len(models["keras_mp"].trainable_variables)
    timings = side_by_side(
        {name: (lambda m=m: m.train_on_batch(x, y)) for name, m in models.items()},
        steps=10 if quick else 50, warmup=3, repeats=5 if quick else 7)
    ratio = timings["keras_mp"]["median"] / timings["keras"]["median"]
    table = format_ratio_table([{"name": k, **v} for k, v in timings.items()],
                               baseline="keras")
    return {"variables": n_vars, **timings, "ratio": ratio, "target": TARGET, "table": table}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats")
    args = parser.parse_args(argv)
    r = run(quick=args.quick)
    print(f"Training step, {r['variables']}-variable MLP, Adam, float32 policy:")
    print(r["table"])
    verdict = "meets" if r["ratio"] <= TARGET else "misses"
    print(f"keras_mp / keras step time: {r['ratio']:.3f} ({verdict} target <= {TARGET})")


if __name__ == "__main__":
    main()
