"""Resident memory of a loaded engine against the raw size of what it holds.

    python bench/memory.py                          # 100k memories, 1 user, then 1,000 users
    python bench/memory.py --memories 1000000       # the 1M points (hours on 2 cores)
    python bench/memory.py --one 100000 1000        # one configuration in this process

Each configuration runs in a fresh process (resident memory does not go back down): it
imports everything, notes the process's resident set, opens an engine on a new store with
vectors (the deterministic 384-dimension HashEmbedder, so that the model's own ~100 MB and its
hours of embedding stay out of it; the vectors, both indexes and the long-term layer are the
real ones), imports the memories (sessions of 20 turns, spread over the users), waits for
every index and follower (``flush``), searches once per user so that every user's vectors are
loaded as a serving engine has them, and waits until the resident set stops growing (the
background HNSW build of a large user). Reported: the growth of the resident set over the
baseline, split into anonymous memory (the engine's own) and file pages (LMDB's and the
indexes' memory maps, which the kernel can drop), against raw = vectors as float32 + the texts'
UTF-8 bytes. Issue 16's target: under 2x raw.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio
from _report import progress, write_results

from engine import Engine, HashEmbedder, NewTurn

WORDS = ("the a to and of I you it my we in for is that on with this was be have at but so "
         "flat dog Lisbon Porto train vet run river job team data pipeline allergy peanut "
         "morning lesson Portuguese weekend dinner market sardines coffee meeting plan").split()
DIM = 384  # MiniLM's dimension, which the HashEmbedder takes too
SESSION_TURNS = 20
CHUNK = 5_000  # turns per add_turns call
SETTLED_SECONDS = 15  # the resident set counts as settled after this long without growing
SETTLE_LIMIT = 900  # seconds to wait for it at most


def rss() -> dict[str, int]:
    """This process's resident set, anonymous and file-backed parts, in bytes (Linux)."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
            fields[name] = int(value.split()[0]) * 1024
    return fields


def sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 30))).capitalize() + "."


async def measure(path: Path, memories: int, users: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    gc.collect()
    before = rss()
    text_bytes = 0
    start = time.perf_counter()
    async with Engine.open(path, embedder=HashEmbedder(dim=DIM)) as mem:
        opened = rss()
        for at in range(0, memories, CHUNK):
            items = []
            for i in range(at, min(at + CHUNK, memories)):
                session = i // SESSION_TURNS
                text = sentence(rng)
                text_bytes += len(text.encode())
                items.append(NewTurn(user_id=f"user{session % users}", session_id=f"s{session}",
                                     role=("user", "assistant")[i % 2], text=text))
            await mem.add_turns(items)
            progress("import", at + len(items), memories)
        await mem.flush()
        ingested = time.perf_counter() - start
        for u in range(users):
            await mem.recall(f"user{u}", "what did we plan for the weekend", limit=5)
            if u % 100 == 0 or u == users - 1:
                progress("search every user", u + 1, users)
        settled, last, waited = time.perf_counter(), rss()["VmRSS"], 0.0
        while time.perf_counter() - settled < SETTLED_SECONDS and waited < SETTLE_LIMIT:
            await trio.sleep(1)
            waited += 1
            now = rss()["VmRSS"]
            if now > last * 1.005:
                settled, last = time.perf_counter(), now
        gc.collect()
        loaded = rss()
        stats = await mem.stats()
    raw_vectors = memories * DIM * 4
    raw = raw_vectors + text_bytes
    grown = loaded["VmRSS"] - before["VmRSS"]
    anon = loaded["RssAnon"] - before["RssAnon"]
    files = loaded["RssFile"] - before["RssFile"]
    return {
        "memories": memories, "users": users, "turns": stats.turns,
        "raw_bytes": raw, "raw_vector_bytes": raw_vectors, "raw_text_bytes": text_bytes,
        "rss_before": before["VmRSS"], "rss_engine_open": opened["VmRSS"],
        "rss_growth": grown, "anon_growth": anon, "file_growth": files,
        "rss_over_empty_engine": loaded["VmRSS"] - opened["VmRSS"],
        "rss_ratio_to_raw": grown / raw, "anon_ratio_to_raw": anon / raw,
        "over_empty_ratio_to_raw": (loaded["VmRSS"] - opened["VmRSS"]) / raw,
        "peak_rss": loaded["VmHWM"], "import_and_index_seconds": ingested,
        "store_bytes": stats.store_bytes,
    }


def one(memories: int, users: int, seed: int) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="engram-bench-memory-"))
    try:
        return trio.run(measure, work / "store", memories, users, seed)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--memories", type=int, nargs="+", default=[100_000])
    parser.add_argument("--users", type=int, nargs="+", default=[1, 1000])
    parser.add_argument("--one", type=int, nargs=2, metavar=("MEMORIES", "USERS"),
                        help="measure one configuration in this process; print its JSON")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", default="bench/results/memory.json")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(*args.one, args.seed)))
        return
    print(f"seed {args.seed}; {os.cpu_count()} cores; python {sys.version.split()[0]}; "
          f"load average {os.getloadavg()[0]:.1f}")
    results = []
    for memories in args.memories:
        for users in args.users:
            done = subprocess.run([sys.executable, __file__, "--one", str(memories), str(users),
                                   "--seed", str(args.seed)], check=True, stdout=subprocess.PIPE,
                                  text=True)
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    mib = 1 << 20
    print(f"\n{'memories':>9}{'users':>7}{'raw':>10}{'RSS +':>10}{'anon +':>10}{'files +':>10}"
          f"{'RSS/raw':>9}{'anon/raw':>9}{'-empty/raw':>11}")
    for r in results:
        print(f"{r['memories']:>9,}{r['users']:>7,}{r['raw_bytes'] / mib:>7.0f}MiB"
              f"{r['rss_growth'] / mib:>7.0f}MiB{r['anon_growth'] / mib:>7.0f}MiB"
              f"{r['file_growth'] / mib:>7.0f}MiB{r['rss_ratio_to_raw']:>8.2f}x"
              f"{r['anon_ratio_to_raw']:>8.2f}x{r['over_empty_ratio_to_raw']:>10.2f}x")
    write_results(args.out, {"seed": args.seed, "results": results}, "memory")


if __name__ == "__main__":
    sys.exit(main())
