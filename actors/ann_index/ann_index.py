"""AnnIndex actor: vector search restricted to one user inside the index.

Every user has an index of their own, so a search can only ever see that user's vectors. A
user's index holds two partitions, each with its own matrix and graph: the turns, and the other
kinds (episodes, facts, notes), which are few beside the turns (100k turns make ~10k episodes).
A search of episodes scans their rows only, and a search of turns never pays for the others: a
kind filter over one shared matrix made an episode search an exact scan of every row (97.6 ms
against 0.9 ms for turns on the graph, at 100k turns and 10k episodes). A user's index is loaded on first use from the store's ``vectors`` database (the source of
truth: vectors are never read back from hnswlib) and kept while the loaded total stays under
``Config.ann_cache_vectors``, least recently used first out.

- Below HNSW_THRESHOLD vectors a partition is searched exactly: one matrix product over a float32
  matrix (up to ~1 ms at 5k rows on this machine with a cold cache); a filter that admits a
  small share of a partition's rows has only those rows multiplied (``rows.GATHER_SHARE``).
- Above it an hnswlib graph is built in the background (~2,200 vectors/s on one thread) while
  exact search serves; then queries use the graph, and the partition's matrix becomes float16
  (``rows.HALF``): the graph holds the float32 copy. Graphs are saved at clean close (under
  ``ann/``, named by a hash of the user id) with the lsn of each row and a sha256 of both
  files written last (a graph per partition), and reloaded on first use, reconciled with the stored vectors, only if
  both files match their checksums (a shuffled ``lsns.npy`` would map rows to the wrong
  records); after a crash or on a mismatch they are rebuilt while the exact scan serves. New vectors are added to it by one writer
  task; ``add_items`` and ``knn_query`` never overlap: while the writer holds a graph, queries
  take the exact path instead of waiting (the matrix is always complete).
- Filters (session, time range, role, kind) are applied inside the search: a boolean mask over
  per-vector metadata for exact search, hnswlib's filter callback for the graph.
- Deletions arrive from the store in commit order: a deleted row leaves the mask at once and
  is marked deleted in the graph by the writer.

A stored vector's bytes and the filters are ``vectors.py``'s; a user's rows in RAM, the exact
scan and the graph search are ``rows.py``'s.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import hashlib
import json
import logging
import mmap
import os
import shutil
from collections import OrderedDict
from pathlib import Path
from typing import Any

import hnswlib
import numpy as np
import trio

from ..base.errors import disk_full
from ..store import Store, read_user_vectors
from .rows import HALF, _dot, _exact, _User, _UserVectors
from .vectors import KINDS, NO_FILTERS, PARTS, Filters, decode_rows, part_of

log = logging.getLogger("engram.ann")

__all__ = ["AnnIndex"]

try:  # glibc's, to return freed heap after a load (_return_free_heap)
    _TRIM = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
except (OSError, AttributeError):  # no glibc (musl, macOS): nothing to trim
    _TRIM = None

# Rows of a partition from which it gets a graph, and a filter's admitted rows from which a
# graphed partition is searched on the graph (fewer are gathered and scanned exactly). On 2
# cores (AMD EPYC, cold cache, k = 100) the exact scan took 0.75 ms at 4k rows, 1.25 at 8k
# and 2.6 at 20k against 0.22-0.33 ms on the graph (recall@10 0.99-0.999); a filter admitting
# 3k of 100k rows took 5.7 ms on the graph and 1.9 gathered, at 6k 3.2 and 3.4, at 10k 2.1
# and 6.0. Below it the answer is exact and a partition keeps one float32 copy.
HNSW_THRESHOLD = 5_000
HNSW_M = 16  # graph degree: recall@10 >= 0.98 on the bench corpus with HNSW_EF_SEARCH
HNSW_EF_CONSTRUCTION = 100
# Smaller exact scans run on the loop (at 4k rows ~0.25 ms with the matrix in cache, ~0.75 ms
# cold on this machine), larger ones in a worker thread.
EXACT_IN_THREAD = 4_096
WRITER_INBOX = 256  # users with new rows waiting for their graph


class _Job:
    """One partition's search, planned on the loop (see :meth:`AnnIndex._plan`) and run there
    or in a worker thread; ``hits`` and the ``chunks`` found by it once it has run."""

    __slots__ = ("uv", "call", "graph", "threaded", "hits", "chunks")

    def __init__(self, uv: _UserVectors, call: tuple[Any, ...] | None, graph: bool,
                 threaded: bool) -> None:
        self.uv, self.call, self.graph, self.threaded = uv, call, graph, threaded
        self.hits: list[tuple[int, float]] = []
        self.chunks: dict[int, int] = {}

    def run(self) -> None:
        if self.call is not None:
            fn, *args = self.call
            self.hits = fn(*args, self.chunks)


def _run_jobs(jobs: list[_Job]) -> None:
    """Several searches in one worker thread call."""
    for job in jobs:
        job.run()


def _sha256(path: Path) -> str:
    """sha256 of a file, hashed from an mmap (the GIL is released while hashing)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return hashlib.sha256(b"").hexdigest()
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)
            try:
                return hashlib.sha256(view).hexdigest()
            finally:
                view.release()


def _return_free_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim``; nothing where
    there is none), after a user's vectors were loaded or cast (worker thread). Those steps
    free temporaries of a few to tens of MB, which glibc keeps in its arenas (its mmap
    threshold rises to 32 MB after the first large free): 52 MiB of the 387 MiB a loaded
    user of 100k vectors held, measured."""
    if _TRIM is not None:
        _TRIM(0)


def _cast_half(matrix: np.ndarray, rows: int) -> np.ndarray:
    """The first ``rows`` rows of ``matrix`` as float16 (worker thread)."""
    return matrix[:rows].astype(HALF)


def _mark_deleted(graph: hnswlib.Index, row: int) -> None:
    """Mark a row deleted; a row saved as deleted and deleted again is no error."""
    try:
        graph.mark_deleted(row)
    except RuntimeError:  # hnswlib: "The requested to delete element is already deleted"
        pass


def _scrub_rows(graph: hnswlib.Index, rows: list[int], dim: int) -> None:
    """Overwrite deleted rows' vectors in the graph with zeros, and mark them deleted.
    hnswlib keeps a deleted element's vector (it still routes searches), so a saved graph
    would carry a forgotten record's vector; updating the element (which unmarks it) with
    zeros and marking it again leaves nothing of it."""
    if not rows:
        return
    graph.add_items(np.zeros((len(rows), dim), dtype=np.float32), np.array(rows))
    for row in rows:
        _mark_deleted(graph, row)


class AnnIndex:
    """The actor. Start ``run`` in the nursery; feed it through ``added`` / ``removed``, which
    the store calls in commit order."""

    def __init__(self, store: Store, dim: int, cache_vectors: int, path: Path,
                 read_only: bool = False, model_id: str = "") -> None:
        self._store = store
        self._path = path  # where graphs are saved at close, three files per user
        self._read_only = read_only  # the graphs belong to another process: never saved
        self._dim = dim
        # The model whose vectors the graphs hold: a re-embed writes every vector anew under
        # the same records, so a graph saved before would match them row for row.
        self._model_id = model_id
        self._cache_vectors = cache_vectors
        self._users: OrderedDict[str, _User] = OrderedDict()
        # Users being loaded: the adds and removals that commit meanwhile, replayed after.
        self._loading: dict[str, list[tuple[str, Any]]] = {}
        self._load_done: dict[str, trio.Event] = {}  # set when that user's load has finished
        # (user, partition) pairs whose graph has work waiting.
        self._send, self._inbox = trio.open_memory_channel[tuple[str, str]](WRITER_INBOX)
        self._graph_limiter = trio.CapacityLimiter(1)  # one graph build or update at a time
        self._search_limiter = trio.CapacityLimiter(2)  # concurrent searches: one per core
        self.damaged = 0  # saved graphs found damaged or unmatched at load, and rebuilt

    # -- the writer: builds and updates graphs ----------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            async with self._inbox:
                async for user_id, part in self._inbox:
                    user = self._users.get(user_id)
                    if user is not None:
                        uv = getattr(user, part)
                        uv.queued = False
                        await self._update_graph(user_id, part, uv)
        finally:
            # Closing: save the graphs that changed, so that a restart need not rebuild them
            # (~2,200 vectors/s here). save_index holds the GIL, which only closing can afford.
            with trio.CancelScope(shield=True):
                for user_id, user in list(self._users.items()):
                    if self._read_only:
                        break
                    for part, uv in user.parts():
                        if uv.graph is not None and uv.unsaved and not uv.writing:
                            await trio.to_thread.run_sync(self._saved_or_said, user_id, part,
                                                          uv, limiter=self._graph_limiter)

    def _saved_or_said(self, user_id: str, part: str, uv: _UserVectors) -> None:
        """Save a graph at close, or log why not: a graph is derived from the stored vectors,
        and one not saved (a full disk) is built again at the next open; no reason to fail a
        close whose every write landed."""
        try:
            self._save_graph(user_id, part, uv)
        except (OSError, RuntimeError, ValueError) as exc:  # hnswlib's save is RuntimeError
            graph_file, lsns_file, sum_file = self._graph_files(user_id, part)
            for tmp in (graph_file.with_suffix(".tmp"), lsns_file.with_suffix(".tmp.npy"),
                        sum_file.with_suffix(".tmp")):
                with contextlib.suppress(OSError):
                    tmp.unlink()
            log.warning("ann: a vector graph could not be saved (%s); the next open builds it "
                        "again from the stored vectors", exc, exc_info=not disk_full(exc))

    def _graph_files(self, user_id: str, part: str) -> tuple[Path, Path, Path]:
        """A partition's graph, the lsn of each of its rows, and the checksums of both; named
        by a hash of the user id, so that no file name carries the id. The turns' files keep
        the name a user's one graph had before partitions: such a graph loads as the turns'
        one, its rows of other kinds dead (the other kinds' graph is then built anew)."""
        name = hashlib.blake2b(user_id.encode(), digest_size=16).hexdigest()
        if part != "turn":
            name = f"{name}-{part}"
        return (self._path / f"{name}.hnsw", self._path / f"{name}.lsns.npy",
                self._path / f"{name}.sum.json")

    def _save_graph(self, user_id: str, part: str, uv: _UserVectors) -> None:
        dead, uv.graph_dead = uv.graph_dead, []
        _scrub_rows(uv.graph, dead, self._dim)  # deletions the writer had not applied yet
        graph_file, lsns_file, sum_file = self._graph_files(user_id, part)
        # Saved graphs are derived: whatever stands where one goes (a file where the folder
        # goes, a folder where a file goes) is in the way of every close, and goes.
        if not self._path.is_dir():
            self._path.unlink(missing_ok=True)
        for path in (graph_file, lsns_file, sum_file):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
        self._path.mkdir(parents=True, exist_ok=True)
        lsns_tmp, graph_tmp = lsns_file.with_suffix(".tmp.npy"), graph_file.with_suffix(".tmp")
        rows = uv.graph_rows
        # Each row's record, and its chunk when some record has several (a pair per row).
        np.save(lsns_tmp, uv.lsns[:rows] if not uv.chunks[:rows].any()
                else np.stack([uv.lsns[:rows], uv.chunks[:rows].astype(np.int64)], axis=1))
        uv.graph.save_index(str(graph_tmp))
        sums = {"rows": uv.graph_rows, "hnsw": _sha256(graph_tmp), "lsns": _sha256(lsns_tmp),
                "model": self._model_id, "vectors_epoch": self._store.vectors_epoch}
        sum_file.with_suffix(".tmp").write_text(json.dumps(sums))
        os.replace(lsns_tmp, lsns_file)
        os.replace(graph_tmp, graph_file)
        # Last: a crash before this leaves the old checksums, which the new files fail.
        os.replace(sum_file.with_suffix(".tmp"), sum_file)
        uv.unsaved = False

    def _build_user(self, user_id: str, lsns: list[int], values: bytes) -> _User:
        """A user's index from their stored vectors (worker thread: ~100k rows of work)."""
        user = _User(self._dim)
        every, chunks, meta, matrix = decode_rows(lsns, values, self._dim)
        turns = meta["kind"] == KINDS["turn"]
        for part, rows in (("turn", turns), ("other", ~turns)):
            uv = self._load_graph(user_id, part, every[rows], chunks[rows], meta[rows],
                                  matrix[rows])
            if uv is not None:  # the loaded graph holds the float32 copy (rows.HALF)
                uv.take_half(_cast_half(uv.matrix, uv.n))
            else:
                uv = _UserVectors(self._dim)
                uv.append(every[rows], chunks[rows], meta[rows], matrix[rows], dedupe=False)
            setattr(user, part, uv)
        return user

    def _load_graph(self, user_id: str, part: str, lsns: np.ndarray, chunks: np.ndarray,
                    meta: np.ndarray, matrix: np.ndarray) -> _UserVectors | None:
        """The partition's saved graph with rows in its saved order, reconciled with its
        stored vectors: rows deleted since are dead placeholders, new vectors come after.
        None when there is no usable saved graph."""
        graph_file, lsns_file, sum_file = self._graph_files(user_id, part)
        if not graph_file.exists() or not lsns_file.exists():
            return None
        try:
            sums = json.loads(sum_file.read_text())
            if not isinstance(sums, dict):
                raise ValueError("not an object")
            # Another model's, one saved before graphs named their model, or one saved
            # before the store last dropped its vectors to embed them again (a re-embed writes
            # new vectors under the same records): its files go, the graph is built anew; a
            # read-only engine leaves them to their owner.
            if (sums.get("model") != self._model_id
                    or sums.get("vectors_epoch", 0) != self._store.vectors_epoch):
                if not self._read_only:
                    for path in (graph_file, lsns_file, sum_file):
                        path.unlink(missing_ok=True)
                return None
            if (sums["hnsw"] != _sha256(graph_file) or sums["lsns"] != _sha256(lsns_file)):
                self.damaged += 1
                return None  # damaged, or not the pair that was saved together: rebuild
            rows = sums["rows"]
            saved = np.load(lsns_file)
            graph = hnswlib.Index(space="ip", dim=self._dim)
            graph.load_index(str(graph_file), max_elements=max(len(saved), len(lsns)) * 2 + 1024)
        except (OSError, RuntimeError, ValueError, KeyError, TypeError):
            self.damaged += 1
            return None
        if graph.get_current_count() != len(saved) or rows != len(saved):
            return None  # the pair was not written together: rebuild instead
        graph.set_num_threads(1)
        # A graph saved before records had chunks (or with none) names one chunk per row.
        if saved.ndim == 2:
            saved_lsns, saved_chunks = saved[:, 0].astype(np.int64), saved[:, 1].astype(np.int32)
        else:
            saved_lsns, saved_chunks = saved.astype(np.int64), np.zeros(len(saved), np.int32)
        position = {key: i for i, key in enumerate(zip(lsns.tolist(), chunks.tolist()))}
        order = [position.get(key, -1)
                 for key in zip(saved_lsns.tolist(), saved_chunks.tolist())]
        present = np.array([i >= 0 for i in order], dtype=bool)
        if not present.any():
            # Nothing it holds is stored any more: its files go, the partition starts anew.
            for path in (graph_file, lsns_file, sum_file):
                path.unlink(missing_ok=True)
            return None
        uv = _UserVectors(self._dim)
        rows = np.array([max(i, 0) for i in order], dtype=np.int64)
        uv.append(saved_lsns, saved_chunks, meta[rows], matrix[rows], dedupe=False)
        absent = np.flatnonzero(~present).tolist()
        if absent:
            # Deleted since the save (or, in a graph saved before partitions, of another
            # partition; a record some of whose chunk rows are gone, re-embedded in other
            # chunks, is taken out whole and added again from the store below): their vectors
            # leave the graph, and the files holding them go (the graph is saved again,
            # scrubbed, at close).
            stale = sorted({int(saved_lsns[row]) for row in absent})
            dead = sorted({row for lsn in stale for row in uv.rows(lsn)} | set(absent))
            uv.remove(stale)  # every row of theirs, the absent ones among them
            _scrub_rows(graph, dead, self._dim)
            for path in (graph_file, lsns_file, sum_file):
                path.unlink(missing_ok=True)
            uv.unsaved = True
        uv.graph, uv.graph_rows = graph, len(saved)
        fresh = np.array([lsn not in uv.row_of for lsn in lsns.tolist()], dtype=bool)
        if fresh.any():
            uv.append(lsns[fresh], chunks[fresh], meta[fresh], matrix[fresh], dedupe=False)
        return uv

    async def _update_graph(self, user_id: str, part: str, uv: _UserVectors) -> None:
        uv.writing = True  # from here on queries take the exact path
        try:
            while uv.readers:
                await uv.idle.park()
            rows = uv.n
            dead, uv.graph_dead = uv.graph_dead, []
            await trio.to_thread.run_sync(self._write_graph, uv, rows, dead,
                                          limiter=self._graph_limiter)
            uv.graph_rows = rows
            uv.unsaved = True
        finally:
            uv.writing = False
        if uv.graph is not None and uv.matrix.dtype != HALF:
            # The graph holds the float32 copy now: the matrix keeps float16 (rows.HALF).
            head = await trio.to_thread.run_sync(_cast_half, uv.matrix, uv.n,
                                                 limiter=self._graph_limiter)
            if uv.matrix.dtype != HALF:
                uv.take_half(head)
            del head
            await trio.to_thread.run_sync(_return_free_heap, limiter=self._graph_limiter)
        if (getattr(self._users.get(user_id), part, None) is uv
                and (uv.n > uv.graph_rows or uv.graph_dead)):
            self._schedule(uv, user_id, part)

    def _write_graph(self, uv: _UserVectors, rows: int, dead: list[int]) -> None:
        if uv.graph is None:
            graph = hnswlib.Index(space="ip", dim=self._dim)
            graph.init_index(max_elements=max(rows * 2, 1024), M=HNSW_M,
                             ef_construction=HNSW_EF_CONSTRUCTION, allow_replace_deleted=False)
            graph.set_num_threads(1)  # a pool would take both cores from the loop
            start = 0
        else:
            graph = uv.graph
            start = uv.graph_rows
            if rows > graph.get_max_elements():
                graph.resize_index(max(rows * 2, graph.get_max_elements() * 2))
        if rows > start:
            graph.add_items(np.asarray(uv.matrix[start:rows], dtype=np.float32),
                            np.arange(start, rows))
        _scrub_rows(graph, dead, self._dim)
        for row in range(start, rows):
            if not uv.alive[row]:
                _mark_deleted(graph, row)  # added as zeros: remove() cleared its matrix row
        uv.graph = graph

    def _schedule(self, uv: _UserVectors, user_id: str, part: str) -> None:
        if uv.queued or uv.writing:
            return
        try:
            self._send.send_nowait((user_id, part))
            uv.queued = True
        except trio.WouldBlock:
            pass  # the writer is behind; the next add for this user will ask again
        except trio.ClosedResourceError:
            pass  # closing: a graph update that ends now saves what it has (or none)

    def close(self) -> None:
        self._send.close()

    # -- feeding (from the store's commit callbacks, on the trio thread) --------------------

    def added(self, items: list[tuple[int, str, bytes]]) -> None:
        """Vectors just committed: (lsn, user_id, stored value)."""
        by_user: dict[str, list[tuple[int, bytes]]] = {}
        for lsn, user_id, value in items:
            by_user.setdefault(user_id, []).append((lsn, value))
        for user_id, rows in by_user.items():
            if user_id in self._loading:
                self._loading[user_id].append(("add", rows))
                continue
            user = self._users.get(user_id)
            if user is not None:
                self._append(user_id, user, rows)

    def removed(self, user_id: str, lsns: list[int], whole_user: bool) -> None:
        """Records just deleted from the store."""
        if user_id in self._loading:
            self._loading[user_id].append(("remove", (lsns, whole_user)))
        self._drop_saved(user_id, lsns, whole_user)
        if whole_user:
            self._users.pop(user_id, None)
        elif (user := self._users.get(user_id)) is not None:
            for part, uv in user.parts():
                if not uv.remove(lsns):
                    continue
                if uv.graph is not None:
                    uv.unsaved = True
                if uv.graph_dead:
                    self._schedule(uv, user_id, part)

    def _drop_saved(self, user_id: str, lsns: list[int], whole_user: bool) -> None:
        """A saved graph holds the vectors it was saved with: one holding a deleted row goes
        now. (A loaded graph is scrubbed by the writer, or before it is saved, and saved again
        at close.)"""
        for part in PARTS:
            files = self._graph_files(user_id, part)
            lsns_file = files[1]
            if not whole_user and lsns_file.exists():
                try:
                    saved = np.load(lsns_file)
                    saved = saved[:, 0] if saved.ndim == 2 else saved  # (lsn, chunk) pairs
                    if not np.isin(np.asarray(lsns, dtype=np.int64), saved).any():
                        continue
                except (OSError, ValueError):
                    pass  # unreadable: it goes too
            for path in files:
                path.unlink(missing_ok=True)

    def drop_saved_graphs(self) -> None:
        """Delete every saved graph: after a crash between a forget and its scrub they may
        hold forgotten vectors (the next use of each user rebuilds its graph)."""
        if self._path.exists():
            for path in self._path.iterdir():
                if path.suffix in (".hnsw", ".npy", ".json", ".tmp"):
                    path.unlink(missing_ok=True)

    def _append(self, user_id: str, user: _User, rows: list[tuple[int, bytes]]) -> None:
        """Rows into their partitions (by each value's kind), a graph update asked for where
        one is due."""
        for part, uv in user.parts():
            mine = [row for row in rows if part_of(row[1]) == part]
            if not mine:
                continue
            uv.append(*decode_rows([lsn for lsn, _ in mine], b"".join(v for _, v in mine),
                                   self._dim))
            if uv.graph is not None or uv.n >= HNSW_THRESHOLD:
                self._schedule(uv, user_id, part)

    # -- searching ---------------------------------------------------------------------------

    async def _user(self, user_id: str) -> _User:
        user = self._users.get(user_id)
        if user is not None:
            self._users.move_to_end(user_id)
            return user
        if user_id in self._load_done:
            await self._load_done[user_id].wait()
            return await self._user(user_id)
        self._loading[user_id] = []
        done = self._load_done[user_id] = trio.Event()
        try:
            lsns, values = await self._store.read(read_user_vectors, user_id)
            # The search limiter, not the graph writer's: a first query must not wait behind
            # another user's graph build.
            user = await trio.to_thread.run_sync(self._build_user, user_id, lsns, values,
                                                 limiter=self._search_limiter)
            del lsns, values
            await trio.to_thread.run_sync(_return_free_heap, limiter=self._search_limiter)
            forgotten = False
            for what, payload in self._loading[user_id]:
                if what == "add":
                    for part, uv in user.parts():
                        mine = [row for row in payload if part_of(row[1]) == part]
                        if mine:
                            uv.append(*decode_rows([lsn for lsn, _ in mine],
                                                   b"".join(v for _, v in mine), self._dim))
                else:
                    removed, whole = payload
                    forgotten = forgotten or whole
                    user.turn.remove(removed)
                    user.other.remove(removed)
            if forgotten:
                user = _User(self._dim)
            self._users[user_id] = user
            self._evict()
            for part, uv in user.parts():
                if uv.n > uv.graph_rows and (uv.graph is not None or uv.n >= HNSW_THRESHOLD):
                    self._schedule(uv, user_id, part)
            return user
        finally:
            del self._loading[user_id]
            del self._load_done[user_id]
            done.set()

    def _evict(self) -> None:
        total = sum(user.n for user in self._users.values())
        while total > self._cache_vectors and len(self._users) > 1:
            _, user = self._users.popitem(last=False)
            total -= user.n

    async def search(self, user_id: str, query: np.ndarray, k: int,
                     filters: Filters = NO_FILTERS, matched: dict[int, int] | None = None
                     ) -> list[tuple[int, float]]:
        """The user's k nearest records to ``query`` (unit length): [(lsn, cosine)], best
        first, each record once at its best chunk; ``matched`` gets that chunk's place for
        each record found that has several. Each partition the kind filter admits is searched
        on its own (a record's chunks are all in its kind's partition, so each list holds a
        record once); when both are, their lists merge (equal scores by lsn)."""
        return (await self.search_each(user_id, query, k, [filters], matched))[0]

    async def search_each(self, user_id: str, query: np.ndarray, k: int,
                          each: list[Filters], matched: dict[int, int] | None = None
                          ) -> list[list[tuple[int, float]]]:
        """:meth:`search` once for each of ``each``, with the scans and graph searches that
        need a thread all run in one worker thread call: a recall searches the turns and the
        other kinds as two lists, and a thread round trip costs more than a small search."""
        user = await self._user(user_id)
        jobs: list[_Job] = []
        plans: list[list[_Job]] = []
        for filters in each:
            plans.append([self._plan(uv, query, k, filters.within(part))
                          for part, uv in user.parts() if filters.admits(part)])
            jobs += plans[-1]
        threaded = [job for job in jobs if job.threaded]
        for job in threaded:
            if job.graph:
                job.uv.readers += 1
        try:
            if threaded:
                await trio.to_thread.run_sync(_run_jobs, threaded, limiter=self._search_limiter)
            else:
                await trio.lowlevel.checkpoint()
        finally:
            for job in threaded:
                if job.graph:
                    uv = job.uv
                    uv.readers -= 1
                    if not uv.readers:
                        uv.idle.unpark_all()
        out = []
        for plan in plans:
            found = []
            for job in plan:
                if not job.threaded:
                    job.run()
                if matched is not None and job.uv.more:
                    matched.update((lsn, job.chunks.get(lsn, 0)) for lsn, _ in job.hits
                                   if lsn in job.uv.more)
                found.append(job.hits)
            if not found:
                out.append([])
            elif len(found) == 1:
                out.append(found[0])
            else:
                out.append(sorted(found[0] + found[1], key=lambda hit: (-hit[1], hit[0]))[:k])
        return out

    def _plan(self, uv: _UserVectors, query: np.ndarray, k: int, filters: Filters) -> _Job:
        """One partition's k nearest, as a job: its graph when it has one that is not being
        written and the filters leave enough rows (with an exact scan of the rows it lacks
        yet), else an exact scan of its rows (on the loop when small).
        Everything the job reads is taken here, before any yield: rows keep arriving on the
        trio thread."""
        if uv.n == 0:
            return _Job(uv, None, False, False)
        keep = (uv.alive[: uv.n] & filters.mask(uv.meta[: uv.n], uv.lsns[: uv.n])
                if filters.any() else None)
        if (uv.graph is not None and not uv.writing
                and (keep is None or keep.sum() > HNSW_THRESHOLD)):
            if uv.graph_rows == uv.n:
                return _Job(uv, (uv.knn, query, k, keep), True, True)
            # Behind its rows (new rows wait for the writer): the graph for the rows it holds,
            # an exact scan for the rest, taken now.
            rows, n = slice(uv.graph_rows, uv.n), uv.n
            tail = (uv.matrix[rows], uv.lsns[rows],
                    (uv.alive[:n] if keep is None else keep)[rows].copy(), uv.chunks[rows])
            return _Job(uv, (uv.knn_behind, query, k, keep, tail), True, True)
        mask = uv.alive[: uv.n].copy() if keep is None else keep
        n = len(mask)
        return _Job(uv, (_exact, uv.matrix[:n], uv.lsns[:n], query, k, mask, uv.chunks[:n],
                         uv.extra), False, n > EXACT_IN_THREAD)

    def graphs_behind(self) -> int:
        """Users in memory who need a graph (HNSW_THRESHOLD vectors, or one already built)
        whose graph is missing, being written, or behind their rows: their searches take the
        exact scan until the writer has caught up."""
        return sum(1 for user in self._users.values()
                   if any((uv.graph is not None or uv.n >= HNSW_THRESHOLD)
                          and (uv.graph is None or uv.writing or uv.graph_rows < uv.n)
                          for _, uv in user.parts()))

    def similarities(self, user_id: str, query: np.ndarray, lsns: list[int],
                     part: str | None = None) -> dict[int, float]:
        """Cosine of ``query`` with each of these records (at its best chunk), for a user
        already loaded (a search loads it); records without a vector yet, and users not in
        RAM, are left out. ``part``: only that partition's rows (``"turn"``: the records are
        all turns), else both."""
        user = self._users.get(user_id)
        if user is None:
            return {}
        out: dict[int, float] = {}
        for name, uv in user.parts():
            if part is not None and name != part:
                continue
            row_of, more = uv.row_of, uv.more
            owners, rows = [], []
            for lsn in lsns:  # each record's rows, as uv.rows gives them
                row = row_of.get(lsn)
                if row is not None:
                    owners.append(lsn)
                    rows.append(row)
                for row in more.get(lsn, ()) if more else ():
                    owners.append(lsn)
                    rows.append(row)
            if rows:
                scores = _dot(uv.matrix[rows], query)
                # max(x, best), without the call: this runs for every neighbour of every
                # recall's candidates.
                for lsn, x in zip(owners, scores.tolist(), strict=True):
                    best = out.get(lsn, -1.0)
                    out[lsn] = best if best > x else x
        return out

    async def admitted(self, user_id: str, lsns: list[int], filters: Filters) -> set[int]:
        """Those of ``lsns`` that ``filters`` admit, judged by their rows' metadata (session,
        time, role, kind), as a search with these filters would; a record without a vector
        yet cannot be judged here and is kept (its caller checks the record itself)."""
        user = await self._user(user_id)
        out = set(lsns)
        for part, uv in user.parts():
            row_of = uv.row_of
            pairs = [(lsn, row) for lsn in lsns if (row := row_of.get(lsn)) is not None]
            if not pairs:
                continue
            # As a search plans it: a partition none of whose kinds the filters admit keeps
            # nothing, and one they admit whole is judged without the kind filter (a recall
            # of turns only: every turn row passes, no mask is made).
            if not filters.admits(part):
                out.difference_update(lsn for lsn, _ in pairs)
                continue
            within = filters.within(part)
            if not within.any():
                continue
            rows = np.array([row for _, row in pairs], dtype=np.int64)
            keep = within.mask(uv.meta[rows], uv.lsns[rows])
            out.difference_update(lsn for (lsn, _), kept in zip(pairs, keep.tolist(),
                                                                 strict=True) if not kept)
        return out

    async def count(self, user_id: str) -> int:
        """The user's records with vectors (loading the user, as a search would)."""
        user = await self._user(user_id)
        return len(user.turn.row_of) + len(user.other.row_of)

    def loaded(self) -> dict[str, int]:
        """Loaded users and their vector counts (for stats and tests)."""
        return {user_id: sum(int(uv.alive[: uv.n].sum()) for _, uv in user.parts())
                for user_id, user in self._users.items()}
