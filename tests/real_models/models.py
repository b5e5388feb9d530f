"""Real models, built from their configs with random weights (nothing is
downloaded), at sizes a 2-core CI machine trains in seconds, with a
learnable task each.

keras.applications: ``ResNet50V2``, ``EfficientNetB0``, ``MobileNetV3Small``
on 32x32 images (the smallest input they accept) of 4 classes, the class a
bright quadrant of the image (pixels in [0, 255], as the models expect:
EfficientNet and MobileNetV3 rescale inside the model, ResNet50V2 does not).

KerasHub: a ``GPT2CausalLM`` over a 2-layer ``GPT2Backbone`` (vocabulary
64, hidden 16) on sequences that count up modulo the vocabulary, and a
``BertTextClassifier`` over a 2-layer ``BertBackbone`` of 3 classes, the
class the first token modulo 3; both with ``preprocessor=None`` and token-id
inputs.
"""

from __future__ import annotations

import numpy as np

#: name -> family ("applications" or "hub").
MODELS = {"ResNet50V2": "applications", "EfficientNetB0": "applications",
          "MobileNetV3Small": "applications", "GPT2CausalLM": "hub",
          "BertTextClassifier": "hub"}
ROWS, BATCH = 64, 16
IMAGE, CLASSES = 32, 4
VOCAB, LENGTH = 64, 16
#: EfficientNetB0 at 1e-3: loss 9.4, 4.8, 2.6, 3.8 over 4 epochs in float32 too.
#: The KerasHub models at 3e-4 moved their loss by 0.02 in 12 steps.
LEARNING_RATE = {"applications": 3e-4, "hub": 1e-3}
EPOCHS = 3
#: Models that need more epochs (4 steps each) under a policy. EfficientNetB0's
#: float16 gradients overflow until the loss scale has halved from 2**15 down to
#: 2**0, one skipped step each (Keras's mixed_float16 loses the same epochs:
#: losses 6.31, 6.55, 6.97, 5.75, then 6.8, 5.7, 3.2, 3.0, down to 1.7 by epoch 15).
MORE_EPOCHS = {("EfficientNetB0", "adaptive_float16"): 8}


def epochs(name: str, policy: str) -> int:
    """Epochs of ``name``'s fit under ``policy``."""
    return MORE_EPOCHS.get((name, policy), EPOCHS)


def build(name: str, policy: str):
    """``name`` built under the global ``policy``, compiled for its task
    (Adam, sparse categorical cross-entropy, from logits for KerasHub's)."""
    import keras

    import keras_mp

    keras_mp.set_global_policy(policy)
    try:
        model = _build(name)
    finally:
        keras_mp.set_global_policy("float32")
    model.compile(optimizer=keras.optimizers.Adam(LEARNING_RATE[MODELS[name]]),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=MODELS[name] == "hub"))
    return model


def _build(name: str):
    import keras

    if MODELS[name] == "applications":
        return getattr(keras.applications, name)(
            weights=None, input_shape=(IMAGE, IMAGE, 3), classes=CLASSES)
    import keras_hub

    if name == "GPT2CausalLM":
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=16,
            intermediate_dim=32, max_sequence_length=LENGTH)
        return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=16,
        intermediate_dim=32, max_sequence_length=LENGTH)
    return keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=3,
                                               preprocessor=None)


def data(name: str, rows: int = ROWS, seed: int = 0):
    """``(x, y)`` for ``name``'s task."""
    rng = np.random.default_rng(seed)
    if MODELS[name] == "applications":
        y = rng.integers(0, CLASSES, size=rows)
        x = rng.uniform(0, 128, size=(rows, IMAGE, IMAGE, 3)).astype("float32")
        half = IMAGE // 2
        for i, c in enumerate(y):
            r, col = divmod(int(c), 2)
            x[i, r * half:(r + 1) * half, col * half:(col + 1) * half] += 127.0
        return x, y.astype("int32")
    start = rng.integers(0, VOCAB, size=(rows, 1))
    ids = ((start + np.arange(LENGTH + 1)) % VOCAB).astype("int32")
    mask = np.ones((rows, LENGTH), "int32")
    if name == "GPT2CausalLM":
        return {"token_ids": ids[:, :-1], "padding_mask": mask}, ids[:, 1:]
    ids = rng.integers(0, VOCAB, size=(rows, LENGTH)).astype("int32")
    x = {"token_ids": ids, "segment_ids": np.zeros_like(ids), "padding_mask": mask}
    return x, (ids[:, 0] % 3).astype("int32")


def rows(x, n: int):
    """The first ``n`` rows of ``x`` (an array or a dict of arrays)."""
    if isinstance(x, dict):
        return {k: v[:n] for k, v in x.items()}
    return x[:n]
