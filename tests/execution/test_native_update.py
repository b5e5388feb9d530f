"""keras_mp.execution.native_update: Keras's Adam, AdamW and SGD updates as
TensorFlow's fused kernels, equal to Keras's own update, and the fallbacks."""

import gc
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mp
from keras_mp import execution
from keras_mp.execution import native_update

OPTIMIZERS = [
    ("adam", lambda: keras.optimizers.Adam(0.01)),
    ("adam_amsgrad", lambda: keras.optimizers.Adam(0.01, amsgrad=True)),
    ("adamw", lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1)),
    ("adamw_schedule", lambda: keras.optimizers.AdamW(
        keras.optimizers.schedules.ExponentialDecay(0.01, 2, 0.5), beta_1=0.8, epsilon=1e-3)),
    ("sgd", lambda: keras.optimizers.SGD(0.1)),
    ("sgd_momentum", lambda: keras.optimizers.SGD(0.1, momentum=0.9)),
    ("sgd_nesterov", lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True)),
    # Keras calls update_step with the accumulated gradient (its step count
    # is iterations // steps) and updates the moving average after it.
    ("adam_accumulate", lambda: keras.optimizers.Adam(0.01, gradient_accumulation_steps=3)),
    ("sgd_momentum_accumulate_ema", lambda: keras.optimizers.SGD(
        0.1, momentum=0.9, gradient_accumulation_steps=2, use_ema=True,
        ema_overwrite_frequency=2)),
    ("adamw_ema", lambda: keras.optimizers.AdamW(0.01, use_ema=True, ema_momentum=0.5)),
]


def _variables():
    rng = np.random.default_rng(0)
    return [keras.Variable(rng.standard_normal(shape).astype("float32"))
            for shape in ((3, 4), (4,))]


def _gradients(step):
    rng = np.random.default_rng(step + 1)
    # Tiny and large values: where rounding order shows, if anywhere.
    return [tf.constant((rng.standard_normal(shape) * 10.0 ** rng.integers(-6, 3, shape))
                        .astype("float32")) for shape in ((3, 4), (4,))]


def _run(make, native, steps=6, graph=True):
    opt, variables = make(), _variables()
    opt.build(variables)
    if native:
        assert native_update.install(opt)
    apply = tf.function(lambda g: opt.apply(g, variables), autograph=False) if graph else (
        lambda g: opt.apply(g, variables))
    for step in range(steps):
        apply(_gradients(step))
    return [v.numpy() for v in variables], [v.numpy() for v in opt.variables]


@pytest.mark.parametrize("graph", [True, False], ids=["graph", "eager"])
@pytest.mark.parametrize("name, make", OPTIMIZERS, ids=[n for n, _ in OPTIMIZERS])
def test_the_native_kernel_computes_what_keras_computes(name, make, graph):
    (w_keras, s_keras), (w_native, s_native) = _run(make, False, graph=graph), _run(
        make, True, graph=graph)
    # Adam's kernel takes 1 - beta in float32 from float32 beta (for 0.999:
    # 0.99998713e-3, Keras 1e-3): a relative 1.3e-5 on the second moment.
    rtol = 3e-5 if name.startswith("adam") else 2e-6
    for a, b in zip(w_keras + s_keras, w_native + s_native):
        np.testing.assert_allclose(b, a, rtol=rtol, atol=1e-7)


def test_adam_kernel_against_the_formula_in_float64():
    g = np.array([1e-6, 1e-3, 1.0, 100.0, -3.0], "float32")
    opt, w = keras.optimizers.Adam(0.01), keras.Variable(np.ones((5,), "float32"))
    opt.build([w])
    native_update.install(opt)
    m = v = np.zeros(5)
    expected = np.ones(5)
    for t in range(1, 6):
        opt.apply([tf.constant(g * t)], [w])
        m = m + (g * t - m) * 0.1
        v = v + ((g * t) ** 2 - v) * 0.001
        expected = expected - 0.01 * np.sqrt(1 - 0.999**t) / (1 - 0.9**t) * m / (
            np.sqrt(v) + 1e-7)
    np.testing.assert_allclose(w.numpy(), expected, rtol=1e-6)


def _ops_of(fn) -> set[str]:
    """The op types of ``fn`` traced, nested functions included."""
    graph_def = tf.function(fn, autograph=False).get_concrete_function().graph.as_graph_def()
    ops = {node.op for node in graph_def.node}
    for function in graph_def.library.function:
        ops.update(node.op for node in function.node_def)
    return ops


def test_the_update_is_one_kernel_per_variable():
    opt, variables = keras.optimizers.Adam(), _variables()
    opt.build(variables)
    grads = _gradients(0)
    keras_ops = _ops_of(lambda: opt.apply(grads, variables))
    assert "ResourceApplyAdam" not in keras_ops and "Sqrt" in keras_ops
    assert native_update.install(opt) and native_update.install(opt)  # idempotent
    ops = _ops_of(lambda: opt.apply(grads, variables))
    assert "ResourceApplyAdam" in ops and "Sqrt" not in ops


def test_what_has_no_native_kernel_runs_keras_update():
    assert native_update.install(keras.optimizers.RMSprop()) is False
    assert "RMSprop has no native update kernel" in native_update.unsupported_reason(
        keras.optimizers.RMSprop())

    class MyAdam(keras.optimizers.Adam):  # may change update_step: not ours to replace
        pass
    assert "MyAdam has no native update kernel" in native_update.unsupported_reason(MyAdam())
    assert not native_update.is_installed(keras.optimizers.Adam())
    # A loss-scale wrapper counts as its inner optimizer.
    inner = keras.optimizers.Adam()
    wrapper = keras_mp.LossScaleOptimizer(inner)
    assert native_update.install(wrapper) and native_update.is_installed(inner)
    assert native_update.is_installed(wrapper)


def test_sparse_gradients_and_16_bit_variables_take_keras_path():
    # An embedding's gradient (IndexedSlices) and a bfloat16 variable: Keras's
    # update_step, with the same result as without the kernel.
    def run(native):
        table = keras.Variable(np.ones((5, 2), "float32"))
        half = keras.Variable(np.ones((3,), "float32"), dtype="bfloat16")
        opt = keras.optimizers.Adam(0.1)
        opt.build([table, half])
        if native:
            native_update.install(opt)
        sparse = tf.IndexedSlices(tf.ones((2, 2)), tf.constant([0, 3]), tf.constant([5, 2]))
        for _ in range(3):
            opt.apply([sparse, tf.ones((3,), "bfloat16")], [table, half])
        return table.numpy(), half.numpy().astype("float32")
    for a, b in zip(run(False), run(True)):
        np.testing.assert_array_equal(a, b)


def test_under_a_distribution_strategy_keras_update_runs():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        w = keras.Variable(np.ones((3,), "float32"))
        opt = keras.optimizers.SGD(0.5, momentum=0.5)
        opt.build([w])
    assert native_update.install(opt)

    @tf.function
    def step():
        strategy.run(lambda: opt.apply([tf.ones((3,))], [w]))
    step()
    step()
    np.testing.assert_allclose(w.numpy(), [1 - 0.5 - 0.75] * 3)  # m = -0.5, then -0.75


def _mlp(optimizer="adam"):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(3)])
    model.compile(optimizer=optimizer, loss="mse")
    return model


def _data():
    rng = np.random.default_rng(0)
    return rng.standard_normal((64, 8)).astype("float32"), rng.standard_normal(
        (64, 3)).astype("float32")


def test_configure_installs_it_and_skips_the_update_under_xla(tmp_path):
    x, y = _data()
    plain = _mlp()
    plain.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    model = _mlp()
    assert execution.reasons.update_native(model) == \
        "the Adam update runs as one TensorFlow kernel per variable"
    assert "xla_update" not in execution.candidate_modes(model)
    assert execution.configure(model, mode="graph") == "graph"
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    assert native_update.is_installed(model.optimizer)
    for a, b in zip(plain.weights, model.weights):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-5, atol=1e-6)
    # Nothing new to save, load or export.
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0),
                               rtol=1e-6)
    assert type(loaded.optimizer) is keras.optimizers.Adam
    model.export(str(tmp_path / "saved"), verbose=False)
    served = tf.saved_model.load(str(tmp_path / "saved"))
    np.testing.assert_allclose(served.serve(x).numpy(), model.predict(x, verbose=0), rtol=1e-6)
    # "keep" is Keras's train step as compiled: no kernel.
    kept = _mlp()
    execution.configure(kept, mode="keep")
    kept.fit(x, y, batch_size=16, verbose=0)
    assert not native_update.is_installed(kept.optimizer)


def test_a_resumed_run_continues_the_same_update(tmp_path):
    # The optimizer's variables (moments, iterations) are Keras's: a checkpoint
    # written with the kernel resumes exactly where it stopped.
    x, y = _data()
    straight = _mlp()
    execution.configure(straight, mode="graph")
    straight.fit(x, y, batch_size=16, epochs=4, verbose=0, shuffle=False)
    first = _mlp()
    execution.configure(first, mode="graph")
    first.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    path = str(tmp_path / "w.weights.h5")
    first.save_weights(path)
    second = _mlp()
    execution.configure(second, mode="graph")
    second.optimizer.build(second.trainable_variables)
    second.load_weights(path)
    assert second.optimizer.iterations.numpy() == 8
    second.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    for a, b in zip(straight.weights, second.weights):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-6, atol=1e-7)


def _train_steps():
    from tensorflow.python.framework.func_graph import FuncGraph

    gc.collect()
    return [g for g in gc.get_objects() if isinstance(g, FuncGraph) and g.name == "one_step_on_data"]


def test_the_recommended_set_up_trains_with_it():
    # The adaptive policy, fuse, the callback and the measured mode ("auto",
    # asked for here: the suite may pin KERAS_MP_EXECUTION).
    x, y = _data()
    earlier = weakref.WeakSet(_train_steps())
    keras_mp.set_global_policy("adaptive")
    try:
        model = keras_mp.fuse(_mlp(), inplace=True)
        model.compile(optimizer="adam", loss="mse")
        execution.configure(model, mode="auto")
        hist = model.fit(x, y, batch_size=8, epochs=3, verbose=0,
                         callbacks=[keras_mp.callbacks.AdaptivePrecision(interval=4)])
    finally:
        keras_mp.set_global_policy("float32")
    assert np.isfinite(hist.history["loss"]).all()
    assert native_update.is_installed(model.optimizer)
    new = [g for g in _train_steps() if g not in earlier]
    assert new and all(_runs(g, "ResourceApplyAdam") for g in new)


def _runs(graph, op_type: str) -> bool:
    """Whether ``graph`` or a function it calls (a ``tf.cond`` branch: the
    update of a step that can be skipped) holds an op of ``op_type``."""
    library = graph.as_graph_def().library.function
    return any(op.type == op_type for op in graph.get_operations()) or any(
        node.op == op_type for function in library for node in function.node_def)


@pytest.mark.parametrize("make", [keras.optimizers.Adamax, keras.optimizers.Nadam,
                                  keras.optimizers.Lion], ids=["adamax", "nadam", "lion"])
def test_compact_state_installs_where_no_native_kernel_is(make):
    """Adamax, Nadam and Lion have no native kernel: install leaves them to
    Keras unless asked for the update over compact state (compact=True),
    and then a float32 slot still takes Keras's own update_step."""
    assert "has no native update kernel" in native_update.unsupported_reason(make())
    assert native_update.install(make()) is False
    opt = make(0.01)
    assert native_update.unsupported_reason(opt, compact=True) is None
    w = keras.Variable(np.ones((3,), "float32"))
    ref = make(0.01)
    w_ref = keras.Variable(np.ones((3,), "float32"))
    opt.build([w])
    ref.build([w_ref])
    assert native_update.install(opt, compact=True) and native_update.is_installed(opt)
    opt.apply([tf.constant([1.0, -2.0, 0.5])], [w])
    ref.apply([tf.constant([1.0, -2.0, 0.5])], [w_ref])
    np.testing.assert_array_equal(w.numpy(), w_ref.numpy())   # Keras's own update, as is
    assert not np.array_equal(w.numpy(), np.ones(3))
    assert "RMSprop" in native_update.unsupported_reason(keras.optimizers.RMSprop(), compact=True)
