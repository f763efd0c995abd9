"""A full disk is the disk's state, not the store's damage: every part that meets it says so
with the engine's own error, the process lives on, and the store opens once space is free.

Each test runs a child on a real small file system (a tmpfs mounted in a mount namespace of
the child's own, gone with it), filled to the last byte by a ballast file."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# What every child starts with: a store of two turns on the small disk, closed; and fill().
PRELUDE = textwrap.dedent("""
    import os, subprocess, sys, trio
    from engine import Engine, EngineBroken, HashEmbedder

    disk = sys.argv[1]
    store = os.path.join(disk, "store")
    ballast = os.path.join(disk, "ballast")

    def fill():
        with open(ballast, "ab", buffering=0) as f:
            for size in (1 << 16, 512, 1):
                try:
                    while True:
                        f.write(b"\\0" * size)
                except OSError:
                    pass

    async def build():
        async with Engine.open(store, embedder=HashEmbedder()) as mem:
            await mem.add_turn("ana", "s", "user", "a first walk in Lisbon", durable=True)
            await mem.add_turn("ana", "s", "user", "then a ferry to Porto", durable=True)
            await mem.flush()

    trio.run(build)
""")


def on_a_small_disk(tmp_path: Path, code: str, size: str = "24m", timeout: float = 120,
                    args: list[str] = ()) -> subprocess.CompletedProcess:
    """Run PRELUDE + ``code`` in a child whose argv[1] is a tmpfs of ``size`` (then
    ``args``)."""
    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux's unshare to mount a small file system")
    disk = tmp_path / "disk"
    disk.mkdir()
    script = 'mount -t tmpfs -o size="$1" tmpfs "$2" && exec "$3" -c "$4" "$2" "$5"'
    done = subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", size, str(disk),
                           sys.executable, PRELUDE + textwrap.dedent(code), *args],
                          capture_output=True, text=True, timeout=timeout)
    if done.returncode and done.stderr.startswith(("unshare:", "mount:")):
        pytest.skip(f"cannot mount a small file system here: {done.stderr.strip()}")
    return done


def test_a_store_without_its_lock_file_on_a_full_disk_says_the_disk_is_full(
        tmp_path: Path) -> None:
    """LMDB makes a missing lock.mdb by lengthening it and writing through a map of it; on a
    full disk that write is SIGBUS, and the process died without a word: `Engine.open`, the
    read-only open and `verify` alike. A store has no lock.mdb after a restore (a snapshot
    carries none) or a backup that copied data.mdb alone."""
    done = on_a_small_disk(tmp_path, """
        os.remove(os.path.join(store, "lock.mdb"))
        fill()

        async def opened(**kw):
            try:
                async with Engine.open(store, embedder=HashEmbedder(), **kw) as mem:
                    return "opened: " + " / ".join(
                        t.text for t in await mem.session_history("ana", "s"))
            except EngineBroken as exc:
                return f"EngineBroken: {exc}"

        print("owner", trio.run(opened))
        print("reader", trio.run(lambda: opened(read_only=True)))
        verify = subprocess.run([sys.executable, "-m", "engine", "verify", store],
                                capture_output=True, text=True)
        print("verify", verify.returncode, (verify.stdout + verify.stderr).strip()[-300:])
        os.remove(ballast)
        print("freed", trio.run(opened))
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    for who in ("owner", "reader", "verify"):
        assert "EngineBroken: " in lines[who] and "the disk is full" in lines[who], lines[who]
    assert lines["verify"].startswith("1 "), lines["verify"]  # not killed by a signal (-7)
    assert lines["freed"] == "opened: a first walk in Lisbon / then a ferry to Porto"


def test_a_text_index_with_files_to_collect_on_a_full_disk_says_the_disk_is_full(
        tmp_path: Path) -> None:
    """A text index that a kill left files to collect (written, never committed) rewrites
    its list of files as it collects them at open; on a full disk tantivy's ValueError came
    out of Engine.open as it was, an error a caller takes for bad input (InvalidInput is a
    ValueError too), and `serve` printed its traceback."""
    done = on_a_small_disk(tmp_path, """
        import json
        index = os.path.join(store, "fulltext")
        # A file of a commit the kill cut short; empty, so that removing it frees nothing.
        stray = "0" * 32 + ".idx"
        open(os.path.join(index, stray), "wb").close()
        with open(os.path.join(index, ".managed.json")) as f:
            managed = json.load(f)
        with open(os.path.join(index, ".managed.json"), "w") as f:
            json.dump(managed + [stray], f)
        fill()

        async def opened():
            try:
                async with Engine.open(store, embedder=HashEmbedder()) as mem:
                    return "opened: " + " / ".join(
                        t.text for t in await mem.session_history("ana", "s"))
            except EngineBroken as exc:
                return f"EngineBroken: {exc}"

        print("full", trio.run(opened))
        os.remove(ballast)
        print("freed", trio.run(opened))
        print("collected", not os.path.exists(os.path.join(index, stray)))
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert lines["full"].startswith("EngineBroken: ") and "the disk is full" in lines["full"], \
        lines["full"]
    assert lines["freed"] == "opened: a first walk in Lisbon / then a ferry to Porto"
    assert lines["collected"] == "True"


def test_a_vector_graph_that_cannot_be_saved_at_close_does_not_fail_the_close(
        tmp_path: Path) -> None:
    """A graph is saved at close so that the next open need not rebuild it; it is derived
    from the stored vectors. On a full disk its save failed the close with EngineBroken
    after every write had landed, and left a temporary file behind."""
    done = on_a_small_disk(tmp_path, """
        import actors.ann_index.ann_index as ann
        ann.HNSW_THRESHOLD = 40  # a graph for a user of a few dozen turns

        async def main():
            async with Engine.open(store, embedder=HashEmbedder()) as mem:
                for i in range(60):
                    await mem.add_turn("ana", "s2", "user", f"walk {i} by the river Douro")
                await mem.flush()
                users = mem._parts.ann._users.values()
                print("graph", sum(uv.graph is not None for u in users for _, uv in u.parts()))
                fill()
            print("closed")
            os.remove(ballast)
            print("left", sorted(n for n in os.listdir(os.path.join(store, "ann"))
                                 if ".tmp" in n))
            async with Engine.open(store, embedder=HashEmbedder()) as mem:
                hits = await mem.recall("ana", "walk 7 by the river", legs=("vector",))
                print("found", any(h.text == "walk 7 by the river Douro" for h in hits))

        trio.run(main)
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "graph 1\nclosed\nleft []\nfound True\n" in done.stdout, done.stdout


@pytest.mark.parametrize("size", [300, 2500, 20000])
def test_a_commit_the_disk_has_no_room_for_says_the_disk_is_full(tmp_path: Path,
                                                                  size: int) -> None:
    """LMDB reports a write the disk had no room for as EIO (a short pwrite): the caller's
    EngineBroken said "Input/output error", a failing device to whoever reads it. Every turn
    acknowledged before is there once space is free."""
    done = on_a_small_disk(tmp_path, """
        async def main():
            stored = 0
            try:
                async with Engine.open(store, embedder=HashEmbedder()) as mem:
                    try:
                        while True:
                            await mem.add_turn("ana", "s2", "user",
                                               f"t{stored} " + "x" * int(sys.argv[2]),
                                               durable=True)
                            stored += 1
                    except EngineBroken as exc:
                        print("said", exc)
                        raise
            except EngineBroken:
                pass
            # Room made: the store filled the disk itself.
            subprocess.run(["mount", "-o", "remount,size=16m", disk], check=True)
            async with Engine.open(store, embedder=HashEmbedder()) as mem:
                kept = len(await mem.session_history("ana", "s2", limit=10**6))
            print("kept", kept == stored)

        trio.run(main)
    """, size="4m", args=[str(size)])
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert "the disk" in lines["said"] and "is full" in lines["said"], lines["said"]
    assert lines["kept"] == "True"


def test_a_snapshot_over_http_to_a_full_disk_is_507_saying_so(tmp_path: Path) -> None:
    """The snapshot's OSError reached the server's catch-all: 500 "the server failed
    answering this request" and a traceback in its log, for a disk an operator can free."""
    done = on_a_small_disk(tmp_path, """
        import httpx
        from engine._server import create_app, load_api_keys

        with open(os.path.join(disk, "keys"), "w") as f:
            f.write("admin-key *\\n")
        keys = load_api_keys(os.path.join(disk, "keys"))

        async def main():
            async with Engine.open(store, embedder=HashEmbedder()) as mem:
                fill()
                transport = httpx.ASGITransport(app=create_app(mem, keys),
                                                raise_app_exceptions=False)
                async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                             headers={"Authorization": "Bearer admin-key"}
                                             ) as http:
                    answer = await http.post("/v1/snapshot",
                                             json={"dest": os.path.join(disk, "snap")})
                print("status", answer.status_code)
                print("body", answer.json())
                print("left", os.path.exists(os.path.join(disk, "snap")))

        trio.run(main)
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert lines["status"] == "507"
    body = eval(lines["body"])  # the dict as printed
    assert body["error"] == "DiskFull" and "the disk is full" in body["message"], body
    assert lines["left"] == "False"
    assert "Traceback" not in done.stderr


def test_a_full_disk_under_the_text_index_is_waited_out_not_the_engines_end(
        tmp_path: Path) -> None:
    """The text index's commit that met a full disk stopped the engine (EngineBroken), every
    user's writes with it, though the store had room and the index is derived from it. The
    index now waits for room and indexes again from its last commit, as it does for file
    descriptors; the store takes every turn meanwhile. Here the index has a disk of its own."""
    done = on_a_small_disk(tmp_path, """
        import logging, shutil
        import actors.fulltext.fulltext as fulltext
        fulltext.DESCRIPTOR_RETRY = 0.05
        logging.basicConfig(level=logging.WARNING, format="%(message)s")

        index = os.path.join(store, "fulltext")
        shutil.copytree(index, os.path.join(disk, "index-copy"))
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", index], check=True)
        shutil.copytree(os.path.join(disk, "index-copy"), index, dirs_exist_ok=True)
        with open(os.path.join(index, "ballast"), "ab", buffering=0) as f:
            try:
                while True:
                    f.write(b"\\0" * 4096)
            except OSError:
                pass

        async def main():
            async with Engine.open(store, embedder=HashEmbedder()) as mem:
                for i in range(300):
                    await mem.add_turn("ana", "s3", "user", f"harbour {i} of Porto",
                                       durable=True)
                with trio.move_on_after(2):
                    await mem.flush()  # the index's commit meets the full disk meanwhile
                print("stored", len(await mem.session_history("ana", "s3", limit=1000)))
                subprocess.run(["mount", "-o", "remount,size=64m", index], check=True)
                await mem.flush()
                hits = await mem.recall("ana", "harbour 257", legs=("bm25",), link_depth=0)
                print("found", [h.text for h in hits][:1])

        trio.run(main)
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "stored 300\nfound ['harbour 257 of Porto']\n" in done.stdout, done.stdout
    assert "no room on the disk" in done.stderr, done.stderr[-2000:]
