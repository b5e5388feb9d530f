"""Per-layer loss scales below the adaptive policy: the layer boundaries, the
in-graph back-off, and LossScaleOptimizer(layer_scales=True) (unscaling by
each variable's own factor, binding, setting, saving)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mp
from keras_mp import FixedLossScale, LossScaleOptimizer
from keras_mp.scaling import layer_scales


def _boundary_grads(factors, dtype="float32"):
    """Gradients of a residual block (x -> a -> b, out = a + b) with each
    layer's backward pass at its own factor."""
    x = tf.constant(np.linspace(-1.0, 1.0, 8, dtype="float32").reshape(2, 4))
    wa = tf.constant(np.full((4, 4), 0.5, "float32"))
    wb = tf.constant(np.eye(4, dtype="float32") * 3.0)
    with tf.GradientTape() as tape:
        tape.watch([x, wa, wb])
        ca, cb = (tf.constant(f) for f in factors)
        h = layer_scales.boundary_in(x, dtype, 1.0 / ca)
        a = layer_scales.boundary_out(tf.tanh(h @ tf.cast(wa, dtype)), ca)
        h = layer_scales.boundary_in(a, dtype, 1.0 / cb)
        b = layer_scales.boundary_out(h @ tf.cast(wb, dtype), cb)
        loss = tf.reduce_sum((a + b) ** 2)  # a reaches the loss twice: skip and b
    gx, gwa, gwb = tape.gradient(loss, [x, wa, wb])
    return gx, gwa / factors[0], gwb / factors[1]


def test_boundaries_keep_gradients_between_layers_at_the_global_scale():
    reference = _boundary_grads((1.0, 1.0))
    for got, want in zip(_boundary_grads((2.0**10, 2.0**-3)), reference):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6)
    # in float16 the values are those of float16 with one scale, up to rounding
    for got, want in zip(_boundary_grads((2.0**6, 2.0**2), "float16"), reference):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=2e-2, atol=1e-3)


def test_boundaries_cast_forward_exactly_and_hand_gradients_back_in_float32():
    x = tf.constant([1.0, 1e-3, 3.14159], tf.float32)

    def grad(factor):
        with tf.GradientTape() as tape:
            tape.watch(x)
            h = layer_scales.boundary_in(x, "float16", tf.constant(1.0 / factor))
            y = layer_scales.boundary_out(h * 2.0, tf.constant(factor))
            loss = tf.reduce_sum(y * 1e-6)
        assert h.dtype == tf.float16 and y.dtype == tf.float32
        np.testing.assert_array_equal(y.numpy(), (tf.cast(x, tf.float16) * 2).numpy())
        g = tape.gradient(loss, x)
        assert g.dtype == tf.float32
        return g.numpy()

    # 1e-6 is a float16 subnormal (17 steps of 2**-24): rounded by 1.3 % at the
    # global scale; at the layer's own 2**12 it is a normal number.
    assert np.abs(grad(1.0) / 2e-6 - 1).max() > 5e-3
    np.testing.assert_allclose(grad(2.0**12), [2e-6] * 3, rtol=1e-3)


def test_cast_source_finds_the_float32_tensor_a_traced_cast_came_from():
    @tf.function
    def f(x):
        cast = tf.cast(x, tf.float16)
        assert layer_scales.cast_source(cast) is x
        plain = x * 2.0
        assert layer_scales.cast_source(plain) is plain
        return cast
    f(tf.ones([2]))
    eager = tf.cast(tf.ones([2]), tf.float16)
    assert layer_scales.cast_source(eager) is eager  # no graph: the tensor itself


def test_backoff_halves_the_layers_that_overflowed_and_spares_the_global_scale():
    factors = tf.constant([8.0, 8.0, 2.0, 1.0])
    groups = [0, 0, 1, 2]
    new, finite = layer_scales.backoff(factors, tf.constant([0, 1, 0, 0]), groups)
    assert new.numpy().tolist() == [4.0, 4.0, 2.0, 1.0] and bool(finite)
    # a non-finite gradient whose factor is 1 is the global scale's to fix
    new, finite = layer_scales.backoff(factors, tf.constant([0, 0, 0, 1]), groups)
    assert new.numpy().tolist() == [8.0, 8.0, 2.0, 1.0] and not bool(finite)
    # never below 1; variables of no group stand alone
    new, finite = layer_scales.backoff(tf.constant([1.5, 3.0]), tf.constant([1, 0]), [-1, -1])
    assert new.numpy().tolist() == [1.0, 3.0] and bool(finite)


def _bound_optimizer(scale=4.0):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dense(1)])
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.1), schedule=FixedLossScale(scale),
                             layer_scales=True)
    opt.build(model.trainable_variables)
    opt.bind_layer_scales([model.layers[0].trainable_variables,
                           model.layers[1].trainable_variables])
    return model, opt


def test_optimizer_unscales_each_variable_by_its_layers_factor():
    model, opt = _bound_optimizer()
    assert opt.get_layer_scales() == [1.0, 1.0]
    opt.set_layer_scales([8.0, 1.0])
    assert opt.variable_scales.numpy().tolist() == [8.0, 8.0, 1.0, 1.0]
    before = [v.numpy().copy() for v in model.trainable_variables]
    # gradients as the boundaries leave them: layer 0's at 4 * 8, layer 1's at 4
    grads = [tf.ones_like(v) * s for v, s in zip(model.trainable_variables, [32, 32, 4, 4])]
    opt.apply(grads, model.trainable_variables)
    for b, v in zip(before, model.trainable_variables):
        np.testing.assert_allclose(b - v.numpy(), 0.1, rtol=1e-6)  # every unscaled gradient 1


def test_optimizer_backs_off_a_layers_factor_and_skips_the_step():
    model, opt = _bound_optimizer()
    opt.set_layer_scales([8.0, 1.0])
    before = [v.numpy().copy() for v in model.trainable_variables]
    grads = [tf.ones_like(v) for v in model.trainable_variables]
    grads[1] = grads[1] * np.inf
    opt.apply(grads, model.trainable_variables)
    assert opt.get_layer_scales() == [4.0, 1.0] and int(opt.skipped_steps) == 1
    assert float(opt.loss_scale) == 4.0
    for b, v in zip(before, model.trainable_variables):
        np.testing.assert_array_equal(b, v.numpy())


def test_optimizer_with_layer_scales_saves_and_loads(tmp_path):
    keras_mp.set_global_policy("float32")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dense(1)])
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.1), layer_scales=True)
    model.compile(optimizer=opt, loss="mse")
    model.fit(np.ones((4, 3)), np.ones((4, 1)), verbose=0)
    opt.bind_layer_scales([model.layers[0].trainable_variables,
                           model.layers[1].trainable_variables])
    opt.set_layer_scales([2.0**20, 2.0])
    assert opt.get_config()["layer_scales"] is True
    assert "layer_scales" not in LossScaleOptimizer(keras.optimizers.SGD()).get_config()
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert loaded.optimizer.layer_scales
    np.testing.assert_array_equal(loaded.optimizer.variable_scales.numpy(),
                                  [2.0**20] * 2 + [2.0] * 2)
    ckpt = tf.train.Checkpoint(optimizer=opt)
    saved = ckpt.save(str(tmp_path / "ckpt"))
    opt.set_layer_scales([1.0, 1.0])
    ckpt.restore(saved)
    assert opt.get_layer_scales() == [2.0**20, 2.0]


def test_layer_scale_is_read_in_float32_inside_a_float16_layer():
    # Keras casts variables read inside a layer's call to its compute dtype:
    # 2**16 would be inf in float16.
    model, opt = _bound_optimizer()
    opt.set_layer_scales([2.0**20, 1.0])
    keras_mp.set_global_policy("mixed_float16")
    try:
        class Probe(keras.layers.Layer):
            def call(self, x):
                return x, opt.layer_scale(0)
        _, factor = Probe()(tf.ones([1]))
    finally:
        keras_mp.set_global_policy("float32")
    assert factor.dtype == tf.float32 and float(factor) == 2.0**20


@pytest.mark.parametrize("call, match", [
    (lambda opt: opt.set_layer_scales([0.5, 1.0]), "`factors`"),
    (lambda opt: opt.set_layer_scales([1.0]), "`factors`"),
    (lambda opt: opt.layer_scale(7), "`group`"),
    (lambda opt: opt.bind_layer_scales([[keras.Variable(1.0)]]), "`groups`"),
    (lambda opt: opt.bind_layer_scales("dense"), "`groups`"),
])
def test_layer_scale_methods_check_their_arguments(call, match):
    _, opt = _bound_optimizer()
    with pytest.raises((ValueError, TypeError), match=match):
        call(opt)
    plain = LossScaleOptimizer(keras.optimizers.SGD())
    plain.build([keras.Variable(1.0)])
    with pytest.raises(ValueError, match="layer_scales=True"):
        plain.get_layer_scales()
