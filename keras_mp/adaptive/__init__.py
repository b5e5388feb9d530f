"""Adaptive precision: each layer's compute dtype chosen from live evidence.

How a decision is made, bottom up:

* the policy: :mod:`~keras_mp.adaptive.policy` (:class:`AdaptivePolicy`, a
  ``DTypePolicyMap`` whose entries the controller switches), its float8
  entries (:mod:`~keras_mp.adaptive.float8_policy`), and the layers it
  controls (:mod:`~keras_mp.adaptive.controlled_layers`);
* evidence: forward statistics of every layer call
  (:mod:`~keras_mp.adaptive.forward`), gradient statistics and their
  on-device accumulation (:mod:`~keras_mp.adaptive.stats`), the float32
  probe (:mod:`~keras_mp.adaptive.probe`), float8's own evidence
  (:mod:`~keras_mp.adaptive.float8`), recorded through trace-time hooks
  (:mod:`~keras_mp.adaptive.hooks`);
* the rule: thresholds and records (:mod:`~keras_mp.adaptive.rule`) and the
  pure decision (:mod:`~keras_mp.adaptive.controller`), applied by
  :mod:`~keras_mp.adaptive.switching`;
* what breaks Keras's mixed precision (token ids through a float input,
  top-k metrics, dtypes mixed in a layer's call), handled where Keras casts
  and calls layers: :mod:`~keras_mp.adaptive.rescue`;
* during ``fit``: the callback (:mod:`~keras_mp.adaptive.callback`), added
  by :mod:`~keras_mp.adaptive.autofit`, which sets up the optimizer
  (:mod:`~keras_mp.adaptive.optimizer_setup`) and keeps its state in
  checkpoints (:mod:`~keras_mp.adaptive.state`);
* out: :mod:`~keras_mp.adaptive.report`,
  :mod:`~keras_mp.adaptive.tensorboard` and the picture of a run,
  :mod:`~keras_mp.adaptive.plot` (from :mod:`~keras_mp.adaptive.timeline`).

Example:
    >>> import keras_mp
    >>> from keras_mp import adaptive
    >>> adaptive.AdaptivePolicy(("float16", "float32")).candidates
    ('float16', 'float32')
"""

from keras_mp import _lazy
from keras_mp.adaptive.controlled_layers import adaptive_layers, policy_of
from keras_mp.adaptive.policy import AdaptivePolicy

# Imported when first used (keras_mp._lazy), as any submodule.
_LAZY = {"AdaptivePrecision": "keras_mp.adaptive.callback:AdaptivePrecision",
         "plot_precision": "keras_mp.adaptive.plot:plot_precision",
         "precision_report": "keras_mp.adaptive.report:precision_report"}

__all__ = ["AdaptivePolicy", "AdaptivePrecision", "adaptive_layers", "plot_precision",
           "policy_of", "precision_report"]


def __getattr__(name: str):
    return _lazy.resolve(__name__, _LAZY, name, globals())


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
