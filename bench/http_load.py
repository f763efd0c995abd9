"""HTTP load benchmark: concurrent clients against `engram-trio serve`: ingest only, recall
only, and the two mixed, each beside a bare FastAPI app on the same stack in the same run.

    python bench/http_load.py             # ~3 minutes on 2 cores (engram-trio bench http: the same)
    python bench/http_load.py --quick     # ~1 minute
    python bench/http_load.py --clients 32 --seconds 30 --recall-share 0.3

Named http_load.py, not http.py: Python puts a script's directory first on sys.path, so a
bench/http.py would shadow the standard library's http package for every script in bench/
(and the engine imports httpx, which imports http.client).

The server runs as its own process (`python -m engine serve`, with an api-keys file, the real
model, fsync on), so what is measured is what a client in another language sees: HTTP/1.1
keep-alive connections, JSON bodies, auth. The clients are trio tasks in this process, each
with its own connection, sending back to back. Three mixes, each run against both servers, one
after the other: every client adds buffered turns (``POST .../turns``, 202); every client
recalls (``POST /v1/users/{u}/recall``, 200 distinct queries, so the query-embedding cache
answers after each client's first round); and ``--recall-share`` of them recalling, the rest
adding turns. Client and server share the machine's two cores, so the figures are a floor.

The baselines come from the same run, because this 2-core machine is shared and absolute
figures move with its load: a bare FastAPI app on Hypercorn's trio worker with trivial JSON
routes at the same paths (the ceiling for any app on this stack), loaded by the same clients
for the same time right before or after each mix; and the same two engine calls in-process on
native trio, for what HTTP adds, and the recall mix without HTTP (as many trio tasks as
clients, the same queries, for as long): what the engine alone answers on these cores. Beside the rates, the CPU each side spent per request (the
clients; the server's loop thread, its model threads and its worker threads, from /proc),
which a shared machine's load moves much less than req/s, and the load average at each
phase's start and end. Before each phase the bench waits until the server's indexes have
caught up and its long-term followers too (one reading of ``/v1/stats``), so the background
embedding of one mix's turns, and the episodes and facts made of them, are not counted in the
next one's CPU. Prints a table and writes JSON (--out, default bench/results/http.json).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio
from _report import percentiles, write_results

from engine import Engine
from engine.cluster import free_port

KEY = "bench-key"
WORDS = ("the a to and of I you it my we in for is that on with this was be have at but so "
         "flat dog Lisbon Porto train vet run river job team data pipeline allergy peanut "
         "morning lesson Portuguese weekend dinner market sardines coffee meeting plan").split()


def sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 30))).capitalize() + "."


TRIVIAL_SERVER = """
import sys, trio
from fastapi import FastAPI
from hypercorn.config import Config
from hypercorn.trio import serve

app = FastAPI()

@app.post("/v1/users/{user_id}/sessions/{session_id}/turns", status_code=202)
async def turn(user_id: str, session_id: str, body: dict) -> dict:
    return {"turn_id": "t_0", "seq": 0, "durable": False}

@app.post("/v1/users/{user_id}/recall")
async def recall(user_id: str, body: dict) -> dict:
    return {"hits": []}

@app.get("/healthz")
async def healthz() -> dict:
    return {"status": "ok"}

config = Config()
config.bind = [f"127.0.0.1:{sys.argv[1]}"]
config.accesslog = None
trio.run(serve, app, config)
"""


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds so far of a process's threads, grouped: ``loop`` (the main thread, where
    trio, Hypercorn, the app and the engine's Python run), ``model`` (threads that kept the
    process's own name: Python threads never renamed, i.e. the embedder's model lanes here),
    ``workers`` (trio's worker threads, named for their job, and native pools such as
    tantivy's). Linux only (/proc); empty elsewhere."""
    groups = {"loop": 0.0, "model": 0.0, "workers": 0.0}
    tick = os.sysconf("SC_CLK_TCK")
    try:
        own = Path(f"/proc/{pid}/comm").read_text().strip()
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue  # the thread ended meanwhile
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        seconds = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
        group = "loop" if tid == str(pid) else "model" if name == own else "workers"
        groups[group] += seconds
    return groups


async def measured(base: str, args: argparse.Namespace, queries: list[str],
                   server: subprocess.Popen, share: float) -> dict[str, Any]:
    """:func:`load`, plus the CPU each side spent per request and the load average: on a
    shared machine req/s moves with the neighbours' load, CPU per request much less."""
    before, client, load_before = thread_cpu(server.pid), time.process_time(), os.getloadavg()
    result = await load(base, args, queries, share)
    after = thread_cpu(server.pid)
    n = max(result["requests"], 1)
    result["cpu_ms_per_request"] = {
        "client": (time.process_time() - client) * 1e3 / n,
        **{f"server_{group}": (after[group] - before.get(group, 0.0)) * 1e3 / n
           for group in after}}
    result["load_average"] = [load_before[0], os.getloadavg()[0]]
    return result


async def wait_ready(base: str, process: subprocess.Popen) -> None:
    async with httpx.AsyncClient(base_url=base) as http:
        for _ in range(600):
            if process.poll() is not None:
                raise SystemExit(f"the server exited with {process.returncode}")
            try:
                if (await http.get("/healthz")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await trio.sleep(0.1)
    raise SystemExit("the server did not answer /healthz within 60 s")


async def caught_up(base: str, limit: float = 300.0) -> float:
    """Wait (up to ``limit`` seconds) until, in one reading of ``/v1/stats``, the server's
    two indexes and its long-term followers have taken in everything committed (what
    ``/readyz`` checks, and the followers), so that one mix's background embedding and the
    episodes, facts and entities made of its turns are not counted in the next's CPU; the
    seconds waited."""
    started = time.perf_counter()
    async with httpx.AsyncClient(base_url=base, timeout=30,
                                 headers={"Authorization": f"Bearer {KEY}"}) as http:
        while time.perf_counter() - started < limit:
            stats = (await http.get("/v1/stats")).json()
            taken = [stats["embedded_lsn"], stats["indexed_lsn"],
                     *stats["long_term_lsn"].values()]
            if min(taken) >= stats["committed_lsn"]:
                break
            await trio.sleep(0.5)
    return time.perf_counter() - started


async def load(base: str, args: argparse.Namespace, queries: list[str],
               share: float) -> dict[str, Any]:
    """Run the clients for args.seconds, ``share`` of them recalling; latencies per kind, and
    counts."""
    latencies: dict[str, list[float]] = {"ingest": [], "recall": []}
    errors: list[str] = []
    recallers = round(args.clients * share)
    deadline = trio.current_time() + args.seconds

    async def client(n: int) -> None:
        rng = random.Random(n)
        kind = "recall" if n < recallers else "ingest"
        user = f"user{n % args.users}"
        limits = httpx.Limits(max_connections=1)
        async with httpx.AsyncClient(base_url=base, limits=limits, timeout=30,
                                     headers={"Authorization": f"Bearer {KEY}"}) as http:
            i = 0
            while trio.current_time() < deadline:
                start = time.perf_counter()
                if kind == "ingest":
                    response = await http.post(
                        f"/v1/users/{user}/sessions/s{n}/turns",
                        json={"role": ("user", "assistant")[i % 2], "text": sentence(rng)})
                else:
                    response = await http.post(f"/v1/users/{user}/recall", json={
                        "query": queries[(n * 7 + i) % len(queries)], "limit": 5})
                latencies[kind].append(time.perf_counter() - start)
                if response.status_code >= 300:
                    errors.append(f"{response.status_code} {response.text[:100]}")
                i += 1

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for n in range(args.clients):
            nursery.start_soon(client, n)
    elapsed = time.perf_counter() - started
    total = sum(len(v) for v in latencies.values())
    return {"seconds": elapsed, "requests": total, "req_per_s": total / elapsed,
            "errors": len(errors), "first_errors": errors[:3],
            **{kind: {**percentiles(v, 1e3, "ms"), "req_per_s": len(v) / elapsed}
               for kind, v in latencies.items() if v}}


async def seed(store: Path, args: argparse.Namespace) -> None:
    """Some history per user, so recall has something to search."""
    rng = random.Random(7)
    async with Engine.open(store) as mem:
        await mem.add_turns([{"user_id": f"user{u}", "session_id": "history", "role": "user",
                              "text": sentence(rng)}
                             for u in range(args.users) for _ in range(args.history)])
        await mem.flush()


async def in_process(store: Path, queries: list[str], n: int) -> dict[str, Any]:
    """The same calls on native trio, back to back, on the seeded store."""
    rng = random.Random(3)
    ingest, recall = [], []
    async with Engine.open(store) as mem:
        for i in range(n):
            start = time.perf_counter()
            await mem.add_turn("user0", "inproc", "user", sentence(rng))
            ingest.append(time.perf_counter() - start)
            start = time.perf_counter()
            await mem.recall("user1", queries[i % len(queries)], limit=5)
            recall.append(time.perf_counter() - start)
            await trio.sleep(0)
    return {"ingest": percentiles(ingest, 1e3, "ms"), "recall": percentiles(recall, 1e3, "ms")}


async def in_process_recalls(store: Path, args: argparse.Namespace,
                             queries: list[str]) -> dict[str, Any]:
    """The recall mix without HTTP: as many trio tasks as the bench has clients, each recalling
    back to back for as long, with the same queries in the same order, on a freshly opened
    engine (an empty query cache, as the server had at its recall mix). What the engine alone
    answers on these cores, for the HTTP recall rate to be read against."""
    latencies: list[float] = []

    async def client(mem: Engine, n: int, deadline: float) -> None:
        i = 0
        while trio.current_time() < deadline:
            start = time.perf_counter()
            await mem.recall(f"user{n % args.users}", queries[(n * 7 + i) % len(queries)],
                             limit=5)
            latencies.append(time.perf_counter() - start)
            i += 1

    async with Engine.open(store) as mem:
        await mem.flush()  # what the server's last mix left for the followers, done first
        started, cpu = time.perf_counter(), time.process_time()
        async with trio.open_nursery() as nursery:
            deadline = trio.current_time() + args.seconds
            for n in range(args.clients):
                nursery.start_soon(client, mem, n, deadline)
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    return {**percentiles(latencies, 1e3, "ms"), "req_per_s": len(latencies) / elapsed,
            "cpu_ms_per_request": cpu * 1e3 / max(len(latencies), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--recall-share", type=float, default=0.25)
    parser.add_argument("--users", type=int, default=50)
    parser.add_argument("--history", type=int, default=20,
                        help="turns per user beforehand (embedded by the real model first)")
    parser.add_argument("--out", default="bench/results/http.json")
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.history = 5, 10
    root = Path(tempfile.mkdtemp(prefix="engram-bench-http-"))
    rng = random.Random(11)
    queries = [" ".join(rng.choice(WORDS) for _ in range(5)) for _ in range(200)]
    servers: dict[str, subprocess.Popen] = {}
    mixes = {"ingest": 0.0, "recall": 1.0, "mixed": args.recall_share}
    results: dict[str, Any] = {"mixes": {}}
    try:
        store = root / "store"
        trio.run(seed, store, args)
        (root / "keys").write_text(f"{KEY} *\n")
        bases = {}
        for name, command in (("trivial_app", [sys.executable, "-c", TRIVIAL_SERVER]),
                              ("http", [sys.executable, "-m", "engine", "serve", str(store),
                                        "--api-keys", str(root / "keys"), "--port"])):
            port = free_port()
            servers[name] = subprocess.Popen(command + [str(port)], stderr=subprocess.DEVNULL)
            bases[name] = f"http://127.0.0.1:{port}"
            trio.run(wait_ready, bases[name], servers[name])
        for i, (mix, share) in enumerate(mixes.items()):
            # Alternate which server goes first, so a trend in the machine's load does not
            # favour one side in every mix.
            order = ("trivial_app", "http") if i % 2 == 0 else ("http", "trivial_app")
            results["mixes"][mix] = {}
            for name in order:
                waited = trio.run(caught_up, bases["http"])
                results["mixes"][mix][name] = trio.run(measured, bases[name], args, queries,
                                                       servers[name], share)
                results["mixes"][mix][name]["waited_for_indexes_s"] = waited
            print(f"  {mix}: engram {results['mixes'][mix]['http']['req_per_s']:,.0f} req/s, "
                  f"trivial {results['mixes'][mix]['trivial_app']['req_per_s']:,.0f}",
                  file=sys.stderr)
        for server in servers.values():
            server.terminate()
            server.wait(30)
        results["in_process"] = trio.run(in_process, store, queries, 500 if args.quick else 2000)
        results["in_process_recalls"] = trio.run(in_process_recalls, store, args, queries)
    finally:
        for server in servers.values():
            if server.poll() is None:
                server.kill()
        shutil.rmtree(root, ignore_errors=True)
    native = results["in_process"]
    print(f"{args.clients} clients, {args.seconds:g} s a phase; mixed: "
          f"{round(args.clients * args.recall_share)} of them recalling")
    print(f"{'mix':<7} {'server':<18} {'req/s':>8} {'ingest p50 / p99 ms':>21} "
          f"{'recall p50 / p99 ms':>21} {'CPU ms/req: loop':>17} {'model':>6} {'workers':>8} "
          f"{'client':>7}  load avg")
    for mix, sides in results["mixes"].items():
        h, b = sides["http"], sides["trivial_app"]
        h["over_trivial_req_per_s"] = h["req_per_s"] / b["req_per_s"]
        for name, side in (("engram-trio serve", h), ("trivial app", b)):
            cells = [f"{side[k]['p50_ms']:>9.2f} / {side[k]['p99_ms']:<9.2f}" if k in side
                     else f"{'':>21}" for k in ("ingest", "recall")]
            cpu = side["cpu_ms_per_request"]
            print(f"{mix:<7} {name:<18} {side['req_per_s']:>8,.0f} {cells[0]:>21} {cells[1]:>21} "
                  f"{cpu.get('server_loop', 0):>17.3f} {cpu.get('server_model', 0):>6.3f} "
                  f"{cpu.get('server_workers', 0):>8.3f} {cpu['client']:>7.3f}  "
                  f"{side['load_average'][0]:.1f} / {side['load_average'][1]:.1f}")
        print(f"{'':<7} engram / trivial: {h['over_trivial_req_per_s']:.2f}x req/s")
    print(f"in-process, native trio: add_turn p50 {native['ingest']['p50_ms']:.3f} ms / p99 "
          f"{native['ingest']['p99_ms']:.3f} ms; recall p50 {native['recall']['p50_ms']:.2f} ms "
          f"/ p99 {native['recall']['p99_ms']:.2f} ms")
    alone, served = results["in_process_recalls"], results["mixes"]["recall"]["http"]
    alone["http_over_in_process_req_per_s"] = served["req_per_s"] / alone["req_per_s"]
    print(f"in-process, native trio, {args.clients} tasks recalling: {alone['req_per_s']:,.0f} "
          f"recalls/s, p50 {alone['p50_ms']:.2f} ms / p99 {alone['p99_ms']:.2f} ms, "
          f"{alone['cpu_ms_per_request']:.2f} ms of CPU each; over HTTP "
          f"{alone['http_over_in_process_req_per_s']:.2f}x of that rate")
    results["args"] = vars(args)
    results["machine"] = {"python": sys.version.split()[0], "platform": platform.platform(),
                          "cpus": os.cpu_count()}
    write_results(args.out, results, "http")


if __name__ == "__main__":
    main()
