"""keras_mp.adaptive.evidence.stats.LayerStatistics: attribution by variable path, size
weighting, accumulation and reset, the loss-scale floor, replicas, and use as
the optimizer's statistics sink inside a compiled train step."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mp
from tests.faults import two_replica_mirrored_strategy
from keras_mp.scaling.kernels import STATISTICS, GradientStatistics
from keras_mp.adaptive.evidence.stats import LayerStatistics, variable_path


def _model():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    return model, [v for l in model.layers for v in l.trainable_variables]


def _stats(**fields):
    n = len(next(iter(fields.values())))
    return GradientStatistics(**{f: tf.constant(fields.get(f, [0.0] * n), tf.float32)
                                 for f in STATISTICS})


def test_attribution_and_size_weighting():
    model, tvars = _model()  # kernel 3x4 (12), bias 4, kernel 4x1 (4), bias 1
    acc = LayerStatistics(model.layers)
    assert acc.paths == tuple(l.path for l in model.layers)
    acc.accumulate(_stats(amax=[1.0, 3.0, 0.5, 0.25], nonfinite=[0.0, 0.0, 0.1, 0.0],
                          fp16_subnormal=[0.5, 0.0, 1.0, 0.0], zero=[0.0, 1.0, 0.0, 0.0]),
                   1.0, tvars)
    r = acc.read()
    a, b = r.layers
    assert r.steps == 1 and r.all_nonfinite == 0.0 and r.mean_scale == 1.0
    assert (a.amax, b.amax) == (3.0, 0.5)
    assert (a.nonfinite, b.nonfinite) == (0.0, 1.0)
    assert a.fp16_subnormal == pytest.approx(0.5 * 12 / 16)  # weighted by elements
    assert a.zero == pytest.approx(4 / 16)
    assert b.fp16_subnormal == pytest.approx(4 / 5)


def test_accumulates_over_steps_until_reset():
    model, tvars = _model()
    acc = LayerStatistics(model.layers)
    bad = _stats(nonfinite=[1.0, 1.0, 1.0, 1.0], amax=[0.0] * 4)
    good = _stats(amax=[2.0, 0.0, 1.0, 0.0], bf16_subnormal=[1.0, 1.0, 0.0, 0.0])
    for s, scale in ((bad, 4.0), (good, 2.0), (good, 2.0), (bad, 0.0)):
        acc.accumulate(s, scale, tvars)
    r = acc.read()
    assert r.steps == 4 and r.all_nonfinite == 0.5 and r.mean_scale == 2.0
    assert [l.nonfinite for l in r.layers] == [0.5, 0.5]
    assert [l.amax for l in r.layers] == [2.0, 1.0]
    assert r.layers[0].bf16_subnormal == pytest.approx(0.5)
    acc.reset()
    r = acc.read()
    assert r.steps == 0 and r.layers[0].amax == 0.0 and r.layers[0].nonfinite == 0.0


def test_nonfinite_counts_only_at_the_scale_floor():
    model, tvars = _model()
    acc = LayerStatistics(model.layers, scale_floor=1.0)
    bad = _stats(nonfinite=[1.0] * 4)
    acc.accumulate(bad, 1024.0, tvars)  # the loss scaler's to fix
    acc.accumulate(bad, 1.0, tvars)  # at the floor: a precision problem
    r = acc.read()
    assert r.all_nonfinite == 0.5 and r.layers[0].nonfinite == 0.5


def test_unowned_variables_are_ignored():
    model, tvars = _model()
    acc = LayerStatistics(model.layers[1:])
    acc.accumulate(_stats(nonfinite=[1.0, 1.0, 0.0, 0.0], amax=[9.0, 9.0, 1.0, 1.0]), 1.0, tvars)
    r = acc.read()
    assert len(r.layers) == 1 and r.layers[0].nonfinite == 0.0 and r.layers[0].amax == 1.0
    with pytest.raises(ValueError, match="`layers`"):
        LayerStatistics([])
    with pytest.raises(TypeError, match="`layers`"):
        LayerStatistics(["dense"])
    with pytest.raises(ValueError, match="`scale_floor`"):
        LayerStatistics(model.layers, scale_floor=-1.0)


def test_reduced_across_replicas():
    strategy = two_replica_mirrored_strategy()
    with strategy.scope():
        model, tvars = _model()
        acc = LayerStatistics(model.layers)

    @tf.function
    def step():
        def replica_fn():
            r = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32)
            # Replica 0 sees a non-finite first-layer gradient; replica 1 a larger amax.
            acc.accumulate(GradientStatistics(
                amax=tf.stack([1.0 + r, 0.0, 1.0, 0.0]),
                nonfinite=tf.stack([1.0 - r, 0.0, 0.0, 0.0]),
                fp16_underflow=tf.zeros([4]),
                fp16_subnormal=tf.stack([2.0 * r, 2.0 * r, 0.0, 0.0]) / 2.0,
                fp16_overflow=tf.zeros([4]), bf16_subnormal=tf.zeros([4]),
                zero=tf.zeros([4])), 8.0, tvars)
        strategy.run(replica_fn)

    step()
    r = acc.read()
    assert r.steps == 1  # one step, not one per replica
    assert [l.nonfinite for l in r.layers] == [1.0, 0.0]  # any replica
    assert [l.amax for l in r.layers] == [2.0, 1.0]  # max over replicas
    assert r.layers[0].fp16_subnormal == pytest.approx(0.5)  # mean over replicas
    assert r.mean_scale == 8.0


def test_sink_of_the_optimizer_in_a_compiled_train_step():
    model, _ = _model()
    acc = LayerStatistics(model.layers)
    opt = keras_mp.LossScaleOptimizer(keras.optimizers.SGD(0.01), schedule=4.0)
    opt.statistics_sink = acc.accumulate
    model.compile(optimizer=opt, loss="mse")
    x = np.ones((8, 3), "float32")
    model.fit(x, np.zeros((8, 1)), batch_size=4, epochs=3, verbose=0)
    r = acc.read()
    assert r.steps == 6 and r.mean_scale == 4.0
    assert all(l.amax > 0 and l.nonfinite == 0 for l in r.layers)
    x[0, 0] = np.inf
    acc.reset()
    model.fit(x, np.zeros((8, 1)), batch_size=4, epochs=1, verbose=0)
    r = acc.read()
    assert r.all_nonfinite == 0.5 and [l.nonfinite for l in r.layers] == [0.5, 0.5]


def test_variable_path():
    v = keras.Variable(1.0, name="w")
    assert variable_path(v) == v.path
    assert variable_path(tf.Variable(1.0, name="t")) == "t:0"
    with pytest.raises(TypeError, match="`variable`"):
        variable_path(3)
