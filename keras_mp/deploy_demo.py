"""The guided-quantization demonstration: adaptive training finds the layer
that int8 would break, and :func:`keras_mp.quantize` keeps it in float.

The problem: 32 standard-normal features decide the label (a linear rule);
feature 0 is a sentinel that is 0 in most rows and 70000 in a quarter of them
(a "missing" marker, or a raw counter, as in unprepared tabular data), and
carries no information. The model is a plain MLP trained under
``adaptive_float16``:

* in float16, 70000 is beyond float16's 65504: the first ``Dense`` overflows
  on every batch, and :class:`keras_mp.callbacks.AdaptivePrecision` promotes
  it to float32 (its history records the switch). The other layers see
  ReLU activations of moderate size and stay in float16;
* Keras's int8 ``Dense`` quantizes each input row by its largest magnitude:
  in a sentinel row the step is 70000/127, so every informative feature
  rounds to 0 and that row's prediction is lost. The other layers' inputs
  have no such outliers and quantize well.

So quantizing everything (``model.quantize("int8")``) loses the sentinel
rows, while the guided version (``keras_mp.quantize(model, "int8")``) keeps
the promoted first layer in float and quantizes the rest.

Example:
    >>> from keras_mp import deploy_demo
    >>> x, y = deploy_demo.sentinel_data(4, seed=0)
    >>> x.shape, y.shape, float(x[:, 0].max()) in (0.0, 70000.0)
    ((4, 32), (4, 1), True)
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import keras
import numpy as np

from keras_mp import callbacks, policies, quantization

__all__ = ["SENTINEL", "sentinel_data", "sentinel_model", "train", "compare"]

#: The sentinel value: beyond float16's largest finite value (65504).
SENTINEL = 7e4
_FEATURES = 32


def sentinel_data(n: int, seed: int = 0, *, fraction: float = 1.0
                  ) -> tuple[np.ndarray, np.ndarray]:
    """``n`` rows of the problem: features (float32, ``(n, 32)``) and 0/1
    labels (``(n, 1)``); feature 0 is the sentinel in ``fraction`` of rows."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"`n` must be an int >= 1, got {n!r}.")
    if not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
        raise ValueError(f"`fraction` must be a number in [0, 1], got {fraction!r}.")
    rng = np.random.default_rng(seed)
    z = rng.normal(size=(n, _FEATURES)).astype("float32")
    w = np.random.default_rng(99).normal(size=(_FEATURES,)).astype("float32")
    x = z.copy()
    x[:, 0] = np.where(rng.random(n) < fraction, SENTINEL, 0.0)
    return x, (z[:, 1:] @ w[1:] > 0).astype("float32")[:, None]


def sentinel_model(policy: Any = "adaptive_float16") -> keras.Model:
    """The MLP, built under ``policy`` (the global policy is restored after)."""
    with policies.policy_scope(policy):
        return keras.Sequential([
            keras.Input((_FEATURES,)),
            keras.layers.Dense(64, name="features"),
            # Normalization kept in float32, as is usual under mixed precision.
            keras.layers.BatchNormalization(momentum=0.9, dtype="float32", name="norm"),
            keras.layers.ReLU(name="relu"),
            keras.layers.Dense(32, activation="relu", name="hidden"),
            keras.layers.Dense(1, name="logit"),
        ], name="sentinel_mlp")


def _compile(model: keras.Model, steps: int = 1) -> None:
    # The learning rate decays, so the weight of the uninformative sentinel
    # settles near 0 (Adam's steps on it shrink with the rate).
    rate = keras.optimizers.schedules.CosineDecay(3e-3, decay_steps=steps, alpha=1e-4)
    model.compile(optimizer=keras.optimizers.Adam(rate),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True),
                  metrics=["accuracy"])


def train(epochs: int = 6, *, n: int = 2048, seed: int = 0
          ) -> tuple[keras.Model, callbacks.AdaptivePrecision]:
    """Trains :func:`sentinel_model` under ``adaptive_float16`` with
    :class:`~keras_mp.callbacks.AdaptivePrecision`; a few seconds on a CPU."""
    keras.utils.set_random_seed(seed)
    x, y = sentinel_data(n, seed)
    model = sentinel_model()
    batch = 32
    _compile(model, steps=epochs * (n // batch))
    callback = callbacks.AdaptivePrecision(interval=5)
    model.fit(x, y, batch_size=batch, epochs=epochs, verbose=0, callbacks=[callback])
    return model, callback


def _accuracy(model: keras.Model, x, y) -> float:
    logits = model.predict(x, batch_size=256, verbose=0)
    return float(np.mean((logits > 0) == (y > 0.5)))


def compare(model: keras.Model, *, mode: str = "int8", n: int = 2048, seed: int = 1,
            directory: str | None = None) -> dict[str, dict[str, Any]]:
    """Accuracy on held-out rows and ``.keras`` size of the float model, the
    model quantized entirely (Keras's ``model.quantize``) and the guided one
    (:func:`keras_mp.quantize`). ``model`` is left as it was.

    Returns:
        variant (``"float"``, ``"full"``, ``"guided"``) -> ``{"accuracy",
        "bytes", "path"}``, plus ``"plan"`` for the guided one.
    """
    quantization._check_mode(mode)
    x, y = sentinel_data(n, seed)
    directory = directory or tempfile.mkdtemp(prefix="keras_mp_deploy_")
    source = os.path.join(directory, "float.keras")
    model.save(source)
    out: dict[str, dict[str, Any]] = {
        "float": {"accuracy": _accuracy(model, x, y), "bytes": os.path.getsize(source),
                  "path": source}}
    for variant in ("full", "guided"):
        copy = keras.saving.load_model(source, compile=False)
        if variant == "full":
            # Everything Keras can quantize; int8 needs a non-float16 compute dtype.
            plan = {path: "quantize" for path in quantization.plan(copy, mode)}
            for layer in copy.layers:
                if mode == "int8" and quantization._supported(layer) \
                        and layer.compute_dtype == "float16":
                    quantization._compute_in_float32(layer)
            # (filters: Keras checks the dtype of every layer it visits,
            # int8 refuses float16 even on a ReLU it then skips).
            copy.quantize(mode, filters=quantization._supported)
        else:
            plan = quantization.quantize(copy, mode)
        path = os.path.join(directory, f"{variant}_{mode}.keras")
        copy.save(path)
        out[variant] = {"accuracy": _accuracy(copy, x, y), "bytes": os.path.getsize(path),
                        "path": path, "plan": plan}
    return out
