"""A one-line progress bar for ``keras-mp bench``, like Keras's own: which
model and variant, the round, and the time left in the phase as estimated
from the calls done so far. It draws only on a terminal: written to a file or
a pipe, the bench prints its log lines and nothing else.

Example:
    >>> import io
    >>> p = Progress(io.StringIO())     # not a terminal: draws nothing
    >>> p.start("[mlp 1/1] timing", 2)
    >>> p.update("round 1/1 keras_mp")
    >>> p.active, p.stream.getvalue()
    (False, '')
"""

from __future__ import annotations

import shutil
import sys
import time
from typing import TextIO

__all__ = ["Progress", "format_seconds"]

_BAR = 20


def format_seconds(seconds: float) -> str:
    """``"1:05"``, ``"1:02:03"``: minutes and seconds, hours where needed.

    >>> format_seconds(65.4), format_seconds(3723)
    ('1:05', '1:02:03')
    """
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    text = f"{rest // 60}:{rest % 60:02d}"
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else text


class Progress:
    """A progress line on ``stream`` (stdout by default), drawn only where it
    is a terminal.

    Args:
        stream: where to draw; None: ``sys.stdout`` at each call.
        clock: the clock for the estimates (``time.perf_counter``).
    """

    def __init__(self, stream: TextIO | None = None, clock=time.perf_counter):
        self._stream = stream
        self._clock = clock
        self._label, self._total, self._done, self._t0 = "", 0, 0, 0.0
        self._width = 0  # characters drawn on the current line

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stdout

    @property
    def active(self) -> bool:
        """Whether the stream is a terminal (then the line is drawn)."""
        isatty = getattr(self.stream, "isatty", None)
        return bool(isatty and isatty())

    def start(self, label: str, total: int) -> None:
        """Begins a phase of ``total`` calls (e.g. every variant's timed rounds)."""
        if isinstance(total, bool) or not isinstance(total, int) or total < 1:
            raise ValueError(f"`total` must be an int >= 1, got {total!r}.")
        self._label, self._total, self._done, self._t0 = label, total, 0, self._clock()

    def update(self, detail: str) -> None:
        """Shows the call about to run (``detail``: the round and variant);
        call :meth:`done` when it finished."""
        if not self.active or not self._total:
            return
        done, total = self._done, self._total
        filled = _BAR * done // total
        bar = "=" * filled + (">" if filled < _BAR else "") + "." * (_BAR - filled - 1)
        elapsed = self._clock() - self._t0
        eta = (f"~{format_seconds(elapsed / done * (total - done))} left" if done
               else "estimating time left")
        line = f"{self._label} {detail} [{bar[:_BAR]}] {done}/{total} {eta}"
        width = shutil.get_terminal_size((100, 20)).columns - 1
        self._draw(line[:width])

    def done(self) -> None:
        """Counts one call finished."""
        self._done = min(self._done + 1, self._total)

    def log(self, message: str) -> None:
        """Prints a log line above the progress line (where one is drawn)."""
        self.clear()
        print(message, file=self.stream, flush=True)

    def clear(self) -> None:
        """Erases the progress line."""
        if self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._width = 0

    def _draw(self, line: str) -> None:
        pad = " " * max(0, self._width - len(line))
        self.stream.write("\r" + line + pad)
        self.stream.flush()
        self._width = len(line)
