"""``model.fit`` on a real two-worker ``MultiWorkerMirroredStrategy``.

One module-scoped run starts two worker processes (``multi_worker/worker.py``
through ``multi_worker/launch.py``) on 127.0.0.1, in a network namespace of
their own where ``unshare`` allows it. The tests then compare what the workers
report with each other and with single-process training here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mp.distribute as distribute

HERE = Path(__file__).parent / "multi_worker"
LAUNCH_TIMEOUT_S = 75  # the workers' whole run; ~20 s on 2 busy cores
RTOL, ATOL = 1e-5, 1e-6  # float32, summed in another order across workers


def _load_worker_module():
    spec = importlib.util.spec_from_file_location("mw_worker", HERE / "worker.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


worker = _load_worker_module()


def _isolation_prefix() -> list[str]:
    """``unshare`` into a namespace with only loopback, when permitted.

    TensorFlow's gRPC server listens on 0.0.0.0 whatever the cluster says;
    in the namespace that is 127.0.0.1 only, and no port can clash with
    another job's.
    """
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return []
    prefix = ["unshare", "-rn", "sh", "-c", 'ip link set lo up && exec "$0" "$@"']
    probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=10)
    return prefix if probe.returncode == 0 else []


def _launch(out: Path, *worker_args: str) -> list[dict[str, Any]]:
    """Runs both workers with ``worker_args``; their JSON results. Fails with
    their logs if the run fails."""
    cmd = [*_isolation_prefix(), sys.executable, str(HERE / "launch.py"),
           "--out-dir", str(out), "--timeout", str(LAUNCH_TIMEOUT_S)]
    if worker_args:
        cmd += ["--", *worker_args]
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        rc = proc.wait(timeout=LAUNCH_TIMEOUT_S + 15)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        if proc.poll() is None:  # the launcher itself hung: kill its group
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def logs() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-4000:]}"
                         for p in sorted(out.glob("worker*.log")))

    assert rc == 0, f"cluster run failed (launcher rc={rc}):\n{logs()}"
    results = [json.loads((out / f"worker{i}.json").read_text()) for i in range(2)]
    for r in results:
        assert "error" not in r, f"worker {r['task']} raised:\n{r['error']}"
    return results


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> list[dict[str, Any]]:
    """Both workers' JSON results for the default phases."""
    return _launch(tmp_path_factory.mktemp("multi_worker"))


def _as_model_weights(model, flat: list[list[float]]) -> list[np.ndarray]:
    return [np.reshape(f, w.shape) for f, w in zip(flat, model.get_weights())]


def _assert_same_weights(a, b, **tol) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_allclose(np.ravel(x), np.ravel(y), **tol)


def test_cluster_is_two_workers(cluster):
    assert sorted(r["task"] for r in cluster) == [0, 1]
    assert all(r["num_replicas"] == 2 for r in cluster)


def test_without_fix_fit_fails_exactly_when_keras_has_the_fault(cluster):
    faults = distribute.keras_multi_worker_faults()
    for r in cluster:
        assert r["faults"] == list(faults)
        assert r["patched"] == list(faults)
        error = r["unpatched"]["error"]
        if "symbolic_build_reduce" in faults:
            assert error and "Attempt to convert a value (PerReplica" in error
        elif "scalar_mean_reduce" in faults:
            assert error and "Invalid reduction dimension 0" in error
        else:
            assert error is None


def test_fit_sgd_workers_agree_and_match_single_process(cluster):
    w0, w1 = (r["sgd"] for r in cluster)
    assert w0["w0"] == w1["w0"], "initial weights differ across workers"
    _assert_same_weights(w0["w"], w1["w"], rtol=0, atol=0)
    assert w0["w"] != w0["w0"], "training did not change the weights"

    model = worker.make_model()
    model.set_weights(_as_model_weights(model, w0["w0"]))
    model.compile(optimizer=keras.optimizers.SGD(worker.LR), loss="mse")
    history = model.fit(worker.global_dataset(), epochs=2, verbose=0,
                        validation_data=worker.global_dataset())
    _assert_same_weights(w0["w"], model.get_weights(), rtol=RTOL, atol=ATOL)
    for key in ("loss", "val_loss"):
        np.testing.assert_allclose(w0["history"][key], history.history[key],
                                   rtol=RTOL, atol=ATOL)


@pytest.fixture(scope="module")
def adaptive_cluster(tmp_path_factory) -> list[dict[str, Any]]:
    """Both workers' JSON results for the adaptive phases (a cluster of their own)."""
    return _launch(tmp_path_factory.mktemp("multi_worker_adaptive"), "--phases",
                   "adaptive,storage")


def test_adaptive_precision_workers_decide_alike_and_as_single_process(adaptive_cluster):
    # Only worker 1's rows overflow float16 in the first layer; the statistics
    # all-reduce must make both workers take the same decisions (and the ones
    # one process takes on the same global batches), or their models diverge.
    x, _ = worker.make_adaptive_data()
    rows = x.reshape(-1, worker.GLOBAL_BATCH, worker.FEATURES)
    half = worker.GLOBAL_BATCH // 2
    assert (np.abs(rows[:, :half]) < 65504).all()  # worker 0's rows
    assert (rows[:, half:] > 65504).any(axis=(1, 2)).all()  # worker 1's, every step

    w0, w1 = (r["adaptive"] for r in adaptive_cluster)
    assert w0["optimizer"] == "LossScaleOptimizer"
    assert w0["w0"] == w1["w0"], "initial weights differ across workers"
    assert w0["events"], "no precision decision was made"
    for key in ("report", "events", "calls", "controller", "statistics", "loss_scale",
                "iterations", "skipped_steps", "optimizer_variables"):
        assert w0[key] == w1[key], f"workers disagree on {key}"
    _assert_same_weights(w0["w"], w1["w"], rtol=0, atol=0)
    assert all(np.isfinite(v).all() for v in w0["w"])
    # Steps 1-2 overflow (scale 2, then the floor 1): the first decision
    # promotes the input layer, after which nothing overflows, and the
    # promotion names the streak's cause: the scale comes back to 2.
    layers = w0["report"]["layers"]
    assert [r["compute_dtype"] for r in layers] == ["float32", "float16", "float16"]
    assert w0["events"] == [{"step": worker.ADAPTIVE_INTERVAL, "layer": layers[0]["layer"],
                             "old": "float16", "new": "float32",
                             "reason": "input_range"}]
    assert (w0["calls"], w0["iterations"], w0["skipped_steps"], w0["loss_scale"]) == \
        (worker.ADAPTIVE_STEPS, worker.ADAPTIVE_STEPS - 2, 2, 2.0)

    # The same global batches in this process, on one device.
    model, cb, ref_w0 = worker.train_adaptive(
        tf.distribute.get_strategy(), worker.make_adaptive_data(),
        batch_size=worker.GLOBAL_BATCH, shuffle=False)
    assert ref_w0 == w0["w0"]
    assert cb.events == w0["events"]
    ref = worker.adaptive_summary(model, cb)
    for key in ("compute_dtype", "state", "history"):
        assert [r[key] for r in ref["report"]["layers"]] == \
            [r[key] for r in w0["report"]["layers"]], key
    assert ref["controller"] == w0["controller"]
    for a, b in zip(ref["report"]["layers"], w0["report"]["layers"]):
        assert a["stats"]["nonfinite"] == b["stats"]["nonfinite"], a["layer"]
    for key in ("loss_scale", "iterations", "skipped_steps"):
        assert ref[key] == w0[key], key
    # float16 layers sum over 4 rows per worker instead of 8.
    _assert_same_weights(w0["w"], ref["w"], rtol=2e-2, atol=2e-2)


def test_no_bfloat16_variable_is_made_under_two_workers_and_the_fit_trains(adaptive_cluster):
    # TensorFlow 2.21's broadcast of a new variable's initial value between
    # workers has no bfloat16 kernel: a frozen layer's weights stored in
    # bfloat16 (the default) crashed the fit's start. They stay float32 with
    # their reason, and compact weights and moments (asked for) stay float32.
    w0, w1 = (r["storage"] for r in adaptive_cluster)
    assert w0 == w1, "workers disagree"
    assert set(w0["dtypes"].values()) == {"float32"}
    assert w0["moment_dtypes"] == ["float32"]
    assert "cannot make a bfloat16 variable across workers" in w0["compact_reason"]
    assert w0["compute"] == ["bfloat16", "bfloat16"]
    frozen, trained = w0["storage"].values()
    assert {r["reason"] for r in frozen.values()} == {"strategy"}
    assert {(r["dtype"], r["reason"]) for r in trained.values()} == {("float32", "trains")}
    assert all(np.isfinite(w).all() for w in w0["w"]) and len(w0["loss"]) == 2


def test_fit_loss_scale_optimizer_skips_a_nan_seen_by_one_worker(cluster):
    w0, w1 = (r["lso"] for r in cluster)
    if "unavailable" in w0:
        pytest.skip(f"keras_mp.LossScaleOptimizer unavailable: {w0['unavailable']}")
    _assert_same_weights(w0["w"], w1["w"], rtol=0, atol=0)
    assert all(np.isfinite(v).all() for v in w0["w"])
    for r in (w0, w1):
        assert r["iterations"] == worker.STEPS - 1, "the NaN step was applied"
        if r["skipped_steps"] is not None:
            assert r["skipped_steps"] == 1

    model = worker.make_model()
    model.set_weights(_as_model_weights(model, w0["w0"]))
    from keras_mp import LossScaleOptimizer

    opt = LossScaleOptimizer(keras.optimizers.SGD(worker.LR))
    model.compile(optimizer=opt, loss="mse")
    model.fit(worker.global_dataset(nan=True), epochs=1, verbose=0)
    assert int(opt.iterations.numpy()) == worker.STEPS - 1
    _assert_same_weights(w0["w"], model.get_weights(), rtol=RTOL, atol=ATOL)
    for r in (w0, w1):
        assert r["loss_scale"] == float(keras.ops.convert_to_numpy(opt.loss_scale))


@pytest.fixture
def restore_patch_state():
    """Leaves the fixes installed or not, as the test found them."""
    before = distribute.patched_faults()
    yield
    distribute.unpatch_multi_worker()
    if before:
        distribute.patch_multi_worker()


def test_patch_is_idempotent_and_reversible(restore_patch_state):
    from keras.src.backend.tensorflow import trainer

    distribute.unpatch_multi_worker()
    originals = (trainer.TensorFlowTrainer._maybe_symbolic_build,
                 trainer.reduce_per_replica)
    first = distribute.patch_multi_worker()
    installed = (trainer.TensorFlowTrainer._maybe_symbolic_build,
                 trainer.reduce_per_replica)
    assert distribute.patch_multi_worker() == first
    assert (trainer.TensorFlowTrainer._maybe_symbolic_build,
            trainer.reduce_per_replica) == installed
    assert distribute.keras_multi_worker_faults() == first  # judged on Keras's code
    assert ("symbolic_build_reduce" in first) == (installed[0] is not originals[0])
    assert ("scalar_mean_reduce" in first) == (installed[1] is not originals[1])
    distribute.unpatch_multi_worker()
    assert distribute.patched_faults() == ()
    assert (trainer.TensorFlowTrainer._maybe_symbolic_build,
            trainer.reduce_per_replica) == originals


def test_fix_leaves_mirrored_strategy_training_unchanged(two_replica_strategy,
                                                         restore_patch_state):
    def train(patched: bool) -> list[np.ndarray]:
        keras.utils.set_random_seed(0)
        (distribute.patch_multi_worker if patched else distribute.unpatch_multi_worker)()
        with two_replica_strategy.scope():
            model = worker.make_model()
            model.compile(optimizer=keras.optimizers.SGD(worker.LR), loss="mse")
        model.fit(worker.global_dataset(), epochs=1, verbose=0)
        return model.get_weights()

    _assert_same_weights(train(False), train(True), rtol=0, atol=0)
