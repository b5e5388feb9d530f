"""The adaptive controller's per-layer state as variables attached to a model.

:class:`PrecisionState` holds what :func:`keras_mp.adaptive.decisions.controller.decide`
remembers per layer (dtype, healthy intervals, cool-down, switches, strikes,
trial) and the call counter, as int variables, so that ``save_weights``,
``ModelCheckpoint``, ``BackupAndRestore`` and ``tf.train.Checkpoint`` carry
it. Beside its variables, in the same weights file, it writes the run's
record: every layer's switch history, the timeline the picture draws
(:mod:`keras_mp.adaptive.record.timeline`) and the controller's next early
decision, as JSON in one byte array
(``"record"``), so that a run resumed by ``BackupAndRestore`` (a weights-only
checkpoint) goes on with its whole history; ``tf.train.Checkpoint`` saves
variables only and does not carry the record. :func:`attached` attaches such
objects (and the statistics) to a model without changing ``model.layers`` or
``model.weights``.

Example:
    >>> import keras, numpy as np
    >>> from keras_mp.adaptive.record.state import PrecisionState
    >>> state = PrecisionState(("dense",))
    >>> store = {}
    >>> state.save_own_variables(store)  # not bound to a model: variables only
    >>> sorted(store)
    ['0', '1']
    >>> store["record"] = np.frombuffer(b'{"history": {"dense": []}, "timeline": null}', np.uint8)
    >>> state.load_own_variables(store)
    >>> state.take_record()
    {'history': {'dense': []}, 'timeline': None}
"""

from __future__ import annotations

import json
import weakref
from typing import Any

import keras
import numpy as np
from keras.src.utils.tracking import DotNotTrackScope  # no public name

from keras_mp import _installed
from keras_mp.adaptive.decisions import controller
from keras_mp.adaptive.decisions.probe_schedule import ProbeSchedule
from keras_mp.adaptive.record import timeline as timeline_lib

__all__ = ["RECORD_KEY", "STATE_FIELDS", "AttachedState", "PrecisionState"]

#: The key of the run's record (JSON bytes) beside the state's variables in a weights file.
RECORD_KEY = "record"

#: The :class:`keras_mp.adaptive.decisions.controller.LayerState` fields, in table-row order.
#: The ``trial`` row also carries ``suspect`` (``trial + 2 * suspect``: a layer
#: is never on both trials), so tables saved before promotion trials load.
STATE_FIELDS = ("dtype", "healthy", "cooldown", "switches", "strikes", "trial")


class AttachedState(keras.layers.Layer):
    """A layer that keras-mp attaches to a model (:func:`attached`) only for
    its variables, never called on data.

    A weights file without its entry (saved by a model that never trained
    under keras-mp, or by Keras alone) leaves it as it is: Keras's
    ``load_weights`` loads the model's own weights from such a file, as it
    does without keras-mp (Keras's ``embedding_test.py::test_enable_lora``
    loads a fresh model's weights into a trained one).
    """

    def load_own_variables(self, store):
        if len(store.keys()):  # else nothing of ours is in the file
            super().load_own_variables(store)


class PrecisionState(AttachedState):
    """The controller's per-layer state as variables, so that checkpoints and
    ``BackupAndRestore`` carry it. Never called on data."""

    def __init__(self, paths: tuple[str, ...]):
        if isinstance(paths, str) or not all(isinstance(p, str) for p in paths):
            raise TypeError(f"`paths` must be a tuple of layer paths, got {paths!r}.")
        super().__init__(name="keras_mp_precision_state", dtype="float32", trainable=False)
        self.paths = tuple(paths)
        kw = dict(trainable=False, aggregation="only_first_replica", initializer="zeros")
        self.table = self.add_weight(shape=(len(STATE_FIELDS), len(paths)), dtype="int32",
                                     name="table", **kw)
        self.calls = self.add_weight(shape=(), dtype="int64", name="calls", **kw)
        self.built = True
        self._last: tuple | None = None  # what was last written or read, on the host
        self._bound: tuple | None = None  # weak references to the model and its policy
        self._loaded: dict[str, Any] | None = None  # the record a weights file brought
        self._schedule: list[int] | None = None  # a decision due soon: [call, window start]
        self._probes: ProbeSchedule | None = None  # where fit's probe runs next

    def bind(self, model: keras.Model, policy) -> None:
        """The model and policy whose record (switch histories, timeline)
        the weights files get beside the variables."""
        object.__setattr__(self, "_bound", (weakref.ref(model), weakref.ref(policy)))

    def set_schedule(self, call: int | None, start: int = 0) -> None:
        """The controller's next early decision (at ``call``, its window from
        ``start``; None: none), which the record carries: a run resumed before
        that call decides there too."""
        object.__setattr__(self, "_schedule", None if call is None else [int(call), int(start)])

    def set_probes(self, schedule: ProbeSchedule | None) -> None:
        """Where ``fit``'s probe runs next (None: never), which the record
        carries: a run resumed from a weights file probes where this one would."""
        if schedule is not None and not isinstance(schedule, ProbeSchedule):
            raise TypeError(f"`schedule` must be a ProbeSchedule or None, got {schedule!r}.")
        object.__setattr__(self, "_probes", schedule)

    @property
    def probes(self) -> ProbeSchedule | None:
        """The probe's schedule last set (:meth:`set_probes`), or None."""
        return self._probes

    def record(self) -> dict[str, Any] | None:
        """The run's record as saved: ``history`` (layer path -> its switches),
        ``timeline`` (:meth:`Timeline.get_config`, or None), ``schedule``
        (:meth:`set_schedule`) and ``probes`` (:meth:`set_probes`); None unbound."""
        model, policy = (ref() for ref in self._bound) if self._bound else (None, None)
        if model is None or policy is None:
            return None
        held = timeline_lib.of(model)
        return {"history": {p: [dict(h) for h in policy.record(p).get("history", [])]
                            for p in self.paths},
                "timeline": None if held is None else held.get_config(),
                "schedule": self._schedule,
                "probes": None if self._probes is None else self._probes.get_config()}

    def take_record(self) -> dict[str, Any] | None:
        """The record the last weights file loaded brought (once; None
        after, or if the file had none: saved before records were kept)."""
        loaded = self._loaded
        object.__setattr__(self, "_loaded", None)
        return loaded

    def save_own_variables(self, store):
        super().save_own_variables(store)
        record = self.record()
        if record is not None:
            store[RECORD_KEY] = np.frombuffer(json.dumps(record).encode(), np.uint8)

    def load_own_variables(self, store):
        keys = [k for k in store.keys() if k != RECORD_KEY]
        super().load_own_variables({k: store[k] for k in keys})
        if keys and RECORD_KEY in store.keys():
            loaded = json.loads(np.asarray(store[RECORD_KEY], np.uint8).tobytes())
            object.__setattr__(self, "_loaded", loaded)

    def write(self, states: list[controller.LayerState], candidates: tuple[str, ...],
              calls: int) -> None:
        rows = [[candidates.index(s.dtype) for s in states]]
        rows += [[getattr(s, f) for s in states] for f in STATE_FIELDS[1:-1]]
        rows.append([s.trial + 2 * s.suspect for s in states])
        self.table.assign(np.asarray(rows, np.int32))
        self.calls.assign(calls)
        self._last = (list(states), calls)

    def restored(self, candidates: tuple[str, ...]) -> bool:
        """Whether the variables changed since this process last wrote or read
        them: a checkpoint was loaded into them."""
        last = self._last  # read() replaces it
        return last is None or self.read(candidates) != last

    def read(self, candidates: tuple[str, ...]) -> tuple[list[controller.LayerState], int]:
        table = np.asarray(keras.ops.convert_to_numpy(self.table))
        states = [controller.LayerState(
            candidates[min(int(table[0, i]), len(candidates) - 1)],
            *(int(table[j, i]) for j in range(1, len(STATE_FIELDS) - 1)),
            trial=int(table[-1, i]) % 2, suspect=int(table[-1, i]) // 2)
            for i in range(len(self.paths))]
        calls = int(keras.ops.convert_to_numpy(self.calls))
        self._last = (states, calls)
        return states, calls

    def call(self, inputs):  # pragma: no cover - never called on data
        raise TypeError("PrecisionState holds state; it is not called on data.")


def attached(model: keras.Model, attr: str, cls, paths: tuple[str, ...], make):
    """``(object, created)``: the ``cls`` attached to ``model`` as ``attr``
    for these layer paths, attaching a new one if there is none."""
    obj = getattr(model, attr, None)
    if isinstance(obj, cls) and obj.paths == paths:
        return obj, False
    with model.distribute_strategy.scope():
        obj = make()
    # Bypasses Keras's tracking on purpose: tracked, it would become one of
    # model.layers and change model.weights. Keras's saving walks plain
    # attributes, so .keras/.weights.h5 files still carry its variables;
    # TensorFlow's own dependency (what Keras's tracking would also have
    # added) makes tf.train.Checkpoint(model=...) carry them too.
    # Keras's tracking off while TensorFlow records it: a subclassed model
    # (and a KerasHub task) keeps TensorFlow's dependency names in a Keras
    # TrackedDict, which would make the object one of model.layers, or
    # raise "You cannot add new elements of state ... already built".
    object.__setattr__(model, attr, obj)
    with DotNotTrackScope():
        model._track_trackable(obj, name=attr, overwrite=True)
    # Not in model.variables: the execution trial puts them back after the
    # calls it makes on a copy of the training state.
    _installed.keep_with_step(model, attr, obj.variables)
    return obj, True
