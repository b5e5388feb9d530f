"""keras_mp.precision_report: the table, the structured form, before and after
switches, and for models that are not adaptive."""

import json

import keras
import numpy as np
import pytest

from keras_mp import DynamicLossScale, policies
from keras_mp.callbacks import AdaptivePrecision
from keras_mp.adaptive.outputs.report import PrecisionReport, precision_report


def _model(policy):
    policies.set_global_policy(policy)
    # A small first kernel keeps that layer's output within float16 once
    # its input (which is not) is handled in float32.
    small = keras.initializers.RandomUniform(-0.001, 0.001, seed=1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, kernel_initializer=small),
                              keras.layers.ReLU(),
                              keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    return model


def test_report_after_a_switch_has_dtypes_statistics_and_history():
    model = _model("adaptive_float16")
    x = np.ones((16, 4), "float32")
    x[::8, 0] = 7e4  # beyond float16: inf in the first layer, finite after it in float32
    # A small initial scale: the non-finite steps count once it reaches its floor.
    cb = AdaptivePrecision(interval=2, loss_scale=DynamicLossScale(initial_scale=2.0))
    model.fit(x, np.ones((16, 1)), batch_size=8, epochs=2, verbose=0, callbacks=[cb])
    r = precision_report(model)
    assert isinstance(r, PrecisionReport)
    assert r.policy == "adaptive_float16" and r.candidates == ("float16", "float32")
    # every layer, the weightless ReLU too, in forward order
    assert [row["layer"] for row in r.rows] == [layer.path for layer in model.layers]
    first, relu, last = r.rows
    assert first["compute_dtype"] == "float32" and last["compute_dtype"] == "float16"
    assert first["variable_dtype"] == "float32"
    # attributed by the forward statistics: the input of the first layer overflows
    assert first["switches"] == 1 and first["history"][0]["reason"] == "input_range"
    assert first["history"][0]["old"] == "float16" and first["history"][0]["new"] == "float32"
    assert set(first["stats"]) >= {"nonfinite", "amax", "fp16_subnormal", "zero", "in_amax",
                                   "out_amax", "in_range", "out_flushed", "grad_error"}
    assert first["stats"]["in_amax"] == 7e4
    assert relu["measured"] == {"gradients": False, "forward": True, "probe": False,
                                "float8": False, "scale": False}
    assert first["measured"]["gradients"] and first["measured"]["forward"]
    # the loss scale the layer's gradients carried at the last decision
    assert first["measured"]["scale"] and relu["loss_scale"] is None
    assert first["loss_scale"] == float(model.optimizer.loss_scale)
    assert "| loss scale |" in str(r)
    text = str(r)
    assert "float16->float32@2 (input_range)" in text
    # head, titles, rule, a row per layer, then the steps skipped (the
    # overflowing steps before the switch)
    assert r.skipped_steps and r.skipped_steps == int(model.optimizer.skipped_steps.numpy())
    assert text.splitlines()[3 + len(r.rows):] == [
        f"skipped steps (non-finite gradients): {r.skipped_steps}"]
    relu_cells = text.splitlines()[3 + 1].split(" | ")
    assert relu_cells[3] == "n/m"  # no gradients: not measured, not 0
    assert "grad nonfinite:" in r.legend() and "n/m" in r.legend()
    json.dumps(r.to_dict())  # the structured form is plain data
    assert r.dtypes() == {first["layer"]: "float32", relu["layer"]: "float16",
                          last["layer"]: "float16"}


def test_report_before_training_shows_dtypes_and_no_statistics():
    model = _model("adaptive_bfloat16")
    r = precision_report(model)
    assert [row["compute_dtype"] for row in r.rows] == ["bfloat16"] * 3
    assert all(row["stats"] is None and row["switches"] == 0 for row in r.rows)
    assert "| n/m |" in str(r)


@pytest.mark.parametrize("policy, dtype", [("float32", "float32"),
                                           ("mixed_bfloat16", "bfloat16")])
def test_report_of_a_model_that_is_not_adaptive(policy, dtype):
    r = precision_report(_model(policy))
    assert r.policy == policy and r.candidates == ()
    assert [row["compute_dtype"] for row in r.rows] == [dtype] * 3
    assert str(r).startswith(f"policy: {policy}\n")


def test_report_rejects_non_models():
    with pytest.raises(TypeError, match="model"):
        precision_report("model")


def _switches_column(report):
    """Layer path -> the table's ``switches`` cell."""
    lines = str(report).splitlines()
    titles = lines[1].strip("| ").split(" | ")
    rows = [line.strip("| ").split(" | ") for line in lines[3:3 + len(report.rows)]]
    return {cells[0]: cells[titles.index("switches")] for cells in rows}


def test_switches_count_every_dtype_change_of_the_history():
    """A small fit trains in float32 (``no_gain``), the next fit adapts
    (``gain`` back to float16, at the same step), and the first layer's input
    overflows float16 (``input_range``): every one of them is a switch in the
    report, where the controller's state counts only its own."""
    model = _model("adaptive_float16")
    x = np.ones((16, 4), "float32")
    model.fit(x, np.ones((16, 1)), batch_size=8, epochs=1, verbose=0)  # too small to gain
    assert [layer.compute_dtype for layer in model.layers] == ["float32"] * 3
    x[::8, 0] = 7e4
    cb = AdaptivePrecision(interval=2)
    model.fit(x, np.ones((16, 1)), batch_size=8, epochs=2, verbose=0, callbacks=[cb])
    r = precision_report(model)
    first, relu, last = r.rows
    assert [h["reason"] for h in first["history"]] == ["no_gain", "gain", "input_range"]
    assert [h["step"] for h in first["history"]] == [0, 0, 2]
    for row in (relu, last):
        assert [(h["old"], h["new"], h["reason"]) for h in row["history"]] == [
            ("float16", "float32", "no_gain"), ("float32", "float16", "gain")]
    assert [row["switches"] for row in r.rows] == [3, 2, 2]
    assert _switches_column(r) == {first["layer"]: "3", relu["layer"]: "2", last["layer"]: "2"}
    # The rule's bound (max_switches) counts the controller's switches alone.
    assert [row["state"]["switches"] for row in r.rows] == [1, 0, 0]
    assert first["compute_dtype"] == "float32" and last["compute_dtype"] == "float16"

