"""keras_mp.fused.layers: each fused layer against its Keras namesake under the
float32, mixed_bfloat16 and mixed_float16 policies (outputs, input and
weight gradients), weight/config compatibility and the Keras fallbacks.

Tolerances as in test_ops.py: both layers round to the compute dtype, at
different points, so they differ by about one unit in its last place.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mp
from keras_mp.fused import layers as klayers
from keras_mp.device import xla
from tests.fused.test_ops import _assert_close_relative_to_largest

POLICIES = ["float32", "mixed_bfloat16", "mixed_float16"]
TOL = {"float32": 1e-5, "mixed_bfloat16": 3e-2, "mixed_float16": 3e-3}
GRAD_TOL = {"float32": 1e-4, "mixed_bfloat16": 8e-2, "mixed_float16": 1e-2}
ATTENTION_TOL = {"float32": 1e-5, "mixed_bfloat16": 5e-2, "mixed_float16": 1e-2}


def _pair(keras_cls, fused_cls, input_shape, policy, **kwargs):
    """A Keras layer and its fused twin, built, with the same weights."""
    ref = keras_cls(dtype=policy, **kwargs)
    fused = fused_cls(dtype=policy, **kwargs)
    ref.build(input_shape)
    fused.build(input_shape)
    rng = np.random.default_rng(3)
    for w in ref.weights:
        w.assign(rng.normal(size=w.shape).astype("float32"))
    fused.set_weights(ref.get_weights())
    return ref, fused


def _run(layer, x, **call_kwargs):
    cot = tf.constant(np.random.default_rng(5).normal(size=x.shape), tf.float32)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x, **call_kwargs)
        loss = tf.reduce_sum(tf.cast(y, tf.float32) * cot) if y.shape == x.shape else \
            tf.reduce_sum(tf.cast(y, tf.float32))
    grads = tape.gradient(loss, [x, *layer.trainable_weights])
    return y, grads


def _assert_same(ref, fused, x, policy, **call_kwargs):
    y_ref, g_ref = _run(ref, x, **call_kwargs)
    y, g = _run(fused, x, **call_kwargs)
    assert y.dtype == y_ref.dtype == tf.as_dtype(ref.compute_dtype)
    for w in fused.weights:
        assert w.dtype == "float32"
    np.testing.assert_allclose(tf.cast(y, tf.float32), tf.cast(y_ref, tf.float32),
                               rtol=TOL[policy], atol=TOL[policy])
    for a, b in zip(g, g_ref):
        assert a.dtype == b.dtype
        scale = max(1.0, float(tf.reduce_max(tf.abs(tf.cast(b, tf.float32)))))
        np.testing.assert_allclose(tf.cast(a, tf.float32) / scale,
                                   tf.cast(b, tf.float32) / scale,
                                   rtol=GRAD_TOL[policy], atol=GRAD_TOL[policy])


# Every activation in every dtype is covered by test_ops; here each policy
# with a linear and a GELU epilogue, and the rest under mixed_bfloat16.
@pytest.mark.parametrize("activation,policy", [
    *[(a, p) for a in (None, "gelu") for p in POLICIES],
    *[(a, "mixed_bfloat16") for a in ("relu", "silu", "tanh")],
])
def test_dense_matches_keras(activation, policy):
    ref, fused = _pair(keras.layers.Dense, klayers.Dense, (2, 3, 8), policy,
                       units=6, activation=activation)
    assert fused.fused
    _assert_same(ref, fused, tf.constant(np.random.default_rng(0).normal(size=(2, 3, 8)),
                                         tf.float32), policy)


def test_dense_without_bias_and_unfused_activation():
    x = tf.constant(np.random.default_rng(0).normal(size=(4, 8)), tf.float32)
    ref, fused = _pair(keras.layers.Dense, klayers.Dense, (4, 8), "float32",
                       units=5, activation="gelu", use_bias=False)
    assert fused.fused
    _assert_same(ref, fused, x, "float32")
    ref, fused = _pair(keras.layers.Dense, klayers.Dense, (4, 8), "float32",
                       units=5, activation="softplus")
    assert not fused.fused  # falls back to Keras's call
    _assert_same(ref, fused, x, "float32")


def test_dense_with_lora_falls_back_to_keras():
    layer = klayers.Dense(4, activation="relu")
    layer.build((2, 8))
    layer.enable_lora(2)
    assert not layer.fused
    assert layer(tf.ones([2, 8])).shape == (2, 4)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("center,scale", [(True, True), (False, True), (True, False)])
def test_layer_normalization_matches_keras(center, scale, policy):
    ref, fused = _pair(keras.layers.LayerNormalization, klayers.LayerNormalization,
                       (2, 3, 16), policy, center=center, scale=scale)
    assert fused.fused
    x = tf.constant(np.random.default_rng(0).normal(size=(2, 3, 16)) * 2 + 1, tf.float32)
    _assert_same(ref, fused, x, policy)


@pytest.mark.parametrize("kwargs", [{"axis": [1, 2]}, {"rms_scaling": True}])
def test_layer_normalization_unfused_options_run_keras(kwargs):
    ref, fused = _pair(keras.layers.LayerNormalization, klayers.LayerNormalization,
                       (2, 3, 16), "float32", **kwargs)
    assert not fused.fused
    x = tf.constant(np.random.default_rng(0).normal(size=(2, 3, 16)), tf.float32)
    _assert_same(ref, fused, x, "float32")


def test_layer_normalization_positive_last_axis_is_fused():
    ref, fused = _pair(keras.layers.LayerNormalization, klayers.LayerNormalization,
                       (2, 3, 16), "float32", axis=2)
    assert fused.fused
    _assert_same(ref, fused, tf.random.normal([2, 3, 16]), "float32")


BN_SHAPE = (4, 5, 5, 6)


def _bn_pair(policy, shape=BN_SHAPE, **kwargs):
    ref, fused = _pair(keras.layers.BatchNormalization, klayers.BatchNormalization, shape,
                       policy, momentum=0.9, **kwargs)
    for w in ref.non_trainable_weights:  # moving variances (and renorm's) must be positive
        w.assign(np.abs(w.numpy()) + 0.5)
    fused.set_weights(ref.get_weights())
    return ref, fused


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("center,scale", [(True, True), (False, False)])
def test_batch_normalization_matches_keras(policy, center, scale):
    ref, fused = _bn_pair(policy, center=center, scale=scale)
    assert fused.fused
    x = tf.constant(np.random.default_rng(0).normal(2.0, 3.0, BN_SHAPE), tf.float32)
    _assert_same(ref, fused, x, policy, training=True)
    # One training call each: the moving averages moved the same way.
    for a, b in zip(ref.non_trainable_weights, fused.non_trainable_weights):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-5, atol=1e-6)
    _assert_same(ref, fused, x, policy, training=False)


@pytest.mark.parametrize("kwargs,shape", [
    ({"renorm": True}, BN_SHAPE), ({"axis": 1}, BN_SHAPE), ({}, (4, 6)),
    ({"epsilon": 1e-6}, BN_SHAPE), ({"synchronized": True}, BN_SHAPE)])
def test_batch_normalization_unfused_options_run_keras(kwargs, shape):
    ref, fused = _bn_pair("mixed_bfloat16", shape, **kwargs)
    assert not fused.fused
    x = tf.constant(np.random.default_rng(0).normal(2.0, 3.0, shape), tf.float32)
    _assert_same(ref, fused, x, "mixed_bfloat16", training=True)


def test_batch_normalization_masked_call_runs_keras():
    ref, fused = _bn_pair("float32")
    x = tf.constant(np.random.default_rng(0).normal(2.0, 3.0, BN_SHAPE), tf.float32)
    mask = tf.constant(np.random.default_rng(1).random(BN_SHAPE[:-1]) > 0.3)
    np.testing.assert_allclose(fused(x, training=True, mask=mask),
                               ref(x, training=True, mask=mask), rtol=1e-5, atol=1e-5)
    for a, b in zip(ref.non_trainable_weights, fused.non_trainable_weights):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("policy", POLICIES)
def test_rms_normalization_matches_keras(policy):
    ref, fused = _pair(keras.layers.RMSNormalization, klayers.RMSNormalization,
                       (2, 3, 16), policy)
    assert fused.fused
    x = tf.constant(np.random.default_rng(0).normal(size=(2, 3, 16)) * 2, tf.float32)
    _assert_same(ref, fused, x, policy)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("masked", [False, True])
def test_softmax_matches_keras(masked, policy):
    ref, fused = _pair(keras.layers.Softmax, klayers.Softmax, (2, 4, 8), policy)
    x = tf.constant(np.random.default_rng(0).normal(size=(2, 4, 8)) * 3, tf.float32)
    kwargs = {}
    if masked:
        kwargs["mask"] = tf.constant(np.random.default_rng(1).random((2, 1, 8)) > 0.3)
    _assert_same(ref, fused, x, policy, **kwargs)


def test_softmax_several_axes_falls_back_to_keras():
    ref, fused = _pair(keras.layers.Softmax, klayers.Softmax, (2, 4, 8), "float32",
                       axis=(1, 2))
    assert not fused.fused
    _assert_same(ref, fused, tf.random.normal([2, 4, 8]), "float32")


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("tie_weights", [True, False])
def test_reversible_embedding_logits_in_the_compute_dtype(policy, tie_weights):
    """Keras's reverse projection runs in float32 under mixed precision (the
    table stays float32 in call); the fused one in the compute dtype, like a
    Dense layer, with the same values within its rounding. The lookup is Keras's."""
    kwargs = dict(input_dim=50, output_dim=8, tie_weights=tie_weights, logit_soft_cap=30.0)
    ref, fused = _pair(keras.layers.ReversibleEmbedding, klayers.ReversibleEmbedding, None,
                       policy, **kwargs)
    assert fused.fused == (policy != "float32")
    h = tf.random.normal([2, 3, 8])
    y_ref, g_ref = _run(ref, h, reverse=True)
    y, g = _run(fused, h, reverse=True)
    assert y.dtype == tf.as_dtype(fused.compute_dtype) and y_ref.dtype == tf.float32
    np.testing.assert_allclose(tf.cast(y, tf.float32), y_ref, rtol=TOL[policy] * 3,
                               atol=TOL[policy] * 3 * float(tf.reduce_max(tf.abs(y_ref))))
    for a, b in zip(g, g_ref):
        assert (a is None) == (b is None)   # an untied table takes no reverse gradient
        if b is None:
            continue
        scale = max(1.0, float(tf.reduce_max(tf.abs(tf.cast(b, tf.float32)))))
        np.testing.assert_allclose(tf.cast(a, tf.float32) / scale,
                                   tf.cast(b, tf.float32) / scale,
                                   rtol=GRAD_TOL[policy], atol=GRAD_TOL[policy])
    ids = tf.constant([[1, 7, 49]])
    np.testing.assert_array_equal(tf.cast(fused(ids), tf.float32), tf.cast(ref(ids), tf.float32))


def test_reversible_embedding_fallbacks_run_keras():
    layer = klayers.ReversibleEmbedding(20, 4, reverse_dtype="float32", dtype="mixed_bfloat16")
    layer.build()
    assert not layer.fused and layer(tf.ones([1, 4]), reverse=True).dtype == tf.float32
    layer = klayers.ReversibleEmbedding(20, 4, dtype="mixed_bfloat16")
    layer.build()
    layer.enable_lora(2)
    assert not layer.fused and layer(tf.ones([1, 4]), reverse=True).dtype == tf.float32
    layer = klayers.ReversibleEmbedding(20, 4, dtype="mixed_bfloat16")
    layer.build()
    layer.quantize("int8")   # Keras's quantized layer from here on
    assert not layer.fused and layer.quantization_mode == "int8"
    assert layer(tf.ones([1, 4]), reverse=True).shape == (1, 20)


def test_fused_class_takes_exact_classes_and_kerashub_reexports_only():
    class Mine(keras.layers.ReversibleEmbedding):
        pass

    assert klayers.fused_class(keras.layers.ReversibleEmbedding) is klayers.ReversibleEmbedding
    assert klayers.fused_class(Mine) is None and klayers.fused_class(keras.layers.Embedding) is None
    keras_hub = pytest.importorskip("keras_hub")
    assert klayers.fused_class(keras_hub.layers.ReversibleEmbedding) is klayers.ReversibleEmbedding
    assert klayers.fused_class(keras_hub.layers.TransformerDecoder) is None


@pytest.mark.parametrize("cls,kwargs", [
    (klayers.Dense, {"units": 3, "activation": "gelu"}),
    (klayers.LayerNormalization, {"epsilon": 1e-5}),
    (klayers.BatchNormalization, {"momentum": 0.9}),
    (klayers.RMSNormalization, {"epsilon": 1e-5}),
    (klayers.Softmax, {"axis": 1}),
    (klayers.ReversibleEmbedding, {"input_dim": 10, "output_dim": 4, "logit_soft_cap": 5.0}),
])
def test_layers_serialize_under_the_keras_mp_package(cls, kwargs):
    layer = cls(dtype="mixed_bfloat16", **kwargs)
    config = keras.saving.serialize_keras_object(layer)
    assert config["registered_name"] == f"keras_mp>{cls.__name__}"
    clone = keras.saving.deserialize_keras_object(config)
    assert type(clone) is cls
    assert clone.dtype_policy.name == "mixed_bfloat16"
    assert clone.get_config() == layer.get_config()


def test_weights_load_from_a_keras_layer_checkpoint(tmp_path):
    ref = keras.layers.Dense(4, activation="tanh")
    ref.build((None, 5))
    ref.kernel.assign(tf.random.normal([5, 4]))
    path = str(tmp_path / "dense.weights.h5")
    keras.Sequential([keras.Input((5,)), ref]).save_weights(path)
    fused = klayers.Dense(4, activation="tanh")
    keras.Sequential([keras.Input((5,)), fused]).load_weights(path)
    x = tf.random.normal([3, 5])
    np.testing.assert_allclose(fused(x), ref(x), atol=1e-6)


@pytest.fixture
def matmul_in_xla():
    xla.set_xla("matmul", True)
    yield
    xla.set_xla("matmul", None)


@pytest.mark.parametrize("matmul_xla", [False, True])
def test_dense_matches_keras_with_either_matmul_placement(matmul_xla):
    xla.set_xla("matmul", matmul_xla)
    try:
        ref, fused = _pair(keras.layers.Dense, klayers.Dense, (2, 3, 8), "mixed_bfloat16",
                           units=6, activation="gelu")
        x = tf.constant(np.random.default_rng(0).normal(size=(2, 3, 8)), tf.float32)
        _assert_same(ref, fused, x, "mixed_bfloat16")
    finally:
        xla.set_xla("matmul", None)


def _mha_pair(policy):
    ref = keras.layers.MultiHeadAttention(2, 4, dtype=policy)
    fused = klayers.MultiHeadAttention(2, 4, dtype=policy)
    q, v = tf.random.normal([2, 5, 8]), tf.random.normal([2, 6, 8])
    ref(q, v)
    fused(q, v)
    rng = np.random.default_rng(3)
    ref.set_weights([rng.normal(size=w.shape).astype("float32") / 2 for w in ref.weights])
    fused.set_weights(ref.get_weights())
    return ref, fused, q, v


def _attend(layer, q, v, **kwargs):
    with tf.GradientTape() as tape:
        tape.watch([q, v])
        y = layer(q, v, **kwargs)
        loss = tf.reduce_sum(tf.cast(y, tf.float32) * tf.cast(y, tf.float32))
    return y, tape.gradient(loss, [q, v, *layer.trainable_weights])


@pytest.mark.parametrize("policy", POLICIES)
def test_multi_head_attention_matches_keras(policy, matmul_in_xla):
    ref, fused, q, v = _mha_pair(policy)
    y_ref, g_ref = _attend(ref, q, v)
    y, g = _attend(fused, q, v)
    assert y.dtype == y_ref.dtype == tf.as_dtype(fused.compute_dtype)
    assert len(g) == len(g_ref) == 2 + 8
    _assert_close_relative_to_largest(y, y_ref, g, g_ref, ATTENTION_TOL[policy])


def test_multi_head_attention_masked_calls_run_keras(matmul_in_xla):
    ref, fused, q, v = _mha_pair("float32")
    assert fused._fusable(q, v, None, (None,) * 4, False, None, False)  # noqa: SLF001
    mask = tf.constant(np.random.default_rng(0).random((2, 5, 6)) > 0.3)
    assert not fused._fusable(q, v, None, (None, None, None, mask), False, None, False)  # noqa: SLF001
    np.testing.assert_allclose(fused(q, v, attention_mask=mask), ref(q, v, attention_mask=mask),
                               atol=1e-5)
    y, scores = fused(q, v, return_attention_scores=True)
    assert scores.shape == (2, 2, 5, 6)
    np.testing.assert_allclose(fused(q, q, use_causal_mask=True),
                               ref(q, q, use_causal_mask=True), atol=1e-5)


def test_multi_head_attention_runs_keras_where_a_projection_was_promoted_alone():
    """An adaptive policy may promote one projection to float32: the fused
    computation has one dtype, so that call runs Keras's code."""
    with keras_mp.policy_scope("adaptive_bfloat16") as policy:
        layer = klayers.MultiHeadAttention(2, 4)
    q = tf.random.normal([2, 5, 8])
    layer(q, q)
    fusable = lambda: layer._fusable(q, q, None, (None,) * 4, False, None, False)  # noqa: E731,SLF001
    assert fusable()
    policy.assign(layer._query_dense.path, "float32")  # noqa: SLF001
    assert layer._query_dense.compute_dtype == "float32"  # noqa: SLF001
    assert not fusable()
    assert layer(q, q).dtype == tf.bfloat16


def test_multi_head_attention_serializes():
    layer = klayers.MultiHeadAttention(2, 4, dtype="mixed_bfloat16")
    config = keras.saving.serialize_keras_object(layer)
    assert config["registered_name"] == "keras_mp>MultiHeadAttention"
    assert type(keras.saving.deserialize_keras_object(config)) is klayers.MultiHeadAttention


@pytest.mark.parametrize("axis", ["x", [], [1.5]])
def test_rms_normalization_rejects_a_bad_axis(axis):
    with pytest.raises(TypeError, match="`axis` must be an int or a non-empty list"):
        klayers.RMSNormalization(axis=axis)
