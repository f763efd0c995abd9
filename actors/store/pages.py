"""LMDB's data file page by page: the bytes LMDB leaves behind, found and overwritten.

LMDB never clears what it no longer uses. A page it copies on write keeps its old version as
a free page until reused; a page's free space (between its node pointers and its nodes), the
unused tail of an overflow page and a node's padding byte carry whatever the page buffer held
before, and LMDB reuses its page buffers without clearing them, so bytes of any record the
process ever wrote (a forgotten one too) can turn up in pages of records that have nothing to
do with it. :func:`zero_stale_bytes` walks the file's B-trees from the newest meta page and
overwrites all of that with zeros, touching only bytes that no transaction reads:

- the free space, padding bytes and overflow tails of the pages the newest tree uses (no
  reader reads them: they are outside every node);
- the free pages LMDB itself would hand to the next write (freed by a transaction older
  than every reader's snapshot and than the latest commit, whose freed pages the previous
  meta page still points to, for a crash while the next meta is written).

It runs inside a write transaction that has written nothing yet, so LMDB's writer lock keeps
every page where it is, and a dirty page of the transaction cannot have been spilled to the
file. Everything it will write is found before anything is written: a page that does not
parse as LMDB 0.9 lays it out raises :class:`PageFormatError` and the file is left untouched.

The layout (lmdb.h / mdb.c of LMDB 0.9, 64-bit): a page starts with a 16-byte header (pgno
u64, pad u16, flags u16, lower u16 and upper u16, or the page count u32 of an overflow
page); a branch or leaf page has a u16 offset per node from byte 16 up to ``lower`` and its
nodes from ``upper`` to the page's end; a node has an 8-byte header (lo u16, hi u16, flags
u16, key size u16), its key, then its data (a leaf's: ``lo | hi << 16`` bytes, or the u64
number of the overflow page that holds them) or, on a branch page, the child page number
``lo | hi << 16 | flags << 32``; nodes are padded to an even size.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import NamedTuple

import numpy as np

HEADER = 16  # bytes of a page header
NODE = 8  # bytes of a node header
P_BRANCH, P_LEAF, P_OVERFLOW = 0x01, 0x02, 0x04  # page flags
F_BIGDATA, F_SUBDATA, F_DUPDATA = 0x01, 0x02, 0x04  # leaf node flags
META_MAGIC = 0xBEEFC0DE
P_INVALID = 2 ** 64 - 1  # the root of an empty tree
CHUNK = 65_536  # pages one vectorised step of a walk parses (bounds its temporary arrays)
DIRTY_ONE_BY_ONE = 1024  # fewer ranges than this are looked at one by one, not in one pass
PAST_STEP = 1 << 20  # bytes past the last page looked at (and zeroed) at a time
META_BYTES = 1 << 16  # read to hold both meta pages (pages 0 and 1) of any page size


class PageFormatError(Exception):
    """The data file is not laid out as this module reads LMDB 0.9's: nothing was written."""


class Meta(NamedTuple):
    """The newest of the file's two meta pages."""

    psize: int
    txnid: int
    last_pgno: int
    free_root: int
    main_root: int


class Scrubbed(NamedTuple):
    """What one :func:`zero_stale_bytes` did."""

    bytes_zeroed: int  # stale bytes it overwrote
    free_pages: int  # free pages it found holding something, and overwrote
    kept_pages: int  # free pages a reader or the previous meta page may still need: left


def _le(buf: np.ndarray, offsets: np.ndarray, width: int) -> np.ndarray:
    """Little-endian unsigned integers of ``width`` (2, 4 or 8) bytes at each of
    ``offsets``: one gather of every byte, then a view."""
    offsets = np.asarray(offsets, dtype=np.int64)
    raw = buf[offsets[:, None] + np.arange(width)]
    return raw.view(f"<u{width}").reshape(len(offsets)).astype(np.uint64)


def read_meta(buf: np.ndarray) -> Meta:
    """The newest meta page (of pages 0 and 1; each names the tree it commits)."""
    metas = []
    for page in (0, 1):
        psize = int(_le(buf, np.array([HEADER + 24]), 4)[0])  # the free DB's md_pad: psize
        base = page * psize
        magic, version = (int(v) for v in _le(buf, np.array([base + 16, base + 20]), 4))
        if magic != META_MAGIC or version != 1:
            raise PageFormatError(f"meta page {page}: magic {magic:#x} version {version}, "
                                  f"expected {META_MAGIC:#x} version 1")
        free_root, main_root, last, txnid = (int(v) for v in _le(
            buf, np.array([base + 80, base + 128, base + 136, base + 144]), 8))
        metas.append(Meta(psize, txnid, last, free_root, main_root))
    return max(metas, key=lambda m: m.txnid)


class _Tree(NamedTuple):
    pages: list[np.ndarray]  # every page number the tree uses (branch, leaf, overflow)
    gaps: list[np.ndarray]  # (start, end) byte ranges of the branch and leaf pages' free space
    pads: list[np.ndarray]  # byte offsets of nodes' padding bytes
    tails: list[np.ndarray]  # (start, end) byte ranges after an overflow value's last byte
    # (key offset, key size, data offset, data size, flags) of every leaf node, kept only
    # for the trees whose records are read (the free list and the main database)
    leaves: list[tuple[np.ndarray, ...]]


def _walk(buf: np.ndarray, meta: Meta, root: int, keep_leaves: bool) -> _Tree:
    """Every page of the tree at ``root``, level by level, CHUNK pages a step."""
    tree = _Tree([], [], [], [], [])
    level = np.array([] if root == P_INVALID else [root], dtype=np.int64)
    while len(level):
        following = []
        for at in range(0, len(level), CHUNK):
            following.append(_step(buf, meta, level[at:at + CHUNK], tree, keep_leaves))
        level = np.concatenate(following)
    return tree


def _step(buf: np.ndarray, meta: Meta, pgnos: np.ndarray, tree: _Tree,
          keep_leaves: bool) -> np.ndarray:
    """Parse branch and leaf pages; record what :func:`_walk` collects; return the children."""
    psize = meta.psize
    if len(pgnos) and (pgnos.min() < 2 or pgnos.max() > meta.last_pgno):
        raise PageFormatError(f"a page number outside 2..{meta.last_pgno}")
    base = pgnos * psize
    stamped = _le(buf, base, 8).astype(np.int64)
    flags = _le(buf, base + 10, 2).astype(np.int64)
    lower = _le(buf, base + 12, 2).astype(np.int64)
    upper = _le(buf, base + 14, 2).astype(np.int64)
    kind = flags & (P_BRANCH | P_LEAF | P_OVERFLOW)
    bad = (stamped != pgnos) | ((kind != P_BRANCH) & (kind != P_LEAF)) | (lower < HEADER) \
        | (lower > upper) | (upper > psize) | ((lower & 1) != 0)
    if bad.any():
        page = int(pgnos[np.argmax(bad)])
        raise PageFormatError(f"page {page} is not a branch or leaf page as LMDB writes one")
    tree.pages.append(pgnos)
    tree.gaps.append(np.stack([base + lower, base + upper], axis=1))
    counts = (lower - HEADER) // 2
    owner = np.repeat(np.arange(len(pgnos)), counts)
    index = np.arange(len(owner)) - np.repeat(np.cumsum(counts) - counts, counts)
    page_base = base[owner]
    node = page_base + _le(buf, page_base + HEADER + 2 * index, 2).astype(np.int64)
    lo = _le(buf, node, 2).astype(np.int64)
    hi = _le(buf, node + 2, 2).astype(np.int64)
    nflags = _le(buf, node + 4, 2).astype(np.int64)
    ksize = _le(buf, node + 6, 2).astype(np.int64)
    branch = (flags[owner] & P_BRANCH) != 0
    big = ~branch & ((nflags & F_BIGDATA) != 0)
    dsize = np.where(branch, 0, lo | (hi << 16))
    stored = np.where(big, 8, dsize)  # bytes of data in the node itself
    end = node + NODE + ksize + stored
    if ((node < page_base + upper[owner]) | (end > page_base + psize)).any() \
            or (~branch & ((nflags & F_DUPDATA) != 0)).any():
        raise PageFormatError("a node outside its page, or a duplicate-sorted one (the store "
                              "has none)")
    odd = (end & 1) != 0
    tree.pads.append(end[odd])
    children = (lo | (hi << 16) | (nflags << 32))[branch]
    data = node + NODE + ksize
    if big.any():
        over = _le(buf, data[big], 8).astype(np.int64)
        size = dsize[big]
        if (over < 2).any() or (over > meta.last_pgno).any():
            raise PageFormatError("an overflow page number outside the file")
        obase = over * psize
        pages = _le(buf, obase + 12, 4).astype(np.int64)
        if ((_le(buf, obase, 8).astype(np.int64) != over)
                | ((_le(buf, obase + 10, 2).astype(np.int64) & P_OVERFLOW) == 0)
                | (pages * psize < HEADER + size)
                | (over + pages - 1 > meta.last_pgno)).any():
            raise PageFormatError("a leaf names an overflow page that is not one")
        tree.tails.append(np.stack([obase + HEADER + size, obase + pages * psize], axis=1))
        tree.pages.append(np.concatenate([np.arange(p, p + n) for p, n in zip(over, pages)]))
        data = data.copy()
        data[big] = obase + HEADER
    if keep_leaves:
        leaf = ~branch
        tree.leaves.append((node[leaf] + NODE, ksize[leaf], data[leaf], dsize[leaf],
                            nflags[leaf]))
    return children


def _free_pages(buf: np.ndarray, tree: _Tree) -> tuple[np.ndarray, np.ndarray]:
    """The free list (LMDB's database 0): each free page number and the transaction that
    freed it. A record's key is that transaction's id; its data a count, then page numbers."""
    pgnos, freed_by = [], []
    for key_off, ksize, data, dsize, _ in tree.leaves:
        if (ksize != 8).any() or (dsize % 8 != 0).any() or (dsize < 8).any():
            raise PageFormatError("a free-list record not shaped as LMDB writes one")
        txnids = _le(buf, key_off, 8).astype(np.int64)
        for txnid, at, size in zip(txnids, data, dsize):
            ids = np.frombuffer(buf[at:at + size].tobytes(), dtype="<u8").astype(np.int64)
            if ids[0] != len(ids) - 1:
                raise PageFormatError(f"free-list record {txnid}: {ids[0]} pages in "
                                      f"{len(ids) - 1} slots")
            pgnos.append(ids[1:])
            freed_by.append(np.full(len(ids) - 1, txnid))
    if not pgnos:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(pgnos), np.concatenate(freed_by)


def _subdb_roots(buf: np.ndarray, main: _Tree) -> list[int]:
    """The roots of the named databases: the main database's records flagged F_SUBDATA
    hold an MDB_db (48 bytes), its root page at byte 40."""
    roots = []
    for _, _, data, dsize, nflags in main.leaves:
        sub = (nflags & F_SUBDATA) != 0
        if (dsize[sub] != 48).any():
            raise PageFormatError("a named database's record is not an MDB_db")
        roots += [int(r) for r in _le(buf, data[sub] + 40, 8) if r != P_INVALID]
    return roots


def _dirty(buf: np.ndarray, ranges: np.ndarray) -> list[tuple[int, int]]:
    """The (start, end) ranges (disjoint) that hold a byte other than zero. Many ranges are
    looked at in one pass over the span they cover (one reduction in C), a few one by one."""
    ranges = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
    ranges = ranges[ranges[:, 1] > ranges[:, 0]]
    if len(ranges) < DIRTY_ONE_BY_ONE:
        return [(int(a), int(b)) for a, b in ranges if buf[a:b].any()]
    ranges = ranges[np.argsort(ranges[:, 0], kind="stable")]
    bounds = ranges.reshape(-1)  # start, end, start, end...: the odd segments lie between
    if bounds[-1] == len(buf):  # reduceat takes the last segment to the end by itself
        bounds = bounds[:-1]
    held = np.bitwise_or.reduceat(buf, bounds)[0::2] != 0
    return [(int(a), int(b)) for a, b in ranges[held]]


def zero_stale_bytes(path: Path, txnid: int | None, oldest: int | None, *,
                     live: bool = True, freed: tuple[int, int | None] = (0, None),
                     sync: bool = True) -> Scrubbed:
    """Overwrite with zeros the bytes LMDB keeps but no transaction reads (module docstring).

    Call it from inside a write transaction of the environment that has written nothing, or
    on a file no process has open (a copy being made: ``txnid`` and ``oldest`` None).

    Args:
        path: the environment's ``data.mdb``.
        txnid: the id of that write transaction (the newest meta page must be its
            predecessor's).
        oldest: the oldest snapshot a reader holds (LMDB reader table), or ``txnid - 1``
            if older than every one: free pages freed by transactions before it are zeroed.
        live: also the free space, padding and overflow tails of the pages in use.
        freed: (first, end): only the free pages freed by transactions ``first`` up to
            before ``end`` (None: no end).
        sync: fsync the file before returning.

    Returns:
        What was overwritten and what was left.

    Raises:
        PageFormatError: the file is not laid out as expected (nothing was written, but for
            a file short of free pages given its full length first, inside a transaction).
    """
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if txnid is not None:
            # Inside the environment's write transaction: the committed trees' pages are all
            # written, so pages past the end of the file are ones a commit took and gave back
            # (in_use_fits): free, and zeros are what a free page may hold.
            meta = read_meta(np.frombuffer(os.pread(fd, META_BYTES, 0), dtype=np.uint8))
            if size < (meta.last_pgno + 1) * meta.psize:
                size = (meta.last_pgno + 1) * meta.psize
                os.ftruncate(fd, size)
        problem = None
        # Written through a shared mapping (the page cache LMDB's own map and writes share):
        # millions of scattered bytes (padding) cost a store each, not a system call each.
        with mmap.mmap(fd, size, access=mmap.ACCESS_WRITE) as view:
            buf = np.frombuffer(view, dtype=np.uint8)
            try:
                ranges, pads, free, kept = _plan(buf, txnid, oldest, live, freed)
                for start, end in ranges:
                    buf[start:end] = 0
                buf[pads] = 0
            except (PageFormatError, IndexError, ValueError) as exc:  # an offset past the end
                problem = f"{exc}"  # not the exception: its frames hold views of the map
            del buf  # the map closes only once no array views it
            zeroed = 0 if problem else sum(end - start for start, end in ranges) + len(pads)
            if zeroed and sync:
                view.flush()
        if problem is not None:
            raise PageFormatError(problem)
        return Scrubbed(zeroed, free, kept)
    finally:
        os.close(fd)


def in_use_fits(path: Path) -> bool:
    """Whether every page the newest meta page's trees use lies inside ``path``'s length.

    LMDB may end a commit with its last page numbers free: pages a transaction took and
    gave back before it committed are never written, so the file can end before the meta
    page's last page and still hold everything any tree reads (a later commit that takes
    them writes them). A file cut short loses pages a tree reads; this tells the two apart
    by walking the trees with plain reads (a mapped read past the end is SIGBUS)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as view:
            buf = np.frombuffer(view, dtype=np.uint8)
            fits = _trees_fit(buf)
            del buf  # the map closes only once no array views it
        return fits
    finally:
        os.close(fd)


def _trees_fit(buf: np.ndarray) -> bool:
    try:
        meta = read_meta(buf)
    except (PageFormatError, IndexError, ValueError):
        return False
    return _trees_problem(buf, meta._replace(last_pgno=len(buf) // meta.psize - 1)) is None


def _trees_problem(buf: np.ndarray, meta: Meta) -> str | None:
    """What keeps a page of ``meta``'s trees (the free list, the main database and every
    named one) from parsing as LMDB lays it out, or None."""
    try:
        _walk(buf, meta, meta.free_root, keep_leaves=False)
        main = _walk(buf, meta, meta.main_root, keep_leaves=True)
        for root in _subdb_roots(buf, main):
            _walk(buf, meta, root, keep_leaves=False)
    except (PageFormatError, IndexError, ValueError) as exc:
        return f"{exc}" or type(exc).__name__  # not the exception: it holds views of the map
    return None


def damaged_page(path: Path) -> str | None:
    """What makes a page of the newest meta page's trees unreadable, or None: LMDB's own
    reads trust a page's layout, and some damage (a zeroed leaf page) trips an assertion that
    aborts the process instead of an error. Read with plain reads of the file; call it
    holding a read transaction of the environment, so that no page of a tree committed since
    that transaction began is reused under the walk."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        # The meta page first, then the length: LMDB writes a tree's pages before the meta
        # page naming it, so the file then holds all of them though a writer commits
        # meanwhile (read the other way round, a commit in between named pages past the map).
        try:
            meta = read_meta(np.frombuffer(os.pread(fd, META_BYTES, 0), dtype=np.uint8))
        except (PageFormatError, IndexError, ValueError) as exc:
            return f"{exc}" or type(exc).__name__
        size = os.fstat(fd).st_size
        with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as view:
            buf = np.frombuffer(view, dtype=np.uint8)
            problem = _trees_problem(buf, meta._replace(
                last_pgno=min(meta.last_pgno, len(buf) // meta.psize - 1)))
            del buf  # the map closes only once no array views it
        return problem
    finally:
        os.close(fd)


def _plan(buf: np.ndarray, txnid: int | None, oldest: int | None, live: bool,
          freed: tuple[int, int | None]
          ) -> tuple[list[tuple[int, int]], np.ndarray, int, int]:
    """What to zero: byte ranges, and single bytes (padding), each holding something; how
    many free pages among them; how many free pages were left."""
    meta = read_meta(buf)
    if txnid is None:  # nobody else has the file: as from the next write, with no reader
        txnid, oldest = meta.txnid + 1, meta.txnid
    if meta.txnid != txnid - 1:
        raise PageFormatError(f"the newest meta page commits transaction {meta.txnid}, "
                              f"expected {txnid - 1} (the one before the caller's)")
    if len(buf) < (meta.last_pgno + 1) * meta.psize:
        raise PageFormatError(f"the file ends before its last page {meta.last_pgno}")
    psize = meta.psize
    free_tree = _walk(buf, meta, meta.free_root, keep_leaves=True)
    pgnos, freed_by = _free_pages(buf, free_tree)
    trees = [free_tree]
    if live:
        main = _walk(buf, meta, meta.main_root, keep_leaves=True)
        trees.append(main)
        trees += [_walk(buf, meta, root, keep_leaves=False) for root in _subdb_roots(buf, main)]
    used = np.concatenate([np.zeros(0, np.int64), *(p for t in trees for p in t.pages)])
    if np.intersect1d(used, pgnos).size or (pgnos < 2).any() or (pgnos > meta.last_pgno).any():
        raise PageFormatError("the free list names a page in use or outside the file")
    first, end = freed
    asked = freed_by >= first
    if end is not None:
        asked &= freed_by < end
    reusable = asked & (freed_by < oldest)
    ranges: list[tuple[int, int]] = []
    pads: list[np.ndarray] = [np.zeros(0, np.int64)]
    starts = np.sort(pgnos[reusable]) * psize
    ranges += _dirty(buf, np.stack([starts, starts + psize], axis=1))
    free = len(ranges)
    if live:
        for tree in trees:
            for gaps in (*tree.gaps, *tree.tails):
                ranges += _dirty(buf, gaps)
            pads += [p[buf[p] != 0] for p in tree.pads]
        # Past the last page: what a transaction that spilled pages there and then aborted
        # wrote (no tree reaches it; a later write takes it as new pages).
        past = (meta.last_pgno + 1) * psize
        ranges += _dirty(buf, np.array([[at, min(at + PAST_STEP, len(buf))]
                                        for at in range(past, len(buf), PAST_STEP)]))
    return ranges, np.concatenate(pads), free, int((asked & ~reusable).sum())
