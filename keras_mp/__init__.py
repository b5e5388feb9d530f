"""keras-mp: mixed-precision training for Keras 3 on TensorFlow.

The public API, re-exported explicitly; each name lives in the module named
for its concept. ``keras_mp.tuning`` (Keras Tuner) and ``keras_mp.datasets``
(TFDS) are imported on their own, since their dependencies are extras.
"""

from keras_mp import _backend  # noqa: F401  (selects/validates the backend first)
from keras_mp.adaptive import (autofit, controller, forward, hooks, state as precision_state,
                               probe, report, stats)
from keras_mp import callbacks, device, distribute, execution, export, policies, quantization
from keras_mp.execution import fused_update
from keras_mp.fused import layers, ops
from keras_mp.scaling import kernels, loss_scale
from keras_mp.device import xla
from keras_mp.distribute import patch_multi_worker
from keras_mp.fused.fuse import fuse
from keras_mp.scaling.loss_scale import (DynamicLossScale, FixedLossScale, LossScaleSchedule,
                                         PiecewiseInterval)
from keras_mp.scaling.optimizer import LossScaleOptimizer
from keras_mp.policies import AdaptivePolicy, global_policy, policy_scope, set_global_policy
from keras_mp.quantization import quantize
from keras_mp.adaptive.report import precision_report
from keras_mp.device.xla import set_xla, uses_xla

__version__ = "0.1.0"

# Keras 3.5-3.15's model.fit fails under a multi-worker
# MultiWorkerMirroredStrategy (see keras_mp.distribute). The fix acts only in
# multi-worker mode and only where the installed Keras has the fault.
patch_multi_worker()
# fit adds an AdaptivePrecision to models built under an adaptive policy.
autofit.install()
# Keras's model.quantize reads a DTypePolicyMap's name as a layer's policy
# name; the fix hands each layer its own entry (see keras_mp.quantization).
quantization.patch_quantize()

__all__ = [
    "AdaptivePolicy",
    "DynamicLossScale",
    "FixedLossScale",
    "LossScaleOptimizer",
    "LossScaleSchedule",
    "PiecewiseInterval",
    "autofit",
    "callbacks",
    "controller",
    "device",
    "distribute",
    "execution",
    "export",
    "forward",
    "fuse",
    "fused_update",
    "global_policy",
    "hooks",
    "kernels",
    "layers",
    "loss_scale",
    "ops",
    "patch_multi_worker",
    "policies",
    "policy_scope",
    "precision_report",
    "precision_state",
    "probe",
    "quantization",
    "quantize",
    "report",
    "set_global_policy",
    "set_xla",
    "stats",
    "uses_xla",
    "xla",
]
