"""Child process that serves a store, for the tests of a second process.

Usage: python serve_child.py STORE_DIR TURNS [MAP_BYTES]
Ingests TURNS durable turns, flushes, prints ``ready PID``, then keeps adding one turn every
few milliseconds (so the parent's commands run against a store that moves). Commands on stdin:
``bulk N`` adds N turns of about 1 KB each for user ``bulk`` and prints ``done``; ``stop`` (or
end of input) closes the engine and prints ``stopped N`` (turns acknowledged). MAP_BYTES sets
the initial LMDB map of a new store (small: bulk grows it).
"""

import os
import sys

import trio

from engine import Engine, HashEmbedder


async def main(path: str, turns: int, map_bytes: int) -> None:
    config = {"initial_map_bytes": map_bytes}
    async with Engine.open(path, embedder=HashEmbedder(), config=config) as mem:
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
            while True:
                line = (await trio.to_thread.run_sync(sys.stdin.readline)).split()
                if line[:1] != ["bulk"]:
                    break
                count = int(line[1])
                await mem.add_turns([{"user_id": "bulk", "session_id": "s", "role": "user",
                                      "text": f"bulk {i} " + "x" * 1000} for i in range(count)],
                                    durable=True)
                added += count
                print("done", flush=True)
            nursery.cancel_scope.cancel()
        await mem.flush()
    print("stopped", added, flush=True)


if __name__ == "__main__":
    trio.run(main, sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3
             else 256 << 20)
