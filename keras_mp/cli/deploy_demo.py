"""The guided-quantization demonstration: adaptive training finds the layer
that int8 would break, and :func:`keras_mp.quantize` keeps it in float.

The problem: 31 standard-normal features decide the label (a linear rule);
feature 0 is a constant 70000 that carries no information (an unscaled
constant column, as in unprepared tabular data). The model is an MLP whose
first ``Dense`` is followed by a capped ReLU and ``BatchNormalization`` (both
float32, as normalization usually is under mixed precision), trained under
``adaptive_float16``:

* in float16, 70000 is beyond float16's 65504: the first ``Dense``
  overflows, its gradients are not finite, and
  :class:`keras_mp.callbacks.AdaptivePrecision` promotes it to float32 (its
  history records the switch). In float32 its response to the constant is
  a constant per unit, which ``BatchNormalization`` removes; the later
  layers see normalized activations and stay in float16;
* Keras's int8 ``Dense`` quantizes each input row by its largest magnitude:
  with 70000 in every row the step is 70000/127 = 551, every informative
  feature rounds to 0, and the prediction is lost. The later layers' inputs
  have no such outliers and quantize well.

So quantizing everything (``model.quantize("int8")``) loses the first layer,
while the guided version (``keras_mp.quantize(model, "int8")``) keeps the
promoted first layer in float and quantizes the rest.

Example:
    >>> from keras_mp.cli import deploy_demo
    >>> x, y = deploy_demo.sentinel_data(4, seed=0)
    >>> x.shape, y.shape, float(x[:, 0].min())
    ((4, 32), (4, 1), 70000.0)
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import keras
import numpy as np

from keras_mp import callbacks, policies
from keras_mp.deploy import quantization

__all__ = ["SENTINEL", "sentinel_data", "sentinel_model", "train", "compare"]

#: The sentinel value: beyond float16's largest finite value (65504).
SENTINEL = 7e4
_FEATURES = 32


def sentinel_data(n: int, seed: int = 0, *, fraction: float = 1.0
                  ) -> tuple[np.ndarray, np.ndarray]:
    """``n`` rows of the problem: features (float32, ``(n, 32)``) and 0/1
    labels (``(n, 1)``); feature 0 is :data:`SENTINEL` in ``fraction`` of
    the rows (all by default), 0 in the others."""
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
            # In float32, as is usual for normalization under mixed precision.
            # The cap keeps a float16 overflow (inf) out of BatchNormalization's
            # moving statistics; the activations stay far below it once the
            # first layer computes in float32.
            keras.layers.ReLU(max_value=6e4, dtype="float32", name="relu"),
            keras.layers.BatchNormalization(momentum=0.5, dtype="float32", name="norm"),
            keras.layers.Dense(32, activation="relu", name="hidden"),
            keras.layers.Dense(1, name="logit"),
        ], name="sentinel_mlp")


def _compile(model: keras.Model, steps: int = 1) -> None:
    # The learning rate decays to 0, so the first layer's response to the
    # constant sentinel settles and BatchNormalization's moving mean (which
    # cancels it at inference) follows.
    rate = keras.optimizers.schedules.CosineDecay(3e-3, decay_steps=steps, alpha=0.0)
    model.compile(optimizer=keras.optimizers.Adam(rate),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True),
                  metrics=["accuracy"])


def train(epochs: int = 6, *, n: int = 2048, seed: int = 0
          ) -> tuple[keras.Model, callbacks.AdaptivePrecision]:
    """Trains :func:`sentinel_model` under ``adaptive_float16`` with
    :class:`~keras_mp.callbacks.AdaptivePrecision`; a few seconds on a CPU."""
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"`epochs` must be an int >= 1, got {epochs!r}.")
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
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a Keras model, got {model!r}.")
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
