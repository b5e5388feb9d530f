"""tests/background.py: a pipeline runs once among the session's workers, and
the worker that did not run it reads what it returned, or its error."""

import os

import pytest

from tests import background


@pytest.fixture
def folders(tmp_path, monkeypatch):
    """Pipeline folders under ``tmp_path`` (the session's own are untouched)."""
    def folder(key):
        path = os.path.join(tmp_path, key.replace("/", "_"))
        os.makedirs(path, exist_ok=True)
        return path

    monkeypatch.setattr(background, "folder", folder)
    return folder


def test_the_first_claim_runs_the_pipeline_and_the_second_reads_its_result(folders):
    calls = []

    def pipeline(name):
        calls.append(name)
        return [{"name": name, "steps": 3}]

    first = background._claimed(pipeline, "demo/a", "a")
    second = background._claimed(pipeline, "demo/a", "a")
    assert calls == ["a"]
    assert first == [{"name": "a", "steps": 3}]
    assert second is background._ELSEWHERE
    assert background._awaited("demo/a") == first


def test_a_pipeline_error_reaches_the_worker_that_waits(folders):
    def pipeline():
        raise ValueError("the child crashed")

    with pytest.raises(RuntimeError, match="the child crashed"):
        background._claimed(pipeline, "demo/b")
    with pytest.raises(RuntimeError, match="(?s)'demo/b' failed:.*ValueError: the child crashed"):
        background._awaited("demo/b")


def test_waiting_for_a_result_nobody_writes_ends(folders, monkeypatch):
    monkeypatch.setattr(background, "WAIT_S", 0.5)
    with pytest.raises(TimeoutError, match="'demo/c'.*no result in 0.5 s"):
        background._awaited("demo/c")
