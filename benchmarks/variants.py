"""The variants ``keras-mp bench`` trains: every Keras one-liner and keras-mp's
recommended set-up, each as a function that trains one ``model.fit`` epoch.

Example:
    >>> from benchmarks import models, variants
    >>> build, data = models.get("mlp", dict(batch=8, features=4, width=8, depth=1), steps=2)
    >>> train, state = variants.make("keras_float32", build, data, steps=2)
    >>> train(); state["loss"] > 0
    True
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

__all__ = ["KERAS_VARIANTS", "VARIANTS", "LONG_FIT", "make", "long_fit_callback", "first_steps",
           "dtype_counts", "add_probe_cost"]

KERAS_VARIANTS: tuple[str, ...] = (
    "keras_float32", "keras_float32_xla", "keras_mixed_bfloat16", "keras_mixed_bfloat16_xla",
    "keras_mixed_float16", "keras_mixed_float16_xla")
VARIANTS: tuple[str, ...] = (*KERAS_VARIANTS, "keras_mp")


def make(variant: str, build: Callable[[], Any], data, steps: int):
    """``(train, state)``: ``train(n=steps, on=data)`` trains one epoch of ``n``
    steps; ``state`` holds the ``model``, the keras_mp ``callback`` (or None)
    and the last epoch's ``loss``.

    ``keras_mp``: ``keras_mp.set_global_policy("adaptive")`` (here as a
    scope), ``keras_mp.fuse(model, inplace=True)`` (the in-place form reaches
    KerasHub's subclassed models and holds no second copy of the model), the
    default :class:`~keras_mp.callbacks.AdaptivePrecision`, ``compile()``
    defaults. The others: Keras's policy, ``jit_compile`` True for ``*_xla``.
    """
    if variant not in VARIANTS:
        raise ValueError(f"`variants` must be among {VARIANTS}, got {variant!r}.")
    import keras

    import keras_mp
    from keras_mp import callbacks, policies

    keras.utils.set_random_seed(0)
    cbs: list[Any] = []
    jit: bool | str = "auto"
    if variant == "keras_mp":
        with policies.policy_scope("adaptive"):
            model = keras_mp.fuse(build(), inplace=True)
        # The defaults, as the README recommends; then the fit's length as the bench models it.
        cbs = [callbacks.AdaptivePrecision(), long_fit_callback()]
    else:
        policy = variant.removeprefix("keras_").removesuffix("_xla")
        jit = variant.endswith("_xla")
        with policies.policy_scope(policy):
            model = build()
    model.compile(optimizer=keras.optimizers.Adam(1e-4),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=jit)
    state: dict[str, Any] = {"model": model, "callback": cbs[0] if cbs else None}

    def train(n: int = steps, on=data):
        hist = model.fit(on, epochs=1, steps_per_epoch=n, verbose=0, callbacks=cbs,
                         shuffle=False)
        state["loss"] = float(hist.history["loss"][-1])

    return train, state


#: The train steps of the fit whose steady state the bench times (its rounds
#: are epochs of it): what keras-mp is told the coming fit makes. Long in
#: seconds too for any model's step (a fit that at its first calls' pace
#: takes under a minute measures nothing, keras_mp.execution.first_calls).
LONG_FIT = 1_000_000


def long_fit_callback():
    """A Keras callback telling keras-mp's execution choice that each of the
    bench's one-epoch fits is an epoch of a fit of :data:`LONG_FIT` steps,
    as the bench's per-step times model (tracing and compilation left out
    of every variant): otherwise a fit of 10 steps measures nothing and runs
    as a graph (:func:`keras_mp.execution.reasons.short_fit`), which is right
    for a fit of 10 steps and not for the long fit the bench stands for.
    Placed after ``AdaptivePrecision``, whose ``set_params`` tells the fit's
    own length and takes the execution choice: this one takes it again.

    >>> type(long_fit_callback()).__name__
    'LongFit'
    """
    import keras

    from keras_mp import execution
    from keras_mp.execution import start_up

    class LongFit(keras.callbacks.Callback):
        def set_params(self, params):
            super().set_params(params)
            if self.model is not None:
                start_up.expect(self.model, LONG_FIT)
                if self.model.compiled:
                    execution.configure(self.model)

    return LongFit()


def first_steps(variant: str, data, small):
    """What ``variant``'s two single steps before its warm-up epoch train on
    (the second is timed to leave out a variant far too slow to time), or
    None for none.

    A graph is traced once for any batch size (the batch dimension is
    unknown to the trace), so 8 rows (``small``) cost the trace and little
    else. XLA compiles each shape anew: an ``*_xla`` variant takes full
    batches (``data``), compiled once. ``keras_mp`` takes none: its first
    calls are its execution trial, which must see the batches it trains on;
    the warm-up epoch holds the trial.

    >>> first_steps("keras_mp", "data", "small") is None
    True
    >>> first_steps("keras_float32_xla", "data", "small"), first_steps("keras_float32", "data", "small")
    ('data', 'small')
    """
    if variant not in VARIANTS:
        raise ValueError(f"`variants` must be among {VARIANTS}, got {variant!r}.")
    if variant == "keras_mp":
        return None
    return data if variant.endswith("_xla") else small


def dtype_counts(model) -> dict[str, int]:
    """Layers with weights per compute dtype (what the variant really ran)."""
    counts: dict[str, int] = {}
    for layer in model._flatten_layers(include_self=False):
        if layer.weights:
            counts[layer.compute_dtype] = counts.get(layer.compute_dtype, 0) + 1
    return counts


def add_probe_cost(entry: dict[str, Any], callback, data) -> dict[str, Any] | None:
    """Times ``callback``'s float32 probe on one batch (median of 3 calls
    after one to trace) and adds its cost per step to every sample of
    ``entry``: divided by the mean gap between probes in a fit of
    :data:`LONG_FIT` calls whose probes confirm the dtypes, as in a run's
    steady state (``probe_every`` doubling up to ``probe_backoff`` times it:
    :mod:`keras_mp.adaptive.decisions.probe_schedule`). Returns what was added."""
    if callback.probe_every is None or getattr(callback, "_inert", False):
        return None
    batch = next(iter(data))
    callback.probe(batch)  # traces
    cpu, wall = [], []
    for _ in range(3):
        c0, w0 = time.process_time(), time.perf_counter()
        callback.probe(batch)
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    from keras_mp.adaptive.decisions.probe_schedule import probe_calls

    every = LONG_FIT / max(1, probe_calls(LONG_FIT, callback.probe_every, callback.probe_backoff))
    added = {"cpu_s": statistics.median(cpu), "wall_s": statistics.median(wall),
             "every": round(every, 1), "probe_every": callback.probe_every,
             "probe_backoff": callback.probe_backoff}
    for clock in ("cpu", "wall"):
        per_step = added[f"{clock}_s"] / every
        added[f"per_step_{clock}_s"] = per_step
        e = entry[clock]
        e["samples"] = [x + per_step for x in e["samples"]]
        for k in ("median", "min", "max"):
            e[k] += per_step
    return added
