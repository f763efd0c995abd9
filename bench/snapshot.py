"""Snapshot and restore benchmark: a live snapshot of a large store, and restore to an answer.

    python bench/snapshot.py                       # 1M memories over 1,000 users, ~3 min
    python bench/snapshot.py --memories 100000     # smaller
    python bench/snapshot.py --memories 25000 50000 100000 200000   # time against store size
    nice python bench/snapshot.py --memories 1000000 --keep /var/tmp/snapbench --build-only
    python bench/snapshot.py --memories 1000000 --keep /var/tmp/snapbench   # reuses that store

With ``--keep DIR``, the store of each size is built in ``DIR/<memories>/store`` the first
time and reused by later runs (building 1M takes ~15 min here); each run's snapshot, restore
and bare copies go beside it and are removed. A reused store grows by the turns each run
ingests (steps 2 and 3): the manifest's turn count is reported.

For each size in --memories, on a store of its own:

1. Build a store of that many turns with vectors (bench/recall.py's corpus and its
   ``Mixtures``: real embeddings mixed, so no hours of embedding) and its text index.
2. Baseline: buffered add_turn at --rate turns/s for --seconds; latency percentiles.
3. The same ingest again while ``Engine.snapshot`` runs; its duration, and the ingest
   percentiles during it (ratio of p99 to the baseline's, same process); then a snapshot
   with no ingest beside it, for the ratio.
4. ``Engine.restore`` into a new directory, ``Engine.open``, first ``recall``: the time from
   the start of the restore to the first answer.
5. Baselines in the same run, on the same store: LMDB's bare compacting copy (``env.copy``,
   in C) and a plain ``cp`` of data.mdb, each fsynced; the snapshot's and the restore's
   ratios to them hold on a quieter or busier machine where the seconds do not. The load
   average is recorded before and after.

Prints a table per size and writes JSON (--out, default bench/results/snapshot.json): one
entry per size under ``sizes``, smallest first.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import trio
from _report import percentiles, progress, write_results
from recall import Mixtures, corpus_pool, load_user

from engine import Engine


async def ingest(mem: Engine, rate: float, seconds: float, stop: trio.Event | None = None
                 ) -> list[float]:
    """Buffered add_turn at a sustained rate; stops after ``seconds`` or when ``stop`` is set."""
    latencies, interval = [], 1.0 / rate
    due = trio.current_time()
    end = due + seconds
    i = 0
    while trio.current_time() < end and not (stop is not None and stop.is_set()):
        if trio.current_time() < due:
            await trio.sleep_until(due)
        start = time.perf_counter()
        await mem.add_turn(f"live{i % 50}", "s", "user", f"live turn {i} about the weekend")
        latencies.append(time.perf_counter() - start)
        due += interval
        i += 1
    return latencies


async def run(args: argparse.Namespace) -> dict[str, Any]:
    texts, pool, queries = await corpus_pool(args.seed)
    sizes = []
    for memories in sorted(args.memories):
        print(f"{memories:,} memories")
        sizes.append(await one_size(args, memories, texts, pool, queries))
        if not args.build_only:
            report(args, sizes[-1])
    return {"sizes": sizes}


async def build(store: Path, memories: int, texts: list[str], backend: Mixtures,
                rng: np.random.Generator) -> float:
    """Write the store's turns, embedded by the engine's background lane with the bench's
    mixtures (bench/recall.py), and no long-term layer; returns the seconds it took."""
    first_at = datetime(2026, 1, 1, tzinfo=timezone.utc)
    users = max(1, memories // 1000)
    start = time.perf_counter()
    async with Engine.open(store, config={"long_term": False}, embedder=backend) as mem:
        for i in range(users):
            await load_user(mem, f"u{i:05d}", memories // users, texts, rng, first_at)
            if i % 100 == 99 or i == users - 1:
                progress("building", i + 1, users)
        await mem.flush()
    return time.perf_counter() - start


async def one_size(args: argparse.Namespace, memories: int, texts: list[str], pool: np.ndarray,
                   queries: list[str]) -> dict[str, Any]:
    if args.keep is None:
        work = Path(tempfile.mkdtemp(prefix="engram-snap-"))
    else:
        work = Path(args.keep) / str(memories)
        work.mkdir(parents=True, exist_ok=True)
        for name in ("snap", "snap.partial", "snap-alone", "snap-alone.partial", "restored",
                     "restored.restoring", "bare-envcopy", "bare-cp"):
            shutil.rmtree(work / name, ignore_errors=True)  # left by an interrupted run
    built = work / "built"  # written once the kept store is whole
    rng = np.random.default_rng(args.seed)
    users = max(1, memories // 1000)
    results: dict[str, Any] = {"memories": memories, "users": users,
                               "load_before": os.getloadavg()}
    backend = Mixtures(texts, pool, args.seed)
    try:
        if built.exists():
            results["build_s"] = None
            print(f"  reusing the store kept in {work}")
        else:
            shutil.rmtree(work / "store", ignore_errors=True)
            results["build_s"] = await build(work / "store", memories, texts, backend, rng)
            print(f"  built in {results['build_s']:.0f} s")
            if args.keep is not None:
                built.write_text(f"{memories}\n")
        if args.build_only:
            return results
        # The live turns below are not embedded (no model runs beside the snapshot), and no
        # long-term layer: this measures bytes.
        config = {"background_embedding": False, "long_term": False}
        async with Engine.open(work / "store", config=config, embedder=backend) as mem:
            cpu = time.process_time()
            results["baseline_ingest"] = percentiles(await ingest(mem, args.rate, args.seconds),
                                                     1e6, "us")
            results["ingest_cpu_per_s"] = (time.process_time() - cpu) / args.seconds
            done = trio.Event()  # set when the snapshot is written
            during: list[float] = []

            async def snapshot() -> None:
                start, cpu = time.perf_counter(), time.process_time()
                manifest = await mem.snapshot(work / "snap")
                results["snapshot_s"] = time.perf_counter() - start
                # The process's CPU, every thread, the ingest running beside it included.
                results["snapshot_cpu_s"] = time.process_time() - cpu
                results["snapshot_turns"] = manifest.counts["turns"]
                results["snapshot_lsn"] = manifest.lsn
                results["snapshot_fulltext"] = manifest.fulltext
                results["snapshot_bytes"] = sum(size for size, _ in manifest.files.values())
                done.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(snapshot)
                during = await ingest(mem, args.rate, 3600, stop=done)
            results["ingest_during_snapshot"] = percentiles(during, 1e6, "us")
            results["p99_ratio"] = (results["ingest_during_snapshot"]["p99_us"]
                                    / results["baseline_ingest"]["p99_us"])
            # The same snapshot with nothing beside it, same engine, same run: what the
            # ingest costs the snapshot.
            start = time.perf_counter()
            await mem.snapshot(work / "snap-alone")
            results["snapshot_alone_s"] = time.perf_counter() - start
            await trio.to_thread.run_sync(shutil.rmtree, work / "snap-alone")
        results.update(await trio.to_thread.run_sync(baselines, work))
        start, cpu = time.perf_counter(), time.process_time()
        await Engine.restore(work / "snap", work / "restored")
        results["restore_s"] = time.perf_counter() - start
        results["restore_cpu_s"] = time.process_time() - cpu
        async with Engine.open(work / "restored", config=config, embedder=backend) as mem:
            results["open_s"] = time.perf_counter() - start - results["restore_s"]
            hits = await mem.recall("u00000", queries[0], limit=10)
            results["first_answer_s"] = time.perf_counter() - start
            results["first_answer_hits"] = len(hits)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
        else:
            for name in ("snap", "restored"):
                shutil.rmtree(work / name, ignore_errors=True)
    results["load_after"] = os.getloadavg()
    return results


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def baselines(work: Path) -> dict[str, float]:
    """Bare copies of the closed store's data.mdb, each fsynced: LMDB's compacting copy (what
    a snapshot's LMDB part is made of) and a plain file copy (what a restore must write)."""
    out = {}
    for name in ("envcopy", "cp"):
        dest = work / f"bare-{name}"
        dest.mkdir()
        start = time.perf_counter()
        if name == "cp":
            shutil.copyfile(work / "store" / "data.mdb", dest / "data.mdb")
        else:
            env = lmdb.open(str(work / "store"), readonly=True, max_dbs=64)  # room for all
            try:
                env.copy(str(dest), compact=True)
            finally:
                env.close()
        _fsync(dest / "data.mdb")
        out[f"bare_{name}_s"] = time.perf_counter() - start
        shutil.rmtree(dest)
    return out


def report(args: argparse.Namespace, r: dict[str, Any]) -> None:
    b, d = r["baseline_ingest"], r["ingest_during_snapshot"]
    print(f"snapshot of {r['memories']:,} memories ({r['snapshot_turns']:,} turns, "
          f"{r['snapshot_bytes'] / 1e9:.2f} GB, text index {r['snapshot_fulltext']}): "
          f"{r['snapshot_s']:.1f} s wall, {r['snapshot_cpu_s']:.1f} s CPU (the ingest beside "
          f"it takes {r['ingest_cpu_per_s']:.2f} s CPU a second); without the ingest, "
          f"{r['snapshot_alone_s']:.1f} s")
    print(f"add_turn @{args.rate:g}/s before: p50 {b['p50_us']:.0f} µs p99 {b['p99_us']:.0f} µs; "
          f"during the snapshot: p50 {d['p50_us']:.0f} µs p99 {d['p99_us']:.0f} µs "
          f"({r['p99_ratio']:.2f}x)")
    print(f"restore {r['restore_s']:.1f} s ({r['restore_cpu_s']:.1f} s CPU) + open "
          f"{r['open_s']:.1f} s -> first answer "
          f"{r['first_answer_s']:.1f} s after the restore began ({r['first_answer_hits']} hits)")
    print(f"same run, same store: bare env.copy(compact) {r['bare_envcopy_s']:.1f} s (snapshot "
          f"{r['snapshot_s'] / r['bare_envcopy_s']:.2f}x), cp {r['bare_cp_s']:.1f} s (restore "
          f"{r['restore_s'] / r['bare_cp_s']:.2f}x); load average {r['load_before'][0]:.1f} "
          f"before, {r['load_after'][0]:.1f} after\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--memories", type=int, nargs="+", default=[1_000_000],
                        help="store sizes, one run each (default 1,000,000)")
    parser.add_argument("--rate", type=float, default=2000)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", default="bench/results/snapshot.json")
    parser.add_argument("--keep", metavar="DIR", default=None,
                        help="build each size's store under DIR once and reuse it after")
    parser.add_argument("--build-only", action="store_true",
                        help="with --keep: build the stores (under nice, say), measure nothing")
    args = parser.parse_args()
    print(f"seed {args.seed}; {os.cpu_count()} cores; "
          f"{', '.join(f'{n:,}' for n in sorted(args.memories))} memories")
    if args.build_only and args.keep is None:
        parser.error("--build-only keeps nothing without --keep DIR")
    r = trio.run(run, args)
    if args.build_only:
        return
    r.update(cores=os.cpu_count(), seed=args.seed, args=vars(args))
    write_results(args.out, r, "snapshot")


if __name__ == "__main__":
    sys.exit(main())
