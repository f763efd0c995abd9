"""A released durable receipt survives a power cut, simulated (bench/powercut.py): a child
process ingests with every write to the store's LMDB file journaled, is killed, and the store
is rebuilt as the disk could hold it after losing power at that moment: what an fsync
covered, and any subset of the pages written after the last one."""

from __future__ import annotations

import importlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

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
    with subprocess.Popen([sys.executable, *CHILD, str(store), *extra], cwd=REPO,
                          env=powercut.child_env(library, store, journal),
                          stdout=subprocess.PIPE, text=True) as child:
        try:
            for line in child.stdout:
                read(line, acked)
                if len(acked) >= ACKED:
                    break
            # Not reading meanwhile: a kill right after a line the child printed would land
            # right after a flush (a receipt resolves after its flush), never between one.
            time.sleep(LINGER)
        finally:
            os.kill(child.pid, signal.SIGKILL)
        for line in child.stdout:  # what it reported before the kill
            read(line, acked)
    assert child.returncode == -signal.SIGKILL
    return acked


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
