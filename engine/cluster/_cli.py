"""The cluster's commands: ``node`` (run a node) and ``cluster init|status``."""

from __future__ import annotations

import argparse
import json
import signal
from datetime import datetime, timezone
from typing import Any

import httpx
import msgspec
import trio

__all__ = ["add_commands", "run", "status"]


class _Marks(msgspec.Struct):
    """What ``cluster status`` reads of a node's ``/cluster/node``."""

    watermarks: dict[int, int]


def _json_arg(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object, found {text!r}: {exc}")
    except RecursionError:
        raise argparse.ArgumentTypeError("expected a JSON object, found one nested deeper "
                                         "than the parser descends") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, found {text!r}")
    return value


def _servers(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


def add_commands(command: Any) -> None:
    """Add ``node`` and ``cluster`` to the CLI's parser (``command`` makes a sub-parser)."""
    node = command("node", "run a cluster node: apply owned partitions, serve the HTTP API "
                           "for every user", False)
    node.add_argument("--store", required=True, help="this node's own store directory")
    node.add_argument("--nats", required=True, type=_servers,
                      help="the log's servers, nats://HOST:PORT[,...]")
    node.add_argument("--http", required=True, help="HOST:PORT to serve the API on")
    node.add_argument("--node-id", required=True, help="this node's stable id")
    node.add_argument("--advertise", metavar="URL",
                      help="the URL other nodes reach this one at (default: http://HOST:PORT "
                           "of --http; required when --http binds 0.0.0.0 or ::)")
    node.add_argument("--api-keys", metavar="FILE", help="as for serve; the same on every node")
    node.add_argument("--cluster-config", type=_json_arg, default=None, metavar="JSON",
                      help="cluster overrides, e.g. '{\"lease_ttl\": 5}' (the same on every "
                           "node)")
    node.add_argument("--config", type=_json_arg, default=None, metavar="JSON",
                      help="engine overrides for this node's store")
    cluster = command("cluster", "create the log's stream and buckets, or show who owns what")
    cluster.add_argument("action", choices=["init", "status"])
    cluster.add_argument("--nats", required=True, type=_servers,
                         help="the log's servers, nats://HOST:PORT[,...]")
    cluster.add_argument("--cluster-config", type=_json_arg, default=None, metavar="JSON",
                         help="cluster overrides (init creates the stream with them)")


def run(args: argparse.Namespace) -> tuple[int, Any]:
    """Run ``node`` or ``cluster``; return (exit code, result to print or None)."""
    if args.command == "node":
        import logging

        from ._serve import serve_node

        # Lease moves, gaps and retries go to stderr: an operator's log of the node.
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s "
                                                       "%(message)s")
        logging.getLogger("nats").setLevel(logging.WARNING)
        signum = trio.run(lambda: serve_node(args.store, args.nats, args.http, args.node_id,
                                             api_keys=args.api_keys,
                                             cluster_config=args.cluster_config,
                                             config=args.config,
                                             advertise=args.advertise))
        return (130 if signum == signal.SIGINT else 0), None
    if args.action == "init":
        return 0, trio.run(_init, args.nats, args.cluster_config)
    return 0, trio.run(status, args.nats, args.cluster_config)


async def _init(servers: list[str], overrides: dict | None) -> dict[str, Any]:
    from ._log import Log

    log = await Log.connect(servers, overrides, name="engram-cli")
    try:
        return {"stream": log.config.stream, "bucket": log.config.bucket,
                "objects": log.config.objects, "partitions": log.config.partitions,
                "replicas": log.config.replicas}
    finally:
        await log.close()


async def status(servers: list[str], overrides: dict | None = None) -> dict[str, Any]:
    """Partition -> owner, watermark, lag (stream last seq - watermark) and lease age.

    Raises:
        LogUnavailable: the log could not be reached, or holds no cluster (no `cluster
            init` yet, or other names in the overrides).
    """
    from ._leases import LEASE_PREFIX, NODE_PREFIX, Beat, LeaseValue
    from ._log import Log

    log = await Log.connect(servers, overrides, name="engram-cli", create=False)
    try:
        entries = await log.kv_entries()
        last = await log.last_seq()
    finally:
        await log.close()
    now = datetime.now(timezone.utc)
    nodes: dict[str, Beat] = {}
    leases: dict[int, tuple[LeaseValue, Any]] = {}
    for key, (value, _, created) in entries.items():
        # A key a node did not write (an operator's) is passed over, as the nodes do.
        try:
            if key.startswith(NODE_PREFIX):
                beat = msgspec.json.decode(value, type=Beat)
                nodes[beat.node] = beat
            elif key.startswith(LEASE_PREFIX):
                leases[int(key[len(LEASE_PREFIX):])] = (
                    msgspec.json.decode(value, type=LeaseValue), created)
        except (msgspec.DecodeError, ValueError):
            continue
    marks: dict[str, dict[int, int]] = {}
    async with httpx.AsyncClient(timeout=5) as client:
        for beat in nodes.values():
            # Whatever answers at a node's address (after a restart elsewhere, anything may):
            # a node's own answer, or no watermarks.
            try:
                answer = await client.get(beat.http.rstrip("/") + "/cluster/node")
                marks[beat.node] = msgspec.json.decode(answer.content, type=_Marks).watermarks
            except (httpx.HTTPError, msgspec.DecodeError):
                marks[beat.node] = {}
    partitions = []
    for p in range(log.config.partitions):
        lease = leases.get(p)
        owner = lease[0].node if lease else None
        mark = marks.get(owner, {}).get(p) if owner else None
        age = (now - lease[1]).total_seconds() if lease and lease[1] is not None else None
        partitions.append({"partition": p, "owner": owner, "watermark": mark,
                           "lag": None if mark is None else max(0, last - mark),
                           "lease_age_seconds": None if age is None else round(age, 3)})
    return {"stream_last_seq": last, "nodes": {n: b.http for n, b in sorted(nodes.items())},
            "partitions": partitions}
