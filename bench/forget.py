"""What "forget means gone" costs: forget_session + flush against a plain flush, same store.

    python bench/forget.py                          # 100k turns over 100 users, ~2 minutes
    python bench/forget.py --memories 20000 --rounds 5

1. Build a store of --memories turns over --users users, 10 sessions each (the deterministic
   HashEmbedder: what is measured is the store and the text index, not the model), flushed.
2. --rounds times, alternately: add one turn and flush (the baseline), and forget one session
   and flush (flush waits for the scrub: the text index re-indexes the segments that held the
   session's documents, LMDB rewrites the pages around the user's keys and zeroes its free
   pages). Both in this process, on the same store, so machine noise hits both.

Prints the percentiles of both, their ratio, and the data file's size before and after (the
free-page fill may grow it a little); writes JSON (--out, default bench/results/forget.json).
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1]))

from _report import percentiles, write_results  # noqa: E402

from engine import Engine, HashEmbedder  # noqa: E402

SESSIONS = 10  # per user


async def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="engram-forget-"))
    rng = random.Random(args.seed)
    try:
        async with Engine.open(work / "s", embedder=HashEmbedder(),
                               config={"long_term": False}) as mem:
            started = time.perf_counter()
            items = [{"user_id": f"u{i % args.users}",
                      "session_id": f"s{(i // args.users) % SESSIONS}",
                      "role": "user" if i % 2 else "assistant",
                      "text": f"turn {i} about the weather, trains, the garden and dinner"}
                     for i in range(args.memories)]
            await mem.add_turns(items)
            await mem.flush()
            built = time.perf_counter() - started
            size_before = (work / "s" / "data.mdb").stat().st_size
            plain, forget = [], []
            victims = rng.sample([(f"u{u}", f"s{s}") for u in range(args.users)
                                  for s in range(SESSIONS)], args.rounds)
            for user, session in victims:
                t = time.perf_counter()
                await mem.add_turn(user, "extra", "user", "one more turn about the weather")
                await mem.flush()
                plain.append(time.perf_counter() - t)
                t = time.perf_counter()
                await mem.forget_session(user, session)
                await mem.flush()
                forget.append(time.perf_counter() - t)
            size_after = (work / "s" / "data.mdb").stat().st_size
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"memories": args.memories, "users": args.users, "rounds": args.rounds,
            "turns_per_forgotten_session": args.memories // (args.users * SESSIONS),
            "build_s": round(built, 1), "add_and_flush": percentiles(plain, 1000, "ms"),
            "forget_and_flush": percentiles(forget, 1000, "ms"),
            "data_mdb_bytes_before": size_before, "data_mdb_bytes_after": size_after}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--memories", type=int, default=100_000)
    parser.add_argument("--users", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--out", default=str(HERE.parent / "results" / "forget.json"))
    args = parser.parse_args()
    result = trio.run(run, args)
    a, f = result["add_and_flush"], result["forget_and_flush"]
    print(f"store: {args.memories:,} turns over {args.users} users, built in {result['build_s']} s; "
          f"{result['turns_per_forgotten_session']} turns a forgotten session")
    print(f"add + flush     p50 {a['p50_ms']:8.1f} ms  max {a['max_ms']:8.1f} ms")
    print(f"forget + flush  p50 {f['p50_ms']:8.1f} ms  max {f['max_ms']:8.1f} ms  "
          f"({f['p50_ms'] / a['p50_ms']:.1f}x the plain flush at p50)")
    print(f"data.mdb {result['data_mdb_bytes_before']:,} -> {result['data_mdb_bytes_after']:,} bytes")
    write_results(args.out, result, "forget")


if __name__ == "__main__":
    main()
