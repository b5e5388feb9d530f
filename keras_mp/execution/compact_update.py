"""Adam and AdamW updates over bfloat16 moments or weights, computed in float32.

Where an optimizer's moments are stored in bfloat16
(:mod:`keras_mp.adaptive.storage.moments`), Keras's ``Adam.update_step``
would still run: its arithmetic is float32 (a float32 gradient promotes the
bfloat16 moment), but each moment is written back rounded to nearest, and
Adam's second moment moves by ``(1 - beta_2) = 0.1 %`` of itself per step,
less than half a bfloat16 ulp (0.2-0.4 %): ``v * 0.999`` rounds back to
``v``, so it can grow but never decay. :func:`adam` computes the update as
TensorFlow's ``ResourceApplyAdam`` formula in float32 (dequantize, update,
requantize)::

    m32, v32 = float32(m), float32(v)
    m32 += (g - m32) * (1 - beta_1);  v32 += (g * g - v32) * (1 - beta_2)
    w   -= lr * sqrt(1 - beta_2 ** t) / (1 - beta_1 ** t) * m32 / (sqrt(v32) + epsilon)
    m, v = nearest(m32), dithered(v32)

The first moment moves by ``1 - beta_1 = 10 %`` of its distance to the
gradient a step and is rounded to nearest. The second is written back with
**dithered rounding**: its 16 dropped bits are compared with a number in
``[0, 2**16)`` from a deterministic sequence of the element's index, the
step and the variable's index in the optimizer (a Weyl sequence: each
element's numbers run through all 65536 values, evenly spread, before one
repeats), so it is rounded up with the probability of its remainder and its
expected value is the float32 one (stochastic rounding, reproducible: a
seeded run repeats bit for bit, a resumed run continues the same sequence,
replicas agree). Measured with ``python -m benchmarks.compact_quality``
(1000 steps, held-out loss against Keras float32's): both moments dithered
with one sequence (the second's half a period on) ended 1.4 % and 2.1 %
above float32 on seeds 0 and 1, the first to nearest 0.3 % above and 0.1 %
below (docs/benchmarks.md). The function is XLA-compiled wherever XLA runs
(:func:`compiled`), also where keras-mp's timing-based XLA is off (a short
fit): one pass over the variable's memory, as TensorFlow's fused kernel, where
its TensorFlow ops make a new tensor of the variable's size per step.

The same update serves weights stored in bfloat16
(:mod:`keras_mp.adaptive.storage.trained`): the weight is read in float32,
AdamW's decay applied to it there (Keras's own, in the weight's dtype, is
below half a bfloat16 ulp; of a float32 weight it is a temporary of the
weight's size: Keras's is left out for every variable this update takes), and
the new value written back with dithered rounding too (its numbers half a
period on from the second moment's). An embedding's sparse gradient
(``tf.IndexedSlices``) takes the update of the dense gradient Keras's Adam
makes of it, the second moment from the sum of each lookup's square (Keras
squares the slices before it adds them up), without making it dense
(:func:`_sparse`). Inside a graph the updates run one variable after
another: each makes its new values before it assigns them, and run together
(a graph runs independent ops together) every variable's new values were
alive at once (the 100M-parameter Llama of ``benchmarks/llm_memory.py``
peaked above 3.7 GiB instead of 2.9-3.1).

With all three (the update compiled in a short fit, the sparse gradient
kept sparse, AdamW's decay inside), that Llama's full fine-tune with compact
weights and moments peaked at 2576 MiB instead of 2970-3028, 0.74x Keras
float32's, and its step took 0.62 s instead of 1.49 (Keras
``mixed_bfloat16``: 0.68 s; docs/benchmarks.md).

The slots and weights of SGD with momentum, Adamax, Nadam and Lion
(:data:`SLOTS`) are updated by the rules of
:mod:`keras_mp.execution.compact_rules`, Adafactor's by
:mod:`keras_mp.execution.compact_adafactor`, with this module's rounding
(:func:`weight_back` for a bfloat16 weight), decay and
one-variable-at-a-time order.

Measured (100M parameters in 4 variables, median of 5 updates, process CPU
time, 2-core AMD EPYC with AVX512-BF16 under load, TF 2.21): ``ResourceApplyAdam``
on float32 moments 0.098 s, Keras's ``update_step`` as TensorFlow ops 0.377 s,
this update as TensorFlow ops 0.705 s and XLA-compiled 0.171 s
(0.164 s with nearest rounding instead of dithered).

Example:
    >>> import numpy as np, tensorflow as tf
    >>> from keras_mp.execution import compact_update
    >>> x = tf.constant([1.0 + 2.0 ** -9] * 4096)      # half a bfloat16 ulp above 1
    >>> r = compact_update.dithered(x, compact_update.dither(x.shape, 0, 0, 0))
    >>> sorted(set(float(v) for v in r.numpy()))       # 1 or the next bfloat16 up
    [1.0, 1.0078125]
    >>> abs(float(tf.reduce_mean(tf.cast(r, tf.float32))) - (1.0 + 2.0 ** -9)) < 1e-4
    True
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from keras_mp import _checks as checks
from keras_mp import _installed
from keras_mp.device import xla

__all__ = ["MOMENT_DTYPE", "SLOTS", "STATISTICS", "WEIGHTS", "WEIGHT_SALT", "adam", "applies",
           "below_half_ulp", "compact_weight", "compiled", "dither", "dithered", "keep_statistics",
           "statistic", "weight_back"]

#: The dtype compact moments are stored in.
MOMENT_DTYPE = tf.bfloat16
#: The attribute of an optimizer's :func:`keras_mp._installed.installed`
#: holder that holds the ids of the trained weights stored in bfloat16.
WEIGHTS = "compact_weights"
#: Where a weight's rounding numbers start in the sequence (the second
#: moment's start at 0): half a period on.
WEIGHT_SALT = 0x8000
#: The attribute of an optimizer's holder that keeps the compact weights'
#: update-to-ulp statistics (:func:`keep_statistics`).
STATISTICS = "update_statistics"
#: The optimizer classes (exact) whose slots can be stored in bfloat16, and
#: the attributes holding those slot lists: Adam's and AdamW's update is
#: :func:`adam`, Adafactor's :mod:`keras_mp.execution.compact_adafactor`'s,
#: the others' :mod:`keras_mp.execution.compact_rules`'.
SLOTS: dict[type, tuple[str, ...]] = {
    keras.optimizers.Adam: ("_momentums", "_velocities"),
    keras.optimizers.AdamW: ("_momentums", "_velocities"),
    keras.optimizers.SGD: ("momentums",), keras.optimizers.Adamax: ("_m", "_u"),
    keras.optimizers.Nadam: ("_momentums", "_velocities"),
    keras.optimizers.Lion: ("_momentums",),
    # Adafactor's factored _r and _c stay float32 (keras_mp.execution.compact_adafactor).
    keras.optimizers.Adafactor: ("_v",)}
_ADAMS = (keras.optimizers.Adam, keras.optimizers.AdamW)
_DECAY = "_use_weight_decay"
_LAST = "compact_update_last"   # (graph, the last update's op) in the optimizer's holder
_LOW = 0xFFFF
# Odd multipliers: each term runs through all 2**16 values (the step's at
# about the golden ratio of the period, so consecutive steps spread evenly).
_ELEMENT, _STEP, _VARIABLE = 20011, 25033, 131


def _float32(**tensors) -> None:
    """Raises TypeError naming the first of ``tensors`` (a rule's gradient,
    weight and slots) that is not a float32 tensor."""
    for name, x in tensors.items():
        if getattr(x, "dtype", None) != tf.float32:
            raise TypeError(f"`{name}` must be a float32 tensor, got {x!r}.")


def dither(shape, step, variable: int, salt: int, *, compiled: bool = False) -> tf.Tensor:
    """Numbers in ``[0, 2**16)``, one per element of ``shape``, from the
    element's index, ``step`` and ``variable`` (int32 arithmetic that never
    overflows), shifted by ``salt`` (an int in ``[0, 2**16)``).

    ``compiled``: the caller is XLA-compiled, which needs the number of
    elements as a constant (and never makes the index as a tensor of its
    own). Elsewhere the count is a value of the run (``step``'s), so that
    TensorFlow's graph optimizer cannot fold the index into a constant: 4
    bytes per element, kept with the graph, 400 MiB on the 100M-parameter
    Llama of ``benchmarks/llm_memory.py``.
    """
    checks.count("salt", salt, 0, _LOW)
    step = tf.bitwise.bitwise_and(tf.cast(step, tf.int32), _LOW)
    count = tf.cast(tf.reduce_prod(shape), tf.int32)
    if not compiled:
        count = count + tf.minimum(step, 0)   # step >= 0: the same count, known only at run time
    return _numbers(tf.reshape(tf.range(count, dtype=tf.int32), shape), step, variable, salt)


def _numbers(index: tf.Tensor, step: tf.Tensor, variable: int, salt: int) -> tf.Tensor:
    """:func:`dither`'s numbers of the elements at ``index`` (int32, their
    flat positions in the variable; only the low 16 bits count), ``step``
    already masked to 16 bits."""
    offset = tf.bitwise.bitwise_and(step * _STEP, _LOW) + (variable % 256) * _VARIABLE + salt
    return tf.bitwise.bitwise_and(
        tf.bitwise.bitwise_and(tf.bitwise.bitwise_and(index, _LOW) * _ELEMENT, _LOW) + offset,
        _LOW)


def _row_numbers(rows: tf.Tensor, shape, step, variable: int, salt: int) -> tf.Tensor:
    """:func:`dither`'s numbers of the rows ``rows`` of a variable of
    ``shape``: the same numbers :func:`dither` gives those elements."""
    width = tf.cast(tf.reduce_prod(shape[1:]), tf.int64)
    index = (tf.cast(rows, tf.int64)[:, None] * width
             + tf.range(width, dtype=tf.int64)[None, :])
    index = tf.cast(tf.bitwise.bitwise_and(index, _LOW), tf.int32)
    step = tf.bitwise.bitwise_and(tf.cast(step, tf.int32), _LOW)
    return _numbers(tf.reshape(index, tf.concat([tf.shape(rows), shape[1:]], 0)), step,
                    variable, salt)


def dithered(value: tf.Tensor, noise: tf.Tensor) -> tf.Tensor:
    """``value`` (float32) in bfloat16, its dropped 16 bits rounded up where
    they exceed ``noise`` (:func:`dither`), else down."""
    if getattr(value, "dtype", None) != tf.float32:
        raise TypeError(f"`value` must be a float32 tensor, got {value!r}.")
    bits = tf.bitcast(value, tf.int32) + noise
    return tf.cast(tf.bitcast(tf.bitwise.bitwise_and(bits, tf.constant(-65536, tf.int32)),
                              tf.float32), MOMENT_DTYPE)


def _math(g, squared, w, m, v, alpha, beta_1, beta_2, epsilon, decay, numbers):
    """The update of the module's docstring; ``g`` and ``squared`` None: a
    zero gradient (the rows a sparse gradient does not reach);
    ``numbers(salt)``: the rounding's numbers of these elements."""
    f32 = tf.float32
    compact = w.dtype != f32
    w = old = tf.cast(w, f32)
    w = w - w * decay    # AdamW's decoupled decay, in float32 (Keras's skipped it)
    m32 = tf.cast(m, f32)
    v32 = tf.cast(v, f32)
    if g is None:
        m32 = m32 - m32 * (1.0 - beta_1)
        v32 = v32 - v32 * (1.0 - beta_2)
    else:
        g = tf.cast(g, f32)
        squared = tf.square(g) if squared is None else squared
        m32 = m32 + (g - m32) * (1.0 - beta_1)
        v32 = v32 + (squared - v32) * (1.0 - beta_2)
    new, lost = weight_back(old, w - alpha * m32 / (tf.sqrt(v32) + epsilon), compact, numbers)
    if v.dtype != f32:
        v32 = dithered(v32, numbers(0))
    return new, tf.cast(m32, m.dtype), v32, lost


def weight_back(old: tf.Tensor, new: tf.Tensor, compact: bool, numbers) -> tuple:
    """A weight's new float32 value as it is stored, and its update-to-ulp
    statistic: for a bfloat16 weight (``compact``) dithered with
    ``numbers(WEIGHT_SALT)`` and :func:`below_half_ulp` of the update; else
    as it is, and NaN (no statistic). Shared by every compact update.

    Raises:
        TypeError: ``compact`` is not a bool.

    Example:
        >>> import tensorflow as tf
        >>> def numbers(salt):
        ...     return tf.zeros(4, tf.int32)
        >>> new, lost = weight_back(tf.ones(4), tf.ones(4) * 1.5, True, numbers)
        >>> new.dtype.name, float(lost)
        ('bfloat16', 0.0)
    """
    if not isinstance(compact, bool):
        raise TypeError(f"`compact` must be True or False, got {compact!r}.")
    if not compact:
        return new, tf.constant(float("nan"))
    return dithered(new, numbers(WEIGHT_SALT)), below_half_ulp(old, new)


def below_half_ulp(old: tf.Tensor, new: tf.Tensor) -> tf.Tensor:
    """The fraction of elements whose update from ``old`` to ``new``
    (float32) is below half a bfloat16 ulp of ``old``: the updates that
    rounding to nearest would lose, and stochastic rounding keeps on average
    (the update-to-ulp statistic).

    Example:
        >>> import tensorflow as tf
        >>> old = tf.constant([1.0, 1.0, 1.0, 1.0])        # half an ulp: 2**-9
        >>> float(below_half_ulp(old, old + [1e-4, -1e-3, 1e-2, 0.0]))
        0.75
    """
    exponent = tf.bitwise.bitwise_and(tf.bitcast(old, tf.int32), 0x7F800000)
    half = tf.bitcast(exponent, tf.float32) * 2.0 ** -8
    return tf.reduce_mean(tf.cast(tf.abs(new - old) < half, tf.float32))


def _adam_ops(gradient, squared, variable, m, v, alpha, beta_1, beta_2, epsilon, decay, step,
              index, compiled):
    def numbers(salt):
        return dither(tf.shape(variable), step, index, salt, compiled=compiled)
    return _math(gradient, squared, variable, m, v, alpha, beta_1, beta_2, epsilon, decay,
                 numbers)


_adam_xla = tf.function(_adam_ops, jit_compile=True, autograph=False)
_adam_graph = tf.function(_adam_ops, autograph=False)


def compiled() -> bool:
    """Whether the update is XLA-compiled: wherever XLA runs on this device,
    unless ``keras_mp.config.set_xla("elementwise", False)`` forbids it.

    Not a decision from timings (:func:`keras_mp.device.xla.uses_xla`, which
    a short fit turns off), so that a seeded run computes the same whatever
    was measured: a memory need. As TensorFlow ops, each of the update's
    steps makes a new tensor of the variable's size (the element index, the
    float32 casts, the products): on the 24.6M-parameter token table of
    ``benchmarks/llm_memory.py``'s Llama six of them, 563 MiB, were alive at
    the step's peak; compiled, the update makes only its results. The
    variable is flattened first, so that variables of one size share a
    compilation (keras.applications' ResNet50V2: 22 sizes among 28 shapes).
    Small variables are compiled too: their updates as TensorFlow ops made
    ResNet50V2's first step take 12-14 s more CPU time than with float32
    state, compiled 4-7 s (2-core AMD EPYC; the train step's graph grows by
    some 40 ops a variable).
    """
    return xla.forced("elementwise") is not False and xla.xla_available()


def _adam(gradient, squared, variable, m, v, *rest, flat: bool = False):
    """The update's new weight, moments and statistic; ``flat``: the first
    three flattened (as the compiled update makes them)."""
    shape = tf.shape(variable)
    if not compiled():
        run = _adam_ops if tf.inside_function() else _adam_graph
        *state, lost = run(gradient, squared, variable, m, v, *rest, False)
        return [tf.reshape(t, [-1]) if flat else t for t in state] + [lost]
    inputs = [None if t is None else tf.reshape(t, [-1])
              for t in (gradient, squared, variable, m, v)]
    *state, lost = _adam_xla(*inputs, *rest, True)
    return [t if flat else tf.reshape(t, shape) for t in state] + [lost]


def _holds(optimizer: Any, variable: Any) -> tuple[int, Any] | None:
    """(index, Keras variable) of ``variable`` in ``optimizer``, or None."""
    try:
        i = optimizer._get_variable_index(variable)
    except (KeyError, AttributeError):
        return None
    return i, optimizer._trainable_variables[i]


def compact_weight(optimizer: Any, variable: Any) -> bool:
    """Whether ``variable`` is a weight ``optimizer`` trains that
    :mod:`keras_mp.adaptive.storage.trained` stored in bfloat16 (its update
    is :func:`adam`'s or a rule of :mod:`keras_mp.execution.compact_rules`,
    its weight decay applied there in float32).

    Raises:
        TypeError: ``optimizer`` is not a Keras optimizer.
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"`optimizer` must be a Keras optimizer, got {optimizer!r}.")
    ids = getattr(_installed.installed(optimizer), WEIGHTS, None)
    held = _holds(optimizer, variable) if ids else None
    return held is not None and id(held[1]) in ids and held[1]._dtype == "bfloat16"


def applies(optimizer: Any, variable: Any) -> bool:
    """Whether ``variable``'s update in ``optimizer`` is computed over its
    compact state (:func:`adam`, or
    :func:`keras_mp.execution.compact_rules.update`): an exact class of
    :data:`SLOTS` (Adam and AdamW without AMSGrad, SGD with momentum,
    Adamax, Nadam, Lion, Adafactor), and a
    float32 variable whose slots are all stored in bfloat16, or a weight
    stored so (:func:`compact_weight`)."""
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"`optimizer` must be a Keras optimizer, got {optimizer!r}.")
    names = SLOTS.get(type(optimizer))
    if names is None or getattr(optimizer, "amsgrad", False):
        return False
    slots = [getattr(optimizer, name, None) for name in names]
    if not all(slots):
        return False   # not built, or SGD without momentum
    if compact_weight(optimizer, variable):
        return True
    if variable.dtype != "float32":
        return False   # a 16-bit variable of the user's own: Keras's update
    i = optimizer._get_variable_index(variable)
    return all(s[i] is not None and s[i]._dtype == "bfloat16" for s in slots)


def _takes(gradient: Any, variable: Any) -> bool:
    """Whether ``gradient`` is a tensor or ``tf.IndexedSlices`` of
    ``variable``'s dtype or float32."""
    values = gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient
    return isinstance(values, tf.Tensor) and values.dtype in (tf.float32,
                                                              tf.as_dtype(variable.dtype))


def _decay(optimizer, variable, lr) -> tf.Tensor:
    """The decoupled weight decay this update applies in float32: where
    Keras's own is left out (for a bfloat16 weight always:
    keras_mp.adaptive.storage.trained.exclude_decay), else 0."""
    wd = getattr(optimizer, "weight_decay", None)
    ours = compact_weight(optimizer, variable) or _installed.is_wrapped(optimizer, _DECAY)
    return lr * tf.cast(wd, tf.float32) if wd and ours and \
        _installed.original(optimizer, _DECAY)(variable) else tf.zeros([], tf.float32)


def _in_order(optimizer, make) -> None:
    """Runs ``make(holder)`` (the update's ops) after the last update made
    in this graph. One variable at a time: the update makes new values
    before it assigns them (TensorFlow's fused kernel writes in place), and a
    graph runs independent updates together, so without this order every
    variable's new values (a second copy of weights and moments) could be
    alive at once."""
    held = _installed.installed(optimizer)
    graph = tf.compat.v1.get_default_graph() if tf.inside_function() else None
    last = getattr(held, _LAST, None)
    with tf.control_dependencies([last[1]] if last is not None and last[0] is graph else []):
        done = make(held)
    if graph is not None:
        setattr(held, _LAST, (graph, tf.group(done)))


def adam(optimizer: Any, gradient: tf.Tensor, variable: Any, learning_rate: Any) -> bool:
    """Applies ``optimizer``'s Adam update of ``variable`` in float32 over its
    bfloat16 moments or to its bfloat16 weight (see the module's docstring);
    returns False, doing nothing, where ``optimizer`` is not an Adam or
    AdamW, :func:`applies` does not hold or the gradient is neither a tensor
    nor ``tf.IndexedSlices`` of the variable's dtype or float32."""
    if not applies(optimizer, variable) or type(optimizer) not in _ADAMS \
            or not _takes(gradient, variable):
        return False
    i = optimizer._get_variable_index(variable)
    f32 = tf.float32
    step = tf.cast(optimizer.iterations + 1, f32)
    beta_1 = tf.constant(optimizer.beta_1, f32)
    beta_2 = tf.constant(optimizer.beta_2, f32)
    lr = tf.cast(learning_rate, f32)
    alpha = lr * tf.sqrt(1 - tf.pow(beta_2, step)) / (1 - tf.pow(beta_1, step))
    hyper = (alpha, beta_1, beta_2, tf.constant(optimizer.epsilon, f32),
             _decay(optimizer, variable, lr))
    m, v = optimizer._momentums[i], optimizer._velocities[i]

    def make(held):
        if isinstance(gradient, tf.IndexedSlices):
            done, lost = _sparse(gradient, variable, m, v, hyper, optimizer.iterations, i)
        else:
            *new, lost = _adam(gradient, None, tf.convert_to_tensor(variable),
                               tf.convert_to_tensor(m), tf.convert_to_tensor(v), *hyper,
                               tf.convert_to_tensor(optimizer.iterations),
                               tf.constant(i, tf.int32))
            done = _assign((variable, m, v), new)
        return done + _note(held, variable, lost)
    _in_order(optimizer, make)
    return True


def _sparse(gradient: tf.IndexedSlices, variable, m, v, hyper, iterations,
            i: int) -> tuple[list, tf.Tensor]:
    """An embedding's update from its sparse gradient, as Keras's Adam
    computes it made dense (every row's moments decay and its weight moves;
    the second moment from the sum of each lookup's squared gradient, not the
    square of their sum), without making it dense: every row is updated with
    a zero gradient, the rows the batch reached are computed again from their
    old values and their gradients summed per row, and written over those.
    A dense float32 gradient and its square were two copies of the table
    (188 MiB for the 32000 x 768 token table of ``benchmarks/llm_memory.py``'s
    Llama). No sparse op touches the variables: after one, TensorFlow copies
    a variable on every read (three more copies of the table). Returns the
    assignments and the update-to-ulp statistic of the reached rows."""
    rows, position = tf.unique(gradient.indices)
    count = tf.size(rows)
    values = tf.cast(gradient.values, tf.float32)
    g = tf.math.unsorted_segment_sum(values, position, count)
    squared = tf.math.unsorted_segment_sum(tf.square(values), position, count)
    state = [tf.convert_to_tensor(x) for x in (variable, m, v)]
    *decayed, _ = _adam(None, None, *state, *hyper, tf.convert_to_tensor(iterations),
                        tf.constant(i, tf.int32), flat=True)
    shape = tf.shape(state[0])

    def numbers(salt):
        return _row_numbers(rows, shape, iterations, i, salt)
    *reached, lost = _math(g, squared, *(tf.gather(x, rows) for x in state), *hyper, numbers)
    # Written over in the flat values the update made: there TensorFlow's
    # scatter takes the buffer as it is (shaped, it copied two of the three).
    width = tf.cast(tf.reduce_prod(shape[1:]), rows.dtype)
    at = tf.reshape(rows[:, None] * width + tf.range(width, dtype=rows.dtype)[None, :], [-1, 1])
    return _assign((variable, m, v), [
        tf.reshape(tf.tensor_scatter_nd_update(x, at, tf.reshape(y, [-1])), shape)
        for x, y in zip(decayed, reached)]), lost


def _note(held, variable, lost) -> list:
    """Keeps a compact weight's update-to-ulp statistic of this step where
    :func:`keep_statistics` made it a place (an op to run with the update)."""
    kept = (getattr(held, STATISTICS, None) or {}).get(id(_tf_variable(variable)))
    return [] if kept is None else [kept.assign(lost, read_value=False)]


def keep_statistics(optimizer: Any, variables) -> None:
    """Makes a place, per compact weight in ``variables``, for the fraction
    of its last update's elements below half a bfloat16 ulp
    (:func:`below_half_ulp`), read by :func:`statistic`; eagerly, before a
    train step is traced (at the start of ``fit``).

    Raises:
        TypeError: ``optimizer`` is not a Keras optimizer.
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"`optimizer` must be a Keras optimizer, got {optimizer!r}.")
    held = _installed.installed(optimizer)
    kept = getattr(held, STATISTICS, None) or {}
    wanted = {id(_tf_variable(v)): v for v in variables}
    # The places already made stay (a train step traced before assigns them).
    kept = {k: kept[k] if k in kept
            else tf.Variable(float("nan"), trainable=False, name="below_half_ulp")
            for k in wanted}
    setattr(held, STATISTICS, kept)


def statistic(optimizer: Any, variable: Any) -> float | None:
    """``variable``'s last update-to-ulp statistic kept in ``optimizer``
    (:func:`keep_statistics`): the fraction of its elements whose float32
    update was below half a bfloat16 ulp; None where none is kept or no
    update ran yet."""
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"`optimizer` must be a Keras optimizer, got {optimizer!r}.")
    kept = (getattr(_installed.installed(optimizer), STATISTICS, None) or {}).get(
        id(_tf_variable(variable)))
    value = None if kept is None else float(kept.numpy())
    return None if value is None or value != value else value


def _assign(variables, values) -> list:
    return [_tf_variable(x).assign(value, read_value=False) for x, value in zip(variables, values)]


def _tf_variable(variable: Any) -> tf.Variable:
    return variable.value if isinstance(variable, keras.Variable) else variable
