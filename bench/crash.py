"""Crash benchmark: kill -9 at random moments during durable ingest, snapshot, compact,
reindex and forget, in real child processes; then check what survived.

    python bench/crash.py                  # 100 runs, ~10 minutes on 2 cores
    python bench/crash.py --runs 10        # a smoke run
    nice -n 10 python bench/crash.py --seed 7 --out bench/results/crash.json

Run i does phase ``PHASES[i % 5]`` in a child process (this script with ``--child``) on a store
of its own. The child prints each acknowledgement as it gets it: a turn whose durable receipt
resolved, a forget that returned, a snapshot that was written. Once the child says the phase is
under way, the parent waits a seeded random delay and sends SIGKILL. Then, in this process:

- the store opens (with the model its vectors come from, the long-term layer on) and ``flush``
  returns: everything logged is indexed and embedded again;
- every acknowledged turn is there (session_history), unless an acknowledged forget removed it;
- nothing an acknowledged forget removed is there (history, recall);
- every snapshot acknowledged as written restores, opens, and holds every turn acknowledged
  before it started.

Prints one row per phase (runs, acknowledged, found, lost, stores that opened) and writes JSON
(--out, default bench/results/crash.json). The seed is printed; the same seed gives the same
phases and kill delays (not the same kill points: the machine's timing moves them).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import random
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import trio

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1]))

from engine import Engine, HashEmbedder  # noqa: E402

sys.path.insert(0, str(HERE.parent))
import powercut  # noqa: E402

PHASES = ("ingest", "snapshot", "compact", "reindex", "forget")
POWER_CUT_PHASES = ("ingest", "snapshot", "forget")  # the store keeps one file throughout
MODELS = ("minilm-l6-v2", "minilm-l6-v2-q8")
KILL_AFTER = (0.05, 3.0)  # seconds after the phase is under way: the range the delay is drawn from
WARMUP_TURNS = 200  # durable turns written before a phase that needs a store to work on
CHILD_LIMIT = 120.0  # seconds a child may take to say it is under way before the run fails


# -- the child: does one phase until killed, printing acknowledgements ----------------------


def _say(*words: Any) -> None:
    print(*words, flush=True)


def _engine(path: Path):
    """The phases other than reindex embed with the deterministic HashEmbedder: what is
    tested is the store and its indexes, and the real model would make every check wait
    ~10 ms a turn for embeddings. Reindex runs the real models (and switches between them)."""
    return Engine.open(path, embedder=HashEmbedder())


async def _durable(mem: Engine, user: str, session: str, i: int) -> None:
    receipt = await mem.add_turn(user, session, "user" if i % 2 == 0 else "assistant",
                                 f"{user} {session} turn {i}: the weather, trains and dinner",
                                 durable=True)
    _say("turn", user, session, receipt.seq, receipt.turn_id)


async def _warm(mem: Engine, users: int) -> None:
    for i in range(WARMUP_TURNS):
        await _durable(mem, f"u{i % users}", "warm", i // users)


async def _ingest_forever(mem: Engine, user: str) -> None:
    i = 0
    while True:
        await _durable(mem, user, "live", i)
        i += 1


async def child_ingest(path: Path) -> None:
    async with _engine(path) as mem:
        _say("ready")
        async with trio.open_nursery() as nursery:
            for w in range(4):  # concurrent writers share group commits
                nursery.start_soon(_ingest_forever, mem, f"w{w}")


async def child_snapshot(path: Path, work: Path) -> None:
    async with _engine(path) as mem:
        await _warm(mem, 4)
        _say("ready")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_ingest_forever, mem, "w0")
            for k in range(1_000_000):
                dest = work / f"snap{k}"
                _say("snapshot-start", dest)
                manifest = await mem.snapshot(dest)
                _say("snapshot-done", dest, manifest.lsn)


async def child_compact(path: Path) -> None:
    for round_ in range(1_000_000):
        async with _engine(path) as mem:
            for i in range(50):
                await _durable(mem, f"u{round_ % 4}", f"r{round_}", i)
            if round_ % 2:
                user, session = f"u{(round_ - 1) % 4}", f"r{round_ - 1}"
                _say("forgetting", user, session)
                await mem.forget_session(user, session)
                _say("forgot")
        if round_ == 0:
            _say("ready")
        await Engine.compact(path)


async def _warm_with_model(path: Path) -> None:
    async with Engine.open(path, config={"model": MODELS[0]}) as mem:
        await _warm(mem, 4)
        await mem.flush()


def child_reindex(path: Path) -> None:
    """`python -m engine reindex` over and over, switching models, run in this process (so
    the kill lands inside it): the public command, as a user runs it."""
    trio.run(_warm_with_model, path)
    _say("ready")
    for k in range(1, 1_000_000):
        argv, sys.argv = sys.argv, ["engram-trio", "reindex", str(path), "--model",
                                    MODELS[k % 2], "--json"]
        try:
            # Its JSON goes to a buffer: the parent reads this stdout for acknowledgements.
            with contextlib.redirect_stdout(io.StringIO()):
                runpy.run_module("engine", run_name="__main__", alter_sys=True)
        except SystemExit as done:
            if done.code not in (0, None):
                raise SystemExit(f"engram-trio reindex exited {done.code}") from None
        finally:
            sys.argv = argv
        _say("reindexed", MODELS[k % 2])


async def child_forget(path: Path) -> None:
    async with _engine(path) as mem:
        await _warm(mem, 8)
        await mem.store_note("u1", "u1 keeps a note about the marathon")
        _say("ready")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_ingest_forever, mem, "w0")
            for k in range(1_000_000):
                user = f"u{k % 8}"
                for i in range(5):
                    await _durable(mem, user, f"f{k}", i)
                if k % 3 == 2:
                    _say("forgetting", user)
                    await mem.forget_user(user)
                else:
                    _say("forgetting", user, f"f{k}")
                    await mem.forget_session(user, f"f{k}")
                _say("forgot")
                await mem.flush()


def child_main(phase: str, path: Path, work: Path) -> None:
    if phase == "reindex":
        child_reindex(path)
        return
    runners = {"ingest": lambda: child_ingest(path), "snapshot": lambda: child_snapshot(path, work),
               "compact": lambda: child_compact(path), "forget": lambda: child_forget(path)}
    trio.run(runners[phase])


# -- the parent -------------------------------------------------------------------------------


def _open(path: Path, phase: str):
    """Open a store with the model its vectors come from: the HashEmbedder of every phase but
    reindex; after a reindex, whichever model it had switched to, which ``Engine.open`` finds
    by itself when no model is configured."""
    if phase == "reindex":
        return Engine.open(path)
    return Engine.open(path, embedder=HashEmbedder())


class Acks:
    """What the child acknowledged, in the order it said so."""

    def __init__(self) -> None:
        self.turns: list[tuple[str, str, int, str]] = []
        # (user, session or None for the whole user, turns acknowledged when it was asked,
        # whether it returned)
        self.forgets: list[list[Any]] = []
        self.snapshots: list[tuple[Path, int, int]] = []  # (dir, lsn, turns acked before it)
        self.started: dict[str, int] = {}  # snapshot dir -> turns acked when it started
        self.ready = threading.Event()  # set when the child says its phase is under way
        self.events = 0

    def feed(self, line: str) -> None:
        words = line.split()
        if not words or not line.endswith("\n"):
            return  # a line the kill cut short acknowledges nothing
        kind = words[0]
        if kind == "turn":
            self.turns.append((words[1], words[2], int(words[3]), words[4]))
        elif kind == "ready":
            self.ready.set()
        elif kind == "forgetting":
            self.forgets.append([words[1], words[2] if len(words) > 2 else None,
                                 len(self.turns), False])
        elif kind == "forgot":
            self.forgets[-1][3] = True
        elif kind == "snapshot-start":
            self.started[words[1]] = len(self.turns)
        elif kind == "snapshot-done":
            self.snapshots.append((Path(words[1]), int(words[2]), self.started[words[1]]))
        self.events += 1

    def fate(self, index: int) -> str:
        """``kept`` (must be there), ``gone`` (an acknowledged forget removed it) or
        ``either`` (a forget asked for and cut short by the kill may have)."""
        user, session = self.turns[index][:2]
        fate = "kept"
        for who, which, asked_at, returned in self.forgets:
            if who == user and which in (None, session) and asked_at > index:
                if returned:
                    return "gone"
                fate = "either"
        return fate


async def _check_store(path: Path, acks: Acks, upto: int, phase: str) -> dict[str, int]:
    """Open the store ``phase`` left; count the first ``upto`` acknowledged turns found and
    lost, and the forgotten ones still there."""
    found = lost = residue = 0
    async with _open(path, phase) as mem:
        with trio.fail_after(300):
            await mem.flush()
        histories: dict[tuple[str, str], set[str]] = {}
        for index in range(upto):
            user, session, _, turn_id = acks.turns[index]
            if (user, session) not in histories:
                history = await mem.session_history(user, session, limit=1_000_000)
                histories[(user, session)] = {t.turn_id for t in history}
            there = turn_id in histories[(user, session)]
            fate = acks.fate(index)
            if fate == "kept":
                found += there
                lost += not there
            elif fate == "gone":
                residue += there
        await mem.recall("w0", "weather and trains")  # every search still answers
    return {"found": found, "lost": lost, "forgotten_left": residue}


SNAPSHOTS_CHECKED = 2  # the latest snapshots written before the kill that are restored


async def _check_snapshots(acks: Acks, work: Path) -> dict[str, int]:
    restored = bad = 0
    for snap, _, acked_before in acks.snapshots[-SNAPSHOTS_CHECKED:]:
        target = work / f"restored-{snap.name}"
        await Engine.restore(snap, target)
        result = await _check_store(target, acks, acked_before, "snapshot")
        restored += 1
        bad += result["lost"] > 0
    return {"snapshots_restored": restored, "snapshots_missing_turns": bad}


def one_run(phase: str, delay: float, work: Path, power_cut: Path | None = None,
            seed: int = 0) -> dict[str, Any]:
    """One child killed after ``delay``; with ``power_cut`` (the built preload library) the
    store checked is the one a power cut at the kill could leave (bench/powercut.py)."""
    store = work / "store"
    journal = work / "journal"
    acks = Acks()
    child = subprocess.Popen(
        [sys.executable, str(HERE), "--child", phase, str(store), str(work)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
        env=None if power_cut is None else powercut.child_env(power_cut, store, journal))
    errors: list[str] = []

    def read_stdout() -> None:
        for line in child.stdout:
            acks.feed(line)

    def read_stderr() -> None:
        errors.extend(child.stderr)

    readers = [threading.Thread(target=read_stdout, daemon=True),
               threading.Thread(target=read_stderr, daemon=True)]
    for reader in readers:
        reader.start()
    started = acks.ready.wait(CHILD_LIMIT)
    time.sleep(delay)
    killed_alive = child.poll() is None
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    for reader in readers:
        reader.join()
    result: dict[str, Any] = {"phase": phase, "delay_s": round(delay, 3),
                              "killed_while_running": killed_alive and started,
                              "acknowledged": sum(acks.fate(i) == "kept"
                                                  for i in range(len(acks.turns))),
                              "events": acks.events, "opened": False}
    if not killed_alive or not started:
        result["child_error"] = "".join(errors[-20:])
    if power_cut is not None:
        cut = work / "cut"
        result["power_cut"] = powercut.cut_store(store, cut, journal, random.Random(seed))
        store = cut
    try:
        result |= trio.run(_check_store, store, acks, len(acks.turns), phase)
        result["opened"] = True
        if acks.snapshots:
            result |= trio.run(_check_snapshots, acks, work)
    except Exception as exc:  # a store that does not open is the failure this bench counts
        result["open_error"] = f"{type(exc).__name__}: {exc}"
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--phases", default=",".join(PHASES),
                        help="comma-separated subset of " + ", ".join(PHASES))
    parser.add_argument("--power-cut", action="store_true",
                        help="check the store a power cut at the kill could leave (bench/"
                             "powercut.py; phases " + ", ".join(POWER_CUT_PHASES) + ")")
    parser.add_argument("--out", default=None,
                        help="default bench/results/crash.json (crash-power-cut.json)")
    parser.add_argument("--child", nargs=3, metavar=("PHASE", "STORE", "WORK"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_main(args.child[0], Path(args.child[1]), Path(args.child[2]))
        return
    from _report import write_results

    phases = [p for p in args.phases.split(",") if p]
    library = None
    if args.power_cut:
        if set(phases) - set(POWER_CUT_PHASES):
            parser.error(f"--power-cut takes phases {', '.join(POWER_CUT_PHASES)}; compact and "
                         "reindex replace the store's file, which the journal does not follow")
        try:
            library = powercut.build(Path(tempfile.mkdtemp(prefix="engram-powercut-")))
        except powercut.NoCompiler as exc:
            parser.error(str(exc))
    out = args.out or str(HERE.parent / "results"
                          / ("crash-power-cut.json" if args.power_cut else "crash.json"))
    rng = random.Random(args.seed)
    cut = " and a power cut" if args.power_cut else ""
    print(f"crash bench: {args.runs} runs over {', '.join(phases)}{cut}, seed {args.seed}")
    runs = []
    start = time.perf_counter()
    for i in range(args.runs):
        phase = phases[i % len(phases)]
        delay = rng.uniform(*KILL_AFTER)
        work = Path(tempfile.mkdtemp(prefix=f"engram-crash-{i}-"))
        try:
            result = one_run(phase, delay, work, library, args.seed * 1_000 + i)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        runs.append(result)
        cut = result.get("power_cut")
        lost_pages = (f", {cut['pages_written_later']} pages written after the last sync, "
                      f"{cut['pieces_lost']} of their {cut['pieces_lost'] + cut['pieces_kept']} "
                      "writes lost" if cut else "")
        print(f"  run {i + 1:>3}/{args.runs} {phase:<8} kill after {delay:5.2f} s: "
              f"{result['acknowledged']:>6} acknowledged, {result.get('lost', '?')} lost"
              f"{lost_pages}, "
              f"{'opened' if result['opened'] else 'DID NOT OPEN: ' + result['open_error']}",
              flush=True)
    summary = {}
    for phase in phases:
        mine = [r for r in runs if r["phase"] == phase]
        summary[phase] = {
            "runs": len(mine),
            "killed_while_running": sum(r["killed_while_running"] for r in mine),
            "acknowledged": sum(r["acknowledged"] for r in mine),
            "found": sum(r.get("found", 0) for r in mine),
            "lost": sum(r.get("lost", 0) for r in mine),
            "forgotten_left": sum(r.get("forgotten_left", 0) for r in mine),
            "opened": sum(r["opened"] for r in mine),
            "snapshots_restored": sum(r.get("snapshots_restored", 0) for r in mine),
            "snapshots_missing_turns": sum(r.get("snapshots_missing_turns", 0) for r in mine),
        }
        if args.power_cut:
            summary[phase]["unsynced_writes_lost"] = sum(r["power_cut"]["pieces_lost"]
                                                         for r in mine)
            summary[phase]["cut_mid_flight"] = sum(r["power_cut"]["writes"]
                                                   > r["power_cut"]["synced_writes"]
                                                   for r in mine)
    print(f"\n{'phase':<9} {'runs':>5} {'killed':>7} {'acknowledged':>13} {'found':>9} "
          f"{'lost':>5} {'forgotten left':>15} {'opened':>7} {'snapshots ok':>13}")
    for phase, s in summary.items():
        print(f"{phase:<9} {s['runs']:>5} {s['killed_while_running']:>7} {s['acknowledged']:>13,} "
              f"{s['found']:>9,} {s['lost']:>5} {s['forgotten_left']:>15} {s['opened']:>7} "
              f"{s['snapshots_restored'] - s['snapshots_missing_turns']:>6}/"
              f"{s['snapshots_restored']:<6}")
    if args.power_cut:
        for phase, s in summary.items():
            print(f"{phase}: {s['cut_mid_flight']} of {s['runs']} cuts landed with writes not "
                  f"yet synced; {s['unsynced_writes_lost']:,} such writes lost in all")
    print(f"{time.perf_counter() - start:.0f} s")
    write_results(out, {"seed": args.seed, "runs": args.runs, "power_cut": args.power_cut,
                        "summary": summary, "each": runs}, "crash")


if __name__ == "__main__":
    main()
