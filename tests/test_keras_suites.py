"""Keras's own test suites run against keras-mp (the installed Keras ships
its tests): the loss-scale optimizer's, in this process, against
keras_mp.LossScaleOptimizer; and Keras's base-optimizer tests of gradient
accumulation, EMA and clipping under keras-mp's float16 set-ups against the
same under Keras's own (tests/keras_suites.py; its ``--full`` command runs
every group)."""

import importlib
import unittest

import pytest

import keras_mp
from tests import keras_suites


def _keras_suite(module_name: str, **replace) -> unittest.TestSuite:
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:  # a Keras build without its tests
        pytest.skip(f"{module_name} is not installed: {e}")
    for name, value in replace.items():
        setattr(module, name, value)   # the names the test module imported
    return unittest.defaultTestLoader.loadTestsFromModule(module)


def test_keras_loss_scale_optimizer_tests_pass_on_keras_mp():
    suite = _keras_suite("keras.src.optimizers.loss_scale_optimizer_test",
                         LossScaleOptimizer=keras_mp.LossScaleOptimizer)
    result = unittest.TestResult()
    suite.run(result)
    problems = [f"{test.id()}: {trace.splitlines()[-1]}"
                for test, trace in result.failures + result.errors]
    assert not problems, "\n".join(problems)
    assert result.testsRun >= 15, result.testsRun
    print(f"{result.testsRun} Keras tests, {len(result.skipped)} skipped")


@pytest.mark.parametrize("mode", keras_suites.CI_PAIRS)
def test_keras_optimizer_tests_pass_where_they_pass_under_keras(mode):
    paths = keras_suites.files(keras_suites.CI_FILES)
    if not paths:
        pytest.skip("this Keras build ships no optimizer tests")
    control = keras_suites.PAIRS[mode]
    got = {m: keras_suites.run(m, paths, keras_suites.CI_SELECT) for m in (control, mode)}
    assert keras_suites.counts(got[control])["passed"] >= 5, got[control]
    assert set(got[mode]) == set(got[control])
    assert keras_suites.regressions(got[control], got[mode]) == []
