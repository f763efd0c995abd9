"""The log read back in order: what the derived views (the ANN and full-text indexes, the
embedder, the long-term layer) replay from their watermarks, and :class:`LogFollower`, which
feeds it to them and persists how far they got."""

from __future__ import annotations

import logging
from array import array
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple, Protocol, TypeVar

import lmdb
import trio

from ..base.errors import ClockFailed, EngineBroken, EngineClosed, StoreCorrupt
from ..base.messages import PutState, Searchable
from ..base.records import Episode, Fact
from ..base.where import attributes, turn_tags
from .chain import _check_logged
from .codecs import _decode_turn, decode_episode, decode_fact, failure_put
from .layout import (
    LOG_EPISODE,
    LOG_FACT,
    LOG_NOTE,
    LOG_TOMBSTONE,
    LOG_TURN,
    _fact_entry_lsns,
    lsn_key,
)
from .reads import _note_version, read_meta_lsn

T = TypeVar("T")
# How long a step the clock failed waits before it runs again, and for how long in all
# before what the clock failed is kept as failures (a flush waits for the followers).
CLOCK_RETRY_SECONDS = 1.0
CLOCK_WAIT_SECONDS = 30.0
# While nobody waits on a follower and fewer than STEP_RECORDS log positions are unread, its
# next step begins at most STEP_SECONDS after its last one began (:func:`paced`). A step costs
# its thread hops (a read of the log, its writes) and passes of the loop whatever it carries:
# at a few hundred turns a second every commit was a step of one or two turns for each
# follower, and those steps were most of what a buffered turn cost the process. A paused
# follower sees the store close when its pause ends: a close waits that much longer at most.
STEP_SECONDS = 0.02
STEP_RECORDS = 256


async def paced(began: float, unread: int, nudge: trio.lowlevel.ParkingLot,
                until: float = float("inf")) -> bool:
    """Before a follower's step, for a caller that found nobody waiting on it: park on
    ``nudge`` (a waiter's arrival) until STEP_SECONDS after the step before ``began``, or
    ``until`` if sooner, unless ``unread`` reaches STEP_RECORDS. The check and the park are one
    step of the task, so a nudge is never lost between them.

    Returns:
        Whether it paused (the caller looks again before its step)."""
    deadline = min(began + STEP_SECONDS, until)
    if unread >= STEP_RECORDS or trio.current_time() >= deadline:
        return False
    with trio.move_on_at(deadline):
        await nudge.park()
    return True


class FollowedStore(Protocol):
    """What a :class:`LogFollower` needs of the store: reads, the commit position and its wait,
    and unlogged writes. A protocol rather than ``Store`` itself, which imports this module."""

    @property
    def committed_lsn(self) -> int: ...

    def usable(self) -> bool: ...

    async def read(self, fn: Callable[..., T], *args: Any) -> T: ...

    async def wait_commit_beyond(self, lsn: int) -> None: ...

    async def yield_to_receipts(self, before_step: bool = False) -> None: ...

    async def write_unlogged(self, op: PutState) -> None: ...

log = logging.getLogger("engram.store")


class LogFollower:
    """Feeds every committed record past a persisted watermark to ``handle(records, last)``,
    in log order, forever (until the store closes). ``handle`` returns the puts and links to
    commit together with the new watermark, so what it derived and where it got to land in one
    transaction: nothing is derived twice or skipped across crashes.

    :meth:`wait` lets ``Engine.flush`` wait until the follower has passed an lsn.
    """

    def __init__(self, store: FollowedStore, watermark_key: bytes, chunk: int,
                 handle: Callable[[list[Searchable], int], Any],
                 settled: Callable[[], None] | None = None) -> None:
        self._store = store
        self._key = watermark_key
        self.name = watermark_key.decode().removesuffix("_lsn")  # in its failure records
        self._chunk = chunk
        self._handle = handle
        # Called once what a step's handle calls returned is committed, or will never be
        # (the step failed): a cache of what they write can trust the store again.
        self._settled = settled
        self.watermark = 0
        # Awaited before each step with the log's committed end: a follower that must keep
        # behind another (the text index, FullText.keep_behind) waits in it. None: none.
        self.lead: Callable[[int], Awaitable[None]] | None = None
        self._stopped = False
        self._step_began = float("-inf")  # when the last step began (paced)
        # Parked: the follower while paced, until a caller of wait arrives.
        self._nudge = trio.lowlevel.ParkingLot()
        self._clock_failed_at: float | None = None  # when a step first met a broken clock
        self._clock_met = False  # the step under way met it
        # Parked: callers of wait, until the watermark moves or the follower stops.
        self._progress = trio.lowlevel.ParkingLot()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        store = self._store
        try:
            self.watermark = await store.read(read_meta_lsn, self._key)
            task_status.started()
            while True:
                await store.wait_commit_beyond(self.watermark)
                if not self._progress and await paced(
                        self._step_began, store.committed_lsn - self.watermark, self._nudge):
                    continue
                self._step_began = trio.current_time()
                if self.lead is not None:
                    await self.lead(store.committed_lsn)
                await store.yield_to_receipts(before_step=True)
                damaged: list[Damaged] = []
                records, _, last = await store.read(read_log_range, self.watermark,
                                                    store.committed_lsn, self._chunk, damaged)
                if damaged:  # kept as failures; the step goes on without them
                    await store.write_unlogged(PutState(damage_puts(self.name, damaged), (),
                                                        trio.Event()))
                self._clock_met = False
                try:
                    try:
                        await store.yield_to_receipts()
                        await self._step(records, last)
                    except (EngineClosed, EngineBroken):
                        raise
                    except Exception as exc:
                        if not store.usable() or self._waits_for_clock(exc):
                            raise
                        await self._one_by_one(records, last)
                except ClockFailed as exc:
                    # The clock's failure, not the records': they are handled again once it
                    # reads (what a step handles twice, it takes in once).
                    log.warning("%s: waiting for the clock to handle record %d on: %s",
                                self.name, self.watermark + 1, exc)
                    await trio.sleep(CLOCK_RETRY_SECONDS)
                    continue
                finally:
                    if self._settled is not None:
                        self._settled()
                if not self._clock_met:  # a clock that failed the step, even past the wait,
                    self._clock_failed_at = None  # is still the one that failed before
                self.watermark = last
                self._progress.unpark_all()
        except EngineClosed:
            return  # the watermark on disk says where to resume
        finally:
            self._stopped = True
            self._progress.unpark_all()

    async def _step(self, records: list[Searchable], last: int) -> None:
        puts, links = await self._handle(records, last)
        puts = (*puts, (b"meta", self._key, lsn_key(last), 0))
        await self._store.write_unlogged(PutState(puts, links, trio.Event()))

    async def _one_by_one(self, records: list[Searchable], last: int) -> None:
        """A step failed: handle its records one at a time, so that the one that fails is
        kept as a failure (with the watermark past it) and the others are taken in."""
        store = self._store
        for record in records:
            try:
                await self._step([record], record.lsn)
            except (EngineClosed, EngineBroken):
                raise
            except Exception as exc:
                if not store.usable() or self._waits_for_clock(exc):
                    raise
                log.warning("%s: record %d failed and is kept as a failure: %r", self.name,
                            record.lsn, exc)
                put = failure_put(record.lsn, self.name, record.user_id, record.memory_id, exc)
                watermark = (b"meta", self._key, lsn_key(record.lsn), 0)
                await store.write_unlogged(PutState((put, watermark), (), trio.Event()))
            self.watermark = record.lsn  # a retry after the clock failed starts past it
        await store.write_unlogged(PutState(((b"meta", self._key, lsn_key(last), 0),), (),
                                            trio.Event()))

    def _waits_for_clock(self, exc: Exception) -> bool:
        """Whether a step that failed with ``exc`` waits for the clock and runs again: the
        clock raised (ClockFailed), for less than CLOCK_WAIT_SECONDS since a step first met
        it. A clock that stays broken longer is the records' failure, as any other error, in
        this step and those after it, until a step runs without meeting it."""
        if not isinstance(exc, ClockFailed):
            return False
        self._clock_met = True
        now = trio.current_time()
        if self._clock_failed_at is None:
            self._clock_failed_at = now
        return now - self._clock_failed_at < CLOCK_WAIT_SECONDS

    async def wait(self, lsn: int) -> None:
        """Return once every record up to ``lsn`` was handled (or the follower stopped)."""
        while self.watermark < lsn and not self._stopped:
            self._nudge.unpark_all()
            await self._progress.park()


def read_log_range(
    txn: lmdb.Transaction, dbs: dict[bytes, Any], after: int, upto: int, limit: int,
    damaged: list[Damaged] | None = None,
) -> tuple[list[Searchable], list[int], int]:
    """What was logged in (after, upto], in log order, at most ``limit`` records.

    Args:
        damaged: if given, a record that fails its check (StoreCorrupt, StoreTampered) is
            skipped and listed here, for the follower to keep as a failure; else it raises.

    Returns:
        (searchable records, lsns deleted by tombstones in the range, the last lsn looked at).
        Records deleted since they were logged are skipped.
    """
    found: list[Searchable] = []
    deleted: list[int] = []
    last = after
    cursor = txn.cursor(dbs[b"log"])
    if cursor.set_range(lsn_key(after + 1)):
        for key, entry in cursor:
            lsn = int.from_bytes(key, "big")
            if lsn > upto or len(found) >= limit:
                break
            last = lsn
            kind = entry[:1]
            if kind == LOG_TOMBSTONE:
                lsns = array("Q", entry[1:])
                lsns.byteswap()
                deleted.extend(lsns)
                continue
            if kind == LOG_NOTE:
                replaces = int.from_bytes(entry[1:9], "big")
                if replaces:
                    deleted.append(replaces)
            elif kind == LOG_FACT:
                deleted.extend(_fact_entry_lsns(entry)[0])
            try:
                record = searchable_at(txn, dbs, lsn, entry)
            except StoreCorrupt as exc:
                if damaged is None:
                    raise
                damaged.append(Damaged(lsn, _owner(exc.key), exc))
                continue
            if record is not None:
                found.append(record)
    if len(found) < limit:
        last = max(last, upto)
    return found, deleted, last


class Damaged(NamedTuple):
    """A logged record a follower could not read: its lsn, the user its key names (records are
    keyed user first), and the error saying what is wrong with it."""

    lsn: int
    user_id: str
    error: StoreCorrupt


def _owner(key: bytes | None) -> str:
    return "" if key is None else key.split(b"\x00", 1)[0].decode("utf-8", "replace")


def damage_puts(follower: str,
                damaged: list[Damaged]) -> tuple[tuple[bytes, bytes, bytes, int], ...]:
    """The failures a follower keeps for the records it skipped as damaged."""
    for d in damaged:
        log.warning("%s: record %d is damaged and is kept as a failure: %s", follower, d.lsn,
                    d.error)
    return tuple(failure_put(d.lsn, follower, d.user_id, "", d.error) for d in damaged)


def searchable_at(txn: lmdb.Transaction, dbs: dict[bytes, Any], lsn: int,
                  entry: bytes) -> Searchable | None:
    """What the indexes see of the record the log entry at ``lsn`` names; None for a
    tombstone, a record deleted since, a note version replaced since, or a retired fact."""
    kind = entry[:1]
    if kind == LOG_TURN:
        raw = txn.get(entry[1:], db=dbs[b"turns"])
        if raw is None:
            return None
        t = _decode_turn(raw)
        return Searchable(lsn, "turn", t.user_id, t.session_id, t.role, t.at, t.text,
                          turn_tags(t), t.turn_id, t.seq, attributes(t))
    if kind == LOG_NOTE:
        note = _note_version(txn, dbs, entry, lsn)
        if note is None:
            return None
        return Searchable(lsn, "note", note.user_id, "", "", note.updated_at, note.text,
                          note.tags, note.note_id, attrs=attributes(note))
    if kind == LOG_EPISODE:
        raw = txn.get(entry[1:], db=dbs[b"episodes"])
        return None if raw is None else episode_searchable(decode_episode(raw))
    if kind == LOG_FACT:
        raw = txn.get(_fact_entry_lsns(entry)[1], db=dbs[b"facts"])
        fact = None if raw is None else decode_fact(raw)
        return fact_searchable(fact) if fact is not None and fact.status == "active" else None
    return None


def read_searchables(txn: lmdb.Transaction, dbs: dict[bytes, Any],
                     lsns: list[int]) -> list[Searchable]:
    """What the indexes see of the records at these lsns, those still there, in order."""
    log = dbs[b"log"]
    found = []
    for lsn in lsns:
        entry = txn.get(lsn_key(lsn), db=log)
        record = None if entry is None else searchable_at(txn, dbs, lsn, entry)
        if record is not None:
            _check_logged(txn, dbs, lsn_key(lsn), entry)
            found.append(record)
    return found


def episode_searchable(e: Episode) -> Searchable:
    """What the indexes see of an episode: its title, summary and keywords."""
    text = f"{e.title}\n{e.summary}\n{' '.join(e.keywords)}"
    return Searchable(e.lsn, "episode", e.user_id, e.session_id, "", e.end_at, text, (),
                      e.episode_id, attrs=attributes(e))


def fact_searchable(f: Fact) -> Searchable:
    """What the indexes see of a fact: its sentence and keywords (seed 001's search text)."""
    return Searchable(f.lsn, "fact", f.user_id, "", "", f.created_at,
                      f"{f.text}\n{' '.join(f.keywords)}", (f.category,), f.fact_id,
                      attrs=attributes(f))


