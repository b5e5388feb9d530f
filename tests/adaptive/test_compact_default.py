"""Compact storage by default (keras_mp.adaptive.storage.trained.AUTO_PARAMETERS).

With the settings at their default (None), a model under an adaptive policy
that trains at least 2**24 parameters has its weights (where their layer
computes in bfloat16) and Adam's moments (where it computes in 16 bits)
stored in bfloat16; a smaller one keeps them in float32. The big model here is
one 65536 x 256 embedding table (2**24 parameters) and a Dense head, as a
user fits it; its file loads into a plain Keras model and predicts the same.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp.adaptive.storage import trained, variables

pytestmark = pytest.mark.usefixtures("adapt_every_fit")


def _model(policy, rows):
    with keras_mp.policy_scope(policy):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,), dtype="int32"),
                                  keras.layers.Embedding(rows, 256, name="table"),
                                  keras.layers.GlobalAveragePooling1D(),
                                  keras.layers.Dense(1, name="head")], name="net")
    model.compile(optimizer=keras.optimizers.AdamW(1e-3), loss="mse")
    return model


def _fit(model, rows):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, rows, (64, 4)).astype("int32")
    return model.fit(ids, rng.normal(size=(64, 1)), batch_size=16, epochs=2, verbose=0)


def _moments(model, variable):
    opt = model.optimizer.inner_optimizer if hasattr(model.optimizer, "inner_optimizer") \
        else model.optimizer
    i = opt._get_variable_index(variable)
    return {variables.stored_dtype(s[i]) for s in (opt._momentums, opt._velocities)}


@pytest.mark.parametrize("policy", ["adaptive", "adaptive_bfloat16", "adaptive_float16"])
def test_a_large_model_is_stored_compactly_by_default(policy, tmp_path):
    assert keras_mp.config.compact_weights() is None is keras_mp.config.compact_moments()
    rows = trained.AUTO_PARAMETERS // 256
    model = _model(policy, rows)
    assert trained.large(model)
    history = _fit(model, rows)
    assert np.isfinite(history.history["loss"]).all()
    table = model.get_layer("table")
    compute = table.compute_dtype
    # Weights where the layer computes in bfloat16; moments where in 16 bits.
    assert variables.stored_dtype(table.embeddings) == (
        "bfloat16" if compute == "bfloat16" else "float32")
    assert _moments(model, table.embeddings) == (
        {"bfloat16"} if compute in ("bfloat16", "float16") else {"float32"})
    storage = keras_mp.precision_report(model).storage()
    entry = next(e for k, e in storage.items() if k.endswith("table/embeddings"))
    assert entry["reason"] == ("trains_compact" if compute == "bfloat16" else "trains")
    # The file loads into a plain Keras float32 model, which predicts the same.
    path = str(tmp_path / "big.keras")
    model.save(path)
    ids = np.arange(8 * 4, dtype="int32").reshape(8, 4)
    with keras_mp.policy_scope("float32"):
        plain = _model("float32", rows)
    plain.load_weights(path)
    assert variables.stored_dtype(plain.get_layer("table").embeddings) == "float32"
    np.testing.assert_allclose(plain.predict(ids, verbose=0), model.predict(ids, verbose=0),
                               atol=2e-2)


def test_a_small_model_keeps_float32_state_by_default():
    model = _model("adaptive_bfloat16", 1000)
    assert not trained.large(model)
    _fit(model, 1000)
    table = model.get_layer("table").embeddings
    assert variables.stored_dtype(table) == "float32" and _moments(model, table) == {"float32"}


def test_the_threshold_is_the_models_trained_parameters(monkeypatch):
    model = _model("adaptive_bfloat16", 1000)
    monkeypatch.setattr(trained, "AUTO_PARAMETERS", 1000 * 256)
    assert trained.large(model)
    _fit(model, 1000)
    assert variables.stored_dtype(model.get_layer("table").embeddings) == "bfloat16"
    model.get_layer("table").trainable = False      # only the head trains now
    assert not trained.large(model)
    keras_mp.config.set_compact_weights(False)
    try:
        _fit(model, 1000)
        assert variables.stored_dtype(model.get_layer("head").kernel) == "float32"
    finally:
        keras_mp.config.set_compact_weights(None)


@pytest.mark.parametrize("optimizer", ["sgd_momentum", "lion"])
def test_other_optimizers_moments_are_compact_only_when_asked(optimizer):
    # By default only Adam's and AdamW's moments (the quality runs'); the
    # others' with keras_mp.config.set_compact_moments(True).
    def make():
        return keras.optimizers.SGD(1e-2, momentum=0.9) if optimizer == "sgd_momentum" \
            else keras.optimizers.Lion(1e-4)
    rows = trained.AUTO_PARAMETERS // 256
    model = _model("adaptive_bfloat16", rows)
    model.compile(optimizer=make(), loss="mse")
    _fit(model, rows)
    slots = "momentums" if optimizer == "sgd_momentum" else "_momentums"
    opt = model.optimizer.inner_optimizer
    assert {variables.stored_dtype(s) for s in getattr(opt, slots)} == {"float32"}
    assert variables.stored_dtype(model.get_layer("table").embeddings) == "float32"
    keras_mp.config.set_compact_moments(True)
    try:
        model.compile(optimizer=make(), loss="mse")
        history = _fit(model, rows)
    finally:
        keras_mp.config.set_compact_moments(None)
    assert np.isfinite(history.history["loss"]).all()
    assert {variables.stored_dtype(s) for s in getattr(model.optimizer.inner_optimizer, slots)} \
        == {"bfloat16"}


def test_a_fit_too_small_to_gain_keeps_float32_moments():
    # The fit trains in float32 (no_gain): its moments are decided after that,
    # float32 as for any layer computing in float32 (they were bfloat16 when
    # decided before the layers' dtypes for the fit were set).
    keras_mp.config.set_min_saving(1e9)
    rows = trained.AUTO_PARAMETERS // 256
    model = _model("adaptive_bfloat16", rows)
    _fit(model, rows)
    table = model.get_layer("table")
    assert table.compute_dtype == "float32"
    rows_ = {r["layer"]: r for r in keras_mp.precision_report(model).to_dict()["layers"]}
    assert [h["reason"] for h in rows_["net/table"]["history"]] == ["no_gain"], rows_
    assert variables.stored_dtype(table.embeddings) == "float32"
    assert _moments(model, table.embeddings) == {"float32"}


def test_compact_moments_are_made_in_bfloat16_never_converted(monkeypatch):
    # Slots made in float32 and converted after the optimizer's build leave
    # their float32 memory in TensorFlow's allocator (the Llama of
    # benchmarks/llm_memory.py peaked 120-160 MiB higher).
    from keras.src.optimizers import base_optimizer

    made = []
    original = base_optimizer.BaseOptimizer.add_variable_from_reference

    def recording(self, reference_variable, name=None, initializer="zeros"):
        slot = original(self, reference_variable, name=name, initializer=initializer)
        made.append((name, variables.stored_dtype(slot)))
        return slot

    monkeypatch.setattr(base_optimizer.BaseOptimizer, "add_variable_from_reference", recording)
    rows = trained.AUTO_PARAMETERS // 256
    model = _model("adaptive_bfloat16", rows)
    _fit(model, rows)
    assert _moments(model, model.get_layer("table").embeddings) == {"bfloat16"}
    assert made and {dtype for _, dtype in made} == {"bfloat16"}, made
