"""A pytest plugin that runs the installed Keras's own test modules under one
precision set-up (:data:`tests.keras_suites.MODES`), named by the
``KERAS_MP_SUITE_MODE`` environment variable, and writes every test's outcome
to the JSON file named by ``KERAS_MP_SUITE_OUT``.

Keras's ``TestCase.setUp`` clears the session (and with it the global dtype
policy), so the policy is set again after it, and before every plain test
function. In keras-mp's modes, ``keras_mp.LossScaleOptimizer`` stands where
Keras uses its own (Keras's ``compile`` under ``mixed_float16`` and the names
the test modules import); in the ``*_wrapped`` modes every optimizer the test
modules make is wrapped in the mode's loss-scale optimizer.

Loaded by :mod:`tests.keras_suites` (``pytest -p tests.keras_suites_plugin``).
"""

from __future__ import annotations

import json
import os
import types

import pytest

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
from keras.src.testing import test_case  # noqa: E402

import keras_mp  # noqa: E402
from keras_mp.adaptive.fit import autofit  # noqa: E402
from keras_mp.adaptive.decisions import gain  # noqa: E402
from tests import keras_suites  # noqa: E402

_MODE = keras_suites.MODES[os.environ["KERAS_MP_SUITE_MODE"]]
_OUT = os.environ.get("KERAS_MP_SUITE_OUT")
_outcomes: dict[str, str] = {}


def _lso_class():
    return keras_mp.LossScaleOptimizer if _MODE.keras_mp else keras.optimizers.LossScaleOptimizer


def _adapting_on_short_fits() -> None:
    """Where every fit adapts, the suites' fits (a few steps each) run the
    statistics step and the float32 probe too: the callback ``fit`` adds
    samples statistics on every call, probes from the second call on (every
    second call, the gap growing while probes confirm, as in a user's run) and
    decides every second (with the defaults, a probe every 200 calls, the probe never
    ran there; issue 49 item 2). A callback a test passes keeps its own."""
    import functools

    from keras_mp.adaptive.fit import callback

    init = callback.AdaptivePrecision.__init__
    if getattr(init, "_suite", False):
        return

    @functools.wraps(init)
    def suite_init(self, interval: int = 2, **kwargs):
        kwargs.setdefault("statistics_every", 1)
        kwargs.setdefault("probe_every", 2)
        kwargs.setdefault("first_decision", None)
        init(self, interval, **kwargs)

    suite_init._suite = True
    callback.AdaptivePrecision.__init__ = suite_init


if _MODE.keras_mp and _MODE.policy.startswith("adaptive") and _MODE.every_fit:
    _adapting_on_short_fits()


def _set_policy() -> None:
    if _MODE.keras_mp and _MODE.policy.startswith("adaptive"):
        autofit.set_min_saving(0 if _MODE.every_fit else gain.START_UP_S)
        keras_mp.config.set_compact_weights(True if _MODE.compact else None)
        keras_mp.config.set_compact_moments(True if _MODE.compact else None)
        keras_mp.set_global_policy(_MODE.policy)
    else:
        keras.config.set_dtype_policy(_MODE.policy)


_keras_set_up = test_case.TestCase.setUp


def _set_up(self):
    _keras_set_up(self)   # clears the session, and the policy with it
    _set_policy()


test_case.TestCase.setUp = _set_up


@pytest.fixture(autouse=True)
def _suite_policy():
    _set_policy()
    yield
    keras.config.set_dtype_policy("float32")


def _wrapping(cls):
    """A stand-in for optimizer class ``cls`` that returns the instance
    wrapped in the mode's loss-scale optimizer."""
    lso = _lso_class()

    def make(*args, **kwargs):
        return lso(cls(*args, **kwargs))

    make.__name__ = cls.__name__
    return make


def _is_optimizer_class(value) -> bool:
    return (isinstance(value, type) and issubclass(value, keras.optimizers.Optimizer)
            and not issubclass(value, keras.optimizers.LossScaleOptimizer)
            and value is not keras.optimizers.Optimizer
            and not value.__module__.endswith("base_optimizer")
            and not value.__module__.endswith(".optimizer"))


def _replacement(name: str, value):
    """What a test module's global ``name`` becomes in this mode (``value``
    when nothing)."""
    if isinstance(value, type) and issubclass(value, keras.optimizers.LossScaleOptimizer):
        return _lso_class()
    if _MODE.wrap and _is_optimizer_class(value):
        return _wrapping(value)
    if isinstance(value, types.ModuleType) and value.__name__ in (
            "keras.src.optimizers", "keras.optimizers"):
        return _OptimizersProxy(value)
    return value


class _OptimizersProxy(types.ModuleType):
    """The ``optimizers`` module as a test module sees it in this mode."""

    def __init__(self, module):
        super().__init__(module.__name__)
        self._module = module

    def __getattr__(self, name):
        return _replacement(name, getattr(self._module, name))


def pytest_collection_modifyitems(session, config, items):
    if not _MODE.keras_mp and not _MODE.wrap:
        return
    if _MODE.keras_mp:
        from keras.src.trainers import trainer   # its compile wraps under mixed_float16

        trainer.LossScaleOptimizer = keras_mp.LossScaleOptimizer
    done = set()
    for item in items:
        module = getattr(item, "module", None)
        if module is None or module.__name__ in done:
            continue
        done.add(module.__name__)
        # A module that wraps optimizers itself (the loss-scale optimizer's
        # tests) is not wrapped again: keras-mp refuses to wrap a wrapper.
        wraps_itself = any(isinstance(v, type) and issubclass(
            v, keras.optimizers.LossScaleOptimizer) for v in vars(module).values())
        for name, value in list(vars(module).items()):
            if wraps_itself and _is_optimizer_class(value):
                continue
            new = _replacement(name, value)
            if new is not value:
                setattr(module, name, new)


def pytest_collectreport(report):
    # A module that cannot be imported (trainer_test.py imports jax) counts
    # as one failed test, under every mode alike.
    if report.failed:
        _outcomes[f"{report.nodeid}::<collection>"] = "failed"


def pytest_runtest_logreport(report):
    # A failure in set-up, call or tear-down fails the test.
    if report.failed:
        _outcomes[report.nodeid] = "failed"
    elif report.skipped:
        _outcomes.setdefault(report.nodeid, "skipped")
    elif report.when == "call":
        _outcomes.setdefault(report.nodeid, "passed")


def pytest_sessionfinish(session, exitstatus):
    if _OUT:
        with open(_OUT, "w") as f:
            json.dump(_outcomes, f, indent=0, sort_keys=True)
