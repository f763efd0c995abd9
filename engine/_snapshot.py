"""Snapshots: point-in-time copies of a live store, their manifest, restore and compaction.

A snapshot directory holds ``store/data.mdb`` (LMDB's compacting copy, holding no byte of a
deleted record: a scrubbed store's pages hold none, and the copy of any other is zeroed beside
its records, ``actors/store/compact.py``), ``fulltext/`` (the text index) and
``manifest.json``. The snapshot first waits for the scrubs of the deletions before it. The
text index is taken first and covers lsn W; the LMDB copy is taken second and covers lsn
L >= W, the snapshot's sequence. An engine opened on the
restored store replays (W, L] into the text index and embeds whatever the copy had not
embedded yet, so it answers as the source did at L. ANN graphs are never copied: they are
rebuilt from the stored vectors.

Forgotten users stay forgotten: the LMDB copy holds no byte of a deleted record (taken
before a forget's scrub ran, too), and a text index whose segments still hold deleted
documents, or that was copied before a deletion the LMDB copy holds, is not copied but built
afresh from the LMDB copy. Restore copies each file while it checks its checksum (each byte
read once), then checks the copy's hash chain: link by link, or, when the manifest's MAC was
checked with the integrity key, its head alone.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import json
import os
import shutil
import threading
from collections.abc import Awaitable, Callable
from contextlib import suppress
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import lmdb
import msgspec
import trio

from actors.base.errors import (
    EngineBroken,
    InvalidInput,
    StoreIncompatible,
    StoreInUse,
    StoreTampered,
    disk_full,
)
from actors.base.records import SCHEMA_VERSION
from actors.fulltext import build_index
from actors.store import LOG_TOMBSTONE, MAX_DBS, clean_copy, lsn_key, open_databases
from actors.store.integrity import HEAD_KEY, OPENING_LOCK, opening, ready_lock_file

from ._files import PATH_ERRNOS, aside, exchange, one_disk_error, refused, resolved
from ._owner import (LOCK_NAME, MANIFEST_NAME, SNAPSHOT_DATA, OwnerLock, alone_in_lmdb,
                     claim_in_process, release_in_process)
from ._parts import Parts
from ._verify import require_store, verify_chain
from ._version import __version__

__all__ = ["Manifest", "take_snapshot", "restore", "compact", "MANIFEST_FORMAT"]

MANIFEST_FORMAT = 1
CHUNK = 64 << 20  # checksum unit: large files are hashed a chunk per thread
READ_STEP = 8 << 20  # one read of a chunk being hashed or copied
STORE_FILE = SNAPSHOT_DATA
_copy_buffers = threading.local()  # each restore thread's READ_STEP buffer (_copy_chunk)


class Manifest(msgspec.Struct, frozen=True, kw_only=True):
    """What a snapshot holds.

    Attributes:
        format: the manifest's own version.
        engine_version / schema_version: what wrote it.
        model / dim: the embedding model of its vectors.
        lsn: the log sequence number the snapshot is consistent at.
        fulltext_lsn: what its text index covers (replayed up to ``lsn`` on open).
        fulltext: ``copied`` (from the live index) or ``rebuilt`` (from the store copy).
        embedded_lsn: what its vectors cover.
        counts: users, sessions, turns, vectors.
        files: relative path -> [size, checksum] (see ``_checksums``).
        created_at: when it was taken.
        seconds: how long it took.
        chain_head: the store copy's hash-chain head (last lsn + digest, hex).
        mac: HMAC-SHA256 (hex) of the manifest without this field, under the engine's
            integrity key ("" without one): a manifest edited to match edited files fails it.
    """

    format: int
    engine_version: str
    schema_version: int
    model: str
    dim: int
    lsn: int
    fulltext_lsn: int
    fulltext: str
    embedded_lsn: int
    counts: dict[str, int]
    files: dict[str, tuple[int, str]]
    created_at: datetime
    seconds: float
    chain_head: str = ""
    mac: str = ""


def _chunk_digest(path: Path, offset: int) -> str:
    """sha256 of one CHUNK of a file, read READ_STEP at a time (the GIL is released for the
    reads and the hashing). Reads, not an mmap: a copy LMDB wrote with O_DIRECT is not in the
    page cache, and faulting it in a page at a time took 1.7x the time (8.2 s against 4.6 s
    for 1.6 GB here, at load 33, two threads)."""
    digest = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        for at in range(offset, offset + CHUNK, READ_STEP):
            data = os.pread(fd, READ_STEP, at)
            digest.update(data)
            if len(data) < READ_STEP:
                break
    finally:
        os.close(fd)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


async def _checksums(root: Path, sync: bool = False,
                     known: dict[Path, list[str]] | None = None) -> dict[str, tuple[int, str]]:
    """Size and a checksum of every file under root: the sha256 of the file for small files,
    and for large ones the sha256 of the concatenated sha256s of its 64 MiB chunks, which two
    threads hash at once (~3 GB/s here against ~0.4 GB/s reading a file through one). With
    ``sync``, every file is fsynced meanwhile, so the disk writes overlap the hashing.
    ``known`` gives the chunks' sha256s of files hashed as they were written (not read
    again)."""
    known = known or {}
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST_NAME)
    sizes = {p: p.stat().st_size for p in files}
    chunks: dict[tuple[Path, int], str] = {}
    for path, digests in known.items():
        chunks.update(((path, CHUNK * i), digest) for i, digest in enumerate(digests))
    limiter = trio.CapacityLimiter(2)

    async def one(path: Path, offset: int) -> None:
        chunks[(path, offset)] = await trio.to_thread.run_sync(
            _chunk_digest, path, offset, limiter=limiter)

    async with trio.open_nursery() as nursery:
        if sync:
            async def flush_all() -> None:
                for path in files:
                    await trio.to_thread.run_sync(_fsync, path)

            nursery.start_soon(flush_all)
        for path in files:
            if path in known:
                continue
            for offset in range(0, max(sizes[path], 1), CHUNK):
                if sizes[path]:
                    nursery.start_soon(one, path, offset)
    return dict(sorted((path.relative_to(root).as_posix(), (sizes[path], _file_digest(
        [chunks[(path, o)] for o in range(0, sizes[path], CHUNK)]))) for path in files))


def _file_digest(chunks: list[str]) -> str:
    """A file's checksum from its chunks' sha256s (see :func:`_checksums`)."""
    if len(chunks) == 1:
        return chunks[0]
    return hashlib.sha256("".join(chunks).encode() if chunks else b"").hexdigest()


def manifest_mac(manifest: Manifest, key: str) -> str:
    """The MAC of everything the manifest says but its MAC."""
    body = msgspec.json.encode(msgspec.structs.replace(manifest, mac=""))
    return hmac.new(key.encode(), body, hashlib.sha256).hexdigest()


def _users(env: lmdb.Environment, txn: lmdb.Transaction) -> set[bytes]:
    """Every user with a session or a note (the first key component of either)."""
    users: set[bytes] = set()
    for name in (b"sessions", b"notes"):
        cursor = txn.cursor(env.open_db(name, txn=txn, create=False))
        users.update(key.split(b"\x00", 1)[0] for key in cursor.iternext(keys=True, values=False))
    return users


def _counts(store_dir: Path) -> dict[str, int]:
    env = lmdb.open(str(store_dir), readonly=True, lock=False, max_dbs=MAX_DBS)
    try:
        with env.begin() as txn:
            stat = {n: txn.stat(db)["entries"] for n, db in open_databases(env, txn).items()}
            users = len(_users(env, txn))
            meta = env.open_db(b"meta", txn=txn, create=False)
            raw = txn.get(b"embedded_lsn", db=meta)
            head = txn.get(HEAD_KEY, db=meta) or b""
        return {"chain_head": head[:24].hex(), "users": users, "sessions": stat[b"sessions"], "turns": stat[b"turns"],
                "notes": stat[b"notes"], "vectors": stat[b"vectors"],
                "links": stat[b"links"] // 2,
                "embedded_lsn": int.from_bytes(raw, "big") if raw else 0}
    finally:
        env.close()


def _deleted_after(store_dir: Path, lsn: int) -> bool:
    """Whether the store copy logs a deletion (a forget, a deleted note) after ``lsn``."""
    env = lmdb.open(str(store_dir), readonly=True, lock=False, max_dbs=MAX_DBS)
    try:
        with env.begin() as txn:
            cursor = txn.cursor(env.open_db(b"log", txn=txn, create=False))
            if not cursor.set_range(lsn_key(lsn + 1)):
                return False
            return any(entry[:1] == LOG_TOMBSTONE for entry in cursor.iternext(keys=False))
    finally:
        env.close()


def _partial(dest: Path, store: Path) -> tuple[Path, Path, int]:
    """``dest`` resolved, the empty ``DEST.partial`` directory a snapshot to it is written
    in, made (an earlier one left behind is removed first), and the descriptor that holds
    it for this snapshot (:func:`_claimed`; close it once the copy is renamed or removed).

    Raises:
        InvalidInput: ``dest`` is no path (a NUL, a lone surrogate), a file, a directory with
            files in it, inside the store, a place this process cannot create, or the
            destination of another snapshot under way.
    """
    dest = resolved("dest", dest)  # "." or "snap/..": the name its .partial sibling is made from
    try:
        if dest.is_file():
            raise InvalidInput("dest", f"expected a new or empty directory, found a file at "
                                       f"{dest}; snapshots never overwrite")
        if dest.exists() and any(dest.iterdir()):
            raise InvalidInput("dest", f"expected a new or empty directory, found {dest} with "
                                       "files in it; snapshots never overwrite")
        store = store.resolve()
        if dest.is_relative_to(store):
            # A restore over the store would delete it, and its text index's folder with it.
            raise InvalidInput("dest", f"expected a directory outside the store, found {dest} "
                                       f"inside {store}; write the snapshot beside the store")
        partial = aside(dest, ".partial")
        if store.is_relative_to(partial):
            # What a snapshot cut short leaves is removed before the next one: not the store.
            raise InvalidInput("dest", f"expected a destination whose {partial.name} is free "
                                       f"for the copy, found the store at {partial}; choose "
                                       "another name")
        held = _claimed(partial, "dest")
    except OSError as exc:
        if exc.errno not in PATH_ERRNOS:
            raise
        raise refused("dest", exc, "a directory this process can create") from exc
    return dest, partial, held


def _claimed(partial: Path, field: str) -> int:
    """Make ``partial`` and hold it for one copy (a snapshot's, a restore's): a descriptor of
    the folder with an exclusive ``flock`` (nothing is added inside it). A second copy to the
    same place meanwhile, of this process or another, is refused (InvalidInput naming
    ``field``) rather than deleting the first one's under it; a folder a crash left behind
    (nobody holds it) is removed."""
    while True:
        try:
            partial.mkdir(parents=True)
            made = True
        except FileExistsError:
            made = False
        try:
            fd = os.open(partial, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:  # renamed into place or removed meanwhile: look again
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise _under_way(partial, field) from None
        if not _same(fd, partial):
            # Between the open and the lock, another copy took the folder for a leftover,
            # removed it and made its own: look again (it holds the new one).
            os.close(fd)
            continue
        if made:
            return fd
        try:
            shutil.rmtree(partial)  # a copy cut short left it; nobody holds it
        finally:
            os.close(fd)


def _same(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the folder open as ``fd``."""
    try:
        here, held = os.stat(path), os.fstat(fd)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino)


def _under_way(partial: Path, field: str) -> InvalidInput:
    return InvalidInput(field, f"expected a destination no other copy is written to, found "
                               f"one under way in {partial}; wait for it, or choose another "
                               "name")


async def take_snapshot(parts: Parts, dest: Path,
                        scrubbed: Callable[[], Awaitable[None]] | None = None) -> Manifest:
    """See ``Engine.snapshot``. ``scrubbed`` returns once the scrubs of the deletions so far
    are done: the copy of a scrubbed store needs no zeroing (``Store.copy_to``)."""
    started = trio.current_time()
    dest, partial, held = await trio.to_thread.run_sync(_partial, dest, parts.store.path)
    try:
        with one_disk_error():
            if not parts.read_only:
                # Every turn acknowledged before the call is in the copy, committed or only
                # queued then (reads showed it already).
                await parts.committed()
            if scrubbed is not None:
                await scrubbed()
            fulltext_lsn, copied = await parts.fulltext.copy_to(partial / "fulltext")
            # Hashed as it is written (when it needs no zeroing after); fsynced below.
            lsn, digests = await parts.store.copy_to(partial / "store", sync=False,
                                                     hash_chunk=CHUNK)
            if copied and lsn > fulltext_lsn:
                # A deletion between the two copies is in the store copy, but the index copy
                # still holds its documents: tantivy would only mark them deleted on replay.
                copied = not await trio.to_thread.run_sync(
                    _deleted_after, partial / "store", fulltext_lsn)
            if not copied:
                if (partial / "fulltext").exists():
                    await trio.to_thread.run_sync(shutil.rmtree, partial / "fulltext")
                fulltext_lsn = await trio.to_thread.run_sync(
                    build_index, partial / "store", partial / "fulltext")
            counts = await trio.to_thread.run_sync(_counts, partial / "store")
            embedded_lsn = counts.pop("embedded_lsn")
            chain_head = counts.pop("chain_head")
            known = {} if digests is None else {partial / "store" / "data.mdb": digests}
            files = await _checksums(partial, sync=True, known=known)  # durable before it is done
            manifest = Manifest(
                format=MANIFEST_FORMAT, engine_version=__version__, schema_version=SCHEMA_VERSION,
                model=parts.embedder.model.id, dim=parts.embedder.model.dim, lsn=lsn,
                fulltext_lsn=fulltext_lsn, fulltext="copied" if copied else "rebuilt",
                embedded_lsn=embedded_lsn, counts=counts, files=files,
                created_at=datetime.now(timezone.utc), seconds=trio.current_time() - started,
                chain_head=chain_head)
            key = parts.config.integrity_key
            if key is not None:
                manifest = msgspec.structs.replace(manifest, mac=manifest_mac(manifest, key))
            (partial / MANIFEST_NAME).write_bytes(
                msgspec.json.format(msgspec.json.encode(manifest)))
            await trio.to_thread.run_sync(_fsync, partial / MANIFEST_NAME)
            if dest.exists():
                dest.rmdir()
            partial.rename(dest)
    except BaseException:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(shutil.rmtree, partial, True)
        raise
    finally:
        os.close(held)
    return manifest


def read_manifest(snapshot: Path) -> Manifest:
    path = snapshot / MANIFEST_NAME
    try:
        # A folder of that name is no manifest either (reading it would be IsADirectoryError).
        body = path.read_bytes() if path.is_file() else None
    except OSError as exc:
        if exc.errno not in PATH_ERRNOS:
            raise
        raise refused("snapshot", exc, "a readable snapshot directory") from exc
    if body is None:
        raise InvalidInput("snapshot", f"expected a snapshot directory with manifest.json, "
                                       f"found none in {snapshot}")
    try:
        manifest = msgspec.json.decode(body, type=Manifest)
    except msgspec.DecodeError as exc:
        raise StoreIncompatible(f"{path} is not a readable Engram manifest: {exc}") from exc
    if manifest.format > MANIFEST_FORMAT or manifest.schema_version > SCHEMA_VERSION:
        raise StoreIncompatible(
            f"{snapshot} was written by a newer engram (manifest {manifest.format}, schema "
            f"{manifest.schema_version}); this build reads up to {MANIFEST_FORMAT} / "
            f"{SCHEMA_VERSION}: upgrade engram to restore it")
    # Restore writes each listed file at its name under the new store: a name that leaves
    # the snapshot (``store/../../x``) would be written outside it.
    for name in manifest.files:
        steps = name.split("/")
        if name != STORE_FILE and (steps[0] != "fulltext" or len(steps) < 2
                                   or any(step in ("", ".", "..") for step in steps)):
            raise StoreIncompatible(
                f"{path} lists {name!r}: expected {STORE_FILE} and files under fulltext/ only; "
                "the manifest was edited: take the snapshot again")
    if STORE_FILE not in manifest.files:
        raise StoreIncompatible(f"{path} lists no {STORE_FILE}: the manifest was edited or "
                                "cut short; take the snapshot again")
    return manifest


async def restore(snapshot: Path, store: Path, overwrite: bool = False,
                  progress: Callable[[int, int], None] | None = None,
                  integrity_key: str | None = None) -> Manifest:
    """See ``Engine.restore``."""
    # "." has no name to put beside it
    snapshot, store = resolved("snapshot", snapshot), resolved("store_path", store)
    if store.is_relative_to(snapshot):
        # Over the snapshot's own store/, its data.mdb would become the live store's, and the
        # first write would leave a snapshot that no longer matches its manifest.
        raise InvalidInput("store_path", f"expected a directory outside the snapshot, found "
                                         f"{store} inside {snapshot}; restore beside it")
    for leftover in (".restoring", ".replaced"):  # removed if found: never the snapshot
        if snapshot.is_relative_to(beside := aside(store, leftover)):
            raise InvalidInput("store_path", f"expected a store whose {beside.name} is free for "
                                             f"the restore, found the snapshot {snapshot} "
                                             "there; restore it under another name")
    manifest = read_manifest(snapshot)
    if integrity_key is not None and not hmac.compare_digest(
            manifest.mac, manifest_mac(manifest, integrity_key)):
        raise StoreTampered(
            f"{snapshot}/manifest.json {'carries no MAC' if not manifest.mac else 'fails its MAC'}"
            " under the given integrity key: it was not written by an engine holding that key, "
            "or was edited since; take the snapshot again", "manifest.json")
    incoming = aside(store, ".restoring")
    try:
        # Made first, and held for this restore alone: another to the same place meanwhile
        # is refused, so what is found there below stays as found until the rename. A place
        # this process cannot write (a path through a file, a read-only folder) is the
        # caller's path; a name too long for the suffix has its sibling cut to fit (aside).
        held = await trio.to_thread.run_sync(_claimed, incoming, "store_path")
    except OSError as exc:
        if exc.errno not in PATH_ERRNOS:
            raise
        raise refused("store_path", exc, "a directory this process can create") from exc
    owner, made = None, False
    try:
        owner, made = _restorable(snapshot, store, overwrite)
        with one_disk_error():
            await _install(snapshot, store, manifest, progress, integrity_key, incoming)
    except BaseException:
        with trio.CancelScope(shield=True):
            # Not once it took the store's name: the name is free then, and may be another
            # restore's folder by now. Nor a store it replaced; a folder made for it, yes.
            if await trio.to_thread.run_sync(_drop_if_held, incoming, held) and made:
                await trio.to_thread.run_sync(shutil.rmtree, store, True)
        raise
    finally:
        if owner is not None:
            owner.release()
        os.close(held)
    return manifest


def _drop_if_held(incoming: Path, held: int) -> bool:
    """Remove ``incoming`` if it is still the folder ``held`` holds (not renamed to the store
    since, nor another restore's); whether it was."""
    if not _same(held, incoming):
        return False
    shutil.rmtree(incoming, ignore_errors=True)
    return True


def _restorable(snapshot: Path, store: Path, overwrite: bool) -> tuple[OwnerLock, bool]:
    """Check what is at ``store`` now (its ``.restoring`` held): a new or empty directory,
    or with ``overwrite`` a store. Either is locked for the restore, a new one made for it
    (whether it was made is the second value): an engine opened there meanwhile would be
    pulled from under it, as would one serving a store it replaces."""
    try:
        there = store.exists()
        holding = there and (not store.is_dir() or any(store.iterdir()))
    except OSError as exc:  # a name too long, a folder this process cannot list
        if exc.errno not in PATH_ERRNOS:
            raise
        raise refused("store_path", exc, "a directory this process can create") from exc
    if holding and not overwrite:
        raise InvalidInput("store_path", f"expected a new or empty directory, found {store} "
                                         "with files in it; pass overwrite=True (--overwrite on "
                                         "the command line) to replace it")
    if overwrite and holding and store.is_dir() and not (store / "data.mdb").exists():
        raise InvalidInput("store_path", f"expected a store to replace, found {store} holding "
                                         "other files (no data.mdb); overwrite replaces only a "
                                         "store: restore into a new or empty directory")
    if overwrite and snapshot.is_relative_to(store):
        raise InvalidInput("snapshot", f"expected a snapshot outside the store it replaces, "
                                       f"found {snapshot} inside {store}; move it out first")
    made = False
    if not there:
        try:
            store.mkdir(parents=True)  # this restore's own, unless another made it first
            made = True
        except FileExistsError:
            pass
        except OSError as exc:
            if exc.errno not in PATH_ERRNOS:
                raise
            raise refused("store_path", exc, "a directory this process can create") from exc
    try:
        return OwnerLock(store, "restore").acquire(), made
    except StoreInUse:
        raise  # another engine took the place meanwhile: what is there is its own
    except BaseException:
        if made:  # a retry must find the place as it was; never files another put there
            with suppress(OSError):
                (store / LOCK_NAME).unlink()
            with suppress(OSError):
                store.rmdir()
        raise


async def _install(snapshot: Path, store: Path, manifest: Manifest,
                   progress: Callable[[int, int], None] | None,
                   integrity_key: str | None, incoming: Path) -> None:
    """Copy the snapshot's files into ``incoming`` (made and held, beside ``store``) while
    checking their checksums (one read of each byte), check the copy's hash chain while it
    is flushed to disk, then put it in place of ``store``.

    With ``integrity_key`` (the manifest's MAC checked by the caller), the chain's head
    alone: the MAC says the manifest is the one an engine holding the key wrote, its
    sha256s that every file is as that engine wrote it, so walking every link would only
    re-check the source store as it was (``engram verify``'s job; opening the restored
    store checks the tail). Without the key anyone can rewrite the manifest, and the walk
    is what catches an edit that left the chain's links behind."""
    # Removed by the caller if anything here fails.
    found = await _copy_checked(snapshot, incoming, manifest, progress)
    if found != manifest.files:
        damaged = sorted(set(found.items()) ^ set(manifest.files.items()))
        name = damaged[0][0] if damaged else "?"
        raise StoreIncompatible(
            f"{snapshot} is damaged: {name} does not match the manifest (size and sha256 "
            f"of {len(manifest.files)} files are recorded); take the snapshot again")
    # On disk before it takes its name: a power cut after restore returns finds the
    # whole store, not files the page cache still held. The flush (the disk's time) runs
    # beside the chain's check (a core's time: a walk of every link without the key),
    # which reads the copy from the page cache; a copy that fails it never takes the
    # store's name.
    checked: list[tuple[bytes, list[str]]] = []

    async def check() -> None:
        checked.append(await trio.to_thread.run_sync(
            verify_chain, incoming, integrity_key, integrity_key is None))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(check)
        nursery.start_soon(_fsync_tree, incoming)
    head, problems = checked[0]
    if manifest.chain_head and head.hex() != manifest.chain_head:
        problems.append("the store's chain head is not the one the manifest records")
    elif int.from_bytes(head[:8], "big") != manifest.lsn:  # the head begins with its lsn
        problems.append(f"the manifest's lsn {manifest.lsn} is not the store's last "
                        f"({int.from_bytes(head[:8], 'big')})")
    if problems:
        raise StoreTampered(
            f"{snapshot} does not verify: {problems[0]} ({len(problems)} problem(s)); it "
            "was edited after it was taken: take the snapshot again", "manifest.json")
    if not store.exists():
        incoming.rename(store)
    elif exchange(incoming, store):
        # One step: a process killed at any moment leaves a whole store under the name. The
        # replaced one, under the copy's name now, is removed as a leftover would be.
        await trio.to_thread.run_sync(shutil.rmtree, incoming)
    else:
        # Renamed aside, not deleted, until the new store has its name: a deletion cut short
        # (Ctrl-C, an I/O error) would leave neither store whole. A kill between the two
        # renames leaves both aside, which the next open names (OwnerLock).
        replaced = aside(store, ".replaced")
        if replaced.exists():
            await trio.to_thread.run_sync(shutil.rmtree, replaced)
        store.rename(replaced)
        incoming.rename(store)
        await trio.to_thread.run_sync(shutil.rmtree, replaced)
    await trio.to_thread.run_sync(_fsync, store.parent)


async def _fsync_tree(root: Path) -> None:
    """fsync every file under ``root`` (two at a time), then every folder, ``root`` last."""
    files = sorted(p for p in root.rglob("*") if p.is_file())
    folders = sorted((p for p in root.rglob("*") if p.is_dir()), reverse=True)
    limiter = trio.CapacityLimiter(2)

    async def one(path: Path) -> None:
        await trio.to_thread.run_sync(_fsync, path, limiter=limiter)

    async with trio.open_nursery() as nursery:
        for path in files:
            nursery.start_soon(one, path)
    for path in [*folders, root]:
        await trio.to_thread.run_sync(_fsync, path)


def _copy_chunk(source: Path, target: Path, offset: int) -> str:
    """Copy one CHUNK of a file (the target already has its size) and return its sha256:
    each byte read once, READ_STEP at a time into a buffer the thread keeps (a fresh 64 MiB
    bytes object a chunk cost its page faults: 5.4-7.1 s of CPU for a 1M restore against
    4.5-4.8 s), the GIL released for the reads, the hashing and the writes."""
    buffer = getattr(_copy_buffers, "buffer", None)
    if buffer is None:
        buffer = _copy_buffers.buffer = memoryview(bytearray(READ_STEP))
    digest = hashlib.sha256()
    src = os.open(source, os.O_RDONLY | os.O_CLOEXEC)
    try:
        dst = os.open(target, os.O_WRONLY | os.O_CLOEXEC)
        try:
            at, end = offset, offset + CHUNK
            while at < end and (n := os.preadv(src, [buffer[:min(READ_STEP, end - at)]], at)):
                digest.update(buffer[:n])
                view = buffer[:n]
                while view:
                    view = view[os.pwrite(dst, view, at + n - len(view)):]
                at += n
        finally:
            os.close(dst)
    finally:
        os.close(src)
    return digest.hexdigest()


async def _copy_checked(snapshot: Path, incoming: Path, manifest: Manifest,
                        progress: Callable[[int, int], None] | None
                        ) -> dict[str, tuple[int, str]]:
    """Copy the files the manifest lists into ``incoming`` (the store's ``data.mdb`` at the
    top, ``fulltext/`` where it is), two chunks at a time, and return what
    :func:`_checksums` would say of the snapshot's files: one read of each byte instead of a
    read to check and another to copy."""
    total = sum(size for size, _ in manifest.files.values())
    done = 0
    sizes: dict[str, int] = {}
    chunks: dict[tuple[str, int], str] = {}
    limiter = trio.CapacityLimiter(2)

    async def one(name: str, source: Path, target: Path, offset: int) -> None:
        nonlocal done
        chunks[(name, offset)] = await trio.to_thread.run_sync(
            _copy_chunk, source, target, offset, limiter=limiter)
        done += min(CHUNK, sizes[name] - offset)
        if progress is not None:
            progress(done, total)

    async with trio.open_nursery() as nursery:
        for name in manifest.files:
            source = snapshot / name
            if not source.is_file():
                continue
            # store/data.mdb is the live store's own data.mdb; fulltext/ keeps its place.
            target = incoming / (name.split("/", 1)[1] if name.startswith("store/") else name)
            target.parent.mkdir(parents=True, exist_ok=True)
            sizes[name] = source.stat().st_size
            with target.open("wb") as f:
                f.truncate(sizes[name])
            for offset in range(0, sizes[name], CHUNK):
                nursery.start_soon(one, name, source, target, offset)
    return dict(sorted((name, (size, _file_digest(
        [chunks[(name, o)] for o in range(0, size, CHUNK)]))) for name, size in sizes.items()))


def _sweep_graphs(store: Path) -> None:
    """Delete saved ANN graphs of users the store no longer has (a crash between a forget's
    commit and its unlink leaves one behind)."""
    folder = store / "ann"
    if not folder.exists():
        return
    env = lmdb.open(str(store), readonly=True, lock=False, max_dbs=MAX_DBS)
    try:
        with env.begin() as txn:
            users = _users(env, txn)
    finally:
        env.close()
    keep = {hashlib.blake2b(user, digest_size=16).hexdigest() for user in users}
    for path in folder.iterdir():
        if path.name.split(".", 1)[0] not in keep:
            path.unlink()


def compact(store: Path, progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Bring a closed store to the state a snapshot would have: LMDB rewritten record by
    record into a new environment (no freed pages, no stale bytes in any page), saved graphs
    of users it no longer has deleted, and the text index rebuilt if its
    segments still hold deleted documents.

    Raises:
        StoreInUse: an engine (or another command) has the store open; the message names
            its pid.
    """
    require_store(store)  # another program's LMDB file is not rewritten as a store
    with OwnerLock(store, "compact"):
        claim = claim_in_process(store, "compacting")  # a reader of this process refused
        try:
            return _compact(store, progress)
        finally:
            release_in_process(claim)


def _compact(store: Path, progress: Callable[[int, int], None] | None) -> dict[str, Any]:
    before = (store / "data.mdb").stat().st_size
    fresh = store / "compact.tmp"
    ready_lock_file(store)
    lock = os.open(store / "lock.mdb", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        # A reader in another process keeps the lock file's state (the last transaction id)
        # alive across the swap below, and the next owner would take it, and with it the
        # wrong one of the new file's meta pages: an empty store. So no other process may
        # have the store open, readers included; refused before the copy, and checked again
        # before the swap (LMDB's close released the lock), with every reader's open held
        # back meanwhile (opening: LMDB opens data.mdb before it locks).
        # Made before the first check, so a reader that finds it missing (an older owner made
        # none) is past its open, and seen by the check, before the swap.
        (store / OPENING_LOCK).touch()
        alone_in_lmdb(store, lock, "compact")
        shutil.rmtree(fresh, ignore_errors=True)
        fresh.mkdir()
        try:
            env = lmdb.open(str(store), max_dbs=MAX_DBS)
            try:
                with env.begin() as txn:
                    clean_copy(env, txn, fresh)
            finally:
                env.close()
        except BaseException as exc:
            shutil.rmtree(fresh, ignore_errors=True)  # a partial copy would keep the disk full
            if disk_full(exc):
                raise EngineBroken(f"compacting {store} failed: {exc}; the store is as it "
                                   "was: free space (the copy needs as much as the live "
                                   "records take) and compact it again") from exc
            raise
        with opening(store, exclusive=True):
            try:
                alone_in_lmdb(store, lock, "compact")
            except BaseException:
                shutil.rmtree(fresh, ignore_errors=True)
                raise
            os.replace(fresh / "data.mdb", store / "data.mdb")
            try:
                # Opened alone (this process holds the lock), LMDB resets the lock file's
                # state from the new file before any other opener reads it.
                lmdb.open(str(store), max_dbs=MAX_DBS).close()
            except BaseException:
                # The lock file may hold a state of neither file: gone, the next opener makes
                # it afresh (nobody else has it open, and nobody opens meanwhile).
                (store / "lock.mdb").unlink(missing_ok=True)
                shutil.rmtree(fresh, ignore_errors=True)
                raise
    finally:
        os.close(lock)
    shutil.rmtree(fresh)
    _sweep_graphs(store)
    rebuilt = False
    meta = store / "fulltext" / "meta.json"
    if not meta.exists() or any(s.get("deletes") for s in json.loads(meta.read_text())["segments"]):
        shutil.rmtree(store / "fulltext", ignore_errors=True)
        build_index(store, store / "fulltext", progress)
        rebuilt = True
    return {"store_bytes_before": before, "store_bytes_after": (store / "data.mdb").stat().st_size,
            "fulltext_rebuilt": rebuilt}
