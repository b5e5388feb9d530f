"""Checkpoints and resume: a run killed with SIGKILL mid-epoch and restarted
with ``BackupAndRestore`` ends bit for bit where an uninterrupted run ends,
loss-scale state, counters, hysteresis and precision decisions included; and
``tf.train.Checkpoint`` carries the adaptive decisions too.

(``model.save``/``load_model`` and ``tf.train.Checkpoint`` of the loss-scale
state are in test_optimizer.py; ``.keras`` files and epoch-level
``BackupAndRestore`` of the precisions in test_callbacks.py.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_mp.scaling import loss_scale
from keras_mp import policies
from keras_mp.callbacks import AdaptivePrecision
from keras_mp.adaptive.outputs.report import precision_report

SCRIPT = Path(__file__).parent / "resume" / "train.py"
TIMEOUT_S = 150  # per process; ~15 s each on 2 busy cores
HANG_AFTER = 6  # train steps: epoch 0 has 4, so this is mid-epoch 1


def _start(tmp_path: Path, name: str, *extra: str) -> subprocess.Popen:
    log = open(tmp_path / f"{name}.stderr", "w")
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), "--backup", str(tmp_path / f"{name}_backup"),
         "--out", str(tmp_path / f"{name}.json"), *extra],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env=dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1])))


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _wait(proc: subprocess.Popen, tmp_path: Path, name: str) -> None:
    try:
        rc = proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        rc = "timeout"
    assert rc == 0, f"{name} failed ({rc}):\n" + (tmp_path / f"{name}.stderr").read_text()[-4000:]


def _log(tmp_path: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / f"{name}.json.log").read_text().splitlines()]


def _strip(entry: dict) -> dict:
    return {k: v for k, v in entry.items() if k not in ("when", "epoch")}


def test_sigkill_mid_epoch_then_resume_ends_bitwise_as_uninterrupted(tmp_path):
    ready = tmp_path / "ready"
    reference = _start(tmp_path, "reference")
    victim = _start(tmp_path, "run", "--hang-after", str(HANG_AFTER), "--ready", str(ready))
    procs = [reference, victim]
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not ready.exists():
            assert victim.poll() is None, "the run exited before it was killed:\n" + \
                (tmp_path / "run.stderr").read_text()[-4000:]
            assert time.monotonic() < deadline, "the run never reached the kill point"
            time.sleep(0.2)
        os.kill(victim.pid, signal.SIGKILL)
        assert victim.wait(timeout=30) == -signal.SIGKILL
        assert not (tmp_path / "run.json").exists()
        killed_log = _log(tmp_path, "run")

        resumed = _start(tmp_path, "run")  # same command, same backup dir
        procs.append(resumed)
        _wait(resumed, tmp_path, "run")
        _wait(reference, tmp_path, "reference")
    finally:
        for p in procs:
            _stop(p)

    # What was backed up at the end of epoch 0 is not the fresh state...
    backed_up = _strip([e for e in killed_log if e["when"] == "end"][-1])
    assert backed_up["skipped_steps"] > 0
    assert "float32" in backed_up["dtypes"].values(), "no precision switch before the kill"
    assert backed_up["loss_scale_state"]["hysteresis_left"] >= 0
    # ...and is exactly what the restarted run starts its first epoch with.
    resumed_log = _log(tmp_path, "run")[len(killed_log):]
    assert resumed_log[0]["when"] == "begin" and resumed_log[0]["epoch"] == 1
    assert _strip(resumed_log[0]) == backed_up

    ref = json.loads((tmp_path / "reference.json").read_text())
    run = json.loads((tmp_path / "run.json").read_text())
    assert run.keys() == ref.keys()
    for key in ref:
        assert run[key] == ref[key], key  # bitwise: floats compared exactly
    assert not (tmp_path / "run_backup").exists(), "the backup outlived a finished run"


# -- tf.train.Checkpoint ---------------------------------------------------------

def _adaptive_model():
    policies.set_global_policy("adaptive_float16")
    small = keras.initializers.RandomUniform(-0.05, 0.05, seed=1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, kernel_initializer=small),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", jit_compile=False)
    return model


def _overflowing():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    x[::8, 0] = 7e4
    return x, y


def test_tf_checkpoint_carries_loss_scale_and_precision_decisions(tmp_path):
    model = _adaptive_model()
    cb = AdaptivePrecision(interval=2, loss_scale=loss_scale.DynamicLossScale(
        initial_scale=2.0, hysteresis=2))
    # Enough non-finite steps at the scale floor for the first layer's promotion.
    model.fit(*_overflowing(), batch_size=8, epochs=4, shuffle=False, verbose=0,
              callbacks=[cb])
    assert model.layers[0].compute_dtype == "float32", cb.events
    saved_report = precision_report(model)
    saved_opt = [v.numpy().copy() for v in model.optimizer.variables]
    path = tf.train.Checkpoint(model=model).save(str(tmp_path / "ckpt"))

    # A new process would build the model from code: float16 everywhere.
    keras.utils.clear_session(free_memory=False)
    fresh = _adaptive_model()
    assert fresh.layers[0].compute_dtype == "float16"
    cb2 = AdaptivePrecision(interval=1000)
    cb2.set_model(fresh)  # wraps the optimizer and attaches the state, as fit does
    status = tf.train.Checkpoint(model=fresh).restore(path)
    status.assert_existing_objects_matched()
    fresh.fit(*_overflowing(), batch_size=8, epochs=1, verbose=0, callbacks=[cb2])
    assert fresh.layers[0].compute_dtype == "float32"
    assert [r["state"] for r in precision_report(fresh).rows] == \
        [r["state"] for r in saved_report.rows]
    assert cb2.events == []
    # The run went on from the saved optimizer state (one more epoch of it).
    assert int(fresh.optimizer.iterations.numpy()) > int(saved_opt[0])


def test_checkpoint_without_keras_mp_state_fails_the_match_check(tmp_path):
    """TensorFlow restores checkpoints leniently; the documented way to refuse
    one that lacks the loss-scale state is assert_existing_objects_matched."""
    plain = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    plain.compile(optimizer=keras.optimizers.SGD(), loss="mse")
    plain.fit(*_overflowing(), verbose=0)
    path = tf.train.Checkpoint(model=plain).save(str(tmp_path / "plain"))
    from keras_mp import LossScaleOptimizer

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=LossScaleOptimizer(keras.optimizers.SGD()), loss="mse")
    model.optimizer.build(model.trainable_variables)
    status = tf.train.Checkpoint(model=model).restore(path)
    with pytest.raises(AssertionError, match=r"not bound to checkpointed values.*loss_scale"):
        status.assert_existing_objects_matched()
