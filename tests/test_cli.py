"""The keras-mp command line, run as a user would (small sizes)."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from keras_mp import cli


def _exe():
    return shutil.which("keras-mp") or os.path.join(os.path.dirname(sys.executable), "keras-mp")


def test_console_script_help_is_quiet():
    for cmd in ([], ["demo"], ["info"], ["bench"]):
        out = subprocess.run([_exe(), *cmd, "--help"], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        assert "usage: keras-mp" in out.stdout
        # TensorFlow's native start-up log (absl, CUDA probing) is hidden.
        assert out.stderr == "", out.stderr
    out = subprocess.run([_exe(), "--verbose", "demo", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "usage: keras-mp demo" in out.stdout


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
    assert "'adaptive' chooses among" in text and "GFLOP" not in text
    png = tmp_path / "keras_mp_demo.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_info(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "float32" in out and "GFLOP/s" in out and "'adaptive' would choose" in out


def test_bench_quick_writes_json_and_plot(tmp_path, capsys):
    assert cli.main(["bench", "--quick", "--models", "mlp", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    mlp = report["results"]["mlp"]
    assert set(mlp) == {"keras_float32", "keras_mixed_bfloat16", "keras_mixed_float16",
                        "keras_mp"}
    assert mlp["keras_float32"]["speedup_vs_float32"] == pytest.approx(1.0)
    for v in mlp.values():
        assert v["median_s"] > 0 and v["final_loss"] is not None
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"
    assert "speed-up vs keras_float32" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["bench", "--models", "resnet"], "models"),
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
