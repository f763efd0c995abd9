"""A process out of file descriptors (a flood of connections to `serve`) is a passing state:
the text index's commit that met it is retried once descriptors are free again, with nothing
of the index lost, and the engine stays up."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import trio

CHILD = textwrap.dedent("""
    import os, resource, sys, trio
    from engine import Engine, HashEmbedder

    async def main(path):
        async with Engine.open(path, embedder=HashEmbedder()) as mem:
            await mem.add_turn("ana", "s", "user", "a first walk in Lisbon", durable=True)
            await mem.flush()
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
            resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 64, hard))
            held = []
            try:
                while True:
                    held.append(os.open("/dev/null", os.O_RDONLY))
            except OSError:
                pass
            await mem.add_turn("ana", "s", "user", "then a ferry to Porto", durable=True)
            with trio.move_on_after(3):  # the text index's commit meets EMFILE meanwhile
                await mem.flush()
            for fd in held:
                os.close(fd)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            await mem.flush()
            hits = await mem.recall("ana", "ferry Porto", legs=("bm25",), link_depth=0)
            print("found:", [h.text for h in hits if "bm25" in h.via])

    trio.run(main, sys.argv[1])
""")


def test_a_text_index_commit_out_of_descriptors_is_retried(tmp_path: Path) -> None:
    """The commit failed with tantivy's TooManyOpenFiles, and the engine stopped as
    EngineBroken: `serve` exited for every user because one client held a few hundred
    connections. A retried commit on the same tantivy writer would not do: after the failure
    the writer drops what it held and every later document, saying nothing."""
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "store")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "found: ['then a ferry to Porto']\n" in done.stdout, done.stdout
    assert "TooManyOpenFiles" in done.stderr or "Too many open files" in done.stderr


TOO_MANY = "An IO error occurred: 'Too many open files (os error 24)'"  # as tantivy says it


async def test_a_forget_whose_commit_found_no_descriptor_is_still_purged(
        store_path, monkeypatch) -> None:
    """The commit before a forget's purge found no descriptor and the index started over
    below the forget; the purge ran on all the same, found no segment holding deletions and
    said it was done, and the forgotten user's words stayed in the index's files for good.
    The purge now waits until the index is past the forget again."""
    import tantivy

    import actors.fulltext.fulltext as fulltext_mod
    from engine import HashEmbedder

    from ..conftest import open_engine

    armed: list[bool] = []
    real = fulltext_mod.FullText._commit

    def commit(self) -> None:
        if armed:
            armed.clear()
            raise ValueError(TOO_MANY)
        real(self)

    monkeypatch.setattr(fulltext_mod.FullText, "_commit", commit)
    async with open_engine(store_path, embedder=HashEmbedder()) as mem:
        for i in range(5):
            await mem.add_turn("bob", "s", "user", f"qwzxmarker secret {i}", durable=True)
        await mem.add_turn("ana", "s", "user", "the weather in Lisbon", durable=True)
        await mem.flush()
        armed.append(True)  # the commit carrying bob's deletion
        await mem.forget_user("bob")
        await mem.flush()
    index = tantivy.Index.open(str(store_path / "fulltext"))
    assert index.searcher().doc_freq("text", "qwzxmarker") == 0
    assert not armed  # the failure was met


async def test_closing_while_descriptors_stay_short_does_not_wait_for_them(
        store_path, monkeypatch) -> None:
    """The text index's waits for a descriptor (a fresh writer, a reload after a commit
    landed) did not look at close: the engine's close waited as long as the shortage
    lasted, for ever if it never ended. It ends them; the next open replays."""
    import actors.fulltext.fulltext as fulltext_mod
    from engine import HashEmbedder

    from ..conftest import open_engine

    short: list[bool] = []
    real = fulltext_mod.FullText._reload

    def reload(self) -> None:
        if short:
            raise ValueError(TOO_MANY)
        real(self)

    monkeypatch.setattr(fulltext_mod.FullText, "_reload", reload)
    monkeypatch.setattr(fulltext_mod, "DESCRIPTOR_RETRY", 0.01)
    async with open_engine(store_path, embedder=HashEmbedder()) as mem:
        await mem.add_turn("ana", "s", "user", "a first walk in Lisbon", durable=True)
        await mem.flush()
        short.append(True)  # for ever, as a leak of the caller's would be
        await mem.add_turn("ana", "s", "user", "then a ferry to Porto", durable=True)
        with trio.move_on_after(1):
            await mem.flush()  # the commit lands; its reload waits
    short.clear()
    async with open_engine(store_path, embedder=HashEmbedder()) as mem:
        await mem.flush()
        hits = await mem.recall("ana", "ferry", legs=("bm25",), link_depth=0)
        assert [h.text for h in hits if "bm25" in h.via] == ["then a ferry to Porto"]
