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


def test_info_shows_the_measured_execution_mode(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "TF graph vs XLA" in out and "Train step under 'adaptive'" in out
    assert "KERAS_MP_EXECUTION" in out


def test_bench_quick_writes_json_and_plot(tmp_path, capsys):
    variants = "keras_float32,keras_float32_xla,keras_mp"
    assert cli.main(["bench", "--quick", "--models", "mlp", "--variants", variants,
                     "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench.json").read_text())
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
    assert mlp["keras_mp"]["mode"] in ("xla", "graph")
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"
    assert "Best Keras one-liner" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["bench", "--models", "resnet"], "models"),
    (["bench", "--variants", "keras_int8"], "variants"),
    (["bench", "--rounds", "3"], "rounds"),
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
