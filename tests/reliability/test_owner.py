"""Case 6 of issue 11: one owner per store. A second engine, in this process or another, is
refused with StoreInUse naming the owner's pid; commands that rewrite a store refuse a served
one; stats, inspect and snapshot read a served store from another process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from actors.fulltext import TextFilters
from engine import Engine, HashEmbedder, InvalidInput, StoreInUse

from ..conftest import open_engine

CHILD = Path(__file__).with_name("serve_child.py")
TURNS = 300


class Served:
    """A child process serving a store."""

    def __init__(self, store: Path, map_bytes: int = 256 << 20) -> None:
        self.store = store
        self.process = subprocess.Popen(
            [sys.executable, str(CHILD), str(store), str(TURNS), str(map_bytes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.process.stdout.readline().split()
        assert line[:1] == ["ready"], line
        self.pid = int(line[1])

    def bulk(self, count: int) -> None:
        """Have it add ``count`` turns of ~1 KB (user ``bulk``) and wait until they are on
        disk."""
        self.process.stdin.write(f"bulk {count}\n")
        self.process.stdin.flush()
        assert self.process.stdout.readline().split() == ["done"]

    def stop(self) -> int:
        """Ask it to close cleanly; the number of turns it acknowledged."""
        out, _ = self.process.communicate("stop\n", timeout=60)
        assert self.process.returncode == 0, out
        return int(out.split()[-1])


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    child = Served(tmp_path / "store")
    try:
        yield child
    finally:
        if child.process.poll() is None:
            child.process.kill()
            child.process.wait()
        for pipe in (child.process.stdin, child.process.stdout):
            if not pipe.closed:
                pipe.close()


def engram(*args: str) -> subprocess.CompletedProcess[str]:
    """The engram command in a process of its own."""
    return subprocess.run([sys.executable, "-m", "engine", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


async def test_a_second_engine_in_this_process_is_refused_with_the_pid(store_path) -> None:
    """Owner then owner, and owner then reader: StoreInUse with this process's pid, and the
    first engine goes on serving; once it closes the store opens again."""
    async with open_engine(store_path) as mem:
        await mem.add_turn("ana", "s", "user", "hello", durable=True)
        for read_only in (False, True):
            with pytest.raises(StoreInUse, match=rf"in use by process {os.getpid()} "
                                                 r"\(this process\), serving") as info:
                async with open_engine(store_path, read_only=read_only):
                    pass
            assert info.value.pid == os.getpid() and info.value.path == str(store_path)
        await mem.add_turn("ana", "s", "user", "still serving", durable=True)
    async with open_engine(store_path) as mem:
        assert len(await mem.session_history("ana", "s")) == 2


async def test_a_read_only_engine_reads_and_refuses_every_write(store_path) -> None:
    """read_only=True searches and counts what is there, takes no lock (an owner may open
    meanwhile... in another process), and every write is InvalidInput naming read_only."""
    async with open_engine(store_path) as mem:
        await mem.add_turns([{"user_id": "ana", "session_id": "s", "role": "user",
                              "text": f"lisbon flat number {i}"} for i in range(20)])
        await mem.flush()
        expected = [h.id for h in await mem.recall("ana", "lisbon flat 7")]
    async with open_engine(store_path, read_only=True) as mem:
        assert [h.id for h in await mem.recall("ana", "lisbon flat 7")] == expected
        stats = await mem.stats()
        assert (stats.turns, stats.read_only, stats.degraded) == (20, True, ())
        for write in (mem.add_turn("ana", "s", "user", "no"), mem.store_note("ana", "no"),
                      mem.forget_user("ana")):
            with pytest.raises(InvalidInput, match="read_only: expected an engine that owns"):
                await write
        await mem.flush()  # nothing to wait for
    with pytest.raises(InvalidInput, match="reembed: expected False with read_only=True"):
        async with open_engine(store_path, read_only=True, reembed=True):
            pass
    async with open_engine(store_path) as mem:
        assert (await mem.stats()).turns == 20


def test_a_second_process_is_refused_and_kill_9_frees_the_store(served: Served) -> None:
    """Engine.open of a store another process serves names that pid; once the owner dies by
    kill -9 the kernel has dropped its lock and the store opens."""

    async def open_it() -> int:
        async with Engine.open(served.store, embedder=HashEmbedder()) as mem:
            return (await mem.stats()).turns

    with pytest.raises(StoreInUse, match=rf"in use by process {served.pid}, serving") as info:
        trio.run(open_it)
    assert info.value.pid == served.pid
    os.kill(served.pid, signal.SIGKILL)
    served.process.wait()
    assert trio.run(open_it) >= TURNS


def test_commands_that_rewrite_a_store_refuse_a_served_one(served: Served, tmp_path) -> None:
    """reindex, restore --overwrite and compact exit 1 naming the owner's pid, and the serving
    engine goes on: every turn it acknowledged is there after it closes."""
    snap = engram("snapshot", served.store, tmp_path / "snap", "--json")
    assert snap.returncode == 0, snap.stderr
    for args in (("reindex", served.store), ("compact", served.store),
                 ("restore", tmp_path / "snap", served.store, "--overwrite")):
        done = engram(*args)
        assert done.returncode == 1, (args, done.stdout, done.stderr)
        assert f"StoreInUse: {served.store} is in use by process {served.pid}" in done.stderr
        assert "Traceback" not in done.stderr
    assert (served.store / "fulltext" / "meta.json").exists()  # reindex deleted nothing
    acknowledged = served.stop()

    async def count() -> int:
        async with open_engine(served.store) as mem:
            return (await mem.stats()).turns

    # The turn being added when it was asked to stop may have landed without being counted.
    assert acknowledged <= trio.run(count) <= acknowledged + 1


def test_stats_inspect_and_snapshot_read_a_served_store(served: Served, tmp_path) -> None:
    """From another process while the owner ingests: stats and inspect answer (read-only),
    and a snapshot restores to a store that answers as the owner did at its lsn."""
    stats = engram("stats", served.store, "--json")
    assert stats.returncode == 0, stats.stderr
    counts = json.loads(stats.stdout)
    assert counts["read_only"] is True and counts["turns"] >= TURNS
    inspect = engram("inspect", served.store, "--user", "u1", "--json")
    assert inspect.returncode == 0, inspect.stderr
    (head,) = [line for line in map(json.loads, inspect.stdout.splitlines())
               if line["type"] == "user"]
    assert head["counts"]["turns"] == TURNS // 3
    snap = engram("snapshot", served.store, tmp_path / "snap", "--json")
    assert snap.returncode == 0, snap.stderr
    manifest = json.loads(snap.stdout)
    assert manifest["counts"]["turns"] >= TURNS and manifest["lsn"] >= TURNS
    restored = engram("restore", tmp_path / "snap", tmp_path / "restored", "--json")
    assert restored.returncode == 0, restored.stderr
    served.stop()

    async def check() -> None:
        # Without the long-term layer, which would derive what the copy's followers had not.
        async with open_engine(tmp_path / "restored", config={"long_term": False}) as mem:
            await mem.flush()
            stats = await mem.stats()
            assert stats.turns == manifest["counts"]["turns"]
            assert stats.last_lsn == manifest["lsn"]
            hits = await mem.recall("u1", "turn 7 lisbon number7", limit=3)
            assert hits[0].text == "turn 7 about lisbon flats and dogs number7"
            assert not hits.degraded
            # Every turn is in the text index once: replaying (fulltext_lsn, lsn] added none
            # twice.
            found = await mem._fulltext.search("live", "live turn", 100_000,
                                               TextFilters(kinds=("turn",)))
            assert len(found) == len({lsn for lsn, _ in found}) == stats.turns - TURNS

    trio.run(check)


def test_a_reader_follows_the_map_its_owner_grew(tmp_path) -> None:
    """A read-only engine opened while the owner's LMDB map is 1 MiB (the reader maps
    py-lmdb's default 10 MiB) still reads after the owner has doubled it past that (LMDB tells
    the reader MAP_RESIZED; it adopts the new size and reads again)."""
    child = Served(tmp_path / "store", map_bytes=1 << 20)
    try:
        async def read() -> None:
            async with open_engine(child.store, read_only=True) as mem:
                before = mem._store.map_size()
                child.bulk(12_000)  # ~13 MB of turns: the owner's map grows to 16 MiB
                counts = await mem.memory_stats("bulk")  # read from the store, not at open
                assert counts["turns"] == 12_000 and mem._store.map_size() > before

        trio.run(read)
    finally:  # its long-term layer would take a while over 12k new turns: no clean stop
        if child.process.poll() is None:
            child.process.kill()
            child.process.wait()
        for pipe in (child.process.stdin, child.process.stdout):
            pipe.close()


async def test_an_owner_refuses_a_path_it_cannot_lock_as_invalid_input(tmp_path) -> None:
    """Opening a store (to own it or to read it) at a path with a NUL, a lone surrogate or
    a name too long, one through a file or in a place this process cannot create, is
    InvalidInput naming ``path`` (never a ValueError or an OSError), and nothing is made
    there."""
    (tmp_path / "a-file").write_text("not a directory")
    before = sorted(tmp_path.rglob("*"))
    # "\udcff": a byte that is not UTF-8 (0xFF), as a command line's argument arrives in
    # Python; the file system takes it, LMDB and the text index take UTF-8 paths only.
    for path in (tmp_path / "nul\x00", tmp_path / "\ud800", tmp_path / ("x" * 300),
                 tmp_path / "a-file" / "store", Path("/proc/self/store"),
                 tmp_path / "st\udcffore"):
        for read_only in (False, True):
            with pytest.raises(InvalidInput) as refused:
                async with open_engine(path, read_only=read_only):
                    pass
            assert refused.value.field == "path", (path, read_only)
    assert sorted(tmp_path.rglob("*")) == before


async def test_an_existing_store_at_a_path_that_is_not_utf8_is_invalid_input(tmp_path) -> None:
    """With the model picked from the store (no embedder given), the store's model was read
    before the path was checked, and a store moved to a name that is not UTF-8 gave a bare
    UnicodeEncodeError out of Engine.open, naming no field."""
    from engine import Engine

    async with open_engine(tmp_path / "store"):
        pass
    moved = tmp_path / "st\udcffore"  # the byte 0xFF, as a command line's argument arrives
    (tmp_path / "store").rename(moved)
    for read_only in (False, True):
        with pytest.raises(InvalidInput) as refused:
            async with Engine.open(moved, read_only=read_only):
                pass
        assert refused.value.field == "path"
