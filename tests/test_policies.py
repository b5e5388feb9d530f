"""keras_mp.policies: AdaptivePolicy on DTypePolicyMap, the global-policy
functions, serialization, retracing and .keras round trips."""

import keras
import numpy as np
import pytest

from keras_mp import device, policies
from keras_mp.adaptive.decisions.controller import DecisionRule
from keras_mp.policies import AdaptivePolicy


@pytest.mark.parametrize("name, candidates", [
    ("adaptive_bfloat16", ("bfloat16", "float32")),
    ("adaptive_float16", ("float16", "float32")),
    ("adaptive", None),
])
def test_adaptive_names(name, candidates):
    policies.set_global_policy(name)
    p = policies.global_policy()
    assert isinstance(p, AdaptivePolicy) and p.name == name
    assert p.candidates == (candidates or device.default_candidates())
    assert p.variable_dtype == "float32" and p.compute_dtype == p.candidates[0]


def test_adaptive_default_never_float16_without_float16_units():
    if device.profile().hardware["float16"]:
        pytest.skip("this CPU has float16 units")
    assert "float16" not in AdaptivePolicy().candidates


@pytest.mark.parametrize("name", ["float32", "float16", "bfloat16", "mixed_float16",
                                  "mixed_bfloat16"])
def test_every_keras_name(name):
    policies.set_global_policy(name)
    assert policies.global_policy().name == name
    assert keras.config.dtype_policy().name == name


def test_bad_names_list_the_allowed_values():
    with pytest.raises(ValueError, match="adaptive_bfloat16"):
        policies.set_global_policy("adaptiv")
    with pytest.raises(ValueError, match="candidates"):
        AdaptivePolicy(candidates=("float16", "int8"))
    with pytest.raises(TypeError, match="rule"):
        AdaptivePolicy(candidates=("float32",), rule=3)
    p = AdaptivePolicy(candidates=("bfloat16", "float32"))
    with pytest.raises(ValueError, match=r"`dtype` must be one of the candidates"):
        p.assign("dense", "float16")
    with pytest.raises(ValueError, match="path"):
        p.assign("", "float32")


def test_model_helpers_reject_non_models():
    with pytest.raises(TypeError, match="`model`"):
        policies.policy_of("model")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    with pytest.raises(TypeError, match="`policy`"):
        policies.adaptive_layers(model, "float32")
    assert policies.policy_of(model) is None  # float32: not adaptive


def test_policy_scope_restores_even_after_an_error():
    policies.set_global_policy("mixed_bfloat16")
    with pytest.raises(RuntimeError):
        with policies.policy_scope("adaptive_float16") as p:
            assert policies.global_policy() is p
            raise RuntimeError
    assert policies.global_policy().name == "mixed_bfloat16"


def test_layers_resolve_their_path_and_change_on_assign():
    policies.set_global_policy("adaptive_float16")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(2)])
    p = policies.policy_of(model)
    assert p is policies.global_policy()
    assert [l.compute_dtype for l in model.layers] == ["float16", "float16"]
    assert all(v.dtype == "float32" for v in model.weights)  # master weights
    p.assign(model.layers[1].path, "float32")
    assert [l.compute_dtype for l in model.layers] == ["float16", "float32"]
    assert p.assignments() == {model.layers[1].path: "float32"}
    p.assign(model.layers[1].path, "float16")  # back to the default: no entry left
    assert p.assignments() == {}


def test_train_function_retraced_with_the_new_dtype(adapt_every_fit):
    policies.set_global_policy("adaptive_bfloat16")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((4, 3), "float32"), np.ones((4, 2), "float32")
    model.fit(x, y, verbose=0)
    assert keras.ops.convert_to_tensor(model(x)).dtype == "bfloat16"
    policies.policy_of(model).assign(model.layers[0].path, "float32")
    model.train_function = model.predict_function = None
    model.fit(x, y, verbose=0)
    assert keras.ops.convert_to_tensor(model(x)).dtype == "float32"


def test_keras_compile_does_not_wrap_the_optimizer():
    policies.set_global_policy("adaptive_float16")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="adam", loss="mse")
    # Only the exact name "mixed_float16" triggers Keras's wrap; the
    # AdaptivePrecision callback wraps in keras_mp's instead.
    assert type(model.optimizer) is keras.optimizers.Adam


def test_config_round_trip():
    p = AdaptivePolicy(candidates=("float32", "float16"), rule=DecisionRule(patience=3),
                       name="mine")
    p.assign("model/dense", "float32")
    p.record("model/dense")["state"] = {"dtype": "float32", "switches": 1}
    q = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(p))
    assert isinstance(q, AdaptivePolicy) and q is not p
    assert q.name == "mine" and q.candidates == ("float16", "float32")
    assert q.rule == DecisionRule(patience=3)
    assert q.assignments() == {"model/dense": "float32"}
    assert q.records == p.records
    assert q.get_config() == p.get_config()


def test_paths_match_with_or_without_the_model_name():
    p = AdaptivePolicy(candidates=("bfloat16", "float32"),
                       assignments={"sequential/dense_1": "float32"})
    # Keras rebuilds layers from a .keras config outside the model's scope.
    assert p.dtype_of("dense_1") == "float32"
    assert p.dtype_of("dense") == "bfloat16"
    assert p.dtype_of("sequential/dense_1") == "float32"
    p.assign("dense_1", "bfloat16")
    assert p.assignments() == {}


def test_keras_file_round_trip_restores_per_layer_dtypes(tmp_path):
    policies.set_global_policy("adaptive_bfloat16")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(2)])
    policies.policy_of(model).assign(model.layers[0].path, "float32")
    path = str(tmp_path / "m.keras")
    model.save(path)
    policies.set_global_policy("float32")
    loaded = keras.saving.load_model(path)
    assert [l.compute_dtype for l in loaded.layers] == ["float32", "bfloat16"]
    p = policies.policy_of(loaded)
    # One shared policy after policy_of, so a change reaches every layer.
    assert all(l._dtype_policy is p for l in loaded.layers)
    p.assign(loaded.layers[1].path, "float32")
    assert loaded.layers[1].compute_dtype == "float32"


def test_keras_policies_without_a_name_take_the_adaptive_default_entry():
    # Keras's DTypePolicy() / QuantizedDTypePolicy(mode) read the global
    # policy's name, which "adaptive_float16" is not a Keras dtype of
    # (Keras's dtype_policy_map_test / dtype_policy_test under keras-mp).
    import keras_mp
    from keras.src.dtype_policies.dtype_policy import QuantizedDTypePolicy

    with keras_mp.policy_scope("adaptive_bfloat16"):
        assert QuantizedDTypePolicy("int8").name == "int8_from_mixed_bfloat16"
    with keras_mp.policy_scope("adaptive_float16") as policy:
        assert keras.DTypePolicy().name == "mixed_float16"
        assert keras.DTypePolicy("bfloat16").name == "bfloat16"
        assert policy == keras_mp.policies.get("adaptive_float16")
        assert policy != keras.DTypePolicy("mixed_float16")
        assert policy != keras_mp.policies.get("adaptive_bfloat16")
