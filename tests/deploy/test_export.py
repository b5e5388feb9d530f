"""keras_mp.deploy.export and `keras-mp export`: SavedModel and LiteRT artifacts of
adaptive, fused and quantized models, reloaded in a fresh process."""

import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp import cli
from keras_mp.deploy.export import export, float32_copy

_X = np.random.default_rng(0).normal(size=(5, 6)).astype("float32")

# Loads every artifact in a folder with TensorFlow only (no Keras model code,
# no keras_mp) and writes its outputs on _X.
_RELOAD = textwrap.dedent("""
    import os, sys, numpy as np, tensorflow as tf
    folder = sys.argv[1]
    x = np.load(os.path.join(folder, "x.npy"))
    out = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name.endswith(".tflite"):
            it = tf.lite.Interpreter(model_path=path)
            runner = it.get_signature_runner()
            key = it.get_signature_list()["serving_default"]["inputs"][0]
            out[name] = list(runner(**{key: x}).values())[0]
        elif os.path.isdir(path):
            loaded = tf.saved_model.load(path)   # held: its variables live with it
            out[name] = loaded.serve(x).numpy()
    np.savez(os.path.join(folder, "outputs.npz"), **out)
""")


def _reload_in_fresh_process(folder):
    np.save(os.path.join(folder, "x.npy"), _X)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run([sys.executable, "-c", _RELOAD, str(folder)], capture_output=True,
                          text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(np.load(os.path.join(folder, "outputs.npz")))


def _model():
    with keras_mp.policy_scope("adaptive_bfloat16"):
        inputs = keras.Input((6,))
        x = keras.layers.Dense(32, activation="relu")(inputs)
        x = keras.layers.LayerNormalization()(x)
        model = keras.Model(inputs, keras.layers.Dense(3)(x))
    keras_mp.policies.policy_of(model).assign(model.layers[-1].path, "float32")
    return model


def test_saved_model_litert_and_cli_reload_in_a_fresh_process(tmp_path, capsys):
    adaptive = _model()
    fused = keras_mp.fuse(adaptive)
    quantized = keras_mp.fuse(adaptive)
    quantized.quantize("int8")
    folder = tmp_path / "artifacts"
    folder.mkdir()
    expected = {}
    for name, model in [("adaptive", adaptive), ("fused", fused), ("int8", quantized)]:
        export(model, folder / f"sm_{name}")
        expected[f"sm_{name}"] = np.asarray(model(_X)).astype("float32")
    export(adaptive, folder / "sm_compute", output_dtype="compute")
    reference32 = np.asarray(float32_copy(adaptive)(_X))
    for weights in (None, "float16", "int8"):
        export(adaptive, folder / f"adaptive_{weights}.tflite", "litert", weights=weights)
    export(fused, folder / "fused_None.tflite", "litert")
    # `keras-mp export` of a quantized .keras file
    quantized.save(tmp_path / "q.keras")
    with pytest.raises(SystemExit):
        cli.main(["export", "--help"])
    assert "--weights" in capsys.readouterr().out
    assert cli.main(["export", str(tmp_path / "q.keras"), str(folder / "sm_cli")]) == 0
    assert "float32 outputs" in capsys.readouterr().out
    assert cli.main(["export", str(tmp_path / "q.keras"), str(folder / "q.tflite"),
                     "--format", "litert"]) == 2
    assert "weights='int8'" in capsys.readouterr().err
    expected["sm_cli"] = expected["sm_int8"]

    got = _reload_in_fresh_process(folder)
    for name, want in expected.items():   # the model's own computation, float32 outputs
        assert got[name].dtype == np.float32
        np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-5)
    assert got["sm_compute"].dtype == np.float32  # the last layer computes in float32 here
    scale = np.abs(reference32).max()
    for name in ("adaptive_None", "fused_None"):
        np.testing.assert_allclose(got[f"{name}.tflite"], reference32, rtol=1e-5, atol=1e-5)
    assert np.abs(got["adaptive_float16.tflite"] - reference32).max() < 1e-2 * scale
    assert np.abs(got["adaptive_int8.tflite"] - reference32).max() < 5e-2 * scale
    # the float32 LiteRT file matches the bfloat16 Keras model within bfloat16's rounding
    assert np.abs(got["adaptive_None.tflite"] - expected["sm_adaptive"]).max() < 3e-2 * scale


def test_bfloat16_outputs_are_cast_unless_asked(tmp_path):
    import tensorflow as tf

    with keras_mp.policy_scope("adaptive_bfloat16"):
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(2)])
    export(model, tmp_path / "f32")
    export(model, tmp_path / "own", output_dtype="compute")
    f32, own = tf.saved_model.load(str(tmp_path / "f32")), tf.saved_model.load(str(tmp_path / "own"))
    assert f32.serve(_X).dtype == tf.float32 and own.serve(_X).dtype == tf.bfloat16


def test_litert_refuses_a_keras_quantized_model(tmp_path):
    model = _model()
    model.quantize("int8")
    with pytest.raises(ValueError, match="weights='int8'"):
        export(model, tmp_path / "q.tflite", "litert")


@pytest.mark.parametrize("kwargs,error,match", [
    ({"format": "torch"}, ValueError, "`format` must be one of"),
    ({"output_dtype": "float16"}, ValueError, "`output_dtype`"),
    ({"weights": "int4", "format": "litert"}, ValueError, "`weights` must be one of"),
    ({"weights": "int8"}, ValueError, "format='litert' only"),
])
def test_bad_arguments(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        export(_model(), tmp_path / "x", **kwargs)
    with pytest.raises(TypeError, match="`model`"):
        export("model.keras", tmp_path / "x")


def test_an_export_replaces_the_last_whole_or_not_at_all(tmp_path):
    """Written beside the target and moved into place (keras_mp/_atomic.py): an earlier
    SavedModel is replaced whole, a failed export leaves the earlier file, and a
    folder holding other files is refused (it would be replaced with them)."""
    import tensorflow as tf

    model = _model()
    served = tmp_path / "served"
    export(model, served)
    (served / "stale.txt").write_text("from the earlier export")
    export(model, served)
    assert "stale.txt" not in os.listdir(served)
    assert tf.saved_model.load(str(served)).serve(_X).shape == (len(_X), 3)

    export(model, tmp_path / "m.tflite", "litert")
    before = (tmp_path / "m.tflite").read_bytes()
    quantized = _model()
    quantized.quantize("int8")
    with pytest.raises(ValueError, match="weights='int8'"):
        export(quantized, tmp_path / "m.tflite", "litert")
    assert (tmp_path / "m.tflite").read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["m.tflite", "served"]  # no temporaries

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's")
    with pytest.raises(ValueError, match="`path` .*mine.* folder holding other files"):
        export(model, mine)
    assert os.listdir(mine) == ["notes.txt"]
