"""What a node reports about itself: per-partition figures (``Node.stats``) and their
Prometheus form, added to the node's ``/metrics``.

No user data: partition numbers, log sequences and counters only.
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

__all__ = ["PartitionStats", "NodeStats", "PartitionCounts", "render_metrics"]


class PartitionCounts:
    """A partition's running counters on this node (mutable; :class:`PartitionStats` is the
    frozen view). Kept after the partition leaves, so the counts of a process never go back."""

    __slots__ = ("lag", "gaps", "consumers", "batches", "entries", "replays",
                 "replay_seconds", "bootstraps", "bootstrap_seconds", "bootstrap_steps",
                 "snapshots_refused", "log_errors",
                 "snapshots", "snapshot_seconds", "snapshot_bytes", "snapshot_watermark",
                 "dropped")

    def __init__(self) -> None:
        self.lag: int | None = None  # entries after the watermark, as the last fetch said
        self.gaps = 0  # consumer-sequence jumps (lost deliveries), each re-read
        self.consumers = 0  # consumers made (one per ownership, plus one per re-read)
        self.batches = 0
        self.entries = 0  # entries applied (or skipped as already applied)
        self.replays = 0  # catch-ups finished: the log read to its end after an acquire
        self.replay_seconds: float | None = None  # the last catch-up's duration
        self.bootstraps = 0  # snapshots restored before replaying
        self.bootstrap_seconds: float | None = None  # the last restore's duration
        # ... and its steps': the snapshot's fetch, its decode, the write of its users
        self.bootstrap_steps: dict[str, float] | None = None
        # snapshots found and refused (damaged, not a snapshot, records an import refuses):
        # the whole log replayed instead
        self.snapshots_refused = 0
        self.log_errors = 0  # reads of the log that failed (retried from the watermark)
        self.snapshots = 0  # snapshots published to the object store
        self.snapshot_seconds: float | None = None  # the last one's taking and storing
        self.snapshot_bytes: int | None = None  # the last one's size
        self.snapshot_watermark = 0  # the newest snapshot's watermark known here
        self.dropped = 0  # copies deleted after the grace period


class PartitionStats(msgspec.Struct, frozen=True, kw_only=True):
    """One partition as this node sees it.

    Attributes:
        partition: its number.
        owned: this node holds its lease and confirmed it within the TTL (it serves it).
        watermark: the last log sequence applied to this node's store (None: never read).
        lag: entries of the partition in the log after the watermark, as the last fetch
            counted them (None: not applied here by this process).
        gaps / consumers / batches / entries / replays / bootstraps / snapshots_refused /
            log_errors / snapshots / dropped: counts since the process started (see
            :class:`PartitionCounts`).
        replay_seconds / bootstrap_seconds / snapshot_seconds: the last catch-up's,
            restore's and snapshot's durations; snapshot_bytes: the last snapshot's size.
        bootstrap_steps: the last restore's seconds by step (``fetch``: the snapshot from
            the object store, ``decode``: checked and decoded, ``write``: its users and the
            watermark written), where a slow hand-over spends its time.
        snapshot_watermark: the newest snapshot's watermark known here.
    """

    partition: int
    owned: bool
    watermark: int | None
    lag: int | None
    gaps: int = 0
    consumers: int = 0
    batches: int = 0
    entries: int = 0
    replays: int = 0
    replay_seconds: float | None = None
    bootstraps: int = 0
    bootstrap_seconds: float | None = None
    bootstrap_steps: dict[str, float] | None = None
    snapshots_refused: int = 0
    log_errors: int = 0
    snapshots: int = 0
    snapshot_seconds: float | None = None
    snapshot_bytes: int | None = None
    snapshot_watermark: int = 0
    dropped: int = 0


class NodeStats(msgspec.Struct, frozen=True, kw_only=True):
    """A node's figures (``Node.stats``).

    Attributes:
        node / incarnation: who and which process.
        owned: the partitions this node serves now.
        partitions: every partition this process has applied or owns, by number.
        leases: lease events (claimed, lost, reacquired, released, adopted, unsure).
        publish_retries: publishes sent again with the same id (lost PubAcks, elections).
        duplicates / invalid / undecodable: entries skipped as already applied, as failing
            the engine's checks, as unreadable (or filed under another partition than
            their user's).
        waited / waited_long: entries (calls, forgets) that waited for the long-term
            followers to take in the log before them, and of those the ones that waited
            10 s or more (a node whose followers lag far).
        forwarded / unavailable: requests the router sent to an owner, and answered 503.
        looked_up / reforwarded: leases the router read from the bucket because its view
            named no holder it could forward to (a move since the last tick, or this node
            unconfirmed), and requests it sent on to the holder the bucket named after the
            first one had handed the partition on.
        redirected: inspector pages about a user sent (307) to the owner of the user.
    """

    node: str
    incarnation: str
    owned: list[int]
    partitions: list[PartitionStats]
    leases: dict[str, int]
    publish_retries: int
    duplicates: int
    invalid: int
    undecodable: int
    waited: int = 0
    waited_long: int = 0
    forwarded: int = 0
    unavailable: int = 0
    looked_up: int = 0
    reforwarded: int = 0
    redirected: int = 0


class _Collector:
    """A node's figures as Prometheus families."""

    def __init__(self, stats: NodeStats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        per = [("owned", GaugeMetricFamily, "1 if this node serves the partition",
                lambda s: int(s.owned)),
               ("watermark", GaugeMetricFamily, "last log sequence applied here",
                lambda s: s.watermark),
               ("lag", GaugeMetricFamily, "entries in the log after the watermark",
                lambda s: s.lag),
               ("gaps", CounterMetricFamily, "lost deliveries detected and re-read",
                lambda s: s.gaps),
               ("consumers", CounterMetricFamily, "consumers made", lambda s: s.consumers),
               ("entries", CounterMetricFamily, "log entries applied", lambda s: s.entries),
               ("replays", CounterMetricFamily, "catch-ups to the end of the log",
                lambda s: s.replays),
               ("replay_seconds", GaugeMetricFamily, "the last catch-up's duration",
                lambda s: s.replay_seconds),
               ("bootstraps", CounterMetricFamily, "snapshots restored", lambda s: s.bootstraps),
               ("bootstrap_seconds", GaugeMetricFamily, "the last restore's duration",
                lambda s: s.bootstrap_seconds),
               ("snapshots_refused", CounterMetricFamily,
                "snapshots refused (damaged, unreadable): the log replayed instead",
                lambda s: s.snapshots_refused),
               ("log_errors", CounterMetricFamily, "failed reads of the log",
                lambda s: s.log_errors),
               ("snapshots", CounterMetricFamily, "snapshots published", lambda s: s.snapshots),
               ("snapshot_seconds", GaugeMetricFamily, "the last snapshot's duration",
                lambda s: s.snapshot_seconds),
               ("snapshot_bytes", GaugeMetricFamily, "the last snapshot's size",
                lambda s: s.snapshot_bytes),
               ("dropped", CounterMetricFamily, "copies deleted after the grace period",
                lambda s: s.dropped)]
        steps = GaugeMetricFamily("engram_cluster_partition_bootstrap_step_seconds",
                                  "the last restore's duration by step",
                                  labels=["partition", "step"])
        for s in stats.partitions:
            for step, seconds in (s.bootstrap_steps or {}).items():
                steps.add_metric([str(s.partition), step], seconds)
        yield steps
        for name, family, doc, value in per:
            metric = family(f"engram_cluster_partition_{name}", doc, labels=["partition"])
            for s in stats.partitions:
                got = value(s)
                if got is not None:
                    metric.add_metric([str(s.partition)], got)
            yield metric
        leases = CounterMetricFamily("engram_cluster_leases", "lease events",
                                     labels=["event"])
        for event, count in sorted(stats.leases.items()):
            leases.add_metric([event], count)
        yield leases
        yield GaugeMetricFamily("engram_cluster_owned_partitions", "partitions served here",
                                value=len(stats.owned))
        for name, doc in (("publish_retries", "publishes sent again with the same id"),
                          ("duplicates", "entries skipped as already applied"),
                          ("invalid", "entries skipped as failing the engine's checks"),
                          ("undecodable", "entries skipped as unreadable"),
                          ("waited", "entries that waited for the long-term followers"),
                          ("waited_long", "entries that waited 10 s or more for them"),
                          ("forwarded", "requests forwarded to a partition's owner"),
                          ("unavailable", "requests answered 503 (no owner, not caught up)"),
                          ("looked_up", "leases read from the bucket: no holder in the view"),
                          ("reforwarded", "requests sent on to a partition's new holder"),
                          ("redirected", "inspector pages sent to their user's owner")):
            yield CounterMetricFamily(f"engram_cluster_{name}", doc, value=getattr(stats, name))


def render_metrics(stats: NodeStats) -> bytes:
    """A node's figures in Prometheus text (appended to the app's ``/metrics``)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(stats))
    return generate_latest(registry)
