"""keras_mp.deploy.export's ONNX format and `keras-mp export --format onnx`: every
kind of keras-mp model converts, and the file runs in onnxruntime in a fresh
process (no TensorFlow, no Keras, no keras_mp there) with float32 inputs and
outputs, within the compute dtype's rounding of the Keras model."""

import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mp
from keras_mp import cli
from keras_mp.adaptive.evidence import float8
from keras_mp.deploy.export import export, serving_copy

onnx = pytest.importorskip("onnx")   # the `onnx` extra, part of `test`
pytest.importorskip("onnxruntime")
pytest.importorskip("tf2onnx")

_RNG = np.random.default_rng(0)
_X = _RNG.normal(size=(8, 6)).astype("float32")
_TOKENS = _RNG.integers(0, 20, size=(4, 5)).astype("int32")
_X256 = _RNG.normal(size=(8, 256)).astype("float32")

# Runs every .onnx file of a folder on its saved inputs with onnxruntime only.
_RUN = textwrap.dedent("""
    import os, sys, numpy as np, onnxruntime as ort
    assert "tensorflow" not in sys.modules and "keras" not in sys.modules
    folder = sys.argv[1]
    out = {}
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".onnx"):
            continue
        stem = name[:-len(".onnx")]
        x = np.load(os.path.join(folder, stem + ".x.npy"))
        session = ort.InferenceSession(os.path.join(folder, name),
                                       providers=["CPUExecutionProvider"])
        (inp,), outputs = session.get_inputs(), session.get_outputs()
        assert [o.name for o in outputs] == ["output_0"], [o.name for o in outputs]
        out[stem] = session.run(None, {inp.name: x})[0]
        out[stem + ".input_type"] = np.array(inp.type)
    np.savez(os.path.join(folder, "outputs.npz"), **out)
""")


def _run_in_fresh_process(folder):
    done = subprocess.run([sys.executable, "-c", _RUN, str(folder)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(np.load(os.path.join(folder, "outputs.npz")))


def _mlp(policy, units=32, features=6):
    keras_mp.set_global_policy(policy)
    try:
        inputs = keras.Input((features,))
        x = keras.layers.Dense(units, activation="relu")(inputs)
        x = keras.layers.LayerNormalization()(x)
        return keras.Model(inputs, keras.layers.Dense(3)(x))
    finally:
        keras_mp.set_global_policy("float32")


def _transformer(policy):
    """Token ids -> Embedding -> Dense(gelu) -> LayerNormalization ->
    MultiHeadAttention -> Dense: exact GELU, TensorFlow's Erfc."""
    keras_mp.set_global_policy(policy)
    try:
        tokens = keras.Input((5,), dtype="int32")
        x = keras.layers.Embedding(20, 16)(tokens)
        x = keras.layers.Dense(32, activation="gelu")(x)
        x = keras.layers.Dense(16)(x)
        x = keras.layers.LayerNormalization()(x)
        x = x + keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)(x, x)
        return keras.Model(tokens, keras.layers.Dense(3)(x))
    finally:
        keras_mp.set_global_policy("float32")


def _float8_mlp():
    policy = keras_mp.AdaptivePolicy(candidates=("float8", "bfloat16", "float32"))
    model = _mlp(policy)
    assert float8.prepare(model)
    return model


def _guided_int8():
    model = _mlp("adaptive_bfloat16")
    first = model.layers[1]
    # What AdaptivePrecision records when it promotes a layer (docs/concepts/deployment.md).
    keras_mp.policies.policy_of(model).record(first.path)["history"] = [
        {"step": 20, "old": "bfloat16", "new": "float32", "reason": "nonfinite"}]
    plan = keras_mp.quantize(model, "int8")
    assert sorted(plan.values()) == ["promoted", "quantize"], plan
    return model


def _int4():
    model = _mlp("adaptive_bfloat16", features=256)   # four int4 blocks of 64 rows
    model.quantize("int4", config=keras.quantizers.Int4QuantizationConfig(block_size=64))
    assert model.layers[1].dtype_policy.name == "int4/64_from_mixed_bfloat16"
    return model


def _per_layer_mixed():
    """First Dense pinned to float32 (as adaptive training promotes a layer
    that overflows float16), the rest bfloat16; inputs hold 70000, beyond
    float16's 65504."""
    keras_mp.set_global_policy("adaptive_bfloat16")
    try:
        inputs = keras.Input((6,))
        x = keras.layers.Dense(16, activation="relu", name="first",
                               kernel_initializer=keras.initializers.RandomNormal(stddev=1e-3)
                               )(inputs)
        x = keras.layers.Dense(8, activation="relu")(x)
        model = keras.Model(inputs, keras.layers.Dense(3)(x))
    finally:
        keras_mp.set_global_policy("float32")
    keras_mp.policies.policy_of(model).assign(model.get_layer("first").path, "float32")
    return model


_BIG = _X.copy()
_BIG[:, 0] = 7e4

# name -> (model factory, inputs, compute dtype, tolerance against model.predict,
# relative to the output's largest magnitude)
CASES = {
    "float32": (lambda: _mlp("float32"), _X, "float32", 1e-5),
    "float32_f16": (lambda: _mlp("float32"), _X, "float16", 1e-2),
    "keras_mixed_bfloat16": (lambda: _mlp("mixed_bfloat16"), _X, "float32", 3e-2),
    "adaptive_bfloat16": (lambda: _mlp("adaptive_bfloat16"), _X, "float32", 3e-2),
    "adaptive_bfloat16_f16": (lambda: _mlp("adaptive_bfloat16"), _X, "float16", 3e-2),
    "adaptive_float16_f16": (lambda: _mlp("adaptive_float16"), _X, "float16", 1e-2),
    "per_layer_mixed_f16": (_per_layer_mixed, _BIG, "float16", 3e-2),
    "transformer_gelu": (lambda: _transformer("float32"), _TOKENS, "float32", 1e-5),
    "transformer_gelu_bf16_f16": (lambda: _transformer("adaptive_bfloat16"), _TOKENS,
                                  "float16", 3e-2),
    "fused_transformer": (lambda: keras_mp.fuse(_transformer("adaptive_bfloat16")), _TOKENS,
                          "float32", 3e-2),
    "guided_int8": (_guided_int8, _X, "float32", 5e-2),
    "guided_int8_f16": (_guided_int8, _X, "float16", 5e-2),
    "keras_int4": (_int4, _X256, "float32", 3e-2),
    "float8_candidate": (_float8_mlp, _X, "float32", 1e-1),
}


def test_every_kind_of_model_runs_in_onnxruntime_in_a_fresh_process(tmp_path):
    expected, reference = {}, {}
    for name, (make, x, compute, _) in CASES.items():
        keras.utils.set_random_seed(0)
        model = make()
        export(model, tmp_path / f"{name}.onnx", "onnx", compute_dtype=compute)
        np.save(tmp_path / f"{name}.x.npy", x)
        expected[name] = model.predict(x, verbose=0).astype("float32")
        # What the file computes: the model in its serving dtypes, in Keras.
        reference[name] = np.asarray(serving_copy(model, compute)(x)).astype("float32")
        if name == "guided_int8":   # the int8 kernels stay int8 in the file
            graph = onnx.load(str(tmp_path / f"{name}.onnx")).graph
            assert [n.op_type for n in graph.node].count("MatMulInteger") == 1
            assert any(t.data_type == onnx.TensorProto.INT8 for t in graph.initializer)
        if name == "fused_transformer":
            assert any(type(layer).__module__ == "keras_mp.fused.layers" for layer in model.layers)
    got = _run_in_fresh_process(tmp_path)
    for name, (_, x, compute, tol) in CASES.items():
        out = got[name]
        assert out.dtype == np.float32, name
        assert str(got[name + ".input_type"]) == (
            "tensor(int32)" if x.dtype == np.int32 else "tensor(float)"), name
        assert np.isfinite(out).all(), name
        scale = np.abs(expected[name]).max()
        err = np.abs(out - expected[name]).max() / scale
        assert err < tol, (name, err)
        # and the serving copy's own computation, to its dtype's rounding
        err_ref = np.abs(out - reference[name]).max() / scale
        print(f"{name}: {err:.1e} from model.predict, {err_ref:.1e} from the serving copy")
        assert err_ref < (1e-5 if compute == "float32" else 1e-2), (name, err_ref)


def test_float16_keeps_the_float32_layers_of_a_mixed_model():
    model = _per_layer_mixed()
    copy = serving_copy(model, "float16")
    assert [layer.compute_dtype for layer in copy.layers[1:]] == [
        "float32", "float16", "float16"]
    # Everything in float16 overflows on these inputs: what the kept layer avoids.
    assert not np.isfinite(np.asarray(serving_copy(_mlp("float32"), "float16")(_BIG))).all()
    assert np.isfinite(np.asarray(copy(_BIG))).all()
    # An all-float32 model computes in float16 throughout.
    assert {layer.compute_dtype for layer in serving_copy(_mlp("float32"), "float16").layers[1:]
            } == {"float16"}


def test_output_dtype_compute_and_opset(tmp_path):
    import onnxruntime as ort

    model = _mlp("adaptive_bfloat16")
    export(model, tmp_path / "own.onnx", "onnx", compute_dtype="float16", output_dtype="compute",
           opset=17)
    proto = onnx.load(str(tmp_path / "own.onnx"))
    assert [o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")] == [17]
    session = ort.InferenceSession(str(tmp_path / "own.onnx"))
    out = session.run(None, {session.get_inputs()[0].name: _X})[0]
    assert out.dtype == np.float16


def test_cli_exports_a_keras_file_to_onnx(tmp_path, capsys):
    model = _transformer("adaptive_bfloat16")
    model.save(tmp_path / "m.keras")
    out = tmp_path / "m.onnx"
    assert cli.main(["export", str(tmp_path / "m.keras"), str(out), "--format", "onnx",
                     "--compute-dtype", "float16"]) == 0
    assert "float16 compute" in capsys.readouterr().out
    assert out.stat().st_size > 0
    assert cli.main(["export", str(tmp_path / "m.keras"), str(out), "--format", "onnx",
                     "--opset", "12"]) == 2
    assert "`opset`" in capsys.readouterr().err
    assert cli.main(["export", str(tmp_path / "m.keras"), str(tmp_path / "sm"),
                     "--compute-dtype", "float16"]) == 2
    assert "--format onnx only" in capsys.readouterr().err


class _LogGamma(keras.layers.Layer):
    """A layer whose TensorFlow op (Lgamma) tf2onnx 1.17 cannot convert."""

    def call(self, x):
        return tf.math.lgamma(tf.abs(x) + 1.0)


def test_an_unconvertible_op_is_a_clear_error_and_leaves_no_file(tmp_path):
    inputs = keras.Input((6,))
    model = keras.Model(inputs, _LogGamma()(keras.layers.Dense(4)(inputs)))
    path = tmp_path / "bad.onnx"
    with pytest.raises(ValueError, match=r"cannot express.*Lgamma"):
        export(model, path, "onnx")
    assert not path.exists()


def test_missing_converter_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tf2onnx", None)   # import fails
    with pytest.raises(ImportError, match=r'pip install "keras-mp\[onnx\]"'):
        export(_mlp("float32"), tmp_path / "m.onnx", "onnx")


@pytest.mark.parametrize("kwargs,error,match", [
    ({"compute_dtype": "bfloat16"}, ValueError, r"`compute_dtype` must be one of \('float32', "
                                                r"'float16'\)"),
    ({"compute_dtype": "float16", "format": "tf_saved_model"}, ValueError,
     "`compute_dtype`='float16' applies to format='onnx' only"),
    ({"opset": 12}, ValueError, "`opset` must be None"),
    ({"opset": 19}, ValueError, "`opset` must be None"),
    ({"opset": True}, ValueError, "`opset` must be None"),
    ({"opset": 15, "format": "litert"}, ValueError, "`opset`=15 applies to format='onnx'"),
    ({"weights": "int8"}, ValueError, "format='litert' only"),
    ({"output_dtype": "float16"}, ValueError, "`output_dtype`"),
    ({"format": "torch"}, ValueError, "`format` must be one of"),
])
def test_bad_arguments(tmp_path, kwargs, error, match):
    kwargs = {"format": "onnx", **kwargs}
    with pytest.raises(error, match=match):
        export(_mlp("float32"), tmp_path / "m.onnx", **kwargs)
    assert not (tmp_path / "m.onnx").exists()


def test_serving_copy_bad_arguments():
    with pytest.raises(ValueError, match="`compute_dtype` must be one of"):
        serving_copy(_mlp("float32"), "bfloat16")
    with pytest.raises(TypeError, match="`model`"):
        serving_copy("model.keras")
    subclassed = _Subclassed()
    subclassed(_X)
    with pytest.raises(TypeError, match="functional or Sequential"):
        serving_copy(subclassed)


class _Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        return self.dense(x)

    def build(self, input_shape):
        self.dense.build(input_shape)
        self.built = True


def _tied_lm(policy):
    """Shaped like a KerasHub GPT2CausalLM (tests/fused/test_fuse.py)."""
    from tests.fused.test_fuse import _tied

    return _tied(policy)


def test_a_dict_input_model_with_a_shared_layer_exports_to_onnx_and_saved_model(tmp_path):
    import onnxruntime as ort

    from tests.fused.test_fuse import _tokens

    model = _tied_lm("adaptive_bfloat16")
    x = _tokens()
    want = np.asarray(serving_copy(model)(x))   # float32 computation, the same weights
    np.testing.assert_allclose(want, np.asarray(model(x), "float32"), rtol=5e-2, atol=5e-2)
    export(model, tmp_path / "lm.onnx", "onnx")
    session = ort.InferenceSession(str(tmp_path / "lm.onnx"))
    # One ONNX input per key of the model's dict input, integer as declared.
    assert [(i.name, i.type) for i in session.get_inputs()] == [
        ("token_ids", "tensor(int32)"), ("padding_mask", "tensor(int32)")]
    np.testing.assert_allclose(session.run(None, x)[0], want, rtol=1e-5, atol=1e-5)
    # The SavedModel takes the dict, integers kept, as Keras's own export does.
    export(model, tmp_path / "lm")
    served = tf.saved_model.load(str(tmp_path / "lm"))   # held: it owns the variables
    np.testing.assert_allclose(served.serve(x).numpy(), np.asarray(model(x), "float32"),
                               rtol=1e-6, atol=1e-6)


def test_an_adapted_normalization_is_served_with_its_own_mean_and_variance(tmp_path):
    import onnxruntime as ort

    keras_mp.set_global_policy("adaptive_bfloat16")
    try:
        inputs = keras.Input((6,))
        norm = keras.layers.Normalization()   # as EfficientNet and MobileNetV3 hold one
        model = keras.Model(inputs, keras.layers.Dense(3)(norm(inputs)))
    finally:
        keras_mp.set_global_policy("float32")
    norm.adapt(_RNG.normal(50.0, 20.0, size=(64, 6)).astype("float32"))
    x = _RNG.normal(50.0, 20.0, size=(8, 6)).astype("float32")
    # The copy computed with the mean and variance of a fresh layer (0 and 1)
    # before: what it made of them when built, not the copied variables.
    copy = serving_copy(model)
    np.testing.assert_allclose(np.asarray(copy(x)), np.asarray(model(x), "float32"),
                               rtol=3e-2, atol=3e-2)
    # tf2onnx made the mean a model input ('.../normalization/Sub/y:0') before.
    export(model, tmp_path / "norm.onnx", "onnx")
    session = ort.InferenceSession(str(tmp_path / "norm.onnx"))
    assert len(session.get_inputs()) == 1
    np.testing.assert_allclose(session.run(None, {session.get_inputs()[0].name: x})[0],
                               np.asarray(copy(x)), rtol=1e-5, atol=1e-5)
