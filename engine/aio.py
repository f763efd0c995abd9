"""The engine on asyncio: ``engine.aio.Engine``, the same methods as awaitables.

The engine's trio loop runs in trio's *guest mode* on the running asyncio loop: one thread,
no second event loop in another thread, and the engine's tasks interleave with yours.

    import asyncio
    from engine.aio import Engine

    async def main():
        async with Engine.open("memory-store") as mem:
            receipt = mem.add_turn_nowait("maya", "s1", "user", "I'm moving to Lisbon")
            await receipt.durable()
            hits = await mem.recall("maya", "where is she moving?")

    asyncio.run(main())

Each awaited call hands the native coroutine to the trio loop and waits on an asyncio future;
cancelling the awaiting task cancels the trio call. ``add_turn_nowait`` is synchronous: it runs
the engine's hot path directly (trio and asyncio share the thread, and trio is between steps
whenever asyncio code runs; trio's guest mode wakes itself when that makes a task runnable),
so it costs about what the native call costs. Works with any asyncio loop that has ``call_soon_threadsafe`` (uvloop too).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any

import outcome
import trio

from . import _bridge
from ._engine import Engine as TrioEngine
from actors.base.errors import EngineClosed

__all__ = ["Engine", "Receipt"]


class Receipt(_bridge.BridgedReceipt):
    """What ``add_turn`` / ``add_turn_nowait`` return on asyncio: the turn's identity, and
    ``await receipt.durable()`` to wait for the disk."""

    __slots__ = ()

    async def durable(self) -> None:
        """Return once the turn is committed to disk (it then survives ``kill -9``)."""
        await self._engine._call(self._native.durable)


class Engine:
    """An open engine on asyncio. Get one with ``async with engine.aio.Engine.open(path)``;
    every coroutine method of :class:`engine.Engine` is here with the same arguments."""

    def __init__(self) -> None:
        self._native: TrioEngine | None = None
        self._nursery: trio.Nursery | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    @classmethod
    @asynccontextmanager
    async def open(cls, path: str | os.PathLike[str], **kwargs: Any) -> AsyncIterator[Engine]:
        """Open the store at ``path`` for the ``async with`` body; the arguments are
        :meth:`engine.Engine.open`'s.

        Raises:
            The errors of :meth:`engine.Engine.open`, on the asyncio side.
        """
        loop = asyncio.get_running_loop()
        facade = cls()
        facade._loop = loop
        ready: asyncio.Future[None] = loop.create_future()
        done: asyncio.Future[outcome.Outcome] = loop.create_future()
        holder: dict[str, trio.Event] = {}

        async def trio_main() -> None:
            # Set by close: the asyncio side is done with the engine.
            stop = holder["stop"] = trio.Event()
            async with TrioEngine.open(path, **kwargs) as native:
                async with trio.open_nursery() as nursery:
                    facade._native, facade._nursery = native, nursery
                    facade._token = trio.lowlevel.current_trio_token()
                    ready.set_result(None)
                    await stop.wait()
                    nursery.cancel_scope.cancel()  # calls still running end as EngineClosed

        trio.lowlevel.start_guest_run(
            trio_main,
            run_sync_soon_threadsafe=loop.call_soon_threadsafe,
            run_sync_soon_not_threadsafe=loop.call_soon,
            done_callback=done.set_result,
            host_uses_signal_set_wakeup_fd=True,
        )
        try:
            await asyncio.wait({ready, done}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            # Cancelled while opening: let the open finish, then close what it opened, so no
            # trio run is left behind on the loop.
            await asyncio.wait({ready, done}, return_when=asyncio.FIRST_COMPLETED)
            if ready.done():
                facade._closed = True
                facade._token.run_sync_soon(holder["stop"].set)
                await asyncio.shield(done)
            raise
        if not ready.done():
            done.result().unwrap()  # the open failed: raise its error here
            raise EngineClosed("the engine stopped before it was ready")
        try:
            yield facade
        finally:
            facade._closed = True
            facade._token.run_sync_soon(holder["stop"].set)
            result = await asyncio.shield(done)
            result.unwrap()

    # -- calls -------------------------------------------------------------------------------

    async def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``await fn(*args, **kwargs)`` as a task on the trio loop; await its result."""
        if self._closed:
            raise EngineClosed("the engine is closed; open a new one with Engine.open(path)")
        future = self._loop.create_future()
        scope = trio.CancelScope()

        async def run() -> None:
            with scope:
                try:
                    result = await fn(*args, **kwargs)
                except trio.Cancelled:
                    if not future.done():
                        future.set_exception(EngineClosed(
                            "the engine closed while this call ran"))
                    raise
                except BaseException as exc:
                    if not future.done():
                        future.set_exception(exc)
                    return
                if not future.done():
                    future.set_result(result)
            if not future.done():  # cancelled from the asyncio side before it finished
                future.cancel()

        def start() -> None:
            try:
                self._nursery.start_soon(run)
            except RuntimeError:  # the nursery closed meanwhile
                future.set_exception(EngineClosed("the engine is closed"))

        # Called directly, not through the TrioToken: guest mode runs trio on this thread and
        # trio is between ticks whenever asyncio code runs, so the spawn only has to wake it
        # (Runner.reschedule does). The token's queue would cost a trio tick more, an asyncio
        # loop turn, before the call even starts.
        start()
        try:
            return await future
        except asyncio.CancelledError:
            scope.cancel()
            raise

    async def add_turn(self, user_id: str, session_id: str, role: str, text: str,
                       at: datetime | None = None, meta: dict[str, Any] | None = None,
                       durable: bool = False) -> Receipt:
        """:meth:`engine.Engine.add_turn` on asyncio; the receipt's ``durable()`` is
        awaitable here."""
        return Receipt(await self._call(self._native.add_turn, user_id, session_id, role, text,
                                        at, meta, durable), self)

    def add_turn_nowait(self, user_id: str, session_id: str, role: str, text: str,
                        at: datetime | None = None, meta: dict[str, Any] | None = None
                        ) -> Receipt:
        """Add a turn without awaiting: it is in the session's window when this returns.

        Call it from the asyncio loop's thread (any coroutine or callback of that loop).

        Raises:
            trio.WouldBlock: the store's queue is full; ``await add_turn(...)`` waits instead.
            InvalidInput / EngineClosed: as :meth:`engine.Engine.add_turn`.
        """
        if self._closed:
            raise EngineClosed("the engine is closed; open a new one with Engine.open(path)")
        # No wake-up call needed: if this reschedules the store's writer while trio waits for
        # I/O, trio's guest mode forces a tick itself (Runner.reschedule), and if the writer
        # is busy committing it takes the turn with its next batch.
        return Receipt(self._native.add_turn_nowait(user_id, session_id, role, text, at, meta),
                       self)

    @staticmethod
    async def restore(snapshot_dir: str | os.PathLike[str], store_path: str | os.PathLike[str],
                      *, overwrite: bool = False) -> Any:
        """:meth:`engine.Engine.restore` in a worker thread (a closed store; no engine)."""
        return await asyncio.to_thread(
            trio.run, lambda: TrioEngine.restore(snapshot_dir, store_path, overwrite=overwrite))

    @staticmethod
    async def compact(store_path: str | os.PathLike[str]) -> dict[str, Any]:
        """:meth:`engine.Engine.compact` in a worker thread (a closed store; no engine)."""
        return await asyncio.to_thread(trio.run, TrioEngine.compact, store_path)


def _make(name: str, native: Callable[..., Any]) -> Callable[..., Any]:
    async def method(self: Engine, *args: Any, **kwargs: Any) -> Any:
        if self._native is None:
            raise EngineClosed("the engine is not open; use `async with Engine.open(path)`")
        return await self._call(getattr(self._native, name), *args, **kwargs)

    return method


_bridge.mirror(Engine, _make)
