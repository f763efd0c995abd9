"""Read functions: each runs as ``fn(txn, dbs, *args)`` in a worker thread inside one read
transaction (:meth:`Store.read`), and returns decoded records."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import lmdb

from ..base.errors import StoreTampered
from ..base.ids import derived_id
from ..base.keys import is_fitted
from ..base.records import (
    Entity,
    Episode,
    Fact,
    Failure,
    Link,
    Note,
    PendingReview,
    ReviewState,
    SessionInfo,
    SummaryState,
    Turn,
)
from .chain import _check_content, _fact_core, content_of
from .codecs import (
    _IDS_TARGETS,
    _decode_link,
    _decode_note,
    _decode_session,
    _decode_summary,
    _decode_turn,
    decode_entity,
    decode_episode,
    decode_fact,
    decode_failure,
    decode_pending,
    decode_review,
)
from .integrity import DIGEST, CheckedTxn, content_digest
from .layout import (
    LOG_EPISODE,
    LOG_FACT,
    LOG_NOTE,
    LOG_TURN,
    _fact_entry_lsns,
    _int,
    entity_key,
    link_prefixes,
    session_prefix,
    user_prefix,
)

# -- read functions: run by Store.read in a worker thread -------------------------------------


def read_sessions(txn: lmdb.Transaction, dbs: dict[bytes, Any]) -> list[SessionInfo]:
    """Every session's info, in key order."""
    return [_decode_session(v) for v in txn.cursor(dbs[b"sessions"]).iternext(keys=False, values=True)]


def read_session_tail(
    txn: lmdb.Transaction, dbs: dict[bytes, Any], user_id: str, session_id: str,
    limit: int, before_seq: int | None,
) -> list[Turn]:
    """Up to ``limit`` turns of a session with seq < ``before_seq`` (all if None), oldest first."""
    prefix = session_prefix(user_id, session_id)
    cursor = txn.cursor(dbs[b"turns"])
    end = prefix + (before_seq.to_bytes(8, "big") if before_seq is not None else b"\xff" * 8)
    found: list[Turn] = []
    # Position on the last key below `end`, then walk backwards.
    if cursor.set_range(end):
        moved = cursor.prev()
    else:
        moved = cursor.last()
    while moved and len(found) < limit:
        key = cursor.key()
        if not key.startswith(prefix):
            break
        found.append(_decode_turn(cursor.value()))
        moved = cursor.prev()
    found.reverse()
    # Turn numbers promise no gaps: the tail must end where the session says it does and
    # count up by one, each turn under its own key.
    if before_seq is None:
        raw = txn.get(prefix[:-1], db=dbs[b"sessions"])
        end = None if raw is None else _decode_session(raw).turn_count
    else:
        end = before_seq
    if end is not None and (end > 0 or found):
        start = end - len(found)
        if start < 0 or [t.seq for t in found] != list(range(start, end)) or (
                len(found) < limit and start != 0) or any(
                t.user_id != user_id or t.session_id != session_id for t in found):
            raise StoreTampered(
                f"session {session_id!r} of user {user_id!r} promises turns numbered up to "
                f"{end - 1} without gaps, and its latest turns in the store are seqs "
                f"{[t.seq for t in found]}: "
                "turns were removed, moved or copied in outside the engine; run `engram-trio verify "
                "STORE`", "turns", prefix, found[0].lsn if found else 0)
    return found


Memory = Turn | Note | Episode | Fact


def _note_version(txn: lmdb.Transaction, dbs: dict[bytes, Any], entry: bytes,
                  lsn: int) -> Note | None:
    """The note a ``N`` log entry at ``lsn`` names, if that version is still the current one."""
    raw = txn.get(entry[9:], db=dbs[b"notes"])
    note = None if raw is None else _decode_note(raw)
    return note if note is not None and note.lsn == lsn else None


def read_records(
    txn: CheckedTxn, dbs: dict[bytes, Any], user_id: str, lsns: list[int]
) -> dict[int, Memory]:
    """The user's records at these lsns; others' records, deleted ones and retired fact
    versions are left out."""
    uprefix = user_prefix(user_id)
    # Recall's candidates, hundreds a read: each value goes through a checking getter bound
    # once per database, and the content digest is compared here (:func:`_check_content`,
    # called on a mismatch, says why it differs).
    log_of, turn_of, chain_of = (txn.getter(dbs[b"log"]), txn.getter(dbs[b"turns"]),
                                 txn.getter(dbs[b"chain"]))
    out: dict[int, Memory] = {}
    for lsn in lsns:
        log_key = lsn.to_bytes(8, "big")
        entry = log_of(log_key)
        if entry is None:
            continue
        kind = entry[:1]
        if kind == LOG_TURN and entry.startswith(uprefix, 1):
            raw = turn_of(entry[1:])
            if raw is not None:
                record = chain_of(log_key)
                if record is None or not record.startswith(
                        content_digest(log_key, entry, raw), DIGEST):
                    _check_content(txn, dbs, log_key, entry, raw)
                out[lsn] = _decode_turn(raw)
        elif kind == LOG_NOTE and entry[9:].startswith(uprefix):
            note = _note_version(txn, dbs, entry, lsn)
            if note is not None:
                _check_content(txn, dbs, log_key, entry, content_of(txn, dbs, entry) or b"")
                out[lsn] = note
        elif kind == LOG_EPISODE and entry[1:].startswith(uprefix):
            raw = txn.get(entry[1:], db=dbs[b"episodes"])
            if raw is not None:
                _check_content(txn, dbs, log_key, entry, raw)
                out[lsn] = decode_episode(raw)
        elif kind == LOG_FACT:
            key = _fact_entry_lsns(entry)[1]
            raw = txn.get(key, db=dbs[b"facts"]) if key.startswith(uprefix) else None
            fact = None if raw is None else decode_fact(raw)
            if fact is not None and fact.status == "active":
                _check_content(txn, dbs, log_key, entry, _fact_core(fact))
                out[lsn] = fact
    return out


def read_links(
    txn: lmdb.Transaction, dbs: dict[bytes, Any], user_id: str, memory_ids: list[str]
) -> dict[str, list[Link]]:
    """Every link touching each memory (either direction), by memory id; each (from, to,
    type) once, though a store may hold one in both key forms (see ``layout.link_keys``)."""
    out: dict[str, list[Link]] = {}
    for memory_id in memory_ids:
        found: dict[tuple[str, str, str], Link] = {}
        for prefix in sorted(link_prefixes(user_id, memory_id)):
            for _, value in _scan(txn, dbs[b"links"], prefix):
                link = _decode_link(value)
                found.setdefault((link.from_id, link.to_id, link.type), link)
        out[memory_id] = list(found.values())
    return out


def read_memories_by_id(
    txn: lmdb.Transaction, dbs: dict[bytes, Any], user_id: str, memory_ids: list[str]
) -> dict[str, Memory]:
    """The user's turns, notes, episodes and facts (any version) with these ids."""
    uprefix = user_prefix(user_id)
    ids, notes = dbs[b"ids"], dbs[b"notes"]
    out: dict[str, Memory] = {}
    if len(memory_ids) > 16 and not holds_memories(txn, dbs, user_id):
        return out  # a user this store has nothing of (an import's): two seeks, not a get each
    for memory_id in memory_ids:
        key = txn.get(uprefix + memory_id.encode(), db=ids)
        if key is not None:
            tag = key[:2]
            name, decode = _IDS_TARGETS.get(tag, (b"turns", _decode_turn))
            raw = txn.get(key[2:] if tag in _IDS_TARGETS else key, db=dbs[name])
            if raw is not None:
                out[memory_id] = decode(raw)
                continue
        raw = txn.get(uprefix + memory_id.encode(), db=notes)
        if raw is not None:
            out[memory_id] = _decode_note(raw)
    return out


def holds_memory(txn: lmdb.Transaction, dbs: dict[bytes, Any], user_id: str,
                 memory_id: str) -> bool:
    """Whether the user's turn, note, episode or fact (any version) ``memory_id`` is stored:
    :func:`read_memories_by_id`'s lookups, without decoding the record."""
    key = user_prefix(user_id) + memory_id.encode()
    found = txn.get(key, db=dbs[b"ids"])
    if found is not None:
        tag = found[:2]
        name = _IDS_TARGETS[tag][0] if tag in _IDS_TARGETS else b"turns"
        if txn.get(found[2:] if tag in _IDS_TARGETS else found, db=dbs[name]) is not None:
            return True
    return txn.get(key, db=dbs[b"notes"]) is not None


def holds_memories(txn: lmdb.Transaction, dbs: dict[bytes, Any], user_id: str) -> bool:
    """Whether the store holds any turn, note, episode or fact of the user (two seeks)."""
    uprefix = user_prefix(user_id)
    return _holds(txn, dbs[b"ids"], uprefix) or _holds(txn, dbs[b"notes"], uprefix)


def read_derived_id(txn: lmdb.Transaction, dbs: dict[bytes, Any], user_id: str, prefix: str,
                    what: Any) -> str:
    """``prefix`` and :func:`~actors.base.ids.derived_id` of ``what``, salted (1, 2, ...)
    until no memory of the user holds it: a derived memory made again from what an earlier
    one, since retired, stood for (a fact extracted again from a turn a failed step read
    twice) never takes the id of a version history keeps. Salts are tried in order, so nodes
    holding the same memories pick the same one."""
    salt = 0
    while True:
        memory_id = prefix + derived_id(what, salt)
        if not read_memories_by_id(txn, dbs, user_id, [memory_id]):
            return memory_id
        salt += 1



def read_turn_contexts(
    txn: lmdb.Transaction, dbs: dict[bytes, Any], user_id: str, turn_ids: list[str]
) -> dict[str, list[Turn]]:
    """Each turn with the turn before and the turn after it in its session, by turn id; turns
    not on disk (or not the user's) are left out."""
    turns = dbs[b"turns"]
    out: dict[str, list[Turn]] = {}
    for turn_id, turn in read_memories_by_id(txn, dbs, user_id, turn_ids).items():
        if type(turn) is not Turn:
            continue
        prefix = session_prefix(user_id, turn.session_id)
        context = [turn]
        for seq, at_end in ((turn.seq - 1, False), (turn.seq + 1, True)):
            raw = txn.get(prefix + seq.to_bytes(8, "big"), db=turns) if seq >= 0 else None
            if raw is not None:
                context.insert(len(context) if at_end else 0, _decode_turn(raw))
        out[turn_id] = context
    return out


def read_summary(
    txn: lmdb.Transaction, dbs: dict[bytes, Any], user_id: str, session_id: str
) -> SummaryState | None:
    raw = txn.get(user_prefix(user_id) + session_id.encode(), db=dbs[b"summaries"])
    return None if raw is None else _decode_summary(raw)


def _holds(txn: lmdb.Transaction, db: Any, prefix: bytes) -> bool:
    """Whether any key of ``db`` starts with ``prefix``."""
    cursor = txn.cursor(db)
    return cursor.set_range(prefix) and cursor.key().startswith(prefix)


def _scan(txn: lmdb.Transaction, db: Any, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
    cursor = txn.cursor(db)
    if cursor.set_range(prefix):
        for key, value in cursor:
            if not key.startswith(prefix):
                break
            yield key, value


def read_facts(txn: lmdb.Transaction, dbs: dict[bytes, Any], user_id: str,
               active_only: bool) -> list[Fact]:
    """The user's facts in key order (category, key, lsn): every version, or the active ones."""
    facts = [decode_fact(v) for _, v in _scan(txn, dbs[b"facts"], user_prefix(user_id))]
    return [f for f in facts if f.status == "active"] if active_only else facts


def read_fact_versions(txn: lmdb.Transaction, dbs: dict[bytes, Any], user_id: str,
                       same: Callable[[str, str], bool]) -> list[Fact]:
    """The user's versions of every key ``same(category, key)`` admits (one key however it
    is spelt), in key order. Keys are told apart by their bytes: only the versions admitted,
    and those whose key was shortened (its full value is in the record), are decoded."""
    prefix = user_prefix(user_id)
    found = []
    last, admitted = b"", False  # a key's versions are next to each other: one test a key
    for key, value in _scan(txn, dbs[b"facts"], prefix):
        name = key[len(prefix):-9]  # category NUL key, shortened if long; NUL, lsn follow
        if is_fitted(name):
            fact = decode_fact(value)
            if same(fact.category, fact.key):
                found.append(fact)
            continue
        if name != last:
            category, _, fact_name = name.decode().partition("\x00")
            last, admitted = name, same(category, fact_name)
        if admitted:
            found.append(decode_fact(value))
    return found


def read_episodes(txn: lmdb.Transaction, dbs: dict[bytes, Any], user_id: str,
                  session_id: str | None) -> list[Episode]:
    """The user's episodes (of one session, if given), by session and position."""
    prefix = (user_prefix(user_id) if session_id is None
              else session_prefix(user_id, session_id))
    return [decode_episode(v) for _, v in _scan(txn, dbs[b"episodes"], prefix)]


def read_last_episode_seqs(txn: lmdb.Transaction, dbs: dict[bytes, Any],
                           keys: list[tuple[str, str]]) -> dict[tuple[str, str], int]:
    """For each (user, session): the last seq its episodes cover (-1: none yet)."""
    out: dict[tuple[str, str], int] = {}
    cursor = txn.cursor(dbs[b"episodes"])
    for user_id, session_id in keys:
        prefix = session_prefix(user_id, session_id)
        seq = -1
        found = cursor.set_range(prefix + b"\xff" * 8)
        moved = cursor.prev() if found else cursor.last()
        if moved and cursor.key().startswith(prefix):
            seq = decode_episode(cursor.value()).last_seq
        out[(user_id, session_id)] = seq
    return out


def read_session_turns(txn: lmdb.Transaction, dbs: dict[bytes, Any], user_id: str,
                       session_id: str, first_seq: int, last_seq: int) -> list[Turn]:
    """A session's turns with first_seq <= seq <= last_seq, in order."""
    prefix = session_prefix(user_id, session_id)
    cursor = txn.cursor(dbs[b"turns"])
    out: list[Turn] = []
    if cursor.set_range(prefix + first_seq.to_bytes(8, "big")):
        for key, value in cursor:
            if not key.startswith(prefix) or int.from_bytes(key[-8:], "big") > last_seq:
                break
            out.append(_decode_turn(value))
    return out


def read_entities(txn: lmdb.Transaction, dbs: dict[bytes, Any], user_id: str,
                  names: list[str]) -> dict[str, Entity]:
    """The user's registry records under these lower-case keys, and, in the same transaction,
    the entity each alias record among them points to (under its own key)."""
    db = dbs[b"entities"]
    out: dict[str, Entity] = {}
    for name in names:
        raw = txn.get(entity_key(user_id, name), db=db)
        if raw is not None:
            out[name] = decode_entity(raw)
    for entity in list(out.values()):
        target = entity.aliases[0] if entity.type == "alias" else None
        if target is not None and target not in out:
            raw = txn.get(entity_key(user_id, target), db=db)
            if raw is not None:
                out[target] = decode_entity(raw)
    return out


def read_entity_keys(txn: lmdb.Transaction, dbs: dict[bytes, Any], user_id: str) -> list[str]:
    """The user's registry keys: entity names and aliases, lower case (a shortened key's
    name comes from its record: an entity is filed under its name in lower case, an alias
    record is named by its own key)."""
    prefix = user_prefix(user_id)
    return [decode_entity(value).name.lower() if is_fitted(key) else key[len(prefix):].decode()
            for key, value in _scan(txn, dbs[b"entities"], prefix)]


def read_review_states(txn: lmdb.Transaction, dbs: dict[bytes, Any], user_id: str,
                       memory_ids: list[str]) -> dict[str, ReviewState]:
    uprefix = user_prefix(user_id)
    out = {}
    for memory_id in memory_ids:
        raw = txn.get(uprefix + memory_id.encode(), db=dbs[b"reviews"])
        if raw is not None:
            out[memory_id] = decode_review(raw)
    return out


def read_pending(txn: lmdb.Transaction, dbs: dict[bytes, Any]
                 ) -> list[tuple[str, str, PendingReview]]:
    """Every pending review: (user, conversation, what was shown)."""
    out = []
    for key, value in _scan(txn, dbs[b"pending"], b""):
        user, conversation = key.split(b"\x00", 1)
        out.append((user.decode(), conversation.decode(), decode_pending(value)))
    return out


def read_failures(txn: lmdb.Transaction, dbs: dict[bytes, Any],
                  user_id: str | None = None) -> list[Failure]:
    """The failures kept (of one user, if given), by lsn."""
    if b"failures" not in dbs:
        return []  # a store read before its failures database existed: none kept
    found = [decode_failure(v) for _, v in _scan(txn, dbs[b"failures"], b"")]
    return [f for f in found if user_id is None or f.user_id == user_id]


def count_failures(txn: lmdb.Transaction, dbs: dict[bytes, Any]) -> int:
    return txn.stat(dbs[b"failures"])["entries"] if b"failures" in dbs else 0


def read_meta_lsn(txn: lmdb.Transaction, dbs: dict[bytes, Any], name: bytes) -> int:
    return _int(txn.get(name, db=dbs[b"meta"])) or 0


def read_user_counts(txn: lmdb.Transaction, dbs: dict[bytes, Any], user_id: str
                     ) -> dict[str, Any]:
    """How many of each kind of memory a user has, and when the latest turn was said."""
    prefix = user_prefix(user_id)
    turns = 0
    latest = None
    for _, value in _scan(txn, dbs[b"sessions"], prefix):
        info = _decode_session(value)
        turns += info.turn_count
        latest = info.last_at if latest is None else max(latest, info.last_at)
    facts = read_facts(txn, dbs, user_id, True)
    return {
        "turns": turns,
        "episodes": sum(1 for _ in _scan(txn, dbs[b"episodes"], prefix)),
        "facts": len(facts),
        "notes": sum(1 for _ in _scan(txn, dbs[b"notes"], prefix)),
        "entities": sum(1 for _, v in _scan(txn, dbs[b"entities"], prefix)
                        if decode_entity(v).type != "alias"),
        "latest_at": latest,
    }
