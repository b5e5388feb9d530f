"""keras_mp.callbacks.AdaptivePrecision: optimizer wrapping, decisions during
fit, train-function rebuilds, logging, persistence, custom loops, and the
gradient-overflow demonstration (the demonstrations of the forward statistics
and the probe are in test_adaptive_evidence.py)."""

import glob
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mp
from tests.faults import two_replica_mirrored_strategy
from keras_mp import callbacks, policies
from keras_mp.scaling import loss_scale
from keras_mp.callbacks import AdaptivePrecision
from keras_mp.adaptive.outputs.report import precision_report
from keras_mp.adaptive.integration import step_functions


def _raw_features(n: int, seed: int):
    """A linearly separable problem whose features are unnormalized: scale
    3e4, so a few exceed float16's 65504 and every first projection does."""
    rng = np.random.default_rng(seed)
    z = rng.normal(size=(n, 32)).astype("float32")
    w = np.random.default_rng(99).normal(size=(32,)).astype("float32")
    return (3e4 * z).astype("float32"), (z @ w > 0).astype("float32")[:, None]


def _raw_feature_model():
    # LayerNormalization after the first projection makes the model
    # scale-invariant in float32; in float16 that projection is inf.
    return keras.Sequential([
        keras.Input((32,)), keras.layers.Dense(64), keras.layers.LayerNormalization(),
        keras.layers.Dense(32, activation="relu"), keras.layers.Dense(1)])


def _train_raw(policy, cbs=(), epochs=6):
    keras.utils.clear_session(free_memory=False)
    keras.utils.set_random_seed(0)
    policies.set_global_policy(policy)
    x, y = _raw_features(2048, 0)
    xv, yv = _raw_features(512, 1)
    model = _raw_feature_model()
    model.compile(optimizer=keras.optimizers.Adam(3e-3),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True), metrics=["accuracy"])
    history = model.fit(x, y, batch_size=32, epochs=epochs, verbose=0, callbacks=list(cbs))
    return model, history, model.evaluate(xv, yv, verbose=0)[1]


def _small(policy="adaptive_bfloat16", units=(8, 4)):
    policies.set_global_policy(policy)
    # A small first kernel keeps that layer's output within float16 once an
    # input beyond float16 (see _overflowing) is handled in float32.
    small = keras.initializers.RandomUniform(-0.05, 0.05, seed=1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(units[0],
                                                                    kernel_initializer=small)]
                             + [keras.layers.Dense(u) for u in units[1:]]
                             + [keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    return model


def _xy(n=32, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype("float32")
    return x, x.sum(axis=1, keepdims=True)


def _overflowing(n=16):
    """Data with one input beyond float16's range in every batch of 8 (the
    targets stay small: only the input side leaves float16's range)."""
    x, y = _xy(n)
    x[::8, 0] = 7e4
    return x, y


def _small_scale():
    # The non-finite steps count once the scale reaches its floor (1): start near it.
    return loss_scale.DynamicLossScale(initial_scale=2.0)


# -- demonstrations ----------------------------------------------------------

def test_float16_failure_recovered_with_most_layers_in_float16():
    _, _, acc32 = _train_raw("float32")
    _, _, acc16 = _train_raw("mixed_float16")
    cb = AdaptivePrecision(interval=5)
    model, history, acc_adaptive = _train_raw("adaptive_float16", [cb])
    print(f"float32 {acc32:.4f}  mixed_float16 {acc16:.4f}  adaptive {acc_adaptive:.4f}")
    print(precision_report(model))
    assert acc16 <= acc32 - 0.05  # static float16 fails honestly
    assert acc_adaptive >= acc32 - 0.01  # adaptive recovers within 1 point
    dense = [l for l in model.layers if isinstance(l, keras.layers.Dense)]
    in_fp16 = [l for l in dense if l.compute_dtype == "float16"]
    assert len(in_fp16) * 2 >= len(dense), [l.compute_dtype for l in dense]
    assert dense[0].compute_dtype == "float32"  # the projection of the raw features
    assert cb.events[0]["reason"] == "input_range"  # attributed by forward statistics
    assert sum(history.history["precision_switches"]) == len(cb.events)
    assert isinstance(model.optimizer, keras_mp.LossScaleOptimizer)


def _tiny_gradients(loss_scale_arg, probe_every="auto", policy="adaptive_float16", **kw):
    """float16 gradients of a small model at a loss scale of 1: 70-99 % of
    their elements are float16 subnormals (amax 3e-5 and 5e-4)."""
    keras.utils.clear_session(free_memory=False)
    keras.utils.set_random_seed(0)
    policies.set_global_policy(policy)
    small = keras.initializers.RandomUniform(-0.05, 0.05, seed=1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, kernel_initializer=small),
                              keras.layers.Dense(1, kernel_initializer=small)])
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    x, y = _xy(64)
    cb = AdaptivePrecision(interval=4, loss_scale=loss_scale_arg, probe_every=probe_every, **kw)
    model.fit(x, 1e-3 * y, batch_size=8, epochs=3, verbose=0, callbacks=[cb])
    return model, cb


def test_underflow_with_headroom_grows_the_loss_scale_instead_of_promoting():
    model, cb = _tiny_gradients(loss_scale.DynamicLossScale(initial_scale=1.0,
                                                            recovery_interval=None))
    assert cb.events == []  # every layer stays float16
    # at the first decision: 2**20 leaves the largest gradient (5e-4) 16x below 65504
    assert cb.scale_events == [{"step": 4, "layer": None, "old": 1.0, "new": 2.0**20}]
    assert float(model.optimizer.loss_scale) == 2.0**20
    rows = precision_report(model).rows
    assert all(row["stats"]["fp16_subnormal"] < 0.01 for row in rows)
    assert all(row["loss_scale"] == 2.0**20 for row in rows)


def test_a_proxy_promotion_waits_for_the_probe_which_finds_no_harm():
    # A fixed scale cannot grow: the subnormal fraction is a proxy, and the
    # probe measures the gradients at float32's quality (errors below 0.01).
    model, cb = _tiny_gradients(1.0)
    report = precision_report(model)
    assert cb.events == [] and all(row["compute_dtype"] == "float16" for row in report.rows)
    assert all(row["stats"]["fp16_subnormal"] > 0.5 for row in report.rows)
    assert all(row["probe"]["grad_error"] < 0.05 for row in report.rows)
    # without probes nothing can judge it: promoted at once, as before
    model, cb = _tiny_gradients(1.0, probe_every=None)
    assert [e["reason"] for e in cb.events] == ["fp16_subnormal"] * 2


def test_per_layer_loss_scales_in_fit_report_tensorboard_and_keras_file(tmp_path):
    policy = keras_mp.AdaptivePolicy(("float16", "float32"), layer_loss_scales=True)
    model, cb = _tiny_gradients(loss_scale.DynamicLossScale(initial_scale=1.0,
                                                            recovery_interval=None),
                                policy=policy, log_dir=str(tmp_path / "logs"))
    opt = model.optimizer
    assert isinstance(opt, keras_mp.LossScaleOptimizer) and opt.layer_scales
    # each layer's own factor grew; the global scale and the dtypes did not change
    assert cb.events == [] and float(opt.loss_scale) == 1.0
    assert {e["layer"] for e in cb.scale_events} == {layer.path for layer in model.layers}
    factors = opt.get_layer_scales()
    assert min(factors) >= 2.0**10 and factors[0] != factors[1]
    rows = precision_report(model).rows
    assert [row["loss_scale"] for row in rows] == factors  # times the global 1.0
    assert all(row["stats"]["fp16_subnormal"] < 0.05 for row in rows)
    tags = set()
    for path in glob.glob(str(tmp_path / "logs" / "*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            tags.update(v.tag for v in event.summary.value)
    assert {f"precision/{layer.path}/loss_scale" for layer in model.layers} <= tags
    # saved and loaded with the model: the option, the factors, and fit goes on
    path = str(tmp_path / "m.keras")
    model.save(path)
    policies.set_global_policy("float32")
    loaded = keras.saving.load_model(path)
    assert policies.policy_of(loaded).layer_loss_scales
    np.testing.assert_array_equal(loaded.optimizer.variable_scales.numpy(),
                                  opt.variable_scales.numpy())
    again = AdaptivePrecision(interval=4, probe_every=None)
    x, y = _xy(16)
    loaded.fit(x, 1e-3 * y, batch_size=8, epochs=1, verbose=0, callbacks=[again])
    assert loaded.optimizer.get_layer_scales() == factors and again.events == []


# -- wiring ------------------------------------------------------------------

def test_wraps_optimizer_with_dynamic_scaling_when_float16_is_a_candidate():
    model = _small("adaptive_float16")
    assert type(model.optimizer) is keras.optimizers.Adam  # Keras did not wrap it
    model.fit(*_xy(), epochs=1, verbose=0, callbacks=[AdaptivePrecision(interval=2)])
    opt = model.optimizer
    assert isinstance(opt, keras_mp.LossScaleOptimizer)
    assert isinstance(opt.schedule, loss_scale.DynamicLossScale)
    assert isinstance(opt.inner_optimizer, keras.optimizers.Adam)
    assert opt.statistics_sink is not None


def test_no_loss_scaling_without_float16_and_keras_lso_is_replaced():
    model = _small("adaptive_bfloat16")
    compiled = model.optimizer
    cb = AdaptivePrecision(interval=2)
    model.fit(*_xy(), epochs=1, verbose=0, callbacks=[cb])
    # bfloat16 needs no loss scale: a fixed scale of 1 around the compiled
    # optimizer, only to skip non-finite steps; gradients observed on
    # statistics steps only.
    assert isinstance(model.optimizer, keras_mp.LossScaleOptimizer)
    assert model.optimizer.schedule == loss_scale.FixedLossScale(1.0)
    assert model.optimizer.inner_optimizer is compiled
    x, y = _xy()
    before = model._keras_mp_statistics.read().steps
    model.fit(x, y, batch_size=8, epochs=1, verbose=0,
              callbacks=[AdaptivePrecision(interval=100, statistics_every=1,
                                                 first_decision=None)])
    assert model._keras_mp_statistics.read().steps == before + 4
    model = _small("adaptive_bfloat16")
    model.fit(*_xy(), epochs=1, verbose=0, callbacks=[AdaptivePrecision(loss_scale=1.0)])
    assert model.optimizer.schedule == loss_scale.FixedLossScale(1.0)  # asked for
    model = _small("adaptive_float16")
    model.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()),
                  loss="mse")
    model.fit(*_xy(), epochs=1, verbose=0, callbacks=[AdaptivePrecision(interval=2)])
    assert isinstance(model.optimizer, keras_mp.LossScaleOptimizer)
    assert isinstance(model.optimizer.inner_optimizer, keras.optimizers.SGD)
    # With skipping off, bfloat16's optimizer stays as compiled, its apply observed.
    keras_mp.config.set_skip_nonfinite(False)
    try:
        model = _small("adaptive_bfloat16")
        compiled = model.optimizer
        model.fit(*_xy(), epochs=1, verbose=0, callbacks=[AdaptivePrecision(interval=2)])
        assert model.optimizer is compiled
    finally:
        keras_mp.config.set_skip_nonfinite(True)


def test_rebuilds_train_function_only_when_a_dtype_changes_and_keeps_optimizer_state():
    model = _small("adaptive_bfloat16")
    policy = policies.policy_of(model)
    policy.rule = keras_mp.adaptive.decisions.controller.DecisionRule(patience=1, cooldown=0)
    # Start the middle layer in float32: healthy statistics demote it.
    policy.assign(model.layers[1].path, "float32")
    cb = AdaptivePrecision(interval=4)
    x, y = _xy(32)
    # 8 calls: a decision puts the layer on trial, the next probe validates it
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[cb])
    assert [(e["layer"], e["reason"]) for e in cb.events] == [
        (model.layers[1].path, "probe_validated")]
    assert model.layers[1].compute_dtype == "bfloat16"
    functions = cb._train_functions()
    moments = [v for v in model.optimizer.variables]
    iterations = int(model.optimizer.iterations)
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[cb])  # no switch now
    assert cb._train_functions() is functions  # not rebuilt
    assert int(model.optimizer.iterations) == iterations + 8
    assert all(a is b for a, b in zip(moments, model.optimizer.variables))


def test_early_judgement_decides_within_the_first_epoch_with_a_probe():
    """Issue 41, item 4: with the default interval (100 calls), a 32-call run
    used to get no decision at all; now the first comes at the end of the
    first epoch (8 calls), on statistics samples and a float32 probe."""
    x, y = _overflowing(64)
    model = _small("adaptive_float16")
    cb = AdaptivePrecision(loss_scale=_small_scale())
    model.fit(x, y, batch_size=8, epochs=4, verbose=0, callbacks=[cb])
    assert cb._calls == 32
    assert (cb.events[0]["step"], cb.events[0]["layer"], cb.events[0]["reason"]) == \
        (8, model.layers[0].path, "input_range")
    # A promotion for non-finite values is judged again within a few calls.
    assert (cb._first_start, cb._first) == (8, 13)
    rows = precision_report(model).rows
    assert all(r["probe"] is not None for r in rows), rows  # the probe ran at call 8
    late = _small("adaptive_float16")
    none = AdaptivePrecision(loss_scale=_small_scale(), first_decision=None)
    late.fit(x, y, batch_size=8, epochs=4, verbose=0, callbacks=[none])
    assert none.events == [] and late.layers[0].compute_dtype == "float16"
    with pytest.raises(ValueError, match="first_decision"):
        AdaptivePrecision(first_decision=0)


def test_statistics_sampled_every_n_calls():
    model = _small("adaptive_bfloat16")
    cb = AdaptivePrecision(interval=100, statistics_every=3, first_decision=None)
    model.fit(*_xy(72), batch_size=8, epochs=1, verbose=0, callbacks=[cb])  # 9 calls
    assert cb._stats.read().steps == 3
    assert model._keras_mp_hooks.forward  # left on after fit (custom loops)
    with pytest.raises(ValueError, match=r"statistics_every.*\[1, 4\]"):
        AdaptivePrecision(interval=4, statistics_every=5)


@pytest.mark.parametrize("policy", ["adaptive_bfloat16", "adaptive_float16"])
def test_one_trace_for_plain_and_statistics_steps_gathers_the_same(policy):
    # bfloat16: the optimizer's apply is observed; float16: a LossScaleOptimizer
    # (its statistics_gate). The same steps, shared trace or two traces.
    read, shared = {}, {}
    for share in (True, False):
        keras.utils.set_random_seed(0)
        model = _small(policy)
        cb = AdaptivePrecision(interval=100, statistics_every=3, probe_every=None,
                               first_decision=None)
        if not share:
            cb._gateable = lambda: False
        model.fit(*_xy(72), batch_size=8, epochs=1, verbose=0, shuffle=False, callbacks=[cb])
        shared[share] = cb._functions.shared
        read[share] = cb._stats.read()
    assert shared == {True: True, False: False}
    a, b = read[True], read[False]
    assert a.steps == b.steps == 3 and a.mean_scale == b.mean_scale
    for la, lb in zip(a.layers, b.layers):
        assert la.steps == lb.steps == 3 and la.forward_steps == lb.forward_steps == 3
        for field in ("amax", "nonfinite", "fp16_underflow", "zero", "in_amax", "out_amax",
                      "in_range", "out_flushed"):
            np.testing.assert_allclose(getattr(la, field), getattr(lb, field), rtol=1e-5,
                                       err_msg=field)


class _Counting(keras.layers.Dense):
    """Counts its Python calls: one per trace of a pass through the model."""
    traced = 0

    def call(self, inputs):
        _Counting.traced += 1
        return super().call(inputs)


@pytest.mark.parametrize("eager", [False, True])
@pytest.mark.parametrize("steps_per_execution", [1, 2])
def test_a_probe_step_traces_only_the_probe_and_trains_every_batch(steps_per_execution, eager,
                                                                   monkeypatch):
    # The probe step hands its batches to the statistics step's trace: the
    # probe is the only new trace (its configured pass, and its float32 pass
    # traced once for the half and the quarter batch), and every batch trains.
    # Run eagerly (a fit of few probe calls, step_functions.eager_probes), it
    # traces nothing: its three passes call the layer once each, per probe.
    monkeypatch.setattr(step_functions, "EAGER_PROBES", 100 if eager else -1)
    traced, iterations, probes = {}, {}, {}
    for probe_every in (None, 2):
        keras.utils.set_random_seed(0)
        policies.set_global_policy("adaptive_bfloat16")
        model = keras.Sequential([keras.Input((4,)), _Counting(8), keras.layers.Dense(1)])
        model.compile(optimizer="adam", loss="mse", steps_per_execution=steps_per_execution)
        keras_mp.execution.configure(model, mode="graph")
        cb = AdaptivePrecision(interval=100, statistics_every=2, probe_every=probe_every,
                               first_decision=None)
        _Counting.traced = 0
        model.fit(*_xy(72), batch_size=8, epochs=1, verbose=0, callbacks=[cb])  # 9 batches
        traced[probe_every] = _Counting.traced
        iterations[probe_every] = int(model.optimizer.iterations)
        probes[probe_every] = cb._stats.read().probe_steps
        assert getattr(cb._probe_step, "eager", False) is (eager and probe_every is not None)
    calls = -(-9 // steps_per_execution)
    assert traced[2] - traced[None] == (3 * (calls // 2) if eager else 2)
    assert iterations == {None: 9, 2: 9}
    assert probes == {None: 0, 2: calls // 2}


def test_a_short_fit_probes_eagerly_and_a_long_one_traced():
    # The rule is the fit's count of probe calls (expected calls, probe_every,
    # the early decision): a fixed rule, no timing.
    model = _small("adaptive_bfloat16")
    assert step_functions.eager_probes(model, 69, 200, 20)
    most = step_functions.EAGER_PROBES
    assert step_functions.eager_probes(model, most * 200 - 1, 200, 20)
    assert not step_functions.eager_probes(model, most * 200, 200, 20)
    assert step_functions.eager_probes(model, most * 200, 200, None)  # no early probe
    assert not step_functions.eager_probes(model, None, 200, 20)  # length unknown
    quantized = _small("adaptive_float16")
    quantized.quantize("float8", filters=lambda layer: layer is quantized.layers[0])
    assert not step_functions.eager_probes(quantized, 69, 200, 20)  # Keras's float8 call
    cb = AdaptivePrecision(interval=100, statistics_every=2, probe_every=2, first_decision=2)
    assert 1 + 24 // 2 > most
    model.fit(*_xy(96), batch_size=4, epochs=1, verbose=0, callbacks=[cb])  # 24 calls, 13 probes
    assert not getattr(cb._probe_step, "eager", False)
    model.fit(*_xy(40), batch_size=8, epochs=1, verbose=0, callbacks=[cb])  # 5 calls, 1 probe
    assert cb._probe_step.eager and cb._stats.read().probe_steps >= 1


def test_per_layer_loss_scales_keep_the_probe_traced_in_a_short_fit():
    # Run eagerly, a layer's input reaches its loss-scale boundary already
    # cast to float16 (no float32 source to find), so the gradient it hands
    # back rounds in float16 at the global scale: the probe stays traced.
    model = _small(keras_mp.AdaptivePolicy(("float16", "float32"), layer_loss_scales=True))
    cb = AdaptivePrecision(interval=100, statistics_every=2, probe_every=2, first_decision=2)
    model.fit(*_xy(40), batch_size=8, epochs=1, verbose=0, callbacks=[cb])  # 5 calls, 3 probes
    assert not step_functions.eager_probes(model, 5, 2, 2)
    assert step_functions.eager_probes(_small("adaptive_float16"), 5, 2, 2)  # the count alone
    assert cb._probe_step is not None and not getattr(cb._probe_step, "eager", False)


def test_the_probe_under_mirrored_strategy_counts_once_per_probe():
    with two_replica_mirrored_strategy().scope():
        model = _small("adaptive_bfloat16")
    cb = AdaptivePrecision(interval=100, statistics_every=2, probe_every=2,
                           first_decision=None)
    model.fit(*_xy(32), batch_size=8, epochs=1, verbose=0, callbacks=[cb])
    interval = cb._stats.read()
    assert interval.steps == 2 and interval.probe_steps == 2
    assert all(0 <= s.grad_error < 0.1 for s in interval.layers)


def test_history_and_tensorboard_logging(tmp_path):
    model = _small("adaptive_bfloat16")
    policies.policy_of(model).assign(model.layers[0].path, "float32")
    policies.policy_of(model).rule = keras_mp.adaptive.decisions.controller.DecisionRule(patience=1, cooldown=0)
    cb = AdaptivePrecision(interval=2, log_dir=str(tmp_path))
    h = model.fit(*_xy(16), batch_size=8, epochs=3, verbose=0, callbacks=[cb])
    # a trial at call 2, validated by the probe at call 4
    assert h.history["precision_switches"] == [0, 1, 0]
    assert h.history["precision_narrow_layers"] == [2, 3, 3]
    tags = set()
    for path in glob.glob(os.path.join(str(tmp_path), "*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            tags.update(v.tag for v in event.summary.value)
    assert f"precision/{model.layers[0].path}/bits" in tags
    assert "precision/switches" in tags and "precision/loss_scale" in tags



def test_the_callback_fit_adds_leaves_history_as_keras_has_it(adapt_every_fit):
    # A drop-in: Keras's own model_test.py compares History's keys exactly.
    keys = {}
    for policy in ("float32", "adaptive_bfloat16"):
        model = _small(policy)
        keys[policy] = set(model.fit(*_xy(16), batch_size=8, epochs=2, verbose=0).history)
    assert keys["adaptive_bfloat16"] == keys["float32"] == {"loss"}
    assert keras_mp.adaptive.fit.autofit.callback_of(model).history_logs is False
    with pytest.raises(TypeError, match="history_logs"):
        AdaptivePrecision(history_logs="no")

def test_custom_training_loop():
    model = _small("adaptive_float16")
    policy = policies.policy_of(model)
    cb = AdaptivePrecision(interval=3, loss_scale=_small_scale())
    cb.set_model(model)
    opt = model.optimizer
    x, y = _overflowing(8)  # every float16 step overflows in the first layer

    def make_step():
        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((tf.cast(model(x), "float32") - y) ** 2)
                scaled = opt.scale_loss(loss)
            grads = tape.gradient(scaled, model.trainable_variables)
            opt.apply(grads, model.trainable_variables)
        return step

    step, switched = make_step(), []
    for _ in range(6):
        step(x, y)
        made = cb.step_end()
        if made:
            switched += made
            step = make_step()
    assert switched and switched[0]["layer"] == model.layers[0].path
    assert policy.dtype_of(model.layers[0].path) == "float32"
    assert cb._stats.read().steps == 0  # the last decision consumed the interval


def test_under_mirrored_strategy():
    with two_replica_mirrored_strategy().scope():
        model = _small("adaptive_bfloat16")
    cb = AdaptivePrecision(interval=100, statistics_every=1, first_decision=None)
    model.fit(*_xy(32), batch_size=8, epochs=1, verbose=0, callbacks=[cb])
    interval = cb._stats.read()
    assert interval.steps == 4  # one accumulation per step, not per replica
    assert all(s.amax > 0 for s in interval.layers)


# -- persistence -------------------------------------------------------------

def _switched_model():
    model = _small("adaptive_float16")
    cb = AdaptivePrecision(interval=2, loss_scale=_small_scale())
    x, y = _overflowing()
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[cb])
    assert model.layers[0].compute_dtype == "float32", cb.events
    return model, cb


def test_keras_file_keeps_dtypes_controller_state_and_optimizer(tmp_path):
    model, _ = _switched_model()
    before = precision_report(model)
    scale = float(model.optimizer.loss_scale)
    path = str(tmp_path / "m.keras")
    model.save(path)
    policies.set_global_policy("float32")
    loaded = keras.saving.load_model(path)
    after = precision_report(loaded)
    assert after.dtypes().values() and list(after.dtypes().values()) == \
        list(before.dtypes().values())
    assert [r["state"] for r in after.rows] == [r["state"] for r in before.rows]
    assert [r["history"] for r in after.rows] == [r["history"] for r in before.rows]
    assert isinstance(loaded.optimizer, keras_mp.LossScaleOptimizer)
    assert float(loaded.optimizer.loss_scale) == scale
    # Resuming: the callback continues from the restored state, no new switch.
    cb = AdaptivePrecision(interval=2)
    x, y = _xy(16)
    loaded.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[cb])
    assert cb.events == []
    assert loaded.layers[0].compute_dtype == "float32"
    assert precision_report(loaded).rows[0]["switches"] == before.rows[0]["switches"]


def test_weights_of_a_model_never_adapted_load_into_an_adapted_one(tmp_path):
    # Keras's embedding_test.py::test_enable_lora: a fresh model's weights
    # file (no keras-mp state in it) is loaded into a trained model.
    model, _ = _switched_model()
    before = precision_report(model)
    policies.set_global_policy("adaptive_float16")
    fresh = keras.Sequential([keras.Input((4,))] + [keras.layers.Dense(u) for u in (8, 4, 1)])
    path = str(tmp_path / "fresh.weights.h5")
    fresh.save_weights(path)
    scale = float(model.optimizer.loss_scale)
    with pytest.warns(UserWarning, match="Skipping variable loading for optimizer"):
        model.load_weights(path)  # no optimizer in the file: Keras's warning, the state kept
    assert float(model.optimizer.loss_scale) == scale
    for a, b in zip(model.weights, fresh.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())  # the weights are the file's
    after = precision_report(model)  # the state is kept
    assert [r["state"] for r in after.rows] == [r["state"] for r in before.rows]
    assert model.layers[0].compute_dtype == "float32"


class _Interrupt(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == 1:
            raise RuntimeError("interrupted")


def test_backup_and_restore_resumes_with_the_same_precisions(tmp_path):
    backup = str(tmp_path / "backup")
    x, y = _overflowing()
    model = _small("adaptive_float16")
    cb = AdaptivePrecision(interval=2, loss_scale=_small_scale())
    with pytest.raises(RuntimeError, match="interrupted"):
        model.fit(x, y, batch_size=8, epochs=4, verbose=0, callbacks=[
            cb,
            keras.callbacks.BackupAndRestore(backup), _Interrupt()])
    states = [r["state"] for r in precision_report(model).rows]
    assert model.layers[0].compute_dtype == "float32"

    # A new process would rebuild the model from code: fresh policy, float16.
    keras.utils.clear_session(free_memory=False)
    fresh = _small("adaptive_float16")
    assert fresh.layers[0].compute_dtype == "float16"
    # No decision during the resumed epochs (nor the early one the first run had due).
    cb2 = AdaptivePrecision(interval=1000, first_decision=None)
    # The restoring callback listed first: order must not matter.
    fresh.fit(x, y, batch_size=8, epochs=4, verbose=0,
              callbacks=[keras.callbacks.BackupAndRestore(backup), cb2])
    assert fresh.layers[0].compute_dtype == "float32"
    assert [r["state"] for r in precision_report(fresh).rows] == states


# -- errors ------------------------------------------------------------------

def test_errors():
    with pytest.raises(ValueError, match="interval"):
        AdaptivePrecision(interval=0)
    with pytest.raises(ValueError, match="verbose"):
        AdaptivePrecision(verbose=2)
    with pytest.raises(ValueError, match="`loss_scale`"):
        AdaptivePrecision(loss_scale="sometimes")
    with pytest.raises(TypeError, match="`log_dir`"):
        AdaptivePrecision(log_dir=3)
    model = _small("float32")
    with pytest.raises(ValueError, match="set_global_policy"):
        model.fit(*_xy(), epochs=1, verbose=0, callbacks=[AdaptivePrecision()])
    policies.set_global_policy("adaptive_bfloat16")
    uncompiled = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match="compiled"):
        AdaptivePrecision().set_model(uncompiled)
    with pytest.raises(ValueError, match="set_model"):
        AdaptivePrecision().step_end()
    assert callbacks.AdaptivePrecision is AdaptivePrecision


def test_tf_checkpoint_carries_precisions_and_state_is_not_a_layer(tmp_path):
    x, y = _overflowing()
    model = _small("adaptive_float16")
    n_layers, n_weights = len(model.layers), len(model.weights)
    cb = AdaptivePrecision(interval=2, loss_scale=_small_scale())
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[cb])
    assert model.layers[0].compute_dtype == "float32", cb.events
    # Attached for saving, but not one of the model's layers or weights.
    assert (len(model.layers), len(model.weights)) == (n_layers, n_weights)
    states = [r["state"] for r in precision_report(model).rows]
    path = tf.train.Checkpoint(model=model).save(str(tmp_path / "ckpt"))

    keras.utils.clear_session(free_memory=False)
    fresh = _small("adaptive_float16")
    cb2 = AdaptivePrecision(interval=1000)
    cb2.set_model(fresh)  # attaches the state (as fit would) so the restore has a target
    status = tf.train.Checkpoint(model=fresh).restore(path)
    status.assert_existing_objects_matched()
    assert fresh.layers[0].compute_dtype == "float16"  # adopted when fit starts
    fresh.fit(*_xy(16), batch_size=8, epochs=1, verbose=0, callbacks=[cb2])
    assert fresh.layers[0].compute_dtype == "float32"
    assert [r["state"] for r in precision_report(fresh).rows] == states
    assert cb2.events == []


class Net(keras.Model):
    """A subclassed model: Keras keeps TensorFlow's dependency names of such
    a model (and of a KerasHub task) in a tracked dict."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.out = keras.layers.Dense(1)

    def call(self, x):
        return self.out(self.hidden(x))


def test_a_subclassed_model_trains_and_the_state_is_not_one_of_its_layers(tmp_path):
    policies.set_global_policy("adaptive_bfloat16")
    net = Net()
    net(np.ones((1, 4), "float32"))
    policies.set_global_policy("float32")
    names, n_weights = [layer.name for layer in net.layers], len(net.weights)
    net.compile(optimizer="adam", loss="mse")
    # Raised "You cannot add new elements of state ... already built" when
    # the callback attached its state; on a KerasHub task, the state became
    # two of its layers.
    history = net.fit(*_xy(16), batch_size=8, epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert ([layer.name for layer in net.layers], len(net.weights)) == (names, n_weights)
    saved = tf.train.Checkpoint(model=net).write(str(tmp_path / "ckpt"))
    assert any("_keras_mp_precision_state" in name for name, _ in tf.train.list_variables(saved))
