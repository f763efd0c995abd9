"""The asyncio facade (trio in guest mode on asyncio, or on a thread of its own) and the
blocking facade (trio in a thread): same methods, errors raised on the caller's side, clean
close. The asyncio tests run once per way of hosting trio."""

from __future__ import annotations

import asyncio
import threading

import pytest
import trio

from engine import EngineClosed, HashEmbedder, InvalidInput
from engine import aio, sync
from engine._bridge import MIRRORED
from engine._engine import Engine as TrioEngine

from .conftest import open_engine

# Every asyncio test runs with trio in guest mode on the loop and with trio on its own thread.
trio_loops = pytest.mark.parametrize("trio_loop", ["guest", "thread"])


def test_both_facades_mirror_every_coroutine_method() -> None:
    """Every public coroutine method of the trio Engine is on both facades, with its docs."""
    assert {"add_turn", "recall", "retrieve_memory", "forget_user", "flush"} <= set(MIRRORED)
    for name in MIRRORED:
        assert callable(getattr(aio.Engine, name)) and callable(getattr(sync.Engine, name))
    assert aio.Engine.recall.__doc__ == sync.Engine.recall.__doc__ is not None


def test_both_facades_offer_every_public_member_of_the_trio_engine() -> None:
    """What a trio caller reaches (methods, the closed-store functions, the settings) an
    asyncio or a blocking caller reaches too; left out are the cluster's hooks, and on the
    blocking facade add_turn_nowait (its add_turn is the buffered call already)."""
    public = {n for n in vars(TrioEngine) if not n.startswith("_")} - {"check_open",
                                                                      "log_counts"}
    assert public - set(dir(aio.Engine)) == set()
    assert public - set(dir(sync.Engine)) == {"add_turn_nowait"}


def test_the_facades_verify_a_store_and_show_its_path_and_settings(tmp_path) -> None:
    """verify and path / config on both facades; verify refuses, in the engine's own terms,
    a store this process serves (LMDB opens a store once per process)."""
    with sync.Engine.open(tmp_path / "s", embedder=HashEmbedder(),
                          config={"max_text_chars": 5000}) as mem:
        mem.add_turn("ana", "s1", "user", "I moved to Lisbon", durable=True)
        assert mem.path == tmp_path / "s" and mem.config.max_text_chars == 5000
        with pytest.raises(InvalidInput, match="another process"):
            sync.Engine.verify(mem.path)
    assert sync.Engine.verify(tmp_path / "s")["ok"] is True

    async def main() -> None:
        async with aio.Engine.open(tmp_path / "s", embedder=HashEmbedder(),
                                   config={"max_text_chars": 4000}) as mem:
            assert mem.path == tmp_path / "s" and mem.config.max_text_chars == 4000
        report = await aio.Engine.verify(tmp_path / "s")
        assert report["ok"] is True and report["last_lsn"] >= 1, report

    asyncio.run(main())


@trio_loops
def test_asyncio_facade_ingests_recalls_and_closes(tmp_path, trio_loop) -> None:
    """Under asyncio.run: add_turn_nowait and awaited calls, durable receipts, errors of the
    engine's own types, concurrent calls, and the store intact on reopen."""

    async def main() -> None:
        async with aio.Engine.open(tmp_path / "s", embedder=HashEmbedder(),
                                   trio_loop=trio_loop) as mem:
            assert mem.trio_loop == trio_loop
            receipt = mem.add_turn_nowait("ana", "s1", "user", "I moved to Lisbon")
            assert receipt.seq == 0
            await receipt.durable()
            second = await mem.add_turn("ana", "s1", "user", "My dog is Pixel", durable=True)
            assert second.seq == 1
            with pytest.raises(InvalidInput, match="role"):
                mem.add_turn_nowait("ana", "s1", "bot", "hi")
            with pytest.raises(InvalidInput, match="role"):
                await mem.add_turn("ana", "s1", "bot", "hi")
            await mem.flush()
            results = await asyncio.gather(*(mem.recall("ana", q, limit=1, kinds=["turn"])
                                             for q in ("dog", "Lisbon", "Pixel")))
            assert [r[0].text for r in results] == ["My dog is Pixel", "I moved to Lisbon",
                                                    "My dog is Pixel"]
            history = await mem.session_history("ana", "s1")
            assert [t.text for t in history] == ["I moved to Lisbon", "My dog is Pixel"]
            await asyncio.sleep(0)  # asyncio's own tasks run between the engine's steps
        with pytest.raises(EngineClosed):
            await mem.recall("ana", "dog")
        with pytest.raises(EngineClosed):
            mem.add_turn_nowait("ana", "s1", "user", "late")
        async with aio.Engine.open(tmp_path / "s", embedder=HashEmbedder(),
                                   trio_loop=trio_loop) as again:
            assert len(await again.session_history("ana", "s1")) == 2

    asyncio.run(main())


@trio_loops
def test_asyncio_cancellation_cancels_the_trio_call_and_leaves_the_engine_usable(
        tmp_path, trio_loop) -> None:
    """A timed-out awaited call is cancelled on the trio side too; the engine goes on."""

    async def main() -> None:
        async with aio.Engine.open(tmp_path / "s", embedder=HashEmbedder(),
                                   trio_loop=trio_loop) as mem:
            receipt = mem.add_turn_nowait("ana", "s1", "user", "hello")
            task = asyncio.ensure_future(mem.flush())
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await receipt.durable()
            assert len(await mem.session_history("ana", "s1")) == 1

    asyncio.run(main())


@trio_loops
def test_asyncio_open_failure_raises_on_the_asyncio_side(tmp_path, trio_loop) -> None:
    """A bad config fails the open with the engine's error, and no trio run is left behind."""

    async def main() -> None:
        with pytest.raises(InvalidInput, match="config"):
            async with aio.Engine.open(tmp_path / "s", embedder=HashEmbedder(),
                                       config={"window_turns": 0}, trio_loop=trio_loop):
                pass

    asyncio.run(main())


@trio_loops
def test_an_exception_in_the_asyncio_body_comes_out_and_the_store_is_closed(
        tmp_path, trio_loop) -> None:
    """The body's own error propagates unchanged after the engine drained and closed."""

    async def main() -> None:
        with pytest.raises(KeyError):
            async with aio.Engine.open(tmp_path / "s", embedder=HashEmbedder(),
                                       trio_loop=trio_loop) as mem:
                mem.add_turn_nowait("ana", "s1", "user", "kept")
                raise KeyError("boom")
        async with aio.Engine.open(tmp_path / "s", embedder=HashEmbedder(),
                                   trio_loop=trio_loop) as mem:
            assert [t.text for t in await mem.session_history("ana", "s1")] == ["kept"]

    asyncio.run(main())


def test_blocking_facade_serves_many_threads(tmp_path) -> None:
    """Eight threads add and read at once through one engine; errors come out in the calling
    thread; after close every call says EngineClosed."""
    errors: list[BaseException] = []
    with sync.Engine.open(tmp_path / "s", embedder=HashEmbedder()) as mem:

        def worker(n: int) -> None:
            try:
                for i in range(20):
                    mem.add_turn(f"u{n}", "s", "user", f"turn {i} of {n}")
                mem.add_turn(f"u{n}", "s", "user", "last", durable=True).durable()
                assert len(mem.session_history(f"u{n}", "s", limit=100)) == 21
            except BaseException as exc:  # handed to the test thread below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        with pytest.raises(InvalidInput, match="text"):
            mem.add_turn("u0", "s", "user", "")
        mem.flush()
        assert mem.stats().turns == 8 * 21
        assert mem.recall("u3", "turn 7 of 3", limit=1, kinds=["turn"])[0].text == "turn 7 of 3"
    with pytest.raises(EngineClosed):
        mem.stats()
    assert not [t for t in threading.enumerate() if t.name == "engram-trio"]


def test_blocking_facade_closes_cleanly_on_keyboard_interrupt(tmp_path) -> None:
    """Ctrl-C inside the with block closes the engine (turns drained) and propagates."""
    with pytest.raises(KeyboardInterrupt):
        with sync.Engine.open(tmp_path / "s", embedder=HashEmbedder()) as mem:
            mem.add_turn("ana", "s1", "user", "before the interrupt")
            raise KeyboardInterrupt
    with sync.Engine.open(tmp_path / "s", embedder=HashEmbedder()) as mem:
        assert [t.text for t in mem.session_history("ana", "s1")] == ["before the interrupt"]


async def test_add_turn_nowait_on_trio_refuses_when_the_queue_is_full(store_path, monkeypatch
                                                                      ) -> None:
    """The native add_turn_nowait raises trio.WouldBlock instead of waiting for room, and
    writes nothing then."""
    import actors.store as store_mod

    async with open_engine(store_path) as mem:
        monkeypatch.setattr(store_mod.writer, "QUEUE_LIMIT", 1)
        mem.add_turn_nowait("ana", "s1", "user", "fits")
        with pytest.raises(trio.WouldBlock):
            mem.add_turn_nowait("ana", "s1", "user", "does not fit")
        await mem.flush()
        assert [t.text for t in await mem.session_history("ana", "s1")] == ["fits"]


# The child takes Ctrl-C as a terminal's program does even when the suite runs as a background
# job (CI, nohup): there the shell starts it with SIGINT ignored, which Python then keeps.
CTRL_C_SCRIPT = """
import asyncio, signal, sys
from engine import HashEmbedder
from engine.aio import Engine

signal.signal(signal.SIGINT, signal.default_int_handler)

async def main():
    async with Engine.open(sys.argv[1], embedder=HashEmbedder(), trio_loop=sys.argv[2]) as mem:
        mem.add_turn_nowait("ana", "s1", "user", "said before Ctrl-C")
        print("ready", flush=True)
        await asyncio.sleep(3600)

asyncio.run(main())
"""


@trio_loops
def test_asyncio_facade_closes_cleanly_on_ctrl_c(tmp_path, trio_loop) -> None:
    """SIGINT to an asyncio program: asyncio cancels the body, the engine drains and closes,
    and the acknowledged turn is on disk."""
    import signal
    import subprocess
    import sys

    with subprocess.Popen([sys.executable, "-c", CTRL_C_SCRIPT, str(tmp_path / "s"), trio_loop],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as process:
        try:
            assert process.stdout.readline().strip() == "ready"
            process.send_signal(signal.SIGINT)
            process.wait(timeout=60)
            err = process.stderr.read()
        finally:
            if process.poll() is None:
                process.kill()
    # Python re-raises an uncaught KeyboardInterrupt as death by SIGINT.
    assert process.returncode in (-signal.SIGINT, 130), err
    assert "EngineBroken" not in err

    async def reopen() -> list[str]:
        async with aio.Engine.open(tmp_path / "s", embedder=HashEmbedder(),
                                   trio_loop=trio_loop) as mem:
            return [t.text for t in await mem.session_history("ana", "s1")]

    assert asyncio.run(reopen()) == ["said before Ctrl-C"]


@trio_loops
def test_asyncio_open_cancelled_midway_closes_what_it_opened(tmp_path, trio_loop) -> None:
    """A task cancelled while the engine opens does not leave the engine running: the store
    can be opened again at once (a running engine would hold it)."""

    async def main() -> None:
        async def open_forever() -> None:
            async with aio.Engine.open(tmp_path / "s", embedder=HashEmbedder(),
                                       trio_loop=trio_loop):
                await asyncio.sleep(3600)

        task = asyncio.ensure_future(open_forever())
        await asyncio.sleep(0)  # the open has started, not finished
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        async with aio.Engine.open(tmp_path / "s", embedder=HashEmbedder(),
                                   trio_loop=trio_loop) as mem:
            assert await mem.list_sessions("ana") == []

    asyncio.run(main())


def test_a_second_asyncio_engine_on_one_loop_runs_trio_on_its_own_thread(tmp_path) -> None:
    """Guest mode hosts one trio run per thread: a second engine on the same loop runs trio
    on a thread of its own by itself, and both serve their stores side by side."""

    async def main() -> None:
        async with aio.Engine.open(tmp_path / "a", embedder=HashEmbedder()) as first:
            with pytest.raises(InvalidInput, match="trio_loop: expected 'thread' or 'auto'"):
                async with aio.Engine.open(tmp_path / "b", embedder=HashEmbedder(),
                                           trio_loop="guest"):
                    pass
            async with aio.Engine.open(tmp_path / "b", embedder=HashEmbedder()) as second:
                assert (first.trio_loop, second.trio_loop) == ("guest", "thread")
                first.add_turn_nowait("ana", "s1", "user", "to the first store")
                await second.add_turn("ana", "s1", "user", "to the second store", durable=True)
                second.add_turn_nowait("ana", "s1", "user", "and once more")
                assert [t.text for t in await first.session_history("ana", "s1")] == [
                    "to the first store"]
                assert [t.text for t in await second.session_history("ana", "s1")] == [
                    "to the second store", "and once more"]
            assert not [t for t in threading.enumerate() if t.name == "engram-trio-aio"]

    asyncio.run(main())


def test_asyncio_open_refuses_an_unknown_trio_loop(tmp_path) -> None:
    """trio_loop names where trio runs; anything else is refused before a store is opened."""

    async def main() -> None:
        with pytest.raises(InvalidInput, match="trio_loop: expected one of 'auto', 'guest', "
                                               "'thread', found 'process'"):
            async with aio.Engine.open(tmp_path / "s", trio_loop="process"):
                pass
        assert not (tmp_path / "s").exists()

    asyncio.run(main())


@trio_loops
def test_the_asyncio_facade_takes_scopes_as_the_trio_engine_does(tmp_path, trio_loop) -> None:
    """add_turn_nowait and add_turn on asyncio take agent_id / run_id like the trio Engine's:
    the session is filed under the scope, recall keeps it, a session's other scope is refused
    on the asyncio side, and forget_scope forgets it."""

    async def main() -> None:
        async with aio.Engine.open(tmp_path / "s", embedder=HashEmbedder(),
                                   trio_loop=trio_loop) as mem:
            mem.add_turn_nowait("ana", "s1", "user", "the red kite", agent_id="bot",
                                run_id="r1")
            await mem.add_turn("ana", "s2", "user", "the red balloon", agent_id="bot",
                               run_id="r2", durable=True)
            mem.add_turn_nowait("ana", "s3", "user", "the red car")
            with pytest.raises(InvalidInput, match="agent_id"):
                mem.add_turn_nowait("ana", "s1", "user", "again", agent_id="other")
            with pytest.raises(InvalidInput, match="run_id"):
                await mem.add_turn("ana", "s2", "user", "again", run_id="r9")
            await mem.flush()
            scopes = {s.session_id: (s.agent_id, s.run_id)
                      for s in await mem.list_sessions("ana")}
            assert scopes == {"s1": ("bot", "r1"), "s2": ("bot", "r2"), "s3": ("", "")}
            found = await mem.recall("ana", "red", kinds=["turn"], run_id="r1")
            assert [h.text for h in found] == ["the red kite"]
            await mem.forget_scope("ana", agent_id="bot")
            left = await mem.recall("ana", "red", kinds=["turn"])
            assert [h.text for h in left] == ["the red car"]

    asyncio.run(main())


def test_the_blocking_facade_takes_scopes_as_the_trio_engine_does(tmp_path) -> None:
    """The blocking facade's add_turn takes agent_id / run_id too."""
    with sync.Engine.open(tmp_path / "s", embedder=HashEmbedder()) as mem:
        mem.add_turn("ana", "s1", "user", "the red kite", agent_id="bot", run_id="r1")
        mem.add_turn("ana", "s2", "user", "the red car", durable=True)
        mem.flush()
        assert {s.session_id: (s.agent_id, s.run_id) for s in mem.list_sessions("ana")} == {
            "s1": ("bot", "r1"), "s2": ("", "")}
        assert [h.text for h in mem.recall("ana", "red", kinds=["turn"], agent_id="bot")] == [
            "the red kite"]


def test_both_facades_refuse_a_durable_that_is_not_true_or_false(tmp_path) -> None:
    """The facades pass durable through to the trio engine, whose check refuses "no" (which
    is truthy) naming durable; nothing is written."""
    turn = {"user_id": "ana", "session_id": "s1", "role": "user", "text": "hi"}
    with sync.Engine.open(tmp_path / "s", embedder=HashEmbedder()) as mem:
        with pytest.raises(InvalidInput, match="durable: expected True or False, found str"):
            mem.add_turn("ana", "s1", "user", "hi", durable="no")
        with pytest.raises(InvalidInput, match="durable: expected True or False, found int"):
            mem.add_turns([turn], durable=1)
        assert mem.session_history("ana", "s1") == []

    async def main() -> None:
        async with aio.Engine.open(tmp_path / "s", embedder=HashEmbedder()) as mem:
            with pytest.raises(InvalidInput, match="durable: expected True or False"):
                await mem.add_turn("ana", "s1", "user", "hi", durable="no")
            with pytest.raises(InvalidInput, match="durable: expected True or False"):
                await mem.add_turns([turn], durable="yes")
            assert await mem.session_history("ana", "s1") == []

    asyncio.run(main())
