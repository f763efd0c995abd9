"""Resident memory of a loaded engine against the raw size of what it holds.

    python bench/memory.py                          # 100k memories, 1 user, then 1,000 users
    python bench/memory.py --memories 100000 1000000 --keep /var/tmp/engram-memory
                                                    # stores kept there, reused by later runs
    python bench/memory.py --one 100000 1000        # one configuration in this process

Each configuration is built, then measured, each in a fresh process (resident memory does not
go back down). The build imports the memories into a store with vectors (the deterministic
384-dimension HashEmbedder, so that the model's own ~100 MB and its hours of embedding stay
out of it; the vectors, both indexes and the long-term layer are the real ones): sessions of
20 turns spread over the users, then ``flush`` (every index and follower has taken every
turn), then the vector graphs of large users are built, and the engine closes (saving them).
With ``--keep`` the store stays there and a later run measures it again without building; a
build stopped after its import resumes there (the followers and graphs go on).

The measurement imports everything, notes the process's resident set, opens an engine on the
store, searches once per user so that every user's vectors are loaded as a serving engine has
them, and waits until the resident set stops growing. Reported: the growth of the resident set
over the process before the engine opened, split by /proc/self/smaps into anonymous memory
(the engine's own: Python objects, vector matrices, graphs, the text index's heap) and file
pages, LMDB's map and the text index's files, which the kernel keeps as page cache and drops
under pressure; against raw = vectors as float32 + the texts' UTF-8 bytes. Issue 16's target:
under 2x raw.
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
GRAPH_LIMIT = 6 * 3600  # seconds a build waits for the vector graphs at most


def smaps() -> dict[str, int]:
    """This process's resident set in bytes (Linux): ``total``, ``anon`` and ``file`` pages,
    the file pages split into ``lmdb`` (the store's data.mdb), ``text_index`` (files under a
    ``fulltext`` directory) and ``other_files`` (libraries, the Python binary)."""
    out = dict.fromkeys(("total", "anon", "file", "lmdb", "text_index", "other_files"), 0)
    path = ""
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=5)
        if not head:
            continue
        if not head[0].endswith(":"):  # a mapping's first line: range perms offset dev inode path
            path = head[5] if len(head) > 5 else ""
            continue
        if head[0] == "Rss:":
            rss = int(head[1]) * 1024
            out["total"] += rss
        elif head[0] == "Anonymous:":
            anon = int(head[1]) * 1024
            out["anon"] += anon
            pages = rss - anon  # file-backed pages of this mapping
            out["file"] += pages
            if path.endswith("/data.mdb"):
                out["lmdb"] += pages
            elif "/fulltext/" in path:
                out["text_index"] += pages
            else:
                out["other_files"] += pages
    return out


def sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 30))).capitalize() + "."


async def build(path: Path, memories: int, users: int, seed: int) -> dict[str, Any]:
    """Import the memories into a new store at ``path``, wait for every index, follower and
    vector graph, close. Returns the raw sizes and the build's time. A store there that holds
    every turn already (a build stopped after its import) is resumed: the followers and the
    graphs go on from where they stopped; one holding some turns is built again."""
    if path.exists():
        async with Engine.open(path, embedder=HashEmbedder(dim=DIM)) as mem:
            held = (await mem.stats()).turns
        if held != memories:
            shutil.rmtree(path)
    rng = random.Random(seed)
    text_bytes = 0
    start = time.perf_counter()
    async with Engine.open(path, embedder=HashEmbedder(dim=DIM)) as mem:
        resumed = (await mem.stats()).turns == memories
        for at in range(0, memories, CHUNK):
            items = []
            for i in range(at, min(at + CHUNK, memories)):
                session = i // SESSION_TURNS
                text = sentence(rng)
                text_bytes += len(text.encode())
                items.append(NewTurn(user_id=f"user{session % users}", session_id=f"s{session}",
                                     role=("user", "assistant")[i % 2], text=text))
            if not resumed:  # else only the texts' bytes, drawn again from the same seed
                await mem.add_turns(items)
            progress("import", at + len(items), memories)
        imported = time.perf_counter() - start
        await mem.flush()
        flushed = time.perf_counter() - start
        for u in range(users):  # loads each user's vectors; a large one's graph starts
            await mem.recall(f"user{u}", "what did we plan for the weekend", limit=5)
        waited = 0
        while (await mem.stats()).vector_graphs_behind and waited < GRAPH_LIMIT:
            await trio.sleep(5)
            waited += 5
        stats = await mem.stats()
    return {"memories": memories, "users": users, "turns": stats.turns,
            "records": stats.last_lsn, "raw_vector_bytes": memories * DIM * 4,
            "raw_text_bytes": text_bytes, "import_seconds": imported,
            "flushed_seconds": flushed, "build_seconds": time.perf_counter() - start}


async def measure(path: Path, users: int) -> dict[str, Any]:
    """Open the store, search once per user, wait for the resident set to settle; the growth
    of each part of it over the process before the engine opened."""
    gc.collect()
    before = smaps()
    async with Engine.open(path, embedder=HashEmbedder(dim=DIM)) as mem:
        opened = smaps()
        for u in range(users):
            await mem.recall(f"user{u}", "what did we plan for the weekend", limit=5)
            if u % 100 == 0 or u == users - 1:
                progress("search every user", u + 1, users)
        settled, last, waited = time.perf_counter(), smaps()["total"], 0.0
        while time.perf_counter() - settled < SETTLED_SECONDS and waited < SETTLE_LIMIT:
            await trio.sleep(1)
            waited += 1
            now = smaps()["total"]
            if now > last * 1.005:
                settled, last = time.perf_counter(), now
        gc.collect()
        loaded = smaps()
        stats = await mem.stats()
    growth = {key: loaded[key] - before[key] for key in loaded}
    return {"rss_before": before["total"], "rss_engine_open": opened["total"],
            "rss_loaded": loaded["total"], "growth": growth,
            "rss_over_empty_engine": loaded["total"] - opened["total"],
            "store_bytes": stats.store_bytes, "vector_graphs_behind": stats.vector_graphs_behind}


def one(memories: int, users: int, seed: int, keep: Path | None) -> dict[str, Any]:
    """Build (unless kept from an earlier run) and measure one configuration, each in a process
    of its own."""
    work = keep or Path(tempfile.mkdtemp(prefix="engram-bench-memory-"))
    store = work / f"memory-{memories}-{users}"
    built = work / f"memory-{memories}-{users}.json"  # written once the store is complete
    try:
        if not built.exists():
            work.mkdir(parents=True, exist_ok=True)
            child = _child(["--build", str(memories), str(users), str(store), str(seed)])
            built.write_text(json.dumps(child))
        info = json.loads(built.read_text())
        measured = _child(["--measure", str(users), str(store)])
    finally:
        if keep is None:
            shutil.rmtree(work, ignore_errors=True)
    raw = info["raw_vector_bytes"] + info["raw_text_bytes"]
    g = measured["growth"]
    return {**info, **measured, "store": str(store) if keep else None, "raw_bytes": raw,
            "rss_growth": g["total"], "anon_growth": g["anon"], "file_growth": g["file"],
            "rss_ratio_to_raw": g["total"] / raw, "anon_ratio_to_raw": g["anon"] / raw,
            "over_empty_ratio_to_raw": measured["rss_over_empty_engine"] / raw}


def _child(args: list[str]) -> dict[str, Any]:
    done = subprocess.run([sys.executable, __file__, *args], check=True,
                          stdout=subprocess.PIPE, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--memories", type=int, nargs="+", default=[100_000])
    parser.add_argument("--users", type=int, nargs="+", default=[1, 1000])
    parser.add_argument("--keep", type=Path, help="build the stores here and keep them; a "
                                                  "store already built there is measured again")
    parser.add_argument("--one", type=int, nargs=2, metavar=("MEMORIES", "USERS"),
                        help="build and measure one configuration; print its JSON")
    parser.add_argument("--build", nargs=4, help=argparse.SUPPRESS)  # the child processes
    parser.add_argument("--measure", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", default="bench/results/memory.json")
    args = parser.parse_args()
    if args.build:
        memories, users, store, seed = args.build
        print(json.dumps(trio.run(build, Path(store), int(memories), int(users), int(seed))))
        return
    if args.measure:
        users, store = args.measure
        print(json.dumps(trio.run(measure, Path(store), int(users))))
        return
    if args.one:
        print(json.dumps(one(*args.one, args.seed, args.keep)))
        return
    print(f"seed {args.seed}; {os.cpu_count()} cores; python {sys.version.split()[0]}; "
          f"load average {os.getloadavg()[0]:.1f}")
    results = [one(memories, users, args.seed, args.keep)
               for memories in args.memories for users in args.users]
    mib = 1 << 20
    print(f"\n{'memories':>9}{'users':>7}{'raw':>9}{'RSS +':>9}{'anon +':>9}{'LMDB +':>9}"
          f"{'index +':>9}{'RSS/raw':>9}{'anon/raw':>9}")
    for r in results:
        g = r["growth"]
        print(f"{r['memories']:>9,}{r['users']:>7,}{r['raw_bytes'] / mib:>6.0f}MiB"
              f"{g['total'] / mib:>6.0f}MiB{g['anon'] / mib:>6.0f}MiB{g['lmdb'] / mib:>6.0f}MiB"
              f"{g['text_index'] / mib:>6.0f}MiB{r['rss_ratio_to_raw']:>8.2f}x"
              f"{r['anon_ratio_to_raw']:>8.2f}x")
    print(f"load average {os.getloadavg()[0]:.1f} after")
    write_results(args.out, {"seed": args.seed, "results": results}, "memory")


if __name__ == "__main__":
    sys.exit(main())
