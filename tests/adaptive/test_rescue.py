"""keras_mp.adaptive.integration.rescue: what breaks Keras's mixed precision trains under the
adaptive policies (issue 41). Each case is keras-io-style code written here (a
text classifier that feeds token ids through a float ``keras.Input``, a
classifier compiled with top-k metrics, a VAE whose ``Sampling`` layer draws a
float32 epsilon, a GAN whose ``train_step`` concatenates generated and real
images), run side by side under Keras's ``mixed_<dtype>`` (which fails, or
silently trains on rounded ids) and keras-mp's ``adaptive_<dtype>`` (which
trains, and says what it did)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers, ops

import keras_mp
from keras_mp.adaptive.integration import rescue

DTYPES = ["bfloat16", "float16"]
VOCAB, MAXLEN = 20000, 8


# (The models hold a normalization layer: for an all-Dense model keras_mp's
# execution mode measures matmuls in a child process once per process, tens of
# seconds on a busy 2-core machine, which these tests do not need.)


@pytest.fixture(autouse=True)
def _reset_policy():
    yield
    keras_mp.set_global_policy("float32")


def _policy(kind, dtype):
    keras.utils.set_random_seed(0)
    if kind == "keras":
        keras.mixed_precision.set_global_policy(f"mixed_{dtype}")
    else:
        keras_mp.set_global_policy(f"adaptive_{dtype}")


def _fit(model, x, y, interval=100):
    """A short fit; ``interval=2``: with decisions (two per epoch)."""
    cb = keras_mp.callbacks.AdaptivePrecision(interval=interval, probe_every=None)
    return model.fit(x, y, batch_size=8, epochs=2 if interval < 100 else 1, verbose=0,
                     callbacks=[cb])


# -- integer inputs through a float Input ------------------------------------

class TokenAndPositionEmbedding(layers.Layer):
    def __init__(self, maxlen, vocab, dim, **kwargs):
        super().__init__(**kwargs)
        self.token_emb = layers.Embedding(vocab, dim)
        self.pos_emb = layers.Embedding(maxlen, dim)

    def call(self, x):
        positions = self.pos_emb(ops.arange(0, ops.shape(x)[-1]))
        return self.token_emb(x) + positions


def _text_classifier():
    inputs = keras.Input(shape=(MAXLEN,))           # float32, as in the keras-io example
    x = TokenAndPositionEmbedding(MAXLEN, VOCAB, 8)(inputs)
    x = layers.GlobalAveragePooling1D()(x)
    outputs = layers.Dense(2, activation="softmax")(x)
    model = keras.Model(inputs, outputs)
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def _ids():
    rng = np.random.default_rng(0)
    x = rng.integers(VOCAB - 8, VOCAB, (32, MAXLEN)).astype("float32")   # 19992..19999
    x[:, 0] = 257                                   # bfloat16 holds 256 and 258, not 257
    return x, rng.integers(0, 2, 32)


def _exact_tokens(model, x):
    """The token embedding the model computes against the one of the int32 ids."""
    emb = model.layers[1].token_emb
    exact = ops.take(emb.embeddings, x.astype("int32"), axis=0)
    got = model.layers[1](x) - model.layers[1].pos_emb(ops.arange(0, MAXLEN))
    return np.asarray(ops.cast(got, "float32")), np.asarray(ops.cast(exact, emb.compute_dtype)
                                                            ).astype("float32")


@pytest.mark.parametrize("dtype", DTYPES)
def test_token_ids_through_a_float_input_stay_exact(dtype):
    x, y = _ids()
    _policy("keras", dtype)
    model = _text_classifier()
    if dtype == "float16":   # 19996-19999 round to 20000: the gather fails
        with pytest.raises(tf.errors.InvalidArgumentError, match="20000"):
            model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    else:                    # silently rounded: 257 -> 256, 19999 -> 20000 -> ...
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
        got, exact = _exact_tokens(model, x)
        assert not np.allclose(got, exact, atol=1e-2)

    _policy("adaptive", dtype)
    model = _text_classifier()
    history = _fit(model, x, y)
    assert np.all(np.isfinite(history.history["loss"]))
    got, exact = _exact_tokens(model, x)
    np.testing.assert_allclose(got, exact, atol=5e-2)
    report = keras_mp.precision_report(model)
    rules = {row["layer"]: row["rules"] for row in report.rows}
    emb = model.layers[1]
    assert rules[emb.path] == ["integer_input"]
    assert rules[emb.token_emb.path] == ["integer_input"]
    assert rules[emb.pos_emb.path] == []            # its positions are int32 already
    assert "exact input (integer_input)" in str(report)
    assert rescue.RULES["integer_input"] in report.legend()
    assert report.dtypes()[emb.path] == dtype       # exact, and still 16-bit


def test_integer_inputs_change_nothing_and_16_bit_ids_warn():
    _policy("adaptive", "bfloat16")
    ids = keras.Input((MAXLEN,), dtype="int32")
    model = keras.Model(ids, layers.Embedding(VOCAB, 4)(ids))
    model(np.zeros((1, MAXLEN), "int32"))
    assert keras_mp.precision_report(model).rows[0]["rules"] == []
    ids = keras.Input((MAXLEN,))
    x = layers.Rescaling(1.0)(ids)                  # casts the ids to bfloat16 first
    with pytest.warns(UserWarning, match="dtype='int32'"):
        keras.Model(ids, layers.Embedding(VOCAB, 4)(x))


# -- metrics whose ops take float32 only -------------------------------------

def _top_k_classifier(dtype, kind):
    _policy(kind, dtype)
    inputs = keras.Input((8, 8, 1))
    x = layers.LayerNormalization()(layers.Flatten()(inputs))
    model = keras.Model(inputs, layers.Dense(10)(x))
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=[keras.metrics.SparseTopKCategoricalAccuracy(5, name="top5"),
                           "sparse_top_k_categorical_accuracy", "accuracy"])
    return model


@pytest.mark.parametrize("dtype", DTYPES)
def test_top_k_metrics_get_float32_predictions(dtype):
    rng = np.random.default_rng(0)
    x, y = rng.random((32, 8, 8, 1)).astype("float32"), rng.integers(0, 10, 32)
    model = _top_k_classifier(dtype, "keras")
    with pytest.raises(TypeError, match="InTopKV2"):
        model.fit(x, y, batch_size=8, verbose=0)

    model = _top_k_classifier(dtype, "adaptive")
    history = _fit(model, x, y)
    top5 = history.history["top5"]
    assert all(0.0 < v <= 1.0 for v in top5)
    assert history.history["sparse_top_k_categorical_accuracy"] == top5
    report = keras_mp.precision_report(model)
    assert set(report.metrics_in_float32) == {"top5", "sparse_top_k_categorical_accuracy"}
    assert "float32_metric" in str(report)
    # The metric is Keras's on the float32 predictions.
    logits = np.asarray(ops.cast(model.predict(x, verbose=0), "float32"))
    top = np.argsort(-logits, -1)[:, :5]
    expected = np.mean([label in row for label, row in zip(y, top)])
    assert model.evaluate(x, y, verbose=0, return_dict=True)["top5"] == pytest.approx(expected)


# -- dtype mismatches in user code -------------------------------------------

class Sampling(layers.Layer):
    """As in the keras-io VAE: epsilon drawn in float32 (keras.random's default)."""

    def call(self, inputs):
        z_mean, z_log_var = inputs
        epsilon = keras.random.normal(shape=ops.shape(z_mean))
        return z_mean + ops.exp(0.5 * z_log_var) * epsilon


def _vae():
    inputs = keras.Input((16,))
    h = layers.LayerNormalization()(layers.Dense(8, activation="relu")(inputs))
    z_mean, z_log_var = layers.Dense(2)(h), layers.Dense(2)(h)
    z = Sampling(name="sampling")([z_mean, z_log_var])
    model = keras.Model(inputs, layers.Dense(16)(z))
    model.compile("adam", "mse")
    return model


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_layer_mixing_dtypes_moves_to_float32(dtype):
    _policy("keras", dtype)
    with pytest.raises(TypeError, match="float32|float"):
        _vae()

    _policy("adaptive", dtype)
    model = _vae()
    sampling = model.get_layer("sampling")
    assert sampling.compute_dtype == "float32"
    assert model.layers[1].compute_dtype == dtype     # the others stay 16-bit
    x = np.random.default_rng(0).random((32, 16)).astype("float32")
    history = _fit(model, x, x, interval=2)
    assert np.all(np.isfinite(history.history["loss"]))
    row = next(r for r in keras_mp.precision_report(model).rows if r["layer"] == sampling.path)
    assert row["dtype"] == "float32"                 # pinned through the decisions
    assert [h["reason"] for h in row["history"]] == ["dtype_mismatch"]
    assert "(dtype_mismatch)" in str(keras_mp.precision_report(model))


class GAN(keras.Model):
    """As in keras-io's GAN examples, with tf.concat where they use keras.ops."""

    def __init__(self):
        super().__init__(name="gan")
        self.generator = keras.Sequential([keras.Input((4,)), layers.Dense(16)])
        self.discriminator = keras.Sequential([keras.Input((16,)), layers.Dense(1)])

    def compile(self, **kwargs):
        super().compile(**kwargs)
        self.d_optimizer = keras.optimizers.Adam()

    def train_step(self, real):
        noise = keras.random.normal((tf.shape(real)[0], 4))
        fake = self.generator(noise)
        combined = tf.concat([fake, real], axis=0)    # 16-bit meets float32
        labels = tf.concat([tf.ones((tf.shape(real)[0], 1)), tf.zeros((tf.shape(real)[0], 1))], 0)
        with tf.GradientTape() as tape:
            loss = keras.losses.binary_crossentropy(
                labels, self.discriminator(combined), from_logits=True)
        grads = tape.gradient(loss, self.discriminator.trainable_weights)
        self.optimizer.apply(grads, self.discriminator.trainable_weights)
        return {"d_loss": ops.mean(loss)}


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_mismatch_in_a_custom_train_step_names_the_model_and_the_fix(dtype):
    real = np.random.default_rng(0).random((16, 16)).astype("float32")
    _policy("keras", dtype)
    gan = GAN()
    gan.compile(optimizer="adam")
    with pytest.raises(TypeError, match="ConcatV2") as plain:
        gan.fit(real, batch_size=8, verbose=0)
    assert not isinstance(plain.value, rescue.DtypeMismatchError)

    _policy("adaptive", dtype)
    gan = GAN()
    gan.compile(optimizer="adam")
    with pytest.raises(rescue.DtypeMismatchError,
                       match=r"train step of model 'gan' \(GAN\): cast one side"):
        gan.fit(real, batch_size=8, verbose=0)


def test_bad_arguments():
    with pytest.raises(TypeError, match="`error`"):
        rescue.is_dtype_mismatch("error")
    with pytest.raises(TypeError, match="`model`"):
        rescue.float32_metrics("model")


class InTopTwo(keras.metrics.Metric):
    """A metric of one's own whose op takes float32 only."""

    def __init__(self):
        super().__init__(name="in_top_two")
        self.hits = self.add_weight(shape=(), initializer="zeros", name="hits")

    def update_state(self, y_true, y_pred, sample_weight=None):
        hits = tf.math.in_top_k(tf.reshape(tf.cast(y_true, tf.int32), [-1]), y_pred, 2)
        self.hits.assign_add(tf.reduce_sum(tf.cast(hits, "float32")))

    def result(self):
        return self.hits


def test_a_metric_of_ones_own_that_fails_names_the_model_and_the_fix(adapt_every_fit):
    _policy("adaptive", "bfloat16")
    inputs = keras.Input((4,))
    model = keras.Model(inputs, layers.Dense(3)(layers.LayerNormalization()(inputs)),
                        name="classifier")
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=[InTopTwo()])
    with pytest.raises(rescue.DtypeMismatchError,
                       match=r"metric compiled with model 'classifier': cast one side"):
        model.fit(np.ones((8, 4), "float32"), np.zeros(8), verbose=0)
