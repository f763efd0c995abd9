"""Per-user export and import: every record of one user as versioned JSON Lines.

``Engine.export_user`` writes a header line, then the user's turns, notes, episodes, fact
versions (the whole history), links, review states, session summaries and entities, then an
end line that counts them; docs/EXPORT.md documents the format. ``Engine.import_user`` reads
it into another store (or under another user id) so that the store answers as the first did:
records keep their ids, times and derivations. Importing the same file twice changes nothing:
every record whose id the user already has is skipped.

An imported record arrives with what was derived from it (facts, episodes, entities, links),
so the long-term followers must not derive it again: each block of imported records takes a
contiguous range of log positions, recorded in ``actors.imported.Imported`` (in RAM and in the
store's meta, ahead of the block), and the followers skip those positions. The text index and
the embedder take imported records like any other.
"""

from __future__ import annotations

import io
import os
import stat
import weakref
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from contextlib import contextmanager, suppress
from itertools import groupby, repeat
from operator import attrgetter
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Union

import msgspec
import numpy as np
import trio

from actors.base import validate as v
from actors.base.text import composed
from actors.base.messages import (Elsewhere, PutEpisode, PutFact, PutNote, PutState,
                                   WriteSummary)
from actors.base.records import (
    ROLES,
    Entity,
    Episode,
    Fact,
    Link,
    Note,
    ReviewState,
    SummaryState,
    Turn,
)
from actors.ann_index.vectors import HEADER, STORED
from actors.entities import MAX_ALIASES, MEMORIES_PER_ENTITY
from actors.facts import spelling
from actors.imported import Imported
from actors.session_buffer import Receipt
from actors.store import (
    ModelInfo,
    decode_entity,
    entity_key,
    fact_key,
    holds_memories,
    read_entities,
    read_episodes,
    read_facts,
    read_links,
    read_memories_by_id,
    read_review_states,
    read_user_vector_values,
    user_prefix,
)
from actors.store.layout import IDS_FACT

from ._args import check_fraction, check_label
from ._files import PATH_ERRNOS, refused, resolved, write_atomically
from ._ingest import other_scope
from .errors import EngineError, InvalidInput, NotFound

if TYPE_CHECKING:
    from ._parts import Parts

__all__ = ["export_user", "export_vectors", "import_user", "import_users", "UserVectors",
           "export_records", "restore_users", "UserRecords", "VectorRows", "FORMAT", "VERSION"]

FORMAT = "engram-user-export"
VERSION = 3  # bumped when a reader of the previous version could not read the lines
# Versions this build imports (1: notes without seed 000's fields; 2: no scopes).
READS = (1, 2, 3)
IMPORT_CHUNK = 1_024  # logged records per import block: one queue burst, well under QUEUE_LIMIT
FACT_STATUSES = ("active", "superseded", "retracted", "pruned")  # what the Facts actor writes
# The users each engine's imports are writing: an import checks what its users hold before it
# writes, so a second import of one of them meanwhile would write the same records again.
_IMPORTING: weakref.WeakKeyDictionary[Parts, set[str]] = weakref.WeakKeyDictionary()


# -- the lines (docs/EXPORT.md) -----------------------------------------------------------------

class _Line(msgspec.Struct, kw_only=True, tag_field="record", forbid_unknown_fields=True,
            gc=False):
    """A line of the format. Untracked by the cyclic collector (values decoded from JSON hold
    no cycles): its passes over a restore's 100k parsed lines took half the parse."""


class Header(_Line, tag="header"):
    format: str
    version: int
    user_id: str
    exported_at: datetime
    engine: str


class TurnLine(_Line, tag="turn"):
    lsn: int
    turn_id: str
    session_id: str
    seq: int
    role: str
    text: str
    at: datetime
    meta: dict[str, Any] = {}
    agent_id: str = ""  # version 3 on
    run_id: str = ""


class NoteLine(_Line, tag="note"):
    lsn: int
    note_id: str
    text: str
    tags: list[str]
    created_at: datetime
    updated_at: datetime
    importance: float = 0.5  # version 2 on
    emotion: str = ""
    category: str = ""
    agent_id: str = ""  # version 3 on
    run_id: str = ""


class EpisodeLine(_Line, tag="episode"):
    lsn: int
    episode_id: str
    session_id: str
    first_seq: int
    last_seq: int
    turn_ids: list[str]
    title: str
    summary: str
    keywords: list[str]
    start_at: datetime
    end_at: datetime
    surprise: float
    stability: float
    difficulty: float
    created_at: datetime
    consolidated_at: datetime | None = None


class FactLine(_Line, tag="fact"):
    lsn: int
    fact_id: str
    category: str
    key: str
    value: str
    text: str
    confidence: float
    importance: float
    keywords: list[str]
    source_turn_ids: list[str]
    source_episode_ids: list[str]
    session_id: str
    valid_at: datetime
    invalid_at: datetime | None
    created_at: datetime
    expired_at: datetime | None
    status: str
    protected: bool
    origin: str
    access_count: int
    last_access_at: datetime | None


class LinkLine(_Line, tag="link"):
    from_id: str
    to_id: str
    type: str
    at: datetime


class ReviewLine(_Line, tag="review"):
    memory_id: str
    stability: float
    difficulty: float
    last_review: datetime
    reps: int


class SummaryLine(_Line, tag="summary"):
    session_id: str
    epoch: int
    summary: str
    upper_seq: int
    updated_at: datetime


class EntityLine(_Line, tag="entity"):
    name: str
    type: str
    aliases: list[str]
    mentions: int
    first_seen: datetime
    last_seen: datetime
    lsns: list[int]
    last_id: str


class End(_Line, tag="end"):
    records: int


Line = Union[Header, TurnLine, NoteLine, EpisodeLine, FactLine, LinkLine, ReviewLine,
             SummaryLine, EntityLine, End]
_encode_line = msgspec.json.Encoder().encode
_decode_line = msgspec.json.Decoder(Line).decode
_decode_lines = msgspec.json.Decoder(list[Line]).decode
_ONCE = (Header, End)  # the first line and the last, nowhere else
# What decoding bytes that are not an export's JSON raises: besides malformed JSON, bytes that
# are not UTF-8 inside a string, and nesting deeper than the decoder recurses.
_UNREADABLE = (msgspec.DecodeError, UnicodeDecodeError, RecursionError)

# Stored values decode with their own record types (the store's are private to it).
_DECODERS = {b"turns": msgspec.msgpack.Decoder(Turn).decode,
             b"notes": msgspec.msgpack.Decoder(Note).decode,
             b"episodes": msgspec.msgpack.Decoder(Episode).decode,
             b"facts": msgspec.msgpack.Decoder(Fact).decode,
             b"links": msgspec.msgpack.Decoder(Link).decode,
             b"reviews": msgspec.msgpack.Decoder(ReviewState).decode,
             b"summaries": msgspec.msgpack.Decoder(SummaryState).decode,
             b"entities": msgspec.msgpack.Decoder(Entity).decode}
_encode = msgspec.msgpack.Encoder().encode


def _fields(record: msgspec.Struct, drop: tuple[str, ...] = ("user_id",)) -> dict[str, Any]:
    return {k: v for k, v in msgspec.structs.asdict(record).items() if k not in drop}


# -- export ------------------------------------------------------------------------------------

def _read_user(txn: Any, dbs: dict[bytes, Any], user_id: str
               ) -> dict[bytes, list[tuple[bytes, Any]]]:
    """Every record of the user in the databases an export carries, in key order."""
    prefix = user_prefix(user_id)
    out: dict[bytes, list[tuple[bytes, Any]]] = {}
    for name, decode in _DECODERS.items():
        rows = out[name] = []
        cursor = txn.cursor(dbs[name])
        if cursor.set_range(prefix):
            for key, value in cursor:
                if not key.startswith(prefix):
                    break
                rows.append((key[len(prefix):], decode(value)))
    return out


def _lines(user_id: str, found: dict[bytes, list[tuple[bytes, Any]]], now: datetime,
           engine_version: str) -> Iterable[_Line]:
    yield Header(format=FORMAT, version=VERSION, user_id=user_id, exported_at=now,
                 engine=engine_version)
    for _, turn in found[b"turns"]:
        yield TurnLine(**_fields(turn))
    for _, note in found[b"notes"]:
        yield NoteLine(**_fields(note))
    for _, episode in found[b"episodes"]:
        yield EpisodeLine(**_fields(episode))
    for _, fact in sorted(found[b"facts"], key=lambda row: row[1].lsn):
        yield FactLine(**_fields(fact))
    seen: set[tuple[str, str, str]] = set()
    for _, link in found[b"links"]:  # each link is stored under both of its ends
        if (link.from_id, link.to_id, link.type) not in seen:
            seen.add((link.from_id, link.to_id, link.type))
            yield LinkLine(**_fields(link, ()))
    for key, state in found[b"reviews"]:
        yield ReviewLine(memory_id=key.decode(), **_fields(state, ()))
    for key, state in found[b"summaries"]:
        yield SummaryLine(session_id=key.decode(), **_fields(state, ()))
    for key, entity in found[b"entities"]:
        fields = _fields(entity, ())
        if entity.type == "alias" and b"\xff" not in key:
            # Filed under its own key, which an older build's record does not name (it
            # named its target): an import files it under its name.
            fields["name"] = key.decode()
        yield EntityLine(**fields)


async def export_user(parts: Parts, user_id: str,
                      dest: str | os.PathLike[str] | IO[bytes]) -> dict[str, int]:
    """Write every record of ``user_id`` to ``dest`` (a path, written atomically, or a
    binary file); returns the count of each kind of line."""
    from ._version import __version__

    store = parts.store
    if isinstance(dest, (str, os.PathLike)):
        dest = _export_path(Path(dest), store.path)
    elif isinstance(dest, io.TextIOBase):
        raise InvalidInput("dest", "expected a binary file (opened 'wb', or sys.stdout.buffer), "
                                   f"found a text file {type(dest).__name__}")
    await store.wait_logged()  # everything acknowledged is in it
    found = await store.read(_read_user, user_id)
    now = parts.clock().astimezone(timezone.utc)
    counts: dict[str, int] = {}
    chunks: list[bytes] = []
    for line in _lines(user_id, found, now, __version__):
        record = type(line).__struct_config__.tag
        counts[record] = counts.get(record, 0) + 1
        chunks.append(_encode_line(line) + b"\n")
    total = sum(counts.values()) - 1  # the header is not a record
    if not total:
        # A typo or a case variant in a backup script: an empty export taken for a backup.
        raise NotFound("user_id", f"expected a user this store holds, found no record of "
                                  f"{v.shown(user_id)} (ids are case-sensitive); nothing written")
    chunks.append(_encode_line(End(records=total)) + b"\n")
    data = b"".join(chunks)
    if isinstance(dest, Path):
        try:
            if dest.exists() and not dest.is_file():
                # A device or a pipe (/dev/stdout): written to, never replaced by a file.
                await trio.to_thread.run_sync(dest.write_bytes, data)
            else:
                # Beside a temporary file of a longer name, in a folder that may refuse it.
                await trio.to_thread.run_sync(write_atomically, dest, data)
        except OSError as exc:
            if exc.errno not in PATH_ERRNOS:
                raise
            raise refused("dest", exc, "a file this process can write") from exc
    else:
        await trio.to_thread.run_sync(_write_all, dest, data)
    counts.pop("header")
    return counts


def _write_all(dest: Any, data: bytes) -> None:
    """Every byte of ``data`` into a binary file: a pipe or a raw file may take part of a
    write (and a reader gone, none), which one ``write`` would leave unnoticed.

    Raises:
        InvalidInput: the file took no more bytes before the end.
    """
    view, done = memoryview(data), 0
    while done < len(data):
        taken = dest.write(view[done:])
        if taken is None:  # a file object that writes everything or raises
            return
        if taken <= 0:
            raise InvalidInput("dest", f"expected a file that takes every byte, found one that "
                                       f"took {done} of {len(data)}")
        done += taken


def _export_path(dest: Path, store: Path) -> Path:
    """Where an export to ``dest`` goes: the file a link names (the link stays), or ``dest``
    itself when it is a device, a pipe or a FIFO; checked before the user is read.

    Raises:
        InvalidInput: ``dest`` is inside the store (its files would be replaced), a
            directory, or in a directory that does not exist.
    """
    path, store = resolved("dest", dest), store.resolve()
    try:
        if dest.exists() and not dest.is_file() and not dest.is_dir():
            # A device, a pipe or a FIFO (/dev/stdout on a pipe links to "pipe:[...]", no
            # file name): written to as it is, never through its link's target.
            return dest
    except OSError:
        pass  # a name too long: refused below, with the other checks' wording
    if path.is_relative_to(store):
        raise InvalidInput("dest", f"expected a file outside the store, found {dest} inside "
                                   f"{store}; write the export beside the store")
    try:
        if path.is_dir():
            raise InvalidInput("dest", f"expected a file, found a directory at {dest}")
        if not path.parent.is_dir():
            raise InvalidInput("dest", f"expected a file in an existing directory, found no "
                                       f"directory {path.parent}; create it first")
    except OSError as exc:  # a name too long
        if exc.errno not in PATH_ERRNOS:
            raise
        raise refused("dest", exc, "a file this process can write") from exc
    return path


class UserVectors(msgspec.Struct, frozen=True):
    """A user's stored vectors, as ``Engine.export_vectors`` reads them, to go beside the
    user's export into ``Engine.import_users``: the importing engine stores them with the
    records instead of running the model on every text again.

    Attributes:
        user_id: the user they were read from (an import checks it against its export's).
        model / dim: the embedding model that made them.
        vectors: the record's position in the exporting store (its export lines' ``lsn``)
            -> its vector, or one per chunk, as ``dim`` little-endian float16 values each.
    """

    user_id: str
    model: str
    dim: int
    vectors: dict[int, bytes]


MAX_CHUNKS = 1 << 16  # chunk vectors one record's value can hold (its header counts them)


async def export_vectors(parts: Parts, user_id: str) -> UserVectors:
    """The vectors the store holds of ``user_id``'s records (those embedded so far)."""
    await parts.store.wait_logged()
    model = parts.embedder.model
    lsns, values = await parts.store.read(read_user_vector_values, user_id)
    return UserVectors(user_id, model.id, model.dim,
                       {lsn: value[HEADER.itemsize:] for lsn, value in zip(lsns, values)})


class VectorRows(msgspec.Struct, frozen=True, gc=False):
    """A user's stored vectors as a partition snapshot carries them: one buffer of every
    vector (a record's chunk vectors next to each other), in record order, where
    :class:`UserVectors` holds a bytes object a record (100k of them cost a restore a
    tenth of a second to make and as much to check).

    Attributes:
        user_id / model / dim: as :class:`UserVectors`'s.
        lsns: each record's position in the exporting store (its lines' ``lsn``).
        counts: how many vectors each record has (one, or one per chunk).
        data: ``sum(counts) * dim`` little-endian float16 values.
    """

    user_id: str
    model: str
    dim: int
    lsns: list[int]
    counts: list[int]
    data: bytes


def _rows(parts: Parts, user_id: str, lsns: list[int], values: list[bytes]) -> VectorRows:
    model = parts.embedder.model
    row = model.dim * STORED.itemsize
    body = [value[HEADER.itemsize:] for value in values]
    return VectorRows(user_id, model.id, model.dim, lsns, [len(b) // row for b in body],
                      b"".join(body))


async def export_records(parts: Parts, user_id: str) -> tuple[UserRecords, VectorRows]:
    """Every record of ``user_id`` as :func:`export_user` writes them, without the JSON, and
    the vectors the store holds of them: what a cluster's partition snapshot carries."""
    await parts.store.wait_logged()
    found = await parts.store.read(_read_user, user_id)
    lsns, values = await parts.store.read(read_user_vector_values, user_id)
    records = UserRecords(user_id, [], [], [], [], [], [], [], [])
    by_kind: dict[type, list[Any]] = {
        TurnLine: records.turns, NoteLine: records.notes, EpisodeLine: records.episodes,
        FactLine: records.facts, LinkLine: records.links, ReviewLine: records.reviews,
        SummaryLine: records.summaries, EntityLine: records.entities}
    for line in _lines(user_id, found, parts.clock().astimezone(timezone.utc), ""):
        if type(line) is not Header:
            by_kind[type(line)].append(line)
    return records, _rows(parts, user_id, lsns, values)


def _vectors_of(given: Any, exported_user: str, model: ModelInfo, name: str
                ) -> dict[int, np.ndarray] | None:
    """An import's vectors by export lsn, checked (in a worker thread: a partition's are
    ~80 MB); None if there are none, or if another model made them (the records are then
    embedded here).

    Raises:
        InvalidInput: not a UserVectors (or VectorRows) of the export's user, or a value that
            is not a whole number of ``dim`` finite float16 vectors, none all zeros.
    """
    if given is None:
        return None
    if not isinstance(given, (UserVectors, VectorRows)):
        raise InvalidInput(name, "expected UserVectors (Engine.export_vectors), found "
                                 f"{type(given).__name__}")
    if given.user_id != exported_user:
        raise InvalidInput(name, f"expected the vectors of user {exported_user!r} (its "
                                 f"export's), found those of {given.user_id!r}")
    if (given.model, given.dim) != (model.id, model.dim):
        return None
    row = model.dim * STORED.itemsize
    if isinstance(given, VectorRows):
        lsns = given.lsns
        if (type(given.counts) is list and set(map(type, given.counts)) == {int}
                and given.counts.count(1) == len(given.counts) == len(lsns)
                and len(given.data) == len(lsns) * row):
            # One vector a record, as an export has them but for a text longer than the
            # model's window: record i is row i, and the per-record sizes need no arrays.
            matrix = np.frombuffer(given.data, dtype=STORED).reshape(-1, model.dim)
            _check_usable(matrix, None, lsns, name)
            return dict(zip(lsns, matrix))
        try:
            counts = np.asarray(given.counts, dtype=np.int64)
        except (OverflowError, ValueError, TypeError):
            raise InvalidInput(name, "expected vector counts of 1 to "
                                     f"{MAX_CHUNKS}, found {v.found(given.counts)}") from None
        if len(lsns) != len(counts) or int(counts.sum()) * row != len(given.data):
            raise InvalidInput(name, f"expected {len(lsns)} vector counts and "
                                     f"{int(counts.sum()) * row} bytes of vectors, found "
                                     f"{len(counts)} counts and {len(given.data)} bytes")
        sizes, data = counts * row, given.data
    else:
        if type(given.vectors) is not dict:
            raise InvalidInput(name, "expected vectors as a dict of record lsn -> bytes, "
                                     f"found {type(given.vectors).__name__}")
        lsns, datas = list(given.vectors), list(given.vectors.values())
        for lsn, value in zip(lsns, datas):
            if type(lsn) is not int or type(value) is not bytes:
                raise InvalidInput(name, "expected vectors as a dict of record lsn (int) -> "
                                         f"bytes, found {type(lsn).__name__} -> "
                                         f"{type(value).__name__}")
        sizes = np.fromiter(map(len, datas), dtype=np.int64, count=len(datas))
        data = b"".join(datas)
    # Checked and cut a user at a time: one array of every vector, each record a view of its
    # rows (a numpy call a record cost a restore of 100k turns a second).
    bad = np.flatnonzero((sizes <= 0) | (sizes % row != 0) | (sizes > MAX_CHUNKS * row))
    if bad.size:
        raise InvalidInput(name, f"expected 1 to {MAX_CHUNKS} vectors of {model.dim} float16 "
                                 f"values, found {sizes[bad[0]]} bytes for record "
                                 f"{lsns[bad[0]]}")
    matrix = np.frombuffer(data, dtype=STORED).reshape(-1, model.dim)
    rows = sizes // row
    ends = np.cumsum(rows)
    _check_usable(matrix, ends, lsns, name)
    return {lsn: matrix[end - n:end]
            for lsn, end, n in zip(lsns, ends.tolist(), rows.tolist(), strict=True)}


def _check_usable(matrix: np.ndarray, ends: np.ndarray | None, lsns: Any, name: str) -> None:
    """Each row of ``matrix`` finite and not all zeros; ``ends``: where each record's rows
    end (None: a row a record).

    Raises:
        InvalidInput: naming the first record holding another row.
    """
    # On the bits (numpy's isfinite on float16 took 0.3 s for 100k vectors): without its sign
    # bit, a float16 is NaN or infinite from 0x7C00 up (exponent bits all set) and zero at 0,
    # so a row's largest such value tells both.
    top = (matrix.view(np.uint16) & np.uint16(0x7FFF)).max(axis=1, initial=0)
    unusable = (top >= 0x7C00) | (top == 0)
    if unusable.any():
        first = int(np.flatnonzero(unusable)[0])
        record = first if ends is None else int(np.searchsorted(ends, first, side="right"))
        raise InvalidInput(name, "expected finite vectors, not all zeros, found another in "
                                 f"record {lsns[record]}")


# -- import ------------------------------------------------------------------------------------

class UserRecords(msgspec.Struct):
    """One user's records as an export's lines carry them, by kind: parsed from JSON Lines
    (:func:`parse`), or as a cluster's partition snapshot holds them (msgpack, no JSON)."""

    user_id: str
    turns: list[TurnLine]
    notes: list[NoteLine]
    episodes: list[EpisodeLine]
    facts: list[FactLine]
    links: list[LinkLine]
    reviews: list[ReviewLine]
    summaries: list[SummaryLine]
    entities: list[EntityLine]


_LINE_KINDS = (("turns", TurnLine), ("notes", NoteLine), ("episodes", EpisodeLine),
               ("facts", FactLine), ("links", LinkLine), ("reviews", ReviewLine),
               ("summaries", SummaryLine), ("entities", EntityLine))


def _bad(where: str, reason: str) -> InvalidInput:
    return InvalidInput("source", f"{where}: {reason}")


def parse(data: bytes) -> UserRecords:
    """Decode and check an export: its lines in one call, and line by line to name the
    first that does not read.

    Raises:
        InvalidInput: the text is not an export of a version this build reads, a line does not
            fit its record's schema, or the file is cut short (no end line, or a wrong count).
    """
    lines = data.splitlines()
    if not lines or not lines[0].strip():
        raise _bad("line 1", "expected the export's header line, found nothing")
    try:
        head = msgspec.json.decode(lines[0])
    except _UNREADABLE as exc:
        raise _bad("line 1", f"expected a JSON header line, found {exc}") from None
    if not isinstance(head, dict) or head.get("format") != FORMAT:
        raise _bad("line 1", f"expected format {FORMAT!r}, found "
                             f"{head.get('format') if isinstance(head, dict) else head!r}")
    if head.get("version") not in READS:
        known = f"{', '.join(map(str, READS[:-1]))} or {READS[-1]}"
        raise _bad("line 1", f"expected format version {known}, found "
                             f"{head.get('version')!r} (written by another engram-trio "
                             "version: export again with this one)")
    parsed = UserRecords("", [], [], [], [], [], [], [], [])
    by_kind: dict[type, list[Any]] = {
        TurnLine: parsed.turns, NoteLine: parsed.notes, EpisodeLine: parsed.episodes,
        FactLine: parsed.facts, LinkLine: parsed.links, ReviewLine: parsed.reviews,
        SummaryLine: parsed.summaries, EntityLine: parsed.entities}
    end: End | None = None
    # Every line in one call (a third faster than a call a line); a line that does not decode
    # sends it to the loop below, whose error names the line.
    body = [raw for raw in lines if raw.strip()]
    try:
        decoded: list[Any] = _decode_lines(b"[" + b",".join(body) + b"]")
    except _UNREADABLE:
        decoded = []
    if decoded:
        if (len(decoded) != len(body) or not isinstance(decoded[0], Header)
                or not isinstance(decoded[-1], End)
                or any(type(line) in _ONCE for line in decoded[1:-1])):
            decoded = []  # not one record a line, or a misplaced header or end: the loop says
        else:
            parsed.user_id = decoded[0].user_id
            end = decoded[-1]
            for line in decoded[1:-1]:
                by_kind[type(line)].append(line)
    for n, raw in enumerate(lines if not decoded else (), 1):
        if not raw.strip():
            continue
        if end is not None:
            raise _bad(f"line {n}", "expected nothing after the end line, found more")
        try:
            line = _decode_line(raw)
        except _UNREADABLE as exc:
            raise _bad(f"line {n}", f"expected a record of the export format, found {exc}"
                       ) from None
        if isinstance(line, Header):
            if n != 1:
                raise _bad(f"line {n}", "expected one header, on the first line, found another")
            parsed.user_id = line.user_id
        elif isinstance(line, End):
            end = line
        else:
            by_kind[type(line)].append(line)
    records = sum(len(found) for found in by_kind.values())
    if end is None:
        raise _bad("the file", f"expected an end line, found none after {records} records: the "
                               "export was cut short")
    if end.records != records:
        raise _bad("the file", f"expected {end.records} records as its end line says, found "
                               f"{records}: the export was cut short or edited")
    return parsed


def _check(parsed: UserRecords, parts: Parts) -> None:
    """What must hold before anything is written: ids, turn order, one active fact per key."""
    config = parts.config
    limit = config.max_id_chars
    ids: set[str] = set()

    def new_id(kind: str, memory_id: str) -> None:
        v.check_id(f"source.{kind}", memory_id, limit)
        if memory_id in ids:
            raise _bad(kind, f"expected unique ids, found {memory_id!r} twice")
        ids.add(memory_id)

    sessions: dict[str, list[TurnLine]] = {}
    turns = parsed.turns
    # Roles, texts, times and ids a column at a time where a column passes (an export of this
    # engine's); else each turn's checks, whose error names the first bad one. Meta and
    # scope are checked on the turns that have them.
    passed = (v.roles_pass([t.role for t in turns])
              and v.texts_pass([t.text for t in turns], config.max_text_chars)
              and v.ats_pass([t.at for t in turns]))
    turn_ids = [t.turn_id for t in turns]
    if v.ids_pass(turn_ids, limit) and len(set(turn_ids)) == len(turn_ids):
        ids.update(turn_ids)
    else:
        for turn in turns:
            new_id("turn_id", turn.turn_id)
    for turn in turns:
        sessions.setdefault(turn.session_id, []).append(turn)
        if not passed:
            if turn.role not in ROLES:
                raise _bad(f"turn {turn.turn_id}", f"expected a role among "
                                                   f"{', '.join(ROLES)}, found {turn.role!r}")
            v.check_text("source.text", turn.text, config.max_text_chars)
            v.check_at(turn.at, "source.at")
        if turn.meta:
            v.check_meta(turn.meta, config.max_meta_bytes)
        for field in ("agent_id", "run_id"):
            if getattr(turn, field):
                v.check_id(f"source.{field}", getattr(turn, field), config.max_id_chars)
    for session_id in sessions:
        v.check_id("source.session_id", session_id, limit)
    for session_id, in_session in sessions.items():
        in_session.sort(key=lambda t: t.seq)
        if [t.seq for t in in_session] != list(range(len(in_session))):
            raise _bad(f"session {session_id}", "expected turns numbered 0, 1, 2... without gaps, "
                                                f"found {[t.seq for t in in_session][:10]}...")
        first = in_session[0]
        for turn in in_session:  # a session belongs to its first turn's agent and run
            for field in ("agent_id", "run_id"):
                if getattr(turn, field) != getattr(first, field):
                    raise other_scope(session_id, field, getattr(first, field),
                                      getattr(turn, field))
        # The import appends in lsn order, each turn taking its session's next seq.
        for before, after in zip(in_session, in_session[1:]):
            if not before.lsn < after.lsn:
                raise _bad(f"session {session_id}", "expected its turns' lsns to rise with their "
                                                    f"seqs, found lsn {after.lsn} at seq "
                                                    f"{after.seq} after lsn {before.lsn}")
    for note in parsed.notes:
        new_id("note_id", note.note_id)
        _check_record(note)
        v.check_text("source.text", note.text, config.max_text_chars)
        if not 0 <= note.importance <= 1:
            raise _bad(f"note {note.note_id}", "expected an importance from 0 to 1, found "
                                               f"{note.importance!r}")
        for i, tag in enumerate(note.tags):  # a merged note may hold more than one call's
            v.check_id(f"source.tags[{i}]", tag, 4 * v.MAX_ID_BYTES, what="tag")
        if note.category:
            v.check_id("source.category", note.category, limit)
        check_label("source.emotion", note.emotion)
        for field in ("agent_id", "run_id"):
            if getattr(note, field):
                v.check_id(f"source.{field}", getattr(note, field), limit)
    starts: dict[tuple[str, int], str] = {}
    for episode in parsed.episodes:
        new_id("episode_id", episode.episode_id)
        _check_record(episode)
        # The store keeps an episode under its session and first turn: a second one there
        # would replace the first.
        other = starts.setdefault((episode.session_id, episode.first_seq), episode.episode_id)
        if other != episode.episode_id:
            raise _bad(f"episode {episode.episode_id}", "expected one episode starting at each "
                                                        f"turn of a session, found {other} at "
                                                        f"seq {episode.first_seq} of "
                                                        f"{episode.session_id} too")
        v.check_id("source.session_id", episode.session_id, limit)
        _check_positive("stability", episode.stability)
        _check_positive("difficulty", episode.difficulty)
        check_fraction("source.surprise", episode.surprise)
        if not episode.turn_ids or episode.first_seq > episode.last_seq:
            raise _bad(f"episode {episode.episode_id}", "expected the turns it covers, first to "
                                                        f"last, found {len(episode.turn_ids)} "
                                                        f"turn ids, seqs {episode.first_seq} to "
                                                        f"{episode.last_seq}")
        for i, turn_id in enumerate(episode.turn_ids):
            v.check_id(f"source.turn_ids[{i}]", turn_id, limit)
    active: set[tuple[str, str]] = set()
    for fact in parsed.facts:
        new_id("fact_id", fact.fact_id)
        _check_record(fact)
        for field in ("category", "key"):
            v.check_id(f"source.{field}", getattr(fact, field), limit)
        for field in ("value", "text"):
            v.check_text(f"source.{field}", getattr(fact, field), config.max_text_chars)
        for field in ("confidence", "importance"):
            check_fraction(f"source.{field}", getattr(fact, field))
        if fact.session_id:
            v.check_id("source.session_id", fact.session_id, limit)
        for field in ("source_turn_ids", "source_episode_ids"):
            for i, memory_id in enumerate(getattr(fact, field)):
                v.check_id(f"source.{field}[{i}]", memory_id, limit)
        if fact.status not in FACT_STATUSES:
            raise InvalidInput("source.status", f"expected one of {', '.join(FACT_STATUSES)}, "
                                                f"found {fact.status!r} in fact {fact.fact_id}")
        if fact.status == "active":
            if spelling(fact.category, fact.key) in active:
                raise _bad(f"fact {fact.fact_id}", "expected one active version per category "
                                                   f"and key, found two for {fact.key!r}")
            active.add(spelling(fact.category, fact.key))
    logged = (*parsed.turns, *parsed.notes, *parsed.episodes, *parsed.facts)
    lsns = [line.lsn for line in logged]
    if len(set(lsns)) != len(lsns):
        # An lsn ties a record to its vectors and to the entities that mention it.
        taken: set[int] = set()
        for line in logged:
            if line.lsn in taken:
                raise _bad(f"{type(line).__struct_config__.tag} {_id_of(line)}",
                           f"expected an lsn of its own, found {line.lsn} twice")
            taken.add(line.lsn)
    for link in parsed.links:
        _check_record(link)
        for field in ("from_id", "to_id", "type"):
            v.check_id(f"source.{field}", getattr(link, field), limit)
    for review in parsed.reviews:
        _check_record(review)
        v.check_id("source.memory_id", review.memory_id, limit)
        _check_positive("stability", review.stability)
        _check_positive("difficulty", review.difficulty)
    for summary in parsed.summaries:
        _check_record(summary)
        v.check_id("source.session_id", summary.session_id, limit)
        if summary.summary.strip():  # a model may have written an empty one
            v.check_text("source.summary", summary.summary, config.max_text_chars)
    for entity in parsed.entities:
        _check_record(entity)
        v.check_text("source.name", entity.name, config.max_text_chars)
        if entity.type == "alias" and len(entity.aliases) != 1:
            # An alias names the entity it stands for: entity_info and every later mention
            # of it read that one key.
            raise InvalidInput("source.aliases", "expected the key of the entity it names, "
                                                 f"found {entity.aliases!r} for alias "
                                                 f"{entity.name!r}")


def _check_record(line: _Line) -> None:
    """Every time and count of a record as the calls that write one check theirs: a time
    the text index can hold, with a zone, and a count msgpack stores."""
    for name in line.__struct_fields__:
        value = getattr(line, name)
        if isinstance(value, datetime):
            v.check_at(value, f"source.{name}")
        elif type(value) is int and not 0 <= value <= v.MAX_INT:
            shown = value if value.bit_length() <= 256 else f"one of {value.bit_length()} bits"
            raise InvalidInput(f"source.{name}", f"expected an integer from 0 to 2**63-1, "
                                                 f"found {shown}")


def _check_positive(field: str, value: float) -> None:
    """An FSRS stability or difficulty: the scheduler divides by and takes logs of them."""
    if not value > 0:
        raise InvalidInput(f"source.{field}", f"expected a positive number, found {value!r}")


async def import_user(parts: Parts, source: str | os.PathLike[str] | bytes | IO[bytes],
                      as_user: str | None) -> dict[str, int]:
    """Read an export into the engine's store; returns what was written and what skipped."""
    return (await import_users(parts, [source], [as_user], ["source"]))[0]


async def import_users(parts: Parts,
                       sources: list[str | os.PathLike[str] | bytes | IO[bytes]],
                       as_users: list[str | None], names: list[str],
                       vectors: list[UserVectors | None] | None = None
                       ) -> list[dict[str, int]]:
    """Read exports into the engine's store, as one import: one parse, one read of what the
    store holds, their logged records in shared blocks, one wait for the commit and one
    write of the records outside the log. Every export is checked before anything is
    written. Returns what was written and what skipped, per export.

    ``names`` name each source in errors (``source``, or ``sources[3]``); ``vectors`` may
    give each source's vectors (:class:`UserVectors`)."""
    datas = [await _source_bytes(source, name) for source, name in zip(sources, names)]
    given = vectors if vectors is not None else [None] * len(datas)
    # Parsed and checked in a worker thread: a partition's restore is ~100k records, and the
    # trio thread serves the node's other partitions meanwhile.
    parsed, checked = await trio.to_thread.run_sync(_parse_all, datas, names, as_users, given,
                                                    parts)
    return await _import(parts, parsed, checked, as_users, names)


async def restore_users(parts: Parts, users: list[UserRecords],
                        vectors: list[VectorRows | None]) -> list[dict[str, int]]:
    """Write users' records as :func:`export_records` read them (a partition snapshot's),
    as one import: checked as an import checks an export, every block queued back to back,
    so the log's followers (text index, embedder, long-term layer) wait until the last is
    committed instead of halving the writes' pace (:meth:`Store.yield_to_receipts`). Then
    they catch up, and until they hold every restored record their search legs are
    reported degraded, as after an open that finds them behind. Returns what
    :func:`import_users` returns, per user."""
    names = [f"users[{i}]" for i in range(len(users))]
    parsed, checked = await trio.to_thread.run_sync(_check_restored, users, names, vectors,
                                                    parts)
    counts = await _import(parts, parsed, checked, [None] * len(users), names)
    # What the indexes lack of the restore now counts as what they lacked at open.
    restored = parts.store.committed_lsn
    parts.open_lsn = max(parts.open_lsn, restored)
    parts.fulltext.open_lsn = max(parts.fulltext.open_lsn, restored)
    return counts


def _check_restored(users: list[UserRecords], names: list[str],
                    vectors: list[VectorRows | None], parts: Parts
                    ) -> tuple[list[UserRecords], list[dict[int, np.ndarray] | None]]:
    """:func:`_check_all` of a restore's records, each first held to :func:`_check_kinds`
    (worker thread: a line at a time over a partition's records)."""
    for user, name in zip(users, names):
        _check_kinds(user, name)
        _check_encodable(user, name)
    return _check_all(users, names, [None] * len(users), vectors, parts)


def _check_kinds(user: UserRecords, name: str) -> None:
    """Each of a UserRecords' lists holds lines of its kind: a snapshot's typed decode makes
    it so, a caller's struct may not (the import's checks read the lines' fields).

    Raises:
        InvalidInput: a line of another type, naming the list and what was found.
    """
    for field, kind in _LINE_KINDS:
        lines = getattr(user, field)
        if type(lines) is not list or any(type(line) is not kind for line in lines):
            wrong = (lines if type(lines) is not list
                     else next(line for line in lines if type(line) is not kind))
            raise InvalidInput(f"{name}.{field}", f"expected {kind.__name__} items in a list, "
                                                  f"found {type(wrong).__name__}")


def _check_encodable(user: UserRecords, name: str) -> None:
    """Every text of a UserRecords' lines can be stored: records built in Python never met
    the JSON decoder, which refuses a lone surrogate, and the import's checks read only some
    fields; the store's writer would find one after the user's other records were written.
    One encode a list (C speed); the field is looked for only in a list that fails.

    Raises:
        InvalidInput: a lone surrogate, naming the line's field.
    """
    for field, _ in _LINE_KINDS:
        lines = getattr(user, field)
        try:
            _ENCODE(lines)
            continue
        except (UnicodeEncodeError, TypeError, ValueError, OverflowError):
            pass  # found below; a value of the wrong type or range: _check_all names it
        for i, line in enumerate(lines):
            for attribute in line.__struct_fields__:
                try:
                    _ENCODE(getattr(line, attribute))
                except UnicodeEncodeError as exc:
                    raise InvalidInput(f"{name}.{field}[{i}].{attribute}",
                                       f"expected text encodable as UTF-8, found {exc.reason} "
                                       f"at {exc.start} (a lone surrogate)") from None
                except (TypeError, ValueError, OverflowError):
                    pass


_ENCODE = msgspec.msgpack.Encoder().encode


async def _import(parts: Parts, parsed: list[UserRecords],
                  checked: list[dict[int, np.ndarray] | None], as_users: list[str | None],
                  names: list[str]) -> list[dict[str, int]]:
    imports: list[tuple[UserRecords, str]] = []
    seen: dict[str, str] = {}
    for one, as_user, name in zip(parsed, as_users, names):
        user_id = as_user if as_user is not None else one.user_id
        if user_id in seen:  # one's writes would be invisible to the other's checks
            raise InvalidInput(name, f"expected one export per user in one import, found "
                                     f"{user_id!r} in {seen[user_id]} too")
        seen[user_id] = name
        imports.append((one, user_id))
    busy = _IMPORTING.setdefault(parts, set())
    for user_id, name in seen.items():
        if user_id in busy:
            raise InvalidInput(name, f"expected no other import of user {user_id!r} under way, "
                                     "found one: import this once it has finished")
    busy.update(seen)
    try:
        if not any(one.facts for one, _ in imports):
            return await _write(parts, imports, checked)
        # Its facts are checked against the users' active ones, then written: no decision
        # of the Facts actor (a remember_fact, the extraction follower) may come between, or
        # a key would hold two active values, one hidden and never superseded. Those wait
        # for the import, then decide against what it wrote.
        async with parts.facts.held():
            return await _write(parts, imports, checked)
    finally:
        busy.difference_update(seen)


_KIND_OF_FILE = {stat.S_IFREG: "file", stat.S_IFIFO: "named pipe", stat.S_IFDIR: "directory",
                 stat.S_IFCHR: "character device", stat.S_IFBLK: "block device",
                 stat.S_IFSOCK: "socket"}


async def _source_bytes(source: str | os.PathLike[str] | bytes | IO[bytes], name: str
                        ) -> bytes:
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        try:
            # A file, or a named pipe (a shell's <(...)); whatever else is there would be
            # read for ever (/dev/zero) or not at all (a directory).
            kind = _KIND_OF_FILE.get(stat.S_IFMT(path.stat().st_mode), "special file")
            if kind not in ("file", "named pipe"):
                raise InvalidInput(name, f"expected an export file, found a {kind} at {path}")
            return await trio.to_thread.run_sync(path.read_bytes)
        except FileNotFoundError:
            raise InvalidInput(name, f"expected an export file, found nothing at {path}"
                               ) from None
        except OSError as exc:  # a name too long, a file this process may not read
            if exc.errno not in PATH_ERRNOS:
                raise
            raise refused(name, exc, "an export file this process can read") from exc
    if isinstance(source, (bytes, bytearray)):
        return bytes(source)
    if isinstance(source, io.TextIOBase):
        raise InvalidInput(name, "expected a binary file (opened 'rb'), found a text file "
                                 f"{type(source).__name__}")
    if hasattr(source, "read"):
        data = await trio.to_thread.run_sync(source.read)
        if not isinstance(data, (bytes, bytearray)):
            raise InvalidInput(name, "expected a binary file (opened 'rb'), found one whose "
                                     f"read() gave {type(data).__name__}")
        return bytes(data)
    raise InvalidInput(name, "expected a path, bytes or a binary file, found "
                             f"{type(source).__name__}")


@contextmanager
def _named(name: str) -> Iterator[None]:
    """Re-raise the checks' errors under one source's name when an import reads several:
    ``source.text`` as ``sources[3].text``, ``meta`` as ``sources[3].meta``."""
    try:
        yield
    except InvalidInput as exc:
        if name == "source":
            raise
        field = (name + exc.field[len("source"):] if exc.field.startswith("source")
                 else f"{name}.{exc.field}")
        raise InvalidInput(field, str(exc)[len(exc.field) + 2:]) from None


def _parse_all(datas: list[bytes], names: list[str], as_users: list[str | None],
               vectors: list[Any], parts: Parts
               ) -> tuple[list[UserRecords], list[dict[int, np.ndarray] | None]]:
    """Each export parsed and checked (:func:`_check_all`; a worker thread's call)."""
    parsed = []
    for data, name in zip(datas, names, strict=True):
        with _named(name):
            parsed.append(parse(data))
    return _check_all(parsed, names, as_users, vectors, parts)


def _check_all(parsed: list[UserRecords], names: list[str], as_users: list[str | None],
               vectors: list[Any], parts: Parts
               ) -> tuple[list[UserRecords], list[dict[int, np.ndarray] | None]]:
    """Each user's records checked (:func:`_check`, its user id), and the vectors given
    with them checked (a worker thread's call: it reads only the config and the model)."""
    checked = []
    for i, (one, name, as_user, given) in enumerate(
            zip(parsed, names, as_users, vectors, strict=True)):
        with _named(name):
            v.check_id("as_user" if as_user is not None else "source.user_id",
                       as_user if as_user is not None else one.user_id,
                       parts.config.max_id_chars)
            _check(one, parts)
        checked.append(_vectors_of(given, one.user_id, parts.embedder.model,
                                   "vectors" if name == "source" else f"vectors[{i}]"))
    return parsed, checked


class _User:
    """One export's part of an import: its records' positions here (the export's lsn to
    this store's), and what was written and skipped."""

    __slots__ = ("parsed", "user_id", "lsn_map", "fresh", "written", "skipped", "have",
                 "unfiled", "vectors")

    def __init__(self, parsed: UserRecords, user_id: str, have: dict[str, Any], unfiled: set[str],
                 vectors: dict[int, np.ndarray] | None) -> None:
        self.parsed, self.user_id, self.have, self.vectors = parsed, user_id, have, vectors
        self.unfiled = unfiled  # past fact versions here without their id's entry
        self.lsn_map: dict[int, int] = {}
        self.fresh: set[int] = set()  # positions this import wrote (the rest were here)
        self.written: dict[str, int] = {}
        self.skipped = 0  # records the store already held


def _every_id(parsed: UserRecords) -> list[str]:
    return ([t.turn_id for t in parsed.turns] + [n.note_id for n in parsed.notes]
            + [e.episode_id for e in parsed.episodes] + [f.fact_id for f in parsed.facts])


def _read_present(txn: Any, dbs: dict[bytes, Any], wanted: list[tuple[str, UserRecords]]
                  ) -> list[tuple[dict[str, Any], set[str], dict[tuple[str, str], Fact],
                                  dict[tuple[str, int], str]]]:
    """Each user's records among those of its export, in one read transaction; the past
    fact versions among them stored without their id's entry (an import stopped before it
    wrote its records outside the log), found in the user's fact history; the user's
    active facts by their spelling (:func:`actors.facts.spelling`); and the user's episodes
    of the export's episodes' sessions, by (session, first seq): where the store keeps them.
    The ids are listed only for a user the store holds memories of (a restore's users are
    new here)."""
    out = []
    for user_id, parsed in wanted:
        past = [f.fact_id for f in parsed.facts if f.status != "active"]
        held = holds_memories(txn, dbs, user_id)
        # The turns episodes name are looked for too: an episode is written only if every
        # one is held once the import's own are.
        wanted = _every_id(parsed) + [turn_id for e in parsed.episodes for turn_id in e.turn_ids]
        have = read_memories_by_id(txn, dbs, user_id, wanted) if held else {}
        versions = {f.fact_id: f for f in read_facts(txn, dbs, user_id, False)}
        unfiled = {f: versions[f] for f in past if f not in have and f in versions}
        active = {spelling(f.category, f.key): f for f in versions.values()
                  if f.status == "active"}
        starts = {(e.session_id, e.first_seq): e.episode_id
                  for session_id in ({e.session_id for e in parsed.episodes} if held else ())
                  for e in read_episodes(txn, dbs, user_id, session_id)}
        out.append(({**have, **unfiled}, set(unfiled), active, starts))
    return out


async def _write(parts: Parts, imports: list[tuple[UserRecords, str]],
                 vectors: list[dict[int, np.ndarray] | None]) -> list[dict[str, int]]:
    store, buffer = parts.store, parts.buffer
    await store.wait_logged()
    haves = await store.read(_read_present, [(user_id, parsed) for parsed, user_id in imports])
    users = [_User(parsed, user_id, have, unfiled, given)
             for (parsed, user_id), (have, unfiled, _, _), given in zip(imports, haves, vectors)]
    for user, (_, _, active, starts) in zip(users, haves):
        for episode in user.parsed.episodes:
            there = starts.get((episode.session_id, episode.first_seq))
            if there is not None and there != episode.episode_id:
                # Kept under its session and first turn, it would replace the user's own.
                raise _bad(f"episode {episode.episode_id}", "expected no episode of session "
                                                            f"{episode.session_id} starting at "
                                                            f"seq {episode.first_seq} here, "
                                                            f"found {there}: import under "
                                                            "another user (as_user)")
        for fact in user.parsed.facts:
            there = active.get(spelling(fact.category, fact.key))
            if (fact.status == "active" and fact.fact_id not in user.have
                    and there is not None):
                # The user's profile holds one value a key: a second would stay active and
                # hidden, never superseded.
                raise _bad(f"fact {fact.fact_id}", f"expected no other active value of "
                                                   f"({fact.category!r}, {fact.key!r}) here, "
                                                   f"found {there.value!r}: import under "
                                                   "another user (as_user), or forget_fact "
                                                   "it first")
    # Where a record is already in this store (an earlier import of the same file, or a part
    # of one a crash cut short), its position here stands for the exported one.
    # The records to write in order, and whose each is (side by side: no pair per record).
    todo: list[Any] = []
    owners: list[_User] = []
    for user in users:
        parsed, user_id, have, lsn_map = user.parsed, user.user_id, user.have, user.lsn_map
        mine: list[Any] = []
        sessions: dict[str, list[TurnLine]] = {}
        for turn in parsed.turns:
            sessions.setdefault(turn.session_id, []).append(turn)
        for session_id, turns in sessions.items():
            present = buffer.next_seq(user_id, session_id) or 0
            for turn in turns[:present]:
                there = have.get(turn.turn_id)
                if (type(there) is not Turn or there.session_id != session_id
                        or there.seq != turn.seq):
                    raise _bad(f"session {session_id}", f"expected its {present} turns here to "
                                                        "be the export's first ones, found "
                                                        "others: import under another user "
                                                        "(as_user)")
                lsn_map[turn.lsn] = there.lsn
            user.skipped += min(present, len(turns))
            new = turns[present:]
            held = buffer.scope(user_id, session_id)
            if new and held is not None:
                for field, own, given in zip(("agent_id", "run_id"), held,
                                             (new[0].agent_id, new[0].run_id)):
                    if given != own:
                        raise other_scope(session_id, field, own, given)
            if have:  # an id held already: only an import of the same file again
                for turn in new:
                    _check_new(user_id, turn, have.get(turn.turn_id))
            mine.extend(new)
        file_turns = {turn.turn_id for turn in parsed.turns} if parsed.episodes else set()
        for line in (*parsed.notes, *parsed.episodes, *parsed.facts):
            there = have.get(_id_of(line))
            if there is None:
                if (type(line) is EpisodeLine and line.session_id not in sessions
                        and buffer.next_seq(user_id, line.session_id) is None):
                    # The store drops an episode of a session it does not hold.
                    raise _bad(f"episode {line.episode_id}", "expected a session of the user's "
                                                             f"turns, found {line.session_id}, "
                                                             "which holds none here or in "
                                                             "the export")
                if type(line) is EpisodeLine:
                    for turn_id in line.turn_ids:  # and one of a turn it does not hold
                        if turn_id not in file_turns and type(have.get(turn_id)) is not Turn:
                            raise _bad(f"episode {line.episode_id}",
                                       "expected the turns it covers among the user's, found "
                                       f"{turn_id!r}, which is neither in the export nor here")
                mine.append(line)
            else:
                _check_new(user_id, line, there)
                lsn_map[line.lsn] = there.lsn
                user.skipped += 1
        for summary in parsed.summaries:  # held to write_session_summary's rules
            here = buffer.next_seq(user_id, summary.session_id)
            if here is None and summary.session_id not in sessions:
                raise InvalidInput("source.session_id", f"expected a session of user "
                                                        f"{user_id!r}, found none called "
                                                        f"{summary.session_id!r} for its summary")
            turns = max(here or 0, len(sessions.get(summary.session_id, ())))
            if summary.upper_seq > turns:
                raise InvalidInput("source.upper_seq", f"expected an integer from 0 to {turns}, "
                                                       f"found {summary.upper_seq} in the "
                                                       f"summary of {summary.session_id}")
        mine.sort(key=_LSN)  # the source's log order: entities' stay in order
        todo.extend(mine)
        owners.extend(repeat(user, len(mine)))
    imported = parts.imported
    last = 0
    try:
        for start in range(0, len(todo), IMPORT_CHUNK):
            chunk = todo[start:start + IMPORT_CHUNK]
            whose = owners[start:start + IMPORT_CHUNK]
            await store.reserve(len(chunk) + 1)
            parts.check_open()
            # A live turn may have reached a session of the import while it waited for room:
            # checked before any of the block is queued, since the block's positions are marked
            # imported (the long-term layer skips them) and a block cut short would leave the
            # rest marked for the next live turns to take.
            _check_seqs(parts, whose, chunk)
            # From here to the end of the block nothing yields: its positions are contiguous.
            first = store.next_lsn
            last = first + len(chunk) - 1
            # The range's mark commits with its records: kept without them (a store that failed
            # between two commits), the next live turns after a restart would take its positions.
            store.hold_together(len(chunk) + 1)
            imported.add(first, last)
            store.submit(PutState((Imported.marker(first, last),)))
            at = 0
            for kind, group in groupby(chunk, type):  # runs of one type
                run = list(group)
                run_owners = whose[at:at + len(run)]
                at += len(run)
                if kind is TurnLine:
                    for user, line, receipt in zip(run_owners, run,
                                                   _append_turns(parts, run_owners, run),
                                                   strict=True):
                        user.lsn_map[line.lsn] = receipt.lsn
                        user.fresh.add(receipt.lsn)
                else:
                    for user, line in zip(run_owners, run):
                        user.lsn_map[line.lsn] = store.next_lsn
                        user.fresh.add(store.next_lsn)
                        _submit(parts, user.user_id, line)
                tag = kind.__struct_config__.tag + "s"
                for user in run_owners:
                    user.written[tag] = user.written.get(tag, 0) + 1
            # Vectors that came with the block's records, before the embedder can read them.
            preset = [(user.lsn_map[line.lsn], vector) for user, line in zip(whose, chunk)
                      if user.vectors is not None
                      and (vector := user.vectors.get(line.lsn)) is not None]
            if preset and parts.config.background_embedding:  # else no follower would take them
                parts.embedder.preset(preset)
        if last:
            await store.wait_committed(last)
        await _write_unlogged(parts, users)
    finally:
        # Queued records land whether or not the caller stays for them (a cancel, a block
        # refused after others were queued, a failed write of the unlogged ones): once
        # everything this import queued has, its notes' files are written and the caches that
        # read the user before it learn of them, reading the user again. Dropped before the
        # commit, a read in between would cache the user without them again.
        if last:
            with trio.CancelScope(shield=True), suppress(EngineError):
                await store.wait_written()
                if parts.notes_md is not None:
                    for user, line in zip(owners, todo):
                        lsn = user.lsn_map.get(line.lsn) if type(line) is NoteLine else None
                        if lsn is not None:
                            await parts.notes_md.write(_note(line, lsn, user.user_id))
        for user in users:
            parts.facts.forget(user.user_id)
            parts.compressor.forget(user.user_id, None)
            parts.entities.forget(user.user_id)
    return [{**user.written, "skipped": user.skipped} for user in users]


_KINDS = {TurnLine: Turn, NoteLine: Note, EpisodeLine: Episode, FactLine: Fact}
_LSN = attrgetter("lsn")


def _check_new(user_id: str, line: Any, there: Any) -> None:
    """A turn to append holds an id the user has no record of; a note, episode or fact the
    user holds under its id is a record of its kind (an earlier import of it), not another
    one: the id would be filed under one record and the other no longer read by it.

    Raises:
        InvalidInput: the id names another of the user's records.
    """
    if there is None or (type(line) is not TurnLine and type(there) is _KINDS[type(line)]):
        return
    kind = type(line).__struct_config__.tag
    raise _bad(f"{kind} {_id_of(line)}", f"expected an id {user_id} does not hold yet, found a "
                                         f"{type(there).__name__.lower()} of that id here: "
                                         "import under another user (as_user)")


def _id_of(line: Any) -> str:
    return getattr(line, "turn_id", None) or getattr(line, "note_id", None) or getattr(
        line, "episode_id", None) or line.fact_id


def _check_seqs(parts: Parts, owners: list[_User], lines: list[Any]) -> None:
    """Each turn among ``lines`` (of ``owners``) takes its own seq in its session when they
    are appended in order: no other turn reached the session since the import read it."""
    buffer = parts.buffer
    next_seq: dict[tuple[str, str], int] = {}
    for user, line in zip(owners, lines):
        if type(line) is not TurnLine:
            continue
        session = (user.user_id, line.session_id)
        seq = next_seq.get(session)
        if seq is None:
            seq = buffer.next_seq(*session) or 0
        if seq != line.seq:
            raise _bad(f"session {line.session_id}", "expected no other turns while importing "
                                                     "it, found some: import it again")
        next_seq[session] = seq + 1


def _append_turns(parts: Parts, owners: list[_User], lines: list[TurnLine]) -> list[Receipt]:
    """Queue a run of turns (of ``owners``) at the store's next positions in one bulk append,
    as a history import does (synchronous); each keeps its id and its seq
    (:func:`_check_seqs`)."""
    return parts.buffer.append_many(
        [user.user_id for user in owners], [line.session_id for line in lines],
        [line.role for line in lines], [line.text for line in lines],
        [line.at for line in lines], [line.meta for line in lines],
        [line.agent_id or None for line in lines], [line.run_id or None for line in lines],
        [line.turn_id for line in lines])


def _submit(parts: Parts, user_id: str, line: Any) -> None:
    """Queue one logged record other than a turn at the store's next position
    (synchronous)."""
    store = parts.store
    lsn = store.next_lsn
    if isinstance(line, NoteLine):
        store.submit(PutNote(lsn, _note(line, lsn, user_id), -1))
    elif isinstance(line, EpisodeLine):
        fields = _fields(line, ("lsn",))
        fields["turn_ids"], fields["keywords"] = tuple(line.turn_ids), tuple(line.keywords)
        store.submit(PutEpisode(lsn, Episode(lsn=lsn, user_id=user_id, **fields), ()))
    else:
        fact = _fact(line, lsn, user_id)
        if fact.status == "active":
            store.submit(PutFact(lsn, user_id, fact, ()))
        else:  # a past version: stored as history, never searchable
            store.submit(PutFact(lsn, user_id, None, (fact,)))


def _note(line: NoteLine, lsn: int, user_id: str) -> Note:
    """The note a checked line holds, its emotion as the engine keeps labels (composed,
    lower-case, spacing tidied: what the emotion filter compares with)."""
    return Note(lsn, line.note_id, user_id, line.text, tuple(line.tags), line.created_at,
                line.updated_at, line.importance, check_label("source.emotion", line.emotion),
                line.category, line.agent_id, line.run_id)


def _fact(line: FactLine, lsn: int, user_id: str) -> Fact:
    fields = _fields(line, ("lsn",))
    for name in ("keywords", "source_turn_ids", "source_episode_ids"):
        fields[name] = tuple(fields[name])
    return Fact(lsn=lsn, user_id=user_id, **fields)


def _merge_entity(user_id: str, imported: Entity, fresh: frozenset[int], raw: bytes | None
                  ) -> bytes | Elsewhere | None:
    """The registry value of an imported entity, merged with the one the key holds (``raw``)
    in the import's write transaction (writer's thread); None to leave it. A key that is an
    alias here (a first name filed under the full one) merges into the entity it names, as
    a live mention of the alias counts for that entity."""
    if raw is None:
        return _encode(imported)
    here = decode_entity(raw)
    if here.type == "alias":
        return Elsewhere(entity_key(user_id, here.aliases[0])) if here.aliases else None
    record = _merged(here, imported, fresh)
    return None if record is None else _encode(record)


def _merged(here: Entity, imported: Entity, fresh: frozenset[int]) -> Entity | None:
    """The user's registry record of a name with the mentions an import brings of it added
    (the long-term layer never derives them: it skips imported positions); None when there
    is nothing to add: none of the import's memories are new here (an earlier import of the
    file brought them, whether or not the record still lists them among its newest)."""
    new = [lsn for lsn in imported.lsns if lsn in fresh and lsn not in here.lsns]
    if not new:
        return None
    # Every mention the export counted when all of its memories are new here; else (a part
    # of it imported before) only those it adds.
    mentions = imported.mentions if len(new) == len(imported.lsns) else len(new)
    aliases = here.aliases
    for alias in (imported.name, *imported.aliases):
        if (len(aliases) < MAX_ALIASES and alias.lower() != here.name.lower()
                and alias.lower() not in {a.lower() for a in aliases}):
            aliases = (*aliases, alias)
    latest = imported if imported.last_seen > here.last_seen else here
    return Entity(here.name, here.type, aliases, here.mentions + mentions,
                  min(here.first_seen, imported.first_seen),
                  max(here.last_seen, imported.last_seen),
                  tuple(sorted({*here.lsns, *new}))[-MEMORIES_PER_ENTITY:], latest.last_id)


def _first_of_each(lines: list[Any], key: Callable[[Any], Any]) -> Iterator[Any]:
    """The first of the lines sharing a key: a pair holds one link of each type (either way)
    and a memory one review state, so a file (an older store's export, holding a link both
    ways) giving one twice writes it once and counts it once."""
    seen: set[Any] = set()
    for line in lines:
        if (k := key(line)) not in seen:
            seen.add(k)
            yield line


def _pair_and_type(link: LinkLine) -> tuple[str, str, str]:
    return (*sorted((link.from_id, link.to_id)), link.type)


def _read_unlogged(txn: Any, dbs: dict[bytes, Any],
                   wanted: list[tuple[str, list[str], list[str], list[str]]]
                   ) -> list[tuple[dict[str, list[Link]], set[str]]]:
    """Each user's links of these memories and which of those reviewed have a review state
    here, in one read transaction; the registry records under these keys are read too, so a
    damaged one fails the import here (StoreCorrupt) rather than the merge in the writer."""
    out = []
    for user_id, keys, ids, reviewed in wanted:
        read_entities(txn, dbs, user_id, keys)
        out.append((read_links(txn, dbs, user_id, ids),
                    set(read_review_states(txn, dbs, user_id, reviewed))))
    return out


async def _write_unlogged(parts: Parts, users: list[_User]) -> None:
    """Links, review states, entities, past fact versions' ids and summaries: records without
    a log position, written once the records they belong to are, in one batch."""
    store = parts.store
    puts: list[tuple[bytes, bytes, bytes | None, int]] = []
    links: list[tuple[str, Link, int]] = []
    # Whose each link and merge is: counted from what the write reports it wrote.
    link_owners: list[_User] = []
    merge_owners: list[_User] = []
    found = await store.read(_read_unlogged, [
        (user.user_id, sorted({composed(e.name).lower() for e in user.parsed.entities}),
         sorted({link.from_id for link in user.parsed.links}),
         [review.memory_id for review in user.parsed.reviews]) for user in users])
    summaries: list[tuple[_User, WriteSummary, list[bool]]] = []
    # What is written here is keyed on what the store holds of it, not on whether its
    # memory was new: an import stopped after its records and before these is completed
    # by importing it again.
    merges: list[tuple[bytes, bytes, Any, int]] = []
    for user, (there, reviewed) in zip(users, found):
        parsed, user_id, have, lsn_map = user.parsed, user.user_id, user.have, user.lsn_map
        counts = user.written
        prefix = user_prefix(user_id)
        # Each put is guarded by the position of a record it belongs to (PutState), so that
        # nothing of a user or session forgotten since those records were written comes back.
        anchor = max(lsn_map.values(), default=0)
        for fact in parsed.facts:
            if fact.status != "active" and (fact.fact_id not in have
                                            or fact.fact_id in user.unfiled):
                version = _fact(fact, lsn_map[fact.lsn], user_id)
                puts.append((b"ids", prefix + fact.fact_id.encode(),
                             IDS_FACT + fact_key(version), lsn_map[fact.lsn]))
        by_id = ({_id_of(line): line.lsn
                  for line in (*parsed.turns, *parsed.notes, *parsed.episodes, *parsed.facts)}
                 if parsed.reviews or parsed.links else {})
        for review in _first_of_each(parsed.reviews, attrgetter("memory_id")):
            lsn = lsn_map.get(by_id.get(review.memory_id, -1))
            if lsn is not None and review.memory_id not in reviewed:
                state = ReviewState(review.stability, review.difficulty, review.last_review,
                                    review.reps)
                puts.append((b"reviews", prefix + review.memory_id.encode(), _encode(state),
                             lsn))
                counts["reviews"] = counts.get("reviews", 0) + 1
        known: set[str] = set()
        for entity in parsed.entities:
            # Keyed as the engine keys a name it extracts: composed, then lower-case, so an
            # export that spelt it decomposed is found by entity_info however it is typed.
            name = composed(entity.name)
            key = name.lower()
            if key in known:
                continue  # another of the export's names composed the same: the first stays
            known.add(key)
            lsns = tuple(sorted(lsn_map[lsn] for lsn in entity.lsns if lsn in lsn_map))
            record = Entity(name, entity.type, tuple(composed(a) for a in entity.aliases),
                            entity.mentions, entity.first_seen, entity.last_seen, lsns,
                            entity.last_id)
            # Merged in the write's own transaction with what the registry holds then: a
            # live mention registered meanwhile is kept, not written over.
            merges.append((b"entities", entity_key(user_id, key),
                           partial(_merge_entity, user_id, record, frozenset(user.fresh)),
                           lsns[-1] if lsns else anchor))
            merge_owners.append(user)
        present = {(l.from_id, l.to_id, l.type) for found_links in there.values()
                   for l in found_links}
        # A link joins two of the export's memories (link() refuses any other, and a
        # memory's links go when it is forgotten): one naming another id is skipped.
        # One the pair holds the other way here stays as it is (link() refuses to turn it).
        new_links = [(user_id, Link(link.from_id, link.to_id, link.type, link.at),
                      lsn_map.get(by_id.get(link.from_id, -1))
                      or lsn_map.get(by_id.get(link.to_id, -1)) or anchor)
                     for link in _first_of_each(parsed.links, _pair_and_type)
                     if (link.from_id, link.to_id, link.type) not in present
                     and (link.to_id, link.from_id, link.type) not in present
                     and link.from_id in by_id and link.to_id in by_id]
        links.extend(new_links)
        link_owners.extend(repeat(user, len(new_links)))
        for summary in parsed.summaries:
            state = SummaryState(summary.epoch, summary.summary, summary.upper_seq,
                                 summary.updated_at)
            applied: list[bool] = []
            summaries.append((user, WriteSummary(user_id, summary.session_id, state, 0,
                                                 trio.Event(), applied.append), applied))
    ops: list[Any] = [op for _, op, _ in summaries]
    wrote: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    if puts or links or merges:
        ops.insert(0, PutState(tuple(puts), tuple(links), trio.Event(), tuple(merges),
                               wrote.append))
    if ops:
        await store.write_unlogged(*ops)
    for kind, owners, written in zip(("links", "entities"), (link_owners, merge_owners),
                                     wrote[0] if wrote else ((), ())):
        for i in written:
            counts = owners[i].written
            counts[kind] = counts.get(kind, 0) + 1
    for user, _, applied in summaries:
        if applied and applied[0]:
            user.written["summaries"] = user.written.get("summaries", 0) + 1
