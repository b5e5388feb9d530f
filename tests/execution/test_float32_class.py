"""The float32-only class (``"adaptive"`` on a CPU without 16-bit units, issue
48): the recommended set-up swaps in only what wins there. No fused layer
whose kernel is an XLA epilogue (they lost to Keras's layers in float32), and
the whole step under XLA is tried whatever its copy of the tensors takes
(Keras's best one-liner there, float32 with XLA, holds that copy too)."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp import execution
from keras_mp.execution import step_trial
from keras_mp.fused import layers as fused_layers

FLOAT32_ALONE = keras_mp.AdaptivePolicy(candidates=("float32",))


def _transformerish(policy):
    with keras_mp.policies.policy_scope(policy):
        x = keras.Input((6, 8))
        h = keras.layers.MultiHeadAttention(2, 4)(x, x)
        h = keras.layers.LayerNormalization()(h + x)
        h = keras.layers.Dense(16, activation="gelu")(h)
        h = keras.layers.Softmax()(keras.layers.Dense(8)(h))
        return keras.Model(x, h)


@pytest.mark.parametrize("policy, fused", [(FLOAT32_ALONE, False),
                                           (keras_mp.AdaptivePolicy(candidates=("bfloat16", "float32")),
                                            True)])
def test_fuse_swaps_in_no_xla_epilogue_where_adaptive_is_float32_alone(policy, fused):
    model = _transformerish(policy)
    x = np.random.default_rng(0).standard_normal((3, 6, 8)).astype("float32")
    before = keras.ops.convert_to_numpy(model(x))
    keras_mp.fuse(model, inplace=True)
    kinds = {type(layer).__name__: type(layer).__module__.split(".")[0]
             for layer in model.layers[1:]}
    expected = "keras_mp" if fused else "keras"
    assert {kinds[k] for k in ("Dense", "LayerNormalization", "Softmax")} == {expected}
    assert fused_layers.float32_alone(model.layers[-1]) is not fused
    if not fused:
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(model(x)), before)
        # The copy keeps the fused classes, and runs Keras's code in them.
        copy = keras_mp.fuse(_transformerish(policy))
        assert not any(getattr(layer, "fused", False) for layer in copy.layers)
    # BatchNormalization's fused kernel is TensorFlow's own (no XLA): it stays fused.
    with keras_mp.policies.policy_scope(policy):
        cnn = keras.Sequential([keras.Input((4, 4, 3)), keras.layers.BatchNormalization()])
    keras_mp.fuse(cnn, inplace=True)
    assert type(cnn.layers[0]) is fused_layers.BatchNormalization and cnn.layers[0].fused


@pytest.mark.parametrize("float32_alone", [True, False])
def test_the_float32_class_tries_xla_whatever_its_copy_takes(monkeypatch, float32_alone):
    from keras_mp.device import memory

    if memory.footprint() is None:
        pytest.skip("no memory figures on this platform")
    # The suite's background pipelines can make XLA's matmuls read slow.
    monkeypatch.setattr(execution.reasons, "slow_matmul", lambda model: None)
    monkeypatch.setattr(step_trial, "MEMORY_BUDGET", -1.0)  # no copy fits
    # A fit of 8 steps is too short to measure anything (reasons.short_fit): as a long one.
    monkeypatch.setattr(execution.reasons, "short_fit", lambda model: None)
    # ... and measured on its first call (not after first calls timed as a graph).
    monkeypatch.setattr(execution.choice, "_first_calls_pending", lambda model, state: False)
    with keras_mp.policies.policy_scope(FLOAT32_ALONE if float32_alone else "float32"):
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="gelu"),
                                  keras.layers.Dense(1)])
    model.compile(optimizer="rmsprop", loss="mse")
    assert execution.reasons.float32_class(model) is float32_alone
    assert "xla" in execution.candidate_modes(model)
    assert execution.configure(model, mode="auto") == "trial"
    rng = np.random.default_rng(0)
    model.fit(rng.standard_normal((64, 8)), rng.standard_normal((64, 1)), batch_size=8,
              verbose=0)
    (record,) = execution.choice._state_of(model).trials.values()
    if float32_alone:
        assert "xla" in record.samples and "xla" not in record.skipped
    else:
        assert "xla" in record.skipped and "xla" not in record.samples
