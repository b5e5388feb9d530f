"""keras_mp.scaling.kernels: the multi-tensor loss-scale kernels against numpy
references, with None / IndexedSlices entries, inf / nan, all three dtypes,
and a check that each kernel really is one XLA computation."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from keras_mp.scaling import kernels

SCALE = 1024.0
FP16_TINY, FP16_MIN_NORMAL, FP16_MAX, BF16_MIN_NORMAL = 2.0**-24, 2.0**-14, 65504.0, 2.0**-126


def _grads(dtype: str, seed: int = 0) -> list[tf.Tensor]:
    rng = np.random.default_rng(seed)
    values = [
        rng.normal(size=(4, 5)) * SCALE,
        rng.normal(size=(7,)) * 1e-3,          # scaled gradients near float16's subnormals
        np.array([0.0, 1e-9, 3e-6, 1.0, -2.0, 6e4, 1e-40 * SCALE]),
        rng.normal(size=(2, 3, 2)),
    ]
    return [tf.cast(tf.constant(v, tf.float32), dtype) for v in values]


def _np_stats(g: np.ndarray, scale: float) -> dict[str, float]:
    """The statistics as the module docstring defines them, in numpy."""
    g = g.astype(np.float64)
    a = np.abs(g)
    ua = np.abs(g / scale)
    finite = np.isfinite(g)
    n = max(g.size, 1)
    with np.errstate(invalid="ignore"):
        return {
            "amax": float(np.max(np.where(finite, ua, 0.0), initial=0.0)),
            "nonfinite": float((~finite).sum() / n),
            "fp16_underflow": float(((a > 0) & (a < FP16_TINY)).sum() / n),
            "fp16_subnormal": float(((a >= FP16_TINY) & (a < FP16_MIN_NORMAL)).sum() / n),
            "fp16_overflow": float((finite & (a > FP16_MAX)).sum() / n),
            "bf16_subnormal": float(((ua > 0) & (ua < BF16_MIN_NORMAL)).sum() / n),
            "zero": float((a == 0).sum() / n),
        }


def _check_stats(stats: kernels.GradientStatistics, grads, scale: float) -> None:
    for i, g in enumerate(grads):
        expected = (_np_stats(tf.cast(g, tf.float32).numpy(), scale)
                    if g is not None and not isinstance(g, tf.IndexedSlices)
                    else dict.fromkeys(kernels.STATISTICS, 0.0))
        for name in kernels.STATISTICS:
            got = float(getattr(stats, name)[i])
            np.testing.assert_allclose(got, expected[name], rtol=1e-5, atol=0,
                                       err_msg=f"gradient {i}, {name}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_unscale_and_check_matches_numpy(dtype):
    grads = _grads(dtype)
    out, ok = kernels.unscale_and_check(grads, SCALE)
    assert bool(ok)
    for g, u in zip(grads, out):
        assert u.dtype == g.dtype and u.shape == g.shape
        # One rounding to the dtype after an exact float32 division.
        expected = tf.cast(tf.cast(g, tf.float32) / SCALE, dtype)
        np.testing.assert_array_equal(tf.cast(u, tf.float32), tf.cast(expected, tf.float32))


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_unscale_and_check_flags_nonfinite(bad, dtype):
    grads = _grads(dtype)
    poisoned = tf.tensor_scatter_nd_update(tf.cast(grads[3], tf.float32), [[1, 2, 0]], [bad])
    grads[3] = tf.cast(poisoned, dtype)
    _, ok = kernels.unscale_and_check(grads, SCALE)
    assert not bool(ok)
    _, mask = kernels.unscale_and_check(grads, SCALE, return_mask=True)
    assert mask.numpy().tolist() == [False, False, False, True]
    np.testing.assert_array_equal(kernels.nonfinite_mask(grads, SCALE), mask)


def test_finite_values_that_overflow_float16_are_not_flagged():
    _, ok = kernels.unscale_and_check([tf.constant([1e6, -3e38])], 2.0)
    assert bool(ok)


def test_none_and_indexed_slices_entries():
    dense = tf.constant([[2.0, 4.0]])
    slices = tf.IndexedSlices(tf.constant([[8.0, 16.0]], tf.bfloat16), tf.constant([1]),
                              tf.constant([3, 2]))
    out, mask = kernels.unscale_and_check([None, dense, slices], 2.0, return_mask=True)
    assert out[0] is None
    np.testing.assert_array_equal(out[1], [[1.0, 2.0]])
    assert isinstance(out[2], tf.IndexedSlices) and out[2].values.dtype == tf.bfloat16
    np.testing.assert_array_equal(tf.cast(out[2].values, tf.float32), [[4.0, 8.0]])
    np.testing.assert_array_equal(out[2].indices, [1])
    assert mask.numpy().tolist() == [False, False, False]

    bad = tf.IndexedSlices(tf.constant([[np.nan, 1.0]]), tf.constant([0]), tf.constant([3, 2]))
    out, mask = kernels.unscale_and_check([None, dense, bad], 2.0, return_mask=True)
    assert mask.numpy().tolist() == [False, False, True]
    _, ok = kernels.unscale_and_check([None, bad], 2.0)
    assert not bool(ok)


def test_empty_and_all_none_lists():
    out, ok = kernels.unscale_and_check([], 2.0)
    assert out == [] and bool(ok)
    out, ok = kernels.unscale_and_check([None, None], 2.0)
    assert out == [None, None] and bool(ok)
    stats = kernels.gradient_statistics([None], 2.0)
    assert stats.amax.shape == (1,) and float(stats.amax[0]) == 0.0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_gradient_statistics_match_numpy(dtype):
    grads = _grads(dtype)
    _check_stats(kernels.gradient_statistics(grads, SCALE), grads, SCALE)


def test_gradient_statistics_with_nonfinite_none_and_slices():
    grads = [tf.constant([np.inf, np.nan, 1.0, 0.0]), None,
             tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0]), tf.constant([2, 2])),
             tf.constant([[1e-30, 2.0]])]
    stats = kernels.gradient_statistics(grads, 4.0)
    _check_stats(stats, grads, 4.0)
    assert float(stats.nonfinite[0]) == 0.5
    assert not bool(stats.all_finite())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_unscale_with_statistics_agrees_with_both_kernels(dtype):
    grads = _grads(dtype, seed=1)
    grads.insert(1, None)
    out, stats = kernels.unscale_with_statistics(grads, SCALE)
    out_ref, ok = kernels.unscale_and_check(grads, SCALE)
    assert bool(stats.all_finite()) == bool(ok)
    for u, r in zip(out, out_ref):
        if r is None:
            assert u is None
        else:
            np.testing.assert_array_equal(tf.cast(u, tf.float32), tf.cast(r, tf.float32))
    _check_stats(stats, grads, SCALE)


def test_unscale_with_statistics_counts_nonfinite_slices():
    bad = tf.IndexedSlices(tf.constant([[np.inf, 1.0]]), tf.constant([0]), tf.constant([3, 2]))
    out, stats = kernels.unscale_with_statistics([tf.ones([2]), bad], 2.0)
    assert stats.nonfinite.numpy().tolist() == [0.0, 1.0]
    assert not bool(stats.all_finite())
    assert isinstance(out[1], tf.IndexedSlices)


def test_kernels_work_inside_a_tf_function():
    grads = _grads("bfloat16")

    @tf.function
    def step(gs):
        out, ok = kernels.unscale_and_check(gs, tf.constant(SCALE))
        return out, ok, kernels.gradient_statistics(gs, tf.constant(SCALE)).amax

    out, ok, amax = step(grads)
    assert bool(ok) and amax.shape == (4,)
    eager_out, _ = kernels.unscale_and_check(grads, SCALE)
    for a, b in zip(out, eager_out):
        np.testing.assert_array_equal(tf.cast(a, tf.float32), tf.cast(b, tf.float32))


@pytest.mark.parametrize("kernel", ["_unscale_check_kernel", "_stats_kernel",
                                    "_unscale_stats_kernel"])
def test_each_kernel_is_one_xla_computation(kernel):
    fn = getattr(kernels, kernel)
    grads = _grads("bfloat16")
    hlo = fn.compiled.experimental_get_compiler_ir(grads, tf.constant(SCALE))(stage="hlo")
    assert hlo.startswith("HloModule")
    assert "custom-call" not in hlo
    # Every gradient is a parameter of the one computation, plus the scale.
    entry = hlo[hlo.index("ENTRY"):]
    assert entry.count("parameter(") == len(grads) + 1


def test_statistics_of_tensors_of_every_size_and_per_tensor_scales():
    # Empty tensors, tensors sampled for their fractions (more than SAMPLE
    # elements; amax and non-finite still see every element), small ones.
    rng = np.random.default_rng(3)
    big = rng.normal(size=(300, 400)) * 10.0 ** rng.integers(-9, 6, size=(300, 400))
    big.flat[big.size - 7] = np.inf  # not on the sample's stride
    grads = [tf.constant(v, tf.float32) for v in (
        np.zeros([0]), rng.normal(size=(3, 4)) * 1e-6, big, np.zeros([7]),
        [np.nan, 1.0, 1e-9], np.zeros([0, 3]))]
    scales = np.array([2.0, 8.0, 1024.0, 1.0, 4.0, 3.0], np.float32)
    stats = kernels.gradient_statistics(grads, tf.constant(scales))
    stride = -(-big.size // kernels.SAMPLE)
    for i, (g, s) in enumerate(zip(grads, scales)):
        full = g.numpy()
        sampled = full.reshape(-1)[::stride] if full.size > kernels.SAMPLE else full
        expected = _np_stats(sampled, float(s))
        if full.size > kernels.SAMPLE:
            # One non-finite element: counted, and amax is the sample's.
            expected["nonfinite"] = max(expected["nonfinite"], 1.0 / full.size)
        else:
            expected["amax"] = _np_stats(full, float(s))["amax"]
        for name in kernels.STATISTICS:
            np.testing.assert_allclose(float(getattr(stats, name)[i]), expected[name],
                                       rtol=1e-5, atol=0, err_msg=f"gradient {i}, {name}")


def test_statistics_alike_inline_and_as_one_function_for_every_shape():
    # Under XLA (and eagerly) each gradient's statistics are ops of the step
    # with static shapes; in a TensorFlow graph, calls of one function traced
    # for every shape. Both give the same numbers, bit for bit.
    rng = np.random.default_rng(5)
    big = rng.normal(size=(300, 400)) * 10.0 ** rng.integers(-9, 6, size=(300, 400))
    bad = big.copy()
    bad.flat[bad.size - 7] = np.nan  # not on the sample's stride
    grads = [tf.constant(v, tf.float32) for v in (
        big, bad, rng.normal(size=(3, 4)) * 1e-6, [np.inf, 1.0, 1e-9, 0.0], np.zeros([0, 3]))]
    scales = tf.constant([1024.0, 3.0, 8.0, 2.0, 4.0])
    inline = kernels._fused(grads, scales, unscale=False, stats=True)[1]
    before = kernels._stats_function().experimental_get_tracing_count()
    traced = kernels.gradient_statistics(grads, scales)
    for name, a, b in zip(kernels.STATISTICS, inline, traced):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=name)
    assert kernels._stats_function().experimental_get_tracing_count() == max(before, 1)
    assert float(traced.nonfinite[1]) == pytest.approx(1.0 / bad.size)
    assert float(traced.amax[1]) == pytest.approx(np.nanmax(np.abs(bad.reshape(-1)[::2])) / 3.0)


def test_statistics_cost_a_few_graph_nodes_per_gradient():
    # Every node of a traced step costs the process memory for as long as
    # the step lives; 270 gradients of ResNet50V2 once took 12,144 nodes
    # (71 per gradient, with the unscaling).
    def nodes(count):
        specs = [tf.TensorSpec([3, 5], tf.bfloat16)] * count
        fn = tf.function(lambda gs: kernels.unscale_with_statistics(gs, 2.0))
        graph = fn.get_concrete_function(specs).graph.as_graph_def()
        return len(graph.node) + sum(len(f.node_def) for f in graph.library.function)

    assert (nodes(60) - nodes(20)) / 40 <= 40


@pytest.mark.parametrize("shape", [(512, 512), (3, 3, 32, 64), (256,), (300,), (7, 100), (1,)])
@pytest.mark.parametrize("bad", ["nan", "inf", "-inf", "inf-inf", None])
@pytest.mark.parametrize("traced", [False, True])
def test_nonfinite_by_sums_flags_one_bad_element_anywhere(shape, bad, traced):
    # A float32 gradient of ROW elements or more is summed as rows times ones
    # (a matrix-vector product); the others with reduce_sum: both must see a
    # single non-finite element wherever it is, and +inf with -inf.
    rng = np.random.default_rng(sum(shape))
    a = rng.normal(size=shape).astype("float32").reshape(-1)
    i, j = rng.choice(a.size, size=2, replace=False) if a.size > 1 else (0, 0)
    if bad == "inf-inf":
        a[i], a[j] = np.inf, -np.inf
        if i == j:
            a[i] = np.nan
    elif bad is not None:
        a[i] = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}[bad]
    g = tf.constant(a.reshape(shape))
    check = tf.function(kernels.nonfinite_by_sums) if traced else kernels.nonfinite_by_sums
    assert check([g, tf.ones([3])]).numpy().tolist() == [bad is not None, False]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_nonfinite_by_sums_of_16_bit_gradients_sums_in_float32(dtype):
    # 4096 float16 values of 60000 sum far beyond float16's range: no overflow.
    big = tf.fill([4096], tf.constant(60000.0, dtype))
    bad = tf.tensor_scatter_nd_update(big, [[5]], tf.constant([np.nan], dtype))
    assert kernels.nonfinite_by_sums([big, bad]).numpy().tolist() == [False, True]


def test_nonfinite_by_sums_of_indexed_slices_reads_their_values():
    values = tf.constant(np.ones((4, 256), "float32"))
    bad = tf.tensor_scatter_nd_update(values, [[2, 7]], [np.inf])
    slices = [tf.IndexedSlices(v, tf.constant([0, 3, 3, 9]), tf.constant([10, 256]))
              for v in (values, bad)]
    assert kernels.nonfinite_by_sums(slices).numpy().tolist() == [False, True]
