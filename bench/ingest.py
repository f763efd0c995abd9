"""Ingest benchmark: add_turn latency at a sustained rate, and bulk throughput into the store.

    python bench/ingest.py                 # defaults: ~1 minute on 2 cores
    python bench/ingest.py --quick         # a few seconds, for a smoke run
    python bench/ingest.py --bulk-only     # the bare LMDB baseline and the bulk import only

Phases, each on a fresh store with fsync on (the engine default):
  baseline   bare LMDB doing the writes the engine does for the bulk import (same keys, same
             databases, encoded up front, 4096 turns a transaction), no engine: the ceiling;
             and bare one-put commits with fsync: the floor under a durable receipt.
  buffered   add_turn acknowledged without waiting for disk, at --rate turns/s for --seconds,
             while the store group-commits, the real model embeds in the background and the
             long-term layer (entities, fact extraction, episodes) follows the log; then the
             same with the long-term layer off, as the baseline in the same process.
  durable    add_turn(durable=True) from --writers concurrent tasks sharing --durable-rate,
             the model embedding in the background likewise.
  bulk       a history import: add_turns in chunks of 1000, 200 turns per user in 10 sessions,
             --bulk turns in all, until committed (background embedding off, as for an import);
             then the bare LMDB baseline again, and the ratio takes the faster of the two.

Prints a table and writes JSON (--out, default bench/results/ingest.json).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lmdb
import msgspec
import trio
from _report import percentiles, progress, write_results

from engine import Engine, NewTurn

WORDS = ("the a to and of I you it my we in for is that on with this was be have at but so "
         "flat dog Lisbon Porto train vet run river job team data pipeline allergy peanut "
         "morning lesson Portuguese weekend dinner market sardines coffee meeting plan").split()


def sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 30))).capitalize() + "."


def pct(values_ns: list[int]) -> dict[str, float]:
    return percentiles(values_ns, 1e-3, "us")


def import_items(total: int, texts: list[str]) -> list[NewTurn]:
    """A history import: users one after another, each user's 10 sessions in order, 20 turns
    per session."""
    return [NewTurn(user_id=f"user{i // 200}", session_id=f"s{(i // 20) % 10}",
                    role=("user", "assistant")[i % 2], text=texts[i % len(texts)])
            for i in range(total)]


def baseline_lmdb(path: Path, items: list[NewTurn]) -> float:
    """The LMDB work the engine does for the same import, and nothing else: the same keys in the
    same databases (turns, ids, log, sessions), encoded up front, 4096 turns a transaction,
    fsync on. Turns per second."""
    env = lmdb.open(str(path), map_size=4 << 30, max_dbs=8, sync=True)
    dbs = {name: env.open_db(name) for name in (b"turns", b"ids", b"log", b"sessions")}
    encode = msgspec.msgpack.Encoder().encode
    rows = []
    for lsn, t in enumerate(items, 1):
        prefix = t.user_id.encode() + b"\0"
        key = prefix + t.session_id.encode() + b"\0" + (lsn % 20).to_bytes(8, "big")
        turn_id = f"t_{lsn:020x}"
        value = encode([lsn, turn_id, t.user_id, t.session_id, lsn % 20, t.role, t.text, 0, {}])
        rows.append((key, value, prefix + turn_id.encode(), lsn.to_bytes(8, "big")))
    start = time.perf_counter()
    for at in range(0, len(rows), 4096):
        batch = rows[at : at + 4096]
        with env.begin(write=True) as txn:
            txn.cursor(dbs[b"turns"]).putmulti([(k, v) for k, v, _, _ in batch])
            txn.cursor(dbs[b"ids"]).putmulti([(i, k) for k, _, i, _ in batch])
            txn.cursor(dbs[b"log"]).putmulti([(n, b"T" + k) for k, _, _, n in batch], append=True)
            txn.cursor(dbs[b"sessions"]).putmulti([(k[:-9], v[:40]) for k, v, _, _ in batch[::20]])
    elapsed = time.perf_counter() - start
    env.close()
    return len(rows) / elapsed


def baseline_commit(path: Path, n: int) -> dict[str, float]:
    """The floor under a durable receipt: bare LMDB, one small put per transaction, fsync on,
    sequential. Its p99 is this disk's fsync tail."""
    env = lmdb.open(str(path), map_size=1 << 28, max_dbs=2, sync=True)
    db = env.open_db(b"t")
    latencies = []
    for i in range(n):
        start = time.perf_counter_ns()
        with env.begin(write=True) as txn:
            txn.put(i.to_bytes(8, "big"), b"x" * 200, db=db)
        latencies.append(time.perf_counter_ns() - start)
    env.close()
    return percentiles(latencies, 1e-3, "us")


async def sustained(path: Path, rate: float, seconds: float, writers: int, durable: bool,
                    texts: list[str], long_term: bool = True) -> dict[str, Any]:
    latencies: list[int] = []
    n_each = int(rate * seconds / writers)
    interval = writers / rate

    last: list[Any] = []

    async def writer(w: int, mem: Engine) -> None:
        due = trio.current_time()
        for i in range(n_each):
            if trio.current_time() < due:
                await trio.sleep_until(due)
            text = texts[(w * n_each + i) % len(texts)]
            start = time.perf_counter_ns()
            receipt = await mem.add_turn(f"user{(w * 7 + i) % 100}", f"s{i % 5}", "user", text,
                                         durable=durable)
            latencies.append(time.perf_counter_ns() - start)
            due += interval
            if w == 0 and i % 500 == 0:
                progress("durable" if durable else "buffered", i + 1, n_each)
        if w == 0:
            progress("durable" if durable else "buffered", n_each, n_each)
        last.append(receipt)

    # The real model follows the log in the background the whole time, as in production.
    async with Engine.open(path, config={"long_term": long_term}) as mem:
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for w in range(writers):
                nursery.start_soon(writer, w, mem)
        elapsed = time.perf_counter() - start
        for receipt in last:
            await receipt.durable()
        stats = await mem.stats()
        embedded = stats.embedded_lsn
        # How far the long-term layer (entities, fact extraction, episodes) got meanwhile.
        followed, episodes = stats.long_term_lsn, stats.episodes_made
    return {**pct(latencies), "achieved_rate": len(latencies) / elapsed,
            "embedded_meanwhile": embedded, "long_term_lsn_meanwhile": followed,
            "episodes_meanwhile": episodes, "last_lsn": last[-1].lsn if last else 0}


async def bulk(path: Path, total: int, texts: list[str]) -> dict[str, Any]:
    items = import_items(total, texts)
    # An import leaves embedding to the serving process, which resumes from the watermark.
    async with Engine.open(path, config={"background_embedding": False}) as mem:
        start, cpu_start = time.perf_counter(), time.process_time()
        for at in range(0, total, 1000):
            receipts = await mem.add_turns(items[at : at + 1000])
            if at % 20_000 == 0:
                progress("bulk", at, total)
        progress("bulk", total, total)
        await receipts[-1].durable()
        elapsed = time.perf_counter() - start
        cpu = time.process_time() - cpu_start
    return {"turns": total, "seconds": elapsed, "turns_per_s": total / elapsed,
            "cpu_us_per_turn": cpu / total * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=2000, help="buffered turns/s (default 2000)")
    parser.add_argument("--seconds", type=float, default=15, help="length of each sustained phase")
    parser.add_argument("--durable-rate", type=float, default=500, help="durable turns/s in all")
    parser.add_argument("--writers", type=int, default=8, help="concurrent durable writers")
    parser.add_argument("--bulk", type=int, default=200_000, help="turns for the bulk phase")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="short phases, for a smoke run")
    parser.add_argument("--bulk-only", action="store_true",
                        help="only the bare LMDB baseline and the bulk import, one after the other")
    parser.add_argument("--out", default="bench/results/ingest.json")
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.bulk = 2, 20_000
    if args.bulk_only and args.out == parser.get_default("out"):
        args.out = "bench/results/ingest-bulk.json"  # not the full run's results
    print(f"seed {args.seed}; {os.cpu_count()} cores; python {platform.python_version()}; "
          f"load average {os.getloadavg()[0]:.1f}")
    rng = random.Random(args.seed)
    texts = [sentence(rng) for _ in range(5000)]
    work = Path(tempfile.mkdtemp(prefix="engram-bench-"))
    results: dict[str, Any] = {"cores": os.cpu_count(), "seed": args.seed, "args": vars(args)}
    try:
        results["baseline_lmdb_turns_per_s"] = baseline_lmdb(
            work / "baseline", import_items(args.bulk, texts))
        if not args.bulk_only:
            results["baseline_commit"] = baseline_commit(work / "commits", 2000)
            results["buffered"] = trio.run(sustained, work / "buffered", args.rate, args.seconds,
                                           1, False, texts)
            results["buffered_without_long_term"] = trio.run(
                sustained, work / "buffered-bare", args.rate, args.seconds, 1, False, texts,
                False)
            results["durable"] = trio.run(sustained, work / "durable", args.durable_rate,
                                          args.seconds, args.writers, True, texts)
        results["bulk"] = trio.run(bulk, work / "bulk", args.bulk, texts)
        # Again right after: on a shared machine the baseline swings with the load, and the
        # faster of the two (the lower ratio) is the one that holds.
        results["baseline_lmdb_after_turns_per_s"] = baseline_lmdb(
            work / "baseline-after", import_items(args.bulk, texts))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results["bulk"]["ratio_to_bare_lmdb"] = results["bulk"]["turns_per_s"] / max(
        results["baseline_lmdb_turns_per_s"], results["baseline_lmdb_after_turns_per_s"])
    results["load_average_after"] = os.getloadavg()[0]
    if args.bulk_only:
        print_bulk(results)
        write_results(args.out, results, "ingest", picture=False)
        return

    print(f"\n{'phase':<34}{'n':>8}{'p50':>10}{'p99':>10}{'p99.9':>10}{'max':>10}")
    for name, label in (("buffered", f"add_turn buffered @{args.rate:g}/s"),
                        ("buffered_without_long_term", "  same, long-term layer off"),
                        ("durable", f"add_turn durable @{args.durable_rate:g}/s x{args.writers}")):
        r = results[name]
        print(f"{label:<34}{r['n']:>8}{r['p50_us']:>8.1f}µs{r['p99_us']:>8.1f}µs"
              f"{r['p999_us']:>8.1f}µs{r['max_us']:>8.1f}µs")
    for name in ("buffered", "buffered_without_long_term", "durable"):
        r = results[name]
        print(f"  {name}: meanwhile embedded to lsn {r['embedded_meanwhile']:,}, long-term "
              f"layer at {r['long_term_lsn_meanwhile']} of {r['last_lsn']:,} turns, "
              f"{r['episodes_meanwhile']:,} episodes made")
    c = results["baseline_commit"]
    print(f"{'bare LMDB commit, fsync (the floor)':<34}{c['n']:>8}{c['p50_us']:>8.1f}µs"
          f"{c['p99_us']:>8.1f}µs{c['p999_us']:>8.1f}µs{c['max_us']:>8.1f}µs")
    # Each figure against its baseline from the same process: the buffered path with the
    # long-term layer on against it off, a durable receipt against the bare fsynced commit.
    for name, base, label in (("buffered", results["buffered_without_long_term"],
                               "buffered / layer off"),
                              ("durable", c, "durable / bare commit")):
        r = results[name]
        ratios = {q: r[f"{q}_us"] / base[f"{q}_us"] for q in ("p50", "p99", "p999")}
        r.update({f"{q}_ratio_to_baseline": x for q, x in ratios.items()})
        print(f"{label + ':':<24}" + "  ".join(f"{q} {x:.2f}x" for q, x in ratios.items()))
    results["durable"]["p99_ratio_to_bare_commit"] = results["durable"]["p99_ratio_to_baseline"]
    print_bulk(results)
    write_results(args.out, results, "ingest")


def print_bulk(results: dict[str, Any]) -> None:
    b = results["bulk"]
    print(f"\nbulk add_turns: {b['turns']:,} turns in {b['seconds']:.2f} s = "
          f"{b['turns_per_s']:,.0f} turns/s; {b['ratio_to_bare_lmdb']:.2f}x of bare LMDB doing the "
          f"same writes ({results['baseline_lmdb_turns_per_s']:,.0f} turns/s before it, "
          f"{results['baseline_lmdb_after_turns_per_s']:,.0f} after, same process); "
          f"{b['cpu_us_per_turn']:.1f} µs of process CPU a turn; load average "
          f"{results['load_average_after']:.1f} after")


if __name__ == "__main__":
    sys.exit(main())
