"""The ``keras-mp demo`` job: adaptive precision rescuing a run that static
float16 loses, then what this device runs fast.

Part 1, the mechanism, the same on every machine. The embedded digits are
fed as raw sensor counts (pixels up to ``1e5``: a forgotten normalization,
beyond float16's 65504) to ``Dense(64) -> LayerNormalization ->
Dense(64, relu) -> Dense(10)``. The LayerNormalization makes the float32
model indifferent to the input's scale. Three runs, same model, data, seed
and steps:

* ``float32``;
* Keras's static ``mixed_float16``: the inputs are inf in float16, every
  step is non-finite and skipped, the model stays at chance;
* ``AdaptivePolicy(candidates=("float16", "float32"))`` with
  :class:`keras_mp.callbacks.AdaptivePrecision`: the forward statistics see
  the input layer's input beyond float16, it is promoted to float32, the
  rest keeps training in float16, and the loss scale, which the overflowing
  steps drove down, comes back to where it was before them (the plot's
  loss-scale panel; dotted lines mark the promotions).

Part 2, this device: :func:`keras_mp.device.profile`'s measured matmul
throughput per dtype, and the dtypes ``"adaptive"`` therefore picks here,
shown on the same model. float16 on a CPU without float16 units is emulated
and slow: part 1 shows the mechanism, not speed (``keras-mp bench`` times
speed).
"""

from __future__ import annotations

import os
import textwrap
from dataclasses import dataclass, field
from typing import Any

import keras
import numpy as np

from keras_mp import _checks as checks
from keras_mp import callbacks, datasets, device, policies
from keras_mp._atomic import atomic_path
from keras_mp.adaptive.outputs.plot import plot_precision
from keras_mp.scaling.optimizer import LossScaleOptimizer

__all__ = ["DemoResult", "DemoRun", "run_demo"]

#: Pixels (in [0, 1]) are multiplied by this: raw counts beyond float16's range.
INPUT_SCALE = 1e5
#: The three variants of part 1, in the order they run.
VARIANTS = ("float32", "mixed_float16", "adaptive_float16")
_LABELS = {"float32": "float32", "mixed_float16": "static mixed_float16",
           "adaptive_float16": "adaptive float16/float32"}
_REASONS = {
    "input_range": "the layer's input beyond float16's range (forward statistics); once it "
                   "computes in float32 the loss scale comes back to where it was before "
                   "the overflowing steps",
    "nonfinite_everywhere": "every layer non-finite at the loss scale's floor, so the "
                            "loss overflowed: the input-most 16-bit layer is promoted",
    "nonfinite": "the layer's gradients non-finite at the loss scale's floor",
    "fp16_subnormal": "the layer's gradients draining into float16's subnormal range",
    "bf16_subnormal": "the layer's gradients below bfloat16's normal range",
    "healthy": "healthy statistics for the layer's patience: the narrower dtype is "
               "tried again",
}


@dataclass
class DemoRun:
    """One training run of part 1.

    Attributes:
        variant: one of :data:`VARIANTS`.
        accuracy: held-out accuracy after training.
        val_accuracy: held-out accuracy after each epoch.
        losses: each step's training loss (NaN where it was not finite, and
            for the rest of that epoch: it is recovered from Keras's running
            mean).
        loss_scales: the loss scale before the first step, then after each
            step (empty without loss scaling).
        skipped_steps: steps skipped for non-finite gradients.
        steps: train steps run.
        dtypes: per weighted layer (by name), its compute dtype after each step.
        events: the switches made (adaptive run only), as
            :attr:`keras_mp.callbacks.AdaptivePrecision.events`.
    """

    variant: str
    accuracy: float = 0.0
    val_accuracy: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    loss_scales: list[float] = field(default_factory=list)
    skipped_steps: int = 0
    steps: int = 0
    dtypes: dict[str, list[str]] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def final_dtypes(self) -> dict[str, str]:
        """Each weighted layer's compute dtype at the end."""
        return {name: seq[-1] for name, seq in self.dtypes.items() if seq}


@dataclass
class DemoResult:
    """What the demo measured.

    Attributes:
        runs: part 1's runs, by variant.
        device_type: ``"CPU"``, ``"GPU"`` or ``"TPU"``.
        speedups: measured matmul throughput per dtype relative to float32.
        hardware: per narrow dtype, whether the device has units for it.
        fast: the narrow dtypes this device runs fast.
        adaptive_candidates: what ``"adaptive"`` chooses among here.
        adaptive_dtypes: the demo model's layers' compute dtypes when built
            under ``"adaptive"`` here.
        plot: the PNG's path, or None.
        precision_plot: the adaptive run's :func:`keras_mp.plot_precision`
            PNG, or None.
        report: the summary as text.
    """

    runs: dict[str, DemoRun]
    device_type: str = ""
    speedups: dict[str, float] = field(default_factory=dict)
    hardware: dict[str, bool] = field(default_factory=dict)
    fast: tuple[str, ...] = ()
    adaptive_candidates: tuple[str, ...] = ()
    adaptive_dtypes: dict[str, str] = field(default_factory=dict)
    plot: str | None = None
    precision_plot: str | None = None
    report: str = ""

    @property
    def rescued(self) -> bool:
        """Static float16 lost the run (5 points below float32 or worse) and
        adaptive precision ended within 2 points of float32."""
        f32, static, adaptive = (self.runs[v].accuracy for v in VARIANTS)
        return static <= f32 - 0.05 and adaptive >= f32 - 0.02


def _model() -> keras.Model:
    return keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(64, name="dense_in"),
        # Makes the float32 model indifferent to the inputs' scale.
        keras.layers.LayerNormalization(name="layer_norm"),
        keras.layers.Dense(64, activation="relu", name="dense_hidden"),
        # float32 logits: softmax/cross-entropy stay accurate in any policy.
        keras.layers.Dense(10, dtype="float32", name="logits"),
    ], name="demo")


def _data(seed: int):
    (x, y), (xt, yt) = datasets.load_digits(seed=seed)
    return ((x.reshape(len(x), -1) * INPUT_SCALE, y),
            (xt.reshape(len(xt), -1) * INPUT_SCALE, yt))


class _Recorder(keras.callbacks.Callback):
    """Per step: loss, loss scale, each weighted layer's dtype; per epoch a line."""

    def __init__(self, run: DemoRun, epochs: int, verbose: int):
        super().__init__()
        self.run, self.epochs, self.verbose = run, epochs, verbose

    def on_train_begin(self, logs=None):
        scale = getattr(self.model.optimizer, "loss_scale", None)
        if scale is not None:
            self.run.loss_scales.append(float(scale))

    def on_epoch_begin(self, epoch, logs=None):
        self._mean, self._batches, self._skipped = 0.0, 0, self._skipped_now()

    def _skipped_now(self) -> int:
        skipped = getattr(self.model.optimizer, "skipped_steps", None)
        return int(skipped.numpy()) if skipped is not None else 0

    def on_train_batch_end(self, batch, logs=None):
        run = self.run
        run.steps += 1
        # Keras logs the epoch's running mean: recover this step's loss.
        mean = float((logs or {}).get("loss", float("nan")))
        self._batches += 1
        run.losses.append(self._batches * mean - (self._batches - 1) * self._mean)
        self._mean = mean
        scale = getattr(self.model.optimizer, "loss_scale", None)
        if scale is not None:  # reading it syncs with the step
            run.loss_scales.append(float(scale))
        for layer in self.model.layers:
            if layer.weights:
                run.dtypes.setdefault(layer.name, []).append(layer.compute_dtype)

    def on_epoch_end(self, epoch, logs=None):
        logs = logs or {}
        self.run.val_accuracy.append(float(logs.get("val_accuracy", float("nan"))))
        if self.verbose:
            loss = logs.get("loss", float("nan"))
            loss_text = f"loss {loss:.3f}" if np.isfinite(loss) else "loss not finite"
            scale = (f", loss scale {self.run.loss_scales[-1]:g}, skipped "
                     f"{self._skipped_now() - self._skipped}/{self._batches} steps"
                     if self.run.loss_scales else "")
            print(f"  {_LABELS[self.run.variant]:<25} epoch {epoch + 1}/{self.epochs}: "
                  f"{loss_text}, held-out accuracy {self.run.val_accuracy[-1]:.3f}{scale}",
                  flush=True)


def _train(variant: str, data, epochs: int, batch_size: int, verbose: int,
           seed: int, precision_plot: str | None = None) -> DemoRun:
    (x, y), (xt, yt) = data
    keras.utils.clear_session(free_memory=False)
    keras.utils.set_random_seed(seed)
    run = DemoRun(variant)
    if variant == "adaptive_float16":
        policy: Any = policies.AdaptivePolicy(candidates=("float16", "float32"))
    else:
        policy = variant
    with policies.policy_scope(policy):
        model = _model()
    optimizer: Any = keras.optimizers.Adam(3e-3)
    if variant == "mixed_float16":
        # The loss scaling the adaptive run gets, so that only the policy differs.
        optimizer = LossScaleOptimizer(optimizer, schedule="dynamic")
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    cbs: list[Any] = [_Recorder(run, epochs, verbose)]
    adaptive = None
    if variant == "adaptive_float16":
        # The callback wraps the optimizer in a dynamic-scale LossScaleOptimizer.
        adaptive = callbacks.AdaptivePrecision(interval=5)
        cbs.insert(0, adaptive)
    model.fit(x, y, batch_size=batch_size, epochs=epochs, verbose=0,
              validation_data=(xt, yt), callbacks=cbs)
    run.accuracy = float(model.evaluate(xt, yt, verbose=0)[1])
    skipped = getattr(model.optimizer, "skipped_steps", None)
    run.skipped_steps = int(skipped.numpy()) if skipped is not None else 0
    if adaptive is not None:
        run.events = [dict(e, layer=e["layer"].rsplit("/", 1)[-1]) for e in adaptive.events]
        if precision_plot is not None:
            plot_precision(model, precision_plot, title="keras-mp demo, adaptive "
                           "float16/float32: each layer's dtype, the switches and the loss "
                           "scale")
    return run


def _adaptive_here() -> dict[str, str]:
    keras.utils.clear_session(free_memory=False)
    with policies.policy_scope("adaptive"):
        model = _model()
    return {layer.name: layer.compute_dtype for layer in model.layers if layer.weights}


def _plot(path: str, result: DemoResult) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    (loss_ax, acc_ax), (scale_ax, dtype_ax) = axes
    colors = dict(zip(VARIANTS, ("tab:blue", "tab:red", "tab:green")))
    for variant, run in result.runs.items():
        label, color = _LABELS[variant], colors[variant]
        losses = np.asarray(run.losses)
        steps = np.arange(1, run.steps + 1)
        if np.isfinite(losses).any():
            loss_ax.plot(steps, losses, color=color, label=label, linewidth=0.8)
        else:
            loss_ax.plot([], [], color=color, label=f"{label} (never finite)")
        acc_ax.plot(range(1, len(run.val_accuracy) + 1), run.val_accuracy, marker="o",
                    color=color, label=label)
        if run.loss_scales:
            scale_ax.step(np.arange(run.steps + 1), run.loss_scales, where="post",
                          color=color, label=f"{label} ({run.skipped_steps} skipped steps)")
    loss_ax.set(xlabel="step", ylabel="training loss", title="training loss per step "
                                                            "(gaps: not finite)")
    loss_ax.set_yscale("log")
    acc_ax.set(xlabel="epoch", ylabel="held-out accuracy", title="accuracy", ylim=(0, 1))
    scale_ax.set(xlabel="step", ylabel="loss scale", title="loss scale")
    scale_ax.set_yscale("log", base=2)
    adaptive = result.runs["adaptive_float16"]
    for k, event in enumerate(e for e in adaptive.events if e["old"] != "float32"):
        # the promotions: after each, the loss scale comes back
        scale_ax.axvline(event["step"], color=colors["adaptive_float16"], linestyle=":",
                         linewidth=1, label="promotion (adaptive)" if k == 0 else None)
    for ax in (loss_ax, acc_ax, scale_ax):
        ax.legend(fontsize=8)
    names = list(adaptive.dtypes)
    bits = np.array([[{"float16": 16, "bfloat16": 16}.get(d, 32) for d in adaptive.dtypes[n]]
                     for n in names])
    dtype_ax.imshow(bits, aspect="auto", interpolation="nearest", cmap="coolwarm",
                    vmin=16, vmax=32, extent=(0.5, adaptive.steps + 0.5, len(names) - 0.5,
                                              -0.5))
    dtype_ax.set_yticks(range(len(names)), names)
    dtype_ax.set(xlabel="step", title="adaptive run: dtype per layer "
                                      "(blue float16, red float32)")
    fig.tight_layout()
    with atomic_path(path) as tmp:  # whole or not at all
        fig.savefig(tmp, dpi=100)
    plt.close(fig)
    return path


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _check_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"`{name}` must be an int >= {low}, got {value!r}.")


def run_demo(epochs: int = 4, batch_size: int = 32, out_dir: str | None = ".",
             verbose: int = 1, seed: int = 0) -> DemoResult:
    """Runs the demo and returns what it measured.

    Args:
        epochs: training epochs of each of the three runs (>= 1).
        batch_size: batch size (>= 1).
        out_dir: folder for ``keras_mp_demo.png`` (the three runs) and
            ``keras_mp_precision.png`` (:func:`keras_mp.plot_precision` of the
            adaptive run); None writes no plot, nor does a machine without
            matplotlib (``pip install "keras-mp[plot]"``; the demo says so).
        verbose: 1 prints a line per epoch and run, 0 nothing.
        seed: random seed of the data split and of every run (>= 0).

    Returns:
        A :class:`DemoResult`; its ``report`` is the summary as text.
    """
    _check_int("epochs", epochs, 1)
    _check_int("batch_size", batch_size, 1)
    _check_int("seed", seed, 0)
    if verbose not in (0, 1):
        raise ValueError(f"`verbose` must be 0 or 1, got {verbose!r}.")
    if out_dir is not None:
        os.makedirs(out_dir, exist_ok=True)
        checks.writable("out_dir", out_dir)
    data = _data(seed)
    if out_dir is not None and not _has_matplotlib():
        if verbose:
            print('keras-mp demo: matplotlib is not installed, so no plots are written '
                  '(pip install "keras-mp[plot]").', flush=True)
        out_dir = None
    precision_plot = None if out_dir is None else os.path.join(out_dir, "keras_mp_precision.png")
    if verbose:
        print(f"Part 1: the embedded digits as raw counts (pixels up to {INPUT_SCALE:g}, "
              "beyond float16's 65504), three runs:", flush=True)
    runs = {v: _train(v, data, epochs, batch_size, verbose, seed, precision_plot)
            for v in VARIANTS}
    prof = device.profile()
    result = DemoResult(
        runs=runs, device_type=prof.device_type,
        speedups={d: prof.speedup(d) for d in prof.throughput},
        hardware=dict(prof.hardware), fast=tuple(prof.fast),
        adaptive_candidates=tuple(device.default_candidates()),
        adaptive_dtypes=_adaptive_here())
    keras.utils.clear_session(free_memory=False)
    if out_dir is not None:
        result.plot = _plot(os.path.join(out_dir, "keras_mp_demo.png"), result)
        result.precision_plot = precision_plot
    result.report = format_result(result)
    return result


def _scales(run: DemoRun) -> str:
    """First -> lowest -> last loss scale (the lowest only where it differs)."""
    if not run.loss_scales:
        return "none"
    first, low, last = run.loss_scales[0], min(run.loss_scales), run.loss_scales[-1]
    if low < min(first, last):
        return f"{first:g} -> {low:g} -> {last:g}"
    return f"{first:g} -> {last:g}"


def format_result(r: DemoResult) -> str:
    """The demo's summary as text."""
    lines = ["", "keras-mp demo, part 1: a run static float16 loses, rescued by adaptive "
                 "precision", "",
             f"{'variant':<26}{'accuracy':>9}  {'skipped steps':>13}  {'loss scale':<24}"
             "layers in 16 bits"]
    for variant, run in r.runs.items():
        final = run.final_dtypes
        narrow = [n for n, d in final.items() if d in ("float16", "bfloat16")]
        lines.append(f"{_LABELS[variant]:<26}{run.accuracy:>9.3f}  "
                     f"{f'{run.skipped_steps}/{run.steps}':>13}  {_scales(run):<23} "
                     f"{len(narrow)}/{len(final)} {', '.join(narrow)}")
    adaptive = r.runs["adaptive_float16"]
    lines += ["", "Switches made by AdaptivePrecision (interval 5 steps):"]
    lines += [f"  step {e['step']:>4}: {e['layer']:<13} {e['old']} -> {e['new']}  "
              f"({e['reason']})" for e in adaptive.events] or ["  none"]
    lines.append("  final: " + ", ".join(f"{n} {d}" for n, d in adaptive.final_dtypes.items()))
    reasons = [r for r in dict.fromkeys(e["reason"] for e in adaptive.events) if r in _REASONS]
    if reasons:
        lines.append("Reasons:")
        lines += [textwrap.fill(f"{reason}: {_REASONS[reason]}", 92, initial_indent="  ",
                                subsequent_indent="    ") for reason in reasons]
    static = r.runs["mixed_float16"]
    if r.rescued:
        summary = (f"Static mixed_float16 skipped {static.skipped_steps} of {static.steps} "
                   "steps (its inputs are beyond float16's range) and ends near chance; "
                   "adaptive precision moved the layer that overflows to float32, kept the "
                   "others in float16, brought the loss scale back and reached float32's "
                   "accuracy.")
    else:
        summary = "No rescue in this run: see the accuracies above."
    lines += ["", textwrap.fill(summary, 92)]
    lines += ["", f"keras-mp demo, part 2: what this {r.device_type} runs fast",
              "Measured matmul throughput relative to float32:"]
    for dtype, ratio in r.speedups.items():
        hw = "" if dtype == "float32" else (
            ", hardware support" if r.hardware.get(dtype) else ", no hardware support")
        lines.append(f"  {dtype:<9} {ratio:5.2f}x{hw}")
    fast = ", ".join(r.fast) or "none"
    lines += [f"Fast 16-bit dtypes here: {fast}; so 'adaptive' chooses among "
              f"{', '.join(r.adaptive_candidates)}",
              "  this model under 'adaptive' here: "
              + ", ".join(f"{n} {d}" for n, d in r.adaptive_dtypes.items())]
    if "float16" not in r.fast:
        lines.append("  (part 1's float16 is emulated on this device: it shows the mechanism,\n"
                     "  not speed; `keras-mp bench` times speed)")
    if r.plot:
        lines += ["", f"Plots written to {r.plot} (the three runs) and {r.precision_plot} "
                      "(each layer's dtype over the steps, the switches, the loss scale)"]
    return "\n".join(lines)
