"""Keras Tuner integration: search loss-scale schedules and precision policies.

Three pieces, usable separately:

* :func:`loss_scale_schedule` turns a Keras Tuner ``hp`` into a
  :class:`keras_mp.DynamicLossScale`, each argument searchable over a
  sensible default range that the caller can narrow, fix or rename;
* :class:`PrecisionHyperModel` wraps a user's ``build_model(hp)``: it also
  searches the precision policy (``"adaptive"``, ``"mixed_bfloat16"``,
  ``"float32"``, ...), builds the model under that policy and compiles it with
  a :class:`keras_mp.LossScaleOptimizer` using the searched schedule;
* :class:`TuningMetrics`, a callback adding ``loss_scale``, ``skipped_steps``,
  ``low_precision_fraction`` and ``step_time`` to the epoch logs, so a tuner
  can use them as objectives (see :func:`objective`) or report them.

Example:
    >>> import keras, keras_tuner, keras_mp
    >>> from keras_mp import tuning
    >>> hp = keras_tuner.HyperParameters()
    >>> s = tuning.loss_scale_schedule(hp, growth_interval=[100, 1000], hysteresis=2)
    >>> type(s).__name__, s.hysteresis
    ('DynamicLossScale', 2)
    >>> sorted(hp.values)  # doctest: +NORMALIZE_WHITESPACE
    ['ls_backoff_factor', 'ls_growth_factor', 'ls_growth_interval', 'ls_hysteresis',
     'ls_initial_scale', 'ls_min_scale']
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import keras
import keras_tuner

from keras_mp import _checks as checks
from keras_mp.scaling import loss_scale as loss_scale_lib
from keras_mp import policies as policies_lib
from keras_mp.scaling.optimizer import LossScaleOptimizer

__all__ = ["PARAMETERS", "DEFAULT_SPACE", "OBJECTIVES", "DEFAULT_POLICIES",
           "loss_scale_schedule", "objective", "PrecisionHyperModel", "TuningMetrics"]

#: The searchable arguments of :class:`keras_mp.DynamicLossScale`.
PARAMETERS: tuple[str, ...] = ("initial_scale", "growth_interval", "growth_factor",
                               "backoff_factor", "hysteresis", "min_scale")

#: Default search space. A dict with ``min``/``max`` is a range (``sampling``
#: ``"log"`` or ``"linear"``), a list is a choice. Every default range keeps
#: ``min_scale <= initial_scale``, so any draw is a valid schedule.
DEFAULT_SPACE: dict[str, Any] = {
    # float16's useful range: scaled gradients overflow above ~2**24 * |g|.
    "initial_scale": {"min": 2.0**8, "max": 2.0**20, "sampling": "log"},
    # Short intervals recover a backed-off scale quickly; long ones overflow less.
    "growth_interval": {"min": 50, "max": 4000, "sampling": "log"},
    "growth_factor": [1.5, 2.0, 4.0],
    "backoff_factor": [0.25, 0.5, 0.75],
    "hysteresis": {"min": 1, "max": 4, "sampling": "linear"},
    "min_scale": {"min": 2.0**-8, "max": 1.0, "sampling": "log"},
}
_INTEGER = {"growth_interval", "hysteresis"}
#: What DynamicLossScale takes for each parameter: every value a search may
#: draw is checked against it before the first trial.
_VALID: dict[str, tuple[Callable[[float], bool], str]] = {
    "initial_scale": (lambda v: v > 0, "> 0"),
    "growth_interval": (lambda v: v >= 1 and float(v).is_integer(), "a whole number >= 1"),
    "growth_factor": (lambda v: v > 1, "> 1"),
    "backoff_factor": (lambda v: 0 < v < 1, "in (0, 1)"),
    "hysteresis": (lambda v: v >= 1 and float(v).is_integer(), "a whole number >= 1"),
    "min_scale": (lambda v: v > 0, "> 0"),
}

#: Metrics added by :class:`TuningMetrics` and the direction that makes each better.
OBJECTIVES: dict[str, str] = {
    "loss_scale": "max",
    "skipped_steps": "min",
    "low_precision_fraction": "max",
    "step_time": "min",
}

#: Policies :class:`PrecisionHyperModel` searches by default.
DEFAULT_POLICIES: tuple[str, ...] = ("adaptive", "mixed_bfloat16", "float32")


def _number(x: Any) -> bool:
    return checks.is_number(x) and math.isfinite(x)


def _valid(param: str, spec: Any, values: list) -> None:
    test, allowed = _VALID[param]
    bad = [v for v in values if not test(v)]
    if bad:
        raise ValueError(f"`{param}` must be {allowed}, as DynamicLossScale takes it: "
                         f"{bad[0]!r} in {spec!r} is not.")


def _as_param(param: str, value: Any) -> int | float:
    """A Python int for an integer parameter, a float for the others (a
    Keras Tuner choice holds one type)."""
    return int(value) if param in _INTEGER else float(value)


def _normalize(param: str, spec: Any) -> Any:
    """A user's spec for ``param`` as a number (fixed), a list (choice) or a
    range dict, every value one DynamicLossScale takes; raises naming
    ``param`` otherwise."""
    allowed = ("a number (fixed), a list of values (choice), a (min, max) tuple or a "
               "dict with 'min', 'max' and optionally 'sampling' ('linear'/'log') and 'step'")
    if _number(spec):
        _valid(param, spec, [spec])
        return _as_param(param, spec)
    if isinstance(spec, list):
        if not spec or not all(_number(v) for v in spec):
            raise ValueError(f"`{param}` as a choice must be a non-empty list of numbers, "
                             f"got {spec!r}.")
        _valid(param, spec, spec)
        return [_as_param(param, v) for v in spec]
    if isinstance(spec, tuple):
        if len(spec) != 2:
            raise ValueError(f"`{param}` as a range must be a (min, max) tuple, got {spec!r}.")
        spec = {"min": spec[0], "max": spec[1]}
    if isinstance(spec, Mapping):
        unknown = set(spec) - {"min", "max", "sampling", "step"}
        if unknown or "min" not in spec or "max" not in spec:
            raise ValueError(f"`{param}` must be {allowed}, got {spec!r}.")
        out = {"sampling": DEFAULT_SPACE[param].get("sampling", "linear")
               if isinstance(DEFAULT_SPACE[param], dict) else "linear", **spec}
        lo, hi = out["min"], out["max"]
        if not (_number(lo) and _number(hi)) or lo > hi:
            raise ValueError(f"`{param}` range needs numbers min <= max, got {spec!r}.")
        if out["sampling"] not in ("linear", "log"):
            raise ValueError(f"`{param}` sampling must be 'linear' or 'log', got "
                             f"{out['sampling']!r}.")
        if out["sampling"] == "log" and lo <= 0:
            raise ValueError(f"`{param}` with log sampling needs min > 0, got {spec!r}.")
        _valid(param, spec, [lo, hi])
        return {**out, "min": _as_param(param, lo), "max": _as_param(param, hi)}
    raise TypeError(f"`{param}` must be {allowed}, got {spec!r}.")


def _bounds(spec: Any) -> tuple[float, float]:
    if _number(spec):
        return float(spec), float(spec)
    if isinstance(spec, list):
        return float(min(spec)), float(max(spec))
    return float(spec["min"]), float(spec["max"])


def _draw(hp, name: str, param: str, spec: Any):
    if _number(spec):
        return hp.Fixed(name, spec)
    if isinstance(spec, list):
        return hp.Choice(name, spec)
    lo, hi = spec["min"], spec["max"]
    if lo == hi:
        return hp.Fixed(name, int(lo) if param in _INTEGER else float(lo))
    if param in _INTEGER:
        return hp.Int(name, int(lo), int(hi), step=spec.get("step"),
                      sampling=spec["sampling"])
    return hp.Float(name, float(lo), float(hi), step=spec.get("step"),
                    sampling=spec["sampling"])


def loss_scale_schedule(hp, *, prefix: str = "ls_", names: Mapping[str, str] | None = None,
                        max_scale: float = 2.0**24,
                        **space: Any) -> loss_scale_lib.DynamicLossScale:
    """A :class:`keras_mp.DynamicLossScale` whose arguments are drawn from ``hp``.

    Each of :data:`PARAMETERS` is searched over :data:`DEFAULT_SPACE` unless
    given as a keyword: a number fixes it (recorded with ``hp.Fixed``), a
    list makes it a choice, a ``(min, max)`` tuple narrows its range (keeping
    its default sampling: log for ``initial_scale``, ``growth_interval`` and
    ``min_scale``), a dict sets ``min``/``max``/``sampling``/``step``.

    Args:
        hp: a ``keras_tuner.HyperParameters``.
        prefix: prepended to each hyperparameter's name (default ``"ls_"``:
            ``ls_initial_scale``, ...), so several schedules can share ``hp``.
        names: parameter -> full hyperparameter name, overriding ``prefix``
            for the parameters given (e.g. ``{"initial_scale": "scale0"}``).
        max_scale: the schedule's upper bound (not searched).
        **space: per-parameter overrides, as above.

    Returns:
        The schedule for this trial's values.

    Raises:
        ValueError / TypeError: naming the argument, for an unknown
            parameter, a malformed range, or ranges that would allow
            ``min_scale > initial_scale`` or ``initial_scale > max_scale``.

    Example:
        >>> import keras_tuner
        >>> from keras_mp.tuning import loss_scale_schedule
        >>> hp = keras_tuner.HyperParameters()
        >>> s = loss_scale_schedule(hp, initial_scale=(2.0**10, 2.0**16), growth_factor=2.0,
        ...                         names={"hysteresis": "hyst"})
        >>> 2.0**10 <= s.initial_scale <= 2.0**16, s.growth_factor, "hyst" in hp.values
        (True, 2.0, True)
    """
    if not hasattr(hp, "Float") or not hasattr(hp, "Choice"):
        raise TypeError(f"`hp` must be a keras_tuner.HyperParameters, got {hp!r}.")
    if not isinstance(prefix, str):
        raise TypeError(f"`prefix` must be a string, got {prefix!r}.")
    unknown = set(space) - set(PARAMETERS)
    if unknown:
        raise TypeError(f"Unknown loss-scale parameter(s) {sorted(unknown)}; the searchable "
                        f"parameters are {list(PARAMETERS)}.")
    names = dict(names or {})
    bad = set(names) - set(PARAMETERS)
    if bad or not all(isinstance(v, str) and v for v in names.values()):
        raise ValueError(f"`names` must map parameters from {list(PARAMETERS)} to non-empty "
                         f"strings, got {names!r}.")
    if not _number(max_scale) or max_scale <= 0:
        raise ValueError(f"`max_scale` must be a finite number > 0, got {max_scale!r}.")

    specs = {p: _normalize(p, space[p]) if p in space else DEFAULT_SPACE[p]
             for p in PARAMETERS}
    init_lo, init_hi = _bounds(specs["initial_scale"])
    if _bounds(specs["min_scale"])[1] > init_lo:
        raise ValueError(
            f"`min_scale` (up to {_bounds(specs['min_scale'])[1]!r}) may exceed `initial_scale` "
            f"(from {init_lo!r}): narrow one so that max(min_scale) <= min(initial_scale).")
    if init_hi > max_scale:
        raise ValueError(f"`initial_scale` (up to {init_hi!r}) may exceed `max_scale` "
                         f"({max_scale!r}).")
    values = {p: _draw(hp, names.get(p, prefix + p), p, specs[p]) for p in PARAMETERS}
    return loss_scale_lib.DynamicLossScale(
        initial_scale=float(values["initial_scale"]),
        growth_factor=float(values["growth_factor"]),
        backoff_factor=float(values["backoff_factor"]),
        growth_interval=int(values["growth_interval"]),
        hysteresis=int(values["hysteresis"]),
        min_scale=float(values["min_scale"]),
        max_scale=float(max_scale),
    )


def objective(name: str):
    """A ``keras_tuner.Objective`` for one of :data:`OBJECTIVES` (or its
    ``val_`` form), with the direction that makes it better.

    Example:
        >>> from keras_mp.tuning import objective
        >>> o = objective("step_time")
        >>> o.name, o.direction
        ('step_time', 'min')
    """
    base = name[4:] if isinstance(name, str) and name.startswith("val_") else name
    if base not in OBJECTIVES:
        raise ValueError(f"`name` must be one of {sorted(OBJECTIVES)}, got {name!r}.")
    return keras_tuner.Objective(name, direction=OBJECTIVES[base])


def _layers_with_weights(model: keras.Model) -> list[keras.layers.Layer]:
    seen: set[int] = set()
    out = []
    for layer in model._flatten_layers(include_self=False):
        if id(layer) not in seen and layer._trainable_variables:
            seen.add(id(layer))
            out.append(layer)
    return out


class TuningMetrics(keras.callbacks.Callback):
    """Adds mixed-precision metrics to each epoch's logs, so that ``History``
    records them and a tuner can use them as objectives.

    Logs added at every epoch end:

    * ``loss_scale``: the optimizer's current loss scale (when it is a
      :class:`keras_mp.LossScaleOptimizer`);
    * ``skipped_steps``: steps skipped for non-finite gradients so far;
    * ``low_precision_fraction``: share of the layers with weights whose
      compute dtype is not float32 (changes under an adaptive policy);
    * ``step_time``: the median seconds per train batch in this epoch
      (a median, so the first batch's tracing does not count).

    Put it before callbacks that read these logs (a tuner's own callbacks
    come last; :class:`PrecisionHyperModel` inserts it first).

    Example:
        >>> import keras, numpy as np, keras_mp
        >>> from keras_mp.tuning import TuningMetrics
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        >>> model.compile(keras_mp.LossScaleOptimizer(keras.optimizers.SGD()), "mse")
        >>> h = model.fit(np.ones((8, 4)), np.ones((8, 1)), batch_size=4, verbose=0,
        ...               callbacks=[TuningMetrics()])
        >>> h.history["loss_scale"], h.history["skipped_steps"], h.history["low_precision_fraction"]
        ([32768.0], [0.0], [0.0])
    """

    def __init__(self):
        super().__init__()
        self._times: list[float] = []
        self._start = 0.0

    def on_epoch_begin(self, epoch, logs=None):
        self._times = []

    def on_train_batch_begin(self, batch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        # The TF train function returns after the step ran on the CPU; on an
        # accelerator this includes the step's dispatch only.
        self._times.append(time.perf_counter() - self._start)

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        logs.update(self.current())

    def current(self) -> dict[str, float]:
        """The metrics now, as floats (also usable in a custom loop)."""
        if self.model is None:
            raise ValueError("TuningMetrics has no model: pass it to fit(callbacks=...) or "
                             "call set_model(model) first.")
        out: dict[str, float] = {}
        opt = getattr(self.model, "optimizer", None)
        if isinstance(opt, LossScaleOptimizer):
            out["loss_scale"] = float(opt.loss_scale)
            out["skipped_steps"] = float(opt.skipped_steps.numpy()) if opt.built else 0.0
        layers = _layers_with_weights(self.model)
        if layers:
            low = sum(layer.compute_dtype != "float32" for layer in layers)
            out["low_precision_fraction"] = low / len(layers)
        if self._times:
            out["step_time"] = float(statistics.median(self._times))
        return out


OptimizerSpec = Any  # a name, a config dict, or a callable hp -> optimizer


class PrecisionHyperModel(keras_tuner.HyperModel):
    """A Keras Tuner ``HyperModel`` around ``build_model(hp)`` that also
    searches the precision policy and the loss-scale schedule.

    For each trial, :meth:`build`:

    1. draws ``policy`` (``hp.Choice``) among ``policies``;
    2. calls ``build_model(hp)`` under that policy
       (:func:`keras_mp.policies.policy_scope`), so every layer gets it;
    3. draws a schedule with :func:`loss_scale_schedule` (``loss_scale`` holds
       its overrides), or uses the fixed ``loss_scale`` schedule given;
    4. compiles with a :class:`keras_mp.LossScaleOptimizer` around a fresh
       inner optimizer.

    :meth:`fit` adds :class:`TuningMetrics` (and, for adaptive policies,
    :class:`keras_mp.callbacks.AdaptivePrecision`) before the tuner's callbacks.

    Args:
        build_model: ``hp -> keras.Model``. If the model it returns is
            compiled, its loss and metrics are reused and its optimizer
            (unwrapped if it is a loss-scale optimizer) becomes the inner one.
        policies: policy names to search (each accepted by
            :func:`keras_mp.policies.get`), or one name to fix it.
        optimizer: the inner optimizer for uncompiled models: a Keras name
            (``"adam"``), a config dict, or ``hp -> keras.optimizers.Optimizer``
            (a fresh one per trial).
        loss: the loss, for uncompiled models.
        metrics: metrics, for uncompiled models.
        loss_scale: a dict of :func:`loss_scale_schedule` keyword arguments
            (``{}``: search everything), or a
            :class:`keras_mp.scaling.loss_scale.LossScaleSchedule` / number to use
            unsearched.
        adaptive_interval: train-function calls between adaptive decisions.
        name: the HyperModel's name.
        tunable: as in ``keras_tuner.HyperModel``.

    Example:
        >>> import keras, keras_tuner
        >>> from keras_mp.tuning import PrecisionHyperModel
        >>> def build_model(hp):
        ...     return keras.Sequential([keras.Input((4,)),
        ...                              keras.layers.Dense(hp.Int("units", 4, 16)),
        ...                              keras.layers.Dense(1, dtype="float32")])
        >>> hm = PrecisionHyperModel(build_model, policies=["mixed_bfloat16", "float32"],
        ...                          optimizer="adam", loss="mse",
        ...                          loss_scale={"growth_interval": [10, 100]})
        >>> hp = keras_tuner.HyperParameters()
        >>> model = hm.build(hp)
        >>> hp.values["policy"], type(model.optimizer).__name__
        ('mixed_bfloat16', 'LossScaleOptimizer')
    """

    def __init__(self, build_model: Callable[[Any], keras.Model], *,
                 policies: Sequence[str] | str = DEFAULT_POLICIES,
                 optimizer: OptimizerSpec = "adam", loss: Any = None, metrics: Any = None,
                 loss_scale: Mapping[str, Any] | Any = None,
                 adaptive_interval: int = 10, name: str | None = None, tunable: bool = True):
        super().__init__(name=name, tunable=tunable)
        if not callable(build_model):
            raise TypeError(f"`build_model` must be a callable hp -> keras.Model, got "
                            f"{build_model!r}.")
        if isinstance(policies, str):
            policies = [policies]
        if not isinstance(policies, Sequence) or not policies or \
                not all(isinstance(p, str) for p in policies):
            raise ValueError(f"`policies` must be a policy name or a non-empty list of them "
                             f"(e.g. {list(DEFAULT_POLICIES)}), got {policies!r}.")
        for p in policies:
            try:
                policies_lib.get(p)
            except ValueError as e:
                raise ValueError(f"`policies` holds {p!r}, which is not a policy: {e}") from e
        if len(set(policies)) != len(policies):
            raise ValueError(f"`policies` must not repeat a name, got {list(policies)!r}.")
        adaptive_interval = checks.count("adaptive_interval", adaptive_interval, 1)
        if loss_scale is None:
            loss_scale = {}
        if isinstance(loss_scale, Mapping):
            # Validates the overrides now rather than in the first trial.
            loss_scale_schedule(keras_tuner.HyperParameters(), **loss_scale)
        else:
            loss_scale = loss_scale_lib.get(loss_scale)
        if not (callable(optimizer) or isinstance(optimizer, (str, dict))):
            raise TypeError("`optimizer` must be an optimizer name, a config dict or a "
                            f"callable hp -> optimizer (a fresh one per trial), got "
                            f"{optimizer!r}.")
        self.build_model = build_model
        self.policies = list(policies)
        self.optimizer = optimizer
        self.loss = loss
        self.metrics = metrics
        self.loss_scale = loss_scale
        self.adaptive_interval = adaptive_interval

    def _inner_optimizer(self, hp) -> keras.optimizers.Optimizer:
        spec = self.optimizer
        opt = spec(hp) if callable(spec) and not isinstance(spec, (str, dict)) else \
            keras.optimizers.get(spec)
        if not isinstance(opt, keras.optimizers.Optimizer):
            raise TypeError(f"`optimizer` produced {opt!r}, not a keras.optimizers.Optimizer.")
        return opt

    def _schedule(self, hp) -> loss_scale_lib.LossScaleSchedule:
        if isinstance(self.loss_scale, Mapping):
            return loss_scale_schedule(hp, **self.loss_scale)
        return self.loss_scale

    def build(self, hp) -> keras.Model:
        """Builds and compiles one trial's model (see the class docstring)."""
        policy = hp.Choice("policy", self.policies) if len(self.policies) > 1 else \
            hp.Fixed("policy", self.policies[0])
        with policies_lib.policy_scope(policy):
            model = self.build_model(hp)
        if not isinstance(model, keras.Model):
            raise TypeError(f"`build_model` must return a keras.Model, got {model!r}.")
        schedule = self._schedule(hp)
        compiled = getattr(model, "compiled", False) and model.optimizer is not None
        if compiled:
            config = dict(model._compile_config.config)
            inner = model.optimizer
            if isinstance(inner, keras.optimizers.LossScaleOptimizer):
                inner = inner.inner_optimizer
        else:
            if self.loss is None:
                raise ValueError("`loss` is required when `build_model` returns an "
                                 "uncompiled model.")
            config = {"loss": self.loss, "metrics": self.metrics}
            inner = self._inner_optimizer(hp)
        config["optimizer"] = LossScaleOptimizer(inner, schedule=schedule)
        model.compile(**config)
        return model

    def fit(self, hp, model: keras.Model, *args, callbacks=None, **kwargs):
        """``model.fit`` with :class:`TuningMetrics` (and, under an adaptive
        policy, :class:`keras_mp.callbacks.AdaptivePrecision`) added first."""
        from keras_mp import callbacks as callbacks_lib

        ours: list[keras.callbacks.Callback] = []
        if policies_lib.policy_of(model) is not None:
            ours.append(callbacks_lib.AdaptivePrecision(interval=self.adaptive_interval))
        ours.append(TuningMetrics())
        return model.fit(*args, callbacks=ours + list(callbacks or []), **kwargs)

