"""keras_mp.execution: the measured graph/XLA choice, its overrides, and the
fallback when XLA cannot compile a model's train step."""

import gc
import logging
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mp
from keras_mp import execution
from keras_mp.execution import fused_update, step_trial
from keras_mp.device import xla


def _data(n=32):
    rng = np.random.default_rng(0)
    return rng.standard_normal((n, 8)).astype("float32"), rng.standard_normal((n, 1)).astype(
        "float32")


def _model(*middle, optimizer="rmsprop"):
    """RMSprop by default: its update has no native kernel
    (keras_mp.execution.native_update), so the update under XLA is a candidate."""
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="gelu"),
                              *middle, keras.layers.Dense(1)])
    model.compile(optimizer=optimizer, loss="mse")
    return model


class _NumpyDouble(keras.layers.Layer):
    """A layer XLA cannot compile (a Python function inside the graph)."""

    def call(self, x):
        y = tf.numpy_function(lambda a: a * 2, [x], x.dtype)
        y.set_shape(x.shape)
        return y


def test_profile_measures_graph_and_xla_per_dtype_once():
    p = execution.profile("CPU")
    assert p is execution.profile("CPU")
    assert "float32" in p.step and p.step["float32"]["graph"][0] > 0
    if p.xla_available:
        assert set(p.step["float32"]) == {"graph", "xla"}
        assert p.xla_speedup("float32") > 0
        assert p.matmul["float32"]["xla"] > 0 and p.matmul["float32"]["graph"] > 0
    assert p.xla_wins("float32") == (p.xla_speedup("float32") >= execution.MARGIN)
    assert execution.choose(["float32"]) == ("xla" if p.xla_available and p.xla_wins(
        "float32") else "graph")


def test_choose_needs_every_dtype_to_win():
    p = execution.ExecutionProfile("CPU", True, {
        "float32": {"graph": (2.0, 2.0), "xla": (1.0, 1.0)},
        "bfloat16": {"graph": (1.0, 1.0), "xla": (3.0, 3.0)}}, {})
    assert p.xla_wins("float32") and not p.xla_wins("bfloat16")
    # Faster by CPU time but slower by wall time is not a win.
    q = execution.ExecutionProfile("CPU", True, {
        "float32": {"graph": (2.0, 1.0), "xla": (1.0, 1.5)}}, {})
    assert not q.xla_wins("float32")
    with pytest.raises(ValueError, match="`dtypes`"):
        execution.choose(["int8"])
    with pytest.raises(ValueError, match="`dtypes`"):
        execution.choose([])


def test_configure_modes_and_env_override(monkeypatch):
    x, y = _data()
    model = _model()
    assert execution.configure(model, mode="graph") == "graph" and model.jit_compile is False
    assert execution.configure(model, mode="xla") == "xla" and model.jit_compile is True
    model.fit(x, y, batch_size=8, verbose=0)
    assert model.jit_compile is True and model.optimizer.iterations.numpy() == 4
    monkeypatch.setenv(execution.ENV_VAR, "graph")
    assert execution.configure(model) == "xla"  # the mode given to configure sticks
    fresh = _model()
    assert execution.configure(fresh) == "graph" and fresh.jit_compile is False
    monkeypatch.setenv(execution.ENV_VAR, "fast")
    with pytest.raises(ValueError, match=execution.ENV_VAR):
        execution.configure(fresh)
    monkeypatch.delenv(execution.ENV_VAR)
    # "auto" measures the model's own step on its next calls.
    assert execution.configure(fresh) == "trial" and fresh.jit_compile is False
    assert execution.chosen(fresh) == "trial"
    kept = _model()
    kept.compile(optimizer="adam", loss="mse", jit_compile=True)
    assert execution.configure(kept, mode="keep") == "xla" and kept.jit_compile is True


def test_configure_rejects_bad_input():
    with pytest.raises(TypeError, match="`model`"):
        execution.configure("model")
    uncompiled = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match="compiled"):
        execution.configure(uncompiled)
    with pytest.raises(ValueError, match="`mode`"):
        execution.configure(_model(), mode="jit")


def test_xla_compile_failure_falls_back_once_on_the_same_batch(caplog):
    x, y = _data()
    model = _model(_NumpyDouble())
    assert execution.configure(model, mode="xla") == "xla"
    with caplog.at_level(logging.WARNING, logger="keras_mp"):
        model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    # Every batch trained (none lost to the failed attempt), in graph mode.
    assert model.optimizer.iterations.numpy() == 8
    assert model.jit_compile is False
    warnings = [r for r in caplog.records if "XLA could not compile" in r.getMessage()]
    assert len(warnings) == 1 and "set_execution(model, 'graph')" in warnings[0].getMessage()
    model.fit(x, y, batch_size=8, verbose=0)  # later fits stay in graph mode, silently
    assert model.jit_compile is False and model.optimizer.iterations.numpy() == 12


def test_fallback_with_several_steps_per_execution():
    x, y = _data()
    model = _model(_NumpyDouble())
    model.compile(optimizer="adam", loss="mse", steps_per_execution=3)
    execution.configure(model, mode="xla")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)  # 4 batches: 3 + 1
    assert model.optimizer.iterations.numpy() == 4 and model.jit_compile is False


def test_graph_only_features_say_why(monkeypatch):
    model = _model()
    model.compile(optimizer=keras_mp.LossScaleOptimizer(keras.optimizers.RMSprop(),
                                                        max_consecutive_skips=3), loss="mse")
    # The whole step cannot be compiled, the optimizer's update alone can.
    assert execution.candidate_modes(model) == ("graph", "xla_update")
    assert execution.configure(model, mode="auto") == "trial"
    with pytest.raises(ValueError, match="max_consecutive_skips"):
        execution.configure(model, mode="xla")
    fresh = _model()
    fresh.compile(optimizer=keras_mp.LossScaleOptimizer(keras.optimizers.RMSprop(),
                                                        max_consecutive_skips=3), loss="mse")
    monkeypatch.setenv(execution.ENV_VAR, "xla")  # a preference, not an error
    assert execution.configure(fresh) == "graph"
    monkeypatch.delenv(execution.ENV_VAR)
    eager = _model()
    eager.compile(optimizer="adam", loss="mse", run_eagerly=True)
    assert execution.candidate_modes(eager) == ("graph",)
    assert execution.configure(eager, mode="auto") == "graph"
    with pytest.raises(ValueError, match="run_eagerly"):
        execution.configure(eager, mode="xla_update")


def test_a_convolutional_model_does_not_try_the_whole_step_under_xla_on_a_cpu():
    # XLA:CPU convolves without oneDNN (several times slower): the trial
    # would only cost its compilation. A mode asked for still runs.
    if execution.micro_benchmark.profile(steps=False).device_type != "CPU":
        pytest.skip("a rule for CPUs")
    model = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3),
                              keras.layers.Flatten(), keras.layers.Dense(2)])
    model.compile(optimizer="rmsprop", loss="mse")
    assert execution.candidate_modes(model) == ("graph", "xla_update")
    assert execution.configure(model, mode="xla") == "xla"
    dense = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
    dense.compile(optimizer="adam", loss="mse")
    assert "xla" in execution.candidate_modes(dense) or \
        execution.reasons.slow_matmul(dense) is not None


def _convolutions(*extra, classes=10, pool=True):
    """Two convolutions (46,208 weights), ``extra`` layers, then a Dense head."""
    inp = keras.Input((16, 16, 16))
    h = keras.layers.Conv2D(64, 3, activation="relu")(inp)
    h = keras.layers.Conv2D(64, 3, activation="relu")(h)
    for layer in extra:
        h = layer(h)
    if pool:
        h = keras.layers.Dense(classes)(keras.layers.GlobalAveragePooling2D()(h))
    model = keras.Model(inp, h)
    model.compile(optimizer="rmsprop",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_a_model_of_convolutions_compiles_nothing_with_xla_on_a_cpu():
    # XLA's runtime costs the process memory (47 MiB on a 2-core EPYC) and a
    # model whose weights are its convolutions gives XLA nothing to gain.
    if xla.current_device_type() != "CPU":
        pytest.skip("a rule for CPUs")
    cnn = _convolutions()
    reason = execution.reasons.little_to_compile(cnn)
    assert reason is not None and "convolutions hold 98.6% of its weights" in reason
    assert "10 values per example" in reason
    assert execution.candidate_modes(cnn) == ("graph",)
    with execution.trace_scope(cnn):
        assert not xla.uses_xla("elementwise") and not xla.uses_xla("matmul")
    assert xla.uses_xla("elementwise")  # only inside the scope
    with execution.trace_scope(_model()):
        assert xla.uses_xla("elementwise")
    # What leaves XLA to the other rules: a fused normalization (elementwise
    # work whatever its weights), weights outside the convolutions (a head of
    # 22% here), outputs of more than SMALL_OUTPUT values per example (the
    # fused loss's work), no convolution at all.
    norm = _convolutions(keras_mp.fused.layers.LayerNormalization())
    wide = _convolutions(classes=200)
    maps = _convolutions(pool=False)
    assert maps.outputs[0].shape[1:] == (12, 12, 64)
    for model in (norm, wide, maps, _model()):
        assert execution.reasons.little_to_compile(model) is None
        assert "xla_update" in execution.candidate_modes(model) or \
            execution.reasons.update_memory(model) is not None


_NO_XLA_SCRIPT = """
import numpy as np, keras, keras_mp
from keras_mp import execution
from keras_mp.device import xla
from tests.execution.test_choice import _convolutions
keras_mp.set_global_policy("adaptive")
model = keras_mp.fuse(_convolutions(), inplace=True)
model.compile(optimizer="adam", metrics=["accuracy"],
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
rng = np.random.default_rng(0)
x = rng.standard_normal((64, 16, 16, 16)).astype("float32")
y = rng.integers(0, 10, 64)
cb = keras_mp.callbacks.AdaptivePrecision(interval=8, statistics_every=4, probe_every=12)
hist = model.fit(x, y, batch_size=8, epochs=4, verbose=0, callbacks=[cb])
assert np.isfinite(hist.history["loss"]).all(), hist.history
assert np.isfinite(model.evaluate(x, y, verbose=0)).all()
assert model.predict(x, verbose=0).shape == (64, 10)
print("chosen", execution.chosen(model), "probed", sorted(xla._available), flush=True)
mlp = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
mlp.compile(optimizer="adam", loss="mse")
execution.candidate_modes(mlp)   # the same check sees an MLP start XLA
print("after an mlp, probed", sorted(xla._available), flush=True)
"""


def test_a_model_of_convolutions_trains_without_starting_xla(tmp_path):
    # The default a user gets (KERAS_MP_EXECUTION unset), in a fresh process:
    # the trial, statistics steps, probes, evaluate and predict of a CNN never
    # start XLA.
    if xla.current_device_type() != "CPU":
        pytest.skip("a rule for CPUs")
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != execution.ENV_VAR}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    proc = subprocess.run([sys.executable, "-c", _NO_XLA_SCRIPT], capture_output=True,
                          text=True, timeout=600, env=env, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "chosen graph probed []" in proc.stdout, proc.stdout
    assert "after an mlp, probed ['CPU']" in proc.stdout, proc.stdout


def test_adaptive_precision_applies_the_mode(monkeypatch):
    x, y = _data()
    keras_mp.set_global_policy("adaptive")
    try:
        model = _model()
        monkeypatch.setenv(execution.ENV_VAR, "xla")
        model.fit(x, y, batch_size=8, epochs=2, verbose=0,
                  callbacks=[keras_mp.callbacks.AdaptivePrecision(interval=2)])
        assert model.jit_compile is True
        assert model.optimizer.iterations.numpy() == 8
        monkeypatch.setenv(execution.ENV_VAR, "graph")
        model.fit(x, y, batch_size=8, verbose=0,
                  callbacks=[keras_mp.callbacks.AdaptivePrecision(interval=2)])
        assert model.jit_compile is False
        # A mode given to configure sticks: the callback does not replace it.
        execution.configure(model, mode="keep")
        model.compile(optimizer="adam", loss="mse", jit_compile=True)
        model.fit(x, y, batch_size=8, verbose=0,
                  callbacks=[keras_mp.callbacks.AdaptivePrecision(interval=2)])
        assert model.jit_compile is True
    finally:
        keras_mp.set_global_policy("float32")


def test_measured_matmul_placement_and_set_xla_override():
    execution.configure(keras_mp.fuse(_model()), mode="graph")  # fused Dense layers
    p = execution.profile(steps=False)   # the matmuls-only profile first, where one is kept
    if "xla" in p.matmul.get("float32", {}):
        assert xla.uses_xla("matmul", "CPU") == p.matmul_xla_wins("float32")
    keras_mp.config.set_xla("matmul", True)
    try:
        assert xla.uses_xla("matmul", "CPU") is True
    finally:
        keras_mp.config.set_xla("matmul", None)
    with pytest.raises(ValueError, match="`device_type`"):
        xla.set_measured_default("matmul", "QPU", True)


def test_only_models_that_need_it_measure_xla_matmuls(monkeypatch):
    # The matmul measurement compiles XLA matmuls in every candidate dtype and
    # the process keeps that memory: a model that cannot use what it tells
    # (no fused matmul layer; convolutions on a CPU, where the whole step is
    # never tried under XLA) does not run it.
    if xla.current_device_type() != "CPU":
        pytest.skip("a rule for CPUs")
    measured = []

    def profile(*args, **kwargs):
        measured.append(kwargs)
        return real(*args, **kwargs)
    real = execution.micro_benchmark.profile
    monkeypatch.setattr(execution.micro_benchmark, "profile", profile)
    monkeypatch.setattr(execution.placement, "profile", profile)
    conv = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3),
                             keras.layers.Flatten(), keras.layers.Dense(2)])
    conv.compile(optimizer="rmsprop", loss="mse")
    assert execution.configure(conv, mode="auto") == "trial"
    assert execution.candidate_modes(conv) == ("graph", "xla_update")
    assert measured == []
    # Fused Dense layers are placed by it, and a model without convolutions
    # needs it to know whether the whole step may go to XLA.
    execution.configure(keras_mp.fuse(conv), mode="auto")
    assert len(measured) == 1
    execution.candidate_modes(_model())
    assert len(measured) == 2
    # A fused head too small to matter (under MIN_SHARE of the weights) is not
    # worth the measurement's memory: the defaults stay.
    wide = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(64, 3),
                             keras.layers.Conv2D(64, 3), keras.layers.GlobalAveragePooling2D(),
                             keras.layers.Dense(2)])
    fused = keras_mp.fuse(wide)
    fused.compile(optimizer="rmsprop", loss="mse")
    head = fused.layers[-1]
    assert type(head).__module__ == "keras_mp.fused.layers"
    assert 0 < head.count_params() < execution.placement.MIN_SHARE * fused.count_params()
    before = len(measured)
    execution.configure(fused, mode="auto")
    assert len(measured) == before


def _fake_clocks(monkeypatch, factors):
    """Makes every timed call of a mode look ``factors[mode]`` times the graph's."""
    def timed(fn, data, mode):
        out = fn(data)
        t = 0.010 * factors.get(mode, 1.0)
        return out, t, t
    monkeypatch.setattr(step_trial, "_timed", timed)


@pytest.fixture
def xla_matmuls_not_slow(monkeypatch):
    """These tests are about the trial of all three modes: the XLA matmul floor
    (tested above) is measured by a micro-benchmark, which under the load of
    the suite's background pipelines can fall below the floor and drop "xla"."""
    monkeypatch.setattr(execution.reasons, "slow_matmul", lambda model: None)


@pytest.mark.parametrize("factors, expected", [
    ({"xla": 0.5}, "xla"), ({"xla": 2.0}, "graph"), ({"xla": 0.99, "xla_update": 0.98}, "graph"),
    ({"xla": 0.8, "xla_update": 0.6}, "xla_update")])
def test_auto_measures_the_models_own_step(monkeypatch, caplog, factors, expected,
                                           xla_matmuls_not_slow):
    _fake_clocks(monkeypatch, factors)
    x, y = _data(8 * 30)
    model = _model()
    assert execution.configure(model, mode="auto") == "trial"
    assert execution.candidate_modes(model) == ("graph", "xla_update", "xla")
    with caplog.at_level(logging.INFO, logger="keras_mp"):
        model.fit(x[:8], y[:8], batch_size=8, verbose=0)
    # Decided on the first call, on a copy of the training state: that call
    # and every later one trained once, in the mode decided.
    assert execution.chosen(model) == expected and model.jit_compile is (expected == "xla")
    assert model.optimizer.iterations.numpy() == 1
    samples = model.train_function.record.samples
    assert {m: len(s) for m, s in samples.items()} == dict.fromkeys(
        ("graph", "xla_update", "xla"), step_trial.PAIRS)
    model.fit(x, y, batch_size=8, verbose=0)
    assert model.optimizer.iterations.numpy() == 31
    told = [r for r in caplog.records if "this model's train step runs" in r.getMessage()]
    assert len(told) == 1 and "interleaved rounds" in told[0].getMessage()
    assert execution.configure(model) == expected  # decided once per model and dtypes
    model.fit(x[:16], y[:16], batch_size=8, verbose=0)
    assert model.jit_compile is (expected == "xla")
    # A model trained in another mode first is measured when "auto" comes.
    other = _model()
    execution.configure(other, mode="graph")
    other.fit(x[:16], y[:16], batch_size=8, verbose=0)
    assert execution.configure(other, mode="auto") == "trial"
    other.fit(x[:8], y[:8], batch_size=8, verbose=0)
    assert execution.chosen(other) == expected


def test_the_trial_trains_as_the_mode_it_decides(monkeypatch, tmp_path, xla_matmuls_not_slow):
    # The trial's calls run on a copy of the training state: a model
    # measured (nothing kept) and one that reads the decision kept on disk
    # train the same weights, optimizer state and metric totals, bit for bit.
    from keras_mp.device import cache

    monkeypatch.setenv(cache.ENV_VAR, str(tmp_path))
    _fake_clocks(monkeypatch, {"xla": 0.8, "xla_update": 0.6})
    x, y = _data(8 * 12)
    ends = []
    for _ in range(2):
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="gelu"),
                                  keras.layers.Dropout(0.3), keras.layers.BatchNormalization(),
                                  keras.layers.Dense(1)])
        model.compile(optimizer="rmsprop", loss="mse", metrics=["mae"])
        assert execution.configure(model, mode="auto") == "trial"
        model.fit(x, y, batch_size=8, epochs=2, verbose=0)
        assert execution.chosen(model) == "xla_update"
        ends.append([np.asarray(v) for v in step_trial.training_state(model)])
    assert len(ends[0]) == len(ends[1]) > 10
    for a, b in zip(*ends):
        np.testing.assert_array_equal(a, b)


def _train_step_graphs() -> list:
    from tensorflow.python.framework.func_graph import FuncGraph

    return [g for g in gc.get_objects()
            if isinstance(g, FuncGraph) and g.name == "one_step_on_data"]


def test_the_trial_releases_the_modes_it_did_not_choose(monkeypatch, xla_matmuls_not_slow):
    # A mode's trace and compiled code stay in the process while anything
    # holds its train function: on ResNet50V2 the losing graph trace held
    # 149 MiB of heap until the end of training.
    _fake_clocks(monkeypatch, {"xla": 0.8, "xla_update": 0.6})
    built = []
    build = execution.choice._build

    def recorded(model, state, mode, switch=None):
        fn = build(model, state, mode, switch)
        built.append((mode, weakref.ref(fn)))
        return fn

    monkeypatch.setattr(execution.choice, "_build", recorded)
    x, y = _data(8 * 30)
    model = _model()
    assert execution.configure(model, mode="auto") == "trial"
    earlier = weakref.WeakSet(_train_step_graphs())
    model.fit(x, y, batch_size=8, verbose=0)
    assert execution.chosen(model) == "xla_update"
    gc.collect()
    # The graph and the update under XLA are one trace (a tf.cond on the update).
    assert sorted(mode for mode, _ in built) == ["xla", "xla_update"]
    assert [mode for mode, ref in built if ref() is not None] == ["xla_update"]
    # Their traces too (TensorFlow's gradient registry held them:
    # keras_mp._gradients), the chosen one's alone is left.
    assert len([g for g in _train_step_graphs() if g not in earlier]) == 1
    model.fit(x[:16], y[:16], batch_size=8, verbose=0)  # the chosen mode trains on
    assert model.optimizer.iterations.numpy() == 32


def test_auto_trial_falls_back_when_xla_cannot_compile(caplog, xla_matmuls_not_slow):
    x, y = _data()
    model = _model(_NumpyDouble())
    assert execution.configure(model, mode="auto") == "trial"
    with caplog.at_level(logging.INFO, logger="keras_mp"):
        model.fit(x, y, batch_size=8, epochs=5, verbose=0)
    assert model.optimizer.iterations.numpy() == 20  # the failed batch was rerun, not lost
    # The whole step could not compile; the update alone could, and was measured.
    assert execution.chosen(model) in ("graph", "xla_update") and model.jit_compile is False
    assert len([r for r in caplog.records if r.levelno == logging.WARNING
                and "XLA could not compile" in r.getMessage()]) == 1


def test_epilogue_measurement_and_placement(monkeypatch):
    s = execution.epilogue("relu", "float32", batch=16, width=32, rounds=1)
    assert s > 0 and execution.epilogue("relu", "float32", batch=16, width=32, rounds=1) == s
    with pytest.raises(ValueError, match="`activation`"):
        execution.epilogue("softplus")
    with pytest.raises(ValueError, match="`dtype`"):
        execution.epilogue("relu", "int8")
    with pytest.raises(ValueError, match="`device_type`"):
        xla.set_measured_epilogue("relu", "QPU", True)
    with pytest.raises(TypeError, match="`fused`"):
        xla.set_measured_epilogue("relu", "CPU", 1)
    monkeypatch.setattr(xla, "_epilogues", {})
    xla.set_measured_epilogue("relu", "CPU", False)
    assert xla.fuses_epilogue("relu", "CPU") is False
    # The fused Dense computes the same either way.
    layer = keras_mp.fused.layers.Dense(4, activation="relu")
    inputs = np.linspace(-1, 1, 12, dtype="float32").reshape(3, 4)
    unfused = layer(inputs)
    xla.set_measured_epilogue("relu", "CPU", True)
    np.testing.assert_allclose(layer(inputs), unfused, atol=1e-6)
    keras_mp.config.set_xla("elementwise", False)  # the override wins over a measurement
    try:
        assert xla.fuses_epilogue("relu", "CPU") is False
    finally:
        keras_mp.config.set_xla("elementwise", None)


def test_no_new_xla_compilation_near_the_memory_map_limit(monkeypatch, caplog,
                                                         xla_matmuls_not_slow):
    """TensorFlow never frees an XLA:CPU executable's memory maps: past half
    of vm.max_map_count, auto keeps the graph and says why, once."""
    maps = xla.memory_maps()
    assert maps is None or 0 < maps[0] < maps[1]
    monkeypatch.setattr(xla, "memory_maps", lambda: (40000, 65530))
    model = _model()
    assert execution.candidate_modes(model) == ("graph",)
    with caplog.at_level(logging.INFO, logger="keras_mp"):
        assert execution.configure(model, mode="auto") == "graph"
        model.fit(*_data(), batch_size=8, verbose=0)
    told = [r for r in caplog.records if "vm.max_map_count" in r.getMessage()]
    assert len(told) == 1 and told[0].levelno == logging.WARNING
    with pytest.raises(ValueError, match="memory maps"):
        execution.configure(_model(), mode="xla")
    monkeypatch.setattr(xla, "memory_maps", lambda: None)  # not Linux: no limit known
    assert execution.candidate_modes(_model()) == ("graph", "xla_update", "xla")


def _trial(graph_bytes):
    """A trial of two modes whose graph call holds ``graph_bytes`` of tensors."""
    calls = {"graph": 0, "xla": 0}

    def mode(name, nbytes):
        def run(_):
            calls[name] += 1
            return tf.reduce_sum(tf.zeros([max(nbytes // 4, 1)]))
        return run

    decided = []
    trial = step_trial.StepTrial(step_trial.Record(), {"graph": mode("graph", graph_bytes),
                                                       "xla": mode("xla", 4)},
                                 1.05, decided.append, memory_cost={"xla": lambda rec: (
                                     rec.step_bytes, "a copy of the step's tensors")})
    return trial, calls, decided


def test_a_memory_heavy_mode_is_tried_only_where_it_fits(caplog):
    from keras_mp.device import memory

    rss = memory.footprint()
    if rss is None or memory.allocator() is None:
        pytest.skip("no memory figures on this platform")
    # The graph's tensors: 10 % of the process (a second copy would not fit).
    trial, calls, decided = _trial(int(0.10 * rss))
    with caplog.at_level(logging.INFO, logger="keras_mp"):
        trial(None)
    # One call to measure the graph's tensors (on a copy), one that trains.
    assert decided == ["graph"] and calls == {"graph": 2, "xla": 0}
    assert trial.record.step_bytes >= 0.10 * rss and "xla" in trial.record.skipped
    assert any("not tried under XLA" in r.getMessage() for r in caplog.records)
    # A step of 1 MiB: the mode is measured. (TensorFlow's oneDNN CPU allocator
    # counts allocations from 256 KiB up; smaller ones go to malloc.)
    trial, calls, decided = _trial(2**20)
    trial(None)
    assert len(decided) == 1 and calls["graph"] + calls["xla"] == step_trial.calls_to_decide(2) + 1
    assert calls["xla"] == step_trial.calls_to_decide(2) // 2 + (decided == ["xla"])
    assert trial.record.skipped == {} and trial.record.step_bytes < 0.05 * rss
    with pytest.raises(ValueError, match="`memory_cost`"):
        step_trial.StepTrial(step_trial.Record(), {"graph": len, "xla": len}, 1.05, print,
                             memory_cost={"graph": len})


def test_the_update_under_xla_is_tried_only_where_its_code_fits(monkeypatch, caplog):
    # Its compiled code is per variable (fused_update.BYTES_PER_VARIABLE): a
    # model whose update would not fit in the budget is not tried that way.
    from keras_mp.device import memory

    if memory.footprint() is None:
        pytest.skip("no memory figures on this platform")
    monkeypatch.setattr(execution.reasons, "slow_matmul", lambda model: "slow")
    x, y = _data()
    model = _model()
    assert execution.candidate_modes(model) == ("graph", "xla_update")
    monkeypatch.setattr(fused_update, "BYTES_PER_VARIABLE", 2**40)
    assert execution.candidate_modes(model) == ("graph",)
    with caplog.at_level(logging.INFO, logger="keras_mp"):
        assert execution.configure(model, mode="auto") == "graph"
        model.fit(x, y, batch_size=8, verbose=0)
    assert execution.chosen(model) == "graph"
    said = [r.getMessage() for r in caplog.records if "compiled code for" in r.getMessage()]
    assert len(said) == 1 and "for 4 variables" in said[0], said
    # The user's own choice stands.
    assert execution.configure(model, mode="xla_update") == "xla_update"
    # At its measured size it fits, and is measured.
    monkeypatch.setattr(fused_update, "BYTES_PER_VARIABLE", 2**20)
    model = _model()
    assert execution.configure(model, mode="auto") == "trial"
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    assert model.train_function.record.samples.keys() == {"graph", "xla_update"}


def test_adaptive_steps_and_the_trial_share_one_trace(monkeypatch, xla_matmuls_not_slow):
    # Plain and statistics steps run one trace from the first call, and the
    # trial times the graph and the update under XLA on it. The trial's calls
    # (on the first call, a statistics step or not) leave nothing in the
    # statistics, the guard's counts or the optimizer: they run on a copy.
    _fake_clocks(monkeypatch, {"xla": 0.8, "xla_update": 0.6})
    # A fit of 30 calls measures nothing (reasons.short_fit, tested in
    # test_cache.py), nor does one that takes seconds (first_calls); this one
    # stands for a longer fit: its first calls run as a graph, then the trial.
    monkeypatch.setattr(execution.reasons, "SHORT_FIT", 30)
    monkeypatch.setattr(execution.first_calls, "TRIAL_AFTER_S", 0.0)
    x, y = _data(8 * 30)
    keras_mp.set_global_policy("adaptive_bfloat16")
    try:
        for statistics_every in (3, 1):   # the first call: a plain step, a statistics step
            model = _model(keras_mp.fused.layers.LayerNormalization())
            cb = keras_mp.callbacks.AdaptivePrecision(
                interval=100, statistics_every=statistics_every, probe_every=None,
                first_decision=None)
            model.fit(x, y, batch_size=8, verbose=0, callbacks=[cb])
            assert execution.chosen(model) == "xla_update" and not execution.measuring(model)
            assert cb._functions.shared is (statistics_every > 1)
            assert cb._stats.read().steps == 30 // statistics_every  # calls 3, 6, ..., 30
            assert model.optimizer.iterations.numpy() == 30
            assert execution.reasons.little_to_compile(model) is None
            assert keras_mp.precision_report(model).skipped_steps in (0, None)
    finally:
        keras_mp.set_global_policy("float32")


def test_a_model_of_embedding_tables_alone_times_no_matmuls(monkeypatch):
    """The matmul profile (about 1 s with an empty cache) decides nothing for
    a model that multiplies no weight matrix: a recommender of embedding
    tables (keras.io's collaborative filtering) is not held back from XLA by
    it and does not run it; a Dense layer, or a subclassed model's own
    matrix, still asks."""
    asked = []

    def profile(**kwargs):
        asked.append(kwargs)
        raise AssertionError("the matmul profile ran")

    monkeypatch.setattr(execution.reasons.micro_benchmark, "profile", profile)

    class Recommender(keras.Model):
        def __init__(self, matrix=False):
            super().__init__()
            self.users = keras.layers.Embedding(50, 8)
            self.user_bias = keras.layers.Embedding(50, 1)
            self.items = keras.layers.Embedding(70, 8)
            self.matrix = self.add_weight(shape=(8, 8)) if matrix else None

        def call(self, pairs):
            u, i = self.users(pairs[:, 0]), self.items(pairs[:, 1])
            if self.matrix is not None:
                u = u @ self.matrix
            return keras.ops.sum(u * i, axis=1, keepdims=True) + self.user_bias(pairs[:, 0])

    class Projected(Recommender):
        def build(self, input_shape):  # may make a matrix: not known before it runs
            self.projection = self.add_weight(shape=(8, 8))

    model = Recommender()
    assert execution.reasons.matmul_free(model)  # not built yet, as fit first sees it
    assert not execution.reasons.matmul_free(Projected())
    model(np.zeros((2, 2), "int32"))
    assert execution.reasons.matmul_free(model)
    assert execution.reasons.slow_matmul(model) is None and not asked

    for other in (Recommender(matrix=True),
                  keras.Sequential([keras.Input((3,), dtype="int32"),
                                    keras.layers.Embedding(10, 4), keras.layers.Flatten(),
                                    keras.layers.Dense(1)]),
                  keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])):
        if isinstance(other, Recommender):
            other(np.zeros((2, 2), "int32"))
        assert not execution.reasons.matmul_free(other)
        with pytest.raises(AssertionError, match="matmul profile ran"):
            execution.reasons.slow_matmul(other)
    assert len(asked) == 3
