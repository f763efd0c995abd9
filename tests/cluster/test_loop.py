"""The trio -> asyncio bridge: one asyncio loop in a thread, answers back through the token."""

from __future__ import annotations

import asyncio
import threading

import pytest
import trio

from engine.cluster._loop import AsyncioThread
from engine.errors import EngineClosed


async def test_a_coroutine_runs_on_the_loop_thread_and_its_result_comes_back() -> None:
    """run() returns the coroutine's value; the coroutine ran on the asyncio thread."""
    with AsyncioThread() as loop:
        async def where(x: int) -> tuple[str, int]:
            await asyncio.sleep(0)
            return threading.current_thread().name, x * 2

        assert await loop.run(where, 21) == ("engram-asyncio", 42)


async def test_an_exception_on_the_asyncio_side_is_raised_in_the_trio_task() -> None:
    """Errors cross the bridge unchanged."""
    with AsyncioThread() as loop:
        async def fail() -> None:
            raise KeyError("nope")

        with pytest.raises(KeyError, match="nope"):
            await loop.run(fail)


async def test_cancelling_the_trio_call_cancels_the_asyncio_task_and_waits_for_it() -> None:
    """Nothing keeps running on the other side of a cancelled call."""
    with AsyncioThread() as loop:
        state: list[str] = []
        started = threading.Event()  # set once the asyncio task runs

        async def slow() -> None:
            state.append("started")
            started.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                await asyncio.sleep(0.01)  # cleanup that the trio side must wait for
                state.append("cancelled")
                raise

        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(loop.run, slow)
                await trio.to_thread.run_sync(started.wait)
                scope.cancel()
        assert state == ["started", "cancelled"]


async def test_a_stopped_loop_refuses_calls() -> None:
    """After stop(), a call says the loop is stopped instead of hanging."""
    loop = AsyncioThread().start()
    loop.stop()

    async def nothing() -> None:
        pass

    with pytest.raises(EngineClosed, match="stopped"):
        await loop.run(nothing)
