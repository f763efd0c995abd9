"""RepeatedWarning: an outage is a few lines a minute, each saying how many it stands for."""

from __future__ import annotations

import logging

from actors.base.logs import RepeatedWarning


def test_a_repeated_warning_logs_the_first_then_a_count_each_interval(caplog) -> None:
    now = [0.0]
    warn = RepeatedWarning(logging.getLogger("engram.test"), every=60.0, clock=lambda: now[0])
    caplog.set_level("WARNING", logger="engram.test")
    for second in range(0, 150):  # two per second for 150 s
        now[0] = float(second)
        warn("model down: %s", "HTTP 401")
        warn("model down: %s", "HTTP 401")
    assert [r.getMessage() for r in caplog.records] == [
        "model down: HTTP 401",
        "model down: HTTP 401 (and 119 more like it in the last 60 s)",
        "model down: HTTP 401 (and 119 more like it in the last 60 s)",
    ]


def test_the_count_after_a_quiet_spell_names_the_span_it_covers(caplog) -> None:
    """Occurrences left out and then a quiet hour: the next line counts them over the hour
    since the last line, not over the last 60 s, when none came."""
    now = [0.0]
    warn = RepeatedWarning(logging.getLogger("engram.test"), every=60.0, clock=lambda: now[0])
    caplog.set_level("WARNING", logger="engram.test")
    for second in (0.0, 1.0, 2.0, 3600.0):
        now[0] = second
        warn("model down")
    assert [r.getMessage() for r in caplog.records] == [
        "model down", "model down (and 2 more like it in the last 3600 s)"]
