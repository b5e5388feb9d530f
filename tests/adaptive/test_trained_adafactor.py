"""Adafactor's trained weights and ``_v`` in bfloat16
(keras_mp.adaptive.storage.trained, keras_mp.execution.compact_adafactor).

Opt-in as SGD with momentum's, Adamax's, Nadam's and Lion's
(tests/adaptive/test_trained_rules.py, whose model and data this uses: an
embedding, whose gradient is sparse, and two Dense layers, under
``"adaptive_bfloat16"``): the math against Keras's own float32
``update_step``, the weights and ``_v`` as stored (the factored ``_r`` and
``_c`` float32), a step against Keras's update over float32 copies, small
updates kept by stochastic rounding, a seeded run repeated,
``BackupAndRestore``, ``.keras`` files under other policies, a NaN batch
skipped, and a float32-only CPU class storing nothing compactly.
"""

from __future__ import annotations

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mp
from keras_mp.adaptive.storage import trained, variables
from keras_mp.execution import compact_adafactor, compact_update
from tests import faults
from tests.adaptive import test_trained_rules as rules

pytestmark = pytest.mark.usefixtures("adapt_every_fit")


def _adafactor(lr=1e-2, **kw):
    return keras.optimizers.Adafactor(lr, **{"weight_decay": 0.05, **kw})


compact = rules.compact  # the fixture: compact weights and moments on, then back


def _factored(opt) -> list:
    """The ``_r`` and ``_c`` of the matrices (not the int32 placeholders of vectors)."""
    return [x for x in (*opt._r, *opt._c) if x is not None and len(x.shape)]


def _f32(v) -> np.ndarray:
    return np.asarray(v.numpy()).astype("float32")


def test_adafactor_is_opt_in(monkeypatch):
    monkeypatch.setattr(trained, "AUTO_PARAMETERS", 100)
    assert trained.unsupported_reason(_adafactor()) is None
    assert keras.optimizers.Adafactor not in trained.DEFAULT_OPTIMIZERS
    model = rules._model(_adafactor())
    assert trained.large(model)
    rules._fit(model)
    assert not trained.allowed(model)
    assert rules._dtypes(model.trainable_variables) == {"float32"}
    keras_mp.config.set_compact_weights(True)
    try:
        rules._fit(model)
        assert rules._dtypes(model.trainable_variables) == {"bfloat16"}
    finally:
        keras_mp.config.set_compact_weights(None)
    assert trained.unsupported_reason(_adafactor(use_ema=True)) == \
        "an exponential moving average (use_ema) averages in the weight dtype"


@pytest.mark.parametrize("schedule", [False, True])
def test_the_math_is_kerass_float32_update(schedule):
    """:func:`compact_adafactor.adafactor` from Keras's state against
    Keras's ``update_step`` on float32 variables, for three steps: a matrix
    (its gradient sparse, a row repeated), a 3-D kernel and a vector;
    ``relative_step`` capping a constant learning rate, or a schedule (not
    capped); a clip threshold that clips."""
    rng = np.random.default_rng(3)
    lr = keras.optimizers.schedules.ExponentialDecay(0.5, 1, 0.9) if schedule else 0.5
    ref = keras.optimizers.Adafactor(lr, clip_threshold=0.5, epsilon_2=1e-2)
    shapes = [(6, 5), (2, 3, 4), (5,)]
    ws = [keras.Variable(rng.normal(size=s).astype("float32")) for s in shapes]
    ref.build(ws)
    for _ in range(3):
        grads = [tf.IndexedSlices(tf.constant(rng.normal(size=(4, 5)), tf.float32),
                                  tf.constant([1, 1, 4, 0]), tf.constant([6, 5])),
                 *(tf.constant(rng.normal(size=s), tf.float32) for s in shapes[1:])]
        before = [[None if x is None else tf.identity(x) for x in (w, r, c, v)]
                  for w, r, c, v in zip(ws, ref._r, ref._c, ref._v)]
        scalars = compact_adafactor.hyper(ref, ref._get_current_learning_rate())
        assert scalars[-1] is not schedule
        expected = []
        for g, w, (w0, r, c, v) in zip(grads, ws, before):
            dense, term = compact_adafactor.densified(g)
            if len(w.shape) < 2:
                r = c = None
            sparse = isinstance(g, tf.IndexedSlices)
            expected.append(compact_adafactor.adafactor(dense, term, w0, r, c, v, *scalars,
                                                        sparse=sparse))
        ref.apply(grads, ws)
        for (w, r, c, v), mine in zip(zip(ws, ref._r, ref._c, ref._v), expected):
            for theirs, ours in zip((w, r, c, v), mine):
                if ours is not None:
                    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-6,
                                               atol=1e-7)


def test_compact_v_alone_leaves_a_matrixs_update_kerass(compact):
    # Float32 weights, _v in bfloat16 (compact moments): a matrix's _v is
    # made anew from _r and _c each step, so its update is Keras's to float32
    # rounding (the compiled update sums in another order); a vector's reads
    # its dithered _v, within a bfloat16 rounding of it.
    keras_mp.config.set_compact_weights(False)
    model = rules._model(_adafactor())
    rules._fit(model)
    opt = rules._inner(model)
    assert rules._dtypes(model.trainable_variables) == {"float32"}
    assert rules._dtypes(opt._v) == {"bfloat16"}
    assert rules._dtypes(_factored(opt)) == {"float32"}
    ref = keras.optimizers.Adafactor.from_config(opt.get_config())
    copies = [keras.Variable(_f32(v)) for v in model.trainable_variables]
    ref.build(copies)
    for mine, theirs in zip(_factored(opt), _factored(ref)):
        theirs.assign(mine)
    for mine, theirs in zip(opt._v, ref._v):
        theirs.assign(_f32(mine))
    ref.iterations.assign(opt.iterations)
    rng = np.random.default_rng(1)
    grads = [tf.constant(rng.normal(size=v.shape), tf.float32)
             for v in model.trainable_variables]
    opt.apply(grads, model.trainable_variables)
    ref.apply(grads, copies)
    for v, theirs in zip(model.trainable_variables, copies):
        if len(v.shape) >= 2:
            np.testing.assert_allclose(v.numpy(), theirs.numpy(), rtol=1e-5, atol=1e-7)
        else:
            assert (np.abs(v.numpy() - theirs.numpy())
                    <= 4e-3 * np.abs(theirs.numpy()) + 1e-6).all(), v.path


def test_adafactor_trains_bfloat16_weights(compact):
    """Weights and ``_v`` in bfloat16, ``_r`` and ``_c`` in float32, the loss
    falling as Keras float32's does (within 1 %), Keras's weight decay left
    to the float32 update, the report's reason and update-to-ulp statistic,
    and a seeded run repeated bit for bit."""
    keras_mp.config.set_compact_weights(False)
    keras_mp.config.set_compact_moments(False)
    reference = rules._fit(rules._model(_adafactor(), "float32"), epochs=3).history["loss"]
    keras_mp.config.set_compact_weights(True)
    keras_mp.config.set_compact_moments(True)
    runs = []
    for _ in range(2):
        keras.utils.clear_session(free_memory=False)
        model = rules._model(_adafactor())
        losses = rules._fit(model, epochs=3).history["loss"]
        runs.append(rules._state(model))
    opt = rules._inner(model)
    assert rules._dtypes(model.trainable_variables) == {"bfloat16"}
    assert rules._dtypes(opt._v) == {"bfloat16"}
    assert rules._dtypes(_factored(opt)) == {"float32"}
    assert len(_factored(opt)) == 6          # the table's and both kernels' r and c
    assert np.isfinite(losses).all() and losses[-1] < losses[0], losses
    np.testing.assert_allclose(losses, reference, rtol=0.01)
    rules.assert_stored_compactly(
        model, opt, ("net/table/embeddings", "net/hidden/kernel", "net/hidden/bias"), runs)


def test_a_new_adafactor_keeps_r_and_c_in_float32(compact):
    # Keras's build makes _r and _c in their weight's dtype: an Adafactor
    # compiled for weights already in bfloat16 has them stored in float32.
    model = rules._model(_adafactor())
    rules._fit(model)
    assert rules._dtypes(model.trainable_variables) == {"bfloat16"}
    model.compile(optimizer=_adafactor(), loss="mse")
    history = rules._fit(model)
    opt = rules._inner(model)
    assert rules._dtypes(_factored(opt)) == {"float32"}
    assert rules._dtypes(opt._v) == {"bfloat16"}
    assert np.isfinite(history.history["loss"]).all()
    assert all(float(np.abs(_f32(x)).max()) > 0 for x in _factored(opt))


def test_compact_weights_alone_keep_float32_slots():
    keras_mp.config.set_compact_weights(True)
    try:
        model = rules._model(_adafactor())
        losses = rules._fit(model, epochs=2).history["loss"]
    finally:
        keras_mp.config.set_compact_weights(None)
    keras_mp.config.set_compact_weights(False)
    try:
        reference = rules._fit(rules._model(_adafactor(), "float32"), epochs=2).history["loss"]
    finally:
        keras_mp.config.set_compact_weights(None)
    opt = rules._inner(model)
    assert rules._dtypes(model.trainable_variables) == {"bfloat16"}
    assert rules._dtypes([*opt._v, *_factored(opt)]) == {"float32"}
    np.testing.assert_allclose(losses, reference, rtol=0.01)


def test_weight_decay_is_applied_once_and_in_float32(compact):
    # lr * wd = 1e-3 of each weight, below half a bfloat16 ulp; a zero
    # gradient moves no weight by the rule itself (u = 0 / sqrt(epsilon_1)).
    opt = keras.optimizers.Adafactor(1e-2, weight_decay=0.1)
    w = keras.Variable(np.ones(4096, "float32"))
    variables.store_as(w, "bfloat16")
    opt.build([w])
    trained.mark(opt, [w], restored=False)
    assert compact_update.compact_weight(opt, w) and not opt._use_weight_decay(w)
    opt.apply([tf.zeros([4096], tf.bfloat16)], [w])
    new = np.asarray(w.numpy()).astype("float64")
    assert set(np.unique(new)) == {1.0 - 2.0 ** -8, 1.0}      # rounded stochastically
    assert new.mean() == pytest.approx(1.0 - 1e-3, abs=2e-4)


def test_a_step_is_kerass_float32_update_to_a_bfloat16_rounding(compact):
    """From the state a fit left, one step (the table's gradient sparse, a
    row repeated) against Keras's Adafactor over float32 copies of the
    weights and slots: each weight and ``_v`` within a bfloat16 ulp of
    Keras's float32 result, ``_r`` and ``_c`` (float32) to float32 rounding,
    and the weights moved."""
    model = rules._model(_adafactor())
    rules._fit(model, epochs=2)
    opt = rules._inner(model)
    weights = model.trainable_variables
    start = [_f32(v) for v in weights]
    ref = keras.optimizers.Adafactor.from_config(opt.get_config())
    copies = [keras.Variable(w, name=v.name) for w, v in zip(start, weights)]
    ref.build(copies)
    for mine, theirs in zip([*_factored(opt), *opt._v], [*_factored(ref), *ref._v]):
        theirs.assign(_f32(mine))
    ref.iterations.assign(opt.iterations)
    rules.step_beside_keras(opt, ref, weights, copies)
    assert rules._dtypes(weights) == {"bfloat16"}
    moved = 0
    for v, w0, expected in zip(weights, start, copies):
        got, expected = _f32(v), expected.numpy()
        assert (np.abs(got - expected) <= rules._ulp(expected)).all(), v.path
        moved += int((got != w0).sum())
    assert moved > 0.3 * sum(w.size for w in start)
    for mine, theirs in zip(opt._v, ref._v):
        got, expected = _f32(mine), theirs.numpy()
        assert (np.abs(got - expected) <= rules._ulp(expected)).all(), mine.path
    for mine, theirs in zip(_factored(opt), _factored(ref)):
        np.testing.assert_allclose(mine.numpy(), theirs.numpy(), rtol=1e-5)


def test_updates_below_half_an_ulp_still_move_the_weights(compact):
    # At lr 1e-4 Adafactor moves a weight by about 1e-4 of the kernel's rms:
    # nearly every update is below half a bfloat16 ulp of its weight.
    model = rules._model(_adafactor(1e-4))
    rules._fit(model)
    kernel = model.get_layer("hidden").kernel
    before = _f32(kernel)
    rules._fit(model, epochs=2)
    assert variables.stored_dtype(kernel) == "bfloat16"
    assert keras_mp.precision_report(model).storage()["net/hidden/kernel"]["below_half_ulp"] \
        >= 0.8
    assert (_f32(kernel) != before).sum() >= 5


def test_under_adaptive_the_weights_follow_their_layers_compute_dtype():
    # Compact weights asked, moments by default (float32 in a small model):
    # where "adaptive" computes in bfloat16 the weights are bfloat16; on a
    # float32-only CPU class (KERAS_MP_TEST_CPU_FLAGS=avx2) nothing is stored
    # compactly.
    keras_mp.config.set_compact_weights(True)
    try:
        model = rules._model(_adafactor(), "adaptive")
        history = rules._fit(model, epochs=2)
    finally:
        keras_mp.config.set_compact_weights(None)
    assert np.isfinite(history.history["loss"]).all()
    hidden = model.get_layer("hidden")
    if os.environ.get("KERAS_MP_TEST_CPU_FLAGS", "").strip().lower() == "avx2":
        assert hidden.compute_dtype == "float32"
    expected = "bfloat16" if hidden.compute_dtype == "bfloat16" else "float32"
    assert rules._dtypes(hidden.trainable_variables) == {expected}, hidden.compute_dtype
    opt = rules._inner(model)
    assert rules._dtypes([*opt._v, *_factored(opt)]) == {"float32"}
    if expected == "float32":
        assert rules._dtypes(model.trainable_variables) == {"float32"}
        assert all(s.get("dtype") == "float32"
                   for s in keras_mp.precision_report(model).storage().values())


@pytest.mark.measured_execution   # the execution mode keras-mp picks, as a user's fit runs
def test_keras_files_load_under_other_policies(compact, tmp_path):
    model = rules._model(_adafactor())
    rules._fit(model)
    model.save(tmp_path / "compact.keras")
    x, _ = rules._data(8)
    expected = np.asarray(model.predict(x, verbose=0))
    for policy in ("float32", "mixed_bfloat16"):      # the global policy at load
        with keras_mp.policy_scope(policy):
            other = keras.saving.load_model(tmp_path / "compact.keras")
        np.testing.assert_array_equal(np.asarray(other.predict(x, verbose=0)), expected)
        assert type(rules._inner(other)) is keras.optimizers.Adafactor
    loaded = keras.saving.load_model(tmp_path / "compact.keras")
    mine = [_f32(v) for v in [*model.weights, *model.optimizer.variables]]
    for a, b in zip([_f32(v) for v in [*loaded.weights, *loaded.optimizer.variables]], mine):
        np.testing.assert_array_equal(a, b)     # the bfloat16 values, exactly
    history = rules._fit(loaded)
    assert np.isfinite(history.history["loss"]).all()
    opt = rules._inner(loaded)
    assert rules._dtypes(loaded.trainable_variables) == rules._dtypes(opt._v) == {"bfloat16"}
    assert rules._dtypes(_factored(opt)) == {"float32"}


def test_backup_and_restore_resumes_bit_for_bit(compact, tmp_path):
    whole = rules._model(_adafactor())
    rules._fit(whole, epochs=4)
    keras.utils.clear_session(free_memory=False)
    first = rules._model(_adafactor())
    with pytest.raises(RuntimeError, match="interrupted"):
        rules._fit(first, epochs=4,
                   callbacks=[keras.callbacks.BackupAndRestore(str(tmp_path / "b")),
                              rules._Interrupt()])
    keras.utils.clear_session(free_memory=False)
    resumed = rules._model(_adafactor())
    rules._fit(resumed, epochs=4,
               callbacks=[keras.callbacks.BackupAndRestore(str(tmp_path / "b"))])
    assert rules._dtypes(resumed.trainable_variables) == {"bfloat16"}
    for a, b in zip(rules._state(resumed), rules._state(whole)):
        np.testing.assert_array_equal(a, b)


def test_a_nan_batch_leaves_weights_and_state_as_they_were(compact):
    model = rules._model(_adafactor())
    rules._fit(model)
    x, y = rules._data(16)
    y[3] = np.nan
    changed = faults.changed_by_a_skipped_fit(model, x, y, rules._state)
    assert rules._dtypes(model.trainable_variables) == {"bfloat16"}
    assert all(np.isfinite(_f32(v)).all() for v in model.trainable_variables)
    assert changed == ["loss_scale_optimizer/skipped_steps",
                       "loss_scale_optimizer/consecutive_skips"], changed
