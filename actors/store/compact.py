"""A clean copy of a store: every live record into a new environment, and nothing else (what
snapshots and ``Engine.compact`` write)."""

from __future__ import annotations

import itertools
from pathlib import Path

import lmdb

from .layout import MAX_DBS, MAX_READERS

CLEAN_COPY_CHUNK = 65_536  # records per write transaction of a clean copy (LMDB caps dirty pages)


def clean_copy(env: lmdb.Environment, txn: lmdb.Transaction, dest: Path) -> None:
    """Copy every named database of ``env`` as ``txn`` sees it, record by record, into a new
    environment in the existing empty directory ``dest``, and flush it to disk.

    Why not LMDB's compacting copy: it copies pages whole, and a page's free space can hold
    bytes of deleted records (a deletion moves the page's other records over the deleted one;
    LMDB reuses page buffers without clearing them). A new environment that only ever held
    the live records writes nothing else. Costs more than a page copy: every record passes
    through Python's iterator (still C calls, no decoding)."""
    out = lmdb.open(str(dest), map_size=env.info()["map_size"], max_dbs=MAX_DBS,
                    max_readers=MAX_READERS, sync=False, metasync=False, writemap=False)
    try:
        names = [key for key, _ in txn.cursor()]  # the main database lists the named ones
        for name in names:
            source = txn.cursor(env.open_db(name, txn=txn, create=False))
            records = source.iternext()
            with out.begin(write=True) as wtxn:
                target = out.open_db(name, txn=wtxn)
            while True:
                with out.begin(write=True) as wtxn:
                    cursor = wtxn.cursor(target)
                    _, added = cursor.putmulti(itertools.islice(records, CLEAN_COPY_CHUNK),
                                               append=True)
                if added < CLEAN_COPY_CHUNK:
                    break
        out.sync(True)
    finally:
        out.close()
