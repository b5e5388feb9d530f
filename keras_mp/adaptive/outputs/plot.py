"""``plot_precision(model)``: one picture of what adaptive precision did in a
run: every layer's dtype over the steps (rows in forward order, coloured by
dtype), each switch marked with its reason, and below, the global loss scale,
the per-layer loss scales where used, and the steps skipped.

It draws from what is already recorded: the switch history of each layer
(kept in the policy, :func:`keras_mp.precision_report`) and the loss scales
and skipped steps that :class:`keras_mp.callbacks.AdaptivePrecision` notes at
each decision (:mod:`keras_mp.adaptive.record.timeline`). matplotlib is an optional
extra (``pip install "keras-mp[plot]"``).

Example:
    >>> import keras, numpy as np, keras_mp
    >>> keras_mp.set_global_policy("adaptive_float16")
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
    ...                           keras.layers.Dense(1)])
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> _ = model.fit(np.ones((16, 4)), np.ones((16, 1)), batch_size=4, epochs=2, verbose=0,
    ...               callbacks=[keras_mp.callbacks.AdaptivePrecision(interval=2)])
    >>> fig = keras_mp.plot_precision(model)
    >>> [t.get_text() for t in fig.axes[0].get_yticklabels()]
    ['dense', 'dense_1']
    >>> keras_mp.set_global_policy("float32")
"""

from __future__ import annotations

import functools
import io
import os
from typing import Any

import keras
import numpy as np

from keras_mp import _checks as checks
from keras_mp._atomic import atomic_path
from keras_mp.adaptive.record import timeline as timeline_lib
from keras_mp.adaptive.outputs.report import precision_report, switch_text

__all__ = ["DTYPE_COLORS", "plot_precision"]

#: Each dtype's colour in the picture, narrowest first.
DTYPE_COLORS = {"float8": "#8172b3", "float16": "#55a868", "bfloat16": "#dd8452",
                "float32": "#4c72b0"}
_MARKERS = "os^vDPX*hp<>"
_ANNOTATE_AT_MOST = 12  # switches written out beside their markers; more: the legend only
_GAP = 6.0  # points between the legends of the column, and from a label to its marker


def _matplotlib():
    colors, figure, patches, transforms = checks.extra(
        ("matplotlib.colors", "matplotlib.figure", "matplotlib.patches",
         "matplotlib.transforms"), "plot", "keras_mp.plot_precision")
    return figure.Figure, colors.ListedColormap, patches.Patch, transforms


def _grid(rows, end: int):
    """Step edges and, per layer and segment, its dtype (from the switch history)."""
    edges = sorted({0, end, *(h["step"] for r in rows for h in r["history"] if h["step"] < end)})
    grid = []
    for r in rows:
        history = sorted(r["history"], key=lambda h: h["step"])
        dtype = history[0]["old"] if history else r["dtype"]
        line, k = [], 0
        for start in edges[:-1]:
            while k < len(history) and history[k]["step"] <= start:
                dtype = history[k]["new"]
                k += 1
            line.append(dtype)
        grid.append(line)
    return edges, grid


def _label(path: str, model_name: str) -> str:
    return path[len(model_name) + 1:] if path.startswith(model_name + "/") else path


def _draw_switches(ax, rows) -> None:
    switches = [(h, i) for i, r in enumerate(rows) for h in r["history"]]
    reasons = list(dict.fromkeys(h["reason"] for h, _ in switches))
    for k, reason in enumerate(reasons):
        mine = [(h, i) for h, i in switches if h["reason"] == reason]
        ax.scatter([h["step"] for h, _ in mine], [i + 0.5 for _, i in mine],
                   marker=_MARKERS[k % len(_MARKERS)], s=42, facecolor="white",
                   edgecolor="black", linewidth=1.0, zorder=5,  # over the labels
                   label=f"{reason} ({len(mine)})", gid=f"switch:{reason}")


def _height(artist) -> float:
    """An artist's drawn height, in points."""
    return artist.get_window_extent().height * 72 / artist.get_figure().dpi


def _draw_legends(ax, Patch, transforms, present: list[str]) -> float:
    """The dtype legend and, below it, the switch reasons' (where any layer
    switched), in one column right of the layer rows; both take part in the
    layout, so the image holds them. Returns the column's height in inches."""
    fig = ax.get_figure()
    kw = dict(fontsize=8, title_fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    dtypes = ax.legend([Patch(color=DTYPE_COLORS[d]) for d in present], present,
                       title="dtype", **kw)
    height = _height(dtypes)
    if not ax.get_legend_handles_labels()[0]:
        return height / 72
    # The switch reasons' legend replaces the axes' own: the dtype legend stays
    # as an artist, unclipped (an artist clipped to the axes is left out of
    # the layout, and would be cut off at the image's edge).
    ax.add_artist(dtypes)
    dtypes.set_clip_on(False)
    below = transforms.offset_copy(ax.transAxes, fig=fig, y=-(height + _GAP), units="points")
    reasons = ax.legend(title="switch reason (count)", bbox_transform=below, **kw)
    return (height + _GAP + _height(reasons)) / 72


def _write_switches(ax, rows, transforms) -> None:
    """Each switched row's history as one label (two switches at one step
    share it), inside the axes: right of the row's last marker, else left of
    its first, else right of its first (its markers drawn over it), else at
    the right edge; the same shortened to the last switch where the whole
    does not fit; left out where nothing fits (the markers and the legend
    still show them). Runs once the layout is fixed; the labels take no part
    in it."""
    fig = ax.get_figure()
    box, pad = ax.get_window_extent(), 2 * fig.dpi / 72
    gap = _GAP * fig.dpi / 72
    beside = {"left": transforms.offset_copy(ax.transData, fig=fig, x=_GAP, units="points"),
              "right": transforms.offset_copy(ax.transData, fig=fig, x=-_GAP, units="points")}
    edge = transforms.offset_copy(transforms.blended_transform_factory(ax.transAxes, ax.transData),
                                  fig=fig, x=-2, units="points")
    for i, r in enumerate(rows):
        history = sorted(r["history"], key=lambda h: h["step"])
        if not history:
            continue
        first, last = (ax.transData.transform((h["step"], 0))[0] for h in (history[0], history[-1]))
        texts = [", ".join(map(switch_text, history))]
        if len(history) > 1:
            texts.append(f"{len(history)} switches, last {switch_text(history[-1])}")
        for text in texts:
            label = ax.text(0, i + 0.5, text, fontsize=7, va="center", zorder=4,
                            gid=f"switches:{r['layer']}",
                            bbox=dict(boxstyle="round,pad=0.15", fc="white", alpha=0.8, lw=0))
            label.set_in_layout(False)
            width = label.get_window_extent().width
            places = [(last + gap + width <= box.x1 - pad, history[-1]["step"], "left"),
                      (first - gap - width >= box.x0 + pad, history[0]["step"], "right"),
                      (first + gap + width <= box.x1 - pad, history[0]["step"], "left")]
            place = next((p[1:] for p in places if p[0]), None)
            if place is not None:
                label.set(x=place[0], transform=beside[place[1]], horizontalalignment=place[1])
                break
            if width <= box.width - 2 * pad:
                label.set(x=1.0, transform=edge, horizontalalignment="right")
                break
            label.remove()


def _draw_scales(ax, timeline, end: int) -> None:
    entries = [e for e in (timeline.entries if timeline else []) if e["loss_scale"] is not None]
    if not entries:
        ax.text(0.5, 0.5, "no loss scaling in this run (bfloat16 and float32 need none)",
                ha="center", va="center", transform=ax.transAxes, fontsize=9)
        ax.set_yticks([])
        return
    steps = [e["step"] for e in entries] + [end]
    ax.step(steps, [e["loss_scale"] for e in entries] + [entries[-1]["loss_scale"]],
            where="post", color="black", linewidth=1.6, label="global loss scale")
    paths = list(dict.fromkeys(p for e in entries for p in (e["layer_scales"] or {})))
    for k, path in enumerate(paths):
        values = [(e["layer_scales"] or {}).get(path, np.nan) for e in entries]
        ax.step(steps, values + [values[-1]], where="post", linewidth=0.7, alpha=0.6,
                color="tab:gray", label=f"per-layer scales ({len(paths)} layers)" if k == 0
                else None)
    ax.set_yscale("log", base=2)
    ax.set_ylabel("loss scale")
    counts = [e["skipped_steps"] for e in entries]
    handles, labels = ax.get_legend_handles_labels()
    if all(c is not None for c in counts):
        skipped = ax.twinx()
        # Entry i's count less entry i-1's: the steps skipped in (step[i-1], step[i]].
        starts, ends = steps[:len(entries) - 1], steps[1:len(entries)]
        per = [b - a for a, b in zip(counts, counts[1:])]
        bars = skipped.bar(starts, per, width=[b - a for a, b in zip(starts, ends)],
                           align="edge", color="tab:red", alpha=0.3,
                           label=f"skipped steps per interval ({sum(per)} in all)")
        skipped.set_ylabel("skipped steps", color="tab:red")
        skipped.set_ylim(0, max([*per, 0]) * 1.25 + 1)
        handles.append(bars)
        labels.append(bars.get_label())
    ax.legend(handles, labels, fontsize=8, loc="upper left", bbox_to_anchor=(1.08, 1.0))


_STATE = (("weights", "#4c72b0"), ("gradients", "#dd8452"), ("moments", "#55a868"))


def _draw_state(ax, timeline, end: int) -> None:
    """The training state's MiB over the steps, stacked: weights, gradients,
    moments (each entry's, held until the next)."""
    entries = [e for e in (timeline.entries if timeline else []) if e.get("state_mib")]
    if not entries:
        ax.text(0.5, 0.5, "training state not recorded in this run",
                ha="center", va="center", transform=ax.transAxes, fontsize=9)
        ax.set_yticks([])
        return
    steps = [e["step"] for e in entries] + [end]
    values = [[e["state_mib"][k] for e in entries] for k, _ in _STATE]
    values = [v + [v[-1]] for v in values]
    ax.stackplot(steps, values, step="post", colors=[c for _, c in _STATE], alpha=0.8,
                 labels=[f"{k} ({v[-1]:.1f} MiB)" for (k, _), v in zip(_STATE, values)])
    ax.set_ylabel("training state MiB")
    ax.set_ylim(0, max(sum(v[i] for v in values) for i in range(len(steps))) * 1.15 or 1)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.08, 1.0))


def plot_precision(model: keras.Model, path: str | os.PathLike | None = None, *,
                   title: str | None = None, dpi: int = 100) -> Any:
    """Draws what adaptive precision did in ``model``'s training so far.

    Top: one row per controlled layer, in forward order, one column per
    stretch of steps, coloured by the layer's dtype (:data:`DTYPE_COLORS`);
    a marker at each switch, one shape per reason; with at most 12 switches,
    each layer's switches written out (``old->new@step (reason)``) in one
    label beside its markers, inside the rows, never over another label; to
    the right, the legends of the dtypes and the reasons, inside the image
    whatever the number of layers. Bottom: the global loss scale, the
    per-layer loss scales where the policy uses them, and the steps skipped
    in each decision interval; last, the training state's MiB over the steps
    (weights, gradients and moments, stacked, as stored).

    Args:
        model: a Keras model trained under an adaptive policy (with
            :class:`keras_mp.callbacks.AdaptivePrecision`, which ``fit``
            adds by itself).
        path: where to write the picture (PNG, or any format matplotlib
            writes, by the file's extension, which it must have); None writes
            nothing. Checked before anything is drawn: a file (replaced if it
            exists) in an existing folder that can be written. The file is
            replaced whole or not at all (written beside it, then renamed).
        title: the title; None: the model's name and policy.
        dpi: the resolution of the file written, an int in [50, 600].

    Returns:
        The ``matplotlib.figure.Figure`` (a notebook shows it as a PNG), laid
        out once, for its size: the labels are placed in that layout.

    Raises:
        ImportError: matplotlib is not installed.
        TypeError / ValueError: a bad argument (``path`` included), a model
            with no adaptive policy, or one that has not trained yet.
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a Keras model, got {model!r}.")
    if isinstance(dpi, bool) or not isinstance(dpi, int) or not 50 <= dpi <= 600:
        raise ValueError(f"`dpi` must be an int in [50, 600], got {dpi!r}.")
    Figure, ListedColormap, Patch, transforms = _matplotlib()
    if path is not None:
        # Before anything is drawn: matplotlib would fail only in savefig.
        formats = sorted(Figure().canvas.get_supported_filetypes(),
                         key=lambda f: (f not in ("png", "svg", "pdf"), f))
        path = checks.output_path("path", path, suffixes=tuple(f".{f}" for f in formats),
                                  what=" (a format matplotlib writes)")
    report = precision_report(model)
    if not report.candidates:
        raise ValueError(f"`model` {model.name!r} has no adaptive policy (policy "
                         f"{report.policy!r}): nothing to plot.")
    if len(report.candidates) == 1:
        raise ValueError(f"`model` {model.name!r}: its policy {report.policy!r} has one candidate "
                         f"here ({report.candidates[0]}), so nothing adapts and there is nothing "
                         "to plot; give candidates, e.g. 'adaptive_float16'.")
    timeline = timeline_lib.of(model)
    rows = list(report.rows)
    switched = [h["step"] for r in rows for h in r["history"]]
    count = sum(r["switches"] for r in rows)
    end = max([timeline.last_step if timeline else 0, *(s + 1 for s in switched)])
    if end == 0:
        raise ValueError(f"`model` {model.name!r} has not trained under AdaptivePrecision yet: "
                         "nothing to plot (call fit first).")
    edges, grid = _grid(rows, end)
    dtypes = list(DTYPE_COLORS)
    codes = np.array([[dtypes.index(d) if d in dtypes else len(dtypes) - 1 for d in line]
                      for line in grid], dtype=float)
    n = len(rows)
    row = 0.24 if n <= 24 else 0.18  # inches per layer
    top = max(1.6, row * n + 0.8)
    fig = Figure(figsize=(11, top + 4.4), layout="constrained")
    ax, scale_ax, state_ax = fig.subplots(3, 1, sharex=True, height_ratios=[top, 2.0, 1.6])
    ax.pcolormesh(edges, np.arange(n + 1), codes, cmap=ListedColormap(list(DTYPE_COLORS.values())),
                  vmin=-0.5, vmax=len(dtypes) - 0.5, edgecolors="white", linewidth=0.3)
    ax.set_ylim(n, 0)
    ax.set_yticks(np.arange(n) + 0.5, [_label(r["layer"], model.name) for r in rows],
                  fontsize=8 if n <= 24 else 7 if n <= 60 else 6)
    _draw_switches(ax, rows)
    column = _draw_legends(ax, Patch, transforms,
                           [d for d in dtypes if any(d in line for line in grid)])
    if column + 0.5 > top:  # the legend column stays beside the layer rows
        top = column + 0.5
        fig.set_size_inches(11, top + 4.4)
        ax.get_subplotspec().get_gridspec().set_height_ratios([top, 2.0, 1.6])
    ax.set_title(title if title is not None else
                 f"{model.name}: {report.policy} ({', '.join(report.candidates)}), "
                 f"{n} layers, {count} switch{'es' if count != 1 else ''}",
                 fontsize=10)
    _draw_scales(scale_ax, timeline, end)
    _draw_state(state_ax, timeline, end)
    state_ax.set_xlabel("step (train-function call)")
    scale_ax.set_xlim(0, end)
    # The layout once, then fixed: the labels are placed in what it gave.
    fig.draw_without_rendering()
    fig.set_layout_engine("none")
    if len(switched) <= _ANNOTATE_AT_MOST:
        _write_switches(ax, rows, transforms)
    if path is not None:
        with atomic_path(path) as tmp:  # whole or not at all: written beside, renamed
            fig.savefig(tmp, dpi=dpi)
    # A figure made without pyplot: IPython shows it through this, with or
    # without matplotlib's inline backend set up.
    fig._repr_png_ = functools.partial(_png, fig, dpi)
    return fig


def _png(fig, dpi: int) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()
