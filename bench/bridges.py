"""Bridge benchmark: add_turn and awaited calls through engine.aio (trio in guest mode, and on
a thread of its own) and engine.sync against the same calls on native trio, in one process,
each on a fresh store.

    python bench/bridges.py              # ~3 min on 2 cores (more on a loaded machine)
    python bench/bridges.py --quick      # ~30 s
    python bench/bridges.py --rounds 5   # more rounds, a tighter median
    python bench/bridges.py --model      # recall with the real model (default: HashEmbedder,
                                         # so the figure is the bridge, not the model)

The add_turn_nowait target (a few µs against a few µs) is measured on its own first: native
``await add_turn`` and asyncio ``add_turn_nowait`` on fresh stores in alternating order, seconds
apart, --hot-rounds times; the target is their ratio's median, and every round is printed.
Then the facades run in rounds, in alternating order (native first in one round, last in the
next), so a change in the shared machine's load falls on every facade alike; the table gives
each figure's median over the rounds. (A ratio from two runs minutes apart, one in a quiet
spell and one in a busy one, says little here: that is how one run gave 2.25x.)

Measured per facade, back to back with a yield between calls:
  add_turn        buffered add_turn (native: ``await mem.add_turn``; aio also
                  ``add_turn_nowait``, the hot path, and ``await add_turn``; sync: the call;
                  with trio on its own thread, ``add_turn_nowait`` is a blocking round trip)
  history         ``session_history(limit=5)``: a cheap awaited call, so the bridge dominates
  recall          ``recall(limit=5)`` over the turns added

Targets (DESIGN.md): asyncio ``add_turn_nowait`` p50 <= 2x native ``add_turn``; awaited calls
p50 < 150 us over native. Prints a table and writes JSON (--out, default
bench/results/bridges.json).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio
from _report import percentiles, write_results

from engine import Engine, HashEmbedder
from engine import aio, sync

CONFIG = {"long_term": False}  # the bridge, not the background layer, is under test


def us(values: list[float]) -> dict[str, float]:
    return percentiles(values, 1e6, "us")


def texts(n: int) -> list[str]:
    words = "the dog Lisbon train river job data plan coffee market morning lesson".split()
    return [" ".join(words[(i + k) % len(words)] for k in range(8)) + f" {i}" for i in range(n)]


WARMUP = 20  # untimed recalls before timing, after the first one has had SETTLE seconds
SETTLE = 3.0  # the first recall loads the user's vectors and starts the graph build in the
# background; recalls switch from exact search to the graph when it is done, so without this
# wait each facade's store is timed at a different point of that switch


def caught_up(stats: Any) -> bool:
    """Both indexes cover every committed turn, so recall compares like with like."""
    return stats.embedded_lsn >= stats.committed_lsn and stats.indexed_lsn >= stats.committed_lsn


def options(args: argparse.Namespace) -> dict[str, Any]:
    return {"config": CONFIG, **({} if args.model else {"embedder": HashEmbedder()})}


async def native(store: Path, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, list[float]] = {"add_turn": [], "add_turn_nowait": [], "history": [],
                                   "recall": []}
    clock = time.perf_counter
    async with Engine.open(store, **options(args)) as mem:
        for i, text in enumerate(texts(args.turns)):
            start = clock()
            await mem.add_turn("u", "s", "user", text)
            out["add_turn"].append(clock() - start)
            start = clock()
            mem.add_turn_nowait("u", "s2", "user", text)
            out["add_turn_nowait"].append(clock() - start)
            await trio.sleep(0)
        await mem.flush()
        while not caught_up(await mem.stats()):
            await trio.sleep(0.05)
        await mem.recall("u", "warm up", limit=5)
        await trio.sleep(SETTLE)
        for query in texts(WARMUP):
            await mem.recall("u", query, limit=5)
        for i in range(args.calls):
            start = clock()
            await mem.session_history("u", "s", limit=5)
            out["history"].append(clock() - start)
            await trio.sleep(0)
        for i, query in enumerate(texts(args.calls)):
            start = clock()
            await mem.recall("u", query, limit=5)
            out["recall"].append(clock() - start)
            await trio.sleep(0)
    return {k: us(v) for k, v in out.items()}


async def on_asyncio(store: Path, args: argparse.Namespace, trio_loop: str) -> dict[str, Any]:
    out: dict[str, list[float]] = {"add_turn_nowait": [], "add_turn": [], "history": [],
                                   "recall": []}
    clock = time.perf_counter
    async with aio.Engine.open(store, trio_loop=trio_loop, **options(args)) as mem:
        for text in texts(args.turns):
            start = clock()
            mem.add_turn_nowait("u", "s", "user", text)
            out["add_turn_nowait"].append(clock() - start)
            start = clock()
            await mem.add_turn("u", "s2", "user", text)
            out["add_turn"].append(clock() - start)
            await asyncio.sleep(0)
        await mem.flush()
        while not caught_up(await mem.stats()):
            await asyncio.sleep(0.05)
        await mem.recall("u", "warm up", limit=5)
        await asyncio.sleep(SETTLE)
        for query in texts(WARMUP):
            await mem.recall("u", query, limit=5)
        for i in range(args.calls):
            start = clock()
            await mem.session_history("u", "s", limit=5)
            out["history"].append(clock() - start)
            await asyncio.sleep(0)
        for query in texts(args.calls):
            start = clock()
            await mem.recall("u", query, limit=5)
            out["recall"].append(clock() - start)
            await asyncio.sleep(0)
    return {k: us(v) for k, v in out.items()}


def blocking(store: Path, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, list[float]] = {"add_turn": [], "history": [], "recall": []}
    clock = time.perf_counter
    with sync.Engine.open(store, **options(args)) as mem:
        for text in texts(args.turns):
            start = clock()
            mem.add_turn("u", "s", "user", text)
            out["add_turn"].append(clock() - start)
        mem.flush()
        while not caught_up(mem.stats()):
            time.sleep(0.05)
        mem.recall("u", "warm up", limit=5)
        time.sleep(SETTLE)
        for query in texts(WARMUP):
            mem.recall("u", query, limit=5)
        for i in range(args.calls):
            start = clock()
            mem.session_history("u", "s", limit=5)
            out["history"].append(clock() - start)
        for query in texts(args.calls):
            start = clock()
            mem.recall("u", query, limit=5)
            out["recall"].append(clock() - start)
    return {k: us(v) for k, v in out.items()}


async def hot_native(store: Path, args: argparse.Namespace) -> list[float]:
    """Native ``await add_turn`` latencies, the hot-path rounds' baseline."""
    out: list[float] = []
    clock = time.perf_counter
    async with Engine.open(store, **options(args)) as mem:
        for text in texts(args.hot_turns):
            start = clock()
            await mem.add_turn("u", "s", "user", text)
            out.append(clock() - start)
            await trio.sleep(0)
    return out


async def hot_asyncio(store: Path, args: argparse.Namespace) -> list[float]:
    """asyncio ``add_turn_nowait`` latencies (guest mode), an awaited call between two, as
    :func:`on_asyncio` times them."""
    out: list[float] = []
    clock = time.perf_counter
    async with aio.Engine.open(store, trio_loop="guest", **options(args)) as mem:
        for text in texts(args.hot_turns):
            start = clock()
            mem.add_turn_nowait("u", "s", "user", text)
            out.append(clock() - start)
            await mem.add_turn("u", "s2", "user", text)
            await asyncio.sleep(0)
    return out


def hot_path_rounds(root: Path, args: argparse.Namespace) -> list[dict[str, float]]:
    """The add_turn_nowait target, measured on its own: native ``add_turn`` and asyncio
    ``add_turn_nowait`` in alternating order, seconds apart, ``hot_rounds`` times; each round's
    p50s and their ratio."""
    rounds = []
    for n in range(args.hot_rounds):
        sides = {}
        for side in (("native", "asyncio") if n % 2 == 0 else ("asyncio", "native")):
            store = root / f"hot-{n}-{side}"
            sides[side] = (trio.run(hot_native, store, args) if side == "native"
                           else asyncio.run(hot_asyncio(store, args)))
        p50 = {side: statistics.median(v) * 1e6 for side, v in sides.items()}
        rounds.append({"native_add_turn_p50_us": p50["native"],
                       "asyncio_add_turn_nowait_p50_us": p50["asyncio"],
                       "ratio": p50["asyncio"] / p50["native"], "load": os.getloadavg()[0]})
        print(f"hot path {n + 1}/{args.hot_rounds}: native add_turn {p50['native']:.1f} us, "
              f"asyncio add_turn_nowait {p50['asyncio']:.1f} us = "
              f"{rounds[-1]['ratio']:.2f}x (load {rounds[-1]['load']:.1f})", flush=True)
    return rounds


FACADES = {
    "native": lambda store, args: trio.run(native, store, args),
    "asyncio": lambda store, args: asyncio.run(on_asyncio(store, args, "guest")),
    "aio-thread": lambda store, args: asyncio.run(on_asyncio(store, args, "thread")),
    "sync": blocking,
}


def median_of(rounds: list[dict[str, Any]], facade: str, call: str) -> dict[str, Any]:
    """A call's figures, each the median of that figure over the rounds (the CDF's level by
    level)."""
    keys = rounds[0][facade][call]
    figures: dict[str, Any] = {}
    for key in keys:
        values = [r[facade][call][key] for r in rounds]
        figures[key] = ([statistics.median(level) for level in zip(*values, strict=True)]
                        if isinstance(values[0], list) else statistics.median(values))  # cdf
    return figures


def targets(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets in one round: asyncio (guest mode) add_turn_nowait p50 over native
    add_turn p50, and each awaited call's p50 over native."""
    base, aio_ = result["native"], result["asyncio"]
    return {"nowait_ratio": aio_["add_turn_nowait"]["p50_us"] / base["add_turn"]["p50_us"],
            "over_us": {call: aio_[call]["p50_us"] - base[call]["p50_us"]
                        for call in ("add_turn", "history", "recall")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", action="store_true", help="recall with the real model")
    parser.add_argument("--turns", type=int, default=5000)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--hot-rounds", type=int, default=None,
                        help="alternating rounds of the add_turn_nowait target alone "
                             "(default 7, 3 with --quick)")
    parser.add_argument("--hot-turns", type=int, default=3000)
    parser.add_argument("--out", default="bench/results/bridges.json")
    args = parser.parse_args()
    if args.quick:
        args.turns, args.calls, args.rounds = 500, 200, 1
    if args.hot_rounds is None:
        args.hot_rounds = 3 if args.quick else 7
    root = Path(tempfile.mkdtemp(prefix="engram-bench-bridges-"))
    rounds: list[dict[str, Any]] = []
    loads: list[float] = []
    try:
        hot = hot_path_rounds(root, args)
        for n in range(args.rounds):
            order = list(FACADES) if n % 2 == 0 else list(FACADES)[::-1]
            loads.append(os.getloadavg()[0])
            result = {facade: FACADES[facade](root / f"{n}-{facade}", args) for facade in order}
            rounds.append({facade: result[facade] for facade in FACADES})
            t = targets(rounds[-1])
            print(f"round {n + 1}/{args.rounds} ({' -> '.join(order)}, load {loads[-1]:.1f}): "
                  f"asyncio add_turn_nowait {t['nowait_ratio']:.2f}x native add_turn; awaited "
                  + ", ".join(f"{k} {v:+.0f} us" for k, v in t["over_us"].items()),
                  flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results: dict[str, Any] = {facade: {call: median_of(rounds, facade, call)
                                        for call in rounds[0][facade]} for facade in FACADES}
    base = results["native"]
    print(f"\nmedians over {args.rounds} rounds")
    print(f"{'facade':<10} {'call':<16} {'p50 us':>9} {'p99 us':>9} {'p50 vs native':>22}")
    for facade in FACADES:
        for call, figures in results[facade].items():
            ref = base.get(call) or base["add_turn"]
            if call == "add_turn_nowait" and facade != "native":
                ref = base["add_turn"]  # the target compares the hot path to native add_turn
            versus = (f"{figures['p50_us'] / ref['p50_us']:.2f}x, "
                      f"{figures['p50_us'] - ref['p50_us']:+.1f} us")
            print(f"{facade:<10} {call:<16} {figures['p50_us']:>9.1f} {figures['p99_us']:>9.1f} "
                  f"{versus:>22}")
    per_round = [targets(r) for r in rounds]
    ratios = [h["ratio"] for h in hot]
    over = {call: [t["over_us"][call] for t in per_round] for call in per_round[0]["over_us"]}
    results["rounds"] = rounds
    results["hot_path_rounds"] = hot
    results["targets"] = {
        "asyncio_add_turn_nowait_p50_vs_native_add_turn_per_hot_round": ratios,
        "asyncio_add_turn_nowait_p50_vs_native_add_turn_median": statistics.median(ratios),
        "asyncio_awaited_p50_over_native_us_per_round": over,
        "met": statistics.median(ratios) <= 2.0
        and all(v < 150 for vs in over.values() for v in vs),
    }
    print("\nasyncio add_turn_nowait p50 / native add_turn p50 by hot-path round: "
          + ", ".join(f"{r:.2f}x" for r in ratios)
          + f" (min {min(ratios):.2f}, median {statistics.median(ratios):.2f}, max "
          f"{max(ratios):.2f}; target <= 2x)")
    print("awaited calls over native by round: "
          + "; ".join(f"{k} " + ", ".join(f"{v:+.0f}" for v in vs) + " us"
                      for k, vs in over.items()) + " (target < 150 us)")
    print("load average (1 min) at the start of each round: "
          + ", ".join(f"{x:.1f}" for x in loads))
    results["machine"] = {"python": sys.version.split()[0], "platform": platform.platform(),
                          "model": "minilm-l6-v2" if args.model else "HashEmbedder",
                          "load_average_per_round": loads}
    write_results(args.out, results, "bridges")


if __name__ == "__main__":
    main()
