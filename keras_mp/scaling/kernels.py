"""Multi-tensor loss-scale kernels: one XLA computation over a whole gradient list.

Every step of mixed-precision training touches every gradient twice outside
the matmuls: to undo the loss scale and to check that it is finite. Done per
tensor that is hundreds of tiny ops; here it is one computation, XLA-compiled
where that pays (GPU/TPU: one launch instead of hundreds; on CPU it runs as a
TensorFlow graph, see :mod:`keras_mp.device.xla`). The same pass can also
measure the statistics that the adaptive precision policy needs, so the loss
scaler and the policy share one mechanism.

Statistics, per gradient tensor (fractions are of the tensor's elements):

========================  ===================================================
``amax``                  largest finite ``|g / scale|``; how close the
                          tensor is to overflowing at the current scale.
``nonfinite``             fraction of inf/nan elements: the step is skipped.
``fp16_underflow``        fraction with ``0 < |g| < 2**-24`` (the smallest
                          float16 subnormal): these become 0 if this gradient
                          is carried in float16 at the current loss scale.
``fp16_subnormal``        fraction with ``2**-24 <= |g| < 2**-14``: kept by
                          float16 but with fewer than 10 bits of precision.
``fp16_overflow``         fraction with ``|g| > 65504``: inf in float16.
``bf16_subnormal``        fraction with ``0 < |g / scale| < 2**-126``: below
                          bfloat16's normal range, where it has no precision.
``zero``                  fraction of exact zeros: a float16 layer whose
                          gradients underflowed shows them here.
========================  ===================================================
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import keras
import tensorflow as tf

from keras_mp.device import xla

__all__ = [
    "GradientStatistics",
    "nonfinite_by_sums",
    "STATISTICS",
    "unscale_and_check",
    "gradient_statistics",
    "unscale_with_statistics",
]

_FP16_TINY = 2.0**-24  # smallest positive float16 subnormal
_FP16_MIN_NORMAL = 2.0**-14
_FP16_MAX = 65504.0
_BF16_MIN_NORMAL = 2.0**-126


class GradientStatistics(NamedTuple):
    """Per-tensor statistics of one gradient list; each field has shape ``[n]``."""

    amax: tf.Tensor
    nonfinite: tf.Tensor
    fp16_underflow: tf.Tensor
    fp16_subnormal: tf.Tensor
    fp16_overflow: tf.Tensor
    bf16_subnormal: tf.Tensor
    zero: tf.Tensor

    def all_finite(self) -> tf.Tensor:
        """A scalar bool: no tensor has a non-finite element."""
        return tf.equal(tf.reduce_max(self.nonfinite), 0.0)


STATISTICS: tuple[str, ...] = GradientStatistics._fields


def _grad_list(grads) -> list:
    # A single tensor is iterable too: it would be unscaled row by row.
    if isinstance(grads, (tf.Tensor, tf.Variable, tf.IndexedSlices, keras.Variable)) \
            or not isinstance(grads, Sequence) and not hasattr(grads, "__iter__"):
        raise TypeError("`grads` must be a list of gradients (tensors, tf.IndexedSlices "
                        f"or None), got {type(grads).__name__}.")
    return list(grads)


def _scale_tensor(scale) -> tf.Tensor:
    if isinstance(scale, (int, float)) and not isinstance(scale, bool) and \
            not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"`scale` must be a finite number > 0, got {scale!r}.")
    # A variable passed to a tf.function is captured by reference; pass its
    # value so that traces never outlive the optimizer that owns it.
    if isinstance(scale, keras.Variable):
        scale = scale.value
    scale = tf.cast(tf.convert_to_tensor(scale), tf.float32)
    if scale.shape.rank not in (0, 1):
        raise ValueError("`scale` must be a scalar, or a vector with one scale per gradient, "
                         f"got shape {scale.shape}.")
    return scale


def _per_tensor(scale: tf.Tensor, index: list[int], n: int) -> tf.Tensor:
    """The scale of the gradients at ``index``: ``scale`` itself if it is one
    scale for all, else its entries there (a vector with one per gradient:
    per-layer loss scales, see :class:`keras_mp.LossScaleOptimizer`)."""
    if scale.shape.rank == 0:
        return scale
    if scale.shape[0] is not None and scale.shape[0] != n:
        raise ValueError(f"`scale` must hold one scale per gradient ({n}), got "
                         f"{scale.shape[0]}.")
    return tf.gather(scale, index)


def _at(scale: tf.Tensor, k: int) -> tf.Tensor:
    return scale if scale.shape.rank == 0 else scale[k]


def _dense(grads):
    """Splits a gradient list into the dense tensors the kernel takes and a
    way to put the results back (None and IndexedSlices stay outside XLA:
    IndexedSlices have a batch-dependent shape that would recompile)."""
    dense_idx = [i for i, g in enumerate(grads)
                 if g is not None and not isinstance(g, tf.IndexedSlices)]
    return dense_idx, [tf.convert_to_tensor(grads[i]) for i in dense_idx]


#: Fractions of a tensor larger than this are estimated on this many of its
#: elements, taken at an even stride (standard error below 0.002, against
#: thresholds of 0.1-0.5); the amax and whether any element is non-finite
#: always see every element. The statistics cost a few passes over every
#: gradient; on a fast 16-bit step that is a large part of the step.
SAMPLE = 65536


def _constants() -> dict[str, tf.Tensor]:
    """The constants of :func:`_tensor_stats`, made once per trace and shared
    by every gradient (each ``tf.constant`` is a graph node of its own)."""
    values = {"zero": 0.0, "one": 1.0, "fp16_tiny": _FP16_TINY,
              "fp16_min_normal": _FP16_MIN_NORMAL, "fp16_max": _FP16_MAX,
              "bf16_min_normal": _BF16_MIN_NORMAL}
    out = {k: tf.constant(v, tf.float32) for k, v in values.items()}
    out["rows"] = tf.constant([len(STATISTICS) - 1, -1])
    out["axis0"], out["axis1"] = tf.constant(0), tf.constant(1)
    return out


def _tensor_stats(g32: tf.Tensor, scale: tf.Tensor, c: dict[str, tf.Tensor]) -> tf.Tensor:
    """The statistics of one float32 gradient ``g32`` at ``scale``, a
    ``[len(STATISTICS)]`` vector; ``g32`` of any shape, known or not.

    The six fractions are counted by one reduction over the six masks
    stacked, with constants shared by all gradients (each a graph node):
    about 40 graph nodes per gradient where counting each apart took 71 (on
    ResNet50V2's 270 gradients the statistics trace held 12,144 nodes more
    than the plain one, and every node of a traced step costs the process
    memory while it lives). Counting all gradients at once
    by segment sums took fewer nodes still, but ran 2.7x slower on a 2-core
    AMD EPYC (TensorFlow's CPU segment sums run on one thread). Where the
    step is a TensorFlow graph, each gradient's statistics are one call of
    :func:`_stats_function` instead (:func:`_fused`).

    The fractions are taken on an even-stride sample of a tensor of more
    than :data:`SAMPLE` elements; the amax and whether any element is
    non-finite always see every element (``inf * 0`` and ``nan * 0`` are
    NaN, so the sum of ``g * 0`` is NaN iff one is). ``max|g| / scale`` is
    ``max|g / scale|`` exactly (rounding a quotient is monotonic).
    """
    size = g32.shape.num_elements()
    if size == 0:
        return tf.zeros([len(STATISTICS)])
    if size is None:
        stride = tf.maximum(1, (tf.size(g32) + SAMPLE - 1) // SAMPLE)
    else:
        stride = -(-size // SAMPLE)
    sample = g32 if size is not None and size <= SAMPLE else tf.reshape(g32, [-1])[::stride]
    zero = c["zero"]
    a, finite = tf.abs(sample), tf.math.is_finite(sample)
    nonzero = a > zero
    masks = tf.stack([
        tf.logical_not(finite),
        nonzero & (a < c["fp16_tiny"]),
        (a >= c["fp16_tiny"]) & (a < c["fp16_min_normal"]),
        finite & (a > c["fp16_max"]),
        # Compared before unscaling: |g / scale| below 2**-126 is a float32
        # subnormal, which XLA:CPU (and TF's CPU kernels) flush to zero, so
        # testing the quotient would never count anything.
        nonzero & (a < c["bf16_min_normal"] * scale),
        tf.equal(a, zero),
    ])
    counted = tf.reduce_sum(tf.reshape(tf.cast(masks, tf.float32), c["rows"]), axis=c["axis1"])
    fractions = counted / tf.maximum(tf.cast(tf.size(sample), tf.float32), c["one"])
    if sample is g32:
        amax = tf.reduce_max(tf.where(finite, a, zero)) / scale
    else:
        bad = tf.math.is_nan(tf.reduce_sum(g32 * zero))
        amax = tf.where(bad, tf.reduce_max(tf.where(finite, a, zero)),
                        tf.reduce_max(tf.abs(g32))) / scale
        every = tf.maximum(tf.cast(tf.size(g32), tf.float32), c["one"])
        fractions = tf.tensor_scatter_nd_max(
            fractions, [[0]], [tf.cast(bad, tf.float32) / every])
    if size is None:  # it may have no element: the maximum of nothing is -inf
        amax = tf.maximum(amax, zero)
    return tf.concat([[amax], fractions], c["axis0"])


@functools.cache
def _stats_function() -> Callable[[tf.Tensor, tf.Tensor], tf.Tensor]:
    """:func:`_tensor_stats` as one ``tf.function`` for gradients of every
    shape (traced once per process: its signature has none) and never inlined
    (``_noinline``), so that a train step traced with gradient statistics
    holds one call per gradient where it held the ~40 ops, and TensorFlow
    optimizes them once, not in every step's graph (see
    :func:`keras_mp.adaptive.evidence.forward._large_kernel` for the
    figures). On keras.io's timeseries Transformer (68 gradients, two
    train-step traces in its ``fit``) the gradient statistics took 1.5 of the
    9.5 s its traces took under cProfile, 0.4 s as calls of this function.

    Where the statistics are an XLA multi-tensor kernel of their own
    (:func:`keras_mp.device.xla.uses_xla`, GPU and TPU) they stay inline ops
    with static shapes: XLA needs a constant stride. (In a whole train step
    compiled by XLA on a CPU the function's call compiles with the step's
    shapes: ``KERAS_MP_EXECUTION=xla`` fits record their statistics.)
    """
    def stats(g32, scale):
        return _tensor_stats(g32, scale, _constants())

    return tf.function(
        stats, autograph=False, experimental_attributes={"_noinline": True},
        input_signature=[tf.TensorSpec(None, tf.float32), tf.TensorSpec([], tf.float32)])


def _fused(grads, scale, *, unscale: bool, stats: bool):
    scale = tf.cast(scale, tf.float32)
    outs, rows, nonfinite = [], [], []
    inline = stats and (xla.uses_xla("multi_tensor") or not tf.inside_function())
    c = _constants() if inline else None
    for k, g in enumerate(grads):
        g32 = tf.cast(g, tf.float32)
        s = _at(scale, k)
        if unscale:
            outs.append(tf.cast(g32 / s, g.dtype))
        if stats:
            rows.append(_tensor_stats(g32, s, c) if inline else _stats_function()(g32, s))
        else:
            nonfinite.append(tf.reduce_any(tf.logical_not(tf.math.is_finite(g32))))
    if stats:
        result = tuple(tf.unstack(tf.stack(rows), axis=1)) if rows else \
            tuple([tf.zeros([0])] * len(STATISTICS))
    else:
        result = tf.stack(nonfinite) if nonfinite else tf.zeros([0], tf.bool)
    return outs, result


@xla.jit("multi_tensor")
def _unscale_check_kernel(grads, scale):
    return _fused(grads, scale, unscale=True, stats=False)


# The statistics are many elementwise ops and reductions per tensor, over the
# whole gradient list: one computation, compiled by XLA where multi-tensor
# kernels are (GPU/TPU), a TensorFlow graph on CPU. XLA:CPU was at most a little
# faster (unscale+statistics of a 4x512 MLP's gradients on a 2-core AMX Xeon:
# 4.9 ms vs 6.1 ms; of a 2-block d=512 Transformer's 34 gradients on a 2-core
# AMD EPYC: 19.2 vs 19.5 ms CPU, medians of 7 interleaved rounds), on one step
# in 20, but compiling that one large module held ~50 MiB more in the process
# and raised a training run's peak memory by as much again (the same
# Transformer, T=256, batch 64: statistics step +359 MiB compiled, +139-259 as
# a graph).
@xla.jit("multi_tensor")
def _stats_kernel(grads, scale):
    return _fused(grads, scale, unscale=False, stats=True)[1]


@xla.jit("multi_tensor")
def _unscale_stats_kernel(grads, scale):
    return _fused(grads, scale, unscale=True, stats=True)


def _merge(grads, dense_idx, dense_out, scale):
    out = list(grads)
    for i, u in zip(dense_idx, dense_out):
        out[i] = u
    for i, g in enumerate(grads):
        if isinstance(g, tf.IndexedSlices):
            v = tf.cast(tf.cast(g.values, tf.float32) / _at(scale, i), g.values.dtype)
            out[i] = tf.IndexedSlices(v, g.indices, g.dense_shape)
    return out


def _slices_nonfinite(grads) -> list[tf.Tensor]:
    return [tf.reduce_any(tf.logical_not(tf.math.is_finite(g.values)))
            for g in grads if isinstance(g, tf.IndexedSlices)]


def nonfinite_by_sums(grads: Sequence) -> tf.Tensor:
    """Per gradient, whether it holds an inf or NaN, from one sum each: no
    unscaling, one pass over each gradient and no temporary (what a loss
    scale of exactly 1 needs: :class:`keras_mp.LossScaleOptimizer` with
    ``FixedLossScale(1.0)``). A gradient whose elements sum beyond float32's
    range (their magnitudes near 3.4e38 over its size) counts as non-finite.

    A float32 gradient of :data:`ROW` elements or more is summed as a matrix
    times a vector of ones (:func:`_sum`): the same pass over its memory, at a
    third of ``reduce_sum``'s CPU time on a 2-core AMD EPYC (the ten gradients
    of a 4x512 MLP, 4.2 MB: 77-84 us against 224 us a call over an empty
    graph's, 9 rounds of 200 calls); an inf or NaN still makes the sum
    non-finite (``nan * 1``, ``inf - inf``).

    Example:
        >>> import tensorflow as tf
        >>> nonfinite_by_sums([tf.constant([1.0, float("inf")]), None,
        ...                    tf.constant([2.0])]).numpy().tolist()
        [True, False, False]
    """
    grads = _grad_list(grads)
    if not grads:
        return tf.zeros([0], tf.bool)
    sums = [tf.constant(0.0) if g is None else
            _sum(g.values if isinstance(g, tf.IndexedSlices) else g) for g in grads]
    return tf.logical_not(tf.math.is_finite(tf.stack(sums)))  # one check for all the sums


#: Row length of the matrix a float32 gradient is summed as (:func:`_sum`).
ROW = 256


def _sum(g: tf.Tensor) -> tf.Tensor:
    """The float32 sum of ``g``'s elements: a float32 tensor whose size is a
    known multiple of :data:`ROW` as rows of that length times ones, then
    the row sums (a matrix-vector product); any other with ``reduce_sum``
    (16-bit ones in float32, so that a float16 sum cannot overflow)."""
    size = g.shape.num_elements()
    if g.dtype != tf.float32 or size is None or size < ROW or size % ROW:
        return tf.reduce_sum(tf.cast(g, tf.float32))
    rows = tf.linalg.matvec(tf.reshape(g, [size // ROW, ROW]), tf.ones([ROW], tf.float32))
    return tf.reduce_sum(rows)


def nonfinite_mask(grads: Sequence, scale) -> tf.Tensor:
    """A bool vector, one entry per gradient in ``grads`` (False for None):
    True where the gradient holds inf or nan."""
    return unscale_and_check(grads, scale, return_mask=True)[1]


def unscale_and_check(grads: Sequence, scale, *, return_mask: bool = False):
    """Divides every gradient by ``scale`` and checks all are finite, in one
    compiled computation.

    Args:
        grads: a list of gradients (tensors, ``tf.IndexedSlices`` or None).
        scale: the loss scale, a scalar, or a vector with one scale per
            gradient (per-layer loss scales).
        return_mask: if True, return a per-gradient bool vector of
            non-finite gradients instead of the single flag.

    Returns:
        ``(unscaled_grads, all_finite)``: the list in the same structure
        (None stays None; dtypes are kept) and a scalar bool tensor, or the
        per-gradient mask when ``return_mask``.

    Example:
        >>> import tensorflow as tf, keras_mp
        >>> g, ok = keras_mp.scaling.kernels.unscale_and_check(
        ...     [tf.constant([4.0, 8.0]), None], 4.0)
        >>> g[0].numpy().tolist(), g[1], bool(ok)
        ([1.0, 2.0], None, True)
    """
    grads = _grad_list(grads)
    scale = _scale_tensor(scale)
    dense_idx, dense = _dense(grads)
    dense_out, dense_nonfinite = _unscale_check_kernel(
        dense, _per_tensor(scale, dense_idx, len(grads))) if dense else ([], None)
    mask = [tf.constant(False)] * len(grads)
    for k, i in enumerate(dense_idx):
        mask[i] = dense_nonfinite[k]
    slices = iter(_slices_nonfinite(grads))
    for i, g in enumerate(grads):
        if isinstance(g, tf.IndexedSlices):
            mask[i] = next(slices)
    mask_t = tf.stack(mask) if mask else tf.zeros([0], tf.bool)
    unscaled = _merge(grads, dense_idx, dense_out, scale)
    if return_mask:
        return unscaled, mask_t
    return unscaled, tf.logical_not(tf.reduce_any(mask_t))


def _scatter_stats(n, dense_idx, columns) -> GradientStatistics:
    if len(dense_idx) == n:
        return GradientStatistics(*columns)
    idx = tf.constant([[i] for i in dense_idx], tf.int32, shape=[len(dense_idx), 1])
    return GradientStatistics(*[tf.scatter_nd(idx, c, [n]) for c in columns])


def gradient_statistics(grads: Sequence, scale) -> GradientStatistics:
    """Statistics of every gradient at the current loss scale, in one pass.

    Args:
        grads: a list of (loss-scaled) gradients; None and
            ``tf.IndexedSlices`` entries get all-zero statistics.
        scale: the loss scale the gradients carry (a scalar, or one per
            gradient).

    Returns:
        A :class:`GradientStatistics` whose fields are float32 vectors with
        one entry per gradient (see the module docstring for each field).

    Example:
        >>> import tensorflow as tf, keras_mp
        >>> s = keras_mp.scaling.kernels.gradient_statistics(
        ...     [tf.constant([1e-9, 1.0, float("inf"), 0.0])], 1.0)
        >>> float(s.nonfinite[0]), float(s.fp16_underflow[0]), float(s.zero[0])
        (0.25, 0.25, 0.25)
    """
    grads = _grad_list(grads)
    scale = _scale_tensor(scale)
    dense_idx, dense = _dense(grads)
    if not dense:
        return GradientStatistics(*[tf.zeros([len(grads)])] * len(STATISTICS))
    return _scatter_stats(len(grads), dense_idx,
                          _stats_kernel(dense, _per_tensor(scale, dense_idx, len(grads))))


def unscale_with_statistics(grads: Sequence, scale):
    """:func:`unscale_and_check` and :func:`gradient_statistics` in one pass.

    Returns:
        ``(unscaled_grads, statistics)``; ``statistics.all_finite()`` is the
        finite flag. Non-finite ``tf.IndexedSlices`` gradients are counted in
        ``statistics.nonfinite`` as a fraction of 1.
    """
    grads = _grad_list(grads)
    scale = _scale_tensor(scale)
    dense_idx, dense = _dense(grads)
    if dense:
        dense_out, columns = _unscale_stats_kernel(dense, _per_tensor(scale, dense_idx,
                                                                      len(grads)))
        stats = _scatter_stats(len(grads), dense_idx, columns)
    else:
        dense_out = []
        stats = GradientStatistics(*[tf.zeros([len(grads)])] * len(STATISTICS))
    slice_idx = [i for i, g in enumerate(grads) if isinstance(g, tf.IndexedSlices)]
    if slice_idx:
        flags = tf.cast(tf.stack(_slices_nonfinite(grads)), tf.float32)
        idx = tf.constant([[i] for i in slice_idx], tf.int32)
        stats = stats._replace(
            nonfinite=stats.nonfinite + tf.scatter_nd(idx, flags, [len(grads)]))
    return _merge(grads, dense_idx, dense_out, scale), stats
