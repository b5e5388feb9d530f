"""What this device is and where each kind of work runs on it.

The bottom of keras-mp: every other package asks these modules, and they ask
none of keras-mp's others.

* :mod:`keras_mp.device.capabilities`: which narrow dtypes this device runs
  fast (CPU flags or GPU compute capability, confirmed by a measured matmul),
  hence what ``"adaptive"`` chooses among.
* :mod:`keras_mp.device.xla`: which work (elementwise, matmul, multi-tensor)
  runs under XLA here, the user's overrides, and the process's memory-map
  budget for new XLA compilations.

The names of :mod:`~keras_mp.device.capabilities` are re-exported here, so
``keras_mp.device.profile()`` and ``keras_mp.device.default_candidates()``
read as before.

Example:
    >>> from keras_mp import device
    >>> "float32" in device.default_candidates()
    True
"""

from keras_mp.device import xla
from keras_mp.device.capabilities import (NARROW_DTYPES, DeviceProfile, cpu_flags,
                                          default_candidates, fast_dtypes, profile)

__all__ = ["DeviceProfile", "NARROW_DTYPES", "cpu_flags", "default_candidates", "fast_dtypes",
           "profile", "xla"]
