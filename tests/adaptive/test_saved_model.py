"""Issue 41, item 1: a model saved after promotions keeps every decision
when loaded in a fresh process, whatever that process's global policy
(none, ``"adaptive"``, ``"mixed_bfloat16"``), through ``precision_report``,
``evaluate``, ``fit`` and ``export``; and its ``.keras`` file holds the
policy once, not once per layer.

Each load runs in its own process (about 10 s of CPU each); ``fit`` and
``export`` after the load run under ``"adaptive"`` only, unless
``KERAS_MP_FULL_SAVED=1`` (then under every global policy).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import keras
import numpy as np

import keras_mp
from keras_mp.callbacks import AdaptivePrecision
from tests.adaptive import saved_model

SCRIPT = Path(saved_model.__file__)
GLOBALS = ("none", "adaptive", "mixed_bfloat16")
FIT = GLOBALS if os.environ.get("KERAS_MP_FULL_SAVED") == "1" else ("adaptive",)


def _policy_configs(path: Path) -> list[dict]:
    def walk(node):
        if isinstance(node, dict):
            if node.get("class_name") == "AdaptivePolicy":
                yield node["config"]
            for v in node.values():
                yield from walk(v)
        elif isinstance(node, list):
            for v in node:
                yield from walk(v)
    with zipfile.ZipFile(path) as z:
        return list(walk(json.loads(z.read("config.json"))))


def test_decisions_survive_load_in_a_fresh_process_under_any_global_policy(tmp_path):
    x, y = saved_model.data()
    model = saved_model.build("adaptive_float16")
    cb = AdaptivePrecision(interval=2, loss_scale=keras_mp.DynamicLossScale(initial_scale=2.0))
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False, callbacks=[cb])
    assert [(e["layer"], e["reason"]) for e in cb.events] == [("proj", "input_range")]
    model.save(tmp_path / "m.keras")
    saved = saved_model.state(model, x)
    procs = {name: subprocess.Popen(
        [sys.executable, str(SCRIPT), "load", str(tmp_path), name]
        + (["--fit"] if name in FIT else []),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env=dict(os.environ, PYTHONPATH=str(SCRIPT.parents[2]))) for name in GLOBALS}
    # The same model trained on here: what the loaded ones must repeat.
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False, callbacks=[cb])
    continued = saved_model.state(model, x)
    for name, proc in procs.items():
        out = proc.communicate(timeout=300)[0].decode()
        assert proc.returncode == 0, f"{name}:\n{out[-4000:]}"
        result = json.loads((tmp_path / f"{name}.json").read_text())
        loaded, after = result["loaded"], result.get("after_fit")
        # Loaded, then precision_report: the same dtypes, history, states,
        # probe records, loss scales and step count; the same outputs.
        assert loaded["dtypes"]["proj"] == "float32"
        for key in ("dtypes", "rows", "loss_scale", "iterations", "calls"):
            assert loaded[key] == saved[key], (name, key)
        np.testing.assert_array_equal(loaded["predictions"], saved["predictions"])
        assert loaded["global_after_load"] == ("float32" if name == "none" else name)
        assert np.isfinite(loaded["evaluate"])
        if name not in FIT:
            continue
        # fit goes on from there as the saved process did, and exports
        assert [(e["step"], e["layer"], e["reason"]) for e in result["events"]] == \
            [(e["step"], e["layer"], e["reason"]) for e in cb.events[1:]], name
        for key in ("dtypes", "calls", "iterations", "loss_scale"):
            assert after[key] == continued[key], (name, key)
        assert after["rows"]["proj"]["history"] == saved["rows"]["proj"]["history"]
        # float16 outputs: a few units in the last place (which kernels run
        # is measured per process)
        np.testing.assert_allclose(after["predictions"], continued["predictions"],
                                   rtol=1e-2, atol=1e-2)
        assert after["dtypes_after_export"] == continued["dtypes"]
        np.testing.assert_allclose(result["exported"], after["predictions"], rtol=1e-6)


def test_keras_file_holds_the_policy_once(tmp_path):
    """A keras-io-sized text classifier (20000-token vocabulary, 32-wide
    embedding): the adaptive file is within 1.2x of Keras's mixed_float16
    file, and only one layer's config holds the policy's records."""
    sizes = {}
    for policy in ("mixed_float16", "adaptive_float16"):
        keras.utils.clear_session(free_memory=False)
        keras_mp.set_global_policy(policy)
        inputs = keras.Input((16,), dtype="int32")
        h = keras.layers.Embedding(20000, 32)(inputs)
        h = keras.layers.GlobalAveragePooling1D()(h)
        h = keras.layers.Dense(20, activation="relu")(h)
        model = keras.Model(inputs, keras.layers.Dense(2)(h))
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True))
        rng = np.random.default_rng(0)
        model.fit(rng.integers(0, 20000, (32, 16)), rng.integers(0, 2, (32,)), batch_size=8,
                  verbose=0, callbacks=[AdaptivePrecision(interval=2)]
                  if policy.startswith("adaptive") else [])
        path = tmp_path / f"{policy}.keras"
        model.save(path)
        sizes[policy] = path.stat().st_size
    configs = _policy_configs(tmp_path / "adaptive_float16.keras")
    assert len(configs) == 4  # Embedding, pooling and the two Dense layers
    assert [("records" in c) for c in configs] == [True, False, False, False]
    ratio = sizes["adaptive_float16"] / sizes["mixed_float16"]
    print(f"adaptive {sizes['adaptive_float16']} B, mixed_float16 {sizes['mixed_float16']} B, "
          f"{ratio:.3f}x")
    assert ratio <= 1.2


class _AutoConfigured(keras.layers.Layer):
    """A layer without get_config: Keras saves it from its __init__ arguments."""

    def __init__(self, units=3, **kwargs):
        super().__init__(**kwargs)
        self.units = units

    def build(self, input_shape):
        self.w = self.add_weight((input_shape[-1], self.units))

    def call(self, x):
        return x @ self.w


def test_a_loaded_layer_without_get_config_saves_again(tmp_path):
    # Keras records a layer's auto config only from plain arguments; a loaded
    # layer gets its policy as an object (Keras's sequential_test.py).
    custom = {"_AutoConfigured": _AutoConfigured}
    with keras_mp.policy_scope("adaptive_float16"):
        model = keras.Sequential([keras.Input((4,)), _AutoConfigured(5), keras.layers.Dense(2)])
    model.save(tmp_path / "a.keras")
    loaded = keras.saving.load_model(tmp_path / "a.keras", custom_objects=custom)
    assert isinstance(loaded.layers[0].dtype_policy, keras_mp.AdaptivePolicy)
    assert loaded.layers[0].get_config()["units"] == 5
    loaded.save(tmp_path / "b.keras")
    again = keras.saving.load_model(tmp_path / "b.keras", custom_objects=custom)
    x = np.ones((2, 4), "float32")
    np.testing.assert_array_equal(np.asarray(again(x)), np.asarray(model(x)))


def test_a_recurrent_layer_first_keeps_the_whole_policy_in_the_file(tmp_path):
    # Keras's LSTM, GRU and SimpleRNN serialize their cell (its policy with it,
    # written whole as the first the save meets) and then drop the cell's
    # config: the file once held only short configs, and refused to load.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 6, 3)).astype("float32")
    for rnn in (keras.layers.LSTM, keras.layers.GRU, keras.layers.SimpleRNN):
        with keras_mp.policy_scope("adaptive_float16"):
            model = keras.Sequential([keras.Input((6, 3)), rnn(5), keras.layers.Dense(2)])
        policy = model.layers[0].dtype_policy
        policy.assign(model.layers[1].path, "float32")   # a decision the file must keep
        path = tmp_path / f"{rnn.__name__}.keras"
        model.save(path)
        configs = _policy_configs(path)   # the model's, the RNN's and the Dense layer's
        assert len(configs) == 3 and sum("records" in c for c in configs) == 1, rnn.__name__
        loaded = keras.saving.load_model(path)
        assert [layer.compute_dtype for layer in loaded.layers] == ["float16", "float32"]
        np.testing.assert_array_equal(np.asarray(loaded(x)), np.asarray(model(x)))
