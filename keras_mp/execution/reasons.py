"""Why an execution mode cannot run, or cannot win, for a model: each rule
returns a sentence naming the cause, or None where the mode may be tried.
:func:`keras_mp.execution.choice.candidate_modes` tries a mode only where
every rule for it says None, and logs the sentence where only the graph is
left.

Example:
    >>> import keras
    >>> from keras_mp.execution import reasons
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    >>> model.compile(optimizer="sgd", loss="mse", run_eagerly=True)
    >>> reasons.graph_only(model)
    'the model runs eagerly (run_eagerly=True)'
"""

from __future__ import annotations

import math

import keras
from keras.src.models.functional import Functional  # no public name

from keras_mp import _installed
from keras_mp.device import memory, xla
from keras_mp.execution import (fused_update, micro_benchmark, native_update, optimizer_state,
                                step_trial)
from keras_mp.execution.placement import (MIN_SHARE, fused_dense_activations,
                                         narrowest, weight_share)
from keras_mp.fused import layers as fused_layers

__all__ = ["MAPS_BUDGET", "XLA_MATMUL_FLOOR", "SMALL_OUTPUT", "SHORT_FIT", "maps", "graph_only",
           "expected", "short_fit", "matmul_free", "slow_matmul", "convolution", "small_xla_work",
           "little_to_compile", "update_only", "update_memory", "update_native", "float32_class"]

#: Past this fraction of the process's memory maps (:func:`keras_mp.device.xla.memory_maps`),
#: no new XLA compilation is tried.
MAPS_BUDGET = 0.5
#: The whole step is tried under XLA only where XLA's matmuls in the model's
#: narrowest compute dtype reach this fraction of the graph's throughput
#: (:func:`keras_mp.execution.profile`, matmuls only).
XLA_MATMUL_FLOOR = 0.8
#: Outputs of at most this many values per example leave the fused loss
#: (:mod:`keras_mp.fused.losses`) too little work for XLA
#: (:func:`little_to_compile`).
SMALL_OUTPUT = 4096


#: A fit of fewer train-function calls than this measures nothing: no trial
#: of execution modes, no XLA (:func:`short_fit`).
SHORT_FIT = 1000
#: Where :func:`keras_mp.execution.start_up.expect` keeps the coming fit's calls
#: (the model's keras_mp._installed holder).
EXPECTED_ATTR = "expected_calls"
#: Where :mod:`keras_mp.execution.choice` keeps why the model's train step runs
#: as a graph without XLA while its fit's first calls are timed, or after
#: they kept the graph (:mod:`keras_mp.execution.first_calls`); None: neither.
FIRST_CALLS_ATTR = "first_calls_reason"


def _check(model: keras.Model) -> None:
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")


def maps() -> str | None:
    """Why another XLA compilation could crash this process (None when not)."""
    held = xla.memory_maps()
    if held is None or held[0] <= MAPS_BUDGET * held[1]:
        return None
    return (f"this process holds {held[0]} of the {held[1]} memory maps Linux allows it "
            "(vm.max_map_count) and TensorFlow never frees an XLA:CPU executable's, so "
            "another XLA compilation could crash it; raise the limit (sysctl -w "
            "vm.max_map_count=262144) or train new models in a new process")


def graph_only(model: keras.Model) -> str | None:
    """Why XLA cannot be used for this model at all (None when it can)."""
    _check(model)
    from keras.src.trainers.trainer import model_supports_jit

    if getattr(model, "run_eagerly", False):
        return "the model runs eagerly (run_eagerly=True)"
    if getattr(model, "_distribute_strategy", None) is not None:
        return "a distribution strategy is set (Keras does not compile its steps with XLA)"
    opt = getattr(model, "optimizer", None)
    if getattr(opt, "max_consecutive_skips", None) is not None:
        return ("the optimizer sets max_consecutive_skips, whose message names variables "
                "with string ops XLA cannot compile; set max_consecutive_skips=None to allow XLA")
    if not model_supports_jit(model):
        names = sorted({type(layer).__name__ for layer in model._flatten_layers()
                        if not layer.supports_jit})
        return f"layers that do not support XLA: {', '.join(names) or 'see Keras'}"
    if not xla.xla_available():
        return "XLA does not run on this device"
    return maps()


def float32_class(model: keras.Model) -> bool:
    """Whether ``model`` adapts among float32 alone: every layer with an
    adaptive policy has float32 as its only candidate
    (:func:`keras_mp.fused.layers.float32_alone`; ``"adaptive"`` on a CPU
    without 16-bit units), and at least one layer has one.

    There the best Keras one-liner is float32 with ``jit_compile=True``
    (1.12-1.34x plain float32 on AVX2 CPUs, docs/benchmarks.md), whose step
    holds XLA's copy of the step's tensors too: so the execution trial
    tries the whole step under XLA whatever that copy takes
    (:data:`keras_mp.execution.step_trial.MEMORY_BUDGET` guards the 16-bit
    set-ups, whose Keras one-liners run no XLA).

    >>> import keras
    >>> float32_class(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]))
    False
    """
    _check(model)
    adaptive = [fused_layers.float32_alone(layer)
                for layer in model._flatten_layers(include_self=True)
                if getattr(layer.dtype_policy, "candidates", None)]
    return bool(adaptive) and all(adaptive)


def slow_matmul(model: keras.Model) -> str | None:
    """Why the whole step under XLA cannot win here (None when it may): XLA's
    matmuls in the model's narrowest compute dtype run far slower than the
    graph's. (On a 2-core AMD EPYC with AVX512-BF16, XLA:CPU's bfloat16 matmul
    ran at 71 GFLOP/s against oneDNN's 147, and the whole bfloat16 step
    under XLA lost on every bench model; each try costs an XLA compilation
    that stays in memory.)

    A model whose only weights of two or more dimensions are ``Embedding``
    tables multiplies no weight matrix (its work is gathers and elementwise
    ops), so it measures nothing here (:func:`matmul_free`): the profile's
    matmuls took about 1 s of keras.io's collaborative-filtering fit (2-core
    AMD EPYC, an empty cache), whose step the trial then ran under XLA.

    Example:
        >>> import keras
        >>> recommender = keras.Sequential([keras.Input((2,), dtype="int32"),
        ...                                 keras.layers.Embedding(100, 8),
        ...                                 keras.layers.GlobalAveragePooling1D()])
        >>> slow_matmul(recommender) is None
        True
    """
    _check(model)
    if matmul_free(model):
        return None
    dtype = narrowest(model)
    speeds = micro_benchmark.profile(steps=False).matmul.get(dtype, {})
    if "xla" not in speeds or "graph" not in speeds:
        return None
    if speeds["xla"] >= XLA_MATMUL_FLOOR * speeds["graph"]:
        return None
    return (f"XLA runs {dtype} matmuls at {speeds['xla']:.0f} GFLOP/s here against "
            f"{speeds['graph']:.0f} as a TensorFlow graph")


def matmul_free(model: keras.Model) -> bool:
    """Whether ``model`` multiplies no weight matrix: it has ``Embedding``
    tables, and no other layer (nor the model itself) holds a weight of two
    or more dimensions, or, not built yet, has a ``build`` of its own that
    could make one (a layer not built whose ``build`` is Keras's base
    ``Layer``'s, ``Model``'s, ``Sequential``'s or a functional model's makes
    none). How fast matmuls run decides nothing for such a model. A fixed
    rule: it reads the model's layers and measures nothing.

    Example:
        >>> import keras
        >>> matmul_free(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]))
        False
    """
    _check(model)
    tables = False
    for layer in model._flatten_layers(include_self=True):
        if isinstance(layer, keras.layers.Embedding):
            tables = True
            continue
        own = layer._trainable_variables + layer._non_trainable_variables
        if any(len(w.shape) >= 2 for w in own):
            return False
        if not layer.built and type(layer).build not in _WEIGHTLESS_BUILDS:
            return False  # its build may make a matrix
    return tables


#: The ``build`` methods that make no weight of their own (:func:`matmul_free`).
_WEIGHTLESS_BUILDS = (keras.layers.Layer.build, keras.Sequential.build, Functional.build)


#: Convolution layers, which XLA:CPU runs without oneDNN.
_CONVOLUTIONS = (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D,
                 keras.layers.Conv1DTranspose, keras.layers.Conv2DTranspose,
                 keras.layers.Conv3DTranspose, keras.layers.DepthwiseConv1D,
                 keras.layers.DepthwiseConv2D, keras.layers.SeparableConv1D,
                 keras.layers.SeparableConv2D)


def convolution(model: keras.Model) -> str | None:
    """Why the whole step under XLA is not tried on a CPU (None when it may):
    the model convolves, and XLA:CPU runs convolutions without oneDNN. A
    small bfloat16 CNN ran 3x slower under XLA on a Xeon with AMX-BF16, and
    ResNet50V2 4x slower on an AMD EPYC with AVX512-BF16. On that EPYC (2
    cores), MobileNetV3Small's first 12 steps (float16, 32x32, batch 16) took
    52 s of wall time with the whole step in the trial, 23 s without it."""
    found = _convolution_on_cpu(model)
    if found is None:
        return None
    return (f"XLA:CPU runs convolutions ({type(found).__name__} {found.name!r}) without "
            "oneDNN, several times slower than the TensorFlow graph")


def _convolution_on_cpu(model: keras.Model) -> keras.layers.Layer | None:
    _check(model)
    if xla.current_device_type() != "CPU":
        return None
    return next((layer for layer in model._flatten_layers(include_self=False)
                 if isinstance(layer, _CONVOLUTIONS)), None)


#: Fused layers whose work is elementwise whatever weights they hold.
_ELEMENTWISE_FUSED = (fused_layers.LayerNormalization, fused_layers.RMSNormalization,
                      fused_layers.Softmax, fused_layers.MultiHeadAttention,
                      fused_layers.ReversibleEmbedding)


def _output_values(model: keras.Model) -> int | None:
    """Values per example in the model's outputs, None where unknown."""
    try:
        outputs = model.outputs
    except (AttributeError, ValueError):
        return None
    if not outputs:
        return None
    dims = [d for t in outputs for d in tuple(t.shape)[1:]]
    if any(d is None for d in dims):
        return None
    return sum(math.prod(int(d) for d in tuple(t.shape)[1:]) for t in outputs)


#: Layers whose work is matmuls (keras_mp's fused ``Dense`` is a ``Dense``).
_MATMULS = (keras.layers.Dense, keras.layers.EinsumDense)


def small_xla_work(model: keras.Model) -> str | None:
    """Which layers hold the weights of a model whose XLA work in keras_mp
    would be small, from the model alone: ``"convolution"`` or ``"dense"``
    where those hold all but :data:`~keras_mp.execution.placement.MIN_SHARE`
    of its weights, on a CPU, with no fused normalization, softmax,
    attention or embedding layer and outputs of at most
    :data:`SMALL_OUTPUT` values per example (the fused loss's work); None
    otherwise. :func:`little_to_compile` then decides; for ``"dense"`` it
    asks measurements, which :func:`keras_mp.execution.configure` makes in a
    child process (:func:`keras_mp.execution.placement.measure_elsewhere`).

    Example:
        >>> import keras
        >>> from keras_mp.execution import reasons
        >>> mlp = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
        >>> reasons.small_xla_work(mlp)   # on a CPU
        'dense'
    """
    _check(model)
    if xla.current_device_type() != "CPU":
        return None
    if any(isinstance(layer, _ELEMENTWISE_FUSED)
           for layer in model._flatten_layers(include_self=False)):
        return None
    values = _output_values(model)
    if values is None or values > SMALL_OUTPUT:
        return None
    for kind, classes in (("convolution", _CONVOLUTIONS), ("dense", _MATMULS)):
        if weight_share(model, classes) >= 1 - MIN_SHARE:
            return kind
    return None


def _held(model: keras.Model, name: str):
    """What keras_mp keeps under ``name`` on ``model``'s holder (None: nothing)."""
    return getattr(model.__dict__.get(_installed.INSTALLED_ATTR), name, None)


def expected(model: keras.Model) -> int | None:
    """The train-function calls of ``model``'s coming ``fit``, as
    :func:`keras_mp.execution.start_up.expect` was told (None: unknown).

    Example:
        >>> import keras
        >>> from keras_mp.execution import reasons, start_up
        >>> mlp = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
        >>> start_up.expect(mlp, 96)
        >>> reasons.expected(mlp)
        96
    """
    _check(model)
    return _held(model, EXPECTED_ATTR)


def short_fit(model: keras.Model) -> str | None:
    """Why measuring for this model cannot pay off in the coming fit (None
    where it may): a fit of fewer than :data:`SHORT_FIT` train-function
    calls (:func:`keras_mp.execution.start_up.expect`;
    :class:`keras_mp.callbacks.AdaptivePrecision` tells it from ``fit``'s
    epochs and steps), whatever the model. Measuring costs what a few
    hundred steps cost, and more for a model whose XLA compilation is slow:
    the trial times each candidate mode over interleaved rounds of calls on a
    copy of the training state (:mod:`keras_mp.execution.step_trial`), and
    the XLA matmul profile and the placement measurements come before it
    (a child process: about 5 s of CPU on a 2-core AMD EPYC, most of it
    importing TensorFlow). Against that, a mode wins at most a fraction of
    each step. keras.io's functional-API guide model (two LSTMs, 80 calls)
    fitted in 5.9 s under Keras ``mixed_bfloat16`` and its trial alone took
    9.2 s; the "customizing fit" model (``Dense(1)``, 96 steps) fitted in
    1.4 s under Keras. Such a fit runs as Keras runs it on a CPU: a
    TensorFlow graph without XLA (:func:`little_to_compile`); a longer fit
    measures, once per machine and model. A fixed rule: whether this machine
    kept measurements (:mod:`keras_mp.device.cache`) does not change it, so
    that a seeded short fit trains the same weights with an empty cache and
    a full one. ``keras_mp.config.set_xla("elementwise", True)`` or an
    explicit mode (``keras_mp.config.set_execution(model, "xla")``) still
    gets XLA.

    Example:
        >>> import keras
        >>> from keras_mp.execution import reasons, start_up
        >>> mlp = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
        >>> start_up.expect(mlp, 96)
        >>> reasons.short_fit(mlp).startswith("this fit makes 96 train steps")
        True
        >>> start_up.expect(mlp, None)   # unknown length: measured
        >>> reasons.short_fit(mlp) is None
        True
    """
    calls = expected(model)
    if calls is None or calls >= SHORT_FIT or xla.forced("elementwise"):
        return None
    return (f"this fit makes {calls} train steps, fewer than {SHORT_FIT}: too few for a "
            "measurement to pay for itself (the trial of each mode, an XLA compilation), so "
            "the step runs as Keras runs it on a CPU, a TensorFlow graph without XLA")


def little_to_compile(model: keras.Model) -> str | None:
    """Why keras_mp compiles nothing with XLA for this model (None where it
    may): the fit is too short to measure anything (:func:`short_fit`,
    whatever the model, or its first calls, timed as a graph, are under way
    or showed it short in seconds: :mod:`keras_mp.execution.first_calls`);
    or its XLA work is small (:func:`small_xla_work`), and either

    * convolutions hold its weights. The whole step is not tried under XLA
      there (:func:`convolution`); the update under XLA has little to fuse,
      since a convolution's weights are used at every position (the bench's
      CNN has 288 thousand weights and about 30 GFLOP a step, forward and
      backward; its trial measured the update under XLA at 188.6 ms of CPU
      per step against 183.9 as a graph); or
    * ``Dense`` layers hold them, the whole step under XLA cannot win
      (:func:`slow_matmul`), the update needs no XLA (it is native,
      :func:`update_native`, or cannot be compiled alone), and the fused
      layers' matmuls and epilogues were measured faster outside XLA
      (:mod:`keras_mp.execution.placement`).

    XLA's runtime, loaded by a process's first compilation and kept for its
    life, took 47-68 MiB of resident memory (2-core AMD EPYC with
    AVX512-BF16); the quick bench's MLP peaked at 685 MiB without it, as
    Keras ``mixed_bfloat16`` did (686), against 792 with it. So the step is
    traced inside :func:`keras_mp.device.xla.disabled`: fused layers, loss
    and metric run their TensorFlow reference ops, and the trial tries
    nothing under XLA. ``keras_mp.config.set_xla("elementwise", True)`` asks for
    XLA's kernels anyway, and gets them.

    Example:
        >>> import keras
        >>> from keras_mp.execution import reasons
        >>> cnn = keras.Sequential([keras.Input((8, 8, 16)), keras.layers.Conv2D(64, 3),
        ...                         keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(2)])
        >>> reasons.little_to_compile(cnn).startswith("convolutions hold")  # on a CPU
        True
        >>> mlp = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
        >>> reasons.little_to_compile(mlp) is None   # no optimizer yet
        True
    """
    short = short_fit(model) or _held(model, FIRST_CALLS_ATTR)
    if short is not None:   # any model: nothing measured, nothing compiled
        return short
    kind = small_xla_work(model)
    if kind is None or xla.forced("elementwise"):   # asked for: keras_mp.config.set_xla
        return None
    values = _output_values(model)
    if kind == "convolution":
        return (f"convolutions hold {weight_share(model, _CONVOLUTIONS):.1%} of its weights, "
                "keras_mp fuses no normalization, softmax or attention in it and its outputs "
                f"are {values} values per example: too little XLA work to pay for the memory "
                "XLA's runtime takes, so keras_mp compiles nothing for it")
    update = update_native(model)
    if update is None and getattr(model, "optimizer", None) is not None:
        update = update_only(model)
    if update is None:
        return None
    if any(isinstance(layer, fused_layers.Dense)
           for layer in model._flatten_layers(include_self=False)) and xla.uses_xla("matmul"):
        return None
    if any(xla.fuses_epilogue(a) for a in fused_dense_activations(model)):
        return None
    slow = slow_matmul(model)
    if slow is None:
        return None
    return (f"Dense layers hold {weight_share(model, _MATMULS):.1%} of its weights, {slow}, "
            f"{update}, keras_mp fuses no normalization, softmax or attention in it, and its "
            f"outputs are {values} values per example: too little XLA work to pay for the "
            "memory XLA's runtime takes, so keras_mp compiles nothing for it")


def update_only(model: keras.Model) -> str | None:
    """Why the optimizer's update alone cannot be compiled (None when it can)."""
    _check(model)
    if getattr(model, "run_eagerly", False):
        return "the model runs eagerly (run_eagerly=True)"
    if getattr(model, "_distribute_strategy", None) is not None:
        return "a distribution strategy is set (the update holds its all-reduce)"
    if getattr(model, "optimizer", None) is None:
        return "the model has no optimizer"
    reason = fused_update.unsupported_reason(model.optimizer)
    if reason is not None:
        return reason
    if not xla.xla_available():
        return "XLA does not run on this device"
    if not xla.uses_xla("elementwise"):
        return "keras_mp.config.set_xla('elementwise', False) keeps elementwise work out of XLA"
    return maps()


def update_memory(model: keras.Model) -> str | None:
    """Why trying the update under XLA would cost more memory than the trial
    may spend (None when it fits): XLA keeps its compiled code per variable
    (:data:`keras_mp.execution.fused_update.BYTES_PER_VARIABLE`), more than
    :data:`keras_mp.execution.step_trial.MEMORY_BUDGET` of the process here.
    (Checked before anything is traced: a trace that holds the update both
    ways costs memory even where the XLA branch never runs. ResNet50V2,
    64x64, batch 16, 2-core AMD EPYC, adaptive precision: peak 1909 MiB with
    that trace, 1747 with the graph's.)"""
    _check(model)
    size = memory.footprint()
    opt = getattr(model, "optimizer", None)
    if size is None or opt is None:
        return None
    count = len(fused_update.updated_variables(opt) or model.trainable_variables)
    cost = count * fused_update.BYTES_PER_VARIABLE
    if cost <= step_trial.MEMORY_BUDGET * size:
        return None
    return (f"the optimizer update under XLA would keep compiled code for {count} variables "
            f"(about {cost / 2**20:.0f} MiB), more than {step_trial.MEMORY_BUDGET:.0%} of the "
            f"{size / 2**20:.0f} MiB this process holds")


def update_native(model: keras.Model) -> str | None:
    """Why compiling the update alone has nothing to gain (None where it may):
    the model's optimizer updates each variable with one TensorFlow kernel
    (:mod:`keras_mp.execution.native_update`), the one pass over memory XLA
    would have fused. On the bench's 4x2048 MLP (Adam, bfloat16, 2-core AMD
    EPYC with AVX512-BF16) the graph with that kernel ran at 158.0 ms CPU per
    step, the update compiled by XLA at 168.2, Keras's update at 192.3; and
    not trying XLA saves the memory its compiled update keeps.

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        >>> model.compile(optimizer="adam", loss="mse")
        >>> update_native(model)
        'the Adam update runs as one TensorFlow kernel per variable'
        >>> model.compile(optimizer="rmsprop", loss="mse")
        >>> update_native(model) is None
        True
    """
    _check(model)
    opt = getattr(model, "optimizer", None)
    if opt is None or native_update.unsupported_reason(opt) is not None:
        return None
    name = type(optimizer_state.inner(opt)).__name__
    return f"the {name} update runs as one TensorFlow kernel per variable"
