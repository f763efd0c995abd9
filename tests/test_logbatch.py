"""apply_log_batch: a cluster's log applied exactly once, with its watermark, in log order."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import trio
import trio.testing

import actors.store as store_mod
from actors.facts import Facts
from engine import EngineBroken, EngineClosed, InvalidInput
from engine._logbatch import LogForget, LogForgetScope, LogTurn, decode_entry, encode_entry

from .conftest import T0, StepClock, open_engine


def turn(n: int, user: str = "ana", session: str = "s1") -> LogTurn:
    return LogTurn(user, session, f"t_{n:020x}", "user", f"turn number {n}",
                   T0 + timedelta(seconds=n))


async def test_batch_applies_turns_in_log_order_and_moves_the_watermark(store_path: Path) -> None:
    """Turns land with seqs in log order; the watermark is the batch's last sequence."""
    async with open_engine(store_path) as mem:
        mark = await mem.apply_log_batch(3, [(1, turn(1)), (2, turn(2)), (5, turn(5))])
        assert mark == 5
        history = await mem.session_history("ana", "s1")
        assert [(t.seq, t.turn_id) for t in history] == [
            (0, turn(1).turn_id), (1, turn(2).turn_id), (2, turn(5).turn_id)]
    async with open_engine(store_path) as mem:
        assert await mem.apply_log_batch(3, [(4, turn(4)), (5, turn(5))]) == 5
        assert len(await mem.session_history("ana", "s1")) == 3


async def test_entries_at_or_below_the_watermark_are_skipped_after_a_reopen(
        store_path: Path) -> None:
    """A replay from an older position (a consumer re-read) applies nothing twice."""
    async with open_engine(store_path) as mem:
        await mem.apply_log_batch(0, [(n, turn(n)) for n in range(1, 11)])
    async with open_engine(store_path) as mem:
        mark = await mem.apply_log_batch(0, [(n, turn(n)) for n in range(1, 16)])
        assert mark == 15
        history = await mem.session_history("ana", "s1", limit=100)
        assert [t.turn_id for t in history] == [turn(n).turn_id for n in range(1, 16)]
        assert [t.seq for t in history] == list(range(15))


async def test_a_turn_id_seen_before_is_skipped_and_counted(store_path: Path) -> None:
    """A publisher's retry beyond the log's duplicate window does not make a second turn."""
    async with open_engine(store_path) as mem:
        await mem.apply_log_batch(1, [(1, turn(1)), (2, turn(2))])
        await mem.apply_log_batch(1, [(3, turn(1))])
        assert len(await mem.session_history("ana", "s1")) == 2
        assert mem._partition_log.duplicates == 1
    async with open_engine(store_path) as mem:
        await mem.apply_log_batch(1, [(4, turn(2)), (5, turn(6))])  # the store remembers it
        assert [t.turn_id for t in await mem.session_history("ana", "s1")] == [
            turn(1).turn_id, turn(2).turn_id, turn(6).turn_id]


async def test_a_forget_tombstone_applies_in_log_order(store_path: Path) -> None:
    """Turns before the tombstone are forgotten, turns after it stay."""
    async with open_engine(store_path) as mem:
        await mem.apply_log_batch(2, [(1, turn(1)), (2, turn(2, session="s2")),
                                      (3, LogForget("ana", "s1")), (4, turn(4))])
        assert [t.turn_id for t in await mem.session_history("ana", "s1")] == [turn(4).turn_id]
        assert len(await mem.session_history("ana", "s2")) == 1
        await mem.apply_log_batch(2, [(5, LogForget("ana"))])
        assert await mem.list_sessions("ana") == []


async def test_malformed_batches_are_refused_before_anything_is_written(
        store_path: Path) -> None:
    """Sequences must increase; the partition must be a number; nothing lands otherwise."""
    async with open_engine(store_path) as mem:
        with pytest.raises(InvalidInput, match="increasing"):
            await mem.apply_log_batch(0, [(2, turn(2)), (2, turn(3))])
        with pytest.raises(InvalidInput, match="partition"):
            await mem.apply_log_batch(-1, [(1, turn(1))])
        # Past what a sequence or a watermark key holds: refused too, not written and then
        # failed (an OverflowError, a key LMDB refused) with the turns already in.
        with pytest.raises(InvalidInput, match="partition"):
            await mem.apply_log_batch(10 ** 600, [(1, turn(1))])
        with pytest.raises(InvalidInput, match=r"2\*\*63-1"):
            await mem.apply_log_batch(1, [(1, turn(1)), (2 ** 64, turn(2))])
        # set_log_watermark holds the same rules (True was partition 1's watermark).
        for partition, seq, field in ((True, 7, "partition"), (-1, 7, "partition"),
                                      (10 ** 600, 7, "partition"), ("3", 7, "partition"),
                                      (1, 2 ** 64, "seq")):
            with pytest.raises(InvalidInput) as info:
                await mem.set_log_watermark(partition, seq)
            assert info.value.field == field
        assert await mem._partition_log.watermark(1) == 0
        await mem.flush()
        assert await mem.list_sessions("ana") == []


async def test_an_entry_that_fails_the_engines_checks_is_skipped_not_fatal(
        store_path: Path) -> None:
    """A bad entry in the log cannot block its partition: it is counted and passed over."""
    async with open_engine(store_path) as mem:
        bad = LogTurn("ana", "s1", "t_bad", "robot", "hello", T0)
        assert await mem.apply_log_batch(0, [(1, bad), (2, turn(2))]) == 2
        assert [t.turn_id for t in await mem.session_history("ana", "s1")] == [turn(2).turn_id]
        assert mem._partition_log.invalid == 1


@pytest.mark.parametrize("error", [EngineClosed("the engine was closed"),
                                   EngineBroken("the store failed")])
async def test_a_call_the_engine_could_not_run_is_not_passed_by_the_watermark(
        store_path: Path, error: Exception) -> None:
    """A logged call that met a closing or broken engine was counted invalid, its error kept
    as the entry's result, and its position written as applied: a restart resumed after a
    call it never ran. That error is this engine's state, not the entry's outcome: it is
    raised, and the watermark stays before the entry, which a replay then applies."""
    from engine._logbatch import LogCall

    call = LogCall("ana", "store_note", {"text": "tea at five", "note_id": "n_1"})
    async with open_engine(store_path) as mem:
        assert await mem.apply_log_batch(0, [(1, turn(1))]) == 1

        async def failing(*args: object, **kwargs: object) -> None:
            raise error

        mem.store_note = failing
        with pytest.raises(type(error)):
            await mem.apply_log_batch(0, [(2, call)])
        del mem.store_note
        assert await mem.apply_log_batch(0, []) == 1
        assert mem._partition_log.invalid == 0
        assert await mem.apply_log_batch(0, [(2, call)]) == 2
        assert [n.text for n in await mem.list_notes("ana")] == ["tea at five"]


def test_entries_round_trip_through_their_bytes() -> None:
    """What a publisher encodes, the applier decodes; garbage is an InvalidInput."""
    for entry in (turn(1), LogForget("ana"), LogForget("ana", "s1")):
        assert decode_entry(encode_entry(entry)) == entry
    with pytest.raises(InvalidInput, match="log entry"):
        decode_entry(b"\x93garbage")
    # Nested past the decoder's depth (a hand-published entry): the same InvalidInput, which
    # the applier counts and skips, where a RecursionError broke the node on it every restart.
    with pytest.raises(InvalidInput, match="nested deeper"):
        decode_entry(b"\x81\xa1a" * 5_000 + b"\xc0")


async def test_turns_and_watermark_commit_in_one_transaction_even_past_the_batch_limit(
        store_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer never cuts a batch between a log batch's turns and its watermark: with a
    batch limit of 3 ops, ten turns and the watermark still go in one write transaction."""
    from actors.store import writer

    monkeypatch.setattr(writer, "BATCH_MAX", 3)
    async with open_engine(store_path, config={"long_term": False}) as mem:
        store = mem._store
        seen: list[list[str]] = []
        real = store._write

        def spy(segments, last, flush):
            kinds = []
            for seg in segments:
                kinds += ["turn"] * len(seg.ops) if hasattr(seg, "ops") else [type(seg).__name__]
            seen.append(kinds)
            return real(segments, last, flush)

        monkeypatch.setattr(store, "_write", spy)
        await mem.apply_log_batch(0, [(n, turn(n)) for n in range(1, 11)])
        together = [kinds for kinds in seen if "PutState" in kinds and "turn" in kinds]
        assert together and together[-1].count("turn") == 10, seen


async def test_each_logged_call_and_forget_commits_in_the_transaction_of_its_watermark(
        store_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every kind of call (and a forget) writes one op, and that op commits in the same write
    transaction as the watermark moved to its log sequence: a crash keeps both or neither."""
    from engine._logbatch import LogCall, watermark_key

    async with open_engine(store_path, config={"long_term": False}) as mem:
        await mem.apply_log_batch(0, [(n, turn(n)) for n in range(1, 4)])
        await mem.flush()
        store = mem._store
        batches: list[list[tuple[str, int | None]]] = []  # (op kind, watermark) per commit
        real = store._write

        def spy(segments, last, flush):
            ops: list[tuple[str, int | None]] = []
            for seg in segments:
                if hasattr(seg, "ops"):
                    ops += [("AppendTurn", None)] * len(seg.ops)
                    continue
                mark = None
                for db, key, value, _ in getattr(seg, "puts", ()):
                    if db == b"meta" and key == watermark_key(0):
                        mark = int.from_bytes(value, "big")
                ops.append((type(seg).__name__, mark))
            batches.append(ops)
            return real(segments, last, flush)

        def written_with(seq: int) -> str:
            """The op just before the put of watermark ``seq``, in the same commit."""
            found = [ops[i - 1][0] for ops in batches for i, (_, mark) in enumerate(ops)
                     if mark == seq and i > 0]
            assert len(found) == 1, batches
            return found[0]

        monkeypatch.setattr(store, "_write", spy)
        t1, t2 = turn(1).turn_id, turn(2).turn_id
        calls = [  # (method, arguments, the op it writes)
            ("store_note", {"text": "likes tea", "note_id": "n_1", "tags": ["drinks"]},
             "PutNote"),
            ("update_note", {"note_id": "n_1", "text": "likes green tea"}, "PutNote"),
            ("remember_fact", {"category": "pets", "key": "cat", "value": "Miso",
                               "valid_at": T0}, "PutFact"),
            ("remember_fact", {"category": "pets", "key": "cat", "value": "Miso",
                               "valid_at": T0}, "PutState"),  # reinforced: rewritten in place
            ("correct_fact", {"category": "pets", "key": "cat", "value": "Mochi"}, "PutFact"),
            ("confirm_fact", {"category": "pets", "key": "cat"}, "PutState"),
            ("forget_fact", {"category": "pets", "key": "cat"}, "PutFact"),
            ("link", {"from_id": t1, "to_id": t2, "type": "about", "at": T0}, "PutLink"),
            ("review", {"memory_id": t1, "rating": "good"}, "PutState"),
            ("write_session_summary", {"session_id": "s1", "summary": "tea talk",
                                       "upper_seq": 2, "expected_epoch": 0}, "WriteSummary"),
            ("close_session", {"session_id": "s1"}, "PutEpisode"),
            ("delete_note", {"note_id": "n_1"}, "DeleteNote"),
        ]
        seq = 3
        for method, args, op in calls:
            seq += 1
            results: dict = {}
            assert await mem.apply_log_batch(0, [(seq, LogCall("ana", method, args))],
                                             results) == seq
            assert not isinstance(results[seq], BaseException), (method, results[seq])
            assert written_with(seq) == op, method
        seq += 1
        await mem.apply_log_batch(0, [(seq, LogForget("ana", "s1"))])
        assert written_with(seq) == "Forget"
        assert mem._partition_log.split == 0 and mem._partition_log.invalid == 0


def scoped(n: int, session: str = "s1", agent_id: str | None = "bot",
           run_id: str | None = "r1", user: str = "ana") -> LogTurn:
    return LogTurn(user, session, f"t_{n:020x}", "user", f"scoped turn {n}",
                   T0 + timedelta(seconds=n), agent_id=agent_id, run_id=run_id)


def test_an_entry_written_before_scopes_decodes_with_none() -> None:
    """A turn entry encoded before the log carried scopes (no agent_id / run_id keys) and a
    scoped one both decode; an unscoped turn's bytes are what they were (the fields are left
    out when empty), so every node reads every entry of the log."""
    import msgspec

    class OldTurn(msgspec.Struct, frozen=True, tag="turn", omit_defaults=True):
        user_id: str
        session_id: str
        turn_id: str
        role: str
        text: str
        at: object
        meta: dict | None = None

    old = OldTurn("ana", "s1", "t_1", "user", "hello", T0)
    data = msgspec.msgpack.encode(old)
    assert decode_entry(data) == LogTurn("ana", "s1", "t_1", "user", "hello", T0)
    assert encode_entry(LogTurn("ana", "s1", "t_1", "user", "hello", T0)) == data
    for entry in (scoped(1), LogForgetScope("ana", "bot"), LogForgetScope("ana", None, "r1")):
        assert decode_entry(encode_entry(entry)) == entry


async def test_scoped_turns_apply_as_the_engine_files_them(store_path: Path,
                                                          tmp_path: Path) -> None:
    """A scoped turn from the log files its session under the scope, a later turn without a
    scope takes the session's, and one naming another scope is refused as add_turn refuses it
    (counted, skipped): the applied store holds what a single-process engine holds for the
    same calls."""
    async with open_engine(store_path) as mem:
        await mem.apply_log_batch(0, [(1, scoped(1)), (2, scoped(2, agent_id=None, run_id=None)),
                                      (3, scoped(3, agent_id="other")),
                                      (4, scoped(4, session="s2", run_id="r2")),
                                      (5, scoped(5, session="s2", agent_id=None, run_id="r2"))])
        assert mem._partition_log.invalid == 1
        applied = {s.session_id: (s.agent_id, s.run_id, s.turn_count)
                   for s in await mem.list_sessions("ana")}
        hits = [h.text for h in await mem.recall("ana", "scoped turn", kinds=["turn"],
                                                 run_id="r1")]
    async with open_engine(tmp_path / "single") as mem:
        await mem.add_turn("ana", "s1", "user", "scoped turn 1", agent_id="bot", run_id="r1")
        await mem.add_turn("ana", "s1", "user", "scoped turn 2")
        with pytest.raises(InvalidInput, match="agent_id"):
            await mem.add_turn("ana", "s1", "user", "scoped turn 3", agent_id="other",
                               run_id="r1")
        await mem.add_turn("ana", "s2", "user", "scoped turn 4", agent_id="bot", run_id="r2")
        await mem.add_turn("ana", "s2", "user", "scoped turn 5", run_id="r2")
        single = {s.session_id: (s.agent_id, s.run_id, s.turn_count)
                  for s in await mem.list_sessions("ana")}
    assert applied == {"s1": ("bot", "r1", 2), "s2": ("bot", "r2", 2)} == single
    assert sorted(hits) == ["scoped turn 1", "scoped turn 2"]


async def test_a_forget_scope_tombstone_applies_in_log_order(store_path: Path) -> None:
    """forget_scope in the log forgets that scope's sessions and notes as they stand at its
    place in the log; other scopes, and the scope's turns after it, stay; its watermark moves
    once everything is forgotten, and what it returned goes to the caller's results."""
    async with open_engine(store_path) as mem:
        await mem.apply_log_batch(0, [(1, scoped(1)), (2, scoped(2, session="s2", run_id="r2")),
                                      (3, turn(3, session="s3"))])
        results: dict[int, object] = {}
        mark = await mem.apply_log_batch(0, [(4, LogForgetScope("ana", run_id="r1")),
                                             (5, scoped(5, session="s4"))], results)
        assert mark == 5 and results == {4: {"sessions": 1, "notes": 0}}
        assert sorted(s.session_id for s in await mem.list_sessions("ana")) == ["s2", "s3", "s4"]
        await mem.apply_log_batch(0, [(6, LogForgetScope("ana", None, None))], results)
        assert isinstance(results[6], InvalidInput) and mem._partition_log.invalid == 1
        assert await mem._partition_log.watermark(0) == 6


async def test_two_stores_that_apply_a_call_at_different_times_make_the_same_records(
        tmp_path: Path) -> None:
    """A logged call carries its writer's time, and the owner applies it at that time with ids
    drawn from its place in the log: two nodes replaying the same entries a year apart make
    the same fact versions, note, review and episode (ids included), with the writer's
    times, not their own clocks'."""
    from engine._logbatch import LogCall

    logged = T0 + timedelta(days=3)
    t1 = turn(1).turn_id
    calls = {  # log sequence: (method, arguments); sequences 1-4 are turns
        5: ("store_note", {"text": "likes tea", "note_id": "n_1"}),
        6: ("update_note", {"note_id": "n_1", "text": "likes green tea"}),
        7: ("remember_fact", {"category": "pets", "key": "cat", "value": "Miso"}),
        8: ("correct_fact", {"category": "pets", "key": "cat", "value": "Mochi"}),
        9: ("confirm_fact", {"category": "pets", "key": "cat"}),
        10: ("review", {"memory_id": t1, "rating": "good"}),
        11: ("close_session", {"session_id": "s1"}),
        # Re-dated: Mochi since the second day (a datetime argument, through the entry's bytes).
        12: ("correct_fact", {"category": "pets", "key": "cat", "value": "Mochi",
                              "valid_at": T0 + timedelta(days=1)}),
    }
    answers = []
    for name, start in (("a", T0 + timedelta(days=10)), ("b", T0 + timedelta(days=400))):
        async with open_engine(tmp_path / name, config={"long_term": False},
                               clock=StepClock(start)) as mem:
            await mem.apply_log_batch(0, [(n, turn(n)) for n in range(1, 5)])
            results: dict = {}
            for seq, (method, args) in calls.items():
                entry = LogCall("ana", method, args, at=logged + timedelta(hours=seq))
                await mem.apply_log_batch(0, [(seq, decode_entry(encode_entry(entry)))],
                                          results)
            assert not any(isinstance(r, BaseException) for r in results.values()), results
            answers.append((results, await mem.fact_history("ana", "pets", "cat"),
                            await mem.get_note("ana", "n_1"), await mem.episodes("ana")))
    assert answers[0] == answers[1]
    results, history, note, episodes = answers[0]
    assert note.created_at == logged + timedelta(hours=5)
    assert note.updated_at == logged + timedelta(hours=6)
    first, second, third = sorted(history, key=lambda f: f.created_at)
    assert first.created_at == logged + timedelta(hours=7)
    assert second.created_at == logged + timedelta(hours=8)
    assert (third.value, third.valid_at, third.status) == ("Mochi", T0 + timedelta(days=1),
                                                           "active")
    assert second.status == "superseded" and second.invalid_at == third.valid_at
    # Mochi since day 1: Miso, recorded as true from later, was never in force.
    assert first.invalid_at == first.valid_at == logged + timedelta(hours=7)
    assert results[10].last_review == logged + timedelta(hours=10)  # the review's state
    assert results[11] is True and len(episodes) == 1  # close_session made one


async def test_a_forget_applies_after_the_followers_as_on_a_node_that_kept_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A forget deletes the facts extracted from its session without restoring the versions
    they retired: applied before a lagging node's fact extraction reached the session, it
    left "Lisbon" active where a node that kept up had it superseded by the forgotten
    "Porto". A forget now waits for the long-term followers, as a call that reads what they
    derive does."""
    entries = [(1, LogTurn("ana", "s1", "t1", "user", "I live in Lisbon.", T0)),
               (2, LogTurn("ana", "s2", "t2", "user", "I moved to Porto.",
                           T0 + timedelta(minutes=1))),
               (3, LogForget("ana", "s2"))]

    async def statuses(engine) -> list[tuple[str, str]]:
        await engine.flush()
        return sorted((f.value, f.status) for f in await engine._parts.store.read(
            store_mod.read_facts, "ana", False))

    async with open_engine(tmp_path / "kept-up", clock=StepClock()) as engine:
        await engine.apply_log_batch(0, entries[:2])
        await engine.flush()
        await engine.apply_log_batch(0, entries[2:])
        kept_up = await statuses(engine)
    gate = trio.Event()
    propose_all = Facts.propose_all

    async def held_back(self, proposals):
        await gate.wait()
        return await propose_all(self, proposals)

    monkeypatch.setattr(Facts, "propose_all", held_back)
    async with open_engine(tmp_path / "lagging", clock=StepClock()) as engine:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.apply_log_batch, 0, entries)
            await trio.testing.wait_all_tasks_blocked()
            gate.set()
        assert await statuses(engine) == kept_up == [("Lisbon", "superseded")]


async def test_a_logged_forget_and_the_reflections_it_deletes_commit_with_its_watermark(
        store_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """forget_session deletes the reflections quoting the session in the forget's own
    transaction; applied from the log, each of its ops is followed by the watermark's puts,
    and the group held together counted only the ops: a batch could be cut between the
    Forget (with the watermark) and the notes' deletions, and a crash there left the entry
    applied and the reflections quoting what it forgot. Batches of two ops show it."""
    from actors.store import writer as writer_mod

    from .actors.test_facts import ManualClock

    clock = ManualClock()
    async with open_engine(store_path, clock=clock) as mem:
        texts = [("private", "I'm allergic to peanuts."), ("private", "I moved to Porto."),
                 ("other", "I work as a pharmacist, long shifts.")]
        await mem.apply_log_batch(0, [
            (n, LogTurn("ana", session, f"t{n}", "user", text, T0))
            for n, (session, text) in enumerate(texts, 1)])
        await mem.flush()
        assert (await mem.maintain()).reflections == 1
        assert await mem._maintenance.reflect_on_switch("ana", mem._parts.store.next_lsn)
        assert len(await mem.list_notes("ana")) == 2
        store = mem._store
        commits: list[list[str]] = []
        real = store._write

        def spy(segments, last, flush):
            commits.append([type(seg).__name__ for seg in segments])
            return real(segments, last, flush)

        monkeypatch.setattr(store, "_write", spy)
        monkeypatch.setattr(writer_mod, "BATCH_MAX", 2)
        await mem.apply_log_batch(0, [(4, LogForget("ana", "private"))])
        await mem.flush()
        assert await mem.list_notes("ana") == []
    [forget] = [ops for ops in commits if "Forget" in ops]
    assert forget == ["Forget", "PutState", "DeleteNote", "PutState", "DeleteNote", "PutState"]


async def test_a_logged_forget_of_a_plan_writes_all_it_changes_with_its_watermark(
        store_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """forget_fact of a value due later puts back what it held true (of its key and of
    another key it superseded) and deletes the reflections quoting it: several ops. Written
    one transaction each, a crash after the first (which holds the watermark) left the rest
    unwritten on that node for good, since a replay skips the entry. They commit together."""
    from engine._logbatch import LogCall, watermark_key

    class Clock:
        now = T0

        def __call__(self):
            return self.now

    clock = Clock()
    async with open_engine(store_path, clock=clock) as mem:
        await mem.remember_fact("ana", "identity", "location", "Lisbon")
        await mem.remember_fact("ana", "preference", "jazz", "yes", text="likes jazz")
        await mem.remember_fact("ana", "work", "job", "nurse")
        await mem.remember_fact("ana", "preference", "jazz_later", "unsure",
                                text="unsure about jazz later")
        clock.now = T0 + timedelta(days=1)
        await mem.remember_fact("ana", "identity", "location", "Porto",
                                valid_at=T0 + timedelta(days=40))
        await mem.remember_fact("ana", "preference", "jazz_later", "no",
                                text="no longer likes jazz", valid_at=T0 + timedelta(days=40))
        await mem.flush()
        assert (await mem.maintain()).reflections == 1
        store = mem._store
        commits: list[list[tuple[str, bool]]] = []  # (op kind, holds the watermark) a commit
        real = store._write

        def spy(segments, last, flush):
            commits.append([(type(seg).__name__, any(
                db == b"meta" and key == watermark_key(0)
                for db, key, _, _ in getattr(seg, "puts", ()))) for seg in segments])
            return real(segments, last, flush)

        monkeypatch.setattr(store, "_write", spy)
        for seq, key in ((1, ("identity", "location")), (2, ("preference", "jazz_later"))):
            commits.clear()
            call = LogCall("ana", "forget_fact", {"category": key[0], "key": key[1]},
                           at=clock.now)
            results: dict = {}
            assert await mem.apply_log_batch(0, [(seq, call)], results) == seq
            assert results[seq] is True
            marked = [ops for ops in commits if any(mark for _, mark in ops)]
            assert len(marked) == 1, commits
            kinds = [kind for kind, _ in marked[0]]
            assert kinds.count("PutFact") == (1 if seq == 1 else 2), kinds
            assert kinds.count("DeleteNote") == (1 if seq == 1 else 0), kinds
        assert mem._partition_log.split == 0
        assert sorted(f.text for f in await mem.profile("ana")) == [
            "job: nurse", "likes jazz", "location: Lisbon", "unsure about jazz later"]
