"""Durable receipts against the disk's floor: add_turn(durable=True) next to bare LMDB commits.

    python bench/durable.py                # ~1 minute on 2 cores
    python bench/durable.py --quick        # a few seconds, for a smoke run

Phases, each on a fresh store with fsync on (the engine default) and the real model embedding
in the background, each preceded by its own floor measured in the same process:
  floor      bare LMDB, one small put per transaction, fsync on, sequential: the least a
             durable receipt can cost on this disk.
  hops       first, once: the floor's commits alternated with the same commits made on a
             thread of their own that wakes the trio loop when done, as the store's writer
             does, on an otherwise idle loop: what the two thread hops cost that any design
             keeping the fsync off the trio thread pays, before the engine does anything.
  shaped     bare LMDB doing one turn's writes as the engine lays them out (six databases,
             the same texts), opened and flushed as the engine does, sequential: what the
             store's layout adds to the floor, apart from the engine around it.
  ideal      right before the steady phase, between its floors: the steady phase's arrivals
             (--writers trio tasks sharing --rate, as the engine's callers are) on the least
             group commit there is: one plain thread takes whatever is queued, commits the
             floor's puts in one transaction with fsync and wakes each waiter through the
             loop; no model, no other work. What a design that keeps the fsync off the trio
             thread and waits for a commit it may arrive behind could reach on this disk and
             these cores: the engine's target is within reach iff this is.
  loaded     the ideal again, while an engine in the same process takes --rate turns/s
             buffered: the model embeds and the followers follow what the steady phase's
             turns would give them, but nothing of the engine is on the commits' path.
             What any design of the durable path could reach beside the work the engine
             does for those turns on these cores.
  steady     add_turn(durable=True) from --writers concurrent tasks sharing --rate turns/s.
  burst      --bursts times: --burst-turns buffered turns at once (add_turns); once they are
             committed, at once --burst-writers concurrent durable add_turns, while the
             long-term followers and the embedder catch up on the burst: does a durable
             receipt wait behind that work?
  burst_raw  the same, the durable writers starting the moment add_turns returned: a durable
             receipt then also covers the burst's own commit (log order: it is on disk only
             with everything before it), so this shows that cost, not a wait on background work.

After each phase, the engine's own trace of its durable receipts (``stats().durable_stages``:
queued, to_writer, plan, write, commit, flush_wait, flush, to_trio, wake) says where their time
went, p50 / p99 per stage. Each durable figure is reported as a ratio to its floor: the floor
measured just before the phase and again just after it, pooled, so that the machine's load
drifting during a phase moves both sides (issue 16's target: p99 <= 2x, p99.9 <= 3x); and to
the shaped floor, measured the same way. Prints a table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import queue
import random
import shutil
import sys
import tempfile
import threading
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


def floor(path: Path, n: int) -> dict[str, list[int]]:
    """Bare LMDB: one 200-byte put per transaction, fsync on (LMDB's defaults), sequential."""
    env = lmdb.open(str(path), map_size=1 << 28, max_dbs=2, sync=True)
    db = env.open_db(b"t")
    latencies = []
    for i in range(n):
        start = time.perf_counter_ns()
        with env.begin(write=True) as txn:
            txn.put(i.to_bytes(8, "big"), b"x" * 200, db=db)
        latencies.append(time.perf_counter_ns() - start)
    env.close()
    shutil.rmtree(path)
    return {"raw": latencies}


async def hopped_floor(path: Path, n: int) -> dict[str, list[int]]:
    """The floor's commits, each followed by the same commit on a thread of its own that
    wakes the trio loop when it is done (``TrioToken.run_sync_soon``, as the store's writer
    wakes a receipt), the loop otherwise idle: ``raw`` the inline ones, ``hopped`` the
    others, each timed from the trio thread."""
    env = lmdb.open(str(path), map_size=1 << 28, max_dbs=2, sync=True)
    db = env.open_db(b"t")
    token = trio.lowlevel.current_trio_token()
    jobs: queue.SimpleQueue[tuple[int, trio.Event] | None] = queue.SimpleQueue()

    def commit(i: int) -> None:
        with env.begin(write=True) as txn:
            txn.put(i.to_bytes(8, "big"), b"x" * 200, db=db)

    def serve() -> None:
        while (job := jobs.get()) is not None:
            commit(job[0])
            token.run_sync_soon(job[1].set)

    thread = threading.Thread(target=serve, name="bench-hops", daemon=True)
    thread.start()
    inline, hopped = [], []
    try:
        for i in range(n):
            start = time.perf_counter_ns()
            commit(2 * i)
            inline.append(time.perf_counter_ns() - start)
            done = trio.Event()
            start = time.perf_counter_ns()
            jobs.put((2 * i + 1, done))
            await done.wait()
            hopped.append(time.perf_counter_ns() - start)
            await trio.sleep(0.001)  # a caller's pace, not a queue
    finally:
        jobs.put(None)
        thread.join()
        env.close()
        shutil.rmtree(path)
    return {"raw": inline, "hopped": hopped}


def shaped_floor(path: Path, n: int, texts: list[str]) -> dict[str, list[int]]:
    """Bare LMDB doing a durable turn's writes as the engine lays them out, and nothing more:
    the turn (msgpack, the same texts), its id, its session record, its log entry and hash-chain
    record, the two meta keys, in six named databases; LMDB opened as the engine opens it
    (MDB_NOMETASYNC) and flushed after each commit (``env.sync``): two flushes a turn, as in the
    floor and in a durable receipt. Sequential, one thread, no engine: what the store's layout
    costs on this disk, apart from what the engine around it costs."""
    env = lmdb.open(str(path), map_size=1 << 28, max_dbs=8, sync=True, metasync=False)
    dbs = {name: env.open_db(name) for name in (b"meta", b"sessions", b"turns", b"ids", b"log",
                                                  b"chain")}
    encode = msgspec.msgpack.Encoder().encode
    latencies = []
    for lsn in range(1, n + 1):
        user, session, seq = f"user{lsn % 100}", f"s{lsn % 5}", lsn  # keys unique, as the engine's
        key = f"{user}\0{session}\0".encode() + seq.to_bytes(8, "big")
        turn_id = f"t_{lsn:020x}"
        value = encode([lsn, turn_id, user, session, seq, "user", texts[lsn % len(texts)],
                        1_795_000_000.0 + lsn, {}, None, None]) + b"crc4"
        start = time.perf_counter_ns()
        with env.begin(write=True) as txn:
            txn.put(key, value, db=dbs[b"turns"])
            txn.put(f"{user}\0{turn_id}".encode() + b"crc4", key, db=dbs[b"ids"])
            txn.put(key[:-9], encode([user, session, 1_795_000_000.0, 1_795_000_000.0 + lsn,
                                      seq + 1, None, None]) + b"crc4", db=dbs[b"sessions"])
            txn.put(lsn.to_bytes(8, "big"), b"T" + key + b"crc4", db=dbs[b"log"], append=True)
            txn.put(lsn.to_bytes(8, "big"), bytes(68), db=dbs[b"chain"], append=True)
            txn.put(b"last_lsn", lsn.to_bytes(8, "big"), db=dbs[b"meta"])
            txn.put(b"chain_head", bytes(48), db=dbs[b"meta"])
        env.sync(True)
        latencies.append(time.perf_counter_ns() - start)
    env.close()
    shutil.rmtree(path)
    return {"raw": latencies}


async def ideal(path: Path, rate: float, seconds: float, writers: int) -> dict[str, list[int]]:
    """The steady phase's arrivals on a bare group commit (see ideal in the module's
    docstring): each writer, a trio task as the engine's callers are, queues a put and waits;
    one plain thread takes whatever is queued into one fsynced transaction, then wakes each
    waiter through the loop."""
    env = lmdb.open(str(path), map_size=1 << 28, max_dbs=2, sync=True)
    db = env.open_db(b"t")
    jobs: queue.SimpleQueue[trio.Event | None] = queue.SimpleQueue()
    token = trio.lowlevel.current_trio_token()

    def wake(waiters: list[trio.Event]) -> None:
        for waiter in waiters:
            waiter.set()

    def commit_loop() -> None:
        key, stop = 0, False
        while not stop:
            batch = [jobs.get()]
            with contextlib.suppress(queue.Empty):
                while True:
                    batch.append(jobs.get_nowait())
            stop = None in batch
            waiters = [job for job in batch if job is not None]
            with env.begin(write=True) as txn:
                for _ in waiters:
                    txn.put(key.to_bytes(8, "big"), b"x" * 200, db=db)
                    key += 1
            if waiters:
                token.run_sync_soon(wake, waiters)

    latencies: list[int] = []
    n_each, interval = int(rate * seconds / writers), writers / rate

    async def writer(w: int) -> None:
        due = trio.current_time() + w * interval / writers  # spread, as the steady phase's
        for _ in range(n_each):
            await trio.sleep_until(due)
            done = trio.Event()
            start = time.perf_counter_ns()
            jobs.put(done)
            await done.wait()
            latencies.append(time.perf_counter_ns() - start)
            due += interval

    committer = threading.Thread(target=commit_loop, name="bench-ideal", daemon=True)
    committer.start()
    try:
        async with trio.open_nursery() as nursery:
            for w in range(writers):
                nursery.start_soon(writer, w)
    finally:
        jobs.put(None)
        committer.join()
        env.close()
    shutil.rmtree(path)
    return {"raw": latencies}


async def loaded_ideal(path: Path, rate: float, seconds: float, writers: int,
                       texts: list[str], config: dict[str, Any]) -> dict[str, list[int]]:
    """:func:`ideal` beside an engine taking ``rate`` buffered turns/s (see loaded in the
    module's docstring), from a second before it to its end."""
    async with Engine.open(path / "engine", config=config) as mem:
        async def feed() -> None:
            due, i = trio.current_time(), 0
            while True:
                await mem.add_turn(f"user{i % 100}", f"s{i % 5}", "user",
                                   texts[i % len(texts)])
                i += 1
                due += 1 / rate
                await trio.sleep_until(due)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(feed)
            await trio.sleep(1.0)
            result = await ideal(path / "ideal", rate, seconds, writers)
            nursery.cancel_scope.cancel()
    return result


async def steady(path: Path, rate: float, seconds: float, writers: int,
                 texts: list[str], config: dict[str, Any]) -> dict[str, Any]:
    latencies: list[int] = []
    n_each = int(rate * seconds / writers)
    interval = writers / rate

    async def writer(w: int, mem: Engine) -> None:
        due = trio.current_time()
        for i in range(n_each):
            if trio.current_time() < due:
                await trio.sleep_until(due)
            start = time.perf_counter_ns()
            await mem.add_turn(f"user{(w * 7 + i) % 100}", f"s{i % 5}", "user",
                               texts[(w * n_each + i) % len(texts)], durable=True)
            latencies.append(time.perf_counter_ns() - start)
            due += interval
        if w == 0:
            progress("steady", 1, 1)

    async with Engine.open(path, config=config) as mem:
        async with trio.open_nursery() as nursery:
            for w in range(writers):
                nursery.start_soon(writer, w, mem)
        stages = (await mem.stats()).durable_stages
    return {**percentiles(latencies, 1e-3, "us"), "stages": stages}


async def burst(path: Path, bursts: int, burst_turns: int, writers: int,
                texts: list[str], committed_first: bool, config: dict[str, Any]
                ) -> dict[str, Any]:
    latencies: list[int] = []

    async def durable_one(mem: Engine, b: int, w: int) -> None:
        start = time.perf_counter_ns()
        await mem.add_turn(f"writer{w}", f"b{b}", "user", texts[(b * writers + w) % len(texts)],
                           durable=True)
        latencies.append(time.perf_counter_ns() - start)

    async with Engine.open(path, config=config) as mem:
        for b in range(bursts):
            items = [NewTurn(user_id=f"user{(b * burst_turns + i) % 50}", session_id=f"s{b}",
                             role=("user", "assistant")[i % 2], text=texts[i % len(texts)])
                     for i in range(burst_turns)]
            receipts = await mem.add_turns(items)
            if committed_first:
                await receipts[-1].durable()
            async with trio.open_nursery() as nursery:
                for w in range(writers):
                    nursery.start_soon(durable_one, mem, b, w)
            progress("burst", b + 1, bursts)
            await trio.sleep(0.2)  # the followers keep working on the burst between rounds
        stages = (await mem.stats()).durable_stages
    return {**percentiles(latencies, 1e-3, "us"), "stages": stages}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=500, help="durable turns/s in all")
    parser.add_argument("--seconds", type=float, default=15, help="length of the steady phase")
    parser.add_argument("--writers", type=int, default=8, help="concurrent durable writers")
    parser.add_argument("--bursts", type=int, default=20)
    parser.add_argument("--burst-turns", type=int, default=3000)
    parser.add_argument("--burst-writers", type=int, default=25)
    parser.add_argument("--floor-commits", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--receipt-switch-us", type=int, default=None,
                        help="the engine's receipt_switch_us (default: the engine's default; "
                             "0: the interpreter's switch interval left alone)")
    parser.add_argument("--quick", action="store_true", help="short phases, for a smoke run")
    parser.add_argument("--out", default="bench/results/durable.json")
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.bursts, args.floor_commits = 2, 5, 500
    print(f"seed {args.seed}; {os.cpu_count()} cores; python {platform.python_version()}; "
          f"load average {os.getloadavg()[0]:.1f}")
    rng = random.Random(args.seed)
    texts = [sentence(rng) for _ in range(5000)]
    work = Path(tempfile.mkdtemp(prefix="engram-bench-"))
    results: dict[str, Any] = {"cores": os.cpu_count(), "seed": args.seed, "args": vars(args)}
    config = ({} if args.receipt_switch_us is None
              else {"receipt_switch_us": args.receipt_switch_us})
    phases = {
        "steady": lambda: trio.run(steady, work / "steady", args.rate, args.seconds,
                                   args.writers, texts, config),
        "burst": lambda: trio.run(burst, work / "burst", args.bursts, args.burst_turns,
                                  args.burst_writers, texts, True, config),
        "burst_raw": lambda: trio.run(burst, work / "burst_raw", args.bursts, args.burst_turns,
                                      args.burst_writers, texts, False, config),
    }
    try:
        hops = trio.run(hopped_floor, work / "hops", args.floor_commits // 2)
        results["hops_floor"] = percentiles(hops["raw"], 1e-3, "us")
        results["hops"] = percentiles(hops["hopped"], 1e-3, "us")
        for name, run in phases.items():
            half = args.floor_commits // 2
            before = floor(work / f"{name}_floor_before", half)["raw"]
            shaped = shaped_floor(work / f"{name}_shaped_before", half, texts)["raw"]
            if name == "steady":  # between the same two floors
                results["ideal"] = percentiles(trio.run(ideal, work / "ideal", args.rate,
                                                        args.seconds, args.writers)["raw"],
                                               1e-3, "us")
                results["loaded"] = percentiles(
                    trio.run(loaded_ideal, work / "loaded", args.rate, args.seconds,
                             args.writers, texts, config)["raw"], 1e-3, "us")
            results[name] = run()
            after = floor(work / f"{name}_floor_after", half)["raw"]
            shaped += shaped_floor(work / f"{name}_shaped_after", half, texts)["raw"]
            results[f"{name}_floor"] = percentiles(before + after, 1e-3, "us")
            results[f"{name}_shaped"] = percentiles(shaped, 1e-3, "us")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"\n{'phase':<48}{'n':>6}{'p50':>11}{'p99':>11}{'p99.9':>11}")
    shaped_label = "bare LMDB, a turn's writes + flush (shaped)"
    for name, label in (
            ("hops_floor", "bare LMDB commit, fsync (floor)"),
            ("hops", "the same, on a thread waking the trio loop"),
            ("steady_floor", "bare LMDB commit, fsync (floor)"),
            ("steady_shaped", shaped_label),
            ("ideal", "the same arrivals, bare group commit (ideal)"),
            ("loaded", "ideal beside an engine taking the same rate"),
            ("steady", f"durable add_turn @{args.rate:g}/s x{args.writers}"),
            ("burst_floor", "bare LMDB commit, fsync (floor)"),
            ("burst_shaped", shaped_label),
            ("burst", f"durable x{args.burst_writers}, {args.burst_turns} buffered committed"),
            ("burst_raw_floor", "bare LMDB commit, fsync (floor)"),
            ("burst_raw_shaped", shaped_label),
            ("burst_raw", f"durable x{args.burst_writers} the moment {args.burst_turns} "
                          "buffered returned")):
        r = results[name]
        print(f"{label:<48}{r['n']:>6}{r['p50_us']:>9.0f}µs{r['p99_us']:>9.0f}µs"
              f"{r['p999_us']:>9.0f}µs")
    h, f = results["hops"], results["hops_floor"]
    h["ratio_p50"], h["ratio_p99"] = h["p50_us"] / f["p50_us"], h["p99_us"] / f["p99_us"]
    print(f"hops: two thread hops / floor  p50 {h['ratio_p50']:.2f}x  p99 {h['ratio_p99']:.2f}x")
    i, f = results["ideal"], results["steady_floor"]
    i["ratio_p50"], i["ratio_p99"], i["ratio_p999"] = (
        i["p50_us"] / f["p50_us"], i["p99_us"] / f["p99_us"], i["p999_us"] / f["p999_us"])
    print(f"ideal: bare group commit / floor  p50 {i['ratio_p50']:.2f}x  p99 {i['ratio_p99']:.2f}x"
          f"  p99.9 {i['ratio_p999']:.2f}x; steady durable / ideal  p99 "
          f"{results['steady']['p99_us'] / i['p99_us']:.2f}x")
    g = results["loaded"]
    g["ratio_p50"], g["ratio_p99"], g["ratio_p999"] = (
        g["p50_us"] / f["p50_us"], g["p99_us"] / f["p99_us"], g["p999_us"] / f["p999_us"])
    print(f"loaded: ideal beside the engine's work / floor  p50 {g['ratio_p50']:.2f}x  p99 "
          f"{g['ratio_p99']:.2f}x  p99.9 {g['ratio_p999']:.2f}x; steady durable / loaded  p99 "
          f"{results['steady']['p99_us'] / g['p99_us']:.2f}x")
    for name in phases:
        r, f = results[name], results[f"{name}_floor"]
        r["ratio_p50"] = r["p50_us"] / f["p50_us"]
        r["ratio_p99"] = r["p99_us"] / f["p99_us"]
        r["ratio_p999"] = r["p999_us"] / f["p999_us"]
        print(f"{name}: durable / floor  p50 {r['ratio_p50']:.2f}x  p99 {r['ratio_p99']:.2f}x  "
              f"p99.9 {r['ratio_p999']:.2f}x")
        g = results[f"{name}_shaped"]
        r["shaped_ratio_p99"], r["shaped_ratio_p999"] = (r["p99_us"] / g["p99_us"],
                                                         r["p999_us"] / g["p999_us"])
        print(f"{' ' * len(name)}  shaped / floor  p50 {g['p50_us'] / f['p50_us']:.2f}x  "
              f"p99 {g['p99_us'] / f['p99_us']:.2f}x; durable / shaped  p99 "
              f"{r['shaped_ratio_p99']:.2f}x  p99.9 {r['shaped_ratio_p999']:.2f}x")
    for name in phases:
        stages = results[name]["stages"]
        print(f"\n{name}: where the engine's last {min(results[name]['n'], 1024)} waits for a "
              "commit spent their time (stats().durable_stages)")
        print("  " + "".join(f"{stage:>11}" for stage in stages))
        for q in ("p50", "p99"):
            print("  " + "".join(f"{s[q + '_ms'] * 1e3:>9.0f}µs" for s in stages.values())
                  + f"  {q}")
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    write_results(args.out, results, "durable")


if __name__ == "__main__":
    sys.exit(main())
