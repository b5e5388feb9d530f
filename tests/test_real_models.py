"""Real models under adaptive precision: keras.applications (ResNet50V2,
EfficientNetB0, MobileNetV3Small, ConvNeXtTiny, DenseNet121), KerasHub (a
GPT-2, a Llama and a Gemma 2 causal LM, a BART encoder-decoder, a BERT and a
ViT classifier) and keras-io-style code (a model with its own
``train_step``, a VAE, a subclassed Transformer block), built from their
configs with random weights at CI sizes (tests/real_models/models.py), under
``"adaptive"`` and ``"adaptive_float16"`` (the keras-io-style ones under
``"adaptive_bfloat16"`` too). The models of :data:`FULL_ONLY` run with
``KERAS_MP_REAL_MODELS=all`` (minutes each on 2 cores).

For each model and policy, tests/real_models/lifecycle.py fits with plain
``compile``/``fit`` (the loss must be finite and decrease), checks that
``keras_mp.precision_report`` lists every layer that computes, fuses the
model (``keras_mp.fuse``: same outputs; the fused model saved and loaded
predicts the same, to the bit), and takes it through ``.keras``
save and load in a fresh process (same predictions), ``model.export``
served by a fresh process, ONNX run by onnxruntime in a fresh process,
``keras-mp export --format litert`` run in TFLite's interpreter,
``model.quantize("int8")`` and ``keras_mp.quantize``, a ``BackupAndRestore``
run resumed in the fresh process, which is also the fit after loading. On
the KerasHub models, one more fit with statistics on every call and the
float32 probe checks that every layer's forward statistics, and every
weighted layer's gradients and probe errors, are measured.

The models of :data:`MEASURED` train under one policy with
``KERAS_MP_EXECUTION`` unset (the measured execution mode a user gets) and
go through all of the above. Every other run (the other policy of those, and
both policies of ResNet50V2 and EfficientNetB0, whose export, ONNX and
LiteRT conversions cost a minute or more each on a 2-core CI machine) trains
as a TensorFlow graph through fit, report, fuse and ``.keras`` save and load
in the fresh process (the float16 run of the models of :data:`EXPORTED`
also through ``model.export``, served by the fresh process): the lifecycle of
every mode and dtype is tests/test_lifecycle_modes.py's.
Each model runs in two processes (train, then a fresh one to check),
started right after collection, beside the other tests
(tests/background.py; ``KERAS_MP_TEST_JOBS`` at a time).
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests import background
from tests.real_models.models import MODELS

pytest.importorskip("keras_hub")   # the `hub` extra, part of `test`
pytest.importorskip("onnxruntime")

POLICIES = ("adaptive", "adaptive_float16")
#: Model -> the policy it runs under with KERAS_MP_EXECUTION unset (measured),
#: through the whole lifecycle: a functional network with in-model
#: preprocessing, a subclassed causal LM with a shared embedding, a classifier
#: with three dict inputs.
MEASURED = {"MobileNetV3Small": "adaptive_float16", "GPT2CausalLM": "adaptive_float16",
            "BertTextClassifier": "adaptive"}
#: Models whose float16 run also goes through ``model.export``, served by a
#: fresh process (the models nobody here wrote, beyond the first five).
#: Not the VAE, under Keras's policies alike: its train_step never calls the
#: model (``model.export``: not built), and once called a subclassed model's
#: serving signature takes its compute dtype (float16 images; Keras's
#: ``export_utils`` uses ``model.input_dtype``).
EXPORTED = ("LlamaCausalLM", "GemmaCausalLM", "BartSeq2SeqLM", "ViTImageClassifier",
            "ConvNeXtTiny", "DenseNet121", "CustomTrainStep", "TransformerBlock")
#: Models that also run under "adaptive_bfloat16" (bfloat16 forced, emulated
#: on a CPU without it): the small keras-io-style ones (all three with
#: KERAS_MP_REAL_MODELS=all, the cheapest in CI).
BFLOAT16 = ("CustomTrainStep", "VAE", "TransformerBlock")
BFLOAT16_IN_CI = ("CustomTrainStep",)
#: Models run only with KERAS_MP_REAL_MODELS=all (minutes each on 2 cores:
#: docs/real_models.md has the figures).
FULL_ONLY = ("GemmaCausalLM", "BartSeq2SeqLM", "ViTImageClassifier", "ConvNeXtTiny",
             "DenseNet121", "LlamaCausalLM", "TransformerBlock", "ResNet50V2", "EfficientNetB0")
#: Fewest report rows a model has (the keras-io-style models are small).
MIN_ROWS = {"CustomTrainStep": 3, "VAE": 12, "TransformerBlock": 20}


def _enabled(name: str) -> bool:
    return name not in FULL_ONLY or os.environ.get("KERAS_MP_REAL_MODELS") == "all"


def policies(name: str) -> tuple[str, ...]:
    everything = os.environ.get("KERAS_MP_REAL_MODELS") == "all"
    bfloat16 = name in (BFLOAT16 if everything else BFLOAT16_IN_CI)
    return POLICIES + (("adaptive_bfloat16",) if bfloat16 else ())


def _length(name: str, policy: str) -> str:
    if name in EXPORTED and policy == "adaptive_float16":
        return "export"
    return "short"


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SCRIPT = os.path.join(_ROOT, "tests", "real_models", "lifecycle.py")
_TEST = "test_real_model"

_TRAIN = ("fit", "report", "predict", "fuse", "save_keras", "model_export", "onnx_export",
          "backup_and_restore", "model_quantize")
_CHECK = ("load_keras", "load_keras_predict", "serve_saved_model", "onnx_run", "cli_litert",
          "load_quantized", "resume_fit_quantize")
#: The other policy's steps.
_SHORT_TRAIN = ("fit", "report", "predict", "fuse", "save_keras")
_SHORT_CHECK = ("load_keras", "load_keras_predict")


def _run(phase: str, args: list[str]) -> str | None:
    """Runs one phase; returns what it printed if it crashed (None if not)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow")
    env.pop("KERAS_MP_EXECUTION", None)   # set per policy by the script
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
    done = background.run([sys.executable, _SCRIPT, phase, *args], timeout=1200, env=env,
                           cwd=_ROOT)
    return None if done.returncode == 0 else f"{phase} crashed:\n{done.stderr[-4000:]}"


def _pipeline(name: str, folder: str) -> str | None:
    specs = [f"{p}:auto:full" if MEASURED.get(name) == p else f"{p}:graph:{_length(name, p)}"
             for p in policies(name)]
    return _run("train", [folder, name, *specs]) or _run("check", [folder])


def start(items) -> None:
    """Starts the pipelines of the models that ``items`` (the session's
    selected tests) need, in the background (tests/background.py), the
    largest first."""
    background.start_selected(items, _TEST, "real", [m for m in MODELS if _enabled(m)],
                              _pipeline)


@pytest.fixture(scope="module")
def lifecycle(request):
    """model -> the folder its processes wrote to (started right after
    collection, tests/conftest.py)."""
    start(request.session.items)
    return background.waiter("real")


def _json(folder: str, name: str) -> dict:
    path = os.path.join(folder, name)
    assert os.path.exists(path), f"no {name} in {folder}"
    with open(path) as f:
        return json.load(f)


@pytest.mark.parametrize("name,policy", [(n, p) for n in MODELS for p in policies(n)])
def test_real_model(lifecycle, name, policy):
    if not _enabled(name):
        pytest.skip(f"{name} runs with KERAS_MP_REAL_MODELS=all (minutes on 2 cores)")
    folder = os.path.join(lifecycle(name), policy)
    facts = _json(folder, "facts.json")
    full = MEASURED.get(name) == policy
    exported = not full and _length(name, policy) == "export"
    train = (*_TRAIN, *(("evidence",) if MODELS[name] == "hub" else ()),
             *(("model_quantize_refused",) if policy == "adaptive_float16" else ())) \
        if full else _SHORT_TRAIN + (("model_export",) if exported else ())
    check = _CHECK if full else _SHORT_CHECK + (("serve_saved_model",) if exported else ())
    failures = {}
    for phase, names in (("train", train), ("check", check)):
        results = _json(folder, f"{phase}.json")["results"]
        for step in names:
            if results.get(step, "not run") != "ok":
                failures[f"{phase}.{step}"] = results.get(step, "not run")
    assert not failures, json.dumps(failures, indent=1)

    loss = facts["loss"]
    assert loss[-1] < loss[0], f"the loss did not decrease: {loss}"
    report = facts["report"]   # the step checked that every computing layer has a row
    assert report["rows"] == report["layers"] >= MIN_ROWS.get(name, 30), report
    # Within the candidates the training process measured ("adaptive" is
    # what is fast on this device, measured when first asked, there).
    assert set(report["dtypes"]) <= set(facts["candidates"]), (report, facts["candidates"])
    if policy == "adaptive_float16":   # the callback's loss-scale wrapper
        assert facts["optimizer"] == "LossScaleOptimizer", facts
    if not full:
        assert facts["chosen"] == "graph", facts
    if MODELS[name] == "hub" and full and set(facts["candidates"]) != {"float32"}:
        evidence = facts["evidence"]
        # Every layer's forward statistics; every layer that holds weights,
        # its gradients and the probe's errors (none where "adaptive" is
        # float32 alone, as on a CPU without 16-bit units: nothing to adapt).
        assert evidence["forward"] == evidence["rows"], evidence
        assert evidence["gradients"] == evidence["probe"] == evidence["with_weights"] > 10, \
            evidence
