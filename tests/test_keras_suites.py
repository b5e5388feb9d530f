"""Keras's own test suite for the optimizer keras-mp replaces, run against
keras_mp.LossScaleOptimizer (the installed Keras ships its tests)."""

import importlib
import unittest

import pytest

import keras_mp


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
