"""Adaptive precision: each layer's compute dtype chosen from live evidence.

One subpackage per concept, lowest first (a subpackage imports only those
above it in this list, ``tests/test_layout.py`` checks it):

* :mod:`~keras_mp.adaptive.decisions`: what decides. The rule's thresholds
  and records (``rule``), the pure decision over an interval's evidence
  (``controller.decide``), the loss scale's side of it (``scale_rule``), and
  whether adapting a fit can pay off at all (``gain``);
* :mod:`~keras_mp.adaptive.policy`: :class:`AdaptivePolicy` (a
  ``DTypePolicyMap`` whose entries the controller switches,
  ``adaptive_policy``), its float8 entries (``float8_policy``), the layers it
  controls (``controlled_layers``) and its form in ``.keras`` files
  (``saved_policy``);
* :mod:`~keras_mp.adaptive.record`: what a run keeps. The controller's
  per-layer state as variables saved with the model (``state``) and the
  timeline the picture of a run draws (``timeline``);
* :mod:`~keras_mp.adaptive.evidence`: what measures. Forward statistics of
  every layer call (``forward``), gradient statistics accumulated on device
  (``stats``), the float32 probe (``probe``), float8's own evidence
  (``float8``), and the trace-time hooks that record them (``hooks``);
* :mod:`~keras_mp.adaptive.storage`: how each variable is stored (the memory
  issue's place);
* :mod:`~keras_mp.adaptive.integration`: how it ties into Keras's train
  step. The step functions (``step_functions``: plain, statistics and probe
  steps), the optimizer's set-up (``optimizer_setup``) and loss scales
  (``loss_scales``), switches applied to the policy (``switching``), and the
  rescues of code Keras's mixed precision breaks (``rescue``);
* :mod:`~keras_mp.adaptive.outputs`: what shows a run. ``precision_report``
  (``report``), the picture of a run (``plot``) and TensorBoard
  (``tensorboard``);
* :mod:`~keras_mp.adaptive.fit`: what runs in ``fit``. The
  ``AdaptivePrecision`` callback (``callback``), which reads the evidence,
  decides, switches and writes the outputs, and ``autofit`` (``fit`` adds the
  callback by itself).

Example:
    >>> import keras_mp
    >>> from keras_mp import adaptive
    >>> adaptive.AdaptivePolicy(("float16", "float32")).candidates
    ('float16', 'float32')
    >>> adaptive.DecisionRule(patience=4).patience
    4
"""

from keras_mp import _lazy
from keras_mp.adaptive.decisions.rule import DecisionRule
from keras_mp.adaptive.policy.adaptive_policy import AdaptivePolicy
from keras_mp.adaptive.policy.controlled_layers import adaptive_layers, policy_of

# Imported when first used (keras_mp._lazy), as any submodule.
_LAZY = {"AdaptivePrecision": "keras_mp.adaptive.fit.callback:AdaptivePrecision",
         "plot_precision": "keras_mp.adaptive.outputs.plot:plot_precision",
         "precision_report": "keras_mp.adaptive.outputs.report:precision_report"}

__all__ = ["AdaptivePolicy", "AdaptivePrecision", "DecisionRule", "adaptive_layers",
           "plot_precision", "policy_of", "precision_report"]


def __getattr__(name: str):
    return _lazy.resolve(__name__, _LAZY, name, globals())


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
