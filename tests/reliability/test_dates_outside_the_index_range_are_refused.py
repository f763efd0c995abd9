"""A date the text index cannot hold (case 2 of issue 11) is refused at the call with the
supported range in the message, for every argument that takes one; nothing is written."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from engine import Engine, InvalidInput

from ..conftest import open_engine

UTC = timezone.utc
OUTSIDE = [
    datetime(1500, 1, 1, tzinfo=UTC),
    datetime(3000, 1, 1, tzinfo=UTC),
    datetime.max.replace(tzinfo=UTC),
    datetime.min.replace(tzinfo=UTC),
    datetime(1699, 12, 31, 23, tzinfo=timezone(timedelta(hours=-5))),  # 1700 in UTC: inside
]
RANGE = r"expected a date from 1700-01-01 to 2199-12-31 \(UTC\)"


@pytest.mark.parametrize("at", OUTSIDE[:4], ids=["1500", "3000", "max", "min"])
async def test_add_turn_refuses_a_date_outside_the_range(store_path: Path, at: datetime) -> None:
    """add_turn and add_turns refuse it; bystanders' turns and the store survive a reopen."""
    async with open_engine(store_path) as mem:
        await mem.add_turn("bo", "s", "user", "bystander")
        with pytest.raises(InvalidInput, match=RANGE) as info:
            await mem.add_turn("ana", "s1", "user", "hello", at=at)
        assert info.value.field == "at"
        with pytest.raises(InvalidInput, match=RANGE) as info:
            await mem.add_turns([{"user_id": "ana", "session_id": "s1", "role": "user",
                                  "text": "fine"},
                                 {"user_id": "ana", "session_id": "s1", "role": "user",
                                  "text": "bad", "at": at}])
        assert info.value.field == "items[1].at"
        await mem.flush()
    async with open_engine(store_path, config={"long_term": False}) as mem:
        assert (await mem.stats()).turns == 1
        assert [h.text for h in await mem.recall("bo", "bystander")] == ["bystander"]


async def test_a_date_inside_the_range_in_another_zone_is_taken(mem: Engine) -> None:
    """The check is made in UTC: 1699-12-31 23:00 at UTC-5 is 1700-01-01 04:00 UTC."""
    receipt = await mem.add_turn("ana", "s1", "user", "old times", at=OUTSIDE[4], durable=True)
    turn = await mem.get_turn("ana", receipt.turn_id)
    assert turn.at == datetime(1700, 1, 1, 4, tzinfo=UTC)


@pytest.mark.parametrize("field", ["since", "until"])
async def test_recall_names_since_and_until(mem: Engine, field: str) -> None:
    """A bad since/until is InvalidInput naming that field, never an exception group or `at`."""
    with pytest.raises(InvalidInput, match=RANGE) as info:
        await mem.recall("ana", "anything", **{field: datetime(1500, 1, 1, tzinfo=UTC)})
    assert info.value.field == field
    with pytest.raises(InvalidInput, match="expected a timezone-aware datetime") as info:
        await mem.recall("ana", "anything", **{field: "yesterday"})
    assert info.value.field == field


async def test_fact_and_link_dates_are_checked(mem: Engine) -> None:
    """remember_fact(valid_at=) and link(at=) take the same range."""
    with pytest.raises(InvalidInput, match=RANGE) as info:
        await mem.remember_fact("ana", "identity", "city", "Lisbon",
                                valid_at=datetime(3000, 1, 1, tzinfo=UTC))
    assert info.value.field == "valid_at"
    a = await mem.add_turn("ana", "s1", "user", "one")
    b = await mem.add_turn("ana", "s1", "user", "two")
    with pytest.raises(InvalidInput, match=RANGE) as info:
        await mem.link("ana", a.turn_id, b.turn_id, at=datetime(1500, 1, 1, tzinfo=UTC))
    assert info.value.field == "at"


async def test_an_engine_clock_outside_the_range_is_refused(store_path: Path) -> None:
    """A clock outside the range is refused at open; one that leaves it later fails the call
    that uses it (a turn, a fact: the text index cannot hold either), not the store."""
    with pytest.raises(InvalidInput, match=RANGE) as info:
        async with open_engine(store_path, clock=lambda: datetime(2500, 1, 1, tzinfo=UTC)):
            pass
    assert info.value.field == "clock"
    readings = iter([datetime(2026, 1, 1, tzinfo=UTC)])
    async with open_engine(store_path,
                           clock=lambda: next(readings, datetime(2500, 1, 1, tzinfo=UTC))
                           ) as mem:
        for call in (lambda: mem.add_turn("ana", "s1", "user", "hello"),
                     lambda: mem.remember_fact("ana", "identity", "location", "Porto"),
                     lambda: mem.correct_fact("ana", "identity", "location", "Faro"),
                     lambda: mem.forget_fact("ana", "identity", "location")):
            with pytest.raises(InvalidInput, match=RANGE) as info:
                await call()
            assert info.value.field == "clock"
        with pytest.raises(InvalidInput, match=RANGE) as info:
            mem.add_turn_nowait("ana", "s1", "user", "hello")
        assert info.value.field == "clock"
        assert await mem.session_history("ana", "s1") == []
        assert await mem.fact_versions("ana") == []


async def test_a_clock_that_leaves_the_range_stamps_nothing(store_path: Path,
                                                             tmp_path: Path) -> None:
    """Turns given their own times go on being taken in after the clock has left the range;
    what the engine would stamp with the clock (an extracted fact, an episode, a review, a
    summary, a pruned fact) is refused or kept as a failure, never stored with a time the
    text index cannot hold, so the store's own export still imports."""
    late = [False]

    def clock() -> datetime:
        return datetime(2500, 1, 1, tzinfo=UTC) if late[0] else datetime(2026, 1, 1,
                                                                          tzinfo=UTC)
    at = datetime(2026, 1, 1, tzinfo=UTC)
    async with open_engine(store_path, clock=clock,
                           config={"episode_after_turns": 4, "episode_keep_turns": 1}) as mem:
        turn = await mem.add_turn("ana", "s1", "user", "I live in Lisbon.", at=at)
        await mem.flush()
        late[0] = True
        for i in range(6):
            await mem.add_turn("ana", "s1", "user", f"I moved to Porto, day {i}.",
                               at=at + timedelta(minutes=i + 1))
        await mem.flush()
        for call in (lambda: mem.close_session("ana", "s1"),
                     lambda: mem.review("ana", turn.turn_id, "good"),
                     lambda: mem.write_session_summary("ana", "s1", "lives in Porto", 1, 0),
                     mem.maintain):
            try:
                await call()
            except InvalidInput as exc:
                assert exc.field == "clock"
        await mem.flush()
        late[0] = False  # the clock back in range: what was stored is what the export holds
        export = tmp_path / "ana.jsonl"
        await mem.export_user("ana", export)
    async with open_engine(tmp_path / "other") as mem:
        await mem.import_user(export)


async def test_a_cluster_node_rates_reviews_at_the_replys_logged_time(store_path: Path) -> None:
    """A cluster node rates a pending review at its reply's logged time and never reads its
    own clock for it: a node whose clock left the range kept the reply as a failure."""
    late = [False]

    def clock() -> datetime:
        return datetime(2500, 1, 1, tzinfo=UTC) if late[0] else datetime(2026, 1, 1,
                                                                          tzinfo=UTC)
    at = datetime(2026, 1, 1, tzinfo=UTC)
    async with open_engine(store_path, clock=clock) as mem:
        mem._parts.compressor.timed_by_log = True  # as a cluster node's engine is
        for i in range(3):
            await mem.add_turn("ana", "old", "user", f"We hiked the volcano trail {i}",
                               at=at + timedelta(minutes=i))
        await mem.flush()
        raw = await mem.retrieve_memory_raw("ana", "volcano trail", conversation_id="chat")
        late[0] = True
        await mem.add_turn("ana", "chat", "assistant", "The volcano trail was steep.",
                           at=at + timedelta(hours=1))
        await mem.flush()
        assert await mem.failures() == []
        late[0] = False
        assert (await mem.review("ana", raw.episodic[0].id, "good")).reps == 2
