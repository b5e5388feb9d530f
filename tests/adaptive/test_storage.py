"""Frozen weights stored in their layer's compute dtype (keras_mp.adaptive.storage).

Under "adaptive" (bfloat16 where the CPU has bfloat16 units, else float32
alone, where nothing is stored compactly) and "adaptive_float16": what fit
stores and when, that a stored model computes what it computed before, that
a layer unfrozen trains in float32 from the value it had, the switch and the
per-variable override, and the lifecycle: .keras files and weights files
both ways against Keras float32 models, export, quantize, BackupAndRestore.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mp
from keras_mp.adaptive.policy.controlled_layers import policy_of
from keras_mp.adaptive.storage import frozen, variables

POLICIES = ("adaptive", "adaptive_float16")

pytestmark = pytest.mark.usefixtures("adapt_every_fit")


def _narrow(policy: str) -> str:
    """The dtype frozen weights are stored in under ``policy`` here."""
    with keras_mp.policy_scope(policy) as p:
        return p.float_candidates[0]


def _model(policy: str | None, frozen_layers=("base",), compiled=True) -> keras.Model:
    """Dense base -> LayerNorm -> BatchNorm -> Dense head (a functional model);
    ``frozen_layers`` do not train."""
    scope = keras_mp.policy_scope(policy) if policy else keras_mp.policy_scope("float32")
    with scope:
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8,))
        h = keras.layers.Dense(16, name="base")(inputs)
        h = keras.layers.LayerNormalization(name="norm")(h)
        h = keras.layers.BatchNormalization(name="bn")(h)
        model = keras.Model(inputs, keras.layers.Dense(1, name="head")(h))
    for name in frozen_layers:
        model.get_layer(name).trainable = False
    if compiled:
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    return model


def _xy(n=64, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype("float32")
    return x, (x[:, :1] * 0.5).astype("float32")


def _fit(model, epochs=1, **kw):
    x, y = _xy()
    return model.fit(x, y, batch_size=16, epochs=epochs, verbose=0, shuffle=False, **kw)


def _fit_compact(model, policy):
    """Fits ``model`` and checks that its frozen base is stored compactly."""
    _fit(model)
    assert variables.stored_dtype(model.get_layer("base").kernel) == _narrow(policy)


def _dtypes(model) -> dict[str, str]:
    return {v.path.split("/", 1)[-1] if v.path.count("/") > 1 else v.path:
            variables.stored_dtype(v) for v in model.weights}


def _values(model) -> list[np.ndarray]:
    return [np.asarray(v.numpy()).astype("float32") for v in model.weights]


@pytest.mark.parametrize("policy", POLICIES)
def test_fit_stores_frozen_weights_in_the_compute_dtype(policy):
    model = _model(policy, frozen_layers=("base", "norm", "bn"))
    assert set(_dtypes(model).values()) == {"float32"}  # compile decides nothing
    _fit(model)
    narrow = _narrow(policy)
    d = _dtypes(model)
    assert d["base/kernel"] == d["base/bias"] == narrow
    # Read in float32 (LayerNormalization's gamma and beta), not weights
    # (BatchNormalization's moving statistics), or training: float32.
    assert d["norm/gamma"] == d["bn/gamma"] == d["bn/moving_mean"] == "float32"
    assert d["head/kernel"] == "float32"
    report = keras_mp.precision_report(model)
    storage = report.storage()
    reason = "frozen" if narrow != "float32" else "compute_float32"
    assert storage["base/kernel"]["reason"] == reason
    assert storage["base/kernel"]["dtype"] == narrow
    assert storage["norm/gamma"]["reason"] in ("read_in_float32", "compute_float32")
    assert storage["head/kernel"]["reason"] == "trains"
    if narrow != "float32":
        assert f"frozen weights stored in {narrow}" in str(report)
        assert 0 < storage["base/kernel"]["error"] <= frozen.UNIT_ROUNDOFF[narrow]


@pytest.mark.parametrize("policy", POLICIES)
def test_storing_changes_no_computation(policy):
    """Each stored layer reads what it read before, bit for bit: Dense with
    LoRA, EinsumDense, Conv1D, Embedding and an untied ReversibleEmbedding
    (its logits' kernel stays float32)."""
    with keras_mp.policy_scope(policy):
        keras.utils.set_random_seed(0)
        tokens = keras.Input((6,), dtype="int32")
        embed = keras.layers.ReversibleEmbedding(50, 8, tie_weights=False, name="embed")
        h = embed(tokens)
        h = keras.layers.Conv1D(8, 3, padding="same", name="conv")(h)
        h = keras.layers.EinsumDense("btd,de->bte", (None, 8), name="einsum")(h)
        h = keras.layers.Dense(8, name="dense")(h)
        model = keras.Model(tokens, embed(h, reverse=True))
    model.get_layer("dense").enable_lora(2)
    model.get_layer("dense").lora_kernel_b.assign(np.full((2, 8), 0.1, "float32"))
    for name in ("embed", "conv", "einsum"):
        model.get_layer(name).trainable = False
    x = np.random.default_rng(0).integers(0, 50, (4, 6)).astype("int32")
    before = model.predict(x, verbose=0)
    made = frozen.apply(model)
    narrow = _narrow(policy)
    stored = {m["variable"] for m in made}
    if narrow == "float32":
        assert not made
    else:
        assert {"embed/embeddings", "conv/kernel", "einsum/kernel", "dense/kernel"} <= {
            "/".join(p.split("/")[-2:]) for p in stored}
        assert variables.stored_dtype(model.get_layer("embed").reverse_embeddings) == "float32"
        assert variables.stored_dtype(model.get_layer("dense").lora_kernel_a) == "float32"
    np.testing.assert_array_equal(model.predict(x, verbose=0), before)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_weight_unfrozen_trains_in_float32_from_its_value(policy):
    model = _model(policy)
    _fit(model)
    base = model.get_layer("base")
    kept = np.asarray(base.kernel.numpy()).astype("float32")
    seen = {}

    class Look(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            seen["dtype"] = variables.stored_dtype(base.kernel)
            seen["value"] = np.asarray(base.kernel.numpy())
            seen["slots"] = {str(v.dtype) for v in model.optimizer.variables if v.ndim}

    base.trainable = True
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    _fit(model, callbacks=[Look()])
    assert seen["dtype"] == "float32" and seen["slots"] == {"float32"}
    np.testing.assert_array_equal(seen["value"], kept)
    assert not np.array_equal(np.asarray(base.kernel.numpy()), kept)  # it trained
    assert keras_mp.precision_report(model).storage()["base/kernel"]["reason"] == "trains"


@pytest.mark.parametrize("policy", POLICIES)
def test_the_switch_and_the_override_keep_float32(policy):
    model = _model(policy)
    keras_mp.config.set_storage(model, model.get_layer("base").kernel, "float32")
    _fit(model)
    narrow = _narrow(policy)
    assert _dtypes(model)["base/kernel"] == "float32"
    assert _dtypes(model)["base/bias"] == narrow
    assert keras_mp.precision_report(model).storage()["base/kernel"]["reason"] == "override"
    keras_mp.config.set_compact_storage(False)
    _fit(model)
    assert set(_dtypes(model).values()) == {"float32"}
    assert keras_mp.precision_report(model).storage()["base/bias"]["reason"] == "switched_off"
    keras_mp.config.set_compact_storage(True)
    keras_mp.config.set_storage(model, model.get_layer("base").kernel, None)
    _fit(model)
    assert _dtypes(model)["base/kernel"] == narrow


def test_float16_keeps_in_float32_what_it_cannot_hold():
    model = _model("adaptive_float16", frozen_layers=("base", "head"))
    base, head = model.get_layer("base"), model.get_layer("head")
    base.kernel.assign(np.full((8, 16), 1e-6, "float32"))   # float16 subnormals
    head.kernel.assign(np.full((16, 1), 3.0, "float32"))
    frozen.apply(model)
    storage = keras_mp.precision_report(model).storage()
    assert storage["base/kernel"]["dtype"] == "float32"
    assert storage["base/kernel"]["reason"] == "not_representable"
    assert storage["base/kernel"]["error"] > frozen.UNIT_ROUNDOFF["float16"]
    assert storage["head/kernel"]["dtype"] == "float16"
    base.kernel.assign(np.full((8, 16), 1e5, "float32"))    # past float16's max
    frozen.apply(model)
    assert keras_mp.precision_report(model).storage()["base/kernel"]["error"] == float("inf")


# -- the lifecycle ---------------------------------------------------------------

@pytest.mark.parametrize("policy", POLICIES)
def test_keras_files_load_both_ways(policy, tmp_path):
    compact = _model(policy)
    _fit_compact(compact, policy)
    compact.save(tmp_path / "compact.keras")
    values = _values(compact)
    # Into a Keras float32 model of the same architecture (uncompiled: the
    # optimizers' states differ).
    plain = _model(None, compiled=False)
    plain.load_weights(tmp_path / "compact.keras")
    for a, b in zip(_values(plain), values):
        np.testing.assert_array_equal(a, b)
    assert set(_dtypes(plain).values()) == {"float32"}
    # Loaded as it was saved: the decisions with it; stored again at its next fit.
    loaded = keras.saving.load_model(tmp_path / "compact.keras")
    for a, b in zip(_values(loaded), values):
        np.testing.assert_array_equal(a, b)
    assert keras_mp.precision_report(loaded).storage()["base/kernel"]["reason"] == \
        keras_mp.precision_report(compact).storage()["base/kernel"]["reason"]
    _fit(loaded)
    assert _dtypes(loaded)["base/kernel"] == _narrow(policy)
    # The reverse: a Keras float32 file into the compact model.
    plain.save(tmp_path / "plain.keras")
    compact.load_weights(tmp_path / "plain.keras")
    assert _dtypes(compact)["base/kernel"] == _narrow(policy)
    np.testing.assert_array_equal(_values(compact)[0], values[0])


@pytest.mark.parametrize("policy", POLICIES)
def test_weights_files_load_both_ways(policy, tmp_path):
    compact = _model(policy)
    _fit_compact(compact, policy)
    compact.save_weights(tmp_path / "compact.weights.h5")
    plain = _model(None, compiled=False)
    plain.load_weights(tmp_path / "compact.weights.h5")
    for a, b in zip(_values(plain), _values(compact)):
        np.testing.assert_array_equal(a, b)
    rng = np.random.default_rng(1)
    for v in plain.weights:
        v.assign(rng.normal(size=v.shape).astype("float32"))
    plain.save_weights(tmp_path / "plain.weights.h5")
    compact.load_weights(tmp_path / "plain.weights.h5")
    narrow = _narrow(policy)
    kernel = compact.get_layer("base").kernel
    assert variables.stored_dtype(kernel) == narrow
    np.testing.assert_array_equal(
        np.asarray(kernel.numpy()).astype("float32"),
        np.asarray(plain.get_layer("base").kernel.numpy()).astype(narrow).astype("float32"))


@pytest.mark.parametrize("policy", POLICIES)
def test_export_serves_what_predict_computes(policy, tmp_path):
    model = _model(policy)
    _fit_compact(model, policy)
    x = _xy(8, seed=3)[0]
    expected = np.asarray(model.predict(x, verbose=0), "float32")
    model.export(str(tmp_path / "keras_export"), verbose=False)
    served = tf.saved_model.load(str(tmp_path / "keras_export"))
    np.testing.assert_allclose(np.asarray(served.serve(x), "float32"), expected, atol=1e-6)
    keras_mp.export(model, tmp_path / "keras_mp_export")
    served = tf.saved_model.load(str(tmp_path / "keras_mp_export"))
    np.testing.assert_allclose(served.serve(x).numpy(), expected, atol=1e-6)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("how", ["keras_mp", "keras"])
def test_quantize_after_compact_storage(policy, how):
    model = _model(policy)
    _fit_compact(model, policy)
    x = _xy(8, seed=3)[0]
    before = np.asarray(model.predict(x, verbose=0), "float32")
    if how == "keras_mp":
        keras_mp.quantize(model, "int8")
    elif _narrow(policy) == "float16":
        # Keras refuses int8 for float16 layers, as for a Keras mixed_float16
        # model (keras_mp.quantize quantizes them from float32).
        with pytest.raises(ValueError, match="compute_dtype='float16'"):
            model.quantize("int8")
        return
    else:
        model.quantize("int8")
    base = model.get_layer("base")
    assert base.quantization_mode == "int8" and base._kernel.dtype == "int8"
    after = np.asarray(model.predict(x, verbose=0), "float32")
    assert np.all(np.isfinite(after))
    assert np.abs(after - before).max() < 0.1 * (np.abs(before).max() + 1)


class _Interrupt(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == 1:
            raise RuntimeError("interrupted")


class _Trace(keras.callbacks.Callback):
    """Each epoch's end: the weights, the loss and the switch history (what
    a failure of the resume test below reports: once, in a full CI run, the
    resumed run ended elsewhere, and no rerun repeated it)."""

    def __init__(self):
        super().__init__()
        self.epochs: dict[int, tuple] = {}

    def on_epoch_end(self, epoch, logs=None):
        policy = policy_of(self.model)
        history = {path: [dict(e) for e in policy.record(path).get("history", [])]
                   for path in sorted(policy.records)} if policy is not None else {}
        self.epochs[epoch] = (_values(self.model), (logs or {}).get("loss"), history)


def _first_difference(a: _Trace, b: _Trace) -> str:
    for epoch in sorted(set(a.epochs) & set(b.epochs)):
        (va, la, ha), (vb, lb, hb) = a.epochs[epoch], b.epochs[epoch]
        if la != lb or ha != hb or any(not np.array_equal(x, y) for x, y in zip(va, vb)):
            return (f"first difference at epoch {epoch}: loss {la} against {lb}; "
                    f"histories {ha} against {hb}")
    return "no difference at any epoch end both runs traced"


@pytest.mark.parametrize("policy", POLICIES)
def test_backup_and_restore_resumes_bit_for_bit(policy, tmp_path):
    whole, traced = _model(policy), _Trace()
    _fit(whole, epochs=4, callbacks=[traced])
    expected = _values(whole)

    keras.utils.clear_session(free_memory=False)
    first, before = _model(policy), _Trace()
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    with pytest.raises(RuntimeError, match="interrupted"):
        _fit(first, epochs=4, callbacks=[backup, before, _Interrupt()])
    keras.utils.clear_session(free_memory=False)
    resumed, after = _model(policy), _Trace()  # a new process rebuilds the model from code
    _fit(resumed, epochs=4,
         callbacks=[keras.callbacks.BackupAndRestore(str(tmp_path / "backup")), after])
    assert _dtypes(resumed) == _dtypes(whole)
    before.epochs.update(after.epochs)
    for a, b in zip(_values(resumed), expected):
        np.testing.assert_array_equal(a, b, err_msg=_first_difference(before, traced))


def test_only_adaptive_models_are_stored():
    model = _model(None)
    _fit(model)
    assert set(_dtypes(model).values()) == {"float32"}
    assert policy_of(model) is None
    with pytest.raises(ValueError, match="`model` does not use"):
        frozen.apply(model)
