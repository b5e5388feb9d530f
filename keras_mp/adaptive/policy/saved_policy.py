"""An :class:`keras_mp.AdaptivePolicy` in a ``.keras`` file: written once per
model, read back as the one policy that every layer of the loaded model
shares, whatever the global policy of the loading process.

Keras writes a layer's ``dtype`` into each layer's config, so a policy shared
by every layer would be written once per layer (its records with it: the
text classifier of issue 41 grew from 6 KB to 135 KB). While Keras saves a
model (inside its ``ObjectSharingScope``), :func:`first_in_save` lets the
first layer's config carry the whole policy and the others only its name and
candidates (where the first was a sublayer's config that its layer dropped,
a recurrent layer's cell, another layer's is made whole when the save ends).

While Keras loads a model, :func:`read` makes every config of one policy
(however many, in any order, full or short, from files of any keras-mp
version) one object again, and makes it the global policy until the load
ends: layers that a custom layer creates in its ``__init__`` without a
``dtype`` (a Transformer block's projections) are not in the file, and took
the global policy when they were built in training, so they take the loaded
one now. Without that a model saved under an adaptive policy loaded with the
loading process's policy in those layers: other dtypes, or a
float16-meets-float32 error inside the block. :func:`install` (called on
import) wraps Keras's ``ObjectSharingScope.__exit__`` to restore the global
policy when the load ends.

A layer without a ``get_config`` of its own is saved from the arguments
Keras recorded when it was made (its "auto config"), and Keras records them
only if every one is a plain value: a loaded layer gets its policy as an
object (``Layer.from_config`` deserializes it), so under an adaptive policy
the loaded layer had no config and the loaded model could not be saved
again (Keras's own ``sequential_test.py::test_serialization``).
:func:`install` also wraps ``Operation.__new__`` so that Keras records the
policy's name in its place (``Layer.get_config`` writes the layer's own
policy over it in any case).

Example:
    >>> import keras, keras_mp, tempfile, os
    >>> with keras_mp.policy_scope("adaptive_bfloat16"):
    ...     model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4),
    ...                               keras.layers.Dense(2)])
    >>> path = os.path.join(tempfile.mkdtemp(), "m.keras")
    >>> model.save(path)
    >>> loaded = keras.saving.load_model(path)
    >>> loaded.layers[0].dtype_policy is loaded.layers[1].dtype_policy
    True
    >>> keras_mp.global_policy().name
    'float32'
"""

from __future__ import annotations

import copy
from typing import Any

from keras.src.backend.common import global_state  # no public name
from keras.src.ops.operation import Operation  # no public name
from keras.src.saving import serialization_lib  # no public name

from keras_mp.adaptive.decisions.rule import DTYPE_ORDER, LayerState

# first_in_save, read and check_records serve AdaptivePolicy's get_config,
# from_config and constructor.
__all__ = ["install"]

#: The key of a short config: the whole policy is in another layer's config.
SHORT = "in_another_layer"

_WRITTEN = "keras_mp/adaptive_policies_written"  # in the save's id -> config map
_LOADED = "keras_mp/adaptive_policies_loaded"  # in the load's id -> object map
_GLOBAL = "keras_mp/global_policy_before_load"
_WHOLE = "keras_mp/adaptive_policies_read_whole"  # the policies a full config was read for
_EDITED = ("The .keras file was edited or damaged: save the model again from where it "
           "trained (or from a copy of the file made before).")


def _scope(name: str) -> dict | None:
    """Keras's map of the save (``"id_to_config_map"``) or load
    (``"id_to_obj_map"``) in progress, or None."""
    return global_state.get_global_attribute(f"shared_objects/{name}")


def first_in_save(policy: Any) -> bool:
    """Whether ``policy``'s config must be written whole: outside a save,
    or the first time this save writes it."""
    written = _scope("id_to_config_map")
    if written is None:
        return True
    seen = written.setdefault(_WRITTEN, set())
    if id(policy) in seen:
        return False
    seen.add(id(policy))
    return True


def _key(config: dict) -> tuple:
    """What identifies a policy in a file, as :func:`read` groups them."""
    return config.get("name"), tuple(sorted(config.get("candidates") or ()))


def _keep_whole(configs: dict) -> None:
    """Makes a short config of each policy whole (one that any load reads,
    :func:`read`) where no whole one is in the saved model's config: a
    layer can serialize a sublayer and drop its config (Keras's ``LSTM``,
    ``GRU`` and ``SimpleRNN`` serialize their cell's, policy included, then
    delete it), and the loaded model would refer to a policy no config holds
    (:func:`_check_whole`).

    ``configs`` is the save's id -> config map: Keras records each object's
    first config under its id (the policy's whole one) and an object after
    what it holds, so the model's config is the last one recorded. (What the
    file holds are copies of those configs, made as each enclosing object's
    config was serialized: they are found by what they say, as a load reads
    them.)"""
    top = next((c for k, c in reversed(configs.items()) if isinstance(k, int)), None)
    wholes = {}
    for policy_id in configs.get(_WRITTEN, ()):
        outer = configs.get(policy_id)
        if isinstance(outer, dict) and isinstance(outer.get("config"), dict):
            wholes[_key(outer["config"])] = outer
    if top is None or not wholes:
        return
    found: dict[tuple, list[tuple[dict, bool]]] = {}  # policy -> (config, in a layer's)
    stack = [(top, False)]
    while stack:  # depth first, in the file's order
        node, in_layers = stack.pop()
        if isinstance(node, dict):
            inner = node.get("config")
            if isinstance(inner, dict) and "candidates" in inner and _key(inner) in wholes \
                    and node.get("class_name") == wholes[_key(inner)].get("class_name"):
                found.setdefault(_key(inner), []).append((node, in_layers))
                continue
            stack.extend(reversed([(v, in_layers or k == "layers") for k, v in node.items()
                                   if isinstance(v, (dict, list))]))
        elif isinstance(node, list):
            stack.extend(reversed([(v, in_layers) for v in node if isinstance(v, (dict, list))]))
    for key, nodes in found.items():
        if any(not node["config"].get(SHORT) for node, _ in nodes):
            continue
        # A layer's config (a load reads every layer's; a model's own dtype
        # it may not read), else all of them.
        layers = [node for node, in_layers in nodes if in_layers]
        for node in layers[:1] or [node for node, _ in nodes]:
            node["config"] = copy.deepcopy(wholes[key]["config"])
            # Read whatever the load's order: a config marked as a shared
            # object is skipped where another of the same mark was read
            # first; read() makes every config of the policy one object.
            node.pop("shared_object_id", None)


def read(cls, config: dict[str, Any]):
    """The policy ``config`` describes: inside a load, the one policy of that
    name and candidates this load has read (``config``'s records and
    entries merged into it), made the global policy until the load ends."""
    config = dict(config)
    short = bool(config.pop(SHORT, False))
    loaded = _scope("id_to_obj_map")
    if loaded is None:
        return cls(**config)
    policies = loaded.setdefault(_LOADED, {})
    key = (config.get("name"), tuple(sorted(config.get("candidates") or ())))
    if not short:
        loaded.setdefault(_WHOLE, set()).add(key)
    policy = policies.get(key)
    if policy is None:
        policy = policies[key] = cls(**config)
        policy.loaded = True
        if _GLOBAL not in loaded:
            loaded[_GLOBAL] = global_state.get_global_attribute("dtype_policy", None)
            global_state.set_global_attribute("dtype_policy", policy)
    elif not short:
        policy.merge(cls(**config))
    return policy


def install(adaptive_policy: type) -> None:
    """Wraps ``ObjectSharingScope.__exit__`` (once) so that a load restores
    the global policy that :func:`read` replaced and a save keeps each
    policy's whole config (:func:`_keep_whole`), and ``Operation.__new__``
    so that a layer made with an ``adaptive_policy`` object (the class,
    passed in: its module imports this one) keeps its auto config (module
    docstring)."""
    if not getattr(Operation.__new__, "_keras_mp", False):
        keras_new = Operation.__new__

        def __new__(cls, *args, **kwargs):
            if isinstance(kwargs.get("dtype"), adaptive_policy):
                kwargs["dtype"] = kwargs["dtype"].name  # what Keras's auto config records
            return keras_new(cls, *args, **kwargs)  # __init__ gets the object

        __new__._keras_mp = True
        Operation.__new__ = staticmethod(__new__)
    scope = serialization_lib.ObjectSharingScope
    if getattr(scope.__exit__, "_keras_mp", False):
        return
    keras_exit = scope.__exit__

    def __exit__(self, *args, **kwargs):
        loaded = _scope("id_to_obj_map")
        saving = _scope("id_to_config_map")
        if saving is not None and saving.get(_WRITTEN) and not (args and args[0] is not None):
            _keep_whole(saving)
        try:
            result = keras_exit(self, *args, **kwargs)
        finally:
            if loaded is not None and _GLOBAL in loaded:
                global_state.set_global_attribute("dtype_policy", loaded[_GLOBAL])
        if loaded is not None and not (args and args[0] is not None):
            _check_whole(loaded)
        return result

    __exit__._keras_mp = True
    scope.__exit__ = __exit__


def _check_whole(loaded: dict) -> None:
    """Refuses a load whose layers referred to an adaptive policy (a short
    config) that no layer's config held whole: its entries and records were
    removed or its reference altered, and the layers would take the
    policy's defaults (float16 where float32 was saved, another dtype)."""
    missing = [key for key in loaded.get(_LOADED, {}) if key not in loaded.get(_WHOLE, set())]
    if missing:
        name, candidates = missing[0]
        raise ValueError(
            f"Cannot load the model: its layers refer to the adaptive policy {name!r} "
            f"(candidates {list(candidates)}), which no layer's config holds whole (no "
            "entries, no records), so they would load with its defaults, not the precisions "
            f"they were saved with. {_EDITED}")


def check_records(records: Any) -> dict[str, dict[str, Any]]:
    """``records`` (layer path -> what the controller recorded), if each
    record is a dict whose ``"state"`` is a controller state's config and
    whose ``"history"`` is a list of switches; an altered file fails here,
    naming the layer, not later in training."""
    if records is None:
        return {}
    if not isinstance(records, dict):
        raise TypeError(f"`records` must be a dict of layer path -> record, got {records!r}.")
    for path, record in records.items():
        problem = None
        if not isinstance(path, str) or not path or not isinstance(record, dict):
            problem = f"{record!r} is not a record of a layer path"
        elif record.get("state") is not None:
            try:
                LayerState(**record["state"])
            except (TypeError, ValueError) as e:
                problem = f"its state {record['state']!r} is invalid ({e})"
        if problem is None and not _valid_history(record.get("history", [])):
            problem = f"its history {record.get('history')!r} is not a list of switches"
        if problem is not None:
            raise ValueError(f"`records` of {path!r}: {problem}. {_EDITED}")
    return records


def _valid_history(history: Any) -> bool:
    return isinstance(history, list) and all(
        isinstance(h, dict) and isinstance(h.get("step"), int) and h["step"] >= 0
        and h.get("old") in DTYPE_ORDER and h.get("new") in DTYPE_ORDER
        and isinstance(h.get("reason"), str) for h in history)
