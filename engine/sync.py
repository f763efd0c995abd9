"""The engine for blocking code: ``engine.sync.Engine``, the same methods as plain calls.

For scripts, notebooks and threaded bots. The engine runs on a trio loop in a thread of its
own; each call is handed to it with ``trio.from_thread.run`` and blocks the calling thread
(any thread: calls from many threads run concurrently on the engine's loop).

    from engine.sync import Engine

    with Engine.open("memory-store") as mem:
        mem.add_turn("maya", "s1", "user", "I'm moving to Lisbon", durable=True)
        for hit in mem.recall("maya", "where is she moving?"):
            print(hit.text)

Leaving the ``with`` block (normally, by an exception or by Ctrl-C) closes the engine and
drains what was acknowledged to disk before it returns; an engine still open when the
interpreter exits (a notebook, a script that never left the block) is closed then.
"""

from __future__ import annotations

import atexit
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from datetime import datetime
from typing import Any

import outcome
import trio

from actors.base.errors import EngineClosed

from . import _bridge
from ._engine import Engine as TrioEngine

__all__ = ["Engine", "Receipt"]


class Receipt(_bridge.BridgedReceipt):
    """What ``add_turn`` returns here: the turn's identity, and a blocking ``durable()``."""

    __slots__ = ()

    def durable(self) -> None:
        """Block until the turn is committed to disk (it then survives ``kill -9``).

        Raises:
            As the trio receipt's ``durable()``; once the engine has closed, whether the close
            got the turn to disk (it drains every acknowledged one) answers.
        """
        engine = self._engine
        if not engine._closed:
            try:
                engine._call(self._native.durable)
                return
            except EngineClosed:
                if not engine._closed:
                    raise
        engine._thread.join()  # a close under way: its drain is what this waits for
        # The trio run is over: the store's last state answers, in a trio run of its own.
        trio.run(self._native.durable)


class Engine(_bridge.Settings):
    """An open engine for blocking code. Get one with ``with engine.sync.Engine.open(path)``;
    every coroutine method of :class:`engine.Engine` is here as a blocking method with the
    same arguments."""

    def __init__(self) -> None:
        self._native: TrioEngine | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._closed = False
        self._thread: threading.Thread | None = None  # runs the engine's trio loop
        self._pid = _bridge.pid  # the process whose thread runs the engine
        self._result: list[outcome.Outcome] = []  # the trio run's outcome, once it ended

    @classmethod
    @contextmanager
    def open(cls, path: str | os.PathLike[str], **kwargs: Any) -> Iterator[Engine]:
        """Open the store at ``path`` for the ``with`` body; the arguments are
        :meth:`engine.Engine.open`'s.

        Raises:
            The errors of :meth:`engine.Engine.open`, in the calling thread.
        """
        facade = cls()
        ready = threading.Event()  # set once the engine is open, or its opening failed
        result = facade._result
        holder: dict[str, trio.Event] = {}

        async def trio_main() -> None:
            # Set by close: the blocking side is done with the engine.
            stop = holder["stop"] = trio.Event()
            async with TrioEngine.open(path, **kwargs) as native:
                facade._native = native
                facade._token = trio.lowlevel.current_trio_token()
                ready.set()
                await stop.wait()

        finished = threading.Event()  # set once the engine's thread is done with it

        def thread_main() -> None:
            try:
                result.append(outcome.capture(trio.run, trio_main))
            finally:
                ready.set()
                finished.set()

        def close() -> None:
            """Stop the engine (it drains what was acknowledged) and wait for its thread. The
            stop goes through the token's queue, which trio.from_thread would refuse a trio
            task: a blocking engine opened in one closes there too."""
            if _bridge.forked_error(facade._pid) is not None:
                return  # a forked child: the engine and its thread are the parent's
            facade._closed = True
            with suppress(trio.RunFinishedError):  # it stopped already (it broke): see result
                facade._token.run_sync_soon(holder["stop"].set)
            # A Ctrl-C meanwhile waits for the drain (bounded by what is queued) and goes on
            # after it: the interpreter would end the engine's daemon thread mid-drain, and
            # turns the caller was told are written with it. An Event, not Thread.join: a
            # join that KeyboardInterrupt cuts short marks the thread stopped while it runs
            # (CPython 3.11), and every later join returns at once.
            interrupted: KeyboardInterrupt | None = None
            while not finished.is_set():
                try:
                    finished.wait()
                except KeyboardInterrupt as exc:
                    interrupted = exc
            if interrupted is not None:
                raise interrupted

        thread = facade._thread = threading.Thread(target=thread_main, name="engram-trio",
                                                   daemon=True)
        thread.start()
        try:
            ready.wait()
        except BaseException:
            # Interrupted while opening (Ctrl-C during a slow model load): let the open
            # finish, then close what it opened, so no engine is left holding the store.
            ready.wait()
            if not result:
                close()
            raise
        if result:  # the open failed (or ended) before it was ready
            thread.join()
            result[0].unwrap()
            raise EngineClosed("the engine stopped before it was ready")
        # A script or a notebook that ends with the engine open: close it while the
        # interpreter still runs threads (at its finalisation the engine's daemon thread is
        # frozen, and the close below, run by garbage collection, would wait for it forever).
        atexit.register(close)
        try:
            yield facade
        finally:
            try:
                close()
            finally:
                if finished.is_set():  # else a Ctrl-C cut the close short: exit drains
                    atexit.unregister(close)
            if _bridge.forked_error(facade._pid) is None:
                result[0].unwrap()

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if (forked := _bridge.forked_error(self._pid)) is not None:
            raise forked
        if self._closed or self._token is None:
            raise EngineClosed("the engine is closed; open a new one with Engine.open(path)")
        try:
            return trio.from_thread.run(lambda: fn(*args, **kwargs), trio_token=self._token)
        except trio.RunFinishedError:
            # The trio run ended by itself (the engine broke): say why, not only that.
            error = _bridge.stopped_error(self._result[0] if self._result else None)
            raise error from error.__cause__

    def add_turn(self, user_id: str, session_id: str, role: str, text: str,
                 at: datetime | None = None, meta: dict[str, Any] | None = None,
                 durable: bool = False, *, agent_id: str | None = None,
                 run_id: str | None = None) -> Receipt:
        """:meth:`engine.Engine.add_turn`, blocking (``agent_id`` / ``run_id``: the session's
        scope, as there); the receipt's ``durable()`` blocks too."""
        return Receipt(self._call(self._native.add_turn, user_id, session_id, role, text, at,
                                  meta, durable, agent_id=agent_id, run_id=run_id), self)

    @staticmethod
    def restore(snapshot_dir: str | os.PathLike[str], store_path: str | os.PathLike[str],
                *, overwrite: bool = False) -> Any:
        """:meth:`engine.Engine.restore`, blocking (a closed store; no engine)."""
        return trio.run(lambda: TrioEngine.restore(snapshot_dir, store_path,
                                                   overwrite=overwrite))

    @staticmethod
    def compact(store_path: str | os.PathLike[str]) -> dict[str, Any]:
        """:meth:`engine.Engine.compact`, blocking (a closed store; no engine)."""
        return trio.run(TrioEngine.compact, store_path)

    @staticmethod
    def verify(store_path: str | os.PathLike[str], *, integrity_key: str | None = None,
               seal: bool = False) -> dict[str, Any]:
        """:meth:`engine.Engine.verify`, blocking (beside an engine of another process too)."""
        return trio.run(lambda: TrioEngine.verify(store_path, integrity_key=integrity_key,
                                                  seal=seal))


def _make(name: str, native: Callable[..., Any]) -> Callable[..., Any]:
    def method(self: Engine, *args: Any, **kwargs: Any) -> Any:
        if self._native is None:
            raise EngineClosed("the engine is not open; use `with Engine.open(path)`")
        return self._call(getattr(self._native, name), *args, **kwargs)

    return method


_bridge.mirror(Engine, _make)
