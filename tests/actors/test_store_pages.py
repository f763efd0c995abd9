"""actors/store/pages.py on bare LMDB environments: what it zeroes, what it must leave."""

from __future__ import annotations

import random
from pathlib import Path

import lmdb
import numpy as np
import pytest

from actors.store.compact import clean_copy, copy_pages
from actors.store.forget import _reader_txnids
from actors.store.pages import PageFormatError, read_meta, zero_stale_bytes

MARKER = b"qzxjstalemarker"
NAMES = (b"small", b"big")


def _open(path: Path) -> lmdb.Environment:
    return lmdb.open(str(path), map_size=64 << 20, max_dbs=4)


def _fill(env: lmdb.Environment, seed: int) -> None:
    """Records of two databases, some holding the marker, some long (overflow pages), written
    over many transactions so that pages are copied, split and freed."""
    rng = random.Random(seed)
    for batch in range(40):
        with env.begin(write=True) as txn:
            for name in NAMES:
                db = env.open_db(name, txn=txn)
                for i in range(25):
                    size = rng.choice([20, 200, 3000 if name == b"big" else 60])
                    marked = rng.random() < 0.3
                    key = b"%s-%04d-%02d" % (b"m" if marked else b"k", batch, i)
                    body = (MARKER if marked else b"kept") + rng.randbytes(size)
                    txn.put(key, body, db=db)


def _forget_marked(env: lmdb.Environment) -> None:
    with env.begin(write=True) as txn:
        for name in NAMES:
            db = env.open_db(name, txn=txn)
            doomed = [k for k, _ in txn.cursor(db) if k.startswith(b"m-")]
            for key in doomed:
                txn.delete(key, db=db)


def _records(env: lmdb.Environment) -> dict[bytes, list[tuple[bytes, bytes]]]:
    with env.begin() as txn:
        return {name: list(txn.cursor(env.open_db(name, txn=txn))) for name in NAMES}


def _commit(env: lmdb.Environment) -> None:
    with env.begin(write=True) as txn:
        txn.put(b"tick", b"", db=env.open_db(b"small", txn=txn))
        txn.delete(b"tick", db=env.open_db(b"small", txn=txn))


def _zero(env: lmdb.Environment, path: Path, **kwargs):
    txn = env.begin(write=True)
    try:
        oldest = min([txn.id() - 1, *_reader_txnids(env)])
        return txn.id(), oldest, zero_stale_bytes(path / "data.mdb", txn.id(), oldest,
                                                  **kwargs)
    finally:
        txn.abort()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_zeroing_keeps_every_record_and_no_deleted_byte(tmp_path: Path, seed: int) -> None:
    """After the deletion, a fresh open, the zeroing, a commit and the zeroing of what the
    commit before it freed, the file holds no byte of a deleted record, every live record
    reads the same, and the environment goes on writing and reading."""
    env = _open(tmp_path)
    _fill(env, seed)
    _forget_marked(env)
    kept = _records(env)
    assert MARKER in (tmp_path / "data.mdb").read_bytes()
    env.close()  # the page buffers this process wrote the records from go with it
    env = _open(tmp_path)
    try:
        first, oldest, done = _zero(env, tmp_path)
        assert done.bytes_zeroed > 0 and done.kept_pages > 0  # the last commit's: kept
        _commit(env)
        _, reached, done = _zero(env, tmp_path, live=False, freed=(oldest, first))
        assert reached >= first and done.kept_pages == 0
        assert (tmp_path / "data.mdb").read_bytes().count(MARKER) == 0
        assert _records(env) == kept
        with env.begin(write=True) as txn:
            txn.put(b"after", b"written after", db=env.open_db(b"small", txn=txn))
        assert dict(_records(env)[b"small"])[b"after"] == b"written after"
    finally:
        env.close()
    env = _open(tmp_path)
    try:
        assert _records(env)[b"big"] == kept[b"big"]
    finally:
        env.close()


def test_a_readers_snapshot_keeps_the_pages_it_reads(tmp_path: Path) -> None:
    """Pages a reader's snapshot from before the deletion still reads are left whole until
    it ends: it reads the deleted records as they were; after it, they go."""
    env = _open(tmp_path)
    try:
        _fill(env, 7)
        reader = env.begin()
        before = {name: list(reader.cursor(env.open_db(name, txn=reader))) for name in NAMES}
        _forget_marked(env)
        _commit(env)
        _, _, done = _zero(env, tmp_path)
        assert done.kept_pages > 0
        again = {name: list(reader.cursor(env.open_db(name, txn=reader))) for name in NAMES}
        assert again == before
        assert any(k.startswith(b"m-") for k, _ in again[b"big"])
        reader.abort()
        env.close()
        env = _open(tmp_path)
        first, oldest, _ = _zero(env, tmp_path)
        _commit(env)
        _zero(env, tmp_path, live=False, freed=(oldest, first))
        assert (tmp_path / "data.mdb").read_bytes().count(MARKER) == 0
    finally:
        env.close()


def test_a_page_it_cannot_read_leaves_the_file_untouched(tmp_path: Path) -> None:
    """A branch or leaf page whose header does not name it is PageFormatError, and not one
    byte of the file was written."""
    env = _open(tmp_path)
    try:
        _fill(env, 5)
        _forget_marked(env)
        data = tmp_path / "data.mdb"
        meta = read_meta(np.frombuffer(data.read_bytes(), dtype=np.uint8))
        with data.open("r+b") as f:  # in place: LMDB has the file mapped
            # The main database's root page: renumbered in its own header.
            f.seek(meta.main_root * meta.psize)
            f.write((meta.main_root + 1).to_bytes(8, "little"))
        damaged = data.read_bytes()
        with pytest.raises(PageFormatError, match="not a branch or leaf page"):
            _zero(env, tmp_path)
        assert data.read_bytes() == damaged
    finally:
        env.close()


def test_a_clean_copy_holds_the_live_records_and_nothing_else(tmp_path: Path) -> None:
    """LMDB's compacting copy of a store right after a deletion carries deleted bytes in
    its pages' free space; the clean copy (that copy, then zeroed) holds none, and every live
    record reads the same from it."""
    env = _open(tmp_path / "live")
    try:
        _fill(env, 11)
        _forget_marked(env)
        kept = _records(env)
        for name in ("bare", "clean"):
            (tmp_path / name).mkdir()
        with env.begin() as txn:
            copy_pages(env, txn, tmp_path / "bare")
            clean_copy(env, txn, tmp_path / "clean")
    finally:
        env.close()
    assert MARKER in (tmp_path / "bare" / "data.mdb").read_bytes()
    assert MARKER not in (tmp_path / "clean" / "data.mdb").read_bytes()
    copy = _open(tmp_path / "clean")
    try:
        assert _records(copy) == kept
    finally:
        copy.close()


@pytest.mark.parametrize("seed", [4, 5])
def test_the_copy_of_a_scrubbed_file_holds_no_deleted_byte_without_zeroing(
        tmp_path: Path, seed: int) -> None:
    """After a deletion, the environment opened afresh and the file zeroed (the scrub), and
    more writes after it, LMDB's compacting copy holds no byte of the deleted records
    although nothing zeroes it, and every live record reads the same from it. (Without the
    scrub the same copy carries them: test_a_clean_copy_holds_the_live_records_and_nothing_else.)"""
    live = tmp_path / "live"
    env = _open(live)
    try:
        _fill(env, seed)
        _forget_marked(env)
    finally:
        env.close()  # its page buffers held the marked records
    env = _open(live)
    try:
        _zero(env, live)
        _commit(env)
        _zero(env, live, live=False)  # the pages the zeroing had to leave to the last meta
        rng = random.Random(seed)
        for batch in range(10):  # writes after the scrub, copying pages it cleaned
            with env.begin(write=True) as txn:
                db = env.open_db(b"big", txn=txn)
                for i in range(25):
                    txn.put(b"k-after-%02d-%02d" % (batch, i), b"kept" + rng.randbytes(
                        rng.choice([20, 300, 3000])), db=db)
        assert MARKER not in (live / "data.mdb").read_bytes()
        kept = _records(env)
        (tmp_path / "copy").mkdir()
        with env.begin() as txn:
            copy_pages(env, txn, tmp_path / "copy")
    finally:
        env.close()
    assert MARKER not in (tmp_path / "copy" / "data.mdb").read_bytes()
    copy = _open(tmp_path / "copy")
    try:
        assert _records(copy) == kept
    finally:
        copy.close()


def _big_env(path: Path) -> lmdb.Environment:
    """~24 MB of records over many transactions: a copy of two HASH_STEPs and a tail."""
    env = lmdb.open(str(path), map_size=256 << 20, max_dbs=4)
    rng = random.Random(5)
    for batch in range(40):
        with env.begin(write=True) as txn:
            db = env.open_db(b"big", txn=txn)
            for i in range(100):
                txn.put(b"%04d-%03d" % (batch, i), rng.randbytes(rng.choice([50, 9000])), db=db)
    return env


def test_a_hashed_copy_is_the_compacting_copy_and_its_chunks_sha256s(tmp_path: Path) -> None:
    """The one-pass copy writes the same bytes as LMDB's compacting copy of the same
    transaction, and returns the sha256 of each chunk of them, the short tail included."""
    import hashlib

    from actors.store.compact import HASH_STEP, copy_pages_hashed

    env = _big_env(tmp_path / "src")
    try:
        for name in ("bare", "hashed"):
            (tmp_path / name).mkdir()
        with env.begin() as txn:
            copy_pages(env, txn, tmp_path / "bare")
            digests = copy_pages_hashed(env, txn, tmp_path / "hashed", HASH_STEP)
    finally:
        env.close()
    data = (tmp_path / "hashed" / "data.mdb").read_bytes()
    assert data == (tmp_path / "bare" / "data.mdb").read_bytes()
    assert len(data) > 2 * HASH_STEP and len(data) % HASH_STEP
    assert digests == [hashlib.sha256(data[at:at + HASH_STEP]).hexdigest()
                       for at in range(0, len(data), HASH_STEP)]


def test_a_hashed_copy_that_cannot_write_fails_and_does_not_hang(tmp_path: Path,
                                                                   monkeypatch) -> None:
    """A write that fails (a full disk) ends the copy with that error: LMDB's side of the
    pipe is told to stop instead of waiting for a reader that is gone."""
    import errno
    import os

    from actors.store.compact import HASH_STEP, copy_pages_hashed

    env = _big_env(tmp_path / "src")
    (tmp_path / "copy").mkdir()
    real, writes = os.pwrite, []

    def filling(fd: int, data: bytes, at: int) -> int:
        if writes:
            raise OSError(errno.ENOSPC, "No space left on device")
        writes.append(at)
        return real(fd, data, at)

    monkeypatch.setattr(os, "pwrite", filling)
    try:
        with env.begin() as txn, pytest.raises(OSError, match="No space left") as caught:
            copy_pages_hashed(env, txn, tmp_path / "copy", HASH_STEP)
    finally:
        env.close()
    assert writes == [0] and caught.value.errno == errno.ENOSPC


@pytest.mark.parametrize("stage", ["snapshot-write", "snapshot-hash"])
def test_a_hashed_copy_whose_stage_cannot_start_fails_and_does_not_hang(
        tmp_path: Path, monkeypatch, stage: str) -> None:
    """A thread of the copy's pipeline that cannot start (no memory left for its stack) ends
    the copy with that error. The reading thread died without saying so: nobody read the
    pipe, and LMDB's copy waited for room forever inside its read transaction (a snapshot
    that never ended, a map that could no longer grow, an engine that could not close)."""
    import threading

    from actors.store.compact import HASH_STEP, copy_pages_hashed

    env = _big_env(tmp_path / "src")
    (tmp_path / "copy").mkdir()
    real_start = threading.Thread.start

    def start(self: threading.Thread) -> None:
        if self.name == stage:
            raise RuntimeError("can't start new thread")
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    outcome: list[BaseException | None] = []

    def copy() -> None:
        try:
            with env.begin() as txn:
                copy_pages_hashed(env, txn, tmp_path / "copy", HASH_STEP)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    runner = threading.Thread(target=copy, name="test-copy", daemon=True)
    real_start(runner)
    runner.join(timeout=60)  # a hang guard, not a timing
    hung = runner.is_alive()
    if not hung:
        env.close()
    assert not hung, "the copy still waits for a reader that is gone"
    assert isinstance(outcome[0], RuntimeError), outcome
