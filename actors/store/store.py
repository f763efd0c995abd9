"""The Store actor: LMDB, the single source of truth. Its lifecycle, opening (schema, model and
hash-chain checks), and reads.

Reads run in worker threads through :meth:`Store.read`, each in its own read transaction.
Growing the map and closing the environment need no transaction open in the process, so both
wait for in-flight reads to finish and hold new ones back meanwhile. The writes are
:class:`.writer.Writer`'s, the ops' effects :class:`.apply.Appliers`' and
:class:`.forget.Forgetting`'s: one object, its methods kept by concern in those modules.
"""

from __future__ import annotations

import hmac
import os
from array import array
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import lmdb
import numpy as np
import trio

from ..base.config import Config
from ..base.errors import (
    EngineBroken,
    EngineClosed,
    InvalidInput,
    ModelMismatch,
    RecordRefused,
    StoreCorrupt,
    StoreIncompatible,
    StoreTampered,
    access_denied,
    disk_full,
    store_denied,
)
from ..base.messages import (
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
from ..base.records import SCHEMA_VERSION
from .apply import Appliers
from .chain import check_chain
from .codecs import _encode
from .compact import clear_copy, copy_pages, copy_pages_hashed, fsync_copy
from .forget import Forgetting
from .integrity import (ZERO, CheckedTxn, check_file, decode_head, encode_head, grown_along,
                        head_mac, OPENING_LOCK, open_reader, ready_lock_file)
from .layout import (
    _EMBEDDED_KEY,
    _LAST_LSN_KEY,
    _MODEL_KEY,
    MODEL_PROBE_KEY,
    SCHEMA_KEY,
    STORE_ID_KEY,
    DB_NAMES,
    EMBED_BACKLOG_KEY,
    HEAD_KEY,
    MAX_DBS,
    MAX_READERS,
    SCRUB_KEY,
    SCRUBBED_KEY,
    VECTORS_EPOCH_KEY,
    _int,
    lsn_key,
    open_databases,
)
from .migrate import MIGRATIONS
from .vectors import ModelInfo, _decode_model
from .writer import COMMIT_TIMES, RECEIPTS_TIMED, Writer, _Landing

READ_THREADS = 2  # concurrent read transactions: one per core; the writer has its own limiter
TAIL_CHECK = 64  # log positions whose chain opening a store recomputes: the last writes

T = TypeVar("T")


# The least cosine between a probe sentence's vectors from the files a store's vectors came
# from and from the files loaded now: the same model on another processor agrees to ~0.9999,
# another model to ~0.
PROBE_AGREEMENT = 0.98


class Store(Writer, Appliers, Forgetting):
    """The LMDB store. Start with ``await nursery.start(store.run)``; stop with :meth:`close`.

    Args:
        path: the store directory (created if missing).
        config: the engine's config.
        model: the embedding model the engine runs; a store made with another is refused.
        reembed: embed everything again with ``model``: the store's vectors are dropped,
            whether another model made them or this one (suspect vectors).
        read_only: open an existing store for reading only, as another process's engine may
            be writing it (LMDB's lock file keeps its readers safe); every write is refused.
    """

    def __init__(self, path: Path, config: Config, model: ModelInfo | None = None,
                 reembed: bool = False, read_only: bool = False) -> None:
        self.path = path
        self._config = config
        self._model = model
        self._reembed = reembed
        self.read_only = read_only  # readers of a store another process may be writing
        self.embedded_lsn = 0  # the persisted embedding watermark, as read at open
        self.store_id = ""  # the store's own random id (STORE_ID_KEY), made by its owner
        # How many times the store dropped its vectors (reembed), as read at open: a graph
        # saved at another count holds vectors the store no longer has.
        self.vectors_epoch = 0
        self.embed_backlog: list[int] = []  # lsns behind it still without a vector, at open
        self.scrub_pending = False  # a forget's freed pages may still hold its bytes (at open)
        self.scrub_owed = False  # an older build's scrub may have left bytes (at open)
        # The log position up to which the follower that drops the records a fact entry
        # retired (the text index) has applied the log durably: a fact entry then need not
        # carry what a retired entry at or below it carried. 0 (carry all) until it says.
        self.retirements_applied_lsn = 0
        self._env: lmdb.Environment | None = None
        self._map_bytes = 0  # the map's size when last read (stats, while the map is held)
        self._dbs: dict[bytes, Any] = {}
        self._names: dict[Any, bytes] = {}  # database handle -> name, for CheckedTxn
        key = config.integrity_key
        self._key = None if key is None else key.encode()
        self._head = (0, ZERO)  # the chain's last lsn and digest, as committed
        self._queue: deque[StoreOp] = deque()
        self._queued = 0  # ops taken and not yet committed (queued or in the writer)
        self._next_lsn = 1
        self._committed_lsn = 0
        self._bulk_until = 0  # the last lsn of the latest bulk run of turns (add_turns, an import)
        # Heap of [lsn, tiebreak, event, the landing's stage times once it lands].
        self._waiters: list[list[Any]] = []
        # (waited, landing's stage times, woken) of the latest durable receipts, in ns.
        self._receipt_times: deque[tuple[int, list[int], int]] = deque(maxlen=RECEIPTS_TIMED)
        self._tiebreak = 0
        self._failure: BaseException | None = None  # why the commit loop died, if it did
        # Ops the writer refused alone (their batch committed without them): by lsn for their
        # waiters, by id() for unlogged ops whose writer waits on ``done``.
        self._refused: dict[int, RecordRefused] = {}
        self._refused_ops: dict[int, RecordRefused] = {}
        self._unreported: dict[int, RecordRefused] = {}  # refused lsns no flush has raised yet
        self._closing = False
        self._readers = 0
        self._exclusive = False  # set while the map grows or the env closes: reads wait
        # Parked: the commit loop, while the queue is empty.
        self._wakeup = trio.lowlevel.ParkingLot()
        # Parked: callers waiting for queue room (backpressure).
        self._room = trio.lowlevel.ParkingLot()
        # Parked: readers waiting out an exclusive section, and the section waiting for readers.
        self._gate = trio.lowlevel.ParkingLot()
        # Parked: followers of the log (the embedder) waiting for the next commit.
        self._commits = trio.lowlevel.ParkingLot()
        self._submitted = 0  # ops ever queued, logged or not
        # (first, end) submit numbers of op runs that must commit in one transaction
        # (hold_together), oldest first; dropped once written.
        self._groups: deque[tuple[int, int]] = deque()
        self._taken = 0  # ops ever taken off the queue into a batch: the first _taken queued
        self._written = 0  # ops ever landed (on disk): the first _written queued
        # Parked: callers of wait_written, until the next batch lands; the commit loop at the
        # end, until the last one has.
        self._batches = trio.lowlevel.ParkingLot()
        # With fsync on, LMDB leaves each commit's meta page to the next flush (MDB_NOMETASYNC),
        # and a batch lands once a flush that began after its commit returned has returned.
        self._meta_deferred = config.fsync and not read_only
        # The switch interval (seconds) while a caller waits for a landing; 0: left alone.
        self._receipt_switch = config.receipt_switch_us / 1e6
        self._switch_lowered = False  # this store holds the interval lowered (gil.lower)
        self._landings: deque[_Landing] = deque()  # committed batches not landed yet, in order
        self._commit_count = 0  # write transactions this process committed
        self._writer_done = False  # the commit loop has drained the queue at close
        self._sync_requested = False  # a committed batch waits for the sync loop's next flush
        self._sync_waited = False  # a caller waits for the flush under way
        # Parked: background steps yielding to a caller's receipt, until the next landing.
        self._landed = trio.lowlevel.ParkingLot()
        # Parked: the sync loop, until a flush is requested (or the writer is done).
        self._sync_kick = trio.lowlevel.ParkingLot()
        self._sync_limiter = trio.CapacityLimiter(1)  # one flush at a time, on its own thread
        # The commit and sync loops' scope: shielded, so that only close() ends them, once
        # what is queued is on disk (run turns a cancellation from outside into a close).
        self._drain_scope = trio.CancelScope(shield=True)
        # How the writer applies each kind of op other than appends (batched apart, see _plan),
        # inside the batch's write transaction; what it returns goes to the op's ``committed``.
        self._appliers: dict[type, Callable[[lmdb.Transaction, Any], Any]] = {
            Forget: self._forget_in, PutVectors: self._put_vectors_in, PutNote: self._put_note_in,
            DeleteNote: self._delete_note_in, WriteSummary: self._write_summary_in,
            PutEpisode: self._put_episode_in, PutFact: self._put_fact_in,
            PutState: self._put_state_in, PutLink: self._put_link_in,
            ScrubDone: self._scrub_done_in,
        }
        self._write_limiter = trio.CapacityLimiter(1)
        self._read_limiter = trio.CapacityLimiter(READ_THREADS)
        # (lsn, trio time): every lsn above the previous sample's and up to this one was
        # committed within COMMIT_TIME_STEP after this time; how far behind a follower is.
        self._commit_times: deque[tuple[int, float]] = deque(maxlen=COMMIT_TIMES)

    # -- lifecycle ---------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Open the environment, then commit queued ops until closed and drained."""
        self._env = await trio.to_thread.run_sync(
            self._open_env_read_only if self.read_only else self._open_env)
        self._commit_times.append((self._committed_lsn, trio.current_time()))
        task_status.started()
        try:
            async with trio.open_nursery() as outside:
                # A cancellation from outside (a service shutting down around the engine)
                # is a close: it reaches this watcher, never the loops, so what callers were
                # told is queued still reaches the disk before the store ends.
                outside.start_soon(self._close_when_cancelled)
                with self._drain_scope:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(self._sync_loop)
                        await self._commit_loop()
                outside.cancel_scope.cancel()  # drained: the watcher goes
        except BaseException as exc:
            # Cancelled from outside (the engine's nursery, a server's task group) is a close,
            # not a failure: a task that runs once more before its own cancellation (a
            # follower about to write its step) hears EngineClosed and returns, where
            # EngineBroken made the engine end as broken around nothing but the cancellation.
            cancelled = isinstance(exc, trio.Cancelled) or (
                isinstance(exc, BaseExceptionGroup) and exc.split(trio.Cancelled)[1] is None)
            self._fail(None if cancelled else exc)
            raise
        finally:
            self._prioritise_receipts(False)
            with trio.CancelScope(shield=True):
                await self._close_env()

    async def _close_when_cancelled(self) -> None:
        try:
            await trio.sleep_forever()
        finally:
            self.close()

    def close(self) -> None:
        """Stop taking ops; the loop commits what is queued and ends.

        The drain is shielded from cancellation and bounded by work, not by a timer: at most
        QUEUE_LIMIT turns, a few commits. A timer could not tell a slow fsync from a dead disk,
        and giving up would lose turns that callers were told are in memory.
        """
        self._closing = True
        self._wakeup.unpark_all()
        self._room.unpark_all()
        self._commits.unpark_all()
        self._sync_kick.unpark_all()
        self._landed.unpark_all()

    def _open_env(self) -> lmdb.Environment:
        if self.path.exists() and not self.path.is_dir():
            raise InvalidInput("path", f"expected a store directory, found a file at {self.path}")
        self.path.mkdir(parents=True, exist_ok=True)
        check_file(self.path, extend=True)
        try:
            (self.path / OPENING_LOCK).touch()  # for readers and compact (integrity.opening)
        except OSError as exc:
            if disk_full(exc):
                raise self._full(exc) from exc
            if access_denied(exc):
                raise store_denied(self.path, exc) from exc
            raise
        try:
            env = self._lmdb_open(self._config.initial_map_bytes)
        except lmdb.Error as exc:
            if disk_full(exc):
                raise self._full(exc) from exc
            if access_denied(exc):
                raise store_denied(self.path, exc) from exc
            raise StoreIncompatible(f"cannot open an LMDB store at {self.path}: {exc}") from exc
        try:
            while True:
                try:
                    self._open_txn(env)
                    break
                except lmdb.MapFullError:
                    # A migration rewrites every record, and copy on write needs room for
                    # both copies: grow the map as the writer does, and open again (the
                    # transaction was aborted: nothing of it stays).
                    env.set_mapsize(env.info()["map_size"] * 2)
        except (lmdb.CorruptedError, lmdb.PageNotFoundError) as exc:
            env.close()
            raise _damaged(self.path, exc) from exc
        except BaseException as exc:
            env.close()
            if disk_full(exc):  # a migration's, a new store's
                raise self._full(exc) from exc
            raise
        self._committed_lsn = self._next_lsn - 1
        return env

    def _full(self, exc: lmdb.Error) -> EngineBroken:
        return EngineBroken(f"cannot open the store at {self.path}: {exc}: the disk is full; "
                            "free space and open it again (nothing of it was changed)")

    def _lmdb_open(self, map_size: int) -> lmdb.Environment:
        ready_lock_file(self.path)
        return lmdb.open(
            str(self.path),
            map_size=map_size,
            max_dbs=MAX_DBS,
            max_readers=MAX_READERS,
            # Data pages are fdatasynced before the meta page that points at them is
            # written; the meta page waits for the next flush (writer.py: batches land
            # after it). LMDB: "maintains database integrity, but a system crash may undo
            # the last committed transaction" -- one whose receipts were not released.
            sync=self._config.fsync,
            metasync=False,
            writemap=False,
            map_async=False,
        )

    async def _reopen_env(self) -> None:
        """Close the environment and open it again, with the flush and every read waiting
        (none may use it meanwhile; a flush after it covers what the old handle committed:
        the file is the same). The caller holds the writer's limiter, so no write
        transaction runs either. What for: LMDB keeps the page buffers of this process's past
        write transactions, uncleared, for its next ones; opened afresh it has none (see
        :meth:`scrub`).

        Raises:
            EngineBroken: the store could not be opened again.
        """
        # The flush loop waits: no env.sync (the commit loop waits on the caller's limiter).
        async with self._sync_limiter:
            await self._enter_exclusive()
            try:
                self.check_usable()
                await trio.to_thread.run_sync(self._reopen_in_thread)
            finally:
                self._leave_exclusive()

    def _reopen_in_thread(self) -> None:
        size = self._env.info()["map_size"]
        # The closed handle stays in place until the new one replaces it: ``_env is None``
        # tells waiters on the trio thread that the engine closed, and nothing uses the
        # handle meanwhile (the caller holds every reader and the writer out).
        self._env.close()
        try:
            env = self._lmdb_open(size)
            with env.begin(write=True) as txn:  # every database exists: this creates none
                dbs = {name: env.open_db(name, txn=txn) for name in DB_NAMES}
        except lmdb.Error as exc:
            self._env = None
            raise EngineBroken(f"opening the store at {self.path} again failed: {exc}") from exc
        self._dbs = dbs
        self._names = {handle: name for name, handle in dbs.items()}
        self._env = env

    def _open_env_read_only(self) -> lmdb.Environment:
        """The environment for reading only; nothing is created, migrated or adopted."""
        if not (self.path / "data.mdb").exists():
            raise InvalidInput("path", f"expected an Engram store, found no data.mdb in "
                                       f"{self.path}")
        check_file(self.path)
        try:
            # lock=True: this reader takes a slot in LMDB's reader table, so a writer in
            # another process never reuses the pages it reads.
            env = open_reader(self.path, readonly=True, max_dbs=MAX_DBS,
                              max_readers=MAX_READERS)
        except lmdb.Error as exc:
            if access_denied(exc):
                raise store_denied(self.path, exc) from exc
            raise StoreIncompatible(f"cannot open an LMDB store at {self.path}: {exc}") from exc

        def look() -> None:
            try:
                # Each opened in its own transaction (a handle opened inside a read-only
                # transaction of py-lmdb dies with it).
                self._dbs = open_databases(env)
            except lmdb.NotFoundError:
                self._dbs = {}
            self._names = {handle: name for name, handle in self._dbs.items()}
            with env.begin() as txn:
                meta = self._dbs.get(b"meta")
                stored = None if meta is None else _int(txn.get(SCHEMA_KEY, db=meta))
                if stored != SCHEMA_VERSION:
                    raise StoreIncompatible(
                        f"{self.path} has schema version {stored} and this build reads "
                        f"{SCHEMA_VERSION}; a read-only engine migrates nothing: open it once "
                        "with Engine.open(path) (not read_only) when nobody serves it")
                raw = txn.get(_MODEL_KEY, db=meta)
                stored_model = None if raw is None else _decode_model(raw)
                if (self._model is not None and stored_model is not None
                        and stored_model != self._model):
                    raise ModelMismatch(
                        f"{self.path} holds vectors from {stored_model.id} and this engine runs "
                        f"{self._model.id}; open it read-only with the model it was built with",
                        stored_model.id, self._model.id)
                self._next_lsn = (_int(txn.get(_LAST_LSN_KEY, db=meta)) or 0) + 1
                self.embedded_lsn = _int(txn.get(_EMBEDDED_KEY, db=meta)) or 0
                self.vectors_epoch = _int(txn.get(VECTORS_EPOCH_KEY, db=meta)) or 0
                if self._next_lsn > 1:  # an empty store has no chain to check
                    self._check_chain(txn)

        try:
            # The owner may have grown the store past this handle's map since it opened.
            grown_along(env, look)
        except (lmdb.CorruptedError, lmdb.PageNotFoundError) as exc:
            env.close()
            raise _damaged(self.path, exc) from exc
        except BaseException:
            env.close()
            raise
        self._committed_lsn = self._next_lsn - 1
        return env

    def _open_txn(self, env: lmdb.Environment) -> None:
        """The open's write transaction: the databases, the schema (migrated), the model, the
        chain's head, and what the store's state starts from."""
        with env.begin(write=True) as txn:
            self._dbs = {name: env.open_db(name, txn=txn) for name in DB_NAMES}
            self._names = {handle: name for name, handle in self._dbs.items()}
            self._check_schema(txn)
            self._check_model(txn)
            self._check_chain(txn)
            meta = self._dbs[b"meta"]
            self._next_lsn = (_int(txn.get(_LAST_LSN_KEY, db=meta)) or 0) + 1
            self.embedded_lsn = _int(txn.get(_EMBEDDED_KEY, db=meta)) or 0
            self.vectors_epoch = _int(txn.get(VECTORS_EPOCH_KEY, db=meta)) or 0
            found = txn.get(STORE_ID_KEY, db=meta)
            if found is None:
                found = os.urandom(16).hex().encode()
                txn.put(STORE_ID_KEY, found, db=meta)
            self.store_id = found.decode()
            self.scrub_pending = txn.get(SCRUB_KEY, db=meta) is not None
            if not self.scrub_pending and txn.get(SCRUBBED_KEY, db=meta) is None:
                # Scrubbed (if ever) by an older build, whose scrub could leave a few
                # bytes in pages written beside it: scrub once more, as after a forget.
                self.scrub_owed = True
                txn.put(SCRUB_KEY, (1).to_bytes(8, "big"), db=meta)
            backlog = array("Q", txn.get(EMBED_BACKLOG_KEY, db=meta) or b"")
            backlog.byteswap()
            self.embed_backlog = backlog.tolist()

    def _check_schema(self, txn: lmdb.Transaction) -> None:
        meta = self._dbs[b"meta"]
        stored = _int(txn.get(SCHEMA_KEY, db=meta))
        if stored is None:
            # The main database holds a key per named database; anything else in it (another
            # program's data, or its databases) is not a new store's.
            foreign = any(key not in self._dbs for key in txn.cursor().iternext(values=False))
            logged = txn.stat(self._dbs[b"log"])["entries"]
            if foreign or (txn.stat(meta)["entries"] and not logged):
                raise StoreIncompatible(
                    f"{self.path} holds LMDB data without an Engram schema version; "
                    "point Engine.open at an empty directory or an Engram store (if this was "
                    "one, its pages are damaged: restore it from a snapshot)"
                )
            if logged:
                # The engine's own databases, its log written to, and no schema record: pages lost
                # under a tree that still reads, not another program's data.
                raise StoreCorrupt(
                    f"{self.path / 'data.mdb'} is damaged: it holds Engram's databases and log "
                    "but no schema version (a disk that lost writes, or a power cut with "
                    "Config(fsync=False), leaves this). Restore the store from a snapshot",
                    "data.mdb")
            txn.put(SCHEMA_KEY, SCHEMA_VERSION.to_bytes(8, "big"), db=meta)
            txn.put(SCRUBBED_KEY, b"\x01", db=meta)  # a new file: nothing deleted, nothing stale
            return
        if stored > SCHEMA_VERSION:
            raise StoreIncompatible(
                f"{self.path} has schema version {stored}, newer than this build reads "
                f"({SCHEMA_VERSION}); upgrade engram to open it"
            )
        for version in range(stored, SCHEMA_VERSION):
            if version not in MIGRATIONS:
                raise StoreIncompatible(
                    f"{self.path} has schema version {stored} and this build has no migration "
                    f"from {version} to {version + 1}"
                )
            MIGRATIONS[version](txn, self._dbs)
        if stored != SCHEMA_VERSION:
            txn.put(SCHEMA_KEY, SCHEMA_VERSION.to_bytes(8, "big"), db=meta)

    def _check_chain(self, txn: lmdb.Transaction) -> None:
        """Check the chain's head (and its MAC, with a key) and recompute its last TAIL_CHECK
        links: a cut, a forged append or an edit among the latest writes refuses the store."""
        meta = self._dbs[b"meta"]
        last = _int(txn.get(_LAST_LSN_KEY, db=meta)) or 0
        raw = txn.get(HEAD_KEY, db=meta)
        if raw is None and not last and not txn.stat(self._dbs[b"log"])["entries"]:
            txn.put(HEAD_KEY, encode_head(0, ZERO, self._key), db=meta)  # a new store
            return
        head = None if raw is None else decode_head(raw)
        if head is None:
            raise StoreTampered(
                f"{self.path} has a log of {last} entries but {'no' if raw is None else 'a broken'}"
                f" hash-chain head (meta {HEAD_KEY!r}); it was edited outside the engine: run "
                f"`engram-trio verify {self.path}` and restore from a snapshot", "meta", HEAD_KEY)
        if self._key is None and head.mac:
            raise StoreIncompatible(
                f"{self.path} is sealed with an integrity key (its chain head carries a MAC); "
                "open it with Config(integrity_key=...) set to that key")
        if self._key is not None and not head.mac:
            if head.lsn:
                raise StoreIncompatible(
                    f"{self.path} was written without an integrity key, so nothing vouches for "
                    f"what it holds so far; check it and seal it with `engram-trio verify {self.path} "
                    "--seal` (the key in ENGRAM_INTEGRITY_KEY), then open it with the key")
            txn.put(HEAD_KEY, encode_head(0, ZERO, self._key), db=meta)
            head = decode_head(encode_head(0, ZERO, self._key))
        if self._key is not None and not hmac.compare_digest(
                head.mac, head_mac(self._key, head.lsn, head.digest)):
            raise StoreTampered(
                f"{self.path}: the MAC of the hash-chain head does not match under the "
                "configured integrity_key: the store was edited by someone without the key, or "
                "the key is not the one it was written with", "meta", HEAD_KEY)
        if head.lsn != last:
            raise StoreTampered(
                f"{self.path}: the hash chain ends at log position {head.lsn} and the store "
                f"says its log ends at {last}: records were cut or added outside the engine; "
                f"run `engram-trio verify {self.path}`", "meta", _LAST_LSN_KEY, min(head.lsn, last))
        problems = check_chain(CheckedTxn(txn, self._names), self._dbs,
                               max(1, last - TAIL_CHECK + 1), last, head.digest)
        if problems:
            lsn, what = problems[0]
            raise StoreTampered(
                f"{self.path}: at log position {lsn}, {what} ({len(problems)} problem(s) in the "
                f"last {min(TAIL_CHECK, last)} positions); run `engram-trio verify {self.path}` for "
                "every break, and restore from a snapshot", "log", lsn_key(lsn), lsn)
        self._head = (last, head.digest)

    def _check_model(self, txn: lmdb.Transaction) -> None:
        if self._model is None:
            return
        meta = self._dbs[b"meta"]
        raw = txn.get(_MODEL_KEY, db=meta)
        stored = None if raw is None else _decode_model(raw)
        if stored == self._model and not self._reembed:
            return
        if stored is not None and not self._reembed:
            raise ModelMismatch(
                f"{self.path} holds vectors from {stored.id} (dimension {stored.dim}) and this "
                f"engine runs {self._model.id} (dimension {self._model.dim}); re-embed the store "
                f"with `engram-trio reindex {self.path} --model <name>` (or "
                "Engine.open(..., reembed=True)), or open it with the model it was built with",
                stored.id, self._model.id,
            )
        if stored is not None:
            txn.drop(self._dbs[b"vectors"], delete=False)
            txn.delete(MODEL_PROBE_KEY, db=meta)  # the next model's files record their own
            txn.put(_EMBEDDED_KEY, lsn_key(0), db=meta)
            epoch = (_int(txn.get(VECTORS_EPOCH_KEY, db=meta)) or 0) + 1
            txn.put(VECTORS_EPOCH_KEY, epoch.to_bytes(8, "big"), db=meta)
        txn.put(_MODEL_KEY, _encode(self._model), db=meta)

    async def check_probe(self, probe: np.ndarray, where: Path) -> None:
        """Compare the loaded model's vector of its probe sentence with the one recorded when
        this store's vectors began (an owner records it if none is): other files under the
        model's names (another model, another tokenizer) give another, and their vectors
        mixed with the store's would find nothing by meaning, without a word.

        Raises:
            ModelMismatch: the files at ``where`` are not the ones the store's vectors came
                from.
        """
        def recorded(txn: lmdb.Transaction, dbs: dict[bytes, Any]) -> bytes | None:
            return txn.get(MODEL_PROBE_KEY, db=dbs[b"meta"])

        raw = await self.read(recorded)
        if raw is None:
            if not self.read_only:
                await self.write_unlogged(PutState(
                    ((b"meta", MODEL_PROBE_KEY, probe.astype("<f4").tobytes(), 0),),
                    done=trio.Event()))
            return
        stored = np.frombuffer(raw, dtype="<f4")
        agree = (float(stored @ probe) / float(np.linalg.norm(stored) * np.linalg.norm(probe))
                 if stored.shape == probe.shape else 0.0)
        if agree < PROBE_AGREEMENT:
            model = self._model.id if self._model is not None else "?"
            raise ModelMismatch(
                f"the model files at {where} are not the ones {self.path}'s vectors came from, "
                f"though both are {model} by name (a probe sentence's vectors agree to cosine "
                f"{agree:.3f}): put that model's own files back (`engram-trio model build "
                f"--force` rebuilds them), or re-embed the store with them, `engram-trio "
                f"reindex {self.path} --force`", model, model)

    async def _close_env(self) -> None:
        await self._enter_exclusive()
        try:
            if self._env is not None:
                self._env.close()
                self._env = None
        finally:
            self._leave_exclusive()
        self._wake_all_waiters()

    async def _grow_map(self) -> None:
        """Double the map. LMDB resizes it only with no transaction open in the process and
        nothing else touching the map: so with no reader (exclusive), between the writer's
        transactions and its calls around them (its limiter), and with no flush on its way
        (the sync thread's); taken in the scrub's order (writer, flush, readers)."""
        async with self._write_limiter, self._sync_limiter:
            await self._enter_exclusive()
            try:
                size = self._env.info()["map_size"] * 2
                self._env.set_mapsize(size)
            finally:
                self._leave_exclusive()

    # -- reads -------------------------------------------------------------------------------

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(txn, dbs, *args)`` in a worker thread inside one read transaction.

        Raises:
            EngineClosed: the store is closed.
        """
        while self._exclusive:
            await self._gate.park()
        if self._env is None:
            raise EngineClosed("the engine is closed; open a new one with Engine.open(path)")
        self._readers += 1
        try:
            return await trio.to_thread.run_sync(
                self._read_in_thread, fn, args, limiter=self._read_limiter
            )
        except _MapResized:
            pass
        finally:
            self._readers -= 1
            if not self._readers and self._gate:
                self._gate.unpark_all()
        await self._enter_exclusive()
        try:
            if self._env is not None:
                self._env.set_mapsize(0)  # 0: adopt the size the writer set
        finally:
            self._leave_exclusive()
        return await self.read(fn, *args)

    def _read_in_thread(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        try:
            with self._env.begin(buffers=False) as txn:
                return fn(CheckedTxn(txn, self._names), self._dbs, *args)
        except lmdb.MapResizedError:
            # The writing process grew the map: a reader adopts the new size (LMDB allows it
            # only with no transaction open in this process, so the caller does it).
            raise _MapResized() from None
        except lmdb.Error as exc:
            raise EngineBroken(f"reading the store at {self.path} failed: {exc}") from exc

    async def copy_to(self, dest: Path, sync: bool = True, hash_chunk: int | None = None
                      ) -> tuple[int, list[str] | None]:
        """A copy of the environment into the empty directory ``dest`` holding no byte of a
        deleted record: LMDB's compacting copy from a worker thread in one read transaction
        (so never from the writer's thread with its transaction open; ingestion goes on
        meanwhile). LMDB's copy takes the live pages' bytes beside their records too, so
        unless that transaction sees the file scrubbed (``layout.SCRUBBED_KEY`` and no
        pending scrub: no page holds a deleted byte), the copy then has those bytes zeroed
        (:mod:`.compact`), outside the transaction: a pass that reads the whole copy back.
        With ``sync``, flushed to disk.

        Args:
            dest: an empty directory to be (it must not exist).
            sync: fsync the copy before returning.
            hash_chunk: hash the copy's ``data.mdb`` in units of this many bytes (see
                :func:`.compact.copy_pages_hashed`): in the same pass as the copy when the
                file is scrubbed, else nothing is hashed (the zeroing changes it after).

        Returns:
            (the last lsn the copy holds, the sha256 of each ``hash_chunk`` bytes of the
            copy, or None when not hashed).
        """

        def copy(txn: lmdb.Transaction, dbs: dict[bytes, Any]
                 ) -> tuple[int, bool, list[str] | None]:
            meta = dbs[b"meta"]
            scrubbed = (txn.get(SCRUBBED_KEY, db=meta) is not None
                        and txn.get(SCRUB_KEY, db=meta) is None)
            digests = None
            if scrubbed and hash_chunk is not None:
                digests = copy_pages_hashed(self._env, txn.raw, dest, hash_chunk)
            else:
                copy_pages(self._env, txn.raw, dest)
            return _int(txn.get(_LAST_LSN_KEY, db=meta)) or 0, scrubbed, digests

        dest.mkdir(parents=True)
        await self._room_for_a_long_read()
        lsn, scrubbed, digests = await self.read(copy)
        if not scrubbed:
            await trio.to_thread.run_sync(clear_copy, dest, sync, limiter=self._read_limiter)
        elif sync:
            await trio.to_thread.run_sync(fsync_copy, dest, limiter=self._read_limiter)
        return lsn, digests

    async def _room_for_a_long_read(self) -> None:
        """Double the map now if more than half of it is in use. The map grows only with no
        transaction open (``_grow_map`` waits for the readers), so a map that filled during
        a long read (a snapshot's copy: seconds to a minute) stalled the writer, and every
        add_turn behind its queue, until the read ended: one add_turn waited 37 s during a
        1M snapshot under load. Reopened, a store's map is only as large as its data, so the
        first snapshot after an open would always risk it. The map is address space: the
        file grows only as pages are written."""
        if self.read_only or self._env is None:
            return  # another process owns the map's size
        info = self._env.info()
        if (info["last_pgno"] + 1) * self._env.stat()["psize"] * 2 > info["map_size"]:
            await self._grow_map()

    async def _enter_exclusive(self) -> None:
        while self._exclusive:
            await self._gate.park()
        self._exclusive = True
        while self._readers:
            await self._gate.park()

    def _leave_exclusive(self) -> None:
        self._exclusive = False
        self._gate.unpark_all()

    def map_size(self) -> int:
        """The map's size in bytes (0 once closed). While a scrub reopens the environment or
        the map grows, the handle is not to be touched: the size last read stands."""
        if self._env is None:
            return 0
        if not self._exclusive:
            self._map_bytes = self._env.info()["map_size"]
        return self._map_bytes


class _MapResized(Exception):
    """A read found the map grown by another process (read-only engines); retried."""


def _damaged(path: Path, exc: lmdb.Error) -> StoreCorrupt:
    """What opening a store whose B-tree LMDB finds broken raises (its pages are not what
    the meta page points at: a disk that lost writes, or a power cut with fsync off)."""
    return StoreCorrupt(f"{path / 'data.mdb'} is damaged: LMDB found its tree pages are not "
                        f"what its meta page points at ({exc}); a disk that lost writes, or a "
                        "power cut with Config(fsync=False), leaves this. Restore the store "
                        "from a snapshot", "data.mdb")
