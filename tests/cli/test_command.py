"""The keras-mp command line, run as a user would (small sizes)."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from benchmarks.variants import LONG_FIT
from keras_mp import cli
from keras_mp.adaptive.decisions.probe_schedule import DEFAULT_BACKOFF, probe_calls


def _exe():
    return shutil.which("keras-mp") or os.path.join(os.path.dirname(sys.executable), "keras-mp")


def test_console_script_help_is_quiet():
    # The five commands run side by side (each starts TensorFlow: seconds).
    runs = [subprocess.Popen([_exe(), *cmd, "--help"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
            for cmd in ([], ["demo"], ["info"], ["bench"], ["--verbose", "demo"])]
    outs = []
    for run in runs:
        stdout, stderr = run.communicate(timeout=120)
        outs.append((run.returncode, stdout, stderr))
    for returncode, stdout, stderr in outs[:-1]:
        assert returncode == 0, stderr
        assert "usage: keras-mp" in stdout
        # TensorFlow's native start-up log (absl, CUDA probing) is hidden.
        assert stderr == "", stderr
    returncode, stdout, _ = outs[-1]
    assert returncode == 0 and "usage: keras-mp demo" in stdout


@pytest.mark.measured_execution
def test_demo_shows_a_rescue_quietly_without_control_characters(tmp_path):
    """The README's command, as a user runs it, output captured (not a TTY)."""
    out = subprocess.run([_exe(), "demo", "--out", str(tmp_path)], capture_output=True,
                         text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stderr == "", out.stderr
    text = out.stdout
    assert not any(c in text for c in "\r\b\x1b"), repr(text[:500])
    rows = {line[:26].strip(): line[26:].split() for line in text.splitlines()
            if line[:26].strip() in ("float32", "static mixed_float16",
                                     "adaptive float16/float32")}
    acc = {name: float(cols[0]) for name, cols in rows.items()}
    assert acc["static mixed_float16"] <= acc["float32"] - 0.05, text  # static fails
    assert acc["adaptive float16/float32"] >= acc["float32"] - 0.02, text  # rescued
    # The switch that rescues the run, with its reason; the rest stays float16.
    assert re.search(r"step +\d+: dense_in +float16 -> float32  \(\w+\)", text), text
    final = dict(pair.split() for pair in re.search(r"final: (.*)", text)[1].split(", "))
    assert final["dense_in"] == "float32" and final["dense_hidden"] == "float16", final
    # The overflowing steps drove the loss scale down; the promotion brought it back.
    scales = re.search(r"adaptive float16/float32 +\S+ +\S+ +(\d+) -> (\d+) -> (\d+)", text)
    assert scales and int(scales[2]) < int(scales[1]) == int(scales[3]), text
    assert "'adaptive' chooses among" in text and "GFLOP" not in text
    for name in ("keras_mp_demo.png", "keras_mp_precision.png"):  # plot_precision's too
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_info(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "float32" in out and "GFLOP/s" in out and "'adaptive' would choose" in out
    assert "float8 units: none" in out  # CI machines have no GPU


def test_info_shows_the_measured_execution_mode(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "TF graph vs XLA" in out and "Train step under 'adaptive'" in out
    assert "KERAS_MP_EXECUTION" in out


def test_bench_quick_writes_json_and_plot(tmp_path, capsys):
    variants = "keras_float32,keras_float32_xla,keras_mp"
    assert cli.main(["bench", "--quick", "--models", "mlp", "--variants", variants,
                     "--steps", "5", "--size", "batch=16,features=64,width=128,depth=2",
                     "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["sizes"]["mlp"] == dict(batch=16, features=64, width=128, depth=2)
    assert report["steps"] >= 5 and report["rounds"] >= 5
    assert report["machine"]["cpu"] and report["machine"]["keras_mp"]
    mlp = report["results"]["mlp"]
    assert set(mlp) == set(variants.split(","))
    for entry in mlp.values():
        for clock in ("cpu", "wall"):
            assert len(entry[clock]["samples"]) == report["rounds"]  # same rounds for all
            assert entry[clock]["median"] > 0
            assert entry[clock]["spread"] == pytest.approx(
                max(entry[clock]["samples"]) - min(entry[clock]["samples"]))
        assert entry["final_loss"] is not None
    assert mlp["keras_float32"]["vs_float32"]["cpu"] == pytest.approx(1.0)
    best = mlp["keras_mp"]["best_keras"]["wall"]
    assert best in ("keras_float32", "keras_float32_xla")
    assert mlp[best]["vs_best_keras"]["wall"] == pytest.approx(1.0)
    assert mlp["keras_mp"]["mode"] in ("xla", "xla_update", "graph")
    probe = mlp["keras_mp"]["probe"]  # None where "adaptive" is float32 alone
    # Charged over a long fit's mean gap between probes once they confirm (the back-off).
    mean_gap = round(LONG_FIT / probe_calls(LONG_FIT, 200, DEFAULT_BACKOFF), 1)
    assert probe is None or (probe["every"] == mean_gap and probe["probe_every"] == 200
                             and probe["per_step_cpu_s"] > 0)
    # Peak memory, a fresh process per variant: keras_float32 and keras_mp
    # (the Keras one-liner of its dtype is not among these variants).
    for v in ("keras_float32", "keras_mp"):
        mem = mlp[v]["memory"]
        assert mem["peak_rss_mib"] > mem["baseline_rss_mib"] > 0
    assert mlp["keras_float32_xla"]["memory"] is None and report["seconds"] > 0
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"
    out = capsys.readouterr().out
    assert "Best Keras one-liner" in out and "peak MiB" in out
    assert "\r" not in out  # no progress line: not a terminal


@pytest.mark.parametrize("argv,message", [
    (["bench", "--models", "vgg"], "models"),
    (["bench", "--variants", "keras_int8"], "variants"),
    (["bench", "--rounds", "3"], "rounds"),
    (["bench", "--size", "batch"], "size"),
    (["bench", "--size", "batch=-1"], "size"),
    (["bench", "--models", "mlp", "--size", "length=256"], "size"),
    (["bench", "--models", "mlp", "--size", "batch=0"], "size"),
    (["demo", "--epochs", "0"], "epochs"),
])
def test_bad_arguments_are_one_clear_line(argv, message, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and err[0].startswith("keras-mp ")


def test_unwritable_output_folder(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert cli.main(["bench", "--quick", "--models", "mlp", "--out", str(blocker / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error" in err[0]


# As a user without the plot extra runs it: importing matplotlib fails.
_WITHOUT_MATPLOTLIB = """
import sys
sys.modules["matplotlib"] = None
from keras_mp.cli.command import main
sys.exit(main(sys.argv[1:]))
"""


def test_bench_without_matplotlib_keeps_what_it_measured(tmp_path):
    """The run goes on and writes bench.json (exit 0); one line says the
    picture needs keras-mp[plot]. It used to compute every table and then die
    in its plot with ModuleNotFoundError."""
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_MATPLOTLIB, "bench", "--quick", "--models", "mlp",
         "--variants", "keras_float32", "--steps", "5", "--rounds", "5", "--no-memory",
         "--size", "batch=16,features=32,width=64,depth=2", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in done.stdout.splitlines() if "keras-mp[plot]" in line]
    assert said == ['bench.png (the picture) needs matplotlib, not installed: pip install '
                    '"keras-mp[plot]". The bench runs on and writes bench.json.'], done.stdout
    # Said before the run started, not after it.
    assert done.stdout.index("keras-mp[plot]") < done.stdout.index("keras-mp bench --quick:")
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["results"]["mlp"]["keras_float32"]["cpu"]["median"] > 0
    assert not (tmp_path / "bench.png").exists() and "Traceback" not in done.stderr


def test_bench_memory_processes_ignore_the_working_folder(tmp_path, monkeypatch):
    """Run from a source checkout with keras-mp installed, a child started
    as ``python -m keras_mp.benchmarks.memory`` found the checkout's
    ``keras_mp/`` first (it has no ``benchmarks``) and every memory figure
    was lost. A folder here whose ``benchmarks`` package hides the real one
    stands for it."""
    from benchmarks import memory

    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "__init__.py").write_text("")
    monkeypatch.chdir(tmp_path)
    spec = dict(kind="mlp", size=dict(batch=8, features=4, width=8, depth=1),
                variant="keras_float32", steps=5, epochs=1)
    (figures,) = memory.measure([spec])
    assert "error" not in figures, figures
    assert figures["peak_rss_mib"] > figures["baseline_rss_mib"] > 0


@pytest.mark.parametrize("hardware, left_out", [
    ({"bfloat16": True, "float16": False},
     ["keras_mixed_float16", "keras_mixed_float16_xla"]),
    ({"bfloat16": False, "float16": False},
     ["keras_mixed_bfloat16", "keras_mixed_bfloat16_xla", "keras_mixed_float16",
      "keras_mixed_float16_xla"]),
    ({"bfloat16": True, "float16": True}, []),
])
def test_quick_bench_leaves_out_one_liners_of_dtypes_without_hardware(hardware, left_out):
    from benchmarks import suite

    out = suite.quick_left_out(suite.VARIANTS, hardware)
    assert sorted(out) == left_out
    # float32, its XLA one-liner and keras_mp are always timed; each reason
    # names the dtype and how to time it anyway.
    for v, why in out.items():
        assert v.removeprefix("keras_mixed_").removesuffix("_xla") in why and "--variants" in why


def test_the_bench_times_keras_mp_as_in_a_long_fit_and_holds_it_to_its_keras_twin():
    """Each bench round is one epoch of a few steps; the bench stands for
    the steady state of a long fit, so keras-mp is told one (a Dense model's
    fit of 10 steps would otherwise measure no execution mode, issue 48), and
    its memory is held to the Keras one-liner of its dtype and mode."""
    from benchmarks import models, suite, variants
    from keras_mp import _installed
    from keras_mp.execution import reasons

    build, data = models.get("mlp", dict(batch=8, features=4, width=8, depth=1), steps=2)
    train, state = variants.make("keras_mp", build, data, steps=2)
    train()
    model = state["model"]
    assert getattr(model.__dict__[_installed.INSTALLED_ATTR], reasons.EXPECTED_ATTR) \
        == variants.LONG_FIT
    assert reasons.short_fit(model) is None
    entry = {"compute_dtypes": {"float32": 3}, "mode": "xla"}
    assert suite._same_dtype_keras(entry) == "keras_float32_xla"
    assert suite._same_dtype_keras({"compute_dtypes": {"bfloat16": 2, "float32": 1},
                                    "mode": "graph"}) == "keras_mixed_bfloat16"
