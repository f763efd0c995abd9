"""The loopback NATS cluster the tests and benches start: its ports, and a start that fails."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import trio

from engine.cluster._local import LocalNats, _ephemeral_floor, free_port
from engine.errors import EngineError

pytestmark = pytest.mark.timeout(120)


def test_free_ports_are_below_the_range_outgoing_connections_take() -> None:
    """A chosen port is bindable, not one already chosen, and below the kernel's ephemeral
    range, where an outgoing connection could take it before the server binds."""
    taken: set[int] = set()
    for _ in range(20):
        port = free_port(taken)
        assert port not in taken and port < _ephemeral_floor()
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
        taken.add(port)


def test_a_server_that_cannot_listen_leaves_none_of_the_others_running(tmp_path) -> None:
    """One server's port is taken: the start fails, saying which server, and the servers it
    had started are stopped rather than left running."""
    cluster = LocalNats(tmp_path, 3)
    with socket.socket() as squatter:  # bound, not listening: as an outgoing connection's port
        squatter.bind(("127.0.0.1", cluster.ports[2]))
        try:
            with pytest.raises(EngineError, match=r"nats-server n3 exited with 1"):
                cluster.start()
        finally:
            started = dict(cluster.procs)
            cluster.stop()
    assert started == {}
    assert not (tmp_path / "servers.pid").exists()


def test_where_the_ephemeral_range_starts_low_the_kernel_chooses(monkeypatch) -> None:
    """An ephemeral range reaching below PORT_FLOOR leaves no room of its own: the port is
    the kernel's choice, still bindable and not one already chosen."""
    import engine.cluster._local as local

    monkeypatch.setattr(local, "_ephemeral_floor", lambda: 1024)
    taken: set[int] = set()
    for _ in range(5):
        port = free_port(taken)
        assert port not in taken and port > 0
        taken.add(port)


async def test_a_trio_caller_starts_and_stops_the_servers_without_holding_its_loop(
        tmp_path) -> None:
    """``async with LocalNats(...)`` waits for each port and reaps each process on a worker
    thread: a task of the caller's loop keeps running meanwhile (the synchronous start polls
    the ports with blocking sleeps), and the servers answer inside the block, none after."""
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await trio.sleep(0.001)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        await trio.sleep(0)
        before = ticks
        async with LocalNats(tmp_path, 1) as cluster:
            started = ticks
            socket.create_connection(("127.0.0.1", cluster.ports[0]), 2).close()
            procs = list(cluster.procs.values())
        nursery.cancel_scope.cancel()
    assert started > before
    assert all(proc.poll() is not None for proc in procs) and cluster.procs == {}


def test_what_a_dead_session_left_running_is_killed_and_a_live_ones_kept(tmp_path) -> None:
    """Servers and nodes of a session whose pytest died are killed at the next session's
    start; those of a session still running, and processes that are neither, are left."""
    from .conftest import NODES, OWNER, reap_earlier_runs

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pytest that is gone
    sessions = {"dead": dead.pid, "alive": os.getpid()}
    procs: dict[tuple[str, str], subprocess.Popen] = {}
    for session, owner in sessions.items():
        base = tmp_path / f"pytest-{session}" / "nats"
        base.mkdir(parents=True)
        (base / OWNER).write_text(str(owner))
        for kind, args in (("server", ["nats-server", str(base)]),
                           ("node", ["engine", "node", "--store", str(base.parent / "s")]),
                           ("other", ["unrelated", str(base)])):
            # A process whose command line reads like one of the fixture's children.
            proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                                     *args])
            procs[session, kind] = proc
            name = {"server": "servers.pid", "node": NODES, "other": "servers.pid"}[kind]
            with open(base / name, "a") as pids:
                pids.write(f"{proc.pid}\n")
    try:
        mine = tmp_path / "pytest-mine" / "nats"
        killed = reap_earlier_runs(tmp_path, mine)
        assert sorted(killed) == sorted([procs["dead", "server"].pid, procs["dead", "node"].pid])
        for (session, kind), proc in procs.items():
            gone = session == "dead" and kind != "other"
            assert (proc.wait(10) if gone else proc.poll()) == (-9 if gone else None)
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
