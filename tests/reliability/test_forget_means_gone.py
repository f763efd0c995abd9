"""Case 7 of issue 11: after forget_session / forget_user and flush, no byte of the forgotten
text and no vector of it is in any file of the store, its indexes or saved graphs, or in a
snapshot taken after, without waiting for a compact."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import lmdb
import numpy as np
import pytest
import tantivy
import trio
import trio.testing

import actors.ann_index.ann_index as ann_mod
import actors.store.store as store_mod
from actors.ann_index import HEADER
from actors.store import MAX_DBS
from actors.store.integrity import unseal
from actors.store.layout import SCRUB_KEY, SCRUBBED_KEY
from engine import Engine

from ..conftest import open_engine, raw_databases

MARKER = "qwzxmarkerkv"  # one token the analyser keeps as is, so it is a term in the index too
GRAPH_AT = 16  # vectors per user above which the test's users get a saved hnswlib graph


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


def _holding(root: Path, needles: list[bytes]) -> list[str]:
    """The files under ``root`` whose raw bytes contain any of ``needles``."""
    found = []
    for path in _files(root):
        data = path.read_bytes()
        if any(needle in data for needle in needles):
            found.append(str(path.relative_to(root)))
    return found


def _index_docs_with_marker(fulltext: Path) -> int:
    """How many documents of the text index's segments hold the marker as a term, deleted
    ones included (a raw scan cannot tell: tantivy compresses its term dictionary blocks)."""
    searcher = tantivy.Index.open(str(fulltext)).searcher()
    return searcher.doc_freq("text", MARKER)


def _needles(vectors: list[bytes], dim: int = 384) -> list[bytes]:
    """The marker, and each forgotten vector as stored (float16) and as a graph holds it
    (float32): every chunk's of a value that holds several (a long text's)."""
    out = [MARKER.encode()]
    size = 2 * dim
    for value in vectors:
        vectors_part = value[HEADER.itemsize:]
        for at in range(0, len(vectors_part), size):
            half = vectors_part[at: at + size]
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
        if marked and i < 2:  # long: embedded in chunks, their vectors in one value
            text += "".join(f" and the lighthouse keeper wrote entry {j} in the log"
                            for j in range(30))
        receipt = await mem.add_turn(user, session, "user" if i % 2 else "assistant", text)
        lsns.append(receipt.lsn)
    return lsns


@pytest.fixture
def graphs(monkeypatch) -> None:
    monkeypatch.setattr(ann_mod, "HNSW_THRESHOLD", GRAPH_AT)


@pytest.fixture
def zeroing_passes(monkeypatch) -> list[Path]:
    """The copies a snapshot zeroed after LMDB's compacting copy (``Store.copy_to``)."""
    passes: list[Path] = []
    clear = store_mod.clear_copy

    def spied(dest: Path, sync: bool = True) -> None:
        passes.append(dest)
        clear(dest, sync)

    monkeypatch.setattr(store_mod, "clear_copy", spied)
    return passes


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
        uv = mem._ann._users["ana"].turn
        while uv.graph is None or uv.graph_rows < uv.n or uv.writing:
            await trio.sleep(0.01)  # built in the background; saved at close once built
    vectors = _vectors_of(store, "ana", set(marked))
    assert len(vectors) == len(marked)
    assert sum(len(v) > HEADER.itemsize + 2 * 384 for v in vectors) == 2  # chunked
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
        assert _holding(store, needles) == []
        assert _index_docs_with_marker(store / "fulltext") == 0
        await mem.snapshot(tmp_path / "snap")
        assert _holding(tmp_path / "snap", needles) == []
        assert _index_docs_with_marker(tmp_path / "snap" / "fulltext") == 0
        kept = await mem.recall("bo", "weather garden")
        assert kept and all(h.text.endswith("the weather and the garden") for h in kept)
        if scope == "session":
            assert len(await mem.session_history("ana", "s2")) == 24
            assert await mem.recall("ana", "weather garden")
    assert _holding(store, needles) == []
    assert _index_docs_with_marker(store / "fulltext") == 0
    async with open_engine(store) as mem:
        await mem.flush()
        assert not [h for h in await mem.recall("ana", f"{MARKER} lighthouse keeper")
                    if MARKER in h.text]
    assert _holding(store, needles) == []
    await Engine.compact(store)
    assert _holding(store, needles) == []



VICTIM = "victimqzx"  # a user id found nowhere else, so its bytes can be looked for too
SESSION = "sessqzx1"  # likewise a session id


async def _bystanders(mem: Engine, round_: int, n: int) -> None:
    for j in range(n):
        await mem.add_turn(f"by{j % 7}", f"s{round_}-{j % 11}", "user",
                           f"bystander {round_}.{j} talks about the weather and the garden")


async def _marked(mem: Engine, first: int, n: int) -> list[int]:
    """Turns of the victim's session holding the marker, ten bystander turns after each;
    every fourth ~3 KB long, so it lands on an overflow page of LMDB. Returns their lsns."""
    lsns = []
    for i in range(first, first + n):
        long = " and the lamp was lit again" * 120 if i % 4 == 0 else ""
        receipt = await mem.add_turn(VICTIM, SESSION, "user",
                                     f"{MARKER} was said in turn {i}{long}")
        lsns.append(receipt.lsn)
        await _bystanders(mem, i, 10)
    return lsns


async def _live_vectors(mem: Engine, lsns: list[int]) -> list[bytes]:
    """The victim's stored vector values at these lsns, read through the serving store."""
    keys = [VICTIM.encode() + b"\x00" + lsn.to_bytes(8, "big") for lsn in lsns]

    def read(txn, dbs):
        return [txn.get(key, db=dbs[b"vectors"]) for key in keys]

    return await mem._store.read(read)


@pytest.mark.parametrize("scope", ["session", "user"])
async def test_forgotten_bytes_leave_the_live_data_file_among_bystanders(
        tmp_path: Path, graphs, zeroing_passes, scope) -> None:
    """With a few hundred turns of other users written around the forgotten ones by the same
    process (long ones too, on LMDB's overflow pages), no byte of the marker, of a forgotten
    vector or of the forgotten ids is in any file of the store, the live data.mdb included,
    once flush returns after the forget, nor after more ingestion, nor after close; nor in
    a snapshot taken then, whose copy of the scrubbed store is not zeroed again."""
    store = tmp_path / "store"
    async with open_engine(store) as mem:
        marked = await _marked(mem, 0, 12)
        await mem.store_note(VICTIM, f"a note that says {MARKER} too")
        await _fill(mem, VICTIM, "s2", 20, marked=False)
        await mem.flush()
        await mem.recall(VICTIM, "lighthouse")  # a graph for the user, saved at close
        uv = mem._ann._users[VICTIM].turn
        while uv.graph is None or uv.graph_rows < uv.n or uv.writing:
            await trio.sleep(0.01)
    ids = [SESSION.encode()] + ([VICTIM.encode()] if scope == "user" else [])
    needles = [*_needles(_vectors_of(store, VICTIM, set(marked))), *ids]
    assert any(p.startswith("ann/") for p in _holding(store, needles))

    async with open_engine(store) as mem:
        await mem.recall(VICTIM, "lighthouse")  # the saved graph is loaded and in use
        marked = await _marked(mem, 12, 18)  # the forgotten bytes pass through this process
        await mem.flush()
        vectors = await _live_vectors(mem, marked)
        assert None not in vectors
        live = _needles(vectors)[1:]
        data = (store / "data.mdb").read_bytes()
        for needle in [MARKER.encode(), *ids, *live[::2]]:  # the premise: in the live file
            assert needle in data, needle  # are the marker, the ids and the float16 vectors
        needles += live
        if scope == "session":
            await mem.forget_session(VICTIM, SESSION)
            note = await mem.recall(VICTIM, MARKER, kinds=["note"])
            await mem.delete_note(VICTIM, note[0].id)
        else:
            await mem.forget_user(VICTIM)
        await mem.flush()
        assert _holding(store, needles) == []
        for round_ in range(100, 103):  # ingestion goes on: nothing comes back
            await _bystanders(mem, round_, 60)
            await mem.flush()
        assert _holding(store, needles) == []
        assert _index_docs_with_marker(store / "fulltext") == 0
        await _bystanders(mem, 103, 60)  # unflushed: the snapshot waits for nothing but scrubs
        await mem.snapshot(tmp_path / "snap")
        assert zeroing_passes == []
        assert _holding(tmp_path / "snap", needles) == []
        if scope == "session":
            assert len(await mem.session_history(VICTIM, "s2")) == 20
    assert _holding(store, needles) == []
    async with open_engine(store) as mem:
        assert len(await mem.session_history("by3", "s0-3")) == 1
        assert await mem.recall("by3", "weather garden")
    assert _holding(store, needles) == []


REPO = Path(__file__).resolve().parents[2]
# As a module from the repository's root: as a script, tests/reliability/ would come first on
# sys.path and tests/actors/ would stand in for the real actors package.
CHILD = [sys.executable, "-m", "tests.reliability.scrub_child"]


async def test_a_reader_in_another_process_keeps_its_snapshot_while_the_bytes_go(
        tmp_path: Path) -> None:
    """A reader in another process holding a snapshot from before the forget reads the
    forgotten turns intact after the scrub's pass over the file (the pages it reads are left
    to it); flush waits for it, and once it ends the bytes are gone from every file."""
    store = tmp_path / "store"
    async with open_engine(store) as mem:
        for i in range(30):
            await mem.add_turn(VICTIM, "s1", "user", f"{MARKER} was said in turn {i}")
            await _bystanders(mem, i, 8)
        await mem.flush()
        reader = subprocess.Popen([*CHILD, "hold", str(store)], cwd=REPO, text=True,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            line = await trio.to_thread.run_sync(reader.stdout.readline)
            assert line.split() == ["holding", "30"]
            passes = []
            zero = mem._store._zero_stale
            passed = trio.Event()  # set once the scrub's first pass over the file returned

            async def spied(*args):
                result = await zero(*args)
                passes.append(result)
                passed.set()
                return result

            mem._store._zero_stale = spied
            await mem.forget_user(VICTIM)
            async with trio.open_nursery() as nursery:
                flushed = trio.Event()  # set once flush returned

                async def flush() -> None:
                    await mem.flush()
                    flushed.set()

                nursery.start_soon(flush)
                await passed.wait()
                reader.stdin.write("check\n")
                reader.stdin.flush()
                line = await trio.to_thread.run_sync(reader.stdout.readline)
                assert line.strip() == "intact"
                assert not flushed.is_set()  # the scrub cannot end while the snapshot lives
                assert passes[0][2].kept_pages > 0
                reader.stdin.write("release\n")
                reader.stdin.flush()
                line = await trio.to_thread.run_sync(reader.stdout.readline)
                assert line.strip() == "released"
            assert _holding(store, [MARKER.encode(), VICTIM.encode()]) == []
        finally:
            reader.stdin.close()
            reader.stdout.close()
            reader.wait(timeout=60)
        assert await mem.recall("by3", "weather garden")


@pytest.mark.parametrize("point", ["reopen", "zeroing"])
async def test_kill_9_during_the_scrub_loses_nothing(tmp_path: Path, zeroing_passes,
                                                     point: str) -> None:
    """SIGKILL in the middle of the scrub (the environment closed and not yet opened again,
    or zeros half written): the store opens, every durable turn is there, the chain verifies,
    and the next engine finishes the scrub: no byte of the forgotten user is left, nor in a
    snapshot taken before that (its copy zeroed) or after."""
    store = tmp_path / "store"
    child = subprocess.run([*CHILD, "crash", str(store), point], cwd=REPO, text=True,
                           capture_output=True, timeout=300)
    lines = child.stdout.splitlines()
    assert child.returncode == -signal.SIGKILL, (child.returncode, child.stderr[-2000:])
    assert "forgotten" in lines and "survived" not in lines
    acked = [line.split()[1:] for line in lines if line.startswith("acked")]
    assert len(acked) == 240
    assert _holding(store, [MARKER.encode()])  # the kill left forgotten bytes behind
    # A snapshot now, from a reader (which scrubs nothing): the copy is zeroed instead.
    async with open_engine(store, read_only=True) as reader:
        await reader.snapshot(tmp_path / "snap-read-only")
    assert zeroing_passes == [tmp_path / "snap-read-only.partial" / "store"]
    assert _holding(tmp_path / "snap-read-only", [MARKER.encode(), VICTIM.encode()]) == []
    async with open_engine(store) as mem:
        await mem.snapshot(tmp_path / "snap")  # after the scrub the open started
        assert len(zeroing_passes) == 1
        assert _holding(tmp_path / "snap", [MARKER.encode(), VICTIM.encode()]) == []
        await mem.flush()
        for user, session, turn_id in acked:
            turn = await mem.get_turn(user, turn_id)
            assert turn is not None and turn.session_id == session
        assert await mem.session_history(VICTIM, "s1") == []
    assert _holding(store, [MARKER.encode(), VICTIM.encode()]) == []
    report = await Engine.verify(store)
    assert report["ok"], report["problems"]


async def test_a_forget_landing_during_a_snapshot_is_in_none_of_its_files(tmp_path: Path) -> None:
    """A forget that commits after the snapshot copied the text index and before it copied
    LMDB: the snapshot's store holds the forget, so its text index must not hold what the
    forget removed (raw bytes, or documents tantivy only marked deleted) either."""
    async with open_engine(tmp_path / "store") as mem:
        await _fill(mem, "ana", "s1", 24, marked=True)
        await _fill(mem, "bo", "s1", 8, marked=False)
        await mem.flush()
        copy_text_index = mem._fulltext.copy_to

        async def copy_then_forget(dest: Path) -> tuple[int, bool]:
            copied = await copy_text_index(dest)
            await mem.forget_user("ana")  # lands between the text index's copy and LMDB's
            return copied

        mem._fulltext.copy_to = copy_then_forget
        manifest = await mem.snapshot(tmp_path / "snap")
    assert manifest.counts["users"] == 1
    assert _holding(tmp_path / "snap", [MARKER.encode()]) == []
    assert _index_docs_with_marker(tmp_path / "snap" / "fulltext") == 0
    await Engine.restore(tmp_path / "snap", tmp_path / "restored")
    async with open_engine(tmp_path / "restored") as mem:
        await mem.flush()
        assert await mem.recall("ana", f"{MARKER} lighthouse keeper") == []
        assert await mem.recall("bo", "weather garden")


async def test_no_write_lands_between_the_scrubs_reopen_and_its_zeroing(tmp_path: Path) -> None:
    """The scrub opens LMDB afresh (no page buffer that held a deleted record) and then
    zeroes what the file keeps beside its records. A write in between would copy pages that
    still hold deleted bytes (up to 7 at each edge of a page's free space, and its padding)
    into fresh buffers, which writes after the zeroing reuse: the bytes would come back
    where it never looks again. A write queued while the scrub reopens waits until the
    zeroing pass is done."""
    async with open_engine(tmp_path / "store") as mem:
        await _fill(mem, "ana", "s1", 12, marked=True)
        await _fill(mem, "bo", "s1", 8, marked=False)
        await mem.flush()
        store = mem._store
        events: list[str] = []
        reopen, zero, write = store._reopen_in_thread, store._zero_stale_in_thread, store._write

        async def queue_a_write() -> None:
            await mem.add_turn("bo", "s1", "user", "a turn that arrives while the scrub reopens")
            await trio.testing.wait_all_tasks_blocked()  # the commit loop waits for the writer

        def reopen_with_a_write_queued() -> None:
            trio.from_thread.run(queue_a_write)
            reopen()
            events.append("reopen")

        def zeroing(*args):
            events.append("zero")
            return zero(*args)

        def writing(*args):
            events.append("write")
            return write(*args)

        store._reopen_in_thread = reopen_with_a_write_queued
        store._zero_stale_in_thread = zeroing
        store._write = writing
        await mem.forget_user("ana")
        await mem.flush()
        assert "reopen" in events
        assert events[events.index("reopen") + 1] == "zero", events
        assert events.count("write") > events.index("reopen")  # the queued turn was written
        assert len(await mem.session_history("bo", "s1")) == 9
    assert _holding(tmp_path / "store", [MARKER.encode()]) == []


def _meta(store: Path) -> dict[bytes, bytes]:
    env = lmdb.open(str(store), readonly=True, lock=False, max_dbs=MAX_DBS)
    try:
        with env.begin() as txn:
            return dict(txn.cursor(env.open_db(b"meta", txn=txn, create=False)))
    finally:
        env.close()


async def test_a_store_an_older_build_scrubbed_is_scrubbed_again_at_open(
        tmp_path: Path, zeroing_passes) -> None:
    """A store without the scrubbed mark (an older build's scrub could leave a few bytes in
    pages written beside it) is scrubbed when an owner opens it: until then a snapshot
    zeroes its copy, after that no snapshot needs to."""
    store = tmp_path / "store"
    async with open_engine(store) as mem:
        await _fill(mem, "ana", "s1", 12, marked=True)
        await mem.forget_user("ana")
        await mem.flush()
    assert SCRUBBED_KEY in _meta(store) and SCRUB_KEY not in _meta(store)
    env = lmdb.open(str(store), max_dbs=MAX_DBS)
    try:
        with env.begin(write=True) as txn:
            txn.delete(SCRUBBED_KEY, db=env.open_db(b"meta", txn=txn, create=False))
    finally:
        env.close()
    async with open_engine(store, read_only=True) as reader:
        await reader.snapshot(tmp_path / "before")
    assert len(zeroing_passes) == 1
    async with open_engine(store) as mem:
        await mem.snapshot(tmp_path / "after")
        assert len(zeroing_passes) == 1
    meta = _meta(store)
    assert SCRUBBED_KEY in meta and SCRUB_KEY not in meta
    for snap in ("before", "after"):
        assert _holding(tmp_path / snap, [MARKER.encode()]) == []


async def test_a_flush_during_a_scrubs_reopen_waits_for_it(store_path, monkeypatch) -> None:
    """The scrub after a forget closes and reopens the environment in the background; a flush
    (or any wait for a commit) that lands while the new environment is being opened waits
    for it, and never takes the gap for a closed engine."""
    import threading

    async with open_engine(store_path, config={"long_term": False}) as mem:
        for i in range(5):
            await mem.add_turn("ana", "s1", "user", f"forgettable turn {i}")
        await mem.add_turn("ana", "s2", "user", "kept turn")
        await mem.flush()
        store = mem._parts.store
        real_open = store._lmdb_open
        reopening, go = threading.Event(), threading.Event()

        def slow_open(size: int) -> lmdb.Environment:
            reopening.set()  # the old environment is closed by now
            go.wait(30)
            return real_open(size)

        monkeypatch.setattr(store, "_lmdb_open", slow_open)
        await mem.forget_session("ana", "s1")
        try:
            assert await trio.to_thread.run_sync(reopening.wait, 30)
            await mem.add_turn("ana", "s2", "user", "said while the store reopens")
            async with trio.open_nursery() as nursery:
                nursery.start_soon(mem.flush)
                await trio.testing.wait_all_tasks_blocked(0.05)
                go.set()
        finally:
            go.set()
        assert [t.text for t in await mem.session_history("ana", "s2")] == [
            "kept turn", "said while the store reopens"]


async def test_a_forgotten_sessions_reviewed_turns_leave_no_review_state(store_path) -> None:
    """A turn rated with review() has an FSRS state under its id; forgetting its session took
    the turn and left the state (forget_user took it). It goes with the turn now, and a
    bystander session's reviewed turn keeps its own."""
    async with open_engine(store_path) as mem:
        gone = await mem.add_turn("ana", "private", "user", "my secret plan", durable=True)
        kept = await mem.add_turn("ana", "other", "user", "the weather", durable=True)
        for receipt in (gone, kept):
            await mem.review("ana", receipt.turn_id, "good")
        await mem.forget_session("ana", "private")
        await mem.flush()
    reviews = b"".join(key for key, _ in raw_databases(store_path)["reviews"])
    assert gone.turn_id.encode() not in reviews
    assert kept.turn_id.encode() in reviews


@pytest.mark.parametrize("conversation", ["s1", None])
async def test_a_review_another_conversation_holds_leaves_with_the_session_it_quotes(
        tmp_path: Path, conversation) -> None:
    """retrieve_memory in one conversation keeps what it showed for the next reply to rate;
    forgetting the session those turns came from left their text and ids in that record,
    in data.mdb after flush and close. The records naming what a forget removes go."""
    store = tmp_path / "store"
    async with open_engine(store) as mem:
        turn = await mem.add_turn("u", "s0", "user", "My friend Zqpendingmarker moved to Berlin.")
        await mem.add_turn("u", "s1", "user", "I like tea.")
        await mem.flush()
        shown = await mem.retrieve_memory("u", "friend moved Berlin", conversation_id=conversation)
        assert "Zqpendingmarker" in shown
        await mem.flush()
        await mem.forget_session("u", "s0")
        await mem.flush()
    everything = b"".join(k + v for rows in raw_databases(store).values() for k, v in rows)
    assert b"Zqpendingmarker" not in everything and turn.turn_id.encode() not in everything
