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
    adaptive: ``model.fit`` of a model built under the ``"adaptive_float16"``
        policy with ``keras_mp.callbacks.AdaptivePrecision``, on per-worker
        input where only worker 1's rows overflow float16 in the first layer
        (not in the default phases: the test runs it in a cluster of its own).
    storage: ``model.fit`` under ``"adaptive_bfloat16"`` of a model whose
        first layer is frozen, compact weights and moments turned on
        (``keras_mp.config.set_compact_weights(True)``,
        ``set_compact_moments(True)``): no variable can be made in bfloat16
        under this strategy (not in the default phases either).
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
ADAPTIVE_STEPS = 6
ADAPTIVE_INTERVAL = 2
OVERFLOW = 7e4  # beyond float16's largest finite value, 65504


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


def worker_dataset_fn(nan: bool, data=None):
    """For ``distribute_datasets_from_function``: worker i gets rows
    ``[i*b, (i+1)*b)`` of each global batch, b the per-replica batch size.
    ``data``: a function returning ``(x, y)`` (default: :func:`make_data`)."""
    def dataset_fn(ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        x, y = make_data(nan) if data is None else data()
        b = ctx.get_per_replica_batch_size(GLOBAL_BATCH)
        i = ctx.input_pipeline_id
        take = lambda a: a.reshape(-1, GLOBAL_BATCH, a.shape[-1])[:, i * b:(i + 1) * b]  # noqa: E731
        xs, ys = (take(a).reshape(-1, a.shape[-1]) for a in (x, y))
        return tf.data.Dataset.from_tensor_slices((xs, ys)).batch(b)
    return dataset_fn


def make_adaptive_data() -> tuple[np.ndarray, np.ndarray]:
    """``ADAPTIVE_STEPS`` global batches; the last row of each, which
    :func:`worker_dataset_fn` gives to worker 1, has a feature of
    ``OVERFLOW``: float16 inf in the first Dense layer on worker 1 only."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(ADAPTIVE_STEPS * GLOBAL_BATCH, FEATURES)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    x[GLOBAL_BATCH - 1::GLOBAL_BATCH, 0] = OVERFLOW
    return x, y


def train_adaptive(strategy, data, **fit_kwargs):
    """Builds and fits the adaptive model under ``strategy`` on ``data`` (a
    dataset, or ``(x, y)``); returns ``(model, callback, initial weights)``.
    The worker and the test's single-process reference both train through it."""
    import keras

    from keras_mp.scaling import loss_scale
    from keras_mp import policies
    from keras_mp.callbacks import AdaptivePrecision

    init = lambda seed: keras.initializers.RandomUniform(-0.05, 0.05, seed=seed)  # noqa: E731
    with policies.policy_scope("adaptive_float16"), strategy.scope():
        model = keras.Sequential([
            keras.Input((FEATURES,)),
            keras.layers.Dense(8, kernel_initializer=init(1), name="mw_in"),
            keras.layers.Dense(4, kernel_initializer=init(2), name="mw_hidden"),
            keras.layers.Dense(1, kernel_initializer=init(3), name="mw_out"),
        ], name="mw_adaptive")
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", jit_compile=False)
    cb = AdaptivePrecision(ADAPTIVE_INTERVAL,
                           loss_scale=loss_scale.DynamicLossScale(initial_scale=2.0))
    w0 = _weights(model)
    x = data if isinstance(data, tuple) else (data,)
    model.fit(*x, epochs=1, verbose=0, callbacks=[cb], **fit_kwargs)
    return model, cb, w0


def adaptive_summary(model, cb) -> dict[str, Any]:
    """What the test compares: report, controller and loss-scale state, weights."""
    import keras

    from keras_mp.adaptive.outputs.report import precision_report

    def values(variables) -> dict[str, list]:
        return {v.path: np.asarray(keras.ops.convert_to_numpy(v)).ravel().tolist()
                for v in variables}

    opt = model.optimizer
    return {
        "report": precision_report(model).to_dict(),
        "events": cb.events,
        "calls": cb._calls,
        "controller": values(cb._state.weights),
        "statistics": values(cb._stats.weights),
        "optimizer": type(opt).__name__,
        "loss_scale": float(keras.ops.convert_to_numpy(opt.loss_scale)),
        "iterations": int(keras.ops.convert_to_numpy(opt.iterations)),
        "skipped_steps": int(keras.ops.convert_to_numpy(opt.skipped_steps)),
        "optimizer_variables": values(opt.variables),
        "w": _weights(model),
    }


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


def _phase_adaptive(strategy) -> dict[str, Any]:
    data = strategy.distribute_datasets_from_function(
        worker_dataset_fn(nan=False, data=make_adaptive_data))
    model, cb, w0 = train_adaptive(strategy, data)
    return {"w0": w0, **adaptive_summary(model, cb)}


def _phase_storage(strategy) -> dict[str, Any]:
    import keras

    import keras_mp
    from keras_mp import policies
    from keras_mp.adaptive.storage import trained

    keras_mp.config.set_compact_weights(True)
    keras_mp.config.set_compact_moments(True)
    keras_mp.config.set_min_saving(0)
    try:
        with policies.policy_scope("adaptive_bfloat16"), strategy.scope():
            model = make_model()
            model.layers[0].trainable = False
            model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", jit_compile=False)
        data = strategy.distribute_datasets_from_function(worker_dataset_fn(nan=False))
        history = model.fit(data, epochs=2, verbose=0)
    finally:
        keras_mp.config.set_compact_weights(None)
        keras_mp.config.set_compact_moments(None)
        keras_mp.config.set_min_saving(0.5)
    policy = keras_mp.policies.policy_of(model)
    return {
        "dtypes": {v.path: str(v.dtype) for v in model.weights},
        "storage": {layer.path: policy.record(layer.path).get("storage", {})
                    for layer in model.layers},
        "moment_dtypes": sorted({str(v.dtype) for v in model.optimizer.variables
                                 if len(v.shape)}),
        "compute": [layer.compute_dtype for layer in model.layers],
        "compact_reason": trained.adam_reason(model.optimizer),
        "loss": history.history["loss"],
        "w": _weights(model),
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
        if "adaptive" in phases:
            result["adaptive"] = _phase_adaptive(strategy)
        if "storage" in phases:
            result["storage"] = _phase_storage(strategy)
    except Exception:  # noqa: BLE001 - reported to the test, which fails on it
        result["error"] = traceback.format_exc()
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
