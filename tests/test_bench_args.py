"""The benchmark scripts' arguments are checked before any work (a clear
error naming the argument and its allowed values)."""

import pytest

from benchmarks import llm_memory, skip_overhead


@pytest.mark.parametrize("call, match", [
    (lambda: skip_overhead.run(model_kind="resnet"), r"`model_kind` must be one of \('mlp'"),
    (lambda: skip_overhead.run(batch=0), "`batch` must be a whole number >= 1"),
    (lambda: skip_overhead.run(batch=True), "`batch` must be a whole number >= 1"),
    (lambda: skip_overhead.run(rounds=3), "`rounds` must be a whole number >= 7"),
    (lambda: llm_memory.run(optimizer="rmsprop"), r"`optimizer` must be one of \['adam'"),
    (lambda: llm_memory.run(variants=["nope"]), "`variants` must be among"),
])
def test_bad_arguments_are_refused_before_any_work(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_every_optimizer_of_the_memory_bench_is_a_keras_optimizer():
    import keras

    for name, (cls, kwargs) in llm_memory.OPTIMIZERS.items():
        assert isinstance(getattr(keras.optimizers, cls)(1e-4, **kwargs),
                          keras.optimizers.Optimizer), name
