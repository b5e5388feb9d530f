"""Weights that train, stored in bfloat16 (keras_mp.adaptive.storage.trained,
keras_mp.execution.compact_update).

The update first (float32 Adam on a bfloat16 weight, rounded stochastically:
its mean is float32's, where rounding to nearest loses a small update; AdamW's
decay applied once, in float32), then what ``fit`` does with the switch on:
which weights and gradients, the switch and the override, unsupported
optimizers, the small-learning-rate fine-tune Keras's ``"bfloat16"`` policy
stalls on, a seeded run repeated, ``.keras`` files both ways (into a plain
Keras float32 model), ``BackupAndRestore``, export and quantization.
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


@pytest.fixture
def compact():
    keras_mp.config.set_compact_weights(True)
    yield
    keras_mp.config.set_compact_weights(None)


def _model(policy="adaptive_bfloat16", optimizer=None, seed=0):
    with keras_mp.policy_scope(policy):
        keras.utils.set_random_seed(seed)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, name="hidden"),
                                  keras.layers.Dense(1, name="out")], name="net")
    model.compile(optimizer=optimizer or keras.optimizers.AdamW(1e-2), loss="mse")
    return model


def _data(rows=64):
    x = np.random.default_rng(0).normal(size=(rows, 8)).astype("float32")
    return x, x[:, :1] * 0.5


def _fit(model, epochs=1, **kw):
    x, y = _data()
    return model.fit(x, y, batch_size=16, epochs=epochs, verbose=0, shuffle=False, **kw)


def _dtypes(variables_) -> set[str]:
    return {variables.stored_dtype(v) for v in variables_}


def _state(model) -> list[np.ndarray]:
    return [np.asarray(v.numpy()).astype("float32")
            for v in [*model.weights, *model.optimizer.variables]]


def _storage(model, variable: str) -> dict:
    found = [e for k, e in keras_mp.precision_report(model).storage().items()
             if k.endswith(variable)]
    assert len(found) == 1, variable
    return found[0]


def _built_adam(weight, **kw):
    """An AdamW built on one weight stored in bfloat16."""
    opt = keras.optimizers.AdamW(**kw)
    w = keras.Variable(np.asarray(weight, "float32"))
    variables.store_as(w, "bfloat16")
    opt.build([w])
    return opt, w


def test_the_update_rounds_stochastically_to_float32_adams_mean():
    # Adam's first step moves each weight by lr (m / sqrt(v) = sign(g)): at
    # lr = 2**-12, a quarter of a bfloat16 ulp of 1.0, nearest rounding loses it.
    lr, n = 2.0 ** -12, 8192
    opt, w = _built_adam(np.ones(n), learning_rate=lr, weight_decay=0.0)
    setattr(keras_mp._installed.installed(opt), compact_update.WEIGHTS, {id(w)})
    assert compact_update.compact_weight(opt, w)
    assert compact_update.adam(opt, tf.ones([n], tf.bfloat16), w, lr)
    new = np.asarray(w.numpy()).astype("float64")
    assert set(np.unique(new)) == {1.0 - 2.0 ** -8, 1.0}      # the two neighbours below 1
    assert abs(new.mean() - (1.0 - lr)) < 2e-5                # float32's mean
    naive = tf.cast(tf.ones([n]) - lr, tf.bfloat16)           # nearest rounding: nothing moves
    assert set(np.unique(naive.numpy().astype("float64"))) == {1.0}


def test_adamw_decay_is_applied_once_and_in_float32(compact):
    # lr * wd = 1e-3 of each weight: below half a bfloat16 ulp, so Keras's own
    # decay in the weight's dtype would leave it; applied here, in float32.
    opt, w = _built_adam(np.full(4096, 1.0), learning_rate=1e-2, weight_decay=0.1)
    trained.mark(opt, [w], restored=False)
    assert not opt._use_weight_decay(w)          # Keras's decay skips it
    opt.apply([tf.zeros([4096], tf.bfloat16)], [w])
    mean = float(np.asarray(w.numpy()).astype("float64").mean())
    assert mean == pytest.approx(1.0 - 1e-3, abs=2e-4)   # one decay, no Adam step (g = 0)


def test_fit_stores_trained_weights_and_their_gradients_in_bfloat16(compact):
    model = _model()
    _fit(model)
    assert _dtypes(model.trainable_variables) == {"bfloat16"}
    assert _dtypes(model.optimizer.inner_optimizer._momentums) == {"float32"}
    entry = _storage(model, "hidden/kernel")
    assert (entry["dtype"], entry["reason"]) == ("bfloat16", "trains_compact")
    x, y = _data(16)
    with tf.GradientTape() as tape:
        loss = keras.losses.mean_squared_error(y, model(x, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    assert {g.dtype for g in grads} == {tf.bfloat16}
    # The override keeps one in float32; off, all of them at the next fit.
    keras_mp.config.set_storage(model, model.get_layer("hidden").kernel, "float32")
    _fit(model)
    assert variables.stored_dtype(model.get_layer("hidden").kernel) == "float32"
    assert variables.stored_dtype(model.get_layer("out").kernel) == "bfloat16"
    keras_mp.config.set_compact_weights(False)
    history = _fit(model, epochs=2)
    assert _dtypes(model.trainable_variables) == {"float32"}
    assert np.isfinite(history.history["loss"]).all()


def test_with_compact_moments_the_state_is_eight_bytes_a_parameter(compact):
    keras_mp.config.set_compact_moments(True)
    try:
        model = _model()
        _fit(model, epochs=2)
    finally:
        keras_mp.config.set_compact_moments(None)
    opt = model.optimizer.inner_optimizer
    params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    state = sum(variables.nbytes(v) for v in [*model.trainable_variables, *opt._momentums,
                                                *opt._velocities])
    assert state == 6 * params      # weight 2 + moments 2 + 2; the gradient is 2 more


@pytest.mark.parametrize("policy", ["adaptive_float16", "float32"])
def test_no_bfloat16_compute_no_compact_weights(policy, compact):
    model = _model(policy)
    _fit(model)
    assert _dtypes(model.trainable_variables) == {"float32"}


@pytest.mark.parametrize("optimizer,reason", [
    (lambda: keras.optimizers.SGD(1e-2), "without momentum"),
    (lambda: keras.optimizers.RMSprop(1e-2), "RMSprop"),
    (lambda: keras.optimizers.Lion(1e-3, use_ema=True), "use_ema"),
    (lambda: keras.optimizers.Adam(1e-2, use_ema=True), "use_ema"),
    (lambda: keras.optimizers.Adam(1e-2, gradient_accumulation_steps=2), "accumulation"),
])
def test_other_optimizers_keep_float32_weights(optimizer, reason, compact):
    assert reason in trained.unsupported_reason(optimizer())
    model = _model(optimizer=optimizer())
    _fit(model)
    assert _dtypes(model.trainable_variables) == {"float32"}


def _fine_tune(policy, compact_weights: bool, steps_epochs=6):
    """A pre-trained classifier fine-tuned to a shifted boundary, AdamW 5e-5:
    (loss before, loss after, trained weights' dtypes)."""
    rng = np.random.default_rng(0)
    u = rng.normal(size=16)
    u /= np.linalg.norm(u)
    x = rng.normal(size=(1024, 16)).astype("float32")
    keras.utils.set_random_seed(0)

    def build():
        return keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="relu"),
                                 keras.layers.Dense(1, activation="sigmoid")])
    with keras_mp.policy_scope("float32"):
        pre = build()
        pre.compile(optimizer=keras.optimizers.Adam(1e-2), loss="binary_crossentropy")
        pre.fit(x, (x @ u > 0).astype("float32"), epochs=5, batch_size=64, verbose=0)
    y = (x @ u > 0.6).astype("float32")
    keras_mp.config.set_compact_weights(compact_weights)
    try:
        with keras_mp.policy_scope(policy):   # Keras's own names too
            model = build()
        model.set_weights(pre.get_weights())
        model.compile(optimizer=keras.optimizers.AdamW(5e-5), loss="binary_crossentropy")
        before = model.evaluate(x, y, verbose=0)
        model.fit(x, y, epochs=steps_epochs, batch_size=64, verbose=0)
        return before, model.evaluate(x, y, verbose=0), _dtypes(model.trainable_variables)
    finally:
        keras_mp.config.set_compact_weights(None)


def test_the_small_learning_rate_fine_tune_keras_bfloat16_stalls_on_trains():
    _, keras_float32, _ = _fine_tune("float32", False)
    before, stalled, dtypes = _fine_tune("bfloat16", False)
    assert dtypes == {"bfloat16"} and stalled == before          # Keras: nothing moved
    start, after, dtypes = _fine_tune("adaptive_bfloat16", True)
    assert dtypes == {"bfloat16"}
    assert after < start - 0.5 * (start - keras_float32)
    assert after == pytest.approx(keras_float32, rel=0.02)       # float32's loss


def test_a_seeded_run_repeats_bit_for_bit(compact):
    runs = []
    for _ in range(2):
        keras.utils.clear_session(free_memory=False)
        model = _model()
        _fit(model, epochs=2)
        runs.append(_state(model))
    assert _dtypes(model.trainable_variables) == {"bfloat16"}
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)


@pytest.mark.measured_execution   # the mode keras-mp picks, as a user's fit runs
def test_keras_files_load_both_ways(compact, tmp_path):
    model = _model()
    _fit(model)
    model.save(tmp_path / "compact.keras")
    x, _ = _data(8)
    expected = np.asarray(model.predict(x, verbose=0))
    for policy in ("float32", "mixed_bfloat16", "adaptive_float16"):   # whatever is global
        with keras_mp.policy_scope(policy):
            other = keras.saving.load_model(tmp_path / "compact.keras")
        # The layers' dtypes are the file's (its variables are float32 until the next
        # fit stores them again, their values the file's bfloat16 ones).
        assert [x.compute_dtype for x in other.layers] == \
            [x.compute_dtype for x in model.layers], policy
        np.testing.assert_array_equal(np.asarray(other.predict(x, verbose=0)), expected)
    loaded = keras.saving.load_model(tmp_path / "compact.keras")
    for a, b in zip(_state(loaded), _state(model)):
        np.testing.assert_array_equal(a, b)     # the bfloat16 values, exactly
    _fit(loaded)
    assert _dtypes(loaded.trainable_variables) == {"bfloat16"}
    # Into a plain Keras float32 model of the same architecture, and back.
    plain = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, name="hidden"),
                              keras.layers.Dense(1, name="out")], name="net")
    plain.load_weights(tmp_path / "compact.keras")
    assert _dtypes(plain.weights) == {"float32"}
    for a, b in zip(plain.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, np.asarray(b).astype("float32"))
    plain.save_weights(tmp_path / "plain.weights.h5")
    model.load_weights(tmp_path / "plain.weights.h5")
    assert _dtypes(model.trainable_variables) == {"bfloat16"}


class _Interrupt(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == 1:
            raise RuntimeError("interrupted")


def test_backup_and_restore_resumes_bit_for_bit(compact, tmp_path):
    whole = _model()
    _fit(whole, epochs=4)
    keras.utils.clear_session(free_memory=False)
    first = _model()
    with pytest.raises(RuntimeError, match="interrupted"):
        _fit(first, epochs=4, callbacks=[keras.callbacks.BackupAndRestore(str(tmp_path / "b")),
                                        _Interrupt()])
    keras.utils.clear_session(free_memory=False)
    resumed = _model()
    _fit(resumed, epochs=4, callbacks=[keras.callbacks.BackupAndRestore(str(tmp_path / "b"))])
    assert _dtypes(resumed.trainable_variables) == {"bfloat16"}
    for a, b in zip(_state(resumed), _state(whole)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.measured_execution
def test_export_and_quantize_a_model_with_compact_weights(compact, tmp_path):
    model = _model()
    _fit(model)
    x, _ = _data(4)
    expected = np.asarray(model.predict(x, verbose=0)).astype("float32")
    model.export(str(tmp_path / "saved"), verbose=False)
    reloaded = tf.saved_model.load(str(tmp_path / "saved"))   # kept: it owns the variables
    served = reloaded.serve(tf.constant(x))
    np.testing.assert_allclose(np.asarray(served).astype("float32"), expected, atol=1e-6)
    model.quantize("int8")
    quantized = np.asarray(model.predict(x, verbose=0)).astype("float32")
    assert np.isfinite(quantized).all()
    assert np.abs(quantized - expected).max() < 0.1 * (np.abs(expected).max() + 1e-3)


def _depends_on(tensor, placeholder) -> bool:
    seen, stack = set(), [tensor.op]
    while stack:
        op = stack.pop()
        if op is placeholder.op:
            return True
        if op.name not in seen:
            seen.add(op.name)
            stack.extend(t.op for t in op.inputs)
    return False


def test_the_rounding_numbers_are_never_a_constant_of_the_graph():
    # A graph's element index would be folded into a constant of 4 bytes per
    # element, kept with the graph (400 MiB on benchmarks/llm_memory.py's Llama):
    # outside XLA, the count is a value of the run; XLA's numbers are the same.
    def numbers(step, compiled):
        return compact_update.dither((300, 7), step, 5, compact_update.WEIGHT_SALT,
                                     compiled=compiled)
    graph = tf.function(lambda step: numbers(step, False)).get_concrete_function(
        tf.TensorSpec([], tf.int64))
    step = graph.graph.inputs[0]
    ranges = [op for op in graph.graph.get_operations() if op.type == "Range"
              and (op.outputs[0].shape.num_elements() or 2100) > 2]   # not reduce_prod's axes
    assert ranges and all(_depends_on(op.inputs[1], step) for op in ranges)
    xla = tf.function(lambda step: numbers(step, True), jit_compile=True)
    for s in (0, 1, 70000):
        np.testing.assert_array_equal(graph(tf.constant(s, tf.int64)).numpy(),
                                      xla(tf.constant(s, tf.int64)).numpy())


def test_an_embeddings_sparse_gradient_takes_the_float32_update(compact):
    # Rows no batch reaches only decay: lr * wd = 1e-3 of themselves a step,
    # below half a bfloat16 ulp; with the table in bfloat16, the float32
    # update keeps that decay on average.
    with keras_mp.policy_scope("adaptive_bfloat16"):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((2,), dtype="int32"),
                                  keras.layers.Embedding(64, 256, name="table",
                                                         embeddings_initializer="ones"),
                                  keras.layers.GlobalAveragePooling1D(),
                                  keras.layers.Dense(1, name="out")])
    model.compile(optimizer=keras.optimizers.AdamW(1e-2, weight_decay=0.1), loss="mse")
    ids = np.zeros((32, 2), "int32")            # only row 0 is ever looked up
    model.fit(ids, np.ones((32, 1)), batch_size=8, epochs=5, verbose=0)   # 20 steps
    table = model.get_layer("table").embeddings
    assert variables.stored_dtype(table) == "bfloat16"
    rest = np.asarray(table.numpy()).astype("float64")[1:]
    assert rest.mean() == pytest.approx((1 - 1e-3) ** 20, abs=2e-3)


@pytest.mark.parametrize("tie_weights, reverse_dtype", [(False, None), (False, "float32"),
                                                        (True, "float32")])
def test_a_logits_kernel_read_in_float32_trains_compactly(tie_weights, reverse_dtype, compact):
    # A ReversibleEmbedding computes its logits in float32 (its untied kernel
    # is read as the float32 variable; ``reverse_dtype`` casts it): stored in
    # bfloat16 it trains compactly, its logits still float32 from the kernel's
    # bfloat16 value. Frozen, it stays float32.
    with keras_mp.policy_scope("adaptive_bfloat16"):
        keras.utils.set_random_seed(0)
        ids = keras.Input((4,), dtype="int32")
        table = keras.layers.ReversibleEmbedding(32, 8, tie_weights=tie_weights, name="table",
                                                 reverse_dtype=reverse_dtype)
        logits = table(keras.layers.Dense(8, name="mix")(table(ids)), reverse=True)
        model = keras.Model(ids, logits)
    model.compile(optimizer=keras.optimizers.AdamW(1e-2), loss=keras.losses.
                  SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.default_rng(0).integers(0, 32, (64, 4)).astype("int32")
    history = model.fit(x, x, batch_size=16, epochs=3, verbose=0)
    kernel = table.embeddings if tie_weights else table.reverse_embeddings
    entry = _storage(model, "table/" + ("embeddings" if tie_weights else "reverse_embeddings"))
    assert (entry["dtype"], entry["reason"]) == ("bfloat16", "trains_compact")
    assert variables.stored_dtype(kernel) == "bfloat16"
    assert np.isfinite(history.history["loss"]).all()
    assert history.history["loss"][-1] < history.history["loss"][0]
    out = model.predict(x[:4], verbose=0)
    assert out.dtype == np.float32                  # the logits stay float32
    h = model.get_layer("mix")(table(x[:4]))
    expected = keras.ops.matmul(keras.ops.cast(h, "float32"), keras.ops.cast(
        keras.ops.transpose(kernel) if tie_weights else kernel, "float32"))
    np.testing.assert_allclose(out, np.asarray(expected), rtol=1e-6, atol=1e-6)
    table.trainable = False
    model.compile(optimizer=keras.optimizers.AdamW(1e-2), loss=keras.losses.
                  SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, x, batch_size=16, epochs=1, verbose=0)
    entry = _storage(model, "table/reverse_embeddings") if not tie_weights else None
    if entry is not None:
        assert (entry["dtype"], entry["reason"]) == ("float32", "read_in_float32")


@pytest.mark.measured_execution   # the execution mode keras-mp picks here, as a user gets it
@pytest.mark.parametrize("global_policy", ["float32", "mixed_float16"])
def test_a_compact_logits_kernel_saves_loads_exports_and_quantizes(global_policy, compact,
                                                                    tmp_path):
    with keras_mp.policy_scope("adaptive_bfloat16"):
        keras.utils.set_random_seed(0)
        ids = keras.Input((4,), dtype="int32")
        table = keras.layers.ReversibleEmbedding(32, 8, tie_weights=False, name="table")
        model = keras.Model(ids, table(keras.layers.Dense(8, name="mix")(table(ids)),
                                       reverse=True))
    model.compile(optimizer=keras.optimizers.AdamW(1e-2), loss=keras.losses.
                  SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.default_rng(0).integers(0, 32, (64, 4)).astype("int32")
    model.fit(x, x, batch_size=16, epochs=2, verbose=0)
    assert variables.stored_dtype(table.reverse_embeddings) == "bfloat16"
    expected = np.asarray(model.predict(x[:8], verbose=0)).astype("float32")
    computes = {layer.name: layer.compute_dtype for layer in model.layers[1:]}  # not the input
    model.save(tmp_path / "m.keras")
    keras.mixed_precision.set_global_policy(global_policy)   # reset by conftest
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    # Loaded with the saved compute dtypes and values (variables float32 until
    # its next fit stores them again).
    assert {layer.name: layer.compute_dtype for layer in loaded.layers[1:]} == computes
    np.testing.assert_array_equal(
        np.asarray(loaded.predict(x[:8], verbose=0)).astype("float32"), expected)
    model.export(str(tmp_path / "saved"), verbose=False)
    reloaded = tf.saved_model.load(str(tmp_path / "saved"))   # kept: it owns the variables
    np.testing.assert_allclose(np.asarray(reloaded.serve(tf.constant(x[:8]))).astype("float32"),
                               expected, atol=1e-6)
    loaded.fit(x, x, batch_size=16, epochs=1, verbose=0)
    assert variables.stored_dtype(loaded.get_layer("table").reverse_embeddings) == "bfloat16"
    expected = np.asarray(loaded.predict(x[:8], verbose=0)).astype("float32")
    keras_mp.quantize(loaded, "int8")   # Keras's own refuses a float16 model (mixed_float16)
    quantized = np.asarray(loaded.predict(x[:8], verbose=0)).astype("float32")
    assert np.isfinite(quantized).all()
    assert np.abs(quantized - expected).max() < 0.1 * (np.abs(expected).max() + 1e-3)


def test_a_tied_logits_kernel_read_by_a_transpose_stays_float32(compact):
    # Tied, with ``reverse_dtype=None``, the logits take the table's dtype
    # through its transpose: a bfloat16 table would make them bfloat16.
    with keras_mp.policy_scope("adaptive_bfloat16"):
        ids = keras.Input((4,), dtype="int32")
        table = keras.layers.ReversibleEmbedding(32, 8, name="table")
        model = keras.Model(ids, table(keras.layers.Dense(8)(table(ids)), reverse=True))
    model.compile(optimizer=keras.optimizers.AdamW(1e-2), loss=keras.losses.
                  SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.default_rng(0).integers(0, 32, (32, 4)).astype("int32")
    model.fit(x, x, batch_size=16, verbose=0)
    entry = _storage(model, "table/embeddings")
    assert (entry["dtype"], entry["reason"]) == ("float32", "read_in_float32")
    assert model.predict(x[:2], verbose=0).dtype == np.float32


@pytest.mark.parametrize("stored", ["weight", "moments"])
def test_a_sparse_gradient_updates_as_keras_adam_does(stored):
    # Row 1 is looked up twice: Keras's Adam makes the gradient dense and its
    # second moment from each lookup's square (1 + 1, not (1 + 1) ** 2).
    values = tf.constant([[1.0, 1.0], [1.0, 1.0], [2.0, 2.0]])
    indices = tf.constant([1, 1, 2])
    results = []
    for compact_state in (False, True):
        opt = keras.optimizers.Adam(0.1)
        w = keras.Variable(np.ones((4, 2), "float32"))
        if compact_state and stored == "weight":
            variables.store_as(w, "bfloat16")
        opt.build([w])
        if compact_state and stored == "weight":
            setattr(keras_mp._installed.installed(opt), compact_update.WEIGHTS, {id(w)})
        elif compact_state:
            for slot in (opt._momentums[0], opt._velocities[0]):
                variables.store_as(slot, "bfloat16")
        for _ in range(3):
            gradient = tf.IndexedSlices(tf.cast(values, w.dtype), indices, tf.constant([4, 2]))
            if compact_state:
                assert compact_update.adam(opt, gradient, w, 0.1)
                opt.iterations.assign_add(1)
            else:
                opt.apply([gradient], [w])              # Keras's own, float32
        results.append([np.asarray(x.numpy()).astype("float32")
                        for x in (w, opt._momentums[0], opt._velocities[0])])
    for keras_value, compact_value in zip(*results):
        np.testing.assert_allclose(compact_value, keras_value, rtol=2e-2, atol=1e-3)
    assert not np.array_equal(results[1][0][1], np.ones(2))      # the rows moved


class Subclassed(keras.Model):
    """keras.io's way: layers built at the first call, a train_step of its own."""

    def __init__(self, custom_step: bool):
        super().__init__()
        self.hidden = keras.layers.Dense(16, activation="relu")
        self.out = keras.layers.Dense(1)
        self.custom_step = custom_step

    def call(self, x):
        return self.out(self.hidden(x))

    def train_step(self, data):
        if not self.custom_step:
            return super().train_step(data)
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


@pytest.mark.parametrize("custom_step", [False, True], ids=["keras_step", "custom_step"])
def test_a_subclassed_model_is_stored_compactly_from_its_second_fit(custom_step, compact):
    # Built by its first fit, after that fit stored its weights: the second
    # stores them in bfloat16 and indexes the optimizer's variables again.
    with keras_mp.policy_scope("adaptive_bfloat16"):
        keras.utils.set_random_seed(0)
        model = Subclassed(custom_step)
    model.compile(optimizer=keras.optimizers.AdamW(1e-2), loss="mse")
    x, y = _data(256)
    model.fit(x, y, epochs=1, verbose=0)
    assert _dtypes(model.trainable_variables) == {"float32"}
    before = model.evaluate(x, y, verbose=0)
    model.fit(x, y, epochs=4, verbose=0)
    assert _dtypes(model.trainable_variables) == {"bfloat16"}
    assert _dtypes(model.optimizer.inner_optimizer._momentums) == {"float32"}
    assert model.evaluate(x, y, verbose=0) < 0.8 * before


@pytest.mark.parametrize("clipping", [dict(clipnorm=1.0), dict(global_clipnorm=1.0),
                                      dict(clipvalue=0.5)], ids=str)
def test_gradient_clipping_works_on_bfloat16_gradients(clipping, compact):
    model = _model(optimizer=keras.optimizers.AdamW(1e-2, **clipping))
    history = _fit(model, epochs=3)
    assert _dtypes(model.trainable_variables) == {"bfloat16"}
    losses = history.history["loss"]
    assert np.isfinite(losses).all() and losses[-1] < losses[0]


def test_adaptation_runs_over_compact_weights(compact):
    # The statistics step and the float32 probe both run on bfloat16 weights.
    callback = keras_mp.callbacks.AdaptivePrecision(interval=1000, statistics_every=2,
                                                    probe_every=2, first_decision=None)
    model = _model()
    x, y = _data()
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[callback])
    assert _dtypes(model.trainable_variables) == {"bfloat16"}
    assert np.isfinite(history.history["loss"]).all()
    evidence = callback._stats.read()
    assert evidence.steps == 4 and evidence.probe_steps >= 1     # 8 calls


def test_a_nan_batch_leaves_compact_weights_as_they_were(compact):
    model = _model()
    _fit(model)
    x, y = _data(16)
    x[3] = np.nan
    changed = faults.changed_by_a_skipped_fit(model, x, y, _state)   # its one step skipped
    assert _dtypes(model.trainable_variables) == {"bfloat16"}
    # Weights, moments and iterations as they were; only the skip counters count it.
    assert changed == ["loss_scale_optimizer/skipped_steps",
                       "loss_scale_optimizer/consecutive_skips"], changed


@pytest.mark.parametrize("learning_rate, lost", [(1e-6, (0.95, 1.0)), (1e-1, (0.0, 0.05))])
def test_the_report_gives_each_compact_weights_update_to_ulp_statistic(compact, learning_rate,
                                                                        lost):
    # The fraction of a weight's last update below half a bfloat16 ulp: what
    # rounding to nearest would have lost (all of a tiny step, none of a big one).
    model = _model(optimizer=keras.optimizers.Adam(learning_rate))
    _fit(model)
    entry = keras_mp.precision_report(model).storage()["net/hidden/kernel"]
    assert entry["dtype"] == "bfloat16"
    assert lost[0] <= entry["below_half_ulp"] <= lost[1], entry
    assert keras_mp.precision_report(model).storage()["net/hidden/bias"]["below_half_ulp"] \
        is not None


def test_the_statistic_is_kept_across_fits_whatever_its_value(compact):
    # A train step traced in one fit assigns the place made for it; the next
    # fit keeps that place, also where the statistic is exactly 0 (no update
    # below half an ulp), which a truth test would have read as missing.
    model = _model(optimizer=keras.optimizers.Adam(1e-1))
    _fit(model)
    opt = model.optimizer.inner_optimizer if hasattr(model.optimizer, "inner_optimizer") \
        else model.optimizer
    kernel = model.get_layer("hidden").kernel
    places = dict(getattr(keras_mp._installed.installed(opt), compact_update.STATISTICS))
    for place in places.values():
        place.assign(0.0)
    compact_update.keep_statistics(opt, [kernel])
    kept = getattr(keras_mp._installed.installed(opt), compact_update.STATISTICS)
    assert all(kept[k] is places[k] for k in kept) and kept
    assert compact_update.statistic(opt, kernel) == 0.0
    _fit(model)
    assert compact_update.statistic(opt, kernel) < 0.05
