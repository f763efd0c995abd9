"""FullText actor: BM25 over every searchable record, restricted to one user inside the query.

It follows the store's log like the embedder does and owns the only ``IndexWriter``, used from
one task (tantivy raises on concurrent use of a writer rather than waiting). Documents are
committed in log order, in batches: when COMMIT_DOCS are pending, COMMIT_INTERVAL after the
first pending one, or at once when a caller of ``wait_indexed`` is waiting; each commit
(~0.1-0.2 s) runs in a worker thread and is followed by a reload. Searches take a fresh searcher
and may run from several threads at once.

What a search asks is built by ``query.py``; the index's schema, documents and files are
``index.py``'s.

The index is a derived view. Because commits follow the log in order, the highest lsn in the
committed index is its watermark: on open the log is replayed from there (re-applying a
deletion is harmless), and a missing or unreadable index is rebuilt from the start of the log.

A damaged, incomplete or stale index (one covering log positions the store does not have, or
failing :func:`check_index`) is deleted and rebuilt from the store in the background, logged
with its progress; until the rebuild passes what the store held at open,
:attr:`FullText.catching_up` is True and recall says so. tantivy's panics are caught here and
treated like any other damage.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import shutil
from pathlib import Path
from collections.abc import Callable
from typing import Any

import tantivy
import trio

from ..base.errors import (LOW_ON_DISK, EngineBroken, EngineClosed, access_denied, disk_full,
                           free_bytes, out_of_descriptors)
from ..base.messages import PutState, Searchable
from ..base.where import Node
from ..store import (Damaged, Store, damage_puts, failure_put, paced, read_log_range,
                     read_searchables)
from .index import (
    ANALYZER,
    FOLLOW_CHUNK,
    WRITER_HEAP,
    IndexDamaged,
    _analyzer,
    _check_schema,
    _copy_committed,
    _is_panic,
    _meta_lock,
    _schema,
    check_index,
    write_records,
)
from .query import QueryBuilder, TextFilters

__all__ = ["FullText"]

log = logging.getLogger("engram.fulltext")

COMMIT_DOCS = 4_096  # pending documents that trigger a commit
COMMIT_INTERVAL = 1.0  # seconds a document may wait for its commit when nobody is waiting
# Seconds between attempts to go on after a commit the process had no file descriptor for,
# and between the warnings that it still waits.
DESCRIPTOR_RETRY = 1.0
DESCRIPTOR_WARN = 30.0
DAMAGED_SUFFIX = ".damaged-"  # a damaged index moved aside before it is removed


def _remove(path: Path) -> None:
    """Remove a damaged index moved aside, as far as it can go now (a folder, or a file that
    stood where the folder goes); what is left goes at the next open."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass
SEARCH_THREADS = 2  # concurrent searches: one per core
PROGRESS_EVERY = 50_000  # log positions between progress lines of a rebuild
# Pending documents that trigger a commit while the index catches up with what the store held
# at open: each commit costs ~0.1-0.2 s and a segment to merge, and nothing of a catch-up is
# searchable before it ends anyway (recall flags the text leg meanwhile).
CATCH_UP_COMMIT_DOCS = 65_536
PURGE_ROUNDS = 3  # re-index passes a purge makes at most (a merge may land between two)
# keep_behind: how far the index may lag before a follower that keeps behind it waits (a
# step of its reading, which live traffic rarely lags by), and the longest such a wait lasts.
# Above the pacing's STEP_RECORDS, so an index that lags this far is never paused by it.
LEAD_SLACK = 2_048
LEAD_SECONDS = 1.0


class FullText:
    """The actor. Start ``run`` in the nursery; it stops when the store closes."""

    def __init__(self, path: Path, store: Store, read_only: bool = False) -> None:
        self.path = path
        self._store = store
        # Only search the index as its owner (another process) last committed it.
        self._read_only = read_only
        self._analyzer = _analyzer()
        self._schema = _schema()
        self._queries = QueryBuilder(self._schema, self._analyzer)
        self._index: tantivy.Index | None = None
        self._writer: Any = None
        self._reloading = False  # a commit landed that searches do not see yet
        self._indexed_lsn = 0  # every log record up to here is searchable (indexed_lsn)
        self._read_lsn = 0  # every log record up to here has been handed to the writer
        self._pending = 0  # documents and deletions not yet committed
        self._pending_since = 0.0
        self._step_began = -math.inf  # when the follower's last step began (paced)
        self._waiters = 0  # callers of wait_indexed
        # Parked: the follower, until new commits in the store or a waiter nudges it.
        self._nudge = trio.lowlevel.ParkingLot()
        # Parked: callers of wait_indexed, until a commit covers their lsn.
        self._indexed = trio.lowlevel.ParkingLot()
        # Parked: followers in keep_behind, until the index reads further or stops.
        self._advanced = trio.lowlevel.ParkingLot()
        self._search_limiter = trio.CapacityLimiter(SEARCH_THREADS)
        # Held by the follower around each commit, and by copy_to so that no commit lands while
        # the committed files are copied.
        self._commit_lock = trio.Lock()
        self._closed = False
        self.rebuilt = False  # the index was missing or unreadable and was rebuilt on open
        self.damage: str | None = None  # why the index found at open was not used
        self.open_lsn = 0  # what the store held at open; below it the index is incomplete
        self._purge_target = 0  # purge once the index covers this lsn (a deletion's)
        self._purged = 0  # every purge asked for up to this lsn is done
        # Parked: callers of purge, until the purge covering their lsn is done.
        self._purges = trio.lowlevel.ParkingLot()

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def indexed_lsn(self) -> int:
        """Every log record up to here is searchable, and applied to the index durably."""
        return self._indexed_lsn

    @indexed_lsn.setter
    def indexed_lsn(self, lsn: int) -> None:
        self._indexed_lsn = lsn
        if not self._read_only:
            # What the store's fact entries need not carry any more (Store's attribute).
            self._store.retirements_applied_lsn = lsn

    async def keep_behind(self, lsn: int) -> None:
        """Wait until the index has read the log to within :data:`LEAD_SLACK` of ``lsn``, or
        stopped, for at most :data:`LEAD_SECONDS`. The long-term layer's followers call it
        before each step (:class:`~actors.store.LogFollower`'s ``lead``): after an import, the
        index that makes the turns findable by their words catches up first instead of
        sharing the cores with them step for step (200k imported turns were all in the index
        43-47 s after the import began when every follower stepped in turn, 17-20 s keeping
        behind it, 15 s with the layer off; the layer itself took 212 s either way).
        Bounded, so the layer keeps moving behind an index that never catches up."""
        if self._closed or self._read_only or self._read_lsn + LEAD_SLACK >= lsn:
            await trio.lowlevel.checkpoint()
            return
        with trio.move_on_after(LEAD_SECONDS):
            while not self._closed and self._read_lsn + LEAD_SLACK < lsn:
                await self._advanced.park()

    @property
    def catching_up(self) -> bool:
        """True while the index lacks records the store held when the engine opened (a
        rebuild or a long replay): a search may miss them."""
        return self.indexed_lsn < self.open_lsn

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.open_lsn = self._store.committed_lsn
        if self._read_only:
            await trio.to_thread.run_sync(self._open_read_only)
            task_status.started()
            try:
                await self._store.wait_commit_beyond(self._store.committed_lsn)
            except EngineClosed:
                pass
            return
        await trio.to_thread.run_sync(self._open)
        self._read_lsn = self.indexed_lsn
        behind = self._store.committed_lsn - self.indexed_lsn
        if behind > 0:
            log.info("fulltext: replaying %d log positions from %d%s", behind, self.indexed_lsn,
                     " (index rebuilt)" if self.rebuilt else "")
        task_status.started()
        try:
            await self._follow()
        except EngineClosed:
            pass  # closed while it waited for a file descriptor: the next open replays
        finally:
            self._closed = True
            self._indexed.unpark_all()
            self._advanced.unpark_all()
            self._purges.unpark_all()
            with trio.CancelScope(shield=True):
                try:
                    if self._pending:
                        await trio.to_thread.run_sync(self._commit)
                        self.indexed_lsn = self._read_lsn
                except Exception as exc:
                    if self._shortage(exc) is None:
                        raise
                    # The next open indexes again from the last commit: nothing is lost.
                    log.warning("fulltext: the last commit at close failed (%s); the next open "
                                "indexes from log position %d", exc, self.indexed_lsn)
                finally:
                    # Even when the commit failed (a full disk): the store's reopen needs it.
                    await trio.to_thread.run_sync(self._release_writer)

    def _release_writer(self) -> None:
        """Finish merges and drop the writer: tantivy's directory lock goes with it, so the
        next engine on this store can open its own, even if the merges fail."""
        if self._writer is not None:
            writer, self._writer = self._writer, None
            try:
                writer.wait_merging_threads()
            finally:
                del writer  # not kept alive by a failure's traceback, nor its lock

    def _open(self) -> None:
        committed = self._store.committed_lsn
        for left in self.path.parent.glob(f"{self.path.name}{DAMAGED_SUFFIX}*"):
            _remove(left)
        # No index where the store has records: it was lost (or never built) and is rebuilt.
        self.rebuilt = (not (self.path / "meta.json").exists() and committed > 0)
        if self.rebuilt:
            self.damage = "missing"
        try:
            self.path.mkdir(parents=True, exist_ok=True)  # a file of that name: damage too
            if (self.path / "meta.json").exists():
                check_index(self.path)
                _check_schema(self.path)
            index = tantivy.Index(self._schema, path=str(self.path), reuse=True)
            index.register_tokenizer(ANALYZER, self._analyzer)
            top = self._max_lsn(index)
            if top > committed:
                raise IndexDamaged(f"it covers log position {top} and the store ends at "
                                   f"{committed}: it belongs to another copy of the store")
        except BaseException as exc:  # PanicException is a BaseException; let the rest pass
            if not isinstance(exc, (IndexDamaged, ValueError, OSError, RuntimeError)
                              ) and not _is_panic(exc):
                raise
            if disk_full(exc):  # the disk's state, not the index's: it is kept
                raise EngineBroken(f"cannot open the text index at {self.path}: {exc}: the "
                                   "disk is full; free space and open the store again") from exc
            self.damage = str(exc) or type(exc).__name__
            log.warning("fulltext: the index at %s is damaged (%s); deleting it and rebuilding "
                        "it from the store's %d log positions", self.path, self.damage, committed)
            index = None
            # Moved aside first, then removed: a thread of the damaged index (tantivy's meta
            # watcher) can still put a file in it, which made a plain rmtree fail now and then
            # with "Directory not empty"; what is left aside goes at the next open.
            aside = self.path.with_name(f"{self.path.name}{DAMAGED_SUFFIX}{os.getpid()}")
            _remove(aside)
            os.rename(self.path, aside)
            _remove(aside)
            self.path.mkdir(parents=True)
            index = tantivy.Index(self._schema, path=str(self.path), reuse=False)
            index.register_tokenizer(ANALYZER, self._analyzer)
            top = 0
            self.rebuilt = True
        self._index = index
        try:
            self._writer = index.writer(heap_size=WRITER_HEAP, num_threads=1)
            # A commit cut short by a crash leaves files meta.json never listed; replaying the
            # same operations would write the same names (FileAlreadyExists), so they go first
            # (which rewrites the index's list of its files).
            self._writer.garbage_collect_files()
        except (ValueError, OSError) as exc:
            if disk_full(exc):
                raise EngineBroken(f"cannot open the text index at {self.path}: {exc}: the "
                                   "disk is full; free space and open the store again") from exc
            raise
        self.indexed_lsn = top

    def _open_read_only(self) -> None:
        """Open the index its owner last committed, checked, without a writer; a missing or
        damaged one is left alone (it is the owner's) and searches find nothing."""
        if not (self.path / "meta.json").exists():
            self.damage = "missing"
            return
        try:
            with _meta_lock(self.path):  # the owner deletes no listed file meanwhile
                check_index(self.path)
            index = tantivy.Index(self._schema, path=str(self.path), reuse=True)
            index.register_tokenizer(ANALYZER, self._analyzer)
            self.indexed_lsn = self._max_lsn(index)
            self._index = index
        except BaseException as exc:
            if not isinstance(exc, (IndexDamaged, ValueError, OSError, RuntimeError)
                              ) and not _is_panic(exc):
                raise
            self.damage = str(exc) or type(exc).__name__
            if access_denied(exc):
                # tantivy's reader takes a lock file it must be able to write (a read-only
                # file system, another user's folder): the index is not damaged.
                log.warning("fulltext: the index at %s cannot be read by this process (%s): "
                            "recall searches without its keyword leg, and says so in "
                            "degraded", self.path, self.damage)
                return
            log.warning("fulltext: the index at %s is damaged (%s); its owner rebuilds it when "
                        "it next opens the store", self.path, self.damage)

    def _max_lsn(self, index: tantivy.Index) -> int:
        searcher = index.searcher()
        if searcher.num_docs == 0:
            return 0
        hits = searcher.search(tantivy.Query.all_query(), limit=1, order_by_field="lsn",
                               order=tantivy.Order.Desc).hits
        return int(searcher.fast_field_values("lsn", [hits[0][1]])[0]) if hits else 0

    # -- following the log -------------------------------------------------------------------

    async def _follow(self) -> None:
        store = self._store
        while True:
            if self._purge_target > self._purged and self._read_lsn >= self._purge_target:
                if self._pending and not await self._commit_now():
                    continue  # started over below the forget: read up to it again first
                target = self._purge_target
                try:
                    if not await self._purge_segments():
                        continue  # a round's commit started over: the purge runs again
                except EngineClosed:
                    return  # the store's scrub marker has the next engine purge again
                self._purged = target
                self._purges.unpark_all()
                continue
            if store.committed_lsn <= self._read_lsn:
                deadline = (self._pending_since + COMMIT_INTERVAL) if self._pending else math.inf
                if self._pending and (self._waiters or trio.current_time() >= deadline):
                    await self._commit_now()
                    continue
                try:
                    await self._wait_for_work(deadline)
                except EngineClosed:
                    return
                continue
            # Paced while nobody waits (nothing is searchable before the next commit anyway),
            # the commit interval kept; a waiter's or a purge's nudge ends the pause.
            if (not self._waiters and self._purge_target <= self._purged and await paced(
                    self._step_began, store.committed_lsn - self._read_lsn, self._nudge,
                    self._pending_since + COMMIT_INTERVAL if self._pending else math.inf)):
                continue
            self._step_began = trio.current_time()
            damaged: list[Damaged] = []
            try:
                await store.yield_to_receipts(before_step=True)
                records, deleted, last = await store.read(
                    read_log_range, self._read_lsn, store.committed_lsn, FOLLOW_CHUNK, damaged)
                if damaged:  # kept as failures; the index goes on without those records
                    await store.write_unlogged(PutState(damage_puts("fulltext", damaged), (),
                                                        trio.Event()))
            except EngineClosed:
                return
            if records or deleted:
                if not self._pending:
                    self._pending_since = trio.current_time()
                self._pending += len(records) + len(deleted)
                try:
                    failed = await trio.to_thread.run_sync(self._apply, records, deleted)
                except ValueError as exc:
                    # A segment the writer's own thread flushed met a full disk, and tantivy
                    # killed the writer: what it held is gone, as after a failed commit.
                    shortage = self._shortage(exc)
                    if shortage is None:
                        raise
                    await self._start_over(shortage)
                    continue
                if failed:
                    # Kept in the store (stats, `engram inspect --failures`) before the index
                    # can commit past them; the index goes on without those records.
                    try:
                        await store.write_unlogged(PutState(tuple(
                            failure_put(r.lsn, "fulltext", r.user_id, r.memory_id, exc)
                            for r, exc in failed), (), trio.Event()))
                    except EngineClosed:
                        # Closing: drop what is uncommitted, so the next open replays these
                        # records and keeps their failures then.
                        await trio.to_thread.run_sync(self._writer.rollback)
                        self._pending = 0
                        return
            if (self._read_lsn < self.open_lsn
                    and last // PROGRESS_EVERY != self._read_lsn // PROGRESS_EVERY):
                log.info("fulltext: %s %d of %d log positions", "rebuilding" if self.rebuilt
                         else "replaying", min(last, self.open_lsn), self.open_lsn)
            self._read_lsn = last
            if self._advanced:
                self._advanced.unpark_all()
            if not self._pending:
                self.indexed_lsn = last
                self._indexed.unpark_all()
            elif (self._pending >= (CATCH_UP_COMMIT_DOCS if self.catching_up else COMMIT_DOCS)
                  or self._waiters or (self.catching_up and last >= self.open_lsn)
                  or (not self.catching_up
                      and trio.current_time() >= self._pending_since + COMMIT_INTERVAL)):
                # Caught up: searches need not wait for the timer. Or a live document's timer is
                # due: under steady traffic the log is rarely all read when the follower looks.
                await self._commit_now()

    async def _wait_for_work(self, deadline: float) -> None:
        """Until the store commits more, a waiter nudges, or the deadline passes.

        Raises:
            EngineClosed: the store is closing (raised bare, not inside the race's group).
        """
        closing = False
        async with trio.open_nursery() as race:
            race.cancel_scope.deadline = deadline

            async def committed() -> None:
                nonlocal closing
                try:
                    await self._store.wait_commit_beyond(self._read_lsn)
                except EngineClosed:
                    closing = True
                race.cancel_scope.cancel()

            async def nudged() -> None:
                # A purge or a waiter may have arrived after the follower looked and before
                # this task parked; its nudge would be lost.
                if not (self._purge_target > self._purged or (self._pending and self._waiters)):
                    await self._nudge.park()
                race.cancel_scope.cancel()

            race.start_soon(committed)
            race.start_soon(nudged)
        if closing:
            raise EngineClosed("the store is closing")

    def _apply(self, records: list[Searchable],
               deleted: list[int]) -> list[tuple[Searchable, Exception]]:
        return write_records(self._writer, self._schema, records, deleted)

    async def purge(self, lsn: int) -> None:
        """Return once the index covers ``lsn`` and no committed segment holds a deleted
        document: tantivy only marks deletions, and a deleted document's terms stay in its
        segment's files until a merge, which tantivy-py cannot ask for. So every live document
        of such a segment is indexed again from the store (and deleted there); a segment left
        with no live document is dropped at the commit and its files deleted. Costs a
        re-index of the segments that held deletions.

        Raises:
            EngineClosed: the engine closed first.
        """
        self._purge_target = max(self._purge_target, lsn)
        self._nudge.unpark_all()
        while self._purged < lsn:
            if self._closed:
                raise EngineClosed("the engine is closed; open a new one with Engine.open(path)")
            await self._purges.park()
        await trio.lowlevel.checkpoint()

    async def _purge_segments(self) -> bool:
        """Whether the purge is done: False if a round's commit started over (it found no
        file descriptor), which left the index below the forget it purges for."""
        for _ in range(PURGE_ROUNDS):
            lsns, deletions = await trio.to_thread.run_sync(self._in_segments_with_deletions)
            if not deletions:
                return True
            for at in range(0, len(lsns), FOLLOW_CHUNK):
                chunk = lsns[at : at + FOLLOW_CHUNK]
                records = await self._store.read(read_searchables, chunk)
                self._pending += len(chunk)
                await trio.to_thread.run_sync(self._apply, records, chunk)
            self._pending += 1  # commit even with nothing to re-add: empty segments drop
            if not await self._commit_now():
                return False
        await trio.to_thread.run_sync(self._writer.garbage_collect_files)
        return True

    def _in_segments_with_deletions(self) -> tuple[list[int], bool]:
        """The lsns of the live documents in committed segments that hold deleted ones, and
        whether there are such segments (worker thread)."""
        # A merge running now could commit a segment carrying a deletion made meanwhile: let
        # the merges finish (that takes the writer) and start a fresh writer.
        self._writer.wait_merging_threads()
        self._writer = self._index.writer(heap_size=WRITER_HEAP, num_threads=1)
        self._writer.garbage_collect_files()
        self._index.reload()
        searcher = self._index.searcher()
        segments = json.loads((self.path / "meta.json").read_bytes())["segments"]
        if not any(segment.get("deletes") for segment in segments):
            return [], False
        hits = searcher.search(tantivy.Query.all_query(), limit=max(searcher.num_docs, 1),
                               count=False).hits
        by_segment: dict[int, list[Any]] = {}
        for _, address in hits:
            by_segment.setdefault(address.segment_ord, []).append(address)
        live = [segment["max_doc"] - (segment.get("deletes") or {}).get("num_deleted_docs", 0)
                for segment in segments]
        # The searcher lists segments in meta.json's order; the live counts confirm it, and
        # if they do not match, every document is indexed again.
        if len(segments) == searcher.num_segments and all(
                len(by_segment.get(i, ())) == n for i, n in enumerate(live)):
            chosen = [a for i, segment in enumerate(segments) if segment.get("deletes")
                      for a in by_segment.get(i, ())]
        else:
            chosen = [address for _, address in hits]
        if not chosen:
            return [], True
        return [int(v) for v in searcher.fast_field_values("lsn", chosen)], True

    async def _commit_now(self) -> bool:
        """Commit what is pending; False if the commit found no file descriptor and the
        index started over from its last commit (:meth:`_start_over`).

        Raises:
            EngineClosed: the store closed while descriptors stayed short.
        """
        async with self._commit_lock:
            try:
                await trio.to_thread.run_sync(self._commit)
            except Exception as exc:
                shortage = self._shortage(exc)
                if shortage is None:
                    raise
                if not self._reloading:
                    await self._start_over(shortage)
                    return False
                # Committed: searches see it once a reload can open its files.
                self._pending = 0
                await self._until_descriptors(self._reload, shortage)
        self._pending = 0
        self.indexed_lsn = self._read_lsn
        self._indexed.unpark_all()
        return True

    async def _start_over(self, exc: Exception) -> None:
        """A commit failed for want of file descriptors (a flood of connections to the
        server holds them all) or of room on the disk. Tantivy's writer has then dropped the
        documents it held, and drops every later one without a word: the index goes on with
        a fresh writer, once one can be made and the disk has room, from the log position it
        last committed. The store goes on meanwhile (the index is derived from it), and so
        does every search but the keyword leg's over what came since."""
        self._pending = 0
        self._read_lsn = self.indexed_lsn
        await self._until_descriptors(self._fresh_writer, exc)

    async def _until_descriptors(self, step: Callable[[], None], exc: Exception) -> None:
        """Run ``step`` in a worker thread each DESCRIPTOR_RETRY until it finds the file
        descriptors it needs (and, after a full disk, the disk has LOW_ON_DISK free), saying
        so every DESCRIPTOR_WARN seconds.

        Raises:
            EngineClosed: the store closed meanwhile (the next open replays from the index's
                last commit).
        """
        waited = 0.0
        while True:
            if waited % DESCRIPTOR_WARN == 0:
                wanted = "room on the disk" if disk_full(exc) else "a free file descriptor"
                log.warning("fulltext: no %s (%s) for %.0f s; the index goes on from log "
                            "position %d once there is", wanted, exc, waited, self.indexed_lsn)
            await trio.sleep(DESCRIPTOR_RETRY if waited else 0)
            if not self._store.usable():
                raise EngineClosed("the store closed while the text index waited for a file "
                                   "descriptor or room on the disk")
            try:
                await trio.to_thread.run_sync(self._attempt, step, disk_full(exc))
                return
            except Exception as again:
                shortage = self._shortage(again)
                if shortage is None:
                    raise
                exc = shortage
            waited += DESCRIPTOR_RETRY

    def _shortage(self, error: BaseException) -> BaseException | None:
        """The shortage a failure is, which the index waits out (None: a failure of its
        own): no file descriptor free (a flood of connections holds them), no room on the
        disk, or a writer tantivy killed while the disk has less than LOW_ON_DISK free (its
        message names no cause), given as ENOSPC."""
        if out_of_descriptors(error) or disk_full(error):
            return error
        if "writer was killed" in str(error):
            free = free_bytes(self.path)
            if free is not None and free < LOW_ON_DISK:
                return OSError(errno.ENOSPC, str(error))
        return None

    def _attempt(self, step: Callable[[], None], needs_room: bool) -> None:
        """``step``; with ``needs_room``, only once the disk under the index has LOW_ON_DISK
        free (a commit that starts on a full disk fails again, and each failed one is the
        whole pending work redone)."""
        free = free_bytes(self.path) if needs_room else None
        if free is not None and free < LOW_ON_DISK:
            raise OSError(errno.ENOSPC, f"{free:,} bytes free under {self.path}, "
                                        f"{LOW_ON_DISK:,} wanted")
        step()

    def _fresh_writer(self) -> None:
        """Drop the writer (what it held uncommitted goes with it) and make a new one."""
        if self._writer is not None:
            old, self._writer = self._writer, None
            try:
                old.rollback()
                old.wait_merging_threads()
            except Exception as exc:  # the failed writer's own state: it is dropped anyway
                log.info("fulltext: dropping the failed writer: %r", exc)
            del old
        self._writer = self._index.writer(heap_size=WRITER_HEAP, num_threads=1)

    def _commit(self) -> None:
        self._writer.commit()
        self._reloading = True  # committed; searches see it after the reload
        self._reload()

    def _reload(self) -> None:
        self._index.reload()
        self._reloading = False

    # -- copies ------------------------------------------------------------------------------

    async def copy_to(self, dest: Path) -> tuple[int, bool]:
        """Copy the committed index to ``dest`` (which must not exist), consistently.

        Returns:
            (the lsn the copy covers, True) — or (0, False) without copying when a committed
            segment still holds deleted documents: their terms stay in its files until a merge,
            so such a copy could carry a forgotten user's words; build one from the store
            instead (:func:`build_index`).
        """
        if self._read_only:
            # The owner (another process) commits as it likes: what the copy covers is read
            # from the copy itself, under tantivy's meta lock so no listed file goes meanwhile.
            if self._index is None:
                return 0, False
            copied = await trio.to_thread.run_sync(_copy_committed, self.path, dest)
            if not copied:
                return 0, False
            return await trio.to_thread.run_sync(self._covered, dest), True
        async with self._commit_lock:  # no commit of ours lands while the files are linked
            covered = self.indexed_lsn
            copied = await trio.to_thread.run_sync(_copy_committed, self.path, dest)
        return (covered, True) if copied else (0, False)

    def _covered(self, copy: Path) -> int:
        check_index(copy)
        index = tantivy.Index(self._schema, path=str(copy), reuse=True)
        return self._max_lsn(index)

    async def wait_indexed(self, lsn: int) -> None:
        """Return once every record up to ``lsn`` is searchable here.

        Raises:
            EngineClosed: the engine closed first.
        """
        self._waiters += 1
        try:
            while self.indexed_lsn < lsn:
                if self._closed:
                    raise EngineClosed("the engine is closed; open a new one with Engine.open(path)")
                self._nudge.unpark_all()
                await self._indexed.park()
        finally:
            self._waiters -= 1
        await trio.lowlevel.checkpoint()

    # -- searching ---------------------------------------------------------------------------

    async def tagged(self, user_id: str, tags: tuple[str, ...] | None, limit: int,
                     where: Node | None = None) -> list[int]:
        """The lsns of the user's records carrying any of ``tags`` and passing ``where``
        (either may be None), for the vector leg's mask; at most ``limit`` of them.

        Raises:
            EngineBroken: tantivy failed (a panic in a segment it could not read).
        """
        return await self._searching(self._tagged, user_id, tags, limit, where)

    def _tagged(self, user_id: str, tags: tuple[str, ...] | None, limit: int,
                where: Node | None) -> list[int]:
        if self._index is None:
            return []
        query = self._queries.tagged(self._index, user_id, tags, where)
        searcher = self._index.searcher()
        hits = searcher.search(query, limit=limit, count=False).hits
        if not hits:
            return []
        return [int(v) for v in searcher.fast_field_values("lsn", [a for _, a in hits])]

    def terms(self, text: str) -> list[str]:
        """The query's terms, as the index analyses text (deduplicated, in order)."""
        return self._queries.terms(text)

    def query_terms(self, text: str) -> list[str]:
        """The terms a query searches with: its terms without QUERY_STOPWORDS, or all of them
        when nothing else is left."""
        return self._queries.query_terms(text)

    async def search(self, user_id: str, text: str, k: int,
                     filters: TextFilters | None = None) -> list[tuple[int, float]]:
        """The user's k best BM25 matches for ``text``: [(lsn, score)], best first.

        Raises:
            EngineBroken: tantivy failed (a panic in a segment it could not read).
        """
        return (await self.search_each(user_id, text, k, [filters]))[0]

    async def search_each(self, user_id: str, text: str, k: int,
                          each: list[TextFilters | None]) -> list[list[tuple[int, float]]]:
        """:meth:`search` once for each of ``each``, in one worker thread call and over one
        searcher (the same committed index for every list): a recall searches the turns and
        the other kinds as two lists, and a thread round trip costs more than a search.

        Raises:
            EngineBroken: tantivy failed (a panic in a segment it could not read).
        """
        return await self._searching(self._search_each, user_id, text, k, each)

    async def _searching(self, fn: Any, *args: Any) -> Any:
        """Run a search in a worker thread; a tantivy panic becomes the engine's own error."""
        try:
            return await trio.to_thread.run_sync(fn, *args, limiter=self._search_limiter)
        except BaseException as exc:
            if _is_panic(exc):
                raise EngineBroken(f"the text index at {self.path} failed a search: {exc}; "
                                   "reopen the store to check and rebuild it") from exc
            raise

    def _search_each(self, user_id: str, text: str, k: int,
                     each: list[TextFilters | None]) -> list[list[tuple[int, float]]]:
        terms = self.query_terms(text)
        index = self._index
        if not terms or index is None:
            return [[] for _ in each]
        searcher = index.searcher()
        return [self._search(index, searcher, user_id, terms, k, filters) for filters in each]

    def _search(self, index: tantivy.Index, searcher: tantivy.Searcher, user_id: str,
                terms: list[str], k: int,
                filters: TextFilters | None) -> list[tuple[int, float]]:
        query = self._queries.search(index, user_id, terms, filters)
        hits = searcher.search(query, limit=k, count=False).hits
        if not hits:
            return []
        lsns = searcher.fast_field_values("lsn", [address for _, address in hits])
        return [(int(lsn), float(score)) for (score, _), lsn in zip(hits, lsns, strict=True)]
