"""What skipping non-finite steps costs (keras_mp.adaptive.integration.skipping).

Under every adaptive policy a step whose gradients are not finite changes
nothing: the optimizer is a ``LossScaleOptimizer`` (a fixed scale of 1 where
no float16 needs one) whose finite check decides, and the guarded train step
puts back what the forward pass assigned. This times the same model with
skipping on and off (``keras_mp.config.set_skip_nonfinite``), under
``"adaptive"`` as it is on this machine (bfloat16 where it is fast here) and
under an adaptive policy whose only candidate is float32 (``"adaptive"`` on a
CPU without 16-bit units), each as ``fit`` runs its train function (the
callback's batch hooks around the train function; before 2026-12-07 the
batch-end hook was left out, so the adaptive variants ran plain steps only), on
the same batches.
Target (issue 46): skipping costs at most 1% of a step's CPU time, median of
at least 7 interleaved rounds (the median of each round's on/off ratio).

Run: ``python -m benchmarks.skip_overhead [--quick] [--model mlp|cnn|mobilenet]
[--batch 128] [--rounds N]``
"""

from __future__ import annotations

import argparse
import os
import statistics

from .adaptive_overhead import _interleaved
from .common import cpu_name, quiet_tensorflow, sync

TARGET = 1.01
#: ``--model``: a 4x512 MLP, a small CNN with BatchNormalization, and
#: keras.applications' MobileNetV3Small built from config (64x64 inputs,
#: random weights, no download).
MODELS = ("mlp", "cnn", "mobilenet")


def run(quick: bool = False, model_kind: str = "mlp", batch: int = 128,
        rounds: int | None = None) -> dict:
    """Times each variant; returns ``{"timings", "ratios", "machine", "model", "rounds"}``."""
    if model_kind not in MODELS:
        raise ValueError(f"`model_kind` must be one of {MODELS}, got {model_kind!r}.")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"`batch` must be a whole number >= 1, got {batch!r}.")
    if rounds is not None and (isinstance(rounds, bool) or not isinstance(rounds, int)
                               or rounds < 7):
        raise ValueError(f"`rounds` must be a whole number >= 7, got {rounds!r}.")
    quiet_tensorflow()
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_mp
    from keras_mp.adaptive.fit import autofit

    rng = np.random.default_rng(0)
    shape = {"mlp": (512,), "cnn": (32, 32, 3), "mobilenet": (64, 64, 3)}[model_kind]
    n = 16 * batch
    x = rng.normal(size=(n, *shape)).astype("float32")
    y = rng.integers(0, 10, size=(n,)).astype("int32")
    batches = [(tf.constant(x[i:i + batch]), tf.constant(y[i:i + batch]))
               for i in range(0, n, batch)]
    cursor = {"i": 0}

    def data():
        cursor["i"] = (cursor["i"] + 1) % len(batches)
        return batches[cursor["i"]]

    def make(policy, skip: bool):
        keras.utils.set_random_seed(0)
        keras_mp.config.set_skip_nonfinite(skip)
        keras_mp.set_global_policy(policy)
        if model_kind == "mlp":
            body = [keras.layers.Dense(512, activation="relu") for _ in range(4)]
        elif model_kind == "cnn":
            body = [keras.layers.Conv2D(32, 3, activation="relu"),
                    keras.layers.BatchNormalization(),
                    keras.layers.Conv2D(64, 3, strides=2, activation="relu"),
                    keras.layers.BatchNormalization(), keras.layers.Flatten(),
                    keras.layers.Dense(128, activation="relu")]
        if model_kind == "mobilenet":
            model = keras.applications.MobileNetV3Small(
                input_shape=shape, weights=None, classes=10, include_preprocessing=False,
                classifier_activation=None)
        else:
            model = keras.Sequential([keras.Input(shape), *body, keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.Adam(1e-4),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=batch, epochs=1, verbose=0)  # builds and traces
        cb = autofit.callback_of(model)

        def step():
            if cb is not None:
                cb.on_train_batch_begin(0)  # what fit does around every call
            logs = model.train_function(iter([data()]))
            if cb is not None:
                cb.on_train_batch_end(0, logs)  # counts the call: statistics, probes
            return logs
        return step

    autofit.set_min_saving(0)  # adapt as a fit large enough to gain does
    float32_only = keras_mp.AdaptivePolicy(candidates=("float32",))
    variants = {"adaptive, skip on": make("adaptive", True),
                "adaptive, skip off": make("adaptive", False),
                "float32 only, skip on": make(float32_only, True),
                "float32 only, skip off": make(float32_only, False)}
    keras_mp.config.set_skip_nonfinite(True)
    keras_mp.set_global_policy("float32")
    for fn in variants.values():  # every trace (plain, statistics, probe) before timing
        for _ in range(41):
            sync(fn())
    calls, default_rounds = (40, 7) if quick else (100, 9)
    rounds = default_rounds if rounds is None else rounds
    t = _interleaved(variants, calls, rounds)
    # Each round's on/off ratio (the two ran side by side in it), then their median.
    ratios = {kind: {clock: statistics.median(
        a / b for a, b in zip(t[f"{kind}, skip on"][f"{clock}_rounds"],
                              t[f"{kind}, skip off"][f"{clock}_rounds"], strict=True))
        for clock in ("cpu", "wall")} for kind in ("adaptive", "float32 only")}
    return {"timings": t, "ratios": ratios, "rounds": rounds, "calls": calls,
            "machine": f"{cpu_name()}, {os.cpu_count()} cores; TensorFlow {tf.__version__}, "
                       f"Keras {keras.__version__}; adaptive = "
                       f"{'/'.join(keras_mp.device.default_candidates())}",
            "model": f"{model_kind}, batch {batch}, Adam"}


def format_result(r: dict) -> str:
    lines = [f"Machine: {r['machine']}", f"Model: {r['model']}; {r['rounds']} interleaved "
             f"rounds of {r['calls']} calls per variant",
             "| variant | CPU ms/call | spread | wall ms/call | spread |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for name, v in r["timings"].items():
        lines.append(f"| {name} | {v['cpu_ms']:.2f} | {v['cpu_spread']:.1%} | "
                     f"{v['wall_ms']:.2f} | {v['wall_spread']:.1%} |")
    for kind, ratio in r["ratios"].items():
        ok = "meets" if ratio["cpu"] <= TARGET else "misses"
        lines.append(f"{kind}: skip on / off, CPU {ratio['cpu']:.3f} ({ok} <= {TARGET}), "
                     f"wall {ratio['wall']:.3f}")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls and rounds")
    parser.add_argument("--model", default="mlp", choices=MODELS)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=None,
                        help="interleaved rounds (>= 7; default 9, 7 with --quick)")
    args = parser.parse_args(argv)
    print(format_result(run(quick=args.quick, model_kind=args.model, batch=args.batch,
                             rounds=args.rounds)))


if __name__ == "__main__":
    main()
