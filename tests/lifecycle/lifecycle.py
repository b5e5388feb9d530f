"""keras-mp models through Keras's lifecycle, in one execution mode.

Run by tests/test_lifecycle_modes.py with ``KERAS_MP_EXECUTION`` set to the
mode under test, in processes of that mode's own (TensorFlow never frees an
XLA:CPU executable, and a mode's state must not leak into another's):

``python lifecycle.py train DIR POLICY...``
    for each policy (``adaptive_bfloat16``, ..., and :data:`NO_GAIN`), in ``DIR/POLICY``: fits a
    3-layer Dense model with plain ``compile``/``fit`` (keras-mp adds its
    callback; enough train-function calls for ``auto`` to decide), then
    predict, ``.keras`` save, ``model.export``, ``keras_mp.deploy.export.export``
    (SavedModel, LiteRT and ONNX), ``tf.train.Checkpoint`` write/read,
    ``keras.models.clone_model`` (trained and exported),
    ``keras_mp.quantize`` and ``model.quantize("int8")`` (exported and
    saved; for float16, Keras's refusal unchanged and ``keras_mp.quantize``
    instead), and a ``BackupAndRestore`` run interrupted and resumed.
``python lifecycle.py check DIR``
    a fresh process, for each ``DIR/POLICY``: loads the ``.keras`` files
    (same predictions), serves every SavedModel with TensorFlow alone (same
    outputs; the model's variables and nothing else), runs the LiteRT file
    and the ONNX file (onnxruntime: what the float32 copy computes, and the
    model's predictions within its dtype's rounding, :data:`ONNX_TOL`),
    runs ``keras-mp export`` (both formats) on the ``.keras`` file, fits the
    loaded model again, then saves, exports and serves it again.

Every step runs on its own: ``DIR/POLICY/<phase>.json`` holds ``results``
(step -> ``"ok"`` or the error, with the innermost frames and keras-mp's)
and ``seconds``, so one failing step does not hide the others.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

ROWS, BATCH, FEATURES = 128, 8, 8   # 16 train-function calls per epoch
EPOCHS = 2   # 32 calls: auto's trial of 3 modes decides after 18
POLICIES = ("adaptive_bfloat16", "adaptive_float16", "adaptive_float8")
#: What a user gets for this model with the defaults: ``"adaptive_float16"``, and
#: a fit too small to gain from 16 bits trains in float32 (keras_mp.adaptive.decisions.gain).
#: The policies above adapt every fit (``autofit.set_min_saving(0)``), as a
#: fit large enough to gain does.
NO_GAIN = "no_gain"


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, FEATURES)).astype("float32")
    y = np.tanh(x @ rng.normal(size=(FEATURES, 1))).astype("float32")
    return x, y


def build(policy: str):
    import keras

    import keras_mp
    from keras_mp.adaptive.fit import autofit
    from keras_mp.adaptive.decisions import gain

    autofit.set_min_saving(gain.START_UP_S if policy == NO_GAIN else 0)
    keras_mp.set_global_policy("adaptive_float16" if policy == NO_GAIN else policy)
    try:
        model = keras.Sequential([keras.Input((FEATURES,)),
                                  keras.layers.Dense(32, activation="relu"),
                                  keras.layers.Dense(32, activation="relu"),
                                  keras.layers.Dense(1)])
    finally:
        keras_mp.set_global_policy("float32")
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    return model


class Steps:
    """Runs named steps, recording "ok" or the error of each, and its time."""

    def __init__(self, out: str):
        self.out, self.results, self.seconds = out, {}, {}

    def __call__(self, name, fn, *args):
        start = time.perf_counter()
        try:
            value = fn(*args)
        except Exception as e:  # noqa: BLE001 - recorded, the next steps still run
            frames = traceback.extract_tb(e.__traceback__)
            where = [f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in frames[-6:]]
            ours = [f"{f.filename.split('keras_mp/')[-1]}:{f.lineno} {f.name}"
                    for f in frames if "/keras_mp/" in f.filename]
            self.results[name] = {"error": f"{type(e).__name__}: {str(e)[:400]}",
                                  "where": where, "keras_mp": ours[-3:]}
            print(f"[{name}] FAILED {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
            return None
        finally:
            self.seconds[name] = round(time.perf_counter() - start, 2)
        self.results[name] = "ok"
        return value

    def save(self):
        with open(self.out, "w") as f:
            json.dump({"results": self.results, "seconds": self.seconds}, f, indent=1)


def predict(model, x):
    """``model``'s outputs on ``x`` computed as a TensorFlow graph, as a
    SavedModel or a fresh process computes them (``model.predict`` runs as
    ``compile`` set ``jit_compile``, whatever the train step's mode:
    keras_mp.execution.inference)."""
    import tensorflow as tf

    fn = tf.function(lambda t: model(t, training=False), autograph=False)
    return np.asarray(fn(tf.constant(x)), "float32")


TOL = 1e-6   # the same computation, elsewhere
#: A quantized model against Keras's int8 quantization of the same weights
#: in the same compute dtype (largest |a - b| over the largest |output|).
QUANTIZE_TOL = 1e-5
#: The ONNX file (float32) against the model's predictions (largest |a - b|
#: over the largest |output|): the narrow dtype's rounding. Not for float8,
#: whose rounding reached 23 % of the largest output: its ONNX file is held
#: to the float32 copy's outputs only.
ONNX_TOL = {"adaptive_bfloat16": 5e-2, "adaptive_float16": 1e-2}
#: ``model.predict`` (batches of 32) against the same model as one
#: TensorFlow graph call (largest |a - b| over the largest |output|). Until
#: issue 49 ``model.predict`` ran under XLA after ``mode="xla"``, which
#: rounds a layer's bfloat16 arithmetic differently (XLA keeps float32
#: between fused operations): given the same inputs, each float8 layer's
#: outputs differed by up to 0.7 % (AVX512-BF16 EPYC). The next layer
#: quantizes its inputs to E4M3, whose steps are 12.5 % apart, so an input
#: near a rounding boundary moves a whole step: over the 3 layers, 6 seeds
#: gave 0.9-7 % there, and a CI run 12.5 %.
PREDICT_TOL = {"adaptive_float8": 0.25}


def _close(a, b, scale_tol=TOL):
    a, b = np.asarray(a, "float32"), np.asarray(b, "float32")
    scale = max(float(np.abs(b).max()), 1e-3)
    err = float(np.abs(a - b).max())
    if not np.all(np.isfinite(a)) or err > scale_tol * scale:
        raise AssertionError(f"outputs differ: max |a - b| = {err:.3g}, scale {scale:.3g}")


def _same_refusal(model) -> None:
    """``model.quantize("int8")`` fails as it fails for a plain Keras
    ``mixed_float16`` model (Keras refuses int8 on float16 computation)."""
    import keras

    def message(m):
        try:
            m.quantize("int8")
        except ValueError as e:
            return str(e)
        return None

    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        plain = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(2)])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    want, got = message(plain), message(model)
    if want is None or got != want:
        raise AssertionError(f"model.quantize('int8') answered {got!r}, plain Keras {want!r}")


def train(policy: str, folder: str) -> None:
    import keras
    import tensorflow as tf

    import keras_mp
    from keras_mp.deploy import export as mp_export

    os.makedirs(folder, exist_ok=True)
    steps = Steps(os.path.join(folder, "train.json"))
    x, y = data()
    xs = x[:16]
    model = build(policy)

    def fit():
        hist = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0)
        if not np.all(np.isfinite(hist.history["loss"])):
            raise AssertionError(f"non-finite loss {hist.history['loss']}")
        return keras_mp.execution.chosen(model)

    chosen = steps("fit", fit)
    info = {"policy": policy, "mode": os.environ.get("KERAS_MP_EXECUTION"), "chosen": chosen,
            "optimizer": type(model.optimizer).__name__,
            "inner": type(getattr(model.optimizer, "inner_optimizer", model.optimizer)).__name__,
            "scale": repr(getattr(model.optimizer, "schedule", None)),
            "dtypes": sorted({layer.compute_dtype for layer in model.layers}),
            "weights": sorted(v.path for v in model.weights)}
    with open(os.path.join(folder, "info.json"), "w") as f:
        json.dump(info, f)
    def predicts():
        out = np.asarray(model.predict(xs, verbose=0), "float32")   # Keras's own, any mode
        _close(out, predict(model, xs), PREDICT_TOL.get(policy, 0.1))
        return predict(model, xs)
    pred = steps("predict", predicts)
    if pred is None:
        steps.save()
        return
    np.save(os.path.join(folder, "x.npy"), xs)
    np.save(os.path.join(folder, "pred.npy"), pred)
    steps("save_keras", model.save, os.path.join(folder, "model.keras"))
    steps("model_export", lambda: model.export(os.path.join(folder, "sm_keras"), verbose=False))
    steps("mp_export_saved_model", mp_export.export, model, os.path.join(folder, "sm_mp"))
    steps("mp_export_litert", lambda: mp_export.export(
        model, os.path.join(folder, "model.tflite"), "litert"))
    steps("float32_copy", lambda: np.save(os.path.join(folder, "pred32.npy"), np.asarray(
        mp_export.float32_copy(model)(xs), "float32")))
    steps("mp_export_onnx", mp_export.export, model, os.path.join(folder, "model.onnx"), "onnx")

    def checkpoint():
        ckpt = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
        path = ckpt.write(os.path.join(folder, "ckpt", "c"))
        before = [np.array(v) for v in model.optimizer.variables]
        model.fit(x[:32], y[:32], batch_size=BATCH, epochs=1, verbose=0)
        ckpt.read(path).assert_existing_objects_matched()
        _close(predict(model, xs), pred, 0.0)
        for v, b in zip(model.optimizer.variables, before, strict=True):
            np.testing.assert_array_equal(np.array(v), b)
    steps("tf_checkpoint", checkpoint)

    def clone():
        copy = keras.models.clone_model(model)
        # By name: a float8 layer's clone creates its variables in another
        # order (Keras's quantized build; plain Keras float8 models too).
        model.save_weights(os.path.join(folder, "clone.weights.h5"))
        copy.load_weights(os.path.join(folder, "clone.weights.h5"))
        _close(predict(copy, xs), pred)
        copy.compile(optimizer="adam", loss="mse")
        copy.fit(x[:32], y[:32], batch_size=BATCH, epochs=1, verbose=0)
        copy.export(os.path.join(folder, "sm_clone"), verbose=False)
    steps("clone_model", clone)

    def quantized(name, how, planned=True):
        # mp_quantize: keras_mp.quantize on a copy loaded from the .keras
        # file; model_quantize: the trained model itself, last (Keras's
        # model.quantize; keras_mp.quantize for float16, which Keras refuses).
        q = model if name == "model_quantize" else keras.saving.load_model(
            os.path.join(folder, "model.keras"))
        # Against what Keras's int8 quantization makes of the same weights
        # (the trained model's own outputs carry float8's rounding, up to
        # 23 % of the largest output here, on top of int8's 4 %), layer by
        # layer as the model left them: what keras_mp.quantize quantizes
        # (its plan: a layer adaptive training promoted, or the probe found
        # sensitive, stays in float: an all-int8 reference then differs by
        # about 1.7 %, as a CI run once did) or all of them (Keras's
        # model.quantize); computed in
        # bfloat16 for a bfloat16 or float8 layer (Keras's
        # int8_from_mixed_bfloat16), in float32 for a float32 layer and a
        # quantized float16 one (Keras refuses int8 on float16).
        plan = keras_mp.deploy.quantization.plan(q) if planned else {}
        reference, chosen_paths = mp_export.float32_copy(model), set()
        for mine, layer in zip(q.layers, reference.layers, strict=True):
            chosen = plan.get(mine.path, "quantize") == "quantize"
            compute = {"bfloat16": "mixed_bfloat16", "float32": "float32",
                       "float16": "float32" if chosen else "mixed_float16"}[mine.compute_dtype]
            layer.dtype_policy = keras.DTypePolicy(compute)
            if chosen:
                chosen_paths.add(layer.path)
        reference.quantize("int8", filters=lambda layer: layer.path in chosen_paths)
        how(q)
        out = predict(q, xs)
        try:
            _close(out, predict(reference, xs), QUANTIZE_TOL)
        except AssertionError as e:
            raise AssertionError(f"{e}; plan {plan}, layers "
                                 f"{[layer.dtype_policy.name for layer in q.layers]}") from None
        q.export(os.path.join(folder, f"sm_{name}"), verbose=False)
        q.save(os.path.join(folder, f"{name}.keras"))
        np.save(os.path.join(folder, f"pred_{name}.npy"), out)

    steps("mp_quantize", quantized, "mp_quantize", lambda q: keras_mp.quantize(q, "int8"))

    def backup_and_restore():
        backup = os.path.join(folder, "backup")
        backed_up, restored, epochs = {}, {}, []

        class Stop(keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                if epoch == 1:   # after BackupAndRestore wrote this epoch's backup
                    backed_up["iterations"] = int(self.model.optimizer.iterations.numpy())
                    backed_up["weights"] = [np.array(w) for w in self.model.get_weights()]
                    raise RuntimeError("interrupted")

        class Seen(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                epochs.append(epoch)
                restored["iterations"] = int(self.model.optimizer.iterations.numpy())
                restored["weights"] = [np.array(w) for w in self.model.get_weights()]

        try:
            build(policy).fit(x[:32], y[:32], batch_size=BATCH, epochs=3, verbose=0,
                              callbacks=[keras.callbacks.BackupAndRestore(backup), Stop()])
        except RuntimeError as e:
            if "interrupted" not in str(e):
                raise
        else:
            raise AssertionError("the interruption did not happen")
        build(policy).fit(x[:32], y[:32], batch_size=BATCH, epochs=3, verbose=0,
                          callbacks=[keras.callbacks.BackupAndRestore(backup), Seen()])
        if epochs != [2]:
            raise AssertionError(f"resumed at epochs {epochs}, not [2]")
        if restored["iterations"] != backed_up["iterations"]:
            raise AssertionError(f"resumed at iteration {restored['iterations']}, the backup "
                                 f"holds {backed_up['iterations']}")
        for got, want in zip(restored["weights"], backed_up["weights"], strict=True):
            np.testing.assert_array_equal(got, want)
    steps("backup_and_restore", backup_and_restore)

    if policy == "adaptive_float16":
        # Keras refuses, and keras-mp must not change its answer;
        # keras_mp.quantize quantizes such layers from float32.
        steps("model_quantize_refused", _same_refusal, model)
        steps("model_quantize", quantized, "model_quantize",
              lambda q: keras_mp.quantize(q, "int8"))
    else:
        steps("model_quantize", quantized, "model_quantize", lambda q: q.quantize("int8"),
              False)
    steps.save()


def check(folder: str) -> None:
    import keras
    import tensorflow as tf

    import keras_mp
    from keras_mp import cli

    steps = Steps(os.path.join(folder, "check.json"))
    if not os.path.exists(os.path.join(folder, "pred.npy")):
        steps.save()   # nothing was trained: the train phase says why
        return
    x, y = data()
    xs = np.load(os.path.join(folder, "x.npy"))
    pred = np.load(os.path.join(folder, "pred.npy"))
    with open(os.path.join(folder, "info.json")) as f:
        info = json.load(f)
    keep = []   # a loaded SavedModel's variables live as long as it does

    def serve(name, want):
        loaded = tf.saved_model.load(os.path.join(folder, name))
        keep.append(loaded)
        if name in ("sm_keras", "sm_mp"):   # the model's weights, nothing else
            held = sorted("/".join(v.name.split(":")[0].split("/")[-2:])
                          for v in loaded.variables)
            weights = sorted("/".join(p.split("/")[-2:]) for p in info["weights"])
            if held != weights:
                raise AssertionError(f"the SavedModel holds {held}, the model {weights}")
        out = loaded.serve(xs).numpy()
        if want is None:   # a model trained on since: finite outputs
            if not np.all(np.isfinite(out)):
                raise AssertionError("non-finite outputs")
        else:
            _close(out, want)

    loaded = steps("load_keras", keras.saving.load_model, os.path.join(folder, "model.keras"))
    if loaded is not None:
        steps("load_keras_predict", lambda: _close(predict(loaded, xs), pred))
    for name, want in [("sm_keras", pred), ("sm_mp", pred), ("sm_clone", None),
                       ("sm_mp_quantize", "pred_mp_quantize.npy"),
                       ("sm_model_quantize", "pred_model_quantize.npy")]:
        if not os.path.isdir(os.path.join(folder, name)):
            continue   # not written: the train phase says why
        if isinstance(want, str):
            want = np.load(os.path.join(folder, want))
        steps(f"serve_{name}", serve, name, want)
    for name in ("mp_quantize", "model_quantize"):
        path = os.path.join(folder, f"{name}.keras")
        if os.path.exists(path):
            want = np.load(os.path.join(folder, f"pred_{name}.npy"))
            steps(f"load_{name}", lambda p=path, w=want: _close(
                predict(keras.saving.load_model(p), xs), w))

    def litert():
        it = tf.lite.Interpreter(model_path=os.path.join(folder, "model.tflite"))
        runner = it.get_signature_runner()
        key = it.get_signature_list()["serving_default"]["inputs"][0]
        out = list(runner(**{key: xs}).values())[0]
        _close(out, np.load(os.path.join(folder, "pred32.npy")), 1e-5)
    if os.path.exists(os.path.join(folder, "model.tflite")) and \
            os.path.exists(os.path.join(folder, "pred32.npy")):
        steps("serve_litert", litert)

    def cli_export():
        for out, fmt in (("cli_sm", "tf_saved_model"), ("cli.tflite", "litert")):
            rc = cli.main(["export", os.path.join(folder, "model.keras"),
                           os.path.join(folder, out), "--format", fmt])
            if rc != 0:
                raise AssertionError(f"keras-mp export --format {fmt} returned {rc}")
        serve("cli_sm", pred)

    def fit_again():
        hist = loaded.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
        if not np.all(np.isfinite(hist.history["loss"])):
            raise AssertionError(f"non-finite loss {hist.history['loss']}")
        now = predict(loaded, xs)
        loaded.save(os.path.join(folder, "again.keras"))
        loaded.export(os.path.join(folder, "sm_again"), verbose=False)
        keras_mp.deploy.export.export(loaded, os.path.join(folder, "sm_mp_again"))
        serve("sm_again", now)
        serve("sm_mp_again", now)
        again = keras.saving.load_model(os.path.join(folder, "again.keras"))
        _close(predict(again, xs), now)

    def onnx():
        import onnxruntime as ort

        session = ort.InferenceSession(os.path.join(folder, "model.onnx"),
                                       providers=["CPUExecutionProvider"])
        out = session.run(None, {session.get_inputs()[0].name: xs})[0]
        _close(out, np.load(os.path.join(folder, "pred32.npy")), 1e-5)   # what it computes
        if info["policy"] in ONNX_TOL:   # the model's own, in its dtypes
            _close(out, pred, ONNX_TOL[info["policy"]])
    if os.path.exists(os.path.join(folder, "model.onnx")) and \
            os.path.exists(os.path.join(folder, "pred32.npy")):
        steps("serve_onnx", onnx)

    if loaded is not None:
        steps("cli_export", cli_export)
        steps("fit_again_save_export", fit_again)
    steps.save()


if __name__ == "__main__":
    phase, root = sys.argv[1], sys.argv[2]
    if phase == "train":
        for policy in sys.argv[3:] or POLICIES:
            train(policy, os.path.join(root, policy))
    elif phase == "check":
        for policy in sorted(os.listdir(root)):
            if os.path.exists(os.path.join(root, policy, "info.json")):
                check(os.path.join(root, policy))
    else:
        raise SystemExit(f"unknown phase {phase!r}")
