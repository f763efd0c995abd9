"""A restore over a store, cut short at its last step, leaves a store under the store's name:
the old one or the restored one, never neither."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import trio

from engine import Engine, HashEmbedder, InvalidInput

# Engine.restore over a store, the process killed at its first rename of a folder.
CUT_SHORT = textwrap.dedent("""
    import os, pathlib, sys, trio
    from engine import Engine

    real = pathlib.Path.rename

    def rename(self, target):
        done = real(self, target)
        os._exit(9)  # killed right after the first rename

    pathlib.Path.rename = rename
    trio.run(lambda: Engine.restore(sys.argv[1], sys.argv[2], overwrite=True))
""")


async def store_of(path: Path, text: str) -> None:
    async with Engine.open(path, embedder=HashEmbedder()) as mem:
        await mem.add_turn("ana", "s", "user", text, durable=True)


async def texts(path: Path) -> list[str]:
    async with Engine.open(path, embedder=HashEmbedder()) as mem:
        return [t.text for t in await mem.session_history("ana", "s")]


def test_a_restore_over_a_store_killed_in_its_swap_leaves_a_store_at_the_name(
        tmp_path: Path) -> None:
    """The swap was two renames, the store aside and the restored copy into its place; a
    process killed between them left no store under the name, and the bot's next open made
    an empty one there and served it (its users' history gone from its view, and the next
    restore deleted the store set aside). The swap is one exchange of the two folders now."""
    live, other, snap = tmp_path / "live", tmp_path / "other", tmp_path / "snap"
    trio.run(store_of, live, "the store as it was")
    trio.run(store_of, other, "the restored store")

    async def snapshot() -> None:
        async with Engine.open(other, embedder=HashEmbedder()) as mem:
            await mem.snapshot(snap)

    trio.run(snapshot)
    done = subprocess.run([sys.executable, "-c", CUT_SHORT, str(snap), str(live)],
                          capture_output=True, text=True, timeout=120)
    assert (live / "data.mdb").exists(), sorted(p.name for p in tmp_path.iterdir())
    # No rename left to kill it at: the swap was the exchange, and the restore went through.
    assert done.returncode == 0, done.stderr[-2000:]
    assert trio.run(texts, live) == ["the restored store"]


async def test_a_store_set_aside_by_a_restore_cut_short_is_not_taken_for_a_new_one(
        tmp_path: Path) -> None:
    """Where the two renames are still the way (a file system that cannot exchange), the
    open after a cut between them says where the stores are instead of making an empty
    one."""
    live = tmp_path / "live"
    await store_of(live, "the store as it was")
    live.rename(tmp_path / "live.replaced")
    with pytest.raises(InvalidInput, match="live.replaced"):
        await texts(live)
    assert not live.exists()
