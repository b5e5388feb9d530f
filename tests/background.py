"""Subprocess pipelines that tests wait for, started as soon as the session's
tests are collected.

tests/test_lifecycle_modes.py and tests/test_real_models.py check what
separate processes wrote (train, then a fresh process to check): each
pipeline is minutes of one process. Started when their first test ran, the
session waited for them (7 of 28 minutes on 2 cores); started right after
collection (``pytest_collection_finish`` in tests/conftest.py), they run
beside the rest of the tests. ``KERAS_MP_TEST_JOBS`` pipelines run at a time
(default 2, shared among the session's workers); the first ones submitted
start first. Their processes run at a lower priority (``nice`` 10): the
session's own tests are the critical path, and the pipelines' results are
needed only when their tests come, near the end.

The session runs in two pytest-xdist workers (``-n auto``, tests/conftest.py):
each worker collects every test and submits every pipeline, and each
pipeline runs once, in the worker that claims it first (an exclusive lock
file in the folder the controller shares with its workers,
``KERAS_MP_TEST_SHARED``); the other worker's tests wait for the result file
it writes (a pickle of what the pipeline returned, or of its error). Without
xdist (``-n 0``) the same code runs in the one process.
"""

from __future__ import annotations

import concurrent.futures
import os
import pickle
import shutil
import subprocess
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["NICE", "SHARED", "run", "start", "start_selected", "result", "folder", "waiter",
           "shutdown"]

#: How much lower the pipelines' processes run than the session's.
NICE = 10
#: The environment variable naming the folder the xdist controller shares with its workers.
SHARED = "KERAS_MP_TEST_SHARED"
#: Longest wait for a pipeline another worker runs (its own timeouts are shorter).
WAIT_S = 3600
_ELSEWHERE = "ran in another worker"

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


def _workers() -> int:
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


def folder(key: str) -> str:
    """The folder of ``key``'s pipeline, the same in every worker (removed
    by :func:`shutdown`, or by the controller under xdist)."""
    global _root
    if _root is None:
        _root = os.environ.get(SHARED) or tempfile.mkdtemp(prefix="keras_mp_background_")
    if key not in _folders:
        _folders[key] = os.path.join(_root, key.replace("/", "_"))
        os.makedirs(_folders[key], exist_ok=True)
    return _folders[key]


def _claimed(fn: Callable[..., Any], key: str, *args: Any) -> Any:
    """``fn(*args)`` if this worker claims ``key`` first (its outcome is
    written beside the folder for the other workers), else :data:`_ELSEWHERE`."""
    base = folder(key)
    try:
        os.close(os.open(base + ".lock", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return _ELSEWHERE
    try:
        outcome = ("ok", fn(*args))
    except BaseException:   # noqa: BLE001 - handed to whichever worker waits
        outcome = ("error", traceback.format_exc())
    with open(base + ".result.tmp", "wb") as f:
        pickle.dump(outcome, f)
    os.replace(base + ".result.tmp", base + ".result")
    return _unpacked(outcome, key)


def _unpacked(outcome: tuple[str, Any], key: str) -> Any:
    status, value = outcome
    if status == "error":
        raise RuntimeError(f"background pipeline {key!r} failed:\n{value}")
    return value


def _awaited(key: str) -> Any:
    """What the worker that claimed ``key`` wrote, once it did."""
    path, deadline = folder(key) + ".result", time.monotonic() + WAIT_S
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"background pipeline {key!r}, run by another worker, "
                               f"wrote no result in {WAIT_S} s")
        time.sleep(1.0)
    with open(path, "rb") as f:
        return _unpacked(pickle.load(f), key)


def start(key: str, fn: Callable[..., Any], *args: Any) -> None:
    """Runs ``fn(*args)`` in the background, once per ``key`` (in one worker)."""
    global _pool
    if key in _runs:
        return
    if _pool is None:
        jobs = int(os.environ.get("KERAS_MP_TEST_JOBS", "2"))
        jobs = max(1, round(jobs / _workers()))
        _pool = concurrent.futures.ThreadPoolExecutor(max_workers=jobs)
    _runs[key] = _pool.submit(_claimed, fn, key, *args)


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
    value = _runs[key].result()
    return _awaited(key) if value is _ELSEWHERE else value


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
    if _root is not None and not os.environ.get(SHARED):
        shutil.rmtree(_root, ignore_errors=True)
    _root = None
