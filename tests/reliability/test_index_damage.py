"""Case 8 of issue 11, the index side: a damaged, shuffled, stale or missing index file is found
at open and rebuilt from the store: never a wrong answer, never a panic out of Engine.open;
and while the text index is rebuilt, recall says its answer is partial."""

from __future__ import annotations

import json
import random
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import trio

import actors.ann_index.ann_index as ann_mod
import actors.fulltext as fulltext_mod
from actors.fulltext import SEGMENT_FILES

from engine import EngineBroken

from ..conftest import open_engine

USERS = ("ana", "bo")
QUERIES = ["lisbon flat", "dog walk in the park", "train to porto", "coffee beans",
           "peanut allergy", "number 17", "violin lessons", "rainy tuesday"]
WORDS = ["lisbon", "flat", "dog", "walk", "park", "train", "porto", "coffee", "beans",
         "peanut", "allergy", "violin", "lessons", "rainy", "tuesday", "garden", "bread"]
TURNS_ONLY = {"long_term": False}  # the index holds turns only: answers depend on nothing else


def _texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=6)) + f" number {i}" for i in range(n)]


async def _fill(path: Path, n: int = 120) -> None:
    async with open_engine(path, config=TURNS_ONLY) as mem:
        await mem.add_turns([{"user_id": USERS[i % 2], "session_id": f"s{i % 4}",
                              "role": "user", "text": text}
                             for i, text in enumerate(_texts(n, seed=3))])
        await mem.flush()


async def _answers(mem) -> list[list[str]]:
    out = []
    for user in USERS:
        for query in QUERIES:
            hits = await mem.recall(user, query, limit=10)
            assert not hits.degraded
            out.append([h.id for h in hits])
            out.append([lsn for lsn, _ in await mem._fulltext.search(user, query, 20)])
    return out


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> tuple[Path, list[list[str]]]:
    """A closed store and the answers it gives, built once for the damage cases."""
    path = tmp_path_factory.mktemp("damage") / "store"
    trio.run(_fill, path)

    async def answers() -> list[list[str]]:
        async with open_engine(path, config=TURNS_ONLY) as mem:
            return await _answers(mem)

    return path, trio.run(answers)


def _segment_files(index: Path) -> list[Path]:
    (segment,) = json.loads((index / "meta.json").read_text())["segments"]
    sid = segment["segment_id"].replace("-", "")
    return [index / f"{sid}.{ext}" for ext in SEGMENT_FILES]


# (file, where): a byte in the body at a deterministic offset, and one in the footer.
DAMAGE = [(ext, where) for ext in SEGMENT_FILES for where in ("body", "footer")]


@pytest.mark.parametrize(("ext", "where"), DAMAGE)
async def test_one_damaged_byte_in_a_text_index_segment_is_found_and_rebuilt(
        template, tmp_path, ext, where, caplog) -> None:
    """One flipped byte in any segment file (body or footer): the engine opens, logs the
    damage, rebuilds from the store and answers exactly as before."""
    source, expected = template
    store = tmp_path / "store"
    shutil.copytree(source, store)
    (target,) = [f for f in _segment_files(store / "fulltext") if f.name.endswith("." + ext)]
    data = bytearray(target.read_bytes())
    offset = len(data) // 3 if where == "body" else len(data) - 12
    data[offset] ^= 0x5A
    target.write_bytes(bytes(data))
    async with open_engine(store, config=TURNS_ONLY) as mem:
        assert mem._fulltext.rebuilt and target.name in mem._fulltext.damage
        await mem.flush()
        assert await _answers(mem) == expected
    assert f"the index at {store / 'fulltext'} is damaged" in caplog.text


@pytest.mark.parametrize("ext", ["idx", "pos", "term", "store", "fast", "fieldnorm"])
async def test_a_missing_text_index_segment_file_is_found_and_rebuilt(
        template, tmp_path, ext) -> None:
    """Any one of a segment's files deleted, the positions file too (tantivy opens it for
    every text field, positions recorded or not): found at open and rebuilt, never a recall
    that fails until someone deletes the index by hand."""
    source, expected = template
    store = tmp_path / "store"
    shutil.copytree(source, store)
    index = store / "fulltext"
    (segment,) = json.loads((index / "meta.json").read_text())["segments"]
    target = index / f"{segment['segment_id'].replace('-', '')}.{ext}"
    target.unlink()
    async with open_engine(store, config=TURNS_ONLY) as mem:
        assert mem._fulltext.rebuilt and target.name in mem._fulltext.damage
        await mem.flush()
        assert await _answers(mem) == expected


async def test_a_stale_text_index_from_a_larger_copy_is_rebuilt(template, tmp_path) -> None:
    """A text index covering log positions the store does not have (another copy's) is not
    searched: it would return records that are not there."""
    source, _ = template
    small = tmp_path / "small"
    await _fill(small, 40)
    shutil.rmtree(small / "fulltext")
    shutil.copytree(source / "fulltext", small / "fulltext")
    async with open_engine(small, config=TURNS_ONLY) as mem:
        assert mem._fulltext.rebuilt and "belongs to another copy" in mem._fulltext.damage
        await mem.flush()
        found = await mem._fulltext.search("ana", "number", 1000)
        assert len(found) == 20


def _text_index_deleted_and_held(template, tmp_path, monkeypatch
                                 ) -> tuple[Path, threading.Event]:
    """A copy of the template store without its text index, whose rebuild is held at its
    first batch until the returned event is set (it commits as soon as it has caught up,
    which on a fast machine could come before the test's first recall)."""
    store = tmp_path / "store"
    shutil.copytree(template[0], store)
    shutil.rmtree(store / "fulltext")
    rebuilding = threading.Event()  # set when the test has seen the flags
    apply = fulltext_mod.FullText._apply

    def held(self, *args):
        rebuilding.wait(60)
        return apply(self, *args)

    monkeypatch.setattr(fulltext_mod.FullText, "_apply", held)
    return store, rebuilding


async def test_while_a_deleted_text_index_is_rebuilt_recall_says_it_is_partial(
        template, tmp_path, monkeypatch) -> None:
    """fulltext/ deleted: the engine opens at once and rebuilds in the background; until the
    rebuild is committed recall's hits carry degraded == ("bm25",), and stats says the same;
    then the answers are the old ones and nothing is flagged."""
    expected = template[1]
    store, rebuilding = _text_index_deleted_and_held(template, tmp_path, monkeypatch)
    async with open_engine(store, config=TURNS_ONLY) as mem:
        try:
            assert mem._fulltext.damage == "missing"
            hits = await mem.recall("ana", "lisbon flat", limit=10)
            assert hits.degraded == ("bm25",) and hits.partial
            assert all("bm25" not in h.via for h in hits)
            assert (await mem.stats()).degraded == ("bm25",)
            raw = await mem.retrieve_memory_raw("ana", "lisbon flat")
            assert raw.degraded == ("bm25",)
        finally:
            rebuilding.set()
        await mem.flush()
        assert (await mem.stats()).degraded == ()
        assert await _answers(mem) == expected


async def test_a_filtered_recall_during_a_rebuild_flags_the_legs_the_filter_masks(
        template, tmp_path, monkeypatch) -> None:
    """With tags or where, the vector and entity legs search only what the text index admits
    (their mask comes from it): while it is rebuilt they miss what it has not taken yet, and
    recall says so, not only of BM25. A recall without a filter flags BM25 alone."""
    store, rebuilding = _text_index_deleted_and_held(template, tmp_path, monkeypatch)
    async with open_engine(store, config=TURNS_ONLY) as mem:
        try:
            plain = await mem.recall("ana", "lisbon flat", limit=10)
            masked = await mem.recall("ana", "lisbon flat", limit=10, where={"role": "user"})
            tagged = await mem.recall("ana", "lisbon flat", limit=10, tags=["home"])
        finally:
            rebuilding.set()
        assert plain.degraded == ("bm25",)
        assert masked.degraded == tagged.degraded == ("bm25", "vector", "entity")
        await mem.flush()
        after = await mem.recall("ana", "lisbon flat", limit=10, where={"role": "user"})
        assert after.degraded == () and after


async def test_recall_flags_the_vector_leg_while_vectors_are_missing(tmp_path) -> None:
    """A store whose records were never embedded (background embedding off): recall answers
    from BM25 and says the vector leg was degraded."""
    store = tmp_path / "store"
    async with open_engine(store, config={**TURNS_ONLY, "background_embedding": False}) as mem:
        await mem.add_turn("ana", "s", "user", "lisbon flat with a garden", durable=True)
    async with open_engine(store, config={**TURNS_ONLY, "background_embedding": False}) as mem:
        await mem.flush()  # the text index has it; nothing embeds it
        hits = await mem.recall("ana", "lisbon garden")
        assert [h.text for h in hits] == ["lisbon flat with a garden"]
        assert hits.degraded == ("vector",)


# -- saved ANN graphs ------------------------------------------------------------------------


@pytest.fixture
def graph_store(tmp_path, monkeypatch) -> Path:
    monkeypatch.setattr(ann_mod, "HNSW_THRESHOLD", 200)  # a graph for 500 vectors
    return tmp_path / "store"


async def _graph_ready(mem) -> bool:
    """Load the user and wait for the graph; True if it came from the saved files."""
    await mem._ann.search("ana", np.ones(mem._ann._dim, dtype=np.float32), 1)
    uv = mem._ann._users["ana"].turn
    reused = uv.graph is not None
    while uv.graph is None or uv.graph_rows < uv.n or uv.writing:
        await trio.sleep(0.01)
    return reused


async def _graph_answers(store: Path, queries: list[np.ndarray]
                         ) -> tuple[list[list[int]], bool, int]:
    """Answers from the graph (the saved one, or the one rebuilt), whether the saved one
    was used, and how many saved graphs were found damaged."""
    async with open_engine(store, config=TURNS_ONLY) as mem:
        reused = await _graph_ready(mem)
        results = [await mem._ann.search("ana", q, 10) for q in queries]
        return [[lsn for lsn, _ in r] for r in results], reused, mem._ann.damaged


async def _saved_graph(store: Path) -> tuple[list[np.ndarray], list[list[int]]]:
    async with open_engine(store, config=TURNS_ONLY) as mem:
        await mem.add_turns([{"user_id": "ana", "session_id": f"s{i % 5}", "role": "user",
                              "text": t} for i, t in enumerate(_texts(500, seed=5))])
        await mem.flush()
        queries = list(await mem.embed(_texts(20, seed=11)))
        await _graph_ready(mem)
        before = [[lsn for lsn, _ in await mem._ann.search("ana", q, 10)] for q in queries]
    assert len(list((store / "ann").glob("*.hnsw"))) == 1
    return queries, before


async def test_a_shuffled_lsns_file_is_detected_and_the_graph_rebuilt(graph_store) -> None:
    """lsns.npy maps graph rows to records: shuffled, every answer would name the wrong
    records. Its checksum fails, the graph is rebuilt, and the answers are the same."""
    queries, before = await _saved_graph(graph_store)
    (lsns_file,) = (graph_store / "ann").glob("*.lsns.npy")
    lsns = np.load(lsns_file)
    np.save(lsns_file, np.random.default_rng(7).permutation(lsns))
    after, reused, damaged = await _graph_answers(graph_store, queries)
    assert (after, reused, damaged) == (before, False, 1)
    # Rebuilt and saved again at close: the next open uses it, undamaged.
    again, reused, damaged = await _graph_answers(graph_store, queries)
    assert (again, reused, damaged) == (before, True, 0)


async def test_a_damaged_graph_file_is_detected_and_rebuilt(graph_store) -> None:
    """One flipped byte in the saved hnsw graph: found by its checksum, not searched."""
    queries, before = await _saved_graph(graph_store)
    (graph_file,) = (graph_store / "ann").glob("*.hnsw")
    data = bytearray(graph_file.read_bytes())
    data[len(data) // 2] ^= 0x01
    graph_file.write_bytes(bytes(data))
    after, reused, damaged = await _graph_answers(graph_store, queries)
    assert (after, reused, damaged) == (before, False, 1)


@pytest.mark.parametrize("damage", ["a flipped key", "no rows", "a list", "null",
                                    "no model named", "another model"])
async def test_a_damaged_or_foreign_graph_checksum_file_means_a_rebuild(graph_store,
                                                                       damage) -> None:
    """sum.json with a bit flipped in a key, or not an object, made every recall of the user
    fail (KeyError, AttributeError) on every open. A graph of another model, or of no model
    named (saved by a build before graphs named theirs, perhaps before a re-embed), is not
    trusted either. Each is rebuilt, with the same answers."""
    queries, before = await _saved_graph(graph_store)
    (sum_file,) = (graph_store / "ann").glob("*.sum.json")
    sums = json.loads(sum_file.read_text())
    if damage == "a flipped key":
        sum_file.write_text(sum_file.read_text().replace('"rows"', '"rqws"'))
    elif damage == "no rows":
        del sums["rows"]
        sum_file.write_text(json.dumps(sums))
    elif damage in ("a list", "null"):
        sum_file.write_text(json.dumps([sums] if damage == "a list" else None))
    else:
        if damage == "no model named":
            del sums["model"]
        else:
            sums["model"] = "another-model"
        sum_file.write_text(json.dumps(sums))
    after, reused, _ = await _graph_answers(graph_store, queries)
    assert (after, reused) == (before, False)
    again, reused, damaged = await _graph_answers(graph_store, queries)
    assert (again, reused, damaged) == (before, True, 0)


async def test_a_read_only_open_leaves_a_graph_of_no_model_named_to_its_owner(
        graph_store) -> None:
    """A read-only engine never writes the owner's files: it deleted every graph saved by a
    build before graphs named their model. It searches without it; the owner rebuilds it."""
    queries, _ = await _saved_graph(graph_store)
    (sum_file,) = (graph_store / "ann").glob("*.sum.json")
    sums = json.loads(sum_file.read_text())
    del sums["model"]
    sum_file.write_text(json.dumps(sums))
    files = sorted(p.name for p in (graph_store / "ann").iterdir())
    async with open_engine(graph_store, config=TURNS_ONLY, read_only=True) as mem:
        found = [await mem._ann.search("ana", q, 10) for q in queries]
    assert all(len(hits) == 10 for hits in found)  # the exact scan answers meanwhile
    assert sorted(p.name for p in (graph_store / "ann").iterdir()) == files


@pytest.mark.parametrize("where", ["sum.json", "hnsw", "lsns.npy", "ann"])
async def test_a_folder_or_file_where_a_graph_file_goes_is_cleared_at_close(graph_store,
                                                                           where) -> None:
    """A folder where a graph's file goes (or a file where ann/ goes) made every close raise
    EngineBroken, on every open, as nothing removed it. The obstacle goes; the graph is
    saved again."""
    queries, before = await _saved_graph(graph_store)
    ann = graph_store / "ann"
    if where == "ann":
        shutil.rmtree(ann)
        ann.write_text("not a folder")
    else:
        (target,) = ann.glob(f"*.{where}")
        target.unlink()
        target.mkdir()
    after, reused, _ = await _graph_answers(graph_store, queries)
    assert (after, reused) == (before, False)
    again, reused, damaged = await _graph_answers(graph_store, queries)
    assert (again, reused, damaged) == (before, True, 0)


async def test_a_panic_in_the_text_index_breaks_the_engine_with_its_own_error(
        tmp_path, monkeypatch, autojump_clock) -> None:
    """tantivy reports some failures by panicking: pyo3's PanicException, a BaseException
    that passed through as a raw exception group, as if the caller had pressed Ctrl-C, when
    nothing else failed with it. It comes out as EngineBroken."""
    panic = type("PanicException", (BaseException,), {})  # the class pyo3 makes at run time

    def commit(self) -> None:
        raise panic("called `Option::unwrap()` on a `None` value")

    monkeypatch.setattr(fulltext_mod.FullText, "_commit", commit)
    with pytest.raises(EngineBroken, match="PanicException") as info:
        async with open_engine(tmp_path / "store", config=TURNS_ONLY) as mem:
            await mem.add_turn("ana", "s", "user", "lisbon", durable=True)
            await trio.sleep_forever()  # the index commits a second later, and panics
    assert isinstance(info.value.__cause__, BaseExceptionGroup)


async def test_a_panic_in_a_text_search_is_the_engines_own_error(tmp_path, monkeypatch) -> None:
    """A search that panics in tantivy raises EngineBroken in the caller, not a BaseException
    that no `except Exception` catches."""
    panic = type("PanicException", (BaseException,), {})

    def search(self, *args) -> None:
        raise panic("index out of bounds")

    async with open_engine(tmp_path / "store", config=TURNS_ONLY) as mem:
        await mem.add_turn("ana", "s", "user", "lisbon", durable=True)
        await mem.flush()
        monkeypatch.setattr(fulltext_mod.FullText, "_search", search)
        with pytest.raises(EngineBroken, match="failed a search: index out of bounds"):
            await mem._fulltext.search("ana", "lisbon", 5)
        # Through recall, whose legs run in a nursery: the one error, not an exception group.
        with pytest.raises(EngineBroken, match="failed a search: index out of bounds"):
            await mem.recall("ana", "lisbon")


async def test_a_file_where_the_text_index_folder_goes_is_replaced_by_a_rebuilt_index(
        template, tmp_path) -> None:
    """A file named fulltext in the store's folder: the open raised FileExistsError out of
    pathlib. It is damage like any other: moved aside, removed, and the index rebuilt."""
    source, expected = template
    store = tmp_path / "store"
    shutil.copytree(source, store)
    shutil.rmtree(store / "fulltext")
    (store / "fulltext").write_bytes(b"not a folder")
    async with open_engine(store, config=TURNS_ONLY) as mem:
        assert mem._fulltext.rebuilt
        await mem.flush()
        assert await _answers(mem) == expected
    assert sorted(p.name for p in store.iterdir() if p.name.startswith("fulltext")) == [
        "fulltext"]
