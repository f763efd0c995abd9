"""A partition restore that dies by SIGKILL midway.

Usage: python -m tests.cluster.restore_child SNAPSHOT STORE PARTITION PARTITIONS

Opens an engine on STORE (the hash embedder, the long-term layer off) and restores the
snapshot in the file SNAPSHOT as a new owner does, in blocks of a few records; once three
blocks are committed, before the fourth is queued, the process kills itself with SIGKILL:
some users are written, the partition's watermark is not.
"""

import os
import signal
import sys
from pathlib import Path

import trio

from actors.store import Store
from engine import Engine, HashEmbedder, _export
from engine.cluster._bootstrap import decode, restore

BLOCK = 16  # records a block, so that a small snapshot takes many
COMMITTED_BLOCKS = 3  # blocks on disk when the process dies


def die_midway() -> None:
    real = Store.reserve
    blocks = 0

    async def reserve(self: Store, n: int) -> None:
        nonlocal blocks
        blocks += 1
        if blocks > COMMITTED_BLOCKS:
            await self.wait_committed(self.next_lsn - 1)
            os.kill(os.getpid(), signal.SIGKILL)
        await real(self, n)

    Store.reserve = reserve
    _export.IMPORT_CHUNK = BLOCK


async def main(snapshot: str, store: str, partition: str, partitions: str) -> None:
    found = decode(Path(snapshot).read_bytes(), int(partition), int(partitions))
    async with Engine.open(store, config={"long_term": False, "fsync": False},
                           embedder=HashEmbedder()) as engine:
        die_midway()
        await restore(engine, found)


if __name__ == "__main__":
    trio.run(main, *sys.argv[1:])
