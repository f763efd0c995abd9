"""A clean copy of a store: its live records and nothing else (what snapshots and
``Engine.compact`` write).

LMDB's compacting copy (in C: live pages only, renumbered) copies each page whole, and a
page's free space, an overflow page's tail and a node's padding hold whatever the page buffer
LMDB wrote it from held before (it reuses them without clearing): bytes of deleted records,
forgotten ones too. So a clean copy is that copy (:func:`copy_pages`, inside the reader's
transaction) with those bytes then overwritten with zeros (:func:`clear_copy`, after it,
before anyone opens the copy): only live records' bytes remain.

The copy takes the bytes beside a page's records from the page itself (up to 7 bytes at
either edge of its free space, its padding, an overflow page's tail) or from pages it copied
before (its write buffer starts zeroed and is reused). So the copy of a file whose pages hold
nothing stale (a scrubbed store, ``layout.SCRUBBED_KEY``) holds nothing stale either, and
``Store.copy_to`` skips the zeroing for it.
"""

from __future__ import annotations

import os
from pathlib import Path

import lmdb

from .pages import zero_stale_bytes


def copy_pages(env: lmdb.Environment, txn: lmdb.Transaction, dest: Path) -> None:
    """LMDB's compacting copy of ``env`` as ``txn`` sees it, into ``dest/data.mdb``
    (``dest`` an existing empty directory). LMDB writes it with O_DIRECT, from a thread of
    its own: 3-7 s for 1.4 GB here under load, where the same copy into a file descriptor
    through the page cache took 34-39 s."""
    env.copy(str(dest), compact=True, txn=txn)


def fsync_copy(dest: Path) -> None:
    """fsync the copy in ``dest``."""
    fd = os.open(dest / "data.mdb", os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def clear_copy(dest: Path, sync: bool = True) -> None:
    """Zero what a copy by :func:`copy_pages` carried beside the live records; with
    ``sync``, fsync it (a snapshot fsyncs it with its other files)."""
    zero_stale_bytes(dest / "data.mdb", None, None, sync=False)
    if sync:
        fsync_copy(dest)


def clean_copy(env: lmdb.Environment, txn: lmdb.Transaction, dest: Path) -> None:
    """:func:`copy_pages` then :func:`clear_copy`, flushed to disk."""
    copy_pages(env, txn, dest)
    clear_copy(dest)
