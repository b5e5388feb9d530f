"""KerasHub's T5 in float16, fit under Keras's ``mixed_float16`` (one epoch),
float32 and ``"adaptive_float16"`` (each :data:`EPOCHS` epochs, seeded, the
train step as a TensorFlow graph); writes what tests/test_made_nonfinite.py
checks to ``FOLDER/result.json``.

Run: ``python tests/made_nonfinite/t5.py FOLDER``
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import keras
import numpy as np

import keras_mp
from keras_mp.adaptive.fit import autofit

EPOCHS, BATCH, N, T = 4, 16, 256, 8


def fit(policy: str, epochs: int):
    if policy.startswith("adaptive"):
        keras_mp.set_global_policy(policy)
    else:
        keras.mixed_precision.set_global_policy(policy)
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.T5Backbone(
        vocabulary_size=512, num_layers=2, num_heads=4, hidden_dim=128, intermediate_dim=256,
        key_value_dim=32, activation="gelu")
    model = keras_hub.models.T5Seq2SeqLM(backbone=backbone, preprocessor=None)
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    tokens = rng.integers(2, 512, size=(N, T)).astype("int32")  # the copy task
    x = {"encoder_token_ids": tokens, "encoder_padding_mask": np.ones((N, T), bool),
         "decoder_token_ids": np.concatenate([np.zeros((N, 1), "int32"), tokens[:, :-1]], 1),
         "decoder_padding_mask": np.ones((N, T), bool)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        history = model.fit(x, tokens, batch_size=BATCH, epochs=epochs, verbose=0)
    return model, [float(v) for v in history.history["loss"]]


def main(folder: str) -> None:
    autofit.set_min_saving(0)   # adapted as a fit large enough to gain is
    _, keras_loss = fit("mixed_float16", 1)
    _, float32_loss = fit("float32", EPOCHS)
    model, loss = fit("adaptive_float16", EPOCHS)
    cb = autofit.callback_of(model)
    result = {
        "keras_loss": keras_loss, "float32_loss": float32_loss, "loss": loss,
        "events": [{"layer": e["layer"], "reason": e["reason"], "step": int(e["step"])}
                   for e in cb.events],
        "query_dtype": keras_mp.policies.policy_of(model).dtype_of(
            "transformer_encoder_layer_0/self_attention/query_projector"),
    }
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "result.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
