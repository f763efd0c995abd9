"""Cluster mode: Engram as N nodes over a replicated NATS JetStream log, partitioned by user.

A layer above the engine, like the HTTP server: it drives :class:`engine.Engine` through its
public API plus one entry point, :meth:`engine.Engine.apply_log_batch`. The single-process
engine never imports it. ``engram-trio node`` runs a node; ``engram-trio cluster init|status``
manages the log; :class:`ClusterClient` is a bot's thin client (writes to the log, reads from
the owners).
"""

from .._logbatch import LogForget, LogForgetScope, LogTurn, decode_entry, encode_entry
from ._bootstrap import PartitionSnapshot
from ._client import ClusterClient
from ._figures import NodeStats, PartitionStats
from ._leases import Leases, plan
from ._local import LocalNats, free_port
from ._log import CallLogged, ClusterConfig, Log, LogUnavailable
from ._loop import AsyncioThread
from ._node import Node
from ._partition import DEFAULT_PARTITIONS, partition_of, subject_of
from ._router import Router
from ._serve import serve_node
from ._writes import ClusterEngine, ClusterReceipt, LogWriter, NotInCluster

__all__ = [
    "DEFAULT_PARTITIONS",
    "AsyncioThread",
    "CallLogged",
    "ClusterClient",
    "ClusterConfig",
    "ClusterEngine",
    "ClusterReceipt",
    "Leases",
    "LocalNats",
    "Log",
    "LogForget",
    "LogForgetScope",
    "LogTurn",
    "LogUnavailable",
    "LogWriter",
    "Node",
    "NodeStats",
    "NotInCluster",
    "PartitionSnapshot",
    "PartitionStats",
    "Router",
    "decode_entry",
    "encode_entry",
    "free_port",
    "partition_of",
    "plan",
    "serve_node",
    "subject_of",
]
