"""A training run that test_resume.py and ``python -m tests.faults`` kill with SIGKILL and restart.

Usage::

    python train.py --backup DIR --out FILE [--checkpoints DIR] [--started FILE]
                    [--kill-in-save N] [--hang-after N --ready FILE]
    python train.py --save-loop DIR --started FILE [--kill-in-save N]

Trains a tiny model under the adaptive float16 policy with
``keras_mp.callbacks.AdaptivePrecision`` (which wraps the optimizer in a
``keras_mp.LossScaleOptimizer`` with hysteresis) and
``keras.callbacks.BackupAndRestore(DIR)``. Some inputs overflow float16, so
the loss scale backs off, steps are skipped and layers switch precision
during the first epoch: all of that state must survive a kill.

* ``--checkpoints DIR``: also ``ModelCheckpoint`` to ``DIR/last.keras`` (one
  file, overwritten every epoch) and ``DIR/epoch{epoch}.weights.h5``.
* ``--started FILE``: written when training starts (after any restore), for
  a kill at a chosen time after it.
* ``--kill-in-save N``: the process kills itself with SIGKILL in the middle
  of its N-th save (counting every ``model.save`` and ``save_weights``,
  backups and checkpoints alike): after all variables are written, before
  the file is closed. (:class:`Tripwire`, attached to the model, is what
  Keras's saving visits last.)
* ``--hang-after N``: writes ``--ready`` after the N-th train step (counting
  across epochs) and then sleeps until killed.
* ``--save-loop DIR``: trains one epoch, then saves without end, each round
  ``model.save`` (``model.keras``), ``save_weights`` (``model.weights.h5``),
  ``keras_mp.export`` (SavedModel ``served/``, ``model.tflite``,
  ``model.onnx``) and ``keras_mp.plot_precision`` (``precision.png``);
  ``--started`` gets the first round's seconds once every file exists.

Without a kill it finishes and writes the final state to ``--out`` (JSON).
Every run appends the state it starts each epoch with (after any restore)
and ends each epoch with (after the backup) to ``--out`` + ``.log`` as JSON
lines.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

EPOCHS = 3
BATCH = 8
STEPS = 4  # per epoch
SAVES_PER_EPOCH = 3  # with --checkpoints: the backup, last.keras, epoch{epoch}.weights.h5


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * BATCH, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    x[::2 * BATCH, 0] = 7e4  # beyond float16 in batches 0 and 2 of every epoch
    return x, y


def tripwire(kill_in_save: int | None):
    """A layer that is only saved: Keras's saving visits it last of all the
    model's attributes (private names sort last), and it SIGKILLs the process
    on its ``kill_in_save``-th visit, with the file still open."""
    import keras

    class Tripwire(keras.layers.Layer):
        saves = 0

        def save_own_variables(self, store):
            Tripwire.saves += 1
            if Tripwire.saves == kill_in_save:
                os.kill(os.getpid(), signal.SIGKILL)

    return Tripwire(name="tripwire")


def build(kill_in_save: int | None = None):
    """The model (compiled, with its tripwire) and its AdaptivePrecision."""
    import keras

    from keras_mp import policies
    from keras_mp.callbacks import AdaptivePrecision
    from keras_mp.scaling import loss_scale

    keras.utils.set_random_seed(0)
    policies.set_global_policy("adaptive_float16")
    small = keras.initializers.RandomUniform(-0.05, 0.05, seed=1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, kernel_initializer=small),
                              keras.layers.Dense(4), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", jit_compile=False)
    object.__setattr__(model, "_zz_tripwire", tripwire(kill_in_save))  # not a layer of the model
    adaptive = AdaptivePrecision(interval=2, statistics_every=1, loss_scale=loss_scale.DynamicLossScale(
        initial_scale=1.0, growth_interval=3, hysteresis=2))  # at the floor: overflows count
    return model, adaptive


def state(model, cb) -> dict:
    """Everything a resumed run must get back, as plain Python values."""
    import keras

    from keras_mp.adaptive.outputs.report import precision_report
    from keras_mp.adaptive.record import timeline

    opt = model.optimizer
    report = precision_report(model)
    held = timeline.of(model)
    return {
        "loss_scale_state": {k: float(keras.ops.convert_to_numpy(v))
                             for k, v in opt.loss_scale_state.items()},
        "skipped_steps": int(opt.skipped_steps.numpy()),
        "consecutive_skips": int(opt.consecutive_skips.numpy()),
        "iterations": int(opt.iterations.numpy()),
        "dtypes": report.dtypes(),
        "controller": [r["state"] for r in report.rows],
        "history": {r["layer"]: r["history"] for r in report.rows},
        "timeline": None if held is None else held.get_config(),
        "calls": int(cb._state.calls.numpy()),
    }


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def save_loop(folder: str, started: str, kill_in_save: int | None) -> None:
    import keras_mp

    model, adaptive = build(kill_in_save)
    x, y = data()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[adaptive])
    first = None
    while True:
        begin = time.monotonic()
        model.save(os.path.join(folder, "model.keras"))
        model.save_weights(os.path.join(folder, "model.weights.h5"))
        keras_mp.export(model, os.path.join(folder, "served"))
        keras_mp.export(model, os.path.join(folder, "model.tflite"), format="litert")
        keras_mp.export(model, os.path.join(folder, "model.onnx"), format="onnx")
        keras_mp.plot_precision(model, os.path.join(folder, "precision.png"))
        if first is None:
            first = time.monotonic() - begin
            _write(started, str(first))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backup")
    parser.add_argument("--out")
    parser.add_argument("--checkpoints", default=None)
    parser.add_argument("--started", default=None)
    parser.add_argument("--kill-in-save", type=int, default=None)
    parser.add_argument("--hang-after", type=int, default=None)
    parser.add_argument("--ready", default=None)
    parser.add_argument("--save-loop", default=None)
    args = parser.parse_args()

    # Bitwise-reproducible on CPU: deterministic kernels, one thread.
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.experimental.enable_op_determinism()
    if args.save_loop:
        save_loop(args.save_loop, args.started, args.kill_in_save)
        return
    import keras

    model, adaptive = build(args.kill_in_save)
    log_path = args.out + ".log"

    class Record(keras.callbacks.Callback):
        steps = 0

        def _log(self, when, epoch):
            with open(log_path, "a") as f:
                f.write(json.dumps({"when": when, "epoch": epoch,
                                    **state(self.model, adaptive)}) + "\n")

        def on_train_begin(self, logs=None):
            if args.started:
                _write(args.started, str(os.getpid()))

        def on_epoch_begin(self, epoch, logs=None):
            self._log("begin", epoch)

        def on_epoch_end(self, epoch, logs=None):
            self._log("end", epoch)

        def on_train_batch_end(self, batch, logs=None):
            Record.steps += 1
            if args.hang_after is not None and Record.steps == args.hang_after:
                _write(args.ready, str(os.getpid()))
                time.sleep(600)  # until the test kills us
                sys.exit(3)  # never reached when the test works

    # Order matters only for what Record sees: after the restore and the
    # callback's adoption of the restored precisions, after the backup.
    callbacks = [keras.callbacks.BackupAndRestore(args.backup), adaptive, Record()]
    if args.checkpoints:
        callbacks += [
            keras.callbacks.ModelCheckpoint(os.path.join(args.checkpoints, "last.keras")),
            keras.callbacks.ModelCheckpoint(
                os.path.join(args.checkpoints, "epoch{epoch}.weights.h5"), save_weights_only=True)]
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
