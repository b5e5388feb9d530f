"""Accuracy parity of adaptive float8 with Keras's own float8 training.

A healthy 5-Dense MLP (32 -> 4 x Dense(128, relu) -> Dense(6), Adam, 8
epochs, batch 64) on a fixed synthetic 6-class task (overlapping gaussian
clusters; 16384 training rows, 4096 test rows), per seed, in:

* ``keras_float32``, ``keras_mixed_bfloat16``: Keras's float policies;
* ``keras_float8``: Keras's float8 training (``model.quantize("float8")``
  on the float32 model before compile), and ``keras_float8_bf16`` (on the
  mixed_bfloat16 model);
* ``adaptive_float8``: keras-mp's ``"adaptive_float8"`` policy, with the
  ``AdaptivePrecision`` callback that ``fit`` adds;

printing the test accuracy per seed, the means, and which layers of the
adaptive model ended in float8 (and its switches). Each variant runs in a
process of its own (the Keras variants do not import keras_mp).
``--data teacher`` uses a random-teacher task instead, on which the output
layer is promoted near the end (``float8_flushed``): 4 of 5 Dense end in
float8.

Measured (2-core CPU, TF 2.21, Keras 3.15.1, ``KERAS_MP_EXECUTION=graph``),
test accuracy, seeds 0/1/2 and mean:

=====================  ===========================  ===========================
variant                clusters                     teacher
=====================  ===========================  ===========================
keras_float32          .8772 .8662 .8621 **.8685**  .8669 .8640 .8406 **.8572**
keras_mixed_bfloat16   .8782 .8635 .8687 **.8701**  .8669 .8657 .8455 **.8594**
keras_float8           .8772 .8618 .8691 **.8694**  .8604 .8628 .8335 **.8522**
keras_float8_bf16      .8743 .8682 .8687 **.8704**  .8657 .8677 .8403 **.8579**
adaptive_float8        .8743 .8682 .8687 **.8704**  .8635 .8643 .8462 **.8580**
=====================  ===========================  ===========================

On the clusters every Dense stays in float8 and the adaptive model's
variables (kernels, biases, scales, amax histories) end bit for bit equal
to Keras's all-float8 ``mixed_bfloat16`` model's: statistics steps, probes
and the optimizer set-up change nothing that Keras's float8 training computes.

Run: ``python -m benchmarks.float8_parity [--variants a,b] [--seeds 0,1,2]
[--data clusters|teacher] [--options '{"probe_every": null}']``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

VARIANTS = ("keras_float32", "keras_mixed_bfloat16", "keras_float8", "keras_float8_bf16",
            "adaptive_float8")
FEATURES, CLASSES, WIDTH, DEPTH = 32, 6, 128, 4
TRAIN, TEST, EPOCHS, BATCH = 16384, 4096, 8, 64
DATA_SEED = 1234


def make_data(kind: str = "clusters"):
    """The task, fixed by :data:`DATA_SEED`: ``(x, y), (x_test, y_test)``.

    * ``"clusters"``: 18 gaussian centres drawn N(0, 0.6^2) in 32
      dimensions, three per class, each row a centre plus N(0, 1) noise (the
      clusters overlap: float32 reaches ~0.87);
    * ``"teacher"``: gaussian rows labelled by a fixed random teacher
      (32 -> 8 tanh -> 6) with Gumbel label noise of 0.1 (float32 ~0.86).
    """
    import numpy as np

    rng = np.random.default_rng(DATA_SEED)
    n = TRAIN + TEST
    if kind == "clusters":
        k = 3
        centres = rng.normal(size=(CLASSES * k, FEATURES)) * 0.6
        label = rng.integers(0, CLASSES * k, size=n)
        x = (centres[label] + rng.normal(size=(n, FEATURES))).astype("float32")
        y = (label % CLASSES).astype("int32")
    elif kind == "teacher":
        x = rng.normal(size=(n, FEATURES)).astype("float32")
        w1 = rng.normal(size=(FEATURES, 8)) / np.sqrt(FEATURES)
        w2 = rng.normal(size=(8, CLASSES)) / np.sqrt(8)
        logits = np.tanh(x @ w1) @ w2 * 4.0
        y = (logits + rng.gumbel(size=logits.shape) * 0.1).argmax(1).astype("int32")
    else:
        raise ValueError(f"`kind` must be 'clusters' or 'teacher', got {kind!r}.")
    return (x[:TRAIN], y[:TRAIN]), (x[TRAIN:], y[TRAIN:])


def build(keras):
    return keras.Sequential([keras.Input((FEATURES,))]
                            + [keras.layers.Dense(WIDTH, activation="relu")
                               for _ in range(DEPTH)]
                            + [keras.layers.Dense(CLASSES)])


def run_variant(variant: str, seed: int, options: dict) -> dict:
    """One training run; returns the test accuracy (and, adaptive, the layers' dtypes)."""
    import keras

    (x, y), (xt, yt) = make_data(options.get("data", "clusters"))
    keras.utils.set_random_seed(seed)
    out: dict = {"variant": variant, "seed": seed}
    callbacks = []
    if variant.startswith("keras_"):
        keras.config.set_dtype_policy(
            "mixed_bfloat16" if variant in ("keras_mixed_bfloat16", "keras_float8_bf16")
            else "float32")
        model = build(keras)
        if variant.startswith("keras_float8"):
            model.quantize("float8")
    else:
        import keras_mp
        from keras_mp import callbacks as cbs

        keras_mp.set_global_policy("adaptive_float8")
        model = build(keras)
        kw = {k: options[k] for k in ("interval", "statistics_every", "probe_every")
              if k in options}
        if kw:
            callbacks.append(cbs.AdaptivePrecision(**kw))
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    hist = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0, callbacks=callbacks,
                     shuffle=True)
    _, acc = model.evaluate(xt, yt, batch_size=512, verbose=0)
    out["accuracy"] = float(acc)
    out["train_loss"] = float(hist.history["loss"][-1])
    if not variant.startswith("keras_"):
        from keras_mp import policies

        policy = policies.policy_of(model)
        out["dtypes"] = {layer.name: policy.dtype_of(layer.path) for layer in model.layers}
        out["float8_layers"] = [n for n, d in out["dtypes"].items() if d == "float8"]
        cb = next((c for c in callbacks), None)
        if cb is None:
            from keras_mp.adaptive.fit import autofit
            cb = autofit.callback_of(model)
        out["switches"] = [(e["step"], e["layer"].split("/")[-1], e["old"], e["new"],
                            e["reason"]) for e in cb.events]
    return out


def _child(variant: str, seeds, options) -> list[dict]:
    cmd = [sys.executable, "-m", "benchmarks.float8_parity", "--child", variant,
           "--seeds", ",".join(map(str, seeds)), "--data", options["data"],
           "--options", json.dumps(options)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    if res.returncode != 0:
        sys.stderr.write(res.stderr[-4000:])
        raise SystemExit(f"{variant} failed ({res.returncode})")
    return [json.loads(line[len("RESULT "):]) for line in res.stdout.splitlines()
            if line.startswith("RESULT ")]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--data", default="clusters", choices=("clusters", "teacher"))
    p.add_argument("--options", default="{}", help="JSON: AdaptivePrecision arguments")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    options = {"data": args.data, **json.loads(args.options)}
    if args.child:
        for seed in seeds:
            print("RESULT " + json.dumps(run_variant(args.child, seed, options)), flush=True)
        return
    variants = args.variants.split(",")
    results = {v: _child(v, seeds, options) for v in variants}
    print(f"{'variant':24s} " + " ".join(f"seed{s:<5d}" for s in seeds) + "  mean")
    for v, rows in results.items():
        accs = [r["accuracy"] for r in rows]
        print(f"{v:24s} " + " ".join(f"{a:.4f}   " for a in accs)
              + f"  {sum(accs) / len(accs):.4f}")
    for v, rows in results.items():
        for r in rows:
            if "float8_layers" in r:
                print(f"{v} seed {r['seed']}: float8 layers {r['float8_layers']}; "
                      f"dtypes {r['dtypes']}; switches {r['switches']}")


if __name__ == "__main__":
    main()
