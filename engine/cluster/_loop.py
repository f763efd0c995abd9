"""The asyncio loop the NATS client runs on, in a dedicated thread, and how trio calls into it.

nats-py is asyncio only. The engine runs on trio, so the client gets one asyncio loop on a
thread of its own for the process's life, and trio tasks hand it coroutines with
``asyncio.run_coroutine_threadsafe`` (its equivalent with a handle on the task, :class:`Call`).
The answer comes back through the trio token: the
future's done callback (on the asyncio thread) reschedules the waiting trio task with
``TrioToken.run_sync_soon``. No worker thread per call, no polling: one wake-up each way.

Cancelling the trio task cancels the asyncio task and waits for it to end, so nothing is left
running on the other side of a cancelled call.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import outcome
import trio

from ..errors import EngineClosed

__all__ = ["AsyncioThread", "Call", "wait_future"]

T = TypeVar("T")

STOP_SECONDS = 10.0  # how long stop() waits for the loop's thread before giving up on it


class AsyncioThread:
    """One asyncio event loop on a daemon thread. Use as a context manager (or :meth:`start`
    and :meth:`stop`); :meth:`run` from trio, :meth:`submit` from anywhere."""

    def __init__(self, name: str = "engram-asyncio") -> None:
        self.name = name
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> AsyncioThread:
        """Start the loop's thread; return once the loop runs."""
        ready = threading.Event()  # set by the thread once its loop is running

        def main() -> None:
            loop = asyncio.new_event_loop()
            self.loop = loop
            loop.call_soon(ready.set)
            try:
                loop.run_forever()
            finally:
                pending = asyncio.all_tasks(loop)
                for task in pending:
                    task.cancel()
                if pending:
                    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

        self._thread = threading.Thread(target=main, name=self.name, daemon=True)
        self._thread.start()
        ready.wait()
        return self

    def stop(self) -> None:
        """Stop the loop (its pending tasks are cancelled) and join the thread."""
        loop, thread = self.loop, self._thread
        if loop is None or thread is None:
            return
        self.loop = None
        if not loop.is_closed():
            loop.call_soon_threadsafe(loop.stop)
        thread.join(STOP_SECONDS)

    def __enter__(self) -> AsyncioThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def submit(self, fn: Callable[..., Awaitable[T]], *args: Any) -> Call[T]:
        """Start ``fn(*args)`` as a task on the loop (from any thread).

        This is ``asyncio.run_coroutine_threadsafe`` with a handle on the task: its future
        completes only once the task has ended, also when it was cancelled, so a caller that
        waits for a cancelled call knows its cleanup on the asyncio side is over.

        Raises:
            EngineClosed: the loop is stopped.
        """
        loop = self.loop
        if loop is None:
            raise EngineClosed("the NATS client's loop is stopped")
        call: Call[T] = Call(loop)
        loop.call_soon_threadsafe(call._start, fn, args)
        return call

    async def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Await ``fn(*args)`` on the asyncio loop from a trio task.

        Raises:
            Whatever the coroutine raises; trio.Cancelled if the trio task was cancelled
            (the asyncio task is cancelled and has ended when this raises).
        """
        call = self.submit(fn, *args)
        return await wait_future(call.future, call.cancel)


class Call(Generic[T]):
    """A coroutine running on the asyncio thread: its :attr:`future` (any thread may wait on
    it) and :meth:`cancel`."""

    __slots__ = ("future", "_loop", "_task", "_cancelled")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._loop = loop
        self._task: asyncio.Task[T] | None = None
        self._cancelled = False

    def _start(self, fn: Callable[..., Awaitable[T]], args: tuple[Any, ...]) -> None:
        if self._cancelled:
            self.future.cancel()
            return
        # The future stays PENDING while the task runs (a RUNNING concurrent future can no
        # longer be marked cancelled, and a cancelled task must show as cancelled).
        self._task = self._loop.create_task(fn(*args))
        self._task.add_done_callback(self._finish)

    def _finish(self, task: asyncio.Task[T]) -> None:
        if task.cancelled():
            self.future.cancel()
        elif task.exception() is not None:
            self.future.set_exception(task.exception())
        else:
            self.future.set_result(task.result())

    def cancel(self) -> None:
        """Ask the task to stop (any thread); its future completes once it has."""
        def cancel_here() -> None:
            self._cancelled = True
            if self._task is not None:
                self._task.cancel()

        try:
            self._loop.call_soon_threadsafe(cancel_here)
        except RuntimeError:
            pass  # the loop is closed: the task ended with it


async def wait_future(future: concurrent.futures.Future[T],
                      cancel: Callable[[], None] | None = None) -> T:
    """Wait in trio for a concurrent future that another thread completes.

    Args:
        future: what to wait for.
        cancel: how to stop the work if the waiting trio task is cancelled; the wait then
            goes on until the future completes. None: a cancelled wait ends at once and the
            work goes on (a publish whose receipt nobody waits for any more still lands).
    """
    token = trio.lowlevel.current_trio_token()
    task = trio.lowlevel.current_task()
    raise_cancel: list[Callable[[], Any]] = []

    def done(_: concurrent.futures.Future[T]) -> None:
        try:
            token.run_sync_soon(trio.lowlevel.reschedule, task)
        except trio.RunFinishedError:
            pass  # the trio run ended meanwhile: nobody waits any more

    def abort(raise_cancel_fn: Callable[[], Any]) -> trio.lowlevel.Abort:
        if cancel is None:
            return trio.lowlevel.Abort.SUCCEEDED
        raise_cancel.append(raise_cancel_fn)
        cancel()
        return trio.lowlevel.Abort.FAILED

    if future.done():
        await trio.lowlevel.checkpoint()
        return future.result()
    future.add_done_callback(done)
    await trio.lowlevel.wait_task_rescheduled(abort)
    if raise_cancel and future.cancelled():
        raise_cancel[0]()
    return outcome.capture(future.result).unwrap()
