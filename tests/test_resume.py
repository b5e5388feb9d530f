"""Checkpoints and resume: a run killed with SIGKILL mid-epoch and restarted
with ``BackupAndRestore`` ends bit for bit where an uninterrupted run ends,
loss-scale state, counters, hysteresis, precision decisions, switch history
and timeline included; SIGKILL in the middle of saves (of a ``fit`` with
``BackupAndRestore`` and ``ModelCheckpoint``, and of a ``model.save`` loop)
leaves every file loadable and the resume exact; ``BackupAndRestore``'s
backups are replaced as one (keras_mp/_saves.py); and ``tf.train.Checkpoint``
carries the adaptive decisions too.

(``model.save``/``load_model`` and ``tf.train.Checkpoint`` of the loss-scale
state are in test_optimizer.py; ``.keras`` files and epoch-level
``BackupAndRestore`` of the precisions in test_callbacks.py; the stress run
with 20 kills is ``python -m tests.faults --kills 20``, docs/recovering.md.)
"""

from __future__ import annotations

import json
import os
import shutil
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
from keras_mp import _saves, policies
from keras_mp.callbacks import AdaptivePrecision
from keras_mp.adaptive.outputs.report import precision_report
from keras_mp.adaptive.record import timeline
from tests import background, faults

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


# -- SIGKILL: the child processes run in the background ---------------------------------
# Each kill test's processes (minutes of waiting on 2 cores) start right after
# collection, beside the rest of the session (tests/background.py); the test
# then checks what they left.

def _mid_epoch(folder: str) -> list[dict]:
    """A reference run, and a run killed mid-epoch 1 then resumed with the same
    command; returns the killed run's log."""
    tmp_path = Path(folder)
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
    return killed_log


def _inside_fit_saves(folder: str) -> tuple[list[dict], dict]:
    """Two kills inside saves (the child's own SIGKILL with the file open), then a
    run to the end, beside an uninterrupted reference run."""
    tmp_path = Path(folder)
    reference = faults.start_child(tmp_path, "reference", "--backup", str(tmp_path / "ref"),
                                   "--out", str(tmp_path / "reference.json"))
    try:
        records, final = faults.fit_chain(tmp_path, [("save", 4), ("save", 5)], kills=2)
        assert faults.wait_child(reference, tmp_path, "reference") == 0
    finally:
        faults.stop_child(reference)
    return records, final


def _inside_save_loop(folder: str) -> list[dict]:
    return faults.save_loop_kills(Path(folder), [("save", 3)], kills=1)


_KILLS = {"test_sigkill_mid_epoch_then_resume_ends_bitwise_as_uninterrupted": _mid_epoch,
          "test_sigkill_inside_saves_of_a_fit_then_resume_ends_as_uninterrupted":
              _inside_fit_saves,
          "test_sigkill_inside_a_model_save_loop_leaves_every_file_loadable": _inside_save_loop}


def start(items) -> None:
    """Starts the kill tests' processes that ``items`` (the session's selected
    tests) need, in the background (tests/background.py)."""
    for test, pipeline in _KILLS.items():
        if any(item.name == test for item in items):
            key = f"resume/{test}"
            background.start(key, pipeline, background.folder(key))


def _killed(test: str):
    """The folder of ``test``'s kill pipeline and what it returned (started now
    where the session did not start it)."""
    key = f"resume/{test}"
    background.start(key, _KILLS[test], background.folder(key))
    return Path(background.folder(key)), background.result(key)


def test_sigkill_mid_epoch_then_resume_ends_bitwise_as_uninterrupted():
    tmp_path, killed_log = _killed(
        "test_sigkill_mid_epoch_then_resume_ends_bitwise_as_uninterrupted")
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


def test_sigkill_inside_saves_of_a_fit_then_resume_ends_as_uninterrupted():
    """Two kills inside saves (the child's own SIGKILL with the file open), then a
    run to the end. Per epoch the child saves the backup, last.keras, then
    epoch{n}.weights.h5. Kill 1, the 4th save: the backup after epoch 1 (run 2
    resumes at epoch 1). Kill 2, run 2's 5th save: last.keras overwritten after the
    backup of the last epoch (run 3 restores a finished run: no epoch runs)."""
    tmp_path, (records, final) = _killed(
        "test_sigkill_inside_saves_of_a_fit_then_resume_ends_as_uninterrupted")
    assert [r["killed"] for r in records] == [True, True]
    # Each kill left its half-written file hidden beside the target, never in its place.
    assert any(n.startswith("generation-000002") for n in records[0]["left"]), records[0]
    assert [n.split(".tmp-")[0] for n in records[1]["left"]] == [".last.keras"], records[1]
    assert records[1]["files"]["keras"] == 1 and records[1]["files"]["backup"] == 1

    ref = json.loads((tmp_path / "reference.json").read_text())
    assert final.keys() == ref.keys()
    for key in ref:
        assert final[key] == ref[key], key  # bitwise: floats compared exactly
    assert any(final["history"].values()) and len(final["timeline"]["entries"]) > 2
    assert not (tmp_path / "backup").exists(), "the backup outlived a finished run"

    # Run 3 saved nothing: the killed save's temporary waits for the next save there.
    checkpoints = tmp_path / "checkpoints"
    assert faults.check_files(checkpoints)["temporary"] == 1
    keras.saving.load_model(checkpoints / "last.keras").save(checkpoints / "last.keras")
    assert "temporary" not in faults.check_files(checkpoints)


def test_sigkill_inside_a_model_save_loop_leaves_every_file_loadable():
    """The loop's 3rd save: its second model.save, over the first one's file."""
    _, [record] = _killed("test_sigkill_inside_a_model_save_loop_leaves_every_file_loadable")
    assert record["killed"]
    assert [n.split(".tmp-")[0] for n in record["left"]] == [".model.keras"], record
    assert record["files"] == {"keras": 1, "weights": 1, "saved_model": 1, "tflite": 1,
                               "onnx": 1, "png": 1, "temporary": 1}


# -- BackupAndRestore: the switch history, and backups replaced as one -----------------

class _Stop(keras.callbacks.Callback):
    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError("interrupted")


def _run(model, backup, epochs, *extra, **kw):
    x, y = _overflowing()
    cb = AdaptivePrecision(interval=2, loss_scale=loss_scale.DynamicLossScale(initial_scale=2.0))
    model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0,
              callbacks=[keras.callbacks.BackupAndRestore(backup, **kw), cb, *extra])
    return cb


def _record(model):
    return [r["history"] for r in precision_report(model).rows], timeline.of(model).get_config()


def test_the_switch_history_and_timeline_survive_a_backup_and_restore_resume(tmp_path):
    backup = str(tmp_path / "backup")
    model = _adaptive_model()
    with pytest.raises(RuntimeError, match="interrupted"):
        _run(model, backup, 4, _Stop(1))
    history, saved_timeline = _record(model)
    assert any(history) and len(saved_timeline["entries"]) >= 2

    keras.utils.clear_session(free_memory=False)
    fresh = _adaptive_model()  # a new process builds it from code: no history
    assert not any(r["history"] for r in precision_report(fresh).rows)
    resumed = _run(fresh, backup, 4)
    got_history, got_timeline = _record(fresh)
    for before, after in zip(history, got_history):
        assert after[:len(before)] == before  # then what the resumed epochs switched
    assert got_timeline["entries"][:len(saved_timeline["entries"])] == \
        saved_timeline["entries"]
    assert got_timeline["last_step"] == resumed._calls == 8


def test_a_finished_runs_backup_restores_the_precisions_when_no_epoch_runs(tmp_path):
    """delete_checkpoint=False keeps the backup of a finished run; fit again
    restores it and runs no epoch, so the state is adopted when fit ends."""
    backup = str(tmp_path / "backup")
    model = _adaptive_model()
    _run(model, backup, 4, delete_checkpoint=False)
    dtypes, record = precision_report(model).dtypes(), _record(model)
    keras.utils.clear_session(free_memory=False)
    fresh = _adaptive_model()
    _run(fresh, backup, 4, delete_checkpoint=False)
    assert precision_report(fresh).dtypes() == dtypes and "float32" in dtypes.values()
    assert _record(fresh) == record


def _backup_of(folder, model, epoch, **kw):
    cb = keras.callbacks.BackupAndRestore(folder, **kw)
    cb.set_model(model)
    cb._current_epoch = epoch
    cb._save_model()
    return [w.numpy().copy() for w in model.weights]


def _restored(folder, **kw):
    fresh = faults.small_model(seed=7, cls=faults.CutAfterWeights)
    cb = keras.callbacks.BackupAndRestore(folder, **kw)
    cb.set_model(fresh)
    cb.on_train_begin()
    return fresh._initial_epoch, [w.numpy() for w in fresh.weights]


def _assert_weights(got, want):
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_a_backup_cut_anywhere_restores_the_last_whole_one(tmp_path):
    folder = str(tmp_path / "backup")
    model = faults.small_model(cls=faults.CutAfterWeights)
    at_1 = _backup_of(folder, model, 1)
    model.fit(np.ones((8, 3)), np.ones((8, 1)), verbose=0)
    model.cut = True  # between the weights and the metadata
    with pytest.raises(OSError, match="killed after the weights"):
        _backup_of(folder, model, 2)
    faults.failing_midway(model).cut = False  # inside the weights file
    with pytest.raises(OSError, match="No space left"):
        _backup_of(folder, model, 2)
    epoch, weights = _restored(folder)
    assert epoch == 1
    _assert_weights(weights, at_1)
    assert sorted(os.listdir(folder)) == ["generation-000001", "keras_mp_backup.json"]


def test_double_checkpoint_falls_back_to_the_previous_backup(tmp_path):
    folder = str(tmp_path / "backup")
    model = faults.small_model(cls=faults.CutAfterWeights)
    at_1 = _backup_of(folder, model, 1, double_checkpoint=True)
    model.fit(np.ones((8, 3)), np.ones((8, 1)), verbose=0)
    at_2 = _backup_of(folder, model, 2, double_checkpoint=True)
    assert not np.array_equal(at_1[0], at_2[0])
    epoch, weights = _restored(folder, double_checkpoint=True)
    assert epoch == 2
    _assert_weights(weights, at_2)
    # The current backup's weights broken on disk (not by a save): the previous one.
    weights_file, _ = _saves.backup_files(folder)
    with open(weights_file, "r+b") as f:
        f.truncate(100)
    epoch, weights = _restored(folder, double_checkpoint=True)
    assert epoch == 1
    _assert_weights(weights, at_1)


def test_a_backup_in_keras_layout_restores_and_a_cut_deletion_starts_afresh(tmp_path):
    folder = str(tmp_path / "backup")
    model = faults.small_model(cls=faults.CutAfterWeights)
    cb = keras.callbacks.BackupAndRestore(folder)
    cb.set_model(model)
    cb._current_epoch = 3
    type(cb)._save_model.__wrapped__(cb)  # Keras's own code: its two files
    assert sorted(os.listdir(folder)) == ["latest.weights.h5", "training_metadata.json"]
    epoch, weights = _restored(folder)
    assert epoch == 3
    _assert_weights(weights, [w.numpy() for w in model.weights])

    # The end of training removes the pointer first: killed in Keras's deletion
    # after it, the generations left behind restore nothing and are removed.
    shutil.rmtree(folder)
    _backup_of(folder, model, 2)
    os.remove(os.path.join(folder, _saves.POINTER))
    epoch, _ = _restored(folder)
    assert epoch is None and os.listdir(folder) == []  # nothing restored: a fresh start


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
