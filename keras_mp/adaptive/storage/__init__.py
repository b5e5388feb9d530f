"""How each variable is stored, decided per variable (issue 47).

* :mod:`~keras_mp.adaptive.storage.variables`: the mechanism. A Keras
  variable stored in another dtype keeps its identity (its layer, the
  optimizer's index, files and checkpoints hold the Keras object); the
  TensorFlow variable inside is made anew;
* :mod:`~keras_mp.adaptive.storage.frozen`: weights that do not train are
  stored in their layer's compute dtype (on by default,
  :func:`keras_mp.config.set_compact_storage`), decided at the start of each
  ``fit``;
* :mod:`~keras_mp.adaptive.storage.moments`: Adam's and AdamW's moments in
  bfloat16, the update in float32 (by default in a model that trains at
  least 2**24 parameters, :func:`keras_mp.config.set_compact_moments`);
* :mod:`~keras_mp.adaptive.storage.trained`: weights that train, in
  bfloat16 with their gradients, each update in float32 rounded
  stochastically (by default in such a model,
  :func:`keras_mp.config.set_compact_weights`).

Not stored compactly (yet): other optimizers' state; the gradients of float32
weights.

Example:
    >>> from keras_mp.adaptive import storage
    >>> storage.frozen.UNIT_ROUNDOFF["bfloat16"] == 2 ** -8
    True
"""

from keras_mp.adaptive.storage import frozen, moments, trained, variables

__all__ = ["frozen", "moments", "trained", "variables"]
