"""When the float32 probe runs: one call in ``probe_every`` at first, less
often while every probe confirms the dtypes, again as often after any change.

The probe (:mod:`keras_mp.adaptive.evidence.probe`) is the costly part of
adaptation: three forward and backward passes, two of them in float32. On
the bench's CNN (6 convolutions, 64x64, batch 32, 2-core Intel Xeon with
AMX-BF16) one probe took 441 ms of CPU time against a 76 ms step, +2.2 ms a
step at one call in 200, the most of what kept keras-mp at 0.93x Keras
``mixed_bfloat16`` (docs/benchmarks.md). Once a run's dtypes have settled a
probe mostly confirms them, so the schedule backs off as a dynamic loss
scale grows, and starts over at any change:

    gap = probe_every; next = probe_every
    at a probe on call c:    last = c; next = c + gap
    at a decision that read a probe:
        if it confirmed (no switch, no layer on trial, no step skipped):
            gap = min(2 * gap, probe_every * backoff)
        else:
            gap = probe_every
        next = last + gap
    at any decision that switched a layer: gap = probe_every;
        next = min(next, call + gap)

Range trouble (overflow, underflow, non-finite values) is the statistics
steps' to find, every ``statistics_every`` calls whatever the probe's gap; a
layer on trial for a narrower dtype keeps the probe at ``probe_every`` until
it is judged. The schedule is a function of the decisions alone (no timing),
so a seeded run probes on the same calls every time, and a resumed run on
the calls the uninterrupted one did (the record of
:class:`keras_mp.adaptive.record.state.PrecisionState` carries it).

Example:
    >>> s = ProbeSchedule.start(probe_every=200, backoff=8)
    >>> s.due(199), s.due(200)
    (False, True)
    >>> s = s.probed(200).decided(200, probed=True, confirmed=True)
    >>> s.gap, s.next
    (400, 600)
    >>> s = s.probed(600).decided(600, probed=True, confirmed=False)
    >>> s.gap, s.next
    (200, 800)
"""

from __future__ import annotations

import dataclasses

__all__ = ["DEFAULT_BACKOFF", "ProbeSchedule", "probe_calls"]

#: The longest gap between probes, as a multiple of ``probe_every``: 1600
#: calls at the default ``probe_every`` of 200 (the probe's share of a step
#: an eighth of what it was).
DEFAULT_BACKOFF = 8


def _count(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"`{name}` must be an int >= {low}, got {value!r}.")
    return value


@dataclasses.dataclass(frozen=True)
class ProbeSchedule:
    """Where the probe runs next (immutable: each event returns a new one).

    Attributes:
        base: ``probe_every``, the shortest gap.
        backoff: the longest gap as a multiple of ``base`` (1: never longer).
        gap: the gap now.
        next: the call the next probe runs on.
        last: the call the last probe ran on (0: none yet).
    """

    base: int
    backoff: int
    gap: int
    next: int
    last: int = 0

    def __post_init__(self):
        _count("probe_every", self.base, 1)
        _count("backoff", self.backoff, 1)
        _count("gap", self.gap, 1)
        _count("next", self.next, 1)
        _count("last", self.last, 0)

    @classmethod
    def start(cls, probe_every: int, backoff: int = DEFAULT_BACKOFF,
              calls: int = 0) -> ProbeSchedule:
        """A schedule at ``probe_every``, its first probe on the first multiple
        of it after ``calls`` (where the periodic probe of a run that has made
        ``calls`` calls would come)."""
        _count("probe_every", probe_every, 1)
        _count("calls", calls, 0)
        return cls(probe_every, backoff, probe_every, (calls // probe_every + 1) * probe_every)

    def due(self, call: int) -> bool:
        """Whether ``call`` (counted from 1) runs the probe."""
        return call >= self.next

    def probed(self, call: int) -> ProbeSchedule:
        """After the probe ran on ``call``."""
        return dataclasses.replace(self, last=call, next=call + self.gap)

    def decided(self, call: int, *, probed: bool, confirmed: bool) -> ProbeSchedule:
        """After the decision on ``call``: ``probed``, whether its interval
        held a probe; ``confirmed``, whether the decision left every dtype as
        it was, with no layer on trial and no step skipped."""
        if not confirmed:
            gap = self.base
            nxt = self.last + gap if probed else min(self.next, call + gap)
            return dataclasses.replace(self, gap=gap, next=max(nxt, call + 1))
        if not probed:
            return self
        gap = min(2 * self.gap, self.base * self.backoff)
        return dataclasses.replace(self, gap=gap, next=max(self.last + gap, call + 1))

    def get_config(self) -> list[int]:
        """``[gap, next, last]``, as a run's record carries it."""
        return [self.gap, self.next, self.last]

    def restored(self, config) -> ProbeSchedule:
        """This schedule with a record's ``[gap, next, last]``; unchanged if
        the record has none or one this schedule's ``base`` and ``backoff``
        cannot hold (the callback's settings changed since it was saved)."""
        if not (isinstance(config, list) and len(config) == 3
                and all(isinstance(v, int) and not isinstance(v, bool) for v in config)):
            return self
        gap, nxt, last = config
        if gap % self.base or not self.base <= gap <= self.base * self.backoff \
                or nxt < 1 or last < 0:
            return self
        return dataclasses.replace(self, gap=gap, next=nxt, last=last)


def probe_calls(total: int, probe_every: int, backoff: int = DEFAULT_BACKOFF) -> int:
    """How many of a fit's first ``total`` calls probe when every probe
    confirms (a decision at each probe).

    Example:
        >>> probe_calls(1000, 200, 1), probe_calls(1000, 200, 8), probe_calls(10**6, 200, 8)
        (5, 2, 627)
    """
    _count("total", total, 0)
    schedule, count = ProbeSchedule.start(probe_every, backoff), 0
    while schedule.next <= total:
        call = schedule.next
        schedule = schedule.probed(call).decided(call, probed=True, confirmed=True)
        count += 1
    return count
