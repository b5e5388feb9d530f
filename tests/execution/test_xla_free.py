"""A small-output Dense model on a CPU trains without XLA in its process:
what keras_mp would measure by compiling XLA code is measured in a child
process (placement.measure_elsewhere), and where the measurements say XLA
cannot help, the step is traced without it (reasons.little_to_compile)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import keras
import pytest

import keras_mp
from keras_mp.device import xla
from keras_mp.execution import placement, reasons

pytestmark = pytest.mark.skipif(xla.current_device_type() != "CPU", reason="a rule for CPUs")


def test_small_xla_work_names_the_layers_that_hold_the_weights():
    mlp = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(2)])
    cnn = keras.Sequential([keras.Input((8, 8, 16)), keras.layers.Conv2D(64, 3),
                            keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(2)])
    wide = keras.Sequential([keras.Input((8,)), keras.layers.Dense(5000)])
    mixed = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3),
                              keras.layers.Flatten(), keras.layers.Dense(2)])
    normed = keras_mp.fuse(keras.Sequential([keras.Input((8,)), keras.layers.Dense(16),
                                             keras.layers.LayerNormalization(),
                                             keras.layers.Dense(2)]))
    assert reasons.small_xla_work(mlp) == "dense"
    assert reasons.small_xla_work(cnn) == "convolution"
    assert reasons.small_xla_work(wide) is None        # 5000 outputs: the fused loss's work
    assert reasons.small_xla_work(mixed) is None       # neither holds 95 % of the weights
    assert reasons.small_xla_work(normed) is None      # a fused normalization runs under XLA


def test_the_update_decides_for_a_dense_model():
    """An update XLA could fuse (RMSprop has no native kernel) keeps the trial."""
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(2)])
    model.compile(optimizer="rmsprop", loss="mse")
    assert reasons.little_to_compile(model) is None
    model.compile(optimizer="adam", loss="mse")
    why = reasons.little_to_compile(model)
    if reasons.slow_matmul(model) is None:     # float32: XLA's matmuls are not slower here
        assert why is None
    else:
        assert why.startswith("Dense layers hold 100.0% of its weights")
    # Asked for by the user, XLA's kernels run whatever the rule would say.
    keras_mp.config.set_xla("elementwise", True)
    try:
        assert reasons.little_to_compile(model) is None
    finally:
        keras_mp.config.set_xla("elementwise", None)


_CHILD = textwrap.dedent("""
    import json, subprocess
    import numpy as np, keras, keras_mp
    from keras_mp.device import xla
    from keras_mp.execution import first_calls, placement, reasons
    import sys
    if sys.argv[1] == "long":   # stands for a fit long in seconds: it measures
        first_calls.TRIAL_AFTER_S = 0.0
    compiled, children = [], []
    real_uses, real_run = xla.uses_xla, subprocess.run
    def uses(kind, device_type=None):
        out = real_uses(kind, device_type)
        if out:
            compiled.append(kind)
        return out
    def run(*args, **kwargs):
        children.append(args[0][:2])
        return real_run(*args, **kwargs)
    xla.uses_xla, subprocess.run = uses, run
    keras.utils.set_random_seed(0)
    keras_mp.set_global_policy("adaptive")
    model = keras_mp.fuse(keras.Sequential([
        keras.Input((32,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)]),
        inplace=True)
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.default_rng(0).normal(size=(512, 32)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    # 1024 steps: a fit long enough to measure (reasons.SHORT_FIT)
    h = model.fit(x, y, batch_size=1, epochs=2, verbose=0,
                  callbacks=[keras_mp.callbacks.AdaptivePrecision(interval=4)])
    print("RESULT " + json.dumps({
        "dtypes": sorted({l.compute_dtype for l in model.layers}),
        "little": reasons.little_to_compile(model), "chosen": keras_mp.execution.chosen(model),
        "compiled": compiled, "children": len(children), "loss": h.history["loss"],
        "recorded": "CPU" in xla._available}))
""")


@pytest.mark.parametrize("length", ["long", "seconds"])
def test_a_small_dense_model_trains_without_xla_in_its_process(tmp_path, length):
    """In a fresh process: where its fit is long in seconds, one child
    measures; where its first calls show the fit takes seconds, nothing is
    measured (no child, no trial); either way nothing keras_mp runs in the
    training process asks for XLA, and the model trains."""
    proc = subprocess.run([sys.executable, "-c", _CHILD, length], capture_output=True,
                          text=True, timeout=600, cwd=tmp_path)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    if length == "seconds":
        assert out["children"] == 0 and out["chosen"] == "graph" and out["compiled"] == []
        assert out["little"].startswith("its 1024 calls take about")
        assert out["loss"][-1] < out["loss"][0]
        return
    assert out["children"] == 1 and out["recorded"]
    assert out["loss"][-1] < out["loss"][0]
    if out["little"] is None:   # XLA's matmuls not slower in this dtype here: XLA may help
        pytest.skip(f"XLA may help here (compute dtypes {out['dtypes']})")
    assert out["little"].startswith("Dense layers hold")
    assert out["chosen"] == "graph" and out["compiled"] == []


def test_a_child_that_cannot_start_leaves_the_measurement_here(monkeypatch, caplog):
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
    monkeypatch.setattr(placement.micro_benchmark, "cached", lambda *a, **k: None)
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    with caplog.at_level("INFO", logger="keras_mp"):
        assert placement.measure_elsewhere(model) is False
    assert "could not measure matmuls in a child process" in caplog.text


def test_results_measured_elsewhere_are_kept(monkeypatch):
    """What the child prints becomes this process's measurements."""
    model = keras_mp.fuse(keras.Sequential([keras.Input((8,)),
                                            keras.layers.Dense(4, activation="tanh")]))
    found = {"xla_available": True, "epilogues": {"tanh": 0.5},
             "matmul": {"float32": {"graph": 100.0, "xla": 50.0}}}
    monkeypatch.setattr(placement.micro_benchmark, "_cache", {})
    monkeypatch.setattr(placement, "_epilogue_cache", {})
    monkeypatch.setattr(xla, "_available", {})

    def run(cmd, **kwargs):
        assert json.loads(cmd[-1]) == ["float32", ["tanh"]]
        return subprocess.CompletedProcess(cmd, 0, placement._MARK + json.dumps(found) + "\n", "")
    monkeypatch.setattr(placement.subprocess, "run", run)
    assert placement.measure_elsewhere(model) is True
    assert placement.micro_benchmark.cached("CPU", steps=False).matmul == found["matmul"]
    assert placement.epilogue("tanh", "float32", "CPU") == 0.5
    assert xla.xla_available("CPU") is True
    # Everything kept: no second child.
    monkeypatch.setattr(placement.subprocess, "run", None)
    assert placement.measure_elsewhere(model) is True
