"""The loopback NATS cluster the tests and benches start: its ports, and a start that fails."""

from __future__ import annotations

import socket

import pytest

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
