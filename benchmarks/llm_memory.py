"""Memory of an LLM fine-tune: a 99.5M-parameter Llama-style causal LM,
Keras float32 and ``mixed_bfloat16`` against keras-mp's ``"adaptive"``.

The model (issue 47): KerasHub's ``LlamaCausalLM`` built from a config, random
weights (8 layers, hidden 768, 12 query and 4 key-value heads, intermediate
2048, vocabulary 32000: 99,496,704 parameters), AdamW(1e-4), next-token loss
on random token ids, batch 4 x 128 tokens, ``model.fit`` for one epoch of 4
steps. Two fine-tunes: ``full`` (every weight trains) and ``lora``
(``backbone.enable_lora(8)``: 794,624 trainable parameters, the rest frozen).

Each variant runs alone in a fresh process
(:func:`benchmarks.memory.fresh_process`; TensorFlow's CPU allocator never
gives memory back), one at a time. Figures, per variant:

* ``peak_mib``: the process's peak resident memory (Linux ``VmHWM``), the
  TensorFlow runtime included;
* ``growth_mib``: that peak less the resident memory just before ``fit``
  (the model built and compiled): what training added;
* ``state``: bytes of training state per trainable parameter, counted from
  the variables after ``fit``: ``weights`` (every model variable, frozen ones
  included), ``gradients`` (one per trainable variable, in its dtype),
  ``moments`` (the optimizer's per-variable slots), ``scales`` (the
  optimizer's scalars: step counts, loss scale), and ``mib`` of each;
* ``step_s``: the median wall time of the steps after the first (the first
  traces the step), with ``steps_s`` every step's, and ``step_cpu_s`` /
  ``steps_cpu_s`` the same in process CPU time; ``loss``: the last
  epoch's; ``storage``: for keras-mp, the variables' stored dtypes
  (``{dtype: count}``), and ``compute``: the layers' compute dtypes.

Variants: ``keras_float32``, ``keras_mixed_bfloat16`` (Keras alone,
``keras_mp`` not imported) and ``keras_mp`` (``keras_mp.set_global_policy(
"adaptive")``, ``fit`` as a user calls it: on a CPU with bfloat16 units
``"adaptive"`` chooses among bfloat16 and float32, ``keras-mp info``).
``keras_mp`` keeps keras-mp's defaults: frozen weights in their compute
dtype, and in a model that trains 2**24 parameters or more (the full
fine-tune, not LoRA's) trained weights, their gradients and AdamW's moments
in bfloat16. ``keras_mp_float32_storage`` is ``keras_mp`` with all compact
storage off (``keras_mp.config.set_compact_storage(False)``,
``set_compact_moments(False)``, ``set_compact_weights(False)``): Keras's
float32 state; ``keras_mp_compact_moments`` stores only AdamW's moments in
bfloat16 (``set_compact_moments(True)``, ``set_compact_weights(False)``);
``keras_mp_compact`` turns both on whatever the model's size
(``set_compact_moments(True)``, ``set_compact_weights(True)``).
``keras_mp_no_skip`` is ``keras_mp`` with the skip of non-finite steps off
(``keras_mp.config.set_skip_nonfinite(False)``: the update no longer waits
for every gradient to be checked).
``keras_mp_remat`` is ``keras_mp`` with the model built inside
``keras.RematScope("full")``: every layer's intermediate tensors recomputed
on the backward pass (:mod:`keras_mp.execution.remat`; Keras's own TensorFlow
``remat`` fails on this model in graph mode).
``--repeats N`` runs every variant N times, interleaved, and reports the run
of median peak (``peak_samples``: all of them).

Run: ``python -m benchmarks.llm_memory [--tunings full,lora] [--variants ...]
[--optimizer adamw|adam|sgd|adamax|nadam|lion] [--json out.json]`` (about 2 minutes a
variant on a 2-core CPU).

Example:
    >>> from benchmarks import llm_memory
    >>> llm_memory.SIZE["hidden_dim"], llm_memory.VARIANTS[:2]
    (768, ('keras_float32', 'keras_mixed_bfloat16'))
    >>> llm_memory.categories({"moments": 8.0, "weights": 4.0}, trainable=2)
    {'moments': 4.0, 'weights': 2.0, 'total': 6.0}
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

from . import memory

__all__ = ["SIZE", "TUNINGS", "VARIANTS", "categories", "main", "run", "table",
           "training_state"]

#: The Llama-style configuration (KerasHub ``LlamaBackbone`` arguments).
SIZE: dict[str, int] = dict(vocabulary_size=32000, num_layers=8, num_query_heads=12,
                            hidden_dim=768, intermediate_dim=2048, num_key_value_heads=4)
BATCH, LENGTH, STEPS, LORA_RANK = 4, 128, 4, 8
VARIANTS: tuple[str, ...] = ("keras_float32", "keras_mixed_bfloat16", "keras_mp",
                             "keras_mp_float32_storage", "keras_mp_compact_moments",
                             "keras_mp_compact", "keras_mp_remat", "keras_mp_no_skip")
TUNINGS: tuple[str, ...] = ("full", "lora")
#: ``--optimizer``: the Keras optimizer the fine-tune compiles with (AdamW by
#: default; the others' weights and moments are compact only with
#: ``keras_mp_compact``, where ``set_compact_weights(True)`` opts them in).
OPTIMIZERS: dict[str, tuple[str, dict[str, Any]]] = {
    "adamw": ("AdamW", {}), "adam": ("Adam", {}), "sgd": ("SGD", {"momentum": 0.9}),
    "adamax": ("Adamax", {}), "nadam": ("Nadam", {}), "lion": ("Lion", {})}
_MARK = "KERAS_MP_LLM_MEMORY "


def _rss(field: str) -> float:
    """``VmRSS`` or ``VmHWM`` of this process, MiB."""
    with open("/proc/self/status", encoding="ascii") as f:
        return next(int(ln.split()[1]) / 1024 for ln in f if ln.startswith(field + ":"))


def categories(nbytes: dict[str, float], trainable: int) -> dict[str, float]:
    """Bytes per trainable parameter of each category of ``nbytes``, and
    their ``total``."""
    out = {k: v / trainable for k, v in sorted(nbytes.items())}
    out["total"] = sum(out.values())
    return out


def training_state(model) -> dict[str, Any]:
    """The bytes of ``model``'s training state, counted from its variables
    (see the module's docstring): ``{"bytes": {category: n}, "trainable":
    parameters}``."""
    import numpy as np

    def size(v) -> int:
        return int(np.prod(v.shape)) * np.dtype(str(v.dtype)).itemsize \
            if str(v.dtype) != "bfloat16" else int(np.prod(v.shape)) * 2

    weights = {id(v): v for v in model.weights}
    trainable = [v for v in model.trainable_variables]
    slots, scalars = 0, 0
    for v in getattr(model.optimizer, "variables", []):
        if id(v) in weights:
            continue
        if len(v.shape) == 0:
            scalars += size(v)
        else:
            slots += size(v)
    return {"bytes": {"weights": sum(size(v) for v in weights.values()),
                      "gradients": sum(size(v) for v in trainable),
                      "moments": slots, "scales": scalars},
            "trainable": int(sum(int(np.prod(v.shape)) for v in trainable))}


class _Timer:
    """Wall time of each training batch."""

    def __new__(cls):
        import keras

        class Timer(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.times: list[float] = []
                self.cpu: list[float] = []

            def on_train_batch_begin(self, batch, logs=None):
                self._t, self._c = time.perf_counter(), time.process_time()

            def on_train_batch_end(self, batch, logs=None):
                self.times.append(time.perf_counter() - self._t)
                self.cpu.append(time.process_time() - self._c)

        return Timer()


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import keras_hub
    import numpy as np

    variant = spec["variant"]
    if variant.startswith("keras_mp"):
        import keras_mp

        keras_mp.set_global_policy("adaptive")
        # The defaults (None: compact weights and moments in a model training
        # 2**24 parameters or more) unless the variant says otherwise.
        float32_state = variant == "keras_mp_float32_storage"
        keras_mp.config.set_compact_storage(not float32_state)
        keras_mp.config.set_compact_moments(
            False if float32_state else True if variant in ("keras_mp_compact_moments",
                                                            "keras_mp_compact") else None)
        keras_mp.config.set_compact_weights(
            False if variant in ("keras_mp_float32_storage", "keras_mp_compact_moments")
            else True if variant == "keras_mp_compact" else None)
        keras_mp.config.set_skip_nonfinite(variant != "keras_mp_no_skip")
    else:
        keras.config.set_dtype_policy(variant.removeprefix("keras_"))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, SIZE["vocabulary_size"], (BATCH * spec["steps"], LENGTH + 1))
    x = {"token_ids": tokens[:, :-1].astype("int32"),
         "padding_mask": np.ones((len(tokens), LENGTH), "int32")}
    y = tokens[:, 1:].astype("int32")
    baseline = _rss("VmRSS")
    keras.utils.set_random_seed(0)
    with keras.RematScope("full") if variant == "keras_mp_remat" else contextlib.nullcontext():
        backbone = keras_hub.models.LlamaBackbone(**SIZE)
        model = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    if spec["tuning"] == "lora":
        backbone.enable_lora(LORA_RANK)
    name, kwargs = OPTIMIZERS[spec.get("optimizer", "adamw")]
    model.compile(optimizer=getattr(keras.optimizers, name)(1e-4, **kwargs),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  weighted_metrics=[])
    before = _rss("VmRSS")
    timer = _Timer()
    history = model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False,
                        callbacks=[timer])
    peak = _rss("VmHWM")
    state = training_state(model)
    out = {"peak_mib": peak, "growth_mib": peak - before, "before_fit_mib": before,
           "baseline_mib": baseline, "loss": float(history.history["loss"][-1]),
           "steps_s": timer.times, "step_s": statistics.median(timer.times[1:]),
           "steps_cpu_s": timer.cpu, "step_cpu_s": statistics.median(timer.cpu[1:]),
           "state": categories(state["bytes"], state["trainable"]),
           "state_mib": {k: v / 2**20 for k, v in state["bytes"].items()},
           "trainable": state["trainable"], "parameters": model.count_params(),
           "storage": {}, "compute": {}}
    for v in model.weights:
        out["storage"][str(v.dtype)] = out["storage"].get(str(v.dtype), 0) + 1
    for layer in model._flatten_layers(include_self=False):
        if layer.weights:
            out["compute"][layer.compute_dtype] = out["compute"].get(layer.compute_dtype, 0) + 1
    return out


def run(variants: Sequence[str] = VARIANTS[:3], tunings: Sequence[str] = TUNINGS,
        steps: int = STEPS, repeats: int = 1, timeout: float = 1800.0,
        optimizer: str = "adamw") -> dict[str, dict[str, Any]]:
    """``{tuning: {variant: figures}}``, each run in a fresh process, one at
    a time, ``repeats`` rounds of all (figures: see the module's docstring,
    of the run of median peak, with every run's peak and median step in
    ``peak_samples``, ``step_s_samples`` and ``step_cpu_s_samples``;
    ``{"error": ...}`` where a process failed); ``optimizer``: a key of
    :data:`OPTIMIZERS`."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"`optimizer` must be one of {sorted(OPTIMIZERS)}, got {optimizer!r}.")
    bad = [v for v in variants if v not in VARIANTS] + [t for t in tunings if t not in TUNINGS]
    if bad:
        raise ValueError(f"`variants` must be among {VARIANTS} and `tunings` among {TUNINGS}, "
                         f"got {bad}.")
    for name, value in (("steps", steps), ("repeats", repeats)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (name == "steps") + 1:
            raise ValueError(f"`{name}` must be an int >= {(name == 'steps') + 1}, "
                             f"got {value!r}.")
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for _ in range(repeats):
        for t in tunings:
            for v in variants:
                runs.setdefault((t, v), []).append(memory.fresh_process(
                    "benchmarks.llm_memory",
                    dict(variant=v, tuning=t, steps=steps, optimizer=optimizer), _MARK,
                    timeout))
    out: dict[str, dict[str, Any]] = {}
    for (t, v), results in runs.items():
        good = sorted((r for r in results if "error" not in r), key=lambda r: r["peak_mib"])
        chosen = good[(len(good) - 1) // 2] if good else results[0]
        out.setdefault(t, {})[v] = dict(
            chosen, peak_samples=[r["peak_mib"] for r in good],
            step_s_samples=[r["step_s"] for r in good],
            step_cpu_s_samples=[r.get("step_cpu_s") for r in good])
    return out


def table(results: dict[str, dict[str, Any]]) -> str:
    """The results of :func:`run` as a Markdown table (ratios against Keras
    float32 where it was run)."""
    lines = ["| fine-tune | variant | peak MiB (runs) | vs float32 | growth in fit MiB | "
             "state bytes / trainable param (weights, grads, moments, scales) | "
             "step s | loss |", "| --- | --- |" + " ---: |" * 6]
    for tuning, by_variant in results.items():
        ref = by_variant.get("keras_float32", {}).get("peak_mib")
        for variant, r in by_variant.items():
            if "error" in r:
                lines.append(f"| {tuning} | {variant} | {r['error']} |" + " |" * 5)
                continue
            s = r["state"]
            parts = ", ".join(f"{s[k]:.3g}" for k in ("weights", "gradients", "moments",
                                                       "scales"))
            ratio = f"{r['peak_mib'] / ref:.2f}x" if ref else ""
            samples = r.get("peak_samples", [])
            runs = ", ".join(f"{p:.0f}" for p in samples) if len(samples) > 1 else ""
            peak = f"{r['peak_mib']:.0f}" + (f" ({runs})" if runs else "")
            lines.append(f"| {tuning} | {variant} | {peak} | {ratio} | "
                         f"{r['growth_mib']:.0f} | {s['total']:.3g} ({parts}) | "
                         f"{r['step_s']:.2f} | {r['loss']:.4f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--variants", default=",".join(VARIANTS[:3]))
    parser.add_argument("--tunings", default=",".join(TUNINGS))
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZERS))
    parser.add_argument("--json", default=None, help="also write every figure there")
    args = parser.parse_args(argv)
    if args.child is not None:
        print(_MARK + json.dumps(_child(json.loads(args.child))), flush=True)
        return
    results = run(args.variants.split(","), args.tunings.split(","), args.steps, args.repeats,
                  optimizer=args.optimizer)
    print(table(results))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
