"""The keras-mp command line, run as a user would (small sizes)."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from keras_mp import cli


def test_console_script_help():
    exe = shutil.which("keras-mp") or os.path.join(os.path.dirname(sys.executable), "keras-mp")
    for cmd in ([], ["demo"], ["info"], ["bench"]):
        out = subprocess.run([exe, *cmd, "--help"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert "usage: keras-mp" in out.stdout


def test_demo_small(tmp_path, capsys):
    assert cli.main(["demo", "--epochs", "1", "--quiet", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Test accuracy" in out and "Loss scale" in out and "x" in out
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
