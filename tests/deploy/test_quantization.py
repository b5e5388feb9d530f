"""Keras quantization on keras-mp models (keras_mp.deploy.quantization): every Keras
mode on adaptive and fused models, save/load, AdaptivePolicy entries, and
quantization guided by adaptive training."""

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp.deploy import quantization
from keras_mp.policies import AdaptivePolicy, policy_of


def _model(policy="adaptive_bfloat16"):
    keras_mp.set_global_policy(policy)
    inputs = keras.Input((6,))
    x = keras.layers.Dense(16, activation="relu")(inputs)
    x = keras.layers.LayerNormalization()(x)
    outputs = keras.layers.Dense(3)(x)
    model = keras.Model(inputs, outputs)
    keras_mp.set_global_policy("float32")   # as in the issue: back to float32 first
    return model


_X = np.random.default_rng(0).normal(size=(16, 6)).astype("float32")
_Y = np.random.default_rng(1).normal(size=(16, 3)).astype("float32")


@pytest.mark.parametrize("fused", [False, True], ids=["adaptive", "fused"])
@pytest.mark.parametrize("mode", ["int8", "float8", "int4"])
def test_keras_quantize_save_load(tmp_path, mode, fused):
    model = _model()
    policy_of(model).assign(model.layers[-1].path, "float32")   # a promoted layer
    if fused:
        model = keras_mp.fuse(model)
    before = np.asarray(model(_X))
    model.quantize(mode)
    dense = [layer for layer in model.layers if isinstance(layer, keras.layers.Dense)]
    names = [layer.dtype_policy.name for layer in dense]
    assert all(name.startswith(mode) for name in names)   # int4 adds "/block_size"
    assert names[0].endswith("_from_mixed_bfloat16") and names[1].endswith("_from_float32")
    policy = policy_of(model)
    assert policy is not None and policy.policies() and policy.assignments() == {}
    if mode == "float8":
        model.compile(optimizer="sgd", loss="mse")
        history = model.fit(_X, _Y, epochs=2, verbose=0)
        assert np.isfinite(history.history["loss"]).all()
    out = model.predict(_X, verbose=0)
    assert np.isfinite(out).all()
    if mode != "float8":  # float8 training changed the weights above
        assert np.abs(out - before).max() < 0.25 * np.abs(before).max()
    path = tmp_path / "q.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert [layer.dtype_policy.name for layer in loaded.layers
            if isinstance(layer, keras.layers.Dense)] == names
    np.testing.assert_allclose(loaded.predict(_X, verbose=0), out, rtol=1e-5, atol=1e-5)


def test_every_keras_mode_is_known():
    from keras.src.dtype_policies import QUANTIZATION_MODES

    assert quantization.MODES == tuple(QUANTIZATION_MODES)
    with pytest.raises(ValueError, match="`mode` must be one of"):
        quantization.plan(_model(), "int2")
    with pytest.raises(ValueError, match="needs `config`"):
        keras_mp.quantize(_model(), "gptq")


def test_unquantized_layers_stay_adaptive_and_quantized_are_refused():
    model = _model()
    first, last = model.layers[1], model.layers[-1]
    model.quantize("int8", filters=lambda layer: layer is first)
    policy = policy_of(model)
    assert isinstance(last._dtype_policy, AdaptivePolicy)  # still controlled
    assert not isinstance(first._dtype_policy, AdaptivePolicy)
    assert first.quantization_mode == "int8"
    assert policy[first.path].quantization_mode == "int8"
    with pytest.raises(ValueError, match="quantized"):
        policy.assign(first.path, "float32")
    policy.assign(last.path, "float32")
    assert last.compute_dtype == "float32"
    # A layer Keras cannot quantize (LayerNormalization) is left as it was.
    assert isinstance(model.layers[2]._dtype_policy, AdaptivePolicy)


def test_adaptive_policy_keeps_any_entry_through_config_and_save(tmp_path):
    p = AdaptivePolicy(("bfloat16", "float32"), name="adaptive_bfloat16")
    p.assign("model/dense", "float32")
    p.set_policy("model/dense_1", "int8_from_mixed_bfloat16")
    p.set_policy("model/dense_2", "mixed_float16")          # outside the candidates
    p.set_policy("model/dense_3", keras.dtype_policies.get("float8_from_float32"))
    q = AdaptivePolicy.from_config(p.get_config())
    assert q.assignments() == {"model/dense": "float32"}
    assert {k: v.name for k, v in q.policies().items()} == {
        "model/dense_1": "int8_from_mixed_bfloat16", "model/dense_2": "mixed_float16",
        "model/dense_3": "float8_from_float32"}
    assert q["model/dense_1"].quantization_mode == "int8"
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(p))
    assert restored.get_config() == p.get_config()
    with pytest.raises(ValueError, match="`policy` must be a DTypePolicy"):
        p.set_policy("x", "int3_from_nothing")

    # A layer quantized by setting its dtype policy, as in Keras.
    model = _model()
    model.layers[1].dtype_policy = "int8_from_mixed_bfloat16"
    assert model.layers[1].quantization_mode == "int8"
    out = model.predict(_X, verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    np.testing.assert_allclose(loaded.predict(_X, verbose=0), out, rtol=1e-5, atol=1e-5)
    assert policy_of(loaded).policies()[loaded.layers[1].path].name == \
        "int8_from_mixed_bfloat16"


def test_plan_reads_history_strikes_probe_and_keep():
    model = _model()
    keras_mp.set_global_policy("adaptive_bfloat16")
    inputs = keras.Input((6,))
    x = inputs
    for i in range(5):
        x = keras.layers.Dense(4, name=f"d{i}")(x)
    model = keras.Model(inputs, x)
    keras_mp.set_global_policy("float32")
    policy = policy_of(model)
    paths = [layer.path for layer in model.layers[1:]]
    policy.record(paths[0])["history"] = [
        {"step": 1, "old": "bfloat16", "new": "float32", "reason": "overflow"}]
    policy.record(paths[1])["state"] = {"dtype": "bfloat16", "strikes": 1}
    policy.record(paths[2])["probe"] = {"sensitive": True, "cosine": 0.5}
    policy.record(paths[3])["history"] = [   # a demotion is not a promotion
        {"step": 1, "old": "float32", "new": "bfloat16", "reason": "healthy"}]
    decisions = keras_mp.quantize(model, "int8", keep=["d4"])
    assert list(decisions.values()) == ["promoted", "promoted", "sensitive", "quantize", "keep"]
    assert [layer.quantization_mode for layer in model.layers[1:]] == \
        [None, None, None, "int8", None]
    with pytest.raises(TypeError, match="`keep`"):
        quantization.plan(model, keep="d4")


def test_guided_quantization_keeps_what_adaptive_training_promoted(tmp_path):
    """The demonstration (keras_mp.cli.deploy_demo): quantizing everything loses
    >= 2 points, the guided version stays within 0.5 point of the float model."""
    from keras_mp.cli import deploy_demo

    model, callback = deploy_demo.train()
    promoted = [e for e in callback.events if e["new"] == "float32"]
    assert promoted and all(e["layer"].endswith("features") for e in promoted), callback.events
    figures = deploy_demo.compare(model, directory=str(tmp_path))
    print({k: (v["accuracy"], v["bytes"]) for k, v in figures.items()})
    flt, full, guided = (figures[k]["accuracy"] for k in ("float", "full", "guided"))
    assert flt >= 0.6   # 0.913 on the 2-core Xeon
    assert full <= flt - 0.02
    assert abs(guided - flt) <= 0.005
    plan = figures["guided"]["plan"]
    assert plan["features"] == "promoted" and plan["logit"] == "quantize", plan
    sizes = [figures[k]["bytes"] for k in ("float", "guided", "full")]
    assert sizes == sorted(sizes, reverse=True), sizes
    # The guided artifact reloads as a plain Keras model with the same outputs.
    loaded = keras.saving.load_model(figures["guided"]["path"])
    x, _ = deploy_demo.sentinel_data(64, seed=3)
    assert [layer.quantization_mode for layer in loaded.layers
            if isinstance(layer, keras.layers.Dense)] == [
        "int8" if plan[name] == "quantize" else None for name in ("features", "hidden", "logit")]
    assert np.isfinite(loaded.predict(x, verbose=0)).all()


@pytest.mark.parametrize("mode", ["gptq", "awq"])
def test_calibrated_modes_on_an_adaptive_token_model(mode):
    """gptq and awq (Keras's calibrated modes) quantize an adaptive model's
    blocks, given a config with calibration tokens and the block structure.
    (Saving such a model fails in Keras 3.15.1 itself, float32 models too:
    a RecursionError while serializing; so no save here.)"""
    configs = {"gptq": "GPTQConfig", "awq": "AWQConfig"}
    config_cls = getattr(keras.quantizers, configs[mode], None)
    if config_cls is None:
        pytest.skip(f"this Keras has no {configs[mode]}")
    vocab, length = 50, 8
    with keras_mp.policy_scope("adaptive_bfloat16"):
        tokens = keras.Input((length,), dtype="int32")
        embedding = keras.layers.Embedding(vocab, 16)
        block = keras.Sequential([keras.Input((length, 16)),
                                  keras.layers.Dense(32, activation="relu"),
                                  keras.layers.Dense(16)], name="block")
        model = keras.Model(tokens, keras.layers.Dense(vocab)(block(embedding(tokens))))
    data = np.random.default_rng(0).integers(0, vocab, size=(32, length)).astype("int32")
    before = model.predict(data[:4], verbose=0)
    kwargs = {"weight_bits": 4, "group_size": -1} if mode == "gptq" else {}
    config = config_cls(dataset=data, tokenizer=object(), num_samples=8, sequence_length=length,
                        quantization_layer_structure={"pre_block_layers": [embedding],
                                                      "sequential_blocks": [block]}, **kwargs)
    model.quantize(mode, config=config)
    assert all(layer.quantization_mode == mode for layer in block.layers)
    assert isinstance(embedding._dtype_policy, AdaptivePolicy)   # not quantized: adaptive
    after = model.predict(data[:4], verbose=0)
    assert np.isfinite(after).all()
    assert np.abs(after - before).max() < 0.5 * np.abs(before).max()


def test_float8_layers_train_under_adaptive_precision_and_are_left_alone():
    from keras_mp.callbacks import AdaptivePrecision

    model = _model("adaptive_float16")
    first, last = model.layers[1], model.layers[-1]
    model.quantize("float8", filters=lambda layer: layer is first)
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    callback = AdaptivePrecision(interval=2)
    history = model.fit(_X, _Y, batch_size=4, epochs=3, verbose=0, callbacks=[callback])
    assert np.isfinite(history.history["loss"]).all()
    assert first.quantization_mode == "float8" and first.dtype_policy.name == \
        "float8_from_mixed_float16"
    assert all(event["layer"] != first.path for event in callback.events)
    assert policy_of(model).dtype_of(last.path) in ("float16", "float32")


def test_fused_attention_quantizes_its_einsum_layers(tmp_path):
    with keras_mp.policy_scope("adaptive_bfloat16"):
        inputs = keras.Input((4, 8))
        x = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)(inputs, inputs)
        model = keras.Model(inputs, keras.layers.Dense(2)(x))
    fused = keras_mp.fuse(model)
    fused.quantize("int8")
    modes = {type(layer).__name__: layer.quantization_mode
             for layer in fused._flatten_layers(include_self=False)
             if isinstance(layer, (keras.layers.EinsumDense, keras.layers.Dense))}
    assert set(modes.values()) == {"int8"} and "EinsumDense" in modes, modes
    x = np.random.default_rng(0).normal(size=(2, 4, 8)).astype("float32")
    out = fused.predict(x, verbose=0)
    fused.save(tmp_path / "mha.keras")
    again = keras.saving.load_model(tmp_path / "mha.keras")
    np.testing.assert_allclose(again.predict(x, verbose=0), out, rtol=1e-5, atol=1e-5)
