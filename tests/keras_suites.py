"""The drop-in suite: the installed Keras's own test modules run under
keras-mp's policies and under Keras's own, side by side. A test that passes
under Keras's policy (the control) and fails under keras-mp's counts against
keras-mp.

Each run is a pytest subprocess over the modules of one group, with
:mod:`tests.keras_suites_plugin` setting up the mode (train steps as
TensorFlow graphs, ``KERAS_MP_EXECUTION=graph``, as in keras-mp's own tests).
The pairs (:data:`PAIRS`), keras-mp's mode against its control:

* ``adaptive_bfloat16`` against Keras ``mixed_bfloat16`` (``"adaptive"``
  resolves to ``"adaptive_bfloat16"`` on bfloat16 hardware, to float32 alone
  on a CPU without it);
* ``adaptive_float16`` against Keras ``mixed_float16``;
* ``mixed_float16`` with every optimizer the test modules make wrapped in
  ``keras_mp.LossScaleOptimizer`` against the same wrapped in Keras's
  ``LossScaleOptimizer`` (``optimizers`` group);
* ``adaptive_bfloat16`` with compact training state forced on
  (``keras_mp.config.set_compact_weights(True)`` and
  ``set_compact_moments(True)``: what a model training 2**24 parameters gets
  by default, here for the suites' small models) against Keras
  ``mixed_bfloat16``;
* ``adaptive_float16`` as a user gets it against Keras ``mixed_float16``:
  the test modules' fits are too small to gain from 16 bits, so ``fit``
  trains their layers in float32 (:mod:`keras_mp.adaptive.decisions.gain`), and what
  runs outside ``fit`` computes in float16, as under Keras's policy.

In the first two pairs ``fit`` adapts every fit
(``autofit.set_min_saving(0)``), as it adapts a fit large enough to gain: the
comparison is of adaptation with Keras's mixed precision, and the callback
``fit`` adds samples statistics on every call and runs the float32 probe every
second call, so that the suites' short fits run both (the defaults probe once
in 200 calls; :mod:`tests.keras_suites_plugin`).

In keras-mp's modes ``keras_mp.LossScaleOptimizer`` stands wherever Keras uses
its own. CI runs :data:`CI_FILES` (``tests/test_keras_suites.py``); the full
comparison, every group of :data:`GROUPS`, is::

    python -m tests.keras_suites --full            # add --json FILE for the outcomes

(about an hour on 2 CPU cores). It prints, per group and pair, the tests
passed and failed under each mode, then every test that passes under the
control and fails under keras-mp, and exits 1 if there is one. Such a test is
run three more times under the control first: one that fails there too is
listed apart, as chance (:func:`flaky_under_control`).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Mode:
    policy: str          # the global policy
    keras_mp: bool       # keras-mp's set-up (else Keras's own)
    wrap: bool = False   # every optimizer wrapped in the mode's loss-scale optimizer
    every_fit: bool = True   # keras-mp adapts every fit (else: where it can gain)
    compact: bool = False    # compact weights and moments forced on (else: by size)


MODES = {
    "keras_mixed_bfloat16": Mode("mixed_bfloat16", False),
    "keras_mp_adaptive_bfloat16": Mode("adaptive_bfloat16", True),
    "keras_mp_adaptive_bfloat16_compact": Mode("adaptive_bfloat16", True, compact=True),
    "keras_mixed_float16": Mode("mixed_float16", False),
    "keras_mp_adaptive_float16": Mode("adaptive_float16", True),
    "keras_lso_wrapped": Mode("mixed_float16", False, wrap=True),
    "keras_mp_lso_wrapped": Mode("mixed_float16", True, wrap=True),
    "keras_mp_adaptive_as_is": Mode("adaptive_float16", True, every_fit=False),
}

#: keras-mp's mode -> its control.
PAIRS = {
    "keras_mp_adaptive_bfloat16": "keras_mixed_bfloat16",
    "keras_mp_adaptive_bfloat16_compact": "keras_mixed_bfloat16",
    "keras_mp_adaptive_float16": "keras_mixed_float16",
    "keras_mp_lso_wrapped": "keras_lso_wrapped",
    "keras_mp_adaptive_as_is": "keras_mixed_float16",
}
_ADAPTIVE = ("keras_mp_adaptive_bfloat16", "keras_mp_adaptive_bfloat16_compact",
             "keras_mp_adaptive_float16", "keras_mp_adaptive_as_is")

#: Group -> Keras test files (globs under keras/src), and the pairs it runs.
GROUPS = {
    "dtype_policies": (["dtype_policies/*_test.py"], _ADAPTIVE),
    "optimizers": (["optimizers/*_test.py", "optimizers/schedules/*_test.py"], tuple(PAIRS)),
    "models": (["models/*_test.py"], _ADAPTIVE),
    "saving": (["saving/*_test.py"], _ADAPTIVE),
    "trainers": (["trainers/*_test.py"], _ADAPTIVE),
    "layers": (["layers/core/*_test.py", "layers/normalization/*_test.py",
                "layers/activations/*_test.py", "layers/merging/*_test.py",
                "layers/attention/*_test.py"], _ADAPTIVE),
}

#: What CI runs (tests/test_keras_suites.py): Keras's base-optimizer tests
#: of gradient accumulation, EMA and clipping, under the float16 pairs
#: (adaptive_float16; every optimizer wrapped in keras_mp.LossScaleOptimizer).
CI_FILES = ["optimizers/optimizer_test.py"]
CI_SELECT = "accumulation or ema or clip"
CI_PAIRS = ("keras_mp_adaptive_float16", "keras_mp_lso_wrapped")


def keras_src() -> str:
    import keras.src

    return os.path.dirname(keras.src.__file__)


def files(patterns: list[str]) -> list[str]:
    src = keras_src()
    return sorted(f for p in patterns for f in glob.glob(os.path.join(src, p)))


def run(mode: str, paths: list[str], select: str | None = None,
        timeout: float = 7200) -> dict[str, str]:
    """Runs pytest over ``paths`` (the tests matching ``select``, a ``-k``
    expression, if given) in a subprocess in ``mode``; returns each test's
    outcome (``passed``, ``failed``, ``skipped``) by node id."""
    if mode not in MODES:
        raise ValueError(f"`mode` must be one of {sorted(MODES)}, got {mode!r}.")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "outcomes.json")
        ini = os.path.join(tmp, "pytest.ini")
        with open(ini, "w") as f:
            f.write("[pytest]\nfilterwarnings = ignore\n")
        env = dict(os.environ, KERAS_MP_SUITE_MODE=mode, KERAS_MP_SUITE_OUT=out,
                   KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="3",
                   KERAS_MP_EXECUTION="graph",
                   PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "tests.keras_suites_plugin",
               "-c", ini, "--rootdir", keras_src(), "-p", "no:cacheprovider",
               "--tb=line", "-o", "console_output_style=classic",
               "--continue-on-collection-errors",
               *(["-k", select] if select else []), *paths]
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout)
        if not os.path.exists(out):
            raise RuntimeError(f"pytest wrote no outcomes ({mode}, rc {proc.returncode}):\n"
                               + proc.stdout[-3000:] + proc.stderr[-3000:])
        with open(out) as f:
            return json.load(f)


def regressions(control: dict[str, str], ours: dict[str, str]) -> list[str]:
    """Tests that pass under the control and do not pass under keras-mp
    (failed, or missing: a crash of the run)."""
    return sorted(t for t, o in control.items() if o == "passed" and ours.get(t) != "passed")


def flaky_under_control(control: str, tests: list[str], reruns: int = 3) -> list[str]:
    """Those of ``tests`` (node ids) that fail at least once in ``reruns``
    more runs under the ``control`` mode: their outcome is chance under
    Keras's own policy (unseeded random data near a tolerance, such as
    ``batch_normalization_test.py::test_correctness*`` in bfloat16), so they
    say nothing of keras-mp. A test the control passes every time stays a
    regression however keras-mp fares on a rerun."""
    flaky: set[str] = set()
    paths = [os.path.join(keras_src(), t) for t in tests]
    for _ in range(reruns if tests else 0):
        got = run(control, paths)
        flaky |= {t for t in tests if got.get(t) != "passed"}
    return sorted(flaky)


def counts(outcomes: dict[str, str]) -> dict[str, int]:
    c = collections.Counter(outcomes.values())
    return {k: c.get(k, 0) for k in ("passed", "failed", "skipped")}


def compare(groups: dict, select: str | None = None, log=print) -> dict:
    """Runs every group's pairs; returns ``{group: {pair: {...}}}``."""
    results: dict = {}
    for group, (patterns, pairs) in groups.items():
        paths = files(patterns)
        results[group] = {}
        for ours in pairs:
            control = PAIRS[ours]
            got = {m: run(m, paths, select) for m in (control, ours)}
            bad = regressions(got[control], got[ours])
            flaky = flaky_under_control(control, bad)
            bad = [t for t in bad if t not in flaky]
            results[group][ours] = {"control": control, "outcomes": got, "regressions": bad,
                                    "flaky_under_control": flaky,
                                    "counts": {m: counts(o) for m, o in got.items()}}
            log(f"{group:15s} {ours:28s} {counts(got[ours])}  vs  {control:22s} "
                f"{counts(got[control])}  keras-mp-only failures: {len(bad)}"
                f" (and {len(flaky)} that fail by chance under the control too)", flush=True)
            for t in bad:
                log(f"    {t}", flush=True)
            for t in flaky:
                log(f"    flaky under {control}: {t}", flush=True)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="every group (default: CI's)")
    parser.add_argument("--groups", help="comma-separated groups of GROUPS")
    parser.add_argument("--json", help="write every outcome to this file")
    parser.add_argument("--pairs", help="comma-separated keras-mp modes of PAIRS (default: all)")
    args = parser.parse_args(argv)
    if args.groups:
        unknown = set(args.groups.split(",")) - set(GROUPS)
        if unknown:
            parser.error(f"--groups: unknown {sorted(unknown)}; choose from {sorted(GROUPS)}")
        groups = {g: GROUPS[g] for g in args.groups.split(",")}
    else:
        groups = GROUPS if args.full else {"ci": (CI_FILES, CI_PAIRS)}
    if args.pairs:
        chosen = args.pairs.split(",")
        if set(chosen) - set(PAIRS):
            parser.error(f"--pairs: unknown {sorted(set(chosen) - set(PAIRS))}; choose from "
                         f"{sorted(PAIRS)}")
        groups = {g: (paths, tuple(p for p in pairs if p in chosen))
                  for g, (paths, pairs) in groups.items()}
    results = compare(groups, None if args.full or args.groups else CI_SELECT)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    bad = [t for g in results.values() for r in g.values() for t in r["regressions"]]
    print(f"keras-mp-only failures: {len(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
