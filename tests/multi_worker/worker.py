"""One worker of the two-worker ``model.fit`` test (run by ``launch.py``).

Reads its place in the cluster from ``TF_CONFIG``, trains in three phases
under one ``MultiWorkerMirroredStrategy`` and writes what it saw as JSON to
``--out``. The data and model helpers are imported by the test as well, so the
single-process reference trains on exactly the same problem.

Phases:
    unpatched: ``model.fit`` with Keras's own code (fails while Keras has the
        faults keras_mp fixes).
    sgd: ``model.fit`` with the fix, plain ``tf.data`` input, validation too.
    lso: ``model.fit`` with ``keras_mp.LossScaleOptimizer`` and per-worker
        input where only worker 1 sees a NaN, at global step ``NAN_STEP``.
"""

from __future__ import annotations

import argparse
import json
import os
import traceback
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

FEATURES = 4
GLOBAL_BATCH = 8
STEPS = 4
LR = 0.1
NAN_STEP = 1
NAN_WORKER = 1


def make_data(nan: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """``STEPS`` global batches of a regression problem, flattened.

    With ``nan``, one input row of global step ``NAN_STEP`` is NaN; it is a
    row that per-worker input (:func:`worker_dataset_fn`) gives to worker
    ``NAN_WORKER`` only.
    """
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * GLOBAL_BATCH, FEATURES)).astype("float32")
    y = (x @ rng.normal(size=(FEATURES, 1)) + 0.1).astype("float32")
    if nan:
        per_worker = GLOBAL_BATCH // 2
        x[NAN_STEP * GLOBAL_BATCH + NAN_WORKER * per_worker, 0] = np.nan
    return x, y


def make_model():
    """A tiny MLP (built, so its weights exist before ``fit``)."""
    import keras

    return keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(3, activation="tanh"),
        keras.layers.Dense(1),
    ])


def global_dataset(nan: bool = False) -> tf.data.Dataset:
    """The data in global batches, as a user would pass it to ``fit``."""
    return tf.data.Dataset.from_tensor_slices(make_data(nan)).batch(GLOBAL_BATCH)


def worker_dataset_fn(nan: bool):
    """For ``distribute_datasets_from_function``: worker i gets rows
    ``[i*b, (i+1)*b)`` of each global batch, b the per-replica batch size."""
    def dataset_fn(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        x, y = make_data(nan)
        b = ctx.get_per_replica_batch_size(GLOBAL_BATCH)
        i = ctx.input_pipeline_id
        take = lambda a: a.reshape(STEPS, GLOBAL_BATCH, -1)[:, i * b:(i + 1) * b]  # noqa: E731
        xs, ys = (take(a).reshape(-1, a.shape[-1]) for a in (x, y))
        return tf.data.Dataset.from_tensor_slices((xs, ys)).batch(b)
    return dataset_fn


def _weights(model) -> list[list[float]]:
    return [w.ravel().tolist() for w in model.get_weights()]


def _phase_unpatched(strategy, distribute) -> dict[str, Any]:
    import keras

    distribute.unpatch_multi_worker()
    with strategy.scope():
        model = make_model()
        model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    try:
        model.fit(global_dataset(), epochs=1, verbose=0)
        return {"error": None}
    except ValueError as e:
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


def _phase_sgd(strategy) -> dict[str, Any]:
    import keras

    with strategy.scope():
        model = make_model()
        model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    w0 = _weights(model)
    history = model.fit(global_dataset(), epochs=2, verbose=0,
                        validation_data=global_dataset())
    return {"w0": w0, "w": _weights(model), "history": history.history}


def _phase_lso(strategy) -> dict[str, Any]:
    import keras

    try:
        from keras_mp import LossScaleOptimizer
    except ImportError as e:
        return {"unavailable": str(e)}
    with strategy.scope():
        model = make_model()
        opt = LossScaleOptimizer(keras.optimizers.SGD(LR))
        model.compile(optimizer=opt, loss="mse")
    w0 = _weights(model)
    data = strategy.distribute_datasets_from_function(worker_dataset_fn(nan=True))
    model.fit(data, epochs=1, verbose=0)
    skipped = getattr(opt, "skipped_steps", None)
    return {
        "w0": w0,
        "w": _weights(model),
        "iterations": int(opt.iterations.numpy()),
        "loss_scale": float(keras.ops.convert_to_numpy(opt.loss_scale)),
        "skipped_steps": None if skipped is None else int(skipped.numpy()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, help="path of the JSON result")
    parser.add_argument("--phases", default="unpatched,sgd,lso")
    args = parser.parse_args()

    # Two workers share two cores with the test: one thread each keeps them
    # from starving each other's collectives.
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras

    import keras_mp.distribute as distribute

    keras.utils.set_random_seed(0)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    result: dict[str, Any] = {
        "task": json.loads(os.environ["TF_CONFIG"])["task"]["index"],
        "faults": list(distribute.keras_multi_worker_faults()),
        "num_replicas": strategy.num_replicas_in_sync,
    }
    phases = args.phases.split(",")
    try:
        if "unpatched" in phases:
            result["unpatched"] = _phase_unpatched(strategy, distribute)
        result["patched"] = list(distribute.patch_multi_worker())
        if "sgd" in phases:
            result["sgd"] = _phase_sgd(strategy)
        if "lso" in phases:
            result["lso"] = _phase_lso(strategy)
    except Exception:  # noqa: BLE001 - reported to the test, which fails on it
        result["error"] = traceback.format_exc()
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
