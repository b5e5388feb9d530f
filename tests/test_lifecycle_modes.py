"""Nothing keras-mp installs for speed or evidence leaks into Keras's own
lifecycle, in any execution mode.

keras-mp installs per-instance wrappers, a compiled optimizer update
(``xla_update``, also built by ``auto``'s trial), hooks and float8 state on a
model and its optimizer during ``fit``. None of it may break, or end up in,
Keras's own saving, export, quantization or cloning. For each execution mode
(``KERAS_MP_EXECUTION``) and adaptive policy, tests/lifecycle/lifecycle.py
fits a model with plain ``compile``/``fit`` and takes it through predict,
``.keras`` save and load in a fresh process, ``model.export`` and
``keras_mp.deploy.export.export`` served by a fresh process (TensorFlow alone),
LiteRT, ONNX (``format="onnx"``) run by onnxruntime in the fresh process,
``keras-mp export``, ``tf.train.Checkpoint``, ``clone_model``,
``keras_mp.quantize`` and ``model.quantize("int8")``, ``BackupAndRestore``
resume, and fit again after loading.

Each mode runs in processes of its own (one to train all three policies,
then a fresh one to check): XLA:CPU executables are never freed in-process,
and the measured mode must not leak between tests. The modes' processes
start right after collection and run beside the other tests
(tests/background.py; ``KERAS_MP_TEST_JOBS`` at a time): about 5 minutes of
CPU on 2 cores.
"""

import json
import os
import sys

import pytest

from tests import background

MODES = ("graph", "xla_update", "xla", "auto")
POLICIES = ("adaptive_bfloat16", "adaptive_float16", "adaptive_float8")
_SCRIPT = os.path.join(os.path.dirname(__file__), "lifecycle", "lifecycle.py")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TEST = "test_fit_save_export_clone_quantize_resume"


#: (mode, policy) pairs. A fit too small to gain (``no_gain``) runs Keras's own
#: train function, whatever the mode: it runs once, in the default mode.
CASES = tuple((mode, policy) for mode in MODES for policy in POLICIES) + (("auto", "no_gain"),)


def _run(phase: str, mode: str, folder: str) -> str | None:
    """Runs one phase; returns what it printed if it crashed (None if not)."""
    env = dict(os.environ, KERAS_MP_EXECUTION=mode, TF_CPP_MIN_LOG_LEVEL="2",
               KERAS_BACKEND="tensorflow")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
    policies = [p for m, p in CASES if m == mode] if phase == "train" else []
    done = background.run([sys.executable, _SCRIPT, phase, folder, *policies], timeout=900,
                          env=env, cwd=_ROOT)
    return None if done.returncode == 0 else f"{phase} ({mode}) crashed:\n{done.stderr[-4000:]}"


def _pipeline(mode: str, folder: str) -> str | None:
    return _run("train", mode, folder) or _run("check", mode, folder)


def start(items) -> None:
    """Starts the pipelines of the modes that ``items`` (the session's
    selected tests) need, in the background (tests/background.py)."""
    background.start_selected(items, _TEST, "lifecycle", MODES, _pipeline)


@pytest.fixture(scope="module")
def lifecycle(request):
    """mode -> the folder where that mode's processes wrote their results
    (started right after collection, tests/conftest.py)."""
    start(request.session.items)
    return background.waiter("lifecycle")


def _results(folder: str, phase: str) -> dict:
    path = os.path.join(folder, f"{phase}.json")
    assert os.path.exists(path), f"{phase} wrote no results in {folder}"
    with open(path) as f:
        return json.load(f)["results"]


# Every step each phase must have run (a step skipped after an earlier
# failure fails the test too).
_TRAIN = ("fit", "predict", "save_keras", "model_export", "mp_export_saved_model",
          "mp_export_litert", "float32_copy", "mp_export_onnx", "tf_checkpoint", "clone_model",
          "mp_quantize", "backup_and_restore", "model_quantize")
_CHECK = ("load_keras", "load_keras_predict", "serve_sm_keras", "serve_sm_mp",
          "serve_sm_clone", "serve_sm_mp_quantize", "serve_sm_model_quantize",
          "load_mp_quantize", "load_model_quantize", "serve_litert", "serve_onnx", "cli_export",
          "fit_again_save_export")


@pytest.mark.parametrize("mode, policy", CASES)
def test_fit_save_export_clone_quantize_resume(lifecycle, mode, policy):
    folder = os.path.join(lifecycle(mode), policy)
    with open(os.path.join(folder, "info.json")) as f:
        info = json.load(f)
    if policy == "no_gain":
        # Keras's float32 fit under "adaptive_float16", no mode chosen; the
        # user's Adam behind the dynamic loss scale float16 asks for, which
        # skips non-finite steps (issue 46)
        assert (info["dtypes"], info["optimizer"], info["inner"], info["chosen"]) == \
            (["float32"], "LossScaleOptimizer", "Adam", None), info
        assert info["scale"].startswith("DynamicLossScale("), info
    elif mode != "auto":   # auto: whichever mode the trial chose
        assert info["chosen"] == mode, info
    if policy == "adaptive_float16":   # the callback's loss-scale wrapper is in place
        assert info["optimizer"] == "LossScaleOptimizer", info
    expected = {"train": _TRAIN + (("model_quantize_refused",)
                                   if policy == "adaptive_float16" else ()),
                "check": _CHECK}
    failures = {}
    for phase, names in expected.items():
        results = _results(folder, phase)
        for name in names:
            got = results.get(name, "not run")
            if got != "ok":
                failures[f"{phase}.{name}"] = got
    assert not failures, json.dumps(failures, indent=1)


# -- the mechanisms, in-process (no fit, no XLA) ----------------------------------


def _functions_savedmodel_would_trace(obj) -> list[str]:
    """What TensorFlow's AutoTrackable lists for SavedModel: every
    ``tf.function`` among the object's attributes."""
    import tensorflow as tf

    found = []
    for name in dir(obj):
        try:
            value = getattr(obj, name, None)
        except Exception:  # noqa: BLE001 - as TensorFlow does
            continue
        if isinstance(value, (tf.types.experimental.GenericFunction,
                              tf.types.experimental.ConcreteFunction)):
            found.append(name)
    return found


def test_what_keras_mp_installs_is_no_function_savedmodel_traces():
    import keras

    import keras_mp
    from keras_mp import _installed, execution
    from keras_mp.adaptive.evidence import hooks
    from keras_mp.execution import fused_update

    with keras_mp.policy_scope("adaptive_bfloat16"):
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    model.optimizer.build(model.trainable_variables)
    before = {id(o): _functions_savedmodel_would_trace(o)
              for o in (model, model.optimizer, *model.layers)}
    installed = hooks.Hooks(model, model.layers)
    installed.hook_optimizer(model.optimizer, lambda *args: None)
    assert execution.configure(model, mode="xla_update") == "xla_update"
    model.make_train_function()   # installs the compiled update
    assert fused_update.is_installed(model.optimizer)
    for obj in (model, model.optimizer, *model.layers):
        assert _functions_savedmodel_would_trace(obj) == before[id(obj)], obj
    # what is installed is where keras-mp finds it, under one holder
    held = _installed.installed(model.optimizer)
    assert {"apply", "_backend_update_step"} <= set(held.originals)
    assert _installed.original(model, "train_step").__func__ is type(model).train_step
    with pytest.raises(TypeError, match="tf.function"):
        import tensorflow as tf

        _installed.install_method(model, "predict_step", lambda f: tf.function(f))


def test_a_float8_trained_model_exports_to_litert_in_float32(tmp_path):
    import keras
    import numpy as np

    import keras_mp
    from keras_mp.adaptive.evidence import float8
    from keras_mp.deploy.export import export, float32_copy

    policy = keras_mp.AdaptivePolicy(candidates=("float8", "bfloat16", "float32"))
    with keras_mp.policy_scope(policy):
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(1)])
    assert len(float8.prepare(model)) == 2   # what the callback does when fit starts
    x = np.random.default_rng(0).normal(size=(3, 4)).astype("float32")
    copy = float32_copy(model)
    assert [w.path.split("/")[-1] for w in copy.weights] == ["kernel", "bias"] * 2
    k0, b0, k1, b1 = (np.asarray(w) for w in model.weights if w.path.split("/")[-1]
                      in ("kernel", "bias"))
    want = np.maximum(x @ k0 + b0, 0.0) @ k1 + b1
    np.testing.assert_allclose(np.asarray(copy(x)), want, rtol=1e-5, atol=1e-6)
    export(model, tmp_path / "m.tflite", "litert")
    assert (tmp_path / "m.tflite").stat().st_size > 0


def test_keras_mp_quantize_leaves_an_optimizer_the_saved_file_loads_into(tmp_path):
    import keras
    import numpy as np

    import keras_mp

    with keras_mp.policy_scope("adaptive_float16"):
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(1)])
    model.compile(optimizer=keras_mp.LossScaleOptimizer(keras.optimizers.Adam()), loss="mse")
    model.optimizer.build(model.trainable_variables)   # as fit, or a loaded .keras file
    assert keras_mp.quantize(model, "int8")
    inner = model.optimizer.inner_optimizer
    assert [id(v) for v in inner._trainable_variables] == \
        [id(v) for v in model.trainable_variables]
    x = np.ones((2, 4), "float32")
    model.save(tmp_path / "q.keras")
    loaded = keras.saving.load_model(tmp_path / "q.keras")
    np.testing.assert_array_equal(np.asarray(loaded(x)), np.asarray(model(x)))
