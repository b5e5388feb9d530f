"""Issue 49, item 3: a seeded script trains the same weights, bit for bit,
run after run, under every adaptive policy, as under Keras's policies.

keras-mp decides some things from timings (docs/architecture.md, "Decisions
made from timings"): the train step's execution mode above all, whose modes
round differently. Each decision is kept on disk once made
(``KERAS_MP_CACHE_DIR``) and measured so that the training steps are the
same whatever was measured, or it is a fixed rule. So the same seeded
script (tests/seeded/train.py: a Dense stack of 1024 steps and an LSTM,
through ``fit`` as a user runs it, the execution mode measured), run in a
fresh process with an empty cache and again in another with the cache the
first left, ends with the same training state: weights, optimizer state,
metric totals, the adaptive statistics and decisions.

Each policy's two processes (about 35 s of CPU each on 2 cores) start right
after collection and run beside the other tests (tests/background.py).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from keras_mp.device import cache
from tests import background

SCRIPT = Path(__file__).parent / "seeded" / "train.py"
_ROOT = str(Path(__file__).parents[1])
POLICIES = ("adaptive", "adaptive_bfloat16", "adaptive_float16")
MODELS = ("dense", "lstm")
_TEST = "test_a_seeded_run_trains_the_same_weights_with_an_empty_and_a_kept_cache"


def _pipeline(policy: str, folder: str) -> str | None:
    """The first run (an empty cache), then the second (the cache the first
    left); what crashed, or None."""
    env = {k: v for k, v in os.environ.items() if k != "KERAS_MP_EXECUTION"}  # measured
    env.update(KERAS_MP_CACHE_DIR=os.path.join(folder, "cache"), TF_CPP_MIN_LOG_LEVEL="3",
               KERAS_BACKEND="tensorflow",
               PYTHONPATH=os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p))
    for run in ("first", "second"):
        done = background.run([sys.executable, str(SCRIPT), policy, os.path.join(folder, run)],
                              timeout=900, env=env, cwd=_ROOT)
        if done.returncode != 0:
            return f"the {run} run ({policy}) crashed:\n{done.stderr[-4000:]}"
    return None


def start(items) -> None:
    """Starts the pipelines of the policies that ``items`` (the session's
    selected tests) need, in the background (tests/background.py)."""
    background.start_selected(items, _TEST, "seeded", POLICIES, _pipeline)


@pytest.fixture(scope="module")
def seeded(request):
    """policy -> the folder where its two runs wrote their results."""
    start(request.session.items)
    return background.waiter("seeded")


@pytest.mark.measured_execution
@pytest.mark.parametrize("policy, model", [(p, m) for p in POLICIES for m in MODELS])
def test_a_seeded_run_trains_the_same_weights_with_an_empty_and_a_kept_cache(seeded, policy,
                                                                             model):
    folder = Path(seeded(policy))
    assert (folder / "cache" / cache.FILE).exists()
    first, second = (json.loads((folder / run / "info.json").read_text())[model]
                     for run in ("first", "second"))
    a, b = (np.load(folder / run / f"{model}.npz") for run in ("first", "second"))
    assert a.files == b.files and len(a.files) > 10
    for key in a.files:
        np.testing.assert_array_equal(a[key], b[key], err_msg=f"{policy} {model} {key}")
    assert first["loss"] == second["loss"]
    assert first["chosen"] == second["chosen"] in ("graph", "xla_update", "xla")
    # The adaptive decisions were taken, and are the same. (On a CPU without
    # 16-bit units "adaptive" is float32 alone and gathers no evidence.)
    if first["report"]["candidates"] != ["float32"]:
        assert any(row["stats"] is not None for row in first["report"]["layers"]), \
            first["report"]
    assert first["report"] == second["report"]
    # The execution trial measured in the first process and its decisions
    # were read back in the second. (The LSTM's RMSprop update has no native
    # kernel: the update under XLA is always a mode to try where XLA runs.)
    if model == "lstm" or first["said"]:
        assert first["said"] and not any("kept in" in line for line in first["said"]), first
        assert len(second["said"]) == len(first["said"])
        assert all("kept in" in line for line in second["said"]), second["said"]
    # The dense fit, seconds long, kept the graph after its first calls, from
    # the median the first process measured and the second read back.
    if model == "dense":
        assert len(first["first_calls"]) == 1 and first["chosen"] == "graph", first
        assert second["first_calls"] == first["first_calls"]
