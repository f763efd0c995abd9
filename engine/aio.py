"""The engine on asyncio: ``engine.aio.Engine``, the same methods as awaitables.

By default the engine's trio loop runs in trio's *guest mode* on the running asyncio loop: one
thread, no second event loop in another thread, and the engine's tasks interleave with yours.
Where guest mode cannot be used (a trio run already lives in this thread: a second engine on the
same loop, or asyncio itself hosted by trio), the engine runs trio on a thread of its own, as
``engine.sync`` does, and bridges each call to an asyncio future: ``Engine.open(path,
trio_loop="thread")`` asks for that explicitly.

    import asyncio
    from engine.aio import Engine

    async def main():
        async with Engine.open("memory-store") as mem:
            receipt = mem.add_turn_nowait("maya", "s1", "user", "I'm moving to Lisbon")
            await receipt.durable()
            hits = await mem.recall("maya", "where is she moving?")

    asyncio.run(main())

Each awaited call hands the native coroutine to the trio loop and waits on an asyncio future;
cancelling the awaiting task cancels the trio call. ``add_turn_nowait`` is synchronous. In guest
mode it runs the engine's hot path directly (trio and asyncio share the thread, and trio is
between steps whenever asyncio code runs; trio's guest mode wakes itself when that makes a task
runnable), so it costs about what the native call costs. On a trio thread of its own it is one
blocking round trip to that thread (tens of µs): the session window belongs to the engine's
loop. Guest mode works with any asyncio loop that has ``call_soon_threadsafe`` (uvloop too).
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager, suppress
from datetime import datetime
from functools import partial
from typing import Any, Literal

import outcome
import trio

from actors.base.errors import EngineClosed, InvalidInput

from . import _bridge
from ._engine import Engine as TrioEngine

__all__ = ["Engine", "Receipt", "TrioLoop"]

# Where the engine's trio loop runs: "guest" (trio's guest mode on this asyncio loop, one
# thread), "thread" (trio.run on a thread of its own), "auto" (guest unless a trio run already
# lives in this thread, which guest mode cannot join).
TrioLoop = Literal["auto", "guest", "thread"]
TRIO_LOOPS = ("auto", "guest", "thread")
# How long a close lets the calls already running finish before it cuts them off (they then end
# as EngineClosed): a durable write cut off may be on disk all the same, and a caller told it
# failed would write it twice.
CLOSE_GRACE_SECONDS = 10.0


class Receipt(_bridge.BridgedReceipt):
    """What ``add_turn`` / ``add_turn_nowait`` return on asyncio: the turn's identity, and
    ``await receipt.durable()`` to wait for the disk."""

    __slots__ = ()

    async def durable(self) -> None:
        """Return once the turn is committed to disk (it then survives ``kill -9``).

        Raises:
            As the trio receipt's ``durable()``; once the engine has closed, whether the close
            got the turn to disk (it drains every acknowledged one) answers.
        """
        engine = self._engine
        if not engine._closed:
            try:
                await engine._call(self._native.durable)
                return
            except EngineClosed:
                if not engine._closed:
                    raise
        await engine._closed_down()
        # The trio run is over: the store's last state answers, in a trio run of its own.
        await asyncio.to_thread(trio.run, self._native.durable)


def _closed_error() -> EngineClosed:
    return EngineClosed("the engine is closed; open a new one with Engine.open(path)")


async def _outlast(future: asyncio.Future[Any]) -> Any:
    """Await ``future`` through any cancellation of the awaiting task, then raise the
    cancellation (if one came) once it is done.

    What a close waits for: cut short, the trio run would be left draining on a loop about to
    stop (asyncio.run cancels the tasks that main left behind, a close among them), and the
    turns it had acknowledged would never reach the disk. The wait is bounded: a close lets
    calls run for CLOSE_GRACE_SECONDS, and the engine's drain is bounded itself.
    """
    cancelled: asyncio.CancelledError | None = None
    while not future.done():
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError as exc:
            cancelled = cancelled or exc
    if cancelled is not None:
        raise cancelled
    return future.result()


class _CtrlC:
    """The main thread's SIGINT handler while an engine is open, around the one
    it found (asyncio.run's, or Python's). asyncio's second Ctrl-C raises KeyboardInterrupt
    wherever the main thread is: inside one of trio's guest ticks that wrecked the trio run
    (a hang for ever, or TrioInternalError) and lost the drain. So the handler it found runs
    as before (asyncio's first Ctrl-C cancels the main task), but a KeyboardInterrupt it
    raises is raised by the asyncio loop's next callback instead, outside any tick; and
    while a close waits (:meth:`noting`), a Ctrl-C is only noted, for the close to raise
    once the drain is done. Off the main thread, or where Python's handler cannot be set
    (another language's host), nothing changes."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.noted: list[int] = []
        self._noting = False
        self._found: Any = None
        self._gone: Any = None  # the handler found, once restored (or left under another's)
        if threading.current_thread() is threading.main_thread():
            with suppress(ValueError, TypeError):
                found = signal.getsignal(signal.SIGINT)
                if callable(found):
                    signal.signal(signal.SIGINT, self._received)
                    self._found = found

    def _received(self, signum: int, frame: Any) -> None:
        if self._noting:
            self.noted.append(signum)
            return
        if self._gone is not None:  # closed, but another engine's handler came after it
            self._gone(signum, frame)
            return
        try:
            self._found(signum, frame)
        except KeyboardInterrupt:
            with suppress(RuntimeError):  # the loop closed: nothing runs to be interrupted
                self.loop.call_soon_threadsafe(_interrupt)

    @contextmanager
    def noting(self) -> Iterator[list[int]]:
        """Within the block, a Ctrl-C is noted in the yielded list, not raised."""
        self._noting = True
        try:
            yield self.noted
        finally:
            self._noting = False

    def restore(self) -> None:
        """Give back the handler it found (if its own is still the one in place)."""
        if self._found is not None:
            with suppress(ValueError, TypeError):
                if signal.getsignal(signal.SIGINT) == self._received:
                    signal.signal(signal.SIGINT, self._found)
            self._gone, self._found = self._found, None


def _interrupt() -> None:
    raise KeyboardInterrupt


def _cancelled(exc: BaseException) -> bool:
    """Whether ``exc`` is trio's cancellation alone: ``Cancelled``, or a group of nothing else
    (the engine's own nurseries wrap it so)."""
    if isinstance(exc, BaseExceptionGroup):
        return exc.split(trio.Cancelled)[1] is None
    return isinstance(exc, trio.Cancelled)


class Engine(_bridge.Settings):
    """An open engine on asyncio. Get one with ``async with engine.aio.Engine.open(path)``;
    every coroutine method of :class:`engine.Engine` is here with the same arguments.

    Attributes:
        trio_loop: where the engine's trio loop runs: ``"guest"`` or ``"thread"``.
    """

    def __init__(self, trio_loop: str) -> None:
        self.trio_loop = trio_loop
        self._guest = trio_loop == "guest"
        self._native: TrioEngine | None = None
        self._nursery: trio.Nursery | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        # Set to the trio run's outcome once it ends (the engine closed, or broke).
        self._done: asyncio.Future[outcome.Outcome] | None = None
        self._pid = _bridge.pid  # the process where the engine's trio loop runs

    @classmethod
    @asynccontextmanager
    async def open(cls, path: str | os.PathLike[str], *, trio_loop: TrioLoop = "auto",
                   **kwargs: Any) -> AsyncIterator[Engine]:
        """Open the store at ``path`` for the ``async with`` body.

        Args:
            path / kwargs: as :meth:`engine.Engine.open` takes them.
            trio_loop: ``"guest"`` runs the engine's trio loop in guest mode on this asyncio
                loop; ``"thread"`` on a thread of its own; ``"auto"`` (default) picks guest
                mode unless a trio run already lives in this thread (another guest-mode engine
                on this loop, or asyncio hosted by trio), where guest mode cannot be used.

        Raises:
            InvalidInput: ``trio_loop`` is not one of the three, or ``"guest"`` where a trio
                run already lives in this thread.
            The errors of :meth:`engine.Engine.open`, on the asyncio side.
        """
        if trio_loop not in TRIO_LOOPS:
            raise InvalidInput("trio_loop", f"expected one of {', '.join(map(repr, TRIO_LOOPS))}"
                                            f", found {trio_loop!r}")
        taken = trio.lowlevel.in_trio_run()
        if trio_loop == "guest" and taken:
            raise InvalidInput("trio_loop", "expected 'thread' or 'auto' where a trio run already "
                                            "lives in this thread (another engine in guest mode "
                                            "on this loop?), found 'guest'")
        mode = "thread" if trio_loop == "thread" or (trio_loop == "auto" and taken) else "guest"
        loop = asyncio.get_running_loop()
        facade = cls(mode)
        facade._loop = loop
        ready: asyncio.Future[None] = loop.create_future()
        done: asyncio.Future[outcome.Outcome] = loop.create_future()
        facade._done = done
        holder: dict[str, trio.Event] = {}
        # How the trio side runs a callback on the asyncio loop: directly in guest mode (same
        # thread, and trio is inside the asyncio loop's callback), else through its queue.
        to_asyncio = (lambda fn, *args: fn(*args)) if facade._guest else loop.call_soon_threadsafe

        async def trio_main() -> None:
            # Set by close: the asyncio side is done with the engine.
            stop = holder["stop"] = trio.Event()
            async with TrioEngine.open(path, **kwargs) as native:
                async with trio.open_nursery() as nursery:
                    facade._native, facade._nursery = native, nursery
                    facade._token = trio.lowlevel.current_trio_token()
                    to_asyncio(ready.set_result, None)
                    await stop.wait()
                    # No call starts after this (the facade is closed); those running finish,
                    # for up to the grace, and then end as EngineClosed.
                    nursery.cancel_scope.deadline = trio.current_time() + CLOSE_GRACE_SECONDS

        thread = None
        ctrl_c = _CtrlC(loop)
        if facade._guest:
            trio.lowlevel.start_guest_run(
                trio_main,
                run_sync_soon_threadsafe=loop.call_soon_threadsafe,
                run_sync_soon_not_threadsafe=loop.call_soon,
                done_callback=done.set_result,
                host_uses_signal_set_wakeup_fd=True,
            )
        else:
            def thread_main() -> None:
                result = outcome.capture(trio.run, trio_main)
                with suppress(RuntimeError):  # the asyncio loop closed: nobody waits for it
                    loop.call_soon_threadsafe(done.set_result, result)

            thread = threading.Thread(target=thread_main, name="engram-trio-aio", daemon=True)
            thread.start()
        try:
            await asyncio.wait({ready, done}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            # Cancelled while opening: let the open finish, then close what it opened, so no
            # trio run is left behind on the loop or its thread (through any cancellation
            # more: this one is raised below).
            while not (ready.done() or done.done()):
                with suppress(asyncio.CancelledError):
                    await asyncio.wait({ready, done}, return_when=asyncio.FIRST_COMPLETED)
            if ready.done():
                facade._closed = True
                with suppress(trio.RunFinishedError):  # it stopped already, as in close()
                    facade._token.run_sync_soon(holder["stop"].set)
                with suppress(asyncio.CancelledError):
                    await _outlast(done)
            ctrl_c.restore()
            raise
        if not ready.done():
            ctrl_c.restore()
            done.result().unwrap()  # the open failed: raise its error here
            raise EngineClosed("the engine stopped before it was ready")

        async def close() -> None:
            """Refuse new calls, stop the trio run (it drains) and wait for it to end; a
            Ctrl-C meanwhile is raised once it has."""
            facade._closed = True
            with ctrl_c.noting() as noted:
                with suppress(trio.RunFinishedError):  # it stopped already (it broke)
                    facade._token.run_sync_soon(holder["stop"].set)
                cancelled = None
                try:
                    await _outlast(done)
                except asyncio.CancelledError as exc:
                    # Cancelled while closing: the close finished all the same, and its
                    # failure, if any, goes first, as it would have without the cancellation.
                    cancelled = exc
            ctrl_c.restore()
            if thread is not None:
                thread.join()  # done is its last act: this returns at once
            done.result().unwrap()
            if noted:
                raise KeyboardInterrupt
            if cancelled is not None:
                raise cancelled

        try:
            yield facade
        finally:
            # In a forked child the engine and its trio loop are the parent's to close.
            if _bridge.forked_error(facade._pid) is None:
                await close()

    # -- calls -------------------------------------------------------------------------------

    def _reachable(self) -> asyncio.AbstractEventLoop:
        """The engine's asyncio loop, once calls can reach the engine through it."""
        if (forked := _bridge.forked_error(self._pid)) is not None:
            raise forked
        if self._closed:
            raise _closed_error()
        if self._done.done() and not self._done.cancelled():
            # The trio run ended by itself (the engine broke): nothing is there to call.
            raise _bridge.stopped_error(self._done.result())
        if self._loop.is_closed():  # closed with the engine open: its trio run went with it
            raise EngineClosed("the engine cannot be reached: the asyncio loop it was opened "
                               "on is closed; open the engine in the loop that uses it, with "
                               "`async with Engine.open(path)`")
        return self._loop

    async def _closed_down(self) -> None:
        """Return once a close under way has ended (a receipt waits for its drain)."""
        if self._done.done():
            return
        if (forked := _bridge.forked_error(self._pid)) is not None:
            raise forked
        if self._loop.is_closed():  # the trio run went with it: nothing will end it
            raise EngineClosed("the engine cannot be reached: the asyncio loop it was opened "
                               "on is closed")
        self._check_running_loop()
        await asyncio.shield(self._done)

    def _check_running_loop(self) -> None:
        """Refuse a caller on another loop or thread: its trio run is not there to reach."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not self._loop:
            raise RuntimeError("this engine serves the asyncio loop it was opened on, and it "
                               "was called from another loop or thread; open one engine per "
                               "loop, or use engine.sync.Engine from threads")

    async def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``await fn(*args, **kwargs)`` as a task on the trio loop; await its result."""
        loop = self._reachable()
        self._check_running_loop()
        future = loop.create_future()
        scope = trio.CancelScope()

        def settle(result: outcome.Outcome | None) -> None:
            """On the asyncio loop: the call's outcome into its future (None: cancelled)."""
            if future.done():  # the awaiting task was cancelled meanwhile
                return
            if result is None:
                future.cancel()
            elif isinstance(result, outcome.Error):
                future.set_exception(result.error)
            else:
                future.set_result(result.value)

        def hand(result: outcome.Outcome | None) -> None:
            """On the trio loop: pass the outcome to the asyncio side."""
            if self._guest:
                settle(result)
            else:
                with suppress(RuntimeError):  # the asyncio loop closed: nobody waits
                    loop.call_soon_threadsafe(settle, result)

        async def run() -> None:
            with scope:
                try:
                    result = await fn(*args, **kwargs)
                except BaseException as exc:
                    if not _cancelled(exc):
                        hand(outcome.Error(exc))
                        return
                    # The engine closes under the call (if its caller left instead, the
                    # future is settled already and this is dropped).
                    hand(outcome.Error(EngineClosed("the engine closed while this call ran")))
                    raise
                hand(outcome.Value(result))
                return
            hand(None)  # cancelled from the asyncio side before it finished

        def start() -> None:
            try:
                self._nursery.start_soon(run)
            except RuntimeError:  # the nursery closed meanwhile
                hand(outcome.Error(EngineClosed("the engine is closed")))

        if self._guest:
            # Called directly, not through the TrioToken: guest mode runs trio on this thread
            # and trio is between ticks whenever asyncio code runs, so the spawn only has to
            # wake it (Runner.reschedule does). The token's queue would cost a trio tick more,
            # an asyncio loop turn, before the call even starts.
            start()
        else:
            try:
                self._token.run_sync_soon(start)
            except trio.RunFinishedError:
                raise _closed_error() from None
        try:
            return await future
        except asyncio.CancelledError:
            if self._guest:
                scope.cancel()
            else:
                with suppress(trio.RunFinishedError):  # a scope is cancelled on its own loop
                    self._token.run_sync_soon(scope.cancel)
            raise

    async def add_turn(self, user_id: str, session_id: str, role: str, text: str,
                       at: datetime | None = None, meta: dict[str, Any] | None = None,
                       durable: bool = False, *, agent_id: str | None = None,
                       run_id: str | None = None) -> Receipt:
        """:meth:`engine.Engine.add_turn` on asyncio (``agent_id`` / ``run_id``: the session's
        scope, as there); the receipt's ``durable()`` is awaitable here."""
        return Receipt(await self._call(self._native.add_turn, user_id, session_id, role, text,
                                        at, meta, durable, agent_id=agent_id, run_id=run_id),
                       self)

    def add_turn_nowait(self, user_id: str, session_id: str, role: str, text: str,
                        at: datetime | None = None, meta: dict[str, Any] | None = None, *,
                        agent_id: str | None = None, run_id: str | None = None) -> Receipt:
        """Add a turn without awaiting: it is in the session's window when this returns.
        ``agent_id`` / ``run_id``: the session's scope, as :meth:`engine.Engine.add_turn`'s.

        Call it from the asyncio loop's thread (any coroutine or callback of that loop). In
        guest mode it costs what the native call costs; on a trio thread of its own
        (``trio_loop="thread"``) it blocks for one round trip to that thread.

        Raises:
            trio.WouldBlock: the store's queue is full; ``await add_turn(...)`` waits instead.
            InvalidInput / EngineClosed: as :meth:`engine.Engine.add_turn`.
        """
        self._reachable()
        if self._guest:
            self._check_running_loop()  # the window belongs to the trio run on this thread
            # No wake-up call needed: if this reschedules the store's writer while trio waits
            # for I/O, trio's guest mode forces a tick itself (Runner.reschedule), and if the
            # writer is busy committing it takes the turn with its next batch.
            native = self._native.add_turn_nowait(user_id, session_id, role, text, at, meta,
                                                  agent_id=agent_id, run_id=run_id)
        else:
            try:  # the window and the store's queue belong to the engine's thread
                native = trio.from_thread.run_sync(
                    partial(self._native.add_turn_nowait, agent_id=agent_id, run_id=run_id),
                    user_id, session_id, role, text, at, meta, trio_token=self._token)
            except trio.RunFinishedError:
                raise _closed_error() from None
        return Receipt(native, self)

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

    @staticmethod
    async def verify(store_path: str | os.PathLike[str], *, integrity_key: str | None = None,
                     seal: bool = False) -> dict[str, Any]:
        """:meth:`engine.Engine.verify` in a worker thread (beside another process's engine too)."""
        return await asyncio.to_thread(trio.run, lambda: TrioEngine.verify(
            store_path, integrity_key=integrity_key, seal=seal))


def _make(name: str, native: Callable[..., Any]) -> Callable[..., Any]:
    async def method(self: Engine, *args: Any, **kwargs: Any) -> Any:
        if self._native is None:
            raise EngineClosed("the engine is not open; use `async with Engine.open(path)`")
        return await self._call(getattr(self._native, name), *args, **kwargs)

    return method


_bridge.mirror(Engine, _make)
