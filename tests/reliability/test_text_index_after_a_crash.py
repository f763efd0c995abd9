"""The text index after kill -9 between a commit's files and its meta.json (found by
bench/crash.py): the next engine replays the same operations, and tantivy would write a
deletion file under the very name the dead commit left behind."""

from __future__ import annotations

from ..conftest import open_engine


async def test_a_commit_cut_short_before_its_meta_does_not_stop_the_next_open(store_path) -> None:
    """Files of a commit whose meta.json never landed are swept at open, so replaying the
    same deletion commits instead of failing with FileAlreadyExists."""
    async with open_engine(store_path) as mem:
        for i in range(6):
            await mem.add_turn("ana", "s1", "user", f"turn {i} about trains")
        note = await mem.store_note("ana", "takes the night train")
        await mem.flush()
    fulltext = store_path / "fulltext"
    before = (fulltext / "meta.json").read_bytes()
    async with open_engine(store_path) as mem:
        await mem.update_note("ana", note.note_id, "takes the morning train")  # deletes a doc
        await mem.flush()
    assert list(fulltext.glob("*.del"))
    (fulltext / "meta.json").write_bytes(before)  # as if killed before meta.json was written
    async with open_engine(store_path) as mem:
        await mem.flush()
        notes = await mem.recall("ana", "train", kinds=["note"])
        assert [h.text for h in notes] == ["takes the morning train"]
