"""Eight keras.io examples, shrunk, as users write them: what
:mod:`benchmarks.user_code` times ``fit`` on (issue 49, item 4).

Each builder returns ``(model, fit)``: the compiled model, built under the
global policy set before the call, and a function that runs the example's
``fit`` on synthetic data of the example's shapes (no download). The code
follows the keras.io example of the same name (Keras 3 versions), with the
data and the epochs shrunk so that a 2-core CPU fits each in seconds:

========================  =================================================
``distillation``          knowledge_distillation: a ``Distiller`` model with
                          its own ``train_step`` (``tf.GradientTape``), a
                          convolutional teacher and student
``collaborative``         collaborative_filtering_movielens: a subclassed
                          ``RecommenderNet`` (embeddings, dot product)
``multi_io``              the functional API guide's ticket classifier: two
                          text inputs through ``Embedding`` + ``LSTM``, tags,
                          two outputs with two losses
``structured``            structured_data_classification_from_scratch:
                          ``tf.data``, ``StringLookup``/``IntegerLookup``
                          one-hot encoding and ``Normalization``
``seq2seq``               lstm_seq2seq: a character-level LSTM
                          encoder-decoder, teacher forcing
``ts_transformer``        timeseries_classification_transformer: four
                          Transformer encoder blocks on a univariate series
``ts_fcn``                timeseries_classification_from_scratch: three
                          ``Conv1D`` + ``BatchNormalization`` blocks
``unet``                  oxford_pets_image_segmentation: the Xception-style
                          U-Net, at 64x64
========================  =================================================

Example:
    >>> import keras
    >>> model, fit = BUILDERS["ts_fcn"](scale=0.05)
    >>> model.name
    'ts_fcn'
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["BUILDERS", "build", "xception_downsampling"]


def _rng(seed: int = 0):
    import numpy as np

    return np.random.default_rng(seed)


def _n(rows: int, scale: float) -> int:
    return max(8, int(rows * scale))


def distillation(scale: float = 1.0):
    import keras
    import tensorflow as tf
    from keras import layers

    def convnet(name, width):
        return keras.Sequential([
            keras.Input((28, 28, 1)),
            layers.Conv2D(width, 3, strides=2, padding="same"), layers.LeakyReLU(0.2),
            layers.MaxPooling2D(2, strides=1, padding="same"),
            layers.Conv2D(2 * width, 3, strides=2, padding="same"),
            layers.Flatten(), layers.Dense(10)], name=name)

    class Distiller(keras.Model):
        def __init__(self, student, teacher):
            super().__init__(name="distillation")
            self.teacher, self.student = teacher, student

        def compile(self, optimizer, metrics, student_loss_fn, distillation_loss_fn,
                    alpha=0.1, temperature=3):
            super().compile(optimizer=optimizer, metrics=metrics)
            self.student_loss_fn, self.distillation_loss_fn = student_loss_fn, distillation_loss_fn
            self.alpha, self.temperature = alpha, temperature

        def call(self, x):
            return self.student(x)

        def train_step(self, data):
            x, y = data
            teacher_predictions = self.teacher(x, training=False)
            with tf.GradientTape() as tape:
                student_predictions = self.student(x, training=True)
                student_loss = self.student_loss_fn(y, student_predictions)
                distillation_loss = self.distillation_loss_fn(
                    tf.nn.softmax(teacher_predictions / self.temperature, axis=1),
                    tf.nn.softmax(student_predictions / self.temperature, axis=1),
                ) * self.temperature**2
                loss = self.alpha * student_loss + (1 - self.alpha) * distillation_loss
            grads = tape.gradient(loss, self.student.trainable_variables)
            self.optimizer.apply(grads, self.student.trainable_variables)
            for metric in self.metrics:
                if metric.name != "loss":
                    metric.update_state(y, student_predictions)
            return {"student_loss": student_loss, "distillation_loss": distillation_loss,
                    **{m.name: m.result() for m in self.metrics if m.name != "loss"}}

    rng = _rng()
    n = _n(4096, scale)
    x = rng.random((n, 28, 28, 1)).astype("float32")
    y = rng.integers(0, 10, (n,)).astype("int32")
    teacher, student = convnet("teacher", 64), convnet("student", 16)
    teacher.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    model = Distiller(student, teacher)
    model.compile(optimizer=keras.optimizers.Adam(),
                  metrics=[keras.metrics.SparseCategoricalAccuracy()],
                  student_loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  distillation_loss_fn=keras.losses.KLDivergence(), alpha=0.1, temperature=10)
    return model, lambda: model.fit(x, y, batch_size=64, epochs=2, verbose=0)


def collaborative(scale: float = 1.0):
    import keras
    from keras import layers, ops

    class RecommenderNet(keras.Model):
        def __init__(self, num_users, num_movies, embedding_size, **kwargs):
            super().__init__(**kwargs)
            self.user_embedding = layers.Embedding(
                num_users, embedding_size, embeddings_initializer="he_normal",
                embeddings_regularizer=keras.regularizers.l2(1e-6))
            self.user_bias = layers.Embedding(num_users, 1)
            self.movie_embedding = layers.Embedding(
                num_movies, embedding_size, embeddings_initializer="he_normal",
                embeddings_regularizer=keras.regularizers.l2(1e-6))
            self.movie_bias = layers.Embedding(num_movies, 1)

        def call(self, inputs):
            user_vector = self.user_embedding(inputs[:, 0])
            user_bias = self.user_bias(inputs[:, 0])
            movie_vector = self.movie_embedding(inputs[:, 1])
            movie_bias = self.movie_bias(inputs[:, 1])
            dot_user_movie = ops.tensordot(user_vector, movie_vector, 2)
            x = dot_user_movie + user_bias + movie_bias
            return ops.nn.sigmoid(x)

    rng = _rng()
    users, movies, n = 610, 9724, _n(90_000, scale)
    x = ops.convert_to_numpy(ops.stack([rng.integers(0, users, n), rng.integers(0, movies, n)],
                                       axis=1)).astype("int64")
    y = rng.random((n, 1)).astype("float32")
    model = RecommenderNet(users, movies, 50, name="collaborative")
    model.compile(loss=keras.losses.BinaryCrossentropy(),
                  optimizer=keras.optimizers.Adam(learning_rate=0.001))
    return model, lambda: model.fit(x, y, batch_size=64, epochs=2, verbose=0)


def multi_io(scale: float = 1.0):
    import keras
    from keras import layers

    num_tags, num_words, num_departments = 12, 10000, 4
    title_input = keras.Input(shape=(None,), name="title")
    body_input = keras.Input(shape=(None,), name="body")
    tags_input = keras.Input(shape=(num_tags,), name="tags")
    title_features = layers.Embedding(num_words, 64)(title_input)
    body_features = layers.Embedding(num_words, 64)(body_input)
    title_features = layers.LSTM(128)(title_features)
    body_features = layers.LSTM(32)(body_features)
    x = layers.concatenate([title_features, body_features, tags_input])
    priority_pred = layers.Dense(1, name="priority")(x)
    department_pred = layers.Dense(num_departments, name="department")(x)
    model = keras.Model(inputs=[title_input, body_input, tags_input],
                        outputs={"priority": priority_pred, "department": department_pred},
                        name="multi_io")
    model.compile(optimizer=keras.optimizers.RMSprop(1e-3),
                  loss={"priority": keras.losses.BinaryCrossentropy(from_logits=True),
                        "department": keras.losses.CategoricalCrossentropy(from_logits=True)},
                  loss_weights={"priority": 1.0, "department": 0.2})
    rng = _rng()
    n = _n(1280, scale)
    title = rng.integers(num_words, size=(n, 10))
    body = rng.integers(num_words, size=(n, 100))
    tags = rng.integers(2, size=(n, num_tags)).astype("float32")
    priority = rng.random(size=(n, 1)).astype("float32")
    department = rng.integers(2, size=(n, num_departments)).astype("float32")
    return model, lambda: model.fit(
        {"title": title, "body": body, "tags": tags},
        {"priority": priority, "department": department}, epochs=2, batch_size=32, verbose=0)


def structured(scale: float = 1.0):
    import keras
    import numpy as np
    import tensorflow as tf
    from keras import layers

    rng = _rng()
    n = _n(303 * 8, scale)
    frame = {
        "sex": rng.integers(0, 2, n), "cp": rng.integers(0, 5, n),
        "fbs": rng.integers(0, 2, n), "restecg": rng.integers(0, 3, n),
        "exang": rng.integers(0, 2, n), "ca": rng.integers(0, 4, n),
        "thal": rng.choice(np.array(["fixed", "normal", "reversible"]), n),
        "age": rng.integers(29, 78, n), "trestbps": rng.integers(94, 201, n),
        "chol": rng.integers(126, 565, n), "thalach": rng.integers(71, 203, n),
        "oldpeak": rng.random(n) * 6.2, "slope": rng.integers(0, 3, n)}
    target = rng.integers(0, 2, n)
    ds = tf.data.Dataset.from_tensor_slices((frame, target)).shuffle(n, seed=0).batch(32)
    ints = ["sex", "cp", "fbs", "restecg", "exang", "ca"]
    numeric = ["age", "trestbps", "chol", "thalach", "oldpeak", "slope"]
    inputs, encoded = {}, []
    for name in ints:
        inputs[name] = keras.Input(shape=(1,), name=name, dtype="int64")
        lookup = layers.IntegerLookup(output_mode="one_hot")
        lookup.adapt(ds.map(lambda x, y, name=name: x[name]))
        encoded.append(lookup(inputs[name]))
    inputs["thal"] = keras.Input(shape=(1,), name="thal", dtype="string")
    lookup = layers.StringLookup(output_mode="one_hot")
    lookup.adapt(ds.map(lambda x, y: x["thal"]))
    encoded.append(lookup(inputs["thal"]))
    # Keras's mixed policies fail in Normalization.adapt on a dataset ("expected
    # to be a float tensor but is a bfloat16 tensor"): there a user writes
    # dtype="float32", as done here (keras-mp adapts in float32 by itself).
    keras_mixed = keras.mixed_precision.global_policy().name.startswith("mixed_")
    for name in numeric:
        inputs[name] = keras.Input(shape=(1,), name=name)
        norm = layers.Normalization(dtype="float32" if keras_mixed else None)
        norm.adapt(ds.map(lambda x, y, name=name: tf.expand_dims(
            tf.cast(x[name], "float32"), -1)))
        encoded.append(norm(inputs[name]))
    x = layers.concatenate(encoded)
    x = layers.Dense(32, activation="relu")(x)
    x = layers.Dropout(0.5)(x)
    model = keras.Model(inputs, layers.Dense(1, activation="sigmoid")(x), name="structured")
    model.compile("adam", "binary_crossentropy", metrics=["accuracy"])
    train = ds.map(lambda x, y: ({k: tf.expand_dims(v, -1) for k, v in x.items()}, y))
    return model, lambda: model.fit(train, epochs=10, verbose=0)


def seq2seq(scale: float = 1.0):
    import keras
    import numpy as np

    num_encoder_tokens, num_decoder_tokens, latent_dim = 71, 93, 256
    encoder_inputs = keras.Input(shape=(None, num_encoder_tokens))
    _, state_h, state_c = keras.layers.LSTM(latent_dim, return_state=True)(encoder_inputs)
    decoder_inputs = keras.Input(shape=(None, num_decoder_tokens))
    decoder_outputs, _, _ = keras.layers.LSTM(latent_dim, return_sequences=True,
                                              return_state=True)(
        decoder_inputs, initial_state=[state_h, state_c])
    decoder_outputs = keras.layers.Dense(num_decoder_tokens, activation="softmax")(
        decoder_outputs)
    model = keras.Model([encoder_inputs, decoder_inputs], decoder_outputs, name="seq2seq")
    model.compile(optimizer="rmsprop", loss="categorical_crossentropy", metrics=["accuracy"])
    rng = _rng()
    n = _n(1600, scale)
    eye_in, eye_out = np.eye(num_encoder_tokens, dtype="float32"), \
        np.eye(num_decoder_tokens, dtype="float32")
    enc = eye_in[rng.integers(0, num_encoder_tokens, (n, 16))]
    dec_tokens = rng.integers(0, num_decoder_tokens, (n, 24))
    dec = eye_out[dec_tokens]
    target = eye_out[np.roll(dec_tokens, -1, axis=1)]
    return model, lambda: model.fit([enc, dec], target, batch_size=64, epochs=2,
                                    validation_split=0.2, verbose=0)


def ts_transformer(scale: float = 1.0):
    import keras
    from keras import layers

    def encoder(inputs, head_size, num_heads, ff_dim, dropout=0):
        x = layers.MultiHeadAttention(key_dim=head_size, num_heads=num_heads,
                                      dropout=dropout)(inputs, inputs)
        x = layers.Dropout(dropout)(x)
        x = layers.LayerNormalization(epsilon=1e-6)(x)
        res = x + inputs
        x = layers.Conv1D(filters=ff_dim, kernel_size=1, activation="relu")(res)
        x = layers.Dropout(dropout)(x)
        x = layers.Conv1D(filters=inputs.shape[-1], kernel_size=1)(x)
        x = layers.LayerNormalization(epsilon=1e-6)(x)
        return x + res

    timesteps = 128
    inputs = keras.Input(shape=(timesteps, 1))
    x = inputs
    for _ in range(4):
        x = encoder(x, head_size=256, num_heads=4, ff_dim=4, dropout=0.25)
    x = layers.GlobalAveragePooling1D(data_format="channels_last")(x)
    x = layers.Dense(128, activation="relu")(x)
    x = layers.Dropout(0.4)(x)
    model = keras.Model(inputs, layers.Dense(2, activation="softmax")(x), name="ts_transformer")
    model.compile(loss="sparse_categorical_crossentropy",
                  optimizer=keras.optimizers.Adam(learning_rate=1e-4),
                  metrics=["sparse_categorical_accuracy"])
    rng = _rng()
    n = _n(1024, scale)
    x = rng.normal(size=(n, timesteps, 1)).astype("float32")
    y = rng.integers(0, 2, (n,)).astype("int32")
    return model, lambda: model.fit(x, y, validation_split=0.2, epochs=2, batch_size=64,
                                    verbose=0)


def ts_fcn(scale: float = 1.0):
    import keras

    timesteps = 500
    input_layer = keras.layers.Input((timesteps, 1))
    x = input_layer
    for _ in range(3):
        x = keras.layers.Conv1D(filters=64, kernel_size=3, padding="same")(x)
        x = keras.layers.BatchNormalization()(x)
        x = keras.layers.ReLU()(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    output_layer = keras.layers.Dense(2, activation="softmax")(x)
    model = keras.Model(input_layer, output_layer, name="ts_fcn")
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                  metrics=["sparse_categorical_accuracy"])
    rng = _rng()
    n = _n(3601 // 2, scale)
    x = rng.normal(size=(n, timesteps, 1)).astype("float32")
    y = rng.integers(0, 2, (n,)).astype("int32")
    return model, lambda: model.fit(x, y, batch_size=32, epochs=3, validation_split=0.2,
                                    verbose=0)


def xception_downsampling(x, entry: int, widths):
    """keras.io's Xception-style entry and downsampling blocks (the U-Net's
    encoder, and image_classification_from_scratch's body): a strided
    ``Conv2D(entry)``, then per width two ``SeparableConv2D`` with
    ``BatchNormalization``, a strided ``MaxPooling2D`` and a strided 1x1
    ``Conv2D`` residual."""
    from keras import layers

    x = layers.Conv2D(entry, 3, strides=2, padding="same")(x)
    x = layers.BatchNormalization()(x)
    x = layers.Activation("relu")(x)
    previous = x
    for width in widths:
        x = layers.Activation("relu")(x)
        x = layers.SeparableConv2D(width, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)
        x = layers.Activation("relu")(x)
        x = layers.SeparableConv2D(width, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)
        x = layers.MaxPooling2D(3, strides=2, padding="same")(x)
        residual = layers.Conv2D(width, 1, strides=2, padding="same")(previous)
        x = layers.add([x, residual])
        previous = x
    return x


def unet(scale: float = 1.0):
    import keras
    from keras import layers

    size, num_classes = 64, 3
    inputs = keras.Input(shape=(size, size, 3))
    x = xception_downsampling(inputs, 32, [64, 128, 256])
    previous_block_activation = x
    for filters in [256, 128, 64, 32]:
        x = layers.Activation("relu")(x)
        x = layers.Conv2DTranspose(filters, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)
        x = layers.Activation("relu")(x)
        x = layers.Conv2DTranspose(filters, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)
        x = layers.UpSampling2D(2)(x)
        residual = layers.UpSampling2D(2)(previous_block_activation)
        residual = layers.Conv2D(filters, 1, padding="same")(residual)
        x = layers.add([x, residual])
        previous_block_activation = x
    outputs = layers.Conv2D(num_classes, 3, activation="softmax", padding="same")(x)
    model = keras.Model(inputs, outputs, name="unet")
    model.compile(optimizer=keras.optimizers.Adam(1e-4),
                  loss="sparse_categorical_crossentropy")
    rng = _rng()
    n = _n(512, scale)
    x = rng.random((n, size, size, 3)).astype("float32")
    y = rng.integers(0, num_classes, (n, size, size, 1)).astype("int32")
    return model, lambda: model.fit(x, y, batch_size=32, epochs=2, verbose=0)


#: name -> builder(scale) returning ``(model, fit)``.
BUILDERS: dict[str, Callable[..., tuple[Any, Callable[[], Any]]]] = {
    "distillation": distillation, "collaborative": collaborative, "multi_io": multi_io,
    "structured": structured, "seq2seq": seq2seq, "ts_transformer": ts_transformer,
    "ts_fcn": ts_fcn, "unet": unet}


def build(name: str, scale: float = 1.0):
    """The example ``name`` (one of :data:`BUILDERS`) at ``scale`` of its
    shrunk data, built under the global policy: ``(model, fit)``."""
    if name not in BUILDERS:
        raise ValueError(f"`name` must be one of {sorted(BUILDERS)}, got {name!r}.")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale <= 100:
        raise ValueError(f"`scale` must be a number in (0, 100], got {scale!r}.")
    return BUILDERS[name](float(scale))
