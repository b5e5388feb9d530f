"""Regularizers, ``add_loss`` and ``Normalization.adapt`` under the adaptive
policies (issue 49, items 1 and 6).

Each set-up runs under Keras's matching mixed policy first, which fails
(Keras adds a 16-bit activity penalty to float32 loss terms; its
``Normalization.adapt`` adds a dataset's 16-bit batches to float32 totals),
then under keras-mp's, which trains with the statistics step and the float32
probe running. The probe's float32 loss and gradients are the train step's
(every weight, activity and ``add_loss`` term) on the same batch with the
model in float32.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers, ops

import keras_mp
from keras_mp import policies
from keras_mp.adaptive.evidence import probe
from keras_mp.adaptive.integration import rescue

#: keras-mp's adaptive policy -> Keras's policy that fails on the same set-up
#: ("adaptive" picks bfloat16 where the device has it).
KERAS_POLICY = {"adaptive": "mixed_bfloat16", "adaptive_bfloat16": "mixed_bfloat16",
                "adaptive_float16": "mixed_float16"}
SUM_OF_16_BIT_AND_FLOAT32 = "Cannot convert a list containing a tensor of dtype"


@pytest.fixture(autouse=True)
def _reset_policy():
    yield
    keras_mp.set_global_policy("float32")


def _set(policy: str) -> None:
    keras.utils.set_random_seed(0)
    if policy.startswith("adaptive"):
        keras_mp.set_global_policy(policy)
    else:
        keras.mixed_precision.set_global_policy(policy)


def _adapts(policy: str) -> bool:
    """Whether ``policy`` has a 16-bit candidate here ("adaptive" is float32
    alone on a CPU without 16-bit units: nothing adapts, nothing fails)."""
    _set(policy)
    adaptive = keras.mixed_precision.global_policy()
    return any(c != "float32" for c in adaptive.candidates)


def _callback(probe_every=2):
    """Statistics every other call and the probe on every other call, no
    decision inside the fit: the fit's evidence can be read at its end."""
    return keras_mp.callbacks.AdaptivePrecision(interval=1000, statistics_every=2,
                                                probe_every=probe_every, first_decision=None)


class Penalty(layers.Layer):
    """A layer of one's own adding a penalty on its input, computed in its
    compute dtype (16 bits under a mixed policy)."""

    def call(self, x):
        self.add_loss(1e-3 * ops.mean(ops.square(x)))
        return x


def _regularized(learning_rate=0.05):
    """Kernel, bias and activity regularizers and an ``add_loss`` term."""
    inputs = keras.Input((8,))
    x = layers.LayerNormalization()(inputs)
    x = layers.Dense(16, activation="relu", kernel_regularizer=keras.regularizers.L2(1e-2),
                     bias_regularizer=keras.regularizers.L1(1e-2),
                     activity_regularizer=keras.regularizers.L2(1e-3), name="hidden")(x)
    x = Penalty(name="penalty")(x)
    outputs = layers.Dense(1, kernel_regularizer=keras.regularizers.L1L2(1e-3, 1e-3))(x)
    model = keras.Model(inputs, outputs)
    model.compile(keras.optimizers.SGD(learning_rate), "mse")
    return model


def _data(n=64, scale=1.0):
    """Features and, as target, the first of them as LayerNormalization gives it."""
    x = np.random.default_rng(0).normal(size=(n, 8)).astype("float32")
    z = (x - x.mean(1, keepdims=True)) / x.std(1, keepdims=True)
    return x * scale, z[:, :1]


def _float32_step(model, x, y):
    """The float32 train step's loss and gradients on (x, y): the same model
    made under float32 with ``model``'s weights, one SGD(1.0) step."""
    _set("float32")
    twin = _regularized(learning_rate=1.0)
    twin.set_weights(model.get_weights())
    before = [np.asarray(v) for v in twin.trainable_variables]
    loss = twin.train_on_batch(x, y)
    grads = [b - np.asarray(v) for b, v in zip(before, twin.trainable_variables)]
    return loss, grads


@pytest.mark.parametrize("policy", ["adaptive", "adaptive_float16"])
def test_a_regularized_model_adapts_and_the_probe_loss_is_the_train_steps(policy,
                                                                          adapt_every_fit):
    x, y = _data()
    _set(KERAS_POLICY[policy])
    with pytest.raises(TypeError, match=SUM_OF_16_BIT_AND_FLOAT32):
        _regularized().fit(x, y, batch_size=8, verbose=0)

    if not _adapts(policy):
        pytest.skip(f"{policy!r} is float32 alone on this CPU: Keras's float32 trains it")
    model = _regularized()
    cb = _callback()
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[cb])
    assert np.all(np.isfinite(history.history["loss"]))
    evidence = cb._stats.read()
    assert evidence.steps == 4 and evidence.probe_steps >= 1     # 8 calls
    hidden = model.get_layer("hidden")
    assert hidden.compute_dtype != "float32"
    adaptive = policies.policy_of(model)
    controlled = policies.adaptive_layers(model, adaptive)
    assert evidence.layers[controlled.index(hidden)].probe_steps == evidence.probe_steps

    # The probe's float32 pass against the train step on the same batch in float32.
    tvars = model.trainable_variables
    in_float32 = {layer.path: "float32" for layer in controlled}

    @tf.function
    def probed(x, y):
        with adaptive.overriding(in_float32):
            return probe._loss_and_grads(model, x, y, None, tf.constant(1.0), tvars)

    loss32, grads32 = probed(x[:8], y[:8])
    loss, grads = _float32_step(model, x[:8], y[:8])
    assert float(loss32) == pytest.approx(loss, rel=1e-5)
    for g32, g, v in zip(grads32, grads, tvars):
        np.testing.assert_allclose(np.asarray(g32), g, rtol=1e-4, atol=1e-6, err_msg=v.path)
    model(x[:8])
    assert len(model.losses) == 5   # activity, add_loss, kernel, bias, output kernel


@pytest.mark.parametrize("policy", ["adaptive", "adaptive_bfloat16", "adaptive_float16"])
def test_activity_regularizers_train_with_float32_penalties(policy, adapt_every_fit):
    x, y = _data()
    _set(KERAS_POLICY[policy])
    with pytest.raises(TypeError, match=SUM_OF_16_BIT_AND_FLOAT32):
        _regularized().fit(x, y, batch_size=8, verbose=0)

    sixteen = _adapts(policy)
    model = _regularized()
    cb = _callback(probe_every=None)
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[cb])
    assert np.all(np.isfinite(history.history["loss"]))
    assert history.history["loss"][-1] < history.history["loss"][0]
    hidden, penalty = model.get_layer("hidden"), model.get_layer("penalty")
    if sixteen:
        assert cb._stats.read().steps == 8                           # statistics ran
    report = keras_mp.precision_report(model)
    rules = {row["layer"]: row["rules"] for row in report.rows}
    narrow = hidden.compute_dtype != "float32"
    assert rules[hidden.path] == rules[penalty.path] == (["float32_loss"] if narrow else [])
    assert ("float32 penalty (float32_loss)" in str(report)) == narrow
    assert rescue.RULES["float32_loss"] in report.legend()

    # Activations whose sum of squares overflows float16 (beyond 65504): the
    # penalty is the float32 one of the layer's output.
    big, _ = _data(8, scale=100.0)
    out = hidden(big)
    activity = hidden.losses[0]                  # then the kernel's and the bias's terms
    expected = 1e-3 * float(ops.sum(ops.square(ops.cast(out, "float32")))) / 8
    assert activity.dtype == "float32"
    assert float(activity) == pytest.approx(expected, rel=1e-5)
    if hidden.compute_dtype == "float16":        # Keras's 16-bit sum: inf
        assert not np.isfinite(float(ops.sum(ops.square(out))))
    # The layer keeps its own regularizer, and saves it.
    assert type(hidden.activity_regularizer) is keras.regularizers.L2
    assert hidden.get_config()["activity_regularizer"]["class_name"] == "L2"


class CustomStep(keras.Model):
    """A ``train_step`` of one's own that adds ``self.losses`` as Keras's
    guide to training loops writes it."""

    loss_fn = keras.losses.MeanSquaredError()

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.loss_fn(y, y_pred)
            loss += sum(self.losses)
            scaled = self.optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return {"total": loss}


def _custom():
    inputs = keras.Input((8,))
    x = layers.LayerNormalization()(inputs)
    x = layers.Dense(16, activation="relu", kernel_regularizer="l2", name="hidden")(x)
    model = CustomStep(inputs, layers.Dense(1)(Penalty(name="penalty")(x)))
    model.compile(keras.optimizers.SGD(0.05))
    return model


@pytest.mark.parametrize("policy", ["adaptive_bfloat16", "adaptive_float16"])
def test_a_custom_train_step_adds_self_losses(policy, adapt_every_fit):
    x, y = _data()
    _set(KERAS_POLICY[policy])
    with pytest.raises(TypeError, match="float32 that does not match type b?float16"):
        _custom().fit(x, y, batch_size=8, verbose=0)     # sum(self.losses)

    _set(policy)
    model = _custom()
    cb = _callback(probe_every=None)
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[cb])
    assert np.all(np.isfinite(history.history["total"]))
    assert history.history["total"][-1] < history.history["total"][0]
    assert cb._stats.read().steps == 8
    penalty = model.get_layer("penalty")
    assert penalty.compute_dtype != "float32"
    assert [t.dtype.name for t in penalty.losses] == ["float32"]   # the add_loss term


# -- Normalization.adapt on a tf.data.Dataset -----------------------------------

def _raw_features():
    """Features in raw units (around 3000, spread 1000), as structured data comes."""
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(256, 4)) * 1000 + 3000).astype("float32")
    return x, (x[:, :1] - 3000) / 1000


def _dataset(x, y=None):
    return tf.data.Dataset.from_tensor_slices(x if y is None else (x, y)).batch(32)


@pytest.mark.parametrize("policy", ["adaptive", "adaptive_bfloat16", "adaptive_float16"])
def test_normalization_adapts_on_a_dataset_in_float32(policy, adapt_every_fit):
    x, y = _raw_features()
    _set("float32")
    reference = layers.Normalization()
    reference.adapt(_dataset(x))
    _set(KERAS_POLICY[policy])
    with pytest.raises(tf.errors.InvalidArgumentError, match="expected to be a float tensor"):
        layers.Normalization().adapt(_dataset(x))

    sixteen = _adapts(policy)
    norm = layers.Normalization()
    norm.adapt(_dataset(x))
    np.testing.assert_array_equal(np.asarray(norm.adapt_mean), np.asarray(reference.adapt_mean))
    np.testing.assert_array_equal(np.asarray(norm.adapt_variance),
                                  np.asarray(reference.adapt_variance))
    assert norm.compute_dtype == (KERAS_POLICY[policy].removeprefix("mixed_") if sixteen
                                  else "float32")
    assert norm.mean.dtype.name == norm.compute_dtype                  # cached as it computes

    # The structured-data example: the adapted layer first in a model fitted on the data.
    inputs = keras.Input((4,))
    h = layers.Dense(16, activation="relu")(norm(inputs))
    model = keras.Model(inputs, layers.Dense(1)(layers.LayerNormalization()(h)))
    model.compile("adam", "mse")
    cb = _callback()
    history = model.fit(_dataset(x, y), epochs=2, verbose=0, callbacks=[cb])
    assert np.all(np.isfinite(history.history["loss"]))
    assert history.history["loss"][-1] < history.history["loss"][0]
    report = keras_mp.precision_report(model)
    rules = {row["layer"]: row["rules"] for row in report.rows}
    assert rules[norm.path] == (["float32_adapt"] if sixteen else [])
    assert ("float32 statistics (float32_adapt)" in str(report)) == sixteen
    if sixteen:
        evidence = cb._stats.read()
        assert evidence.steps == 8 and evidence.probe_steps >= 1


@pytest.mark.parametrize("policy", ["adaptive", "adaptive_float16"])
@pytest.mark.parametrize("gated", [True, False])
def test_lookup_layers_one_hot_encode_while_the_model_adapts(policy, gated, adapt_every_fit):
    """keras.io's structured-data example: ``IntegerLookup`` and ``StringLookup``
    one-hot encode categorical columns. Their ``compute_dtype`` is ``int64``
    and ``string`` whatever their policy, so they are not layers the policy
    controls (the statistics step crashed on them: "`dtype` must be one of
    ..., got 'int64'"); the model around them adapts, statistics and probe
    running, with plain steps sharing the statistics' trace or not."""
    _set(policy)
    rng = np.random.default_rng(0)
    n = 128
    ints = rng.integers(0, 4, (n, 1))
    words = rng.choice(np.array(["fixed", "normal", "reversible"]), (n, 1))
    numbers = (rng.normal(size=(n, 1)) * 50 + 130).astype("float32")
    y = (ints[:, 0] % 2).astype("float32")
    int_lookup = layers.IntegerLookup(output_mode="one_hot")
    int_lookup.adapt(ints)
    string_lookup = layers.StringLookup(output_mode="one_hot")
    string_lookup.adapt(words)
    norm = layers.Normalization()
    norm.adapt(numbers)
    inputs = [keras.Input((1,), dtype="int64"), keras.Input((1,), dtype="string"),
              keras.Input((1,))]
    h = layers.concatenate([int_lookup(inputs[0]), string_lookup(inputs[1]), norm(inputs[2])])
    h = layers.Dropout(0.5)(layers.Dense(32, activation="relu")(h))
    model = keras.Model(inputs, layers.Dense(1, activation="sigmoid")(h))
    model.compile("adam", "binary_crossentropy", metrics=["accuracy"])
    controlled = policies.adaptive_layers(model, policies.policy_of(model))
    assert int_lookup not in controlled and string_lookup not in controlled
    assert any(isinstance(layer, layers.Dense) for layer in controlled)
    cb = keras_mp.callbacks.AdaptivePrecision(
        interval=1000, statistics_every=2 if gated else 1, probe_every=2, first_decision=None)
    history = model.fit(tf.data.Dataset.from_tensor_slices(((ints, words, numbers), y)).batch(16),
                        epochs=2, verbose=0, callbacks=[cb])
    assert np.all(np.isfinite(history.history["loss"]))
    if _adapts(policy):
        evidence = cb._stats.read()
        assert evidence.steps >= 8 and evidence.probe_steps >= 1
