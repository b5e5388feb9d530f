"""benchmarks.user_code and its keras.io examples (issue 49, item 4): the
pairs compared on this CPU, bad input, and an example as the bench's child
process runs it."""

import keras
import pytest

import keras_mp
from benchmarks import keras_io_examples, user_code


def test_adaptive_is_compared_with_the_keras_policy_of_the_dtype_it_picks_here():
    first = keras_mp.device.default_candidates()[0]
    expected = "keras_float32" if first == "float32" else f"keras_mixed_{first}"
    # On a float32-only CPU Keras's other one-liner, float32 under XLA, too.
    xla = (("adaptive", user_code.XLA),) if first == "float32" else ()
    for name in user_code.EXAMPLES:
        assert user_code.pairs(name) == (("adaptive", expected),
                                         ("adaptive_float16", "keras_mixed_float16"), *xla)
    assert user_code.pairs("small_fit") == user_code.PAIRS["small_fit"]


def test_the_xla_variant_compiles_every_model_with_jit_compile(monkeypatch):
    monkeypatch.setattr(keras.Model, "compile", keras.Model.compile)  # put back after
    policy = keras.mixed_precision.global_policy()
    try:
        user_code._set_policy(user_code.XLA)
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        assert model.jit_compile is True
        assert keras.mixed_precision.global_policy().name == "float32"
    finally:
        keras.mixed_precision.set_global_policy(policy)


@pytest.mark.parametrize("call, match", [
    (lambda: user_code.pairs("nope"), "`scenario` must be one of"),
    (lambda: user_code.run("nope"), "`scenario` must be one of"),
    (lambda: user_code.run("ts_fcn", rounds=0), "`rounds` must be an int >= 1"),
    (lambda: user_code.run("ts_fcn", scale=0), r"`scale` must be a number in \(0, 100\]"),
    (lambda: user_code.run("ts_fcn", policy="mixed_float16"), "`policy` must be one of"),
    (lambda: keras_io_examples.build("nope"), "`name` must be one of"),
    (lambda: keras_io_examples.build("unet", scale=True), "`scale` must be a number"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_an_example_trains_under_adaptive_as_the_child_times_it():
    keras_mp.set_global_policy("adaptive")
    try:
        times = user_code._example("ts_fcn", "adaptive", 0.02)
    finally:
        keras_mp.set_global_policy("float32")
    assert 0 < times["fit_wall_s"] <= times["wall_s"]
    assert times["cpu_s"] > 0
    keras.mixed_precision.set_global_policy("float32")
