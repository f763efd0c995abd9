"""A warning that repeats while its cause lasts (a model provider down, an API key revoked):
logged the first time, then at most once every ``every`` seconds with how many were left out,
so an outage is a few lines a minute, not one per turn. Each occurrence stays countable where
it is kept (a failure record), never only in the log."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

__all__ = ["RepeatedWarning"]

EVERY = 60.0  # seconds between two lines of the same warning


class RepeatedWarning:
    """One call site's warning, rate-limited."""

    def __init__(self, logger: logging.Logger, every: float = EVERY,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log = logger
        self._every = every
        self._clock = clock
        self._next = -float("inf")  # when a line may be logged again
        self._last = -float("inf")  # when the last line was logged
        self._left_out = 0  # occurrences since the last line

    def __call__(self, message: str, *args: object) -> None:
        now = self._clock()
        if now < self._next:
            self._left_out += 1
            return
        if self._left_out:
            # Counted since the last line, which may be long before ``every`` ago (the
            # cause stopped, then came back): the span is that line's age.
            message += " (and %d more like it in the last %.0f s)"
            args = (*args, self._left_out, now - self._last)
        self._log.warning(message, *args)
        self._last = now
        self._next = now + self._every
        self._left_out = 0
