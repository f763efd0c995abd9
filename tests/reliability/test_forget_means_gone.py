"""Case 7 of issue 11: after forget_session / forget_user and flush, no byte of the forgotten
text and no vector of it is in any file of the store, its indexes or saved graphs, or in a
snapshot taken after, without waiting for a compact."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tantivy
import trio

import actors.ann_index as ann_mod
from actors.store.integrity import unseal
from engine import Engine

from ..conftest import open_engine, raw_databases

MARKER = "qwzxmarkerkv"  # one token the analyser keeps as is, so it is a term in the index too
GRAPH_AT = 16  # vectors per user above which the test's users get a saved hnswlib graph


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


def _holding(root: Path, needles: list[bytes], live_lmdb: bool = False) -> list[str]:
    """The files under ``root`` whose raw bytes contain any of ``needles``; with
    ``live_lmdb``, leaving out the data file of an LMDB environment the engine wrote in place
    (LMDB reuses page buffers without clearing them, so a page's free space can keep stale
    bytes; the engine's scrub removes nearly all, a snapshot or compact all of them)."""
    found = []
    for path in _files(root):
        if live_lmdb and path.name == "data.mdb":
            continue
        data = path.read_bytes()
        if any(needle in data for needle in needles):
            found.append(str(path.relative_to(root)))
    return found


def _index_docs_with_marker(fulltext: Path) -> int:
    """How many documents of the text index's segments hold the marker as a term, deleted
    ones included (a raw scan cannot tell: tantivy compresses its term dictionary blocks)."""
    searcher = tantivy.Index.open(str(fulltext)).searcher()
    return searcher.doc_freq("text", MARKER)


def _needles(vectors: list[bytes]) -> list[bytes]:
    """The marker, and each forgotten vector as stored (float16) and as a graph holds it
    (float32)."""
    out = [MARKER.encode()]
    for value in vectors:
        half = value[ann_mod.HEADER.itemsize:]
        out += [half, np.frombuffer(half, dtype="<f2").astype("<f4").tobytes()]
    return out


def _vectors_of(path: Path, user: str, lsns: set[int]) -> list[bytes]:
    """The user's stored vector values at these lsns (header and vector, without the seal)."""
    prefix = user.encode() + b"\x00"
    return [unseal(value, b"vectors", key) for key, value in raw_databases(path)["vectors"]
            if key.startswith(prefix) and int.from_bytes(key[len(prefix):], "big") in lsns]


async def _fill(mem: Engine, user: str, session: str, n: int, marked: bool) -> list[int]:
    lsns = []
    for i in range(n):
        text = (f"{MARKER} was said in turn {i} about the lighthouse keeper" if marked
                else f"turn {i} about the weather and the garden")
        receipt = await mem.add_turn(user, session, "user" if i % 2 else "assistant", text)
        lsns.append(receipt.lsn)
    return lsns


@pytest.fixture
def graphs(monkeypatch) -> None:
    monkeypatch.setattr(ann_mod, "HNSW_THRESHOLD", GRAPH_AT)


@pytest.mark.parametrize("scope", ["session", "user"])
async def test_forgotten_text_and_vectors_leave_every_file(tmp_path: Path, graphs, scope) -> None:
    """With a saved graph loaded, text-index segments holding the records and LMDB pages
    that held them, forgetting then flushing leaves no byte of the marker or the vectors in
    the store directory, while it serves, after it closes, and in a snapshot taken after."""
    store = tmp_path / "store"
    async with open_engine(store) as mem:
        marked = await _fill(mem, "ana", "s1", 24, marked=True)
        await mem.store_note("ana", f"a note that says {MARKER} too")
        await _fill(mem, "ana", "s2", 24, marked=False)
        await _fill(mem, "bo", "s1", 8, marked=False)
        await _fill(mem, "al", "s1", 8, marked=False)  # keys before ana's in every database
        await mem.flush()
        await mem.recall("ana", "lighthouse")  # builds ana's graph (more than GRAPH_AT vectors)
        await mem.flush()
        uv = mem._ann._users["ana"]
        while uv.graph is None or uv.graph_rows < uv.n or uv.writing:
            await trio.sleep(0.01)  # built in the background; saved at close once built
    vectors = _vectors_of(store, "ana", set(marked))
    assert len(vectors) == len(marked)
    needles = _needles(vectors)
    before = _holding(store, needles)
    # The premise: the marker is in LMDB and the text index, the vectors in LMDB and the graph.
    assert "data.mdb" in before and any(p.startswith("ann/") for p in before), before
    assert _index_docs_with_marker(store / "fulltext") > len(marked)  # turns, note, episodes

    async with open_engine(store) as mem:
        await mem.recall("ana", "lighthouse")  # the saved graph is loaded and in use
        if scope == "session":
            await mem.forget_session("ana", "s1")
            note = [h for h in await mem.recall("ana", MARKER, kinds=["note"])]
            await mem.delete_note("ana", note[0].id)
        else:
            await mem.forget_user("ana")
        await mem.flush()
        assert _holding(store, needles, live_lmdb=True) == []
        assert _index_docs_with_marker(store / "fulltext") == 0
        await mem.snapshot(tmp_path / "snap")
        assert _holding(tmp_path / "snap", needles) == []
        assert _index_docs_with_marker(tmp_path / "snap" / "fulltext") == 0
        kept = await mem.recall("bo", "weather garden")
        assert kept and all(h.text.endswith("the weather and the garden") for h in kept)
        if scope == "session":
            assert len(await mem.session_history("ana", "s2")) == 24
            assert await mem.recall("ana", "weather garden")
    assert _holding(store, needles, live_lmdb=True) == []
    assert _index_docs_with_marker(store / "fulltext") == 0
    async with open_engine(store) as mem:
        await mem.flush()
        assert not [h for h in await mem.recall("ana", f"{MARKER} lighthouse keeper")
                    if MARKER in h.text]
    assert _holding(store, needles, live_lmdb=True) == []
    await Engine.compact(store)
    assert _holding(store, needles) == []
