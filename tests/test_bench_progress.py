"""keras-mp bench's progress line: drawn on a terminal (model, variant, round,
time left), nothing in a file."""

import io

from benchmarks.common import interleaved_clocks
from benchmarks.progress import Progress


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def _timed(stream):
    now = [0.0]

    def clock():
        return now[0]

    def call():  # each call "takes" 2 s on the progress clock
        now[0] += 2.0

    progress = Progress(stream, clock=clock)
    progress.start("[mlp 1/2] timing", 3 * 2)
    interleaved_clocks({"keras_float32": call, "keras_mp": call}, rounds=3, warmup=0,
                       progress=progress)
    progress.log("mlp: done")
    return progress


def test_progress_on_a_terminal_shows_model_variant_round_and_time_left(monkeypatch):
    # The line is cut to the terminal's width: a wide one here, whatever
    # pytest's own output is (an xdist worker's narrower one cut the line).
    monkeypatch.setenv("COLUMNS", "200")
    stream = _Terminal()
    _timed(stream)
    frames = stream.getvalue().split("\r")
    assert any(f.startswith("[mlp 1/2] timing round 1/3 keras_float32 [>")
               and "0/6 estimating time left" in f for f in frames), frames
    # After 3 calls of 2 s each, 3 calls left: about 6 s.
    assert any("round 2/3 keras_mp" in f and "3/6 ~0:06 left" in f for f in frames), frames
    assert any("round 3/3 keras_mp" in f and "5/6 ~0:02 left" in f for f in frames), frames
    # A log line erases the progress line first, then stands on its own line.
    assert stream.getvalue().endswith("\rmlp: done\n")


def test_progress_in_a_file_is_quiet():
    stream = io.StringIO()  # not a terminal, as when stdout goes to a file
    progress = _timed(stream)
    assert not progress.active
    assert stream.getvalue() == "mlp: done\n"
