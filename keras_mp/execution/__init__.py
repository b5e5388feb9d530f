"""How the train step runs: TensorFlow graph or XLA, chosen by measurement.

Whether XLA (``model.compile(jit_compile=True)``) speeds a train step up
depends on the machine and the compute dtype. On a 2-core AVX2 AMD EPYC,
XLA made a float32 Keras step 1.12-1.26x faster (it fuses the elementwise
work around the matmuls); on a Xeon with AMX-BF16 it makes a bfloat16 step
up to 4x slower (a small CNN), because XLA:CPU does not use AMX while TensorFlow's
oneDNN kernels do. So the choice is measured, once per process and device:

* a whole train step (dense -> gelu -> layer norm -> dense, gradients, SGD
  update, float32 variables with the compute cast to the dtype, as Keras
  mixed precision does) timed as a TensorFlow graph and under XLA, for
  float32 and the low-precision dtype the ``"adaptive"`` policy uses here
  (:func:`keras_mp.device.default_candidates`), in interleaved rounds, by
  process CPU time and by wall time;
* a matmul in the same dtypes, graph and XLA, which decides where the fused
  layers' matmuls run (:func:`keras_mp.device.xla.uses_xla` ``("matmul")``).

That micro-benchmark is what ``keras-mp info`` shows and what
:func:`choose` answers; it does not decide for a model. An elementwise-heavy
probe step says little about a model whose time goes to convolutions or
large matmuls (on an AMX-BF16 Xeon the bfloat16 probe step measured 0.8-1.1x
under XLA from run to run, a bfloat16 CNN 0.3x). So with ``mode="auto"``
:func:`configure` times **the model's own train step** on its first call,
on the batch it trains on, in each mode the model can use
(:func:`candidate_modes`): ``"graph"``, ``"xla_update"`` (the graph with
only the optimizer's update compiled by XLA, :mod:`keras_mp.execution.fused_update`)
and ``"xla"`` (the whole step compiled), and keeps another mode than the
graph only where it is at least :data:`MARGIN` faster by process CPU time
and by wall time (:mod:`keras_mp.execution.step_trial`). The modes round
differently, so the trial runs on a copy of the training state, before the
first step trains, and its decision is kept on disk: every step trains in
the mode decided, and a seeded run trains the same weights whether it
measured or read the decision back (docs/architecture.md, "Decisions made
from timings"). In a ``fit`` of known length the first calls train as a
graph, timed, and nothing is measured where the fit at that pace would take
under a minute (:mod:`keras_mp.execution.first_calls`). ``evaluate`` and
``predict`` run as ``compile`` set
``jit_compile`` (:mod:`keras_mp.execution.inference`), so a saved and
loaded model predicts what the trained one did. XLA is not tried at all
where the model cannot use it: a layer without ``supports_jit``, a
distribution strategy, an optimizer that needs graph-only ops
(``max_consecutive_skips`` names variables with string ops, which XLA
cannot compile), ``run_eagerly``; nor, on a CPU, where it could not pay for
itself: a model whose convolutions hold nearly all its weights, with small
outputs (:func:`~keras_mp.execution.reasons.little_to_compile`), is traced
with no XLA at all (:func:`trace_scope`), so that XLA's runtime (47 MiB of a
2-core EPYC's process) is never loaded for it.

:func:`configure` applies the choice to a compiled model; the
:class:`~keras_mp.callbacks.AdaptivePrecision` callback calls it, so the
recommended set-up uses the fastest measured mode by default. If XLA then
fails to compile the model's train step, training goes on as a TensorFlow
graph with one warning, on the same batch (nothing is skipped).

Override, strongest first: ``configure(model, mode=...)``, the environment
variable ``KERAS_MP_EXECUTION`` (``auto``, ``xla``, ``xla_update``, ``graph``
or ``keep``),
the default ``auto``. ``keep`` leaves ``model.jit_compile`` as
``model.compile`` set it.

Example:
    >>> import keras, keras_mp
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    >>> model.compile(optimizer="rmsprop", loss="mse")   # an update XLA can fuse
    >>> keras_mp.execution.configure(model, mode="graph")
    'graph'
    >>> model.jit_compile
    False
    >>> keras_mp.execution.configure(model, mode="xla")
    'xla'
    >>> import numpy as np
    >>> _ = model.fit(np.ones((8, 4)), np.ones((8, 2)), verbose=0)
    >>> model.jit_compile
    True
    >>> keras_mp.execution.configure(model, mode="auto")   # measured on the next calls
    'trial'
    >>> _ = model.fit(np.ones((160, 4)), np.ones((160, 2)), batch_size=8, verbose=0)
    >>> keras_mp.execution.chosen(model) in ("graph", "xla_update", "xla")
    True

One module per part: :mod:`~keras_mp.execution.choice` (:func:`configure`,
:func:`chosen`, :func:`measuring`, :func:`candidate_modes`, :func:`trace_scope`), :mod:`~keras_mp.execution.reasons`
(why a mode cannot run or cannot win for a model), :mod:`~keras_mp.execution.step_trial`
(the measurement on the model's first call), :mod:`~keras_mp.execution.first_calls`
(a fit's first calls, timed, before anything is measured), :mod:`~keras_mp.execution.inference`
(how ``evaluate`` and ``predict`` run), :mod:`~keras_mp.execution.fused_update`
(the ``xla_update`` mode), :mod:`~keras_mp.execution.native_update` (Adam, AdamW
and SGD updates as TensorFlow's fused kernels, in every mode), :mod:`~keras_mp.execution.micro_benchmark` (the device-wide
micro-benchmark) :mod:`~keras_mp.execution.placement` (the fused layers'
matmuls and epilogues) and :mod:`~keras_mp.execution.start_up` (the coming fit's
length, the model's signature; what start-up measures is kept on disk by
:mod:`keras_mp.device.cache`).
"""

from keras_mp.execution import (choice, first_calls, fused_update, inference, micro_benchmark,
                                native_update, placement, reasons, replay, start_up, step_trial)
from keras_mp.execution.choice import (ENV_VAR, MAPS_BUDGET, MODES, candidate_modes, chosen,
                                       configure, measuring, trace_scope)
from keras_mp.execution.placement import epilogue
from keras_mp.execution.micro_benchmark import MARGIN, ExecutionProfile, choose, profile

__all__ = ["MODES", "ENV_VAR", "MARGIN", "MAPS_BUDGET", "ExecutionProfile", "profile", "choose",
           "configure", "chosen", "measuring", "candidate_modes", "trace_scope", "epilogue", "choice",
           "first_calls", "fused_update", "inference",
           "micro_benchmark", "native_update", "placement", "reasons", "replay", "start_up",
           "step_trial"]
