"""Forward statistics: what one layer's call did to the range of its dtype.

On a statistics step every controlled layer's call is observed (see
:mod:`keras_mp.adaptive.evidence.hooks`): its floating inputs *as the layer received them*
(after Keras's cast to its compute dtype, so an input that overflowed in the
cast arrives as inf) and its floating outputs. :func:`call_statistics`
reduces each call to three numbers inside the traced step, and :func:`finish`
turns those of all layers into these fields at once (:func:`layer_statistics`
does both for one call):

==================  ==========================================================
``in_amax``         largest ``|input|`` (float32; 0 when one is non-finite).
``out_amax``        largest ``|output|`` (0 when one is non-finite).
``in_range``        1 if an input was non-finite or beyond the largest finite
                    value of the layer's compute dtype (so it overflows, or
                    overflowed, when cast there), else 0.
``out_nonfinite``   1 if an output held inf or nan, else 0.
``out_near_max``    1 if a finite output came within a factor
                    :data:`NEAR_MAX` of the dtype's largest finite value
                    (the next larger activation overflows), else 0.
``out_flushed``     fraction of output elements below the dtype's smallest
                    normal number but not zero: precision lost to
                    subnormals (or to zero, on hardware that flushes them).
``f8_growth``,      float8 evidence of a float8-capable layer, recorded by
``f8_saturated``,   :mod:`keras_mp.adaptive.evidence.float8` (0 for other layers; see
``f8_flushed``      :func:`with_float8`).
==================  ==========================================================

The 0/1 fields become, accumulated over an interval, the fraction of the
observed steps in which it happened.

Example:
    >>> import tensorflow as tf
    >>> from keras_mp.adaptive.evidence.forward import FIELDS, layer_statistics
    >>> s = layer_statistics([tf.constant([1e5, 1.0])], [tf.constant([2.0, 1e-6])], "float16")
    >>> {f: round(float(v), 3) for f, v in zip(FIELDS, s) if not f.startswith("f8")}
    {'in_amax': 100000.0, 'out_amax': 2.0, 'in_range': 1.0, 'out_nonfinite': 0.0, \
'out_near_max': 0.0, 'out_flushed': 0.5}
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import keras
import ml_dtypes
import tensorflow as tf

from keras_mp.device import xla

__all__ = ["FIELDS", "RAW_FIELDS", "MAX_FIELDS", "MEAN_FIELDS", "FLOAT8_FIELDS", "LARGE",
           "NEAR_MAX", "dtype_max", "dtype_tiny", "floating_tensors", "call_statistics", "finish",
           "layer_statistics"]

#: The forward statistics, in the order of :func:`layer_statistics`'s vector.
FIELDS: tuple[str, ...] = ("in_amax", "out_amax", "f8_growth", "in_range", "out_nonfinite",
                           "out_near_max", "out_flushed", "f8_saturated", "f8_flushed")
#: The fields accumulated by maximum, first in :data:`FIELDS` (the others
#: are summed over the steps, then averaged).
MAX_FIELDS: tuple[str, ...] = ("in_amax", "out_amax", "f8_growth")
#: The fractions of elements (two calls of a layer in one step average them).
MEAN_FIELDS: tuple[str, ...] = ("out_flushed", "f8_saturated", "f8_flushed")
#: The float8 evidence fields (see :mod:`keras_mp.adaptive.evidence.float8`).
FLOAT8_FIELDS: tuple[str, ...] = ("f8_growth", "f8_saturated", "f8_flushed")
#: An output within this factor of the dtype's largest finite value is near it.
NEAR_MAX: float = 16.0


_FLOATS = ("float16", "bfloat16", "float32", "float64")


def _float(dtype: str) -> str:
    try:
        name = keras.backend.standardize_dtype(dtype)
    except ValueError:
        name = None
    if name not in _FLOATS:
        raise ValueError(f"`dtype` must be one of {_FLOATS}, got {dtype!r}.")
    return name


def dtype_max(dtype: str) -> float:
    """The largest finite value of a float dtype.

    Example:
        >>> dtype_max("float16"), dtype_max("bfloat16") > 3e38
        (65504.0, True)
    """
    return float(ml_dtypes.finfo(_float(dtype)).max)


def dtype_tiny(dtype: str) -> float:
    """The smallest normal positive value of a float dtype.

    Example:
        >>> dtype_tiny("float16")
        6.103515625e-05
    """
    return float(ml_dtypes.finfo(_float(dtype)).tiny)


def floating_tensors(structure) -> list[tf.Tensor]:
    """The floating-point tensors in a nested structure (others are skipped:
    integer ids, masks, strings, None); of a ragged or sparse tensor its
    values (an ``Embedding`` of ragged ids returns a ``tf.RaggedTensor``).

    Example:
        >>> import tensorflow as tf
        >>> ragged = tf.ragged.constant([[1.0, -4.0], [2.0]])
        >>> found = floating_tensors({"x": ragged, "ids": tf.ones(2, tf.int32)})
        >>> [t.shape.as_list() for t in found]
        [[3]]
    """
    out = []
    for x in keras.tree.flatten(structure):
        if isinstance(x, tf.RaggedTensor):
            x = x.flat_values
        elif isinstance(x, tf.SparseTensor):
            x = x.values
        if isinstance(x, (tf.Tensor, tf.Variable)) or keras.ops.is_tensor(x):
            if x.dtype.is_floating:
                out.append(x)
    return out


#: The subnormal fraction of a tensor larger than this is estimated on an
#: even-stride sample of about this many elements (see
#: :data:`keras_mp.scaling.kernels.SAMPLE`).
SAMPLE = 65536


def _amax_kernel(x: tf.Tensor) -> tf.Tensor:
    # NaN counts as inf: XLA:CPU's max does not propagate NaN, so a
    # non-finite element makes amax inf either way.
    a = tf.abs(tf.cast(x, tf.float32))
    return tf.reduce_max(tf.where(tf.math.is_nan(a), tf.constant(float("inf")), a))


@xla.jit("elementwise")
def _amax(x: tf.Tensor) -> tf.Tensor:
    """Largest ``|x|`` as float32 (inf where an element is inf or nan), one
    fused pass under XLA.

    As TensorFlow ops (``|x|``, max, a float32 copy, ``x * 0``, sum, and a
    strided sample for the subnormal fraction) a statistics step cost
    1.55-1.64x a plain step on an AMX Xeon (the bench's quick bfloat16 MLP
    and CNN); with these kernels and the reuse in :func:`_ranges`,
    1.26-1.43x.
    """
    return _amax_kernel(x)


def _flushed_fraction(sample: tf.Tensor, tiny: tf.Tensor) -> tf.Tensor:
    a = tf.abs(tf.cast(sample, tf.float32))
    return tf.reduce_mean(tf.cast((a > 0.0) & (a < tiny), tf.float32))


@xla.jit("elementwise")
def _amax_and_flushed(x: tf.Tensor, tiny: tf.Tensor, stride: int):
    """:func:`_amax` and the fraction of every ``stride``-th element in
    ``(0, tiny)``, in one XLA computation."""
    return _amax_kernel(x), _flushed_fraction(tf.reshape(x, [-1])[::stride], tiny)


#: A tensor of more elements than this gets its largest ``|x|`` from two
#: TensorFlow reductions (its maximum and minimum; for a 16-bit tensor on CPU,
#: of its bits: :func:`_amax_of_bits`), not from the XLA kernel: XLA:CPU
#: reduces a 16-bit tensor through a float32 copy of it. On GPT-2's
#: ``[2048, 50257]`` bfloat16 logits (2-core AMD EPYC) the kernel raised
#: TensorFlow's allocator peak by 512 MiB, the two reductions by nothing
#: (71.5 against 57.4 ms CPU), and that copy on the statistics step grew the
#: process by 1.2 GB.
LARGE = 1 << 22


def _amax_large(x: tf.Tensor) -> tf.Tensor:
    """:func:`_amax` of a large tensor, copying nothing (TensorFlow's CPU
    reductions propagate NaN); a 16-bit tensor on CPU takes
    :func:`_amax_of_bits`."""
    if x.dtype in _BITS and xla.current_device_type() == "CPU":
        return _amax_of_bits(x)
    hi, lo = tf.reduce_max(x), tf.reduce_min(x)
    bad = tf.math.is_nan(hi) | tf.math.is_nan(lo)
    amax = tf.maximum(tf.cast(hi, tf.float32), -tf.cast(lo, tf.float32))
    return tf.where(bad, tf.constant(float("inf")), amax)


#: 16-bit float dtype -> the bits of its infinity (above them: NaN).
_BITS = {tf.bfloat16: 0x7F80, tf.float16: 0x7C00}


def _amax_of_bits(x: tf.Tensor) -> tf.Tensor:
    """:func:`_amax` of a bfloat16 or float16 tensor from two integer
    reductions of its bits, exact, copying nothing.

    A 16-bit float's bits without the sign order its magnitudes, inf and NaN
    above every finite one. Read as ``int16``, the largest element is the
    positive of largest magnitude (negatives are below 0); read as
    ``uint16``, it is ``0x8000`` plus the largest negative magnitude (where
    there is a negative). TensorFlow's CPU reductions of 16-bit floats
    convert every element to float32 one by one; its integer reductions are
    vectorized. A ``[32, 64, 64, 32]`` bfloat16 activation took 0.98 ms of
    CPU time against 4.52 for ``reduce_max`` and ``reduce_min``; GPT-2's
    ``[2048, 50257]`` bfloat16 logits 25.0 against 90.7 (float16: 0.91
    against 2.22, 23.5 against 35.6; 2-core AMD EPYC with AVX512-BF16).

    Example:
        >>> import tensorflow as tf
        >>> x = tf.constant([[1.5, -3.0], [0.25, 2.0]], tf.bfloat16)
        >>> float(_amax_of_bits(x)), float(_amax_of_bits(-tf.abs(x)))
        (3.0, 3.0)
        >>> float(_amax_of_bits(tf.constant([1.0, float("nan")], tf.float16)))
        inf
    """
    if x.dtype not in _BITS:
        raise ValueError(f"`x` must be bfloat16 or float16, got {x.dtype.name}.")
    positive = tf.reduce_max(tf.bitcast(x, tf.int16))
    # 0x8000 + m -> m; a largest uint16 below 0x8000 (no negative) -> below 0
    negative = tf.bitcast(tf.bitwise.bitwise_xor(tf.reduce_max(tf.bitcast(x, tf.uint16)),
                                                 tf.constant(0x8000, tf.uint16)), tf.int16)
    # NaN (above inf's bits) counts as inf, as in the XLA kernel
    bits = tf.minimum(tf.maximum(positive, negative), tf.constant(_BITS[x.dtype], tf.int16))
    return tf.cast(tf.bitcast(bits, x.dtype), tf.float32)


def _is_large(x: tf.Tensor) -> bool:
    """Whether ``x`` takes the copy-free reductions: more than :data:`LARGE`
    elements, or a size not known when the step is traced.

    A train function's tensors mostly have no static batch size (Keras traces
    it for batches of ``None`` rows). The XLA kernel for all of them gave the
    2-block Transformer (T=256, d=512, batch 64, bfloat16) a float32 copy of
    each activation on its statistics step: TensorFlow's allocator peak rose
    by 270 MiB there, the process by 414 MiB. Choosing at run time instead (a
    ``tf.cond`` on the size, per tensor) made ResNet50V2's statistics trace
    hold 130 MiB more (495 against 366 MiB of heap).
    """
    size = x.shape.num_elements()
    return size is None or size > LARGE


def _stride(size: int) -> int:
    """The sampling stride for a tensor of ``size`` elements."""
    return 1 if size <= SAMPLE else -(-size // SAMPLE)


def _sample(x: tf.Tensor) -> tf.Tensor:
    """Every ``stride``-th element of ``x``, about :data:`SAMPLE` of them
    (all of a smaller tensor); the stride is a tensor where the size is not
    known when the step is traced."""
    size = x.shape.num_elements()
    stride = _stride(size) if size is not None else tf.maximum(
        1, (tf.size(x) + SAMPLE - 1) // SAMPLE)
    return tf.reshape(x, [-1])[::stride]


def _amax_and_flushed_any(x: tf.Tensor, tiny: float):
    """:func:`_amax_and_flushed` for a tensor of any size (see
    :func:`_is_large`); the fraction is taken on :func:`_sample`."""
    if _is_large(x):
        return _large_kernel(x.dtype, tiny)(tf.stop_gradient(x))
    return _amax_and_flushed(x, tf.constant(tiny, tf.float32), _stride(x.shape.num_elements()))


@functools.cache
def _large_kernel(dtype: tf.DType, tiny: float | None) -> Callable:
    """:func:`_amax_large` of a ``dtype`` tensor of any shape and, unless
    ``tiny`` is None, the fraction of :func:`_sample` in ``(0, tiny)``: one
    ``tf.function`` traced once per process for every shape (its signature
    has none) and never inlined (``_noinline``), so that a train step traced
    with statistics holds one call of it per tensor where it held the
    kernel's 25-30 ops, and TensorFlow optimizes the kernel once, not in
    every step's graph.

    The ops of a traced step are made one by one in Python, and every one is
    optimized again with the step's graph on its first call. On keras.io's
    timeseries Transformer (56 layer calls, two train-step traces in its
    ``fit``; 2-core AMD EPYC with AVX512-BF16) the forward statistics took
    2.5 of the 9.5 s its traces took under cProfile, and its step's graph
    held 14,408 nodes in graph optimization (3.2 s; Keras ``mixed_bfloat16``'s:
    5,287 nodes, 0.75 s). With this kernel and :func:`keras_mp.scaling.kernels._stats_function`,
    5,467 nodes (1.06 s), and the first call took 4.5-6.1 s where it took
    8.3-9.2 s (Keras: 5.4-6.7 s, single fits). On its own, 56 calls of the
    kernel (bfloat16 ``[None, 500, 64]``) took 78 ms to trace where its ops
    took 531; the first run 0.16-0.24 s where the inlined kernel took
    0.43-0.50 s and the ops 0.22-0.33 s; later runs alike. Callers hand it
    ``tf.stop_gradient(x)``: under a gradient tape, a function call on a
    watched tensor would be traced again with its gradient.
    """
    def kernel(x):
        if tiny is None:
            return _amax_large(x)
        return _amax_large(x), _flushed_fraction(_sample(x), tf.constant(tiny, tf.float32))

    return tf.function(kernel, input_signature=[tf.TensorSpec(None, dtype)], autograph=False,
                       experimental_attributes={"_noinline": True})


def _ranges(tensors: Sequence[tf.Tensor], memo: dict | None) -> list[tf.Tensor]:
    """:func:`_amax` of each tensor, reusing the amax of a tensor already
    measured in this trace (the previous layer's output is the next one's
    input)."""
    out = []
    for x in tensors:
        if x.shape.num_elements() == 0:
            out.append(tf.constant(0.0))
            continue
        hit = None if memo is None else memo.get(id(x))
        if hit is not None and hit[0] is x:
            out.append(hit[1])
            continue
        amax = _large_kernel(x.dtype, None)(tf.stop_gradient(x)) if _is_large(x) else _amax(x)
        if memo is not None:
            memo[id(x)] = (x, amax)
        out.append(amax)
    return out


def _flushed(tensors: Sequence[tf.Tensor], tiny: float, memo: dict | None):
    """(amax per tensor, fraction of subnormal elements over all tensors)."""
    amaxes, fractions, sizes = [], [], []
    for x in tensors:
        if x.shape.num_elements() == 0:
            amaxes.append(tf.constant(0.0))
            continue
        amax, fraction = _amax_and_flushed_any(x, tiny)
        if memo is not None:
            memo[id(x)] = (x, amax)
        amaxes.append(amax)
        fractions.append(fraction)
        sizes.append(tf.cast(tf.size(x), tf.float32))
    if len(fractions) <= 1:
        return amaxes, fractions[0] if fractions else tf.constant(0.0)
    total = tf.add_n(sizes)
    return amaxes, tf.add_n([f * n for f, n in zip(fractions, sizes)]) / total


def _largest(amaxes: list[tf.Tensor]) -> tf.Tensor:
    return amaxes[0] if len(amaxes) == 1 else tf.reduce_max(tf.stack(amaxes))


#: What a call records while the step runs (:func:`call_statistics`); the
#: rest of :data:`FIELDS` follows from it for all layers at once
#: (:func:`finish`).
RAW_FIELDS: tuple[str, ...] = ("in_amax", "out_amax", "out_flushed")


def call_statistics(inputs: Sequence[tf.Tensor], outputs: Sequence[tf.Tensor],
                    dtype: str, memo: dict | None = None) -> tf.Tensor:
    """One call's raw statistics, a float32 vector in :data:`RAW_FIELDS` order:
    the largest ``|input|`` and ``|output|`` (inf where one is non-finite; 0
    where there is none) and the outputs' subnormal fraction.

    Only these few reductions run per call: comparing them with the dtype's
    range is left to :func:`finish`, once for every layer of the step. Done
    per call, the comparison made a statistics trace 72 graph nodes per layer
    longer than the plain one, against 48 now, and every node of a traced
    step costs the process memory while it lives.

    Args and the memo: as :func:`layer_statistics`.

    Example:
        >>> import tensorflow as tf
        >>> [float(v) for v in call_statistics([tf.constant([3.0, -5.0])], [], "float16")]
        [5.0, 0.0, 0.0]
    """
    tiny = dtype_tiny(dtype)
    zero = tf.constant(0.0)
    in_amax = _largest(_ranges(inputs, memo)) if inputs else zero
    out_amax = out_flushed = zero
    if outputs:
        if dtype in ("float32", "float64"):
            # No narrow dtype: nothing to lose to subnormals here.
            amaxes = _ranges(outputs, memo)
        else:
            amaxes, out_flushed = _flushed(outputs, tiny, memo)
        out_amax = _largest(amaxes)
    return tf.stack([in_amax, out_amax, out_flushed])


def finish(raw: tf.Tensor, dtypes: Sequence[str]) -> tf.Tensor:
    """The forward statistics (:data:`FIELDS`, float8 fields 0) of layers
    whose calls recorded ``raw`` (``[layers, len(RAW_FIELDS)]``, rows of
    :func:`call_statistics`) in compute dtypes ``dtypes`` (one per row).

    Example:
        >>> import tensorflow as tf
        >>> rows = finish(tf.constant([[1e5, 6e4, 0.0], [1e5, 6e4, 0.0]]),
        ...               ["float16", "float32"])
        >>> [dict(zip(FIELDS, r))["in_range"] for r in rows.numpy().tolist()]
        [1.0, 0.0]
    """
    dtypes = list(dtypes)
    if raw.shape.rank != 2 or raw.shape[1] != len(RAW_FIELDS) or raw.shape[0] != len(dtypes):
        raise ValueError(f"`raw` must have shape [len(dtypes), {len(RAW_FIELDS)}] = "
                         f"[{len(dtypes)}, {len(RAW_FIELDS)}], got {raw.shape}.")
    big = tf.constant([dtype_max(d) for d in dtypes], tf.float32)
    zero = tf.zeros_like(big)
    in_amax, out_amax, out_flushed = tf.unstack(tf.cast(raw, tf.float32), axis=1)
    in_bad = tf.logical_not(tf.math.is_finite(in_amax))
    out_bad = tf.logical_not(tf.math.is_finite(out_amax))
    values = {
        "in_amax": tf.where(in_bad, zero, in_amax),  # finite amax: not known here, 0
        "out_amax": tf.where(out_bad, zero, out_amax),
        "in_range": tf.cast(in_bad | (in_amax > big), tf.float32),
        "out_nonfinite": tf.cast(out_bad, tf.float32),
        "out_near_max": tf.cast(tf.logical_not(out_bad) & (out_amax >= big / NEAR_MAX),
                                tf.float32),
        "out_flushed": out_flushed}
    return tf.stack([values.get(f, zero) for f in FIELDS], axis=1)


def layer_statistics(inputs: Sequence[tf.Tensor], outputs: Sequence[tf.Tensor],
                     dtype: str, memo: dict | None = None) -> tf.Tensor:
    """One call's forward statistics, a float32 vector in :data:`FIELDS` order
    (:func:`call_statistics`, then :func:`finish`).

    Args:
        inputs: the call's floating inputs (may be empty).
        outputs: the call's floating outputs (may be empty).
        dtype: the layer's compute dtype.
        memo: a dict kept for the whole traced step, or None: the largest
            ``|x|`` of a tensor measured as one layer's output is reused
            where it is another layer's input.

    Returns:
        A ``[len(FIELDS)]`` float32 tensor.
    """
    return finish(call_statistics(inputs, outputs, dtype, memo)[None], [dtype])[0]


def with_float8(row: tf.Tensor, f8: tf.Tensor) -> tf.Tensor:
    """``row`` (a :func:`layer_statistics` vector) with its float8 fields
    set from ``f8`` (``[f8_growth, f8_saturated, f8_flushed]``)."""
    parts = tf.unstack(row)
    for k, name in enumerate(FLOAT8_FIELDS):
        parts[FIELDS.index(name)] = f8[k]
    return tf.stack(parts)


def combine(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
    """Two calls of one layer in a step (rows of :func:`call_statistics`): the
    maximum of every field but the fractions of elements (:data:`MEAN_FIELDS`),
    which are averaged."""
    mean = tf.constant([f in MEAN_FIELDS for f in RAW_FIELDS])
    return tf.where(mean, (a + b) / 2.0, tf.maximum(a, b))
