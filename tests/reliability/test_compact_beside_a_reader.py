"""Compact replaces data.mdb under LMDB's lock file. A reader in another process (a
read-only engine, stats, snapshot, verify) keeps that lock file's shared state alive, and the
next owner took its last transaction id, of the file before the compact, and with it the
wrong one of the new file's two meta pages: an empty store. Compact now runs only where no
other process has the store open."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import trio

from engine import Engine, HashEmbedder, StoreInUse

READER = textwrap.dedent("""
    import sys, trio
    from engine import Engine, HashEmbedder

    async def main(path):
        async with Engine.open(path, embedder=HashEmbedder(), read_only=True) as mem:
            print(len(await mem.session_history("ana", "s", limit=1000)), flush=True)
            await trio.to_thread.run_sync(sys.stdin.readline)

    trio.run(main, sys.argv[1])
""")

# A count of turns for which the next owner's transaction id picked the compacted copy's
# empty meta page (which one depends on the count alone: LMDB's parity of the last id).
TURNS = 155


async def write(path: Path, first: int, n: int) -> None:
    async with Engine.open(path, embedder=HashEmbedder()) as mem:
        for i in range(first, first + n):
            await mem.add_turn("ana", "s", "user", f"turn {i} about trains", durable=True)


async def turns(path: Path) -> list[str]:
    async with Engine.open(path, embedder=HashEmbedder()) as mem:
        return [t.text for t in await mem.session_history("ana", "s", limit=1000)]


def test_compact_beside_a_reader_in_another_process_is_refused_and_loses_nothing(
        tmp_path: Path) -> None:
    store = tmp_path / "store"
    trio.run(write, store, 0, TURNS)
    reader = subprocess.Popen([sys.executable, "-c", READER, str(store)], text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert reader.stdout.readline().strip() == str(TURNS)
        with pytest.raises(StoreInUse) as refused:
            trio.run(Engine.compact, store)
        assert refused.value.pid == reader.pid
        assert f"process {reader.pid}" in str(refused.value)
        assert "read-only" in str(refused.value)
        trio.run(write, store, TURNS, 5)  # the reader still there, an owner writes on
        assert len(trio.run(turns, store)) == TURNS + 5
    finally:
        reader.communicate("\n", timeout=60)
    assert reader.returncode == 0
    trio.run(Engine.compact, store)  # alone now
    trio.run(write, store, TURNS + 5, 5)
    assert trio.run(turns, store) == [f"turn {i} about trains" for i in range(TURNS + 10)]


async def test_compact_beside_a_reader_of_this_process_is_refused(tmp_path: Path) -> None:
    """Refused by LMDB with its own lmdb.Error ("already open in this process"), before."""
    store = tmp_path / "store"
    await write(store, 0, 3)
    async with Engine.open(store, embedder=HashEmbedder(), read_only=True) as mem:
        with pytest.raises(StoreInUse, match="this process"):
            await Engine.compact(store)
        assert len(await mem.session_history("ana", "s")) == 3


OPENING = textwrap.dedent("""
    import sys, lmdb
    from pathlib import Path
    from actors.store import MAX_DBS
    from actors.store.integrity import opening

    with opening(Path(sys.argv[1])):  # as every reader of the engine's opens
        print("holding", flush=True)
        sys.stdin.readline()
        env = lmdb.open(sys.argv[1], readonly=True, lock=True, max_dbs=MAX_DBS)
    print("open", flush=True)
    sys.stdin.readline()
    env.close()
""")


def test_compact_waits_out_a_reader_between_its_data_file_and_its_lock(tmp_path: Path) -> None:
    """LMDB opens data.mdb before it takes its lock on lock.mdb: a reader between the two
    was invisible to compact's check, held the old file across the swap, then set the lock
    file's state from it, and the next owner read the new file by the old one's transaction
    id (an empty store; reproduced with strace holding a reader there). Readers hold the
    store's opening lock until LMDB has theirs, and compact swaps under it exclusively:
    here it waits for the reader, finds it, and refuses."""
    import time

    store = tmp_path / "store"
    trio.run(write, store, 0, TURNS)
    reader = subprocess.Popen([sys.executable, "-c", OPENING, str(store)], text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    compact = None
    try:
        assert reader.stdout.readline().strip() == "holding"
        compact = subprocess.Popen([sys.executable, "-m", "engine", "compact", str(store)],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(600):  # until the copy began: past compact's first look for readers
            if (store / "compact.tmp").exists() or compact.poll() is not None:
                break
            time.sleep(0.05)
        time.sleep(1)  # the copy of a small store is done by now; the swap is next
        reader.stdin.write("\n")
        reader.stdin.flush()
        assert reader.stdout.readline().strip() == "open"
        out, err = compact.communicate(timeout=120)
    finally:
        reader.communicate("\n", timeout=60)
        if compact is not None and compact.poll() is None:
            compact.kill()
    assert compact.returncode == 1 and "StoreInUse" in err, (compact.returncode, err)
    assert f"process {reader.pid}" in err
    trio.run(write, store, TURNS, 5)
    assert len(trio.run(turns, store)) == TURNS + 5
