"""Index checks and rebuilds: what checking the text index at open costs, and how long a
missing or damaged text index takes to rebuild from the store.

    python bench/rebuild.py                        # 100k memories over 100 users, ~1 minute
    python bench/rebuild.py --memories 20000       # smaller

1. Build a store of --memories turns (the long-term layer and embedding off: this is about the
   text index) and close it.
2. Open it with its index intact: the open time, and the time of the footer check alone
   (``check_index``: a CRC-32 of every segment file's body) over the index's bytes.
3. Delete ``fulltext/``; open: the time until recall stops flagging ``bm25`` as degraded
   (the rebuild committed), and recalls answered meanwhile (flagged).
4. Flip one byte of a segment file; open: the same, found by the check.

Prints a table and writes JSON (--out, default bench/results/rebuild.json).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import trio
from _report import write_results

from actors.fulltext import check_index
from engine import Engine, HashEmbedder

CONFIG = {"long_term": False, "background_embedding": False}
WORDS = ("lisbon flat dog walk park train porto coffee beans peanut allergy violin lessons "
         "rainy tuesday garden bread market river bridge").split()


async def build(path: Path, memories: int, users: int) -> None:
    rng = random.Random(1)
    async with Engine.open(path, config=CONFIG, embedder=HashEmbedder()) as mem:
        for start in range(0, memories, 10_000):
            await mem.add_turns([{"user_id": f"u{i % users}", "session_id": f"s{i % 7}",
                                  "role": "user", "text": " ".join(rng.choices(WORDS, k=12))
                                  + f" item{i}"} for i in range(start, min(memories,
                                                                         start + 10_000))])
        await mem.flush()


async def open_until_ready(path: Path) -> dict[str, Any]:
    """Open; recall until the text leg is not degraded (embedding is off here, so the vector
    leg stays flagged); the times and how many answers were flagged meanwhile."""
    started = time.perf_counter()
    async with Engine.open(path, config=CONFIG, embedder=HashEmbedder()) as mem:
        opened = time.perf_counter() - started
        flagged = 0
        while True:
            hits = await mem.recall("u1", "lisbon garden item1")
            if "bm25" not in hits.degraded:
                break
            flagged += 1
            await trio.sleep(0.05)
        ready = time.perf_counter() - started
        damage = (await mem.stats()).text_index_rebuilt
    return {"open_s": round(opened, 3), "ready_s": round(ready, 3),
            "flagged_recalls": flagged, "damage": damage}


def index_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in (path / "fulltext").iterdir() if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--memories", type=int, default=100_000)
    parser.add_argument("--users", type=int, default=100)
    parser.add_argument("--out", default="bench/results/rebuild.json")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="engram-rebuild-"))
    try:
        store = root / "store"
        trio.run(build, store, args.memories, args.users)
        size = index_bytes(store)
        started = time.perf_counter()
        check_index(store / "fulltext")
        check_s = time.perf_counter() - started
        intact = trio.run(open_until_ready, store)
        shutil.rmtree(store / "fulltext")
        missing = trio.run(open_until_ready, store)
        meta = json.loads((store / "fulltext" / "meta.json").read_text())
        sid = max(meta["segments"], key=lambda s: s["max_doc"])["segment_id"].replace("-", "")
        target = store / "fulltext" / f"{sid}.term"
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0x01
        target.write_bytes(bytes(data))
        damaged = trio.run(open_until_ready, store)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results = {"memories": args.memories, "users": args.users, "index_bytes": size,
               "check_index_s": round(check_s, 3),
               "check_mb_per_s": round(size / check_s / 1e6, 1),
               "intact": intact, "missing": missing, "one_byte_damaged": damaged}
    print(f"{args.memories:,} memories, text index {size / 1e6:.1f} MB")
    print(f"  footer check of every segment file: {check_s * 1000:.0f} ms "
          f"({results['check_mb_per_s']} MB/s)")
    for name in ("intact", "missing", "one_byte_damaged"):
        row = results[name]
        print(f"  {name:<17} open {row['open_s']:6.2f} s, bm25 complete after "
              f"{row['ready_s']:6.2f} s ({row['flagged_recalls']} recalls flagged meanwhile)")
    write_results(args.out, results, "rebuild")


if __name__ == "__main__":
    main()
