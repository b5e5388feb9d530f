"""keras_mp.LossScaleOptimizer with an inner optimizer that accumulates
gradients (``gradient_accumulation_steps``): finite micro-batches give
Keras's result, and a non-finite micro-batch is skipped alone, leaving the
variables, the accumulators and the micro-batch count as they were."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_mp import FixedLossScale, LossScaleOptimizer

SCALE = 2.0**10


def _variables():
    return [keras.Variable(np.linspace(-1, 1, 12, dtype="float32").reshape(3, 4)),
            keras.Variable(np.ones((4,), "float32"))]


def _gradients(step):
    rng = np.random.default_rng(step)
    return [rng.standard_normal((3, 4)).astype("float32"),
            rng.standard_normal((4,)).astype("float32")]


def _inner():
    return keras.optimizers.Adam(0.1, gradient_accumulation_steps=3)


def _apply(opt, variables, grads, graph):
    grads = [tf.constant(g) for g in grads]
    if graph:
        tf.function(lambda: opt.apply(grads, variables), autograph=False)()
    else:
        opt.apply(grads, variables)


def _state(opt, variables):
    inner = getattr(opt, "inner_optimizer", opt)
    return ([v.numpy().copy() for v in variables],
            [a.numpy().copy() for a in inner._accumulated_gradients],
            int(inner._iterations.numpy()), int(inner.iterations.numpy()))


def _assert_same(got, expected):
    for a, b in zip(got[0] + got[1], expected[0] + expected[1]):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert got[2:] == expected[2:]


@pytest.mark.parametrize("graph", [True, False], ids=["graph", "eager"])
def test_finite_accumulation_equals_keras(graph):
    runs = {}
    for name, make in [("keras", lambda: keras.optimizers.LossScaleOptimizer(
                            _inner(), initial_scale=SCALE)),
                       ("keras_mp", lambda: LossScaleOptimizer(
                            _inner(), schedule=FixedLossScale(SCALE)))]:
        opt, variables = make(), _variables()
        for step in range(7):   # two whole accumulated steps and one micro-batch
            _apply(opt, variables, [g * SCALE for g in _gradients(step)], graph)
        runs[name] = _state(opt, variables)
    _assert_same(runs["keras_mp"], runs["keras"])
    assert runs["keras_mp"][2:] == (7, 2)
    assert np.any(runs["keras_mp"][1][0] != 0)   # the seventh micro-batch waits


@pytest.mark.parametrize("graph", [True, False], ids=["graph", "eager"])
def test_a_nonfinite_micro_batch_is_skipped_alone(graph):
    # Reference: the inner optimizer alone, given only the finite micro-batches.
    plain, plain_vars = _inner(), _variables()
    finite = [0, 1, 3, 4]
    for step in finite:
        _apply(plain, plain_vars, _gradients(step), graph)

    opt, variables = LossScaleOptimizer(_inner(), initial_scale=SCALE), _variables()
    scale = SCALE
    for step in range(5):
        grads = [g * scale for g in _gradients(step)]
        if step == 2:   # overflows in the middle of the first accumulated step
            before = _state(opt, variables)
            grads[1][2] = np.inf
            _apply(opt, variables, grads, graph)
            _assert_same(_state(opt, variables), before)   # nothing of it entered
            assert float(opt.loss_scale) == scale / 2
            scale /= 2
            continue
        _apply(opt, variables, grads, graph)
    _assert_same(_state(opt, variables), _state(plain, plain_vars))
    assert int(opt.skipped_steps.numpy()) == 1


def test_fit_with_accumulation_under_mixed_float16_skips_the_overflow():
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(1)])
    opt = LossScaleOptimizer(keras.optimizers.Adam(1e-2, gradient_accumulation_steps=4))
    model.compile(optimizer=opt, loss="mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    x[8:16] = 1e6   # the second micro-batch's loss overflows float16
    model.fit(x, x.sum(1, keepdims=True), batch_size=8, shuffle=False, verbose=0)
    skipped = int(opt.skipped_steps.numpy())
    assert skipped >= 1
    assert int(opt.inner_optimizer._iterations.numpy()) == 8 - skipped
    assert all(np.isfinite(v.numpy()).all() for v in model.weights + opt.variables)
