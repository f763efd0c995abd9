"""Child process for the crash tests: ingests until killed, printing each durable receipt.

Usage: python -m tests.ingest_child STORE_DIR [--no-fsync] [--bulk] (from the repository's root)
Each line printed is ``seq turn_id kind`` of a turn, ``durable`` once its durable receipt
resolved. Buffered turns go in between, so commits are in flight when the parent's SIGKILL
lands. ``--no-fsync`` opens the store with ``Config(fsync=False)``; ``--bulk`` also imports
batches of buffered turns into session ``bulk`` all along, commits nobody waits for, so the
store is seldom flushed up to its last write when the kill lands.
"""

import sys

import trio

from engine import Engine, NewTurn


async def durable_pairs(mem: Engine) -> None:
    for i in range(1_000_000):
        buffered = await mem.add_turn("crash-user", "s1", "user", f"buffered {i}")
        durable = await mem.add_turn("crash-user", "s1", "assistant", f"durable {i}")
        await durable.durable()
        print(buffered.seq, buffered.turn_id, "buffered", flush=False)
        print(durable.seq, durable.turn_id, "durable", flush=True)


async def bulk(mem: Engine) -> None:
    for i in range(1_000_000):
        await mem.add_turns([NewTurn(user_id="crash-user", session_id="bulk", role="user",
                                     text=f"bulk {i} {j}")
                             for j in range(50)])
        await trio.sleep(0.002)


async def main(path: str, fsync: bool, with_bulk: bool) -> None:
    async with Engine.open(path, config={"fsync": fsync}) as mem:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(durable_pairs, mem)
            if with_bulk:
                nursery.start_soon(bulk, mem)


if __name__ == "__main__":
    trio.run(main, sys.argv[1], "--no-fsync" not in sys.argv[2:], "--bulk" in sys.argv[2:])
