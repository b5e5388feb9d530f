"""keras_mp.fuse(model, inplace=True): layers inside subclassed models and
inside other layers (KerasHub's decoder blocks) change class where a fused
kernel runs, outputs stay equal, training and .keras files work."""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mp
from keras_mp.fused import layers as klayers
from keras_mp.fused.fuse import fuse


class Block(keras.layers.Layer):
    """A custom layer holding Keras layers (as KerasHub's blocks do)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.norm = keras.layers.LayerNormalization()
        self.up = keras.layers.Dense(16, activation="gelu")
        self.down = keras.layers.Dense(8)
        self.other = keras.layers.Dense(8, activation="softplus")  # no fused kernel
        self.softmax = keras.layers.Softmax()

    def call(self, x):
        h = self.down(self.up(self.norm(x)))
        return self.softmax(h + self.other(x))


class Net(keras.Model):
    def __init__(self):
        super().__init__()
        self.block = Block()
        self.head = keras.layers.Dense(3)

    def call(self, x):
        return self.head(self.block(x))


def _x():
    return np.random.default_rng(0).normal(size=(4, 8)).astype("float32")


def test_inplace_reaches_layers_inside_layers_of_a_subclassed_model():
    net = Net()
    before = np.asarray(net(_x()))
    assert fuse(net, inplace=True) is net
    b = net.block
    assert type(b.norm) is klayers.LayerNormalization and b.norm.fused
    assert type(b.up) is klayers.Dense and type(b.down) is klayers.Dense
    assert type(b.softmax) is klayers.Softmax and type(net.head) is klayers.Dense
    assert type(b.other) is keras.layers.Dense  # softplus: Keras's code, Keras's class
    np.testing.assert_allclose(net(_x()), before, atol=1e-5)
    net.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(True))
    loss = net.fit(_x(), np.array([0, 1, 2, 0]), epochs=3, verbose=0).history["loss"]
    assert loss[-1] < loss[0]
    with pytest.raises(TypeError, match="`inplace`"):
        fuse(net, inplace="yes")
    with pytest.raises(TypeError, match="inplace=True"):
        fuse(Net())  # a copy needs a functional or Sequential model


def test_batch_normalization_after_convolutions_is_fused_in_place(tmp_path):
    keras_mp.set_global_policy("mixed_bfloat16")
    try:
        inp = keras.Input((8, 8, 3))
        h = keras.layers.BatchNormalization()(keras.layers.Conv2D(4, 3)(inp))
        h = keras.layers.Dense(5)(keras.layers.GlobalAveragePooling2D()(h))
        out = keras.layers.BatchNormalization()(h)  # 2-D: Keras's code, Keras's class
        model = keras.Model(inp, out)
    finally:
        keras_mp.set_global_policy("float32")
    x = np.random.default_rng(0).normal(size=(6, 8, 8, 3)).astype("float32")
    before = [np.asarray(model(x, training=False), "float32")]
    fuse(model, inplace=True)
    convolved, flat = [layer for layer in model.layers
                       if isinstance(layer, keras.layers.BatchNormalization)]
    assert type(convolved) is klayers.BatchNormalization and convolved.fused
    assert type(flat) is keras.layers.BatchNormalization
    np.testing.assert_allclose(np.asarray(model(x, training=False), "float32"), before[0],
                               rtol=3e-2, atol=3e-2)
    model.compile(optimizer="adam", loss="mse")
    model.fit(x, np.zeros((6, 5), "float32"), epochs=1, verbose=0)
    path = str(tmp_path / "bn.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert type(loaded.layers[2]) is klayers.BatchNormalization
    expected = np.asarray(model(x), "float32")
    np.testing.assert_allclose(np.asarray(loaded(x), "float32"), expected, rtol=1e-6, atol=1e-6)
    export = str(tmp_path / "bn_export")
    model.export(export, format="tf_saved_model", verbose=False)
    reloaded = tf.saved_model.load(export)  # held: its variables live as long as it
    served = reloaded.serve(tf.constant(x))
    # Grappler may fold the normalization into the convolution there: bfloat16 rounding.
    np.testing.assert_allclose(np.asarray(tf.cast(served, tf.float32)), expected,
                               rtol=3e-2, atol=3e-2)
    model.quantize("int8")  # the Dense head; the fused normalization stays as it is
    assert np.isfinite(np.asarray(model(x), "float32")).all()


def test_a_model_without_fused_kernels_stays_keras_only():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, activation="softplus")])
    fuse(model, inplace=True)
    assert "keras_mp" not in json.dumps(model.get_config())  # loads with Keras alone


def _tiny_gpt2():
    """A 1-block KerasHub GPT-2 under mixed_bfloat16, and a batch of its data."""
    keras_hub = pytest.importorskip("keras_hub")
    keras_mp.set_global_policy("mixed_bfloat16")
    try:
        backbone = keras_hub.models.GPT2Backbone(vocabulary_size=64, num_layers=1, num_heads=2,
                                                 hidden_dim=16, intermediate_dim=32,
                                                 max_sequence_length=8)
        lm = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    finally:
        keras_mp.set_global_policy("float32")
    tokens = np.random.default_rng(0).integers(0, 64, (2, 8)).astype("int32")
    return lm, backbone, {"token_ids": tokens, "padding_mask": np.ones((2, 8), "int32")}, tokens


def test_kerashub_gpt2_fused_in_place_exports_and_quantizes(tmp_path):
    """Keras binds a layer's quantize method when the layer is built, to
    Keras's class, which refuses other classes: a layer fused in place is
    still quantized (keras_mp.deploy.quantization)."""
    import tensorflow as tf

    lm, backbone, x, tokens = _tiny_gpt2()
    fuse(lm, inplace=True)
    lm.compile(optimizer="adam",
               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    lm.fit(x, tokens, epochs=1, verbose=0)
    expected = np.asarray(lm.predict(x, verbose=0), "float32")
    lm.export(str(tmp_path / "sm"), verbose=False)
    loaded = tf.saved_model.load(str(tmp_path / "sm"))
    served = loaded.serve({k: tf.constant(v) for k, v in x.items()})
    np.testing.assert_allclose(np.asarray(tf.cast(served, tf.float32)), expected, atol=1e-2)
    lm.quantize("int8")
    assert backbone.token_embedding.quantization_mode == "int8"
    ffn = backbone.transformer_layers[0]._feedforward_intermediate_dense
    assert type(ffn) is klayers.Dense and ffn.quantization_mode == "int8"
    np.testing.assert_allclose(np.asarray(lm.predict(x, verbose=0), "float32"), expected,
                               atol=0.5)   # int8 weights


def test_kerashub_gpt2_blocks_are_fused_in_place(tmp_path):
    lm, backbone, x, tokens = _tiny_gpt2()
    before = lm.predict(x, verbose=0)
    fuse(lm, inplace=True)
    decoder = backbone.transformer_layers[0]
    ffn = decoder._feedforward_intermediate_dense
    assert type(ffn) is klayers.Dense and ffn.fused  # GPT-2's tanh GELU has a kernel
    assert type(decoder._self_attention_layer_norm) is klayers.LayerNormalization
    assert type(decoder._self_attention_layer._softmax) is klayers.Softmax  # causal mask
    # The tied logits run in bfloat16 (Keras's run in float32) and come out so.
    assert type(backbone.token_embedding) is klayers.ReversibleEmbedding
    after = lm.predict(x, verbose=0)
    assert after.dtype.name == "bfloat16" and before.dtype.name == "float32"
    after = np.asarray(after, "float32")
    np.testing.assert_allclose(after, np.asarray(before, "float32"), atol=0.1, rtol=0.05)
    lm.compile(optimizer=keras.optimizers.Adam(1e-3),
               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    lm.fit(x, tokens, epochs=1, verbose=0)
    # KerasHub rebuilds its blocks from their constructor arguments: the file's
    # configs name no keras_mp class (Keras alone loads it, unfused), and its
    # keras_mp_fused entry gives the blocks' layers their fused class again
    # on a load with keras_mp imported (keras_mp.fused.saved).
    path = str(tmp_path / "gpt2.keras")
    lm.save(path)
    assert "keras_mp" not in json.dumps(lm.get_config())
    loaded = keras.models.load_model(path)
    inner = loaded.backbone.transformer_layers[0]._feedforward_intermediate_dense
    assert type(inner) is klayers.Dense
    expected = np.asarray(lm.predict(x, verbose=0), "float32")
    np.testing.assert_array_equal(np.asarray(loaded.predict(x, verbose=0), "float32"), expected)
