"""Real models (tests/real_models/models.py) under adaptive precision, from
plain ``fit`` to serving, in processes of their own.

Run by tests/test_real_models.py, one model per pair of processes:

``python lifecycle.py train DIR MODEL POLICY[:MODE[:short|export]]...``
    for each policy, in ``DIR/POLICY`` (``KERAS_MP_EXECUTION`` set to MODE
    for that policy, or unset for ``auto``, the default a user gets; a
    ``short`` run stops after the ``.keras`` save, and its check after the
    load; an ``export`` run adds ``model.export``, served in the check):
    builds the model under the policy, fits it with plain
    ``compile``/``fit`` (loss per epoch recorded), checks that
    ``keras_mp.precision_report`` lists every layer that computes,
    ``keras_mp.fuse`` (same outputs), ``model.predict``, ``.keras`` save,
    ``model.export``, ONNX (``keras_mp.deploy.export.export``), a
    ``BackupAndRestore`` run interrupted after one epoch, and last
    ``model.quantize("int8")`` (``keras_mp.quantize`` for float16, which
    Keras refuses; the refusal itself is checked unchanged), saved.
``python lifecycle.py check DIR``
    a fresh process, for each ``DIR/POLICY``: loads the ``.keras`` file
    (same predictions), serves the SavedModel with TensorFlow alone, runs
    the ONNX file in onnxruntime, runs ``keras-mp export --format litert``
    on the ``.keras`` file and the ``.tflite`` file in TFLite's interpreter,
    loads the quantized ``.keras`` file (same predictions), then fits the
    loaded model with ``BackupAndRestore``, which resumes the interrupted
    run (its epoch, iteration count and weights), and quantizes the result
    with ``keras_mp.quantize``.

Outputs are compared within the tolerance of the policy's narrow dtype
(:data:`TOL`, relative to the largest output). Every step runs on its own
(``DIR/POLICY/<phase>.json``: ``results``, ``seconds`` and ``facts``), so one
failing step does not hide the others.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

from tests.lifecycle.lifecycle import Steps, _same_refusal  # noqa: E402
from tests.real_models import keras_io, models  # noqa: E402,F401 (keras_io: its classes)

#: Train-function calls of the interrupted run and of its resumption: with
#: the fit's 12, 16 calls in all, below the 20th, where the adaptive
#: callback's first statistics step is traced (a trace of its own:
#: ``evidence`` below runs those on the KerasHub models).
BACKUP_STEPS = 2
#: Largest |difference| / largest |output| between two computations of one
#: model in the policy's narrow dtype (e.g. a SavedModel's graph, fused by
#: TensorFlow differently, or ONNX and LiteRT in float32).
TOL = {"adaptive": 5e-2, "adaptive_bfloat16": 5e-2, "adaptive_float16": 1e-2}
QUANTIZED_TOL = 0.2   # int8 weights
SAMPLE = 8


def _tol(policy: str) -> float:
    import keras_mp

    candidates = keras_mp.policies.get(policy).candidates
    return max(TOL.get(policy, 5e-2) if len(candidates) > 1 else 1e-5, 1e-5)


def predict(model, x) -> np.ndarray:
    """``model``'s outputs as a TensorFlow graph computes them (as a fresh
    process or a SavedModel does)."""
    import tensorflow as tf

    fn = tf.function(lambda t: model(t, training=False), autograph=False)
    return np.asarray(fn(tf.nest.map_structure(tf.constant, x)), "float32")


def close(got, want, tol: float, what: str = "outputs") -> float:
    got, want = np.asarray(got, "float32"), np.asarray(want, "float32")
    scale = max(float(np.abs(want).max()), 1e-3)
    err = float(np.abs(got - want).max()) / scale
    if got.shape != want.shape or not np.isfinite(got).all() or err > tol:
        raise AssertionError(f"{what} differ: shape {got.shape} vs {want.shape}, "
                             f"max |a - b| / {scale:.3g} = {err:.3g} > {tol}")
    return err


def _computing_layers(model, fixed: bool = False) -> list:
    """Every layer of ``model`` that computes (not models, not inputs) under
    the model's adaptive policy; ``fixed=True``: those under another policy
    instead (a layer that fixes its own dtype, as KerasHub's Llama and Gemma
    attention softmax does with ``dtype="float32"``: the report leaves them out)."""
    import keras

    import keras_mp

    policy = keras_mp.adaptive.policy_of(model)
    return [layer for layer in model._flatten_layers(include_self=False)
            if not isinstance(layer, (keras.Model, keras.layers.InputLayer))
            and (layer.dtype_policy is not policy) == fixed]


def _own_weights(layer) -> list:
    """The trainable variables ``layer`` holds itself (a composite layer's,
    such as ``TransformerDecoder``, are its sublayers')."""
    below = {id(w) for sub in layer._flatten_layers(include_self=False)
             for w in sub.trainable_weights}
    return [w for w in layer.trainable_weights if id(w) not in below]


def _digest(model) -> list[float]:
    return [float(np.abs(np.asarray(w, "float64")).sum()) for w in model.weights]


def _save_x(folder: str, xs) -> None:
    np.savez(os.path.join(folder, "x.npz"), **(xs if isinstance(xs, dict) else {"x": xs}))


def _load_x(folder: str):
    loaded = dict(np.load(os.path.join(folder, "x.npz")))
    return loaded["x"] if list(loaded) == ["x"] else loaded


def train(name: str, policy: str, mode: str, folder: str, length: str = "full") -> None:
    import keras

    import keras_mp
    from keras_mp.deploy import export as mp_export

    if mode == "auto":
        os.environ.pop("KERAS_MP_EXECUTION", None)
    else:
        os.environ["KERAS_MP_EXECUTION"] = mode
    os.makedirs(folder, exist_ok=True)
    steps = Steps(os.path.join(folder, "train.json"))
    # The candidates as this process measured them ("adaptive": the dtypes
    # fast on this device, measured when first asked).
    full = length == "full"
    facts = {"model": name, "policy": policy, "mode": mode, "full": full, "length": length,
             "candidates": list(keras_mp.policies.get(policy).candidates)}
    tol = _tol(policy)
    keras.utils.set_random_seed(0)
    x, y = models.data(name)
    xs = models.rows(x, SAMPLE)
    model = models.build(name, policy)

    def fit():
        history = model.fit(x, y, batch_size=models.BATCH, epochs=models.epochs(name, policy),
                            verbose=0).history
        facts["loss"] = [float(v) for v in history["loss"]]
        facts["chosen"] = keras_mp.execution.chosen(model)
        facts["optimizer"] = type(model.optimizer).__name__
        if not np.isfinite(facts["loss"]).all():
            raise AssertionError(f"non-finite loss {facts['loss']}")
    steps("fit", fit)

    def report():
        rows = keras_mp.precision_report(model).rows
        listed = {row["layer"] for row in rows}
        layers = _computing_layers(model)
        missing = [f"{layer.path} ({type(layer).__name__})" for layer in layers
                   if layer.path not in listed]
        facts["report"] = {"rows": len(rows), "layers": len(layers),
                           "dtypes": sorted({row["dtype"] for row in rows}),
                           "classes": len({row["class"] for row in rows}),
                           "switched": [r["layer"] for r in rows if r["switches"]],
                           "fixed": sorted({f"{type(layer).__name__} {layer.dtype_policy.name}"
                                            for layer in _computing_layers(model, fixed=True)})}
        if missing or len(rows) != len(layers):
            raise AssertionError(f"{len(rows)} rows for {len(layers)} layers; missing "
                                 f"{missing[:8]}")
    steps("report", report)

    def predicts():
        pred = predict(model, xs)
        close(model.predict(xs, verbose=0), pred, tol, "model.predict and the graph")
        np.save(os.path.join(folder, "pred.npy"), pred)
        _save_x(folder, xs)
        return pred
    pred = steps("predict", predicts)
    if pred is None:
        facts_out(folder, facts)
        steps.save()
        return

    def fuse():
        if name in models.FUSED_IN_PLACE:   # in place, on a copy
            model.save(os.path.join(folder, "to_fuse.keras"))
            fused = keras_mp.fuse(keras.saving.load_model(os.path.join(folder, "to_fuse.keras")),
                                  inplace=True)
        else:
            fused = keras_mp.fuse(model)
        facts["fused_layers"] = sum(type(layer).__module__ == "keras_mp.fused.layers"
                                    for layer in fused._flatten_layers())
        fused_pred = predict(fused, xs)
        close(fused_pred, pred, tol, "the fused copy's outputs")
        return fused, fused_pred
    fused = steps("fuse", fuse)

    def fused_reload(fused, fused_pred):   # fused layers come back fused (keras_mp.fused.saved)
        path = os.path.join(folder, "fused.keras")
        fused.save(path)
        again = keras.saving.load_model(path)
        os.remove(path)
        facts["fused_reloaded"] = len(keras_mp.fused.saved.record(again))
        close(predict(again, xs), fused_pred, 0.0, "the fused model's reload")
    if fused is not None:
        steps("fused_reload", fused_reload, *fused)
    steps("save_keras", model.save, os.path.join(folder, "model.keras"))
    if length == "export":
        steps("model_export", lambda: model.export(os.path.join(folder, "sm_keras"),
                                                   verbose=False))
    if not full:   # the short run: trained, reported, fused, saved (and exported)
        facts_out(folder, facts)
        steps.save()
        return
    steps("model_export", lambda: model.export(os.path.join(folder, "sm_keras"), verbose=False))
    steps("onnx_export", mp_export.export, model, os.path.join(folder, "model.onnx"), "onnx")

    def backup():
        # Training goes on one epoch with BackupAndRestore, then stops: the
        # check phase resumes it in a fresh process.
        seen = {}

        class Stop(keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                seen["iterations"] = int(self.model.optimizer.iterations.numpy())
                seen["digest"] = _digest(self.model)
                raise RuntimeError("interrupted")

        try:
            model.fit(x, y, batch_size=models.BATCH, epochs=2, steps_per_epoch=BACKUP_STEPS,
                      verbose=0, callbacks=[
                          keras.callbacks.BackupAndRestore(os.path.join(folder, "backup")),
                          Stop()])
        except RuntimeError as e:
            if "interrupted" not in str(e):
                raise
        else:
            raise AssertionError("the interruption did not happen")
        facts["backup"] = seen
    steps("backup_and_restore", backup)

    def evidence():
        # Statistics on every call and the float32 probe on every other (no
        # back-off, so the report's last interval holds one): the traces a
        # plain fit reaches at its 20th and 200th calls.
        callback = keras_mp.callbacks.AdaptivePrecision(interval=2, statistics_every=1,
                                                         probe_every=2, probe_backoff=1)
        history = model.fit(x, y, batch_size=models.BATCH, epochs=1, verbose=0,
                            callbacks=[callback])
        if not np.isfinite(history.history["loss"]).all():
            raise AssertionError(f"non-finite loss {history.history['loss']}")
        rows = keras_mp.precision_report(model).rows
        trainable = {layer.path for layer in _computing_layers(model) if _own_weights(layer)}
        facts["evidence"] = {
            "rows": len(rows),
            "forward": sum(r["measured"]["forward"] for r in rows),
            "gradients": sum(r["measured"]["gradients"] for r in rows),
            "probe": sum(r["measured"]["probe"] for r in rows),
            "with_weights": sum(r["layer"] in trainable for r in rows),
            "not_observed": [r["layer"] for r in rows if not r["measured"]["forward"]],
            "switches": [f"{e['layer']}: {e['old']}->{e['new']} ({e['reason']})"
                         for e in callback.events]}
    if models.MODELS[name] == "hub":
        steps("evidence", evidence)

    def quantized(how):
        before = predict(model, xs)   # trained on since `pred`
        how(model)
        out = predict(model, xs)
        facts["quantized_error"] = close(out, before, QUANTIZED_TOL, "int8 outputs")
        model.save(os.path.join(folder, "quantized.keras"))
        np.save(os.path.join(folder, "pred_quantized.npy"), out)
    if policy == "adaptive_float16":
        steps("model_quantize_refused", _same_refusal, model)
        steps("model_quantize", quantized, lambda m: keras_mp.quantize(m, "int8"))
    else:
        steps("model_quantize", quantized, lambda m: m.quantize("int8"))
    facts_out(folder, facts)
    steps.save()


def facts_out(folder: str, facts: dict) -> None:
    with open(os.path.join(folder, "facts.json"), "w") as f:
        json.dump(facts, f, indent=1)


def _serve(folder: str, xs, pred, tol: float, errors: dict):
    """Serves ``folder``'s SavedModel with TensorFlow alone; returns it (its
    variables live as long as it does)."""
    import tensorflow as tf

    served = tf.saved_model.load(os.path.join(folder, "sm_keras"))
    out = served.serve(tf.nest.map_structure(tf.constant, xs))
    errors["serve_saved_model"] = close(out, pred, tol)
    return served


def check(folder: str) -> None:
    import keras
    import tensorflow as tf

    import keras_mp
    from keras_mp import cli

    os.environ["KERAS_MP_EXECUTION"] = "graph"
    steps = Steps(os.path.join(folder, "check.json"))
    if not os.path.exists(os.path.join(folder, "pred.npy")):
        steps.save()   # nothing was trained: the train phase says why
        return
    with open(os.path.join(folder, "facts.json")) as f:
        facts = json.load(f)
    name, policy = facts["model"], facts["policy"]
    tol = _tol(policy)
    x, y = models.data(name)
    xs = _load_x(folder)
    pred = np.load(os.path.join(folder, "pred.npy"))
    errors = {}
    keep = []   # a loaded SavedModel's variables live as long as it does

    loaded = steps("load_keras", keras.saving.load_model, os.path.join(folder, "model.keras"))
    if loaded is not None:
        steps("load_keras_predict", lambda: errors.__setitem__(
            "load_keras", close(predict(loaded, xs), pred, tol)))
    if not facts.get("full", True):   # the short run: loaded, same predictions
        if os.path.isdir(os.path.join(folder, "sm_keras")):
            steps("serve_saved_model", _serve, folder, xs, pred, tol, errors)
        steps.save()
        return

    if os.path.isdir(os.path.join(folder, "sm_keras")):
        keep.append(steps("serve_saved_model", _serve, folder, xs, pred, tol, errors))

    def onnx():
        import onnxruntime as ort

        session = ort.InferenceSession(os.path.join(folder, "model.onnx"),
                                       providers=["CPUExecutionProvider"])
        feeds = xs if isinstance(xs, dict) else {session.get_inputs()[0].name: xs}
        out = session.run(None, {i.name: feeds[i.name] for i in session.get_inputs()})[0]
        errors["onnx"] = close(out, pred, tol)
    if os.path.exists(os.path.join(folder, "model.onnx")):
        steps("onnx_run", onnx)

    def litert():
        path = os.path.join(folder, "cli.tflite")
        rc = cli.main(["export", os.path.join(folder, "model.keras"), path, "--format", "litert"])
        if rc != 0:
            raise AssertionError(f"keras-mp export --format litert returned {rc}")
        it = tf.lite.Interpreter(model_path=path)
        runner = it.get_signature_runner()
        keys = it.get_signature_list()["serving_default"]["inputs"]
        feeds = xs if isinstance(xs, dict) else {keys[0]: xs}
        out = list(runner(**{k: feeds[k] for k in keys}).values())[0]
        errors["litert"] = close(out, pred, tol)
    if loaded is not None:
        steps("cli_litert", litert)

    def quantized():
        q = keras.saving.load_model(os.path.join(folder, "quantized.keras"))
        close(predict(q, xs), np.load(os.path.join(folder, "pred_quantized.npy")), tol)
    if os.path.exists(os.path.join(folder, "quantized.keras")):
        steps("load_quantized", quantized)

    def resume():
        if not loaded.compiled:   # a KerasHub task's own compile() is not saved
            facts["recompiled"] = True
            models.compile_model(loaded, name)
        restored, epochs = {}, []

        class Seen(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                epochs.append(epoch)
                restored["iterations"] = int(self.model.optimizer.iterations.numpy())
                restored["digest"] = _digest(self.model)

        history = loaded.fit(x, y, batch_size=models.BATCH, epochs=2,
                             steps_per_epoch=BACKUP_STEPS, verbose=0, callbacks=[
                                 keras.callbacks.BackupAndRestore(os.path.join(folder, "backup")),
                                 Seen()])
        backed_up = facts["backup"]
        if epochs != [1]:
            raise AssertionError(f"resumed at epochs {epochs}, not [1]")
        if restored["iterations"] != backed_up["iterations"]:
            raise AssertionError(f"resumed at iteration {restored['iterations']}, the backup "
                                 f"holds {backed_up['iterations']}")
        np.testing.assert_allclose(restored["digest"], backed_up["digest"], rtol=1e-6)
        if not np.isfinite(history.history["loss"]).all():
            raise AssertionError(f"non-finite loss {history.history['loss']}")
        after = predict(loaded, xs)
        keras_mp.quantize(loaded, "int8")
        close(predict(loaded, xs), after, QUANTIZED_TOL, "keras_mp.quantize outputs")
    if loaded is not None and "backup" in facts:
        steps("resume_fit_quantize", resume)
    with open(os.path.join(folder, "errors.json"), "w") as f:
        json.dump(errors, f)
    steps.save()


if __name__ == "__main__":
    phase, root = sys.argv[1], sys.argv[2]
    if phase == "train":
        for spec in sys.argv[4:]:   # POLICY[:MODE[:short|export]]
            policy, mode, length = (spec.split(":") + ["graph", "full"])[:3]
            train(sys.argv[3], policy, mode, os.path.join(root, policy), length)
    elif phase == "check":
        for policy in sorted(os.listdir(root)):
            if os.path.exists(os.path.join(root, policy, "facts.json")):
                check(os.path.join(root, policy))
    else:
        raise SystemExit(f"unknown phase {phase!r}")
