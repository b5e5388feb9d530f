"""Makes sure Keras runs on TensorFlow before anything of keras-mp is imported.

keras-mp builds on TensorFlow-only machinery (tf.distribute, XLA via
``tf.function(jit_compile=True)``), so another backend is an error, not a
degraded mode.
"""

import contextlib
import os
import sys

# The `keras-mp` command prints its own report; TensorFlow's C++ start-up log
# (CUDA probing, oneDNN notes) would bury it. Library users keep theirs, and
# `keras-mp --verbose` shows it.
_QUIET = (os.path.basename(sys.argv[0] if sys.argv else "") == "keras-mp"
          and "--verbose" not in sys.argv[1:])
if _QUIET:
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"  # errors at run time too (e.g. cuInit)


@contextlib.contextmanager
def _native_stderr_hidden(active: bool):
    """Points file descriptor 2 at /dev/null while active. TensorFlow 2.21
    logs its start-up lines from C++ before absl's logging is initialized,
    which TF_CPP_MIN_LOG_LEVEL does not silence."""
    if not active:
        yield
        return
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


# Only choose for the user when nothing has chosen yet: once keras is imported
# its backend is fixed and changing the variable would only mislead.
if "keras" not in sys.modules and not os.environ.get("KERAS_BACKEND"):
    os.environ["KERAS_BACKEND"] = "tensorflow"

with _native_stderr_hidden(_QUIET):
    import keras  # noqa: E402  (imports TensorFlow)

if _QUIET:
    # The command traces a model's step several times by design (statistics,
    # probe, the graph/XLA trial of keras_mp.execution); TensorFlow's Python
    # warnings about retracing are noise in its report.
    import tensorflow as _tf  # noqa: E402

    _tf.get_logger().setLevel("ERROR")

if keras.backend.backend() != "tensorflow":
    raise ImportError(
        "keras_mp requires the TensorFlow backend of Keras, but the active "
        f"backend is {keras.backend.backend()!r}. Set the environment "
        "variable KERAS_BACKEND=tensorflow (or leave it unset) before "
        "importing keras or keras_mp."
    )
