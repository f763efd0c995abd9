"""The FullText actor: tenant-scoped BM25, hostile query text, replay and rebuild."""

from __future__ import annotations

import shutil

import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import actors.fulltext as fulltext_mod

from ..conftest import open_engine

TEXT_ONLY = {"background_embedding": False}


async def _texts(mem, user: str, query: str, **filters) -> list[str]:
    found = await mem._fulltext.search(user, query, 10)
    records = {t.lsn: t.text for t in await mem.session_history(user, "s", limit=1000)}
    return [records[lsn] for lsn, _ in found]


async def test_search_is_stemmed_and_scoped_to_the_user(store_path) -> None:
    """'running dogs' finds 'the dog runs' for its user only, even for ids that prefix others."""
    async with open_engine(store_path, config=TEXT_ONLY) as mem:
        for user in ("an", "ana", "anab"):
            await mem.add_turn(user, "s", "user", f"the dog runs fast ({user})")
        await mem.add_turn("ana", "s", "user", "cats sleep all day")
        await mem.flush()
        assert await _texts(mem, "ana", "running dogs") == ["the dog runs fast (ana)"]
        assert await _texts(mem, "nobody", "dog") == []


HOSTILE = ['"unbalanced', "user:bo OR 1=1", "(dog", "dog AND", "NOT dog", "*", "dog*", "🐶🐕",
           "Größe straße", "日本語のテキスト", "", "  ", "\\", "field:[a TO z]", "~2 ^3 +-"]


async def test_query_syntax_in_user_text_is_just_text(store_path) -> None:
    """Quotes, colons, operators, wildcards, emoji and other scripts give results, never errors."""
    async with open_engine(store_path, config=TEXT_ONLY) as mem:
        await mem.add_turn("ana", "s", "user", "my dog loves the Größe straße and 日本語のテキスト")
        await mem.add_turn("bo", "s", "user", "bo's dog")
        await mem.flush()
        for query in HOSTILE:
            found = await mem._fulltext.search("ana", query, 10)
            assert all(lsn == 1 for lsn, _ in found), query
        assert await _texts(mem, "ana", "user:bo OR 1=1") == []  # no field syntax, no widening
        assert len(await mem._fulltext.search("ana", "(dog", 10)) == 1


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(query=st.text(max_size=60))
async def test_any_query_text_searches_without_error(tmp_path_factory, query: str) -> None:
    """Arbitrary unicode as a query never raises and never returns another user's document."""
    mem_path = tmp_path_factory.mktemp("ft")
    async with open_engine(mem_path, config=TEXT_ONLY) as mem:
        await mem.add_turn("bo", "s", "user", query if query.strip() else "x")
        await mem.flush()
        assert await mem._fulltext.search("ana", query, 10) == []


async def test_the_index_replays_what_it_missed_and_rebuilds_when_lost(store_path) -> None:
    """Turns stored while the index was gone are searchable after reopen; a deleted or
    corrupted index directory is rebuilt from the store."""
    async with open_engine(store_path, config=TEXT_ONLY) as mem:
        await mem.add_turn("ana", "s", "user", "first about lisbon")
        await mem.flush()
    shutil.rmtree(store_path / "fulltext")
    async with open_engine(store_path, config=TEXT_ONLY) as mem:
        assert mem._fulltext.rebuilt
        await mem.add_turn("ana", "s", "user", "second about lisbon")
        await mem.flush()
        assert sorted(await _texts(mem, "ana", "lisbon")) == ["first about lisbon", "second about lisbon"]
    (store_path / "fulltext" / "meta.json").write_text("{ not json")
    async with open_engine(store_path, config=TEXT_ONLY) as mem:
        await mem.flush()
        assert mem._fulltext.rebuilt
        assert len(await _texts(mem, "ana", "lisbon")) == 2


async def test_forgotten_records_leave_the_index_and_stay_gone_after_reopen(store_path) -> None:
    """forget_session and forget_user remove documents, durably."""
    async with open_engine(store_path, config=TEXT_ONLY) as mem:
        await mem.add_turn("ana", "gone", "user", "secret lisbon plan")
        await mem.add_turn("ana", "s", "user", "public lisbon plan")
        await mem.add_turn("zed", "s", "user", "zed lisbon plan")
        await mem.flush()
        await mem.forget_session("ana", "gone")
        await mem.forget_user("zed")
        await mem.flush()
        assert await _texts(mem, "ana", "lisbon") == ["public lisbon plan"]
    async with open_engine(store_path, config=TEXT_ONLY) as mem:
        await mem.flush()
        assert await mem._fulltext.search("zed", "lisbon", 10) == []
        assert await _texts(mem, "ana", "lisbon") == ["public lisbon plan"]


async def test_commits_are_batched_until_someone_waits(store_path, monkeypatch) -> None:
    """Documents wait for a commit (no timer fires here); flush commits them all at once."""
    monkeypatch.setattr(fulltext_mod, "COMMIT_INTERVAL", 3600.0)
    commits = []
    original = fulltext_mod.FullText._commit
    monkeypatch.setattr(fulltext_mod.FullText, "_commit",
                        lambda self: (commits.append(1), original(self)))
    async with open_engine(store_path, config=TEXT_ONLY) as mem:
        await mem.add_turns([{"user_id": "ana", "session_id": "s", "role": "user",
                              "text": f"lisbon {i}"} for i in range(10)], durable=True)
        ft = mem._fulltext
        while ft._read_lsn < 10:  # the follower has handed all ten to the writer
            await trio.sleep(0.001)
        assert ft.indexed_lsn == 0 and commits == []
        await mem.flush()
        assert ft.indexed_lsn == 10 and len(commits) == 1
        assert len(await mem._fulltext.search("ana", "lisbon", 20)) == 10


async def test_a_document_is_committed_within_the_interval_unasked(store_path, monkeypatch) -> None:
    """With nobody waiting, the commit interval still makes a document searchable."""
    monkeypatch.setattr(fulltext_mod, "COMMIT_INTERVAL", 0.05)
    async with open_engine(store_path, config=TEXT_ONLY) as mem:
        await mem.add_turn("ana", "s", "user", "lisbon", durable=True)
        while mem._fulltext.indexed_lsn < 1:  # bounded by the suite's wall-clock guard
            await trio.sleep(0.01)
        assert len(await mem._fulltext.search("ana", "lisbon", 5)) == 1
