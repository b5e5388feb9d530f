"""Every change ``import keras_mp`` makes to Keras, installed from here.

keras-mp changes Keras in two ways. **On import** it replaces a few Keras
functions for the whole process (:data:`ON_IMPORT`): five fix faults of Keras
itself (``kind="fault"``), each acting only where the installed Keras still has
the fault (the atomic saves change no file's content, only how it reaches its
name); the others let the adaptive policies work where Keras's own code reads a
policy (``kind="feature"``), and hand every call under another policy to Keras
unchanged. **Per instance**, while a model trains under an adaptive policy, it
wraps methods of that model, its layers and its optimizer, one object at a time,
through :mod:`keras_mp._installed` (:data:`PER_INSTANCE`); nothing of Keras's
classes changes there.

Each entry names the Keras attributes it replaces (``targets``), why, the
Keras versions it was written for, and the module that holds its code. The
code of each change lives with its concept; this module only lists and
installs them, in this order, once (:func:`install` is idempotent, as is each
change). ``tests/test_keras_changes.py`` checks that every target still exists
in the installed Keras and that each fault is still there (a Keras release that
fixes one fails that test: the fix can then go). docs/architecture.md, "What
importing keras-mp changes in Keras", is this table in prose.

Example:
    >>> import keras_mp
    >>> from keras_mp import _keras_changes
    >>> [change.name for change in _keras_changes.ON_IMPORT if change.kind == "fault"]
    ['multi_worker_fit', 'quantize_policy_map', 'atomic_saves', 'atomic_backups', 'remat']
    >>> _keras_changes.installed() == tuple(c.name for c in _keras_changes.ON_IMPORT)
    True
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["Change", "ON_IMPORT", "PER_INSTANCE", "install", "installed", "resolve"]

#: The Keras release every change was written and tested against.
WRITTEN_FOR = "3.15.1"


@dataclasses.dataclass(frozen=True)
class Change:
    """One change keras-mp makes to Keras.

    Attributes:
        name: a short identifier.
        kind: ``"fault"`` (a fix of a Keras fault, installed only where the
            installed Keras has it) or ``"feature"`` (what an adaptive policy
            needs of Keras's code), or ``"instance"`` (per object, while a model
            adapts).
        targets: the Keras attributes replaced, as ``"module:Class.attribute"``
            (resolved by :func:`resolve`).
        reason: one line: why.
        keras: the Keras versions it was written for.
        module: the keras-mp module that holds the code.
        install: what installs it (``None`` for per-instance changes, which
            the module installs on each object it adapts).
    """

    name: str
    kind: str
    targets: tuple[str, ...]
    reason: str
    keras: str
    module: str
    install: Callable[[], Any] | None = None


def _call(module: str, function: str, *args) -> Callable[[], Any]:
    def install():
        return getattr(importlib.import_module(module), function)(*args)
    install.__qualname__ = f"{module}.{function}"
    return install


def _saved_policy() -> None:
    from keras_mp.adaptive.policy import saved_policy
    from keras_mp.adaptive.policy.adaptive_policy import AdaptivePolicy

    saved_policy.install(AdaptivePolicy)


_TRAINER = "keras.src.backend.tensorflow.trainer"
_QUANTIZABLE = ("keras.layers:Dense.quantize", "keras.layers:EinsumDense.quantize",
                "keras.layers:Embedding.quantize", "keras.layers:ReversibleEmbedding.quantize")

#: What ``import keras_mp`` installs, in the order it installs them.
ON_IMPORT: tuple[Change, ...] = (
    Change("multi_worker_fit", "fault",
           (f"{_TRAINER}:TensorFlowTrainer._maybe_symbolic_build",
            f"{_TRAINER}:reduce_per_replica"),
           "model.fit fails under a multi-worker MultiWorkerMirroredStrategy: the first batch "
           "is reduced as a structure, scalar logs along axis 0",
           "3.5-3.15.1 (the first fault from 3.5, the second from 3.3.3)",
           "keras_mp.distribute", _call("keras_mp.distribute", "patch_multi_worker")),
    Change("quantize_policy_map", "fault",
           _QUANTIZABLE + ("keras.layers:Layer._check_quantize_args",),
           "layer.quantize reads a DTypePolicyMap's own name as the layer's policy ('Cannot "
           "convert ... to a mixed precision DTypePolicy'); a layer keras-mp trained in float8 "
           "is released first",
           "3.15.1", "keras_mp.deploy.quantization",
           _call("keras_mp.deploy.quantization", "patch_quantize")),
    Change("atomic_saves", "fault",
           ("keras.src.saving.saving_lib:save_model", "keras.src.saving.saving_lib:save_weights_only",
            "keras.src.legacy.saving.legacy_h5_format:save_model_to_hdf5"),
           "model.save, save_weights and ModelCheckpoint open the target with 'wb' and write into "
           "it (a kill mid-save leaves a torn file); written beside it and renamed into place",
           "3.15.1", "keras_mp._saves", _call("keras_mp._saves", "install", "saves")),
    Change("atomic_backups", "fault",
           tuple(f"keras.src.callbacks.backup_and_restore:BackupAndRestore.{a}"
                 for a in ("_save_model", "_load_model", "on_train_end")),
           "BackupAndRestore replaces its weights and then its metadata (a kill inside or between "
           "them breaks the resume); each backup is a new folder, named by a pointer written last",
           "3.15.1", "keras_mp._saves", _call("keras_mp._saves", "install", "backups")),
    Change("remat", "fault",
           ("keras.src.backend.tensorflow.core:remat",
            "keras.src.ops.operation:Operation.rematerialized_call"),
           "keras.RematScope and keras.remat fail in graph mode on a call with keyword "
           "arguments, and recompute outside the call's autocast scope and call context, with "
           "new dropout masks and second moving-statistics updates; 'larger_than' sizes outputs "
           "from backend tensors (a residual Add fails); recomputed as the forward pass ran",
           "3.15.1", "keras_mp.execution.remat", _call("keras_mp.execution.remat", "install")),
    Change("fit_adapts", "feature", ("keras:Model.fit",),
           "fit adds AdaptivePrecision to a model under an adaptive policy, so that setting the "
           "global policy is enough; a LossScaleOptimizer's max_consecutive_skips stop is "
           "raised as keras-mp's TooManySkipsError, its sentence first",
           "3.15.1", "keras_mp.adaptive.fit.autofit",
           _call("keras_mp.adaptive.fit.autofit", "install")),
    Change("saved_policy", "feature",
           ("keras.src.saving.serialization_lib:ObjectSharingScope.__exit__",
            "keras.src.ops.operation:Operation.__new__"),
           "a loaded model gets back the one adaptive policy it was saved with, whatever the "
           "global policy; a layer made with an adaptive policy keeps its auto config",
           "3.15.1", "keras_mp.adaptive.policy.saved_policy", _saved_policy),
    Change("fused_saves", "feature",
           ("keras.src.saving.saving_lib:_serialize_model_as_json",
            "keras.src.saving.saving_lib:_model_from_config"),
           "a .keras file records which layers were fused, and a load gives them their fused "
           "class again, the layers a custom layer makes in its __init__ included, so the loaded "
           "model predicts what the saved one did",
           "3.15.1", "keras_mp.fused.saved", _call("keras_mp.fused.saved", "install")),
    Change("rescues", "feature",
           ("keras:layers.Layer.__call__", "keras:layers.Layer.add_loss",
            "keras.layers:Normalization.adapt", "keras:Model.compute_metrics"),
           "under an adaptive policy: integer inputs kept exact, dtypes mixed in a layer's call "
           "resolved in float32, activity penalties and add_loss terms in float32, "
           "Normalization.adapt's statistics in float32, float32 predictions for top-k metrics",
           "3.15.1", "keras_mp.adaptive.integration.rescue",
           _call("keras_mp.adaptive.integration.rescue", "install")),
    Change("default_policy_names", "feature",
           ("keras.src.dtype_policies.dtype_policy:DTypePolicy.__init__",
            "keras.src.dtype_policies.dtype_policy:QuantizedDTypePolicy.__init__"),
           "DTypePolicy() without a name under an adaptive global policy takes its default "
           "entry's name ('mixed_float16'), not an adaptive name Keras cannot parse",
           "3.15.1", "keras_mp.adaptive.policy.adaptive_policy",
           _call("keras_mp.adaptive.policy.adaptive_policy", "patch_default_names")),
    Change("skipped_steps_keep_state", "feature",
           ("keras.src.backend.tensorflow.core:Variable._direct_assign",),
           "while a guarded train step traces, each variable the forward pass or the metrics "
           "assign is read first, so that a step skipped for non-finite gradients puts it back",
           "3.15.1", "keras_mp.adaptive.integration.skipping",
           _call("keras_mp.adaptive.integration.skipping", "install")),
    Change("probe_draws", "feature",
           ("keras.src.backend.tensorflow.random:dropout",
            "keras.src.backend.tensorflow.random:uniform"),
           "inside the adaptive probe's passes, dropout masks and 16-bit uniform noise are "
           "drawn in float32, so that a 16-bit pass and the float32 one drop the same "
           "elements; elsewhere Keras's draws run unchanged",
           "3.15.1", "keras_mp.adaptive.evidence.same_draws",
           _call("keras_mp.adaptive.evidence.same_draws", "install")),
    Change("float8_layers", "feature",
           ("keras.layers:Dense._float8_call", "keras.layers:EinsumDense._float8_call"),
           "a layer holding keras-mp's Float8Policy trains in float8 only while the controller "
           "has float8 on, with keras-mp's recipe and evidence; other layers run Keras's",
           "3.15.1", "keras_mp.adaptive.evidence.float8",
           _call("keras_mp.adaptive.evidence.float8", "install")),
)

#: What keras-mp wraps on single objects while a model under an adaptive policy
#: trains (through :mod:`keras_mp._installed`; Keras's classes are left as they are).
PER_INSTANCE: tuple[Change, ...] = (
    Change("forward_statistics", "instance", ("keras:layers.Layer.call",),
           "each controlled layer's call records its forward statistics on statistics steps "
           "(quantized_call for float8 layers), and per-layer loss-scale boundaries",
           "3.15.1", "keras_mp.adaptive.evidence.hooks"),
    Change("gradient_statistics", "instance", ("keras:optimizers.Optimizer.apply",),
           "an optimizer that is not keras-mp's LossScaleOptimizer reports gradient statistics "
           "on statistics steps",
           "3.15.1", "keras_mp.adaptive.evidence.hooks"),
    Change("execution_mode", "instance",
           ("keras:Model.make_train_function", "keras:Model.make_test_function",
            "keras:Model.make_predict_function"),
           "the train step runs as a graph, with an XLA-compiled update or wholly under XLA, "
           "as measured for this model; evaluate and predict run as compile set jit_compile",
           "3.15.1", "keras_mp.execution.choice"),
    Change("compiled_update", "instance", ("keras:optimizers.Optimizer._backend_update_step",),
           "the xla_update mode compiles the optimizer's update with XLA",
           "3.15.1", "keras_mp.execution.fused_update"),
    Change("native_update", "instance", ("keras:optimizers.Adam.update_step",
                                         "keras:optimizers.AdamW.update_step",
                                         "keras:optimizers.SGD.update_step"),
           "Adam, AdamW and SGD updates run as TensorFlow's fused kernels (ResourceApplyAdam...); "
           "over bfloat16 moments, in float32 (keras_mp.execution.compact_update)",
           "3.15.1", "keras_mp.execution.native_update"),
    Change("compact_moments", "instance",
           ("keras:optimizers.Optimizer.add_variable_from_reference",),
           "where compact moments apply (keras_mp.config.set_compact_moments: by default in a "
           "model training 2**24 parameters or more), the moments an Adam or AdamW "
           "builds for a model under an adaptive policy are made in bfloat16",
           "3.15.1", "keras_mp.adaptive.storage.moments"),
    Change("compact_weights", "instance", ("keras:optimizers.Optimizer._use_weight_decay",),
           "an AdamW's decay skips the variables whose update is keras-mp's compact update "
           "(weights stored in bfloat16, weights with bfloat16 moments): that update applies "
           "it in float32, in its one pass",
           "3.15.1", "keras_mp.adaptive.storage.trained"),
    Change("skip_guard", "instance", ("keras:Model.train_step",),
           "a step the optimizer skips for non-finite gradients puts back what it assigned "
           "(moving statistics, metric totals), under every adaptive policy",
           "3.15.1", "keras_mp.adaptive.integration.skipping"),
    Change("loss_scale_optimizer", "instance", ("keras:Model.compile",),
           "under an adaptive policy the optimizer compile set (model.optimizer) is replaced "
           "by keras-mp's LossScaleOptimizer around it: a dynamic loss scale where float16 is "
           "a candidate (Keras wraps only under the policy name mixed_float16), else a fixed "
           "scale of 1 that skips non-finite steps",
           "3.15.1", "keras_mp.adaptive.integration.optimizer_setup"),
)

_done: list[str] = []


def resolve(target: str) -> Any:
    """The Keras object a target names (``"module:Class.attribute"``).

    Raises:
        AttributeError: the installed Keras no longer has it.

    Example:
        >>> resolve("keras:Model.fit").__name__
        'fit'
    """
    module, _, path = target.partition(":")
    obj = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def install() -> tuple[str, ...]:
    """Installs every change of :data:`ON_IMPORT` not installed yet, in order
    (``import keras_mp`` calls it). Returns the names installed so far."""
    for change in ON_IMPORT:
        if change.name not in _done:
            change.install()
            _done.append(change.name)
    return installed()


def installed() -> tuple[str, ...]:
    """The names of the :data:`ON_IMPORT` changes installed in this process."""
    return tuple(_done)
