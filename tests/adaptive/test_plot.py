"""keras_mp.plot_precision: the picture of a run, drawn from what
AdaptivePrecision recorded (a float16 run whose input layer overflows), and
its layout: labels that never overlap, legends inside the image, for 2, 50
and 70 layers, with and without switches."""

import os
import sys

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp.adaptive.integration import switching
from keras_mp.adaptive.outputs.plot import DTYPE_COLORS
from keras_mp.adaptive.outputs.report import switch_text
from keras_mp.adaptive.policy.controlled_layers import adaptive_layers
from keras_mp.adaptive.record import timeline


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
    labels = {t.get_gid(): t.get_text() for t in ax.texts}
    for e in cb.events:
        row = names.index(e["layer"].split("/")[-1])
        assert [e["step"], row + 0.5] in markers[f"switch:{e['reason']}"]
        assert switch_text(e) in labels[f"switches:{e['layer']}"].split(", ")
    _check_layout(fig)
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


def test_the_picture_shows_the_training_state_as_stored(trained):
    # The bottom panel: weights, gradients and moments stacked, from the
    # sizes the timeline recorded at each decision, as stored.
    model, _ = trained
    fig = keras_mp.plot_precision(model)
    state_ax = fig.axes[2]
    entries = timeline.of(model).entries
    assert all("state_mib" in e for e in entries)
    last = entries[-1]["state_mib"]
    assert last == timeline.state_mib(model, model.optimizer)
    assert last["weights"] > 0 and last["gradients"] > 0 and last["moments"] > 0
    legend = [t.get_text() for t in state_ax.get_legend().get_texts()]
    assert legend == [f"{k} ({last[k]:.1f} MiB)" for k in ("weights", "gradients", "moments")]
    assert state_ax.get_ylabel() == "training state MiB"
    _check_layout(fig)


def test_compact_storage_shows_in_the_state_it_records():
    # A bfloat16 weight and its gradient count 2 bytes an element.
    with keras_mp.policy_scope("adaptive_bfloat16"):
        model = keras.Sequential([keras.Input((1024,)), keras.layers.Dense(512)])
    from keras_mp.adaptive.storage import variables
    full = timeline.state_mib(model, None)
    variables.store_as(model.layers[0].kernel, "bfloat16")
    half = timeline.state_mib(model, None)
    assert half["weights"] == pytest.approx(full["weights"] - 1.0, abs=0.01)   # 2 MiB -> 1
    assert half["gradients"] == half["weights"]


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


def _check_layout(fig):
    """The drawn picture, measured with its renderer: no two switch labels
    overlap (text or box), each inside the layer rows; every legend inside
    the image, right of the plots, none over another. Returns the labels."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.legend import Legend

    FigureCanvasAgg(fig).draw()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    rows = ax.get_window_extent(renderer)
    labels = list(ax.texts)
    boxes = [(t.get_window_extent(renderer), t.get_bbox_patch().get_window_extent(renderer))
             for t in labels]
    for k, (text, patch) in enumerate(boxes):
        assert rows.x0 <= text.x0 and text.x1 <= rows.x1, (labels[k].get_text(), text, rows)
        for other, other_patch in boxes[k + 1:]:
            assert not text.overlaps(other) and not patch.overlaps(other_patch), \
                (labels[k].get_text(), text, other)
    legends = list({id(x): x for x in fig.findobj(Legend)}.values())
    extents = [x.get_window_extent(renderer) for x in legends]
    for k, extent in enumerate(extents):
        title = legends[k].get_title().get_text()
        assert 0 <= extent.x0 and extent.x1 <= fig.bbox.x1 and 0 <= extent.y0 \
            and extent.y1 <= fig.bbox.y1, (title, extent, fig.bbox)
        assert extent.x0 >= rows.x1, (title, extent, rows)
        assert not any(extent.overlaps(other) for other in extents[k + 1:]), title
    return labels, [x.get_title().get_text() for x in legends]


def _stack(n, policy="adaptive_bfloat16"):
    with keras_mp.policy_scope(policy):
        return keras.Sequential([keras.Input((4,)), *(keras.layers.Dense(4) for _ in range(n))],
                                name=f"stack{n}")


def _recorded(model, switches, end):
    """``switches`` (layer index, step, new dtype, reason), made as
    AdaptivePrecision makes them, in a run of ``end`` steps."""
    policy = keras_mp.policies.policy_of(model)
    layers = adaptive_layers(model, policy)
    paths = [layer.path for layer in layers]
    timeline.record(model, 0, None, paths, None)
    for k, step, new, reason in sorted(switches, key=lambda s: s[1]):
        switching.apply(policy, paths, layers, [(k, policy.dtype_of(paths[k]), new, reason)],
                        calls=step)
    timeline.finish(model, end)
    return model


def _twice_at(k, step):
    return [(k, step, "float32", "no_gain"), (k, step, "bfloat16", "gain")]


@pytest.mark.parametrize("n", [50, 70])
@pytest.mark.parametrize("case", ["none", "few", "many"])
def test_labels_and_legends_of_deep_models(n, case):
    """Switches recorded as the callback records them: none; a few (two at
    one step on each of three layers, three close together on one, one at
    the last step), all written out; one on each layer (too many to write)."""
    switches = {"none": [],
                "few": [*_twice_at(0, 0), *_twice_at(1, 0), *_twice_at(n - 1, 0),
                        (5, 40, "float32", "input_range"), (5, 41, "bfloat16", "healthy"),
                        (5, 43, "float32", "probe_error"), (n // 2, 399, "float32", "with_parent")],
                "many": [(k, 7 * k % 400, "float32", "probe_error") for k in range(n)]}[case]
    model = _recorded(_stack(n), switches, end=400)
    fig = keras_mp.plot_precision(model)
    labels, legends = _check_layout(fig)
    assert len(fig.axes[0].get_yticklabels()) == n
    assert legends[0] == "dtype"
    assert ("switch reason (count)" in legends) == bool(switches)
    if case == "few":
        texts = {t.get_gid(): t.get_text() for t in labels}
        assert len(texts) == 5
        paths = [layer.path for layer in model.layers]
        assert texts[f"switches:{paths[0]}"] == \
            "bfloat16->float32@0 (no_gain), float32->bfloat16@0 (gain)"
        assert texts[f"switches:{paths[5]}"].split(", ") == [
            "bfloat16->float32@40 (input_range)", "float32->bfloat16@41 (healthy)",
            "bfloat16->float32@43 (probe_error)"]
        assert texts[f"switches:{paths[n // 2]}"] == "bfloat16->float32@399 (with_parent)"
    else:
        assert labels == []


def test_labels_and_legends_of_two_layers_after_real_fits():
    """Two layers, real fits: one that adapts and switches nothing, then one
    whose first fit is too small to gain (``no_gain``), the next adapting it
    (``gain``, at the same step) while its input overflows float16
    (``input_range``)."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 4)).astype("float32"), rng.normal(size=(32, 1))
    calm = _stack(2)
    calm.compile(optimizer="adam", loss="mse")
    calm.fit(x, y, batch_size=8, epochs=2, verbose=0,
             callbacks=[keras_mp.callbacks.AdaptivePrecision(interval=2)])
    assert timeline.of(calm).last_step == 8
    assert all(not r["history"] for r in keras_mp.precision_report(calm).rows)
    labels, legends = _check_layout(keras_mp.plot_precision(calm))
    assert labels == [] and "dtype" in legends and "switch reason (count)" not in legends

    model = _stack(2, "adaptive_float16")
    model.compile(optimizer="adam", loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)  # too small to gain: float32
    x[::8, 0] = 7e4  # beyond float16
    model.fit(x, y, batch_size=8, epochs=2, verbose=0,
              callbacks=[keras_mp.callbacks.AdaptivePrecision(interval=2)])
    first, last = keras_mp.precision_report(model).rows
    assert [h["reason"] for h in first["history"]] == ["no_gain", "gain", "input_range"]
    assert [(h["step"], h["reason"]) for h in last["history"][:2]] == [(0, "no_gain"),
                                                                       (0, "gain")]
    fig = keras_mp.plot_precision(model)
    labels, legends = _check_layout(fig)
    assert {t.get_gid(): t.get_text().split(", ") for t in labels} == {
        f"switches:{r['layer']}": [switch_text(h) for h in r["history"]] for r in (first, last)}
    # The loss scale's and the training state's legends (no title) below.
    assert sorted(legends) == ["", "", "dtype", "switch reason (count)"]
    switches = len(first["history"]) + len(last["history"])
    assert fig.axes[0].get_title().endswith(f"2 layers, {switches} switches")


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
