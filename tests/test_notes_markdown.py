"""Notes mirrored as Markdown files (seed 000) with Config(notes_markdown_dir=...)."""

from __future__ import annotations

import threading
import time
from functools import partial
from pathlib import Path

import pytest
import trio

import engine._notes_md as notes_md_mod

from engine import InvalidInput

from .conftest import open_engine


def _files(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text(encoding="utf-8")
            for p in sorted(root.rglob("*")) if p.is_file()}


async def test_each_note_is_one_markdown_file_kept_in_step_with_the_store(store_path, clock,
                                                                          tmp_path) -> None:
    """Stored: a file with front matter; updated: rewritten; deleted: removed; the user
    forgotten: their directory goes. No temporary file is ever left behind."""
    root = tmp_path / "notes"
    async with open_engine(store_path, clock=clock,
                           config={"notes_markdown_dir": str(root)}) as mem:
        note = await mem.store_note("maya", "Planning a trip to Madeira.\nIn May.",
                                    note_id="trip", tags=["travel", "café"])
        store_id = mem._parts.store.store_id  # the store that wrote it, 32 hex digits
        assert len(store_id) == 32 and _files(root) == {"maya/trip.md": (
            '---\nid: "trip"\nuser: "maya"\ntags: ["travel", "café"]\n'
            'category: ""\nimportance: 0.5\nemotion: ""\n'
            f"created_at: {note.created_at.isoformat()}\n"
            f"updated_at: {note.updated_at.isoformat()}\n"
            f'store: "{store_id}"\n---\n\n'
            "Planning a trip to Madeira.\nIn May.\n")}
        updated = await mem.update_note("maya", "trip", "Booked Madeira for May.")
        text = (root / "maya" / "trip.md").read_text(encoding="utf-8")
        assert text.endswith("---\n\nBooked Madeira for May.\n") and "tags: []" in text
        assert f"created_at: {note.created_at.isoformat()}" in text
        assert f"updated_at: {updated.updated_at.isoformat()}" in text
        await mem.store_note("maya", "Second note", note_id="other")
        assert await mem.delete_note("maya", "trip")
        assert list(_files(root)) == ["maya/other.md"]
        await mem.store_note("ana", "Ana's note", note_id="n1")
        await mem.forget_user("maya")
        assert list(_files(root)) == ["ana/n1.md"]
        assert not (root / "maya").exists()


async def test_ids_cannot_escape_or_hide_and_long_ids_fit(store_path, clock, tmp_path) -> None:
    """Every id becomes one safe file name inside the user's directory: no path separators,
    no dot files, no '..', letters outside ASCII encoded, long ids cut with a hash."""
    root = tmp_path / "notes"
    ids = ["../../escape", "a/b\\c", ".hidden", "..", "ünïcode note", "x" * 250, "x" * 249 + "y",
           "é" * 125]
    async with open_engine(store_path, clock=clock,
                           config={"notes_markdown_dir": str(root)}) as mem:
        for note_id in ids:
            await mem.store_note("../maya", f"note {note_id}", note_id=note_id)
    files = list((root).rglob("*"))
    names = sorted(p.name for p in files if p.is_file())
    assert len(names) == len(ids)  # nothing overwrote anything
    assert all(p.resolve().is_relative_to(root.resolve()) for p in files)
    assert [p.name for p in root.iterdir()] == ["%2E%2E%2Fmaya"]
    assert "%2E%2E%2F%2E%2E%2Fescape.md" in names and "%2E%2E.md" in names
    assert "%C3%BCn%C3%AFcode%20note.md" in names
    assert all(not n.startswith(".") and len(n.encode()) <= 255 for n in names)


async def test_opening_makes_the_directory_match_the_store(store_path, clock, tmp_path) -> None:
    """A file lost (a crash between commit and rename) is written again at open, a stale one
    rewritten, and one the mirror wrote whose note is gone removed; Markdown files it did not
    write stay (the directory may be shared with an editor's vault)."""
    root = tmp_path / "notes"
    config = {"notes_markdown_dir": str(root)}
    async with open_engine(store_path, clock=clock) as mem:  # no mirror yet
        await mem.store_note("maya", "Kept before the mirror existed", note_id="old")
    async with open_engine(store_path, clock=clock, config=config) as mem:
        assert list(_files(root)) == ["maya/old.md"]
        await mem.store_note("maya", "Second", note_id="two")
    (root / "maya" / "old.md").unlink()
    (root / "maya" / "two.md").write_text("edited by hand")
    # A file the mirror wrote for a note deleted since (a crash before its removal), and
    # Markdown files of someone else's in the directory: a vault's folder, one in maya's.
    (root / "maya" / "gone.md").write_text('---\nid: "gone"\nuser: "maya"\n---\n\nGone\n')
    (root / "maya" / "mine.md").write_text("# My own file\n")
    (root / "vault").mkdir()
    (root / "vault" / "plans.md").write_text("---\ntitle: plans\n---\n")
    async with open_engine(store_path, clock=clock, config=config) as mem:
        files = _files(root)
        assert sorted(files) == ["maya/mine.md", "maya/old.md", "maya/two.md",
                                 "vault/plans.md"]
        assert files["maya/two.md"].endswith("\nSecond\n")
        await mem.store_note("maya", "Imported later", note_id="three")
        assert (root / "maya" / "three.md").exists()


async def test_a_read_only_engine_writes_no_files_and_the_option_is_checked(
        store_path, clock, tmp_path) -> None:
    """A reader never writes the mirror; an empty directory name is refused."""
    root = tmp_path / "notes"
    async with open_engine(store_path, clock=clock) as mem:
        await mem.store_note("maya", "a note", note_id="n")
    async with open_engine(store_path, read_only=True,
                           config={"notes_markdown_dir": str(root)}):
        pass
    assert not root.exists()
    with pytest.raises(InvalidInput, match="notes_markdown_dir"):
        async with open_engine(store_path, config={"notes_markdown_dir": ""}):
            pass


async def test_imported_notes_are_mirrored_too(clock, tmp_path) -> None:
    """A note that arrives by import_user gets its file like one stored directly."""
    async with open_engine(tmp_path / "a", clock=clock) as mem:
        await mem.store_note("maya", "From the other store", note_id="n1", tags=["moved"])
        await mem.export_user("maya", tmp_path / "maya.jsonl")
    root = tmp_path / "notes"
    async with open_engine(tmp_path / "b", clock=clock,
                           config={"notes_markdown_dir": str(root)}) as mem:
        await mem.import_user(tmp_path / "maya.jsonl")
        text = (root / "maya" / "n1.md").read_text(encoding="utf-8")
    assert 'tags: ["moved"]' in text and text.endswith("\nFrom the other store\n")


async def test_a_note_written_as_its_user_is_forgotten_never_comes_back(
        store_path, clock, tmp_path, monkeypatch) -> None:
    """The mirror's file operations run in worker threads, so a note's write and its user's
    forget may land in either order: the write that lands after the forget is dropped, and
    the forgotten note's file never stays on disk."""
    root = tmp_path / "notes"
    entered, release = threading.Event(), threading.Event()
    real = notes_md_mod.write_atomically

    def held(path, data: bytes) -> None:
        if b"held note" in data:
            entered.set()
            release.wait(30)
        real(path, data)

    monkeypatch.setattr(notes_md_mod, "write_atomically", held)
    async with open_engine(store_path, clock=clock,
                           config={"notes_markdown_dir": str(root)}) as mem:
        await mem.store_note("maya", "An earlier note", note_id="early")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(mem.store_note, "maya", "held note", note_id="late"))
            await trio.to_thread.run_sync(entered.wait, 30)
            nursery.start_soon(mem.forget_user, "maya")
            # Time for the forget's removal to run beside the held write, as it did before
            # the mirror ordered them (it now waits for the write, then removes it).
            await trio.to_thread.run_sync(_gone_within, root / "maya", 1.0)
            release.set()
        assert not (root / "maya").exists()
        await mem.store_note("maya", "A new note after the forget", note_id="new")
        assert list(_files(root)) == ["maya/new.md"]


def _gone_within(path: Path, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


async def test_a_mirror_file_spoiled_by_hand_never_stops_the_engine(store_path, clock,
                                                                      tmp_path) -> None:
    """The files are a view: a note's file saved in another encoding, a folder where a file
    was, a user's folder replaced by a file, make neither open nor a committed call fail.
    The call returns what it stored, and what can be written is made right (at the latest
    at the next open)."""
    root = tmp_path / "notes"
    config = {"notes_markdown_dir": str(root)}
    async with open_engine(store_path, clock=clock, config=config) as mem:
        for name in ("latin", "folder", "gone", "later"):
            await mem.store_note("maya", f"A note called {name}", note_id=name)
    (root / "maya" / "latin.md").write_bytes("caf\xe9 edited in Latin-1".encode("latin-1"))
    (root / "maya" / "folder.md").unlink()
    (root / "maya" / "folder.md").mkdir()
    async with open_engine(store_path, clock=clock, config=config) as mem:
        assert _files(root)["maya/latin.md"].endswith("\nA note called latin\n")
        assert await mem.update_note("maya", "folder", "Updated beside a folder")
        assert await mem.delete_note("maya", "folder")
        assert await mem.get_note("maya", "folder") is None
        (root / "maya" / "folder.md").rmdir()
        for path in (root / "maya").iterdir():
            path.unlink()
        (root / "maya").rmdir()
        (root / "maya").write_text("a file where the user's folder was")
        stored = await mem.store_note("maya", "Stored beside a spoiled mirror", note_id="new")
        assert stored.note_id == "new" and await mem.get_note("maya", "new") == stored
        assert await mem.update_note("maya", "later", "Updated beside a spoiled mirror")
        assert await mem.delete_note("maya", "gone")
    (root / "maya").unlink()
    async with open_engine(store_path, clock=clock, config=config) as mem:
        files = _files(root)
        assert sorted(files) == ["maya/later.md", "maya/latin.md", "maya/new.md"]
        assert files["maya/later.md"].endswith("\nUpdated beside a spoiled mirror\n")


async def test_a_notes_folder_that_holds_the_store_or_lies_in_it_is_refused(tmp_path) -> None:
    """With the notes folder the store's own parent ("." beside ./memory), forget_user of a
    user named "memory" (or of no user at all) deleted the whole store: data.mdb, the text
    index, every user's turns. A notes folder that holds the store, is it, or lies inside it
    is refused at open, naming the option, and nothing is made."""
    store = tmp_path / "memory"
    async with open_engine(store) as mem:
        await mem.add_turn("ana", "s", "user", "kept", durable=True)
    for notes in (tmp_path, store, store / "notes", tmp_path / "x" / ".."):
        with pytest.raises(InvalidInput, match="notes_markdown_dir") as refused:
            async with open_engine(store, config={"notes_markdown_dir": str(notes)}):
                pass
        assert refused.value.field == "notes_markdown_dir"
    assert not (store / "notes").exists()
    async with open_engine(store, config={"notes_markdown_dir": str(tmp_path / "notes")}) as mem:
        assert [t.text for t in await mem.session_history("ana", "s")] == ["kept"]


async def test_forgetting_a_user_removes_the_mirrors_files_and_nothing_else(clock,
                                                                          tmp_path) -> None:
    """forget_user removed the user's folder whole (rmtree), whatever it held: a folder of
    the user's name that the mirror never wrote went too. Now the mirror's own files go,
    and the folder if that leaves it empty; anything else stays."""
    root = tmp_path / "notes"
    async with open_engine(tmp_path / "s", clock=clock,
                           config={"notes_markdown_dir": str(root)}) as mem:
        await mem.store_note("maya", "a note", note_id="n1")
        await mem.store_note("bo", "bo's note", note_id="n2")
        (root / "maya" / "mine.txt").write_text("the operator's own file")
        (root / "theirs").mkdir()
        (root / "theirs" / "plan.md").write_text("# not a mirror file")
        await mem.forget_user("maya")
        await mem.forget_user("theirs")  # no such user: nothing of it is the mirror's
        await mem.flush()
    assert _files(root) == {"bo/n2.md": _files(root)["bo/n2.md"],
                            "maya/mine.txt": "the operator's own file",
                            "theirs/plan.md": "# not a mirror file"}


async def test_the_mirror_never_writes_or_deletes_through_a_symbolic_link(clock,
                                                                         tmp_path) -> None:
    """A user's folder that was a symbolic link to a folder outside the notes folder: notes
    were written out there, forget_user left them (rmtree refuses a link, and the error was
    ignored), and the sync at open deleted files out there that looked like the mirror's.
    Now a linked folder is left as it is: no note is written through it, none is removed."""
    root, outside = tmp_path / "notes", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "kept.md").write_text('---\nid: "kept"\nuser: "x"\n---\n\nsomeone else\'s\n')
    (root / "alice").symlink_to(outside, target_is_directory=True)
    async with open_engine(tmp_path / "s", clock=clock,
                           config={"notes_markdown_dir": str(root)}) as mem:
        await mem.store_note("alice", "secret plans", note_id="n1")
        await mem.flush()
        assert sorted(p.name for p in outside.iterdir()) == ["kept.md"]
        await mem.forget_user("alice")
        await mem.flush()
    async with open_engine(tmp_path / "s", clock=clock,
                           config={"notes_markdown_dir": str(root)}):
        pass
    assert sorted(p.name for p in outside.iterdir()) == ["kept.md"]
    assert "secret plans" not in "".join(p.read_text() for p in tmp_path.rglob("*.md"))


async def test_two_stores_sharing_a_notes_folder_keep_each_others_files(clock,
                                                                         tmp_path) -> None:
    """Bot B opened with the notes folder bot A mirrors to deleted A's files at its sync
    (every file with the mirror's front matter was taken for its own), and B's forget of a
    user it never had deleted A's files of that user: back only at A's next open. Each file
    now names the store that wrote it (a random id the store keeps), and a store removes
    only its own, or those of no store (written before the mark)."""
    root = tmp_path / "vault"
    config = {"notes_markdown_dir": str(root)}
    async with open_engine(tmp_path / "a", clock=clock, config=config) as a:
        await a.store_note("carol", "carol's plan", note_id="n1")
        await a.flush()
    mine = _files(root)
    assert list(mine) == ["carol/n1.md"] and "\nstore: " in mine["carol/n1.md"]
    async with open_engine(tmp_path / "b", clock=clock, config=config) as b:
        await b.store_note("dan", "dan's note", note_id="n2")
        await b.forget_user("carol")  # B never had carol
        await b.flush()
    assert _files(root)["carol/n1.md"] == mine["carol/n1.md"]
    async with open_engine(tmp_path / "a", clock=clock, config=config) as a:
        await a.forget_user("carol")
        await a.flush()
    assert list(_files(root)) == ["dan/n2.md"]
