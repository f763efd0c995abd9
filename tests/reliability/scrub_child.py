"""Child process for the tests of forgetting across processes.

Usage (from the repository's root): python -m tests.reliability.scrub_child MODE STORE [POINT]

``hold``: opens the store as LMDB's readers of another process do (``engram inspect`` and
read-only engines), begins one read transaction and prints ``holding N`` (N: the turns of
user ``victimqzx`` it sees); on ``check`` from stdin it reads them again in that same
snapshot and prints ``intact`` or ``changed``; on ``release`` it ends the transaction and
prints ``released``.

``crash``: ingests the victim's marked turns among durable turns of other users (printing
``acked USER SESSION TURN_ID`` for each of those), forgets the victim (``forgotten``), then
flushes with a SIGKILL of itself armed at POINT of the scrub: ``reopen`` (the environment
closed, not yet opened again) or ``zeroing`` (half the zeros written).
"""

import os
import signal
import sys

import lmdb
import trio

from actors.store import Store, pages
from engine import Engine, HashEmbedder

VICTIM = "victimqzx"
MARKER = "qwzxmarkerkv"


def hold(path: str) -> None:
    env = lmdb.open(path, readonly=True, lock=True, max_dbs=32)
    try:
        txn = env.begin(buffers=False)
        turns = env.open_db(b"turns", txn=txn, create=False)

        def victims() -> list[tuple[bytes, bytes]]:
            return [(k, v) for k, v in txn.cursor(turns) if k.startswith(VICTIM.encode())]

        seen = victims()
        print("holding", len(seen), flush=True)
        for line in sys.stdin:
            if line.strip() == "check":
                print("intact" if victims() == seen else "changed", flush=True)
            elif line.strip() == "release":
                break
        txn.abort()
    finally:
        env.close()
    print("released", flush=True)


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def arm(point: str) -> None:
    if point == "reopen":
        def killed_open(self, map_size):
            _die()
        Store._lmdb_open = killed_open  # only the scrub opens the environment again
    else:
        plan = pages._plan

        def half_then_die(buf, *args):  # the scrub's zeroing loop, cut at its middle
            ranges, pads, free, kept = plan(buf, *args)
            for start, end in ranges[:len(ranges) // 2]:
                buf[start:end] = 0
            _die()
        pages._plan = half_then_die


async def crash(path: str, point: str) -> None:
    async with Engine.open(path, embedder=HashEmbedder()) as mem:
        for i in range(40):
            long = " and the lamp was lit again" * 120 if i % 5 == 0 else ""
            await mem.add_turn(VICTIM, "s1", "user", f"{MARKER} was said in turn {i}{long}")
            for j in range(6):
                user, session = f"by{j}", f"s{i % 3}"
                receipt = await mem.add_turn(user, session, "user", f"bystander {i}.{j} garden")
                await receipt.durable()
                print("acked", user, session, receipt.turn_id, flush=True)
        await mem.flush()
        await mem.forget_user(VICTIM)
        print("forgotten", flush=True)
        arm(point)
        await mem.flush()
    print("survived", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "hold":
        hold(sys.argv[2])
    else:
        trio.run(crash, sys.argv[2], sys.argv[3])
