"""Crash safety: what a durable receipt promised survives kill -9 of the process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import trio

from engine import Engine

from .conftest import raw_databases

REPO = Path(__file__).resolve().parents[1]
# Run as a module from the repository's root: as a script its folder, tests/, would come first
# on sys.path, and tests/actors/ would stand in for the real actors package.
CHILD = ["-m", "tests.ingest_child"]


def test_kill_9_keeps_every_durably_acknowledged_turn(store_path: Path) -> None:
    """After SIGKILL mid-ingest, every durable turn is there in order and the log has no gaps."""
    acked: list[tuple[int, str]] = []
    with subprocess.Popen(
        [sys.executable, *CHILD, str(store_path)], cwd=REPO, stdout=subprocess.PIPE, text=True
    ) as child:
        try:
            for line in child.stdout:
                seq, turn_id, kind = line.split()
                if kind == "durable":
                    acked.append((int(seq), turn_id))
                if len(acked) >= 300:
                    break
        finally:
            os.kill(child.pid, signal.SIGKILL)
    assert child.returncode == -signal.SIGKILL

    async def check() -> int:
        async with Engine.open(store_path) as mem:
            history = await mem.session_history("crash-user", "s1", limit=1_000_000)
            by_id = {t.turn_id: t for t in history}
            for seq, turn_id in acked:
                assert by_id[turn_id].seq == seq
            assert [t.seq for t in history] == list(range(len(history)))
            after = await mem.add_turn("crash-user", "s1", "user", "after the crash", durable=True)
            assert after.seq == len(history)
            return after.lsn

    last = trio.run(check)
    log_keys = [int.from_bytes(k, "big") for k, _ in raw_databases(store_path)["log"]]
    # The long-term layer may log an episode after the last turn, before the engine closed.
    assert log_keys == list(range(1, max(last, log_keys[-1]) + 1))
