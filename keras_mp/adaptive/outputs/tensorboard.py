"""TensorBoard scalars of the adaptive policy: what
:class:`keras_mp.callbacks.AdaptivePrecision` writes with ``log_dir``, once per
decision, from the same interval statistics that the rule, the report and the
loss scaler read.

Per decision: ``precision/switches``, ``precision/loss_scale`` and, after a
probe, ``precision/probe_loss_error`` and ``precision/probe_loss_noise_ratio``;
per layer ``precision/{path}/bits`` (8, 16 or 32) and its evidence (forward
statistics; gradient statistics where it has gradients; probe errors where
probed; float8 evidence for float8-capable layers) and, with per-layer loss
scales, ``precision/{path}/loss_scale`` (the scale its gradients carry).

Example:
    >>> import tempfile, tensorflow as tf
    >>> from keras_mp import AdaptivePolicy
    >>> from keras_mp.adaptive.outputs import tensorboard
    >>> from keras_mp.adaptive.decisions.controller import LayerStats
    >>> from keras_mp.adaptive.evidence.stats import IntervalStats
    >>> interval = IntervalStats(steps=4, all_nonfinite=0.0, mean_scale=1.0, paths=("dense",),
    ...                          layers=(LayerStats(steps=4),))
    >>> writer = tf.summary.create_file_writer(tempfile.mkdtemp())
    >>> tensorboard.write_interval(writer, 4, AdaptivePolicy(("bfloat16", "float32")),
    ...                            ("dense",), interval, 0)
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf
from tensorflow.core.framework import summary_pb2

from keras_mp.adaptive.evidence import float8
from keras_mp.adaptive.evidence.stats import IntervalStats

__all__ = ["BITS", "write_interval"]

#: The width of each adaptive dtype, as logged.
BITS = {"float8": 8, "float16": 16, "bfloat16": 16, "float32": 32}
_SCALAR_METADATA = summary_pb2.SummaryMetadata(
    plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars")
).SerializeToString()


def _scalar(tag: str, value: float) -> None:
    # tf.summary.scalar lives in the tensorboard package, which training
    # machines often lack; tf.summary.write with the scalars plugin's
    # metadata writes the same event without it.
    tf.summary.write(tag, tf.constant(float(value), tf.float32), metadata=_SCALAR_METADATA)


def write_interval(writer, step: int, policy, paths: Sequence[str], interval,
                   switches: int, *, loss_scales: Sequence[float] | None = None) -> None:
    """Writes one decision's scalars (see the module docstring).

    Args:
        writer: a ``tf.summary`` file writer.
        step: the train-function call of the decision.
        policy: the model's :class:`keras_mp.AdaptivePolicy`.
        paths: the controlled layers' paths, as in ``interval``.
        interval: the :class:`keras_mp.adaptive.evidence.stats.IntervalStats` decided on.
        switches: how many switches the decision made.
        loss_scales: with per-layer loss scales, the scale each layer's
            gradients carry, as ``paths``; None: one global scale.
    """
    if not isinstance(interval, IntervalStats):
        raise TypeError(f"`interval` must be a keras_mp.adaptive.evidence.stats.IntervalStats, got {interval!r}.")
    if loss_scales is not None and len(loss_scales) != len(paths):
        raise ValueError(f"`loss_scales` must hold one scale per path ({len(paths)}), got "
                         f"{loss_scales!r}.")
    with writer.as_default(step=step):
        _scalar("precision/switches", switches)
        _scalar("precision/loss_scale", interval.mean_scale)
        if interval.probe_steps:
            _scalar("precision/probe_loss_error", interval.probe_loss_error)
            _scalar("precision/probe_loss_noise_ratio", interval.probe_loss_noise_ratio)
        for path, stats in zip(paths, interval.layers):
            _scalar(f"precision/{path}/bits", BITS[policy.dtype_of(path)])
            keys = ["in_amax", "out_amax", "in_range", "out_nonfinite", "out_flushed"]
            if stats.gradients:
                keys += ["nonfinite", "fp16_subnormal", "fp16_overflow", "bf16_subnormal"]
            if stats.probe_steps:
                keys += ["grad_error", "cosine", "grad_noise_ratio"]
            if policy.is_float8(path):
                keys += list(float8.FIELDS)
            for key in keys:
                _scalar(f"precision/{path}/{key}", getattr(stats, key))
        for path, scale in zip(paths, loss_scales or ()):
            _scalar(f"precision/{path}/loss_scale", scale)
