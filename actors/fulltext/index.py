"""The text index on disk: its schema and analyser, how a record becomes a document, and
its files: checked against tantivy's own checksums, copied consistently, built offline.

Damage is found before the index is used: every file tantivy writes into a segment ends with a
footer holding a CRC-32 of the file's body (``body | footer JSON | footer length u32 | magic
1337 u32``, little-endian), and :func:`check_index` verifies it for every file of every
segment ``meta.json`` lists, so a flipped byte anywhere in a segment is caught. tantivy
reports some damage by panicking (pyo3's ``PanicException``, a ``BaseException``):
:func:`_is_panic` tells it apart, so that the actor (``fulltext.py``) treats it like any other
damage.
"""

from __future__ import annotations

import json
import mmap
import shutil
import struct
import zlib
from pathlib import Path
from typing import Any

import tantivy

from ..base.messages import Searchable
from ..base.text import composed
from ..base.where import string_leaves
from ..store import read_log_range

__all__ = ["ANALYZER", "WRITER_HEAP", "FOLLOW_CHUNK", "FOOTER_MAGIC", "SEGMENT_FILES",
           "SCHEMA_FIELDS", "COLUMNS", "write_records", "IndexDamaged", "check_index",
           "build_index"]

FOLLOW_CHUNK = 2_048  # log records read per step, by the actor and by build_index
WRITER_HEAP = 64_000_000  # tantivy's writer heap: one thread's worth, well above its 3 MB floor
# The analyser's name is in every index's meta.json (the text field's tokenizer): an index
# whose name differs was analysed otherwise, or holds its filters' attributes otherwise, and
# is rebuilt (:func:`_check_schema`). Renamed whenever either changes: "engram_en" folded no
# accents; "engram_en_folded" held categories as spelt, where filters now compare them
# folded (``base.where``).
ANALYZER = "engram_en_folded_2"
FOOTER_MAGIC = 1337  # tantivy's footer magic number, the last 4 bytes of every segment file
# Files every segment has: our schema has fast fields and a stored-nothing doc store, and
# tantivy writes a positions file (``.pos``) beside the postings and opens it for every text
# field, positions recorded or not, so a segment without one fails every search.
SEGMENT_FILES = ("idx", "pos", "term", "store", "fast", "fieldnorm")


def _analyzer() -> tantivy.TextAnalyzer:
    """Words (runs of letters and digits), lower-cased, accents folded to ASCII where Latin
    script has a plain letter ("café", "São", "ﬁancé" as "cafe", "sao", "fiance": people type
    names and borrowed words both ways, and the embedding model's tokenizer folds them too),
    then stemmed. Text reaches it composed (:func:`composed`)."""
    return (tantivy.TextAnalyzerBuilder(tantivy.Tokenizer.simple())
            .filter(tantivy.Filter.remove_long(40))
            .filter(tantivy.Filter.lowercase())
            .filter(tantivy.Filter.ascii_fold())
            .filter(tantivy.Filter.stemmer("english"))
            .build())


def _schema(analyzer: str = ANALYZER) -> tantivy.Schema:
    """The index's fields; ``analyzer``: the text field's tokenizer name (an older engine's,
    to write the index it left in a test)."""
    b = tantivy.SchemaBuilder()
    b.add_unsigned_field("lsn", stored=False, indexed=True, fast=True)
    for raw in ("user", "session", "role", "kind", "tags"):
        b.add_text_field(raw, stored=False, tokenizer_name="raw")
    b.add_date_field("at", stored=False, indexed=True, fast=True)
    # Term frequencies without positions: BM25 needs no more, and no phrase query is offered
    # (a third less index to write, copy and snapshot).
    b.add_text_field("text", stored=False, tokenizer_name=analyzer, index_option="freq")
    # What recall's ``where`` filters see (``base.where.attributes``): the record's own fields
    # and a turn's meta as one JSON document (terms for equality, a fast column for ranges),
    # and each string attribute as one "path NUL value" term, which ``contains`` matches with
    # a regular expression (tantivy-py's regex query takes no JSON path).
    b.add_json_field("attrs", stored=False, tokenizer_name="raw", index_option="basic",
                     fast=True)
    b.add_text_field("attr_str", stored=False, tokenizer_name="raw", index_option="basic")
    return b.build()


SCHEMA_FIELDS = ("lsn", "user", "session", "role", "kind", "tags", "at", "text", "attrs",
                 "attr_str")  # _schema's, in order: an index with others is rebuilt
# Attributes a filter finds in the text index's own columns rather than in ``attrs``.
COLUMNS = {"kind": "kind", "role": "role", "session_id": "session", "tags": "tags"}
_IN_COLUMNS = frozenset(COLUMNS)


def write_records(writer: Any, schema: tantivy.Schema, records: list[Searchable],
                  deleted: list[int]) -> list[tuple[Searchable, Exception]]:
    """Hand deletions and documents to a writer (uncommitted).

    Returns:
        The records the index could not take (a date outside its range, from a store written
        before dates were checked), with why: the others are indexed all the same.
    """
    if deleted:  # by query: delete_documents_by_term misses u64 terms given Python ints
        writer.delete_documents_by_query(tantivy.Query.term_set_query(schema, "lsn", deleted))
    failed: list[tuple[Searchable, Exception]] = []
    for r in records:
        try:
            doc = tantivy.Document()
            doc.add_unsigned("lsn", r.lsn)  # typed adders: keyword construction guesses i64
            doc.add_text("user", r.user_id)
            doc.add_text("session", r.session_id)
            doc.add_text("role", r.role)
            doc.add_text("kind", r.kind)
            # To the second, cut down here: tantivy cuts toward zero, which before 1970 is a
            # second late (a turn past its own until=). Searches check the exact time after.
            doc.add_date("at", r.at.replace(microsecond=0))
            doc.add_text("text", composed(r.text))
            for tag in r.tags:
                doc.add_text("tags", tag)
            if r.attrs:
                fields = {k: v for k, v in r.attrs["f"].items() if k not in _IN_COLUMNS}
                doc.add_json("attrs", {"f": fields, "m": r.attrs["m"]})
                for path, value in string_leaves(r.attrs, _IN_COLUMNS):
                    doc.add_text("attr_str", f"{path}\x00{value}")
        except (ValueError, OverflowError) as exc:
            failed.append((r, exc))
            continue
        writer.add_document(doc)
    return failed


class IndexDamaged(Exception):
    """The index on disk is damaged or incomplete; the message says where."""


def _check_schema(path: Path) -> None:
    """An index written with other fields (by an older engine: before ``attrs`` came for
    recall's filters) is rebuilt with this schema; tantivy itself would refuse to open it.
    So is one whose text an older analyser cut into terms (its tokenizer's name differs):
    its terms would not be the ones queries now look for."""
    try:
        schema = json.loads((path / "meta.json").read_bytes())["schema"]
        fields = tuple(f["name"] for f in schema)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise IndexDamaged(f"meta.json is unreadable: {exc!r}") from exc
    if fields != SCHEMA_FIELDS:
        raise IndexDamaged(f"it was written with the fields {', '.join(fields)} and this engine "
                           f"indexes {', '.join(SCHEMA_FIELDS)} (an older engine's index)")
    try:
        analyzer = schema[SCHEMA_FIELDS.index("text")]["options"]["indexing"]["tokenizer"]
    except (KeyError, TypeError) as exc:
        raise IndexDamaged(f"meta.json names no analyser for the text: {exc!r}") from exc
    if analyzer != ANALYZER:
        raise IndexDamaged(f"its text was analysed by {analyzer!r} and this engine analyses "
                           f"by {ANALYZER!r} (an older engine's index)")


def _is_panic(exc: BaseException) -> bool:
    """pyo3's PanicException (a BaseException, from module pyo3_runtime): a Rust panic."""
    return type(exc).__name__ == "PanicException"


class _meta_lock:
    """tantivy's meta lock, held while no writer may garbage-collect listed files."""

    def __init__(self, path: Path) -> None:
        self._path = path / ".tantivy-meta.lock"

    def __enter__(self) -> None:
        import fcntl

        self._file = open(self._path, "a+b")
        fcntl.flock(self._file, fcntl.LOCK_EX)  # tantivy takes this lock before it deletes

    def __exit__(self, *exc: object) -> None:
        self._file.close()  # closing drops the flock


def check_index(path: Path) -> int:
    """Check every file of every segment ``meta.json`` lists against tantivy's own footer
    checksum (CRC-32 of the file's body). Returns the number of bytes checked.

    Raises:
        IndexDamaged: meta.json is unreadable, a listed file is missing, or a checksum, footer
            or length does not match; the message names the file.
    """
    try:
        segments = json.loads((path / "meta.json").read_bytes())["segments"]
        expected: list[str] = []
        for segment in segments:
            sid = segment["segment_id"].replace("-", "")
            expected += [f"{sid}.{ext}" for ext in SEGMENT_FILES]
            if segment.get("deletes"):
                expected.append(f"{sid}.{segment['deletes']['opstamp']}.del")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise IndexDamaged(f"meta.json is unreadable: {exc!r}") from exc
    checked = 0
    for name in expected:
        file = path / name
        try:
            size = file.stat().st_size
            if size < 8:
                raise IndexDamaged(f"{name} is {size} bytes, shorter than a footer")
            with open(file, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                length, magic = struct.unpack("<II", mm[size - 8 :])
                if magic != FOOTER_MAGIC or length > size - 8:
                    raise IndexDamaged(f"{name} has no valid footer")
                footer = json.loads(mm[size - 8 - length : size - 8])
                view = memoryview(mm)
                try:
                    crc = zlib.crc32(view[: size - 8 - length])  # releases the GIL
                finally:
                    view.release()
        except FileNotFoundError:
            raise IndexDamaged(f"{name}, listed in meta.json, is missing") from None
        except (OSError, ValueError) as exc:
            raise IndexDamaged(f"{name} cannot be checked: {exc!r}") from exc
        if not isinstance(footer, dict) or footer.get("crc") != crc:
            raise IndexDamaged(f"{name} fails its checksum (stored "
                               f"{footer.get('crc') if isinstance(footer, dict) else None}, "
                               f"computed {crc})")
        checked += size
    return checked


def _copy_committed(source: Path, dest: Path) -> bool:
    """Hard-link (or copy) meta.json and the files of the segments it lists, holding tantivy's
    meta lock so that no merge's garbage collection removes them meanwhile."""
    import fcntl
    import json
    import os

    with open(source / ".tantivy-meta.lock", "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # tantivy takes this lock before it deletes files
        try:
            meta_bytes = (source / "meta.json").read_bytes()
            segments = json.loads(meta_bytes)["segments"]
            if any(segment.get("deletes") for segment in segments):
                return False
            ids = {segment["segment_id"].replace("-", "") for segment in segments}
            dest.mkdir(parents=True)
            for name in os.listdir(source):
                if name.split(".", 1)[0] in ids:
                    try:
                        os.link(source / name, dest / name)
                    except OSError:  # another filesystem: copy instead
                        shutil.copy2(source / name, dest / name)
            (dest / "meta.json").write_bytes(meta_bytes)
            return True
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def build_index(store_path: Path, dest: Path, progress: Any = None) -> int:
    """Index every searchable record of a (closed or copied) store into a fresh index at
    ``dest``. Returns the lsn it covers. Runs in a worker thread or offline."""
    import lmdb

    from ..store import MAX_DBS, open_databases
    from ..store.integrity import CheckedTxn, check_file

    check_file(store_path)
    env = lmdb.open(str(store_path), readonly=True, lock=False, max_dbs=MAX_DBS)
    try:
        dbs = open_databases(env)
        names = {handle: name for name, handle in dbs.items()}
        with env.begin() as txn:
            raw = txn.get(b"last_lsn", db=dbs[b"meta"])
            last = int.from_bytes(raw, "big") if raw else 0
        dest.mkdir(parents=True)
        schema = _schema()
        index = tantivy.Index(schema, path=str(dest), reuse=False)
        index.register_tokenizer(ANALYZER, _analyzer())
        writer = index.writer(heap_size=WRITER_HEAP, num_threads=1)
        after = 0
        while after < last:
            with env.begin() as txn:
                records, _, after = read_log_range(CheckedTxn(txn, names), dbs, after, last,
                                                   FOLLOW_CHUNK)
            write_records(writer, schema, records, [])
            if progress is not None:
                progress(after, last)
        writer.commit()
        writer.wait_merging_threads()
        return last
    finally:
        env.close()
