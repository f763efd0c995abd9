"""The store's key schema and byte layout: the one place that knows every database, key
prefix, log-entry tag and meta key.

Layout (named databases; every key that belongs to a user starts with ``user_id + NUL`` so one
user's records are contiguous and a prefix scan finds all of them):

=========  ======================================  ===========================================
database   key                                     value
=========  ======================================  ===========================================
meta       ``schema`` / ``last_lsn`` /             8-byte big-endian integers
           ``embedded_lsn``
meta       ``model``                               ModelInfo (msgpack): id and dimension
meta       ``embed_backlog``                       8-byte lsns behind ``embedded_lsn`` still
                                                   without a vector (schema 4's migration)
meta       ``scrub_pending``                       8-byte count of the deletions since the last
                                                   scrub (older builds: a list of user prefixes)
meta       ``scrubbed``                            one byte: the file was created by, or last
                                                   scrubbed by, a build whose scrub leaves no
                                                   stale byte anywhere (see SCRUBBED_KEY)
meta       ``chain_head``                          the hash chain's head (:mod:`.integrity`)
sessions   user NUL session                        SessionInfo (msgpack)
turns      user NUL session NUL seq(8 bytes)       Turn (msgpack)
ids        user NUL turn_id                        the turn's key in ``turns``
log        lsn (8 bytes, big-endian)               ``T`` + turn key; ``N`` + replaced lsn +
                                                   notes key; ``D`` + deleted lsns; ``E``, ``F``
vectors    user NUL lsn(8 bytes)                   ANN header (16 bytes) + the embedding as
                                                   float16, one per chunk (see below)
links      user NUL from NUL to / user NUL to NUL  Link (msgpack), once per direction
           from
notes      user NUL note_id                        Note (msgpack), its latest version
summaries  user NUL session                        SummaryState (msgpack)
episodes   user NUL session NUL first seq(8)       Episode (msgpack)
facts      user NUL category NUL key NUL lsn(8)    Fact (msgpack), every version kept
entities   user NUL lower-case name                Entity (msgpack)
reviews    user NUL memory id                      ReviewState (msgpack): FSRS after reviews
pending    user NUL conversation id                PendingReview (msgpack)
chain      lsn (8 bytes, big-endian)               chain digest + content digest + removed lsns
failures   lsn(8) actor                            Failure (msgpack): a record a part skipped
=========  ======================================  ===========================================

Every value but ``meta``'s ends with a CRC-32 of the rest, sealed and checked in one place
(:class:`.integrity.CheckedTxn`): a damaged record is ``StoreCorrupt``, never a value. The
``chain`` database is the log's hash chain, its head in ``meta`` under ``chain_head`` (see
:mod:`.integrity` and :mod:`.chain`); opening a store checks the chain's tail against the head.

Entity names, a fact's category and key, and both ends of a link go through ``keys.fit`` when
the key would pass LMDB's 511 bytes: a readable head, 0xFF, a digest (the full value is in the
record). Ids a caller chooses are at most 250 bytes (checked at the call).

``ids`` maps ``user NUL id`` of a turn, an episode or a fact to its key (in ``turns``, or
after the tag ``NUL E`` / ``NUL F`` in ``episodes`` / ``facts``). Log entries: ``E`` + episode key; ``F`` + count(2) + the lsns that
left the indexes with it (8 bytes each) + fact key.

A ``vectors`` value is :data:`actors.ann_index.HEADER` (time, kind, role, ``extra``, session
code) and then the record's vectors as float16 (schema 2; schema 1 stored float32). A text
longer than one chunk (:mod:`actors.chunking`: 640 characters, none past the model's window)
keeps every chunk's vector in its one value, in order, ``extra`` counting the chunks past the
first (0 in a value written before chunks: one vector). So a record has one key however many
chunks it has: a forget, a scrub, a snapshot and a restore take all of its chunks or none, and
the ANN index (whose partition is chosen by the header's kind) reads a row per chunk.

A deletion leaves a tombstone that lists the deleted sequence numbers and nothing of the user.
"""

from __future__ import annotations

import time
from array import array
from typing import Any

import lmdb

from ..base.keys import MAX_KEY_BYTES, fit
from ..base.records import Episode, Fact, Link

MAX_DBS = 32  # named databases LMDB reserves room for; later layers add theirs
MAX_READERS = 126  # LMDB reader slots: the default, far above the threads we use

DB_NAMES = (b"meta", b"sessions", b"turns", b"ids", b"log", b"vectors", b"links", b"notes",
            b"summaries", b"episodes", b"facts", b"entities", b"reviews", b"pending", b"chain",
            b"failures")
# Databases a store of the current schema may lack (written before they were added; an engine
# that owns the store creates them at open, a read-only one reads them as empty).
OPTIONAL_DBS = frozenset({b"failures"})
LOG_TURN = b"T"
LOG_NOTE = b"N"  # + the lsn this version replaces (8 bytes, 0: none) + the notes key
LOG_TOMBSTONE = b"D"
LOG_EPISODE = b"E"  # + the episodes key
LOG_FACT = b"F"  # + count (2 bytes) + lsns that left the indexes (8 bytes each) + the facts key
# ``ids`` values: a turn's key as is; an episode's or a fact's behind a tag no turn key starts
# with (a turn key starts with its non-empty user id).
IDS_EPISODE = b"\x00E"
IDS_FACT = b"\x00F"

SCHEMA_KEY = b"schema"
_LAST_LSN_KEY = b"last_lsn"
_EMBEDDED_KEY = b"embedded_lsn"
_MODEL_KEY = b"model"
# The model's vector of a fixed sentence (float32), from the files the store's vectors came
# from: other files under the same model's names give another (see engine/_wiring.py).
MODEL_PROBE_KEY = b"model_probe"
# How many times the store dropped its vectors to embed everything again (8 bytes; absent:
# none): a saved graph names the count it was built at, and one of another is not searched.
VECTORS_EPOCH_KEY = b"vectors_epoch"
# Records behind the embedding watermark that still need a vector (8-byte lsns): what a
# migration found missing; the embedder embeds them before following the log.
EMBED_BACKLOG_KEY = b"embed_backlog"
# A random id the store is given by its first owner (a snapshot or a copy keeps it): what
# the notes mirror marks its files with, so two stores sharing one folder keep each other's.
STORE_ID_KEY = b"store_id"
HEAD_KEY = b"chain_head"  # the chain's head: last lsn (8) + digest (16) + MAC (32, if keyed)
# Set in the transaction of every forget, cleared once the file was scrubbed: a crash in
# between leaves it, and the next engine scrubs again.
SCRUB_KEY = b"scrub_pending"
# Written by a store's creation and by every scrub that clears the marker: together with no
# scrub_pending, no page of the file holds a byte of a deleted record of any deletion (a
# forget, a deleted note), nor of a record replaced or removed before the last scrub: only
# live records, and bytes of records replaced as ordinary upkeep since. A store an older
# build scrubbed lacks it and is scrubbed again at open. A snapshot of a store in that state
# needs no zeroing pass over its copy.
SCRUBBED_KEY = b"scrubbed"
SCRUB_STEP_KEY = b"scrub_step"  # written and deleted in one transaction: a commit, no record
_SCRUB_FILL = b"\xffscrub"  # + 8-byte counter: zero values an older build's scrub wrote


def open_databases(env: lmdb.Environment, txn: Any = None) -> dict[bytes, Any]:
    """Every named database of an existing store, for readers that create nothing; one of
    OPTIONAL_DBS that the store does not have yet is left out (read it as empty).

    Raises:
        lmdb.NotFoundError: a database every store of this schema has is missing.
    """
    dbs = {}
    for name in DB_NAMES:
        try:
            dbs[name] = env.open_db(name, txn=txn, create=False)
        except lmdb.NotFoundError:
            if name not in OPTIONAL_DBS:
                raise
    return dbs


def user_prefix(user_id: str) -> bytes:
    return user_id.encode() + b"\x00"


def session_prefix(user_id: str, session_id: str) -> bytes:
    return user_id.encode() + b"\x00" + session_id.encode() + b"\x00"


def lsn_key(lsn: int) -> bytes:
    return lsn.to_bytes(8, "big")


def fact_key(fact: Fact) -> bytes:
    """user NUL category NUL key NUL lsn; category and key shortened (keys.fit) if long."""
    prefix = user_prefix(fact.user_id)
    name = fit(fact.category.encode() + b"\x00" + fact.key.encode(),
               MAX_KEY_BYTES - len(prefix) - 9)
    return prefix + name + b"\x00" + lsn_key(fact.lsn)


def entity_key(user_id: str, name: str) -> bytes:
    """user NUL lower-case name; the name shortened (keys.fit) if long."""
    prefix = user_prefix(user_id)
    return prefix + fit(name.encode(), MAX_KEY_BYTES - len(prefix))


def failure_key(lsn: int, actor: str) -> bytes:
    """lsn, actor: one failure per record and actor; writes outside the log (lsn 0) add the
    time, so that each is kept."""
    key = lsn_key(lsn) + actor.encode()
    return key if lsn else key + b"\x00" + time.time_ns().to_bytes(8, "big")


def episode_key(episode: Episode) -> bytes:
    return session_prefix(episode.user_id, episode.session_id) + lsn_key(episode.first_seq)


def _fact_entry_lsns(entry: bytes) -> tuple[list[int], bytes]:
    """The lsns an ``F`` log entry retired, and the fact's key. Decoded in one call: a key
    superseded often carries thousands (each entry carries what the one it retired did), and
    the writer and every reader of the entry decode them, the writer holding the GIL."""
    n = int.from_bytes(entry[1:3], "big")
    retired = array("Q", entry[3: 3 + 8 * n])
    retired.byteswap()
    return retired.tolist(), entry[3 + 8 * n:]


def fact_entry(left: list[int], key: bytes) -> bytes:
    """An ``F`` log entry: the lsns that left the indexes, then the fact's key."""
    lsns = array("Q", left)
    lsns.byteswap()
    return LOG_FACT + len(left).to_bytes(2, "big") + lsns.tobytes() + key


def _int(raw: bytes | None) -> int | None:
    return None if raw is None else int.from_bytes(raw, "big")


def entry_record_key(entry: bytes) -> bytes:
    """The key of the record a log entry names (in turns, notes, episodes or facts; it starts
    with the user's prefix), or b"" for a tombstone."""
    kind = entry[:1]
    if kind == LOG_NOTE:
        return entry[9:]
    if kind == LOG_FACT:
        return _fact_entry_lsns(entry)[1]
    if kind == LOG_TOMBSTONE:
        return b""
    return entry[1:]


LINK_TYPE_ROOM = 64  # bytes of a link's type its key keeps (longer types are shortened, keys.fit)


def link_keys(user_id: str, link: Link) -> tuple[bytes, bytes]:
    """The link's key from its source, and from its target (for walking it backwards): user
    NUL one end NUL the other NUL the type, so one pair holds a link of each type (a derived
    link never replaces a provenance link). Both ends are shortened (keys.fit) when the key
    would be too long, to a room that does not depend on the type, so a memory's shortened
    id is one prefix whatever its links' types."""
    prefix = user_prefix(user_id)
    a, b = link.from_id.encode(), link.to_id.encode()
    kind = fit(link.type.encode(), LINK_TYPE_ROOM)
    if len(prefix) + len(a) + len(b) + len(kind) + 2 > MAX_KEY_BYTES:
        room = _link_end_room(prefix)
        a, b = fit(a, room), fit(b, room)
    return (prefix + a + b"\x00" + b + b"\x00" + kind,
            prefix + b + b"\x00" + a + b"\x00" + kind)


def legacy_link_keys(user_id: str, link: Link) -> tuple[bytes, bytes]:
    """The keys links had before they carried their type (one link per pair): still read,
    and deleted with their memories."""
    prefix = user_prefix(user_id)
    a, b = link.from_id.encode(), link.to_id.encode()
    if len(prefix) + len(a) + 1 + len(b) > MAX_KEY_BYTES:
        room = (MAX_KEY_BYTES - len(prefix) - 1) // 2
        a, b = fit(a, room), fit(b, room)
    return prefix + a + b"\x00" + b, prefix + b + b"\x00" + a


def _link_end_room(prefix: bytes) -> int:
    return (MAX_KEY_BYTES - len(prefix) - LINK_TYPE_ROOM - 2) // 2


def link_prefixes(user_id: str, memory_id: str) -> set[bytes]:
    """The key prefixes of the links from a memory: with its id whole, and shortened (the
    form a link takes when its key would be too long; as typed links and as older links)."""
    prefix = user_prefix(user_id)
    whole = memory_id.encode()
    return {prefix + end + b"\x00" for end in (
        whole, fit(whole, _link_end_room(prefix)),
        fit(whole, (MAX_KEY_BYTES - len(prefix) - 1) // 2))}
