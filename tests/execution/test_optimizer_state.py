"""keras_mp.execution.optimizer_state: the optimizer is built before the
first trace, so that the train step is traced once, not twice."""

import gc
import inspect

import keras
import numpy as np
import pytest

from keras_mp import execution
from keras_mp.execution import optimizer_state


def _data(n=32):
    rng = np.random.default_rng(0)
    return rng.standard_normal((n, 8)).astype("float32"), rng.standard_normal((n, 1)).astype(
        "float32")


def _model():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    return model


def _step_functions(model):
    """The tf.functions Keras traced for ``model``'s train step (``one_step_on_data``)."""
    found = []
    for obj in gc.get_objects():
        if type(obj).__name__ != "Function" or getattr(obj, "_name", None) != "one_step_on_data":
            continue
        cells = getattr(inspect.unwrap(obj._python_function), "__closure__", None) or ()
        if any(c.cell_contents is model for c in cells):
            found.append(obj)
    return found


def _variable_creating_traces(model):
    # A tf.function that created variables on its first call keeps that
    # trace and traces again without variable creation: two graphs.
    return sum(1 for f in _step_functions(model) if f._created_variables)


def test_plain_keras_traces_the_step_twice_and_configure_once():
    x, y = _data()
    plain = _model()
    plain.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert _variable_creating_traces(plain) == 1  # what Keras does: Adam's slots in the trace

    model = _model()
    execution.configure(model, mode="graph")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert model.optimizer.built
    functions = _step_functions(model)
    assert functions and _variable_creating_traces(model) == 0


def test_build_matches_what_the_first_step_builds():
    x, y = _data()
    first, early = _model(), _model()
    first.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert optimizer_state.build(early) is True and optimizer_state.build(early) is False
    early.fit(x, y, batch_size=16, epochs=1, verbose=0)
    # The same variables, in the same order, under the optimizer's own name scope.
    for model in (first, early):
        assert all(v.path.startswith(model.optimizer.name + "/")
                   for v in model.optimizer.variables)
    described = lambda m: [(v.shape, v.dtype) for v in m.optimizer.variables]  # noqa: E731
    assert described(early) == described(first)
    assert int(early.optimizer.iterations.numpy()) == int(first.optimizer.iterations.numpy()) == 2


def test_a_model_with_unbuilt_layers_is_left_alone():
    class Lazy(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1)

        def call(self, x):
            return self.dense(x)

    model = Lazy()
    model.compile(optimizer="adam", loss="mse")
    assert optimizer_state.build(model) is False and not model.optimizer.built
    x, y = _data()
    execution.configure(model, mode="graph")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)  # builds it in the trace, as Keras does
    assert model.optimizer.built and len(model.optimizer.variables) > 2


def test_no_optimizer_and_bad_input():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    assert optimizer_state.build(model) is False
    with pytest.raises(TypeError, match="`model`"):
        optimizer_state.build("model")


@pytest.mark.parametrize("how", ["configure", "float32_only", "adaptive"])
def test_compiled_metrics_are_built_before_the_first_trace(how, adapt_every_fit):
    """Compiled metrics create variables too (Keras builds them in the first
    trace): built from the iterator's element spec first, the step is traced
    once, and the metrics read as Keras's."""
    import keras_mp

    x, y = _data()

    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16),
                                  keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse",
                      metrics=["mae", keras.metrics.RootMeanSquaredError()])
        return model

    expected = build().fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False).history
    if how != "configure":
        keras_mp.set_global_policy("adaptive" if how == "adaptive" else
                                   keras_mp.AdaptivePolicy(candidates=("float32",)))
    try:
        model = build()
        if how == "configure":
            execution.configure(model, mode="graph")
        got = model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False).history
    finally:
        keras_mp.set_global_policy("float32")
    assert _step_functions(model) and _variable_creating_traces(model) == 0
    # Keras's numbers where the dtypes are Keras's (float32); close in 16 bits.
    rtol = 2e-2 if how == "adaptive" else 1e-5
    for name in ("loss", "mae", "root_mean_squared_error"):
        np.testing.assert_allclose(got[name], expected[name], rtol=rtol)


def test_metrics_built_first_checks_its_model():
    with pytest.raises(TypeError, match="`model` must be a keras.Model"):
        optimizer_state.metrics_built_first("model", lambda it: it)


def test_a_model_keras_cannot_call_symbolically_still_trains():
    """Building metrics first calls the model symbolically; a model that
    cannot be called so trains as without keras-mp (its metrics built in the
    trace)."""
    from keras.src.backend.common.symbolic_scope import in_symbolic_scope

    class Picky(keras.layers.Layer):
        def call(self, x):
            if in_symbolic_scope():
                raise RuntimeError("no symbolic calls here")
            return x * 2.0

    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.picky, self.dense = Picky(), keras.layers.Dense(1)

        def call(self, x):
            return self.dense(self.picky(x))

    x, y = _data()
    model = Net()
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    execution.configure(model, mode="graph")
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert np.isfinite(history.history["mae"][0])


def test_a_loss_alone_is_not_built_first(monkeypatch):
    """A single loss on a single-output model creates no variable in the trace:
    no symbolic call of the model before it, and the step is still traced once."""
    built = []
    monkeypatch.setattr(optimizer_state, "build_metrics",
                        lambda model, batch: built.append(model) or False)
    x, y = _data()
    model = _model()  # loss="mse", no metrics
    execution.configure(model, mode="graph")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert built == []
    assert _step_functions(model) and _variable_creating_traces(model) == 0
