"""keras_mp.fused.ops: every fused op against its reference, forward and backward,
in float32, bfloat16 and float16, really XLA-compiled, and inf/nan handling.

Tolerances: the fused op rounds once, at its output, while the reference is
evaluated here in float32 on the same (already rounded) inputs, so the two
differ by about one unit in the last place of the dtype: float32 1e-5,
float16 2e-3 (10 mantissa bits) and bfloat16 2e-2 (7 bits), relative and
absolute, for values of order one.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_mp.fused import ops as kops
from keras_mp import device
from keras_mp.device import xla

DTYPES = ["float32", "bfloat16", "float16"]
TOL = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 2e-3}
# Gradients are sums over a row or a batch of rounded products: allow more.
GRAD_TOL = {"float32": 1e-4, "bfloat16": 6e-2, "float16": 1e-2}
# Attention chains four matmuls and a softmax, each rounding to the dtype;
# relative to the largest magnitude of the compared tensor.
ATTENTION_TOL = {"float32": 1e-5, "bfloat16": 5e-2, "float16": 1e-2}

ACTIVATIONS = [("linear", False), ("relu", False), ("gelu", False), ("gelu", True),
               ("silu", False), ("tanh", False)]


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def _as(x: np.ndarray, dtype: str) -> tf.Tensor:
    return tf.cast(tf.constant(x, tf.float32), dtype)


def _f32(t) -> np.ndarray:
    return tf.cast(t, tf.float32).numpy()


def _value_and_grads(fn, inputs, cotangent):
    """Output of ``fn(*inputs)`` and the gradients of <output, cotangent>."""
    with tf.GradientTape() as tape:
        tape.watch(inputs)
        y = fn(*inputs)
        loss = tf.reduce_sum(tf.cast(y, tf.float32) * cotangent)
    return y, tape.gradient(loss, inputs)


def _compare(fused_fn, ref_fn, inputs, dtype, out_shape):
    """Fused op on the dtype inputs vs the reference on their float32 values."""
    cot = tf.constant(_rng(9).normal(size=out_shape), tf.float32)
    y, grads = _value_and_grads(fused_fn, inputs, cot)
    ref_inputs = [tf.cast(t, tf.float32) for t in inputs]
    y_ref, grads_ref = _value_and_grads(ref_fn, ref_inputs, cot)
    assert y.dtype == inputs[0].dtype
    np.testing.assert_allclose(_f32(y), _f32(y_ref), rtol=TOL[dtype], atol=TOL[dtype])
    for g, g_ref, t in zip(grads, grads_ref, inputs):
        assert g.dtype == t.dtype
        np.testing.assert_allclose(_f32(g), _f32(g_ref), rtol=GRAD_TOL[dtype],
                                   atol=GRAD_TOL[dtype])


@pytest.fixture(autouse=True)
def _default_xla():
    xla.set_xla("elementwise", None)
    yield
    xla.set_xla("elementwise", None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation,approximate", ACTIVATIONS)
def test_bias_activation_matches_reference(activation, approximate, dtype):
    x = _as(_rng().normal(size=(3, 5, 16)) * 2, dtype)
    b = tf.constant(_rng(1).normal(size=(16,)), tf.float32)
    _compare(lambda x, b: kops.bias_activation(x, b, activation, approximate=approximate),
             lambda x, b: kops.bias_activation_reference(x, b, activation,
                                                         approximate=approximate),
             [x, b], dtype, (3, 5, 16))


def test_bias_activation_gelu_forms_differ_and_follow_keras():
    import keras
    x = tf.constant(np.linspace(-3, 3, 64, dtype="float32"))
    exact = kops.bias_activation(x, None, "gelu", approximate=False)
    approx = kops.bias_activation(x, None, "gelu", approximate=True)
    np.testing.assert_allclose(exact, keras.activations.gelu(x, approximate=False), atol=1e-6)
    np.testing.assert_allclose(approx, keras.activations.gelu(x, approximate=True), atol=1e-6)
    assert np.abs(exact.numpy() - approx.numpy()).max() > 1e-4


def test_bias_activation_gradient_matches_finite_differences():
    x = tf.constant(_rng().normal(size=(2, 4)), tf.float64)
    b = tf.constant(_rng(1).normal(size=(4,)), tf.float64)
    # float32 math inside: finite differences in float64 see its rounding only.
    theo, num = tf.test.compute_gradient(
        lambda x, b: tf.cast(kops.bias_activation(x, b, "gelu"), tf.float64), [x, b],
        delta=1e-3)
    for t, n in zip(theo, num):
        np.testing.assert_allclose(t, n, atol=2e-3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_matches_reference(dtype):
    x = _as(_rng().normal(size=(4, 3, 32)) * 3 + 1, dtype)
    g = tf.constant(_rng(1).normal(size=(32,)), tf.float32)
    b = tf.constant(_rng(2).normal(size=(32,)), tf.float32)
    _compare(lambda x, g, b: kops.layer_norm(x, g, b, epsilon=1e-3),
             lambda x, g, b: kops.layer_norm_reference(x, g, b, epsilon=1e-3),
             [x, g, b], dtype, (4, 3, 32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_matches_reference(dtype, training):
    x = _as(_rng().normal(size=(4, 3, 3, 8)) * 3 + 1, dtype)
    g = tf.constant(_rng(1).normal(size=(8,)), tf.float32)
    b = tf.constant(_rng(2).normal(size=(8,)), tf.float32)
    mean = tf.constant(_rng(3).normal(size=(8,)), tf.float32)
    var = tf.constant(np.abs(_rng(4).normal(size=(8,))) + 0.5, tf.float32)
    _compare(lambda x, g, b: kops.batch_norm(x, g, b, mean, var, training=training)[0],
             lambda x, g, b: kops.batch_norm_reference(x, g, b, mean, var, training=training)[0],
             [x, g, b], dtype, (4, 3, 3, 8))
    _, m, v = kops.batch_norm(x, g, b, training=True)
    _, m_ref, v_ref = kops.batch_norm_reference(tf.cast(x, tf.float32), training=True)
    np.testing.assert_allclose(m, m_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(v, v_ref, rtol=1e-4)  # the population variance, as Keras's
    one = kops.batch_norm(tf.ones([1, 1, 1, 2], dtype), training=True)[2]
    assert one.numpy().tolist() == [0.0, 0.0]  # one value per channel: variance 0, not nan
    with pytest.raises(ValueError, match="`epsilon`"):
        kops.batch_norm(x, epsilon=1e-6)
    with pytest.raises(ValueError, match="`mean` and `variance`"):
        kops.batch_norm(x, training=False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_reference(dtype):
    x = _as(_rng().normal(size=(4, 3, 32)) * 3, dtype)
    s = tf.constant(_rng(1).normal(size=(32,)), tf.float32)
    _compare(lambda x, s: kops.rms_norm(x, s, epsilon=1e-6),
             lambda x, s: kops.rms_norm_reference(x, s, epsilon=1e-6),
             [x, s], dtype, (4, 3, 32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("masked", [False, True])
def test_softmax_matches_reference(dtype, masked):
    x = _as(_rng().normal(size=(2, 3, 8, 8)) * 3, dtype)
    mask = None
    if masked:
        # Causal mask, broadcast over batch and heads; row 0 keeps one entry.
        mask = tf.constant(np.tril(np.ones((8, 8), bool)))[None, None]
    _compare(lambda x: kops.softmax(x, mask), lambda x: kops.softmax_reference(x, mask),
             [x], dtype, (2, 3, 8, 8))


def test_softmax_numeric_mask_and_fully_masked_rows():
    x = tf.constant([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    mask = tf.constant([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    y = kops.softmax(x, mask).numpy()
    e = np.exp([1.0, 3.0])
    np.testing.assert_allclose(y[0], [e[0] / e.sum(), 0.0, e[1] / e.sum()], rtol=1e-6)
    np.testing.assert_array_equal(y[1], [0.0, 0.0, 0.0])
    np.testing.assert_allclose(y, kops.softmax_reference(x, mask), atol=1e-6)


def test_softmax_other_axis():
    x = tf.constant(_rng().normal(size=(4, 6)), tf.float32)
    np.testing.assert_allclose(kops.softmax(x, axis=0), kops.softmax_reference(x, axis=0),
                               atol=1e-6)


def test_softmax_float16_large_logits_stay_finite():
    # Logits near float16's maximum: the fused op masks and normalises in
    # float32, so nothing overflows and masked entries are exactly zero.
    x = tf.constant([[60000.0, 65000.0, -65000.0, 100.0]], tf.float16)
    mask = tf.constant([[True, True, False, True]])
    y = kops.softmax(x, mask)
    assert y.dtype == tf.float16
    np.testing.assert_allclose(_f32(y), [[0.0, 1.0, 0.0, 0.0]], atol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sparse_softmax_cross_entropy_matches_reference(dtype):
    logits = _as(_rng().normal(size=(6, 5, 10)) * 2, dtype)
    labels = tf.constant(_rng(1).integers(0, 10, size=(6, 5)), tf.int32)
    cot = tf.constant(_rng(2).normal(size=(6, 5)), tf.float32)
    y, (g,) = _value_and_grads(lambda z: kops.sparse_softmax_cross_entropy(labels, z),
                               [logits], cot)
    y_ref, (g_ref,) = _value_and_grads(
        lambda z: kops.sparse_softmax_cross_entropy_reference(labels, z),
        [tf.cast(logits, tf.float32)], cot)
    assert y.dtype == logits.dtype and g.dtype == logits.dtype
    np.testing.assert_allclose(_f32(y), y_ref, rtol=TOL[dtype], atol=TOL[dtype])
    np.testing.assert_allclose(_f32(g), g_ref, rtol=GRAD_TOL[dtype], atol=GRAD_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_sparse_softmax_cross_entropy_with_matches(dtype):
    """The forward kernel's top-1 matches are the argmax's: the first class on
    ties, none for an out-of-range label; the loss is the same."""
    logits = _as(_rng().normal(size=(6, 5, 10)) * 2, dtype)
    labels = _rng(1).integers(0, 10, size=(6, 5)).astype("int32")
    labels.reshape(-1)[:12] = np.argmax(_f32(logits), -1).reshape(-1)[:12]
    labels[0, 0], labels[0, 1] = 10, -1
    loss, matches = kops.sparse_softmax_cross_entropy(labels, logits, with_matches=True)
    np.testing.assert_allclose(_f32(loss), _f32(kops.sparse_softmax_cross_entropy(labels, logits)),
                               rtol=1e-6, equal_nan=True)
    assert matches.dtype == tf.float32
    np.testing.assert_array_equal(matches, kops.sparse_top1_matches_reference(labels, logits))
    assert 10 <= float(tf.reduce_sum(matches)) < 30
    ties = tf.constant([[1.0, 3.0, 3.0, 0.0]] * 3, tf.as_dtype(dtype))
    _, matches = kops.sparse_softmax_cross_entropy(tf.constant([1, 2, 0]), ties, with_matches=True)
    np.testing.assert_array_equal(matches, [1.0, 0.0, 0.0])
    np.testing.assert_array_equal(kops.sparse_top1_matches(tf.constant([1, 2, 0]), ties),
                                  [1.0, 0.0, 0.0])
    with pytest.raises(TypeError, match="`with_matches` must be True or False"):
        kops.sparse_softmax_cross_entropy(labels, logits, with_matches=1)


def test_sparse_softmax_cross_entropy_out_of_range_label_is_nan():
    logits = tf.zeros([3, 4])
    loss = kops.sparse_softmax_cross_entropy(tf.constant([0, 4, -1]), logits).numpy()
    assert np.isfinite(loss[0]) and np.isnan(loss[1]) and np.isnan(loss[2])


# --------------------------------------------------------------------------
# inf / nan


def test_bias_activation_propagates_nonfinite_like_reference():
    x = tf.constant([[np.inf, -np.inf, np.nan, 1.0]], tf.float32)
    for act, approximate in ACTIVATIONS:
        y = kops.bias_activation(x, tf.zeros([4]), act, approximate=approximate).numpy()
        ref = kops.bias_activation_reference(x, tf.zeros([4]), act,
                                             approximate=approximate).numpy()
        msg = f"{act} approximate={approximate}"
        # What matters downstream is that a non-finite input stays visible to
        # the loss scaler's finite check; the kind of non-finite may differ
        # (gelu(-inf) is -inf*0: nan in TF, -inf under XLA's erf).
        np.testing.assert_array_equal(np.isfinite(y), np.isfinite(ref), err_msg=msg)
        finite = np.isfinite(ref)
        np.testing.assert_allclose(y[finite], ref[finite], atol=1e-6, err_msg=msg)


def test_normalizations_confine_nonfinite_rows():
    x = np.ones((3, 8), "float32") * np.arange(8, dtype="float32")
    x[1, 2] = np.inf
    x[2, 5] = np.nan
    for y in (kops.layer_norm(x), kops.rms_norm(x)):
        y = y.numpy()
        assert np.isfinite(y[0]).all()
        assert np.isnan(y[1]).any() and np.isnan(y[2]).all()


def test_softmax_and_cross_entropy_with_infinite_logits():
    x = tf.constant([[-np.inf, 0.0, 0.0], [np.nan, 0.0, 0.0]])
    y = kops.softmax(x).numpy()
    np.testing.assert_allclose(y[0], [0.0, 0.5, 0.5])
    assert np.isnan(y[1]).all()
    loss = kops.sparse_softmax_cross_entropy(tf.constant([1, 1]), x).numpy()
    np.testing.assert_allclose(loss[0], np.log(2.0), rtol=1e-6)
    assert np.isnan(loss[1])
    np.testing.assert_allclose(
        loss, kops.sparse_softmax_cross_entropy_reference(tf.constant([1, 1]), x),
        rtol=1e-6, equal_nan=True)
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = kops.sparse_softmax_cross_entropy(tf.constant([1, 1]), x)
    g = tape.gradient(loss, x).numpy()
    np.testing.assert_allclose(g[0], [0.0, -0.5, 0.5], atol=1e-6)
    assert np.isnan(g[1]).all()


# --------------------------------------------------------------------------
# compilation


def _kernel_args():
    x = tf.ones([2, 3, 8], tf.bfloat16)
    v = tf.ones([8], tf.float32)
    labels = tf.zeros([2, 3], tf.int32)
    mask = tf.ones([2, 3, 8], tf.bool)
    return {
        "bias_activation": [(x, v, "gelu"), (x, x, v, "gelu")],
        "layer_norm": [(x, v, v, 1e-3), (x, x, v, v, 1e-3)],
        "rms_norm": [(x, v, 1e-6), (x, x, v, 1e-6)],
        "softmax": [(x, mask, -1, 1.0), (x, x, -1, 1.0)],
        "sparse_softmax_cross_entropy": [(labels, x, True),
                                         (tf.ones([2, 3], tf.bfloat16), labels, x,
                                          tf.ones([2, 3], tf.float32))],
    }


@pytest.mark.parametrize("op", sorted(kops._FUSED))
def test_kernels_compile_to_plain_hlo(op):
    for kernel, args in zip(kops._FUSED[op], _kernel_args()[op]):
        hlo = kernel.compiled.experimental_get_compiler_ir(*args)(stage="hlo")
        assert hlo.startswith("HloModule"), hlo[:200]
        # A custom-call would be work XLA hands back to a library kernel.
        assert "custom-call" not in hlo, op


def test_op_inside_a_graph_runs_only_compiled_calls():
    """The traced training graph contains no elementwise TF op of the fused
    op's own: every piece of work is a call marked for XLA compilation."""

    @tf.function
    def step(x, b):
        with tf.GradientTape() as tape:
            tape.watch([x, b])
            y = kops.bias_activation(x, b, "gelu")
        return y, tape.gradient(y, [x, b])

    graph = step.get_concrete_function(tf.TensorSpec([4, 8], tf.bfloat16),
                                       tf.TensorSpec([8], tf.float32)).graph
    allowed = {"Placeholder", "Identity", "IdentityN", "Const", "NoOp", "OnesLike",
               "PartitionedCall", "StatefulPartitionedCall", "Fill", "Shape"}
    types = {op.type for op in graph.get_operations()}
    assert types <= allowed, types - allowed
    calls = [op for op in graph.get_operations() if op.type.endswith("PartitionedCall")]
    assert len(calls) == 2  # forward and backward
    for call in calls:
        fn_name = call.get_attr("f").name
        fdef = graph._get_function(fn_name).cached_definition  # noqa: SLF001
        assert fdef.attr["_XlaMustCompile"].b, fn_name


def test_disabled_xla_runs_the_reference():
    x = tf.constant(_rng().normal(size=(4, 8)), tf.bfloat16)
    xla.set_xla("elementwise", False)
    assert not xla.uses_xla("elementwise")
    y = kops.bias_activation(x, None, "gelu")
    ref = kops.bias_activation_reference(x, None, "gelu")
    np.testing.assert_array_equal(_f32(y), _f32(ref))


def test_unusable_xla_falls_back_to_the_reference(monkeypatch):
    monkeypatch.setitem(xla._available, xla.current_device_type(), False)  # noqa: SLF001
    assert not xla.uses_xla("elementwise")
    x = tf.constant(_rng().normal(size=(4, 8)), tf.float16)
    np.testing.assert_array_equal(_f32(kops.layer_norm(x)), _f32(kops.layer_norm_reference(x)))


# --------------------------------------------------------------------------
# argument errors


def test_errors_name_the_argument_and_allowed_values():
    x = tf.ones([2, 4])
    with pytest.raises(ValueError, match=r"`activation` must be one of .*'gelu'"):
        kops.bias_activation(x, None, "softplus")
    with pytest.raises(TypeError, match="`approximate`"):
        kops.bias_activation(x, None, "gelu", approximate="tanh")
    with pytest.raises(ValueError, match="`bias` must be a vector of length"):
        kops.bias_activation(x, tf.ones([3]))
    with pytest.raises(ValueError, match="`epsilon` must be a number > 0"):
        kops.layer_norm(x, epsilon=0.0)
    with pytest.raises(ValueError, match="`gamma`"):
        kops.layer_norm(x, tf.ones([2]))
    with pytest.raises(ValueError, match="`axis` must be an int"):
        kops.softmax(x, axis=2)
    with pytest.raises(ValueError, match="`mask` must be broadcastable"):
        kops.softmax(x, tf.ones([1, 2, 4], tf.bool))
    with pytest.raises(TypeError, match="`labels` must be integer"):
        kops.sparse_softmax_cross_entropy(tf.zeros([2]), x)
    with pytest.raises(ValueError, match="`labels` must have shape"):
        kops.sparse_softmax_cross_entropy(tf.zeros([2, 4], tf.int32), x)
    with pytest.raises(ValueError, match="`axis` must be an int"):
        kops.softmax_reference(x, axis=2)
    for dense in (kops.dense_activation, kops.dense_activation_reference):
        with pytest.raises(ValueError, match="`kernel` must be a matrix with x.shape"):
            dense(x, tf.ones([3, 2]))
    with pytest.raises(ValueError, match="`bias` must be a vector of length"):
        kops.dense_activation(x, tf.ones([4, 2]), tf.ones([3]))
    for attention in (kops.multi_head_attention, kops.multi_head_attention_reference):
        with pytest.raises(ValueError, match="`weights` must hold 8 entries"):
            attention(tf.ones([1, 2, 4]), tf.ones([1, 2, 4]), tf.ones([1, 2, 4]), [], scale=1.0)
    with pytest.raises(ValueError, match="`device_type` must be one of"):
        xla.xla_available("QPU")


# --------------------------------------------------------------------------
# matmul-bearing ops (placed by xla.uses_xla("matmul"))


@pytest.fixture(params=[False, True], ids=["matmul_outside_xla", "matmul_in_xla"])
def matmul_placement(request):
    xla.set_xla("matmul", request.param)
    yield request.param
    xla.set_xla("matmul", None)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_activation_matches_reference(dtype, matmul_placement):
    x = _as(_rng().normal(size=(2, 3, 8)), dtype)
    k = _as(_rng(1).normal(size=(8, 6)) / 3, dtype)
    b = tf.constant(_rng(2).normal(size=(6,)), tf.float32)
    _compare(lambda x, k, b: kops.dense_activation(x, k, b, "gelu"),
             lambda x, k, b: kops.dense_activation_reference(x, k, b, "gelu"),
             [x, k, b], dtype, (2, 3, 6))


def _assert_close_relative_to_largest(y, y_ref, grads, grads_ref, tol):
    """Output relative to its largest value, gradients relative to the
    largest gradient of all: four chained matmuls each round to the dtype,
    and the key bias's gradient is zero in exact arithmetic (softmax ignores
    a per-row constant), so it is pure rounding noise on either side."""
    y_ref = _f32(y_ref)
    np.testing.assert_allclose(_f32(y) / np.abs(y_ref).max(), y_ref / np.abs(y_ref).max(),
                               atol=tol)
    scale = max(float(np.abs(_f32(g)).max()) for g in grads_ref)
    for i, (a, b) in enumerate(zip(grads, grads_ref)):
        np.testing.assert_allclose(_f32(a) / scale, _f32(b) / scale, atol=tol,
                                   err_msg=f"gradient {i}")


def _mha_weights(dim=8, heads=2, key_dim=4, seed=0):
    rng = _rng(seed)
    shapes = [(dim, heads, key_dim), (heads, key_dim)] * 3 + [(heads, key_dim, dim), (dim,)]
    return [tf.constant(rng.normal(size=s) / 2, tf.float32) for s in shapes]


@pytest.mark.parametrize("dtype", DTYPES)
def test_multi_head_attention_matches_reference(dtype, matmul_placement):
    try:
        q = _as(_rng().normal(size=(2, 5, 8)), dtype)
        v = _as(_rng(1).normal(size=(2, 7, 8)), dtype)
        w = _mha_weights()
        inputs = [q, v, *w]
        cot = tf.constant(_rng(9).normal(size=(2, 5, 8)), tf.float32)
        y, grads = _value_and_grads(
            lambda q, v, *w: kops.multi_head_attention(q, v, v, w, scale=0.5), inputs, cot)
        y_ref, grads_ref = _value_and_grads(
            lambda q, v, *w: kops.multi_head_attention_reference(q, v, v, w, scale=0.5),
            [tf.cast(t, tf.float32) for t in inputs], cot)
        assert y.dtype == q.dtype
        _assert_close_relative_to_largest(y, y_ref, grads, grads_ref, ATTENTION_TOL[dtype])
    finally:
        xla.set_xla("matmul", None)


def _keras_attention(q, v, w, dtype):
    """Keras's own layer under ``mixed_<dtype>`` (or float32) with weights ``w``."""
    policy = "float32" if dtype == "float32" else f"mixed_{dtype}"
    layer = keras.layers.MultiHeadAttention(2, 4, dtype=policy)
    layer(q, v)
    layer.set_weights([np.asarray(t) for t in w])
    return layer


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("softmax_in_xla", [False, True], ids=["tf_softmax", "xla_softmax"])
def test_attention_outside_xla_is_keras(dtype, softmax_in_xla):
    """The graph form (matmuls in oneDNN) computes Keras's outputs: the same
    products, the scores scaled and normalized in float32; bit for bit where
    TensorFlow's softmax runs, within a float32 rounding of the softmax
    (one unit of the last place at most) where XLA's kernel does."""
    q = tf.constant(_rng().normal(size=(2, 5, 8)), tf.float32)
    v = tf.constant(_rng(1).normal(size=(2, 7, 8)), tf.float32)
    w = _mha_weights()
    layer = _keras_attention(q, v, w, dtype)
    xla.set_xla("matmul", False)
    xla.set_xla("elementwise", softmax_in_xla)
    try:
        y = kops.multi_head_attention(tf.cast(q, dtype), tf.cast(v, dtype), tf.cast(v, dtype),
                                      w, scale=0.5)
    finally:
        xla.set_xla("matmul", None)
        xla.set_xla("elementwise", None)
    y_ref = _f32(layer(q, v))
    if softmax_in_xla:
        ulp = 2.0 ** -7 if dtype == "bfloat16" else 2.0 ** -22
        np.testing.assert_allclose(_f32(y), y_ref, rtol=0, atol=4 * ulp * np.abs(y_ref).max())
    else:
        np.testing.assert_array_equal(_f32(y), y_ref)


def test_attention_outside_xla_sums_bias_gradients_in_float32():
    """Each bias gradient of the bfloat16 graph form is as close to float32's
    as Keras's own layer's (TensorFlow's BiasAddGrad, summing in bfloat16,
    was 10-30x further off)."""
    q = tf.constant(_rng().normal(size=(8, 64, 8)), tf.float32)
    w = _mha_weights()
    cot = tf.constant(_rng(9).normal(size=(8, 64, 8)), tf.float32)
    layer = _keras_attention(q, q, w, "bfloat16")
    xla.set_xla("matmul", False)
    try:
        _, mine = _value_and_grads(lambda q, *w: kops.multi_head_attention(
            tf.cast(q, tf.bfloat16), tf.cast(q, tf.bfloat16), tf.cast(q, tf.bfloat16), w,
            scale=0.5), [q, *w], cot)
        _, exact = _value_and_grads(lambda q, *w: kops.multi_head_attention(
            q, q, q, w, scale=0.5), [q, *w], cot)
    finally:
        xla.set_xla("matmul", None)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.cast(layer(q, q), tf.float32) * cot)
    keras_grads = tape.gradient(loss, layer.trainable_weights)
    for i in (1, 5, 7):  # query, value and output biases (the key bias's is ~0)
        err = np.linalg.norm(_f32(mine[1 + i]) - _f32(exact[1 + i]))
        keras_err = np.linalg.norm(_f32(keras_grads[i]) - _f32(exact[1 + i]))
        assert err <= 2 * keras_err + 1e-6 * np.linalg.norm(_f32(exact[1 + i])), (i, err,
                                                                                    keras_err)


def test_multi_head_attention_without_biases_and_bad_weights():
    w = _mha_weights()
    for i in (1, 3, 5, 7):
        w[i] = None
    q = tf.constant(_rng().normal(size=(1, 4, 8)), tf.float32)
    xla.set_xla("matmul", True)
    try:
        np.testing.assert_allclose(
            kops.multi_head_attention(q, q, q, w, scale=0.5),
            kops.multi_head_attention_reference(q, q, q, w, scale=0.5), atol=1e-5)
        with pytest.raises(ValueError, match="`weights` must hold 8 entries"):
            kops.multi_head_attention(q, q, q, w[:6], scale=0.5)
    finally:
        xla.set_xla("matmul", None)


def test_matmul_kernels_compile_to_plain_hlo():
    x = tf.ones([2, 3, 8], tf.bfloat16)
    w = [tf.cast(t, tf.bfloat16) for t in _mha_weights()]
    irs = [kops.dense._dense_fwd.compiled.experimental_get_compiler_ir(  # noqa: SLF001
               x, tf.ones([8, 4], tf.bfloat16), tf.ones([4]), "gelu"),
           kops.dense._dense_bwd.compiled.experimental_get_compiler_ir(  # noqa: SLF001
               tf.ones([2, 3, 4], tf.bfloat16), x, tf.ones([8, 4], tf.bfloat16),
               tf.ones([2, 3, 4], tf.bfloat16), True, "gelu"),
           kops.attention._attention_xla.compiled.experimental_get_compiler_ir(  # noqa: SLF001
               x, x, x, tuple(w), 0.5)]
    for ir in irs:
        hlo = ir(stage="hlo")
        assert hlo.startswith("HloModule") and "custom-call" not in hlo
        assert " dot(" in hlo  # the matmuls are inside the computation


def test_dense_in_xla_differentiates_inside_xla():
    """Forward and backward of the one-computation Dense are both compiled."""
    xla.set_xla("matmul", True)
    try:
        @tf.function
        def step(x, k, b):
            with tf.GradientTape() as tape:
                tape.watch([x, k, b])
                y = kops.dense_activation(x, k, b, "relu")
            return y, tape.gradient(y, [x, k, b])

        graph = step.get_concrete_function(tf.TensorSpec([4, 8], tf.bfloat16),
                                           tf.TensorSpec([8, 3], tf.bfloat16),
                                           tf.TensorSpec([3], tf.float32)).graph
        calls = [op for op in graph.get_operations() if op.type.endswith("PartitionedCall")]
        assert {op.type for op in graph.get_operations()} <= {
            "Placeholder", "Identity", "IdentityN", "Const", "PartitionedCall",
            "StatefulPartitionedCall"}
        assert len(calls) == 2
        for call in calls:
            fdef = graph._get_function(call.get_attr("f").name).cached_definition  # noqa: SLF001
            assert fdef.attr["_XlaMustCompile"].b
    finally:
        xla.set_xla("matmul", None)


# --------------------------------------------------------------------------
# placement decisions


def test_cpu_matmul_placement_follows_bf16_hardware(monkeypatch):
    # Without a measured placement (an earlier test may have configured a
    # model, which measures one), the default follows the hardware.
    monkeypatch.setattr(xla, "_measured", {})
    flags = device.cpu_flags()
    has = "amx_bf16" in flags or "avx512_bf16" in flags
    assert xla.cpu_has_bf16_matmul() is has
    assert xla.uses_xla("matmul", "CPU") is (not has)
    assert xla.uses_xla("elementwise", "CPU")
    xla.set_xla("matmul", has)
    try:
        assert xla.uses_xla("matmul", "CPU") is has
    finally:
        xla.set_xla("matmul", None)


def test_set_xla_rejects_bad_arguments():
    with pytest.raises(ValueError, match="`kind` must be one of"):
        xla.set_xla("conv", True)
    with pytest.raises(TypeError, match="`enabled` must be True, False or None"):
        xla.set_xla("matmul", "yes")
