"""HTTP load benchmark: concurrent clients against `engram-trio serve`, ingest and recall mixed.

    python bench/http_load.py             # ~40 s on 2 cores (engram-trio bench http: the same)
    python bench/http_load.py --quick     # ~10 s
    python bench/http_load.py --clients 32 --seconds 30 --recall-share 0.3

Named http_load.py, not http.py: Python puts a script's directory first on sys.path, so a
bench/http.py would shadow the standard library's http package for every script in bench/
(and the engine imports httpx, which imports http.client).

The server runs as its own process (`python -m engine serve`, with an api-keys file, the real
model, fsync on), so what is measured is what a client in another language sees: HTTP/1.1
keep-alive connections, JSON bodies, auth. The clients are trio tasks in this process, each
with its own connection, sending back to back: a share of them recall (``POST
/v1/users/{u}/recall``, 200 distinct queries, so the query-embedding cache answers after the
first round), the rest add buffered turns (``POST .../turns``, 202). Client and server share
the machine's two cores, so the figures are a floor.

Two baselines from the same run, because this 2-core machine is shared and absolute figures
move with its load: a bare FastAPI app on Hypercorn's trio worker with one trivial JSON route
(the ceiling for any app on this stack), loaded by the same clients for the same time; and the
same two engine calls in-process on native trio, for what HTTP adds. Beside the rates, the CPU
each side spent per request (the clients; the server's loop thread, its model threads and its
worker threads, from /proc), which a shared machine's load moves much less than req/s. Prints a
table and writes JSON (--out, default bench/results/http.json).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import shutil
import socket
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
                   server: subprocess.Popen) -> dict[str, Any]:
    """:func:`load`, plus the CPU each side spent per request and the load average: on a
    shared machine req/s moves with the neighbours' load, CPU per request much less."""
    before, client, load_before = thread_cpu(server.pid), time.process_time(), os.getloadavg()
    result = await load(base, args, queries)
    after = thread_cpu(server.pid)
    n = max(result["requests"], 1)
    result["cpu_ms_per_request"] = {
        "client": (time.process_time() - client) * 1e3 / n,
        **{f"server_{group}": (after[group] - before.get(group, 0.0)) * 1e3 / n
           for group in after}}
    result["load_average"] = [load_before[0], os.getloadavg()[0]]
    return result


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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


async def load(base: str, args: argparse.Namespace, queries: list[str]) -> dict[str, Any]:
    """Run the clients for args.seconds; latencies per kind, and counts."""
    latencies: dict[str, list[float]] = {"ingest": [], "recall": []}
    errors: list[str] = []
    recallers = round(args.clients * args.recall_share)
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
    process = None
    try:
        store = root / "store"
        trio.run(seed, store, args)
        (root / "keys").write_text(f"{KEY} *\n")
        port = free_port()
        trivial = subprocess.Popen([sys.executable, "-c", TRIVIAL_SERVER, str(port)],
                                   stderr=subprocess.DEVNULL)
        try:
            trio.run(wait_ready, f"http://127.0.0.1:{port}", trivial)
            baseline = trio.run(measured, f"http://127.0.0.1:{port}", args, queries, trivial)
        finally:
            trivial.kill()
            trivial.wait()
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        process = subprocess.Popen(
            [sys.executable, "-m", "engine", "serve", str(store), "--port", str(port),
             "--api-keys", str(root / "keys")], stderr=subprocess.DEVNULL)
        trio.run(wait_ready, base, process)
        results = {"http": trio.run(measured, base, args, queries, process),
                   "trivial_app": baseline}
        process.terminate()
        process.wait(30)
        results["in_process"] = trio.run(in_process, store, queries, 500 if args.quick else 2000)
    finally:
        if process is not None and process.poll() is None:
            process.kill()
        shutil.rmtree(root, ignore_errors=True)
    http, native = results["http"], results["in_process"]
    print(f"{args.clients} clients ({round(args.clients * args.recall_share)} recalling), "
          f"{http['seconds']:.0f} s: {http['req_per_s']:,.0f} req/s, {http['errors']} errors; "
          f"the trivial app, same clients: {baseline['req_per_s']:,.0f} req/s "
          f"(engram = {http['req_per_s'] / baseline['req_per_s']:.2f}x)")
    print(f"{'call':<8} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8}   trivial app p50 / p99 ms"
          f"   in-process p50 / p99 ms")
    for kind in ("ingest", "recall"):
        if kind in http:
            h, b, n = http[kind], baseline[kind], native[kind]
            print(f"{kind:<8} {h['req_per_s']:>8,.0f} {h['p50_ms']:>8.2f} {h['p99_ms']:>8.2f}"
                  f"   {b['p50_ms']:>8.2f} / {b['p99_ms']:<8.2f}"
                  f"   {n['p50_ms']:.3f} / {n['p99_ms']:.3f}")
    print("CPU ms per request      " + "".join(f"{k:>16}" for k in http["cpu_ms_per_request"]))
    for name, side in (("engram-trio serve", http), ("trivial app", baseline)):
        print(f"{name:<23}" + "".join(f"{side['cpu_ms_per_request'].get(k, 0.0):>16.3f}"
                                      for k in http["cpu_ms_per_request"]))
    print(f"load average (1 min) at start / end: engram {http['load_average'][0]:.1f} / "
          f"{http['load_average'][1]:.1f}, trivial {baseline['load_average'][0]:.1f} / "
          f"{baseline['load_average'][1]:.1f}")
    results["engram_over_trivial_req_per_s"] = http["req_per_s"] / baseline["req_per_s"]
    results["args"] = vars(args)
    results["machine"] = {"python": sys.version.split()[0], "platform": platform.platform(),
                          "cpus": os.cpu_count()}
    write_results(args.out, results, "http")


if __name__ == "__main__":
    main()
