"""A busy bot against the engine: calls cancelled at random points, forgets racing the work
on the user they forget, writers crowding one session, closes with calls in flight, clocks
that jump. Whatever the interleaving, the store stays consistent, nothing acknowledged is
lost, and nothing forgotten comes back."""

from __future__ import annotations

import random
from datetime import timedelta
from pathlib import Path
from typing import Any

import trio
import trio.testing

from engine import Engine, EngineClosed, InvalidInput, NewTurn

from .conftest import T0, StepClock, open_engine

MARKER = "qwzxmarkerkv"  # one token found nowhere else, so its bytes can be looked for


def _data_holds(store: Path, needle: bytes) -> bool:
    return needle in (store / "data.mdb").read_bytes()


async def _cancel_after(checkpoints: int, fn: Any, *args: Any, **kwargs: Any) -> bool:
    """Run ``fn`` in a task of its own and cancel it once this task passed ``checkpoints``
    checkpoints; True if it was cancelled before it returned."""
    finished = False

    async def call() -> None:
        nonlocal finished
        try:
            await fn(*args, **kwargs)
        except InvalidInput:  # the caller's mistake (no such session): said, not broken
            pass
        finished = True

    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(call)
            for _ in range(checkpoints):
                await trio.lowlevel.checkpoint()
            scope.cancel()
    return not finished


async def _verified(store: Path) -> None:
    report = await Engine.verify(store)
    assert report["ok"], report["problems"]


# -- a forget cancelled once it is queued ---------------------------------------------------


async def test_forget_user_cancelled_once_queued_still_forgets_everywhere(store_path) -> None:
    """A forget_user cancelled after its deletion was queued still takes the user's facts
    out of the facts cache and still has flush scrub the bytes out of the data file: the
    deletion commits anyway, so everything that follows a commit must follow this one."""
    async with open_engine(store_path, clock=StepClock()) as mem:
        await mem.remember_fact("ana", "identity", "location", f"{MARKER}ville")
        await mem.add_turn("ana", "s", "user", f"I live in {MARKER}ville", durable=True)
        await mem.add_turn("bo", "s", "user", "the garden needs water", durable=True)
        assert [f.value for f in await mem.profile("ana")] == [f"{MARKER}ville"]  # cached
        await mem.flush()
        with trio.move_on_after(0) as scope:
            await mem.forget_user("ana")
        assert scope.cancelled_caught
        await mem.flush()
        assert await mem.profile("ana") == []
        assert not [h for h in await mem.recall("ana", f"{MARKER}ville") if MARKER in h.text]
        assert not _data_holds(store_path, MARKER.encode())
    await _verified(store_path)


async def test_delete_note_cancelled_once_queued_still_scrubs(store_path) -> None:
    """A delete_note cancelled after the deletion was queued still has flush scrub the
    note's bytes out of the data file."""
    async with open_engine(store_path, clock=StepClock()) as mem:
        note = await mem.store_note("ana", f"the code word is {MARKER}")
        await mem.add_turn("ana", "s", "user", "hello there", durable=True)
        await mem.flush()
        with trio.move_on_after(0) as scope:
            await mem.delete_note("ana", note.note_id)
        assert scope.cancelled_caught
        await mem.flush()
        assert await mem.get_note("ana", note.note_id) is None
        assert not _data_holds(store_path, MARKER.encode())
    await _verified(store_path)


def _gate_writer(mem: Engine) -> Any:
    """Hold the store's writer thread before each batch until the returned event is set."""
    import threading

    gate = threading.Event()
    gate.set()
    write = mem._store._plan_and_write

    def held(*args: Any) -> Any:
        gate.wait()
        return write(*args)

    mem._store._plan_and_write = held
    return gate


async def test_forget_racing_a_turn_behind_backpressure_leaves_buffer_and_store_agreeing(
        store_path, monkeypatch) -> None:
    """A forget_user waiting for room in a full store queue, and a turn of the same user
    waiting there too: whichever goes first, the session buffer and the store agree after
    (the turn is either forgotten in both or kept in both), and the store verifies."""
    import actors.store.writer as writer_mod

    monkeypatch.setattr(writer_mod, "QUEUE_LIMIT", 1)
    seen: dict[str, list[str]] = {}
    async with open_engine(store_path, clock=StepClock(),
                           config={"long_term": False}) as mem:
        gate = _gate_writer(mem)
        for round_ in range(8):
            user = f"u{round_}"
            await mem.add_turn(user, "s", "user", "before", durable=True)
            gate.clear()
            await mem.add_turn("bo", "s", "user", f"filler {round_}")  # the writer holds it
            await trio.testing.wait_all_tasks_blocked()
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(mem.forget_user, user)
                    nursery.start_soon(mem.add_turn, user, "s", "user", "after")
                    await trio.testing.wait_all_tasks_blocked()
                    gate.set()
            finally:
                gate.set()
            await mem.flush()
            seen[user] = [t.text for t in await mem.session_history(user, "s")]
            assert seen[user] in ([], ["after"]), seen[user]
    await _verified(store_path)
    async with open_engine(store_path, config={"long_term": False}) as mem:
        for user, texts in seen.items():
            assert [t.text for t in await mem.session_history(user, "s")] == texts


def _hold_reads(mem: Engine, fn_name: str) -> tuple[trio.Event, trio.Event]:
    """Hold each store read by the function named ``fn_name`` after it read, until the
    second event is set; the first is set once one is held."""
    held, release = trio.Event(), trio.Event()
    read = mem._store.read

    async def holding(fn: Any, *args: Any) -> Any:
        result = await read(fn, *args)
        if fn.__name__ == fn_name and not release.is_set():
            held.set()
            await release.wait()
        return result

    mem._store.read = holding
    return held, release


async def test_a_profile_read_racing_forget_user_does_not_cache_forgotten_facts(
        store_path) -> None:
    """A profile whose read of the facts began before a forget_user committed, and ended
    after, does not leave the forgotten facts in the facts cache for the next call."""
    async with open_engine(store_path, clock=StepClock()) as mem:
        await mem.remember_fact("ana", "identity", "location", "Lisbon")
    async with open_engine(store_path, clock=StepClock()) as mem:  # nothing cached yet
        held, release = _hold_reads(mem, "read_facts")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(mem.profile, "ana")
            await held.wait()
            await mem.forget_user("ana")
            release.set()
        assert await mem.profile("ana") == []
        assert not [h for h in await mem.recall("ana", "Lisbon location") if h.kind == "fact"]
    await _verified(store_path)


class _GatedExtractor:
    """States one fact per user turn, once the test lets it: a model mid-call on a turn."""

    name = "gated"

    def __init__(self) -> None:
        self.called = trio.Event()
        self.release = trio.Event()

    async def extract(self, text: str) -> list[Any]:
        from engine import Candidate

        self.called.set()
        await self.release.wait()
        return [Candidate("identity", "location", "Lisbon", f"lives in Lisbon ({text})",
                          0.9, 0.8)]


async def test_a_fact_the_follower_derives_from_a_forgotten_turn_never_shows(
        store_path) -> None:
    """The extraction follower mid-call on a turn when its user is forgotten: the fact it
    then decides is refused by the store, and no profile shows it meanwhile either (not
    even while its write waits to commit)."""
    extractor = _GatedExtractor()
    async with open_engine(store_path, clock=StepClock(), extractor=extractor) as mem:
        await mem.add_turn("ana", "s", "user", "I moved last spring", durable=True)
        await extractor.called.wait()
        await mem.forget_user("ana")
        gate = _gate_writer(mem)
        gate.clear()  # the fact's write waits in the writer
        extractor.release.set()
        shown: list[Any] = []

        async def look() -> None:  # from the cache at once, or after the write lands
            shown.extend(await mem.profile("ana"))

        try:
            await trio.testing.wait_all_tasks_blocked()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(look)
                await trio.testing.wait_all_tasks_blocked()
                gate.set()
        finally:
            gate.set()
        await mem.flush()
        assert shown == []
        assert await mem.profile("ana") == []
    await _verified(store_path)


async def test_a_recall_racing_forget_user_does_not_cache_forgotten_entity_names(
        store_path) -> None:
    """A recall whose read of the user's entity names began before a forget_user committed
    and ended after does not leave those names cached for the forgotten user."""
    async with open_engine(store_path, clock=StepClock()) as mem:
        await mem.add_turn("ana", "s", "user", "I had lunch with Marguerite Qwzx in Porto")
        await mem.flush()
    async with open_engine(store_path, clock=StepClock()) as mem:  # nothing cached yet
        held, release = _hold_reads(mem, "read_entity_keys")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(mem.recall, "ana", "Marguerite")
            await held.wait()
            await mem.forget_user("ana")
            release.set()
        assert "ana" not in mem._parts.entities._keys
        assert await mem.entity_info("ana", "Marguerite Qwzx") is None
    await _verified(store_path)


# -- every call cancelled at random points --------------------------------------------------


async def test_every_call_cancelled_at_random_points_leaves_a_usable_consistent_store(
        store_path, tmp_path) -> None:
    """Each public call, cancelled after a random number of the canceller's checkpoints
    (seeded), over and over: the engine answers normally after, flush returns, what was
    forgotten stays gone, and the closed store verifies."""
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    snaps = iter(range(1_000))
    async with open_engine(store_path, clock=StepClock()) as mem:
        for i in range(30):
            await mem.add_turn("ana", "s1", "user" if i % 2 else "assistant",
                               f"I live in Lisbon and my sister Marta likes jazz, turn {i}")
        note = await mem.store_note("ana", "the flat in Lisbon has a balcony")
        await mem.remember_fact("ana", "preference", "music", "jazz")
        await mem.flush()
        first = (await mem.session_history("ana", "s1", limit=1))[0]

        for k in range(120):
            if k % 17 == 12:  # forgotten below, in a call cancelled at some point
                await mem.add_turn(f"gone{k}", "s", "user", f"{MARKER} I live in Oslo")
                await mem.remember_fact(f"gone{k}", "identity", "location", f"{MARKER}by")
                await mem.profile(f"gone{k}")  # cached
        await mem.flush()

        calls = [
            lambda k: mem.add_turn("ana", "s1", "user", f"durable {k}", durable=True),
            lambda k: mem.add_turns([NewTurn(user_id="ana", session_id=f"b{k}", role="user", text=f"bulk {k}.{j}")
                                     for j in range(40)], durable=True),
            lambda k: mem.recall("ana", "Lisbon jazz", link_depth=2),
            lambda k: mem.retrieve_memory("ana", "where do I live", conversation_id="s1"),
            lambda k: mem.remember_fact("ana", "identity", "location", f"Lisbon {k % 3}"),
            lambda k: mem.correct_fact("ana", "identity", "job", f"baker {k % 2}"),
            lambda k: mem.confirm_fact("ana", "preference", "music"),
            lambda k: mem.store_note("ana", f"note number {k} about the weather"),
            lambda k: mem.update_note("ana", note.note_id, f"the flat has a balcony, {k}"),
            lambda k: mem.delete_note("ana", f"n{k}"),
            lambda k: mem.close_session("ana", f"b{k - 1}"),
            lambda k: mem.forget_session("ana", f"b{k - 2}"),
            lambda k: mem.forget_user(f"gone{k}"),
            lambda k: mem.snapshot(tmp_path / f"snap{next(snaps)}"),
            lambda k: mem.maintain(),
            lambda k: mem.link("ana", first.turn_id, note.note_id, "about"),
            lambda k: mem.flush(),
        ]
        for k in range(120):
            call = calls[k % len(calls)]
            await _cancel_after(rng.choice([0, 1, 2, 3, 5, 8, 13, 40]), call, k)
        await mem.add_turn("ana", "s1", "user", "still here", durable=True)
        await mem.flush()
        assert await mem.recall("ana", "still here")
        for k in range(12, 120, 17):  # its deletion is queued at its first step
            assert await mem.profile(f"gone{k}") == []
            assert await mem.list_sessions(f"gone{k}") == []
            assert not await mem.recall(f"gone{k}", f"{MARKER} Oslo")
    assert not _data_holds(store_path, MARKER.encode())
    await _verified(store_path)
    async with open_engine(store_path) as mem:
        await mem.flush()
        assert (await mem.session_history("ana", "s1", limit=1))[0].text == "still here"


# -- writers crowding one session -----------------------------------------------------------


async def test_many_writers_to_one_session_get_gapless_seqs_in_acknowledgement_order(
        store_path) -> None:
    """Forty tasks adding turns to one session, durable or not, with random yields: the
    seqs run without gaps or repeats, each task's turns in its own order, and the history
    after reopening is the acknowledgement order."""
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    acked: list[tuple[int, str]] = []
    async with open_engine(store_path, clock=StepClock()) as mem:
        await mem.add_turn("ana", "s", "user", "first", durable=True)

        async def writer(w: int, pauses: list[int]) -> None:
            for i, pause in enumerate(pauses):
                for _ in range(pause):
                    await trio.lowlevel.checkpoint()
                text = f"w{w} t{i}"
                if i % 3 == 0:
                    receipt = await mem.add_turn("ana", "s", "user", text)
                    acked.append((receipt.seq, text))
                elif i % 3 == 1:
                    receipt = await mem.add_turn("ana", "s", "user", text, durable=True)
                    acked.append((receipt.seq, text))
                else:
                    got = await mem.add_turns([NewTurn(user_id="ana", session_id="s", role="user", text=f"{text}.{j}")
                                               for j in range(3)])
                    acked.extend((r.seq, f"{text}.{j}") for j, r in enumerate(got))

        async with trio.open_nursery() as nursery:
            for w in range(40):
                nursery.start_soon(writer, w, [rng.randrange(4) for _ in range(12)])
        history = await mem.session_history("ana", "s", limit=10_000)
    seqs = sorted(seq for seq, _ in acked)
    assert seqs == list(range(1, len(acked) + 1))
    assert [t.seq for t in history] == list(range(len(history)))
    by_seq = dict(acked)
    assert [t.text for t in history[1:]] == [by_seq[s] for s in seqs]
    for w in range(40):  # each writer's turns in the order it said them
        mine = [t.text for t in history if t.text.startswith(f"w{w} ")]
        assert mine == sorted(mine, key=lambda x: (int(x.split()[1][1:].split(".")[0]), x))
    await _verified(store_path)
    async with open_engine(store_path) as mem:
        again = await mem.session_history("ana", "s", limit=10_000)
    assert [(t.seq, t.text) for t in again] == [(t.seq, t.text) for t in history]


# -- a close with calls in flight -----------------------------------------------------------


async def test_close_with_calls_in_flight_drains_what_it_acknowledged(store_path) -> None:
    """Writers, readers and a forget in other tasks while the engine's ``async with`` exits:
    every call either finished or raised EngineClosed, every acknowledged turn is in the
    store after reopening, and the store verifies."""
    acked: list[str] = []
    outcomes: list[str] = []

    async def writer(mem: Engine, w: int) -> None:
        i = 0
        try:
            while True:
                text = f"w{w} t{i}"
                await mem.add_turn(f"u{w % 3}", f"s{w}", "user", text, durable=(i % 4 == 0))
                acked.append(text)
                i += 1
        except EngineClosed:
            outcomes.append("closed")

    async def reader(mem: Engine, w: int) -> None:
        try:
            while True:
                await mem.recall(f"u{w % 3}", "t1 t2", link_depth=1)
                await mem.profile(f"u{w % 3}")
        except EngineClosed:
            outcomes.append("closed")

    async with trio.open_nursery() as outside:
        async with open_engine(store_path, clock=StepClock()) as mem:
            await mem.add_turn("gone", "s", "user", f"{MARKER} to be forgotten", durable=True)
            for w in range(6):
                outside.start_soon(writer, mem, w)
                outside.start_soon(reader, mem, w)
            for _ in range(50):
                await trio.lowlevel.checkpoint()
            await mem.forget_user("gone")
            for _ in range(50):
                await trio.lowlevel.checkpoint()
        with trio.fail_after(30):
            while len(outcomes) < 12:
                await trio.sleep(0.01)
    assert len(acked) > 12
    await _verified(store_path)
    async with open_engine(store_path) as mem:
        said = set()
        for w in range(6):
            said |= {t.text for t in await mem.session_history(f"u{w % 3}", f"s{w}",
                                                                 limit=100_000)}
        assert set(acked) <= said
        assert await mem.list_sessions("gone") == []
    assert not _data_holds(store_path, MARKER.encode())


# -- clocks that jump -------------------------------------------------------------------------


class _JumpingClock:
    """An engine clock that goes back and forth by hours, and sometimes stands still."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.now = T0

    def __call__(self):
        self.now += timedelta(seconds=self.rng.choice([-7200, -1, 0, 0, 1, 3600]))
        return self.now


async def test_times_that_jump_back_and_repeat_keep_order_by_seq(store_path) -> None:
    """Turns stamped far in the past and future, many at one instant, and a clock that goes
    backwards: ingestion, recall, episodes, maintenance and close all work, every session
    reads back in seq order, and the store verifies."""
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    far = [T0 - timedelta(days=365 * 40), T0 + timedelta(days=365 * 30), T0, T0, None]
    async with open_engine(store_path, clock=_JumpingClock(seed),
                           config={"episode_after_turns": 12, "episode_keep_turns": 4}) as mem:
        for i in range(120):
            at = rng.choice(far)
            await mem.add_turn("ana", f"s{i % 3}", "user" if i % 2 else "assistant",
                               f"turn {i} about Lisbon and the jazz club", at=at,
                               durable=(i % 10 == 0))
        await mem.add_turns([NewTurn(user_id="ana", session_id="s3", role="user", text=f"same instant {j}", at=T0)
                             for j in range(50)])
        await mem.remember_fact("ana", "identity", "location", "Lisbon")
        await mem.flush()
        await mem.close_session("ana", "s0")
        await mem.maintain()
        await mem.flush()
        assert await mem.recall("ana", "Lisbon jazz", link_depth=2)
        assert await mem.recall("ana", "Lisbon", since=T0 - timedelta(days=1),
                                until=T0 + timedelta(days=1)) is not None
        await mem.retrieve_memory("ana", "jazz club", conversation_id="s1")
        for s in range(4):
            turns = await mem.session_history("ana", f"s{s}", limit=1000)
            assert [t.seq for t in turns] == list(range(len(turns)))
        assert [t.text for t in await mem.session_history("ana", "s3", limit=100)] == [
            f"same instant {j}" for j in range(50)]
    await _verified(store_path)


async def test_a_snapshot_racing_forget_user_is_wholly_before_or_after(store_path,
                                                                       tmp_path) -> None:
    """Snapshots taken while a user is forgotten: each restores to a store that verifies
    and holds either all of the user (turns, facts, notes) or none of it."""
    async with open_engine(store_path, clock=StepClock()) as mem:
        for round_ in range(3):
            user = f"v{round_}"
            for i in range(20):
                await mem.add_turn(user, "s", "user", f"I live in Oslo, turn {i}")
            await mem.remember_fact(user, "identity", "location", "Oslo")
            await mem.store_note(user, "a note about Oslo")
            await mem.flush()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(mem.snapshot, tmp_path / f"snap{round_}")
                for _ in range(round_ * 3):
                    await trio.lowlevel.checkpoint()
                nursery.start_soon(mem.forget_user, user)
    for round_ in range(3):
        user, restored = f"v{round_}", tmp_path / f"restored{round_}"
        await Engine.restore(tmp_path / f"snap{round_}", restored)
        await _verified(restored)
        async with open_engine(restored) as mem:
            await mem.flush()
            turns = await mem.session_history(user, "s", limit=100)
            facts = await mem.profile(user)
            notes = [h for h in await mem.recall(user, "note Oslo", kinds=["note"])]
            assert (len(turns), len(facts), len(notes)) in ((0, 0, 0), (20, 1, 1))
