"""Child process that serves a store, for the tests of a second process.

Usage: python -m tests.reliability.serve_child STORE_DIR TURNS
Ingests TURNS durable turns, flushes, prints ``ready PID``, then keeps adding one turn every
few milliseconds (so the parent's commands run against a store that moves) until a line on
stdin asks it to stop; then it closes the engine and prints ``stopped N`` (turns acknowledged).
"""

import os
import sys

import trio

from engine import Engine, HashEmbedder


async def main(path: str, turns: int) -> None:
    async with Engine.open(path, embedder=HashEmbedder()) as mem:
        await mem.add_turns([{"user_id": f"u{i % 3}", "session_id": "s", "role": "user",
                              "text": f"turn {i} about lisbon flats and dogs number{i}"}
                             for i in range(turns)], durable=True)
        await mem.flush()
        print("ready", os.getpid(), flush=True)
        added = turns
        async with trio.open_nursery() as nursery:
            async def ingest() -> None:
                nonlocal added
                while True:
                    await mem.add_turn("live", "s", "user", f"live turn {added}", durable=True)
                    added += 1
                    await trio.sleep(0.005)

            nursery.start_soon(ingest)
            await trio.to_thread.run_sync(sys.stdin.readline)
            nursery.cancel_scope.cancel()
        await mem.flush()
    print("stopped", added, flush=True)


if __name__ == "__main__":
    trio.run(main, sys.argv[1], int(sys.argv[2]))
