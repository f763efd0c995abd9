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
import base64
import collections
import functools
import hashlib
import logging
import math
import os
import time
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import nats
import nats.aio.client
import nats.errors
import nats.js.errors
import trio
from nats.js import api
from nats.js.object_store import OBJ_CHUNKS_PRE_TEMPLATE, OBJ_STREAM_TEMPLATE

from actors.base.config import converted

from .._logbatch import MAX_BATCH
from ..errors import EngineClosed, EngineError, InvalidInput
from ._loop import AsyncioThread
from ._partition import DEFAULT_PARTITIONS, SUBJECT_ROOT, partition_subjects

__all__ = ["ClusterConfig", "Log", "LogUnavailable", "Delivery", "Pending", "TRANSIENT"]

log = logging.getLogger("engine.cluster")

Positive = msgspec.Meta(gt=0)
# The most partitions a cluster may have: a node renews its leases one at a time each tick
# (TTL/5), runs a consumer and an applier per partition it holds, and plans over them all.
MAX_PARTITIONS = 1024


class ClusterConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Tunables of a cluster; every node of one cluster must use the same.

    Attributes:
        partitions: fixed partitions (never changed on a live cluster: it moves every user;
            at most MAX_PARTITIONS).
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
        fetch_batch: entries an owner pulls and applies at a time (at most 1,024: what one
            ``apply_log_batch`` takes).
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
        config = converted(cls, config, "cluster_config")
        for name in ("partitions", "replicas", "fetch_batch"):
            if getattr(config, name) < 1:
                raise InvalidInput(f"cluster_config.{name}", "expected at least 1, found "
                                                             f"{getattr(config, name)}")
        for name in ("lease_ttl", "read_wait", "publish_retry_seconds", "duplicate_window",
                     "max_age", "snapshot_interval", "grace"):
            if not getattr(config, name) > 0:
                raise InvalidInput(f"cluster_config.{name}", "expected seconds above 0, found "
                                                             f"{getattr(config, name)}")
            if not math.isfinite(getattr(config, name)):
                raise InvalidInput(f"cluster_config.{name}", "expected finite seconds, found "
                                                             f"{getattr(config, name)}")
        if config.duplicate_window > config.max_age:
            raise InvalidInput("cluster_config.duplicate_window",
                               f"expected at most max_age ({config.max_age} s), found "
                               f"{config.duplicate_window}: the log servers refuse a stream "
                               "that remembers ids longer than it keeps entries")
        if config.partitions > MAX_PARTITIONS:
            raise InvalidInput("cluster_config.partitions",
                               f"expected at most {MAX_PARTITIONS}, found {config.partitions}; "
                               "a cluster's count is fixed for its life, so choose a few per "
                               "node you may ever run (the default is "
                               f"{DEFAULT_PARTITIONS})")
        if config.fetch_batch > MAX_BATCH:
            raise InvalidInput("cluster_config.fetch_batch",
                               f"expected at most {MAX_BATCH} (what apply_log_batch takes at "
                               f"once), found {config.fetch_batch}")
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


class CallLogged(EngineError):
    """A call is in the log, at ``log_seq``, but the node that logged it did not see it
    applied in time (it lost the partition meanwhile, or its applier is behind). The
    partition's owner applies it, once: calling again would be a second call. Reading with
    ``min_seq=log_seq`` shows its effect once applied.

    Attributes:
        log_seq: the call's stream sequence.
    """

    def __init__(self, message: str, log_seq: int) -> None:
        super().__init__(message)
        self.log_seq = log_seq


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
PARTITIONS_KEY = "engram.partitions"  # the stream's metadata: the count it was made with
CLOSE_SECONDS = 6.0  # a failed connect's close: its drain's own bound (5 s), and a margin
# How long a first connect tries the servers before giving up: every server a few times at
# its connect_timeout (2 s). Told to reconnect for ever, nats-py never gives up on its own.
CONNECT_SECONDS = 10.0
FETCH_BATCH = 256  # entries a scan of a subject reads at a time
SCAN_TIMEOUT = 5.0  # seconds a scan waits for the next entries of a subject (all are there)
DELETES_IN_FLIGHT = 16  # deletions of single entries sent at once (each a replicated request)
WATCH_IDLE_SECONDS = 10.0  # the server deletes a stopped watch's consumer after this (not 5 min)
RETRY_PAUSE = (0.05, 0.1, 0.2, 0.4, 0.5)  # seconds between attempts, the last one repeated
IN_PROCESS = 10158  # JetStream: "duplicate message id is in process" (its first attempt's)
LOST_PULL_SECONDS = 2.0  # a pull request this long past its expiry without an answer is lost
HEADER_ROOM = 1024  # bytes of max_payload left to a publish's headers and framing (Nats-Msg-Id)


class Pending:
    """A buffered publish's outcome, as trio waits for it: filled on the trio thread, many
    at a time (one wake-up of trio per batch of PubAcks, not one per publish)."""

    __slots__ = ("result", "error", "done", "_event")

    def __init__(self) -> None:
        self.result: tuple[int, bool] | None = None
        self.error: BaseException | None = None
        self.done = False
        self._event: trio.Event | None = None  # made by a waiter; set once done

    async def wait(self) -> tuple[int, bool]:
        """``(stream sequence, was a duplicate)`` once the log acknowledged the entry.

        Raises:
            LogUnavailable (or what the retrying publish raised): no PubAck in time.
        """
        if self.done:
            await trio.lowlevel.checkpoint()
        else:
            if self._event is None:
                self._event = trio.Event()
            await self._event.wait()
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


def _settle_all(batch: list[tuple[Pending, tuple[int, bool] | None, BaseException | None]]
                ) -> None:
    """Runs on the trio thread: the outcomes the asyncio thread gathered."""
    for pending, result, error in batch:
        pending.result, pending.error, pending.done = result, error, True
        if pending._event is not None:
            pending._event.set()


class Pull:
    """A pull consumer (a partition's, a scan's of one subject, a snapshot's chunks), read
    continuously (asyncio thread).

    One pull request stays open on the server (``batch`` entries, expiring after the fetch
    timeout), and whatever it delivers is handed over as soon as it arrives: an entry never
    waits for its batch to fill or for the request to expire. nats-py's ``fetch`` does wait
    so once an entry came under a pull request other than the one it expects (one a fetch
    that timed out left open on the server, a race under load), which put up to a whole
    fetch timeout on read-your-writes. A request that ends (batch delivered, 404, 408) is
    replaced on the next fetch; one that never answers (its server died, the connection
    moved) is replaced once it is ``LOST_PULL_SECONDS`` past its expiry.

    Args:
        nc: the NATS connection.
        stream: the stream's name.
        name: the consumer's name (made by its user: :meth:`_Client.subscribe`,
            ``delete_where``, ``get_snapshot``).
    """

    def __init__(self, nc: Any, js: Any, stream: str, name: str) -> None:
        self.nc = nc
        self.js = js
        self.stream = stream
        self.name = name
        self.next_subject = f"{api.DEFAULT_PREFIX}.CONSUMER.MSG.NEXT.{stream}.{name}"
        self.inbox = nc.new_inbox()
        self.sub: Any = None
        self.arrived: collections.deque[Any] = collections.deque()
        self.wake = asyncio.Event()  # set when a message arrives on the inbox
        self.left = 0  # entries the open pull request may still deliver (0: none open)
        self.ends = 0.0  # loop time the open pull request expires at
        self.failed: BaseException | None = None  # a refusal to raise on the next fetch

    async def open(self) -> None:
        self.sub = await self.nc.subscribe(self.inbox, cb=self._arrive)

    async def _arrive(self, msg: Any) -> None:
        self.arrived.append(msg)
        self.wake.set()

    async def close(self) -> None:
        if self.sub is not None:
            await self.sub.unsubscribe()

    async def fetch(self, batch: int, timeout: float) -> list[Delivery]:
        """What the consumer delivered: at least one entry as soon as one is here, or none
        after ``timeout`` seconds.

        Raises:
            nats.js.errors.APIError (503: the consumer is gone with its server; 409: it was
            deleted or moved): make a new consumer.
        """
        loop = asyncio.get_running_loop()
        give_up = loop.time() + timeout
        while True:
            self.wake.clear()
            out = self._take()
            if out:
                return out
            if self.failed is not None:
                failed, self.failed = self.failed, None
                if not (isinstance(failed, nats.js.errors.ServiceUnavailableError)
                        and await self._still_there()):
                    raise failed
            now = loop.time()
            if now >= give_up:
                return []
            if self.left <= 0 or now > self.ends + LOST_PULL_SECONDS:
                self.left, self.ends = batch, now + timeout
                await self.nc.publish(self.next_subject, msgspec.json.encode(
                    {"batch": batch, "expires": int(timeout * 1e9)}), reply=self.inbox)
                continue
            try:
                await asyncio.wait_for(self.wake.wait(), min(give_up, self.ends
                                                             + LOST_PULL_SECONDS) - now)
            except asyncio.TimeoutError:
                pass

    async def _still_there(self) -> bool:
        """After a 503 (no responders): True if the consumer exists, so the request only
        went out before the servers knew of it (a consumer just made lives on one server and
        its interest spreads to the others a moment later); False if it is gone."""
        try:
            await self.js.consumer_info(self.stream, self.name)
        except nats.js.errors.NotFoundError:
            return False
        await asyncio.sleep(RETRY_PAUSE[0])
        return True

    def _take(self) -> list[Delivery]:
        out = []
        while self.arrived:
            msg = self.arrived.popleft()
            status = msg.headers.get(api.Header.STATUS) if msg.headers else None
            if not status:
                self.left -= 1
                meta = msg.metadata
                out.append(Delivery(meta.sequence.stream, meta.sequence.consumer, msg.data,
                                    meta.num_pending or 0))
            elif status in (api.StatusCode.NO_MESSAGES, api.StatusCode.REQUEST_TIMEOUT):
                self.left = 0  # that pull request is over: the next fetch makes another
            elif status != api.StatusCode.CONTROL_MESSAGE:
                self.left = 0
                try:
                    nats.js.errors.APIError.from_msg(msg)
                except nats.js.errors.APIError as exc:
                    self.failed = exc
        return out


class _Client:
    """The asyncio side: a NATS connection and what the cluster does with it. Every method
    runs on the log's asyncio thread."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        # Buffered publishes queued from trio, taken by flush_buffered on the asyncio thread:
        # one cross-thread wake-up per burst instead of one per turn.
        self.buffered: collections.deque[tuple[str, bytes, str, Pending]] = collections.deque()
        self.flush_scheduled = False
        self.sending = False  # a task is sending the buffered publishes (asyncio thread)
        # Outcomes of buffered publishes not yet handed to trio, and whether a hand-over is
        # scheduled (both on the asyncio thread).
        self.settled: list[tuple[Pending, tuple[int, bool] | None, BaseException | None]] = []
        self.deliver_scheduled = False
        self.trio_token: trio.lowlevel.TrioToken | None = None  # where outcomes are handed
        self.nc: Any = None
        self.js: Any = None
        self.kv: Any = None
        self.objects: Any = None
        self.retries = 0  # publish attempts after the first, over the client's life

    async def connect(self, servers: Sequence[str], name: str) -> None:
        """Connect, reconnecting for ever once connected; the first connect is bounded.

        Raises:
            LogUnavailable: no server answered within CONNECT_SECONDS.
        """
        # Kept before connecting, so a connect that fails midway is closed (Log.connect).
        self.nc = nats.aio.client.Client()
        try:
            await asyncio.wait_for(self.nc.connect(
                servers=list(servers), name=name, max_reconnect_attempts=-1,
                reconnect_time_wait=0.25, connect_timeout=2, allow_reconnect=True,
                error_cb=_quiet, disconnected_cb=_quiet_event, reconnected_cb=_quiet_event),
                CONNECT_SECONDS)
        except asyncio.TimeoutError:
            raise LogUnavailable(f"could not reach the log at {', '.join(servers)}: no server "
                                 f"answered within {CONNECT_SECONDS:g} s; are the URLs right "
                                 "and the servers up?") from None
        self.js = self.nc.jetstream(timeout=PUBLISH_TIMEOUT)

    async def ensure(self, create: bool = True, wait: float = 30.0) -> bool:
        """Create the stream and the lease bucket if missing; True if this call made any.
        A cluster that has just started has no JetStream leader for a few seconds: retried
        for up to ``wait`` seconds.

        Raises:
            LogUnavailable: one is missing and ``create`` is False.
        """
        deadline = time.monotonic() + wait
        while True:
            try:
                return await self._ensure(create)
            except (nats.errors.TimeoutError, nats.js.errors.APIError,
                    nats.errors.NoRespondersError, nats.js.errors.NoStreamResponseError):
                # APIError too: another node may be creating the same stream or bucket now.
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.25)

    async def _ensure(self, create: bool) -> bool:
        c = self.config
        made = False
        try:
            info = await self.js.stream_info(c.stream)
        except nats.js.errors.NotFoundError:
            self._missing(create, f"stream {c.stream!r}")
            await self.js.add_stream(api.StreamConfig(
                name=c.stream, subjects=[f"{SUBJECT_ROOT}.>"], storage=api.StorageType.FILE,
                num_replicas=c.replicas, duplicate_window=c.duplicate_window,
                max_age=c.max_age, retention=api.RetentionPolicy.LIMITS,
                discard=api.DiscardPolicy.OLD, allow_direct=True,
                metadata={PARTITIONS_KEY: str(c.partitions)}))
            made = True
        else:
            # A stream made before it carried the count has none to compare.
            made_with = (info.config.metadata or {}).get(PARTITIONS_KEY)
            _agree(c.stream, "partitions", c.partitions,
                   None if made_with is None else int(made_with))
            _agree(c.stream, "duplicate_window", c.duplicate_window,
                   info.config.duplicate_window)
        try:
            self.kv = await self.js.key_value(c.bucket)
        except (nats.js.errors.BucketNotFoundError, nats.js.errors.NotFoundError):
            self._missing(create, f"lease bucket {c.bucket!r}")
            self.kv = await self.js.create_key_value(api.KeyValueConfig(
                bucket=c.bucket, history=1, ttl=c.lease_ttl, replicas=c.replicas,
                storage=api.StorageType.FILE))
            made = True
        else:
            _agree(c.bucket, "lease_ttl", c.lease_ttl, (await self.kv.status()).ttl)
        try:
            self.objects = await self.js.object_store(c.objects)
        except (nats.js.errors.BucketNotFoundError, nats.js.errors.NotFoundError):
            self._missing(create, f"snapshot store {c.objects!r}")
            self.objects = await self.js.create_object_store(c.objects, api.ObjectStoreConfig(
                description="engram partition snapshots", replicas=c.replicas,
                storage=api.StorageType.FILE))
            made = True
        return made

    def _missing(self, create: bool, what: str) -> None:
        if not create:
            raise LogUnavailable(f"the log has no {what}: run `engram-trio cluster init` (or "
                                 "start a node) with the cluster's settings first, or check "
                                 "the names in cluster_config")

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
                # 503: no quorum yet; 409 with err_code 10158: this id's first attempt is in
                # process (it will land): both wait, as a refusal would be retried under a
                # new id and stored twice.
                passing = exc.code in (None, 503) or (exc.code == 409
                                                      and exc.err_code == IN_PROCESS)
                if not passing or time.monotonic() > deadline:
                    raise LogUnavailable(f"the log refused the entry: {exc}") from exc
            except nats.errors.MaxPayloadError:
                raise _too_large(len(payload), self.nc.max_payload) from None
            self.retries += 1
            await asyncio.sleep(RETRY_PAUSE[min(attempt, len(RETRY_PAUSE) - 1)])
            attempt += 1

    def flush_buffered(self) -> None:
        """Send every entry queued by :meth:`Log.publish_soon` (runs on the asyncio thread,
        once per wake-up however many are queued): one task sends them all in order."""
        self.flush_scheduled = False
        if not self.sending:
            self.sending = True
            asyncio.ensure_future(self._send_buffered())

    async def _send_buffered(self) -> None:
        """Pipelined publishes (nats-py's publish_async, no wait for each PubAck before the
        next goes out, no task per publish); a publish that fails, or whose PubAck does, is
        retried by the retrying ``publish`` with the same id."""
        queue = self.buffered
        try:
            while queue:
                subject, payload, msg_id, pending = queue.popleft()
                try:
                    ack = await self.js.publish_async(subject, payload,
                                                      headers={"Nats-Msg-Id": msg_id})
                except (*_RETRY, nats.js.errors.APIError):
                    self._retry(subject, payload, msg_id, pending)
                    continue
                except nats.errors.MaxPayloadError:
                    # Settled, not raised: a raise would end this task and strand the queue.
                    self._settle(pending, None, _too_large(len(payload), self.nc.max_payload))
                    continue
                ack.add_done_callback(functools.partial(self._acked, subject, payload, msg_id,
                                                        pending))
        finally:
            self.sending = False

    def _acked(self, subject: str, payload: bytes, msg_id: str, pending: Pending,
               ack: asyncio.Future) -> None:
        if ack.cancelled() or ack.exception() is not None:
            self._retry(subject, payload, msg_id, pending)
            return
        result = ack.result()
        self._settle(pending, (result.seq, bool(result.duplicate)), None)

    def _retry(self, subject: str, payload: bytes, msg_id: str, pending: Pending) -> None:
        self.retries += 1
        task = asyncio.ensure_future(self.publish(subject, payload, msg_id))

        def done(task: asyncio.Task) -> None:
            if task.cancelled():
                self._settle(pending, None, EngineClosed("the log closed before the PubAck"))
            else:
                error = task.exception()
                self._settle(pending, None if error else task.result(), error)

        task.add_done_callback(done)

    def _settle(self, pending: Pending, result: tuple[int, bool] | None,
                error: BaseException | None) -> None:
        """Gather an outcome; those of one turn of the asyncio loop go to trio together."""
        self.settled.append((pending, result, error))
        if not self.deliver_scheduled:
            self.deliver_scheduled = True
            asyncio.get_running_loop().call_soon(self._deliver)

    def _deliver(self) -> None:
        batch, self.settled, self.deliver_scheduled = self.settled, [], False
        if self.trio_token is None:
            return
        try:
            self.trio_token.run_sync_soon(_settle_all, batch)
        except trio.RunFinishedError:
            pass  # the trio run ended: nobody waits for these any more

    async def subscribe(self, partition: int, start: int, name: str) -> Pull:
        """A fresh pull consumer on one partition from stream sequence ``start``: ephemeral,
        in memory, one replica, no acks (the position lives in the store's watermark)."""
        config = api.ConsumerConfig(
            name=name, deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=max(1, start), ack_policy=api.AckPolicy.NONE,
            filter_subject=partition_subjects(partition), mem_storage=True, num_replicas=1,
            inactive_threshold=max(30.0, self.config.lease_ttl * 2))
        await self.js.add_consumer(self.config.stream, config=config)
        pull = Pull(self.nc, self.js, self.config.stream, name)
        try:
            await pull.open()
        except BaseException:
            await self.drop(pull)
            raise
        return pull

    async def fetch(self, sub: Pull, batch: int, timeout: float) -> list[Delivery]:
        return await sub.fetch(batch, timeout)

    async def drop(self, sub: Pull) -> None:
        """Stop a consumer (unsubscribe and delete it; it would expire by itself anyway)."""
        try:
            await sub.close()
            await self.js.delete_consumer(sub.stream, sub.name)
        except (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError):
            pass  # an ephemeral consumer expires after its inactive threshold

    async def kv_snapshot(self) -> dict[str, tuple[bytes, int]]:
        """Every live key of the lease bucket: key -> (value, revision)."""
        return {k: (value, rev) for k, (value, rev, _) in (await self.kv_entries()).items()}

    async def kv_entries(self) -> dict[str, tuple[bytes, int, Any]]:
        """Every live key of the lease bucket: key -> (value, revision, written at)."""
        watcher = await self.kv.watchall(inactive_threshold=WATCH_IDLE_SECONDS)
        try:
            return await collect_entries(watcher.updates, self._bucket_empty)
        finally:
            await watcher.stop()

    async def _bucket_empty(self) -> bool:
        info = await self.js.stream_info(f"KV_{self.config.bucket}")
        return info.state.messages == 0

    async def last_seq(self) -> int:
        info = await self.js.stream_info(self.config.stream)
        return info.state.last_seq

    async def first_seq(self) -> int:
        info = await self.js.stream_info(self.config.stream)
        return info.state.first_seq

    async def snapshot_mark(self, partition: int) -> int | None:
        try:
            info = await self.objects.get_info(_snapshot_name(partition))
        except nats.js.errors.ObjectNotFoundError:
            return None
        return _mark_of(info)

    async def get_snapshot(self, partition: int, name: str) -> tuple[int, bytes] | None:
        """The snapshot's chunks, read through a pull consumer of their subject (``name``)
        and checked against the object's digest. nats-py's ``ObjectStore.get`` reads them
        with an ordered push consumer, which delivered 7.5 MB in 0.51 s on loopback whatever
        the chunk size; pulled in one batch, 21-26 ms.

        Raises:
            InvalidInput: the chunks are not the object's (its digest, as ``get`` checks it):
                damaged in the store. Not a failure to reach the log: asked again, the same
                chunks would come back.
            LogUnavailable: the chunks did not arrive (replaced meanwhile by a newer one).
        """
        try:
            info = await self.objects.get_info(_snapshot_name(partition))
        except nats.js.errors.ObjectNotFoundError:
            return None
        if not info.size:
            return _mark_of(info), b""
        stream = OBJ_STREAM_TEMPLATE.format(bucket=self.config.objects)
        await self.js.add_consumer(stream, config=api.ConsumerConfig(
            name=name, deliver_policy=api.DeliverPolicy.ALL, ack_policy=api.AckPolicy.NONE,
            filter_subject=OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=self.config.objects,
                                                          obj=info.nuid),
            mem_storage=True, num_replicas=1, inactive_threshold=30.0))
        pull = Pull(self.nc, self.js, stream, name)
        chunks: list[bytes] = []
        try:
            await pull.open()
            while len(chunks) < info.chunks:
                got = await pull.fetch(info.chunks - len(chunks), SCAN_TIMEOUT)
                if not got:
                    raise LogUnavailable(f"snapshot of partition {partition}: {len(chunks)} of "
                                         f"{info.chunks} chunks arrived within {SCAN_TIMEOUT} s")
                chunks += [d.data for d in got]
        finally:
            await self.drop(pull)
        data = b"".join(chunks)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode()
        expected = info.digest.split("=", 1)[-1]
        if expected.rstrip("=") != digest.rstrip("="):
            raise InvalidInput("snapshot", f"expected the {info.size} bytes of partition "
                                           f"{partition}'s snapshot under their sha256 digest "
                                           f"{expected}, found {len(data)} bytes of digest "
                                           f"{digest}: damaged in the object store")
        return _mark_of(info), data

    async def put_snapshot(self, partition: int, watermark: int, data: bytes) -> None:
        name = _snapshot_name(partition)
        await self.objects.put(name, data, meta=api.ObjectMeta(
            name=name, description=msgspec.json.encode({"watermark": watermark}).decode()))

    async def purge(self, subject: str, before: int | None) -> None:
        try:
            await self.js.purge_stream(self.config.stream, subject=subject, seq=before)
        except TRANSIENT as exc:  # no quorum for a moment: the caller answers 503, retry
            raise LogUnavailable(f"purging {subject} failed ({type(exc).__name__}: {exc}); "
                                 "is a quorum of its servers up?") from exc

    async def delete_where(self, subject: str, before: int, match: Callable[[bytes], bool],
                           name: str) -> int:
        """Delete the entries under ``subject`` below stream sequence ``before`` whose bytes
        ``match`` selects, read through a consumer of that subject alone; returns how many.
        One by one: a subject is a user's, and what goes (a session's) is among the rest."""
        config = api.ConsumerConfig(
            name=name, deliver_policy=api.DeliverPolicy.ALL, ack_policy=api.AckPolicy.NONE,
            filter_subject=subject, mem_storage=True, num_replicas=1, inactive_threshold=30.0)
        doomed: list[int] = []
        try:
            await self.js.add_consumer(self.config.stream, config=config)
            pull = Pull(self.nc, self.js, self.config.stream, name)
            try:
                await pull.open()
                while True:
                    got = await pull.fetch(FETCH_BATCH, SCAN_TIMEOUT)
                    if not got:  # the subject ends at ``before`` (the caller's own entry)
                        raise LogUnavailable(f"the log did not deliver {subject} up to "
                                             f"{before} within {SCAN_TIMEOUT} s; nothing was "
                                             "deleted")
                    doomed += [d.stream_seq for d in got
                               if d.stream_seq < before and match(d.data)]
                    if got[-1].stream_seq >= before - 1:
                        break
            finally:
                await self.drop(pull)
        except TRANSIENT as exc:  # no quorum for a moment: the caller answers 503, retry
            raise LogUnavailable(f"reading {subject} to delete from it failed "
                                 f"({type(exc).__name__}: {exc}); nothing was deleted") from exc
        slots = asyncio.Semaphore(DELETES_IN_FLIGHT)

        async def delete(seq: int) -> None:
            async with slots:
                try:
                    await self.js.delete_msg(self.config.stream, seq)
                except nats.js.errors.NotFoundError:
                    pass  # purged or aged out meanwhile

        try:
            await asyncio.gather(*map(delete, doomed))
        except (*_RETRY, nats.js.errors.APIError, nats.errors.Error) as exc:
            raise LogUnavailable(f"deleting {len(doomed)} entries of {subject} failed "
                                 f"({type(exc).__name__}); forgetting again deletes the "
                                 "rest") from exc
        return len(doomed)

    async def close(self) -> None:
        if self.nc is not None and not self.nc.is_closed:
            try:
                await asyncio.wait_for(self.nc.drain(), 5)
            except (asyncio.TimeoutError, nats.errors.Error):
                await self.nc.close()


def _agree(made: str, field: str, mine: float, theirs: float | None) -> None:
    """Refuse a node whose setting differs from the one the cluster's ``made`` (its stream or
    bucket) was created with: every node of one cluster must use the same (another partition
    count files every user under another partition; another lease TTL or duplicate window
    than the bucket's or the stream's breaks what the leases and retries rely on)."""
    if theirs is not None and not math.isclose(mine, theirs, rel_tol=1e-6):
        raise InvalidInput(f"cluster_config.{field}", f"expected {theirs:g}, as {made} was made "
                                                      f"with (every node of a cluster uses the "
                                                      f"same), found {mine:g}")


def _too_large(size: int, max_payload: int) -> InvalidInput:
    return InvalidInput("entry", f"expected a log entry of at most {max_payload - HEADER_ROOM} "
                                 f"bytes (the log servers' max_payload), found {size}")


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


async def collect_entries(next_update: Any, bucket_empty: Any
                          ) -> dict[str, tuple[bytes, int, Any]]:
    """The live keys a KV watcher (``watchall``) hands over: key -> (value, revision, written).

    The watch ends at the entry that was the last one pending when it was delivered (its
    ``delta`` is 0), not at nats-py's "nothing pending" marker (None): the watcher can send
    that marker before any entry, when it asks the server how many are pending after the
    server has already pushed them all. A snapshot that stopped there saw an empty bucket (no
    owners, no members) for a whole lease tick. A None before any entry ends the watch only
    if the bucket's stream really holds nothing.

    Args:
        next_update: the watcher's ``updates`` (awaited with ``timeout=``).
        bucket_empty: awaited; whether the bucket's stream holds no message.

    Raises:
        nats.errors.TimeoutError: no entry within ``PUBLISH_TIMEOUT``.
    """
    out: dict[str, tuple[bytes, int, Any]] = {}
    seen = False
    while True:
        entry = await next_update(timeout=PUBLISH_TIMEOUT)
        if entry is None:
            if seen or await bucket_empty():
                return out
            continue  # the early marker: the entries are still on their way
        seen = True
        if entry.operation in ("DEL", "PURGE"):
            out.pop(entry.key, None)
        else:
            out[entry.key] = (entry.value, entry.revision, entry.created)
        if entry.delta == 0:
            return out


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
                      name: str = "engram", *, create: bool = True) -> Log:
        """Connect to the servers and make sure the stream and the buckets exist.

        Args:
            create: make what is missing (a node, ``cluster init``); False for those that
                only look or write (``cluster status``, a thin client), which must not make
                a cluster of their own settings.

        Raises:
            LogUnavailable: no server answered, or (``create`` False) something is missing.
        """
        config = ClusterConfig.checked(config)
        _check_servers(servers)
        thread = AsyncioThread(f"engram-nats-{name}").start()
        client = _Client(config)
        try:
            await thread.run(client.connect, servers, name)
            await thread.run(client.ensure, create)
        except BaseException as exc:
            with trio.move_on_after(CLOSE_SECONDS, shield=True):
                await thread.run(client.close)  # a connection made before ensure refused
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

    def publish_soon(self, subject: str, payload: bytes, msg_id: str) -> Pending:
        """Start a publish without waiting (from trio); returns its :class:`Pending`, whose
        ``wait()`` gives ``(stream sequence, was a duplicate)``. Publishes queued together go
        out pipelined, after one wake-up of the asyncio thread; their PubAcks come back to
        trio in batches.

        Raises:
            EngineClosed: the log's loop is stopped.
        """
        pending = Pending()
        client = self._client
        if client.trio_token is None:
            client.trio_token = trio.lowlevel.current_trio_token()
        client.buffered.append((subject, payload, msg_id, pending))
        if not client.flush_scheduled:
            client.flush_scheduled = True
            loop = self.thread.loop
            if loop is None:
                raise EngineClosed("the NATS client's loop is stopped")
            loop.call_soon_threadsafe(client.flush_buffered)
        return pending

    async def subscribe(self, partition: int, start: int, name: str) -> Pull:
        """A fresh consumer of partition ``partition`` from stream sequence ``start``."""
        return await self.thread.run(self._client.subscribe, partition, start, name)

    async def fetch(self, sub: Pull, batch: int, timeout: float) -> list[Delivery]:
        """What ``sub`` delivered: at least one entry as soon as one is here, or none after
        ``timeout`` seconds (see :class:`Pull`)."""
        return await self.thread.run(self._client.fetch, sub, batch, timeout)

    async def drop(self, sub: Pull) -> None:
        await self.thread.run(self._client.drop, sub)

    async def last_seq(self) -> int:
        return await self.thread.run(self._client.last_seq)

    async def first_seq(self) -> int:
        """The oldest sequence the stream still holds (past its last one when it is empty):
        what came before aged out (``max_age``) or was purged."""
        return await self.thread.run(self._client.first_seq)

    async def snapshot_mark(self, partition: int) -> int | None:
        """The watermark of the partition's newest snapshot in the object store (None:
        there is none)."""
        return await self.thread.run(self._client.snapshot_mark, partition)

    async def get_snapshot(self, partition: int) -> tuple[int, bytes] | None:
        """The partition's newest snapshot: (its watermark, its bytes), or None.

        Raises:
            InvalidInput: its bytes do not match its digest (damaged in the object store).
        """
        return await self.thread.run(self._client.get_snapshot, partition,
                                     f"snapshot-{os.urandom(6).hex()}")

    async def put_snapshot(self, partition: int, watermark: int, data: bytes) -> None:
        """Store a snapshot of the partition, tagged with its watermark (it replaces the
        previous one)."""
        await self.thread.run(self._client.put_snapshot, partition, watermark, data)

    async def purge(self, subject: str, before: int | None = None) -> None:
        """Remove a subject's entries from the stream (those below ``before`` if given)."""
        await self.thread.run(self._client.purge, subject, before)

    async def delete_where(self, subject: str, before: int,
                           match: Callable[[bytes], bool]) -> int:
        """Remove the entries of ``subject`` below ``before`` that ``match`` selects (a
        predicate over an entry's bytes, run on the log's thread); returns how many."""
        return await self.thread.run(self._client.delete_where, subject, before, match,
                                     f"scan-{os.urandom(6).hex()}")

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
    def max_payload(self) -> int:
        """The largest entry, in bytes, the log takes: the servers' ``max_payload`` (as they
        announced it to this connection), less room for a publish's headers."""
        return self._client.nc.max_payload - HEADER_ROOM

    @property
    def retries(self) -> int:
        """Publish attempts repeated so far (each with the same message id)."""
        return self._client.retries


def _check_servers(servers: Sequence[str]) -> None:
    """Refuse what no server could be at (nats-py's own refusal reads as the log down).

    Raises:
        InvalidInput: on ``nats``, naming the first address that is not nats://HOST[:PORT].
    """
    if isinstance(servers, str) or not servers:
        raise InvalidInput("nats", f"expected nats://HOST:PORT URLs, found {servers!r}")
    for server in servers:
        if not isinstance(server, str) or not server.startswith(("nats://", "tls://")):
            raise InvalidInput("nats", f"expected nats://HOST:PORT URLs, found {server!r} "
                                       f"in {list(servers)!r}")
        try:
            url = urllib.parse.urlsplit(server)
            port = url.port
        except ValueError:
            url, port = None, 0
        if url is None or not url.hostname or port == 0:
            raise InvalidInput("nats", f"expected nats://HOST:PORT URLs (a port from 1 to "
                                       f"65535), found {server!r} in {list(servers)!r}")
