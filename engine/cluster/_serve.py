"""``engram-trio node``: one cluster node, its engine, its leases and its HTTP API."""

from __future__ import annotations

import ipaddress
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import trio

from .._engine import Engine
from .._http_edge import KeysFirst, LocalOnly, is_loopback
from .._server import (
    LOOPBACK,
    Shutdown,
    create_app,
    hypercorn_config,
    load_api_keys,
    spare_descriptors,
)
from ._log import ClusterConfig, Log
from ._node import Node
from ._router import Router
from ._writes import ClusterEngine

__all__ = ["serve_node", "node_engine_options"]


def node_engine_options(store: Path, config: Any) -> dict[str, Any]:
    """How a node opens its store: without fsync (the log is the durable copy and the
    watermark makes recovery exact), and with the embedding backend the store's vectors came
    from (a store made with the test embedder keeps it)."""
    from actors.embedder import HashEmbedder
    from actors.store import stored_model

    overrides = dict(config or {})
    overrides.setdefault("fsync", False)
    options: dict[str, Any] = {"config": overrides}
    model = stored_model(store) if (store / "data.mdb").exists() else None
    if model is not None and model.id == HashEmbedder().model_id:
        options["embedder"] = HashEmbedder(dim=model.dim)
    return options


async def serve_node(store: str | Path, nats: Sequence[str], http: str, node_id: str, *,
                     api_keys: str | Path | None = None,
                     cluster_config: ClusterConfig | dict | None = None,
                     config: Any = None,
                     say: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
                     handle_signals: bool = True, advertise: str | None = None,
                     task_status: trio.TaskStatus[Node] = trio.TASK_STATUS_IGNORED) -> int | None:
    """Run a node until SIGINT / SIGTERM (or cancellation).

    Args:
        store: the node's own store directory.
        nats: the log servers' URLs.
        http: ``HOST:PORT`` to serve the API on.
        node_id: this node's stable id (a restart with the same id keeps its leases).
        api_keys: the api-keys file (every node of a cluster uses the same).
        cluster_config / config: the cluster's and the engine's overrides.
        advertise: the URL other nodes reach this one at (its heartbeat carries it for
            their forwards); default ``http://HOST:PORT`` of ``http``, which must then name
            one address (not 0.0.0.0 or ::, which another machine reaches as itself).

    Returns:
        The signal that stopped the node, or None.

    Raises:
        InvalidInput: bad flags; StoreInUse: another process serves the store;
        LogUnavailable: the log could not be reached.
    """
    from hypercorn.trio import serve as hypercorn_serve

    from ..errors import InvalidInput

    host, _, port = http.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]  # [::1]:8081
    if (not host or "[" in host or "]" in host or not (port.isascii() and port.isdigit())
            or not 0 < int(port) < 65536):
        raise InvalidInput("http", f"expected HOST:PORT with a port from 1 to 65535, found "
                                   f"{http!r}")
    keys = load_api_keys(api_keys) if api_keys is not None else None
    if keys is None and not is_loopback(host):
        say(f"warning: no --api-keys file, so no auth: binding to {LOOPBACK} instead of {host}")
        host = LOOPBACK
    url = _advertised(host, port, http, advertise)
    store = Path(store)
    hc = hypercorn_config(host, port)
    spare_descriptors()
    shutdown = Shutdown()  # also releases the node's leases before the engine closes
    try:
        async with Engine.open(store, **node_engine_options(store, config)) as engine:
            log = await Log.connect(nats, cluster_config, name=node_id)
            try:
                node = Node(engine, log, node_id, url)
                writer = ClusterEngine(engine, log, node)
                router = Router(create_app(writer, keys), node, log)
                # What the owner's Edge would refuse (no key, another user's path; without
                # keys, a caller from off this machine) is refused before the router reads a
                # body or forwards it.
                app = KeysFirst(router, keys) if keys is not None else LocalOnly(router)
                writer.routed = router.counts  # stats() shows what the router did, as /cluster/node
                async with trio.open_nursery() as nursery:
                    node_scope = trio.CancelScope()  # the node's leases and appliers

                    async def run_node(task_status: trio.TaskStatus[None]) -> None:
                        with node_scope:
                            await node.run(task_status=task_status)

                    await nursery.start(run_node)
                    binds = await nursery.start(
                        lambda task_status: hypercorn_serve(
                            app, hc, shutdown_trigger=shutdown.event.wait, task_status=task_status))
                    say(f"engram-trio node {node_id} serving {store} on {', '.join(binds)}, "
                        f"log at {', '.join(nats)}")
                    task_status.started(node)
                    if handle_signals:
                        shutdown.hold_signals()
                    await shutdown.event.wait()
                    node_scope.cancel()  # hands its leases back at once (the run's finally)
                    nursery.cancel_scope.deadline = trio.current_time() + hc.graceful_timeout + 1
            finally:
                with trio.CancelScope(shield=True):
                    await log.close()
    finally:
        shutdown.release_signals()
    return shutdown.signal


def _advertised(host: str, port: str, http: str, advertise: str | None) -> str:
    """The URL other nodes forward to (carried in this node's heartbeat).

    Raises:
        InvalidInput: ``http`` binds every interface and ``advertise`` is not given (another
            machine would reach 0.0.0.0 as itself), or ``advertise`` is not an http URL.
    """
    from ..errors import InvalidInput

    if advertise is None:
        try:
            wildcard = ipaddress.ip_address(host).is_unspecified
        except ValueError:
            wildcard = False
        if wildcard:
            raise InvalidInput("http", f"expected an address other nodes can reach, found "
                                       f"{http!r}, which binds every interface; give "
                                       "--advertise http://THIS-MACHINE:PORT as well")
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    try:
        url = httpx.URL(advertise)
    except (httpx.InvalidURL, TypeError):
        url = None
    if url is None or url.scheme not in ("http", "https") or not url.host:
        raise InvalidInput("advertise", f"expected http://HOST:PORT, the URL other nodes "
                                        f"reach this one at, found {advertise!r}")
    return advertise.rstrip("/")
