"""The adaptive controller's per-layer state as variables attached to a model.

:class:`PrecisionState` holds what :func:`keras_mp.adaptive.decisions.controller.decide`
remembers per layer (dtype, healthy intervals, cool-down, switches, strikes,
trial) and the call counter, as int variables, so that ``save_weights``,
``ModelCheckpoint``, ``BackupAndRestore`` and ``tf.train.Checkpoint`` carry
it. :func:`attached` attaches such objects (and the statistics) to a model
without changing ``model.layers`` or ``model.weights``.
"""

from __future__ import annotations

import keras
import numpy as np
from keras.src.utils.tracking import DotNotTrackScope  # no public name

from keras_mp import _installed
from keras_mp.adaptive.decisions import controller

__all__ = ["STATE_FIELDS", "AttachedState", "PrecisionState"]

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
