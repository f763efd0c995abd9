"""Snapshots taken while the engine serves, restore, and compaction."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest
import trio

import engine._snapshot as snapshot_mod
from engine import (
    Engine,
    EngineBroken,
    InvalidInput,
    Manifest,
    StoreIncompatible,
    StoreInUse,
)

from .conftest import StepClock, open_engine

QUERIES = ["lisbon flat", "dog walk", "train to porto", "coffee", "peanut allergy"]
WORDS = ["lisbon", "flat", "dog", "walk", "train", "porto", "coffee", "peanut", "allergy", "job"]


def _text(i: int) -> str:
    return f"{WORDS[i % 10]} {WORDS[(i * 7) % 10]} {WORDS[(i * 3) % 10]} note {i}"


def _files_containing(root: Path, needles: list[bytes]) -> list[str]:
    found = []
    for path in root.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            found += [f"{path.relative_to(root)}: {n!r}" for n in needles if n in data]
    return found


async def _recall_texts(mem: Engine, user: str) -> list[list[str]]:
    return [[h.text for h in await mem.recall(user, q, limit=5, kinds=["turn"])] for q in QUERIES]


async def test_a_snapshot_taken_during_ingest_restores_to_the_same_answers(tmp_path) -> None:
    """While producers ingest, the snapshot captures exactly the turns up to its lsn, and the
    restored engine answers like an engine holding just those turns."""
    source, snap, restored, reference = (tmp_path / n for n in ("src", "snap", "rst", "ref"))

    async def produce(mem: Engine, session: str, n: int) -> None:
        for i in range(n):
            await mem.add_turn("ana", session, "user", _text(1000 + i))
            await trio.sleep(0)

    # Turns only: episodes made at different moments in the two engines would shift tantivy's
    # tie-breaks between these near-identical texts (the long-term layer's own snapshot test
    # is test_long_term_records_survive_a_snapshot).
    turns_only = {"long_term": False}
    async with open_engine(source, clock=StepClock(), config=turns_only) as mem:
        for i in range(40):
            await mem.add_turn("ana", "early", "user", _text(i))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(produce, mem, "during", 1000)
            while mem._store.committed_lsn < 100:  # the producer is well under way
                await trio.sleep(0)
            manifest = await mem.snapshot(snap)
        history = {s: await mem.session_history("ana", s, limit=2000) for s in ("early", "during")}
    assert isinstance(manifest, Manifest) and manifest.lsn >= 100
    expected = sorted((t for ts in history.values() for t in ts if t.lsn <= manifest.lsn),
                      key=lambda t: t.lsn)
    assert manifest.counts["turns"] == len(expected)

    await Engine.restore(snap, restored)
    async with open_engine(restored, config=turns_only) as mem:
        await mem.flush()
        got = [t for s in ("early", "during") for t in await mem.session_history("ana", s, limit=2000)]
        assert sorted(t.lsn for t in got) == [t.lsn for t in expected]
        restored_answers = await _recall_texts(mem, "ana")
    async with open_engine(reference, config=turns_only) as mem:
        for t in expected:
            await mem.add_turn("ana", t.session_id, t.role, t.text, at=t.at)
        await mem.flush()
        assert await _recall_texts(mem, "ana") == restored_answers


FORGOTTEN = [b"zed-the-user", b"xyzzysecret", b"zsession"]


async def _forget_a_user(mem: Engine, turns: int) -> None:
    """Turns of zed and ana, all indexed; then zed is forgotten."""
    for i in range(turns):
        await mem.add_turn("zed-the-user", "zsession", "user", f"xyzzysecret plan {i}")
        await mem.add_turn("ana", "s", "user", f"ana plan {i}")
    await mem.flush()
    await mem.forget_user("zed-the-user")
    await mem.flush()


async def test_a_forgotten_user_is_in_no_byte_of_a_later_snapshot(tmp_path) -> None:
    """After forget_user, neither the snapshot nor a store restored from it holds the user's
    id or words; the live text index was purged by flush, so the snapshot copies it."""
    live = tmp_path / "live"
    async with open_engine(live) as mem:
        await _forget_a_user(mem, 30)
        manifest = await mem.snapshot(tmp_path / "snap")
    assert manifest.fulltext == "copied" and manifest.counts["users"] == 1
    # Outside LMDB's data file (whose page free space a scrub cannot promise to clear) the
    # live store holds nothing of the user either.
    assert [f for f in _files_containing(live, FORGOTTEN) if not f.startswith("data.mdb")] == []
    assert _files_containing(tmp_path / "snap", FORGOTTEN) == []
    await Engine.restore(tmp_path / "snap", tmp_path / "restored")
    async with open_engine(tmp_path / "restored") as mem:
        await mem.flush()
        assert await mem.recall("zed-the-user", "xyzzysecret plan") == []
        assert len(await mem.recall("ana", "ana plan", limit=50, kinds=["turn"])) == 30
    assert _files_containing(tmp_path / "restored", FORGOTTEN) == []


async def test_compact_leaves_no_bytes_of_forgotten_users_in_the_live_store(tmp_path) -> None:
    """compact rewrites LMDB record by record and rebuilds a text index with tombstones (a
    superseded note's here; a forget's were purged by flush); it refuses a store an engine
    has open."""
    live = tmp_path / "live"
    async with open_engine(live) as mem:
        await _forget_a_user(mem, 20)
        await mem.add_turn("ana", "t", "user", "one more turn")
        note = await mem.store_note("ana", "first version")
        await mem.flush()  # committed with the turn in one segment, which the update marks
        await mem.update_note("ana", note.note_id, "second version")
        await mem.flush()
        with pytest.raises(StoreInUse, match=rf"is in use by process {os.getpid()} "
                                             r"\(this process\), serving"):
            await Engine.compact(live)
    report = await Engine.compact(live)
    assert report["fulltext_rebuilt"] is True
    assert _files_containing(live, FORGOTTEN) == []
    async with open_engine(live) as mem:
        hits = await mem.recall("ana", "ana plan", limit=50, kinds=["turn"])
        assert len([h for h in hits if h.text.startswith("ana plan")]) == 20


async def test_restore_checks_what_it_is_given(tmp_path) -> None:
    """No manifest, a damaged file, or a store already there are refused with the fix."""
    async with open_engine(tmp_path / "live") as mem:
        await mem.add_turn("ana", "s", "user", "hello")
        await mem.flush()
        await mem.snapshot(tmp_path / "snap")
        with pytest.raises(InvalidInput, match=r"dest: expected a new or empty directory"):
            await mem.snapshot(tmp_path / "snap")
    with pytest.raises(InvalidInput, match=r"snapshot: expected a snapshot directory with manifest.json"):
        await Engine.restore(tmp_path / "live", tmp_path / "x")
    with pytest.raises(InvalidInput, match=r"store_path: expected a new or empty directory.*overwrite=True"):
        await Engine.restore(tmp_path / "snap", tmp_path / "live")
    await Engine.restore(tmp_path / "snap", tmp_path / "live", overwrite=True)
    data = tmp_path / "snap" / "store" / "data.mdb"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(StoreIncompatible, match=r"is damaged: store/data.mdb does not match the manifest"):
        await Engine.restore(tmp_path / "snap", tmp_path / "other")
    assert not (tmp_path / "other").exists()


async def test_long_term_records_survive_a_snapshot(tmp_path) -> None:
    """Facts with their history, episodes, entities and review state restore as they were."""
    source, snap, restored = tmp_path / "src", tmp_path / "snap", tmp_path / "rst"
    async with open_engine(source) as mem:
        await mem.add_turn("ana", "s1", "user", "I live in Lisbon with my dog Biscuit.")
        await mem.add_turn("ana", "s2", "user", "Big news: I moved to Porto.")
        for i in range(20):
            await mem.add_turn("ana", "s3", "user" if i % 2 == 0 else "assistant",
                               f"Planning the garden, tomatoes and basil, step {i}.")
        await mem.flush()
        (episode, *_) = await mem.episodes("ana")
        await mem.review("ana", episode.episode_id, "easy")
        raw = await mem.retrieve_memory_raw("ana", "garden tomatoes")
        await mem.flush()  # the use counts of the facts it showed
        profile = await mem.profile("ana")
        history = await mem.fact_history("ana", "identity", "location")
        episodes = await mem.episodes("ana")
        biscuit = await mem.entity_info("ana", "biscuit")
        await mem.snapshot(snap)
    await Engine.restore(snap, restored)
    async with open_engine(restored) as mem:
        await mem.flush()
        assert await mem.profile("ana") == profile
        assert await mem.fact_history("ana", "identity", "location") == history
        assert await mem.episodes("ana") == episodes
        again = await mem.retrieve_memory_raw("ana", "garden tomatoes")
        assert await mem.entity_info("ana", "biscuit") == biscuit
        assert biscuit.entity.mentions == 2  # the turn, and the fact "Their dog is called ..."
    assert [i.id for i in again.episodic] == [i.id for i in raw.episodic]
    assert [(i.stability, i.last_reviewed_at) for i in again.episodic] == [
        (i.stability, i.last_reviewed_at) for i in raw.episodic]
    assert [s.fact for s in again.semantic] == [s.fact for s in raw.semantic]


async def test_a_restored_store_is_on_disk_before_it_takes_its_name(tmp_path, monkeypatch) -> None:
    """A power cut right after restore returns must not leave a store whose files the page
    cache still held: every file and folder of the copy is fsynced before the copy is renamed
    into place, and the folder holding it after (the rename itself)."""
    import engine._snapshot as snapshot_mod

    async with open_engine(tmp_path / "live") as mem:
        for i in range(20):
            await mem.add_turn("ana", "s", "user", _text(i))
        await mem.flush()
        await mem.snapshot(tmp_path / "snap")
    synced: list[Path] = []
    real = snapshot_mod._fsync

    def recording(path: Path) -> None:
        synced.append(Path(path))
        real(path)

    monkeypatch.setattr(snapshot_mod, "_fsync", recording)
    target = tmp_path / "restored"
    await Engine.restore(tmp_path / "snap", target)
    incoming = target.with_name(target.name + ".restoring")
    copied = [incoming / p.relative_to(target) for p in target.rglob("*")]
    assert copied and set(copied) | {incoming} <= set(synced)
    assert synced[-1] == tmp_path  # the rename, once the copy is on disk
    async with open_engine(target) as mem:
        assert len(await mem.session_history("ana", "s", limit=100)) == 20


async def test_a_snapshot_hashed_as_it_is_copied_records_the_checksums_of_its_files(
        tmp_path) -> None:
    """The store copy of a snapshot is hashed while it is written, not read back: what the
    manifest records is what reading every file of the snapshot gives, for a store that
    never deleted anything (hashed in the copy's pass) and after a forget (hashed after the
    zeroing), and both restore."""
    from engine._snapshot import _checksums

    async with open_engine(tmp_path / "live") as mem:
        for i in range(60):
            await mem.add_turn("ana" if i % 2 else "bo", "s", "user", _text(i))
        await mem.flush()
        first = await mem.snapshot(tmp_path / "fresh")
        await mem.forget_user("bo")
        await mem.flush()
        second = await mem.snapshot(tmp_path / "forgot")
    for name, manifest in (("fresh", first), ("forgot", second)):
        assert manifest.files == await _checksums(tmp_path / name)
        assert "store/data.mdb" in manifest.files
        await Engine.restore(tmp_path / name, tmp_path / f"{name}-restored")
        async with open_engine(tmp_path / f"{name}-restored") as mem:
            assert len(await mem.session_history("ana", "s", limit=100)) == 30


async def test_a_snapshot_destination_that_is_no_usable_path_is_invalid_input(mem, tmp_path) -> None:
    """The engine checks the path it is given, whoever calls (the HTTP route adds only that
    it be absolute): a NUL, a lone surrogate, a name too long or a path through a file is
    InvalidInput naming ``dest``, not a ValueError or OSError, and nothing is written."""
    (tmp_path / "a-file").write_text("not a directory")
    for dest in (tmp_path / "nul\x00byte", tmp_path / "\ud800", tmp_path / ("x" * 300),
                 tmp_path / "a-file" / "snap"):
        with pytest.raises(InvalidInput) as refused:
            await mem.snapshot(dest)
        assert refused.value.field == "dest"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "store"]


async def test_a_restore_path_that_is_no_usable_path_is_invalid_input(tmp_path) -> None:
    """A snapshot or store path with a NUL, a lone surrogate or a name too long, a store
    path through a file, and a snapshot whose manifest.json is a folder are InvalidInput
    naming the path (never a ValueError, an OSError or an exception group), and nothing is
    written."""
    async with open_engine(tmp_path / "live") as mem:
        await mem.add_turn("ana", "s", "user", "hello")
        await mem.flush()
        await mem.snapshot(tmp_path / "snap")
    (tmp_path / "a-file").write_text("not a directory")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    bad = [tmp_path / "nul\x00byte", tmp_path / "\ud800", tmp_path / ("x" * 300)]
    for store in [*bad, tmp_path / "a-file" / "store"]:
        with pytest.raises(InvalidInput) as refused:
            await Engine.restore(tmp_path / "snap", store)
        assert refused.value.field == "store_path", store
    for snapshot in bad:
        with pytest.raises(InvalidInput) as refused:
            await Engine.restore(snapshot, tmp_path / "new")
        assert refused.value.field == "snapshot", snapshot
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    folder = tmp_path / "odd-snap"
    (folder / "manifest.json").mkdir(parents=True)
    with pytest.raises(InvalidInput, match=r"snapshot: expected a snapshot directory with "
                                           r"manifest.json"):
        await Engine.restore(folder, tmp_path / "new")
    assert not (tmp_path / "new").exists()


async def test_a_path_through_a_symbolic_link_loop_is_invalid_input(mem, tmp_path) -> None:
    """A loop of symbolic links as a snapshot's, a restore's or a store's path is InvalidInput
    naming the path, as the other paths no file can be at (it was pathlib's RuntimeError)."""
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    for dest in (loop, loop / "snap"):
        with pytest.raises(InvalidInput, match=r"loop of symbolic links") as refused:
            await mem.snapshot(dest)
        assert refused.value.field == "dest"
    await mem.snapshot(tmp_path / "snap")
    with pytest.raises(InvalidInput, match=r"loop of symbolic links") as refused:
        await Engine.restore(tmp_path / "snap", loop / "store")
    assert refused.value.field == "store_path"
    with pytest.raises(InvalidInput, match=r"loop of symbolic links"):
        async with open_engine(loop / "store"):
            pass


async def test_a_restore_into_the_snapshot_itself_is_refused_and_the_snapshot_kept(
        tmp_path) -> None:
    """Restoring over the snapshot's own ``store/`` folder would make its data.mdb the live
    store's, so the first write broke the snapshot: a store inside its snapshot is refused
    with or without overwrite, and the snapshot still restores."""
    async with open_engine(tmp_path / "live") as mem:
        await mem.add_turn("ana", "s", "user", "hello")
        await mem.flush()
        await mem.snapshot(tmp_path / "snap")
    for target in ("store", "other"):
        for overwrite in (False, True):
            with pytest.raises(InvalidInput, match=r"store_path: expected a directory outside "
                                                   r"the snapshot"):
                await Engine.restore(tmp_path / "snap", tmp_path / "snap" / target,
                                     overwrite=overwrite)
    assert sorted(p.name for p in (tmp_path / "snap").iterdir()) == [
        "fulltext", "manifest.json", "store"]
    assert [p.name for p in (tmp_path / "snap" / "store").iterdir()] == ["data.mdb"]
    await Engine.restore(tmp_path / "snap", tmp_path / "again")
    async with open_engine(tmp_path / "again") as mem:
        assert [t.text for t in await mem.session_history("ana", "s")] == ["hello"]


async def test_a_snapshots_own_store_is_never_opened_to_write(tmp_path) -> None:
    """The ``store/`` folder inside a snapshot holds a data.mdb that is an LMDB store: opened
    to write or compacted, it no longer matched the manifest, and the snapshot (maybe the
    only backup) would not restore. Both are refused naming the snapshot, a read-only open
    is not, and the snapshot restores afterwards."""
    async with open_engine(tmp_path / "live") as mem:
        await mem.add_turn("ana", "s", "user", "hello")
        await mem.flush()
        await mem.snapshot(tmp_path / "snap")
    inside = tmp_path / "snap" / "store"
    before = (inside / "data.mdb").read_bytes()
    refusal = rf"path: expected a store, found the copy of one inside the snapshot {tmp_path}"
    with pytest.raises(InvalidInput, match=refusal):
        async with open_engine(inside):
            pass
    with pytest.raises(InvalidInput, match=refusal):
        await Engine.compact(inside)
    assert [p.name for p in inside.iterdir()] == ["data.mdb"]
    async with open_engine(inside, read_only=True) as mem:
        assert [t.text for t in await mem.session_history("ana", "s")] == ["hello"]
    assert (inside / "data.mdb").read_bytes() == before
    await Engine.restore(tmp_path / "snap", tmp_path / "again")
    async with open_engine(tmp_path / "again") as mem:
        assert [t.text for t in await mem.session_history("ana", "s")] == ["hello"]


async def test_a_store_folder_beside_another_programs_manifest_still_opens(tmp_path) -> None:
    """A web app keeps its store in webapp/store beside its own manifest.json (a PWA's): that
    is no snapshot, and the store opens and compacts as before."""
    store = tmp_path / "webapp" / "store"
    async with open_engine(store) as mem:
        await mem.add_turn("ana", "s", "user", "hello")
    (tmp_path / "webapp" / "manifest.json").write_text('{"name": "My PWA", "files": {}}')
    async with open_engine(store) as mem:
        assert [t.text for t in await mem.session_history("ana", "s")] == ["hello"]
    await Engine.compact(store)


async def test_snapshots_to_one_destination_at_once_give_one_snapshot(tmp_path) -> None:
    """Every snapshot to a destination wrote in DEST.partial and began by deleting it: a
    second one deleted the first's copy under it, and they raced on the rename (the engine
    broke; over HTTP, 500s and at times no snapshot at all). One writes it; the others are
    refused. So with restores to one place, which shared STORE.restoring alike."""
    async with open_engine(tmp_path / "live") as mem:
        await mem.add_turns([{"user_id": "ana", "session_id": "s", "role": "user",
                              "text": f"turn {i}"} for i in range(200)])
        await mem.flush()
        outcomes: list[object] = []

        async def one() -> None:
            try:
                outcomes.append(await mem.snapshot(tmp_path / "same"))
            except InvalidInput as exc:
                outcomes.append(exc)

        async with trio.open_nursery() as nursery:
            for _ in range(6):
                nursery.start_soon(one)
    assert sum(isinstance(o, Manifest) for o in outcomes) == 1, outcomes
    assert all(isinstance(o, Manifest) or o.field == "dest" for o in outcomes)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["live", "same"]
    restored: list[object] = []

    async def restore() -> None:
        try:
            restored.append(await Engine.restore(tmp_path / "same", tmp_path / "again"))
        except InvalidInput as exc:
            restored.append(exc)

    async with trio.open_nursery() as nursery:  # restores to one place: one restores it
        for _ in range(4):
            nursery.start_soon(restore)
    assert sum(isinstance(o, Manifest) for o in restored) == 1, restored
    assert all(isinstance(o, Manifest) or o.field == "store_path" for o in restored)
    async with open_engine(tmp_path / "again") as mem:
        assert len(await mem.session_history("ana", "s", limit=1000)) == 200


async def _restore_twice(snapshot: Path, target: Path, overwrite: bool,
                         second_after: trio.Event, first_done: trio.Event
                         ) -> dict[str, object]:
    """Restore ``snapshot`` to ``target`` twice, the second once ``second_after`` is set;
    ``first_done`` is set when the first returns. Each outcome, a Manifest or the engine's
    or the disk's error, by "first" and "second"."""
    outcomes: dict[str, object] = {}

    async def restore(name: str) -> None:
        try:
            outcomes[name] = await Engine.restore(snapshot, target, overwrite=overwrite)
        except (InvalidInput, OSError) as exc:
            outcomes[name] = exc
        if name == "first":
            first_done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(restore, "first")
        await second_after.wait()
        nursery.start_soon(restore, "second")
    return outcomes


async def test_a_restore_finds_what_is_there_once_it_holds_its_place(
        tmp_path, monkeypatch) -> None:
    """A restore checked that its target was new, then waited to take STORE.restoring while
    another restore to the same place finished: it then replaced that store, without
    overwrite and without its owner's lock. It looks once it holds the place."""
    async with open_engine(tmp_path / "live") as mem:
        await mem.add_turn("ana", "s", "user", "hello")
        await mem.snapshot(tmp_path / "snap")
    first_claimed, first_done = trio.Event(), trio.Event()
    real = snapshot_mod._claimed
    calls = []

    def claimed(path, field):  # on a worker thread of trio's
        calls.append(path)
        if len(calls) == 1:
            held = real(path, field)
            trio.from_thread.run_sync(first_claimed.set)
            return held
        trio.from_thread.run(first_done.wait)  # the second takes it after the first is done
        return real(path, field)

    monkeypatch.setattr(snapshot_mod, "_claimed", claimed)
    outcomes = await _restore_twice(tmp_path / "snap", tmp_path / "new", False,
                                    first_claimed, first_done)
    assert isinstance(outcomes["first"], Manifest), outcomes
    assert (isinstance(outcomes["second"], InvalidInput)
            and "with files in it" in str(outcomes["second"]))


async def test_an_engine_opened_where_a_restore_copies_is_refused(tmp_path,
                                                                  monkeypatch) -> None:
    """A restore to a new path locked nothing there while it copied: an engine opened the
    path meanwhile, wrote a turn, and the restore then moved its store aside and deleted it
    under it, without overwrite. The place is the restore's from the start."""
    async with open_engine(tmp_path / "live") as mem:
        await mem.add_turn("ana", "s", "user", "from the snapshot", durable=True)
        await mem.snapshot(tmp_path / "snap")
    copying, tried = trio.Event(), trio.Event()
    real = snapshot_mod._fsync_tree

    async def fsync_tree(path):
        copying.set()
        await tried.wait()
        await real(path)

    monkeypatch.setattr(snapshot_mod, "_fsync_tree", fsync_tree)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(Engine.restore, tmp_path / "snap", tmp_path / "new")
        await copying.wait()
        with pytest.raises(StoreInUse, match="restore"):
            async with open_engine(tmp_path / "new"):
                pass
        tried.set()
    async with open_engine(tmp_path / "new") as mem:
        assert [t.text for t in await mem.session_history("ana", "s")] == ["from the snapshot"]


async def test_a_restore_failing_after_its_rename_leaves_the_next_ones_copy(
        tmp_path, monkeypatch) -> None:
    """Once a restore's STORE.restoring took the store's name, the name is free, and a second
    restore may hold a folder of that name: the first one failing after (its last fsync)
    deleted the second one's copy under it. It deletes only the folder it still holds."""
    async with open_engine(tmp_path / "live") as mem:
        await mem.add_turn("ana", "s", "user", "hello", durable=True)
        await mem.snapshot(tmp_path / "snap")
    store = tmp_path / "store"
    await Engine.restore(tmp_path / "snap", store)
    renamed, first_done = trio.Event(), trio.Event()
    second_claimed = threading.Event()
    real_fsync, real_claimed = snapshot_mod._fsync, snapshot_mod._claimed
    claims, kept = [], []

    def fsync(path):
        if Path(path) == tmp_path and not renamed.is_set():
            trio.from_thread.run_sync(renamed.set)
            second_claimed.wait(30)
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))
        return real_fsync(path)

    def claimed(path, field):
        held = real_claimed(path, field)
        claims.append(path)
        if len(claims) == 2:
            second_claimed.set()
            trio.from_thread.run(first_done.wait)  # copies once the first has failed
            kept.append(path.exists())
        return held

    monkeypatch.setattr(snapshot_mod, "_fsync", fsync)
    monkeypatch.setattr(snapshot_mod, "_claimed", claimed)
    outcomes = await _restore_twice(tmp_path / "snap", store, True, renamed, first_done)
    assert isinstance(outcomes["first"], OSError), outcomes
    assert isinstance(outcomes["second"], Manifest), outcomes
    assert kept == [True]
    async with open_engine(store) as mem:
        assert [t.text for t in await mem.session_history("ana", "s")] == ["hello"]


async def test_a_restore_onto_a_full_disk_raises_one_os_error_and_leaves_nothing(
        tmp_path, monkeypatch) -> None:
    """Files are copied two chunks at a time: when the disk fills, both copies fail, and the
    caller got an ExceptionGroup (the command line a traceback) where a snapshot onto a full
    disk gives one OSError. The restore raises the disk's error alone, and nothing of it is
    left beside the target."""
    async with open_engine(tmp_path / "live") as mem:
        await mem.add_turns([{"user_id": "ana", "session_id": "s", "role": "user",
                              "text": f"turn {i}"} for i in range(50)])
        await mem.flush()
        await mem.snapshot(tmp_path / "snap")

    def full(source: Path, target: Path, offset: int) -> str:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(target))

    monkeypatch.setattr(snapshot_mod, "_copy_chunk", full)
    with pytest.raises(OSError) as raised:
        await Engine.restore(tmp_path / "snap", tmp_path / "restored")
    assert type(raised.value) is OSError and raised.value.errno == errno.ENOSPC
    assert sorted(p.name for p in tmp_path.iterdir()) == ["live", "snap"]


async def test_a_restore_whose_lock_a_full_disk_refused_leaves_nothing_to_block_a_retry(
        tmp_path, monkeypatch) -> None:
    """The disk filled as the restore wrote its pid into the new store's owner lock: the
    folder it made, holding that lock file, stayed, and every retry once space was freed was
    refused (a folder with files in it; with overwrite, not a store). It is removed, the
    restore fails as EngineBroken saying the disk is full, and the retry restores."""
    import engine._owner as owner_mod

    async with open_engine(tmp_path / "live") as mem:
        await mem.add_turn("ana", "s", "user", "hello", durable=True)
        await mem.snapshot(tmp_path / "snap")

    def full(fd: int, data: bytes, offset: int) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as patched:
        patched.setattr(owner_mod.os, "pwrite", full)
        with pytest.raises(EngineBroken, match="No space left on device"):
            await Engine.restore(tmp_path / "snap", tmp_path / "restored")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["live", "snap"]
    await Engine.restore(tmp_path / "snap", tmp_path / "restored")
    async with open_engine(tmp_path / "restored") as mem:
        assert [t.text for t in await mem.session_history("ana", "s")] == ["hello"]


async def test_a_restore_that_finds_another_engine_there_leaves_its_store(
        tmp_path, monkeypatch) -> None:
    """Between the restore's look at a new path and its lock, another process opened an
    engine there: the lock was refused (StoreInUse), and the restore's cleanup, taking the
    folder for one its lock had made, deleted that engine's live store. A refused lock
    removes nothing; another failure removes only a folder this restore made and left
    empty."""
    async with open_engine(tmp_path / "live") as mem:
        await mem.add_turn("ana", "s", "user", "hello", durable=True)
        await mem.snapshot(tmp_path / "snap")
    target = tmp_path / "target"

    class Raced(snapshot_mod.OwnerLock):
        def acquire(self):  # another engine made the folder and holds it, just now
            self.store.mkdir(exist_ok=True)
            (self.store / "data.mdb").write_bytes(b"the other engine's store")
            raise StoreInUse(f"{self.store} is in use by process 1, serving", str(self.store), 1)

    monkeypatch.setattr(snapshot_mod, "OwnerLock", Raced)
    with pytest.raises(StoreInUse):
        await Engine.restore(tmp_path / "snap", target)
    assert (target / "data.mdb").read_bytes() == b"the other engine's store"


async def test_a_leftover_name_that_is_a_store_or_a_snapshot_is_never_removed(tmp_path) -> None:
    """A snapshot clears ``DEST.partial`` and a restore ``STORE.restoring`` (what one cut
    short left): when that name is the live store, or the snapshot being restored, it is
    refused instead, and the store or the snapshot is kept."""
    store = tmp_path / "backup.partial"
    async with open_engine(store) as mem:
        await mem.add_turn("ana", "s", "user", "hello")
        await mem.flush()
        with pytest.raises(InvalidInput, match=r"^dest: expected .*backup.partial"):
            await mem.snapshot(tmp_path / "backup")
        assert [t.text for t in await mem.session_history("ana", "s")] == ["hello"]
        await mem.snapshot(tmp_path / "snap.restoring")
    with pytest.raises(InvalidInput, match=r"^store_path: expected .*snap.restoring"):
        await Engine.restore(tmp_path / "snap.restoring", tmp_path / "snap")
    await Engine.restore(tmp_path / "snap.restoring", tmp_path / "elsewhere")
    async with open_engine(tmp_path / "elsewhere") as mem:
        assert [t.text for t in await mem.session_history("ana", "s")] == ["hello"]
    assert (store / "data.mdb").exists()


async def test_a_compact_the_disk_cannot_hold_leaves_the_store_as_it_was(
        tmp_path, monkeypatch, capsys) -> None:
    """LMDB's copy ran out of disk: the API raised a bare lmdb.DiskError, the command line
    called the store corrupt and said to restore it from a snapshot (throwing away what was
    written since), and the partial copy stayed as STORE/compact.tmp, keeping the disk full.
    The copy is removed, the failure is EngineBroken saying the store is as it was, and the
    store opens with everything in it."""
    import lmdb

    store = tmp_path / "store"
    async with open_engine(store) as mem:
        await mem.add_turn("ana", "s", "user", "kept", durable=True)

    def full(env, txn, fresh: Path) -> None:
        (fresh / "data.mdb").write_bytes(b"\0" * 4096)
        raise lmdb.DiskError("mdb_env_copy3: No space left on device")

    monkeypatch.setattr(snapshot_mod, "clean_copy", full)
    with pytest.raises(EngineBroken, match="No space left on device.*as it was"):
        await Engine.compact(store)
    assert not (store / "compact.tmp").exists()
    from engine.__main__ import main

    assert await trio.to_thread.run_sync(main, ["compact", str(store)]) == 1
    said = capsys.readouterr().err
    assert "EngineBroken" in said and "as it was" in said and "snapshot" not in said, said
    monkeypatch.undo()
    async with open_engine(store) as mem:
        assert [t.text for t in await mem.session_history("ana", "s")] == ["kept"]


async def test_a_store_whose_name_is_near_the_limit_snapshots_restores_and_exports(
        tmp_path) -> None:
    """A name of 250 bytes is a legal store name (255 bytes is the file system's limit), and
    such a store opened, served and compacted, but could never be restored in place: the
    restore's '<name>.restoring' beside it, a snapshot's '<dest>.partial' and an export's
    temporary file were past 255 bytes, refused naming a path the caller never gave. The
    siblings are cut to fit, marked with a hash of the whole name."""
    store, snap = tmp_path / ("s" * 250), tmp_path / ("é" * 125)  # 250 bytes each
    async with open_engine(store) as mem:
        await mem.add_turn("ana", "s1", "user", "I live in Lisbon", durable=True)
        await mem.snapshot(snap)
        assert (await mem.export_user("ana", tmp_path / ("e" * 250)))["turn"] == 1
    await Engine.restore(snap, store, overwrite=True)
    await Engine.restore(snap, tmp_path / ("r" * 255))
    for path in (store, tmp_path / ("r" * 255)):
        async with open_engine(path) as mem:
            assert [t.text for t in await mem.session_history("ana", "s1")] == [
                "I live in Lisbon"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["e" * 250, "r" * 255, "s" * 250, "é" * 125])


async def test_a_snapshot_holds_every_turn_acknowledged_before_it(store_path, tmp_path) -> None:
    """A turn add_turn acknowledged (buffered, and shown by session_history) but not yet
    committed when snapshot() began was left out of it: the copy took what LMDB held at its
    start, and a store restored from it lacked the turn (half of the fuzzer's rounds)."""
    import threading

    from .test_concurrency_hostile import _gate_writer

    async with open_engine(store_path) as mem:
        await mem.add_turn("ana", "s1", "user", "a first turn", durable=True)
        gate = _gate_writer(mem)
        gate.clear()  # the next commit waits in the writer's thread
        receipt = await mem.add_turn("ana", "s1", "user", "acknowledged, not yet committed")
        threading.Timer(0.2, gate.set).start()
        manifest = await mem.snapshot(tmp_path / "snap")
    assert manifest.lsn >= receipt.lsn
    await Engine.restore(tmp_path / "snap", tmp_path / "restored")
    async with open_engine(tmp_path / "restored") as mem:
        assert [t.text for t in await mem.session_history("ana", "s1")] == [
            "a first turn", "acknowledged, not yet committed"]
