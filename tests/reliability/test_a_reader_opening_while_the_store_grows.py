"""Another process opening a store that its owner is growing: the reader maps the file as it
found it at open, and if the owner wrote past that before the reader's first transaction,
LMDB refuses the transaction (MDB_MAP_RESIZED) until the reader adopts the new size. The
read-only engine raised a bare lmdb.MapResizedError, the model lookup too, every command of
the command line said the healthy store was damaged ("restore it from a snapshot"), and
`verify` reported it broken. Each now adopts the new size and reads on."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import lmdb
import pytest
import trio

import actors.store.store as store_module
import actors.store.vectors as vectors_module
import engine._verify as verify_module
from actors.store import stored_model
from engine import Engine, HashEmbedder

# An owner in another process writing past the reader's map: the reader maps at least 10 MiB.
GROW = textwrap.dedent("""
    import sys, trio
    from engine import Config, Engine, HashEmbedder

    async def main(path):
        async with Engine.open(path, embedder=HashEmbedder(),
                               config=Config(long_term=False)) as mem:
            for i in range(450):
                mem.add_turn_nowait("bob", "s", "user", f"{i} " + "growing the store " * 1_700)
            await mem.add_turn("bob", "s", "user", "on disk with all before it", durable=True)

    trio.run(main, sys.argv[1])
""")


async def small_store(path: Path) -> None:
    async with Engine.open(path, embedder=HashEmbedder()) as mem:
        await mem.add_turn("ana", "s", "user", "I moved to Lisbon", durable=True)


def grown_after(opened: Any, path: Path) -> Any:
    """``opened`` (an LMDB open), then the store at ``path`` grown past the map just made."""
    def wrapper(*args: Any, **kwargs: Any) -> lmdb.Environment:
        env = opened(*args, **kwargs)
        size = (path / "data.mdb").stat().st_size
        subprocess.run([sys.executable, "-c", GROW, str(path)], check=True)
        assert (path / "data.mdb").stat().st_size > max(size, 10 << 20)
        return env
    return wrapper


@pytest.mark.parametrize("reader", ["read-only engine", "command line", "verify",
                                    "model lookup"])
def test_a_reader_opening_while_the_owner_grows_the_store_reads_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reader: str) -> None:
    store = tmp_path / "store"
    trio.run(small_store, store)
    if reader == "read-only engine":
        monkeypatch.setattr(store_module, "open_reader",
                            grown_after(store_module.open_reader, store))

        async def history() -> list[str]:
            async with Engine.open(store, embedder=HashEmbedder(), read_only=True) as mem:
                return [t.text for t in await mem.session_history("ana", "s")]

        assert trio.run(history) == ["I moved to Lisbon"]
    elif reader == "command line":
        monkeypatch.setattr(verify_module.lmdb, "open", grown_after(lmdb.open, store))
        verify_module.require_store(store)  # every command's first look at a store
    elif reader == "verify":
        monkeypatch.setattr(verify_module, "open_reader",
                            grown_after(verify_module.open_reader, store))
        report = verify_module.verify_store(store)
        assert report["ok"], report["problems"]
    else:
        monkeypatch.setattr(vectors_module, "open_reader",
                            grown_after(vectors_module.open_reader, store))
        assert stored_model(store) is not None
