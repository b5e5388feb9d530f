"""Trained weights in bfloat16 for SGD with momentum, Adamax, Nadam and Lion
(keras_mp.adaptive.storage.trained, keras_mp.execution.compact_rules).

Opt-in: ``keras_mp.config.set_compact_weights(True)`` (by default only Adam's
and AdamW's weights are compact, in large models). Each optimizer trains a
small model with an embedding (a sparse gradient) and a Dense head under
``"adaptive_bfloat16"`` with compact weights and moments: the weights, their
slots and Nadam's ``_u_product`` as stored, a step against Keras's own
update over float32 copies (to a bfloat16 rounding), small updates kept by
stochastic rounding, a seeded run repeated, ``.keras`` files under other
policies, ``BackupAndRestore``, a NaN batch skipped.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mp
from keras_mp.adaptive.storage import trained, variables
from keras_mp.execution import compact_update
from tests import faults

pytestmark = pytest.mark.usefixtures("adapt_every_fit")

#: The optimizers, with Keras's weight decay where they take it.
OTHERS = {"sgd_momentum": lambda lr=1e-2: keras.optimizers.SGD(lr, momentum=0.9, nesterov=True,
                                                                weight_decay=0.05),
          "adamax": lambda lr=1e-2: keras.optimizers.Adamax(lr),
          "nadam": lambda lr=1e-2: keras.optimizers.Nadam(lr),
          "lion": lambda lr=5e-3: keras.optimizers.Lion(lr, weight_decay=0.1)}
ROWS = 32


@pytest.fixture
def compact():
    keras_mp.config.set_compact_weights(True)
    keras_mp.config.set_compact_moments(True)
    yield
    keras_mp.config.set_compact_weights(None)
    keras_mp.config.set_compact_moments(None)


def _model(optimizer, policy="adaptive_bfloat16"):
    with keras_mp.policy_scope(policy):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,), dtype="int32"),
                                  keras.layers.Embedding(ROWS, 8, name="table"),
                                  keras.layers.GlobalAveragePooling1D(),
                                  keras.layers.Dense(16, name="hidden"),
                                  keras.layers.Dense(1, name="out")], name="net")
    model.compile(optimizer=optimizer, loss="mse")
    return model


def _data(rows=64):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, ROWS, (rows, 4)).astype("int32")
    return ids, (ids[:, :1] % 3 - 1).astype("float32")

def step_beside_keras(opt, ref, weights, copies) -> None:
    """One step of ``opt`` on ``weights`` with seeded bfloat16 gradients (the
    embedding's sparse, a row repeated) and of Keras's ``ref`` on their
    float32 ``copies`` with the same gradients in float32."""
    rng = np.random.default_rng(5)

    def gradient(v, dtype):
        if v.path.endswith("table/embeddings"):
            values = tf.constant(rng.normal(size=(5, 8)), dtype)
            return tf.IndexedSlices(values, tf.constant([3, 3, 7, 0, 30]),
                                    tf.constant([ROWS, 8]))
        return tf.constant(rng.normal(size=v.shape), dtype)
    grads = [gradient(v, tf.bfloat16) for v in weights]
    opt.apply(grads, weights)
    ref.apply([tf.IndexedSlices(tf.cast(g.values, tf.float32), g.indices, g.dense_shape)
               if isinstance(g, tf.IndexedSlices) else tf.cast(g, tf.float32) for g in grads],
              copies)


def assert_stored_compactly(model, opt, paths, runs) -> None:
    """Every trained weight of ``model`` updated compactly by ``opt`` (Keras's
    own weight decay left out), each of ``paths`` reported bfloat16 with
    bfloat16 moments and its update-to-ulp statistic, and the seeded
    ``runs`` (two lists of arrays) equal bit for bit."""
    for v in model.trainable_variables:
        assert compact_update.compact_weight(opt, v) and not opt._use_weight_decay(v)
    report = keras_mp.precision_report(model).storage()
    for path in paths:
        entry = report[path]
        assert (entry["dtype"], entry["reason"], entry["moments"]) == \
            ("bfloat16", "trains_compact", "bfloat16"), entry
        assert 0.0 <= entry["below_half_ulp"] <= 1.0, entry
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)



def _fit(model, epochs=1, **kw):
    x, y = _data()
    return model.fit(x, y, batch_size=16, epochs=epochs, verbose=0, shuffle=False, **kw)


def _inner(model):
    return model.optimizer.inner_optimizer


def _slots(opt) -> list:
    return [s for name in compact_update.SLOTS[type(opt)] for s in getattr(opt, name)]


def _dtypes(vs) -> set[str]:
    return {variables.stored_dtype(v) for v in vs}


def _extra(opt) -> list:
    """Nadam's ``_u_product`` (a scalar of its own, made in ``build``)."""
    return [opt._u_product] if isinstance(opt, keras.optimizers.Nadam) else []


def _state(model) -> list[np.ndarray]:
    opt = _inner(model)
    if isinstance(opt, keras.optimizers.Nadam):   # listed, so saved (keras_mp.LossScaleOptimizer)
        assert any(v is opt._u_product for v in model.optimizer.variables)
    return [np.asarray(v.numpy()).astype("float32")
            for v in [*model.weights, *model.optimizer.variables]]


def _ulp(x: np.ndarray) -> np.ndarray:
    """A bfloat16 ulp of each element of ``x`` (float32)."""
    exponent = np.frexp(np.abs(x).astype("float32"))[1]
    return np.ldexp(np.ones_like(x, dtype="float32"), exponent - 8)


def test_only_adams_weights_are_compact_by_default(monkeypatch):
    # The setting None: in a large model (the threshold lowered here) Adam's
    # and AdamW's weights are bfloat16, the others' only when asked.
    monkeypatch.setattr(trained, "AUTO_PARAMETERS", 100)
    assert keras_mp.config.compact_weights() is None
    for name in sorted(OTHERS):
        assert trained.unsupported_reason(OTHERS[name]()) is None
    lion = _model(OTHERS["lion"]())
    adamw = _model(keras.optimizers.AdamW(1e-2))
    for model in (lion, adamw):
        assert trained.large(model)
        _fit(model)
    assert not trained.allowed(lion) and trained.allowed(adamw)
    assert _dtypes(lion.trainable_variables) == {"float32"}
    assert _dtypes(adamw.trainable_variables) == {"bfloat16"}
    keras_mp.config.set_compact_weights(True)
    try:
        _fit(lion)
        assert _dtypes(lion.trainable_variables) == {"bfloat16"}
    finally:
        keras_mp.config.set_compact_weights(None)


@pytest.mark.parametrize("name", sorted(OTHERS))
def test_other_optimizers_train_bfloat16_weights(name, compact):
    """Weights and slots in bfloat16, the loss falling as Keras float32's
    does (within 1 %), Keras's weight decay left to the float32 update, the report's reason and
    update-to-ulp statistic, and a seeded run repeated bit for bit."""
    keras_mp.config.set_compact_weights(False)
    keras_mp.config.set_compact_moments(False)
    reference = _fit(_model(OTHERS[name](), "float32"), epochs=3).history["loss"]   # Keras's
    keras_mp.config.set_compact_weights(True)
    keras_mp.config.set_compact_moments(True)
    runs = []
    for _ in range(2):
        keras.utils.clear_session(free_memory=False)
        model = _model(OTHERS[name]())
        losses = _fit(model, epochs=3).history["loss"]
        runs.append(_state(model))
    opt = _inner(model)
    assert _dtypes(model.trainable_variables) == {"bfloat16"}
    assert _dtypes(_slots(opt)) == {"bfloat16"}
    assert _dtypes(_extra(opt)) <= {"float32"}          # Nadam's product stays float32
    assert np.isfinite(losses).all() and losses[-1] < losses[0], losses
    np.testing.assert_allclose(losses, reference, rtol=0.01)   # Keras float32's fit
    assert_stored_compactly(model, opt, ("net/table/embeddings", "net/hidden/kernel"), runs)


@pytest.mark.parametrize("name", sorted(OTHERS))
def test_compact_weights_alone_keep_float32_slots(name):
    # Without compact moments the slots of a bfloat16 weight are made float32
    # (Keras would copy the weight's dtype) and the update still reads them.
    keras_mp.config.set_compact_weights(True)
    try:
        model = _model(OTHERS[name]())
        losses = _fit(model, epochs=2).history["loss"]
    finally:
        keras_mp.config.set_compact_weights(None)
    keras_mp.config.set_compact_weights(False)
    try:
        reference = _fit(_model(OTHERS[name](), "float32"), epochs=2).history["loss"]
    finally:
        keras_mp.config.set_compact_weights(None)
    assert _dtypes(model.trainable_variables) == {"bfloat16"}
    assert _dtypes(_slots(_inner(model))) == {"float32"}
    np.testing.assert_allclose(losses, reference, rtol=0.01)


@pytest.mark.parametrize("name", sorted(OTHERS))
def test_weight_decay_is_applied_once_and_in_float32(name, compact):
    # lr * wd = 1e-3 of each weight, below half a bfloat16 ulp: Keras's own
    # decay in the weight's dtype would round back to 1; here it is applied
    # in float32 inside the update, once. A zero gradient from zero slots
    # moves no weight by the rule itself (SGD's momentum, Lion's sign and
    # Adamax's and Nadam's first moment are all 0).
    opt = type(OTHERS[name]()).from_config({**OTHERS[name]().get_config(),
                                            "learning_rate": 1e-2, "weight_decay": 0.1})
    w = keras.Variable(np.ones(4096, "float32"))
    variables.store_as(w, "bfloat16")
    opt.build([w])
    trained.mark(opt, [w], restored=False)
    assert compact_update.compact_weight(opt, w) and not opt._use_weight_decay(w)
    assert _dtypes(_extra(opt)) <= {"float32"}        # Nadam's, built before the mark
    opt.apply([tf.zeros([4096], tf.bfloat16)], [w])
    new = np.asarray(w.numpy()).astype("float64")
    assert set(np.unique(new)) == {1.0 - 2.0 ** -8, 1.0}      # rounded stochastically
    assert new.mean() == pytest.approx(1.0 - 1e-3, abs=2e-4)


@pytest.mark.parametrize("name", sorted(OTHERS))
def test_under_adaptive_the_weights_follow_their_layers_compute_dtype(name, compact):
    # "adaptive" computes in bfloat16 only where this CPU runs it fast (not
    # with KERAS_MP_TEST_CPU_FLAGS=avx2): there the weights are bfloat16; on
    # a float32-only CPU they stay float32 (the moments, asked, are bfloat16).
    model = _model(OTHERS[name](), "adaptive")
    history = _fit(model, epochs=2)
    assert np.isfinite(history.history["loss"]).all()
    hidden = model.get_layer("hidden")
    expected = "bfloat16" if hidden.compute_dtype == "bfloat16" else "float32"
    assert _dtypes(hidden.trainable_variables) == {expected}, hidden.compute_dtype
    opt = _inner(model)
    i = opt._get_variable_index(hidden.kernel)
    slots = [getattr(opt, attr)[i] for attr in compact_update.SLOTS[type(opt)]]
    assert _dtypes(slots) == {"bfloat16"}     # compact moments asked: any layer's


@pytest.mark.parametrize("name", sorted(OTHERS))
def test_a_step_is_kerass_float32_update_to_a_bfloat16_rounding(name, compact):
    """From the state a fit left, one step (the table's gradient sparse, a
    row repeated) against the same optimizer class over float32 copies of
    the weights and slots: each weight within a bfloat16 ulp of Keras's
    float32 result (stochastic rounding picks one of its two neighbours),
    each slot too, and the weights moved."""
    model = _model(OTHERS[name]())
    _fit(model, epochs=2)
    opt = _inner(model)
    weights = model.trainable_variables
    start = [np.asarray(v.numpy()).astype("float32") for v in weights]
    ref = type(opt).from_config(opt.get_config())
    copies = [keras.Variable(w, name=v.name) for w, v in zip(start, weights)]
    ref.build(copies)
    for attr in compact_update.SLOTS[type(opt)]:
        for mine, theirs in zip(getattr(opt, attr), getattr(ref, attr)):
            theirs.assign(np.asarray(mine.numpy()).astype("float32"))
    ref.iterations.assign(opt.iterations)
    for mine, theirs in zip(_extra(opt), _extra(ref)):
        theirs.assign(mine)
    step_beside_keras(opt, ref, weights, copies)
    assert _dtypes(weights) == {"bfloat16"}
    moved = 0
    for v, w0, expected in zip(weights, start, copies):
        got, expected = np.asarray(v.numpy()).astype("float32"), expected.numpy()
        assert (np.abs(got - expected) <= _ulp(expected)).all(), v.path
        moved += int((got != w0).sum())
    assert moved > 0.3 * sum(w.size for w in start)
    for attr in compact_update.SLOTS[type(opt)]:
        for mine, theirs in zip(getattr(opt, attr), getattr(ref, attr)):
            got, expected = np.asarray(mine.numpy()).astype("float32"), theirs.numpy()
            assert (np.abs(got - expected) <= _ulp(expected)).all(), mine.path
    for mine, theirs in zip(_extra(opt), _extra(ref)):
        assert float(mine.numpy()) == float(theirs.numpy())


@pytest.mark.parametrize("name", sorted(OTHERS))
def test_updates_below_half_an_ulp_still_move_the_weights(name, compact):
    # At lr 1e-4 nearly every update is below half a bfloat16 ulp of its
    # weight: rounded to nearest none would move; rounded stochastically the
    # weights move, and the report's statistic says so.
    model = _model(OTHERS[name](1e-4))
    _fit(model)
    kernel = model.get_layer("hidden").kernel
    before = np.asarray(kernel.numpy()).astype("float32")
    _fit(model, epochs=2)
    assert variables.stored_dtype(kernel) == "bfloat16"
    assert keras_mp.precision_report(model).storage()["net/hidden/kernel"]["below_half_ulp"] \
        >= 0.8
    assert (np.asarray(kernel.numpy()).astype("float32") != before).sum() >= 5


def test_a_new_nadam_keeps_its_product_in_float32(compact):
    # Keras's Nadam makes _u_product in its first weight's dtype: a Nadam
    # compiled for weights already in bfloat16 would round the momentum
    # schedule's product to 8 bits each step.
    model = _model(OTHERS["nadam"]())
    _fit(model)
    assert _dtypes(model.trainable_variables) == {"bfloat16"}
    model.compile(optimizer=OTHERS["nadam"](), loss="mse")
    _fit(model)
    opt = _inner(model)
    assert variables.stored_dtype(opt._u_product) == "float32"
    expected = np.float32(1.0)
    for t in range(1, int(opt.iterations.numpy()) + 1):
        expected = np.float32(expected * np.float32(0.9) * np.float32(1 - 0.5 * 0.96 ** t))
    assert float(opt._u_product.numpy()) == pytest.approx(float(expected), rel=1e-5)


@pytest.mark.measured_execution   # the execution mode keras-mp picks, as a user's fit runs
@pytest.mark.parametrize("name", sorted(OTHERS))
def test_keras_files_load_under_other_policies(name, compact, tmp_path):
    model = _model(OTHERS[name]())
    _fit(model)
    model.save(tmp_path / "compact.keras")
    x, _ = _data(8)
    expected = np.asarray(model.predict(x, verbose=0))
    for policy in ("float32", "mixed_bfloat16"):      # the global policy at load
        with keras_mp.policy_scope(policy):
            other = keras.saving.load_model(tmp_path / "compact.keras")
        np.testing.assert_array_equal(np.asarray(other.predict(x, verbose=0)), expected)
    loaded = keras.saving.load_model(tmp_path / "compact.keras")
    assert type(_inner(loaded)) is type(_inner(model))
    mine = [np.asarray(v.numpy()).astype("float32")
            for v in [*model.weights, *model.optimizer.variables]]
    for a, b in zip([np.asarray(v.numpy()).astype("float32")
                     for v in [*loaded.weights, *loaded.optimizer.variables]], mine):
        np.testing.assert_array_equal(a, b)     # the bfloat16 values, exactly
    history = _fit(loaded)
    assert np.isfinite(history.history["loss"]).all()
    assert _dtypes(loaded.trainable_variables) == _dtypes(_slots(_inner(loaded))) == {"bfloat16"}


class _Interrupt(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == 1:
            raise RuntimeError("interrupted")


@pytest.mark.parametrize("name", sorted(OTHERS))
def test_backup_and_restore_resumes_bit_for_bit(name, compact, tmp_path):
    whole = _model(OTHERS[name]())
    _fit(whole, epochs=4)
    keras.utils.clear_session(free_memory=False)
    first = _model(OTHERS[name]())
    with pytest.raises(RuntimeError, match="interrupted"):
        _fit(first, epochs=4, callbacks=[keras.callbacks.BackupAndRestore(str(tmp_path / "b")),
                                        _Interrupt()])
    keras.utils.clear_session(free_memory=False)
    resumed = _model(OTHERS[name]())
    _fit(resumed, epochs=4, callbacks=[keras.callbacks.BackupAndRestore(str(tmp_path / "b"))])
    assert _dtypes(resumed.trainable_variables) == {"bfloat16"}
    for a, b in zip(_state(resumed), _state(whole)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", sorted(OTHERS))
def test_a_nan_batch_leaves_weights_and_state_as_they_were(name, compact):
    model = _model(OTHERS[name]())
    _fit(model)
    x, y = _data(16)
    y[3] = np.nan
    changed = faults.changed_by_a_skipped_fit(model, x, y, _state)   # its one step skipped
    assert _dtypes(model.trainable_variables) == {"bfloat16"}
    # Weights, slots, Nadam's product and iterations as they were; the skip counted.
    assert changed == ["loss_scale_optimizer/skipped_steps",
                       "loss_scale_optimizer/consecutive_skips"], changed
