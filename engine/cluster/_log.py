"""The replicated log and the lease bucket on NATS JetStream, and their trio-facing client.

Everything that talks to NATS runs on one asyncio loop in a thread of its own
(:class:`~engine.cluster._loop.AsyncioThread`); :class:`Log` is what trio code calls. One file
stream (``ClusterConfig.stream``, replicas from config, R3 by default) takes ``turns.>``: a
publish names the partition and the user (``turns.<p>.<user digest>``) and carries
``Nats-Msg-Id`` = the entry's id (a turn's id), so a publisher that retries after a lost
PubAck gets the first one's sequence back instead of a second copy (the stream's duplicate
window is longer than the longest retry). Leases and heartbeats live in one KV bucket whose
TTL is the lease TTL: a key nobody renews expires by itself.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import io
import logging
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.js import api

from ..errors import EngineClosed, EngineError, InvalidInput
from ._loop import AsyncioThread
from ._partition import DEFAULT_PARTITIONS, SUBJECT_ROOT, partition_subjects

__all__ = ["ClusterConfig", "Log", "LogUnavailable", "Delivery", "TRANSIENT"]

log = logging.getLogger("engine.cluster")

Positive = msgspec.Meta(gt=0)


class ClusterConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Tunables of a cluster; every node of one cluster must use the same.

    Attributes:
        partitions: fixed partitions (never changed on a live cluster: it moves every user).
        replicas: copies of the log and the lease bucket (3: a kill -9 of one server loses
            nothing acknowledged; 1 only for a lone development server).
        lease_ttl: seconds a lease lives without renewal (renewed every ``lease_ttl / 5``).
        read_wait: seconds an owner waits for its watermark to reach a read's ``min_seq``
            before it answers 503 with Retry-After.
        publish_retry_seconds: how long a publish is retried (same message id) before the
            write fails; below ``duplicate_window`` so a retry is always deduplicated.
        duplicate_window: seconds the stream remembers message ids.
        max_age: seconds the stream keeps entries (more than two snapshot intervals, so a
            new owner always finds the log after the newest snapshot).
        fetch_batch: entries an owner pulls and applies at a time.
        snapshot_interval: seconds between an owner's snapshots of a partition that moved
            (a new owner restores the newest and replays only the log after it).
        grace: seconds a node keeps its copy of a partition it no longer owns (a fast
            resume if the partition comes back), before deleting it.
        stream / bucket / objects: names of the stream, the lease bucket and the object
            store of snapshots.
    """

    partitions: int = DEFAULT_PARTITIONS
    replicas: int = 3
    lease_ttl: float = 15.0
    read_wait: float = 0.2
    publish_retry_seconds: float = 60.0
    duplicate_window: float = 120.0
    max_age: float = 7 * 24 * 3600.0
    fetch_batch: int = 256
    snapshot_interval: float = 900.0
    grace: float = 600.0
    stream: str = "ENGRAM"
    bucket: str = "engram_leases"
    objects: str = "engram_snapshots"

    @classmethod
    def checked(cls, config: ClusterConfig | dict | None) -> ClusterConfig:
        """A validated config from a ClusterConfig, a dict of overrides or None.

        Raises:
            InvalidInput: a field is unknown or out of range.
        """
        if config is None:
            return cls()
        raw = msgspec.structs.asdict(config) if isinstance(config, ClusterConfig) else config
        try:
            config = msgspec.convert(raw, cls)
        except msgspec.ValidationError as exc:
            raise InvalidInput("cluster_config", f"{exc}") from None
        for name in ("partitions", "replicas", "fetch_batch"):
            if getattr(config, name) < 1:
                raise InvalidInput(f"cluster_config.{name}", "expected at least 1, found "
                                                             f"{getattr(config, name)}")
        for name in ("lease_ttl", "read_wait", "publish_retry_seconds", "duplicate_window",
                     "max_age", "snapshot_interval", "grace"):
            if not getattr(config, name) > 0:
                raise InvalidInput(f"cluster_config.{name}", "expected seconds above 0, found "
                                                             f"{getattr(config, name)}")
        if config.publish_retry_seconds >= config.duplicate_window:
            raise InvalidInput("cluster_config.publish_retry_seconds",
                               f"expected less than duplicate_window "
                               f"({config.duplicate_window} s), found "
                               f"{config.publish_retry_seconds}: a retry past the window "
                               "would be stored twice")
        if config.max_age <= 2 * config.snapshot_interval:
            raise InvalidInput("cluster_config.max_age",
                               f"expected more than two snapshot intervals "
                               f"({2 * config.snapshot_interval} s), found {config.max_age}: a "
                               "new owner must find the log after the newest snapshot")
        return config


class LogUnavailable(EngineError):
    """The log could not take or give entries in time (no quorum, servers unreachable)."""


class Delivery(msgspec.Struct, frozen=True):
    """One entry as a consumer delivered it; ``pending``: the entries of its partition the
    log held after it when it was sent (the partition's lag, in entries)."""

    stream_seq: int
    consumer_seq: int
    data: bytes
    pending: int = 0


# Errors after which a publish is retried with the same message id: the PubAck was lost or
# the stream had no leader for a moment (an election after a server died).
_RETRY = (nats.errors.TimeoutError, nats.errors.NoRespondersError,
          nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError,
          nats.js.errors.NoStreamResponseError, nats.js.errors.ServiceUnavailableError,
          asyncio.TimeoutError)
# Errors of a call to the log that say it could not answer now (no leader, no quorum, the
# connection down or reconnecting): worth trying again, never a verdict.
TRANSIENT = (*_RETRY, nats.js.errors.APIError, nats.errors.Error)
PUBLISH_TIMEOUT = 2.0  # seconds one attempt waits for its PubAck
RETRY_PAUSE = (0.05, 0.1, 0.2, 0.4, 0.5)  # seconds between attempts, the last one repeated


def _settle(future: concurrent.futures.Future, task: asyncio.Task) -> None:
    if task.cancelled():
        future.cancel()
    elif task.exception() is not None:
        future.set_exception(task.exception())
    else:
        future.set_result(task.result())


class _Client:
    """The asyncio side: a NATS connection and what the cluster does with it. Every method
    runs on the log's asyncio thread."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        # Buffered publishes queued from trio, taken by flush_buffered on the asyncio thread:
        # one cross-thread wake-up per burst instead of one per turn.
        self.buffered: collections.deque[tuple[str, bytes, str, Any]] = collections.deque()
        self.flush_scheduled = False
        self.nc: Any = None
        self.js: Any = None
        self.kv: Any = None
        self.objects: Any = None
        self.retries = 0  # publish attempts after the first, over the client's life

    async def connect(self, servers: Sequence[str], name: str) -> None:
        self.nc = await nats.connect(
            servers=list(servers), name=name, max_reconnect_attempts=-1,
            reconnect_time_wait=0.25, connect_timeout=2, allow_reconnect=True,
            error_cb=_quiet, disconnected_cb=_quiet_event, reconnected_cb=_quiet_event)
        self.js = self.nc.jetstream(timeout=PUBLISH_TIMEOUT)

    async def ensure(self, wait: float = 30.0) -> bool:
        """Create the stream and the lease bucket if missing; True if this call made any.
        A cluster that has just started has no JetStream leader for a few seconds: retried
        for up to ``wait`` seconds."""
        deadline = time.monotonic() + wait
        while True:
            try:
                return await self._ensure()
            except (nats.errors.TimeoutError, nats.js.errors.APIError,
                    nats.errors.NoRespondersError, nats.js.errors.NoStreamResponseError):
                # APIError too: another node may be creating the same stream or bucket now.
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.25)

    async def _ensure(self) -> bool:
        c = self.config
        made = False
        try:
            await self.js.stream_info(c.stream)
        except nats.js.errors.NotFoundError:
            await self.js.add_stream(api.StreamConfig(
                name=c.stream, subjects=[f"{SUBJECT_ROOT}.>"], storage=api.StorageType.FILE,
                num_replicas=c.replicas, duplicate_window=c.duplicate_window,
                max_age=c.max_age, retention=api.RetentionPolicy.LIMITS,
                discard=api.DiscardPolicy.OLD, allow_direct=True))
            made = True
        try:
            self.kv = await self.js.key_value(c.bucket)
        except (nats.js.errors.BucketNotFoundError, nats.js.errors.NotFoundError):
            self.kv = await self.js.create_key_value(api.KeyValueConfig(
                bucket=c.bucket, history=1, ttl=c.lease_ttl, replicas=c.replicas,
                storage=api.StorageType.FILE))
            made = True
        try:
            self.objects = await self.js.object_store(c.objects)
        except (nats.js.errors.BucketNotFoundError, nats.js.errors.NotFoundError):
            self.objects = await self.js.create_object_store(c.objects, api.ObjectStoreConfig(
                description="engram partition snapshots", replicas=c.replicas,
                storage=api.StorageType.FILE))
            made = True
        return made

    async def publish(self, subject: str, payload: bytes, msg_id: str) -> tuple[int, bool]:
        deadline = time.monotonic() + self.config.publish_retry_seconds
        attempt = 0
        while True:
            try:
                ack = await self.js.publish(subject, payload, timeout=PUBLISH_TIMEOUT,
                                            headers={"Nats-Msg-Id": msg_id})
                return ack.seq, bool(ack.duplicate)
            except _RETRY as exc:
                if time.monotonic() > deadline:
                    raise LogUnavailable(
                        f"the log took no entry for {self.config.publish_retry_seconds} s "
                        f"(last: {type(exc).__name__}); is a quorum of its servers up?"
                    ) from exc
            except nats.js.errors.APIError as exc:
                if exc.code not in (None, 503) or time.monotonic() > deadline:
                    raise LogUnavailable(f"the log refused the entry: {exc}") from exc
            self.retries += 1
            await asyncio.sleep(RETRY_PAUSE[min(attempt, len(RETRY_PAUSE) - 1)])
            attempt += 1

    async def publish_pipelined(self, subject: str, payload: bytes, msg_id: str
                                ) -> tuple[int, bool]:
        """``publish`` without waiting for each PubAck before the next publish goes out
        (nats-py's publish_async); on any failure, the retrying ``publish`` with the same id."""
        try:
            ack = await (await self.js.publish_async(subject, payload,
                                                     headers={"Nats-Msg-Id": msg_id}))
            return ack.seq, bool(ack.duplicate)
        except (*_RETRY, nats.js.errors.APIError):
            return await self.publish(subject, payload, msg_id)

    def flush_buffered(self) -> None:
        """Start a pipelined publish for every entry queued by :meth:`Log.publish_soon`
        (runs on the asyncio thread, once per wake-up however many are queued)."""
        self.flush_scheduled = False
        queue = self.buffered
        while queue:
            subject, payload, msg_id, future = queue.popleft()
            task = asyncio.ensure_future(self.publish_pipelined(subject, payload, msg_id))
            task.add_done_callback(functools.partial(_settle, future))

    async def subscribe(self, partition: int, start: int, name: str) -> Any:
        """A fresh pull consumer on one partition from stream sequence ``start``: ephemeral,
        in memory, one replica, no acks (the position lives in the store's watermark)."""
        config = api.ConsumerConfig(
            name=name, deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=max(1, start), ack_policy=api.AckPolicy.NONE,
            filter_subject=partition_subjects(partition), mem_storage=True, num_replicas=1,
            inactive_threshold=max(30.0, self.config.lease_ttl * 2))
        return await self.js.pull_subscribe(partition_subjects(partition), stream=self.config.stream,
                                            config=config)

    async def fetch(self, sub: Any, batch: int, timeout: float) -> list[Delivery]:
        try:
            msgs = await sub.fetch(batch, timeout=timeout)
        except (nats.errors.TimeoutError, asyncio.TimeoutError):
            return []  # nothing new within the timeout
        out = []
        for msg in msgs:
            meta = msg.metadata
            out.append(Delivery(meta.sequence.stream, meta.sequence.consumer, msg.data,
                                meta.num_pending or 0))
        return out

    async def drop(self, sub: Any) -> None:
        """Stop a consumer (unsubscribe and delete it; it would expire by itself anyway)."""
        try:
            info = sub._cinfo if hasattr(sub, "_cinfo") else None
            await sub.unsubscribe()
            name = getattr(sub, "_consumer", None) or (info.name if info else None)
            if name:
                await self.js.delete_consumer(self.config.stream, name)
        except (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError):
            pass  # an ephemeral consumer expires after its inactive threshold

    async def kv_snapshot(self) -> dict[str, tuple[bytes, int]]:
        """Every live key of the lease bucket: key -> (value, revision)."""
        return {k: (value, rev) for k, (value, rev, _) in (await self.kv_entries()).items()}

    async def kv_entries(self) -> dict[str, tuple[bytes, int, Any]]:
        """Every live key of the lease bucket: key -> (value, revision, written at)."""
        watcher = await self.kv.watchall()
        out: dict[str, tuple[bytes, int, Any]] = {}
        try:
            while True:
                entry = await watcher.updates(timeout=PUBLISH_TIMEOUT)
                if entry is None:
                    break
                if entry.operation in ("DEL", "PURGE"):
                    out.pop(entry.key, None)
                else:
                    out[entry.key] = (entry.value, entry.revision, entry.created)
        finally:
            await watcher.stop()
        return out

    async def last_seq(self) -> int:
        info = await self.js.stream_info(self.config.stream)
        return info.state.last_seq

    async def snapshot_mark(self, partition: int) -> int | None:
        try:
            info = await self.objects.get_info(_snapshot_name(partition))
        except nats.js.errors.ObjectNotFoundError:
            return None
        return _mark_of(info)

    async def get_snapshot(self, partition: int) -> tuple[int, bytes] | None:
        out = io.BytesIO()
        try:
            result = await self.objects.get(_snapshot_name(partition), writeinto=out)
        except nats.js.errors.ObjectNotFoundError:
            return None
        return _mark_of(result.info), out.getvalue()

    async def put_snapshot(self, partition: int, watermark: int, data: bytes) -> None:
        name = _snapshot_name(partition)
        await self.objects.put(name, data, meta=api.ObjectMeta(
            name=name, description=msgspec.json.encode({"watermark": watermark}).decode()))

    async def purge(self, subject: str, before: int | None) -> None:
        await self.js.purge_stream(self.config.stream, subject=subject, seq=before)

    async def close(self) -> None:
        if self.nc is not None and not self.nc.is_closed:
            try:
                await asyncio.wait_for(self.nc.drain(), 5)
            except (asyncio.TimeoutError, nats.errors.Error):
                await self.nc.close()


def _snapshot_name(partition: int) -> str:
    return f"partition.{partition}"


def _mark_of(info: Any) -> int:
    """The watermark a snapshot object was tagged with (0: not one of ours)."""
    try:
        return int(msgspec.json.decode(info.description or "{}").get("watermark", 0))
    except (msgspec.DecodeError, AttributeError, TypeError, ValueError):
        return 0


async def _quiet(exc: Exception) -> None:
    log.debug("nats: %s: %s", type(exc).__name__, exc)


async def _quiet_event() -> None:
    log.debug("nats: connection state changed")


class Log:
    """The trio face of the cluster's NATS connection. Open with ``async with Log.open(...)``.

    Attributes:
        config: the cluster's config.
        thread: the asyncio thread the client runs on (for callers that must publish
            without waiting, as a buffered ``add_turn`` does).
    """

    def __init__(self, config: ClusterConfig, thread: AsyncioThread, client: _Client) -> None:
        self.config = config
        self.thread = thread
        self._client = client

    @classmethod
    async def connect(cls, servers: Sequence[str], config: ClusterConfig | dict | None = None,
                      name: str = "engram") -> Log:
        """Connect to the servers and make sure the stream and the bucket exist.

        Raises:
            LogUnavailable: no server answered.
        """
        config = ClusterConfig.checked(config)
        _check_servers(servers)
        thread = AsyncioThread(f"engram-nats-{name}").start()
        client = _Client(config)
        try:
            await thread.run(client.connect, servers, name)
            await thread.run(client.ensure)
        except BaseException as exc:
            thread.stop()
            if isinstance(exc, (nats.errors.Error, OSError, asyncio.TimeoutError)):
                raise LogUnavailable(f"could not reach the log at {', '.join(servers)}: "
                                     f"{type(exc).__name__}: {exc}") from exc
            raise
        return cls(config, thread, client)

    async def close(self) -> None:
        """Drain and close the connection, then stop the asyncio thread."""
        try:
            await self.thread.run(self._client.close)
        finally:
            self.thread.stop()

    async def publish(self, subject: str, payload: bytes, msg_id: str) -> tuple[int, bool]:
        """Append an entry; return ``(stream sequence, was a duplicate)`` once a quorum has it.

        Raises:
            LogUnavailable: no PubAck within ``publish_retry_seconds`` of retries.
        """
        return await self.thread.run(self._client.publish, subject, payload, msg_id)

    def publish_soon(self, subject: str, payload: bytes, msg_id: str
                     ) -> concurrent.futures.Future:
        """Start a publish without waiting; returns its ``concurrent.futures.Future`` of
        ``(stream sequence, was a duplicate)``. Publishes queued together go out pipelined,
        after one wake-up of the asyncio thread.

        Raises:
            EngineClosed: the log's loop is stopped.
        """
        future: concurrent.futures.Future = concurrent.futures.Future()
        client = self._client
        client.buffered.append((subject, payload, msg_id, future))
        if not client.flush_scheduled:
            client.flush_scheduled = True
            loop = self.thread.loop
            if loop is None:
                raise EngineClosed("the NATS client's loop is stopped")
            loop.call_soon_threadsafe(client.flush_buffered)
        return future

    async def subscribe(self, partition: int, start: int, name: str) -> Any:
        return await self.thread.run(self._client.subscribe, partition, start, name)

    async def fetch(self, sub: Any, batch: int, timeout: float) -> list[Delivery]:
        return await self.thread.run(self._client.fetch, sub, batch, timeout)

    async def drop(self, sub: Any) -> None:
        await self.thread.run(self._client.drop, sub)

    async def last_seq(self) -> int:
        return await self.thread.run(self._client.last_seq)

    async def snapshot_mark(self, partition: int) -> int | None:
        """The watermark of the partition's newest snapshot in the object store (None:
        there is none)."""
        return await self.thread.run(self._client.snapshot_mark, partition)

    async def get_snapshot(self, partition: int) -> tuple[int, bytes] | None:
        """The partition's newest snapshot: (its watermark, its bytes), or None."""
        return await self.thread.run(self._client.get_snapshot, partition)

    async def put_snapshot(self, partition: int, watermark: int, data: bytes) -> None:
        """Store a snapshot of the partition, tagged with its watermark (it replaces the
        previous one)."""
        await self.thread.run(self._client.put_snapshot, partition, watermark, data)

    async def purge(self, subject: str, before: int | None = None) -> None:
        """Remove a subject's entries from the stream (those below ``before`` if given)."""
        await self.thread.run(self._client.purge, subject, before)

    async def kv_snapshot(self) -> dict[str, tuple[bytes, int]]:
        """Every live key of the lease bucket: key -> (value, revision)."""
        return await self.thread.run(self._client.kv_snapshot)

    async def kv_entries(self) -> dict[str, tuple[bytes, int, Any]]:
        """Every live key of the lease bucket: key -> (value, revision, written at)."""
        return await self.thread.run(self._client.kv_entries)

    async def kv(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call a method of the lease bucket (``create``, ``update``, ``delete``, ``get``...)."""
        async def call() -> Any:
            return await getattr(self._client.kv, method)(*args, **kwargs)

        return await self.thread.run(call)

    @property
    def retries(self) -> int:
        """Publish attempts repeated so far (each with the same message id)."""
        return self._client.retries


def _check_servers(servers: Sequence[str]) -> None:
    if not servers or any(not isinstance(s, str) or not s.startswith(("nats://", "tls://"))
                          for s in servers):
        raise InvalidInput("nats", f"expected nats://HOST:PORT URLs, found {list(servers)!r}")
