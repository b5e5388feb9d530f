"""Where a model's fused layers run their matmuls and epilogues, as measured.

:func:`keras_mp.execution.configure` calls :func:`apply` for a model: the
fused layers' matmuls go to the faster of graph and XLA for the narrowest
dtype the model computes in (:mod:`keras_mp.execution.micro_benchmark`), and where
matmuls stay outside XLA, each activation's epilogue is measured
(:func:`epilogue`) and the result handed to :mod:`keras_mp.device.xla`.

Example:
    >>> import keras
    >>> from keras_mp.execution import placement
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    >>> placement.compute_dtypes(model)
    {'float32'}
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import threading

import keras
import tensorflow as tf

from keras_mp import _gradients
from keras_mp.device import cache as disk
from keras_mp.device import xla
from keras_mp.execution import micro_benchmark
from keras_mp.execution.micro_benchmark import _check_device_type, _interleaved, profile
from keras_mp.fused import layers as fused_layers
from keras_mp.fused import ops as kops

__all__ = ["MIN_SHARE", "apply", "compute_dtypes", "epilogue", "fused_dense_activations",
           "measure_elsewhere", "measured", "narrowest", "weight_share"]

#: The share of a model's weight elements its fused matmul layers must hold for
#: :func:`apply` to measure where their matmuls run; below it, the defaults of
#: :mod:`keras_mp.device.xla` stay.
MIN_SHARE = 0.05

_lock = threading.Lock()
_log = logging.getLogger("keras_mp")


def compute_dtypes(model: keras.Model) -> set[str]:
    """The compute dtypes of ``model``'s layers with weights (float32 if none)."""
    return {layer.compute_dtype for layer in model._flatten_layers(include_self=False)
            if layer.weights and layer.compute_dtype in ("float32", "bfloat16", "float16")} or {
                "float32"}


def _places_matmuls(model: keras.Model) -> bool:
    """Whether layers of ``model`` that run their matmuls where
    :func:`keras_mp.device.xla.uses_xla` ``("matmul")`` says (keras_mp's fused
    ``Dense`` and ``MultiHeadAttention``) hold at least :data:`MIN_SHARE` of
    its weight elements.

    Example:
        >>> import keras
        >>> from keras_mp.fused.layers import Dense
        >>> cnn = keras.Sequential([keras.Input((32, 32, 3)), keras.layers.Conv2D(64, 3),
        ...                         keras.layers.Conv2D(64, 3), keras.layers.GlobalAveragePooling2D(),
        ...                         Dense(10)])
        >>> _places_matmuls(cnn)  # a head of 650 weights beside 38,720
        False
    """
    return weight_share(model, (fused_layers.Dense, fused_layers.MultiHeadAttention)) >= MIN_SHARE


def weight_share(model: keras.Model, classes: tuple[type, ...]) -> float:
    """The share of ``model``'s weight elements held by its layers of
    ``classes`` (nested layers included; 0.0 for a model without weights).

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
        ...                           keras.layers.LayerNormalization()])
        >>> round(weight_share(model, (keras.layers.Dense,)), 3)   # 15 of 21 elements
        0.714
    """
    held: dict[int, int] = {}
    for layer in model._flatten_layers(include_self=False):
        if isinstance(layer, classes):
            held.update((id(w), _size(w)) for w in layer.weights)
    total = sum(_size(w) for w in {id(w): w for w in model.weights}.values())
    return sum(held.values()) / total if total else 0.0


def _size(weight) -> int:
    return math.prod(int(d) for d in weight.shape)


def apply(model: keras.Model) -> None:
    """Points the fused layers' matmuls at the faster of graph and XLA for
    the narrowest dtype the model computes in (measured, not from flags),
    and, where matmuls stay outside XLA, their epilogues (:func:`epilogue`).

    A model without such layers, or where they hold under :data:`MIN_SHARE`
    of its weights (a small CNN's or ResNet50V2's 10-class head), measures
    nothing: the measurement (:func:`keras_mp.execution.micro_benchmark.profile`,
    then :func:`epilogue`) took 0.6 s on a 2-core AMD EPYC and compiles XLA
    matmuls the process keeps. On the ``cnn`` bench model (6 convolutions, a
    fused ``Dense(10)`` head, batch 32, 64x64, bfloat16) it grew the process by
    142 MiB during ``configure``, and skipping it lowered the training run's
    peak from 874 to 843 MiB (844 to 814 with the graph pinned; one run each,
    2-core AMD EPYC with AVX512-BF16), against 730 MiB for Keras
    ``mixed_bfloat16``.
    """
    if not _places_matmuls(model):
        return
    prof = profile(steps=False)
    dtype = narrowest(model)
    if dtype in prof.matmul and "xla" in prof.matmul[dtype]:
        xla.set_measured_default("matmul", prof.device_type, prof.matmul_xla_wins(dtype))
    if xla.uses_xla("matmul", prof.device_type) or not xla.xla_available(prof.device_type):
        return
    for act in fused_dense_activations(model):
        speedup = epilogue(act, dtype, prof.device_type)
        xla.set_measured_epilogue(act, prof.device_type, speedup > 1.0)


def narrowest(model: keras.Model) -> str:
    """The narrowest of ``model``'s compute dtypes (:func:`compute_dtypes`):
    the one its matmuls are measured in.

    Example:
        >>> import keras
        >>> narrowest(keras.Sequential([keras.Input((4,)),
        ...                             keras.layers.Dense(2, dtype="mixed_bfloat16")]))
        'bfloat16'
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    dtypes = compute_dtypes(model)
    return next((d for d in ("bfloat16", "float16", "float32") if d in dtypes), "float32")


#: Marks the child process's answer on its standard output.
_MARK = "KERAS_MP_MEASURED "
_CHILD = ("import json, sys\n"
          "from keras_mp.execution import placement\n"
          "print(placement._MARK + json.dumps(placement._measure_here(*json.loads(sys.argv[1]))),"
          " flush=True)\n")


def _measure_here(dtype: str, activations: list[str]) -> dict:
    """What :func:`measure_elsewhere`'s child process measures and prints."""
    prof = profile(steps=False)
    available = xla.xla_available("CPU")
    return {"xla_available": available, "matmul": prof.matmul,
            "epilogues": {a: epilogue(a, dtype, "CPU") for a in activations} if available else {}}


def measure_elsewhere(model: keras.Model, *, timeout: float = 300.0) -> bool:
    """On a CPU, measures in a child Python process what this process would
    otherwise compile XLA code to measure for ``model``: whether XLA runs,
    graph against XLA matmul throughput (:func:`keras_mp.execution.micro_benchmark.profile`
    with ``steps=False``) and the epilogues of its fused ``Dense`` layers'
    activations in its narrowest compute dtype (:func:`epilogue`); this
    process keeps the results as its own.

    A process's first XLA compilation loads XLA's runtime, which it keeps:
    68 MiB of resident memory on a 2-core AMD EPYC with AVX512-BF16. A model
    for which keras_mp compiles nothing
    (:func:`keras_mp.execution.reasons.little_to_compile`) then never loads
    it: the quick bench's MLP peaked at 685 MiB, as Keras ``mixed_bfloat16``
    (686), against 792 with the measurements made here. The child takes a
    few seconds (most of them importing TensorFlow), once per process.

    Args:
        model: a Keras model.
        timeout: seconds to wait for the child (> 0).

    Returns:
        True where the results are kept (measured now or before), False
        where nothing was measured elsewhere (not a CPU, or the child
        failed, which is logged): then the measurements happen here when
        asked for.
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"`timeout` must be a number > 0, got {timeout!r}.")
    if xla.current_device_type() != "CPU":
        return False
    if measured(model):
        return True
    dtype = narrowest(model)
    missing = [a for a in fused_dense_activations(model)
               if _kept_epilogue((a, dtype, "CPU")) is None]
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    try:
        proc = subprocess.run([sys.executable, "-P", "-c", _CHILD, json.dumps([dtype, missing])],
                              capture_output=True, text=True, timeout=timeout, env=env)
        line = next(ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith(_MARK))
        found = json.loads(line[len(_MARK):])
    except (OSError, subprocess.SubprocessError, StopIteration, ValueError) as e:
        _log.info("keras_mp: could not measure matmuls in a child process (%s); measuring "
                  "here.", e)
        return False
    xla.record_available("CPU", bool(found["xla_available"]))
    micro_benchmark.remember(micro_benchmark.ExecutionProfile(
        "CPU", bool(found["xla_available"]), {}, found["matmul"]))
    for a, speedup in found["epilogues"].items():
        _keep_epilogue((a, dtype, "CPU"), float(speedup))
    return True


def measured(model: keras.Model) -> bool:
    """Whether what :func:`measure_elsewhere` measures for ``model`` is
    known here (measured in this process, or kept on disk by
    :mod:`keras_mp.device.cache`); True off a CPU, where it measures nothing.

    Example:
        >>> import keras
        >>> measured(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])) in (True, False)
        True
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    if xla.current_device_type() != "CPU":
        return True
    dtype = narrowest(model)
    return micro_benchmark.cached("CPU", steps=False) is not None and all(
        _kept_epilogue((a, dtype, "CPU")) is not None for a in fused_dense_activations(model))


def fused_dense_activations(model: keras.Model) -> list[str]:
    """The epilogue kernels (:func:`epilogue`'s names) of ``model``'s fused
    ``Dense`` layers, sorted.

    Example:
        >>> import keras
        >>> from keras_mp import fused
        >>> model = fused.fuse(keras.Sequential([keras.Input((4,)),
        ...                                      keras.layers.Dense(8, activation="relu")]))
        >>> fused_dense_activations(model)
        ['relu']
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    names = set()
    for layer in model._flatten_layers(include_self=False):
        if isinstance(layer, fused_layers.Dense) and layer.fused:
            name, approximate = fused_layers.fused_activation(layer.activation)
            names.add(kops.activation._check_activation(name, approximate))
    return sorted(names)


_epilogue_cache: dict[tuple[str, str, str], float] = {}


def _kept_epilogue(key: tuple[str, str, str]) -> float | None:
    """The epilogue speed-up measured for ``key`` in this process or kept
    on disk (:mod:`keras_mp.device.cache`), else None."""
    with _lock:
        if key in _epilogue_cache:
            return _epilogue_cache[key]
    found = disk.get("epilogue", f"{key[0]}/{key[1]}", key[2])
    if isinstance(found, (int, float)) and not isinstance(found, bool):
        with _lock:
            _epilogue_cache.setdefault(key, float(found))
        return float(found)
    return None


def _keep_epilogue(key: tuple[str, str, str], speedup: float) -> None:
    with _lock:
        _epilogue_cache[key] = speedup
    disk.put("epilogue", f"{key[0]}/{key[1]}", speedup, key[2])


def epilogue(activation: str, dtype: str = "bfloat16", device_type: str | None = None, *,
             batch: int = 256, width: int = 1024, rounds: int = 5) -> float:
    """Measures (once per process; kept on disk, :mod:`keras_mp.device.cache`,
    for the default sizes) a fused ``Dense``'s epilogue as one XLA
    kernel against TensorFlow ops fused into the matmul by TensorFlow.

    The step: three ``activation(h @ kernel + bias)`` layers, forward,
    backward and update, matmuls in TensorFlow, ``[batch, width] x [width,
    width]`` in ``dtype``, timed in interleaved rounds. (One layer alone
    does not show it: the cost of the XLA epilogue on an AMX Xeon came from
    the boundaries between oneDNN matmuls and XLA kernels across layers.)

    Args:
        activation: a :func:`keras_mp.fused.ops.bias_activation` kernel name
            (``"linear"``, ``"relu"``, ``"gelu"``, ``"gelu_tanh"``,
            ``"silu"``, ``"tanh"``).
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        device_type: as for :func:`profile`.
        batch, width, rounds: the step's size and the timing rounds.

    Returns:
        The XLA epilogue's speed-up over TensorFlow's fusion: the smaller of
        the CPU-time and wall-time ratios (> 1: the XLA kernel is faster).
    """
    device_type = _check_device_type(device_type)
    if activation not in xla.EPILOGUE_ACTIVATIONS:
        raise ValueError(f"`activation` must be one of {xla.EPILOGUE_ACTIVATIONS}, "
                         f"got {activation!r}.")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"`dtype` must be one of 'float32', 'bfloat16', 'float16', got "
                         f"{dtype!r}.")
    key = (activation, dtype, device_type)
    defaults = (batch, width, rounds) == (256, 1024, 5)
    with _lock:
        kept = _epilogue_cache.get(key)
    if kept is None and defaults:
        kept = _kept_epilogue(key)
    if kept is not None:
        return kept
    name, approximate = ("gelu", True) if activation == "gelu_tanh" else (activation, False)
    init = tf.random.stateless_normal
    with tf.device(f"/{device_type}:0"):
        x = tf.cast(init([batch, width], seed=[3, 1]), dtype)
        weights = [tf.Variable(init([width, width], seed=[3, 2 + i]) * 0.03) for i in range(3)]
        weights += [tf.Variable(tf.zeros([width])) for _ in range(3)]

        def make(impl):
            def step():
                with tf.GradientTape() as tape:
                    h = x
                    for kernel, bias in zip(weights[:3], weights[3:]):
                        h = impl(tf.matmul(h, tf.cast(kernel, dtype)), bias, name,
                                 approximate=approximate)
                    loss = tf.reduce_mean(tf.square(tf.cast(h, "float32")))
                for w, g in zip(weights, tape.gradient(loss, weights)):
                    w.assign_sub(1e-4 * g)
                return loss
            fn = tf.function(step, autograph=False)
            return lambda: fn().numpy()

        times = _interleaved({"xla": make(kops.bias_activation),
                              "tf": make(kops.bias_activation_reference)}, rounds, 3)
        _gradients.adopt()  # the kernel's custom gradient: its step (and weights) can go
    (tc, tw), (xc, xw) = times["tf"], times["xla"]
    speedup = min(tc / max(xc, 1e-12), tw / max(xw, 1e-12))
    if defaults:
        _keep_epilogue(key, speedup)
    else:
        with _lock:
            _epilogue_cache[key] = speedup
    return speedup
