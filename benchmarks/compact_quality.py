"""Does compact storage train as well as float32? A small causal LM, 1000 steps.

The quality evidence of issue 47 (item 5): a KerasHub ``LlamaCausalLM``
built from a config (2 layers, hidden 128, 4 query and 2 key-value heads,
intermediate 256: 0.46M parameters) learns the bytes of Python's own
standard library (a byte-level LM, vocabulary 256, read from the running
Python's ``*.py`` files, sorted, the first 2 MB: nothing downloaded),
AdamW(1e-3), batch 16 x 128 bytes, 10 epochs of 100 steps, seed 0
(``--seed``: the weights and the training windows; the held-out windows stay). Each
variant trains in a fresh process, with the execution mode fixed to the
TensorFlow graph (``KERAS_MP_EXECUTION=graph``: the measured choice of mode
times the machine, and another mode computes other bits):

* ``keras_float32``: Keras float32, the reference;
* ``keras_mp``: ``"adaptive"`` as it is by default;
* ``keras_mp_compact_moments``: ``"adaptive"`` with
  ``keras_mp.config.set_compact_moments(True)`` (AdamW's moments in
  bfloat16, the update in float32);
* ``keras_mp_compact_moments_again``: the same run again, whose weights and
  optimizer state must equal the first's bit for bit (``digest``);
* ``keras_mp_compact``: compact moments and
  ``keras_mp.config.set_compact_weights(True)`` (the trained weights and
  their gradients in bfloat16 too, each update rounded stochastically; with
  every ``--optimizer``: the others' weights are compact when asked).

Figures: the last epoch's mean training loss, the loss on 256 held-out
sequences (the last 10 % of the text), each epoch's training loss, and a
SHA-256 ``digest`` of every model and optimizer variable after training,
the dtypes of the moments and of the trained weights.
``within_1_percent``: both final losses within 1 % of Keras float32's.

Run: ``python -m benchmarks.compact_quality [--steps 100] [--epochs 10]``
(about 2 minutes a variant on a 2-core CPU); ``--optimizer`` trains with
another optimizer whose moments keras-mp can store compactly
(:data:`OPTIMIZERS`: ``sgd_momentum``, ``adamax``, ``nadam``, ``lion``,
``adafactor``).

Example:
    >>> from benchmarks import compact_quality
    >>> x, y = compact_quality.sequences(compact_quality.text()[:4096], 2, 16, seed=0)
    >>> x.shape, y.shape, bool((x[:, 1:] == y[:, :-1]).all())
    ((2, 16), (2, 16), True)
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import sysconfig
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import memory

__all__ = ["SIZE", "VARIANTS", "main", "run", "sequences", "text"]

SIZE: dict[str, int] = dict(vocabulary_size=256, num_layers=2, num_query_heads=4,
                            hidden_dim=128, intermediate_dim=256, num_key_value_heads=2)
BATCH, LENGTH, STEPS, EPOCHS, TEXT_BYTES = 16, 128, 100, 10, 2 * 2**20
#: ``--optimizer``: the optimizer each variant trains with (learning rates as
#: their Keras docs suggest against Adam's 1e-3: Lion's 3-10x smaller;
#: Adafactor's relative step, ``min(1e-2, 1 / sqrt(t))`` of each weight's rms,
#: the paper's).
OPTIMIZERS: dict[str, tuple[str, dict[str, Any]]] = {
    "adamw": ("AdamW", {"learning_rate": 1e-3}),
    "sgd_momentum": ("SGD", {"learning_rate": 0.1, "momentum": 0.9}),
    "adamax": ("Adamax", {"learning_rate": 2e-3}),
    "nadam": ("Nadam", {"learning_rate": 1e-3}),
    "lion": ("Lion", {"learning_rate": 2e-4}),
    "adafactor": ("Adafactor", {"learning_rate": 1e-2}),
}
VARIANTS: tuple[str, ...] = ("keras_float32", "keras_mp", "keras_mp_compact_moments",
                             "keras_mp_compact_moments_again", "keras_mp_compact")
_MARK = "KERAS_MP_COMPACT_QUALITY "


def text(size: int = TEXT_BYTES) -> np.ndarray:
    """The first ``size`` bytes of the running Python's standard library
    sources (``*.py`` in its ``stdlib`` folder, sorted by name), as uint8."""
    chunks, total = [], 0
    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))):
        with open(path, "rb") as f:
            chunks.append(f.read())
        total += len(chunks[-1])
        if total >= size:
            break
    return np.frombuffer(b"".join(chunks)[:size], np.uint8)


def sequences(data: np.ndarray, count: int, length: int, seed: int):
    """``count`` windows of ``length + 1`` bytes of ``data`` at seeded random
    places: (inputs, next-byte targets), int32."""
    starts = np.random.default_rng(seed).integers(0, len(data) - length - 1, count)
    windows = np.stack([data[s:s + length + 1] for s in starts]).astype("int32")
    return windows[:, :-1], windows[:, 1:]


def _digest(model) -> str:
    h = hashlib.sha256()
    for v in [*model.weights, *model.optimizer.variables]:
        h.update(np.ascontiguousarray(np.asarray(v.numpy())).tobytes())
    return h.hexdigest()


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ["KERAS_MP_EXECUTION"] = "graph"
    import keras
    import keras_hub

    variant = spec["variant"]
    if variant.startswith("keras_mp"):
        import keras_mp

        keras_mp.set_global_policy("adaptive")
        keras_mp.config.set_compact_moments(variant.startswith("keras_mp_compact"))
        keras_mp.config.set_compact_weights(variant == "keras_mp_compact")
    data = text()
    split = int(len(data) * 0.9)
    seed = spec.get("seed", 0)
    x, y = sequences(data[:split], BATCH * spec["steps"], LENGTH, seed=seed)
    vx, vy = sequences(data[split:], 256, LENGTH, seed=1)
    keras.utils.set_random_seed(seed)
    model = keras_hub.models.LlamaCausalLM(backbone=keras_hub.models.LlamaBackbone(**SIZE),
                                           preprocessor=None)
    name, kwargs = OPTIMIZERS[spec.get("optimizer", "adamw")]
    model.compile(optimizer=getattr(keras.optimizers, name)(**kwargs),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  weighted_metrics=[])
    mask = lambda a: {"token_ids": a, "padding_mask": np.ones_like(a)}  # noqa: E731
    history = model.fit(mask(x), y, batch_size=BATCH, epochs=spec["epochs"], verbose=0,
                        shuffle=False)
    held_out = model.evaluate(mask(vx), vy, batch_size=64, verbose=0, return_dict=True)
    moments = sorted({str(v.dtype) for v in model.optimizer.variables if len(v.shape)})
    weights = sorted({str(v.dtype) for v in model.trainable_variables})
    return {"loss": history.history["loss"], "final_loss": history.history["loss"][-1],
            "held_out_loss": held_out["loss"], "digest": _digest(model),
            "moment_dtypes": moments, "weight_dtypes": weights,
            "parameters": model.count_params()}


def run(variants: Sequence[str] = VARIANTS, steps: int = STEPS, epochs: int = EPOCHS,
        seed: int = 0, optimizer: str = "adamw") -> dict[str, Any]:
    """``{variant: figures}`` (each in a fresh process; ``seed``: the weights'
    and the training windows'; ``optimizer``: a key of :data:`OPTIMIZERS`),
    with ``within_1_percent`` and ``repeats_bit_for_bit`` where their
    variants ran."""
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        raise ValueError(f"`variants` must be among {VARIANTS}, got {bad}.")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"`optimizer` must be one of {sorted(OPTIMIZERS)}, got {optimizer!r}.")
    out: dict[str, Any] = {v: memory.fresh_process(
        "benchmarks.compact_quality", dict(variant=v, steps=steps, epochs=epochs, seed=seed,
                                           optimizer=optimizer),
        _MARK, timeout=3600) for v in variants}
    ref = out.get("keras_float32", {})
    for v, r in out.items():
        if "error" not in r and "final_loss" in ref and v != "keras_float32":
            r["vs_float32"] = {k: r[k] / ref[k] - 1 for k in ("final_loss", "held_out_loss")}
            r["within_1_percent"] = all(abs(d) <= 0.01 for d in r["vs_float32"].values())
    again = out.get("keras_mp_compact_moments_again", {})
    if "digest" in again and "digest" in out.get("keras_mp_compact_moments", {}):
        out["repeats_bit_for_bit"] = again["digest"] == out["keras_mp_compact_moments"]["digest"]
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=STEPS, help="steps per epoch")
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument("--seed", type=int, default=0, help="the weights' and the windows'")
    parser.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZERS),
                        help="what every variant trains with")
    parser.add_argument("--json", default=None, help="also write every figure there")
    args = parser.parse_args(argv)
    if args.child is not None:
        print(_MARK + json.dumps(_child(json.loads(args.child))), flush=True)
        return
    results = run(args.variants.split(","), args.steps, args.epochs, args.seed, args.optimizer)
    print("| variant | final train loss | held-out loss | vs float32 (train, held-out) | "
          "moments | weights |\n| --- | ---: | ---: | ---: | --- | --- |")
    for v, r in results.items():
        if not isinstance(r, dict):
            continue
        if "error" in r:
            print(f"| {v} | {r['error']} | | | | |")
            continue
        rel = r.get("vs_float32")
        cell = f"{rel['final_loss']:+.2%}, {rel['held_out_loss']:+.2%}" if rel else ""
        print(f"| {v} | {r['final_loss']:.4f} | {r['held_out_loss']:.4f} | {cell} | "
              f"{', '.join(r['moment_dtypes'])} | {', '.join(r.get('weight_dtypes', []))} |")
    if "repeats_bit_for_bit" in results:
        print(f"\nseeded compact run repeated bit for bit: {results['repeats_bit_for_bit']}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
