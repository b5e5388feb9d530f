"""keras-mp: mixed-precision training for Keras 3 on TensorFlow.

The public API, re-exported explicitly; each name lives in the subpackage of
its concept (docs/architecture.md): :mod:`keras_mp.device`,
:mod:`keras_mp.scaling`, :mod:`keras_mp.fused`, :mod:`keras_mp.execution`,
:mod:`keras_mp.adaptive`, :mod:`keras_mp.deploy`, :mod:`keras_mp.cli`.
The module names of earlier releases (``keras_mp.adaptive.hooks``, ``keras_mp.xla``,
``keras_mp.loss_scale``, ...) stay bound here to the modules that hold them
now; the callback, the statistics, execution and export are imported when
first used (:mod:`keras_mp._lazy`). ``keras_mp.tuning`` (Keras Tuner) and
``keras_mp.datasets`` (TFDS) are imported on their own, since their
dependencies are extras.
"""

from keras_mp import _backend  # noqa: F401  (selects/validates the backend first)
from keras_mp import _lazy
from keras_mp import adaptive, deploy, device, distribute, fused, policies, scaling
from keras_mp._version import __version__
from keras_mp.adaptive import autofit, rescue, saved_policy
from keras_mp.deploy import quantization
from keras_mp.deploy.quantization import quantize
from keras_mp.device import xla
from keras_mp.device.xla import set_xla, uses_xla
from keras_mp.distribute import patch_multi_worker
from keras_mp.fused import layers, ops
from keras_mp.fused.fuse import fuse
from keras_mp.policies import AdaptivePolicy, global_policy, policy_scope, set_global_policy
from keras_mp.scaling import kernels, loss_scale
from keras_mp.scaling.loss_scale import (DynamicLossScale, FixedLossScale, LossScaleSchedule,
                                         PiecewiseInterval)
from keras_mp.scaling.optimizer import LossScaleOptimizer

# Imported when first used (keras_mp._lazy): what adapting, reporting and
# exporting need, which a fit too small to gain does not.
_LAZY = {"callbacks": "keras_mp.callbacks", "execution": "keras_mp.execution",
         "export": "keras_mp.deploy.export", "fused_update": "keras_mp.execution.fused_update",
         "controller": "keras_mp.adaptive.controller", "forward": "keras_mp.adaptive.forward",
         "hooks": "keras_mp.adaptive.hooks", "probe": "keras_mp.adaptive.probe",
         "report": "keras_mp.adaptive.report", "stats": "keras_mp.adaptive.stats",
         "plot_precision": "keras_mp.adaptive.plot:plot_precision",
         "precision_report": "keras_mp.adaptive.report:precision_report",
         "precision_state": "keras_mp.adaptive.state"}

# Keras 3.5-3.15's model.fit fails under a multi-worker
# MultiWorkerMirroredStrategy (see keras_mp.distribute). The fix acts only in
# multi-worker mode and only where the installed Keras has the fault.
patch_multi_worker()
# fit adds an AdaptivePrecision to models built under an adaptive policy.
autofit.install()
# A loaded model gets back the one adaptive policy it was saved with, whatever
# the global policy (see keras_mp.adaptive.saved_policy).
saved_policy.install(AdaptivePolicy)
# Under an adaptive policy: exact integer inputs, dtype mismatches resolved in
# float32, float32 predictions for top-k metrics (keras_mp.adaptive.rescue).
rescue.install()
# Keras's model.quantize reads a DTypePolicyMap's name as a layer's policy
# name; the fix hands each layer its own entry (see keras_mp.deploy.quantization).
quantization.patch_quantize()
# Keras's DTypePolicy() without a name takes the global policy's; an adaptive
# global gives its default entry's (see keras_mp.adaptive.policy).
adaptive.policy.patch_default_names()

__all__ = [
    "AdaptivePolicy",
    "DynamicLossScale",
    "FixedLossScale",
    "LossScaleOptimizer",
    "LossScaleSchedule",
    "PiecewiseInterval",
    "adaptive",
    "autofit",
    "callbacks",
    "controller",
    "deploy",
    "device",
    "distribute",
    "execution",
    "export",
    "forward",
    "fuse",
    "fused",
    "fused_update",
    "global_policy",
    "hooks",
    "kernels",
    "layers",
    "loss_scale",
    "ops",
    "patch_multi_worker",
    "plot_precision",
    "policies",
    "policy_scope",
    "precision_report",
    "precision_state",
    "probe",
    "quantization",
    "quantize",
    "report",
    "scaling",
    "set_global_policy",
    "set_xla",
    "stats",
    "uses_xla",
    "xla",
]


def __getattr__(name: str):
    return _lazy.resolve(__name__, _LAZY, name, globals(), submodules=False)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
