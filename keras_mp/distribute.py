"""Makes ``model.fit`` work under a multi-worker ``MultiWorkerMirroredStrategy``.

Keras 3's TensorFlow trainer has two faults that only show once a
``tf.distribute.MultiWorkerMirroredStrategy`` spans more than one worker
process. One worker and ``MirroredStrategy`` take other code paths and work.
Both faults are in ``keras/src/backend/tensorflow/trainer.py`` (line numbers
of Keras 3.15.1):

1. ``"symbolic_build_reduce"`` -- ``TensorFlowTrainer._maybe_symbolic_build``
   (line 713) peeks at the first batch of the distributed dataset to build the
   model, and hands the whole ``(x, y)`` structure of ``PerReplica`` values to
   ``strategy.reduce("MEAN", batch, axis=None)`` (line 731).
   ``tf.distribute.Strategy.reduce`` takes one ``DistributedValues``, not a
   structure of them. With one worker, ``CollectiveAllReduceExtended._reduce_to``
   returns a non-distributed value untouched, so the structure passes through
   by luck; with several workers it goes to ``CrossDeviceOps.reduce``, which
   calls ``convert_to_tensor`` on the tuple and fails on the first batch with
   ``ValueError: Attempt to convert a value (PerReplica...) ... to a Tensor``.
   Present from Keras 3.5 (absent in 3.4.1).
2. ``"scalar_mean_reduce"`` -- hidden behind the first. ``reduce_per_replica``
   (line 778), which reduces the logs every train/test step returns, resolves
   ``reduction="auto"`` to ``"mean"`` and, in multi-worker mode, calls
   ``strategy.reduce("MEAN", v, axis=0)`` (line 841). Losses and metric results
   are scalars, so tracing the train function fails with ``ValueError: Invalid
   reduction dimension 0 for input with 0 dimensions``. Present from at least
   Keras 3.3.3 (absent in 3.0.0).

:func:`patch_multi_worker` wraps exactly those two places and only acts when
the strategy really is multi-worker:

1. While ``_maybe_symbolic_build`` runs for a multi-worker strategy, a
   ``reduce`` of a *structure* with ``axis=None`` -- the call that always fails
   there -- returns each leaf's first local replica instead. The build only
   reads shapes and dtypes, and that is the value one worker builds from
   already, so multi-worker builds the same model as one worker does, and no
   collective runs eagerly just to learn shapes.
2. In multi-worker mode ``reduce_per_replica`` reduces *scalars* with
   ``strategy.reduce("MEAN", v, axis=None)``: the mean over replicas, as the
   one-worker branch of the same function computes. Everything else still goes
   to Keras's own code.

Each fix is installed only when its fault is found in the installed Keras (by
reading the source of the faulty function), so a Keras release that fixes one
turns the matching fix into a no-op. :func:`patch_multi_worker` is idempotent.

Example:
    >>> import keras_mp.distribute
    >>> keras_mp.distribute.patch_multi_worker()   # before model.fit
    ('symbolic_build_reduce', 'scalar_mean_reduce')
"""

from __future__ import annotations

import functools
import inspect
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import keras
import tensorflow as tf
from keras.src.backend.tensorflow import trainer as _tf_trainer

__all__ = [
    "FAULTS",
    "SUPPORTED_STRATEGIES",
    "check_strategy",
    "keras_multi_worker_faults",
    "patch_multi_worker",
    "patched_faults",
    "unpatch_multi_worker",
]

FAULTS: tuple[str, ...] = ("symbolic_build_reduce", "scalar_mean_reduce")

#: Strategies keras-mp is tested with (docs/distributed.md), by class name.
SUPPORTED_STRATEGIES: tuple[str, ...] = (
    "default (no strategy)", "OneDeviceStrategy", "MirroredStrategy",
    "MultiWorkerMirroredStrategy", "CentralStorageStrategy")

# Versions where each fault was seen in the released source: used only when
# the source cannot be read (e.g. a bytecode-only install).
_KNOWN_AFFECTED: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "symbolic_build_reduce": ((3, 5, 0), (3, 15, 1)),
    "scalar_mean_reduce": ((3, 3, 3), (3, 15, 1)),
}

# Whitespace-free signatures of the faulty calls in Keras's source.
_SIGNATURES: dict[str, tuple[Callable[[], Any], re.Pattern[str]]] = {
    "symbolic_build_reduce": (
        lambda: _tf_trainer.TensorFlowTrainer._maybe_symbolic_build,
        re.compile(r"distribute_strategy\.reduce\(['\"]MEAN['\"],"
                   r"maybe_distributed_data_batch,axis=None"),
    ),
    "scalar_mean_reduce": (
        lambda: _tf_trainer.reduce_per_replica,
        re.compile(r"strategy\.reduce\(['\"]MEAN['\"],v,axis=0\)"),
    ),
}

_lock = threading.Lock()
_originals: dict[str, Callable[..., Any]] = {}
_MARK = "_keras_mp_multi_worker_fix"


def _version(text: str) -> tuple[int, ...]:
    numbers = re.match(r"\d+(?:\.\d+)*", text)
    return tuple(int(n) for n in numbers.group(0).split(".")) if numbers else ()


def _unwrapped(fn: Callable[..., Any]) -> Callable[..., Any]:
    # Judge Keras's own code, not a fix of ours that may be installed.
    return _originals.get(getattr(fn, _MARK, ""), fn)


def keras_multi_worker_faults() -> tuple[str, ...]:
    """Lists the multi-worker faults of :data:`FAULTS` in the installed Keras.

    A fault counts as present when the faulty call is in the source of the
    Keras function. When the source cannot be read, the Keras version is
    compared with the releases known to carry the fault.

    Returns:
        The names of the faults present, in the order of :data:`FAULTS`;
        empty when Keras does not have them (or is not Keras 3).
    """
    version = _version(keras.version())
    if version[:1] != (3,):
        return ()
    found = []
    for name in FAULTS:
        get_fn, pattern = _SIGNATURES[name]
        try:
            source = inspect.getsource(_unwrapped(get_fn()))
        except (OSError, TypeError):
            first, last = _KNOWN_AFFECTED[name]
            if first <= version <= last:
                found.append(name)
            continue
        if pattern.search(re.sub(r"\s+", "", source)):
            found.append(name)
    return tuple(found)


def _in_multi_worker_mode(strategy: tf.distribute.Strategy | None) -> bool:
    # The same test Keras applies before taking its multi-worker branches.
    return (
        isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
        and strategy.extended._in_multi_worker_mode()
    )


def _first_local_replica(value: Any, strategy: tf.distribute.Strategy) -> Any:
    if isinstance(value, tf.distribute.DistributedValues):
        return strategy.experimental_local_results(value)[0]
    return value


@contextmanager
def _structure_reduce_is_local(strategy: tf.distribute.Strategy) -> Iterator[None]:
    """Within the block, ``strategy.reduce`` of a structure returns local values.

    Only structures with ``axis=None`` are answered locally: that is the call
    ``CrossDeviceOps.reduce`` always rejects in multi-worker mode, so nothing
    that worked before changes. The override is an instance attribute, removed
    on exit, so the strategy's class and other strategies are left alone.
    """
    if "reduce" in vars(strategy):  # already inside (re-entrant call)
        yield
        return
    reduce = strategy.reduce

    def local_reduce(reduce_op: Any, value: Any, axis: int | None = None) -> Any:
        if axis is None and tf.nest.is_nested(value):
            return tf.nest.map_structure(
                lambda v: _first_local_replica(v, strategy), value)
        return reduce(reduce_op, value, axis=axis)

    strategy.reduce = local_reduce
    try:
        yield
    finally:
        del strategy.reduce


def _fix_symbolic_build(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _maybe_symbolic_build(self: Any, iterator: Any = None,
                              data_batch: Any = None) -> Any:
        strategy = self._distribute_strategy
        if iterator is None or not _in_multi_worker_mode(strategy):
            return original(self, iterator=iterator, data_batch=data_batch)
        with _structure_reduce_is_local(strategy):
            return original(self, iterator=iterator, data_batch=data_batch)

    return _maybe_symbolic_build


def _fix_scalar_mean(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def reduce_per_replica(values: Any, strategy: tf.distribute.Strategy,
                           reduction: str) -> Any:
        # "auto" means "mean" for every strategy but TPUStrategy, which is
        # never multi-worker MirroredStrategy.
        if reduction not in ("auto", "mean") or not _in_multi_worker_mode(strategy):
            return original(values, strategy, reduction)

        def reduce_one(v: Any) -> Any:
            if _first_local_replica(v, strategy).shape.rank == 0:
                return strategy.reduce("MEAN", v, axis=None)
            return original(v, strategy, reduction)

        return keras.tree.map_structure(reduce_one, values)

    return reduce_per_replica


def _targets() -> dict[str, tuple[Any, str, Callable[..., Any]]]:
    # fault -> (owner, attribute, fix factory)
    return {
        "symbolic_build_reduce": (
            _tf_trainer.TensorFlowTrainer, "_maybe_symbolic_build",
            _fix_symbolic_build),
        "scalar_mean_reduce": (
            _tf_trainer, "reduce_per_replica", _fix_scalar_mean),
    }


def patch_multi_worker() -> tuple[str, ...]:
    """Installs the fixes for the multi-worker faults the installed Keras has.

    Call it once before ``model.fit``/``evaluate`` under a multi-worker
    ``MultiWorkerMirroredStrategy``; calling it again changes nothing. Outside
    multi-worker mode the fixes hand every call to Keras unchanged.

    Returns:
        The names of the faults now fixed (see :data:`FAULTS`); empty when
        Keras has none of them.
    """
    with _lock:
        for name in keras_multi_worker_faults():
            owner, attribute, make_fix = _targets()[name]
            current = getattr(owner, attribute)
            if getattr(current, _MARK, None) == name:
                continue
            fix = make_fix(current)
            setattr(fix, _MARK, name)
            _originals[name] = current
            setattr(owner, attribute, fix)
        return tuple(name for name in FAULTS if name in _originals)


def unpatch_multi_worker() -> None:
    """Puts Keras's own functions back (for tests that need the fault)."""
    with _lock:
        for name, original in list(_originals.items()):
            owner, attribute, _ = _targets()[name]
            if getattr(getattr(owner, attribute), _MARK, None) == name:
                setattr(owner, attribute, original)
            del _originals[name]


def patched_faults() -> tuple[str, ...]:
    """Names of the faults whose fixes are installed now."""
    with _lock:
        return tuple(name for name in FAULTS if name in _originals)


def _unsupported_reason(strategy: tf.distribute.Strategy) -> str | None:
    name = type(strategy).__name__
    if name.startswith("ParameterServerStrategy"):
        return ("its workers apply updates asynchronously, so they cannot agree on "
                "skipping a step with non-finite gradients, and Keras 3's model.fit "
                "does not run under it")
    if name.startswith("TPUStrategy"):  # the test Keras's own trainer uses
        return ("it is untested with keras-mp, and XLA on TPU drops the assertion "
                "behind `max_consecutive_skips`")
    return None


def check_strategy(strategy: tf.distribute.Strategy | None = None) -> None:
    """Raises if keras-mp's loss scaling cannot run under ``strategy``.

    :class:`keras_mp.LossScaleOptimizer` calls it when it is created inside a
    strategy's scope and when it creates its variables (the first ``fit``),
    so an unsupported set-up fails before any step runs.

    Args:
        strategy: a ``tf.distribute.Strategy``; the current one when None.

    Raises:
        TypeError: ``strategy`` is not a ``tf.distribute.Strategy``.
        ValueError: ``strategy`` is a ParameterServerStrategy or a TPUStrategy.
    """
    if strategy is None:
        strategy = tf.distribute.get_strategy()
    if not isinstance(strategy, (tf.distribute.Strategy, tf.compat.v1.distribute.Strategy)):
        raise TypeError("`strategy` must be a tf.distribute.Strategy or None, got "
                        f"{strategy!r}.")
    reason = _unsupported_reason(strategy)
    if reason is not None:
        raise ValueError(
            f"keras_mp.LossScaleOptimizer does not support {type(strategy).__name__}: "
            f"{reason}. Supported strategies: {', '.join(SUPPORTED_STRATEGIES)} "
            "(see docs/distributed.md).")
