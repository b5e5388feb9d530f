"""Makes sure Keras runs on TensorFlow before anything of keras-mp is imported.

keras-mp builds on TensorFlow-only machinery (tf.distribute, XLA via
``tf.function(jit_compile=True)``), so another backend is an error, not a
degraded mode.
"""

import os
import sys

# The `keras-mp` command prints its own report; TensorFlow's C++ start-up log
# (CUDA probing, CPU-feature notes) would bury it. Library users keep theirs.
if os.path.basename(sys.argv[0] if sys.argv else "") == "keras-mp":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

# Only choose for the user when nothing has chosen yet: once keras is imported
# its backend is fixed and changing the variable would only mislead.
if "keras" not in sys.modules and not os.environ.get("KERAS_BACKEND"):
    os.environ["KERAS_BACKEND"] = "tensorflow"

import keras  # noqa: E402

if keras.backend.backend() != "tensorflow":
    raise ImportError(
        "keras_mp requires the TensorFlow backend of Keras, but the active "
        f"backend is {keras.backend.backend()!r}. Set the environment "
        "variable KERAS_BACKEND=tensorflow (or leave it unset) before "
        "importing keras or keras_mp."
    )
