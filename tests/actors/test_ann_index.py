"""The AnnIndex actor: per-user search, exact and graph paths, deletions, filters."""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import trio

import actors.ann_index as ann_mod
from actors.ann_index import Filters
from engine import HashEmbedder

from ..conftest import T0, open_engine

WORDS = "lisbon porto dog cat train river job team flat vet run lunch coffee sardine".split()


def _texts(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=4)) + f" n{i}" for i in range(n)]


async def _vector(text: str) -> np.ndarray:
    return HashEmbedder().encode([text])[0]


async def test_search_sees_only_the_users_own_vectors(store_path) -> None:
    """Identical texts under another user never come back."""
    async with open_engine(store_path) as mem:
        mine = await mem.add_turn("ana", "s", "user", "lisbon dog")
        await mem.add_turn("an", "s", "user", "lisbon dog")
        await mem.add_turn("anab", "s", "user", "lisbon dog")
        await mem.flush()
        found = await mem._ann.search("ana", await _vector("lisbon dog"), 10)
    assert [lsn for lsn, _ in found] == [mine.lsn]


async def test_graph_search_agrees_with_exact_search_and_honours_deletions(store_path, monkeypatch) -> None:
    """Above the threshold the user gets an hnswlib graph whose answers match the exact scan;
    forgotten records leave both."""
    monkeypatch.setattr(ann_mod, "HNSW_THRESHOLD", 200)
    texts = _texts(600, seed=3)
    async with open_engine(store_path) as mem:
        await mem.add_turns([{"user_id": "ana", "session_id": f"s{i % 3}", "role": "user",
                              "text": t} for i, t in enumerate(texts)])
        await mem.flush()
        ann = mem._ann
        await ann.search("ana", await _vector("dog"), 1)  # loads the user; schedules the graph
        uv = ann._users["ana"]
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
        await mem.forget_session("ana", "s1")
        gone = {t.lsn for t in await mem.session_history("ana", "s2", limit=1000)}
        everything = await ann.search("ana", await _vector("dog lisbon"), 600,
                                      ann_mod.Filters(kinds=("turn",)))
        history = {t.lsn for s in ("s0", "s2") for t in await mem.session_history("ana", s, limit=1000)}
    assert {lsn for lsn, _ in everything} <= history and gone <= history


async def test_filters_apply_inside_the_search(store_path, clock) -> None:
    """Session, time and role filters pick among the user's vectors before ranking."""
    async with open_engine(store_path, clock=clock) as mem:
        early = await mem.add_turn("ana", "a", "user", "dog lisbon", at=T0)
        late = await mem.add_turn("ana", "b", "assistant", "dog lisbon", at=T0 + timedelta(days=3))
        await mem.flush()
        ann, query = mem._ann, await _vector("dog lisbon")
        assert [l for l, _ in await ann.search("ana", query, 5, Filters(session_id="b"))] == [late.lsn]
        since = Filters(since=T0 + timedelta(days=1))
        assert [l for l, _ in await ann.search("ana", query, 5, since)] == [late.lsn]
        assert [l for l, _ in await ann.search("ana", query, 5, Filters(roles=("user",)))] == [early.lsn]
        assert await ann.search("ana", query, 5, Filters(kinds=("fact",))) == []


async def test_vectors_committed_while_a_user_loads_are_not_lost(store_path) -> None:
    """Adds that commit between the load's read and its install are replayed into the index."""
    async with open_engine(store_path) as mem:
        await mem.add_turn("ana", "s", "user", "dog one")
        await mem.flush()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(mem._ann.search, "ana", await _vector("dog"), 5)
            await mem.add_turn("ana", "s", "user", "dog two")
            await mem.flush()
        found = await mem._ann.search("ana", await _vector("dog"), 5)
    assert len(found) == 2


async def _graph_ready(mem) -> None:
    uv = mem._ann._users["ana"]
    while uv.graph is None or uv.graph_rows < uv.n or uv.writing:
        await trio.sleep(0.01)


async def test_graphs_saved_at_close_are_reused_and_reconciled(store_path, monkeypatch) -> None:
    """A reopened engine searches the saved graph at once, with the same answers; turns
    forgotten and added since it was saved are honoured; forget_user deletes its files."""
    monkeypatch.setattr(ann_mod, "HNSW_THRESHOLD", 200)
    texts = _texts(500, seed=5)
    queries = [await _vector(t) for t in _texts(10, seed=11)]
    turns_only = {"long_term": False}  # no episodes: the vector counts below are turns
    async with open_engine(store_path, config=turns_only) as mem:
        await mem.add_turns([{"user_id": "ana", "session_id": f"s{i % 5}", "role": "user",
                              "text": t} for i, t in enumerate(texts)])
        await mem.flush()
        await mem._ann.search("ana", queries[0], 1)
        await _graph_ready(mem)
        before = [await mem._ann.search("ana", q, 10) for q in queries]
    files = sorted(p.name for p in (store_path / "ann").iterdir())
    assert len(files) == 3 and not any("ana" in name for name in files)  # graph, lsns, sums
    async with open_engine(store_path, config=turns_only) as mem:
        again = [await mem._ann.search("ana", q, 10) for q in queries]
        uv = mem._ann._users["ana"]
        assert uv.graph is not None and uv.graph_rows == uv.n == 500  # no rebuild
        assert again == before
        gone = {t.lsn for t in await mem.session_history("ana", "s3", limit=500)}
        await mem.forget_session("ana", "s3")
        await mem.add_turn("ana", "s9", "user", "brand new note lisbon")
        await mem.flush()
    async with open_engine(store_path, config=turns_only) as mem:
        found = {lsn for q in queries for lsn, _ in await mem._ann.search("ana", q, 50)}
        assert not found & gone
        await _graph_ready(mem)
        uv = mem._ann._users["ana"]
        assert int(uv.alive[: uv.n].sum()) == 401
        await mem.forget_user("ana")
        assert list((store_path / "ann").iterdir()) == []


async def test_rows_appended_during_a_search_do_not_break_it(store_path, monkeypatch) -> None:
    """A vector committed while a filtered exact scan runs in its thread leaves that scan
    consistent (it sees the rows it was started with) and the next search sees the new row."""
    import threading

    gate, entered = threading.Event(), threading.Event()
    original = ann_mod._exact

    def held(*args):
        entered.set()
        gate.wait(10)
        return original(*args)

    monkeypatch.setattr(ann_mod, "_exact", held)
    monkeypatch.setattr(ann_mod, "EXACT_IN_THREAD", 0)
    async with open_engine(store_path) as mem:
        for i in range(3):
            await mem.add_turn("ana", "s", "user", f"dog walk {i}")
        await mem.flush()
        found = []

        async def search() -> None:
            found.extend(await mem._ann.search("ana", await _vector("dog walk"), 10,
                                               Filters(roles=("user",))))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(search)
            await trio.to_thread.run_sync(entered.wait, 10)
            await mem.add_turn("ana", "s", "user", "dog walk 3")
            await mem.flush()  # its vector is appended to the index while the scan is held
            assert mem._ann._users["ana"].n == 4
            gate.set()
        assert len(found) == 3
        monkeypatch.setattr(ann_mod, "_exact", original)
        assert len(await mem._ann.search("ana", await _vector("dog walk"), 10,
                                         Filters(roles=("user",)))) == 4
