"""keras-io-style models, written here as a keras.io example writes them:
a model with its own ``train_step`` (``tf.GradientTape``), a variational
autoencoder with two losses, and a subclassed Transformer block.

Each is registered with Keras's serialization (package ``keras_mp_tests``),
so a fresh process that imports this module loads their ``.keras`` files.

One change to keras.io's code: the subclassed layers pass
``dtype=self.dtype_policy`` to the sublayers they create (as KerasHub's and
Keras's own layers do). Without it a sublayer takes the global policy where
it is created: a ``.keras`` file loaded under the float32 global policy gets a
float32 attention meeting float16 inputs (``AddV2`` fails: Keras's
``load_model`` and ``clone_model`` fail so under ``mixed_float16`` too);
``keras_mp.fuse`` and keras-mp's serving copies clone each layer under its
own policy and need no such change.
"""

from __future__ import annotations

import keras
import tensorflow as tf
from keras import layers, ops

_PACKAGE = "keras_mp_tests"


@keras.saving.register_keras_serializable(package=_PACKAGE)
class CustomStepModel(keras.Model):
    """A functional model whose ``train_step`` is written by hand, as in
    Keras's guide "Customizing what happens in fit() with TensorFlow".

    The one line a user must add for loss scaling (under ``mixed_float16``,
    ``"adaptive_float16"``, or any policy whose optimizer scales the loss) is
    ``self.optimizer.scale_loss(loss)``, differentiated instead of the loss:
    Keras's own ``train_step`` does the same, and ``apply`` unscales.
    ``scale_loss=False`` leaves it out (what the tests check keras-mp does then).
    """

    def __init__(self, *args, scale_loss: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.scale_loss = scale_loss

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
            if self.scale_loss:
                loss_to_differentiate = self.optimizer.scale_loss(loss)
            else:
                loss_to_differentiate = loss
        grads = tape.gradient(loss_to_differentiate, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}

    def get_config(self):
        return {**super().get_config(), "scale_loss": self.scale_loss}


@keras.saving.register_keras_serializable(package=_PACKAGE)
class Sampling(layers.Layer):
    """``z = mean + exp(log_var / 2) * epsilon``, epsilon drawn in the
    inputs' dtype. keras.io's VAE draws a float32 epsilon, which meets a
    16-bit ``z_mean`` under any mixed policy (Keras's ``mixed_float16``
    included)."""

    def __init__(self, seed: int = 1337, **kwargs):
        super().__init__(**kwargs)
        self.seed = seed
        self.seed_generator = keras.random.SeedGenerator(seed)

    def call(self, inputs):
        z_mean, z_log_var = inputs
        epsilon = keras.random.normal(ops.shape(z_mean), dtype=z_mean.dtype,
                                      seed=self.seed_generator)
        return z_mean + ops.exp(0.5 * z_log_var) * epsilon

    def get_config(self):
        return {**super().get_config(), "seed": self.seed}


@keras.saving.register_keras_serializable(package=_PACKAGE)
class VAE(keras.Model):
    """keras.io's variational autoencoder (convolutional encoder, Sampling,
    transposed-convolution decoder) on ``size x size x 1`` images in [0, 1],
    trained by its own ``train_step`` on a reconstruction loss plus a KL
    loss, each tracked; calling it returns the reconstruction of the latent
    mean."""

    def __init__(self, size: int = 16, latent_dim: int = 2, **kwargs):
        super().__init__(**kwargs)
        self.size, self.latent_dim = size, latent_dim
        inputs = keras.Input((size, size, 1))
        h = layers.Conv2D(8, 3, activation="relu", strides=2, padding="same")(inputs)
        h = layers.Conv2D(16, 3, activation="relu", strides=2, padding="same")(h)
        h = layers.Dense(16, activation="relu")(layers.Flatten()(h))
        z_mean = layers.Dense(latent_dim, name="z_mean")(h)
        z_log_var = layers.Dense(latent_dim, name="z_log_var")(h)
        z = Sampling()([z_mean, z_log_var])
        self.encoder = keras.Model(inputs, [z_mean, z_log_var, z], name="encoder")
        quarter = size // 4
        latent = keras.Input((latent_dim,))
        h = layers.Dense(quarter * quarter * 16, activation="relu")(latent)
        h = layers.Reshape((quarter, quarter, 16))(h)
        h = layers.Conv2DTranspose(16, 3, activation="relu", strides=2, padding="same")(h)
        h = layers.Conv2DTranspose(8, 3, activation="relu", strides=2, padding="same")(h)
        out = layers.Conv2DTranspose(1, 3, activation="sigmoid", padding="same")(h)
        self.decoder = keras.Model(latent, out, name="decoder")
        self.total_loss_tracker = keras.metrics.Mean(name="loss")
        self.reconstruction_loss_tracker = keras.metrics.Mean(name="reconstruction_loss")
        self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

    @property
    def metrics(self):
        return [self.total_loss_tracker, self.reconstruction_loss_tracker,
                self.kl_loss_tracker]

    def call(self, inputs, training=False):
        # The reconstruction of the latent mean: no sampling, the same each call.
        return self.decoder(self.encoder(inputs, training=training)[0], training=training)

    def train_step(self, data):
        x = data[0] if isinstance(data, tuple) else data
        with tf.GradientTape() as tape:
            z_mean, z_log_var, z = self.encoder(x, training=True)
            reconstruction = self.decoder(z, training=True)
            # The losses in float32, whatever the layers computed in.
            x32, rec32 = ops.cast(x, "float32"), ops.cast(reconstruction, "float32")
            z_mean, z_log_var = ops.cast(z_mean, "float32"), ops.cast(z_log_var, "float32")
            reconstruction_loss = ops.mean(ops.sum(
                keras.losses.binary_crossentropy(x32, rec32), axis=(1, 2)))
            kl_loss = -0.5 * (1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var))
            kl_loss = ops.mean(ops.sum(kl_loss, axis=1))
            total_loss = reconstruction_loss + kl_loss
            scaled = self.optimizer.scale_loss(total_loss)
        grads = tape.gradient(scaled, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        self.total_loss_tracker.update_state(total_loss)
        self.reconstruction_loss_tracker.update_state(reconstruction_loss)
        self.kl_loss_tracker.update_state(kl_loss)
        return {m.name: m.result() for m in self.metrics}

    def get_config(self):
        return {"size": self.size, "latent_dim": self.latent_dim, "name": self.name}


@keras.saving.register_keras_serializable(package=_PACKAGE)
class TokenAndPositionEmbedding(layers.Layer):
    """keras.io's token plus learned position embedding."""

    def __init__(self, maxlen: int, vocab_size: int, embed_dim: int, **kwargs):
        super().__init__(**kwargs)
        self.maxlen, self.vocab_size, self.embed_dim = maxlen, vocab_size, embed_dim
        self.token_emb = layers.Embedding(vocab_size, embed_dim, dtype=self.dtype_policy)
        self.pos_emb = layers.Embedding(maxlen, embed_dim, dtype=self.dtype_policy)

    def call(self, x):
        positions = ops.arange(0, ops.shape(x)[-1], 1)
        return self.token_emb(x) + self.pos_emb(positions)

    def get_config(self):
        return {**super().get_config(), "maxlen": self.maxlen, "vocab_size": self.vocab_size,
                "embed_dim": self.embed_dim}


@keras.saving.register_keras_serializable(package=_PACKAGE)
class TransformerBlock(layers.Layer):
    """keras.io's Transformer block: a subclassed layer of
    ``MultiHeadAttention``, a feed-forward ``Sequential``, two
    ``LayerNormalization`` and two ``Dropout`` layers."""

    def __init__(self, embed_dim: int, num_heads: int, ff_dim: int, rate: float = 0.1,
                 **kwargs):
        super().__init__(**kwargs)
        self.embed_dim, self.num_heads, self.ff_dim, self.rate = embed_dim, num_heads, ff_dim, rate
        dtype = self.dtype_policy   # see the module docstring
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim, dtype=dtype)
        self.ffn = keras.Sequential([layers.Dense(ff_dim, activation="relu", dtype=dtype),
                                     layers.Dense(embed_dim, dtype=dtype)])
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6, dtype=dtype)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6, dtype=dtype)
        self.dropout1 = layers.Dropout(rate, dtype=dtype)
        self.dropout2 = layers.Dropout(rate, dtype=dtype)

    def call(self, inputs, training=False):
        attn_output = self.att(inputs, inputs)
        out1 = self.layernorm1(inputs + self.dropout1(attn_output, training=training))
        ffn_output = self.dropout2(self.ffn(out1), training=training)
        return self.layernorm2(out1 + ffn_output)

    def get_config(self):
        return {**super().get_config(), "embed_dim": self.embed_dim,
                "num_heads": self.num_heads, "ff_dim": self.ff_dim, "rate": self.rate}


def transformer_classifier(maxlen: int, vocab_size: int, classes: int) -> keras.Model:
    """keras.io's "Text classification with Transformer", shrunk."""
    inputs = keras.Input((maxlen,), dtype="int32")
    x = TokenAndPositionEmbedding(maxlen, vocab_size, 16)(inputs)
    x = TransformerBlock(16, 2, 32)(x)
    x = layers.GlobalAveragePooling1D()(x)
    x = layers.Dropout(0.1)(x)
    x = layers.Dense(20, activation="relu")(x)
    outputs = layers.Dense(classes, activation="softmax")(x)
    return keras.Model(inputs, outputs)


def custom_step_classifier(features: int, classes: int, scale_loss: bool = True):
    """A small :class:`CustomStepModel` classifier over ``features`` inputs."""
    inputs = keras.Input((features,))
    h = layers.Dense(32, activation="relu")(inputs)
    h = layers.Dense(32, activation="relu")(h)
    return CustomStepModel(inputs, layers.Dense(classes)(h), scale_loss=scale_loss)
