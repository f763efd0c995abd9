"""The writer: the op queue, group commit, and the waits for a commit.

py-lmdb binds a write transaction to the thread that began it, so:

- Writes are group-committed: everything queued while one commit runs becomes the next batch,
  and each batch is one write transaction begun and committed inside one ``to_thread.run_sync``
  call. The queue is appended to synchronously on the trio thread, so log order is call order
  and a cancelled caller can never leave a hole in the sequence; backpressure happens *before*
  a sequence number is taken (:meth:`Writer.reserve`).
- One op that cannot be written (a key LMDB refuses, a value that does not encode) is refused
  alone: the batch is written again with each op in a nested transaction, and the refused op's
  log position gets an empty tombstone.
- With fsync on, the environment runs with LMDB's MDB_NOMETASYNC: each commit writes its pages
  and fdatasyncs them *before* it writes the meta page that makes them the current tree, and
  leaves that meta page to the next flush. A batch *lands* (its receipts are released, derived
  views learn of it, ``committed_lsn`` passes it) once a flush that began after its commit
  returned has returned: an ``env.sync()`` on the sync task's own thread, or the next commit's
  own fdatasync, whichever ends first. So the writer commits the next batch while the last one's
  meta page is flushed, and a power cut can undo only a batch that has not landed (LMDB keeps
  the previous meta page and every page it points to intact), never corrupt the store.
  A batch a caller waits for, when nothing was queued behind it by the time its commit
  returned, is flushed at once by the writer's own thread: there is no next batch for the sync
  thread to overlap, and the caller is spared two thread hops and a pass of the trio loop.
- Every durable receipt's way is timed in stages (:data:`STAGES`, ``receipt_stages``): a few
  clock reads a batch and two a receipt, so ``stats()`` can say where a receipt's time goes.
"""

from __future__ import annotations

import contextlib
import contextvars
import heapq
import logging
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from itertools import repeat
from pathlib import Path
from typing import Any

import lmdb
import msgspec
import trio

from ..base.errors import (LOW_ON_DISK, EngineBroken, EngineClosed, EngineError, InvalidInput,
                           RecordRefused, disk_full, free_bytes)
from ..base.messages import (
    AppendTurn,
    AppendTurns,
    DeleteNote,
    Forget,
    PutEpisode,
    PutFact,
    PutLink,
    PutNote,
    PutState,
    PutVectors,
    ScrubDone,
    StoreOp,
    WriteSummary,
)
from ..base.records import SessionInfo, Turn
from .chain import _chain_in, _chain_turns, _tombstone_in
from . import gil
from .codecs import _encode, failure_put
from .integrity import CheckedTxn, encode_head
from .layout import _LAST_LSN_KEY, HEAD_KEY, LOG_TURN, lsn_key

log = logging.getLogger("engram.store")

QUEUE_LIMIT = 16_384  # queued turns before callers wait: ~4 full batches means the disk is behind
BATCH_MAX = 4_096  # ops per write transaction, so one commit (and the waiters behind it) stays short
COMMIT_TIME_STEP = 0.1  # seconds one commit-time sample covers: how precise a lag in seconds is
COMMIT_TIMES = 100_000  # samples kept: ~2.8 hours of constant commits at one per step
# Errors of one op (a key LMDB cannot hold, a value that cannot be encoded): the op is refused
# alone and the rest of its batch commits. Any other lmdb.Error is the disk's and breaks the store.
_OP_ERRORS = (lmdb.BadValsizeError, ValueError, TypeError, OverflowError, msgspec.MsgspecError)
REFUSALS_KEPT = 1024  # refused lsns remembered for their waiters
# Ops the writer takes into a batch while a flush that callers wait on is under way: planning
# and writing a batch is Python that holds the GIL, and the flush's callers are released on
# the trio thread, which needs it.
BATCH_MAX_WHILE_WAITED = 256
# The longest a follower waits before a step for an import's queued turns to commit
# (yield_to_receipts): an import of up to ~50k turns runs alone here; behind a longer one every
# follower still takes a step a second.
IMPORT_YIELD_SECONDS = 1.0
RECEIPTS_TIMED = 1024  # the latest durable receipts whose stages receipt_stages summarises
# A durable receipt's way from the caller to its release, in order (nanoseconds each):
#   queued      its turn waits in the queue until the writer takes its batch
#   to_writer   the hop to the writer's thread
#   plan        the batch is cut into runs for the transaction (writer's thread)
#   write       the puts and the hash chain, inside the transaction
#   commit      LMDB's commit: the pages written and fdatasynced, the meta page written
#   flush_wait  until the flush that lands it begins (0: flushed by the writer's own thread)
#   flush       that flush: an fdatasync (or the next commit's, which lands it as well)
#   to_trio     the hop back to the trio thread, until the batch lands there
#   wake        from the landing until the caller's task runs again
STAGES = ("queued", "to_writer", "plan", "write", "commit", "flush_wait", "flush", "to_trio",
          "wake")
_clock = time.perf_counter_ns


def _if_full(path: Path, error: lmdb.Error) -> str:
    """What to add to a failed write's message when the disk holding ``path`` is full: LMDB
    reports a write the disk had no room for as EIO (a short pwrite), which reads as a failing
    device."""
    if disk_full(error):
        return ": the disk is full; free space and open the store again"
    free = free_bytes(path)
    if free is None or free >= LOW_ON_DISK:
        return ""
    return (f" (the disk holding it has {free:,} bytes free: the disk is full; free space and "
            "open the store again)")


def _first(failure: BaseException) -> BaseException:
    """The first failure itself inside the groups a nursery wrapped it in."""
    while isinstance(failure, BaseExceptionGroup) and failure.exceptions:
        failure = failure.exceptions[0]
    return failure


class _Commit:
    """What one write transaction did, as its worker thread saw it: the clock (ns) when it
    began, when its batch was planned, when LMDB's commit began and returned, and when the
    flush the thread ran itself began and ended (0: none)."""

    __slots__ = ("began", "planned", "committing", "committed", "synced", "flush_began",
                 "flush_ended")

    def __init__(self, began: int) -> None:
        self.began = self.planned = began
        self.committing = self.committed = began
        self.synced = False  # the commit wrote, and so fdatasynced, something
        self.flush_began = self.flush_ended = 0


class _Landing:
    """A committed batch on its way to landing: what its ops return, what was refused, the last
    lsn it logged and how many ops it took, and the clock (ns) at each stage of its way
    (``times``, indexed as STAGES' ends: taken, began, planned, committing, committed,
    flush began, flush ended, landed)."""

    __slots__ = ("results", "refused", "last", "count", "number", "times")

    def __init__(self, results: list[tuple[Any, Any]], refused: list[tuple[Any, BaseException]],
                 last: int | None, count: int, number: int, times: list[int]) -> None:
        self.results = results
        self.refused = refused
        self.last = last
        self.count = count
        self.number = number  # commits ever made by this process, this one included
        self.times = times


class Attached:
    """Puts that ride along with the ops one task queues (:meth:`Writer.attached`).

    Attributes:
        puts: ``PutState`` puts written in the same transaction as each op.
        ops: how many ops took them so far.
        together: the most ops :meth:`Writer.hold_together` held in one transaction here
            (ops up to that many commit with one another, and with the puts).
    """

    __slots__ = ("puts", "ops", "together")

    def __init__(self, puts: tuple[tuple[bytes, bytes, bytes | None, int], ...]) -> None:
        self.puts = puts
        self.ops = 0
        self.together = 1


# The puts attached to every op the current task queues (None: none). A context variable, so
# the ops of other tasks queued meanwhile (the embedder's, a retrieval's use counts) are not
# taken into the group.
_ATTACHED: contextvars.ContextVar[Attached | None] = contextvars.ContextVar(
    "engram_store_attached", default=None)


class _Slot:
    """One queue slot of an AppendTurns' turns, but its last (which holds the op): queue limits
    and batches count turns. Takes no log position of its own."""

    __slots__ = ()
    lsn = None


_SLOT = _Slot()


class _Puts:
    """One run of appends between deletions, as columns (one item per turn) for a
    ``putmulti`` per database: lists of bytes, which the garbage collector does not track."""

    __slots__ = ("ops", "keys", "values", "id_keys", "lsns", "entries", "sessions")

    def __init__(self) -> None:
        # For writing them one by one if the run fails.
        self.ops: list[AppendTurn | AppendTurns] = []
        self.keys: list[bytes] = []  # in ``turns``
        self.values: list[bytes] = []  # the turns encoded
        self.id_keys: list[bytes] = []  # in ``ids``, each to its key
        self.lsns: list[bytes] = []  # lsn keys in ``log``
        self.entries: list[bytes] = []  # their log entries
        self.sessions: list[tuple[bytes, bytes]] = []  # one put per session


def _plan(ops: list[StoreOp]) -> list[Any]:
    """Cut a batch into runs of appends and other ops, in order. Runs on the writer's thread:
    it is Python over every op (4-5 ms for 3,000 turns queued one by one), which on the trio
    thread would hold back every receipt's landing and every buffered turn meanwhile."""
    segments: list[Any] = []
    puts = _Puts()
    latest: dict[bytes, Turn] = {}  # each session's last turn in the run
    spans: dict[bytes, tuple[datetime, datetime]] = {}  # and its earliest and latest time

    def close_run() -> None:
        for key, t in latest.items():
            started_at, last_at = spans[key]
            info = SessionInfo(t.user_id, t.session_id, started_at, last_at, t.seq + 1,
                               t.agent_id, t.run_id)
            puts.sessions.append((key, _encode(info)))
        segments.append(puts)

    for op in ops:
        kind = type(op)
        if kind is AppendTurn:
            t = op.turn
            puts.ops.append(op)
            puts.keys.append(op.key)
            puts.values.append(op.value)
            puts.id_keys.append(op.id_key)
            puts.lsns.append(lsn_key(t.lsn))
            puts.entries.append(LOG_TURN + op.key)
            key = op.key[:-9]  # the turn key less NUL + seq is the sessions key
            latest[key] = t
            spans[key] = (op.started_at, op.last_at)
        elif kind is _Slot:
            continue  # its AppendTurns follows
        elif kind is AppendTurns:
            puts.ops.append(op)
            puts.keys += op.keys
            puts.values += op.values
            puts.id_keys += op.id_keys
            puts.lsns += op.lsns
            puts.entries += map(LOG_TURN.__add__, op.keys)
            for key, (first_at, last_at, last) in op.sessions.items():
                latest[key] = last
                spans[key] = (first_at, last_at)
        else:
            if puts.keys:
                close_run()
                puts, latest = _Puts(), {}
            segments.append(op)
    if puts.keys:
        close_run()
    return segments


def _put_run(txn: CheckedTxn, dbs: dict[bytes, Any], seg: _Puts) -> None:
    """A run of appends, one putmulti per database."""
    added = txn.cursor(dbs[b"turns"]).put_columns(seg.keys, seg.values)[1]
    txn.cursor(dbs[b"ids"]).put_columns(seg.id_keys, seg.keys)
    txn.cursor(dbs[b"sessions"]).putmulti(seg.sessions)
    logged = txn.cursor(dbs[b"log"]).put_columns(seg.lsns, seg.entries, append=True)[1]
    if added != len(seg.keys) or logged != len(seg.lsns):
        raise AssertionError(
            f"store invariant broken: {len(seg.keys)} turns to write, "
            f"{added} new keys, {logged} of {len(seg.lsns)} log entries appended"
        )


def _put_one(txn: lmdb.Transaction, dbs: dict[bytes, Any], op: AppendTurn) -> None:
    """One append on its own (a run that failed is written again turn by turn)."""
    t = op.turn
    txn.put(op.key, op.value, db=dbs[b"turns"])
    txn.put(op.id_key, op.key, db=dbs[b"ids"])
    txn.put(lsn_key(t.lsn), LOG_TURN + op.key, db=dbs[b"log"])
    info = SessionInfo(t.user_id, t.session_id, op.started_at, op.last_at, t.seq + 1,
                       t.agent_id, t.run_id)
    txn.put(op.key[:-9], _encode(info), db=dbs[b"sessions"])


def _each_turn(ops: list[AppendTurn | AppendTurns]) -> Iterator[AppendTurn]:
    """A run's appends one turn at a time (to find the one that cannot be written)."""
    for op in ops:
        if type(op) is AppendTurn:
            yield op
        else:
            yield from map(op.one, range(len(op.turns)))


def _op_identity(op: Any) -> tuple[str, str]:
    """(user id, memory id) of an op, as far as it names them, for its failure record."""
    match op:
        case AppendTurn():
            return op.turn.user_id, op.turn.turn_id
        case PutNote():
            return op.note.user_id, op.note.note_id
        case PutEpisode():
            return op.episode.user_id, op.episode.episode_id
        case PutFact():
            return op.user_id, op.fact.fact_id if op.fact is not None else ""
        case DeleteNote():
            return op.user_id, op.note_id
    return getattr(op, "user_id", None) or "", ""


def _read_only_error() -> InvalidInput:
    return InvalidInput("read_only", "expected an engine that owns the store, found one opened "
                                     "with read_only=True, which writes nothing; open the store "
                                     "with Engine.open(path) where it is served")


class Writer:
    """The writing side of :class:`~.store.Store`: the op queue, group commit, refusals and
    the waits for a commit. Its state is set up in ``Store.__init__``."""

    # -- writes ------------------------------------------------------------------------------

    @property
    def next_lsn(self) -> int:
        """The sequence number the next queued op will get."""
        return self._next_lsn

    @property
    def committed_lsn(self) -> int:
        """Every op up to this sequence number is committed."""
        return self._committed_lsn

    @property
    def queued(self) -> int:
        return self._queued

    def committed_since(self, lsn: int) -> float:
        """How long ago (trio time, seconds) ``lsn`` was committed, to within COMMIT_TIME_STEP;
        0 if it is not committed yet. An lsn committed before this process opened the store
        counts from the open; past COMMIT_TIMES samples, from the oldest kept."""
        times = self._commit_times
        if lsn > self._committed_lsn or not times:
            return 0.0
        low, high = 0, len(times) - 1
        while low < high:  # the first sample covering lsn
            mid = (low + high) // 2
            if times[mid][0] < lsn:
                low = mid + 1
            else:
                high = mid
        return trio.current_time() - times[low][1]

    def check_usable(self) -> None:
        """Raise if ops can no longer be taken.

        Raises:
            EngineBroken: the store failed.
            EngineClosed: the store is closing.
        """
        if self._failure is not None:
            raise EngineBroken(f"the store failed ({_first(self._failure)}); reopen it to "
                               "go on") from self._failure
        if self._closing:
            raise EngineClosed("the engine is closed; open a new one with Engine.open(path)")

    def usable(self) -> bool:
        """Whether ops can still be taken (see :meth:`check_usable`)."""
        return self._failure is None and not self._closing

    async def reserve(self, n: int) -> None:
        """Wait until ``n`` more ops fit in the queue. Cancel-safe: nothing is taken yet.

        Returns at once, without a checkpoint, when there is room: this is the hot path.
        """
        while self._queued and self._queued + n > QUEUE_LIMIT:
            self.check_usable()
            await self._room.park()
        self.check_usable()
        if self.read_only:
            raise _read_only_error()

    def has_room(self, n: int) -> bool:
        """Whether ``n`` more ops fit in the queue now: :meth:`reserve` would not wait.

        Raises:
            EngineBroken / EngineClosed: as :meth:`check_usable`.
        """
        self.check_usable()
        return not (self._queued and self._queued + n > QUEUE_LIMIT)

    def submit(self, op: StoreOp) -> None:
        """Queue an op whose lsn is :attr:`next_lsn`, or a derived op with none. Synchronous, so
        queue order is lsn order."""
        if self.read_only:
            raise _read_only_error()
        if op.lsn is not None:
            if op.lsn != self._next_lsn:
                raise AssertionError(f"op lsn {op.lsn} submitted, expected {self._next_lsn}")
            self._next_lsn += 1
        attached = _ATTACHED.get()
        if attached is not None:
            # The op and its attached puts, next to each other and in one transaction.
            attached.ops += 1
            self._groups.append((self._submitted, self._submitted + 2))
            self._enqueue(op)
            op = PutState(attached.puts)
        self._enqueue(op)

    def submit_turns(self, op: AppendTurns) -> None:
        """Queue a run of turns whose first lsn is :attr:`next_lsn`. Synchronous, like
        :meth:`submit`. It takes one queue slot per turn, so :meth:`reserve` and the batches
        count its turns: the op sits in the last of its slots, and the commit loop never cuts
        a batch inside them (nor between them and puts :meth:`attached` adds)."""
        if self.read_only:
            raise _read_only_error()
        first, count = op.turns[0].lsn, len(op.turns)
        if first != self._next_lsn:
            raise AssertionError(f"op lsns from {first} submitted, expected {self._next_lsn}")
        self._next_lsn += count
        self._bulk_until = self._next_lsn - 1
        attached = _ATTACHED.get()
        taken = count if attached is None else count + 1
        if taken > 1:
            self._groups.append((self._submitted, self._submitted + taken))
        queue = self._queue
        queue.extend(repeat(_SLOT, count - 1))
        queue.append(op)
        if attached is not None:
            attached.ops += 1
            queue.append(PutState(attached.puts))
        self._queued += taken
        self._submitted += taken
        if self._wakeup:
            self._wakeup.unpark_all()

    def _enqueue(self, op: StoreOp) -> None:
        self._queue.append(op)
        self._queued += 1
        self._submitted += 1
        if self._wakeup:
            self._wakeup.unpark_all()

    @contextlib.contextmanager
    def attached(self, puts: tuple[tuple[bytes, bytes, bytes | None, int], ...]
                 ) -> Iterator[Attached]:
        """Within the block, every op the current task queues commits in one write
        transaction with ``puts`` (a ``PutState``'s), which follow it. A cluster's applier
        runs a logged call this way, with the partition's watermark: the call's write and the
        watermark land together or not at all. The yielded :class:`Attached` counts the ops
        that took the puts (0: the call wrote nothing, and the caller writes them itself).

        Reserve one extra queue slot for each op: the puts take one.
        """
        attached = Attached(puts)
        token = _ATTACHED.set(attached)
        try:
            yield attached
        finally:
            _ATTACHED.reset(token)

    def hold_together(self, count: int) -> None:
        """Make the next ``count`` ops queued commit in one write transaction: the commit loop
        never cuts a batch inside them (a batch may then pass BATCH_MAX by their number).
        Queue them without a checkpoint in between. A cluster's applier writes turns and the
        partition's watermark this way. Within :meth:`attached`, each op takes the puts after
        it, and the group holds those too."""
        attached = _ATTACHED.get()
        if attached is not None:
            attached.together = max(attached.together, count)
            count *= 2
        if count > 1:
            self._groups.append((self._submitted, self._submitted + count))

    def _batch_size(self) -> int:
        """Ops the next write transaction takes: up to BATCH_MAX, never cutting a group."""
        groups, written = self._groups, self._taken
        while groups and groups[0][1] <= written:
            groups.popleft()
        limit = BATCH_MAX_WHILE_WAITED if self._sync_waited else BATCH_MAX
        end = written + min(len(self._queue), limit)
        for first, last in groups:
            if first >= end:
                break
            if first < end < last:
                end = last
        return min(end - written, len(self._queue))

    async def wait_logged(self) -> None:
        """Return once every op logged before the call is committed, for a caller that then
        reads what is stored. An op the store refused is its own caller's to hear of (its
        receipt, the next ``flush``), not this one's: a read goes on without it.

        Raises:
            EngineBroken: the store failed first.
            EngineClosed: the engine closed first.
        """
        try:
            await self.wait_committed(self._next_lsn - 1)
        except RecordRefused:
            pass

    async def wait_committed(self, lsn: int) -> None:
        """Return once every op up to ``lsn`` is committed.

        Raises:
            EngineBroken: the store failed before committing it.
            EngineClosed: the engine closed before committing it.
        """
        if lsn <= self._committed_lsn:
            await trio.lowlevel.checkpoint()
            if lsn in self._refused:
                raise self._refused[lsn]
            return
        if self._failure is not None or self._env is None:
            raise self._not_committed_error()
        self._tiebreak += 1
        event = trio.Event()  # set once the commit covering lsn lands, or the store fails
        waited = _clock()
        # [lsn, tiebreak, event, the landing's times once it lands]: ordered by lsn, then
        # arrival; the event is never compared.
        waiter = [lsn, self._tiebreak, event, None]
        heapq.heappush(self._waiters, waiter)
        self._prioritise_receipts(True)
        await event.wait()
        if waiter[3] is not None:
            self._receipt_times.append((waited, waiter[3], _clock()))
        if lsn > self._committed_lsn:
            raise self._not_committed_error()
        if lsn in self._refused:
            raise self._refused[lsn]

    def _not_committed_error(self) -> EngineError:
        if self._failure is None:
            return EngineClosed("the engine closed before this write was committed")
        error = EngineBroken(f"the store failed before committing this write "
                             f"({_first(self._failure)}); reopen it to go on")
        error.__cause__ = self._failure
        return error

    def take_refused(self, upto: int) -> list[RecordRefused]:
        """The refusals of logged ops up to ``upto`` that no earlier call returned (for
        ``Engine.flush``, which promises everything acknowledged before it is on disk)."""
        taken = [lsn for lsn in self._unreported if lsn <= upto]
        return [self._unreported.pop(lsn) for lsn in taken]

    async def wait_written(self) -> None:
        """Return once every op queued before the call is committed, whether it took a log
        position or not (vectors, links, derived state).

        Raises:
            EngineBroken: the store failed first.
            EngineClosed: the store closed first.
        """
        target = self._submitted
        while self._written < target:
            if self._failure is not None or self._env is None:
                raise self._not_committed_error()
            await self._batches.park()
        await trio.lowlevel.checkpoint()

    async def wait_commit_beyond(self, lsn: int) -> None:
        """Return once the committed log passes ``lsn`` (at once if it already has).

        Raises:
            EngineClosed: the store closed first.
        """
        while self._committed_lsn <= lsn:
            if self._closing:
                raise EngineClosed("the store is closing")
            await self._commits.park()
        await trio.lowlevel.checkpoint()

    @property
    def receipts_waiting(self) -> bool:
        """Whether a caller waits for a commit to land (background loops check it cheaply)."""
        return bool(self._waiters)

    def receipt_stages(self) -> dict[str, dict[str, float]]:
        """Where the latest durable receipts' time went (up to RECEIPTS_TIMED of them): for
        each of :data:`STAGES` and ``total``, the median, 99th percentile and maximum in
        milliseconds; empty if no receipt waited yet. A receipt awaited after its batch was
        taken counts its queued stage as 0."""
        rows = []
        for waited, times, woken in self._receipt_times:
            ends = (waited, *times, woken)
            rows.append((*(max(0, ends[i + 1] - ends[i]) for i in range(len(STAGES))),
                         woken - waited))
        summary: dict[str, dict[str, float]] = {}
        for i, name in enumerate((*STAGES, "total")):
            values = sorted(row[i] for row in rows)
            if values:
                summary[name] = {"p50_ms": values[len(values) // 2] / 1e6,
                                 "p99_ms": values[min(len(values) - 1,
                                                      len(values) * 99 // 100)] / 1e6,
                                 "max_ms": values[-1] / 1e6}
        return summary

    async def yield_to_receipts(self, before_step: bool = False) -> None:
        """Background work (the log's followers) calls this before each step (``before_step``)
        and between parts of a long one, so a step's Python and its GIL-holding reads do not
        run in front of a caller.

        - While a caller waits for a commit to land (a durable receipt, a forget): until the
          next batch lands, which releases that caller first. One landing at most: a steady
          stream of receipts slows the followers, never starves them.
        - While turns a bulk append queued (``add_turns``, ``import_user``) are not all
          committed: between the parts of a step, until the next landing; before a step,
          until they are all committed, for at most :data:`IMPORT_YIELD_SECONDS` (then one
          more landing if a receipt waits). On two cores with one GIL, an index stepping beside the import
          halves the import's rate and gains nothing overall: it catches up behind the
          import. The bound keeps every index moving behind an import that does not end.

        Otherwise a checkpoint."""
        importing = self._committed_lsn < self._bulk_until
        if not (importing or self._waiters) or not self.usable():
            await trio.lowlevel.checkpoint()
            return
        if importing and before_step:
            with trio.move_on_after(IMPORT_YIELD_SECONDS):
                while self._committed_lsn < self._bulk_until and self.usable():
                    await self._landed.park()
            if self._waiters and self.usable():
                await self._landed.park()
        else:
            await self._landed.park()
        # The landing woke its callers and this step in one scheduling batch, which trio runs
        # in random order: one more turn, so the callers run before the step does.
        await trio.lowlevel.cancel_shielded_checkpoint()

    async def write_unlogged(self, *ops: PutVectors | PutLink | WriteSummary | PutState
                             | ScrubDone) -> None:
        """Queue ops that take no log position, together (one batch, unless it fills), and
        wait for their commit.

        Raises:
            RecordRefused: the store could not write an op (the first refused; every other
                op, and the rest of their batch, landed).
            EngineBroken / EngineClosed: the store failed or closed first.
        """
        self.check_usable()
        for op in ops:
            self.submit(op)
        for op in ops:
            await op.done.wait()
        refused = [self._refused_ops.pop(id(op), None) for op in ops]
        first = next((exc for exc in refused if exc is not None), None)
        if first is not None:
            raise first
        if self._failure is not None:
            raise self._not_committed_error()

    async def forget(self, user_id: str, session_id: str | None,
                     committed: Callable[[list[int]], None] | None = None) -> None:
        """Delete a session or a user and wait until that is committed. ``committed`` gets the
        deleted lsns on the trio thread, in commit order with every other op."""
        await self.reserve(1)
        lsn = self._next_lsn
        self.submit(Forget(lsn, user_id, session_id, committed))
        await self.wait_committed(lsn)

    async def _commit_loop(self) -> None:
        """Commit queued ops, one write transaction per batch, until closed and drained; then
        wait for the last batch to land."""
        while True:
            if not self._queue:
                if self._closing:
                    break
                await self._wakeup.park()
                continue
            n = self._batch_size()
            queue = self._queue
            if n == len(queue):
                ops = list(queue)
                queue.clear()
            else:
                ops = [queue.popleft() for _ in range(n)]
            self._taken += n
            taken = _clock()
            last = None  # logged ops are queued in lsn order: the batch's last is its highest
            for op in reversed(ops):
                if op.lsn is not None:
                    last = op.lsn
                    break
            # A caller waits for this batch: its commit may be flushed by the writer's thread.
            flush = (self._meta_deferred and last is not None and bool(self._waiters)
                     and self._waiters[0][0] <= last)
            while (written := await trio.to_thread.run_sync(
                self._plan_and_write, ops, last, flush, limiter=self._write_limiter
            )) is None:
                await self._grow_map()
            (results, refused), commit = written
            self._queued -= n
            if self._room:
                self._room.unpark_all()
            self._commit_count += 1
            landing = _Landing(results, refused, last, n, self._commit_count,
                               [taken, commit.began, commit.planned, commit.committing,
                                commit.committed, commit.flush_began, commit.flush_ended, 0])
            if not self._meta_deferred:
                # fsync off: no flush to wait for (kill -9 safe only)
                landing.times[5] = landing.times[6] = commit.committed
                self._land(landing)
            elif commit.flush_ended:
                # Flushed by the writer's thread after the commit returned: this batch and
                # every one before it are on disk.
                self._landings.append(landing)
                self._land_upto(self._commit_count, commit)
            else:
                if commit.synced:
                    # This commit's fdatasync ran after every earlier commit's meta page was
                    # written: they are all on disk now.
                    self._land_upto(self._commit_count - 1, commit)
                self._landings.append(landing)
                if not self._queue or self._waited(landing):
                    self._want_sync()
            # The callers just released (by this commit's own fdatasync) run before the next
            # batch is taken (up to BATCH_MAX ops; BATCH_MAX_WHILE_WAITED while the sync loop's
            # flush has callers): no receipt waits on work that came after it.
            # Twice: trio runs the tasks of one scheduling batch in random order, so the first
            # resumption may come before theirs; by the second, each of them has run.
            await trio.lowlevel.cancel_shielded_checkpoint()
            await trio.lowlevel.cancel_shielded_checkpoint()
        self._writer_done = True
        self._want_sync()  # the last batches land, or the sync loop sees it may end
        while self._landings and self._failure is None:
            await self._batches.park()

    def _waited(self, landing: _Landing) -> bool:
        """Whether a caller waits for ``landing`` now: a receipt or a forget on one of its
        lsns, an unlogged op's writer, or a ``flush``."""
        if self._waiters and landing.last is not None and self._waiters[0][0] <= landing.last:
            return True
        if self._batches:
            return True
        return any(getattr(op, "done", None) is not None for op, _ in landing.results)

    def _want_sync(self) -> None:
        self._sync_requested = True
        self._sync_kick.unpark_all()

    async def _sync_loop(self) -> None:
        """Flush the environment whenever a committed batch waits to land, on a thread of its
        own, so the writer commits the next batch meanwhile; land what the flush covered.

        A flush covers every commit that had returned when it began (LMDB: mdb_env_sync is
        fdatasync of the data file, and may run beside a write transaction)."""
        while True:
            while not self._sync_requested:
                if self._writer_done and not self._landings:
                    return
                await self._sync_kick.park()
            self._sync_requested = False
            covered = self._commit_count
            if not self._landings:
                continue  # a later commit's own fdatasync landed them meanwhile
            self._sync_waited = self._waited(self._landings[-1])
            try:
                flushed = await trio.to_thread.run_sync(self._timed_sync,
                                                        limiter=self._sync_limiter)
            finally:
                self._sync_waited = False
            self._land_upto(covered, flushed)

    def _timed_sync(self) -> _Commit:
        """:meth:`_sync`, timed (worker thread): its start and end as a flush's."""
        flushed = _Commit(0)
        flushed.flush_began = _clock()
        self._sync()
        flushed.flush_ended = _clock()
        return flushed

    def _sync(self) -> None:
        """fdatasync of the data file (worker thread)."""
        try:
            self._env.sync(True)
        except lmdb.Error as exc:
            raise EngineBroken(f"flushing the store at {self.path} failed: {exc}") from exc

    def _land_upto(self, number: int, flush: _Commit) -> None:
        """Land the batches up to commit ``number``, which ``flush`` (its own flush, a sync's,
        or a later commit whose fdatasync covers them) put on disk."""
        landings = self._landings
        while landings and landings[0].number <= number:
            landing = landings.popleft()
            times = landing.times
            if not times[6]:  # landed by a later commit's fdatasync, or by the sync thread
                times[5], times[6] = ((flush.flush_began, flush.flush_ended) if flush.flush_ended
                                      else (flush.committing, flush.committed))
            self._land(landing)

    def _land(self, landing: _Landing) -> None:
        """A batch is on disk: release its callers, tell the derived views. Trio thread, in
        commit order."""
        last = landing.last
        if last is not None:
            # The waiters first: they have the least Python between the flush and them.
            self._committed_lsn = last
            waiters = self._waiters
            if waiters and waiters[0][0] <= last:
                times = landing.times
                times[7] = _clock()
                while waiters and waiters[0][0] <= last:
                    waiter = heapq.heappop(waiters)
                    waiter[3] = times
                    waiter[2].set()
                if not waiters:
                    self._prioritise_receipts(False)
        for op, error in landing.refused:
            self._refuse(op, error)
        self._written += landing.count
        if self._batches:
            self._batches.unpark_all()
        if self._landed:
            self._landed.unpark_all()
        # Derived views learn of each op here, on the trio thread and in commit order, so
        # none can apply a deletion before the write it deletes.
        for op, result in landing.results:
            committed = getattr(op, "committed", None)
            if committed is not None:
                committed(result)
            done = getattr(op, "done", None)
            if done is not None:
                done.set()
        if last is None:
            return
        now, times = trio.current_time(), self._commit_times
        if now - times[-1][1] < COMMIT_TIME_STEP:
            times[-1] = (last, times[-1][1])
        else:
            times.append((last, now))
        if self._commits:
            self._commits.unpark_all()

    def _refuse(self, op: StoreOp, error: BaseException) -> None:
        """Tell the op's caller (trio thread): its waiter raises RecordRefused, nobody else."""
        lsn = op.lsn or 0
        user_id, memory_id = _op_identity(op)
        named = f" {memory_id!r} of user {user_id!r}" if memory_id else ""
        refusal = RecordRefused(lsn, f"the store refused the record at lsn {lsn}{named} "
                                     f"({type(op).__name__}): {type(error).__name__}: {error}; "
                                     "the rest of its batch was written", memory_id)
        log.warning("%s", refusal)
        if op.lsn is not None:
            self._refused[op.lsn] = refusal
            self._unreported[op.lsn] = refusal
            while len(self._refused) > REFUSALS_KEPT:
                del self._refused[next(iter(self._refused))]
            while len(self._unreported) > REFUSALS_KEPT:
                del self._unreported[next(iter(self._unreported))]
        elif getattr(op, "done", None) is not None:
            self._refused_ops[id(op)] = refusal
            op.done.set()

    def _plan_and_write(self, ops: list[StoreOp], last_lsn: int | None, flush: bool
                        ) -> tuple[tuple[list[tuple[Any, Any]],
                                         list[tuple[Any, BaseException]]], _Commit] | None:
        """:func:`_plan` the batch, then :meth:`_write` it (worker thread); the commit's clock
        starts before the plan."""
        began = _clock()
        segments = _plan(ops)
        planned = _clock()
        written = self._write(segments, last_lsn, flush)
        if written is not None:
            written[1].began, written[1].planned = began, planned
        return written

    def _write(self, segments: list[Any], last_lsn: int | None, flush: bool
               ) -> tuple[tuple[list[tuple[Any, Any]], list[tuple[Any, BaseException]]],
                          _Commit] | None:
        """One write transaction (worker thread). If one op cannot be written, the batch is
        written again with each op in a nested transaction, so only that op is left out.
        With ``flush`` (a caller waits for the batch), the environment is flushed right
        after the commit if nothing was queued meanwhile: no next commit would overlap it.

        Returns:
            (((op, result) for every op that is not an append, in order; (op, error) for every
            op refused), the :class:`_Commit`: whether the commit wrote (and so fdatasynced)
            anything, as LMDB commits an empty transaction without touching the file, and
            whether this thread flushed it); None if the map was full and nothing was written.
        """
        env = self._env
        commit = _Commit(_clock())
        before = env.info()["last_txnid"]
        try:
            try:
                written = self._write_batch(segments, last_lsn, False, commit)
            except _OP_ERRORS:
                # some op of the batch cannot be written: find it, write the others
                written = self._write_batch(segments, last_lsn, True, commit)
        except lmdb.MapFullError:
            return None
        except lmdb.Error as exc:
            raise EngineBroken(f"writing to the store at {self.path} failed: {exc}"
                               f"{_if_full(self.path, exc)}") from exc
        commit.committed = _clock()
        commit.synced = env.info()["last_txnid"] != before
        # The queue's length read from this thread: one atomic read under the GIL. Stale, it
        # costs a caller a flush's wait or a batch a flush's delay, never a landing too early:
        # the flush begins after the commit returned, whatever is queued.
        if flush and commit.synced and not self._queue:
            commit.flush_began = _clock()
            self._sync()
            commit.flush_ended = _clock()
        return written, commit

    def _write_batch(self, segments: list[Any], last_lsn: int | None, isolate: bool,
                     commit: _Commit) -> tuple[list[tuple[Any, Any]],
                                               list[tuple[Any, BaseException]]]:
        """The batch in one transaction; with ``isolate``, each op (or run of appends, then
        each append of a run that fails) in a nested one, and a refused op's log position
        gets an empty tombstone, chained like any entry."""
        dbs = self._dbs
        results: list[tuple[Any, Any]] = []
        refused: list[tuple[Any, BaseException]] = []
        digest = self._head[1]
        with self._env.begin(write=True) as raw_txn:
            txn = CheckedTxn(raw_txn, self._names)
            for seg in segments:
                if type(seg) is _Puts:
                    if not isolate:
                        _put_run(txn, dbs, seg)
                    elif self._nested(txn, _put_run, dbs, seg)[1] is not None:
                        for op in _each_turn(seg.ops):
                            error = self._nested(txn, _put_one, dbs, op)[1]
                            if error is None:
                                digest = _chain_turns(txn, dbs, [lsn_key(op.lsn)],
                                                      [LOG_TURN + op.key], [op.value], digest)
                            else:
                                refused.append((op, error))
                                digest = _tombstone_in(txn, dbs, op.lsn, digest)
                        continue
                    # The chain, here in the writer thread: hashing stays off the loop.
                    digest = _chain_turns(txn, dbs, seg.lsns, seg.entries, seg.values, digest)
                    continue
                txn.removed = []
                if not isolate:
                    result, error = self._appliers[type(seg)](txn, seg), None
                else:
                    result, error = self._nested(txn, self._appliers[type(seg)], seg)
                if error is not None:
                    refused.append((seg, error))
                    if seg.lsn is not None:
                        digest = _tombstone_in(txn, dbs, seg.lsn, digest)
                    continue
                results.append((seg, result))
                if seg.lsn is not None:
                    digest = _chain_in(txn, dbs, seg.lsn, digest)
                elif txn.removed:
                    raise AssertionError(f"{type(seg).__name__} took no log position and "
                                         f"removed log entries {txn.removed}")
            for op, error in refused:
                _, key, value, _ = failure_put(op.lsn or 0, "store", *_op_identity(op), error)
                txn.put(key, value, db=dbs[b"failures"])
            if last_lsn is not None:
                txn.put(_LAST_LSN_KEY, lsn_key(last_lsn), db=dbs[b"meta"])
                txn.put(HEAD_KEY, encode_head(last_lsn, digest, self._key), db=dbs[b"meta"])
            commit.committing = _clock()  # leaving the block commits
        if last_lsn is not None:
            self._head = (last_lsn, digest)
        return results, refused

    def _nested(self, txn: CheckedTxn, apply: Callable[..., Any], *args: Any
                ) -> tuple[Any, BaseException | None]:
        """``apply(child, *args)`` in a transaction nested in ``txn``: kept if it succeeds,
        rolled back alone if it raises one op's error."""
        child = CheckedTxn(self._env.begin(write=True, parent=txn.raw), self._names)
        try:
            result = apply(child, *args)
        except _OP_ERRORS as exc:
            child.raw.abort()
            return None, exc
        except BaseException:
            child.raw.abort()
            raise
        child.raw.commit()
        txn.removed.extend(child.removed)
        return result, None

    def _fail(self, exc: BaseException | None) -> None:
        """Stop taking ops and wake every waiter: with ``exc``, the store failed (they hear
        EngineBroken); without, it was cancelled (EngineClosed)."""
        if self._failure is None:
            self._failure = exc
        self._closing = True
        self._wake_all_waiters()
        self._room.unpark_all()
        self._commits.unpark_all()
        self._landed.unpark_all()

    def _prioritise_receipts(self, waiting: bool) -> None:
        """While a caller waits for a commit to land, hold the interpreter's switch interval
        at ``receipt_switch_us`` (:mod:`.gil`): each thread on its way gets the GIL back within
        it, not within 5 ms. Called with whether a caller waits now; idempotent."""
        if waiting == self._switch_lowered or not self._receipt_switch:
            return
        if waiting:
            gil.lower(self._receipt_switch)
        else:
            gil.release()
        self._switch_lowered = waiting

    def _wake_all_waiters(self) -> None:
        # Woken waiters compare their lsn with committed_lsn (or look at _failure) and raise
        # if theirs did not land.
        while self._waiters:
            heapq.heappop(self._waiters)[2].set()
        self._prioritise_receipts(False)
        self._batches.unpark_all()
        for op in self._queue:
            done = getattr(op, "done", None)  # unlogged ops carry an event for their writer
            if done is not None:
                done.set()
