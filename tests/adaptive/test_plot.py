"""keras_mp.plot_precision: the picture of a run, drawn from what
AdaptivePrecision recorded (a float16 run whose input layer overflows)."""

import os
import sys

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp.adaptive.record import timeline
from keras_mp.adaptive.outputs.plot import DTYPE_COLORS


@pytest.fixture(scope="module")
def trained():
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    # Inputs beyond float16's 65504: the first layer is promoted (input_range).
    x = rng.uniform(0, 1e5, (320, 16)).astype("float32")
    y = rng.integers(0, 4, 320)
    with keras_mp.policy_scope(keras_mp.AdaptivePolicy(candidates=("float16", "float32"))):
        model = keras.Sequential([
            keras.Input((16,)), keras.layers.Dense(16, name="dense_in"),
            keras.layers.LayerNormalization(name="norm"),
            keras.layers.Dense(16, activation="relu", name="hidden"),
            keras.layers.Dense(4, dtype="float32", name="logits")], name="small")
    model.compile(optimizer=keras.optimizers.Adam(3e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    cb = keras_mp.callbacks.AdaptivePrecision(interval=5)
    model.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[cb])
    return model, cb


def test_the_picture_carries_every_layer_dtype_and_switch(trained, tmp_path):
    model, cb = trained
    report = keras_mp.precision_report(model)
    assert any(e["layer"].endswith("dense_in") and e["reason"] == "input_range"
               for e in cb.events), cb.events
    path = tmp_path / "precision.png"
    fig = keras_mp.plot_precision(model, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert fig._repr_png_()[:8] == b"\x89PNG\r\n\x1a\n"  # what a notebook shows
    ax, scale_ax = fig.axes[:2]
    # Rows: every controlled layer, in forward order.
    names = [t.get_text() for t in ax.get_yticklabels()]
    assert names == [r["layer"].split("/")[-1] for r in report.rows]
    assert names[0] == "dense_in"
    # Cells: all float16 at the start, each layer's final dtype at the end.
    codes = np.asarray(ax.collections[0].get_array()).reshape(len(names), -1)
    dtypes = list(DTYPE_COLORS)
    assert [dtypes[int(c)] for c in codes[:, 0]] == ["float16"] * len(names)
    assert [dtypes[int(c)] for c in codes[:, -1]] == [r["dtype"] for r in report.rows]
    # Each switch: a marker at its step and row, its reason in the legend and beside it.
    markers = {c.get_gid(): c.get_offsets().tolist() for c in ax.collections[1:]}
    texts = [t.get_text() for t in ax.texts]
    for e in cb.events:
        row = names.index(e["layer"].split("/")[-1])
        assert [e["step"], row + 0.5] in markers[f"switch:{e['reason']}"]
        assert f" {e['old']}->{e['new']} ({e['reason']})" in texts
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any(t.startswith("input_range (") for t in legend), legend
    # The loss scale as recorded at each decision, and the skipped steps.
    entries = timeline.of(model).entries
    line = scale_ax.get_lines()[0]
    assert line.get_label() == "global loss scale"
    assert list(line.get_ydata())[:-1] == [e["loss_scale"] for e in entries]
    skipped = int(model.optimizer.skipped_steps.numpy())
    assert skipped > 0
    labels = [t.get_text() for t in scale_ax.get_legend().get_texts()]
    assert f"skipped steps per interval ({skipped} in all)" in labels


def test_clear_errors(trained, monkeypatch):
    model, _ = trained
    with pytest.raises(ValueError, match="dpi"):
        keras_mp.plot_precision(model, dpi=5)
    with pytest.raises(TypeError, match="model"):
        keras_mp.plot_precision("model.keras")
    with keras_mp.policy_scope("float32"):
        plain = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match="no adaptive policy"):
        keras_mp.plot_precision(plain)
    with keras_mp.policy_scope("adaptive_float16"):
        fresh = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match="not trained"):
        keras_mp.plot_precision(fresh)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # not installed
    with pytest.raises(ImportError, match=r"keras-mp\[plot\]"):
        keras_mp.plot_precision(model)


def test_the_picture_is_replaced_whole_or_not_at_all(trained, tmp_path):
    """Written beside the file and renamed into place (keras_mp/_atomic.py): no
    temporary stays, and one a killed process left in the folder goes."""
    from tests.faults import dead_pid

    model, _ = trained
    stale = tmp_path / f".precision.png.tmp-{dead_pid()}-0123abcd.png"
    stale.write_bytes(b"\x89PNG half")
    (tmp_path / "precision.png").write_bytes(b"an older picture")
    keras_mp.plot_precision(model, tmp_path / "precision.png")
    assert os.listdir(tmp_path) == ["precision.png"]
    assert (tmp_path / "precision.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
