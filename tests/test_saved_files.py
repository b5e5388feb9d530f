"""``.keras`` files saved by earlier keras-mp code still load: the registered
names (``keras_mp>...``) are what Keras resolves, whatever module a class
lives in now. ``tests/data/make_saved.py`` wrote the files in
``tests/data/saved_0_1_0/`` before the package was split into subpackages, and
those in ``tests/data/saved_62d6112/`` before ``keras_mp/adaptive/`` was split by
concept (their configs name the old modules, ``keras_mp.adaptive.policy`` among
them, now a package).
"""

import pathlib

import keras
import numpy as np
import pytest

import keras_mp

DATA = pathlib.Path(__file__).parent / "data"
NAMES = ["adaptive_float16", "fused_bfloat16", "adaptive_float8"]
FILES = [("saved_0_1_0", name) for name in NAMES] + \
    [("saved_62d6112", name) for name in NAMES + ["adaptive_no_gain"]]


def _expected(folder: str) -> dict:
    with np.load(DATA / folder / "expected.npz") as f:
        return dict(f)


@pytest.mark.parametrize("folder, name", FILES)
def test_file_saved_before_the_layout_loads_predicts_and_trains(folder, name):
    expected = _expected(folder)
    model = keras.saving.load_model(DATA / folder / f"{name}.keras")
    x = expected[f"{name}/x"]
    # Within two units in the last place of the output's 16-bit dtype: which
    # kernels compute it (XLA or TensorFlow) is measured per process. float8
    # layers quantize their inputs to 3 mantissa bits: another CPU's float32
    # summation order (AVX2 against AVX-512) flips a rounding there (seen:
    # 0.1177 against 0.1348 on an AVX2-only EPYC), so two float8 units.
    y = expected[f"{name}/y"]
    mantissa_bits = 3 if name == "adaptive_float8" else 7
    np.testing.assert_allclose(np.asarray(model.predict(x, verbose=0), "float32"), y,
                               rtol=0, atol=2 * 2.0 ** -mantissa_bits * np.abs(y).max())
    assert [f"{layer.name}:{layer.compute_dtype}" for layer in model.layers
         if not isinstance(layer, keras.layers.InputLayer)] == \
        list(expected[f"{name}/dtypes"])
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == \
        int(expected[f"{name}/iterations"])
    if not np.isnan(expected[f"{name}/loss_scale"]):
        assert isinstance(model.optimizer, keras_mp.LossScaleOptimizer)
        assert float(keras.ops.convert_to_numpy(model.optimizer.loss_scale)) == \
            float(expected[f"{name}/loss_scale"])
    policy = keras_mp.policies.policy_of(model)
    if name.startswith("adaptive"):
        assert isinstance(policy, keras_mp.AdaptivePolicy)
    if name == "adaptive_float8":
        assert all(policy.is_float8(layer.path) for layer in model.layers)
    if name == "adaptive_no_gain":  # the fit too small to gain, recorded in the policy
        assert {row["history"][-1]["reason"] for row in keras_mp.precision_report(model).rows} \
            == {"no_gain"}
    if name == "fused_bfloat16":
        assert {type(layer).__name__ for layer in model.layers} >= {
            "Dense", "LayerNormalization", "MultiHeadAttention", "RMSNormalization", "Softmax"}
        assert all(type(layer).__module__.startswith("keras_mp") for layer in model.layers
                   if type(layer).__name__ in ("LayerNormalization", "MultiHeadAttention"))
    # it trains on: the loaded optimizer takes further steps
    y = np.asarray(model.predict(x, verbose=0), "float32")
    target = np.argmax(y, -1) if name == "fused_bfloat16" else (y > 0).astype("float32")
    model.fit(x, target, batch_size=4, epochs=1, verbose=0)
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) > \
        int(expected[f"{name}/iterations"])
