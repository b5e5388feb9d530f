"""Writes ``.keras`` files that ``tests/test_saved_files.py`` loads with today's
code, saved by the keras-mp of an earlier commit, into a folder of their own:

* ``saved_0_1_0/``: keras-mp 0.1.0 before the package was split into
  subpackages (commit 6d04e20), the first three models;
* ``saved_62d6112/``: before ``keras_mp/adaptive/`` was split by concept
  (commit 62d6112), all four (``adaptive_no_gain``: a fit too small to gain,
  whose layers the policy records as ``no_gain``).

Run from the repository root with keras-mp of that commit importable::

    KERAS_MP_EXECUTION=graph PYTHONPATH=<checkout of the commit> \
        python tests/data/make_saved.py tests/data/saved_62d6112
    # for saved_0_1_0 add: --models adaptive_float16,fused_bfloat16,adaptive_float8

Each model is trained a few steps so that its optimizer, loss-scale state and
adaptive records hold non-initial values; ``expected.npz`` keeps each model's
predictions on a fixed input, its optimizer iteration count and loss scale.
"""

import argparse
import os
import pathlib

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_mp  # noqa: E402
from keras_mp.callbacks import AdaptivePrecision  # noqa: E402

X = np.random.default_rng(0).normal(size=(16, 8)).astype("float32")
Y = (X.sum(1, keepdims=True) > 0).astype("float32")


def _adaptive_float16():
    """Raw features (beyond float16) into Rescaling: the Rescaling layer
    moves to float32; a LossScaleOptimizer with a piecewise schedule."""
    keras_mp.set_global_policy("adaptive_float16")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Rescaling(1e-5),
                              keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
    opt = keras_mp.LossScaleOptimizer(
        keras.optimizers.Adam(1e-3),
        schedule=keras_mp.DynamicLossScale(
            growth_interval=keras_mp.PiecewiseInterval([100], [10, 1000]), hysteresis=2))
    model.compile(optimizer=opt, loss=keras.losses.BinaryCrossentropy(from_logits=True))
    model.fit(1e5 * X, Y, batch_size=4, epochs=4, verbose=0,
              callbacks=[AdaptivePrecision(interval=2)])
    return model, 1e5 * X


def _fused_bfloat16():
    """keras_mp.fuse's layers (Dense+GELU, LayerNormalization, Softmax,
    MultiHeadAttention, RMSNormalization) under mixed_bfloat16."""
    keras_mp.set_global_policy("mixed_bfloat16")
    inp = keras.Input((4, 8))
    h = keras.layers.Dense(16, activation="gelu")(inp)
    h = keras.layers.LayerNormalization()(h)
    h = keras.layers.MultiHeadAttention(2, 8)(h, h)
    h = keras.layers.RMSNormalization()(h)
    out = keras.layers.Softmax()(keras.layers.Dense(3)(keras.layers.Flatten()(h)))
    model = keras_mp.fuse(keras.Model(inp, out))
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    x = X.reshape(16, 4, 2).repeat(4, axis=2)
    model.fit(x, (Y[:, 0] * 2).astype("int32"), batch_size=4, epochs=1, verbose=0)
    return model, x


def _adaptive_float8():
    """Dense layers in float8 (emulated on CPU) under adaptive_float8."""
    keras_mp.set_global_policy("adaptive_float8")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(32, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss=keras.losses.BinaryCrossentropy(from_logits=True))
    model.fit(X, Y, batch_size=4, epochs=2, verbose=0,
              callbacks=[AdaptivePrecision(interval=2)])
    return model, X


def _adaptive_no_gain():
    """A fit too small to gain under adaptive_float16: fit trains it in float32,
    each layer's record saying no_gain."""
    keras_mp.set_global_policy("adaptive_float16")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss=keras.losses.BinaryCrossentropy(from_logits=True))
    model.fit(X, Y, batch_size=4, epochs=2, verbose=0)
    return model, X


MODELS = {"adaptive_float16": _adaptive_float16, "fused_bfloat16": _fused_bfloat16,
          "adaptive_float8": _adaptive_float8, "adaptive_no_gain": _adaptive_no_gain}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=pathlib.Path)
    parser.add_argument("--models", default=",".join(MODELS))
    args = parser.parse_args()
    args.folder.mkdir(parents=True, exist_ok=True)
    expected = {}
    for name in args.models.split(","):
        make = MODELS[name]
        keras.utils.clear_session()
        keras.utils.set_random_seed(0)
        model, x = make()
        model.save(args.folder / f"{name}.keras")
        expected[f"{name}/x"] = x
        expected[f"{name}/y"] = np.asarray(model.predict(x, verbose=0), "float32")
        expected[f"{name}/iterations"] = int(keras.ops.convert_to_numpy(model.optimizer.iterations))
        scale = getattr(model.optimizer, "loss_scale", None)
        expected[f"{name}/loss_scale"] = (
            float(keras.ops.convert_to_numpy(scale)) if scale is not None else np.nan)
        expected[f"{name}/dtypes"] = np.array(
            [f"{layer.name}:{layer.compute_dtype}" for layer in model.layers
         if not isinstance(layer, keras.layers.InputLayer)])
        print(name, expected[f"{name}/dtypes"], expected[f"{name}/loss_scale"])
    keras_mp.set_global_policy("float32")
    np.savez(args.folder / "expected.npz", **expected)


if __name__ == "__main__":
    main()
