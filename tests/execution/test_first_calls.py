"""A fit's first calls, timed as a graph, decide whether anything is measured
(keras_mp.execution.first_calls): the graph kept where the fit is short in
seconds, the measured function handed over otherwise, and the median kept on
disk so that a later process decides alike."""

from __future__ import annotations

import time

import pytest

from keras_mp.device import cache
from keras_mp.execution import first_calls


def _calls(fn, count):
    return [fn(i) for i in range(count)]


def _graph(seconds, log):
    def graph(iterator):
        log.append(("graph", iterator))
        time.sleep(seconds)
        return None
    return graph


def test_a_fit_short_in_seconds_keeps_the_graph_on_every_call():
    log, kept, then = [], [], []
    fn = first_calls.FirstCalls(_graph(0.0, log), then=lambda: then.append(1),
                                keep=kept.append, key=None, fit_calls=5000)
    _calls(fn, first_calls.FIRST_CALLS + 5)
    assert [name for name, _ in log] == ["graph"] * (first_calls.FIRST_CALLS + 5)
    assert [i for _, i in log] == list(range(first_calls.FIRST_CALLS + 5))  # every batch trained
    assert fn.decided and not then and len(kept) == 1
    assert kept[0].startswith("its 5000 calls take about") and "less than 60 s" in kept[0]


def test_a_fit_long_in_seconds_hands_over_to_the_measured_function(monkeypatch):
    monkeypatch.setattr(first_calls, "TRIAL_AFTER_S", 0.5)
    log, kept = [], []

    def measured(iterator):
        log.append(("measured", iterator))

    fn = first_calls.FirstCalls(_graph(0.002, log), then=lambda: measured, keep=kept.append,
                                key=None, fit_calls=1000)   # about 2 s at 2 ms a call
    _calls(fn, first_calls.FIRST_CALLS + 3)
    names = [name for name, _ in log]
    assert names == ["graph"] * first_calls.FIRST_CALLS + ["measured"] * 3
    assert [i for _, i in log] == list(range(first_calls.FIRST_CALLS + 3))
    assert not kept


def test_the_median_is_kept_on_disk_and_read_back(tmp_path, monkeypatch):
    """The first process measures a slow step (a long fit: measured); a later
    one, whose calls are fast, reads the kept median and decides alike."""
    monkeypatch.setenv(cache.ENV_VAR, str(tmp_path))
    monkeypatch.setattr(first_calls, "TRIAL_AFTER_S", 1.0)
    outcomes = []
    for seconds in (0.01, 0.0):   # 10 ms a call: 100 calls take 1 s
        log, kept = [], []
        fn = first_calls.FirstCalls(_graph(seconds, log), then=lambda: (lambda it: None),
                                    keep=kept.append, key="model-signature", fit_calls=120)
        _calls(fn, first_calls.FIRST_CALLS + 1)
        outcomes.append(not kept)
        cache._memo.clear()   # what a new process knows: the file alone
    assert outcomes == [True, True]
    assert (tmp_path / cache.FILE).exists()


def test_projected_says_why_or_none():
    assert first_calls.projected(0.5, 200) is None
    why = first_calls.projected(0.001, 2000)
    assert why is not None and "2.0 s" in why and "1.00 ms" in why
    with pytest.raises(ValueError, match="`fit_calls`"):
        first_calls.projected(0.1, True)
