"""A property test (issue 11): arbitrary unicode (lone surrogates, NULs, long and multi-byte
strings), ids, integers, datetimes and meta thrown at every public method only ever raise
InvalidInput; then the engine closes, reopens, every acknowledged turn is still there and every
search still answers. Deterministic (derandomized), bounded, with the HashEmbedder."""

from __future__ import annotations

import itertools
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import Engine, InvalidInput

from ..conftest import StepClock, open_engine

SPECIAL = ["€" * 200, "a" * 300, "x\ud800", "\udfff", "\x00", " ", "", "ana", "s1",
           "https://example.com/" + "p" * 600, "Maya Lindqvist", "I live in Lisbon",
           " ".join(["Word"] * 80), "#tag @someone 2026-01-02", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢" * 40]
ANY_CHAR = st.characters(codec=None, exclude_categories=())  # surrogates and controls too
VALID_TEXT = st.text(min_size=1, max_size=30).map(lambda s: s if s.strip() else s + "x")
# Weighted towards valid values, so that most examples store something to lose.
TEXT = st.one_of(VALID_TEXT, VALID_TEXT, st.sampled_from(SPECIAL), st.text(ANY_CHAR, max_size=30))
VALID_IDS = st.sampled_from(["ana", "bo", "s1", "s2"])
IDS = st.one_of(VALID_IDS, VALID_IDS, VALID_IDS, TEXT)
INTS = st.one_of(st.integers(), st.sampled_from([2**70, -(2**70), 2**63, -1, 0, 10**9]))
ZONES = st.sampled_from([timezone.utc, timezone(timedelta(hours=14)),
                         timezone(timedelta(hours=-12)), None])
DATES = st.one_of(st.datetimes(timezones=ZONES),
                  st.sampled_from([datetime(2026, 3, 1, tzinfo=timezone.utc),
                                   datetime.max.replace(tzinfo=timezone.utc),
                                   datetime(1500, 1, 1, tzinfo=timezone.utc)]))
SCALARS = st.one_of(st.none(), st.booleans(), INTS, st.floats(), TEXT)
META = st.one_of(st.none(), st.recursive(
    SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                     st.dictionaries(TEXT, inner, max_size=3)),
    max_leaves=6).map(lambda m: m if isinstance(m, dict) else {"v": m}))
OPTIONAL = lambda s: st.one_of(st.none(), s)  # noqa: E731
METHODS = ["add_turn", "add_turns", "recall", "retrieve_memory", "retrieve_memory_raw",
           "context_pre_retrieve", "store_note", "update_note", "delete_note", "get_note",
           "remember_fact", "correct_fact", "confirm_fact", "forget_fact", "profile",
           "fact_history", "link", "links", "review", "entity_info", "session_summary",
           "write_session_summary", "episodes", "close_session", "get_turn", "session_history",
           "list_sessions", "memory_stats", "forget_session", "forget_user", "call_tool"]
_dirs = itertools.count()


async def _call(mem: Engine, name: str, draw: Any, known: list[str],
                acked: dict[str, tuple[str, str, str]]) -> None:
    """Draw arguments for one method and call it; record acknowledged turns."""
    user, session = draw(IDS), draw(IDS)
    memory = draw(st.sampled_from(known)) if known and draw(st.booleans()) else draw(IDS)
    match name:
        case "add_turn":
            receipt = await mem.add_turn(user, session, draw(st.sampled_from(
                ["user", "assistant", "user", "bot"])), draw(TEXT),
                at=draw(st.one_of(st.none(), st.none(), DATES)), meta=draw(META))
            acked[receipt.turn_id] = (user, session, receipt)
        case "add_turns":
            items = draw(st.lists(st.fixed_dictionaries(
                {"user_id": IDS, "session_id": IDS, "role": st.just("user"), "text": TEXT},
                optional={"at": DATES, "meta": META}), min_size=1, max_size=3))
            for item, receipt in zip(items, await mem.add_turns(items), strict=True):
                acked[receipt.turn_id] = (item["user_id"], item["session_id"], receipt)
        case "recall":
            await mem.recall(user, draw(TEXT), draw(OPTIONAL(INTS)), since=draw(OPTIONAL(DATES)),
                             until=draw(OPTIONAL(DATES)), tags=draw(OPTIONAL(st.lists(TEXT))),
                             session_id=draw(OPTIONAL(IDS)))
        case "retrieve_memory" | "retrieve_memory_raw":
            await getattr(mem, name)(user, draw(TEXT), conversation_id=draw(OPTIONAL(IDS)),
                                     category=draw(OPTIONAL(IDS)))
        case "context_pre_retrieve":
            await mem.context_pre_retrieve(user, draw(TEXT), category=draw(OPTIONAL(IDS)))
        case "store_note":
            note = await mem.store_note(user, draw(TEXT), note_id=draw(OPTIONAL(IDS)),
                                        tags=draw(OPTIONAL(st.lists(TEXT, max_size=3))))
            known.append(note.note_id)
        case "update_note":
            await mem.update_note(user, memory, draw(TEXT), tags=draw(OPTIONAL(st.lists(TEXT))))
        case "delete_note" | "get_note":
            await getattr(mem, name)(user, memory)
        case "remember_fact" | "correct_fact":
            fact = await getattr(mem, name)(user, draw(IDS), draw(IDS), draw(TEXT),
                                            text=draw(OPTIONAL(TEXT)),
                                            keywords=draw(st.lists(TEXT, max_size=3)))
            known.append(fact.fact_id)
        case "confirm_fact" | "forget_fact" | "fact_history":
            await getattr(mem, name)(user, draw(IDS), draw(IDS))
        case "profile":
            await mem.profile(user, category=draw(OPTIONAL(IDS)))
        case "link":
            other = draw(st.sampled_from(known)) if known else draw(IDS)
            await mem.link(user, memory, other, draw(IDS), at=draw(OPTIONAL(DATES)))
        case "links":
            await mem.links(user, memory)
        case "review":
            await mem.review(user, memory, draw(st.sampled_from(["good", "again", 3, 7, "x"])))
        case "entity_info":
            await mem.entity_info(user, draw(TEXT))
        case "session_summary" | "episodes" | "close_session" | "session_history":
            await getattr(mem, name)(user, session)
        case "write_session_summary":
            await mem.write_session_summary(user, session, draw(TEXT), draw(INTS), draw(INTS))
        case "get_turn":
            await mem.get_turn(user, memory)
        case "list_sessions" | "memory_stats":
            await getattr(mem, name)(user)
        case "forget_session":
            await mem.forget_session(user, session)
            for turn_id in [t for t, (u, s, _) in acked.items() if (u, s) == (user, session)]:
                del acked[turn_id]
        case "forget_user":
            await mem.forget_user(user)
            for turn_id in [t for t, (u, _, _) in acked.items() if u == user]:
                del acked[turn_id]
        case "call_tool":
            await mem.call_tool(draw(st.sampled_from(["memory_search", "remember_fact", "x"])),
                                draw(st.dictionaries(TEXT, SCALARS, max_size=3)))


@settings(derandomize=True, max_examples=40, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(data=st.data())
async def test_arbitrary_calls_raise_only_invalid_input_and_lose_nothing(
        tmp_path: Path, data: st.DataObject) -> None:
    """Each call succeeds or raises InvalidInput; after close and reopen every acknowledged turn
    is there with its text, and recall and retrieve_memory answer for every user."""
    path = tmp_path / f"store{next(_dirs)}"
    acked: dict[str, tuple[str, str, Any]] = {}
    known: list[str] = []
    async with open_engine(path, clock=StepClock()) as mem:
        # Half of the calls add turns: every example has acknowledged turns to lose.
        calls = st.one_of(st.sampled_from(["add_turn", "add_turns"]), st.sampled_from(METHODS))
        for name in data.draw(st.lists(calls, min_size=6, max_size=16)):
            try:
                await _call(mem, name, data.draw, known, acked)
            except InvalidInput:
                pass
            known[:] = dict.fromkeys([*known, *acked])
        texts = {t: await mem.get_turn(u, t) for t, (u, _, _) in acked.items()}
        await mem.flush()
    async with open_engine(path, clock=StepClock()) as mem:
        for turn_id, (user, session, receipt) in acked.items():
            turn = await mem.get_turn(user, turn_id)
            assert turn is not None and turn == texts[turn_id], (user, session, receipt)
        for user in {u for u, _, _ in acked.values()} | {"ana"}:
            await mem.recall(user, "anything at all")
            await mem.retrieve_memory(user, "anything at all")
        assert (await mem.stats()).failures == 0
        await mem.add_turn("ana", "s1", "user", "still serving", durable=True)
