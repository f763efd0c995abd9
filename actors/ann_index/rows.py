"""One user's vectors in RAM, behind the AnnIndex actor (``ann_index.py``): the rows of a
partition in arrival order, the exact scan over them, and the hnswlib graph search when the
actor has built one.
"""

from __future__ import annotations

import hnswlib
import numpy as np
import trio

from .vectors import HEADER

HNSW_EF_SEARCH = 96
# A partition's matrix once its graph is built: hnswlib keeps a float32 copy of every vector
# it holds, so a second float32 copy here would double what the partition costs. The vectors
# are stored as float16 (vectors.py), so this copy loses nothing; scans cast it back a block at
# a time, which makes an exact scan of a graphed partition (while its graph is being written,
# or for a narrow filter) slower than over float32: 79 ms against 8.6 ms at 100k rows here.
# While the graph is only behind its rows, it answers for its rows and the scan covers the
# rest alone (knn_behind).
HALF = np.float16
DOT_BLOCK = 8_192  # rows cast to float32 at a time by an exact scan of a float16 matrix
# An exact scan multiplies only the rows a filter admits when they are under this share of
# the matrix: a float32 gather reads and writes each row it takes where a product only reads
# every row; a float16 scan casts every row it multiplies, so gathering pays up to ~70% of
# them (100k rows: 28 / 42 / 63 / 83 ms gathered at 30 / 50 / 70 / 90% against ~65 masked).
GATHER_SHARE = 0.25
GATHER_SHARE_HALF = 0.6


class _UserVectors:
    """One user's vectors: rows in arrival order; an hnswlib graph over rows when large."""

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.n = 0
        self.lsns = np.zeros(0, dtype=np.int64)
        self.chunks = np.zeros(0, dtype=np.int32)  # each row's chunk of its record
        self.meta = np.zeros(0, dtype=HEADER)
        self.matrix = np.zeros((0, dim), dtype=np.float32)
        self.alive = np.zeros(0, dtype=bool)
        self.row_of: dict[int, int] = {}  # a record's first chunk's row
        self.more: dict[int, list[int]] = {}  # the rows of a record's other chunks
        self.extra = 0  # live rows of chunks past the first: a search takes that many more
        self.graph: hnswlib.Index | None = None
        self.graph_rows = 0  # rows [0, graph_rows) are in the graph
        self.graph_dead: list[int] = []  # rows deleted but not yet marked in the graph
        self.readers = 0  # knn_query calls in flight on the graph
        self.writing = False  # the writer holds the graph (build, add_items, mark_deleted)
        self.queued = False  # in the writer's queue
        self.unsaved = False  # the graph changed since it was last saved
        # Parked: the writer, waiting for graph readers to finish.
        self.idle = trio.lowlevel.ParkingLot()

    def append(self, lsns: np.ndarray, chunks: np.ndarray, meta: np.ndarray,
               matrix: np.ndarray, dedupe: bool = True) -> None:
        """Rows (a record's chunks together, first chunk first); ``dedupe``: records already
        here are skipped (rows arriving twice, a load racing a commit, are kept once)."""
        if dedupe and self.row_of:
            fresh = np.array([lsn not in self.row_of for lsn in lsns.tolist()], dtype=bool)
            lsns, chunks, meta, matrix = lsns[fresh], chunks[fresh], meta[fresh], matrix[fresh]
        k = len(lsns)
        if not k:
            return
        need = self.n + k
        if need > len(self.lsns):
            size = max(need, 2 * len(self.lsns))  # loaded at its size; doubles as it grows
            self.lsns = np.resize(self.lsns, size)
            self.chunks = np.resize(self.chunks, size)
            self.meta = np.resize(self.meta, size)
            self.alive = np.resize(self.alive, size)
            grown = np.zeros((size, self.dim), dtype=self.matrix.dtype)
            grown[: self.n] = self.matrix[: self.n]
            self.matrix = grown
        rows = slice(self.n, need)
        self.lsns[rows], self.chunks[rows] = lsns, chunks
        self.meta[rows], self.matrix[rows] = meta, matrix
        self.alive[rows] = True
        if chunks.any():
            for row, lsn, chunk in zip(range(self.n, need), lsns.tolist(), chunks.tolist(),
                                       strict=True):
                if chunk:
                    self.more.setdefault(lsn, []).append(row)
                    self.extra += 1
                else:
                    self.row_of[lsn] = row
        else:
            self.row_of.update(zip(lsns.tolist(), range(self.n, need)))
        self.n = need

    def take_half(self, head: np.ndarray) -> None:
        """Hold the matrix as float16 (:data:`HALF`): ``head`` is its first rows, cast in a
        worker thread while rows kept arriving; the rest are cast here, and rows removed
        meanwhile are zeroed again (the cast copied them before ``remove`` cleared them).
        Trio thread, synchronous."""
        done = len(head)
        half = np.zeros((len(self.lsns), self.dim), dtype=HALF)
        half[:done] = head
        half[done : self.n] = self.matrix[done : self.n]
        half[np.flatnonzero(~self.alive[:done])] = 0
        self.matrix = half

    def rows(self, lsn: int) -> list[int]:
        """Every row of a record here (none if it has none)."""
        first = self.row_of.get(lsn)
        return ([] if first is None else [first]) + self.more.get(lsn, [])

    def remove(self, lsns: list[int]) -> bool:
        """Rows of these records (every chunk's) leave the matrix; whether any was here."""
        found = False
        for lsn in lsns:
            rows = self.rows(lsn)
            self.row_of.pop(lsn, None)
            self.extra -= len(self.more.pop(lsn, ()))
            for row in rows:
                found = True
                self.alive[row] = False
                self.matrix[row] = 0  # a graph built from the matrix later must not get it
                if row < self.graph_rows:
                    self.graph_dead.append(row)
        return found

    def exact(self, query: np.ndarray, k: int, keep: np.ndarray) -> list[tuple[int, float]]:
        """Exact scan over the first ``len(keep)`` rows. The views are taken together, before
        any await or thread: rows keep arriving on the trio thread, and the mask, the matrix
        and the lsns must describe the same rows (rows below that length never change)."""
        n = len(keep)
        return _exact(self.matrix[:n], self.lsns[:n], query, k, keep, self.chunks[:n],
                      self.extra)

    def knn(self, query: np.ndarray, k: int, keep: np.ndarray | None,
            matched: dict[int, int] | None = None) -> list[tuple[int, float]]:
        """Graph search over rows [0, graph_rows); ``keep`` (a filter) or the live rows decide
        what may be returned, inside the search. Each record once, at its best chunk (which
        goes in ``matched``); with chunk rows about, more rows are asked for so that k records
        come back."""
        rows = self.graph_rows
        allowed = (self.alive if keep is None else keep)[:rows]
        # Rows below graph_rows are fixed.
        matrix, lsns, chunks = self.matrix[:rows], self.lsns[:rows], self.chunks[:rows]
        want, extra = k, self.extra
        k = min(k + min(extra, 3 * k), int(allowed.sum()))
        if k <= 0:
            return []
        self.graph.set_ef(max(HNSW_EF_SEARCH, k))
        # Rows deleted but not yet marked in the graph are kept out by the filter too.
        check = None if keep is None and not self.graph_dead else (lambda row: bool(allowed[row]))
        try:
            labels, distances = self.graph.knn_query(query, k=k, filter=check)
        except RuntimeError:  # the filter left fewer than k reachable: scan exactly instead
            return _exact(matrix, lsns, query, want, allowed, chunks, extra, matched)
        found = labels[0]
        if not extra:
            return [(lsn, 1.0 - distance) for lsn, distance
                    in zip(lsns[found].tolist(), distances[0].tolist(), strict=True)]
        return _distinct(lsns[found], (1.0 - distances[0]).tolist(), chunks[found], want,
                         matched)

    def knn_behind(self, query: np.ndarray, k: int, keep: np.ndarray | None,
                   tail: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
                   matched: dict[int, int] | None = None) -> list[tuple[int, float]]:
        """:meth:`knn` while the graph is behind its rows: the graph answers for the rows it
        holds and an exact scan for the ``tail`` after them (matrix, lsns, mask and chunks of
        rows [graph_rows, n), taken when the search was planned), merged best first, each
        record once at its best score. A busy user's graph is behind most of the time; a scan
        of every row instead would cost a float16 matrix's whole pass per query."""
        head = self.knn(query, k, keep, matched)
        matrix, lsns, mask, chunks = tail
        places: dict[int, int] = {}
        best = dict(head)
        for lsn, score in _exact(matrix, lsns, query, k, mask, chunks, self.extra, places):
            if score > best.get(lsn, -np.inf):
                best[lsn] = score
                if matched is not None and lsn in places:
                    matched[lsn] = places[lsn]
        return sorted(best.items(), key=lambda hit: (-hit[1], hit[0]))[:k]


class _User:
    """One user's vectors, as two partitions searched and graphed apart (see the module's
    docstring): ``turn`` and ``other``."""

    __slots__ = ("turn", "other")

    def __init__(self, dim: int) -> None:
        self.turn = _UserVectors(dim)
        self.other = _UserVectors(dim)

    def parts(self) -> tuple[tuple[str, _UserVectors], ...]:
        return (("turn", self.turn), ("other", self.other))

    @property
    def n(self) -> int:
        return self.turn.n + self.other.n


def _dot(matrix: np.ndarray, query: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
    """Each row of ``matrix`` times ``query``, on the calling thread alone. ``matrix @ query``
    goes to BLAS, whose thread pool numpy does not cap: on 2 cores its threads fought the
    engine's own (every other native pool here runs one thread), and an 8,000-row scan took
    13 ms at the median under load, against 1.35 ms with one BLAS thread. numpy's own loop
    (einsum without BLAS) is as fast as BLAS on one thread for a matrix times one vector.
    A float16 matrix (:data:`HALF`) is cast back a block at a time: the same float32 values,
    so the same scores. ``rows``: only these rows (ascending), in their order, gathered a
    block at a time too."""
    if matrix.dtype != HALF:
        return np.einsum("ij,j->i", matrix if rows is None else matrix[rows], query)
    n = len(matrix) if rows is None else len(rows)
    out = np.empty(n, dtype=np.float32)
    for start in range(0, n, DOT_BLOCK):
        block = (matrix[start : start + DOT_BLOCK] if rows is None
                 else matrix[rows[start : start + DOT_BLOCK]]).astype(np.float32)
        out[start : start + DOT_BLOCK] = np.einsum("ij,j->i", block, query)
    return out


def _exact(matrix: np.ndarray, lsns: np.ndarray, query: np.ndarray, k: int,
           keep: np.ndarray, chunks: np.ndarray | None = None, extra: int = 0,
           matched: dict[int, int] | None = None) -> list[tuple[int, float]]:
    """The k best records among the rows of ``matrix`` that ``keep`` admits: [(lsn,
    cosine)], each record at its best row (chunk, noted in ``matched``). ``extra``: rows of
    chunks past the first, so k + extra rows hold k records.

    A filter that admits a small share of the rows (GATHER_SHARE, GATHER_SHARE_HALF) has
    only them multiplied: a session of a 100k-row partition is ~50 rows, not 100k cast and
    multiplied."""
    admitted = int(keep.sum())
    want = k
    k = min(k + extra, admitted)
    if k <= 0:
        return []
    if admitted < len(keep) * (GATHER_SHARE_HALF if matrix.dtype == HALF else GATHER_SHARE):
        rows = np.flatnonzero(keep)
        scores = _dot(matrix, query, rows)
        lsns = lsns[rows]
        chunks = None if chunks is None else chunks[rows]
    else:
        scores = _dot(matrix, query)
        scores[~keep] = -np.inf
    # Equal scores go by lsn: rows arrive in embedding order, which a restored or reopened
    # index does not repeat, and the same store must give the same answer.
    if k == len(scores) and not extra:  # every row (each its own record): sort them all
        top = np.lexsort((lsns, -scores))
    else:
        top = np.argpartition(-scores, k - 1)[:k]
        top = top[np.lexsort((lsns[top], -scores[top]))]
    if not extra:
        return list(zip(lsns[top].tolist(), scores[top].tolist()))
    return _distinct(lsns[top], scores[top].tolist(), chunks[top], want, matched)


def _distinct(lsns: np.ndarray, scores: list[float], chunks: np.ndarray, k: int,
              matched: dict[int, int] | None) -> list[tuple[int, float]]:
    """Rows best first -> the first k records, each at its first (best) row, whose chunk goes
    in ``matched``."""
    out: list[tuple[int, float]] = []
    seen: set[int] = set()
    for lsn, score, chunk in zip(lsns.tolist(), scores, chunks.tolist(), strict=True):
        if lsn in seen:
            continue
        seen.add(lsn)
        out.append((lsn, score))
        if matched is not None:
            matched[lsn] = chunk
        if len(out) == k:
            break
    return out
