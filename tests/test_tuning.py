"""keras_mp.tuning: schedules from hp, the precision HyperModel, metrics, and a
real Keras Tuner search on the embedded digits."""

import keras
import keras_tuner
import numpy as np
import pytest

import keras_mp
from keras_mp import datasets, tuning


def _digits(n_train=384, n_val=128):
    (x, y), (xt, yt) = datasets.load_digits()
    return (x[:n_train].reshape(n_train, 64), y[:n_train]), (xt[:n_val].reshape(n_val, 64),
                                                              yt[:n_val])


def _build_model(hp):
    return keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(hp.Int("units", 16, 32, step=16), activation="relu"),
        keras.layers.Dense(10, dtype="float32"),  # float32 logits under any policy
    ])


# -- loss_scale_schedule ------------------------------------------------------

def test_default_space_registers_every_parameter():
    hp = keras_tuner.HyperParameters()
    s = tuning.loss_scale_schedule(hp)
    assert isinstance(s, keras_mp.DynamicLossScale)
    assert set(hp.values) == {"ls_" + p for p in tuning.PARAMETERS}
    init = hp.get("ls_initial_scale")
    space = {h.name: h for h in hp.space}
    assert space["ls_initial_scale"].sampling == "log"
    assert space["ls_growth_interval"].sampling == "log"
    assert space["ls_initial_scale"].min_value == 2.0**8
    assert s.initial_scale == init and s.min_scale <= s.initial_scale <= s.max_scale


def test_narrow_fix_choose_and_rename():
    hp = keras_tuner.HyperParameters()
    s = tuning.loss_scale_schedule(
        hp, prefix="a_", names={"hysteresis": "hyst"},
        initial_scale=(2.0**10, 2.0**12), growth_interval=[7, 9], growth_factor=3.0,
        backoff_factor={"min": 0.3, "max": 0.6, "step": 0.1}, hysteresis=(2, 2),
        min_scale=0.5)
    space = {h.name: h for h in hp.space}
    assert set(space) == {"a_initial_scale", "a_growth_interval", "a_growth_factor",
                          "a_backoff_factor", "hyst", "a_min_scale"}
    assert (space["a_initial_scale"].min_value, space["a_initial_scale"].max_value) == \
        (2.0**10, 2.0**12)
    assert space["a_initial_scale"].sampling == "log"  # narrowing keeps the sampling
    assert isinstance(space["a_growth_interval"], keras_tuner.engine.hyperparameters.Choice)
    assert isinstance(space["a_growth_factor"], keras_tuner.engine.hyperparameters.Fixed)
    assert s.growth_factor == 3.0 and s.hysteresis == 2 and s.min_scale == 0.5
    assert s.growth_interval in (7, 9)


def test_values_set_by_the_tuner_are_used():
    hp = keras_tuner.HyperParameters()
    tuning.loss_scale_schedule(hp)
    # A tuner sets values before calling build; the schedule must follow them.
    hp.values.update({"ls_initial_scale": 4096.0, "ls_growth_interval": 123,
                      "ls_growth_factor": 4.0, "ls_backoff_factor": 0.25,
                      "ls_hysteresis": 3, "ls_min_scale": 0.125})
    s = tuning.loss_scale_schedule(hp)
    assert s.get_config() == keras_mp.DynamicLossScale(
        initial_scale=4096.0, growth_interval=123, growth_factor=4.0, backoff_factor=0.25,
        hysteresis=3, min_scale=0.125).get_config()


@pytest.mark.parametrize("kwargs, exc, argument", [
    ({"initial_scale": (10.0,)}, ValueError, "initial_scale"),
    ({"growth_interval": []}, ValueError, "growth_interval"),
    ({"growth_factor": "big"}, TypeError, "growth_factor"),
    ({"backoff_factor": {"min": 0.9, "max": 0.1}}, ValueError, "backoff_factor"),
    ({"min_scale": {"min": 0.0, "max": 1.0, "sampling": "log"}}, ValueError, "min_scale"),
    ({"hysteresis": {"min": 1, "max": 3, "sampling": "cubic"}}, ValueError, "hysteresis"),
    ({"initial_scale": {"min": 1, "max": 8, "scale": 2}}, ValueError, "initial_scale"),
    ({"min_scale": 2.0**9}, ValueError, "min_scale"),  # could exceed initial_scale
    ({"initial_scale": 2.0**30}, ValueError, "max_scale"),
    ({"max_scale": -1.0}, ValueError, "max_scale"),
    ({"prefix": 3}, TypeError, "prefix"),
    ({"names": {"initial": "x"}}, ValueError, "names"),
    ({"warmup": 3}, TypeError, "initial_scale"),  # the error lists the valid parameters
])
def test_loss_scale_schedule_rejects_bad_input(kwargs, exc, argument):
    with pytest.raises(exc, match=argument):
        tuning.loss_scale_schedule(keras_tuner.HyperParameters(), **kwargs)


def test_loss_scale_schedule_needs_hyperparameters():
    with pytest.raises(TypeError, match="`hp`"):
        tuning.loss_scale_schedule({"initial_scale": 2.0})


def test_objective_directions():
    assert tuning.objective("skipped_steps").direction == "min"
    assert tuning.objective("low_precision_fraction").direction == "max"
    assert tuning.objective("val_step_time").name == "val_step_time"
    with pytest.raises(ValueError, match="`name`"):
        tuning.objective("accuracy")


# -- TuningMetrics --------------------------------------------------------------

def test_tuning_metrics_count_skips_and_low_precision():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    model = _build_model(keras_tuner.HyperParameters())
    keras.mixed_precision.set_global_policy("float32")
    opt = keras_mp.LossScaleOptimizer(keras.optimizers.SGD(0.01),
                                      schedule=keras_mp.DynamicLossScale(initial_scale=1024.0))
    model.compile(opt, keras.losses.MeanSquaredError())
    x = np.ones((16, 64), "float32")
    y = np.zeros((16, 10), "float32")
    y[4] = np.inf  # the second batch of 4 has an infinite loss: skipped
    cb = tuning.TuningMetrics()
    h = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0, callbacks=[cb])
    assert h.history["skipped_steps"] == [1.0, 2.0]
    assert h.history["loss_scale"] == [512.0, 256.0]
    assert h.history["low_precision_fraction"] == [0.5, 0.5]  # float32 logits layer
    assert all(t > 0 for t in h.history["step_time"])


def test_tuning_metrics_needs_a_model():
    with pytest.raises(ValueError, match="set_model"):
        tuning.TuningMetrics().current()


# -- PrecisionHyperModel --------------------------------------------------------

def test_build_uses_policy_schedule_and_fresh_optimizer():
    hm = tuning.PrecisionHyperModel(_build_model, policies=["mixed_bfloat16", "float32"],
                                    optimizer=lambda hp: keras.optimizers.Adam(
                                        hp.Float("lr", 1e-3, 1e-2, sampling="log")),
                                    loss="sparse_categorical_crossentropy",
                                    loss_scale={"initial_scale": 256.0, "hysteresis": 2})
    hp = keras_tuner.HyperParameters()
    hp.values["policy"] = "float32"
    m1 = hm.build(hp)
    assert hp.values["policy"] == "float32"
    assert [layer.compute_dtype for layer in m1.layers] == ["float32", "float32"]
    assert isinstance(m1.optimizer, keras_mp.LossScaleOptimizer)
    assert m1.optimizer.schedule.initial_scale == 256.0 and m1.optimizer.schedule.hysteresis == 2
    hp.values["policy"] = "mixed_bfloat16"
    m2 = hm.build(hp)
    assert m2.layers[0].compute_dtype == "bfloat16"
    assert m2.optimizer.inner_optimizer is not m1.optimizer.inner_optimizer
    # the policy scope does not leak into the global policy
    assert keras.mixed_precision.global_policy().name == "float32"


def test_build_wraps_a_compiled_models_optimizer_and_keeps_its_loss():
    def build(hp):
        model = _build_model(hp)
        model.compile(keras.optimizers.SGD(0.05),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        return model

    hm = tuning.PrecisionHyperModel(build, policies="float32",
                                    loss_scale=keras_mp.FixedLossScale(8.0))
    model = hm.build(keras_tuner.HyperParameters())
    assert isinstance(model.optimizer, keras_mp.LossScaleOptimizer)
    assert isinstance(model.optimizer.inner_optimizer, keras.optimizers.SGD)
    assert float(model.optimizer.loss_scale) == 8.0
    (x, y), _ = _digits(32, 8)
    logs = model.fit(x, y, epochs=1, verbose=0).history
    assert "accuracy" in logs


@pytest.mark.parametrize("kwargs, exc, argument", [
    ({"policies": []}, ValueError, "policies"),
    ({"policies": ["float32", "float64x"]}, ValueError, "policies"),
    ({"policies": ["float32", "float32"]}, ValueError, "policies"),
    ({"optimizer": 3}, TypeError, "optimizer"),
    ({"adaptive_interval": 0}, ValueError, "adaptive_interval"),
    ({"loss_scale": {"hysteresis": 0.5}}, ValueError, "hysteresis"),
    ({"loss_scale": "huge"}, ValueError, "schedule"),
])
def test_hypermodel_rejects_bad_input(kwargs, exc, argument):
    with pytest.raises(exc, match=argument):
        tuning.PrecisionHyperModel(_build_model, loss="mse", **kwargs)


def test_hypermodel_rejects_bad_build_model_and_missing_loss():
    with pytest.raises(TypeError, match="build_model"):
        tuning.PrecisionHyperModel("not callable")
    with pytest.raises(ValueError, match="`loss`"):
        tuning.PrecisionHyperModel(_build_model).build(keras_tuner.HyperParameters())
    with pytest.raises(TypeError, match="build_model"):
        tuning.PrecisionHyperModel(lambda hp: 3, loss="mse").build(
            keras_tuner.HyperParameters())


# -- a real search -------------------------------------------------------------

def test_random_search_end_to_end(tmp_path):
    (x, y), (xv, yv) = _digits()
    hm = tuning.PrecisionHyperModel(
        _build_model, policies=["adaptive_bfloat16", "mixed_bfloat16", "float32"],
        optimizer=lambda hp: keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"], adaptive_interval=2,
        loss_scale={"growth_interval": [2, 4], "initial_scale": (2.0**8, 2.0**12)})
    tuner = keras_tuner.RandomSearch(hm, objective="val_accuracy", max_trials=3, seed=3,
                                     directory=str(tmp_path), project_name="digits",
                                     overwrite=True)
    tuner.search(x, y, validation_data=(xv, yv), epochs=2, batch_size=64, verbose=0)

    trials = [t for t in tuner.oracle.trials.values() if t.status == "COMPLETED"]
    assert len(trials) == 3
    for t in trials:
        for name in ("loss_scale", "skipped_steps", "low_precision_fraction", "step_time",
                     "val_accuracy"):
            assert t.metrics.exists(name), (name, t.hyperparameters.values)
        policy = t.hyperparameters.get("policy")
        low = t.metrics.get_last_value("low_precision_fraction")
        assert low == (0.0 if policy == "float32" else 0.5), (policy, low)
        assert t.metrics.get_last_value("skipped_steps") == 0.0
        # 12 steps with growth every 2 or 4: the scale grew from its draw
        scale0 = t.hyperparameters.get("ls_initial_scale")
        assert t.metrics.get_last_value("loss_scale") > scale0
    assert (tmp_path / "digits" / "oracle.json").exists()

    best_hp = tuner.get_best_hyperparameters(1)[0]
    best = tuner.get_best_models(1)[0]
    assert isinstance(best.optimizer, keras_mp.LossScaleOptimizer)
    assert best.optimizer.schedule.initial_scale == best_hp.get("ls_initial_scale")
    assert best.optimizer.schedule.growth_interval == best_hp.get("ls_growth_interval")
    acc = best.evaluate(xv, yv, verbose=0, return_dict=True)["accuracy"]
    # the best epoch's weights were restored, and they were trained (chance: 0.1)
    assert acc == pytest.approx(tuner.oracle.get_best_trials(1)[0].score, abs=1e-6)
    assert acc > 0.5


def test_search_on_a_tuning_metric_as_objective(tmp_path):
    (x, y), (xv, yv) = _digits(128, 32)
    hm = tuning.PrecisionHyperModel(_build_model, policies=["mixed_bfloat16", "float32"],
                                    loss=keras.losses.SparseCategoricalCrossentropy(
                                        from_logits=True))
    tuner = keras_tuner.RandomSearch(hm, objective=tuning.objective("low_precision_fraction"),
                                     max_trials=2, seed=1, directory=str(tmp_path),
                                     project_name="lp", overwrite=True)
    tuner.search(x, y, validation_data=(xv, yv), epochs=1, batch_size=64, verbose=0)
    best = tuner.oracle.get_best_trials(1)[0]
    values = [t.score for t in tuner.oracle.trials.values()]
    assert best.score == max(values)
