"""A process out of file descriptors (a flood of connections to `serve`) is a passing state:
the text index's commit that met it is retried once descriptors are free again, with nothing
of the index lost, and the engine stays up."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

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
