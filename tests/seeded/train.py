"""A seeded run that tests/test_seeded_runs.py starts twice, in fresh processes.

Usage: ``python train.py POLICY OUT_DIR``

As a user runs it: ``keras_mp.set_global_policy(POLICY)``, then ``compile`` and
``fit`` (which adapts: ``keras_mp.config.set_min_saving(0)``, so that these
small fits adapt as a larger one would), ``KERAS_MP_EXECUTION`` unset (the
execution mode measured; ``KERAS_MP_CACHE_DIR`` names where the measurements
are kept). Two functional models, each seeded with
``keras.utils.set_random_seed``:

* ``dense``: a Dense stack with Adam, 1024 train steps (more than
  ``keras_mp.execution.reasons.SHORT_FIT``, so that the execution mode is
  decided from measurements, not by the short-fit rule): its first calls are
  timed as a graph, and the fit, seconds long, keeps the graph
  (``keras_mp.execution.first_calls``; the median call is kept on disk);
* ``lstm``: an LSTM and a Dense head with RMSprop, whose update has no
  native kernel, so the trial has the update under XLA to try; 1056 train
  steps, more than ``SHORT_FIT`` too (a shorter fit of any model measures
  nothing). It stands for a long fit (``first_calls.TRIAL_AFTER_S`` set to
  0): after its first calls, the trial.

A feature of a few batches is beyond float16 (7e4): under
``"adaptive_float16"`` steps are skipped and layers are promoted, so the
train step is rebuilt and its new compute dtypes are tried again mid-fit.

Writes ``OUT_DIR/<model>.npz`` (every variable of the training state, by
position) and ``OUT_DIR/info.json`` (per model: the mode chosen, the
precision report, and what keras_mp logged about the execution mode).
"""

from __future__ import annotations

import json
import logging
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402


class _Said(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def dense(keras, rng):
    inputs = keras.Input((16,))
    h = keras.layers.Dense(64, activation="gelu")(inputs)
    h = keras.layers.Dense(64, activation="relu")(h)
    model = keras.Model(inputs, keras.layers.Dense(1)(h))
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    x = rng.normal(size=(4096, 16)).astype("float32")
    y = x[:, :4].sum(axis=1, keepdims=True)
    x[::1024, 1] = 7e4
    return model, x, y, dict(batch_size=4, epochs=1)


def lstm(keras, rng):
    inputs = keras.Input((12, 8))
    h = keras.layers.LSTM(16)(inputs)
    h = keras.layers.Dropout(0.2)(h)
    model = keras.Model(inputs, keras.layers.Dense(1)(h))
    model.compile(optimizer="rmsprop", loss="mse", metrics=["mae"])
    x = rng.normal(size=(352 * 16, 12, 8)).astype("float32")
    y = x[:, 0, :1] + x[:, -1, 1:2]
    x[::96, 0, 2] = 7e4
    return model, x, y, dict(batch_size=16, epochs=3)


def main(policy: str, out: str) -> None:
    import keras

    import keras_mp
    from keras_mp.execution import first_calls, step_trial

    said = _Said()
    logging.getLogger("keras_mp").addHandler(said)
    logging.getLogger("keras_mp").setLevel(logging.INFO)
    keras_mp.set_global_policy(policy)
    keras_mp.config.set_min_saving(0)
    os.makedirs(out, exist_ok=True)
    info = {}
    for build in (dense, lstm):
        said.lines.clear()
        first_calls.TRIAL_AFTER_S = 0.0 if build is lstm else 60.0
        keras.utils.set_random_seed(7)
        model, x, y, fit = build(keras, np.random.default_rng(0))
        history = model.fit(x, y, verbose=0, **fit)
        state = step_trial.training_state(model)
        np.savez(os.path.join(out, f"{build.__name__}.npz"),
                 **{f"{i:03d}": np.asarray(v) for i, v in enumerate(state)})
        info[build.__name__] = {
            "chosen": keras_mp.execution.chosen(model),
            "loss": [float(v) for v in history.history["loss"]],
            "report": keras_mp.precision_report(model).to_dict(),
            "variables": [getattr(v, "path", None) or v.name for v in state],
            # What the execution trial said (not the rules that leave only the graph).
            "said": [line for line in said.lines if "this model's train step runs" in line],
            # What its first calls, timed as a graph, decided.
            "first_calls": [line for line in said.lines if " calls take about " in line],
        }
    with open(os.path.join(out, "info.json"), "w") as f:
        json.dump(info, f, indent=1, default=str)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
