"""keras-mp: mixed-precision training for Keras 3 on TensorFlow.

What a user calls, by name (``__all__``, pinned by ``tests/test_layout.py``):

* the policies: :func:`set_global_policy`, :func:`global_policy`,
  :func:`policy_scope` and :class:`AdaptivePolicy` (``"adaptive"``,
  ``"adaptive_float16"``, ... or any Keras policy);
* loss scaling: :class:`LossScaleOptimizer` and its schedules
  (:class:`DynamicLossScale`, :class:`FixedLossScale`,
  :class:`PiecewiseInterval`, the base :class:`LossScaleSchedule`);
* :mod:`keras_mp.callbacks` (``AdaptivePrecision``), :func:`fuse`,
  :func:`quantize`, :func:`export`, :func:`precision_report`,
  :func:`plot_precision`;
* the settings, in one place: :mod:`keras_mp.config`;
* the subpackages, one concept each (docs/architecture.md):
  :mod:`~keras_mp.adaptive`, :mod:`~keras_mp.scaling`, :mod:`~keras_mp.fused`,
  :mod:`~keras_mp.execution`, :mod:`~keras_mp.device`, :mod:`~keras_mp.deploy`,
  :mod:`~keras_mp.distribute`, :mod:`~keras_mp.policies`.

``keras_mp.tuning`` (Keras Tuner) and ``keras_mp.datasets`` (TFDS) are imported
on their own: their dependencies are extras. The callback, the statistics,
execution and export are imported when first used (:mod:`keras_mp._lazy`).
Importing keras-mp changes Keras in the places :mod:`keras_mp._keras_changes`
lists, all installed from there.

Example:
    >>> import keras_mp
    >>> keras_mp.set_global_policy("adaptive_float16")
    >>> keras_mp.global_policy().candidates
    ('float16', 'float32')
    >>> keras_mp.set_global_policy("float32")
"""

from keras_mp import _backend  # noqa: F401  (selects/validates the backend first)
from keras_mp import _keras_changes, _lazy
from keras_mp import adaptive, config, deploy, device, distribute, fused, policies, scaling
from keras_mp._version import __version__
from keras_mp.deploy.quantization import quantize
from keras_mp.fused.fuse import fuse
from keras_mp.policies import AdaptivePolicy, global_policy, policy_scope, set_global_policy
from keras_mp.scaling.loss_scale import (DynamicLossScale, FixedLossScale, LossScaleSchedule,
                                         PiecewiseInterval)
from keras_mp.scaling.optimizer import LossScaleOptimizer

# Every change keras-mp makes to Keras on import, with its reason.
_keras_changes.install()

# Imported when first used (keras_mp._lazy): what adapting, reporting and
# exporting need, which a fit too small to gain does not.
_LAZY = {"callbacks": "keras_mp.callbacks", "execution": "keras_mp.execution",
         "export": "keras_mp.deploy.export:export",
         "plot_precision": "keras_mp.adaptive.outputs.plot:plot_precision",
         "precision_report": "keras_mp.adaptive.outputs.report:precision_report"}

__all__ = [
    "AdaptivePolicy",
    "DynamicLossScale",
    "FixedLossScale",
    "LossScaleOptimizer",
    "LossScaleSchedule",
    "PiecewiseInterval",
    "adaptive",
    "callbacks",
    "config",
    "deploy",
    "device",
    "distribute",
    "execution",
    "export",
    "fuse",
    "fused",
    "global_policy",
    "plot_precision",
    "policies",
    "policy_scope",
    "precision_report",
    "quantize",
    "scaling",
    "set_global_policy",
]


def __getattr__(name: str):
    return _lazy.resolve(__name__, _LAZY, name, globals(), submodules=False)


def __dir__() -> list[str]:
    # The public names and nothing else: submodules imported later (tuning,
    # datasets, cli, ...) and the install imports stay out of it.
    return sorted(set(__all__) | {n for n in globals() if n.startswith("_")})
