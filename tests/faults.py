"""Fault injection shared by the fault, distributed, saving and resume tests.

:class:`GradientFault` is an ordinary Keras layer: the identity in the
forward pass, and in the backward pass it replaces the gradient of the rows
whose flag input is set with a non-finite value. Flags are data, so a fault
can be placed at any step, on any replica (rows ``[r*b, (r+1)*b)`` of a
global batch go to replica ``r`` of a MirroredStrategy), and only the layers
*before* it get non-finite gradients: the variables to name in errors.

Saves that fail half-way: :class:`DiskFull` (a model's state that cannot be
written) and :class:`CutAfterWeights` (a model whose ``save_weights`` fails
after writing, as a process killed between BackupAndRestore's two files).

Processes killed with SIGKILL at seeded moments (``tests/resume/train.py`` is
the child): :func:`fit_chain` kills a ``fit`` with ``BackupAndRestore`` and
``ModelCheckpoint`` again and again, each run resuming from what the last
left, :func:`save_loop_kills` a loop of ``model.save``, ``save_weights``,
exports and pictures; after every kill :func:`check_files` loads every file on
disk. ``python -m tests.faults --kills 20`` is the stress run (:func:`main`,
docs/recovering.md).
"""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf


def _poison(value: float):
    @tf.custom_gradient
    def poison(h, flag):
        def grad(dy):
            bad = tf.reshape(flag > 0, [-1] + [1] * (len(dy.shape) - 1))
            return tf.where(bad, tf.constant(value, dy.dtype), dy), tf.zeros_like(flag)

        return tf.identity(h), grad

    return poison


class GradientFault(keras.layers.Layer):
    """``[h, flag] -> h``; the gradient of rows with ``flag > 0`` becomes ``value``."""

    def __init__(self, value: float = np.inf, **kwargs):
        super().__init__(**kwargs)
        self.value = float(value)

    def call(self, inputs):
        h, flag = inputs
        return _poison(self.value)(h, tf.cast(flag, h.dtype))


FEATURES = 4


def fault_model(value: float = np.inf) -> keras.Model:
    """``first`` (before the fault) gets the non-finite gradients, ``second`` never.

    tanh, not relu: relu's zero derivative would turn an injected inf into a
    finite 0 for inactive units.
    """
    x = keras.Input((FEATURES,), name="x")
    flag = keras.Input((1,), name="flag")
    h = keras.layers.Dense(8, activation="tanh", name="first")(x)
    h = GradientFault(value, name="fault")([h, flag])
    out = keras.layers.Dense(1, name="second")(h)
    return keras.Model([x, flag], out, name="faulty")


def fault_data(steps: int, batch: int, bad: dict[int, list[int]] | None = None, seed: int = 0):
    """``steps`` batches of a regression problem; ``bad`` maps a step to the
    rows (within its batch) whose gradient is poisoned."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(steps * batch, FEATURES)).astype("float32")
    y = (x @ rng.normal(size=(FEATURES, 1))).astype("float32")
    flag = np.zeros((steps * batch, 1), "float32")
    for step, rows in (bad or {}).items():
        for r in rows:
            flag[step * batch + r] = 1.0
    return x, flag, y


def local_values(variable) -> np.ndarray:
    """A variable's value on every replica, stacked (one row without a strategy)."""
    value = variable.value if isinstance(variable, keras.Variable) else variable
    strategy = tf.distribute.get_strategy()
    if isinstance(value, tf.distribute.DistributedValues):
        strategy = value._distribute_strategy
    return np.stack([np.asarray(v) for v in strategy.experimental_local_results(value)])


class Snapshots(keras.callbacks.Callback):
    """Every variable of ``get_variables()`` on every replica, before the
    first step and after each step."""

    def __init__(self, get_variables):
        super().__init__()
        self.get_variables = get_variables
        self.steps: list[list[np.ndarray]] = []

    def take(self) -> None:
        self.steps.append([local_values(v) for v in self.get_variables()])

    def on_train_begin(self, logs=None):
        if not self.steps:
            self.take()

    def on_train_batch_end(self, batch, logs=None):
        self.take()


def changed_by_a_skipped_fit(model: keras.Model, x, y, state) -> list[str]:
    """Fits ``model`` for one epoch of one batch ``(x, y)`` holding a
    non-finite value (its one step skipped, with keras-mp's warning) and
    returns the paths of the model's and optimizer's variables whose values
    that fit changed; ``state(model)`` gives those values, in that order."""
    import pytest

    names = [v.path for v in [*model.weights, *model.optimizer.variables]]
    before = state(model)
    with pytest.warns(UserWarning, match="non-finite"):
        model.fit(x, y, batch_size=len(x), epochs=1, verbose=0)
    return [n for n, a, b in zip(names, state(model), before) if not np.array_equal(a, b)]


def two_replica_mirrored_strategy() -> tf.distribute.MirroredStrategy:
    """A MirroredStrategy over the two logical CPU devices whose collectives
    cannot collide with those of strategies made before it in this process.

    Every MirroredStrategy numbers its collective groups and instances from
    the same start, and TensorFlow remembers each (group, instance) it has run
    for the life of the process: a later strategy whose n-th collective is of
    another kind (an all-gather where an earlier one had an all-reduce) fails
    with "Collective instance ... expected type 0 ... but got type 2". The
    class attribute that offsets the numbering is TensorFlow's own, "only set
    in tests".
    """
    tf.distribute.MirroredStrategy._collective_key_base += 10_000
    devices = [d.name for d in tf.config.list_logical_devices("CPU")][:2]
    assert len(devices) == 2, devices
    return tf.distribute.MirroredStrategy(devices)


# -- saves that fail half-way ----------------------------------------------------------------

class DiskFull(keras.layers.Layer):
    """Attached to a model (visited last when Keras saves it): its state
    cannot be written, as when the disk fills up half-way through a save."""

    def save_own_variables(self, store):
        raise OSError(28, "No space left on device")


def failing_midway(model: keras.Model) -> keras.Model:
    """``model``, whose saves now fail after its variables are written."""
    object.__setattr__(model, "_zz_disk_full", DiskFull())
    return model


class CutAfterWeights(keras.Sequential):
    """A model whose ``save_weights``, once ``cut`` is set, fails after the
    weights file is written: a process killed between BackupAndRestore's
    weights and its metadata."""

    cut = False

    def save_weights(self, *args, **kwargs):
        super().save_weights(*args, **kwargs)
        if self.cut:
            raise OSError("killed after the weights")


def small_model(seed: int = 0, cls=keras.Sequential) -> keras.Model:
    """A compiled ``3 -> 4 -> 1`` model trained one epoch (its optimizer built)."""
    keras.utils.set_random_seed(seed)
    model = cls([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    model.fit(np.ones((8, 3)), np.ones((8, 1)), verbose=0)
    return model


def dead_pid() -> int:
    """The id of a process that has ended (and was waited for)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# -- processes killed with SIGKILL at seeded moments ---------------------------------------------
#
# A moment is ("save", n): the child kills itself in the middle of its n-th
# save (tests/resume/train.py --kill-in-save), or ("time", s): the parent kills
# it s seconds after it reported that training (or its save loop) started.
# ``python -m tests.faults --kills 20`` is the stress run (docs/recovering.md).

CHILD = Path(__file__).parent / "resume" / "train.py"
CHILD_TIMEOUT_S = 300  # per process; ~15 s each on 2 busy cores


def start_child(folder: Path, name: str, *args: str) -> subprocess.Popen:
    """Starts the child script with ``args``; its output goes to ``folder/name.stderr``."""
    log = open(folder / f"{name}.stderr", "a")
    return subprocess.Popen(
        [sys.executable, str(CHILD), *args], stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True, env=dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1])))


def stop_child(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def child_output(folder: Path, name: str) -> str:
    return (folder / f"{name}.stderr").read_text()[-4000:]


def wait_child(proc: subprocess.Popen, folder: Path, name: str) -> int:
    """The child's exit status (-9 for SIGKILL); fails on a timeout or another error."""
    try:
        rc = proc.wait(timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        stop_child(proc)
        raise AssertionError(f"{name} timed out:\n" + child_output(folder, name))
    assert rc in (0, -signal.SIGKILL), f"{name} failed ({rc}):\n" + child_output(folder, name)
    return rc


def kill_after(proc: subprocess.Popen, started: Path, delay, folder: Path,
               name: str) -> tuple[bool, float]:
    """SIGKILLs ``proc`` ``delay(text of started)`` seconds after it wrote
    ``started``. Returns whether it was killed (not ended first), and the delay."""
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while not started.exists() or not started.read_text():
        if proc.poll() is not None:
            return False, 0.0
        assert time.monotonic() < deadline, f"{name} never started:\n" + child_output(folder, name)
        time.sleep(0.05)
    seconds = delay(started.read_text())
    time.sleep(seconds)
    if proc.poll() is not None:
        return False, seconds
    os.kill(proc.pid, signal.SIGKILL)
    return proc.wait(timeout=30) == -signal.SIGKILL, seconds


def moments(seed: int, saves: int, seconds: float) -> Iterator[tuple[str, float]]:
    """Kill moments without end, alternately in a save (``("save", k)``, k in
    ``[1, saves]``) and at a time (``("time", s)``, s in ``[0, seconds)``)."""
    rng = np.random.default_rng(seed)
    while True:
        yield "save", int(rng.integers(1, saves + 1))
        yield "time", float(rng.uniform(0, seconds))


def _load_child_module():
    spec = importlib.util.spec_from_file_location("tests_resume_train", CHILD)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _child_model_with(weights: str):
    """The child's model as a restore sees it (optimizer wrapped and built,
    the state attached), with ``weights`` loaded."""
    model, adaptive = _load_child_module().build()
    adaptive.set_model(model)
    if not model.optimizer.built:  # as BackupAndRestore does
        model.optimizer.build(model.trainable_variables)
    model.load_weights(weights)
    return model


def check_files(folder: Path) -> dict[str, int]:
    """Loads every file the child wrote under ``folder`` (what a user would
    load: ``.keras`` files, weights files, SavedModels, ``.tflite``/``.onnx``
    files, pictures, and the backup the next restore reads); fails on any that
    does not load. Temporaries of killed saves, and backup generations the
    pointer does not name, are counted, not loaded: the next save or restore
    removes them. Returns counts by kind."""
    import onnx

    from keras_mp import _atomic, _saves

    counts: dict[str, int] = {}

    def count(kind):
        counts[kind] = counts.get(kind, 0) + 1

    for root, dirs, files in os.walk(folder):
        root = Path(root)
        temporaries = set(_atomic.temporaries(str(root)))
        pointer = _saves.read_pointer(str(root)) if _saves.POINTER in files else None
        named = set() if pointer is None else {pointer["current"], pointer.get("previous")}
        for d in list(dirs):
            if d in temporaries or d.startswith("generation-"):
                dirs.remove(d)  # named generations: loaded below, through the pointer
                count("temporary" if d in temporaries else
                      "generation" if d in named else "unnamed_generation")
            elif (root / d / "saved_model.pb").exists():
                dirs.remove(d)
                served = tf.saved_model.load(str(root / d))  # held: serve needs its variables
                served.serve(np.ones((1, FEATURES), "float32"))
                count("saved_model")
        for name in files:
            path = root / name
            if name in temporaries:
                count("temporary")
            elif name.endswith(".keras"):
                keras.saving.load_model(path)
                count("keras")
            elif name.endswith(".weights.h5"):
                _child_model_with(str(path))
                count("weights")
            elif name.endswith(".tflite"):
                tf.lite.Interpreter(model_path=str(path)).allocate_tensors()
                count("tflite")
            elif name.endswith(".onnx"):
                onnx.checker.check_model(onnx.load(str(path)))
                count("onnx")
            elif name.endswith(".png"):
                assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
                count("png")
            elif name == _saves.POINTER:
                weights, metadata = _saves.backup_files(str(root))
                _child_model_with(weights)
                assert isinstance(json.loads(Path(metadata).read_text())["epoch"], int)
                count("backup")
    return counts


def _left_by(folder: Path, pid: int) -> list[str]:
    """What a killed save of process ``pid`` left: its temporaries, and
    backup generations no pointer names yet."""
    from keras_mp import _atomic, _saves

    left = []
    for root, dirs, _files in os.walk(folder):
        left += [n for n in _atomic.temporaries(root) if f"-{pid}-" in n]
        pointer = _saves.read_pointer(root) or {}
        left += [d for d in dirs if d.startswith("generation-")
                 and d not in (pointer.get("current"), pointer.get("previous"))]
    return left


def _until_killed(folder: Path, name: str, args: list[str], moments: Iterable, kills: int,
                  delay, check) -> list[dict]:
    """Runs the child with ``args`` once per moment until ``kills`` runs were
    killed: in their k-th save (``("save", k)``) or ``delay(at, started)``
    seconds after they wrote ``--started`` (``("time", at)``); a run that ends
    first counts as a moment missed. After each, ``check()`` loads the files."""
    records, source = [], iter(moments)
    while sum(r["killed"] for r in records) < kills:
        assert len(records) < 3 * kills, f"most moments came after the run ended: {records}"
        kind, at = next(source, (None, None))
        assert kind is not None, f"ran out of moments: {records}"
        started = folder / f"{name}-started-{len(records)}"
        extra = ["--kill-in-save", str(at)] if kind == "save" else []
        proc = start_child(folder, name, *args, "--started", str(started), *extra)
        try:
            if kind == "time":
                killed, at = kill_after(proc, started, lambda text: delay(at, text), folder, name)
            else:
                killed = wait_child(proc, folder, name) == -signal.SIGKILL
        finally:
            stop_child(proc)
        records.append({"moment": (kind, round(at, 3)), "killed": killed,
                        "left": _left_by(folder, proc.pid), "files": check()})
    return records


def fit_chain(folder: Path, moments: Iterable, kills: int) -> tuple[list[dict], dict]:
    """Runs the child's ``fit`` (BackupAndRestore, ModelCheckpoint) killed at
    ``kills`` of the ``moments`` (``("time", s)``: ``s`` seconds after training
    started), each run resuming from what the last left, then once to the end;
    after each kill every file must load (:func:`check_files`). Returns one
    record per moment and the final state (the child's ``--out``)."""
    backup, checkpoints = folder / "backup", folder / "checkpoints"
    checkpoints.mkdir(exist_ok=True)
    args = ["--backup", str(backup), "--out", str(folder / "run.json"),
            "--checkpoints", str(checkpoints)]
    records = _until_killed(
        folder, "run", args, moments, kills, lambda at, _text: at,
        lambda: dict(collections.Counter(check_files(checkpoints)) +
                     collections.Counter(check_files(backup))))
    proc = start_child(folder, "run", *args)
    try:
        assert wait_child(proc, folder, "run") == 0
    finally:
        stop_child(proc)
    return records, json.loads((folder / "run.json").read_text())


def reference_run(folder: Path) -> tuple[dict, float]:
    """The child's ``fit`` uninterrupted: its final state and the seconds
    from the start of training to the end of the process."""
    started = folder / "reference-started"
    proc = start_child(folder, "reference", "--backup", str(folder / "reference_backup"),
                       "--out", str(folder / "reference.json"), "--started", str(started))
    try:
        while not started.exists() and proc.poll() is None:
            time.sleep(0.05)
        begin = time.monotonic()
        assert wait_child(proc, folder, "reference") == 0
    finally:
        stop_child(proc)
    return json.loads((folder / "reference.json").read_text()), time.monotonic() - begin


def save_loop_kills(folder: Path, moments: Iterable, kills: int) -> list[dict]:
    """Runs the child's save loop killed at ``kills`` of the ``moments``
    (``("time", f)``: ``f`` times its first round's length into its second
    round), all in one folder, so each run overwrites the files of the last;
    after each kill every file must load. Returns one record per moment."""
    saves = folder / "saves"
    saves.mkdir(exist_ok=True)
    return _until_killed(folder, "loop", ["--save-loop", str(saves)], moments, kills,
                         lambda at, text: at * float(text), lambda: check_files(saves))


def main(argv: list[str] | None = None) -> int:
    """The stress run: ``--kills`` SIGKILLs at seeded moments (a moment
    that comes after its run ended is drawn again), half during the child's
    ``fit`` (BackupAndRestore and ModelCheckpoint; one chain of runs, each
    resuming from the last, then one to the end, whose final state must equal
    an uninterrupted run's), half during its save loop. Every file on disk is
    loaded after every kill."""
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(prog="python -m tests.faults", description=main.__doc__)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--folder", default=None, help="where the runs write (default: a new "
                        "temporary folder, kept)")
    args = parser.parse_args(argv)
    if args.kills < 2:
        parser.error(f"--kills must be at least 2, got {args.kills}")
    folder = Path(args.folder or tempfile.mkdtemp(prefix="keras_mp_kills_"))
    folder.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    reference, span = reference_run(folder)
    saves = 2 * _load_child_module().SAVES_PER_EPOCH  # a run's first two epochs
    fit, final = fit_chain(folder, moments(args.seed, saves, span), args.kills - args.kills // 2)
    loop = save_loop_kills(folder, moments(args.seed + 1, 4, 1.0), args.kills // 2)
    for kind, records in (("fit", fit), ("save loop", loop)):
        for r in records:
            print(f"{kind:9} {r['moment'][0]} {r['moment'][1]:<7g} killed={r['killed']!s:5} "
                  f"left={r['left']} loaded={r['files']}")
    records = fit + loop
    killed = [r for r in records if r["killed"]]
    differ = [key for key, value in reference.items() if final.get(key) != value]
    print(f"{len(records)} moments, {len(killed)} kills ({len(fit)} moments during fit, "
          f"{len(loop)} during the save loop; {sum(bool(r['left']) for r in killed)} kills left "
          "a half-written file or backup beside its target); every file on disk loaded after "
          f"every kill; the resumed run's final state equals the uninterrupted run's: "
          f"{not differ} ({len(reference)} items compared{', differ: ' if differ else ''}"
          f"{', '.join(differ)}); {time.monotonic() - began:.0f} s, folder {folder}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
