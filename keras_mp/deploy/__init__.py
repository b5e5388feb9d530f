"""From training to deployment: quantization guided by what training learned,
and export for serving.

* :mod:`keras_mp.deploy.quantization`: Keras's ``model.quantize`` made to
  work on layers under an adaptive policy, and :func:`quantize`: quantization
  guided by the adaptive records (layers that needed float32 stay float).
* :mod:`keras_mp.deploy.export`: ``export(model, path, format=...)``, a
  SavedModel or LiteRT file with float32 inputs and outputs.

Example:
    >>> from keras_mp import deploy
    >>> "int8" in deploy.quantization.MODES and "litert" in deploy.export.FORMATS
    True
"""

from keras_mp import _lazy
from keras_mp.deploy import quantization
from keras_mp.deploy.quantization import quantize

_LAZY: dict[str, str] = {}  # export: imported when first used (keras_mp._lazy)

__all__ = ["export", "quantization", "quantize"]


def __getattr__(name: str):
    return _lazy.resolve(__name__, _LAZY, name, globals())


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
