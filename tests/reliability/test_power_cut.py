"""A released durable receipt survives a power cut, simulated (bench/powercut.py): a child
process ingests with every write to the store's LMDB file journaled, is killed, and the store
is rebuilt as the disk could hold it after losing power at that moment: what an fsync
covered, and any subset of the pages written after the last one."""

from __future__ import annotations

import importlib
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, NoReturn

import pytest
import trio

from engine import Engine, EngineError

REPO = Path(__file__).resolve().parents[2]
importlib.import_module("bench.__main__")  # puts bench/ on sys.path
powercut = importlib.import_module("powercut")
CHILD = ["-m", "tests.ingest_child"]
ACKED = 200  # durable receipts the child reports before the kill...
LINGER = 0.05  # ...and the seconds it goes on after that, so commits are in flight at the kill
IMAGES = 3  # power-cut images made of each run's journal, each with its own lost pages
# The wait for the child's reports is bounded by its progress, not by the run's length: a
# machine at load 10 runs it several times slower and still checks it all. The child gets
# FIRST_REPORT seconds for its first line (an interpreter, the engine's imports, the store
# and its first flush), then STALLED seconds between lines, each a flush, before the test
# gives up on it. Silent from the start on a machine whose load average exceeds its CPUs,
# it is skipped as starved (nothing was checked); silent otherwise, or stalled later, it
# fails, saying so.
FIRST_REPORT = 90.0
STALLED = 60.0


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        return powercut.build(tmp_path_factory.mktemp("powercut"))
    except powercut.NoCompiler as exc:
        pytest.skip(str(exc))


def ingest_until_killed(library: Path, store: Path, journal: Path, *extra: str
                        ) -> list[tuple[int, str]]:
    """Run the ingest child with its writes journaled; SIGKILL it LINGER seconds after it
    has reported ACKED durable receipts, while it goes on writing. Returns every durable
    receipt it reported before the kill (seq, turn id)."""
    acked: list[tuple[int, str]] = []
    lines: queue.Queue[str | None] = queue.Queue()  # the child's lines; None once it ended
    with subprocess.Popen([sys.executable, *CHILD, str(store), *extra], cwd=REPO,
                          env=powercut.child_env(library, store, journal),
                          stdout=subprocess.PIPE, text=True) as child:
        # A thread reads the pipe, so the wait below has a deadline of its own and the child
        # never blocks on a full pipe; the kill does not wait on a line (LINGER is timed from
        # the report, not from a print).
        reader = threading.Thread(target=_pump, args=(child.stdout, lines), daemon=True)
        reader.start()
        try:
            reported = 0
            while len(acked) < ACKED:
                wait = STALLED if reported else FIRST_REPORT
                try:
                    line = lines.get(timeout=wait)
                except queue.Empty:
                    _no_progress(reported, len(acked), wait)
                if line is None:
                    child.wait()
                    pytest.fail(f"the ingest child ended (exit code {child.returncode}) "
                                f"after {len(acked)} of {ACKED} durable receipts; expected "
                                "it to ingest until killed (its stderr is above)")
                reported += 1
                read(line, acked)
            time.sleep(LINGER)
        finally:
            child.kill()  # SIGKILL, unless it already ended
            reader.join()  # the kill closes the pipe: the thread reads what is left, and ends
        while (line := lines.get_nowait()) is not None:  # what it reported before the kill
            read(line, acked)
    assert child.returncode == -signal.SIGKILL
    return acked


def _pump(stream: Any, lines: queue.Queue[str | None]) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def _no_progress(reported: int, durable: int, waited: float) -> NoReturn:
    """Skip (nothing reported, the machine starved) or fail (stalled) a child that printed
    nothing for ``waited`` seconds."""
    load, cpus = os.getloadavg()[0], os.cpu_count() or 1
    if not reported and load > cpus:
        pytest.skip(f"machine starved: the journaled ingest child reported nothing in "
                    f"{waited:.0f} s at load average {load:.1f} on {cpus} CPUs; nothing was "
                    "checked")
    pytest.fail(f"the journaled ingest child made no progress for {waited:.0f} s after "
                f"{reported} lines ({durable} of {ACKED} durable receipts), at load average "
                f"{load:.1f} on {cpus} CPUs; expected a line at each durable flush")


def read(line: str, acked: list[tuple[int, str]]) -> None:
    if line.endswith("\n"):  # a line the kill cut short reports nothing
        seq, turn_id, kind = line.split()
        if kind == "durable":
            acked.append((int(seq), turn_id))


async def missing_after_the_cut(cut: Path, acked: list[tuple[int, str]]) -> list[str]:
    """Open the cut store; the acknowledged turns it lacks (or that moved). Also checks that
    it numbers its turns without gaps and takes a durable write."""
    async with Engine.open(cut) as mem:
        history = await mem.session_history("crash-user", "s1", limit=1_000_000)
        seqs = {t.turn_id: t.seq for t in history}
        assert [t.seq for t in history] == list(range(len(history)))
        after = await mem.add_turn("crash-user", "s1", "user", "after the cut", durable=True)
        assert after.seq == len(history)
        await mem.recall("crash-user", "durable")
    return [turn_id for seq, turn_id in acked if seqs.get(turn_id) != seq]


# Bounded by the child's progress (FIRST_REPORT, STALLED), which a starved machine slows
# several times over: the suite's 120 s would cut a run that is still making progress.
@pytest.mark.timeout(600)
def test_every_released_durable_receipt_survives_a_power_cut(library: Path,
                                                               tmp_path: Path) -> None:
    store, journal = tmp_path / "store", tmp_path / "journal"
    acked = ingest_until_killed(library, store, journal, "--bulk")
    for seed in range(IMAGES):
        cut = tmp_path / f"cut-{seed}"
        counts = powercut.cut_store(store, cut, journal, random.Random(seed))
        print(f"image {seed}: {counts}")
        assert counts["synced_writes"] > 0
        assert trio.run(missing_after_the_cut, cut, acked) == []


@pytest.mark.timeout(90)
@pytest.mark.parametrize("script, first_report, expected", [
    ("time.sleep(60)", 1.0, "reported nothing|made no progress for 1 s after 0 lines"),
    ("print('0 t0 durable', flush=True); time.sleep(60)", 30.0,
     "made no progress for 1 s after 1 lines \\(1 of 200 durable receipts\\)"),
    ("print('0 t0 durable', flush=True)", 30.0, "ended \\(exit code 0\\) after 1 of 200"),
])
def test_a_silent_stalled_or_ended_child_is_reported_not_waited_on(
        library: Path, tmp_path: Path, monkeypatch, script: str, first_report: float,
        expected: str) -> None:
    """A child that reports nothing, stops reporting, or ends is told apart by the wait's
    own deadlines (skipped as starved only if silent from the start on a loaded machine).
    A child that prints gets 30 s for its first line: an interpreter starting on a loaded
    machine can take more than a second."""
    monkeypatch.setattr(sys.modules[__name__], "CHILD", ["-c", f"import time; {script}"])
    monkeypatch.setattr(sys.modules[__name__], "FIRST_REPORT", first_report)
    monkeypatch.setattr(sys.modules[__name__], "STALLED", 1.0)
    with pytest.raises((pytest.fail.Exception, pytest.skip.Exception), match=expected):
        ingest_until_killed(library, tmp_path / "store", tmp_path / "journal")


def test_the_simulation_finds_what_fsync_off_loses(library: Path, tmp_path: Path) -> None:
    """The same run with Config(fsync=False), whose receipts promise nothing past a process
    crash, on a store first written and closed with fsync on: the simulated power cut loses
    acknowledged turns or leaves a store the engine refuses. A simulation that found nothing
    here could not show the test above."""
    store, journal = tmp_path / "store", tmp_path / "journal"

    async def create() -> None:
        async with Engine.open(store) as mem:
            await mem.add_turn("crash-user", "before", "user", "written with fsync on",
                               durable=True)

    trio.run(create)
    base = (store / "data.mdb").read_bytes()
    acked = ingest_until_killed(library, store, journal, "--no-fsync", "--bulk")
    counts = powercut.cut_store(store, tmp_path / "cut", journal, random.Random(0), base)
    assert counts["synced_writes"] == 0 and counts["pieces_lost"] > 0
    try:
        missing = trio.run(missing_after_the_cut, tmp_path / "cut", acked)
    except (EngineError, AssertionError) as refused:
        print(f"the cut store: {refused!r}")
        return
    assert missing, "every acknowledged turn survived a cut that kept none of its fsyncs"
