"""keras_mp.execution.fused_update: the optimizer's update compiled alone, the same
numbers as Keras's graph, and only where it is asked for."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mp
from keras_mp.execution import fused_update

OPTIMIZERS = ["adam", "adamw", "sgd", "rmsprop", "lion", "adafactor", "nadam", "adagrad",
              "adamax", "ftrl", "adadelta", "muon"]


def _variables():
    return [keras.Variable(np.linspace(-1, 1, 6000, dtype="float32").reshape(60, 100)),
            keras.Variable(np.ones((100,), "float32"))]


def _run(optimizer, compiled, steps=5, switch=None):
    """``steps`` updates; with ``switch``, one trace holding both ways
    (``fused_update.switched``), the switch set to ``compiled(i)`` before step i."""
    variables = _variables()
    optimizer.build(variables)
    fused_update.install(optimizer)

    @tf.function
    def step(grads):
        with fused_update.compiling(compiled) if switch is None \
                else fused_update.switched(switch):
            optimizer.apply(grads, variables)

    g0 = [tf.constant(np.sin(np.arange(6000)).reshape(60, 100).astype("float32")),
          tf.constant(np.cos(np.arange(100)).astype("float32"))]
    for i in range(steps):
        if switch is not None:
            switch.assign(compiled(i))
        step([g * (i + 1) for g in g0])
    if switch is not None:
        assert step.experimental_get_tracing_count() == 1
    graph = step.get_concrete_function([tf.TensorSpec(g.shape) for g in g0]).graph
    return [v.numpy() for v in variables], graph


def _compiles(graph) -> bool:
    """Whether a function called from ``graph`` (or nested in one) is compiled by XLA."""
    funcs = list(graph._functions.values())
    return any(f.definition.attr["_XlaMustCompile"].b for f in funcs)


#: Gradient accumulation and EMA: Keras's update runs inside them.
FEATURES = {"accumulate": {"gradient_accumulation_steps": 2},
            "ema": {"use_ema": True, "ema_momentum": 0.5, "ema_overwrite_frequency": 2}}


@pytest.mark.parametrize("name, feature", [(n, None) for n in OPTIMIZERS] + [
    ("adam", "accumulate"), ("sgd", "ema"), ("lion", "accumulate")])
def test_same_variables_as_the_graph(name, feature):
    config = {"learning_rate": 1e-2, **FEATURES.get(feature, {})}
    make = lambda: keras.optimizers.get({"class_name": name,  # noqa: E731
                                         "config": config})
    plain, plain_graph = _run(make(), False)
    fused, fused_graph = _run(make(), True)
    assert not _compiles(plain_graph) and _compiles(fused_graph)
    for a, b in zip(plain, fused):
        assert np.max(np.abs(a - b)) <= 1e-6 * np.max(np.abs(a))


@pytest.mark.parametrize("name", ["adam", "sgd", "lion"])
def test_one_trace_switches_between_graph_and_xla_updates(name):
    # The execution trial's trace: the update both ways under a tf.cond. Steps
    # alternating between them give the graph's numbers, and the trace compiles.
    make = lambda: keras.optimizers.get({"class_name": name,  # noqa: E731
                                         "config": {"learning_rate": 1e-2}})
    plain, _ = _run(make(), False)
    switch = tf.Variable(False)
    mixed, graph = _run(make(), lambda i: i % 2 == 1, switch=switch)
    assert _compiles(graph)
    for a, b in zip(plain, mixed):
        assert np.max(np.abs(a - b)) <= 1e-6 * np.max(np.abs(a))
    with pytest.raises(TypeError, match="`switch`"):
        with fused_update.switched(tf.Variable(1.0)):
            pass


def test_loss_scale_wrapper_compiles_its_inner_optimizer():
    opt = keras_mp.LossScaleOptimizer(keras.optimizers.Adam(1e-2))
    assert fused_update.install(opt) and fused_update.is_installed(opt.inner_optimizer)
    ref, _ = _run(keras_mp.LossScaleOptimizer(keras.optimizers.Adam(1e-2)), False)
    got, graph = _run(opt, True)
    assert _compiles(graph)
    for a, b in zip(ref, got):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_sparse_gradients_and_saving(tmp_path):
    model = keras.Sequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(50, 4),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    keras_mp.execution.configure(model, mode="xla_update")
    x = np.arange(48, dtype="int32").reshape(16, 3) % 50
    y = np.ones((16, 1), "float32")
    model.fit(x, y, batch_size=4, epochs=2, verbose=0)
    assert fused_update.is_installed(model.optimizer)
    assert model.optimizer.iterations.numpy() == 8
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))


def test_not_under_a_distribution_strategy():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        opt = keras.optimizers.Adam()
    assert "distribution strategy" in fused_update.unsupported_reason(opt)
    assert fused_update.install(opt) is False and not fused_update.is_installed(opt)


def test_bad_input():
    with pytest.raises(TypeError, match="`optimizer`"):
        fused_update.install("adam")
    with pytest.raises(TypeError, match="`enabled`"):
        with fused_update.compiling(1):
            pass
