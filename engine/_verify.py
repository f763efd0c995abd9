"""``engram-trio verify``: check a whole store against its checksums, its hash chain and its promises.

Opening a store checks only the chain's tail; this walks everything, in one read transaction
(so it may run beside an engine serving the store from another process, and sees one
consistent state):

- every value of every database passes its CRC-32;
- the chain's head matches its MAC (with the key) and the chain's last digest;
- every link of the chain recomputes, every logged record matches its content digest, and every
  log entry that is gone is listed as removed by a later chain record (a forget's tombstone);
- every session's turns are numbered 0..turn_count-1 without gaps, each stored under its own
  user, session and seq, and logged at its own lsn;
- no user's category and key has two active fact values.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import zlib
from pathlib import Path
from typing import Any

import lmdb
import msgspec

from actors.base.config import Config
from actors.base.errors import (EngineBroken, EngineError, InvalidInput, StoreCorrupt,
                                access_denied, store_denied)
from actors.base.records import SessionInfo, Turn
from actors.facts import spelling
from actors.store import LOG_TURN, MAX_DBS, check_chain, decode_fact, lsn_key, open_databases
from actors.store.layout import SCHEMA_KEY
from actors.store.pages import damaged_page
from actors.store.integrity import (
    DIGEST,
    HEAD_KEY,
    SEAL,
    ZERO,
    CheckedTxn,
    check_file,
    decode_head,
    encode_head,
    grown_along,
    head_mac,
    open_reader,
    opening,
    unseal,
)

from ._files import PATH_ERRNOS, refused
from ._owner import OwnerLock

__all__ = ["verify_store", "verify_chain", "require_store"]

MAX_LISTED = 50  # problems listed in the report; the count covers all of them
SEAL_ROOM = 1 << 20  # map bytes past the file for the seal: its page or two, and LMDB's

_decode_turn = msgspec.msgpack.Decoder(Turn).decode
_decode_session = msgspec.msgpack.Decoder(SessionInfo).decode


def _data_file(path: Path) -> Path:
    """``path``'s data.mdb, a file.

    Raises:
        InvalidInput: there is none (a folder of that name is none either), or ``path`` is
            one the system refuses (a name too long, a folder this process cannot read).
    """
    data = path / "data.mdb"
    try:
        found = data.is_file()
    except OSError as exc:
        if exc.errno not in PATH_ERRNOS:
            raise
        raise refused("store", exc, "an Engram store") from exc
    if not found:
        what = (f"a file, not a directory, at {path}" if path.is_file()
                else f"no data.mdb in {path}")
        raise InvalidInput("store", f"expected an Engram store, found {what}")
    return data


def require_store(path: Path) -> None:
    """Refuse a path that holds no Engram store, before a command opens it: opened to write,
    another program's LMDB file (or an empty one) would become a store, its data kept beside
    Engram's databases.

    Raises:
        InvalidInput: no data.mdb, an empty one, or LMDB data without Engram's schema version.
        StoreCorrupt: a data.mdb that is not LMDB's, or that LMDB cannot read.
    """
    data = _data_file(path)
    check_file(path)
    if data.stat().st_size == 0:
        raise InvalidInput("store", f"expected an Engram store, found an empty data.mdb in "
                                    f"{path}")
    try:
        # A reader's slot in the lock file where there is one (a store has one: an engine in
        # another process may be writing); no lock file made in another program's folder.
        locked = (path / "lock.mdb").exists()
        with opening(path) if locked else contextlib.nullcontext():
            env = lmdb.open(str(path), readonly=True, lock=locked, max_dbs=MAX_DBS)
    except lmdb.Error as exc:
        if "already open in this process" in str(exc):
            return  # an engine of this process has it open: a store
        if access_denied(exc):
            raise store_denied(path, exc) from None
        raise StoreCorrupt(f"{data} does not open as LMDB ({exc}); restore the store from a "
                           "snapshot", "data.mdb") from None

    def look() -> bool:
        with env.begin() as txn:
            try:
                meta = env.open_db(b"meta", txn=txn, create=False)
            except lmdb.NotFoundError:
                meta = None
            return meta is not None and txn.get(SCHEMA_KEY, db=meta) is not None

    try:
        found = grown_along(env, look)  # an engine serving it may have grown it since
    except lmdb.Error as exc:
        raise StoreCorrupt(f"{data} is damaged: LMDB cannot read it ({exc}); run `engram-trio "
                           f"verify {path}`, or restore the store from a snapshot",
                           "data.mdb") from None
    finally:
        env.close()
    if not found:
        raise InvalidInput("store", f"expected an Engram store, found LMDB data without "
                                    f"Engram's schema version in {path} (another program's?); "
                                    "it was left as it was")


def verify_store(path: Path, integrity_key: str | None = None, seal: bool = False
                 ) -> dict[str, Any]:
    """Check a store (closed, or served by another engine) and say where it breaks.

    Args:
        path: the store directory.
        integrity_key: the key the store is sealed with; without it the head's MAC is not
            checked (everything else is).
        seal: when the store verifies and carries no MAC yet, MAC its head with the key, so
            that the engine opens it with ``Config(integrity_key=...)`` from then on.

    Returns:
        ``ok``, ``last_lsn``, ``records`` (values checked), ``sessions``, ``mac`` (checked,
        sealed, absent or unchecked), ``problems`` (the first MAX_LISTED, each ``where`` and
        ``what``) and ``problem_count``.

    Raises:
        InvalidInput: no store at ``path``, or ``seal`` without a key the engine accepts.
        StoreInUse: ``seal``, and an engine (or a command) owns the store.
    """
    _data_file(path)
    if not seal:
        return _verify(path, integrity_key, False)
    if not integrity_key:
        raise InvalidInput("integrity_key", "expected the key to seal the store with, found none")
    try:
        Config.checked({"integrity_key": integrity_key})
    except InvalidInput as exc:
        # Sealed under a key no engine opens a store with, the store would open no more.
        raise InvalidInput("integrity_key", f"expected a key the engine opens stores with, "
                                            f"found one it refuses ({exc}); nothing was "
                                            "sealed") from None
    # The head is read, then rewritten with its MAC: an owner committing in between would
    # have its head rolled back (and its next commit would drop the MAC).
    with OwnerLock(path, "verify --seal"):
        return _verify(path, integrity_key, True)


def _verify(path: Path, integrity_key: str | None, seal: bool) -> dict[str, Any]:
    problems: list[tuple[str, str]] = []
    report: dict[str, Any] = {"path": str(path), "last_lsn": 0, "records": 0, "sessions": 0,
                              "mac": "absent"}
    try:
        check_file(path)
    except StoreCorrupt as exc:
        return _done(report, [("data.mdb", str(exc))])
    if (path / "data.mdb").stat().st_size == 0:
        return _done(report, [("data.mdb", "is empty: no store was ever written here")])
    key = None if integrity_key is None else integrity_key.encode()
    # lock=True: an engine in another process may be writing, and only a reader in LMDB's
    # reader table is safe from its writer reusing the pages being read.
    # The seal writes one page or two: a map no larger than the file (py-lmdb's default
    # 10 MiB, and a compacted store fills its file) would have no room for them.
    room = (path / "data.mdb").stat().st_size + SEAL_ROOM if seal else 10 << 20
    try:
        env = open_reader(path, readonly=not seal, max_dbs=MAX_DBS, map_size=room)
    except lmdb.Error as exc:
        if access_denied(exc):
            raise store_denied(path, exc) from None
        if "already open in this process" not in str(exc):
            return _done(report, [("data.mdb", f"LMDB does not open it: {exc}")])
        # LMDB opens an environment once per process: the engine serving it is here.
        raise InvalidInput("store", f"expected a store no engine of this process serves, found "
                                    f"{path} open here; verify it from another process "
                                    "(`engram-trio verify STORE`) or once the engine is "
                                    "closed") from None
    try:
        # The engine serving it may have grown it since (the walk's first act is its begin).
        return grown_along(env, lambda: _walk(env, report, problems, key, seal))
    except lmdb.NotFoundError:
        problems.append(("data.mdb", "lacks Engram's databases: another program's LMDB "
                                     "data, or a store whose databases were removed"))
    except lmdb.Error as exc:
        # A damaged page (MDB_CORRUPTED, MDB_PAGE_NOTFOUND...): the walk stops there.
        problems.append(("data.mdb", f"LMDB cannot read its pages: {exc}"))
    finally:
        env.close()
    return _done(report, problems)


def _walk(env: lmdb.Environment, report: dict[str, Any], problems: list[tuple[str, str]],
          key: bytes | None, seal: bool) -> dict[str, Any]:
    """Every check of :func:`verify_store` in one read transaction, then the seal."""
    with env.begin() as raw:
        # Before LMDB's cursors walk the trees: some damage (a zeroed leaf page) trips an
        # assertion in LMDB that aborts the process, not an error this report could give.
        damage = damaged_page(Path(env.path()) / "data.mdb")
        if damage is not None:
            problems.append(("data.mdb", f"a page of its trees is damaged ({damage}); restore "
                                         "the store from a snapshot"))
            return _done(report, problems)
        dbs = open_databases(env, raw)
        txn = CheckedTxn(raw, {handle: name for name, handle in dbs.items()})
        report["records"] = _checksums(raw, dbs, problems)
        meta = dbs[b"meta"]
        last = int.from_bytes(raw.get(b"last_lsn", db=meta) or bytes(8), "big")
        report["last_lsn"] = last
        head_raw = raw.get(HEAD_KEY, db=meta)
        head = None if head_raw is None else decode_head(head_raw)
        if head is None:
            problems.append(("meta chain_head", "the hash chain's head is missing or "
                                                "broken"))
        else:
            if head.mac:
                report["mac"] = "unchecked (no key given)"
                if key is not None:
                    report["mac"] = "checked"
                    if not hmac.compare_digest(head.mac, head_mac(key, head.lsn, head.digest)):
                        report["mac"] = "fails"
                        problems.append(("meta chain_head", "the head's MAC does not match "
                                         "under this key: edited without the key, or "
                                         "another key"))
            if head.lsn != last:
                problems.append(("meta last_lsn", f"the chain ends at {head.lsn}, the log "
                                                  f"at {last}"))
            problems.extend((f"lsn {lsn}", what) for lsn, what in
                            check_chain(txn, dbs, 1, max(head.lsn, last), head.digest))
        report["sessions"] = _sessions(txn, dbs, problems)
        _active_facts(txn, dbs, problems)
    if seal and not problems and head is not None and not head.mac:
        try:
            with env.begin(write=True) as wtxn:
                wtxn.put(HEAD_KEY, encode_head(head.lsn, head.digest, key),
                         db=env.open_db(b"meta", txn=wtxn, create=False))
        except lmdb.Error as exc:  # a write's failure (a full disk), not the store's damage
            raise EngineBroken(f"{env.path()} verifies, but its seal could not be written: "
                               f"{exc}; free space and seal it again") from exc
        report["mac"] = "sealed"
    return _done(report, problems)


def verify_chain(path: Path, integrity_key: str | None = None, links: bool = True
                 ) -> tuple[bytes, list[str]]:
    """The hash chain's links from the first log position to the head, and the head's MAC
    (with the key): what ``restore`` checks of a snapshot's store. Cheaper than
    :func:`verify_store` (one digest a position, no record read): the manifest's sha256s
    already say every file is as it was written, and its MAC that the manifest is. Without
    ``links``, the head alone (its MAC, and that it ends where the log does).

    Returns:
        (the head as stored: lsn + digest, what is wrong: empty if nothing).
    """
    try:
        check_file(path)
    except StoreCorrupt as exc:
        return b"", [str(exc)]
    # lock=False: a snapshot is written by no one, and a lock file would be a file the
    # manifest does not list.
    try:
        env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=MAX_DBS)
    except lmdb.Error as exc:
        return b"", [f"LMDB does not open its store: {exc}"]
    problems: list[str] = []
    try:
        with env.begin() as txn:
            meta = env.open_db(b"meta", txn=txn, create=False)
            chain = env.open_db(b"chain", txn=txn, create=False)
            raw = txn.get(HEAD_KEY, db=meta)
            head = None if raw is None else decode_head(raw)
            last = int.from_bytes(txn.get(b"last_lsn", db=meta) or bytes(8), "big")
            if head is None:
                return b"", ["the hash chain's head is missing or broken"]
            if integrity_key is not None and not hmac.compare_digest(
                    head.mac, head_mac(integrity_key.encode(), head.lsn, head.digest)):
                problems.append("the chain head's MAC does not match under the key")
            if head.lsn != last:
                problems.append(f"the chain ends at {head.lsn}, the log at {last}")
            if not links:
                return raw[:8 + DIGEST], problems
            digest, expected = ZERO, 1
            # integrity.unseal and integrity.link inlined: one call each a position was a
            # quarter of the walk's CPU (2.5 s -> 1.8 s for 1.1M positions here).
            crc, blake2b, number = zlib.crc32, hashlib.blake2b, int.from_bytes
            for key, value in txn.cursor(chain).iternext():
                record = value[:-SEAL]
                stored = number(value[-SEAL:], "big") if len(value) >= SEAL else None
                if stored is None or (crc(record, crc(key)) != stored
                                      and crc(record) != stored):  # sealed before keys were
                    problems.append(f"lsn {number(key, 'big')}: its chain record fails its "
                                    "checksum")
                    break
                # link(previous, lsn, content, removed): the record is digest + content +
                # removed, so content + removed is its tail.
                if (number(key, "big") != expected or blake2b(
                        digest + key + record[DIGEST:], digest_size=DIGEST).digest()
                        != record[:DIGEST]):
                    problems.append(f"lsn {number(key, 'big')}: the hash chain breaks")
                    break
                digest, expected = record[:DIGEST], expected + 1
            else:
                if expected != head.lsn + 1 or digest != head.digest:
                    problems.append(f"the chain ends at {expected - 1}, not at its head "
                                    f"({head.lsn})")
            return raw[:8 + DIGEST], problems
    except lmdb.Error as exc:  # a damaged page, or not a store: as broken as a broken link
        return b"", [f"LMDB cannot read its store: {exc}"]
    finally:
        env.close()


def _done(report: dict[str, Any], problems: list[tuple[str, str]]) -> dict[str, Any]:
    report["ok"] = not problems
    report["problem_count"] = len(problems)
    report["problems"] = [{"where": where, "what": what} for where, what in problems[:MAX_LISTED]]
    return report


def _checksums(raw: Any, dbs: dict[bytes, Any], problems: list[tuple[str, str]]) -> int:
    checked = 0
    for name, db in dbs.items():
        if name == b"meta":
            continue
        for key, value in raw.cursor(db):
            checked += 1
            try:
                unseal(value, name, key)
            except StoreCorrupt:
                problems.append((f"{name.decode()} {key!r}", "fails its checksum"))
    return checked


def _active_facts(txn: CheckedTxn, dbs: dict[bytes, Any],
                  problems: list[tuple[str, str]]) -> None:
    """At most one active version of each user's category and key (however spelt), as the
    facts actor keeps them and an import requires: a store written before 79cbe2a could hold
    two after a forget under a clock behind the one that recorded the value."""
    active: dict[tuple[str, tuple[str, str]], str] = {}
    for key, value in txn.raw.cursor(dbs[b"facts"]):
        try:
            fact = decode_fact(unseal(value, b"facts", key))
        except (EngineError, msgspec.DecodeError):
            continue  # already listed by the checksum pass
        if fact.status != "active":
            continue
        which = (fact.user_id, spelling(fact.category, fact.key))
        if which in active:
            problems.append((f"facts {key!r}", f"a second active value of "
                             f"{fact.category}/{fact.key} for user {fact.user_id!r} (beside "
                             f"{active[which]}): call forget_fact on the key until it has no "
                             "active value, then remember the right one"))
        else:
            active[which] = fact.fact_id


def _sessions(txn: CheckedTxn, dbs: dict[bytes, Any], problems: list[tuple[str, str]]) -> int:
    """Every session's turns: numbered without gaps, stored where they say, logged."""
    sessions: dict[bytes, int] = {}
    for key, value in txn.raw.cursor(dbs[b"sessions"]):
        try:
            sessions[key] = _decode_session(unseal(value, b"sessions", key)).turn_count
        except (EngineError, msgspec.DecodeError):
            continue  # already listed by the checksum pass
    seen: dict[bytes, list[int]] = {}
    for key, value in txn.raw.cursor(dbs[b"turns"]):
        where = f"turns {key!r}"
        try:
            turn = _decode_turn(unseal(value, b"turns", key))
        except (EngineError, msgspec.DecodeError):
            continue
        session = key[:-9]
        seq = int.from_bytes(key[-8:], "big")
        seen.setdefault(session, []).append(seq)
        user, _, sid = session.partition(b"\x00")
        if (turn.user_id.encode(), turn.session_id.encode(), turn.seq) != (user, sid, seq):
            problems.append((where, f"holds turn {turn.seq} of user {turn.user_id!r}, session "
                                    f"{turn.session_id!r}: a turn moved or copied in"))
        try:
            entry = txn.get(lsn_key(turn.lsn), db=dbs[b"log"])
        except EngineError:
            entry = None
        if entry != LOG_TURN + key:
            problems.append((where, f"is not logged at its lsn {turn.lsn}"))
    for session, count in sessions.items():
        seqs = seen.pop(session, [])
        if seqs != list(range(count)):
            missing = sorted(set(range(count)) - set(seqs))
            problems.append((f"sessions {session!r}", f"promises turns 0..{count - 1} without "
                             f"gaps; missing {missing[:10]}, extra "
                             f"{sorted(set(seqs) - set(range(count)))[:10]}"))
    for session in seen:
        problems.append((f"sessions {session!r}", "has turns and no session record"))
    return len(sessions)
