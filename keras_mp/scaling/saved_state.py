"""How :class:`keras_mp.LossScaleOptimizer` loads its variables from a file:
where Keras only warns when the file holds another count of optimizer
variables and keeps the defaults (a resumed run would restart from the initial
loss scale), it refuses a file saved with another optimizer or schedule, and
loads its own state where only the inner optimizer's count changed (the
model's variables changed since it was saved: quantized, say), skipping the
inner state with Keras's warning.
"""

from __future__ import annotations

import warnings

import numpy as np

__all__ = ["SavedStateMixin"]


class SavedStateMixin:
    """``load_own_variables`` for :class:`keras_mp.LossScaleOptimizer` (its
    own variables first, then the inner optimizer's)."""

    def load_own_variables(self, store):
        # Keras only warns on a count mismatch and keeps the defaults: a resumed run would
        # restart from the initial scale. No optimizer in the file: Keras's warning, state kept.
        saved, counts = len(store.keys()), (len(self.variables), self._unbuilt_variable_count)
        late = self._attribute_variables()
        if self.built and late and saved == len(self.variables) - len(late):
            self._load_without(store, late)
            return
        if self.built and saved and saved not in counts and self._load_own_part(store, saved):
            return
        if self.built and saved and saved not in counts:
            own = ", ".join(v.path.split("/")[-1] for v in self._variables)
            raise ValueError(
                f"Cannot load the optimizer state: the file holds {saved} optimizer "
                f"variables, this {type(self).__name__} ({type(self.schedule).__name__}, "
                f"inner {type(self.inner_optimizer).__name__}) has {len(self.variables)} "
                f"(its own: {own}; then the inner optimizer's). The file was saved with "
                "another optimizer (e.g. without keras_mp.LossScaleOptimizer) or another "
                "loss-scale schedule: compile with the optimizer it was saved with, or "
                "load only the model weights (e.g. load_weights into a model compiled "
                "without an optimizer, then copy them).")
        super().load_own_variables(store)

    def _attribute_variables(self) -> list:
        """The inner optimizer's variables it made as attributes rather than
        with ``add_variable`` (outside its name scope: Nadam's ``_u_product``,
        Adafactor's placeholders), which files saved before keras-mp tracked
        them (as Keras's own LossScaleOptimizer still does not) lack."""
        inner = self.inner_optimizer
        return [v for v in inner.variables if not v.path.startswith(f"{inner.name}/")]

    def _load_without(self, store, late: list) -> None:
        """Loads a file saved without ``late`` (each other variable in its
        place), leaving those as they are, with a warning."""
        skip = {id(v) for v in late}
        for i, v in enumerate(v for v in self.variables if id(v) not in skip):
            v.assign(store[str(i)])
        warnings.warn(
            f"The file was saved without the inner {type(self.inner_optimizer).__name__}'s "
            f"{', '.join(v.path for v in late)} (keras-mp before 2026-12-07 and Keras's own "
            "LossScaleOptimizer leave it out): it keeps its present value; every other "
            "optimizer variable was loaded.", stacklevel=3)

    def _load_own_part(self, store, saved: int) -> bool:
        """Where the file holds this optimizer's own variables (same shapes,
        first) but another count of the inner optimizer's (the model's
        variables changed since: quantized, say), loads its own and, as Keras
        does for any optimizer, skips the inner state with a warning."""
        own = list(self._variables)

        def kind(i):
            value = store[str(i)]
            return tuple(np.shape(value)), np.dtype(value.dtype).name
        # Ours first (same shapes and dtypes), then the inner optimizer's
        # iteration count and learning rate: not another schedule's state.
        if saved < len(own) + 2 or [kind(i) for i in range(len(own) + 2)] != \
                [(tuple(v.shape), v.dtype) for v in own] + [((), "int64"), ((), "float32")]:
            return False
        for i, v in enumerate(own):
            v.assign(store[str(i)])
        warnings.warn(f"Skipping the inner {type(self.inner_optimizer).__name__}'s state: the "
                      f"file holds {saved - len(own)} of its variables, this one has "
                      f"{len(self.variables) - len(own)} (the model's variables changed since "
                      "it was saved). The loss-scale state was loaded.", stacklevel=2)
        return True
