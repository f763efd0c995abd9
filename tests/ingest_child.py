"""Child process for the crash test: ingests until killed, printing each durable receipt.

Usage: python -m tests.ingest_child STORE_DIR (from the repository's root)
Each line printed is ``seq turn_id`` of a turn whose durable receipt resolved. Buffered turns
go in between, so commits are in flight when the parent's SIGKILL lands.
"""

import sys

import trio

from engine import Engine


async def main(path: str) -> None:
    async with Engine.open(path) as mem:
        for i in range(1_000_000):
            buffered = await mem.add_turn("crash-user", "s1", "user", f"buffered {i}")
            durable = await mem.add_turn("crash-user", "s1", "assistant", f"durable {i}")
            await durable.durable()
            print(buffered.seq, buffered.turn_id, "buffered", flush=False)
            print(durable.seq, durable.turn_id, "durable", flush=True)


if __name__ == "__main__":
    trio.run(main, sys.argv[1])
