"""The start-up measurements kept on disk (keras_mp.device.cache) and the
short-fit rule (keras_mp.execution.reasons.short_fit)."""

import os
import subprocess
import sys
import textwrap

import pytest

from keras_mp.device import cache
from keras_mp.execution import start_up, step_trial


def test_cache_keeps_values_per_device_and_can_be_off(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.ENV_VAR, str(tmp_path))
    assert cache.get("section", "k") is None
    cache.put("section", "k", {"a": [1, 2]})
    assert cache.get("section", "k") == {"a": [1, 2]}
    assert (tmp_path / cache.FILE).exists()
    assert cache.get("section", "k", "GPU") is None   # another device's entry
    monkeypatch.setenv(cache.ENV_VAR, "off")
    assert cache.directory() is None and cache.get("section", "k") is None
    cache.put("section", "other", 1)                   # writes nothing
    monkeypatch.setenv(cache.ENV_VAR, str(tmp_path))
    assert cache.get("section", "other") is None
    with pytest.raises(ValueError, match="`device_type`"):
        cache.device_key("NPU")


class _Batches:
    element_spec = ("float32", (8, 4))


def test_a_kept_trial_decision_is_taken_on_the_first_call(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.ENV_VAR, str(tmp_path))
    clock = {"graph": 2.0, "xla": 1.0}
    monkeypatch.setattr(step_trial, "_timed",
                        lambda fn, data, mode: (fn(data), clock[mode], clock[mode]))
    calls = {"graph": 0, "xla": 0}

    def fn(mode):
        def call(data):
            calls[mode] += 1
        return call

    decided = []
    trial = step_trial.StepTrial(step_trial.Record(), {"graph": fn("graph"), "xla": fn("xla")},
                                 1.05, decided.append, cache_key="model-a")
    trial(_Batches())   # measured on the first call, which then runs the decided mode
    assert decided == ["xla"] and calls == {"graph": step_trial.calls_to_decide(2) // 2,
                                            "xla": step_trial.calls_to_decide(2) // 2 + 1}
    calls.update(graph=0, xla=0)
    again = step_trial.StepTrial(step_trial.Record(), {"graph": fn("graph"), "xla": fn("xla")},
                                 1.05, decided.append, cache_key="model-a")
    again(_Batches())
    assert decided == ["xla", "xla"] and calls == {"graph": 0, "xla": 1}
    other = step_trial.StepTrial(step_trial.Record(), {"graph": fn("graph"), "xla": fn("xla")},
                                 1.05, decided.append, cache_key="model-b")
    calls.update(graph=0, xla=0)
    other(_Batches())                                  # another model measures
    assert decided == ["xla", "xla", "xla"] and calls["graph"] == step_trial.PAIRS + 2


def test_expect_and_expected_calls_check_their_input():
    import keras

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="`calls`"):
        start_up.expect(model, -1)
    with pytest.raises(TypeError, match="`model`"):
        start_up.expect("m", 3)
    assert start_up.expected_calls({"epochs": 3, "steps": 32}, 4) == 24
    assert start_up.expected_calls({"epochs": 3}) is None


_SHORT_FIT = textwrap.dedent("""
    import numpy as np, keras, keras_mp
    from keras_mp.device import xla
    from keras_mp.execution import reasons
    keras_mp.set_global_policy("adaptive")
    inputs = keras.Input((32,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="adam", loss="mse")
    x, y = np.random.rand(1000, 32), np.random.rand(1000, 1)
    model.fit(x, y, epochs=3, verbose=0, callbacks=[keras_mp.callbacks.AdaptivePrecision()])
    print("short", reasons.short_fit(model) is not None, "chosen", keras_mp.execution.chosen(model),
          "xla started", sorted(xla._available), flush=True)
""")


def test_a_short_fit_of_a_small_dense_model_measures_nothing(tmp_path):
    env = dict(os.environ, KERAS_MP_CACHE_DIR=str(tmp_path), TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run([sys.executable, "-c", _SHORT_FIT], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # On a CPU: no child process, no trial, no XLA compilation; the device
    # profile behind "adaptive" is kept for the next process.
    assert "short True chosen graph xla started []" in proc.stdout, proc.stdout
    assert (tmp_path / cache.FILE).exists()


def test_a_short_fit_of_any_model_measures_nothing_and_a_long_one_does(monkeypatch, caplog):
    """An LSTM with a normalization (not a small Dense model): its fit of 12
    calls takes the graph without asking any measured rule; told the fit is
    long enough, the same model is tried in each mode. Outside ``fit`` (a
    custom loop), ``set_model`` takes the choice at once."""
    import logging

    import keras
    import numpy as np

    import keras_mp
    from keras_mp import execution

    asked = []
    slow_matmul = execution.reasons.slow_matmul
    monkeypatch.setattr(execution.reasons, "slow_matmul",
                        lambda model: asked.append(model) or slow_matmul(model))
    x = np.random.default_rng(0).normal(size=(32, 12, 8)).astype("float32")
    y = x[:, 0, :1]

    def build():
        model = keras.Sequential([keras.Input((12, 8)), keras.layers.LSTM(8),
                                  keras.layers.LayerNormalization(), keras.layers.Dense(1)])
        model.compile(optimizer="rmsprop", loss="mse")
        return model

    keras_mp.set_global_policy("adaptive_bfloat16")
    try:
        model = build()
        with caplog.at_level(logging.INFO, logger="keras_mp"):
            model.fit(x, y, batch_size=8, epochs=3, verbose=0)   # 12 calls
        assert execution.reasons.short_fit(model).startswith("this fit makes 12 train steps")
        assert execution.chosen(model) == "graph" and not asked
        assert "fewer than 1000" in caplog.text and "this model's train step runs" not in caplog.text

        # A fit long in calls but short in seconds: its first calls, timed as
        # a graph, show that measuring cannot pay for itself.
        monkeypatch.setattr(execution.reasons, "SHORT_FIT", 12)
        caplog.clear()
        model = build()
        with caplog.at_level(logging.INFO, logger="keras_mp"):
            model.fit(x, y, batch_size=8, epochs=3, verbose=0)
        assert execution.reasons.short_fit(model) is None
        assert "its 12 calls take about" in caplog.text and "less than 60 s" in caplog.text
        assert execution.chosen(model) == "graph" and not asked
        assert "this model's train step runs" not in caplog.text

        monkeypatch.setattr(execution.first_calls, "TRIAL_AFTER_S", 0.0)
        caplog.clear()
        model = build()
        with caplog.at_level(logging.INFO, logger="keras_mp"):
            model.fit(x, y, batch_size=8, epochs=3, verbose=0)
        assert "this model's train step runs" in caplog.text   # the trial's verdict
        assert execution.chosen(model) in ("graph", "xla_update", "xla") and asked

        model = build()
        cb = keras_mp.callbacks.AdaptivePrecision()
        cb.set_model(model)                                   # a custom loop's set-up
        assert execution.chosen(model) is not None
    finally:
        keras_mp.set_global_policy("float32")
