"""Adam's and AdamW's moments in bfloat16, the update in float32
(keras_mp.adaptive.storage.moments, keras_mp.execution.compact_update).

The rounding first (dithered rounding follows a decaying second moment that
rounding to nearest freezes), then the update against Keras's float32 Adam,
then what fit does with the switch on, under "adaptive" and
"adaptive_float16": which moments, the switch and the override, a seeded
run repeated, .keras files both ways and BackupAndRestore.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mp
from keras_mp.adaptive.storage import moments, variables
from keras_mp.execution import compact_update, native_update

POLICIES = ("adaptive", "adaptive_float16")

pytestmark = pytest.mark.usefixtures("adapt_every_fit")


@pytest.fixture
def compact():
    keras_mp.config.set_compact_moments(True)
    yield
    keras_mp.config.set_compact_moments(None)


def test_dithered_rounding_follows_what_nearest_rounding_freezes():
    """Adam's second moment with no gradient decays by beta_2 = 0.999 a step:
    0.999 ** 2000 = 0.135. Rounded to nearest bfloat16 each step it never
    leaves 1.0; dithered, it ends within 2 % of float32's value."""
    start = tf.ones((4096,), tf.bfloat16)
    nearest, dithered = start, start
    for step in range(2000):
        nearest = tf.cast(tf.cast(nearest, tf.float32) * 0.999, tf.bfloat16)
        x = tf.cast(dithered, tf.float32) * 0.999
        dithered = compact_update.dithered(x, compact_update.dither(x.shape, step, 3, 0))
    assert float(tf.reduce_max(tf.cast(nearest, tf.float32))) == 1.0
    mean = float(tf.reduce_mean(tf.cast(dithered, tf.float32)))
    assert abs(mean / 0.999 ** 2000 - 1) < 0.02


def test_the_update_is_float32_adams():
    """From zero moments the first step moves the weights as Keras's Adam
    with float32 moments does (the rounding only touches what is stored);
    the next steps read rounded moments: within 1 % of a step."""
    rng = np.random.default_rng(0)
    w0 = rng.normal(size=(64, 32)).astype("float32")
    grads = [rng.normal(size=(64, 32)).astype("float32") * 1e-3 for _ in range(3)]
    moved: dict[str, list[np.ndarray]] = {}
    for dtype in ("float32", "bfloat16"):
        w = keras.Variable(w0)
        opt = keras.optimizers.Adam(1e-2)
        opt.build([w])
        for slot in (opt._momentums[0], opt._velocities[0]):
            variables.store_as(slot, dtype)
        assert native_update.install(opt)
        moved[dtype] = []
        for g in grads:
            opt.apply([tf.constant(g)], [w])
            moved[dtype].append(np.asarray(w.numpy()) - w0)
        assert str(opt._momentums[0].dtype) == dtype
    first, last = (np.abs(moved["bfloat16"][i] - moved["float32"][i]).max() for i in (0, -1))
    assert first < 1e-6 and 0 < last < 0.01 * 1e-2 * len(grads)
    assert np.abs(moved["float32"][-1]).max() > 1e-2


def _model(policy, optimizer=None):
    with keras_mp.policy_scope(policy):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, name="hidden"),
                                  keras.layers.Dense(1, name="out")], name="net")
    model.compile(optimizer=optimizer or keras.optimizers.AdamW(1e-2), loss="mse")
    return model


def _fit(model, epochs=1, **kw):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    return model.fit(x, x[:, :1] * 0.5, batch_size=16, epochs=epochs, verbose=0,
                     shuffle=False, **kw)


def _slot_dtypes(model) -> set[str]:
    opt = model.optimizer.inner_optimizer
    return {str(v.dtype) for v in [*opt._momentums, *opt._velocities]}


def _storage(model, variable: str) -> dict:
    """The report's storage entry of ``layer/variable`` (the model's name before it)."""
    found = [e for k, e in keras_mp.precision_report(model).storage().items()
             if k.endswith(variable)]
    assert len(found) == 1, variable
    return found[0]


def _state(model) -> list[np.ndarray]:
    return [np.asarray(v.numpy()).astype("float32")
            for v in [*model.weights, *model.optimizer.variables]]


@pytest.mark.parametrize("policy", POLICIES)
def test_fit_stores_adams_moments_in_bfloat16(policy, compact):
    model = _model(policy)
    _fit(model)
    assert _slot_dtypes(model) == {"bfloat16"}
    assert {str(v.dtype) for v in model.trainable_variables} == {"float32"}
    assert _storage(model, "hidden/kernel")["moments"] == "bfloat16"
    # The override keeps one variable's moments in float32; off, all of them.
    keras_mp.config.set_storage(model, model.get_layer("hidden").kernel, "float32")
    _fit(model)
    i = model.optimizer.inner_optimizer._get_variable_index(model.get_layer("hidden").kernel)
    assert variables.stored_dtype(model.optimizer.inner_optimizer._momentums[i]) == "float32"
    keras_mp.config.set_compact_moments(False)
    _fit(model)
    assert _slot_dtypes(model) == {"float32"}
    assert _storage(model, "out/kernel")["moments"] == "float32"


@pytest.mark.parametrize("policy", POLICIES)
def test_adamw_decays_a_float32_weight_once_inside_the_update(policy, compact):
    # Keras decays each weight before its update (a temporary of the
    # weight's size); with compact moments the update does it in float32,
    # and Keras's is left out: the same fit as Keras's AdamW within rounding.
    models = []
    for compact_moments in (True, False):
        keras_mp.config.set_compact_moments(compact_moments)
        model = _model(policy, keras.optimizers.AdamW(1e-2, weight_decay=0.5))
        _fit(model, epochs=3)
        models.append(model)
    opt = models[0].optimizer.inner_optimizer
    kernel = models[0].get_layer("hidden").kernel
    assert variables.stored_dtype(kernel) == "float32" and not opt._use_weight_decay(kernel)
    assert variables.stored_dtype(opt._momentums[0]) == "bfloat16"
    for compact_weight, keras_weight in zip(models[0].weights, models[1].weights):
        np.testing.assert_allclose(compact_weight.numpy(), keras_weight.numpy(), atol=2e-3)
    assert np.abs(models[0].get_layer("out").kernel.numpy()).max() > 0.01


def test_other_optimizers_keep_their_moments():
    assert "AMSGrad" in moments.unsupported_reason(keras.optimizers.Adam(amsgrad=True))
    assert "RMSprop" in moments.unsupported_reason(keras.optimizers.RMSprop())
    assert "without momentum" in moments.unsupported_reason(keras.optimizers.SGD(1e-2))
    keras_mp.config.set_compact_moments(True)
    try:
        model = _model("adaptive", keras.optimizers.RMSprop(1e-2))
        _fit(model)
        opt = model.optimizer.inner_optimizer
        assert {str(v.dtype) for v in opt._velocities} == {"float32"}
        assert not native_update.is_installed(opt)
    finally:
        keras_mp.config.set_compact_moments(None)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_seeded_run_repeats_bit_for_bit(policy, compact):
    runs = []
    for _ in range(2):
        keras.utils.clear_session(free_memory=False)
        model = _model(policy)
        _fit(model, epochs=2)
        runs.append(_state(model))
    assert _slot_dtypes(model) == {"bfloat16"}
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("policy", POLICIES)
def test_keras_files_carry_the_moments_both_ways(policy, compact, tmp_path):
    model = _model(policy)
    _fit(model)
    model.save(tmp_path / "compact.keras")
    loaded = keras.saving.load_model(tmp_path / "compact.keras")
    for a, b in zip(_state(loaded), _state(model)):
        np.testing.assert_array_equal(a, b)     # bfloat16 values, exactly
    _fit(loaded)
    assert _slot_dtypes(loaded) == {"bfloat16"}
    # A file with float32 moments into a model with compact ones.
    keras_mp.config.set_compact_moments(False)
    wide = _model(policy)
    _fit(wide)
    wide.save(tmp_path / "wide.keras")
    keras_mp.config.set_compact_moments(True)
    model.load_weights(tmp_path / "wide.keras")
    assert _slot_dtypes(model) == {"bfloat16"}
    opt, ref = model.optimizer.inner_optimizer, wide.optimizer.inner_optimizer
    np.testing.assert_array_equal(
        np.asarray(opt._velocities[0].numpy()).astype("float32"),
        np.asarray(ref._velocities[0].numpy()).astype("bfloat16").astype("float32"))


class _Interrupt(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == 1:
            raise RuntimeError("interrupted")


@pytest.mark.parametrize("policy", POLICIES)
def test_backup_and_restore_resumes_bit_for_bit(policy, compact, tmp_path):
    whole = _model(policy)
    _fit(whole, epochs=4)
    keras.utils.clear_session(free_memory=False)
    first = _model(policy)
    with pytest.raises(RuntimeError, match="interrupted"):
        _fit(first, epochs=4, callbacks=[keras.callbacks.BackupAndRestore(str(tmp_path / "b")),
                                        _Interrupt()])
    keras.utils.clear_session(free_memory=False)
    resumed = _model(policy)
    _fit(resumed, epochs=4, callbacks=[keras.callbacks.BackupAndRestore(str(tmp_path / "b"))])
    assert _slot_dtypes(resumed) == {"bfloat16"}
    for a, b in zip(_state(resumed), _state(whole)):
        np.testing.assert_array_equal(a, b)


#: Keras's other stateful optimizers whose moments can be compact
#: (keras_mp.execution.compact_rules).
OTHERS = {"sgd_momentum": lambda: keras.optimizers.SGD(1e-2, momentum=0.9),
          "adamax": lambda: keras.optimizers.Adamax(1e-2),
          "nadam": lambda: keras.optimizers.Nadam(1e-2),
          "lion": lambda: keras.optimizers.Lion(1e-3)}


def _other_slots(model) -> list:
    opt = model.optimizer.inner_optimizer
    return [s for name in compact_update.SLOTS[type(opt)] for s in getattr(opt, name)]


@pytest.mark.parametrize("name", sorted(OTHERS))
def test_a_nan_batch_leaves_other_optimizers_compact_state_as_it_was(name, compact):
    model = _model("adaptive", OTHERS[name]())
    _fit(model)
    before = [np.asarray(v.numpy()).astype("float32")
              for v in [*model.weights, *_other_slots(model)]]
    x = np.full((16, 8), np.nan, "float32")
    model.fit(x, np.zeros((16, 1), "float32"), batch_size=16, verbose=0)   # one skipped step
    after = [np.asarray(v.numpy()).astype("float32")
             for v in [*model.weights, *_other_slots(model)]]
    assert {variables.stored_dtype(s) for s in _other_slots(model)} == {"bfloat16"}
    for a, b in zip(after, before):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", sorted(OTHERS))
def test_other_optimizers_train_on_compact_moments(name, compact, tmp_path):
    """Slots in bfloat16 after fit, the loss falling, the report saying so, a
    seeded fit repeated bit for bit and a .keras file carrying the state."""
    runs = []
    for _ in range(2):
        keras.utils.clear_session(free_memory=False)
        model = _model("adaptive", OTHERS[name]())
        losses = _fit(model, epochs=3).history["loss"]
        runs.append(_state(model))
    assert {str(s.dtype) for s in _other_slots(model)} == {"bfloat16"}
    assert np.isfinite(losses).all() and losses[-1] < 0.9 * losses[0], losses
    assert _storage(model, "hidden/kernel")["moments"] == "bfloat16"
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)
    model.save(tmp_path / "other.keras")
    loaded = keras.saving.load_model(tmp_path / "other.keras")
    assert type(loaded.optimizer.inner_optimizer) is type(model.optimizer.inner_optimizer)
    for a, b in zip(_state(loaded), _state(model)):
        np.testing.assert_array_equal(a, b)     # bfloat16 values, exactly
    _fit(loaded)
    assert {str(s.dtype) for s in _other_slots(loaded)} == {"bfloat16"}
