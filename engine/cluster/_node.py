"""A cluster node: an engine that owns some partitions of the log, applies them, and serves
the HTTP API for every user (forwarding to the owner where it is not one).

Write path: a write on any node (``add_turn``, a batch, a forget) becomes a log entry
published to the user's partition (:class:`ClusterEngine`); the node that holds the
partition's lease pulls it and applies it with :meth:`Engine.apply_log_batch`
(:class:`Node`). Read path: the :class:`Router` (ASGI) sends a user's reads to the owner;
a read may carry ``?min_seq=N`` (the ``log_seq`` its caller's last write got) and the owner
answers once its watermark for the partition reaches N, or 503 with ``Retry-After`` after
``read_wait``.
"""

from __future__ import annotations

import inspect
import logging
import os
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping
from datetime import datetime, timezone
from typing import Any

import httpx
import msgspec
import trio

from actors.base import validate as v
from actors.base.records import NewTurn
from actors.session_buffer import new_turn_id

from .._engine import Engine
from .._http_edge import IdConvertor, routed_path
from .._logbatch import (CALLS, LogCall, LogEntry, LogForget, LogForgetScope, LogTurn,
                         decode_entry, encode_entry)
from .._tools import call_tool
from ..errors import EngineError, InvalidInput
from ._bootstrap import decode as decode_snapshot
from ._bootstrap import drop_local, restore
from ._bootstrap import take as take_snapshot
from ._figures import NodeStats, PartitionCounts, PartitionStats, render_metrics
from ._leases import Leases
from ._log import TRANSIENT, Log, LogUnavailable, Pending
from ._partition import partition_of, subject_of

__all__ = ["Node", "ClusterEngine", "ClusterReceipt", "Router", "NotInCluster"]

log = logging.getLogger("engine.cluster")

FETCH_SECONDS = 1.0  # a pull waits this long for entries before asking again
FORWARDED = "x-engram-forwarded"  # header on a forwarded request: never forward it again
RETRY_AFTER = "1"  # seconds, on a 503 from a read that could not be served here yet
FORWARD_TIMEOUT = 30.0  # seconds a forwarded request may take at the owner
RETRY_SECONDS = 0.5  # pause before a partition's reader asks a failing log again
CALL_WAIT = 10.0  # seconds the owner waits to apply its own logged call before answering
RESULTS_KEPT = 4096  # applied calls' results kept for their publishers (popped on answer)


class NotInCluster(EngineError):
    """This write is not carried by the cluster's log yet, so a node refuses it rather than
    writing a copy that the partition's next owner would not have."""


class ClusterReceipt:
    """What a write through the cluster returns.

    Attributes:
        turn_id: the turn's id (made before publishing; it is the log's message id).
        seq: None: a turn's position in its session is assigned when its owner applies it.
        log_seq: the stream sequence, once the log acknowledged it (None before).
    """

    __slots__ = ("turn_id", "seq", "log_seq", "_pending")

    def __init__(self, turn_id: str, log_seq: int | None = None,
                 pending: Pending | None = None) -> None:
        self.turn_id = turn_id
        self.seq = None
        self.log_seq = log_seq
        self._pending = pending

    async def durable(self) -> None:
        """Return once the log's quorum holds the turn (``log_seq`` is then set).

        Raises:
            LogUnavailable: the log took no PubAck within the retry time.
        """
        if self.log_seq is None:
            assert self._pending is not None
            self.log_seq = (await self._pending.wait())[0]

    def __repr__(self) -> str:
        return f"ClusterReceipt(turn_id={self.turn_id!r}, log_seq={self.log_seq})"


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
                    entries.append((d.stream_seq, decode_entry(d.data)))
                except InvalidInput as exc:
                    self.counts["undecodable"] += 1
                    log.warning("partition %d: entry %d skipped: %s", p, d.stream_seq, exc)
            if entries:
                mark = await self._apply(p, entries)

    async def _bootstrap(self, p: int, counts: PartitionCounts) -> int:
        """Start a copy that holds nothing of the partition from its newest snapshot, if
        there is one; return the watermark to replay from (0: the whole log)."""
        started = time.monotonic()
        partitions = self.config.partitions
        await drop_local(self.engine, p, partitions)  # what a half-done restore left
        while True:
            try:
                found = await self.log.get_snapshot(p)
                break
            except (*TRANSIENT, LogUnavailable) as exc:
                counts.log_errors += 1
                log.info("partition %d: no snapshot now (%r); trying again", p, exc)
                await trio.sleep(RETRY_SECONDS)
        if found is None:
            return 0
        try:
            snapshot = decode_snapshot(found[1], p, partitions)
        except InvalidInput as exc:
            log.warning("partition %d: snapshot refused (%s); replaying the whole log", p, exc)
            return 0
        await restore(self.engine, snapshot)
        counts.bootstraps += 1
        counts.bootstrap_seconds = time.monotonic() - started
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
        async with self._guard(p):
            mark = self.marks.get(p, 0)
            if p not in self._scopes or mark <= counts.snapshot_watermark:
                return None
            data = await take_snapshot(self.engine, p, self.config.partitions, mark,
                                       self.node_id)
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

    def stats(self, router: Router | None = None) -> NodeStats:
        """This node's figures: each partition it owns or has applied (owned, watermark,
        lag, gaps, replays and bootstraps with their durations), lease events, retries.

        Args:
            router: the node's router, for its forwarded / unavailable counts.
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
                bootstrap_seconds=c.bootstrap_seconds, log_errors=c.log_errors,
                snapshots=c.snapshots, snapshot_seconds=c.snapshot_seconds,
                snapshot_bytes=c.snapshot_bytes, snapshot_watermark=c.snapshot_watermark,
                dropped=c.dropped))
        applied = self.engine.log_counts
        routed = router.counts if router is not None else {}
        return NodeStats(node=self.node_id, incarnation=self.incarnation, owned=owned,
                         partitions=partitions,
                         leases={k: v for k, v in self.leases.counts.items()},
                         publish_retries=self.log.retries, duplicates=applied["duplicates"],
                         invalid=applied["invalid"], undecodable=self.counts["undecodable"],
                         forwarded=routed.get("forwarded", 0),
                         unavailable=routed.get("unavailable", 0))

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


class ClusterEngine:
    """The engine a cluster node's HTTP app drives: writes become log entries, reads go to
    the local engine (the :class:`Router` sends a user's reads only to the owner).

    Args:
        engine: the node's open engine.
        log: the cluster's log.
        node: the node that applies this engine's partitions (calls other than turns and
            forgets wait for it); None for a writer that only publishes turns.
    """

    def __init__(self, engine: Engine, log: Log, node: Node | None = None) -> None:
        self._engine = engine
        self._log = log
        self._node = node
        self._config = engine.config
        self._partitions = log.config.partitions

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def _turn(self, field: str, user_id: Any, session_id: Any, role: Any, text: Any, at: Any,
              meta: Any, agent_id: Any = None, run_id: Any = None) -> LogTurn:
        config = self._config
        try:
            v.check_id("user_id", user_id, config.max_id_chars)
            v.check_id("session_id", session_id, config.max_id_chars)
            v.check_role(role)
            v.check_text("text", text, config.max_text_chars)
            at = datetime.now(timezone.utc) if at is None else v.check_at(at)
            meta = v.check_meta(meta, config.max_meta_bytes)
            for name, value in (("agent_id", agent_id), ("run_id", run_id)):
                if value is not None:
                    v.check_id(name, value, config.max_id_chars)
        except InvalidInput as exc:
            if not field:
                raise
            raise InvalidInput(f"{field}.{exc.field}", str(exc).split(": ", 1)[-1]) from None
        return LogTurn(user_id, session_id, new_turn_id(), role, text,
                       at.astimezone(timezone.utc), meta or None, agent_id, run_id)

    async def add_turn(self, user_id: str, session_id: str, role: str, text: str,
                       at: datetime | None = None, meta: dict[str, Any] | None = None,
                       durable: bool = False, *, agent_id: str | None = None,
                       run_id: str | None = None) -> ClusterReceipt:
        """:meth:`Engine.add_turn` through the log: the turn is published to the user's
        partition; ``durable`` waits for the PubAck (a quorum of the log holds it). Its scope
        (``agent_id`` / ``run_id``) goes with it; the owner files it as ``add_turn`` does,
        and a turn naming another scope than its session's is refused there (counted
        invalid), since only the owner holds the session.

        Raises:
            InvalidInput: a bad argument; nothing was published.
            LogUnavailable: (durable) no PubAck within the retry time.
        """
        turn = self._turn("", user_id, session_id, role, text, at, meta, agent_id, run_id)
        return await self._publish(turn, turn.turn_id, durable)

    async def add_turns(self, items: Iterable[NewTurn | Mapping[str, Any]], *,
                        durable: bool = False) -> list[ClusterReceipt]:
        """:meth:`Engine.add_turns` through the log: all are checked before any is published."""
        turns = []
        for index, item in enumerate(items):
            if isinstance(item, Mapping):
                try:
                    item = NewTurn(**item)
                except TypeError as exc:
                    raise InvalidInput(f"items[{index}]", f"expected NewTurn fields, found "
                                                          f"{exc}") from None
            turns.append(self._turn(f"items[{index}]", item.user_id, item.session_id,
                                    item.role, item.text, item.at, item.meta, item.agent_id,
                                    item.run_id))
        receipts = [await self._publish(t, t.turn_id, False) for t in turns]
        if durable:
            for receipt in receipts:
                await receipt.durable()
        return receipts

    async def _publish(self, entry: LogEntry, msg_id: str, durable: bool) -> ClusterReceipt:
        subject = subject_of(entry.user_id, self._partitions)
        payload = encode_entry(entry)
        if durable:
            seq, _ = await self._log.publish(subject, payload, msg_id)
            return ClusterReceipt(msg_id, seq)
        return ClusterReceipt(msg_id, None, self._log.publish_soon(subject, payload, msg_id))

    async def forget_user(self, user_id: str) -> None:
        """Forget a user through the log: a tombstone, then the user's earlier entries are
        purged from the stream (the tombstone stays until every owner applied it)."""
        v.check_id("user_id", user_id, self._config.max_id_chars)
        seq, _ = await self._log.publish(subject_of(user_id, self._partitions),
                                         encode_entry(LogForget(user_id)), new_turn_id())
        await self._log.purge(subject_of(user_id, self._partitions), before=seq)

    async def forget_session(self, user_id: str, session_id: str) -> None:
        """Forget a session through the log (a tombstone; subjects are per user, so its
        entries leave the stream with its age limit, not by a purge)."""
        v.check_id("user_id", user_id, self._config.max_id_chars)
        v.check_id("session_id", session_id, self._config.max_id_chars)
        await self._log.publish(subject_of(user_id, self._partitions),
                                encode_entry(LogForget(user_id, session_id)), new_turn_id())

    async def _logged(self, method: str, user_id: str, args: dict[str, Any]) -> Any:
        """Publish a :class:`LogCall` and return what the owner's engine returned applying it.

        Only the owner runs this (the router forwards these routes there), so it waits for
        its own applier and takes the result from it.

        Raises:
            The engine's own error for the call (raised on the owner when it applied it).
            LogUnavailable: this node is not the partition's owner any more, or the log did
                not take or deliver the entry in time (it may still apply later).
        """
        return await self._applied(method, LogCall(user_id, method, args))

    async def _applied(self, method: str, entry: LogCall | LogForgetScope) -> Any:
        """Publish ``entry`` (a call or a scope's tombstone) and return what the owner's
        engine returned applying it; raises as :meth:`_logged`."""
        user_id = entry.user_id
        v.check_id("user_id", user_id, self._config.max_id_chars)
        p = partition_of(user_id, self._partitions)
        node = self._node
        if node is None or not node.owns(p):
            raise LogUnavailable(f"partition {p} is not held here: its owner takes {method} "
                                 "(a node forwards it there); retry")
        seq, _ = await self._log.publish(subject_of(user_id, self._partitions),
                                         encode_entry(entry), "c_" + new_turn_id()[2:])
        if not await node.wait_applied(p, seq, CALL_WAIT):
            raise LogUnavailable(f"{method} is in the log at {seq} but was not applied here "
                                 f"within {CALL_WAIT} s; it applies once the owner catches up")
        result = node.results.pop(seq, None)
        if isinstance(result, BaseException):
            raise result
        return result

    async def call_tool(self, name: str, arguments: Mapping[str, Any] | str) -> dict[str, Any]:
        """:meth:`Engine.call_tool` on the owner of the tool's user: its writes (facts, notes)
        go through the log like the same calls made directly, its reads are the local
        engine's (the :class:`Router` sends a tool call to the owner of its ``user_id``).

        Raises:
            InvalidInput: an unknown tool, or arguments that do not fit its schema.
            LogUnavailable: this node is not the user's partition's owner (any more).
        """
        self._engine.check_open()
        return await call_tool(self, name, arguments)

    async def snapshot(self, dest: str | os.PathLike[str]) -> Any:
        """:meth:`Engine.snapshot` of this node's own store: the partitions it has applied,
        each with its watermark (committed in the same transactions as what they cover).
        A node whose store is restored from it resumes each partition it then holds from
        that watermark, replaying only the log after it; copies of partitions held
        elsewhere go after the grace period. The cluster-wide backup is the log itself,
        with the per-partition snapshots in the object store.

        Args:
            dest: a new or empty directory on this node's machine.

        Returns:
            The snapshot's :class:`~engine.Manifest`.
        """
        return await self._engine.snapshot(dest)

    async def forget_scope(self, user_id: str, *, agent_id: str | None = None,
                           run_id: str | None = None) -> dict[str, int]:
        """:meth:`Engine.forget_scope` through the log: a tombstone (:class:`LogForgetScope`)
        that every node applies at its place in the log, as ``forget_session``'s; on the
        owner (the router forwards it there), it returns what the owner's apply forgot.

        Raises:
            InvalidInput: neither ``agent_id`` nor ``run_id``, or a bad id (nothing logged).
            LogUnavailable: as a logged call's.
        """
        if agent_id is None and run_id is None:
            raise InvalidInput("agent_id", "expected agent_id or run_id (or both), found "
                                           "neither; forget_user forgets the whole user")
        for field, value in (("agent_id", agent_id), ("run_id", run_id)):
            if value is not None:
                v.check_id(field, value, self._config.max_id_chars)
        return await self._applied("forget_scope", LogForgetScope(user_id, agent_id, run_id))


def _logged_method(name: str) -> Callable[..., Awaitable[Any]]:
    """A ClusterEngine method that logs the Engine method ``name`` as a :class:`LogCall`."""
    signature = inspect.signature(getattr(Engine, name))

    async def method(self: ClusterEngine, user_id: str, *args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(None, user_id, *args, **kwargs)
        except TypeError as exc:
            raise InvalidInput("arguments", f"{name}: {exc}") from None
        call = {k: _plain(v) for k, v in bound.arguments.items() if k not in ("self", "user_id")}
        # What the owner would make up when it applies, made here once, so that every node
        # that replays the entry makes the same record.
        if name == "store_note" and call.get("note_id") is None:
            call["note_id"] = "n_" + new_turn_id()[2:]
        if name in ("remember_fact", "link"):
            stamp = "valid_at" if name == "remember_fact" else "at"
            if call.get(stamp) is None:
                call[stamp] = datetime.now(timezone.utc)
        return await self._logged(name, user_id, call)

    method.__name__ = name
    method.__doc__ = f":meth:`Engine.{name}` through the log, applied by the owner."
    return method


def _plain(value: Any) -> Any:
    """An argument as msgpack carries it: iterables (tags, keywords) as lists."""
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, Iterable):
        return value
    return list(value)


for _name in sorted(CALLS):
    setattr(ClusterEngine, _name, _logged_method(_name))


# -- routing ------------------------------------------------------------------------------------

_ID = IdConvertor()  # a path segment of routed_path back to the id it stands for
# Routes whose user is in the JSON body (an agent tool's arguments name it too).
_BODY_USER = ("/v1/retrieve_memory", "/v1/retrieve_memory/raw", "/v1/context_pre_retrieve")
_TOOLS = "/v1/tools/"


class Router:
    """ASGI middleware in front of the node's app: a user's requests go to the owner of the
    user's partition (forwarded over HTTP), writes through the log are served here, and a
    read with ``?min_seq=`` waits for the owner's watermark.

    Args:
        app: the node's app (``create_app`` over a :class:`ClusterEngine`).
        node: the node (its leases say who owns what).
    """

    def __init__(self, app: Callable[..., Awaitable[None]], node: Node) -> None:
        self.app = app
        self.node = node
        self.client = httpx.AsyncClient(timeout=FORWARD_TIMEOUT)
        self.counts = {"forwarded": 0, "waited": 0, "unavailable": 0}

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            if scope["type"] == "http" and scope["path"] == "/cluster/node":
                # No user data: partitions, watermarks and counters (engram cluster status).
                await _respond(send, 200, self.node.figures() | {"router": self.counts})
                return
            if scope["type"] == "http" and scope["path"] == "/metrics":
                await self._metrics(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        # The path as the app routes it: an id's '/' stays escaped, so "team/alice" is one
        # segment here, as in the app's routes (engine/_http_edge.py).
        path, method = routed_path(scope), scope["method"]
        body: bytes | None = None
        user = _path_user(path)
        if user is None and method == "POST" and (path in _BODY_USER
                                                  or path.startswith(_TOOLS)):
            body = await _read_body(receive)
            try:
                user = msgspec.json.decode(body).get("user_id")
            except (msgspec.DecodeError, AttributeError):
                user = None
        if not isinstance(user, str) or _is_log_write(method, path, user):
            await self.app(scope, _replay(body, receive) if body is not None else receive, send)
            return
        p = partition_of(user, self.node.config.partitions)
        query = urllib.parse.parse_qs(scope.get("query_string", b"").decode())
        min_seq = query.get("min_seq", [None])[0]
        if self.node.owns(p):
            if min_seq is not None:
                if not min_seq.isdigit():
                    await _respond(send, 422, {"error": "InvalidInput", "field": "min_seq",
                                               "message": "min_seq: expected a log sequence "
                                                          f"number, found {min_seq!r}"})
                    return
                self.counts["waited"] += 1
                if not await self.node.wait_applied(p, int(min_seq),
                                                    self.node.config.read_wait):
                    self.counts["unavailable"] += 1
                    await _respond(send, 503, {
                        "error": "NotCaughtUp", "message": f"partition {p} has applied the "
                        f"log up to {self.node.marks.get(p, 0)}, not yet {min_seq}; retry"},
                        retry=True)
                    return
            await self.app(scope, _replay(body, receive) if body is not None else receive, send)
            return
        headers = dict(scope.get("headers", []))
        owner = self.node.leases.owner(p)
        url = None if owner is None else self.node.leases.url_of(owner.node)
        if FORWARDED.encode() in headers or url is None or owner.node == self.node.node_id:
            self.counts["unavailable"] += 1
            await _respond(send, 503, {"error": "NoOwner", "message": f"partition {p} has no "
                                       "confirmed owner reachable from here yet; retry"},
                           retry=True)
            return
        if body is None:
            body = await _read_body(receive)
        await self._forward(scope, url, body, send)

    async def _metrics(self, scope: dict, receive: Callable, send: Callable) -> None:
        """The app's ``/metrics`` with the node's cluster families after them."""
        start: dict = {}
        chunks: list[bytes] = []

        async def keep(message: dict) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
            else:
                chunks.append(message.get("body", b""))

        await self.app(scope, receive, keep)
        body = b"".join(chunks)
        if start.get("status") == 200:
            body += render_metrics(self.node.stats(self))
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": start.get("status", 500),
                    "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _forward(self, scope: dict, url: str, body: bytes, send: Callable) -> None:
        self.counts["forwarded"] += 1
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]
                   if k.lower() not in (b"host", b"content-length", b"connection")]
        headers.append((FORWARDED, self.node.node_id))
        target = url.rstrip("/") + scope["raw_path"].decode("latin-1") if scope.get(
            "raw_path") else url.rstrip("/") + scope["path"]
        if scope.get("query_string"):
            target += "?" + scope["query_string"].decode("latin-1")
        try:
            answer = await self.client.request(scope["method"], target, content=body,
                                               headers=headers)
        except httpx.HTTPError as exc:
            self.counts["unavailable"] += 1
            await _respond(send, 503, {"error": "OwnerUnreachable", "message":
                                       f"the partition's owner did not answer ({exc!r}); retry"},
                           retry=True)
            return
        out = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in answer.headers.items()
               if k.lower() not in ("content-length", "transfer-encoding", "connection",
                                    "content-encoding")]
        out.append((b"content-length", str(len(answer.content)).encode()))
        await send({"type": "http.response.start", "status": answer.status_code, "headers": out})
        await send({"type": "http.response.body", "body": answer.content})


def _path_user(path: str) -> str | None:
    if not path.startswith("/v1/users/"):
        return None
    return _ID.convert(path[len("/v1/users/"):].split("/", 1)[0]) or None


def _is_log_write(method: str, path: str, user: str) -> bool:
    rest = path[len("/v1/users/"):].split("/", 1)
    tail = "/" + rest[1] if len(rest) > 1 else ""
    if method == "POST" and (tail == "/turns" or (tail.startswith("/sessions/")
                                                  and tail.endswith("/turns"))):
        return True
    return method == "DELETE" and (tail == "" or (tail.startswith("/sessions/")
                                                  and tail.count("/") == 2))


async def _read_body(receive: Callable) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


def _replay(body: bytes, receive: Callable) -> Callable:
    sent = False

    async def again() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


async def _respond(send: Callable, status: int, body: dict, retry: bool = False) -> None:
    data = msgspec.json.encode(body)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    if retry:
        headers.append((b"retry-after", RETRY_AFTER.encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})
