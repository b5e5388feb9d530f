"""Real models, built from their configs with random weights (nothing is
downloaded), at sizes a 2-core CI machine trains in seconds, with a
learnable task each.

keras.applications: ``ResNet50V2``, ``EfficientNetB0``, ``MobileNetV3Small``,
``ConvNeXtTiny`` (LayerScale) and ``DenseNet121`` on 32x32 images (the
smallest input they accept) of 4 classes, the class a bright quadrant of the
image (pixels in [0, 255], as the models expect: EfficientNet, MobileNetV3
and ConvNeXt rescale inside the model, ResNet50V2 and DenseNet121 do not).

KerasHub: causal LMs over 2-layer backbones (vocabulary 64, hidden 16) on
sequences that count up modulo the vocabulary: ``GPT2CausalLM``,
``LlamaCausalLM`` (RMSNorm, rotary embeddings, a gated MLP, grouped-query
attention) and ``GemmaCausalLM`` in Gemma 2's configuration (post-attention
and post-feed-forward norms, attention and final logit soft-capping, sliding
windows); a ``BartSeq2SeqLM`` encoder-decoder that continues the count it
reads; a ``BertTextClassifier`` of 3 classes, the class the first token
modulo 3; a ``ViTImageClassifier`` on the images above, scaled to [0, 1].
All with ``preprocessor=None`` and token-id (or image) inputs.

keras-io-style (tests/real_models/keras_io.py): ``CustomTrainStep`` (a
model with its own ``train_step`` and ``tf.GradientTape``), ``VAE``
(reconstruction and KL losses, its own ``train_step``) and
``TransformerBlock`` (a subclassed Transformer block in a token classifier).
"""

from __future__ import annotations

import numpy as np

#: name -> family ("applications", "hub" or "keras_io").
MODELS = {"ResNet50V2": "applications", "EfficientNetB0": "applications",
          "MobileNetV3Small": "applications", "GPT2CausalLM": "hub",
          "BertTextClassifier": "hub", "LlamaCausalLM": "hub", "GemmaCausalLM": "hub",
          "BartSeq2SeqLM": "hub", "ViTImageClassifier": "hub",
          "ConvNeXtTiny": "applications", "DenseNet121": "applications",
          "CustomTrainStep": "keras_io", "VAE": "keras_io", "TransformerBlock": "keras_io"}
#: name -> task (what :func:`data` makes), where it is not the family's.
TASKS = {"BertTextClassifier": "first_token", "TransformerBlock": "first_token",
         "BartSeq2SeqLM": "seq2seq", "ViTImageClassifier": "images",
         "CustomTrainStep": "vectors", "VAE": "autoencode"}
_FAMILY_TASK = {"applications": "images", "hub": "count"}
ROWS, BATCH = 64, 16
IMAGE, CLASSES = 32, 4
VOCAB, LENGTH = 64, 16
FEATURES, VAE_SIZE = 16, 16
#: EfficientNetB0 at 1e-3: loss 9.4, 4.8, 2.6, 3.8 over 4 epochs in float32 too.
#: The KerasHub models at 3e-4 moved their loss by 0.02 in 12 steps.
LEARNING_RATE = {"applications": 3e-4, "hub": 1e-3, "keras_io": 1e-3}
#: Models whose outputs are logits (the others end in a softmax, or have their
#: own loss).
LOGITS = {"hub", "CustomTrainStep"}
EPOCHS = 3
#: Models ``keras_mp.fuse`` cannot copy, fused in place instead (on a copy
#: loaded from a ``.keras`` file): a subclassed model (the copy takes
#: functional and Sequential models), and those ``keras.models.clone_model``
#: cannot copy (KerasHub 0.32: a layer's ``get_config`` fails or its
#: ``from_config`` refuses what it wrote).
FUSED_IN_PLACE = {
    "VAE": "a subclassed model",
    "LlamaCausalLM": "LlamaTransformerDecoder.get_config: AttributeError "
                     "'rope_scaling_factor'",
    "ViTImageClassifier": "ViTPatchingAndEmbedding.from_config: unrecognized keyword "
                          "arguments (its get_config writes more than __init__ takes)"}
#: Models that need more epochs (4 steps each) under a policy. EfficientNetB0's
#: float16 gradients overflow until the loss scale has halved from 2**15 down to
#: 2**0, one skipped step each (Keras's mixed_float16 loses the same epochs:
#: losses 6.31, 6.55, 6.97, 5.75, then 6.8, 5.7, 3.2, 3.0, down to 1.7 by epoch 15).
MORE_EPOCHS = {("EfficientNetB0", "adaptive_float16"): 8}


def task(name: str) -> str:
    """What ``name`` learns (the kind of data :func:`data` makes)."""
    return TASKS.get(name) or _FAMILY_TASK[MODELS[name]]


def epochs(name: str, policy: str) -> int:
    """Epochs of ``name``'s fit under ``policy``."""
    return MORE_EPOCHS.get((name, policy), EPOCHS)


def from_logits(name: str) -> bool:
    return name in LOGITS or MODELS[name] in LOGITS


def compile_model(model, name: str) -> None:
    """Compiles ``model`` for ``name``'s task: Adam and sparse categorical
    cross-entropy (the VAE: Adam alone, its ``train_step`` has its losses)."""
    import keras

    loss = None if name == "VAE" else keras.losses.SparseCategoricalCrossentropy(
        from_logits=from_logits(name))
    model.compile(optimizer=keras.optimizers.Adam(LEARNING_RATE[MODELS[name]]), loss=loss)


def build(name: str, policy: str):
    """``name`` built under the global ``policy``, compiled for its task."""
    import keras_mp
    from keras_mp.adaptive.fit import autofit

    # Shrunk to train in seconds, these fits could not repay adaptation; at the
    # models' real sizes they can, so fit adapts them as it would those.
    autofit.set_min_saving(0)
    keras_mp.set_global_policy(policy)
    try:
        model = _build(name)
    finally:
        keras_mp.set_global_policy("float32")
    compile_model(model, name)
    return model


def _build(name: str):
    import keras

    family = MODELS[name]
    if family == "applications":
        return getattr(keras.applications, name)(
            weights=None, input_shape=(IMAGE, IMAGE, 3), classes=CLASSES)
    if family == "keras_io":
        from tests.real_models import keras_io

        if name == "CustomTrainStep":
            return keras_io.custom_step_classifier(FEATURES, CLASSES)
        if name == "VAE":
            return keras_io.VAE(VAE_SIZE)
        return keras_io.transformer_classifier(LENGTH, VOCAB, 3)
    import keras_hub

    hub = keras_hub.models
    small = dict(vocabulary_size=VOCAB, num_layers=2, hidden_dim=16, intermediate_dim=32)
    if name == "GPT2CausalLM":
        backbone = hub.GPT2Backbone(num_heads=2, max_sequence_length=LENGTH, **small)
        return hub.GPT2CausalLM(backbone=backbone, preprocessor=None)
    if name == "LlamaCausalLM":
        backbone = hub.LlamaBackbone(num_query_heads=2, num_key_value_heads=1, **small)
        return hub.LlamaCausalLM(backbone=backbone, preprocessor=None)
    if name == "GemmaCausalLM":   # Gemma 2's configuration
        backbone = hub.GemmaBackbone(
            num_query_heads=2, num_key_value_heads=1, head_dim=8, use_post_ffw_norm=True,
            use_post_attention_norm=True, attention_logit_soft_cap=50.0,
            final_logit_soft_cap=30.0, use_sliding_window_attention=True,
            sliding_window_size=8, **small)
        return hub.GemmaCausalLM(backbone=backbone, preprocessor=None)
    if name == "BartSeq2SeqLM":
        backbone = hub.BartBackbone(num_heads=2, max_sequence_length=LENGTH, **small)
        return hub.BartSeq2SeqLM(backbone=backbone, preprocessor=None)
    if name == "ViTImageClassifier":
        backbone = hub.ViTBackbone(image_shape=(IMAGE, IMAGE, 3), patch_size=8, num_layers=2,
                                   num_heads=2, hidden_dim=16, mlp_dim=32)
        return hub.ViTImageClassifier(backbone=backbone, num_classes=CLASSES)
    backbone = hub.BertBackbone(num_heads=2, max_sequence_length=LENGTH, **small)
    return hub.BertTextClassifier(backbone=backbone, num_classes=3, preprocessor=None)


def data(name: str, rows: int = ROWS, seed: int = 0):
    """``(x, y)`` for ``name``'s task."""
    rng = np.random.default_rng(seed)
    kind = task(name)
    if kind == "images":
        y = rng.integers(0, CLASSES, size=rows)
        x = rng.uniform(0, 128, size=(rows, IMAGE, IMAGE, 3)).astype("float32")
        half = IMAGE // 2
        for i, c in enumerate(y):
            r, col = divmod(int(c), 2)
            x[i, r * half:(r + 1) * half, col * half:(col + 1) * half] += 127.0
        return (x / 255 if MODELS[name] == "hub" else x), y.astype("int32")
    if kind == "vectors":
        x = rng.normal(size=(rows, FEATURES)).astype("float32")
        return x, x[:, :CLASSES].argmax(-1).astype("int32")
    if kind == "autoencode":   # blobs: a bright square somewhere, in [0, 1]
        x = np.zeros((rows, VAE_SIZE, VAE_SIZE, 1), "float32")
        for i, (r, c) in enumerate(rng.integers(0, VAE_SIZE - 6, size=(rows, 2))):
            x[i, r:r + 6, c:c + 6] = 1.0
        return x, x
    start = rng.integers(0, VOCAB, size=(rows, 1))
    ids = ((start + np.arange(2 * LENGTH + 1)) % VOCAB).astype("int32")
    mask = np.ones((rows, LENGTH), "int32")
    if kind == "count":
        return {"token_ids": ids[:, :LENGTH], "padding_mask": mask}, ids[:, 1:LENGTH + 1]
    if kind == "seq2seq":   # read a count, write what follows
        return {"encoder_token_ids": ids[:, :LENGTH], "encoder_padding_mask": mask,
                "decoder_token_ids": ids[:, LENGTH:2 * LENGTH],
                "decoder_padding_mask": mask}, ids[:, LENGTH + 1:]
    ids = rng.integers(0, VOCAB, size=(rows, LENGTH)).astype("int32")
    y = (ids[:, 0] % 3).astype("int32")
    if name == "TransformerBlock":
        return ids, y
    return {"token_ids": ids, "segment_ids": np.zeros_like(ids), "padding_mask": mask}, y


def rows(x, n: int):
    """The first ``n`` rows of ``x`` (an array or a dict of arrays)."""
    if isinstance(x, dict):
        return {k: v[:n] for k, v in x.items()}
    return x[:n]
