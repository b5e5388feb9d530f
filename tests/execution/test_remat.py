"""``keras.RematScope`` and ``keras.remat`` on TensorFlow in graph mode
(keras_mp/execution/remat.py): the same loss, gradients, dropout masks,
moving statistics and losses as without rematerialization, under Keras's
policies and keras-mp's adaptive ones, traced as a graph and under XLA; Keras's
own ``remat`` fails on the same models (tests/test_keras_changes.py)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mp
from keras_mp.execution import remat

T, D = 8, 16


class Penalty(keras.layers.Layer):
    """An ``add_loss`` term made inside a call."""

    def call(self, x):
        self.add_loss(1e-3 * keras.ops.mean(keras.ops.square(x)))
        return x


def _model(mode: str | None, seed: int = 0) -> keras.Model:
    """Dense with an activation, attention (called with keyword arguments),
    Dropout, BatchNormalization, LayerNormalization, an add_loss term."""
    keras.utils.set_random_seed(seed)

    def build():
        inputs = keras.Input((T, D))
        x = keras.layers.Dense(D, activation="gelu")(inputs)
        # Seeded layers: their masks must not hang on how many numbers Python's
        # global generator gave out before them (once in a full-suite run,
        # the two models' masks differed).
        x = keras.layers.MultiHeadAttention(2, D // 2, dropout=0.2, seed=seed + 1)(
            x, x, use_causal_mask=True)
        x = keras.layers.Dropout(0.3, seed=seed + 2)(x)
        x = keras.layers.BatchNormalization()(x)
        x = keras.layers.LayerNormalization()(Penalty()(x))
        x = keras.layers.GlobalAveragePooling1D()(x)
        return keras.Model(inputs, keras.layers.Dense(3, dtype="float32")(x))

    if mode is None:
        return build()
    with keras.RematScope(mode, output_size_threshold=64):
        return build()


def _data(n: int = 32):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(n, T, D)).astype("float32"),
            rng.integers(0, 3, size=(n,)).astype("int32"))


def _step(model: keras.Model, x, y, jit: bool = False):
    """Loss (with the model's losses), gradients and the model's losses, one
    training call, traced."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function(jit_compile=jit)
    def step(x, y):
        with tf.GradientTape() as tape:
            out = model(x, training=True)
            extra = tf.add_n([tf.constant(0.0)] + [tf.cast(a, tf.float32) for a in model.losses])
            loss = loss_fn(y, out) + extra
        return loss, extra, tape.gradient(loss, model.trainable_variables)

    return step(tf.constant(x), tf.constant(y))


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16", "mixed_float16"])
@pytest.mark.parametrize("mode", ["full", "larger_than", "activations"])
def test_rematerialized_model_has_the_same_loss_gradients_and_state(policy, mode):
    keras.config.set_dtype_policy(policy)
    try:
        x, y = _data()
        plain, rematerialized = _model(None), _model(mode)
        rematerialized.set_weights(plain.get_weights())
        a, b = _step(plain, x, y), _step(rematerialized, x, y)
    finally:
        keras.config.set_dtype_policy("float32")
    assert float(a[0]) == pytest.approx(float(b[0]), rel=1e-6)
    assert float(a[1]) == pytest.approx(float(b[1]), rel=1e-6)  # the add_loss term once
    # Float rounding of another summation order, not another computation (a
    # unit dropped differently moves a gradient by its whole size).
    rtol, atol = (1e-4, 1e-5) if policy == "float32" else (2e-2, 2e-3)
    for g, h, v in zip(a[2], b[2], plain.trainable_variables, strict=True):
        assert h is not None, v.path
        np.testing.assert_allclose(h.numpy(), g.numpy(), rtol=rtol, atol=atol, err_msg=v.path)
    # Moving statistics moved once, as without rematerialization.
    for v, w in zip(plain.non_trainable_variables, rematerialized.non_trainable_variables,
                    strict=True):
        np.testing.assert_allclose(w.numpy(), v.numpy(), rtol=1e-6, atol=1e-7, err_msg=v.path)


def test_dropout_masks_are_those_of_the_forward_pass():
    """The recomputed Dropout drops the units the forward pass dropped: a
    unit's gradient is zero exactly where its output is."""
    with keras.RematScope("full"):
        layer = keras.layers.Dropout(0.5, seed=3)
    x = tf.ones([64, 32])

    @tf.function
    def run():
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
        return y, tape.gradient(y, x)

    for _ in range(3):  # the seed moves on between calls; each call's pair agrees
        y, g = run()
        assert np.array_equal(y.numpy() == 0, g.numpy() == 0)
        assert 0.3 < float(np.mean(y.numpy() == 0)) < 0.7


def test_under_xla_gradients_are_equal():
    x, y = _data()
    plain, rematerialized = _model(None), _model("full")
    rematerialized.set_weights(plain.get_weights())
    a, b = _step(plain, x, y, jit=True), _step(rematerialized, x, y, jit=True)
    assert float(a[0]) == pytest.approx(float(b[0]), rel=1e-5)
    for g, h in zip(a[2], b[2], strict=True):
        np.testing.assert_allclose(h.numpy(), g.numpy(), rtol=1e-4, atol=1e-6)


def test_a_call_with_keyword_tensors_and_no_float_input():
    """Keyword tensors are differentiated; a call of integers alone is called
    as it is (nothing to recompute a gradient for)."""
    scale = tf.Variable(2.0)

    def f(x, *, factor, ids=None):
        return x * factor * scale + (0.0 if ids is None else tf.cast(ids, x.dtype))

    x, factor = tf.constant([1.0, 2.0]), tf.constant(3.0)

    @tf.function
    def grads(fn):
        with tf.GradientTape() as tape:
            tape.watch([x, factor])
            out = tf.reduce_sum(fn(x, factor=factor, ids=tf.constant([1, 1])))
        return tape.gradient(out, [x, factor, scale])

    for g, h in zip(grads(f), grads(remat.remat(f)), strict=True):
        np.testing.assert_allclose(h.numpy(), g.numpy())
    ids = tf.constant([3, 1])
    assert remat.remat(lambda i: i + 1)(ids).numpy().tolist() == [4, 2]


def test_remat_of_something_not_callable_is_a_clear_error():
    with pytest.raises(TypeError, match="`f` must be callable"):
        remat.remat(3)


@pytest.mark.parametrize("policy,mode", [("adaptive", "full"), ("adaptive", "larger_than"),
                                         ("adaptive_float16", "larger_than")])
def test_fit_adapts_a_rematerialized_model_as_the_plain_one(policy, mode, adapt_every_fit):
    """Under keras-mp's adaptive policies, with statistics steps and the probe
    running, a rematerialized model trains to the weights of the plain one,
    and each layer's forward statistics are recorded once."""
    from keras_mp.callbacks import AdaptivePrecision

    x, y = _data(64)
    results = []
    for remat_mode in (None, mode):
        keras_mp.set_global_policy(policy)
        try:
            model = _model(remat_mode, seed=1)
            # SGD: an update in proportion to its gradient (Adam's sign-like
            # steps turn a rounding difference of a tiny gradient into a whole step).
            model.compile(optimizer=keras.optimizers.SGD(0.05),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            cb = AdaptivePrecision(interval=2, statistics_every=1, probe_every=3)
            history = model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False,
                                callbacks=[cb])
            report = keras_mp.precision_report(model)
            results.append((history.history["loss"], model.get_weights(),
                            [(r["class"], r["dtype"], r["measured"]) for r in report.rows]))
        finally:
            keras_mp.set_global_policy("float32")
    (loss_a, weights_a, dtypes_a), (loss_b, weights_b, dtypes_b) = results
    assert np.all(np.isfinite(loss_b))
    np.testing.assert_allclose(loss_b, loss_a, rtol=2e-2)
    assert dtypes_b == dtypes_a
    for v, w in zip(weights_a, weights_b, strict=True):
        np.testing.assert_allclose(w, v, rtol=5e-2, atol=5e-3)


@pytest.mark.parametrize("inplace", [True, False])
def test_fused_layers_stay_rematerialized_with_equal_gradients(inplace):
    """``keras_mp.fuse`` keeps each layer's remat mode (in place and in the
    copy), and the fused, rematerialized model's gradients are the fused
    plain one's."""
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        x, y = _data()
        plain, rematerialized = _model(None), _model("full")
        rematerialized.set_weights(plain.get_weights())
        keras.utils.set_random_seed(2)  # a copy's Dropout layers draw new seeds
        plain = keras_mp.fuse(plain, inplace=inplace)
        keras.utils.set_random_seed(2)
        rematerialized = keras_mp.fuse(rematerialized, inplace=inplace)
        modes = {layer._remat_mode.mode for layer in rematerialized._flatten_layers()
                 if layer._remat_mode is not None}
        assert modes == {"full"}
        assert all(layer._remat_mode is not None for layer in rematerialized._flatten_layers()
                   if not isinstance(layer, keras.layers.InputLayer))  # never called
        assert any(type(layer).__module__ == "keras_mp.fused.layers"
                   for layer in rematerialized._flatten_layers())
        a, b = _step(plain, x, y), _step(rematerialized, x, y)
    finally:
        keras.config.set_dtype_policy("float32")
    assert float(a[0]) == pytest.approx(float(b[0]), rel=1e-3)
    for g, h in zip(a[2], b[2], strict=True):
        np.testing.assert_allclose(h.numpy(), g.numpy(), rtol=2e-2, atol=2e-3)


def test_keras_own_remat_fails_on_the_same_model(monkeypatch):
    """What keras-mp replaces: Keras's remat, on the model above, in graph mode."""
    from keras.src.backend.tensorflow import core

    monkeypatch.setattr(core, "remat", remat._state["keras_remat"])
    x, y = _data()
    with pytest.raises(ValueError, match=remat.FAULT):
        _step(_model("full"), x, y)


def test_eager_calls_are_rematerialized_alike():
    x, y = _data()
    plain, rematerialized = _model(None), _model("full")
    rematerialized.set_weights(plain.get_weights())
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    grads = []
    for model in (plain, rematerialized):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True)) + tf.add_n(model.losses)
        grads.append(tape.gradient(loss, model.trainable_variables))
    for g, h in zip(*grads, strict=True):
        np.testing.assert_allclose(h.numpy(), g.numpy(), rtol=1e-4, atol=1e-5)


def test_a_kerashub_llama_trains_rematerialized_under_adaptive(adapt_every_fit):
    """KerasHub's Llama built inside RematScope("full") (Keras's own remat fails
    on it: keyword arguments), statistics and the probe running: the losses of
    the plain model."""
    keras_hub = pytest.importorskip("keras_hub")
    import contextlib

    from keras_mp.callbacks import AdaptivePrecision

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 500, (32, 17))
    x = {"token_ids": tokens[:, :-1].astype("int32"),
         "padding_mask": np.ones((32, 16), "int32")}
    y = tokens[:, 1:].astype("int32")
    losses = []
    for mode in (None, "full"):
        keras_mp.set_global_policy("adaptive")
        try:
            keras.utils.set_random_seed(0)
            with keras.RematScope(mode) if mode else contextlib.nullcontext():
                backbone = keras_hub.models.LlamaBackbone(
                    vocabulary_size=500, num_layers=2, num_query_heads=4, num_key_value_heads=2,
                    hidden_dim=32, intermediate_dim=64)
                model = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
            model.compile(optimizer=keras.optimizers.SGD(0.1), weighted_metrics=[],
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            history = model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False,
                                callbacks=[AdaptivePrecision(interval=2, statistics_every=1,
                                                             probe_every=3)])
            losses.append(history.history["loss"])
        finally:
            keras_mp.set_global_policy("float32")
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-3)


def test_lifecycle_of_a_rematerialized_model(tmp_path, adapt_every_fit):
    """fit, save, load, export and quantize a model built inside RematScope
    under "adaptive" (the file holds no remat mode: Keras saves none)."""
    x, y = _data(32)
    keras_mp.set_global_policy("adaptive")
    try:
        model = _model("larger_than")
        model.compile(optimizer="adam",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=8, epochs=2, verbose=0)
        expected = model.predict(x, verbose=0)
        path = str(tmp_path / "remat.keras")
        model.save(path)
        loaded = keras.models.load_model(path, custom_objects={"Penalty": Penalty})
        np.testing.assert_array_equal(loaded.predict(x, verbose=0), expected)
        model.export(str(tmp_path / "served"))
        served = tf.saved_model.load(str(tmp_path / "served"))
        np.testing.assert_allclose(served.serve(tf.constant(x)).numpy(), expected,
                                   rtol=1e-2, atol=1e-2)
        model.quantize("int8")
        assert np.all(np.isfinite(model.predict(x, verbose=0)))
    finally:
        keras_mp.set_global_policy("float32")


def test_a_wrapped_layer_call_keeps_its_dropout_masks():
    """A layer's call wrapped (as keras-mp's hooks wrap it, ``functools.wraps``):
    the seeds are still the layer's, read as the forward pass read them."""
    import functools

    layer = keras.layers.Dropout(0.5, seed=4)
    original = layer.call

    @functools.wraps(original)
    def call(*args, **kwargs):
        return original(*args, **kwargs)

    x = tf.ones([64, 32])

    @tf.function
    def run():
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = remat.remat(call)(x, training=True)
        return y, tape.gradient(y, x)

    y, g = run()
    assert np.array_equal(y.numpy() == 0, g.numpy() == 0)


def test_under_a_mirrored_strategy(two_replica_strategy):
    """Two replicas, the model built in the strategy's scope inside RematScope:
    the losses of the plain model."""
    x, y = _data(32)
    losses = []
    for mode in (None, "larger_than"):
        with two_replica_strategy.scope():
            model = _model(mode, seed=3)
            model.compile(optimizer=keras.optimizers.SGD(0.05),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        losses.append(model.fit(x, y, batch_size=16, epochs=2, verbose=0,
                                shuffle=False).history["loss"])
    assert np.all(np.isfinite(losses[1]))
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-4)


def _residual(mode: str | None) -> keras.Model:
    keras.utils.set_random_seed(5)

    def build():
        inputs = keras.Input((8, 8, 3))
        x = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(inputs)
        y = keras.layers.BatchNormalization()(keras.layers.Conv2D(8, 3, padding="same")(x))
        x = keras.layers.Add()([x, y])
        x = keras.layers.GlobalAveragePooling2D()(x)
        return keras.Model(inputs, keras.layers.Dense(3)(x))

    if mode is None:
        return build()
    with keras.RematScope(mode, output_size_threshold=64):
        return build()


def test_larger_than_on_a_residual_model():
    """Keras sizes a "larger_than" call's output from the call's own tensors,
    which Add cannot read: keras-mp sizes it from Keras tensors of them."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 8, 8, 3)).astype("float32")
    y = rng.integers(0, 3, size=(16,)).astype("int32")
    plain, rematerialized = _residual(None), _residual("larger_than")
    rematerialized.set_weights(plain.get_weights())
    a, b = _step(plain, x, y), _step(rematerialized, x, y)
    assert float(a[0]) == pytest.approx(float(b[0]), rel=1e-6)
    for g, h in zip(a[2], b[2], strict=True):
        np.testing.assert_allclose(h.numpy(), g.numpy(), rtol=1e-4, atol=1e-5)


def test_keras_own_larger_than_fails_on_a_residual_model(monkeypatch):
    from keras.src.ops.operation import Operation

    monkeypatch.setattr(Operation, "rematerialized_call",
                        remat._state["keras_rematerialized_call"])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 8, 8, 3)).astype("float32")
    with pytest.raises(AttributeError, match="sparse"):
        _step(_residual("larger_than"), x, np.zeros(16, "int32"))


def _fit_adaptive(x, y, seed: int = 7) -> keras.Model:
    keras_mp.set_global_policy("adaptive")
    try:
        model = _model("larger_than", seed=seed)
        model.compile(optimizer=keras.optimizers.SGD(0.05),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False,
                  callbacks=[keras_mp.callbacks.AdaptivePrecision(
                      interval=2, statistics_every=1, probe_every=3)])
    finally:
        keras_mp.set_global_policy("float32")
    return model


def test_a_seeded_rematerialized_fit_repeats(adapt_every_fit):
    x, y = _data(64)
    a, b = _fit_adaptive(x, y), _fit_adaptive(x, y)
    for v, w in zip(a.get_weights(), b.get_weights(), strict=True):
        np.testing.assert_array_equal(w, v)


def test_a_nan_batch_leaves_a_rematerialized_model_as_it_was(adapt_every_fit):
    """A NaN batch is skipped: weights and BatchNormalization's moving
    statistics (assigned on the forward pass, recomputed without assigning)
    stay finite."""
    x, y = _data(64)
    x[16:32] = np.nan
    with pytest.warns(UserWarning, match="skipped"):
        model = _fit_adaptive(x, y)
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())
