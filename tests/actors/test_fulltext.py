"""The FullText actor: tenant-scoped BM25, hostile query text, replay and rebuild.

Driven bare over a real Store (tests/actors/ground.py), as the engine wires it: the index
follows the store's log and stops when the store closes.
"""

from __future__ import annotations

import math
import shutil
import threading
import unicodedata
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import tantivy
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import actors.fulltext as fulltext_mod
import actors.fulltext.fulltext as actor_mod
import actors.fulltext.index as fulltext_index
import actors.store.replay as replay_mod
from actors.base.messages import Searchable
from actors.fulltext import FullText, TextFilters
from actors.store.replay import STEP_SECONDS

from .ground import T0, Ground, running_store


@asynccontextmanager
async def running_index(path: Path) -> AsyncIterator[tuple[Ground, FullText]]:
    """A store at ``path`` and its full-text index at ``path/fulltext``, both running."""
    async with running_store(path) as ground:
        index = FullText(path / "fulltext", ground.store)
        await ground.start(index.run)
        yield ground, index


async def flush(ground: Ground, index: FullText) -> None:
    """Wait until everything queued is committed, then searchable (the engine's flush)."""
    await ground.store.wait_written()
    await index.wait_indexed(ground.store.committed_lsn)


async def _texts(ground: Ground, index: FullText, user: str, query: str) -> list[str]:
    found = await index.search(user, query, 10)
    records = await ground.texts(user, "s")
    return [records[lsn] for lsn, _ in found]


async def test_search_is_stemmed_and_scoped_to_the_user(store_path) -> None:
    """'running dogs' finds 'the dog runs' for its user only, even for ids that prefix others."""
    async with running_index(store_path) as (ground, index):
        for user in ("an", "ana", "anab"):
            await ground.add_turn(user, "s", f"the dog runs fast ({user})")
        await ground.add_turn("ana", "s", "cats sleep all day")
        await flush(ground, index)
        assert await _texts(ground, index, "ana", "running dogs") == ["the dog runs fast (ana)"]
        assert await _texts(ground, index, "nobody", "dog") == []


async def test_a_word_matches_however_its_accents_are_typed(store_path) -> None:
    """A word is found whether it was typed composed (NFC), decomposed (NFD, as macOS and some
    keyboards send it) or without its accents. An NFD 'São' was cut at its combining mark
    into 'sa' and 'o', so neither 'São' nor 'Sao' found the turn, nor 'cafe' a 'café'."""
    nfd = unicodedata.normalize("NFD", "We met at a café in São Paulo")
    nfc = "a naïve plan for Zoë"
    async with running_index(store_path) as (ground, index):
        await ground.add_turn("ana", "s", nfd)
        await ground.add_turn("ana", "s", nfc)
        await flush(ground, index)
        for query in ("São Paulo", "sao", unicodedata.normalize("NFD", "São"), "cafe", "CAFÉ"):
            assert await _texts(ground, index, "ana", query) == [nfd], query
        for query in ("naive", unicodedata.normalize("NFD", "naïve"), "zoe", "Zoë"):
            assert await _texts(ground, index, "ana", query) == [nfc], query
        # The terms the unindexed turns are matched by (read-your-writes) agree.
        assert index.terms(nfd) == index.terms(unicodedata.normalize("NFC", nfd))
        assert index.terms("São") == index.terms("sao")


async def test_an_index_an_older_analyser_wrote_is_rebuilt_at_open(store_path) -> None:
    """An index whose text an older engine cut into terms (no composing, no accent folding)
    holds terms today's queries never ask for: it is rebuilt from the store at open."""
    nfd = unicodedata.normalize("NFD", "lunch in São Paulo")
    async with running_index(store_path) as (ground, index):
        lsn = await ground.add_turn("ana", "s", nfd, durable=True)
    path = store_path / "fulltext"
    shutil.rmtree(path)
    path.mkdir()
    schema = fulltext_index._schema("engram_en")
    old = tantivy.Index(schema, path=str(path))
    old.register_tokenizer("engram_en", tantivy.TextAnalyzerBuilder(tantivy.Tokenizer.simple())
                           .filter(tantivy.Filter.lowercase()).build())
    writer = old.writer(15_000_000, 1)
    fulltext_index.write_records(writer, schema, [Searchable(
        lsn=lsn, kind="turn", user_id="ana", session_id="s", role="user", at=T0, text=nfd)], [])
    writer.commit()
    writer.wait_merging_threads()
    del writer, old
    async with running_index(store_path) as (ground, index):
        assert "analysed by 'engram_en'" in index.damage
        await flush(ground, index)
        assert await _texts(ground, index, "ana", "Sao Paulo") == [nfd]


async def test_searches_of_several_lists_answer_as_one_search_each(store_path) -> None:
    """search_each gives, for each filter set, what search gives for it alone."""
    async with running_index(store_path) as (ground, index):
        for i in range(30):
            await ground.add_turn("ana", f"s{i % 3}", f"the dog runs to the river {i}")
        await flush(ground, index)
        each = [None, TextFilters(session_id="s1"), TextFilters(kinds=("episode",)),
                TextFilters(roles=("assistant",))]
        alone = [await index.search("ana", "dog river", 20, filters) for filters in each]
        assert await index.search_each("ana", "dog river", 20, each) == alone
        assert len(alone[0]) == 20 and len(alone[1]) == 10 and alone[2] == []
        assert await index.search_each("ana", "the", 5, each) == [
            await index.search("ana", "the", 5, filters) for filters in each]


async def test_a_filter_of_one_or_several_values_keeps_what_it_names(store_path) -> None:
    """A filter on a field admits the documents holding any of its values, whether it has
    one value or a few (a union of term queries), ranked as without it (tests/test_recall.py
    has more values than SET_AFTER, on tags)."""
    async with running_index(store_path) as (ground, index):
        lsns = {}
        for i in range(24):
            lsns[i] = await ground.add_turn("ana", "s", f"dog {i}",
                                            role=("user", "assistant")[i % 2])
        await flush(ground, index)
        everything = dict(await index.search("ana", "dog", 100))
        assert len(everything) == 24
        for roles in (("user",), ("user", "assistant"), ("assistant", "tool")):
            found = await index.search("ana", "dog", 100, TextFilters(roles=roles))
            want = {lsns[i] for i in range(24) if ("user", "assistant")[i % 2] in roles}
            assert {lsn for lsn, _ in found} == want, roles
            assert all(everything[lsn] == score for lsn, score in found)  # ranked alike
        for count in (1, 2, 4):
            assert len(await index.search("ana", "dog", 100, TextFilters(
                kinds=("turn", "episode", "fact", "note")[:count]))) == 24
        assert await index.search("ana", "dog", 100, TextFilters(kinds=("note", "fact"))) == []


HOSTILE = ['"unbalanced', "user:bo OR 1=1", "(dog", "dog AND", "NOT dog", "*", "dog*", "🐶🐕",
           "Größe straße", "日本語のテキスト", "", "  ", "\\", "field:[a TO z]", "~2 ^3 +-"]


async def test_query_syntax_in_user_text_is_just_text(store_path) -> None:
    """Quotes, colons, operators, wildcards, emoji and other scripts give results, never errors."""
    async with running_index(store_path) as (ground, index):
        await ground.add_turn("ana", "s", "my dog loves the Größe straße and 日本語のテキスト")
        await ground.add_turn("bo", "s", "bo's dog")
        await flush(ground, index)
        for query in HOSTILE:
            found = await index.search("ana", query, 10)
            assert all(lsn == 1 for lsn, _ in found), query
        assert await _texts(ground, index, "ana", "user:bo OR 1=1") == []  # no field syntax
        assert len(await index.search("ana", "(dog", 10)) == 1


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(query=st.text(max_size=60))
async def test_any_query_text_searches_without_error(tmp_path_factory, query: str) -> None:
    """Arbitrary unicode as a query never raises and never returns another user's document."""
    path = tmp_path_factory.mktemp("ft")
    async with running_index(path) as (ground, index):
        await ground.add_turn("bo", "s", query if query.strip() else "x")
        await flush(ground, index)
        assert await index.search("ana", query, 10) == []


async def test_the_index_replays_what_it_missed_and_rebuilds_when_lost(store_path) -> None:
    """Turns stored while the index was gone are searchable after reopen; a deleted or
    corrupted index directory is rebuilt from the store."""
    async with running_index(store_path) as (ground, index):
        await ground.add_turn("ana", "s", "first about lisbon")
        await flush(ground, index)
    shutil.rmtree(store_path / "fulltext")
    async with running_index(store_path) as (ground, index):
        assert index.rebuilt
        await ground.add_turn("ana", "s", "second about lisbon")
        await flush(ground, index)
        assert sorted(await _texts(ground, index, "ana", "lisbon")) == [
            "first about lisbon", "second about lisbon"]
    (store_path / "fulltext" / "meta.json").write_text("{ not json")
    async with running_index(store_path) as (ground, index):
        await flush(ground, index)
        assert index.rebuilt
        assert len(await _texts(ground, index, "ana", "lisbon")) == 2


async def test_forgotten_records_leave_the_index_and_stay_gone_after_reopen(store_path) -> None:
    """A forgotten session's and a forgotten user's documents go, durably (the store logs a
    tombstone; the index follows it)."""
    async with running_index(store_path) as (ground, index):
        await ground.add_turn("ana", "gone", "secret lisbon plan")
        await ground.add_turn("ana", "s", "public lisbon plan")
        await ground.add_turn("zed", "s", "zed lisbon plan")
        await flush(ground, index)
        await ground.store.forget("ana", "gone")
        await ground.store.forget("zed", None)
        await flush(ground, index)
        assert await _texts(ground, index, "ana", "lisbon") == ["public lisbon plan"]
    async with running_index(store_path) as (ground, index):
        await flush(ground, index)
        assert await index.search("zed", "lisbon", 10) == []
        assert await _texts(ground, index, "ana", "lisbon") == ["public lisbon plan"]


async def test_commits_are_batched_until_someone_waits(store_path, monkeypatch) -> None:
    """Documents wait for a commit (no timer fires here); flush commits them all at once."""
    monkeypatch.setattr(actor_mod, "COMMIT_INTERVAL", 3600.0)
    commits = []
    original = fulltext_mod.FullText._commit
    monkeypatch.setattr(fulltext_mod.FullText, "_commit",
                        lambda self: (commits.append(1), original(self)))
    async with running_index(store_path) as (ground, index):
        for i in range(10):
            await ground.add_turn("ana", "s", f"lisbon {i}", durable=i == 9)
        while index._read_lsn < 10:  # the follower has handed all ten to the writer
            await trio.sleep(0.001)
        assert index.indexed_lsn == 0 and commits == []
        await flush(ground, index)
        assert index.indexed_lsn == 10 and len(commits) == 1
        assert len(await index.search("ana", "lisbon", 20)) == 10


async def test_a_follower_keeps_behind_the_index_for_at_most_a_second(
        store_path, monkeypatch, mock_clock) -> None:
    """keep_behind (what the long-term layer's followers await before each step) returns at
    once while the index has read the log to within LEAD_SLACK; further behind, it waits until
    the index reads on, and for LEAD_SECONDS at most while the index stays stuck."""
    mock_clock.autojump_threshold = 0.05  # jump only when idle: waits on threads stay real
    monkeypatch.setattr(actor_mod, "LEAD_SLACK", 4)
    lead_seconds = actor_mod.LEAD_SECONDS
    gate = threading.Event()  # cleared by the test: the index's writes wait
    gate.set()
    original = fulltext_mod.FullText._apply
    monkeypatch.setattr(fulltext_mod.FullText, "_apply",
                        lambda self, *args: (gate.wait(10), original(self, *args))[1])
    async with running_index(store_path) as (ground, index):
        await ground.add_turn("ana", "s", "before", durable=True)
        await flush(ground, index)
        start = trio.current_time()
        await index.keep_behind(ground.store.committed_lsn + 4)  # within the slack
        assert trio.current_time() == start
        returned: list[tuple[float, int]] = []  # (seconds waited, the index's read lsn then)

        async def follower(lsn: int) -> None:
            began = trio.current_time()
            await index.keep_behind(lsn)
            returned.append((trio.current_time() - began, index._read_lsn))

        targets = []
        for release in (True, False):
            # Released, only the index's reading may end the wait, however slow its thread.
            monkeypatch.setattr(actor_mod, "LEAD_SECONDS", 3600.0 if release else lead_seconds)
            gate.clear()
            for i in range(10):
                await ground.add_turn("ana", "s", f"turn {i}", durable=i == 9)
            targets.append(ground.store.committed_lsn)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(follower, targets[-1])
                await trio.sleep(0.5)
                assert len(returned) == (0 if release else 1)
                if release:
                    gate.set()
            gate.set()
        (_, read), (waited, stuck) = returned
        assert read + 4 >= targets[0]
        assert abs(waited - lead_seconds) < 1e-6 and stuck + 4 < targets[1]


async def test_a_document_is_committed_within_the_interval_unasked(store_path, monkeypatch) -> None:
    """With nobody waiting, the commit interval still makes a document searchable."""
    monkeypatch.setattr(actor_mod, "COMMIT_INTERVAL", 0.05)
    async with running_index(store_path) as (ground, index):
        await ground.add_turn("ana", "s", "lisbon", durable=True)
        while index.indexed_lsn < 1:  # bounded by the suite's wall-clock guard
            await trio.sleep(0.01)
        assert len(await index.search("ana", "lisbon", 5)) == 1



async def _trickle(ground: Ground, index: FullText, seconds: float, every: float
                   ) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """Add a turn every ``every`` seconds (real time: the pacing is the follower's own clock
    against the store's threads) for ``seconds``, nobody waiting on the index. Returns (lsn,
    when added) for each turn and (indexed_lsn, when first seen) for each rise of it."""
    added: list[tuple[int, float]] = []
    indexed: list[tuple[int, float]] = []
    seen = 0
    due = trio.current_time()
    for i in range(int(seconds / every)):
        await trio.sleep_until(due)
        if index.indexed_lsn > seen:
            seen = index.indexed_lsn
            indexed.append((seen, trio.current_time()))
        await ground.add_turn("ana", "s", f"turn {i} about lisbon")
        added.append((ground.store.next_lsn - 1, trio.current_time()))
        due += every
    return added, indexed


async def test_a_steady_trickle_is_read_in_paced_steps(store_path) -> None:
    """Turns arriving one at a time are read from the log in steps at least STEP_SECONDS
    apart, not a step per commit: each step costs two thread hops and a pass of the loop,
    which at 500 turns/s were the largest cost of a buffered turn without the long-term
    layer. A waiter then gets everything at once."""
    async with running_index(store_path) as (ground, index):
        reads = 0
        real_read = ground.store.read

        async def counted(*args, **kwargs):
            nonlocal reads
            reads += 1
            return await real_read(*args, **kwargs)

        ground.store.read = counted
        began = trio.current_time()
        added, _ = await _trickle(ground, index, 1.0, 0.002)
        elapsed = trio.current_time() - began
        assert reads <= elapsed / STEP_SECONDS + 3, (reads, elapsed)
        await flush(ground, index)
        assert index.indexed_lsn == added[-1][0] == 500
        assert len(await index.search("ana", "lisbon", 1000)) == 500



async def test_the_commit_interval_holds_when_the_log_is_never_all_read(store_path) -> None:
    """A turn lands during every step of the index, so the follower never finds the log all
    read when it looks: documents are still committed within COMMIT_INTERVAL, not only at
    COMMIT_DOCS."""
    async with running_index(store_path) as (ground, index):
        await ground.add_turn("ana", "s", "seed about lisbon", durable=True)
        real_read = ground.store.read
        feeding = True

        async def read(fn, *args, **kwargs):
            out = await real_read(fn, *args, **kwargs)
            if fn is actor_mod.read_log_range and feeding:
                await ground.add_turn("ana", "s", "more about lisbon", durable=True)
            return out

        ground.store.read = read
        began = trio.current_time()
        while index.indexed_lsn == 0 and trio.current_time() - began < 4.0:
            await trio.sleep(0.01)
        feeding = False
        waited = trio.current_time() - began
        assert index.indexed_lsn > 0, f"nothing committed after {waited:.2f} s"
        assert waited < actor_mod.COMMIT_INTERVAL + 0.5, waited


async def test_a_catch_up_commits_by_its_own_size_not_the_interval(store_path, monkeypatch
                                                                    ) -> None:
    """A rebuild (or a replay after open) commits every CATCH_UP_COMMIT_DOCS and once caught
    up, however long it takes: each commit costs 0.1-0.2 s and a segment to merge, and nothing
    of it is searchable before it ends. The commit interval is for live documents."""
    turns = 3 * fulltext_index.FOLLOW_CHUNK
    async with running_store(store_path) as ground:
        for i in range(turns):
            await ground.add_turn("ana", "s", f"turn {i} about lisbon")
        await ground.store.wait_written()
    monkeypatch.setattr(actor_mod, "COMMIT_INTERVAL", 0.0)  # always due
    commits = 0
    real_commit = FullText._commit

    def counted(self) -> None:
        nonlocal commits
        commits += 1
        real_commit(self)

    monkeypatch.setattr(FullText, "_commit", counted)
    async with running_index(store_path) as (ground, index):  # no index yet: a rebuild
        while index.indexed_lsn < turns:  # nobody waits (a waiter commits at every step)
            await trio.sleep(0.01)
        assert index.rebuilt and not index.catching_up
        assert commits == 1, commits
        assert len(await index.search("ana", "lisbon", 2 * turns)) == turns


async def test_a_waiter_wakes_an_index_paused_by_its_pacing(store_path, monkeypatch) -> None:
    """A caller of wait_indexed (the engine's flush) that arrives while the index pauses
    between steps ends the pause: it is not held for the pacing's STEP_SECONDS."""
    monkeypatch.setattr(replay_mod, "STEP_SECONDS", 5.0)
    pausing = trio.Event()
    real_paced = actor_mod.paced

    async def watched(began: float, unread: int, nudge, until: float = math.inf) -> bool:
        if trio.current_time() < min(began + replay_mod.STEP_SECONDS, until):
            pausing.set()  # the real one parks in this same step of the follower's task
        return await real_paced(began, unread, nudge, until)

    monkeypatch.setattr(actor_mod, "paced", watched)
    async with running_index(store_path) as (ground, index):
        await ground.add_turn("ana", "s", "first", durable=True)
        await index.wait_indexed(ground.store.committed_lsn)  # a step has just begun
        await ground.add_turn("ana", "s", "second about porto", durable=True)
        await pausing.wait()
        began = trio.current_time()
        await index.wait_indexed(ground.store.committed_lsn)
        assert trio.current_time() - began < 2.5
        assert len(await index.search("ana", "porto", 5)) == 1
