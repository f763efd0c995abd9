"""One bad record never stops the engine: a follower that fails on one record records the
failure and goes on; a store whose derived work fails on one record still opens; a group commit
isolates the op that fails, so the rest of the batch commits and only its caller gets the error."""

from __future__ import annotations

import io
import json
from datetime import datetime, timezone
from pathlib import Path

import pytest
import trio

from actors.base.messages import PutNote, PutState
from actors.store import LogFollower
from engine import Engine, Failure, HashEmbedder, InvalidInput, Note, RecordRefused
from engine.__main__ import main

from ..conftest import open_engine

UTC = timezone.utc


async def _old_store_with_a_date_the_index_cannot_hold(path: Path) -> None:
    """What a build before the date check could write: a turn from the year 1500 (appended
    behind the facade's back, as that build's add_turn did)."""
    async with open_engine(path, config={"long_term": False}) as mem:
        await mem.add_turn("ana", "s", "user", "before the bad one", durable=True)
        mem._buffer.append("ana", "s", "user", "a turn from 1500",
                           datetime(1500, 1, 1, tzinfo=UTC), {})
        await mem.add_turn("ana", "s", "user", "after the bad one", durable=True)


async def test_a_store_whose_index_cannot_take_one_record_opens_and_lists_it(
        store_path: Path) -> None:
    """The text index skips the record and keeps a failure naming its lsn and the error; every
    other record is searchable; stats counts it; the store opens again and again."""
    await _old_store_with_a_date_the_index_cannot_hold(store_path)
    for _ in range(2):
        async with open_engine(store_path) as mem:
            await mem.flush()
            hits = await mem.recall("ana", "after the bad one", kinds=["turn"])
            assert "after the bad one" in [h.text for h in hits]
            failures = await mem.failures()
            assert [(f.lsn, f.actor, f.user_id) for f in failures] == [(2, "fulltext", "ana")]
            assert "out of range" in failures[0].error
            assert (await mem.stats()).failures == 1
            await mem.add_turn("ana", "s", "user", "serving on", durable=True)


def test_inspect_lists_the_failures(store_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`engram inspect STORE --failures` prints each failure with its lsn, actor and error."""

    async def fill() -> None:
        await _old_store_with_a_date_the_index_cannot_hold(store_path)
        async with open_engine(store_path) as mem:
            await mem.flush()

    trio.run(fill)
    assert main(["inspect", str(store_path), "--failures", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [(f["lsn"], f["actor"]) for f in report["failures"]] == [(2, "fulltext")]


async def test_a_follower_failing_on_one_record_quarantines_it_and_goes_on(mem: Engine) -> None:
    """The failing record is kept as a failure (lsn, actor, error); the records around it are
    handled; the watermark passes it, so a restart does not trip over it again."""
    store = mem._store
    handled: list[str] = []

    async def handle(records, last):
        for r in records:
            if "poison" in r.text:
                raise ValueError(f"cannot take {r.text!r}")
        handled.extend(r.text for r in records)
        return (), ()

    follower = LogFollower(store, b"probe_lsn", 64, handle)
    async with trio.open_nursery() as nursery:
        await nursery.start(follower.run)
        for text in ("one", "two poison", "three"):
            await mem.add_turn("ana", "s", "user", text)
        await mem.flush()
        await follower.wait(store.next_lsn - 1)
        nursery.cancel_scope.cancel()
    assert handled == ["one", "three"]
    (failure,) = await mem.failures()
    assert (failure.lsn, failure.actor, failure.memory_id) == (2, "probe", failure.memory_id)
    assert "cannot take 'two poison'" in failure.error
    assert follower.watermark == store.next_lsn - 1


async def test_a_group_commit_isolates_the_op_that_fails(store_path: Path) -> None:
    """A note whose key LMDB cannot hold (written behind the facade's checks) fails alone: its
    caller gets RecordRefused naming its lsn, the turns in the same batch commit, the log keeps
    no gap, and the engine serves on and reopens."""
    async with open_engine(store_path) as mem:
        store = mem._store
        receipts = [await mem.add_turn(f"user{i}", "s", "user", f"turn {i}") for i in range(8)]
        lsn = store.next_lsn
        now = datetime(2026, 1, 1, tzinfo=UTC)
        store.submit(PutNote(lsn, Note(lsn, "n" * 600, "ana", "text", (), now, now), -1))
        after = [await mem.add_turn(f"user{i}", "s", "user", f"later {i}") for i in range(8)]
        with pytest.raises(RecordRefused, match=f"the store refused the record at lsn {lsn}") as info:
            await store.wait_committed(lsn)
        assert isinstance(info.value, InvalidInput) and info.value.lsn == lsn
        for receipt in receipts + after:
            await receipt.durable()
        with pytest.raises(RecordRefused):
            await store.write_unlogged(PutState(((b"notes", b"k" * 600, b"v", 0),), (),
                                                trio.Event()))
        await mem.add_turn("ana", "s", "user", "serving on", durable=True)
        with pytest.raises(RecordRefused, match=f"lsn {lsn}"):
            await mem.flush()  # it promises what came before it is on disk: not that note
        await mem.flush()
        assert {f.actor for f in await mem.failures()} == {"store"}
    async with open_engine(store_path) as mem:
        for i in range(8):
            assert [t.text for t in await mem.session_history(f"user{i}", "s")] == [
                f"turn {i}", f"later {i}"]
        assert (await mem.stats()).committed_lsn == 18
        assert all(isinstance(f, Failure) for f in await mem.failures())


async def test_a_pending_review_for_any_conversation_never_kills_the_engine(mem: Engine) -> None:
    """retrieve_memory records its pending review without waiting; the engine stays up."""
    await mem.add_turn("ana", "s", "user", "I like green tea in the morning")
    await mem.close_session("ana", "s")
    await mem.flush()
    await mem.retrieve_memory("ana", "green tea", conversation_id="c" * 250)
    await mem.flush()
    await mem.add_turn("ana", "c" * 250, "assistant", "green tea it is", durable=True)
    await mem.flush()
    assert await mem.failures() == []


class _ChokesOnPoison(HashEmbedder):
    """An embedding backend (the edge) that fails on any batch holding the word "poison"."""

    def encode(self, texts: list[str]):
        if any("poison" in text for text in texts):
            raise RuntimeError("the model cannot take this text")
        return super().encode(texts)


async def test_the_embedder_keeps_a_record_it_cannot_embed_as_a_failure(store_path: Path) -> None:
    """The batch around it gets its vectors; the record keeps its text-index entry, no vector,
    and a failure; the engine serves and reopens."""
    async with Engine.open(store_path, embedder=_ChokesOnPoison(),
                           config={"long_term": False}) as mem:
        for text in ("green tea", "poison ivy", "black coffee"):
            await mem.add_turn("ana", "s", "user", text)
        await mem.flush()
        assert [(f.lsn, f.actor) for f in await mem.failures()] == [(2, "embedder")]
        assert [h.text for h in await mem.recall("ana", "black coffee", limit=1)] == [
            "black coffee"]
        assert "poison ivy" in [h.text for h in await mem.recall("ana", "ivy")]
        assert (await mem.stats()).embedded_lsn == 3
    async with Engine.open(store_path, embedder=_ChokesOnPoison()) as mem:
        await mem.add_turn("ana", "s", "user", "still serving", durable=True)
        await mem.flush()
        assert (await mem.stats()).failures == 1


async def test_a_refused_turn_reaches_its_receipt_and_the_next_flush_with_its_id(
        store_path: Path) -> None:
    """A turn the store refuses (ids over the byte limit, appended behind the facade's checks):
    its durable receipt raises RecordRefused naming its lsn and turn id, the next flush raises
    it once, the turns around it land."""
    async with open_engine(store_path) as mem:
        before = await mem.add_turn("bo", "s", "user", "before")
        bad = mem._buffer.append("€" * 200, "€" * 200, "user", "refused",
                                 datetime(2026, 1, 1, tzinfo=UTC), {})
        after = await mem.add_turn("bo", "s", "user", "after")
        with pytest.raises(RecordRefused, match=bad.turn_id) as info:
            await bad.durable()
        assert (info.value.lsn, info.value.memory_id) == (bad.lsn, bad.turn_id)
        await before.durable()
        await after.durable()
        with pytest.raises(RecordRefused, match=f"lsn {bad.lsn}"):
            await mem.flush()
        await mem.flush()  # reported once
    async with open_engine(store_path) as mem:
        assert [t.text for t in await mem.session_history("bo", "s")] == ["before", "after"]
        (failure,) = await mem.failures()
        assert (failure.lsn, failure.actor, failure.memory_id) == (bad.lsn, "store", bad.turn_id)


async def test_a_store_from_before_failures_were_kept_opens_read_only(store_path: Path) -> None:
    """A store without the failures database (written before it existed) is read by a
    read-only engine, which creates nothing: it has no failures; verify and compact read it."""
    import lmdb

    async with open_engine(store_path) as mem:
        await mem.add_turn("ana", "s", "user", "hello", durable=True)
    env = lmdb.open(str(store_path), max_dbs=64)
    with env.begin(write=True) as txn:
        txn.drop(env.open_db(b"failures", txn=txn), delete=True)
    env.close()
    async with open_engine(store_path, read_only=True) as mem:
        assert (await mem.stats()).failures == 0
        assert await mem.failures() == []
        assert [t.text for t in await mem.session_history("ana", "s")] == ["hello"]
    assert (await Engine.verify(store_path))["ok"]
    await Engine.compact(store_path)


async def test_a_refused_turn_in_a_bulk_run_is_refused_alone(store_path: Path) -> None:
    """A turn the store refuses inside a run of turns appended in bulk (an id over the byte
    limit, behind the facade's checks): its receipt raises RecordRefused with its lsn, its log
    position holds a tombstone, every other turn of the run lands, and the chain verifies."""
    at = datetime(2026, 1, 1, tzinfo=UTC)
    users = ["bo", "bo", "€" * 200, "bo", "cy"]
    async with open_engine(store_path, config={"long_term": False}) as mem:
        receipts = mem._buffer.append_many(
            users, ["s", "s", "€" * 200, "s", "s"], ["user"] * 5,
            [f"turn {i}" for i in range(5)], [at] * 5, [{}] * 5, [None] * 5, [None] * 5)
        bad = receipts[2]
        with pytest.raises(RecordRefused, match=bad.turn_id) as info:
            await bad.durable()
        assert (info.value.lsn, info.value.memory_id) == (bad.lsn, bad.turn_id)
        for receipt in receipts[:2] + receipts[3:]:
            await receipt.durable()
        with pytest.raises(RecordRefused, match=f"lsn {bad.lsn}"):
            await mem.flush()
    async with open_engine(store_path) as mem:
        assert [t.text for t in await mem.session_history("bo", "s")] == [
            "turn 0", "turn 1", "turn 3"]
        assert [t.seq for t in await mem.session_history("bo", "s")] == [0, 1, 2]
        assert [t.text for t in await mem.session_history("cy", "s")] == ["turn 4"]
        (failure,) = await mem.failures()
        assert (failure.lsn, failure.actor, failure.memory_id) == (bad.lsn, "store", bad.turn_id)
    report = await Engine.verify(store_path)
    assert report["ok"], report["problems"]


async def test_reads_after_a_refused_record_answer_a_bystander(store_path: Path) -> None:
    """The newest logged record was refused (a turn appended behind the facade's checks):
    its own receipt and the next flush say so, but a read that waits for what was logged
    before it (another user's profile, notes, export, briefing, a recall as of a time) is
    not that record's caller, and answers."""
    async with open_engine(store_path) as mem:
        await mem.add_turn("bo", "s", "user", "I live in Porto.", durable=True)
        await mem.store_note("bo", "likes tea")
        bad = mem._buffer.append("€" * 200, "€" * 200, "user", "refused",
                                 datetime(2026, 1, 1, tzinfo=UTC), {})
        with pytest.raises(RecordRefused, match=bad.turn_id):
            await bad.durable()
        assert "bo" in await mem.list_users()
        assert [n.text for n in await mem.list_notes("bo")] == ["likes tea"]
        assert isinstance(await mem.profile("bo", as_of=datetime(2030, 1, 1, tzinfo=UTC)), list)
        await mem.fact_history("bo", "location", "city")
        export = io.BytesIO()
        await mem.export_user("bo", export)
        assert b"likes tea" in export.getvalue()
        await mem.recall("bo", "Porto", as_of=datetime(2030, 1, 1, tzinfo=UTC))
        await mem.context_for_prompt("bo", "s2")
        with pytest.raises(RecordRefused, match=f"lsn {bad.lsn}"):
            await mem.flush()  # its report is the flush's, once
