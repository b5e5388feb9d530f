"""keras_mp.adaptive.evidence.forward: the statistics of a large tensor (more than
``LARGE`` elements) come from reductions that copy nothing, and equal those
of the XLA kernel used for smaller tensors, also where the step is traced
with no static batch size (as Keras traces a train function)."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from keras_mp.adaptive.evidence import forward
from keras_mp.device import memory


def _large(dtype="bfloat16"):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1024, 8192)).astype("float32") * 3.0
    x[7, 11] = -40.0                                   # the largest |x|, negative
    x[100, :2000] = forward.dtype_tiny(dtype) / 4      # subnormal in `dtype`
    assert x.size > forward.LARGE
    return tf.cast(x, dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_large_tensor_statistics_equal_the_kernels(dtype):
    x = _large(dtype)
    tiny = forward.dtype_tiny(dtype)
    large = forward.layer_statistics([x], [x], dtype)
    # The same tensor below the threshold takes the XLA kernel.
    small = forward.layer_statistics([x[:16]], [x[:16]], dtype)
    fields = dict(zip(forward.FIELDS, large.numpy()))
    expected = float(np.max(np.abs(np.asarray(tf.cast(x, tf.float32)))))
    assert fields["in_amax"] == fields["out_amax"] == pytest.approx(expected)
    assert expected == pytest.approx(40.0, rel=1e-2)
    assert fields["in_range"] == fields["out_nonfinite"] == 0.0
    # Subnormals, from a strided sample: about 2000 / 8.4M of the elements.
    # (TensorFlow's CPU threads read float32 and bfloat16 subnormals as zero.)
    if dtype == "float16":
        assert 0.0 < fields["out_flushed"] < 0.01
    assert tiny > 0
    assert dict(zip(forward.FIELDS, small.numpy()))["out_nonfinite"] == 0.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_large_tensor_nonfinite_is_seen(bad):
    x = tf.tensor_scatter_nd_update(_large(), [[900, 8000]], tf.constant([bad], tf.bfloat16))
    fields = dict(zip(forward.FIELDS, forward.layer_statistics([x], [x], "bfloat16").numpy()))
    assert fields["in_range"] == 1.0 and fields["out_nonfinite"] == 1.0
    assert fields["in_amax"] == fields["out_amax"] == 0.0   # not known: 0


def _traced(static: bool, shape, dtype="bfloat16"):
    """layer_statistics as a traced step, with the static shape or with the
    batch dimension unknown."""
    spec = tf.TensorSpec([None if not static else shape[0]] + list(shape[1:]), dtype)
    return tf.function(lambda x: forward.layer_statistics([x], [x], dtype),
                       input_signature=[spec])


@pytest.mark.parametrize("static", [True, False], ids=["static", "unknown_batch"])
def test_large_tensor_statistics_copy_nothing(static):
    """XLA:CPU reduces a 16-bit tensor through a float32 copy of it; the
    large-tensor path must not (measured: +512 MiB of TensorFlow's allocator
    peak on GPT-2's bfloat16 logits before; +270 MiB on a Transformer's
    statistics step, whose activations had no static batch size)."""
    x = _large()
    step = _traced(static, x.shape)
    step(x)
    if not memory.reset_peak("CPU:0"):
        pytest.skip("TensorFlow's CPU allocator keeps no statistics here (no oneDNN allocator)")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    step(x).numpy()
    grown = tf.config.experimental.get_memory_info("CPU:0")["peak"] - before
    assert grown < x.shape.num_elements() // 4, grown   # a float32 copy is 2x the tensor


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("rows", [1024, 16], ids=["large", "small"])
def test_unknown_batch_size_gives_the_static_statistics(dtype, rows):
    x = _large(dtype)[:rows]
    x = tf.tensor_scatter_nd_update(x, [[3, 5]], tf.constant([-77.0], dtype))
    static = _traced(True, x.shape, dtype)(x).numpy()
    unknown = _traced(False, x.shape, dtype)(x).numpy()
    np.testing.assert_allclose(unknown, static, rtol=1e-6)
    assert dict(zip(forward.FIELDS, unknown))["out_amax"] == pytest.approx(77.0, rel=1e-2)


def test_a_statistics_trace_costs_few_graph_nodes_per_layer():
    """Every node of a traced step costs the process memory while the trace
    lives, and each is made in Python; comparing each layer's amaxes with its
    dtype's range per call took 72 nodes per layer, once per step for all
    layers (forward.finish) 48, with each tensor's reductions one call of a
    function traced once (forward._large_kernel) 6."""
    import keras

    from keras_mp.adaptive.evidence.hooks import Hooks

    def nodes(depth):
        model = keras.Sequential([keras.Input((64,))]
                                 + [keras.layers.Dense(64, dtype="mixed_bfloat16")
                                    for _ in range(depth)])
        hooks = Hooks(model, model.layers)

        @tf.function
        def step(x):
            with hooks.recording(forward=True):
                model(x, training=True)
                return hooks.take()[0]

        spec = tf.TensorSpec([None, 64], tf.float32)
        plain = len(tf.function(lambda x: model(x, training=True))
                    .get_concrete_function(spec).graph.get_operations())
        return len(step.get_concrete_function(spec).graph.get_operations()) - plain

    assert (nodes(30) - nodes(10)) / 20 <= 12


def test_the_large_tensor_kernel_is_traced_once_for_every_shape_and_under_a_tape():
    # One trace per dtype serves every shape, and a call on a tensor a
    # gradient tape watches neither retraces it for a gradient nor changes
    # the tape's gradients.
    kernel = forward._large_kernel(tf.bfloat16, forward.dtype_tiny("bfloat16"))
    before = kernel.experimental_get_tracing_count()
    got = []
    for shape in ([None, 8], [None, 3, 4], [None]):
        fn = tf.function(lambda x: forward.call_statistics([x], [x * 2.0], "bfloat16"))
        x = tf.cast(tf.reshape(tf.range(1, 1 + 24, dtype=tf.float32), [-1] + [
            d for d in shape[1:]]), tf.bfloat16)
        got.append(fn.get_concrete_function(tf.TensorSpec(shape, tf.bfloat16))(x).numpy())
    for row in got:
        np.testing.assert_allclose(row, [24.0, 48.0, 0.0])

    w = tf.Variable(tf.ones([5, 8]))

    @tf.function(input_signature=[tf.TensorSpec([None, 5], tf.float32)])
    def step(x):
        with tf.GradientTape() as tape:
            y = tf.cast(tf.matmul(x, w), tf.bfloat16)
            stats = forward.call_statistics([], [y], "bfloat16")
            loss = tf.reduce_sum(tf.cast(y, tf.float32) ** 2)
        return stats, tape.gradient(loss, w)

    stats, grad = step(tf.ones([3, 5]))
    np.testing.assert_allclose(grad.numpy(), np.full([5, 8], 30.0))
    assert float(stats[1]) == 5.0
    assert kernel.experimental_get_tracing_count() == max(before, 1)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", ["mixed", "positive", "negative", "zeros", "subnormal",
                                  "nan", "negative_nan", "inf", "negative_inf", "dtype_max"])
def test_amax_of_bits_equals_the_float_reductions(dtype, case):
    """The integer reductions of a 16-bit tensor's bits give what the float
    reductions give: the largest |x| exactly, inf where an element is inf or
    NaN, whatever the signs."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(64, 129)).astype("float32") * 5.0
    x = {"positive": np.abs(x), "negative": -np.abs(x), "zeros": np.zeros_like(x) * -1.0,
         "subnormal": np.full_like(x, -forward.dtype_tiny(dtype) / 8)}.get(case, x)
    special = {"nan": np.nan, "negative_nan": -np.nan, "inf": np.inf, "negative_inf": -np.inf,
               "dtype_max": -forward.dtype_max(dtype)}
    if case in special:
        x[5, 7] = special[case]
    t = tf.cast(x, dtype)
    got = float(forward._amax_of_bits(t))
    ref = np.abs(np.asarray(tf.cast(t, tf.float32)))
    want = np.inf if np.isnan(ref).any() else float(ref.max())
    assert got == want
    if case == "subnormal":
        # TensorFlow's CPU float reductions read bfloat16 subnormals as zero;
        # the bits keep them.
        assert got > 0.0
        return
    hi, lo = tf.reduce_max(t), tf.reduce_min(t)   # the path other dtypes and devices take
    floats = np.inf if np.isnan([float(hi), float(lo)]).any() else max(float(hi), -float(lo))
    assert got == floats


def test_amax_of_bits_takes_only_16_bit_floats():
    with pytest.raises(ValueError, match="`x` must be bfloat16 or float16"):
        forward._amax_of_bits(tf.constant([1.0]))
