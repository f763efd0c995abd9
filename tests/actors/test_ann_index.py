"""The AnnIndex actor: per-user search, exact and graph paths, deletions, filters.

Driven bare over a real Store (tests/actors/ground.py): turns are appended to the store, their
vectors (a deterministic hash embedding) written as the embedder writes them, with the index's
``added`` as the commit callback, and forgets passed to its ``removed``, as the engine wires it.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path

import msgspec
import numpy as np
import pytest
import trio

import actors.ann_index.ann_index as ann_mod
import actors.ann_index.rows as rows_mod
import actors.store as store_mod
from actors.ann_index import AnnIndex, Filters, encode_vector
from actors.base.config import Config
from actors.base.messages import PutVectors

from .ground import DIM, T0, Ground, hash_vectors, running_store

WORDS = "lisbon porto dog cat train river job team flat vet run lunch coffee sardine".split()


def _texts(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=4)) + f" n{i}" for i in range(n)]


async def _vector(text: str) -> np.ndarray:
    return hash_vectors([text])[0]


class Vectors:
    """A store and the index over its vectors, running; turns are embedded as they are added."""

    def __init__(self, ground: Ground, ann: AnnIndex) -> None:
        self.ground = ground
        self.ann = ann

    async def add_turn(self, user_id: str, session_id: str, text: str, role: str = "user",
                       at_offset: timedelta | None = None) -> int:
        """Append a turn, then write its vector (the index hears of it at the commit)."""
        lsn = await self.ground.add_turn(user_id, session_id, text, durable=True, role=role,
                                         at_offset=at_offset)
        await self.embed([lsn])
        return lsn

    async def add_turns(self, user_id: str, items: list[tuple[str, str]],
                        kind: str = "turn") -> list[int]:
        """Append (session, text) turns, then write their vectors in one batch, labelled
        ``kind`` (the index knows a vector's kind by its header only: episodes, facts and
        notes are stood in for by turns labelled so)."""
        lsns = [await self.ground.add_turn(user_id, s, t) for s, t in items]
        await self.ground.store.wait_committed(lsns[-1])
        await self.embed(lsns, kind)
        return lsns

    async def embed(self, lsns: list[int], kind: str = "turn") -> None:
        """Write the records' vectors: a long text's one per chunk, as the embedder does."""
        store = self.ground.store
        records = [msgspec.structs.replace(r, kind=kind)
                   for r in await store.read(store_mod.read_searchables, lsns)]
        items = []
        for r in records:
            chunks = _chunks(r.text)
            vectors = hash_vectors(chunks)
            items.append((r.lsn, r.user_id, encode_vector(r, vectors if len(chunks) > 1
                                                          else vectors[0])))
        await store.write_unlogged(PutVectors(items, max(lsns), trio.Event(), self.ann.added))

    async def forget(self, user_id: str, session_id: str | None) -> None:
        """The engine's forget_session / forget_user, as the index sees it."""
        await self.ground.store.forget(
            user_id, session_id, lambda lsns: self.ann.removed(user_id, lsns, session_id is None))

    async def history(self, session_id: str) -> set[int]:
        return set(await self.ground.texts("ana", session_id))


@asynccontextmanager
async def running_index(path: Path, model_id: str = "hash") -> AsyncIterator[Vectors]:
    """A store at ``path`` and its vector index (graphs saved in ``path/ann``), running; the
    index is closed (saving its graphs) before the store, as the engine closes them."""
    async with running_store(path) as ground:
        ann = AnnIndex(ground.store, DIM, Config().ann_cache_vectors, path / "ann",
                       model_id=model_id)
        await ground.start(ann.run)
        try:
            yield Vectors(ground, ann)
        finally:
            ann.close()


async def test_search_sees_only_the_users_own_vectors(store_path) -> None:
    """Identical texts under another user never come back."""
    async with running_index(store_path) as v:
        mine = await v.add_turn("ana", "s", "lisbon dog")
        await v.add_turn("an", "s", "lisbon dog")
        await v.add_turn("anab", "s", "lisbon dog")
        found = await v.ann.search("ana", await _vector("lisbon dog"), 10)
    assert [lsn for lsn, _ in found] == [mine]


async def test_graph_search_agrees_with_exact_search_and_honours_deletions(store_path, monkeypatch) -> None:
    """Above the threshold the user gets an hnswlib graph whose answers match the exact scan;
    forgotten records leave both."""
    monkeypatch.setattr(ann_mod, "HNSW_THRESHOLD", 200)
    texts = _texts(600, seed=3)
    async with running_index(store_path) as v:
        await v.add_turns("ana", [(f"s{i % 3}", t) for i, t in enumerate(texts)])
        ann = v.ann
        await ann.search("ana", await _vector("dog"), 1)  # loads the user; schedules the graph
        uv = ann._users["ana"].turn
        while uv.graph is None or uv.graph_rows < uv.n or uv.writing:
            await trio.sleep(0.01)
        recalls = []
        for text in _texts(20, seed=9):
            query = await _vector(text)
            graph = await ann.search("ana", query, 10)
            exact = uv.exact(query, 10, uv.alive[: uv.n])
            # Hash vectors tie a lot, so compare by score: a graph hit is right when it scores
            # at least what the exact 10th best does.
            tenth = exact[-1][1] - 1e-6
            recalls.append(sum(score >= tenth for _, score in graph) / 10)
        assert np.mean(recalls) >= 0.95
        await v.forget("ana", "s1")
        gone = await v.history("s2")
        everything = await ann.search("ana", await _vector("dog lisbon"), 600,
                                      ann_mod.Filters(kinds=("turn",)))
        history = await v.history("s0") | await v.history("s2")
    assert {lsn for lsn, _ in everything} <= history and gone <= history


async def test_filters_apply_inside_the_search(store_path) -> None:
    """Session, time and role filters pick among the user's vectors before ranking."""
    async with running_index(store_path) as v:
        early = await v.add_turn("ana", "a", "dog lisbon", at_offset=timedelta(0))
        late = await v.add_turn("ana", "b", "dog lisbon", role="assistant",
                                at_offset=timedelta(days=3))
        ann, query = v.ann, await _vector("dog lisbon")
        assert [l for l, _ in await ann.search("ana", query, 5, Filters(session_id="b"))] == [late]
        since = Filters(since=T0 + timedelta(days=1))
        assert [l for l, _ in await ann.search("ana", query, 5, since)] == [late]
        assert [l for l, _ in await ann.search("ana", query, 5, Filters(roles=("user",)))] == [early]
        assert await ann.search("ana", query, 5, Filters(kinds=("fact",))) == []


async def test_admitted_judges_records_by_their_rows_and_keeps_those_without_one(
        store_path) -> None:
    """``admitted`` answers, for given records, what a search with the same filters could
    return, in each partition (a kind filter admits a partition whole, or none of it); a
    record with no vector yet cannot be judged and is kept."""
    async with running_index(store_path) as v:
        early = await v.add_turn("ana", "a", "dog lisbon", at_offset=timedelta(0))
        late = await v.add_turn("ana", "b", "dog lisbon", role="assistant",
                                at_offset=timedelta(days=3))
        bare = await v.ground.add_turn("ana", "a", "no vector yet", durable=True)
        episode, fact = (await v.add_turns("ana", [("a", "dog episode")], "episode")
                         + await v.add_turns("ana", [("a", "dog fact")], "fact"))
        ann, turns = v.ann, [early, late, bare]
        every = [*turns, episode, fact]
        assert await ann.admitted("ana", every, Filters(kinds=("turn",))) == set(turns)
        assert await ann.admitted("ana", every, Filters(kinds=("episode", "fact", "note"))) == {
            bare, episode, fact}
        assert await ann.admitted("ana", every, Filters(kinds=("episode",))) == {bare, episode}
        assert await ann.admitted("ana", every, Filters(kinds=("turn", "fact"),
                                                        roles=("user",))) == {early, bare, fact}
        assert await ann.admitted("ana", every, Filters(kinds=("turn",),
                                                        exclude=[early])) == {late, bare}
        assert await ann.admitted("ana", turns, Filters(session_id="b")) == {late, bare}
        assert await ann.admitted("ana", turns, Filters(roles=("user",))) == {early, bare}
        since = Filters(since=T0 + timedelta(days=1))
        assert await ann.admitted("ana", turns, since) == {late, bare}
        assert await ann.admitted("ana", turns, Filters(kinds=("fact",))) == {bare}
        assert await ann.admitted("ana", turns, Filters(exclude=[late])) == {early, bare}


async def test_vectors_committed_while_a_user_loads_are_not_lost(store_path) -> None:
    """Adds that commit between the load's read and its install are replayed into the index."""
    async with running_index(store_path) as v:
        await v.add_turn("ana", "s", "dog one")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(v.ann.search, "ana", await _vector("dog"), 5)
            await v.add_turn("ana", "s", "dog two")
        found = await v.ann.search("ana", await _vector("dog"), 5)
    assert len(found) == 2


async def _graph_ready(ann: AnnIndex, part: str = "turn") -> None:
    uv = getattr(ann._users["ana"], part)
    while uv.graph is None or uv.graph_rows < uv.n or uv.writing:
        await trio.sleep(0.01)


async def test_graphs_saved_at_close_are_reused_and_reconciled(store_path, monkeypatch) -> None:
    """A reopened index searches the saved graph at once, with the same answers; turns
    forgotten and added since it was saved are honoured; forgetting the user deletes its files."""
    monkeypatch.setattr(ann_mod, "HNSW_THRESHOLD", 200)
    texts = _texts(500, seed=5)
    queries = [await _vector(t) for t in _texts(10, seed=11)]
    async with running_index(store_path) as v:
        await v.add_turns("ana", [(f"s{i % 5}", t) for i, t in enumerate(texts)])
        await v.ann.search("ana", queries[0], 1)
        await _graph_ready(v.ann)
        before = [await v.ann.search("ana", q, 10) for q in queries]
    files = sorted(p.name for p in (store_path / "ann").iterdir())
    assert len(files) == 3 and not any("ana" in name for name in files)  # graph, lsns, sums
    async with running_index(store_path) as v:
        again = [await v.ann.search("ana", q, 10) for q in queries]
        uv = v.ann._users["ana"].turn
        assert uv.graph is not None and uv.graph_rows == uv.n == 500  # no rebuild
        assert again == before
        gone = await v.history("s3")
        await v.forget("ana", "s3")
        await v.add_turn("ana", "s9", "brand new note lisbon")
    async with running_index(store_path) as v:
        found = {lsn for q in queries for lsn, _ in await v.ann.search("ana", q, 50)}
        assert not found & gone
        await _graph_ready(v.ann)
        uv = v.ann._users["ana"].turn
        assert int(uv.alive[: uv.n].sum()) == 401
        await v.forget("ana", None)
        assert list((store_path / "ann").iterdir()) == []


async def test_a_graph_saved_under_another_model_is_not_reused(store_path, monkeypatch) -> None:
    """A re-embed (a model change) writes every vector anew under the same records: a graph
    saved before matched them record for record and was searched with the new model's
    vectors, its neighbours those of the old one's (12 of 20 exact-text queries missed). A
    graph names its model; another model's is dropped and built anew."""
    monkeypatch.setattr(ann_mod, "HNSW_THRESHOLD", 200)
    texts = _texts(300, seed=5)
    async with running_index(store_path, model_id="model-a") as v:
        await v.add_turns("ana", [(f"s{i % 5}", t) for i, t in enumerate(texts)])
        await v.ann.search("ana", await _vector("dog"), 1)
        await _graph_ready(v.ann)
    sums = [p for p in (store_path / "ann").iterdir() if p.name.endswith(".sum.json")]
    assert [json.loads(p.read_text())["model"] for p in sums] == ["model-a"]
    async with running_index(store_path, model_id="model-b") as v:
        await v.ann.search("ana", await _vector("dog"), 1)
        assert list((store_path / "ann").iterdir()) == []  # dropped, not loaded
        await _graph_ready(v.ann)
    assert [json.loads(p.read_text())["model"] for p in sums] == ["model-b"]
    async with running_index(store_path, model_id="model-b") as v:
        await v.ann.search("ana", await _vector("dog"), 1)
        uv = v.ann._users["ana"].turn
        assert uv.graph is not None and uv.graph_rows == 300  # its own model's: reused


async def test_rows_appended_during_a_search_do_not_break_it(store_path, monkeypatch) -> None:
    """A vector committed while a filtered exact scan runs in its thread leaves that scan
    consistent (it sees the rows it was started with) and the next search sees the new row."""
    gate, entered = threading.Event(), threading.Event()
    original = ann_mod._exact

    def held(*args):
        entered.set()
        gate.wait(10)
        return original(*args)

    monkeypatch.setattr(ann_mod, "_exact", held)
    monkeypatch.setattr(rows_mod, "_exact", held)
    monkeypatch.setattr(ann_mod, "EXACT_IN_THREAD", 0)
    async with running_index(store_path) as v:
        for i in range(3):
            await v.add_turn("ana", "s", f"dog walk {i}")
        found = []

        async def search() -> None:
            found.extend(await v.ann.search("ana", await _vector("dog walk"), 10,
                                            Filters(roles=("user",))))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(search)
            await trio.to_thread.run_sync(entered.wait, 10)
            await v.add_turn("ana", "s", "dog walk 3")  # appended while the scan is held
            assert v.ann._users["ana"].turn.n == 4
            gate.set()
        assert len(found) == 3
        monkeypatch.setattr(ann_mod, "_exact", original)
        monkeypatch.setattr(rows_mod, "_exact", original)
        assert len(await v.ann.search("ana", await _vector("dog walk"), 10,
                                      Filters(roles=("user",)))) == 4


async def test_each_kind_is_searched_over_its_own_partition(store_path, monkeypatch) -> None:
    """Turns and the other kinds are two partitions: a search of episodes scans the
    episodes' rows only, a search of turns uses the turns' graph with no filter, and a search
    of every kind merges both to the exact answer over all rows. (One matrix with a kind mask
    made an episode search scan every turn too: 97.6 ms at 100k turns.)"""
    monkeypatch.setattr(ann_mod, "HNSW_THRESHOLD", 200)
    scanned, filtered = [], []
    exact, knn = ann_mod._exact, ann_mod._UserVectors.knn

    def counting_exact(matrix, lsns, query, k, keep, *chunks):
        scanned.append(len(matrix))
        return exact(matrix, lsns, query, k, keep, *chunks)

    def counting_knn(self, query, k, keep, *matched):
        filtered.append(keep is not None)
        return knn(self, query, k, keep, *matched)

    monkeypatch.setattr(ann_mod, "_exact", counting_exact)
    monkeypatch.setattr(rows_mod, "_exact", counting_exact)
    monkeypatch.setattr(ann_mod._UserVectors, "knn", counting_knn)
    async with running_index(store_path) as v:
        turns = await v.add_turns("ana", [(f"s{i % 3}", t)
                                          for i, t in enumerate(_texts(300, seed=3))])
        episodes = await v.add_turns("ana", [("s9", t) for t in _texts(40, seed=4)], "episode")
        notes = await v.add_turns("ana", [("s9", t) for t in _texts(10, seed=5)], "note")
        query = await _vector("dog lisbon")
        await v.ann.search("ana", query, 1)  # loads the user; schedules the turns' graph
        await _graph_ready(v.ann)
        scanned.clear()
        found = await v.ann.search("ana", query, 10, Filters(kinds=("episode",)))
        assert scanned == [50] and {lsn for lsn, _ in found} <= set(episodes)
        both = await v.ann.search("ana", query, 10, Filters(kinds=("episode", "note", "fact")))
        assert scanned == [50, 50] and {lsn for lsn, _ in both} <= set(episodes + notes)
        scanned.clear()
        assert {lsn for lsn, _ in await v.ann.search("ana", query, 10,
                                                     Filters(kinds=("turn",)))} <= set(turns)
        assert scanned == [] and filtered == [False]
        # Every kind: both partitions, merged; the same as one exact scan over every row (the
        # filter keeps the turns' search exact: graph answers are approximate).
        monkeypatch.setattr(ann_mod, "HNSW_THRESHOLD", 1000)
        user = v.ann._users["ana"]
        every = await v.ann.search("ana", query, 20, Filters(roles=("user",)))
        rows = np.concatenate([user.turn.matrix[: user.turn.n], user.other.matrix[: user.other.n]])
        lsns = np.concatenate([user.turn.lsns[: user.turn.n], user.other.lsns[: user.other.n]])
        truth = exact(rows, lsns, query, 20, np.ones(len(rows), dtype=bool))
        assert np.allclose([s for _, s in every], [s for _, s in truth], atol=1e-6)
        last = truth[-1][1] + 1e-6  # equal scores at the cut may be either
        assert ({lsn for lsn, s in every if s > last} == {lsn for lsn, s in truth if s > last})
        assert {lsn for lsn, _ in every} & set(episodes + notes)
        assert v.ann.loaded() == {"ana": 350} and await v.ann.count("ana") == 350


async def test_searches_of_several_lists_answer_as_one_search_each(store_path,
                                                                  monkeypatch) -> None:
    """search_each gives, for each filter set, what search gives for it alone (matched chunks
    included), and runs every search that needs a thread (the turns' graph, the other kinds'
    scan) in one worker thread call."""
    monkeypatch.setattr(ann_mod, "HNSW_THRESHOLD", 200)
    monkeypatch.setattr(ann_mod, "EXACT_IN_THREAD", 10)
    calls = []
    run_jobs = ann_mod._run_jobs

    def counting(jobs):
        calls.append(len(jobs))
        return run_jobs(jobs)

    monkeypatch.setattr(ann_mod, "_run_jobs", counting)
    async with running_index(store_path) as v:
        await v.add_turns("ana", [(f"s{i % 3}", t) for i, t in enumerate(_texts(300, seed=3))])
        await v.add_turns("ana", [("s9", t) for t in _texts(40, seed=4)], "episode")
        await v.add_turns("ana", [("s9", "lisbon dog " * 300)], "note")  # several chunks
        query = await _vector("dog lisbon")
        await v.ann.search("ana", query, 1)
        await _graph_ready(v.ann)
        each = [Filters(kinds=("turn",)), Filters(kinds=("episode", "fact", "note")),
                Filters(roles=("user",)), Filters(kinds=("fact",))]
        alone, alone_matched = [], {}
        for filters in each:
            alone.append(await v.ann.search("ana", query, 20, filters, alone_matched))
        calls.clear()
        matched: dict[int, int] = {}
        together = await v.ann.search_each("ana", query, 20, each, matched)
        assert calls == [5]  # two graph searches and three scans, in one call
        assert together == alone and together[3] == []
        assert matched == alone_matched and matched


async def test_a_graph_saved_before_partitions_is_not_trusted(store_path, monkeypatch) -> None:
    """A user's one graph saved before the partitions, turns and other kinds mixed, under the
    name the turns' graph keeps (so before graphs named their model, which a re-embed may
    since have changed): its files go at once (they held the episodes' vectors too, which
    must not outlive a forget), and the turns are answered as well without it."""
    monkeypatch.setattr(ann_mod, "HNSW_THRESHOLD", 200)
    query = await _vector("dog lisbon")
    async with running_index(store_path) as v:
        turns = await v.add_turns("ana", [(f"s{i % 3}", t)
                                          for i, t in enumerate(_texts(300, seed=3))])
        episodes = await v.add_turns("ana", [("s9", t) for t in _texts(40, seed=4)], "episode")
        await v.ann.search("ana", query, 1)
        await _graph_ready(v.ann)
        user = v.ann._users["ana"]
        truth = user.turn.exact(query, 10, user.turn.alive[: user.turn.n])
        # The old layout: every row in one graph, as the old code built and saved it.
        rows = np.concatenate([user.turn.matrix[: user.turn.n], user.other.matrix[: user.other.n]])
        lsns = np.concatenate([user.turn.lsns[: user.turn.n], user.other.lsns[: user.other.n]])
    ann_dir = store_path / "ann"
    for path in ann_dir.iterdir():
        path.unlink()
    graph = ann_mod.hnswlib.Index(space="ip", dim=DIM)
    graph.init_index(max_elements=len(rows), M=ann_mod.HNSW_M,
                     ef_construction=ann_mod.HNSW_EF_CONSTRUCTION)
    graph.add_items(rows, np.arange(len(rows)))
    name = hashlib.blake2b(b"ana", digest_size=16).hexdigest()
    graph.save_index(str(ann_dir / f"{name}.hnsw"))
    np.save(ann_dir / f"{name}.lsns.npy", lsns)
    (ann_dir / f"{name}.sum.json").write_text(json.dumps({
        "rows": len(rows), "hnsw": ann_mod._sha256(ann_dir / f"{name}.hnsw"),
        "lsns": ann_mod._sha256(ann_dir / f"{name}.lsns.npy")}))
    async with running_index(store_path) as v:
        again = await v.ann.search("ana", query, 10, Filters(kinds=("turn",)))
        assert list(ann_dir.iterdir()) == []  # not loaded: gone
        assert {lsn for lsn, _ in again} <= set(turns)
        assert sum(score >= truth[-1][1] - 1e-6 for _, score in again) >= 9
        user = v.ann._users["ana"]
        assert user.turn.row_of.keys() == set(turns)
        assert user.other.row_of.keys() == set(episodes)


def _chunks(text: str) -> list[str]:
    """A long text's pieces as the embedder cuts them in size (640 characters, 96 repeated;
    where it cuts is actors.chunking's business, not the index's)."""
    return [text[at: at + 640] for at in range(0, max(len(text) - 96, 1), 544)]


def _long(topic: str, filler: int, i: int) -> str:
    """A text of several chunks whose last one alone names ``topic``."""
    rng = np.random.default_rng(i)
    words = " ".join(rng.choice(WORDS[:8], size=filler))
    return f"{words} {topic} {topic} {topic}"


async def test_a_record_of_several_chunks_is_found_by_any_once_and_survives_the_graph(
        store_path, monkeypatch) -> None:
    """Each chunk of a long text is a row of its kind's partition (a turn's in the turns', a
    note's in the other): the record is found by its last chunk, returned once (never as two
    hits) with that chunk named, in the exact scan and in the graph, in each partition and in
    their merge, after the graphs are saved and reloaded, and a forget takes every one of its
    rows."""
    monkeypatch.setattr(ann_mod, "HNSW_THRESHOLD", 200)
    texts = _texts(300, seed=4)
    longs = [_long(f"zebra{i}", 400, i) for i in range(5)]
    notes = [_long(f"okapi{i}", 400, 10 + i) for i in range(3)]
    assert all(len(_chunks(t)) >= 3 for t in longs + notes)
    async with running_index(store_path) as v:
        lsns = await v.add_turns("ana", [("s0", t) for t in texts]
                                 + [(f"long{i}", t) for i, t in enumerate(longs)])
        noted = await v.add_turns("ana", [("n", t) for t in notes]
                                  + [("n", t) for t in _texts(250, seed=9)], "note")
        chunked = lsns[-5:]
        matched: dict[int, int] = {}
        query = await _vector("zebra3 zebra3")
        exact = await v.ann.search("ana", query, 50, matched=matched)
        found = [lsn for lsn, _ in exact]
        assert found[0] == chunked[3] and len(found) == len(set(found)) == 50
        last = len(_chunks(longs[3])) - 1
        assert matched[chunked[3]] == last
        user = v.ann._users["ana"]
        assert user.turn.n == len(lsns) + sum(len(_chunks(t)) - 1 for t in longs)
        assert user.other.n == len(noted) + sum(len(_chunks(t)) - 1 for t in notes)
        assert await v.ann.count("ana") == len(lsns) + len(noted)
        note_query = await _vector("okapi1 okapi1")
        matched.clear()
        by_note = await v.ann.search("ana", note_query, 30, matched=matched)
        assert by_note[0][0] == noted[1] and matched[noted[1]] == len(_chunks(notes[1])) - 1
        assert len({lsn for lsn, _ in by_note}) == 30
        await _graph_ready(v.ann)
        await _graph_ready(v.ann, "other")
        matched.clear()
        graph = await v.ann.search("ana", query, 50, matched=matched)
        assert graph[0][0] == chunked[3] and matched[chunked[3]] == last
        assert len({lsn for lsn, _ in graph}) == len(graph) == 50
        only_notes = await v.ann.search("ana", note_query, 30, Filters(kinds=("note",)))
        assert only_notes[0][0] == noted[1] and len({lsn for lsn, _ in only_notes}) == 30
    async with running_index(store_path) as v:
        reloaded = await v.ann.search("ana", query, 50)
        user = v.ann._users["ana"]
        for uv in (user.turn, user.other):  # the saved graphs, no rebuild
            assert uv.graph is not None and uv.graph_rows == uv.n
        assert reloaded == graph
        assert await v.ann.search("ana", note_query, 30, Filters(kinds=("note",))) == only_notes
        await v.forget("ana", "long3")
        assert not user.turn.rows(chunked[3])
        assert chunked[3] not in {lsn for lsn, _ in await v.ann.search("ana", query, 50)}
        await v.forget("ana", "n")
        assert not user.other.row_of and not user.other.more and user.other.extra == 0
        assert not user.other.alive[: user.other.n].any()
    async with running_index(store_path) as v:
        again = await v.ann.search("ana", query, 50)
        assert chunked[3] not in {lsn for lsn, _ in again}
        uv = v.ann._users["ana"].turn
        assert int(uv.alive[: uv.n].sum()) == sum(len(uv.rows(lsn)) for lsn in uv.row_of)
        assert uv.extra == sum(len(uv.rows(lsn)) - 1 for lsn in uv.row_of)
        assert not await v.ann.search("ana", note_query, 30, Filters(kinds=("note",)))


async def test_a_graphed_partition_keeps_its_matrix_as_float16_with_the_same_answers(
        store_path, monkeypatch) -> None:
    """Once a partition's graph is built (or loaded), its matrix is float16: the graph holds
    the float32 copy. Exact scans, similarities and the graph give the scores the stored
    vectors give in float32; rows forgotten are zeroed; rows added after are found."""
    monkeypatch.setattr(ann_mod, "HNSW_THRESHOLD", 200)
    monkeypatch.setattr(rows_mod, "DOT_BLOCK", 64)  # scans cross blocks
    texts = _texts(500, seed=21)
    queries = [await _vector(t) for t in _texts(8, seed=22)]
    # What the stored float16 vectors score, in float32 (hash vectors: one chunk each).
    stored = hash_vectors(texts).astype(np.float16).astype(np.float32)

    async def halved(v: Vectors) -> rows_mod._UserVectors:
        await _graph_ready(v.ann)
        uv = v.ann._users["ana"].turn
        while uv.matrix.dtype != np.float16:
            await trio.sleep(0.01)
        return uv

    async with running_index(store_path) as v:
        lsns = await v.add_turns("ana", [(f"s{i % 4}", t) for i, t in enumerate(texts)])
        await v.ann.search("ana", queries[0], 1)
        uv = await halved(v)
        assert uv.matrix.dtype == np.float16 and uv.graph is not None
        for query in queries:
            exact = uv.exact(query, 10, uv.alive[: uv.n])
            scores = stored @ query
            best = np.argsort(-scores, kind="stable")[:10]
            assert [score for _, score in exact] == pytest.approx(scores[best].tolist(), abs=1e-6)
            sims = v.ann.similarities("ana", query, lsns[:5])
            assert [sims[lsn] for lsn in lsns[:5]] == pytest.approx(scores[:5].tolist(),
                                                                     abs=1e-6)
        gone = await v.history("s1")
        await v.forget("ana", "s1")
        dead = np.flatnonzero(~uv.alive[: uv.n])
        assert len(dead) == len(gone) and not uv.matrix[dead].any()
        new = await v.add_turn("ana", "s9", "zebra zebra zebra quokka")
        await _graph_ready(v.ann)
        found = await v.ann.search("ana", await _vector("zebra zebra zebra quokka"), 1)
        assert found[0][0] == new
        # A row the graph does not have yet (appended without waking its writer) is found: the
        # exact scan of the float16 matrix serves while the graph is behind.
        [record] = await v.ground.store.read(store_mod.read_searchables, [lsns[0]])
        query = await _vector("quokka quokka lisbon")
        uv.append(*ann_mod.decode_rows(
            [10**9], encode_vector(msgspec.structs.replace(record, lsn=10**9), query), DIM))
        assert uv.graph_rows == uv.n - 1
        scanned = []  # rows each exact scan covered: the graph answers for its own rows
        real_exact = rows_mod._exact
        monkeypatch.setattr(rows_mod, "_exact",
                            lambda matrix, *rest: scanned.append(len(matrix))
                            or real_exact(matrix, *rest))
        found = await v.ann.search("ana", query, 3)
        assert found[0] == (10**9, pytest.approx(1.0, abs=1e-3)) and len(found) == 3
        assert scanned == [1]
        full = real_exact(uv.matrix[: uv.n], uv.lsns[: uv.n], query, 3, uv.alive[: uv.n])
        assert [score for _, score in found] == pytest.approx([score for _, score in full],
                                                               abs=1e-6)  # ties may differ
        monkeypatch.setattr(rows_mod, "_exact", real_exact)
    async with running_index(store_path) as v:  # the saved graph loads with a float16 matrix
        found = await v.ann.search("ana", await _vector("zebra zebra zebra quokka"), 1)
        uv = v.ann._users["ana"].turn
        assert uv.matrix.dtype == np.float16 and found[0][0] == new


async def test_a_loaded_partition_holds_a_matrix_of_its_own_size(store_path) -> None:
    """A user's partitions are loaded at the size of their rows (a few episodes do not take a
    matrix of 64 rows: at 1,000 users that was 94 MiB of zeros), and grow by doubling."""
    async with running_index(store_path) as v:
        await v.add_turns("ana", [("s", t) for t in _texts(5, seed=31)])
        await v.add_turns("ana", [("s", t) for t in _texts(3, seed=32)], kind="episode")
        await v.ann.search("ana", await _vector("dog"), 1)
        user = v.ann._users["ana"]
        assert [(uv.n, len(uv.matrix)) for _, uv in user.parts()] == [(5, 5), (3, 3)]
        await v.add_turn("ana", "s", "one more lisbon dog")
        assert (user.turn.n, len(user.turn.matrix), len(user.turn.lsns)) == (6, 10, 10)


async def test_a_narrow_filter_scans_only_the_rows_it_admits(store_path, monkeypatch) -> None:
    """A filter that admits fewer rows than a graph is worth (one session of a graphed user)
    is answered exactly over those rows alone: the float16 matrix of a large partition is not
    cast and multiplied whole for them (at 100k turns a recall in one session took 80 ms,
    against 9 ms unfiltered). The answer is the scan of every row with the filter applied."""
    monkeypatch.setattr(ann_mod, "HNSW_THRESHOLD", 200)
    monkeypatch.setattr(rows_mod, "DOT_BLOCK", 64)
    multiplied = []  # rows each matrix product covered
    real_dot = rows_mod._dot
    monkeypatch.setattr(rows_mod, "_dot", lambda matrix, query, rows=None: multiplied.append(
        len(matrix) if rows is None else len(rows)) or real_dot(matrix, query, rows))
    texts = _texts(600, seed=41)
    async with running_index(store_path) as v:
        lsns = await v.add_turns("ana", [(f"s{i % 12}", t) for i, t in enumerate(texts)])
        await v.ann.search("ana", await _vector("dog"), 1)
        await _graph_ready(v.ann)
        uv = v.ann._users["ana"].turn
        with trio.fail_after(30):
            while uv.matrix.dtype != np.float16:
                await trio.sleep(0.01)
        in_s3 = {lsn for i, lsn in enumerate(lsns) if i % 12 == 3}
        for text in _texts(5, seed=42):
            query = await _vector(text)
            multiplied.clear()
            found = await v.ann.search("ana", query, 10, Filters(session_id="s3"))
            assert multiplied == [len(in_s3)] and {lsn for lsn, _ in found} <= in_s3
            keep = np.isin(uv.lsns[: uv.n], list(in_s3))
            scores = uv.matrix[: uv.n].astype(np.float32) @ query
            scores[~keep] = -np.inf
            best = np.argsort(-scores, kind="stable")[:10]
            assert [s for _, s in found] == pytest.approx(scores[best].tolist(), abs=1e-6)
            cut = scores[best[-1]] + 1e-6  # equal scores at the cut may be either
            assert ({lsn for lsn, s in found if s > cut}
                    == {int(uv.lsns[i]) for i in best if scores[i] > cut})
