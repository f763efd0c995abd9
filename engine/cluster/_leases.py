"""Who owns which partition: leases in a JetStream KV bucket, renewed by their holders.

A lease is the key ``partition.<p>`` whose value names the holder (node id and incarnation).
Claim = ``create`` (fails if anyone holds it), renew = ``update`` on the revision the holder
last wrote, release = ``delete`` on that revision: every change is a compare-and-set, so two
nodes never both believe they hold a partition after a write succeeded. The bucket's TTL is the
lease TTL, so a lease nobody renews expires by itself; holders renew every TTL/5. Membership is
the live ``node.<id>`` heartbeat keys (same TTL). Each tick a node aims at
``ceil(partitions / nodes)``: it claims free partitions while below, hands one back while above.

A renewal that fails because the log had no leader (an election after a server died) is not a
loss: the holder keeps trying, and if the lease expired meanwhile and nobody took it, the next
``create`` re-acquires it. A node restarted within the TTL finds its own node id on its
leases and adopts them (an ``update`` on their revision), so its partitions do not move.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
import trio

from ..errors import EngineClosed
from ._log import TRANSIENT, Log, LogUnavailable

__all__ = ["Leases", "LeaseValue", "Beat", "plan", "LEASE_PREFIX", "NODE_PREFIX"]

log = logging.getLogger("engine.cluster")

LEASE_PREFIX = "partition."
NODE_PREFIX = "node."
# Errors that say the bucket could not answer (no quorum, no leader, connection down): the
# lease's fate is unknown, so nothing is concluded from them.
_UNSURE = (nats.errors.TimeoutError, nats.errors.NoRespondersError,
           nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError,
           nats.js.errors.NoStreamResponseError, nats.js.errors.ServiceUnavailableError,
           TimeoutError)


# The key is not at the revision this node wrote (or not there at all): someone else's now.
_MOVED = (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.KeyNotFoundError,
          nats.js.errors.KeyDeletedError)


class LeaseValue(msgspec.Struct, frozen=True):
    """What a lease holds: its holder."""

    node: str
    incarnation: str


class Beat(msgspec.Struct, frozen=True):
    """A node's heartbeat: it is alive, and where its HTTP API answers."""

    node: str
    incarnation: str
    http: str


# Seconds after another node's key is due to expire before this node ticks: the server drops
# an expired key at its time; this covers the timer and the watch that reads the bucket.
EXPIRY_MARGIN = 0.25
# Seconds a router waits for a lease it reads from the bucket (:meth:`Leases.lookup`): a
# healthy bucket answers in ~1 ms; one without a leader would hold the request for the log
# client's whole timeout (2 s), and the caller is better told NoOwner and to retry.
LOOKUP_SECONDS = 0.25
# What a lookup concludes nothing from: the bucket or the client unavailable or closing.
_LOOKUP_UNSURE = (*_UNSURE, *TRANSIENT, EngineClosed, LogUnavailable, msgspec.DecodeError)

_lease_decode = msgspec.json.Decoder(LeaseValue).decode
_beat_decode = msgspec.json.Decoder(Beat).decode
_encode = msgspec.json.encode


def plan(me: str, partitions: int, owners: dict[int, str], members: set[str]
         ) -> tuple[list[int], int | None]:
    """What a node does this tick to reach its fair share.

    Args:
        me: this node's id.
        partitions: the cluster's partition count.
        owners: partition -> holder node id, for every held lease.
        members: the live nodes (this one included).

    Returns:
        (free partitions to claim, lowest first, up to the share; a partition to hand back,
        or None). Claims and a hand-back never come together.
    """
    members = members | {me}
    share = math.ceil(partitions / len(members))
    mine = sorted(p for p, node in owners.items() if node == me)
    if len(mine) > share:
        # Hand back the highest: claims take the lowest, so one partition moves once.
        return [], mine[-1]
    free = [p for p in range(partitions) if p not in owners]
    return free[: max(0, share - len(mine))], None


class Leases:
    """This node's leases and its view of everyone's. ``await nursery.start(leases.run)``.

    Args:
        log: the cluster's log (its KV bucket holds the leases).
        node: this node's id (stable across restarts).
        incarnation: unique per process start.
        http: this node's HTTP base URL, published in its heartbeat.
        acquired / lost: called (awaited, in this task) when a partition becomes this node's
            or stops being it.
        clock: seconds, monotonic (tests may inject one).
    """

    def __init__(self, log: Log, node: str, incarnation: str, http: str,
                 acquired: Callable[[int], Awaitable[None]],
                 lost: Callable[[int], Awaitable[None]],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log = log
        self.config = log.config
        self.node = node
        self.incarnation = incarnation
        self.http = http
        self._acquired = acquired
        self._lost = lost
        self._clock = clock
        self.held: dict[int, int] = {}  # partition -> revision this node last wrote
        self.confirmed: dict[int, float] = {}  # partition -> clock time its last write was sent
        self.owners: dict[int, LeaseValue] = {}  # everyone's, as last seen
        self.members: dict[str, Beat] = {}  # live nodes, as last seen
        self.counts = {"claimed": 0, "lost": 0, "reacquired": 0, "released": 0, "adopted": 0,
                       "unsure": 0}
        self._adoptable: dict[int, int] = {}  # leases of an earlier incarnation of this node
        # Keys the last snapshot missed, kept in the view from the one before (for one tick).
        self._kept_owners: set[int] = set()
        self._kept_members: set[str] = set()
        self._value = _encode(LeaseValue(node, incarnation))
        self.ready = trio.Event()  # set after the first tick: the view of owners is filled
        # Clock time the first key of another node is due to expire, as the last tick read
        # the bucket (None: no such key): the next tick comes right after it.
        self.next_expiry: float | None = None

    # -- the view (any task) -----------------------------------------------------------------

    def owner(self, partition: int) -> LeaseValue | None:
        return self.owners.get(partition)

    def url_of(self, node: str) -> str | None:
        beat = self.members.get(node)
        return None if beat is None else beat.http

    async def lookup(self, partition: int) -> tuple[LeaseValue | None, str | None]:
        """The partition's holder and where its HTTP API answers, read from the bucket now
        rather than as of the last tick, and kept in the view.

        The view refreshes once a tick (TTL/5), so for up to a tick after a partition moves
        it names the old holder, or none; a router asks here before answering NoOwner. When
        the bucket cannot answer within LOOKUP_SECONDS, the view's entry stands.
        """
        key = LEASE_PREFIX + str(partition)
        fallback = self.owners.get(partition)
        unsure = fallback, None if fallback is None else self.url_of(fallback.node)
        lease: LeaseValue | None = None
        with trio.move_on_after(LOOKUP_SECONDS):
            try:
                lease = _lease_decode((await self.log.kv("get", key)).value)
            except _MOVED:
                self.owners.pop(partition, None)
                return None, None
            except _LOOKUP_UNSURE:
                return unsure
        if lease is None:  # timed out
            return unsure
        self.owners[partition] = lease
        beat = self.members.get(lease.node)
        # A member that joined since the last tick, or one restarted since (perhaps on another
        # port: what answers at its old address may be anything now): read its heartbeat.
        url = beat.http if beat is not None and beat.incarnation == lease.incarnation else None
        if url is None:
            fresh = None
            with trio.move_on_after(LOOKUP_SECONDS):
                try:
                    fresh = _beat_decode((await self.log.kv("get", NODE_PREFIX + lease.node)
                                          ).value)
                except (*_MOVED, *_LOOKUP_UNSURE):
                    pass
            if fresh is not None:
                self.members[fresh.node] = beat = fresh
            url = None if beat is None else beat.http  # unread: the address known before
        return lease, url

    def serving(self, partition: int) -> bool:
        """Whether this node holds the partition and confirmed that within the TTL."""
        at = self.confirmed.get(partition)
        return (partition in self.held and at is not None
                and self._clock() - at < self.config.lease_ttl)

    # -- the loop ------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Tick every TTL/5 until cancelled, and right after another node's key is due to
        expire; releases every held lease on the way out.

        A dead node's leases and heartbeat expire a TTL after it last renewed them, anywhere
        within a tick of ours: at TTL/5 alone, its partitions were claimed up to TTL/5 after
        they expired (18 s of a 15 s TTL), where a tick at the expiry claims them at once."""
        await self._tick_once()
        self.ready.set()
        task_status.started()
        try:
            while True:
                wait = self.config.lease_ttl / 5
                if self.next_expiry is not None:
                    wait = min(wait, max(0.0, self.next_expiry - self._clock()) + EXPIRY_MARGIN)
                await trio.sleep(wait)
                await self._tick_once()
        finally:
            with trio.CancelScope(shield=True) as scope:
                scope.deadline = trio.current_time() + 5
                await self.release_all()

    async def _tick_once(self) -> None:
        try:
            await self.tick()
        except TRANSIENT as exc:
            # The bucket failed in a way the steps below did not expect: nothing is concluded,
            # the next tick tries again (a lease this node holds stays until it expires).
            self.counts["unsure"] += 1
            log.warning("lease tick failed: %r", exc)

    async def tick(self) -> None:
        """One round: heartbeat, refresh the view, renew, then claim or hand back."""
        try:
            await self._beat()
            snapshot = await self.log.kv_entries()
        except _UNSURE as exc:
            self.counts["unsure"] += 1
            log.info("lease bucket unavailable this tick (%s); renewing what we hold",
                     type(exc).__name__)
            await self._renew_all()
            return
        owners, members = self._read(snapshot)
        await self._renew_all()
        claims, release = plan(self.node, self.config.partitions,
                               {p: v.node for p, v in owners.items()}, set(members))
        if release is not None:
            await self.release(release)
        # Survivors of a dead node read the bucket at about the same time and aim at the
        # same lowest free partitions: a claim another node won moves on to the next free
        # one, so this tick still ends at the share, not a whole tick short of it.
        wanted = len(claims)
        for p in [p for p in range(self.config.partitions) if p not in owners]:
            if not wanted:
                break
            claimed = await self._claim(p)
            if claimed is None:
                break  # the bucket is unavailable: the next tick decides
            if claimed:
                wanted -= 1

    def _read(self, snapshot: dict[str, tuple[bytes, int, datetime]]
              ) -> tuple[dict[int, LeaseValue], dict[str, Beat]]:
        """Take a snapshot of the bucket (key -> value, revision, written at) into the view;
        return what the snapshot itself holds (owners, members), for planning; and note when
        the first key of another node is due to expire (:attr:`next_expiry`).

        A watch of the bucket can end without a key that was renewed while it ran (its old
        revision gone, the new one delivered after the watch's last pending entry). Such a
        key stays in the view (``owners``, ``members``: where the router forwards) for one
        more tick rather than leaving it for a whole tick, which made the router answer 503
        NoOwner on a balanced cluster. Plans use only the snapshot: a claim of a lease that is
        still held fails on its revision, and fewer members never make a node hand back.
        """
        owners: dict[int, LeaseValue] = {}
        members: dict[str, Beat] = {}
        written: list[datetime] = []  # when the keys of other nodes were last written
        for key, (value, revision, at) in snapshot.items():
            try:
                if key.startswith(LEASE_PREFIX):
                    lease = _lease_decode(value)
                    p = int(key[len(LEASE_PREFIX):])
                    owners[p] = lease
                    if lease.node == self.node and p not in self.held:
                        self._adoptable[p] = revision
                    elif lease.node != self.node:
                        written.append(at)
                elif key.startswith(NODE_PREFIX):
                    beat = _beat_decode(value)
                    members[beat.node] = beat
                    if beat.node != self.node:
                        written.append(at)
            except (msgspec.DecodeError, ValueError):
                log.warning("ignoring a malformed key in the lease bucket: %r", key)
        # The servers' clock says when a key was written; the wait until its expiry is taken
        # on that clock and counted on ours from now (a skew only moves the extra tick).
        due = [(at - datetime.now(timezone.utc)).total_seconds() + self.config.lease_ttl
               for at in written if isinstance(at, datetime) and at.tzinfo is not None]
        self.next_expiry = self._clock() + min(due) if due else None
        kept_owners = {p: v for p, v in self.owners.items()
                       if p not in owners and p not in self._kept_owners}
        kept_members = {n: b for n, b in self.members.items()
                        if n not in members and n not in self._kept_members}
        self._kept_owners, self._kept_members = set(kept_owners), set(kept_members)
        self.owners, self.members = kept_owners | owners, kept_members | members
        return owners, members

    async def _beat(self) -> None:
        key = NODE_PREFIX + self.node
        value = _encode(Beat(self.node, self.incarnation, self.http))
        await self.log.kv("put", key, value)

    async def _renew_all(self) -> None:
        for p, revision in list(self._adoptable.items()):
            await self._adopt(p, revision)
        self._adoptable = {}
        for p in list(self.held):
            await self._renew(p)

    async def _adopt(self, p: int, revision: int) -> None:
        """A lease with this node's id from an earlier incarnation: take it over."""
        sent = self._clock()
        try:
            self.held[p] = await self.log.kv("update", LEASE_PREFIX + str(p), self._value,
                                             last=revision)
        except _MOVED:
            return
        except _UNSURE:
            self.counts["unsure"] += 1
            return
        self.confirmed[p] = sent
        self.owners[p] = LeaseValue(self.node, self.incarnation)
        self.counts["adopted"] += 1
        await self._acquired(p)

    async def _renew(self, p: int) -> None:
        # A lease is confirmed from when its write was sent: the bucket's TTL runs from when
        # it took the write, before the answer came (a slow answer would stretch it).
        key = LEASE_PREFIX + str(p)
        sent = self._clock()
        try:
            self.held[p] = await self.log.kv("update", key, self._value, last=self.held[p])
            self.confirmed[p] = sent
            return
        except _UNSURE:
            self.counts["unsure"] += 1
            return  # unknown: keep it, try again next tick
        except _MOVED:
            pass
        # The revision moved. A renewal of ours that the bucket took but whose answer was
        # lost (a timeout on a loaded machine) moved it too: the key holds this
        # incarnation's value at a revision we never heard of. Keep the lease then, renewed
        # on that revision next tick; its confirmation stays the last write we heard of, as
        # the one that landed was sent at an unknown time since (up to a tick ago).
        try:
            entry = await self.log.kv("get", key)
        except _UNSURE:
            self.counts["unsure"] += 1
            return  # unknown: keep it, try again next tick
        except _MOVED:
            entry = None  # gone (expired, deleted)
        if entry is not None and entry.value == self._value:
            self.held[p] = entry.revision
            return
        # Either the lease expired (no key) and nobody took it, so take it again, or
        # someone else holds it now.
        sent = self._clock()
        try:
            self.held[p] = await self.log.kv("create", key, self._value)
            self.confirmed[p] = sent
            self.counts["reacquired"] += 1
            log.info("partition %d: lease expired while unconfirmed; re-acquired", p)
            return
        except _UNSURE:
            self.counts["unsure"] += 1
            return
        except _MOVED:
            pass
        await self._drop(p, "lost")

    async def _claim(self, p: int) -> bool | None:
        """Claim ``p``: True once held, False if another node holds it, None if the bucket
        did not answer."""
        sent = self._clock()
        try:
            self.held[p] = await self.log.kv("create", LEASE_PREFIX + str(p), self._value)
        except _MOVED:
            return False  # someone was faster
        except _UNSURE:
            return None
        self.confirmed[p] = sent
        self.owners[p] = LeaseValue(self.node, self.incarnation)
        self.counts["claimed"] += 1
        await self._acquired(p)
        return True

    async def release(self, p: int) -> None:
        """Hand a partition back (delete on the revision this node wrote)."""
        revision = self.held.get(p)
        if revision is None:
            return
        await self._drop(p, "released")
        try:
            await self.log.kv("delete", LEASE_PREFIX + str(p), last=revision)
        except (*_MOVED, *_UNSURE, *TRANSIENT):
            # It moved on, or the bucket refused: either way it expires by itself within
            # the TTL, and a node stopping goes on releasing the others.
            pass
        self.owners.pop(p, None)

    async def release_all(self) -> None:
        for p in list(self.held):
            await self.release(p)
        try:
            await self.log.kv("delete", NODE_PREFIX + self.node)
        except (*_UNSURE, *TRANSIENT):
            pass

    async def _drop(self, p: int, why: str) -> None:
        self.held.pop(p, None)
        self.confirmed.pop(p, None)
        self.counts[why] += 1
        await self._lost(p)

    def figures(self) -> dict[str, Any]:
        return {"held": sorted(self.held), **self.counts}
