"""What the asyncio and blocking facades share: which Engine methods they mirror, and how."""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from actors.base.config import Config
import outcome

from actors.base.errors import EngineBroken, EngineClosed, EngineError

from ._engine import Engine as TrioEngine

# The native methods the facades mirror: every public coroutine method of the trio Engine,
# listed from the class itself so a method added there is mirrored without edits here.
MIRRORED = tuple(
    name for name, member in vars(TrioEngine).items()
    if not name.startswith("_") and inspect.iscoroutinefunction(member)
)


def mirror(cls: type, make: Callable[[str, Callable[..., Any]], Callable[..., Any]]) -> type:
    """Give ``cls`` one method per :data:`MIRRORED` name, built by ``make(name, native)`` and
    carrying the native method's signature and docstring (for help() and IDEs)."""
    for name in MIRRORED:
        if name in vars(cls):
            continue  # the facade defines it itself (add_turn: its receipt is bridged)
        native = getattr(TrioEngine, name)
        method = functools.wraps(native)(make(name, native))
        setattr(cls, name, method)
    return cls


# This process's id, kept current in a forked child, so that the facades' calls compare it
# without a system call each (add_turn_nowait costs about a microsecond).
pid = os.getpid()


def _forked() -> None:
    global pid
    pid = os.getpid()


os.register_at_fork(after_in_child=_forked)


def forked_error(opened_in: int) -> EngineClosed | None:
    """The error for a call made in a child forked from the process that opened the engine
    (a pre-forking server, a multiprocessing pool), or None in that process itself: the
    engine's trio loop did not come along into the child, so a call handed to it would wait
    for ever."""
    if pid == opened_in:
        return None
    return EngineClosed(f"the engine was opened in process {opened_in}, and this process "
                        f"({pid}) was forked from it, where its trio loop does not run; "
                        "open an engine in the process that uses it (one engine owns a store "
                        "at a time: the other process's must be closed first)")


def stopped_error(result: outcome.Outcome | None) -> EngineError:
    """What a facade's call gets once the engine's trio run ended without being closed:
    EngineBroken with the failure as its cause if the engine failed, else EngineClosed."""
    if isinstance(result, outcome.Error):
        error = EngineBroken("the engine failed and stopped (the cause says why); open it "
                             "again with Engine.open(path)")
        error.__cause__ = result.error
        return error
    return EngineClosed("the engine stopped; open a new one with Engine.open(path)")


class Settings:
    """The open trio engine's plain attributes, read on the caller's thread: they never
    change while it is open."""

    _native: TrioEngine | None

    def _opened(self) -> TrioEngine:
        if self._native is None:
            raise EngineClosed("the engine is not open; open it with Engine.open(path)")
        return self._native

    @property
    def path(self) -> Path:
        """:attr:`engine.Engine.path`: the store directory (for ``verify`` beside it)."""
        return self._opened().path

    @property
    def config(self) -> Config:
        """:attr:`engine.Engine.config`: the settings the engine was opened with."""
        return self._opened().config


class BridgedReceipt:
    """A facade's receipt: the native receipt's identity, and its ``durable()`` called through
    the facade (awaited on asyncio, blocking in engine.sync; the subclass says which).

    Attributes:
        turn_id / seq / lsn: as the native :class:`engine.Receipt`'s.
    """

    __slots__ = ("turn_id", "seq", "lsn", "_native", "_engine")

    def __init__(self, native: Any, engine: Any) -> None:
        self.turn_id = native.turn_id
        self.seq = native.seq
        self.lsn = native.lsn
        self._native = native
        self._engine = engine

    def __repr__(self) -> str:
        return f"Receipt(turn_id={self.turn_id!r}, seq={self.seq}, lsn={self.lsn})"
