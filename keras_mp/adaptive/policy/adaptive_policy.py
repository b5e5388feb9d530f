"""``AdaptivePolicy``: a per-layer dtype policy whose entries change during
training (the global-policy functions that accept it are in
:mod:`keras_mp.policies`).

An :class:`AdaptivePolicy` is a Keras ``DTypePolicyMap``. Set as the global
policy, every layer built afterwards holds it and looks its own path up in it
whenever it needs its compute dtype, so changing an entry (and retracing the
train step) changes that layer's precision. Variables always stay float32
(master weights): each entry is ``float32``, ``mixed_bfloat16`` or
``mixed_float16``; with ``"float8"`` among the candidates, each ``Dense`` and
``EinsumDense`` holds a :class:`keras_mp.adaptive.evidence.float8.Float8Policy` instead, whose
``active`` flag says whether it trains in float8 now (see
:mod:`keras_mp.adaptive.evidence.float8`).

Besides the entries, the policy carries what the adaptive controller knows per
layer (its state, its last statistics, its probe errors and its switch
history) and the count of train steps it has seen, so that a ``.keras`` file
restores all of it: the first layer's config holds the whole policy, the
others a short reference, and a load makes them one policy again
(:mod:`keras_mp.adaptive.policy.saved_policy`).

Example:
    >>> import keras, keras_mp
    >>> keras_mp.set_global_policy("adaptive_bfloat16")
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    >>> layer = model.layers[0]
    >>> layer.compute_dtype, layer.variable_dtype
    ('bfloat16', 'float32')
    >>> keras_mp.global_policy().assign(layer.path, "float32")
    >>> layer.compute_dtype
    'float32'
    >>> keras_mp.set_global_policy("float32")
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import keras
from keras.dtype_policies import DTypePolicy, DTypePolicyMap

from keras_mp import _checks as checks
from keras_mp import device
from keras_mp.adaptive.policy import saved_policy
from keras_mp.adaptive.policy.layer_paths import check_path, same_layer
from keras_mp.adaptive.policy.float8_policy import Float8Policy, Float8Recipe
from keras_mp.adaptive.decisions.rule import DecisionRule, sort_candidates

__all__ = ["AdaptivePolicy", "patch_default_names"]

_KERAS_FOR = {"float32": "float32", "bfloat16": "mixed_bfloat16", "float16": "mixed_float16"}


def _keras_policy(dtype: str) -> DTypePolicy:
    return DTypePolicy(_KERAS_FOR[dtype])


def patch_default_names() -> None:
    """Keras's ``DTypePolicy()`` and ``QuantizedDTypePolicy(mode)`` without a
    name take the global policy's name, which under an :class:`AdaptivePolicy`
    (``"adaptive_float16"``) is no Keras dtype: they take the name of its
    default entry instead (``"mixed_float16"``), the policy its layers start
    with. Idempotent; called on import of ``keras_mp``.

    Example:
        >>> import keras, keras_mp
        >>> with keras_mp.policy_scope("adaptive_bfloat16"):
        ...     keras.DTypePolicy().name
        'mixed_bfloat16'
    """
    from keras.src.dtype_policies import dtype_policy as module

    for cls, argument in ((module.DTypePolicy, "name"),
                          (module.QuantizedDTypePolicy, "source_name")):
        init = cls.__dict__["__init__"]
        if getattr(init, "_keras_mp_default_name", False):
            continue

        def patched(self, *args, _init=init, _argument=argument, _class=cls, **kwargs):
            # The name is the first argument of DTypePolicy, the second of
            # QuantizedDTypePolicy (after the mode).
            position = 0 if _class is module.DTypePolicy else 1
            given = args[position] if len(args) > position else kwargs.get(_argument)
            # Read only when no name is given: the global's own default
            # is built here, with a name.
            current = module.dtype_policy() if given is None else None
            if isinstance(current, AdaptivePolicy):
                kwargs[_argument] = current.default_policy.name
                args = args[:position]
            _init(self, *args, **kwargs)

        patched._keras_mp_default_name = True
        cls.__init__ = patched


@keras.saving.register_keras_serializable(package="keras_mp")
class AdaptivePolicy(DTypePolicyMap):
    """A ``DTypePolicyMap`` whose per-layer compute dtypes are chosen during
    training among ``candidates``; variables stay float32.

    Args:
        candidates: the allowed compute dtypes, from ``"float8"``,
            ``"float16"``, ``"bfloat16"``, ``"float32"``; layers start in the
            narrowest they can use (``"float8"`` only for ``Dense`` and
            ``EinsumDense``, which Keras trains in float8; the others start
            in the narrowest of the rest, which must not be empty).
            None: the device's fast set (:func:`keras_mp.device.default_candidates`):
            never float16 on a CPU without float16 units, float8 only on
            GPUs with float8 units.
        rule: the :class:`keras_mp.adaptive.decisions.rule.DecisionRule` (or its config
            dict) used by :class:`keras_mp.callbacks.AdaptivePrecision`.
        name: the policy's name; ``"adaptive"`` unless given.
        assignments: layer path -> dtype, for layers not in the narrowest
            candidate (restored from a config).
        policies: layer path (or regex, as in ``DTypePolicyMap``) -> any
            other ``DTypePolicy`` (or its name or config): quantized entries
            such as ``"int8_from_mixed_bfloat16"``, or dtypes outside the
            candidates. The adaptive controller never changes them.
        records: layer path -> what the controller recorded (``"state"``,
            ``"stats"``, ``"history"``), restored from a config.
        float8_recipe: a :class:`keras_mp.adaptive.evidence.float8.Float8Recipe` (or its
            config) for the float8 layers; the defaults are Keras's.
        float8: layer path -> dtype of each float8-capable layer (restored
            from a config; :func:`keras_mp.adaptive.evidence.float8.prepare` adds them).
        layer_loss_scales: per-layer loss scales (needs ``"float16"`` among
            the candidates): every controlled layer not inside another runs
            its backward pass at the global loss scale times a factor of its
            own, chosen from its gradient statistics, so layers whose
            gradients lie further apart than float16's range all stay in
            float16 (see :mod:`keras_mp.scaling.layer_scales`). The optimizer
            becomes a ``keras_mp.LossScaleOptimizer(..., layer_scales=True)``.
        calls: train-function calls the controller has counted (restored
            from a config: a loaded model's switch history and probe cadence
            continue from there).

    Example:
        >>> from keras_mp import AdaptivePolicy
        >>> p = AdaptivePolicy(candidates=("float16", "float32"))
        >>> p.candidates, p.compute_dtype, p.variable_dtype
        (('float16', 'float32'), 'float16', 'float32')
        >>> p.assign("dense", "float32")
        >>> p["dense"].name, p.dtype_of("other")
        ('float32', 'float16')
        >>> AdaptivePolicy.from_config(p.get_config()).dtype_of("dense")
        'float32'
    """

    def __init__(self, candidates: Sequence[str] | None = None, *,
                 rule: DecisionRule | dict | None = None,
                 name: str | None = None,
                 assignments: dict[str, str] | None = None,
                 policies: dict[str, Any] | None = None,
                 records: dict[str, dict[str, Any]] | None = None,
                 float8_recipe: Float8Recipe | dict | None = None,
                 float8: dict[str, str] | None = None,
                 layer_loss_scales: bool = False,
                 calls: int = 0):
        if candidates is None:
            candidates = device.default_candidates()
        self._candidates = sort_candidates(candidates)
        if not isinstance(layer_loss_scales, bool):
            raise ValueError("`layer_loss_scales` must be True or False, got "
                             f"{layer_loss_scales!r}.")
        if layer_loss_scales and "float16" not in self._candidates:
            raise ValueError("`layer_loss_scales`=True needs 'float16' among the candidates "
                             f"(only float16 is loss-scaled), got {self._candidates}.")
        self.layer_loss_scales = layer_loss_scales
        self.float8_recipe = checks.object_or_config(
            "float8_recipe", float8_recipe, Float8Recipe, "keras_mp.adaptive.evidence.float8.Float8Recipe")
        self.rule = checks.object_or_config("rule", rule, DecisionRule,
                                            "keras_mp.adaptive.decisions.rule.DecisionRule")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"`name` must be a string or None, got {name!r}.")
        self._adaptive_name = name or "adaptive"
        super().__init__(default_policy=_keras_policy(self.float_candidates[0]))
        self._models: Any = weakref.WeakValueDictionary()  # id -> a model it controls
        if float8 is not None and not isinstance(float8, dict):
            raise TypeError(f"`float8` must be a dict of layer path -> dtype, got {float8!r}.")
        for path, dtype in (float8 or {}).items():
            self.set_float8(path, dtype)
        for path, dtype in (assignments or {}).items():
            self.assign(path, dtype)
        if policies is not None and not isinstance(policies, dict):
            raise TypeError(f"`policies` must be a dict of layer path -> DTypePolicy, got "
                            f"{policies!r}.")
        for path, entry in (policies or {}).items():
            self.set_policy(path, entry)
        self.records: dict[str, dict[str, Any]] = copy.deepcopy(
            saved_policy.check_records(records))
        if isinstance(calls, bool) or not isinstance(calls, int) or calls < 0:
            raise ValueError(f"`calls` must be an int >= 0, got {calls!r}.")
        self.calls = calls
        self.loaded = False  # read from a file (saved_policy.read)
        self._override: dict[str, str] = {}

    def __bool__(self) -> bool:
        # A policy is there, whatever its entries: DTypePolicyMap's __len__
        # (its entries) made `if policy_of(model):` false until a switch.
        return True

    def knows(self, model: keras.layers.Layer) -> None:
        """Notes that ``model``'s layers hold this policy (``policy_of`` does),
        so :meth:`assign` can refuse a path inside it that names none of them."""
        self._models[id(model)] = model

    # -- the policy ------------------------------------------------------

    @property
    def name(self) -> str:
        # Not "mixed_float16": Keras's compile must not wrap the optimizer in
        # its own LossScaleOptimizer; keras_mp's callback wraps it instead.
        return self._adaptive_name

    @property
    def candidates(self) -> tuple[str, ...]:
        """The allowed compute dtypes, narrowest first."""
        return self._candidates

    @property
    def float_candidates(self) -> tuple[str, ...]:
        """The candidates other than float8, narrowest first (what layers
        that cannot train in float8 choose among)."""
        return tuple(c for c in self._candidates if c != "float8")

    def candidates_for(self, path: str) -> tuple[str, ...]:
        """The candidates of the layer at ``path``: all of them for a
        float8-capable layer, :attr:`float_candidates` for the others."""
        return self._candidates if self.is_float8(path) else self.float_candidates

    def is_float8(self, path: str) -> bool:
        """Whether the layer at ``path`` is float8-capable (holds a
        :class:`keras_mp.adaptive.evidence.float8.Float8Policy`)."""
        found = self._key_for(path)
        return found is not None and isinstance(self._policy_map[found], Float8Policy)

    def set_float8(self, path: str, dtype: str) -> None:
        """Makes the layer at ``path`` float8-capable, computing in ``dtype``
        (``"float8"``: active; another candidate: that dtype, float8 off).
        Its variables come from Keras's ``layer.quantize("float8")`` (see
        :func:`keras_mp.adaptive.evidence.float8.prepare`)."""
        if "float8" not in self._candidates:
            raise ValueError(f"Cannot make {path!r} float8-capable: 'float8' is not among the "
                             f"candidates {self._candidates}.")
        if not isinstance(path, str) or not path:
            raise ValueError(f"`path` must be a non-empty layer path, got {path!r}.")
        if dtype not in self._candidates:
            raise ValueError(f"`dtype` must be one of the candidates {self._candidates}, "
                             f"got {dtype!r}.")
        old = self._key_for(path)
        if old is not None:
            del self[old]
        self[path] = self._float8_entry(dtype)

    def release_float8(self, path: str, dtype: str) -> None:
        """The layer at ``path`` is no longer float8-capable: it computes in
        ``dtype`` (one of :attr:`float_candidates`) under a plain entry (see
        :func:`keras_mp.adaptive.evidence.float8.release`)."""
        if not self.is_float8(path):
            raise ValueError(f"`path` {path!r} is not a float8-capable layer of this policy.")
        if dtype not in self.float_candidates:
            raise ValueError(f"`dtype` must be one of {self.float_candidates}, got {dtype!r}.")
        del self[self._key_for(path)]
        self.assign(path, dtype)

    def _float8_entry(self, dtype: str) -> Float8Policy:
        source = self.float_candidates[0] if dtype == "float8" else dtype
        return Float8Policy(source_name=_KERAS_FOR[source], active=dtype == "float8",
                            **self.float8_recipe.get_config())

    @property
    def uses_float16(self) -> bool:
        """Whether a layer may compute in float16, so loss scaling is needed."""
        return "float16" in self._candidates

    def _key_for(self, path: str) -> str | None:
        """The stored key that means the layer at ``path``, if any.

        A layer's path includes its model's name when the layer was built
        inside the model ("sequential/dense") but not when Keras rebuilt it
        from a config ("dense"), so a ``.keras`` file written under one and
        read under the other must still find its entry.
        """
        if path in self._policy_map:
            return path
        hits = [k for k in self._policy_map if same_layer(path, k)]
        return hits[0] if len(hits) == 1 else None

    def __getitem__(self, key):
        found = self._key_for(key)
        if key in self._override:
            dtype = self._override[key]
            if found is not None and isinstance(self._policy_map[found], Float8Policy):
                return self._float8_entry(dtype)
            return _keras_policy(self.float_candidates[0] if dtype == "float8" else dtype)
        if found is not None:
            return self._policy_map[found]
        return super().__getitem__(key)

    def record(self, path: str) -> dict[str, Any]:
        """What the controller recorded for the layer at ``path`` (a live dict,
        created empty)."""
        if path not in self.records:
            old = next((k for k in self.records if same_layer(path, k)), None)
            self.records[path] = self.records.pop(old) if old is not None else {}
        return self.records[path]

    def dtype_of(self, path: str) -> str:
        """The adaptive dtype of the layer at ``path``: its compute dtype, or
        ``"float8"`` for a layer training in float8."""
        entry = self[path]
        if isinstance(entry, Float8Policy) and entry.active:
            return "float8"
        return entry.compute_dtype

    def assign(self, path: str, dtype: str) -> None:
        """Sets the compute dtype of the layer at ``path`` (its next trace).

        A layer may be given its dtype before it is built (before it has a
        path), so only a path that cannot name a layer is refused: one with
        an empty part, or one inside a model this policy knows (found on it
        by ``keras_mp.policies.policy_of``, which ``fit`` calls) that names
        none of its layers (:func:`~keras_mp.adaptive.policy.layer_paths.check_path`).

        Args:
            path: a layer's ``path``.
            dtype: one of :attr:`candidates`.
        """
        check_path(path, list(self._models.values()))
        if dtype not in self._candidates:
            raise ValueError(f"`dtype` must be one of the candidates {self._candidates}, "
                             f"got {dtype!r}.")
        if self.is_float8(path):
            self.set_float8(path, dtype)
            return
        if dtype == "float8":
            raise ValueError(f"Cannot assign `dtype`='float8' to the layer at `path`={path!r}: "
                             "only Dense and EinsumDense layers prepared by "
                             "keras_mp.adaptive.evidence.float8.prepare train in float8.")
        old = self._key_for(path)
        if old is not None:
            entry = self._policy_map[old]
            if entry.quantization_mode is not None:
                raise ValueError(
                    f"Cannot assign `dtype`={dtype!r} to the layer at `path`={path!r}: it is "
                    f"quantized ({entry.name!r}); a quantized layer keeps its precision. "
                    "Reload the float model to change it.")
            del self[old]
        if dtype != self.float_candidates[0]:
            self[path] = _keras_policy(dtype)

    @contextlib.contextmanager
    def overriding(self, dtypes: dict[str, str]) -> Iterator[None]:
        """Layers at these paths compute in these dtypes inside the block,
        without a change of the assignments (the float32 probe traces its
        passes this way).

        Example:
            >>> p = AdaptivePolicy(candidates=("bfloat16", "float32"))
            >>> with p.overriding({"dense": "float32"}):
            ...     p.dtype_of("dense")
            'float32'
            >>> p.dtype_of("dense")
            'bfloat16'
        """
        allowed = ("float8", *_KERAS_FOR)
        bad = {k: v for k, v in dtypes.items() if v not in allowed}
        if bad:
            raise ValueError(f"`dtypes` must map layer paths to one of {allowed}, "
                             f"got {bad!r}.")
        old, self._override = self._override, {**self._override, **dtypes}
        try:
            yield
        finally:
            self._override = old

    def set_policy(self, path: str, policy: Any) -> None:
        """Sets any ``DTypePolicy`` as the entry for ``path`` (replacing one),
        as ``DTypePolicyMap``'s item assignment does; the adaptive controller
        does not change such an entry.

        Args:
            path: a layer's ``path`` (or a regex, as in ``DTypePolicyMap``).
            policy: a ``DTypePolicy``, its name (``"int8_from_mixed_bfloat16"``)
                or its config.

        Example:
            >>> from keras_mp import AdaptivePolicy
            >>> p = AdaptivePolicy(("bfloat16", "float32"))
            >>> p.set_policy("dense", "int8_from_mixed_bfloat16")
            >>> q = AdaptivePolicy.from_config(p.get_config())
            >>> q["dense"].name, q["dense"].quantization_mode
            ('int8_from_mixed_bfloat16', 'int8')
        """
        if not isinstance(path, str) or not path:
            raise ValueError(f"`path` must be a non-empty layer path, got {path!r}.")
        if isinstance(policy, dict):
            policy = keras.saving.deserialize_keras_object(policy)
        try:
            policy = keras.dtype_policies.get(policy)
        except (ValueError, TypeError) as e:
            raise ValueError(f"`policy` must be a DTypePolicy, its name or its config, got "
                             f"{policy!r}.") from e
        if isinstance(policy, DTypePolicyMap):
            raise ValueError(f"`policy` for {path!r} cannot itself be a DTypePolicyMap.")
        old = self._key_for(path)
        if old is not None:
            del self[old]
        self[path] = policy

    def _is_assignment(self, policy: DTypePolicy) -> bool:
        dtype = policy.compute_dtype
        return (type(policy) is DTypePolicy and dtype in self._candidates
                and policy.name == _KERAS_FOR[dtype])

    def assignments(self) -> dict[str, str]:
        """Layer path -> compute dtype, for layers not in the narrowest candidate
        (the entries the adaptive controller sets; see :meth:`policies`)."""
        return {path: policy.compute_dtype for path, policy in self._policy_map.items()
                if self._is_assignment(policy)}

    def float8_layers(self) -> dict[str, str]:
        """Layer path -> adaptive dtype, for the float8-capable layers."""
        return {path: "float8" if policy.active else policy.compute_dtype
                for path, policy in self._policy_map.items()
                if isinstance(policy, Float8Policy)}

    def policies(self) -> dict[str, DTypePolicy]:
        """Layer path -> entry, for every other entry (quantized layers, dtypes
        outside the candidates), which the adaptive controller leaves alone."""
        return {path: policy for path, policy in self._policy_map.items()
                if not self._is_assignment(policy) and not isinstance(policy, Float8Policy)}

    # -- serialization ---------------------------------------------------

    def merge(self, other: AdaptivePolicy) -> None:
        """Takes ``other``'s rule, settings, entries and records (another
        copy of this policy read from a file; see
        :mod:`keras_mp.adaptive.policy.saved_policy`)."""
        if not isinstance(other, AdaptivePolicy) or other.candidates != self.candidates:
            raise ValueError(f"`other` must be an AdaptivePolicy with the candidates "
                             f"{self.candidates}, got {other!r}.")
        self.rule, self.float8_recipe = other.rule, other.float8_recipe
        self.layer_loss_scales = other.layer_loss_scales
        for path, dtype in other.float8_layers().items():
            self.set_float8(path, dtype)
        for path, dtype in other.assignments().items():
            self.assign(path, dtype)
        for path, entry in other.policies().items():
            self.set_policy(path, entry)
        self.records.update(copy.deepcopy(other.records))
        self.calls = max(self.calls, other.calls)

    def get_config(self) -> dict[str, Any]:
        head = {
            # Resolved, not None: a model resumed on another device must
            # continue with the precisions it had.
            "candidates": list(self._candidates),
            "name": self._adaptive_name,
            "layer_loss_scales": self.layer_loss_scales,
        }
        if not saved_policy.first_in_save(self):
            # Saving a model: an earlier layer's config holds the rest.
            return {**head, saved_policy.SHORT: True}
        return {
            **head,
            "rule": self.rule.get_config(),
            "assignments": self.assignments(),
            "policies": {path: keras.saving.serialize_keras_object(policy)
                         for path, policy in self.policies().items()},
            "records": copy.deepcopy(self.records),
            "float8_recipe": self.float8_recipe.get_config(),
            "float8": self.float8_layers(),
            "calls": self.calls,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects=None) -> AdaptivePolicy:
        return saved_policy.read(cls, config)

    def __eq__(self, other) -> bool:
        # Keras's DTypePolicy.__eq__ compares ``_name``, which a map has not.
        return type(other) is type(self) and other.get_config() == self.get_config()

    __hash__ = None   # mutable, as Keras's DTypePolicyMap

    def __repr__(self) -> str:
        others = {path: p.name for path, p in self.policies().items()}
        return (f"<AdaptivePolicy {self._adaptive_name!r} candidates={self._candidates} "
                f"assignments={self.assignments()}" + (f" policies={others}" if others else "")
                + (f" float8={self.float8_layers()}" if self.float8_layers() else "")
                + ">")
