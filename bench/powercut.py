"""A power cut, simulated: what the disk could hold of a store after the machine lost power.

``kill -9`` cannot show what an fsync promises, since the kernel's page cache outlives the
process and writes everything back anyway. Here a process runs with ``powercut.c`` preloaded
(:func:`build`, :func:`child_env`): every write to the store's LMDB file is journaled, and so
is every fsync/fdatasync of it, with how many writes it covered. After the process is
killed, :func:`cut_store` copies the store and rebuilds its ``data.mdb`` as a power cut at
that moment could leave it: every write a sync covered, then each page written after the
last such sync as it stood at a random moment (the kernel writes dirty pages back whole, in
no promised order across pages), so a commit that wrote its meta page before its data was
synced shows up as what it is, a meta page over pages that never reached the disk.

What this models and what it does not: one file (LMDB's, the store of record); writes
through the C library (LMDB without ``MDB_WRITEMAP``, as the engine opens it; the forget
scrub's zeroing of free pages goes through a mapping and is not seen, so the image keeps
those free pages' old bytes); a sync covers exactly the writes that had returned when it was
called; a descriptor opened O_SYNC/O_DSYNC is not treated as synced (the engine opens none:
``metasync=False`` writes meta pages through the plain one). The store's other files (the text
index, saved vector graphs) are copied as the kill left them, so they may hold more than the
cut store: derived views ahead of their source, which the engine must notice. A torn page
(half of one 4 KiB page written) is not modelled; LMDB's pages are the kernel's.
"""

from __future__ import annotations

import os
import random
import shutil
import struct
import subprocess
from pathlib import Path
from typing import Any

SOURCE = Path(__file__).resolve().with_suffix(".c")
PAGE = 4096


class NoCompiler(RuntimeError):
    """The C compiler that builds the preload library is missing."""


def build(dest: Path) -> Path:
    """Compile ``powercut.c`` into ``dest``; returns the library's path.

    Raises:
        NoCompiler: no ``cc`` on PATH (Debian: ``apt install gcc``).
    """
    library = dest / "powercut.so"
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise NoCompiler("the power-cut simulation needs a C compiler (cc or gcc) to build "
                         f"{SOURCE.name}; found none on PATH (Debian: apt install gcc)")
    subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(library), str(SOURCE),
                    "-ldl", "-lpthread"], check=True, capture_output=True)
    return library


def child_env(library: Path, store: Path, journal: Path) -> dict[str, str]:
    """The environment of a process whose writes to ``store``'s LMDB file are journaled."""
    return os.environ | {"LD_PRELOAD": str(library),
                         "ENGRAM_POWERCUT_FILE": str(store / "data.mdb"),
                         "ENGRAM_POWERCUT_JOURNAL": str(journal)}


def read_journal(journal: Path) -> tuple[list[Any], int]:
    """The journal's records in order (``("W", offset, data)`` and ``("T", size)``) and how
    many of its writes the latest sync covered. A record the kill cut short is dropped."""
    data = journal.read_bytes()
    records: list[Any] = []
    covered = at = 0
    while at < len(data):
        tag = data[at : at + 1]
        if tag == b"W" and at + 13 <= len(data):
            offset, length = struct.unpack_from("<QI", data, at + 1)
            if at + 13 + length > len(data):
                break
            records.append(("W", offset, data[at + 13 : at + 13 + length]))
            at += 13 + length
        elif tag in (b"S", b"T") and at + 9 <= len(data):
            (value,) = struct.unpack_from("<Q", data, at + 1)
            if tag == b"S":
                covered = max(covered, value)
            else:
                records.append(("T", value))
            at += 9
        else:
            break
    return records, covered


def image(records: list[Any], covered: int, rng: random.Random, base: bytes = b""
          ) -> tuple[bytearray, dict[str, int]]:
    """The file a power cut could leave, from ``base`` (the file before the journal began):
    the first ``covered`` writes whole; then, page by page, what the kernel had written back
    of the later ones when the power went, which is the page as it stood at some moment: the
    first k of the later writes to it, k drawn from 0 to all of them (a page's pieces never
    reach the disk out of their order, as whole pages are written back)."""
    out = bytearray(base)
    later: dict[int, list[tuple[int, bytes]]] = {}  # page -> its later pieces, in order
    writes = 0
    for record in records:
        if record[0] == "T":
            if writes <= covered:
                del out[record[1]:]
            continue
        _, offset, data = record
        writes += 1
        if writes <= covered:
            _put(out, offset, data)
            continue
        at = offset
        while at < offset + len(data):
            page = at // PAGE
            end = min(offset + len(data), (page + 1) * PAGE)
            later.setdefault(page, []).append((at, data[at - offset : end - offset]))
            at = end
    kept = lost = 0
    for page in sorted(later):
        pieces = later[page]
        k = rng.randint(0, len(pieces))
        for at, piece in pieces[:k]:
            _put(out, at, piece)
        kept += k
        lost += len(pieces) - k
    return out, {"writes": writes, "synced_writes": min(covered, writes),
                 "pages_written_later": len(later), "pieces_kept": kept, "pieces_lost": lost}


def _put(out: bytearray, offset: int, data: bytes) -> None:
    end = offset + len(data)
    if len(out) < end:
        out.extend(bytes(end - len(out)))
    out[offset:end] = data


def cut_store(store: Path, cut: Path, journal: Path, rng: random.Random, base: bytes = b""
              ) -> dict[str, int]:
    """Copy ``store`` to ``cut`` with its LMDB file as a power cut could leave it (``base``:
    the file, on disk, before the journaled process began; none for a store it created).
    The file keeps the size the kill left (the tail a lost write would have filled reads as
    zeros, as a file's unwritten blocks do), and the lock file goes (a reboot clears it)."""
    shutil.copytree(store, cut, ignore=shutil.ignore_patterns("lock.mdb"))
    records, covered = read_journal(journal)
    data, counts = image(records, covered, rng, base)
    size = (store / "data.mdb").stat().st_size
    if len(data) < size:
        data.extend(bytes(size - len(data)))
    (cut / "data.mdb").write_bytes(bytes(data))
    return counts
