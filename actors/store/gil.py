"""The interpreter's thread switch interval, lowered while a caller waits for a commit to land.

A durable receipt's way crosses threads: the trio thread hands the batch to the writer's
thread, LMDB's commit and the flush release the GIL for their fdatasync, and the landing goes
back to the trio thread. Each time, the thread that comes back wants the GIL while another
thread (a follower's step on the trio thread, a read, the embedder's Python) may hold it, and
CPython hands it over only when the holder blocks or when the waiter has waited a whole
switch interval (``sys.getswitchinterval()``, 5 ms by default). Measured on this project's
2-core machine (a thread running Python beside one that commits to LMDB with fsync, 300
commits, load average 16): the commit's p50 was 0.5 ms alone and 5.9 ms beside it at 5 ms;
2.6 ms at 1 ms, 1.1 ms at 0.5 ms, 0.68 ms at 0.25 ms. So while a caller waits, the interval
is at most the engine's ``receipt_switch_us``; once nobody waits, it is what it was (a value
the application set meanwhile is overwritten then).

The interval belongs to the process, which may hold several engines (and their trio loops on
threads of their own): one count for all of them, under a lock, and the value found before
the first lowered it comes back when the last lets go.
"""

from __future__ import annotations

import sys
import threading

_lock = threading.Lock()  # guards the count and the saved interval (engines on other threads)
_holders = 0  # stores that have a caller waiting now
_saved = 0.0  # the interval found when the first of them lowered it


def lower(seconds: float) -> None:
    """Hold the switch interval at most ``seconds`` until the matching :func:`release`."""
    global _holders, _saved
    with _lock:
        if _holders == 0:
            _saved = sys.getswitchinterval()
        _holders += 1
        if sys.getswitchinterval() > seconds:
            sys.setswitchinterval(seconds)


def release() -> None:
    """Let go of one :func:`lower`; the last one puts back the interval found before."""
    global _holders
    with _lock:
        if _holders == 0:
            raise AssertionError("switch interval released more often than lowered")
        _holders -= 1
        if _holders == 0:
            sys.setswitchinterval(_saved)
