"""A cluster node: the partitions it holds (leases), each applied from the log into the
node's engine with :meth:`Engine.apply_log_batch`, in order, exactly once (the watermark
commits with what it covers); replays, bootstraps from partition snapshots, and the node's
figures. Writes reach the log through :class:`~engine.cluster._writes.ClusterEngine`; the
HTTP requests of users it does not own go to their owner through
:class:`~engine.cluster._router.Router`.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import msgspec
import trio

from .._engine import Engine
from .._logbatch import LogEntry, decode_entry
from ..errors import InvalidInput
from ._bootstrap import Framed, drop_local, opened, restore, settle, unframed
from ._bootstrap import pack as pack_snapshot
from ._bootstrap import read as read_snapshot
from ._figures import NodeStats, PartitionCounts, PartitionStats
from ._leases import Leases
from ._log import TRANSIENT, Log, LogUnavailable
from ._partition import partition_of

__all__ = ["Node"]

log = logging.getLogger("engine.cluster")
T = TypeVar("T")

FETCH_SECONDS = 1.0  # a pull waits this long for entries before asking again
RETRY_SECONDS = 0.5  # pause before a partition's reader asks a failing log again
# Pause before a partition whose snapshot was refused, and whose log no longer holds its
# first entries, asks for a snapshot again (one an operator stored, or none: see _bootstrap).
UNRESTORABLE_RETRY_SECONDS = 30.0
RESULTS_KEPT = 4096  # applied calls' results kept for their publishers (popped on answer)


class Node:
    """The partitions this node applies, their watermarks, and the waiters on them.

    Args:
        engine: the node's open engine (its store holds the partitions it applies).
        log: the cluster's log.
        node_id: this node's stable id.
        http: this node's HTTP base URL (published in its heartbeat).
    """

    def __init__(self, engine: Engine, log: Log, node_id: str, http: str) -> None:
        self.engine = engine
        self.log = log
        self.config = log.config
        self.node_id = node_id
        self.incarnation = f"{os.getpid()}-{time.time_ns():x}"
        self.leases = Leases(log, node_id, self.incarnation, http, self._acquired, self._lost)
        self.marks: dict[int, int] = {}
        # What applied LogCalls returned, by log sequence, for the caller that published them.
        self.results: OrderedDict[int, Any] = OrderedDict()
        self._scopes: dict[int, trio.CancelScope] = {}
        self._changed: dict[int, trio.Event] = {}  # set whenever a partition's watermark moves
        self._nursery: trio.Nursery | None = None
        self.counts = {"gaps": 0, "consumers": 0, "batches": 0, "entries": 0,
                       "undecodable": 0, "replays": 0, "log_errors": 0}
        self.replay_seconds: list[float] = []
        self.partitions: dict[int, PartitionCounts] = {}  # every partition applied here
        # Held while a partition's copy changes (a batch applied, a restore, a deletion) or
        # is exported for a snapshot: a snapshot is the memory at exactly its watermark.
        self._guards: dict[int, trio.Lock] = {}
        self._lost_at: dict[int, float] = {}  # trio time each partition last left this node

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Hold leases and apply owned partitions until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await nursery.start(self.leases.run)
            nursery.start_soon(self._snapshots)
            nursery.start_soon(self._retire_unowned)
            task_status.started()

    # -- ownership ---------------------------------------------------------------------------

    async def _acquired(self, p: int) -> None:
        if p in self._scopes or self._nursery is None:
            return
        scope = self._scopes[p] = trio.CancelScope()
        self._nursery.start_soon(self._apply_loop, p, scope)

    async def _lost(self, p: int) -> None:
        scope = self._scopes.pop(p, None)
        if scope is not None:
            scope.cancel()
            self._lost_at[p] = trio.current_time()
            if self._nursery is not None:
                self._nursery.start_soon(self._retire, p)

    async def _retire(self, p: int) -> None:
        """Delete the copy of a partition this node no longer owns, once it has been gone
        for the grace period (unless it came back meanwhile)."""
        await trio.sleep(self.config.grace)
        async with self._guard(p):
            lost = self._lost_at.get(p)
            if (p in self._scopes or lost is None
                    or trio.current_time() - lost < self.config.grace):
                return  # back here, or lost again later: that loss's own task decides
            users = await drop_local(self.engine, p, self.config.partitions)
            self.marks.pop(p, None)
            self._counts(p).dropped += 1
            log.info("partition %d: copy deleted after the grace period (%d users)", p, users)

    async def _retire_unowned(self) -> None:
        """Copies this store holds of partitions that moved away while the node was down
        go the way of any partition lost: deleted after the grace period."""
        now = trio.current_time()
        for p in range(self.config.partitions):
            if p not in self._scopes and await self.engine.apply_log_batch(p, []) > 0:
                self._lost_at.setdefault(p, now)
                self._nursery.start_soon(self._retire, p)

    def _guard(self, p: int) -> trio.Lock:
        guard = self._guards.get(p)
        if guard is None:
            guard = self._guards[p] = trio.Lock()
        return guard

    def owns(self, p: int) -> bool:
        return self.leases.serving(p)

    # -- applying ----------------------------------------------------------------------------

    def _counts(self, p: int) -> PartitionCounts:
        counts = self.partitions.get(p)
        if counts is None:
            counts = self.partitions[p] = PartitionCounts()
        return counts

    async def _apply_loop(self, p: int, scope: trio.CancelScope) -> None:
        counts = self._counts(p)
        with scope:
            async with self._guard(p):
                mark = await self.engine.apply_log_batch(p, [])
                if mark > 0 and await self._outlived(p, mark, counts):
                    mark = 0  # the bootstrap drops the copy before it restores
                if mark == 0:
                    mark = await self._bootstrap(p, counts)
            self._moved(p, mark)
            started = time.monotonic()
            caught_up = False
            while True:
                self.counts["consumers"] += 1
                counts.consumers += 1
                name = f"{self.node_id}-{self.incarnation}-p{p}-{self.counts['consumers']}"
                try:
                    sub = await self.log.subscribe(p, mark + 1, _consumer_name(name))
                except (*TRANSIENT, LogUnavailable) as exc:
                    self.counts["log_errors"] += 1
                    counts.log_errors += 1
                    log.info("partition %d: no consumer now (%r); trying again", p, exc)
                    await trio.sleep(RETRY_SECONDS)
                    continue
                try:
                    mark, caught_up = await self._consume(p, sub, mark, started, caught_up)
                except (*TRANSIENT, LogUnavailable) as exc:
                    # The log failed mid-read: a fresh consumer from the watermark (the
                    # position is ours, so nothing is skipped or applied twice).
                    self.counts["log_errors"] += 1
                    counts.log_errors += 1
                    log.info("partition %d: reading failed (%r); re-reading from %d", p, exc,
                             self.marks.get(p, mark) + 1)
                    mark = self.marks.get(p, mark)
                    await trio.sleep(RETRY_SECONDS)
                finally:
                    with trio.CancelScope(shield=True) as drop:
                        drop.deadline = trio.current_time() + 2
                        await _quietly(self.log.drop(sub))

    async def _consume(self, p: int, sub: Any, mark: int, started: float, caught_up: bool
                       ) -> tuple[int, bool]:
        """Apply what ``sub`` delivers until a consumer-sequence gap; return the watermark."""
        expected = 1
        counts = self._counts(p)
        while True:
            deliveries = await self.log.fetch(sub, self.config.fetch_batch, FETCH_SECONDS)
            if deliveries:
                counts.lag = deliveries[-1].pending
            elif counts.lag is None:
                counts.lag = 0  # nothing after the watermark
            if not deliveries and not caught_up:
                caught_up = True
                self.counts["replays"] += 1
                counts.replays += 1
                counts.replay_seconds = time.monotonic() - started
                self.replay_seconds.append(counts.replay_seconds)
            entries: list[tuple[int, LogEntry]] = []
            for d in deliveries:
                if d.consumer_seq != expected:
                    # A delivery was lost between the server and us: never skip forward.
                    self.counts["gaps"] += 1
                    counts.gaps += 1
                    log.warning("partition %d: consumer sequence %d after %d; re-reading "
                                "from %d", p, d.consumer_seq, expected - 1, mark + 1)
                    if entries:
                        mark = await self._apply(p, entries)
                    return mark, caught_up
                expected += 1
                try:
                    entry = decode_entry(d.data)
                    home = partition_of(entry.user_id, self.config.partitions)
                    if home != p:
                        # Published under another partition's subject than its user's (by
                        # hand, or by a writer with another count): stored, it would sit in
                        # p's copy, out of reach of the user's forgets and of p's hand-over.
                        raise InvalidInput("entry", f"expected a user of partition {p}, "
                                                    f"found one of partition {home}")
                    entries.append((d.stream_seq, entry))
                except InvalidInput as exc:
                    self.counts["undecodable"] += 1
                    log.warning("partition %d: entry %d skipped: %s", p, d.stream_seq, exc)
            if entries:
                mark = await self._apply(p, entries)

    async def _asking(self, p: int, counts: PartitionCounts, what: str,
                      call: Callable[..., Awaitable[T]], *args: Any) -> T:
        """``call(*args)`` of the log for partition ``p``, asked again after RETRY_SECONDS
        for as long as the log is unreachable (each failure counted, logged as ``what``)."""
        while True:
            try:
                return await call(*args)
            except (*TRANSIENT, LogUnavailable) as exc:
                counts.log_errors += 1
                log.info("partition %d: no %s now (%r); trying again", p, what, exc)
                await trio.sleep(RETRY_SECONDS)

    async def _outlived(self, p: int, mark: int, counts: PartitionCounts) -> bool:
        """Whether this copy cannot be brought up to date from the log, and a snapshot can:
        the entries after its watermark are gone from the stream (aged out while the node
        was away longer than ``max_age``) and a later owner stored a snapshot past it. The
        consumer would start at the oldest entry left, and the copy go on without the
        entries between."""
        if await self._asking(p, counts, "stream state", self.log.first_seq) <= mark + 1:
            return False
        stored = await self._asking(p, counts, "snapshot mark", self.log.snapshot_mark, p)
        if stored is None or stored <= mark:
            return False  # the copy is the newest there is: resumed as it stands
        log.warning("partition %d: the log no longer holds the entries after this copy's "
                    "watermark %d; restoring the snapshot at %d instead", p, mark, stored)
        return True

    async def _bootstrap(self, p: int, counts: PartitionCounts) -> int:
        """Start a copy that holds nothing of the partition from its newest snapshot, if
        there is one; return the watermark to replay from (0: the whole log).

        A snapshot refused (bytes that fail their digest, not a snapshot, one of elsewhere,
        records an import refuses) is replaced by the whole log while the log still holds
        its first entries. Once some aged out (or were purged), the log alone would make a
        copy without them, and this node's next snapshot would spread that loss: the
        partition then waits, unserved and counted, asking again every
        UNRESTORABLE_RETRY_SECONDS, until a snapshot restores, or until there is none (an
        operator deleted the damaged one: what the log holds is then what there is)."""
        partitions = self.config.partitions
        while True:
            started = time.monotonic()
            await drop_local(self.engine, p, partitions)  # what a half-done restore left
            fetching = time.monotonic()
            try:
                found = await self._asking(p, counts, "snapshot", self.log.get_snapshot, p)
                if found is None:
                    return 0
                decoding = time.monotonic()
                snapshot = await trio.to_thread.run_sync(opened, found[1], p, partitions)
                if isinstance(snapshot, Framed):
                    snapshot = await unframed(snapshot)
                writing = time.monotonic()
                await restore(self.engine, snapshot)
                break
            except InvalidInput as exc:
                # What a batch before the refused one wrote (a snapshot of exports) goes
                # first, as a half-done restore's would.
                counts.snapshots_refused += 1
                await drop_local(self.engine, p, partitions)
                if await self._asking(p, counts, "stream state", self.log.first_seq) <= 1:
                    log.warning("partition %d: snapshot refused (%s); replaying the whole log",
                                p, exc)
                    return 0
                log.error("partition %d: snapshot refused (%s), and the log no longer holds "
                          "its first entries: not served until a snapshot restores (deleting "
                          "the damaged one replays what the log holds)", p, exc)
                await trio.sleep(UNRESTORABLE_RETRY_SECONDS)
        counts.bootstraps += 1
        ended = time.monotonic()
        counts.bootstrap_seconds = ended - started
        counts.bootstrap_steps = {"fetch": decoding - fetching, "decode": writing - decoding,
                                  "write": ended - writing}
        counts.snapshot_watermark = max(counts.snapshot_watermark, snapshot.watermark)
        log.info("partition %d: restored %d users at log sequence %d in %.2f s", p,
                 len(snapshot.users), snapshot.watermark, counts.bootstrap_seconds)
        return snapshot.watermark

    async def _snapshots(self) -> None:
        """Publish a snapshot of each owned partition that moved since its last one, every
        ``snapshot_interval``."""
        while True:
            await trio.sleep(self.config.snapshot_interval)
            for p in sorted(self._scopes):
                try:
                    await self.snapshot(p)
                except (*TRANSIENT, LogUnavailable) as exc:
                    self._counts(p).log_errors += 1
                    log.info("partition %d: snapshot not stored (%r); next round", p, exc)

    async def snapshot(self, p: int) -> int | None:
        """Take and store a snapshot of partition ``p`` if it moved past the newest stored
        one; return its watermark (None: not owned here, or nothing new).

        Raises:
            LogUnavailable (or a transient NATS error): the object store did not take it.
        """
        counts = self._counts(p)
        if p not in self._scopes or self.marks.get(p, 0) <= counts.snapshot_watermark:
            return None
        stored = await self.log.snapshot_mark(p)
        counts.snapshot_watermark = max(counts.snapshot_watermark, stored or 0)
        started = time.monotonic()
        # A snapshot carries what the engine derived from the partition, so it waits for every
        # index and the long-term layer to take in what was applied. Most of that wait happens
        # here, with the partition still applying (a layer minutes behind would otherwise
        # hold its applies and reads as long); under the guard only what came meanwhile is left.
        await settle(self.engine)
        async with self._guard(p):
            mark = self.marks.get(p, 0)
            if p not in self._scopes or mark <= counts.snapshot_watermark:
                return None
            records = await read_snapshot(self.engine, p, self.config.partitions, mark,
                                          self.node_id)
        # Compressed once the partition applies again: its records are read.
        data = await pack_snapshot(records)
        await self.log.put_snapshot(p, mark, data)
        counts.snapshots += 1
        counts.snapshot_seconds = time.monotonic() - started
        counts.snapshot_bytes = len(data)
        counts.snapshot_watermark = mark
        return mark

    async def _apply(self, p: int, entries: list[tuple[int, LogEntry]]) -> int:
        async with self._guard(p):
            mark = await self.engine.apply_log_batch(p, entries, self.results)
        while len(self.results) > RESULTS_KEPT:
            self.results.popitem(last=False)
        self.counts["batches"] += 1
        self.counts["entries"] += len(entries)
        counts = self._counts(p)
        counts.batches += 1
        counts.entries += len(entries)
        self._moved(p, mark)
        return mark

    def _moved(self, p: int, mark: int) -> None:
        self.marks[p] = mark
        event = self._changed.pop(p, None)
        if event is not None:
            event.set()

    async def wait_applied(self, p: int, min_seq: int, timeout: float) -> bool:
        """Wait until partition ``p``'s watermark reaches ``min_seq``; False on timeout."""
        with trio.move_on_after(timeout):
            while self.marks.get(p, 0) < min_seq:
                event = self._changed.get(p)
                if event is None:
                    event = self._changed[p] = trio.Event()
                await event.wait()
            return True
        return False

    def stats(self, routed: Mapping[str, int] | None = None) -> NodeStats:
        """This node's figures: each partition it owns or has applied (owned, watermark,
        lag, gaps, replays and bootstraps with their durations), lease events, retries.

        Args:
            routed: the node's router's counts (forwarded, unavailable, looked_up,
                reforwarded), if it has one.
        """
        owned = sorted(p for p in self.leases.held if self.owns(p))
        partitions = []
        for p in sorted(set(self.partitions) | set(self.leases.held)):
            c = self.partitions.get(p) or PartitionCounts()
            partitions.append(PartitionStats(
                partition=p, owned=self.owns(p), watermark=self.marks.get(p),
                lag=c.lag if p in self._scopes else None, gaps=c.gaps, consumers=c.consumers,
                batches=c.batches, entries=c.entries, replays=c.replays,
                replay_seconds=c.replay_seconds, bootstraps=c.bootstraps,
                bootstrap_seconds=c.bootstrap_seconds, bootstrap_steps=c.bootstrap_steps,
                snapshots_refused=c.snapshots_refused, log_errors=c.log_errors,
                snapshots=c.snapshots, snapshot_seconds=c.snapshot_seconds,
                snapshot_bytes=c.snapshot_bytes, snapshot_watermark=c.snapshot_watermark,
                dropped=c.dropped))
        applied = self.engine.log_counts
        routed = routed or {}
        return NodeStats(node=self.node_id, incarnation=self.incarnation, owned=owned,
                         partitions=partitions,
                         leases={k: v for k, v in self.leases.counts.items()},
                         publish_retries=self.log.retries, duplicates=applied["duplicates"],
                         invalid=applied["invalid"], undecodable=self.counts["undecodable"],
                         waited=applied["waited"], waited_long=applied["waited_long"],
                         forwarded=routed.get("forwarded", 0),
                         unavailable=routed.get("unavailable", 0),
                         looked_up=routed.get("looked_up", 0),
                         reforwarded=routed.get("reforwarded", 0),
                         redirected=routed.get("redirected", 0))

    def figures(self) -> dict[str, Any]:
        return {"node": self.node_id, "incarnation": self.incarnation,
                "watermarks": dict(sorted(self.marks.items())), **self.counts,
                "publish_retries": self.log.retries, "leases": self.leases.figures(),
                "replay_seconds": self.replay_seconds[-16:],
                "partitions": msgspec.to_builtins(self.stats().partitions)}


async def _quietly(call: Any) -> None:
    try:
        await call
    except (*TRANSIENT, LogUnavailable):
        pass  # an ephemeral consumer expires by itself


def _consumer_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)[:200]
