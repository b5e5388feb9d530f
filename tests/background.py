"""Subprocess pipelines that tests wait for, started as soon as the session's
tests are collected.

tests/test_lifecycle_modes.py and tests/test_real_models.py check what
separate processes wrote (train, then a fresh process to check): each
pipeline is minutes of one process. Started when their first test ran, the
session waited for them (7 of 28 minutes on 2 cores); started right after
collection (``pytest_collection_finish`` in tests/conftest.py), they run
beside the rest of the tests, whose processes leave a core idle much of the
time (tracing and Python-side work). ``KERAS_MP_TEST_JOBS`` pipelines run at
a time (default 2); the first ones submitted start first. Their processes
run at a lower priority (``nice`` 10): the session's own tests, one after
another, are the critical path, and the pipelines' results are needed only
when their tests come, near the end.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from typing import Any

__all__ = ["NICE", "run", "start", "start_selected", "result", "folder", "waiter", "shutdown"]

#: How much lower the pipelines' processes run than the session's.
NICE = 10

_pool: concurrent.futures.ThreadPoolExecutor | None = None
_runs: dict[str, concurrent.futures.Future] = {}
_folders: dict[str, str] = {}
_root: str | None = None


def run(args: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(args, **kwargs)`` at :data:`NICE` (through ``nice``,
    where there is one: a ``preexec_fn`` is not safe beside threads), output
    captured."""
    nice = shutil.which("nice")
    prefix = [nice, "-n", str(NICE)] if nice else []
    return subprocess.run([*prefix, *args], capture_output=True, text=True, **kwargs)


def folder(key: str) -> str:
    """A fresh folder for ``key``'s pipeline (removed by :func:`shutdown`)."""
    global _root
    if _root is None:
        _root = tempfile.mkdtemp(prefix="keras_mp_background_")
    if key not in _folders:
        _folders[key] = tempfile.mkdtemp(prefix=key.replace("/", "_") + "_", dir=_root)
    return _folders[key]


def start(key: str, fn: Callable[..., Any], *args: Any) -> None:
    """Runs ``fn(*args)`` in the background, once per ``key``."""
    global _pool
    if key in _runs:
        return
    if _pool is None:
        jobs = int(os.environ.get("KERAS_MP_TEST_JOBS", "2"))
        _pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs))
    _runs[key] = _pool.submit(fn, *args)


def start_selected(items, test: str, prefix: str, names, pipeline: Callable[[str, str], Any]
                   ) -> None:
    """Starts ``pipeline(name, folder)`` as ``prefix/name`` for each of
    ``names`` (in that order) that a selected test ``test[name-...]`` of
    ``items`` needs."""
    for name in names:
        if any(item.name.startswith(f"{test}[{name}-") for item in items):
            key = f"{prefix}/{name}"
            start(key, pipeline, name, folder(key))


def result(key: str) -> Any:
    """What ``key``'s pipeline returned (waits for it)."""
    if key not in _runs:
        raise KeyError(f"no background pipeline {key!r} was started")
    return _runs[key].result()


def waiter(prefix: str) -> Callable[[str], str]:
    """``name -> folder`` of the pipeline ``prefix/name``, once it ended
    without crashing (a crash fails the test that waits, with its output)."""
    def wait(name: str) -> str:
        key = f"{prefix}/{name}"
        crashed = result(key)
        assert crashed is None, crashed
        return folder(key)

    return wait


def shutdown() -> None:
    """Waits for the pipelines still running, then removes their folders."""
    global _pool, _root
    if _pool is not None:
        _pool.shutdown(wait=True, cancel_futures=True)
        _pool = None
    _runs.clear()
    _folders.clear()
    if _root is not None:
        shutil.rmtree(_root, ignore_errors=True)
        _root = None
