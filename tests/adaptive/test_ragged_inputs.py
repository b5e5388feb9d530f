"""Ragged inputs under adaptation: an ``Embedding`` of ragged ids returns a
``tf.RaggedTensor``, whose values the forward statistics read (Keras's own
``layers/core/embedding_test.py::EmbeddingTest::test_ragged`` crashed keras-mp's
statistics step: a ragged tensor handed to a kernel traced for dense ones)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mp
from keras_mp.adaptive.fit.callback import AdaptivePrecision

pytestmark = pytest.mark.usefixtures("adapt_every_fit")


@pytest.mark.parametrize("policy", ["adaptive_bfloat16", "adaptive_float16"])
def test_an_embedding_of_ragged_ids_trains_with_statistics_and_probe(policy):
    with keras_mp.policy_scope(policy):
        ids_in = keras.Input((None,), dtype="int32", ragged=True)
        h = keras.layers.Embedding(8, 4, name="table")(ids_in)
        h = keras.layers.Lambda(lambda t: tf.reduce_mean(t, axis=1), output_shape=(4,))(h)
        model = keras.Model(ids_in, keras.layers.Dense(1, name="head")(h))
    model.compile(optimizer="adam", loss="mse")
    ids = tf.ragged.constant([[1, 2, 3], [4], [5, 6], [7, 1, 2, 3]] * 4)
    history = model.fit(ids, np.ones((16, 1), "float32"), batch_size=4, epochs=2, verbose=0,
                        callbacks=[AdaptivePrecision(statistics_every=1, probe_every=2)])
    assert np.isfinite(history.history["loss"]).all()
    rows = {r["layer"]: r for r in keras_mp.precision_report(model).to_dict()["layers"]}
    table = rows["table"]
    assert table["measured"]["forward"] and table["measured"]["probe"], table
    assert table["stats"]["out_amax"] > 0
