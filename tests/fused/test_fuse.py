"""keras_mp.fuse: layers swapped, weights carried, outputs and training
equal to the original's, `.keras` save/load, and the errors it raises."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_mp.fused import layers as klayers
from keras_mp.fused.fuse import fuse

TOL = {"float32": 1e-5, "mixed_bfloat16": 5e-2}


def _block(policy: str) -> keras.Model:
    """A small Transformer-like functional model with a nested Sequential."""
    inp = keras.Input((6, 8))
    h = keras.layers.LayerNormalization(dtype=policy)(inp)
    h = keras.layers.Add(dtype=policy)(
        [h, keras.layers.MultiHeadAttention(2, 4, dtype=policy)(h, h)])
    scores = keras.layers.Dense(6, dtype=policy)(h)
    attn = keras.layers.Softmax(dtype=policy)(scores, mask=np.tril(np.ones((6, 6), bool)))
    h = keras.layers.Dense(8, dtype=policy)(attn)
    mlp = keras.Sequential([keras.layers.Dense(16, activation="gelu", dtype=policy),
                            keras.layers.Dense(8, activation="softplus", dtype=policy)])
    h = keras.layers.Add(dtype=policy)([h, mlp(h)])
    h = keras.layers.RMSNormalization(dtype=policy)(h)
    out = keras.layers.Dense(3, dtype="float32")(keras.layers.GlobalAveragePooling1D()(h))
    return keras.Model(inp, out)


def _x(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(4, 6, 8)).astype("float32")


def _all_layers(model: keras.Model):
    for layer in model.layers:
        yield layer
        if isinstance(layer, keras.Model):
            yield from _all_layers(layer)


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_fuse_swaps_supported_layers_and_preserves_outputs(policy):
    model = _block(policy)
    fused = fuse(model)
    kinds = {type(l) for l in _all_layers(fused)}
    assert {klayers.Dense, klayers.LayerNormalization, klayers.RMSNormalization,
            klayers.Softmax, klayers.MultiHeadAttention} <= kinds
    assert keras.layers.Dense not in kinds
    # The original is untouched and shares no variables with the copy.
    assert all(type(l).__module__.startswith("keras.") for l in _all_layers(model))
    assert not {id(v) for v in model.weights} & {id(v) for v in fused.weights}
    for layer in _all_layers(fused):
        if layer.weights and not isinstance(layer, keras.Model):
            assert all(w.dtype == "float32" for w in layer.weights)
    np.testing.assert_allclose(fused(_x()), model(_x()), rtol=TOL[policy], atol=TOL[policy])


def test_fused_model_trains_like_the_original():
    model = _block("float32")
    fused = fuse(model)
    y = np.random.default_rng(1).integers(0, 3, size=(4,))
    for m in (model, fused):
        m.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        m.train_on_batch(_x(), y)
    for a, b in zip(model.weights, fused.weights):
        np.testing.assert_allclose(b.numpy(), a.numpy(), atol=1e-5, err_msg=a.path)
    assert not np.allclose(model(_x()), fuse(_block("float32"))(_x()))  # it did train


def test_fused_model_survives_keras_save_and_load(tmp_path):
    fused = fuse(_block("mixed_bfloat16"))
    path = str(tmp_path / "fused.keras")
    fused.save(path)
    loaded = keras.models.load_model(path)
    assert {type(l) for l in _all_layers(loaded)} == {type(l) for l in _all_layers(fused)}
    assert loaded.layers[1].dtype_policy.name == "mixed_bfloat16"
    np.testing.assert_array_equal(np.asarray(loaded(_x())), np.asarray(fused(_x())))


def test_fuse_sequential_model():
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(7, activation="relu"),
                              keras.layers.Dense(2), keras.layers.Softmax()])
    fused = fuse(model)
    assert [type(l) for l in fused.layers] == [klayers.Dense, klayers.Dense, klayers.Softmax]
    x = np.random.default_rng(0).normal(size=(3, 5)).astype("float32")
    np.testing.assert_allclose(fused(x), model(x), atol=1e-6)


def test_fuse_leaves_subclasses_of_supported_layers_alone():
    class MyDense(keras.layers.Dense):
        pass

    model = keras.Sequential([keras.Input((5,)), MyDense(3)])
    assert type(fuse(model).layers[0]) is MyDense


def test_fuse_rejects_subclassed_and_unbuilt_models():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.d = keras.layers.Dense(2)

        def call(self, x):
            return self.d(x)

    net = Net()
    net(tf.ones([1, 3]))
    with pytest.raises(TypeError, match="`model` must be a Keras functional or Sequential"):
        fuse(net)
    with pytest.raises(ValueError, match="`model` must be built"):
        fuse(keras.Sequential([keras.layers.Dense(2)]))


def test_fused_layers_share_one_policy_where_the_original_did():
    import keras_mp

    keras_mp.set_global_policy("adaptive_bfloat16")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="gelu"),
                              keras.layers.LayerNormalization(), keras.layers.Dense(2)])
    keras_mp.set_global_policy("float32")
    original = {id(layer._dtype_policy) for layer in model.layers}
    fused = fuse(model)
    copies = {id(layer._dtype_policy) for layer in fused.layers}
    assert len(original) == 1 and len(copies) == 1  # one policy, as in the original
    assert copies != original  # the copy's own: a switch in one does not reach the other
    assert isinstance(fused.layers[0]._dtype_policy, keras_mp.AdaptivePolicy)


def _tied(policy: str) -> keras.Model:
    """Shaped like a KerasHub GPT2CausalLM: dict inputs, a nested functional
    backbone whose token embedding the outer graph reuses (tied output
    projection), and a Keras op (slicing) in the graph."""
    import keras_mp

    keras_mp.set_global_policy(policy)
    try:
        ids = keras.Input((5,), dtype="int32", name="token_ids")
        mask = keras.Input((5,), dtype="int32", name="padding_mask")
        embed = keras.layers.ReversibleEmbedding(20, 8, name="token_embedding")
        h = embed(ids)
        h = h * keras.ops.expand_dims(keras.ops.cast(mask, h.dtype), -1)
        h = keras.layers.LayerNormalization()(h + h[:, :1, :])
        h = keras.layers.Dense(8, activation="gelu")(h)
        backbone = keras.Model({"token_ids": ids, "padding_mask": mask}, h, name="backbone")
        ids2 = keras.Input((5,), dtype="int32", name="token_ids")
        mask2 = keras.Input((5,), dtype="int32", name="padding_mask")
        inputs = {"token_ids": ids2, "padding_mask": mask2}
        return keras.Model(inputs, embed(backbone(inputs), reverse=True))
    finally:
        keras_mp.set_global_policy("float32")


def _tokens(seed: int = 0) -> dict:
    ids = np.random.default_rng(seed).integers(0, 20, size=(3, 5)).astype("int32")
    return {"token_ids": ids, "padding_mask": np.ones_like(ids)}


def test_fuse_keeps_a_layer_shared_by_a_nested_model_and_the_outer_graph():
    model = _tied("adaptive_bfloat16")
    fused = fuse(model)
    # One token embedding, as in the original (the weights were paired by
    # position before: the clone lists the nested model's layers elsewhere).
    assert len(fused.weights) == len(model.weights)
    np.testing.assert_allclose(fused(_tokens()), model(_tokens()), rtol=5e-2, atol=5e-2)
    assert fused.get_layer("backbone").get_layer("token_embedding") is \
        fused.get_layer("token_embedding")


class _KerasIOBlock(keras.layers.Layer):
    """keras.io's style: sublayers created in ``__init__`` without a dtype."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.att = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)
        self.norm = keras.layers.LayerNormalization()

    def call(self, x):
        return self.norm(x + self.att(x, x))


@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_fuse_copies_a_subclassed_layer_that_creates_its_sublayers(policy):
    """Rebuilt from its config, the block names its sublayers anew
    (``multi_head_attention_1``: its variables pair by position) and, under
    a 16-bit policy, creates them under the block's policy (Keras's
    ``clone_model`` gives them the global float32 one: ``AddV2`` fails)."""
    keras.mixed_precision.set_global_policy(policy)
    inp = keras.Input((6, 8))
    model = keras.Model(inp, keras.layers.Dense(3)(_KerasIOBlock()(inp)))
    keras.mixed_precision.set_global_policy("float32")
    fused = fuse(model)
    tol = TOL.get(policy, 1e-2)
    np.testing.assert_allclose(np.asarray(fused(_x()), "float32"),
                               np.asarray(model(_x()), "float32"), atol=tol, rtol=tol)
    # Fused whichever placement this process measured for matmuls: XLA's
    # computation, or the graph of 2-D projections oneDNN runs.
    assert type(fused.layers[1].att) is klayers.MultiHeadAttention
    assert fused.layers[1].att.compute_dtype == model.layers[1].att.compute_dtype
