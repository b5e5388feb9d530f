"""The ``keras-mp demo`` job: keras-mp on the embedded digits, end to end.

Trains a small CNN with keras-mp's adaptive precision policy (the device's
fast dtypes, chosen per layer during training by
:class:`keras_mp.callbacks.AdaptivePrecision`) and its LossScaleOptimizer,
then the same model in plain float32, and reports the precision report,
accuracy, the loss-scale history, the speed ratio and a PNG plot.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import keras
import numpy as np

from keras_mp import callbacks, datasets, device, policies, report
from keras_mp.loss_scale import DynamicLossScale, FixedLossScale
from keras_mp.optimizer import LossScaleOptimizer

__all__ = ["DemoResult", "run_demo"]


@dataclass
class DemoResult:
    """What the demo measured."""

    policy: str
    accuracy: float
    float32_accuracy: float
    step_ms: float
    float32_step_ms: float
    loss_scale_history: list[float] = field(default_factory=list)
    skipped_steps: int = 0
    layer_dtypes: dict[str, str] = field(default_factory=dict)
    plot: str | None = None
    precision: str = ""
    report: str = ""

    @property
    def speedup(self) -> float:
        """float32 step time over keras-mp's (> 1 means keras-mp is faster)."""
        return self.float32_step_ms / self.step_ms


def _model(num_classes: int = 10) -> keras.Model:
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(128, activation="relu"),
        # float32 logits: softmax/cross-entropy stay accurate in any policy.
        keras.layers.Dense(num_classes, dtype="float32"),
    ])


class _ScaleRecorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.scales: list[float] = []
        self.batch_seconds: list[float] = []
        self._t = 0.0

    def on_train_batch_begin(self, batch, logs=None):
        self._t = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        # Reading the scale syncs with the step, so the time is the step's.
        self.scales.append(float(self.model.optimizer.loss_scale))
        self.batch_seconds.append(time.perf_counter() - self._t)


def _train(policy: str, data, epochs: int, batch_size: int, verbose: int, seed: int):
    (x, y), (xt, yt) = data
    keras.utils.clear_session()
    keras.utils.set_random_seed(seed)
    with policies.policy_scope(policy) as active:
        model = _model()
    adaptive = isinstance(active, policies.AdaptivePolicy)
    needs_scaling = adaptive and active.uses_float16 or "float16" in str(active.name)
    # Loss scaling only where float16 can underflow; a fixed scale of 1 keeps
    # the skip-on-non-finite guard (and the statistics) for the other dtypes.
    schedule = DynamicLossScale(initial_scale=2.0**15, growth_interval=50) \
        if needs_scaling else FixedLossScale(1.0)
    opt = LossScaleOptimizer(keras.optimizers.Adam(2e-3), schedule=schedule)
    model.compile(optimizer=opt,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    rec = _ScaleRecorder()
    cbs: list[Any] = [rec]
    if adaptive:
        cbs.append(callbacks.AdaptivePrecision(interval=10))
    model.fit(x, y, batch_size=batch_size, epochs=epochs, verbose=verbose, callbacks=cbs)
    acc = float(model.evaluate(xt, yt, verbose=0)[1])
    steady = rec.batch_seconds[len(rec.batch_seconds) // 4:]  # skip tracing
    return model, rec, acc, 1e3 * float(np.median(steady))


def _plot(path: str, result: DemoResult, losses: dict[str, list[float]]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, values in losses.items():
        a.plot(range(1, len(values) + 1), values, marker="o", label=name)
    a.set_xlabel("epoch")
    a.set_ylabel("training loss")
    a.set_title("keras-mp vs float32")
    a.legend()
    b.plot(result.loss_scale_history)
    b.set_yscale("log", base=2)
    b.set_xlabel("step")
    b.set_ylabel("loss scale")
    b.set_title(f"loss scale ({result.skipped_steps} skipped steps)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def run_demo(policy: str = "adaptive", epochs: int = 3, batch_size: int = 64,
             out_dir: str | None = ".", verbose: int = 1, seed: int = 0) -> DemoResult:
    """Runs the demo and returns what it measured.

    Args:
        policy: the precision policy keras-mp trains with: ``"adaptive"``
            (the device's fast dtypes), another adaptive name or any Keras
            policy name.
        epochs: training epochs for each of the two runs (>= 1).
        batch_size: batch size (>= 1).
        out_dir: folder for ``keras_mp_demo.png``; None writes no plot.
        verbose: Keras's ``fit`` verbosity (1 shows a progress bar).
        seed: random seed of both runs.
    """
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"`epochs` must be an int >= 1, got {epochs!r}.")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"`batch_size` must be an int >= 1, got {batch_size!r}.")
    if out_dir is not None:
        os.makedirs(out_dir, exist_ok=True)
        if not os.access(out_dir, os.W_OK):
            raise PermissionError(f"`out_dir` {out_dir!r} is not writable.")
    policies.get(policy)  # a clear error for an unknown name, before any work
    data = datasets.load_digits(seed=seed)
    model, rec, acc, step_ms = _train(policy, data, epochs, batch_size, verbose, seed)
    losses = {policy: list(model.history.history["loss"])}
    layer_dtypes = {layer.name: layer.compute_dtype for layer in model.layers
                    if layer.trainable_weights}
    precision = str(report.precision_report(model))
    skipped = int(model.optimizer.skipped_steps.numpy())
    if verbose:
        print("\nThe same model in float32, for the speed comparison:")
    model32, _, acc32, step32 = _train("float32", data, epochs, batch_size, verbose, seed)
    losses["float32"] = list(model32.history.history["loss"])
    result = DemoResult(policy=policy, accuracy=acc, float32_accuracy=acc32,
                        step_ms=step_ms, float32_step_ms=step32,
                        loss_scale_history=rec.scales, skipped_steps=skipped,
                        layer_dtypes=layer_dtypes, precision=precision)
    if out_dir is not None:
        result.plot = _plot(os.path.join(out_dir, "keras_mp_demo.png"), result, losses)
    result.report = format_result(result)
    return result


def format_result(r: DemoResult) -> str:
    """The demo's summary as text."""
    prof = device.profile()
    fast = ", ".join(prof.fast) or "none"
    lines = ["", f"keras-mp demo: policy {r.policy!r} on the embedded digits",
             f"Fast low-precision dtypes on this {prof.device_type}: {fast} "
             f"(adaptive chooses among: {', '.join(device.default_candidates())})", "",
             "Precision report:", r.precision]
    hist = r.loss_scale_history
    changes = [f"step {i}: {hist[i - 1]:g} -> {hist[i]:g}"
               for i in range(1, len(hist)) if hist[i] != hist[i - 1]]
    lines += ["", f"Loss scale: start {hist[0]:g}, end {hist[-1]:g}, "
              f"{r.skipped_steps} skipped steps" if hist else "Loss scale: no steps"]
    lines += [f"  {c}" for c in changes[:10]]
    lines += ["", f"Test accuracy: {r.accuracy:.3f} (float32: {r.float32_accuracy:.3f})",
              f"Median step: {r.step_ms:.2f} ms vs float32 {r.float32_step_ms:.2f} ms "
              f"-> {r.speedup:.2f}x float32's speed"]
    if r.plot:
        lines.append(f"Plot written to {r.plot}")
    return "\n".join(lines)
