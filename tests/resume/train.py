"""A training run that test_resume.py kills with SIGKILL and restarts.

Usage: ``python train.py --backup DIR --out FILE [--hang-after N --ready FILE]``

Trains a tiny model under the adaptive float16 policy with
``keras_mp.callbacks.AdaptivePrecision`` (which wraps the optimizer in a
``keras_mp.LossScaleOptimizer`` with hysteresis) and
``keras.callbacks.BackupAndRestore(DIR)``. Some inputs overflow float16, so
the loss scale backs off, steps are skipped and layers switch precision
during the first epoch: all of that state must survive a kill.

With ``--hang-after N`` it writes ``--ready`` after its N-th train step
(counting across epochs) and then sleeps until killed. Without it, it
finishes and writes the final state to ``--out`` (JSON). Every run appends
the state it starts each epoch with (after any restore) and ends each epoch
with (after the backup) to ``--out`` + ``.log`` as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

EPOCHS = 3
BATCH = 8
STEPS = 4  # per epoch


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * BATCH, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    x[::2 * BATCH, 0] = 7e4  # beyond float16 in batches 0 and 2 of every epoch
    return x, y


def state(model, cb) -> dict:
    """Everything a resumed run must get back, as plain Python values."""
    import keras

    from keras_mp.adaptive.outputs.report import precision_report

    opt = model.optimizer
    return {
        "loss_scale_state": {k: float(keras.ops.convert_to_numpy(v))
                             for k, v in opt.loss_scale_state.items()},
        "skipped_steps": int(opt.skipped_steps.numpy()),
        "consecutive_skips": int(opt.consecutive_skips.numpy()),
        "iterations": int(opt.iterations.numpy()),
        "dtypes": precision_report(model).dtypes(),
        "controller": [r["state"] for r in precision_report(model).rows],
        "calls": int(cb._state.calls.numpy()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backup", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--hang-after", type=int, default=None)
    parser.add_argument("--ready", default=None)
    args = parser.parse_args()

    # Bitwise-reproducible on CPU: deterministic kernels, one thread.
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.experimental.enable_op_determinism()
    import keras

    from keras_mp.scaling import loss_scale
    from keras_mp import policies
    from keras_mp.callbacks import AdaptivePrecision

    keras.utils.set_random_seed(0)
    policies.set_global_policy("adaptive_float16")
    small = keras.initializers.RandomUniform(-0.05, 0.05, seed=1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, kernel_initializer=small),
                              keras.layers.Dense(4), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", jit_compile=False)
    adaptive = AdaptivePrecision(interval=2, statistics_every=1, loss_scale=loss_scale.DynamicLossScale(
        initial_scale=1.0, growth_interval=3, hysteresis=2))  # at the floor: overflows count
    log_path = args.out + ".log"

    class Record(keras.callbacks.Callback):
        steps = 0

        def _log(self, when, epoch):
            with open(log_path, "a") as f:
                f.write(json.dumps({"when": when, "epoch": epoch,
                                    **state(self.model, adaptive)}) + "\n")

        def on_epoch_begin(self, epoch, logs=None):
            self._log("begin", epoch)

        def on_epoch_end(self, epoch, logs=None):
            self._log("end", epoch)

        def on_train_batch_end(self, batch, logs=None):
            Record.steps += 1
            if args.hang_after is not None and Record.steps == args.hang_after:
                with open(args.ready, "w") as f:
                    f.write(str(os.getpid()))
                time.sleep(600)  # until the test kills us
                sys.exit(3)  # never reached when the test works

    # Order matters only for what Record sees: after the restore and the
    # callback's adoption of the restored precisions, after the backup.
    callbacks = [keras.callbacks.BackupAndRestore(args.backup), adaptive, Record()]
    x, y = data()
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
              callbacks=callbacks)
    result = state(model, adaptive)
    result["weights"] = [w.numpy().ravel().tolist() for w in model.weights]
    result["optimizer"] = [np.asarray(v.numpy()).ravel().tolist()
                           for v in model.optimizer.variables]
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
