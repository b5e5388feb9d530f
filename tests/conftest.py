"""Shared test set-up.

TensorFlow fixes its devices at first use, so the two logical CPU devices
that the tf.distribute tests need are configured here, at import time, before
any test touches TensorFlow.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Tests measure what they test: no measurement kept from another test or run
# (keras_mp.device.cache); the tests of the cache point it at their own tmp dirs.
os.environ["KERAS_MP_CACHE_DIR"] = "off"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

_cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(
    _cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402

import keras_mp  # noqa: E402,F401
from keras_mp.adaptive.fit import autofit  # noqa: E402
from keras_mp.adaptive.decisions import gain  # noqa: E402
from keras_mp.device import _cpuinfo  # noqa: E402


def _cpu_seen_by_the_tests():
    """``KERAS_MP_TEST_CPU_FLAGS="avx2"``: the tests run as on a CPU of that
    class (``avx2``, ``avx512_bf16``, ``amx_bf16``: CI's CPU changes between
    runs; ``avx2`` alone is a CPU without 16-bit units, where ``"adaptive"`` is
    float32), through keras-mp's own ``KERAS_MP_CPU_CLASS``
    (keras_mp/device/_cpuinfo.py), which subprocesses inherit. Other flag
    lists are written to a file keras_mp.device reads in this process only.
    Matmuls are still measured on this machine."""
    flags = os.environ.get("KERAS_MP_TEST_CPU_FLAGS")
    if flags is None:
        return
    if flags.strip().lower() in _cpuinfo.CLASSES:
        os.environ[_cpuinfo.ENV_VAR] = flags.strip().lower()
        return
    import tempfile

    model = _cpuinfo.fields().get("model name", "")
    path = os.path.join(tempfile.mkdtemp(prefix="keras_mp_cpuinfo"), "cpuinfo")
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"processor\t: 0\nmodel name\t: {model}\n"
                f"flags\t\t: {' '.join(flags.replace(',', ' ').split())}\n")
    _cpuinfo.PATH = path


_cpu_seen_by_the_tests()


# Tests of the measured execution mode itself (tests/execution/); elsewhere the
# train step runs as a TensorFlow graph (see _graph_unless_measuring).
MEASURING_PACKAGE = "tests.execution."


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pyproject.toml): two workers, or ``KERAS_MP_TEST_WORKERS``.

    On CI's 2 cores one session's process kept 1.5 cores busy (most tests
    trace and run Python on one thread); two workers keep both busy. Each
    worker holds TensorFlow and its models (up to 5 GB), so not one per core
    on larger machines."""
    return int(os.environ.get("KERAS_MP_TEST_WORKERS", "2"))


def pytest_configure(config):
    """The xdist controller makes the folder its workers share for the
    background pipelines (tests/background.py); workers inherit it."""
    from tests import background

    if not hasattr(config, "workerinput") and getattr(config.option, "numprocesses", None) \
            and not os.environ.get(background.SHARED):
        import tempfile

        os.environ[background.SHARED] = tempfile.mkdtemp(prefix="keras_mp_background_")
        config._keras_mp_shared = os.environ[background.SHARED]


def pytest_collection_finish(session):
    """The subprocess pipelines that selected tests wait for start now, in
    the background (tests/background.py): the lifecycle of every execution
    mode first (its tests come first), then KerasHub's T5 in float16, the
    SIGKILL runs of tests/test_resume.py, the real models, then the seeded runs."""
    import sys

    for name in ("tests.test_lifecycle_modes", "tests.test_made_nonfinite",
                 "tests.test_resume", "tests.test_real_models", "tests.test_seeded_runs"):
        module = sys.modules.get(name)
        if module is not None:
            module.start(session.items)


def pytest_sessionfinish(session, exitstatus):
    import shutil

    from tests import background

    background.shutdown()
    shared = getattr(session.config, "_keras_mp_shared", None)
    if shared:   # the controller, after its workers
        shutil.rmtree(shared, ignore_errors=True)


@pytest.fixture(autouse=True)
def _clean_keras_state():
    """Every test starts with the float32 policy, fresh names and seeds.

    (``free_memory=False``: Keras's ``gc.collect()`` took ~0.9 s per test once
    the heap had grown, minutes over the suite; Python's own collector runs.)
    """
    keras.mixed_precision.set_global_policy("float32")
    keras.utils.clear_session(free_memory=False)
    keras.utils.set_random_seed(0)
    yield
    keras.mixed_precision.set_global_policy("float32")
    # A test that makes fit adapt every model, however small, does not leak it,
    # nor one that turns skipping or compact storage off.
    autofit.set_min_saving(gain.START_UP_S)
    keras_mp.config.set_skip_nonfinite(True)
    keras_mp.config.set_compact_storage(True)


@pytest.fixture(autouse=True)
def _graph_unless_measuring(request, monkeypatch):
    """Outside the tests of ``keras_mp.execution`` (``tests/execution/``) (and those marked
    ``measured_execution``), train steps run as TensorFlow graphs:
    ``KERAS_MP_EXECUTION=graph``, the documented override.

    The measured choice compiles each model's step with XLA, and TensorFlow
    never frees an XLA:CPU executable (about 100 memory maps for a 3-layer
    MLP's step, thousands for a Transformer's): over hundreds of models in one
    process that costs minutes and can exhaust ``vm.max_map_count``, where
    :mod:`keras_mp.execution` then stops trying XLA. The measurement has its
    own tests; the rest test numerics.
    """
    if request.module.__name__.startswith(MEASURING_PACKAGE) or \
            request.node.get_closest_marker("measured_execution"):
        monkeypatch.delenv("KERAS_MP_EXECUTION", raising=False)
    else:
        monkeypatch.setenv("KERAS_MP_EXECUTION", "graph")


@pytest.fixture
def adapt_every_fit():
    """``fit`` adapts the test's small models as it adapts a fit large enough
    to gain from 16 bits (``autofit.set_min_saving(0)``; the default, a
    small fit trained in float32, is tested in tests/adaptive/test_gain.py and
    by the lifecycle's ``no_gain`` case). Reset after the test."""
    autofit.set_min_saving(0)


@pytest.fixture
def two_replica_strategy():
    """A MirroredStrategy over the two logical CPU devices, whose collectives
    cannot collide with those of earlier strategies in this process (see
    tests/faults.py)."""
    from tests.faults import two_replica_mirrored_strategy

    return two_replica_mirrored_strategy()


def tiny_regression_data(n: int = 64, features: int = 4, seed: int = 0):
    """A small, deterministic regression problem."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    w = rng.normal(size=(features, 1)).astype("float32")
    return x, x @ w
